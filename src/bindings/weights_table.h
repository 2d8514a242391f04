// The weights table (src/core/weights.h) as python/qwenmetal/weights_table.py hands it over, parsed once
// for both C++ engines.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "core/weights.h"

namespace qwenmetal::bindings {

inline DType dtype_of(const std::string& s) {
    if (s == "float32") return DType::F32;
    if (s == "float16") return DType::F16;
    if (s == "bfloat16") return DType::BF16;
    throw std::invalid_argument("weights table: unsupported dtype " + s);
}

inline Span span_of(nanobind::handle h) {
    if (h.is_none()) return Span();
    nanobind::tuple t = nanobind::cast<nanobind::tuple>(h);
    return Span{nanobind::cast<int32_t>(t[0]), nanobind::cast<uint64_t>(t[1]), nanobind::cast<uint64_t>(t[2])};
}

// mappings: [(name, address or 0, nbytes)]; tensors: {name: {bits, group_size, dtype, sdtype, shape,
// data: (mapping, offset, nbytes), scales, biases}}
inline WeightTable parse_table(const nanobind::list& mappings, const nanobind::dict& tensors) {
    WeightTable w;
    for (nanobind::handle h : mappings) {
        nanobind::tuple t = nanobind::cast<nanobind::tuple>(h);
        w.mappings.push_back(Mapping{nanobind::cast<std::string>(t[0]),
                                     reinterpret_cast<const void*>(nanobind::cast<uintptr_t>(t[1])),
                                     nanobind::cast<uint64_t>(t[2])});
    }
    for (auto [k, v] : tensors) {
        nanobind::dict d = nanobind::cast<nanobind::dict>(v);
        WeightDesc x;
        x.bits = nanobind::cast<int>(d["bits"]);
        x.group_size = nanobind::cast<int>(d["group_size"]);
        x.dtype = dtype_of(nanobind::cast<std::string>(d["dtype"]));
        x.sdtype = dtype_of(nanobind::cast<std::string>(d["sdtype"]));
        for (nanobind::handle s : nanobind::cast<nanobind::list>(d["shape"]))
            x.shape.push_back(nanobind::cast<int64_t>(s));
        x.data = span_of(d["data"]);
        x.scales = span_of(d["scales"]);
        x.biases = span_of(d["biases"]);
        if (d.contains("stride")) x.stride = nanobind::cast<uint64_t>(d["stride"]);
        if (d.contains("sstride")) x.sstride = nanobind::cast<uint64_t>(d["sstride"]);
        const std::string name = nanobind::cast<std::string>(k);
        for (const Span* s : {&x.data, &x.scales, &x.biases}) {
            if (!s->present()) continue;
            if (size_t(s->mapping) >= w.mappings.size())
                throw std::invalid_argument("weights table: tensor '" + name + "' names mapping " +
                                            std::to_string(s->mapping) + " of " + std::to_string(w.mappings.size()));
            if (s->offset + s->nbytes > w.mappings[size_t(s->mapping)].size)
                throw std::invalid_argument("weights table: tensor '" + name + "' lies outside its mapping " +
                                            w.mappings[size_t(s->mapping)].name);
        }
        w.tensors[name] = std::move(x);
    }
    return w;
}

}  // namespace qwenmetal::bindings

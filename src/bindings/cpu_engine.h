// What the cpu engine's bindings share between their files (cpu_engine.cpp: CpuEngine, CpuState and the
// kernel hooks; dflash.cpp: a DFlash draft running on a CpuEngine): the Python-side engine object and the
// parsers of the tensor descriptors Python hands over (python/qwenmetal/backends/cpu.py, `describe`).
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "cpu/engine.h"

namespace qwenmetal::bindings {

struct PyEngine {
    std::unique_ptr<Engine> engine;
    nanobind::object keepalive;     // the numpy arrays (mmap views) the descriptors point into
};

inline DType parse_dtype(const std::string& s) {
    if (s == "float32") return DType::F32;
    if (s == "float16") return DType::F16;
    if (s == "bfloat16") return DType::BF16;
    throw std::invalid_argument("unsupported dtype " + s);
}

inline const void* ptr_of(const nanobind::handle& h) {
    return reinterpret_cast<const void*>(static_cast<uintptr_t>(nanobind::cast<uint64_t>(h)));
}

// a tensor's format and shape: {bits, dtype, sdtype, group_size, shape}
inline TensorDesc parse_format(const nanobind::dict& d) {
    TensorDesc t;
    t.bits = nanobind::cast<int>(d["bits"]);
    t.dtype = parse_dtype(nanobind::cast<std::string>(d["dtype"]));
    t.sdtype = parse_dtype(nanobind::cast<std::string>(d["sdtype"]));
    t.group_size = nanobind::cast<int>(d["group_size"]);
    for (nanobind::handle v : nanobind::cast<nanobind::list>(d["shape"])) t.shape.push_back(nanobind::cast<int64_t>(v));
    return t;
}

// a linear tensor's pointer descriptor (`describe`): the format plus data / scales / biases and strides
inline TensorDesc parse_desc(const nanobind::dict& d) {
    TensorDesc t = parse_format(d);
    t.data = ptr_of(d["data"]);
    t.scales = ptr_of(d["scales"]);
    t.biases = ptr_of(d["biases"]);
    t.stride = nanobind::cast<size_t>(d["stride"]);
    t.sstride = nanobind::cast<size_t>(d["sstride"]);
    if (t.shape.size() < 2) throw std::invalid_argument("a linear tensor needs at least 2 dimensions");
    return t;
}

}  // namespace qwenmetal::bindings

// The weights table: every canonical tensor of a checkpoint as a descriptor into one of the
// checkpoint's file mappings — {mapping, offset, dtype, shape, bits, group size} — with no raw
// pointers and nothing device-specific. Python builds it (qwenmetal.metal_backend.weight_table)
// from the memory-mapped safetensors files (one mapping per file; tensors the loader had to
// transform are mappings of their own), or from the config alone with virtual mappings (costing the
// real model without its weights). A backend turns mappings into its own memory (the GPU graph:
// one device buffer per mapping, wrapped without a copy).
#pragma once
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace qwenmetal {

struct Mapping {
    std::string name;            // file path, or "<name of the owned array>"
    const void* base = nullptr;  // nullptr: virtual (encode-only costing; no contents)
    uint64_t size = 0;
};

// A byte range of one mapping.
struct Span {
    int32_t mapping = -1;
    uint64_t offset = 0, nbytes = 0;
    bool present() const { return mapping >= 0; }
};

// One canonical tensor. Quantized (bits 4/8): `data` uint32 [..., rows, cols*bits/32], `scales` and
// `biases` [..., rows, cols/group_size] of `sdtype`. Dense (bits 0): `data` [...shape] of `dtype`.
// `shape` is the logical shape (cols unpacked).
struct WeightDesc {
    int bits = 0;
    int group_size = 0;
    DType dtype = DType::F32;
    DType sdtype = DType::BF16;
    std::vector<int64_t> shape;
    Span data, scales, biases;
    // bytes between consecutive matrices of a stack whose matrices are not adjacent (HF's fused experts
    // viewed as gate / up); 0: contiguous
    uint64_t stride = 0, sstride = 0;

    int64_t rows() const { return shape.size() >= 2 ? shape[shape.size() - 2] : 1; }
    int64_t cols() const { return shape.empty() ? 0 : shape.back(); }
    int64_t count() const {   // matrices along the leading axes (experts)
        int64_t n = 1;
        for (size_t i = 0; i + 2 < shape.size(); ++i) n *= shape[i];
        return n;
    }
};

struct WeightTable {
    std::vector<Mapping> mappings;
    std::map<std::string, WeightDesc> tensors;

    bool has(const std::string& name) const { return tensors.count(name) != 0; }
    const WeightDesc& get(const std::string& name) const {
        auto it = tensors.find(name);
        if (it == tensors.end()) throw std::invalid_argument("weights table: no tensor '" + name + "'");
        return it->second;
    }
    bool is_virtual() const {
        for (const Mapping& m : mappings)
            if (m.base) return false;
        return !mappings.empty();
    }
    // host pointer of a span (nullptr when virtual)
    const uint8_t* host(const Span& s) const {
        const Mapping& m = mappings.at(size_t(s.mapping));
        return m.base ? static_cast<const uint8_t*>(m.base) + s.offset : nullptr;
    }
};

}  // namespace qwenmetal

// Weight descriptors of the CPU engine (pointers into memory it can read): a matrix is either dense (bf16/f16/f32) or MLX
// affine-quantized (2, 3, 4, 5, 6 or 8 bits, per-group scale and bias). Descriptors point into memory owned
// elsewhere (the mmap'd checkpoint, kept alive by Python, or buffers the engine owns after
// quantizing at load); nothing here copies weights.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <new>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace qwenmetal {

// One [rows, cols] matrix, y = W x. Rows are contiguous: a dense row is `cols` values, a quantized
// row is cols*bits/32 uint32 words plus cols/group_size scales and biases.
struct WMat {
    int bits = 0;                  // 0 = dense, else 2, 3, 4, 5, 6 or 8 (MLX affine)
    DType dtype = DType::F32;      // dense: element type
    DType sdtype = DType::BF16;    // quantized: scale/bias type (BF16 or F32; F16 is converted at load)
    int group_size = 0;
    int64_t rows = 0, cols = 0;
    const void* data = nullptr;    // dense values, or packed uint32 words
    const void* scales = nullptr;
    const void* biases = nullptr;

    bool quantized() const { return bits != 0; }
    bool empty() const { return data == nullptr; }
    size_t row_bytes() const { return quantized() ? size_t(cols) * bits / 8 : size_t(cols) * dtype_size(dtype); }
    int64_t groups() const { return quantized() ? cols / group_size : 0; }
    size_t srow_bytes() const { return size_t(groups()) * dtype_size(sdtype); }
    const uint8_t* row(int64_t r) const { return static_cast<const uint8_t*>(data) + size_t(r) * row_bytes(); }
    const uint8_t* srow(int64_t r) const { return static_cast<const uint8_t*>(scales) + size_t(r) * srow_bytes(); }
    const uint8_t* brow(int64_t r) const { return static_cast<const uint8_t*>(biases) + size_t(r) * srow_bytes(); }
    size_t nbytes() const { return size_t(rows) * (row_bytes() + (quantized() ? 2 * srow_bytes() : 0)); }
};

// Value k (< 2^bits) of a packed MLX affine row: the row is one LSB-first stream of `bits`-bit values
// over its little-endian bytes, so value k sits at bits [bits·k, bits·(k+1)). At 3/5/6 bits a value may
// straddle two bytes (never more: bits ≤ 8 and the in-byte offset ≤ 7). Byte reads: no alignment needed,
// and nothing past the value's last byte is read.
inline uint32_t affine_q(const uint8_t* row, int bits, int64_t k) {
    const int64_t bit = int64_t(bits) * k;
    const int s = static_cast<int>(bit & 7);
    uint32_t v = uint32_t(row[bit >> 3]) >> s;
    if (s + bits > 8) v |= uint32_t(row[(bit >> 3) + 1]) << (8 - s);
    return v & ((1u << bits) - 1u);
}

// A stack of matrices (the routed experts): matrix e starts at byte offset e*stride of each array.
struct WStack {
    WMat base;
    int64_t n = 0;
    size_t stride = 0, sstride = 0;    // bytes between consecutive matrices (data / scales+biases)
    WMat at(int64_t e) const {
        WMat m = base;
        m.data = static_cast<const uint8_t*>(base.data) + size_t(e) * stride;
        if (base.quantized()) {
            m.scales = static_cast<const uint8_t*>(base.scales) + size_t(e) * sstride;
            m.biases = static_cast<const uint8_t*>(base.biases) + size_t(e) * sstride;
        }
        return m;
    }
};

// 64-byte aligned float buffer that only grows (scratch).
class FBuf {
public:
    FBuf() = default;
    FBuf(const FBuf&) = delete;
    FBuf& operator=(const FBuf&) = delete;
    ~FBuf() { std::free(p_); }
    float* get(size_t n) {            // at least n floats; contents not preserved on growth
        if (n > cap_) {
            size_t bytes = ((n * sizeof(float) + 63) / 64) * 64;
            void* q = std::aligned_alloc(64, bytes ? bytes : 64);
            if (!q) throw std::bad_alloc();
            std::free(p_);
            p_ = static_cast<float*>(q);
            cap_ = n;
        }
        return p_;
    }
    float* data() const { return p_; }
    size_t capacity() const { return cap_; }

private:
    float* p_ = nullptr;
    size_t cap_ = 0;
};

}  // namespace qwenmetal

// Host functions of metal/quant.metal, and the device-side description of a weight matrix that
// every GEMV-like kernel (quant, moe) takes.
#pragma once
#include <string>
#include <vector>

#include "gpu/ops/common.h"

namespace qwenmetal::gpu {

// Storage format of a linear weight: MLX affine 2/3/4/5/6/8-bit (uint32 words holding one LSB-first bit
// stream per row, one scale + bias per group of `group_size` inputs of a row) or dense 16/32-bit floats.
// Q4 and Q8 have kernels of their own; Q2, Q3, Q5, Q6 share the run-time-width kernels (WFMT_QN,
// variant "qn_*", the width in the params: metal/quant_dot.h says why).
enum class WFormat : uint8_t { Q4 = 0, Q8 = 1, BF16 = 2, F16 = 3, F32 = 4, Q2 = 5, Q3 = 6, Q5 = 7, Q6 = 8 };

inline uint32_t format_bits(WFormat f) {
    switch (f) {
        case WFormat::Q2: return 2;
        case WFormat::Q3: return 3;
        case WFormat::Q4: return 4;
        case WFormat::Q5: return 5;
        case WFormat::Q6: return 6;
        case WFormat::Q8: return 8;
        case WFormat::F32: return 32;
        default: return 16;
    }
}
inline bool quantized(WFormat f) { return f != WFormat::BF16 && f != WFormat::F16 && f != WFormat::F32; }
// the quantized format of width `bits` (2, 3, 4, 5, 6, 8); std::invalid_argument naming `what` otherwise
WFormat quantized_format(uint32_t bits, const std::string& what);
// kernel-name part: "q2", "q3", "q4", "q5", "q6", "q8", "bf16", "f16", "f32"
const char* format_name(WFormat f);

// A [rows, cols] matrix, or a stack of `count` of them (routed experts: [count, rows, cols],
// contiguous), in device buffers. Quantized: `w` uint32 [count, rows, cols*bits/32], `scales` and
// `biases` [count, rows, cols/group_size] of bf16 (scales_f32: float32). Dense: `w` [count, rows, cols].
struct Matrix {
    WFormat fmt = WFormat::Q4;
    uint32_t rows = 0, cols = 0, group_size = 0, count = 1;
    bool scales_f32 = false;
    Buffer w, scales, biases;

    uint64_t row_bytes() const { return uint64_t(cols) * format_bits(fmt) / 8; }
    // the width a kernel's params carry (`bits`: read by the qn kernels), 0 for a dense matrix
    uint32_t qbits() const { return quantized(fmt) ? format_bits(fmt) : 0; }
    uint64_t srow_bytes() const { return quantized(fmt) ? uint64_t(cols / group_size) * (scales_f32 ? 4 : 2) : 0; }
    // bytes of one matrix of the stack (weights + scales + biases): what a GEMV over it reads
    uint64_t matrix_bytes() const { return uint64_t(rows) * (row_bytes() + 2 * srow_bytes()); }
    // checks the buffers against the shape; throws std::invalid_argument naming `what`
    void validate(const char* what) const;
    // "q4_sbf16", "q8_sf32", "qn_sbf16" (2, 3, 5, 6 bits), "bf16", ...: the weight-format part of kernel names
    std::string variant() const;
};

// The weight-format part of the kernel that runs `a` and `b` in one dispatch (the MoE kernels: routed
// experts and the shared expert): their common variant, or "qn_*" for two quantized widths with one
// scale type (the run-time-width kernel takes a width per matrix). std::invalid_argument naming `op`
// and `what` (b) otherwise.
std::string paired_variant(const Matrix& a, const Matrix& b, const char* op, const char* what);
// Whether paired_variant finds one for a and b (else the MoE host functions run the shared expert apart).
bool can_pair(const Matrix& a, const Matrix& b);

// Appends the three kernel arguments of M (w, scales, biases: views over the whole stack), declaring
// `rows_read` rows as read (e.g. k * rows for the k selected experts of a stack: the costing counts
// the bytes really touched). A dense matrix binds its w view in the scales and biases slots too,
// declared unread.
void matrix_args(std::vector<Arg>& args, const Matrix& M, uint64_t rows_read);

namespace ops {

// What a qmv dispatch may fuse around the product (metal/quant.h QMV_*):
//   norm_w      the input is rmsnorm(x) * norm_w (T [cols]; eps) -- the RMSNorm before a projection
//   xn          ... and that normalised input is stored there too (T, like x), for later kernels
//   residual    y = residual + W x (like y; may be y itself: the residual add in place); the product is
//               rounded to the activation type first, as the bf16 graph adds two bf16 values
//   round       a float output holds the product rounded to the activation type
// The Gated DeltaNet's causal conv as the epilogue of its decode in-projection (batch 1, T output): row
// c < channels of the product is channel c of the conv; act[c] = silu(conv), conv_out = the state shifted
// by this token (conv_out may be conv_state). Bit for bit gdn_conv of one token over the stored rows.
struct QmvConv {
    const Buffer* conv_w = nullptr;      // float [channels, taps] (the canonical [conv_dim, K])
    const Buffer* conv_state = nullptr;  // float [taps - 1, channels]
    const Buffer* conv_out = nullptr;    // float [taps - 1, channels]
    const Buffer* act = nullptr;         // T [channels]
    uint32_t taps = 0;                   // K >= 2
    uint32_t channels = 0;               // the product's first rows (<= W.rows); 0: all of them
};

struct QmvFusion {
    const Buffer* norm_w = nullptr;
    float eps = 0.0f;
    const Buffer* xn = nullptr;
    const Buffer* residual = nullptr;
    bool round = false;       // float output holding the product rounded to the activation type
    const QmvConv* conv = nullptr;
};

// y[b, :rows] = W x[b, :cols] for b < batch; x [batch, x_stride] (T), y [batch, y_stride] (T, or
// float with f32_out). Strides default to cols / rows. One dispatch. Batch 1 is the decode kernel;
// batch 2..QMV_MULTI_MAX (16: the skinny prefill rows) reads each weight once for all vectors (the
// qmv_b<4|8|16> variants), larger batches once per chunk of 16 vectors. Every fusion is per vector.
void qmv(Encoder& e, Act t, const Matrix& W, const Buffer& x, const Buffer& y, uint32_t batch = 1,
         bool f32_out = false, uint32_t x_stride = 0, uint32_t y_stride = 0, const QmvFusion& fuse = QmvFusion());

// y[i, :] = row ids[i] of the table E (dequantized, as T) for i < n; ids uint32 [n] on the device
// (the decode token slot). One dispatch.
void embed(Encoder& e, Act t, const Matrix& E, const Buffer& ids, uint32_t n, const Buffer& y);

}  // namespace ops
}  // namespace qwenmetal::gpu

// quant family: parameters and thread geometry shared by metal/quant.metal, metal/moe.metal (through
// metal/quant_dot.h) and their host functions (src/gpu/ops/quant.cpp, src/gpu/ops/moe.cpp).
#pragma once
// Host side: uint32_t comes from <cstdint>, included first by src/gpu/ops/common.h (msl_lint
// admits no non-Metal #include in kernel headers, guarded or not).

// qmv: y[b, :N] = W x[b, :K] for b < batch; threadgroup row y holds vectors y * MB .. y * MB + MB - 1
// (MB the kernel variant's vectors per threadgroup: 1, 4, 8 or 16, see QMV_MULTI_MAX)
struct QmvParams {
    uint32_t K;           // input features (columns of W)
    uint32_t N;           // output rows
    uint32_t group_size;  // quantized: 32, 64 or 128; dense: unused
    uint32_t x_stride;    // elements between consecutive input vectors (grid.y), a multiple of 4
    uint32_t y_stride;    // elements between consecutive output vectors
    uint32_t flags;       // QMV_NORM | QMV_NORM_OUT | QMV_ADD | QMV_ROUND
    float eps;            // QMV_NORM: added to mean(x^2)
    uint32_t batch;       // input vectors in all (the last threadgroup row may hold fewer than MB)
    uint32_t bits;        // WFMT_QN: the weights' width (2, 3, 4, 5, 6, 8); other formats: unused
    uint32_t conv_k;      // QMV_CONV: the conv's taps K (its state holds K - 1 rows of conv_c channels)
    uint32_t conv_c;      // QMV_CONV: the conv's channels, output rows 0 .. conv_c - 1 (<= N)
};
static_assert(sizeof(QmvParams) == 44, "QmvParams: 11 x 4 bytes, as the host packs it");
// qmv fusions (flags): the input is rmsnorm(x) * g (QMV_NORM; with QMV_NORM_OUT threadgroup 0 also
// stores that normalised input to xn, for the next kernels that read it), and the output is added to r
// (QMV_ADD: y = r + W x, r may be y itself: the residual add in place)
#define QMV_NORM 1u
#define QMV_NORM_OUT 2u
#define QMV_ADD 4u
// with float output: store the product rounded to the activation type (QMV_ROUND)
#define QMV_ROUND 8u
// the Gated DeltaNet's causal conv + SiLU + conv-state update as the epilogue of its decode in-projection
// (QMV_CONV, batch 1): output row c < conv_c is channel c; act[c] = silu(conv(state[:, c], y[c])), the
// state's rows shifted by one with y[c] last (the unfused gdn_conv of one token, bit for bit)
#define QMV_CONV 16u

// embed: y[i, :K] = row ids[i] of the table, dequantized, for i = threadgroup
struct EmbedParams {
    uint32_t K;           // columns of the table (the hidden size)
    uint32_t rows;        // rows of the table (ids >= rows produce a zero row)
    uint32_t group_size;
    uint32_t bits;        // WFMT_QN: the table's width; other formats: unused
};
static_assert(sizeof(EmbedParams) == 16, "EmbedParams: 4 x 4 bytes, as the host packs it");

// GEMV mapping (MLX's qmv_fast): QMV_ROWS consecutive output rows per SIMD-group, QMV_SIMDGROUPS
// SIMD-groups (of 32 lanes) per threadgroup, so a threadgroup covers QMV_ROWS * QMV_SIMDGROUPS rows.
#define QMV_LANES 32u
#define QMV_ROWS 4u
#define QMV_SIMDGROUPS 2u
#define QMV_TG_ROWS (QMV_ROWS * QMV_SIMDGROUPS)
// Skinny (multi-vector) qmv: a kernel variant holds the accumulators of MB input vectors (MB = 1, the
// decode kernel, or QMV_MULTI_MIN, 2 QMV_MULTI_MIN, ... QMV_MULTI_MAX: qmv_b<MB>_*) and reads each
// weight once for all of them; a batch takes the smallest variant that holds it, batches past
// QMV_MULTI_MAX chunks of QMV_MULTI_MAX. (No b2: it would save 8 of b4's 16 accumulators per lane,
// for 21 more instantiations, ~7 s more simulator compile; docs/metal.md.)
#define QMV_MULTI_MIN 4u
#define QMV_MULTI_MAX 16u
// inputs a lane takes per step (one 8-byte word pair at 4 and 8 bits; two 4-vectors dense; at a
// run-time width (WFMT_QN) 32 values = `bits` whole words). The weight's columns must be a multiple
// of this (quantized: implied by the group size, 32 at least).
#define QMV_VALS_Q4 16u
#define QMV_VALS_Q8 8u
#define QMV_VALS_DENSE 8u
#define QMV_VALS_QN 32u
// WFMT_QN: the widest run-time width (words per 32-value unit a lane holds)
#define QN_MAX_BITS 8u
// embed: threads per threadgroup, at most (each dequantizes QMV_VALS_* consecutive values per step)
#define EMBED_MAX_THREADS 256u

// MLX affine quantization (docs/model.md §3): value = scale * q + bias per group of `group_size`
// consecutive inputs of a row; the q values of a row are one LSB-first bit stream in uint32 words
// (cols * bits / 32 words; 16/8/4 whole values per word at 2/4/8 bits, at 3/5/6 bits a value may
// straddle two words). Widths 2, 3, 4, 5, 6, 8; groups 32, 64, 128 (a group = whole 32-value chunks
// of `bits` words each).
//
// Kernels of the "quant" family: the linear layers y = W x of every format the loader produces.
//  * decode (few rows of x): GEMV, memory-bound. Per group the factored form
//    scale·Σ q·x + bias·Σ x, x pre-converted to fp32 (and pre-permuted to the nibble order the
//    unpack produces), 4 weight rows per pass sharing every x load, no dequantized weight ever
//    written to memory (kernels.inc: q_rows over every width / dense_rows).
//  * prefill (many rows of x): a task dequantizes a 16-row weight tile once into a per-thread
//    fp32 buffer (L2-resident) and multiplies every row of x with it (gemm_tile, 4x3 register
//    blocks of dot products over the whole K).
// Work is split over threads by 16-row blocks of the output; several matrices sharing one input
// (q|k|v, qkv|z|b|a, router|shared gate|shared up|shared-expert gate) run as one parallel section.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cpu/tensor.h"
#include "core/threadpool.h"
#include "cpu/kernels.h"

namespace qwenmetal::cpu {

// Throws std::invalid_argument naming `name` unless (bits, group_size) is a width / group the CPU
// kernels run (bits 2, 3, 4, 5, 6, 8; group 32, 64, 128) and `cols` a whole number of groups.
void check_affine(const std::string& name, int bits, int group_size, int64_t cols);

// Dequantize `rows` rows of `in_features` values into float32 `out` [rows, in_features].
// w: [rows, in_features * bits / 32]; scales, biases: [rows, in_features / group_size].
void dequantize_affine(const uint32_t* w, const float* scales, const float* biases, float* out,
                       size_t rows, size_t in_features, int bits, int group_size);

// MLX's affine quantizer (mlx/backend/cpu/quantized.cpp, as python/qwenmetal/quant.py), float32
// arithmetic, scales and biases rounded to bf16 at the end. src: [rows, cols] of `dtype`, row
// stride `ld` elements. Byte-identical to quant.quantize(w, bits, group_size) for bf16 scales.
void quantize_affine(const void* src, DType dtype, int64_t ld, int64_t rows, int64_t cols, int bits, int group_size,
                     uint32_t* wq, uint16_t* scales, uint16_t* biases);

constexpr int64_t kRowBlock = 16;      // output rows per task (and GEMM weight-tile height)
constexpr int64_t kGemvMaxRows = 3;    // up to this many input rows: GEMV per row, else tiled GEMM

// Scratch memory of one forward pass: one growing buffer per thread plus shared ones. Everything a
// pass needs is reserved before it starts (Workspace::reserve), so kernels never allocate.
struct Workspace {
    std::vector<std::unique_ptr<FBuf>> thread;   // per-thread scratch (GEMM tiles, attention, GDN)
    FBuf xvec;                                    // prepared GEMV/GEMM inputs (XVec data), shared
    std::vector<XVec> xv;                         // the prepared inputs
    std::vector<const XVec*> xvp;                 // pointers to them (kernels take pointer arrays)
    int planes = 0;                               // activations: 0 float, 1 int8, 2 int16 (integer copies of inputs)
    // up to this many input rows, `linear` and the MoE run the GEMV once per row (the decode path); a
    // speculative verification raises it to its row count so that every row is computed as a one-token
    // call computes it (Engine::forward)
    int64_t gemv_rows = kGemvMaxRows;
    explicit Workspace(int n_threads = 1) { resize(n_threads); }
    void resize(int n_threads) {
        while (static_cast<int>(thread.size()) < n_threads) thread.emplace_back(new FBuf());
    }
    void reserve(size_t per_thread, size_t xvec_floats, size_t n_xvecs = 0) {
        for (auto& t : thread) t->get(per_thread);
        xvec.get(xvec_floats);
        if (xv.size() < n_xvecs) {
            xv.resize(n_xvecs);
            xvp.resize(n_xvecs);
        }
    }
    float* t(int i) const { return thread[i]->data(); }
};

// Per-thread floats `linear` needs for input width K (the GEMM tile), and shared XVec floats and
// XVec count for M input rows.
inline size_t linear_thread_floats(int64_t K) { return size_t(kRowBlock) * size_t(K) + 64; }
inline size_t linear_xvec_floats(int64_t K, int64_t M) { return size_t(M) * xvec_floats(K); }

struct LinearOut {
    const WMat* W;
    float* y;           // y[m * ldy + r]
    int64_t ldy;
    bool accumulate;    // y += W x instead of y = W x (residual adds)
};

// Rows [r0, r1) of y = X W^T for M input rows, from the M prepared inputs xv[m] (X itself is only
// read by the dequantized-tile path, which uses `tile`, >= kRowBlock*K floats).
// `gemv_rows`: up to this many rows, the GEMV per row (Workspace::gemv_rows).
void linear_rows(const WMat& W, const float* X, int64_t M, int64_t ldx, const XVec* const* xv, float* tile,
                 int64_t r0, int64_t r1, float* y, int64_t ldy, bool accumulate, int64_t gemv_rows = kGemvMaxRows);

// Prepare M input rows (row stride ldx) into ws.xvec / ws.xv / ws.xvp, starting at XVec index `first`.
// ws.planes > 0: also the integer copy of each row (4-bit g64 weights then use the integer GEMV / GEMM kernels).
void prepare_xvecs(Workspace& ws, const float* X, int64_t M, int64_t ldx, int64_t K, int64_t first = 0,
                   size_t float_offset = 0);

// Y_i = X W_i^T for up to 8 matrices sharing the input X [M, K] (row stride ldx), in one parallel
// section split by 16-row blocks over all outputs.
void linear(ThreadPool& pool, Workspace& ws, const float* X, int64_t M, int64_t ldx, const LinearOut* outs, int n);

}  // namespace qwenmetal::cpu

// Tiled GEMM with the weight dequantization fused into the tile staging, on Metal 4 tensor operations
// (MetalPerformancePrimitives' matmul2d): the M5 (GPU family apple10) route of the prefill projections;
// metal/gemm.metal is the simdgroup_matrix route of M1-M4. Same kernels, buffers, grid and fusions:
//
//   gemm_tensor_<w>_<T>          Y[m, :N] = X[m, :K] W^T, Y in T     (dense row blocks, or MoE tile maps)
//   gemm_tensor_<w>_bf16_f32out  the same with bf16 X and float Y      (router logits, expert outputs)
// <w> = q4_sbf16, q4_sf32, q8_sbf16, q8_sf32, qn_sbf16, qn_sf32 (2, 3, 5, 6 bits: GemmParams.bits), bf16,
// f16, f32 (gpu::Matrix::variant()); T = f32 | bf16.
//
// Only the multiply differs from gemm.metal: metal/gemm_tile.h stages the X tile (in T) and the
// dequantized W tile (float) in threadgroup memory (the fusion: each packed weight tile is dequantized once per
// threadgroup, straight into the tile the tensor op reads) and stores the product with the epilogue
// (residual, rounding, SwiGLU) — GemmParams.flags select dense row blocks or tile-map entries exactly as
// there, so the host (src/gpu/ops/gemm.cpp) binds both routes alike.
//
// Buffers: 0 GemmParams; 1-3 the weight (w, scales, biases; the gate part with SwiGLU); 4-6 the second
// weight binding (the up part with SwiGLU); 7 x T; 8 slot_rows uint (GEMM_GATHER); 9 tiles uint4
// (GEMM_TILEMAP); 10 residual (like y); 11 y.
//
// Simulator-verified against the simulator's emulation of the tensor API (msl_sim/tensor.h, written from
// Apple's documentation), hardware-unverified: no M5 has run it.
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#include "common.h"
#include "gemm.h"
#include "gemm_tile.h"
#include "quant_dot.h"

using namespace mpp::tensor_ops;

typedef dextents<int32_t, 2> gemm_ext;
typedef tensor<threadgroup float, gemm_ext, tensor_inline> gemm_tg_tensor;

// Thread mapping: GEMM_SIMDGROUPS = 4 SIMD-groups (128 threads) per threadgroup, a tile of bm =
// tile_rows (16 or 32) rows x GEMM_BN = 64 columns (SwiGLU: 32 gate and the 32 matching up columns).
// Per K step of GEMM_BK = 32 every thread stages its units of the X tile xt [bm, 32] in T (bfloat X
// stays bfloat: exact) and the dequantized W tile wt [64, 32] in float (gemm_tile.h), then SIMD-group s
// runs one matmul2d (execution_simdgroup scope, all 32 lanes) of the bm rows by tile columns
// [16 s, 16 s + 16): left = xt (extents (XLD, bm): rows of 40 bfloat or 36 floats, k = GEMM_BK so the
// padding is never read), right = W tile rows [16 s, + 16) (transpose_right: wt holds W rows, extents
// (GEMM_LD, 64)), destination = the float tile ct columns [16 s, + 16) in threadgroup memory,
// multiply_accumulate over the K steps from zero. The descriptor is static (m = GEMM_BM): for 16-row
// tiles the operands' extents are 16 rows, and matmul2d's documented edge checking neither reads nor
// writes past them. ct then holds the tile's product and the threadgroup stores it with the fusions.
// bfloat (or float) x float -> float is in Apple's documented type table; relaxed_precision off, so the
// product is the float products the simdgroup route sums (in an undocumented order: the tests compare
// with tolerances). The W operand stays float: half or bfloat would round the dequantized weights
// beyond the tests' bound (docs/metal.md, gemm section). Threadgroup memory 20,608 bytes with bfloat
// activations, 22,656 with float. Grid (ceil(N / cols), ceil(M / 32) or the tile-map capacity, 1) x
// (128, 1, 1). An empty tile returns before any barrier (the condition depends only on the threadgroup).
template <int FMT, typename S, typename T, typename O>
[[kernel, max_total_threads_per_threadgroup(GEMM_THREADS)]]
void gemm_tensor(constant GemmParams& p [[buffer(0)]], device const uint32_t* w [[buffer(1)]],
                 device const S* scales [[buffer(2)]], device const S* biases [[buffer(3)]],
                 device const uint32_t* w2 [[buffer(4)]], device const S* scales2 [[buffer(5)]],
                 device const S* biases2 [[buffer(6)]], device const T* x [[buffer(7)]],
                 device const uint* slot_rows [[buffer(8)]], device const uint4* tiles [[buffer(9)]],
                 device const O* r [[buffer(10)]], device O* y [[buffer(11)]],
                 uint3 tgid [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                 uint sg [[simdgroup_index_in_threadgroup]]) {
    // declared as 4-vectors (row lengths are multiples of 4): the staging's vector stores need their alignment
    threadgroup vec<T, 4> xt_[GEMM_BM * GemmXLd<T>::LD / 4u];
    threadgroup float4 wt_[GEMM_BN * GEMM_LD / 4u];
    threadgroup float ct_[GEMM_BM * GEMM_LDC];
    threadgroup uint xr_[GEMM_BM];
    // the tiles as pointers, as gemm.metal (gemm_tile.h's helpers take deduced pointer types)
    constexpr uint XLD = GemmXLd<T>::LD;
    threadgroup vec<T, 4>* xt4 = xt_;   // the staging's view (gemm_tile.h stores whole vectors)
    threadgroup float4* wt4 = wt_;
    threadgroup T* xt = (threadgroup T*)xt4;   // the fragment loads' view
    threadgroup float* wt = (threadgroup float*)wt4;
    threadgroup float* ct = ct_;
    threadgroup uint* xr = xr_;
    typedef typename WDot<FMT, S, T>::wvec WV;
    const GemmTile t = gemm_tile_of(p, tgid.y, (p.flags & GEMM_TILEMAP) != 0u ? tiles[tgid.y] : uint4(0u));
    if (t.rows == 0u) {
        return;
    }
    const bool swiglu = (p.flags & GEMM_SWIGLU) != 0u;
    const uint bm = min(p.tile_rows, GEMM_BM), cols = swiglu ? GEMM_BN / 2u : GEMM_BN;
    gemm_tile_rows(p, t, slot_rows, xr, tid, GEMM_THREADS);
    for (uint i = tid; i < GEMM_BM * GEMM_LDC; i += GEMM_THREADS) {
        ct[i] = 0.0f;
    }
    // the weight parts: rows [n0, n0 + cols) of the first binding, and with SwiGLU the matching up rows
    // of the second; the tile's matrix of each stack (64-bit offsets formed once, gemm_tile.h)
    const uint parts = swiglu ? 2u : 1u, n0 = tgid.x * cols;
    typedef device const WV* WVP;
    const GemmWPart<WVP, device const S*> pa = gemm_w_part<FMT, S, T>(p, (WVP)w, scales, biases, t.expert, n0, p.N);
    const GemmWPart<WVP, device const S*> pb =
        gemm_w_part<FMT, S, T>(p, (WVP)w2, scales2, biases2, t.expert, p.up_row + n0, p.up_row + p.N);

    constexpr auto desc = matmul2d_descriptor(int(GEMM_BM), 16, int(GEMM_BK), false, true, false,
                                              matmul2d_descriptor::mode::multiply_accumulate);
    matmul2d<desc, execution_simdgroup> op;
    tensor<threadgroup T, gemm_ext, tensor_inline> xtt(xt, gemm_ext(int(XLD), int(bm)));
    gemm_tg_tensor wtt(wt, gemm_ext(int(GEMM_LD), int(GEMM_BN)));
    gemm_tg_tensor ctt(ct, gemm_ext(int(GEMM_LDC), int(bm)));
    auto wts = wtt.slice(0, 16 * int(sg));
    auto cts = ctt.slice(16 * int(sg), 0);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint k0 = 0; k0 < p.K; k0 += GEMM_BK) {
        gemm_stage_x<T, T>((device const vec<T, 4>*)x, xr, bm, p.K, k0, xt4, XLD, tid, GEMM_THREADS);
        for (uint q = 0; q < parts; ++q) {
            const GemmWPart<WVP, device const S*> wq = q == 0u ? pa : pb;
            gemm_stage_w<FMT, S, T, float>(wq.w, wq.scales, wq.biases, wq.upr, wq.spr, wq.rows, p.K, p.group_size,
                                           p.bits, k0, GEMM_BN / parts, wt4 + q * cols * GEMM_LD / 4u, GEMM_LD, tid,
                                           GEMM_THREADS);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        op.run(xtt, wts, cts);
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    gemm_store<T, O>(p, t, ct, GEMM_LDC, n0, cols, r, y, tid, GEMM_THREADS);
}

// ---- instantiations: every weight format x {float, bfloat activations, bfloat with float output}
// (written out: the embedded-source table reads the host names literally) --------------------------
INSTANTIATE_KERNEL("gemm_tensor_q4_sbf16_f32", gemm_tensor, WFMT_Q4, bfloat, float, float)
INSTANTIATE_KERNEL("gemm_tensor_q4_sbf16_bf16", gemm_tensor, WFMT_Q4, bfloat, bfloat, bfloat)
INSTANTIATE_KERNEL("gemm_tensor_q4_sbf16_bf16_f32out", gemm_tensor, WFMT_Q4, bfloat, bfloat, float)
INSTANTIATE_KERNEL("gemm_tensor_q4_sf32_f32", gemm_tensor, WFMT_Q4, float, float, float)
INSTANTIATE_KERNEL("gemm_tensor_q4_sf32_bf16", gemm_tensor, WFMT_Q4, float, bfloat, bfloat)
INSTANTIATE_KERNEL("gemm_tensor_q4_sf32_bf16_f32out", gemm_tensor, WFMT_Q4, float, bfloat, float)
INSTANTIATE_KERNEL("gemm_tensor_q8_sbf16_f32", gemm_tensor, WFMT_Q8, bfloat, float, float)
INSTANTIATE_KERNEL("gemm_tensor_q8_sbf16_bf16", gemm_tensor, WFMT_Q8, bfloat, bfloat, bfloat)
INSTANTIATE_KERNEL("gemm_tensor_q8_sbf16_bf16_f32out", gemm_tensor, WFMT_Q8, bfloat, bfloat, float)
INSTANTIATE_KERNEL("gemm_tensor_q8_sf32_f32", gemm_tensor, WFMT_Q8, float, float, float)
INSTANTIATE_KERNEL("gemm_tensor_q8_sf32_bf16", gemm_tensor, WFMT_Q8, float, bfloat, bfloat)
INSTANTIATE_KERNEL("gemm_tensor_q8_sf32_bf16_f32out", gemm_tensor, WFMT_Q8, float, bfloat, float)
INSTANTIATE_KERNEL("gemm_tensor_qn_sbf16_f32", gemm_tensor, WFMT_QN, bfloat, float, float)
INSTANTIATE_KERNEL("gemm_tensor_qn_sbf16_bf16", gemm_tensor, WFMT_QN, bfloat, bfloat, bfloat)
INSTANTIATE_KERNEL("gemm_tensor_qn_sbf16_bf16_f32out", gemm_tensor, WFMT_QN, bfloat, bfloat, float)
INSTANTIATE_KERNEL("gemm_tensor_qn_sf32_f32", gemm_tensor, WFMT_QN, float, float, float)
INSTANTIATE_KERNEL("gemm_tensor_qn_sf32_bf16", gemm_tensor, WFMT_QN, float, bfloat, bfloat)
INSTANTIATE_KERNEL("gemm_tensor_qn_sf32_bf16_f32out", gemm_tensor, WFMT_QN, float, bfloat, float)
INSTANTIATE_KERNEL("gemm_tensor_bf16_f32", gemm_tensor, WFMT_DENSE, bfloat, float, float)
INSTANTIATE_KERNEL("gemm_tensor_bf16_bf16", gemm_tensor, WFMT_DENSE, bfloat, bfloat, bfloat)
INSTANTIATE_KERNEL("gemm_tensor_bf16_bf16_f32out", gemm_tensor, WFMT_DENSE, bfloat, bfloat, float)
INSTANTIATE_KERNEL("gemm_tensor_f16_f32", gemm_tensor, WFMT_DENSE, half, float, float)
INSTANTIATE_KERNEL("gemm_tensor_f16_bf16", gemm_tensor, WFMT_DENSE, half, bfloat, bfloat)
INSTANTIATE_KERNEL("gemm_tensor_f16_bf16_f32out", gemm_tensor, WFMT_DENSE, half, bfloat, float)
INSTANTIATE_KERNEL("gemm_tensor_f32_f32", gemm_tensor, WFMT_DENSE, float, float, float)
INSTANTIATE_KERNEL("gemm_tensor_f32_bf16", gemm_tensor, WFMT_DENSE, float, bfloat, bfloat)
INSTANTIATE_KERNEL("gemm_tensor_f32_bf16_f32out", gemm_tensor, WFMT_DENSE, float, bfloat, float)

// Tiled GEMM with the weight dequantization fused into the tile staging, on simdgroup_matrix (the
// prefill projections on M1-M4; metal/gemm_tensor.metal is the Metal 4 tensor-op route for M5).
//
//   gemm_<w>_<T>          Y[m, :N] = X[m, :K] W^T, Y in T          (dense row blocks, or MoE tile maps)
//   gemm_<w>_bf16_f32out  the same with bf16 X and float Y           (router logits, expert outputs)
// <w> = q4_sbf16, q4_sf32, q8_sbf16, q8_sf32, qn_sbf16, qn_sf32 (2, 3, 5, 6 bits: GemmParams.bits), bf16,
// f16, f32 (gpu::Matrix::variant()); T = f32 | bf16.
//
// One kernel serves the dense GEMM (ops::gemm) and the MoE grouped GEMMs (ops::gemm_grouped,
// ops::gemm_grouped_swiglu): GemmParams.flags select the rows of a tile (a row block, or a tile-map
// entry whose rows are slots, gathered from token rows with GEMM_GATHER) and the epilogue (residual,
// rounding, SwiGLU over a gate half and an up half of the weight tile). metal/gemm_tile.h does the
// staging and the epilogue; this file only multiplies.
//
// Buffers: 0 GemmParams; 1-3 the weight (w, scales, biases; the gate part with SwiGLU); 4-6 the second
// weight binding (the up part with SwiGLU: the same stacked matrix at row up_row, or the up stack);
// 7 x T; 8 slot_rows uint (GEMM_GATHER); 9 tiles uint4 (GEMM_TILEMAP); 10 residual (like y); 11 y.
// Unused slots bind a buffer of the dispatch again, declared unread by the host.
//
// Simulator-verified, hardware-unverified.
#include "common.h"
#include "gemm.h"
#include "gemm_tile.h"
#include "quant_dot.h"

// Why fused: prefill is compute-bound, but dequantizing W into a separate dense copy would write and
// re-read 4-8x the packed bytes; staging dequantizes each [GEMM_BN, GEMM_BK] weight tile once per
// threadgroup straight from the packed words into threadgroup memory, where GEMM_BM rows of X reuse it.
//
// Thread mapping: a threadgroup is GEMM_SIMDGROUPS = 4 SIMD-groups (128 threads) and computes a tile of
// bm = tile_rows (16 or 32) rows x GEMM_BN = 64 columns (SwiGLU: 32 gate and the 32 matching up columns,
// 32 outputs). Per K step of GEMM_BK = 32 the threadgroup stages the X tile [bm, 32] in T (exact: X is T)
// and the W tile [64, 32] dequantized as float (gemm_tile.h; every thread one or two units, stored as
// whole 4-vectors in a bank-conflict-free lane order). SIMD-group
// s then owns the 32 x 32 block of tile columns [32 (s & 1), + 32) and the half (s >> 1) of the K step
// (inputs [16 (s >> 1), + 16)): per 8 inputs 4 X fragments and 4 transposed W fragments (W^T) feed
// 4 x 4 simdgroup 8x8 multiply-accumulates into acc[4][4] (float): 8 fragment loads per 16 multiplies
// (MLX steel's 32 x 32 warp tile). All loops over fragments have constant bounds, so acc stays in
// registers; a 16-row tile skips fragment rows 2-3 by a threadgroup-uniform branch inside the loop.
// After the K loop the two K halves meet in the float product tile ct [bm, 68], which reuses the W
// tile's memory (the W tile is dead by then): SIMD-groups 2-3 store theirs, SIMD-groups 0-1 add theirs
// (an exact multiply-accumulate by the identity) and store the sum, and the threadgroup stores ct with
// the fusions. Threadgroup memory (rows padded so that consecutive rows start in different banks):
// X bm x 40 (bfloat) or x 36 (float), W 64 x 36 floats, 32 row offsets: 11,904 bytes with bfloat
// activations, 13,952 with float (was 22,656 with a separate product tile and float X). The W tile stays
// float: a half or bfloat tile would round the dequantized weights (scale * q + bias has up to 12 + 8
// significant bits), moving the results by more than the tests' float-accumulation bound.
// Grid (ceil(N / cols), ceil(M / tile_rows) or the tile-map capacity, 1) x (128, 1, 1). An empty tile
// returns before any barrier (its condition depends only on the threadgroup: uniform).
static_assert(GEMM_BM * GEMM_LDC <= GEMM_BN * GEMM_LD, "the product tile fits in the W tile's memory");
static_assert(GEMM_SIMDGROUPS == 4u && GEMM_BN == 64u && GEMM_BK == 32u && GEMM_BM == 32u,
              "gemm: 2 column halves x 2 K halves of 32 x 32 per SIMD-group");

template <int FMT, typename S, typename T, typename O>
[[kernel, max_total_threads_per_threadgroup(GEMM_THREADS)]]
void gemm(constant GemmParams& p [[buffer(0)]], device const uint32_t* w [[buffer(1)]],
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
    threadgroup uint xr_[GEMM_BM];
    // the tiles as pointers: gemm_tile.h's helpers take deduced pointer types (an array would be copied
    // into a by-value template parameter in the simulator)
    threadgroup vec<T, 4>* xt4 = xt_;   // the staging's view (gemm_tile.h stores whole vectors)
    threadgroup float4* wt4 = wt_;
    threadgroup T* xt = (threadgroup T*)xt4;   // the fragment loads' view
    threadgroup float* wt = (threadgroup float*)wt4;
    threadgroup float* ct = wt;    // the product tile [GEMM_BM, GEMM_LDC] after the K loop
    threadgroup uint* xr = xr_;
    constexpr uint XLD = GemmXLd<T>::LD;
    typedef typename WDot<FMT, S, T>::wvec WV;
    typedef device const WV* WVP;
    const bool tilemap = (p.flags & GEMM_TILEMAP) != 0u, swiglu = (p.flags & GEMM_SWIGLU) != 0u;
    const GemmTile t = gemm_tile_of(p, tgid.y, tilemap ? tiles[tgid.y] : uint4(0u));
    if (t.rows == 0u) {
        return;
    }
    const uint bm = min(p.tile_rows, GEMM_BM), cols = swiglu ? GEMM_BN / 2u : GEMM_BN, n0 = tgid.x * cols;
    const uint frag_rows = bm / 8u;   // 2 or 4: fragment rows i < frag_rows hold tile rows
    gemm_tile_rows(p, t, slot_rows, xr, tid, GEMM_THREADS);
    // the weight parts of the tile (64-bit offsets formed once): rows [n0, n0 + cols) of the first
    // binding, and with SwiGLU the matching up rows of the second
    const GemmWPart<WVP, device const S*> pa =
        gemm_w_part<FMT, S, T>(p, (WVP)w, scales, biases, t.expert, n0, p.N);
    const GemmWPart<WVP, device const S*> pb =
        gemm_w_part<FMT, S, T>(p, (WVP)w2, scales2, biases2, t.expert, p.up_row + n0, p.up_row + p.N);
    device const vec<T, 4>* x4 = (device const vec<T, 4>*)x;
    const uint nh = sg & 1u, kh = sg >> 1u;   // this SIMD-group's column half and K half
    simdgroup_float8x8 acc[4][4];
    for (uint i = 0; i < 4u; ++i) {
        for (uint j = 0; j < 4u; ++j) {
            acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint k0 = 0; k0 < p.K; k0 += GEMM_BK) {
        gemm_stage_x<T, T>(x4, xr, bm, p.K, k0, xt4, XLD, tid, GEMM_THREADS);
        if (swiglu) {
            gemm_stage_w<FMT, S, T, float>(pa.w, pa.scales, pa.biases, pa.upr, pa.spr, pa.rows, p.K, p.group_size,
                                           p.bits, k0, cols, wt4, GEMM_LD, tid, GEMM_THREADS);
            gemm_stage_w<FMT, S, T, float>(pb.w, pb.scales, pb.biases, pb.upr, pb.spr, pb.rows, p.K, p.group_size,
                                           p.bits, k0, cols, wt4 + cols * GEMM_LD / 4u, GEMM_LD, tid, GEMM_THREADS);
        } else {
            gemm_stage_w<FMT, S, T, float>(pa.w, pa.scales, pa.biases, pa.upr, pa.spr, pa.rows, p.K, p.group_size,
                                           p.bits, k0, GEMM_BN, wt4, GEMM_LD, tid, GEMM_THREADS);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint s8 = 0; s8 < GEMM_BK / 16u; ++s8) {
            const uint kk = GEMM_BK / 2u * kh + 8u * s8;
            simdgroup_float8x8 b[4];
            for (uint j = 0; j < 4u; ++j) {
                simdgroup_load(b[j], wt + (32u * nh + 8u * j) * GEMM_LD + kk, GEMM_LD, ulong2(0, 0), true);
            }
            for (uint i = 0; i < 4u; ++i) {
                if (i < frag_rows) {
                    simdgroup_matrix<T, 8, 8> a;
                    simdgroup_load(a, xt + 8u * i * XLD + kk, XLD);
                    for (uint j = 0; j < 4u; ++j) {
                        simdgroup_multiply_accumulate(acc[i][j], a, b[j], acc[i][j]);
                    }
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    // the two K halves: SIMD-groups 2-3 store their sums to ct, 0-1 add theirs (identity x part + acc:
    // exact) and store the total
    if (kh == 1u) {
        for (uint i = 0; i < 4u; ++i) {
            if (i < frag_rows) {
                for (uint j = 0; j < 4u; ++j) {
                    simdgroup_store(acc[i][j], ct + 8u * i * GEMM_LDC + 32u * nh + 8u * j, GEMM_LDC);
                }
            }
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (kh == 0u) {
        const simdgroup_float8x8 ident = simdgroup_float8x8(1.0f);
        for (uint i = 0; i < 4u; ++i) {
            if (i < frag_rows) {
                for (uint j = 0; j < 4u; ++j) {
                    threadgroup float* c8 = ct + 8u * i * GEMM_LDC + 32u * nh + 8u * j;
                    simdgroup_float8x8 part;
                    simdgroup_load(part, c8, GEMM_LDC);
                    simdgroup_multiply_accumulate(acc[i][j], ident, part, acc[i][j]);
                    simdgroup_store(acc[i][j], c8, GEMM_LDC);
                }
            }
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    gemm_store<T, O>(p, t, ct, GEMM_LDC, n0, cols, r, y, tid, GEMM_THREADS);
}

// ---- instantiations: every weight format x {float, bfloat activations, bfloat with float output}
// (written out: the embedded-source table reads the host names literally) --------------------------
INSTANTIATE_KERNEL("gemm_q4_sbf16_f32", gemm, WFMT_Q4, bfloat, float, float)
INSTANTIATE_KERNEL("gemm_q4_sbf16_bf16", gemm, WFMT_Q4, bfloat, bfloat, bfloat)
INSTANTIATE_KERNEL("gemm_q4_sbf16_bf16_f32out", gemm, WFMT_Q4, bfloat, bfloat, float)
INSTANTIATE_KERNEL("gemm_q4_sf32_f32", gemm, WFMT_Q4, float, float, float)
INSTANTIATE_KERNEL("gemm_q4_sf32_bf16", gemm, WFMT_Q4, float, bfloat, bfloat)
INSTANTIATE_KERNEL("gemm_q4_sf32_bf16_f32out", gemm, WFMT_Q4, float, bfloat, float)
INSTANTIATE_KERNEL("gemm_q8_sbf16_f32", gemm, WFMT_Q8, bfloat, float, float)
INSTANTIATE_KERNEL("gemm_q8_sbf16_bf16", gemm, WFMT_Q8, bfloat, bfloat, bfloat)
INSTANTIATE_KERNEL("gemm_q8_sbf16_bf16_f32out", gemm, WFMT_Q8, bfloat, bfloat, float)
INSTANTIATE_KERNEL("gemm_q8_sf32_f32", gemm, WFMT_Q8, float, float, float)
INSTANTIATE_KERNEL("gemm_q8_sf32_bf16", gemm, WFMT_Q8, float, bfloat, bfloat)
INSTANTIATE_KERNEL("gemm_q8_sf32_bf16_f32out", gemm, WFMT_Q8, float, bfloat, float)
INSTANTIATE_KERNEL("gemm_qn_sbf16_f32", gemm, WFMT_QN, bfloat, float, float)
INSTANTIATE_KERNEL("gemm_qn_sbf16_bf16", gemm, WFMT_QN, bfloat, bfloat, bfloat)
INSTANTIATE_KERNEL("gemm_qn_sbf16_bf16_f32out", gemm, WFMT_QN, bfloat, bfloat, float)
INSTANTIATE_KERNEL("gemm_qn_sf32_f32", gemm, WFMT_QN, float, float, float)
INSTANTIATE_KERNEL("gemm_qn_sf32_bf16", gemm, WFMT_QN, float, bfloat, bfloat)
INSTANTIATE_KERNEL("gemm_qn_sf32_bf16_f32out", gemm, WFMT_QN, float, bfloat, float)
INSTANTIATE_KERNEL("gemm_bf16_f32", gemm, WFMT_DENSE, bfloat, float, float)
INSTANTIATE_KERNEL("gemm_bf16_bf16", gemm, WFMT_DENSE, bfloat, bfloat, bfloat)
INSTANTIATE_KERNEL("gemm_bf16_bf16_f32out", gemm, WFMT_DENSE, bfloat, bfloat, float)
INSTANTIATE_KERNEL("gemm_f16_f32", gemm, WFMT_DENSE, half, float, float)
INSTANTIATE_KERNEL("gemm_f16_bf16", gemm, WFMT_DENSE, half, bfloat, bfloat)
INSTANTIATE_KERNEL("gemm_f16_bf16_f32out", gemm, WFMT_DENSE, half, bfloat, float)
INSTANTIATE_KERNEL("gemm_f32_f32", gemm, WFMT_DENSE, float, float, float)
INSTANTIATE_KERNEL("gemm_f32_bf16", gemm, WFMT_DENSE, float, bfloat, bfloat)
INSTANTIATE_KERNEL("gemm_f32_bf16_f32out", gemm, WFMT_DENSE, float, bfloat, float)

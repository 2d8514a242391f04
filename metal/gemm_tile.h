// The GEMM's tile staging and epilogue, shared by every GEMM route: metal/gemm.metal (simdgroup_matrix,
// M1-M4) and metal/gemm_tensor.metal (Metal 4 tensor ops, M5). A route only differs in how it
// multiplies the staged tiles; what a tile holds, how weights of every gpu::Matrix format are
// dequantized into it, which rows a tile covers (dense row blocks or MoE tile-map entries) and how the
// result is stored with its fusions is here, once.
//
// Usage by a kernel (GEMM_THREADS threads, geometry and GemmParams in metal/gemm.h):
//
//   const GemmTile t = gemm_tile_of(p, tgid.y, tilemap ? tiles[tgid.y] : uint4(0u));
//   if (t.rows == 0u) return;                       // empty tile: the whole threadgroup returns
//   gemm_tile_rows(p, t, slot_rows, xr, tid, nthreads);  // xr[GEMM_BM]: the X row of each tile row
//   threadgroup_barrier(...);
//   for (k0 = 0; k0 < K; k0 += GEMM_BK) {
//       gemm_stage_x<T, float>(x4, xr, ..., xt, GEMM_LD, ...);               // [bm, BK] of X
//       gemm_stage_w<FMT, S, T, float>(w, scales, biases, n0, N, ..., wt, GEMM_LD, ...);  // [BN, BK] of W
//       threadgroup_barrier(...);   multiply xt by wt^T into the accumulators;   threadgroup_barrier(...);
//   }
//   accumulators -> ct [bm, GEMM_LDC] (float), threadgroup_barrier(...), gemm_store<T>(p, t, ct, ...).
//
// Layouts: a staged tile is row-major with `ld` elements per row: X tile row i = X row xr[i], columns
// k0 .. k0 + GEMM_BK - 1; W tile row i = weight row r0 + i, the same columns. So the product tile is
// xt . wt^T (W^T as a transposed load of wt). Every element of [rows, GEMM_BK] is written (zeros for
// absent rows and for inputs past K), so the multiply needs no edge case and no slot is left unwritten.
// Element type TT of a tile: any type the route multiplies (gemm.metal stages float).
//
// Work split: element units are spread over the threadgroup's threads (thread tid takes units tid,
// tid + nthreads, ...): a unit is 4 activations (one vec<T, 4> load) or one WDot step of a weight row
// (metal/quant_dot.h: 16 weights at 4 bits, 8 at 8 bits, 8 dense), dequantized in registers and
// stored to the tile. Consecutive threads take consecutive units of a row, so a SIMD-group reads
// contiguous bytes of each weight row.
//
// Pointers are template parameters (deduced), as in quant_dot.h: this header is included as it is
// while the kernel files are rewritten for the simulator. Pass threadgroup tiles as pointers
// (`threadgroup float* xt = xt_;`), not as the arrays: the simulator would copy an array into a
// by-value template parameter. Simulator-verified, hardware-unverified.
#pragma once
#include "common.h"
#include "gemm.h"
#include "quant_dot.h"

// The rows one threadgroup's tile covers.
struct GemmTile {
    uint expert;  // matrix of the weight stack (0 dense)
    uint first;   // first row of Y (dense: a row block; grouped: a slot)
    uint rows;    // rows of the tile (0: nothing to do)
};

// The tile of threadgroup row ty: a row block of Y (dense), or tile-map entry `entry` = {expert, first
// slot, n_rows, 0} (GEMM_TILEMAP). Entries are clamped to the tile height and to the M rows of Y;
// an entry naming an expert past the stack is empty (device-side data the host cannot check).
inline GemmTile gemm_tile_of(constant GemmParams& p, uint ty, uint4 entry) {
    GemmTile t;
    const uint bm = min(p.tile_rows, GEMM_BM);
    if ((p.flags & GEMM_TILEMAP) != 0u) {
        t.expert = entry.x;
        t.first = entry.y;
        t.rows = entry.x < p.n_experts && entry.y < p.M ? min(min(entry.z, bm), p.M - entry.y) : 0u;
    } else {
        t.expert = 0u;
        t.first = ty * bm;
        t.rows = t.first < p.M ? min(bm, p.M - t.first) : 0u;
    }
    return t;
}

// xr[i] = the X row of tile row i for i < GEMM_BM: first + i, or slot_rows[first + i] with GEMM_GATHER;
// GEMM_NO_ROW past the tile's rows or for a gathered index past x_rows. Threads tid, tid + nthreads, ...
// write; the caller's barrier makes xr visible. slot_rows is read only with GEMM_GATHER.
template <typename RP, typename XRP>
inline void gemm_tile_rows(constant GemmParams& p, GemmTile t, RP slot_rows, XRP xr, uint tid, uint nthreads) {
    for (uint i = tid; i < GEMM_BM; i += nthreads) {
        uint row = GEMM_NO_ROW;
        if (i < t.rows) {
            row = t.first + i;
            if ((p.flags & GEMM_GATHER) != 0u) {
                row = slot_rows[row];
                row = row < p.x_rows ? row : GEMM_NO_ROW;
            }
        }
        xr[i] = row;
    }
}

// tile[i * ld + j] = X[xr[i], k0 + j] for i < bm, j < GEMM_BK (zero for absent rows and k0 + j >= K).
// x4 = X as vec<T, 4> (x_stride and the columns a multiple of 4: whole vectors are in or out).
template <typename T, typename TT, typename XP, typename XRP, typename TP>
inline void gemm_stage_x(XP x4, XRP xr, uint x_stride, uint bm, uint K, uint k0, TP tile, uint ld, uint tid,
                         uint nthreads) {
    const uint per_row = GEMM_BK / 4u;
    for (uint u = tid; u < bm * per_row; u += nthreads) {
        const uint i = u / per_row, j = 4u * (u % per_row), k = k0 + j;
        const uint row = xr[i];
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (row != GEMM_NO_ROW && k < K) {
            const vec<T, 4> a = x4[(ulong(row) * x_stride + k) / 4u];
            for (uint c = 0; c < 4u; ++c) {
                v[c] = float(a[c]);
            }
        }
        for (uint c = 0; c < 4u; ++c) {
            tile[i * ld + j + c] = TT(v[c]);
        }
    }
}

// tile[i * ld + j] = W[r0 + i, k0 + j] dequantized, for i < count, j < GEMM_BK (zero for rows >= rlim
// and k0 + j >= K). w, scales, biases: one matrix of the stack at its row 0 (w as WDot's wvec; bits the
// run-time width of WFMT_QN, whose unit of 32 values is one whole GEMM_BK step of a row); rlim
// bounds the rows this part may read (so the gate part of a stacked [gate | up] never reads up rows).
// Values are WDot::dequant's (scale * q + bias in float, as every GEMV of the project computes them).
template <int FMT, typename S, typename T, typename TT, typename WP, typename SP, typename TP>
inline void gemm_stage_w(WP w, SP scales, SP biases, uint r0, uint rlim, uint K, uint gs, uint bits, uint k0,
                         uint count, TP tile, uint ld, uint tid, uint nthreads) {
    typedef WDot<FMT, S, T> D;
    const uint per_row = GEMM_BK / D::VALS;
    const ulong upr = D::units_per_row(K, bits), spr = D::scales_per_row(K, gs);
    for (uint u = tid; u < count * per_row; u += nthreads) {
        const uint i = u / per_row, j = D::VALS * (u % per_row), k = k0 + j;
        const uint row = r0 + i;
        float v[D::VALS];
        if (row < rlim && k < K) {
            D::dequant(w + ulong(row) * upr, scales + ulong(row) * spr, biases + ulong(row) * spr, k, gs, bits, v);
        } else {
            for (uint c = 0; c < D::VALS; ++c) {
                v[c] = 0.0f;
            }
        }
        for (uint c = 0; c < D::VALS; ++c) {
            tile[i * ld + j + c] = TT(v[c]);
        }
    }
}

// Stores the product tile ct ([t.rows, ldc] float; with GEMM_SWIGLU columns [0, cols) the gate and
// [cols, 2 cols) the up products) to Y rows t.first .. (row stride y_stride), columns n0 .. n0 + cols - 1
// (< N), with the fusions: GEMM_SWIGLU y = swiglu_act<T>(gate, up) (rounded as the bf16 graph);
// GEMM_ADD y = residual + T(product) (residual may be y); GEMM_ROUND float y = T(product).
// Threads take consecutive columns of a row (coalesced stores).
template <typename T, typename O, typename CP, typename RP, typename YP>
inline void gemm_store(constant GemmParams& p, GemmTile t, CP ct, uint ldc, uint n0, uint cols, RP residual, YP y, uint tid,
                       uint nthreads) {
    const bool swiglu = (p.flags & GEMM_SWIGLU) != 0u, add = (p.flags & GEMM_ADD) != 0u;
    const bool round = (p.flags & GEMM_ROUND) != 0u;
    for (uint u = tid; u < t.rows * cols; u += nthreads) {
        const uint i = u / cols, c = u % cols, n = n0 + c;
        if (n >= p.N) {
            continue;
        }
        const ulong at = ulong(t.first + i) * p.y_stride + n;
        float v = ct[i * ldc + c];
        if (swiglu) {
            v = swiglu_act<T>(v, ct[i * ldc + cols + c]);
        } else if (add || round) {
            v = rnd<T>(v);   // the product rounded to T first (the bf16 graph adds two bf16 values)
        }
        if (add) {
            v += float(residual[at]);
        }
        y[at] = O(v);
    }
}

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
//   gemm_tile_rows(p, t, slot_rows, xr, tid, nthreads);  // xr[GEMM_BM]: the X row offset of each tile row
//   const GemmWPart<...> wp = gemm_w_part<FMT, S, T>(p, w, scales, biases, t.expert, n0, N);  // once
//   threadgroup_barrier(...);
//   for (k0 = 0; k0 < K; k0 += GEMM_BK) {
//       gemm_stage_x<T, TX>(x4, xr, bm, K, k0, xt4, ldx, ...);                 // [bm, BK] of X (xt4: vec<TX, 4>)
//       gemm_stage_w<FMT, S, T, float>(wp.w, wp.scales, wp.biases, wp.upr, wp.spr, wp.rows, ..., wt4, GEMM_LD, ...);
//       threadgroup_barrier(...);   multiply xt by wt^T into the accumulators;   threadgroup_barrier(...);
//   }
//   accumulators -> ct [bm, GEMM_LDC] (float), threadgroup_barrier(...), gemm_store<T>(p, t, ct, ...).
//
// 64-bit arithmetic (several times slower than 32-bit on Apple GPUs) happens once per threadgroup, outside
// the loops: gemm_w_part forms the weight parts' first-row pointers, gemm_store the output tile's; inside a
// tile every offset is 32-bit (X rows as vec4 offsets in xr, weight rows i * units per row, output rows
// i * y_stride), which the host's size checks keep in range (src/gpu/ops/gemm.cpp).
//
// Layouts: a staged tile is row-major with `ld` elements per row (a multiple of 4: the staging stores whole
// vec<TT, 4>, one SIMD-group access of 64 or 128 words per store, bank-conflict free in the simulator's
// 32-bank model; the caller passes the tile as a vec<TT, 4> pointer): X tile row i = X row xr[i], columns
// k0 .. k0 + GEMM_BK - 1; W tile row i = weight row r0 + i, the same columns. So the product tile is
// xt . wt^T (W^T as a transposed load of wt). Every element of [rows, GEMM_BK] is written (zeros for
// absent rows and for inputs past K), so the multiply needs no edge case and no slot is left unwritten.
// Element type TT of a tile: any type the route multiplies (gemm.metal stages X in T and W in float,
// gemm_tensor.metal both in float).
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

// Elements per staged row of an X tile of element type T: GEMM_BK plus 16 bytes of padding for 2-byte
// types (bfloat, half: 40), 4 floats for float (GEMM_LD = 36), so that the 8 rows of a fragment load start
// in different threadgroup-memory banks (a row of 80 or 144 bytes moves the next row by 20 or 4 words).
template <typename T>
struct GemmXLd {
    enum : uint { LD = GEMM_BK + 8u };
};
template <>
struct GemmXLd<float> {
    enum : uint { LD = GEMM_LD };
};

static_assert(GEMM_LD % 4u == 0u && GemmXLd<bfloat>::LD % 4u == 0u, "tile rows hold whole 4-vectors (vector stores)");

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

// xr[i] = where the X row of tile row i starts, in vec<T, 4> units of X (row * x_stride / 4), for
// i < GEMM_BM: the row is first + i, or slot_rows[first + i] with GEMM_GATHER; GEMM_NO_ROW past the
// tile's rows or for a gathered index past x_rows. 32-bit: the host checks that x_rows * x_stride / 4
// fits (gemm.cpp), so the staging indexes X without 64-bit arithmetic. Threads tid, tid + nthreads, ...
// write; the caller's barrier makes xr visible. slot_rows is read only with GEMM_GATHER.
template <typename RP, typename XRP>
inline void gemm_tile_rows(constant GemmParams& p, GemmTile t, RP slot_rows, XRP xr, uint tid, uint nthreads) {
    const uint x4_stride = p.x_stride / 4u;
    for (uint i = tid; i < GEMM_BM; i += nthreads) {
        uint row = GEMM_NO_ROW;
        if (i < t.rows) {
            row = t.first + i;
            if ((p.flags & GEMM_GATHER) != 0u) {
                row = slot_rows[row];
                row = row < p.x_rows ? row : GEMM_NO_ROW;
            }
        }
        xr[i] = row == GEMM_NO_ROW ? GEMM_NO_ROW : row * x4_stride;
    }
}

// tile[i * ld + j] = X[xr[i], k0 + j] for i < bm, j < GEMM_BK (zero for absent rows and k0 + j >= K).
// x4 = X as vec<T, 4> (x_stride and the columns a multiple of 4: whole vectors are in or out); xr the
// rows' vec4 offsets (gemm_tile_rows); tile the tile as vec<TT, 4> (ld elements per row, a multiple of 4).
// Each unit (4 activations) is one vector store. Lane mapping (bm a multiple of 16, nthreads of 32): the
// 32 units of one SIMD-group access are the 8 units of 4 rows i, i + 4, i + 8, i + 12 of a 16-row block
// (g = u / 32 picks the block and i), not 4 consecutive rows: with 2-byte T a row is 20 words, so rows 4
// apart start 80 words = 16 banks apart and each pair covers the 32 banks once (2 cycles for 64 words, the
// fewest); 4 consecutive rows start 20 banks apart and put 3 words on some banks. With float T (36 floats a
// row) any 4 rows are already spread (4 cycles for 128 words).
template <typename T, typename TT, typename XP, typename XRP, typename TP>
inline void gemm_stage_x(XP x4, XRP xr, uint bm, uint K, uint k0, TP tile, uint ld, uint tid, uint nthreads) {
    const uint per_row = GEMM_BK / 4u;   // 8: 4 rows per 32 units
    for (uint u = tid; u < bm * per_row; u += nthreads) {
        const uint g = u / 32u, l = u % 32u;
        const uint i = 16u * (g / 4u) + g % 4u + 4u * (l / per_row), j = 4u * (l % per_row), k = k0 + j;
        const uint at = xr[i];
        vec<TT, 4> o;
        if (at != GEMM_NO_ROW && k < K) {
            const vec<T, 4> a = x4[at + k / 4u];
            for (uint c = 0; c < 4u; ++c) {
                o[c] = TT(float(a[c]));
            }
        } else {
            for (uint c = 0; c < 4u; ++c) {
                o[c] = TT(0.0f);
            }
        }
        tile[(i * ld + j) / 4u] = o;
    }
}

// tile[i * ld + j] = W[r0 + i, k0 + j] dequantized, for i < count, j < GEMM_BK (zero for rows i >= rows
// and k0 + j >= K). w, scales, biases: the weight part at its first tile row r0 (w as WDot's wvec; the
// caller forms these 64-bit offsets once per threadgroup, gemm_w_part), upr / spr its wvec units and
// scales per row, so a row here is a 32-bit offset i * upr (i < GEMM_BN); `rows` the rows of the part
// from r0 that this tile may read (so the gate part of a stacked [gate | up] never reads up rows); bits
// the run-time width of WFMT_QN, whose unit of 32 values is one whole GEMM_BK step of a row.
// Values are WDot::dequant's (scale * q + bias in float, as every GEMV of the project computes them).
// tile: the tile as vec<TT, 4> (ld elements per row, a multiple of 4); a unit's VALS values (16, 8 or 32)
// are stored as VALS / 4 vectors. With a float tile of 36 floats a row, lane l's q-th vector of one
// SIMD-group access is 16-byte slot 9 i + VALS / 4 * (unit in row) + q, i.e. slot (i + ...) mod 8 of a
// 128-byte bank line: the 32 lanes spread evenly over the 8 slots (4 cycles for 128 words, the fewest).
// Scalar stores (word 36 i + j + c, bank 4 i + j + c) put the 32 lanes of one store on 8 banks (4 cycles
// for 32 words where 1 is possible).
template <int FMT, typename S, typename T, typename TT, typename WP, typename SP, typename TP>
inline void gemm_stage_w(WP w, SP scales, SP biases, uint upr, uint spr, uint rows, uint K, uint gs, uint bits,
                         uint k0, uint count, TP tile, uint ld, uint tid, uint nthreads) {
    typedef WDot<FMT, S, T> D;
    const uint per_row = GEMM_BK / D::VALS;
    for (uint u = tid; u < count * per_row; u += nthreads) {
        const uint i = u / per_row, j = D::VALS * (u % per_row), k = k0 + j;
        float v[D::VALS];
        if (i < rows && k < K) {
            D::dequant(w + i * upr, scales + i * spr, biases + i * spr, k, gs, bits, v);
        } else {
            for (uint c = 0; c < D::VALS; ++c) {
                v[c] = 0.0f;
            }
        }
        for (uint q = 0; q < D::VALS / 4u; ++q) {
            vec<TT, 4> o;
            for (uint c = 0; c < 4u; ++c) {
                o[c] = TT(v[4u * q + c]);
            }
            tile[(i * ld + j) / 4u + q] = o;
        }
    }
}

// One weight part of a tile (the whole tile, or the gate or up half with SwiGLU): its rows from row r0 of
// matrix `expert` of a stack (w as wvec, scales, biases at the stack's start), limited to rows < rlim.
// The 64-bit offsets are formed here, once per threadgroup (Apple GPUs run 64-bit integer multiplies
// several times slower: none is left in the staging loops).
template <typename WP, typename SP>
struct GemmWPart {
    WP w;
    SP scales, biases;
    uint upr, spr, rows;
};
template <int FMT, typename S, typename T, typename WP, typename SP>
inline GemmWPart<WP, SP> gemm_w_part(constant GemmParams& p, WP w, SP scales, SP biases, uint expert, uint r0,
                                     uint rlim) {
    typedef WDot<FMT, S, T> D;
    GemmWPart<WP, SP> q;
    q.upr = D::units_per_row(p.K, p.bits);
    q.spr = D::scales_per_row(p.K, p.group_size);
    const ulong row = ulong(expert) * p.w_rows + r0;
    q.w = w + row * q.upr;
    q.scales = scales + row * q.spr;
    q.biases = biases + row * q.spr;
    q.rows = rlim > r0 ? rlim - r0 : 0u;
    return q;
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
    // the tile's first row once at a 64-bit offset; inside it 32-bit offsets (GEMM_BM * y_stride fits:
    // checked by the host)
    const ulong first = ulong(t.first) * p.y_stride;
    const RP rt = residual + first;
    const YP yt = y + first;
    for (uint u = tid; u < t.rows * cols; u += nthreads) {
        const uint i = u / cols, c = u % cols, n = n0 + c;
        if (n >= p.N) {
            continue;
        }
        const uint at = i * p.y_stride + n;
        float v = ct[i * ldc + c];
        if (swiglu) {
            v = swiglu_act<T>(v, ct[i * ldc + cols + c]);
        } else if (add || round) {
            v = rnd<T>(v);   // the product rounded to T first (the bf16 graph adds two bf16 values)
        }
        if (add) {
            v += float(rt[at]);
        }
        yt[at] = O(v);
    }
}

// gemm family: parameters and thread geometry shared by metal/gemm.metal (the simdgroup_matrix GEMM),
// metal/gemm_tile.h (the tile staging and the epilogue, also used by the tensor-op GEMM) and the host
// functions (src/gpu/ops/gemm.cpp).
#pragma once
// Host side: uint32_t comes from <cstdint>, included first by src/gpu/ops/common.h.

// One dispatch computes Y = X W^T over tiles of GEMM_BM (or the tile map's tile_rows) rows of X and
// GEMM_BN weight rows (output columns; with GEMM_SWIGLU, GEMM_BN / 2 gate rows and the GEMM_BN / 2
// matching up rows), stepping over the inputs GEMM_BK at a time.
//
// Dense (no GEMM_TILEMAP): threadgroup (tx, ty) computes rows [ty * tile_rows, + tile_rows) of X/Y,
// columns [tx * cols, + cols) of Y (cols = GEMM_BN, or GEMM_BN / 2 with GEMM_SWIGLU).
// Grouped (GEMM_TILEMAP): threadgroup (tx, ty) computes entry ty of the tile map: uint4 {expert,
// first slot, n_rows, 0}; its rows are slots first .. first + n_rows - 1 (rows of Y); the X row of a
// slot is the slot itself, or slot_rows[slot] with GEMM_GATHER. n_rows == 0: the threadgroup returns.
struct GemmParams {
    uint32_t M;           // rows of Y: dense M (tokens), grouped S (slots; tile-map slots >= S are skipped)
    uint32_t N;           // output columns (swiglu: per half, = rows of the gate part)
    uint32_t K;           // inputs (columns of W): quantized a multiple of group_size, dense of 8
    uint32_t group_size;  // quantized: 32, 64 or 128; dense: unused
    uint32_t x_stride;    // elements between rows of X (a multiple of 4: vector loads)
    uint32_t y_stride;    // elements between rows of Y (and of the residual)
    uint32_t flags;       // GEMM_ADD | GEMM_ROUND | GEMM_SWIGLU | GEMM_TILEMAP | GEMM_GATHER
    uint32_t tile_rows;   // rows per tile: GEMM_BM (dense), the tile map's 16 or 32 (grouped)
    uint32_t x_rows;      // rows X holds (a gathered row index >= x_rows stages zeros: no stray read)
    uint32_t w_rows;      // rows of one matrix of the weight stack (the stride between experts)
    uint32_t n_experts;   // matrices in the stack (a tile-map entry naming expert >= it is skipped)
    uint32_t up_row;      // swiglu: first up row in the second weight binding (stacked [gate|up]: N; else 0)
    uint32_t bits;        // WFMT_QN: the weights' width (2, 3, 5, 6); other formats: unused
};
static_assert(sizeof(GemmParams) == 52, "GemmParams: 13 x 4 bytes, as the host packs it");

// flags (uniform over a dispatch)
#define GEMM_ADD 1u      // y = residual + T(X W^T) (residual may be y: each element read and written once)
#define GEMM_ROUND 2u    // float output holding T(X W^T) (router logits; the grouped expert outputs)
#define GEMM_SWIGLU 4u   // y[:, j] = silu(gate_j . x) * (up_j . x), gate rows and up rows from two bindings
#define GEMM_TILEMAP 8u  // grouped: threadgroup row ty is tile-map entry ty
#define GEMM_GATHER 16u  // grouped: the X row of slot s is slot_rows[s]

// Tile geometry (4 SIMD-groups; the X tile in the activation type, the dequantized W tile and the
// product tile float, in threadgroup memory: metal/gemm.metal). GEMM_BM is the largest tile height;
// grouped tiles are 16 or 32 rows (GEMM_BM_SMALL or GEMM_BM).
#define GEMM_BM 32u
#define GEMM_BM_SMALL 16u
#define GEMM_BN 64u
#define GEMM_BK 32u
#define GEMM_SIMDGROUPS 4u
#define GEMM_THREADS (32u * GEMM_SIMDGROUPS)
// floats per staged row of the W tile and of a float X tile (BK + 4: the padding staggers rows over
// memory banks; a bfloat/half X tile pads by 16 bytes instead: GemmXLd in gemm_tile.h)
#define GEMM_LD (GEMM_BK + 4u)
// floats per row of the output tile
#define GEMM_LDC (GEMM_BN + 4u)
// an absent tile row (past M, past the tile's n_rows, or a gathered index past x_rows)
#define GEMM_NO_ROW 0xFFFFFFFFu
// batches up to this many rows go to qmv (the skinny route; QMV's batched GEMV reads weights once)
#define GEMM_SKINNY_MAX 16u

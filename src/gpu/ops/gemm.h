// Host functions of metal/gemm.metal: the prefill GEMM (dense projections of a chunk of M rows) and
// the MoE grouped GEMMs over a tile map of counting-sorted (token, expert) slots.
#pragma once
#include "gpu/ops/common.h"
#include "gpu/ops/quant.h"

namespace qwenmetal::gpu::ops {

// simdgroup_matrix (M1-M4) | Metal 4 tensor ops (M5: metal/gemm_tensor.metal)
enum class GemmRoute : uint8_t { Simdgroup = 0, Tensor = 1 };

// The route of a device: Tensor where DeviceInfo::tensor_ops (M5, GPU family apple10; a SimDevice that
// claims it), else Simdgroup. Tensor on a device without tensor ops is an invalid_argument in every GEMM.
GemmRoute gemm_route(const DeviceInfo& info);
// "simdgroup" / "tensor" (the Python options' and bindings' names); parse throws invalid_argument
GemmRoute parse_gemm_route(const std::string& name);
const char* gemm_route_name(GemmRoute r);

struct GemmFusion {
    const Buffer* residual = nullptr;  // y = residual + X W^T (may be y itself; product rounded to T first, as qmv)
    bool round = false;                // f32 output holding the product rounded to T (router logits)
    bool swiglu = false;               // W is a stacked [gate | up] (rows 2n): y[m, :n] = silu(gate x) * (up x)
};

// Y[m, :N] = X[m, :K] W^T for m < M (N = W.rows, or W.rows/2 with swiglu; K = W.cols).
// x T [M, x_stride]; y T [M, y_stride] (float with f32_out). Strides default to K / N.
// M <= 16 (GEMM_SKINNY_MAX) without swiglu: forwards to ops::qmv with batch M (weights read once for
// all rows); otherwise, and for swiglu at every M, the tiled GEMM with dequantization fused into the
// weight-tile staging, on `route`. One dispatch.
void gemm(Encoder& e, Act t, const Matrix& W, const Buffer& x, const Buffer& y, uint32_t M,
          bool f32_out = false, uint32_t x_stride = 0, uint32_t y_stride = 0,
          const GemmFusion& f = GemmFusion(), GemmRoute route = GemmRoute::Simdgroup);

// The tile map of the MoE grouped GEMMs (built on the GPU by ops::moe_sort): `capacity` entries of
// uint4 {expert, first slot, n_rows (1..tile_rows), 0}; n_rows == 0 is an empty entry (its
// threadgroups return at once). The grid is always the capacity (no read-back of counts).
struct TileMap {
    Buffer tiles;             // u32x4 [capacity]
    uint32_t capacity = 0;
    uint32_t tile_rows = 16;  // 16 or 32
};

// act[s, :I] = silu(gate_e x[slot_rows[s]]) * (up_e x[slot_rows[s]]) for every slot s of every tile
// (e = the tile's expert); gate, up: stacks [E, I, H] of one format; x T [rows, H] (rows = what the
// buffer holds; a slot_rows entry past it stages zeros); slot_rows u32 [S]; act T [S, I]. One dispatch.
void gemm_grouped_swiglu(Encoder& e, Act t, const Matrix& gate, const Matrix& up, const Buffer& x,
                         const Buffer& slot_rows, const TileMap& tm, uint32_t S, const Buffer& act,
                         GemmRoute route = GemmRoute::Simdgroup);

// y[s, :N] = W_e act[s, :K] for every slot s of every tile (rows of act are slots, not tokens);
// W: stack [E, N, K]; act T [S, K]; y float [S, N] holding the product rounded to T (the bf16 graph's
// expert outputs; the combine adds k of them per token in float). One dispatch.
void gemm_grouped(Encoder& e, Act t, const Matrix& W, const Buffer& act, const TileMap& tm, uint32_t S,
                  const Buffer& y, GemmRoute route = GemmRoute::Simdgroup);

}  // namespace qwenmetal::gpu::ops

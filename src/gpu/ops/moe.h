// Host functions of metal/moe.metal: the sparse MoE block of one decode token in three kernels after
// the router GEMV (quant: qmv with f32 output over [router | shared_expert_gate] rows), and the
// prefill block of a chunk of M tokens (top-k for all rows, GPU counting sort + tile map, combine).
#pragma once
#include <vector>

#include "gpu/ops/gemm.h"
#include "gpu/ops/quant.h"

namespace qwenmetal::gpu::ops {

// logits f32 [n_experts (+ 1 shared-gate logit, ignored here)] -> softmax over the n_experts,
// top-k (ties: lower index first), renormalised to sum 1 when `norm`; ids uint32 [k], weights f32 [k].
// moe_topk_rows for one row, without roundings (float). One threadgroup.
void moe_topk(Encoder& e, const Buffer& logits, uint32_t n_experts, uint32_t k, bool norm, const Buffer& ids,
              const Buffer& weights);

// act[s, :inter] = silu(gate_s x) * up_s x for the k routed slots (expert ids[s] of the gate/up
// stacks) and, when shared_gate_up is given (rows = 2 * shared_inter: [gate | up]), slot k for the
// shared expert (its row length shared_inter; act's row stride is max(inter, shared_inter)).
// x [H] (T); act [(k + 1), stride] (T). One dispatch, or two when the shared expert's format cannot
// share the routed experts' kernel (can_pair: e.g. dense routed experts beside a quantized shared
// expert): then mlp_gate_up writes its slot.
// With `route`, the router top-k is fused in (moe_topk's function run by every SIMD-group of a routed
// slot on route->logits): ids and route->weights are then written, for moe_down, instead of read.
struct MoeRouting {
    Buffer logits;            // f32 [n_experts (+1)]: the router GEMV's output
    uint32_t n_experts = 0;
    bool norm = true;         // renormalise the k weights (norm_topk_prob)
    Buffer weights;           // f32 [k] (written)
};
void moe_gate_up(Encoder& e, Act t, const Matrix& gate, const Matrix& up, const Matrix* shared_gate_up,
                 const Buffer& x, const Buffer& ids, uint32_t k, const Buffer& act, const MoeRouting* route = nullptr);

// x[:H] += sum_s weights[s] * down_{ids[s]} act[s]  (+ sigmoid(logits[n_experts]) * shared_down act[k]
// when shared_down is given; that logit is the shared_expert_gate row of the router GEMV), summed in a
// fixed order (slots 0..k-1, then shared). x (T) is read and written in place: the residual add.
// One dispatch; when the shared expert's format cannot share the routed experts' kernel, its down
// projection runs first (qmv, the same per-row arithmetic) into `shared_out` (f32 [H], required then).
void moe_down(Encoder& e, Act t, const Matrix& down, const Matrix* shared_down, const Buffer& act,
              const Buffer& ids, const Buffer& weights, const Buffer& logits, uint32_t n_experts, uint32_t k,
              const Buffer& x, const Buffer* shared_out = nullptr);

// ------------------------------------------------------------------------------- the union-read MoE
// The MoE block of R rows (a verification call, a batched decode step) reading each expert of the rows'
// union once for every row that chose it (metal/moe.metal, moe_*_rows), every row's result bit for bit
// moe_gate_up's / moe_down's on that row alone. Row r: x[r] at x_stride elements, its routing ids [R, k] /
// weights [R, k] (moe_topk_rows on the router logits [R, logits_stride]), its act block [k (+1), stride]
// at act_row elements (stride = max(inter, shared_inter), as moe_gate_up lays one row out).
// R in 1..MOE_ROWS_MAX, R k <= MOE_ROWS_MAX_PAIRS; strides multiples of 4 elements.
//
// Bytes declared: the union's experts are known only on the GPU, so a dispatch declares the rows of
// moe_expected_union(count, k, R) experts: a model (uniform random routing), not the routing of the call.
double moe_expected_union(uint32_t n_experts, uint32_t k, uint32_t rows);
struct MoeRows {
    uint32_t rows = 1;
    uint32_t x_stride = 0;    // elements between x rows (0: H)
    uint32_t act_row = 0;     // elements between act rows (0: (k + 1) stride)
};
// The router top-k fused into moe_gate_up_rows (R <= MOE_ROWS_TOPK_FUSED_MAX): moe_topk_rows's function on
// logits [R, stride], ids and weights [R, k] written for moe_down_rows instead of read.
struct MoeRowsRouting {
    Buffer logits;            // f32 [R, stride]
    uint32_t stride = 0;      // floats between logit rows (>= n_experts)
    uint32_t n_experts = 0;
    bool norm = true;
    Buffer weights;           // f32 [R, k] (written)
};
// act[r, j, :inter] = silu(gate_{ids[r, j]} x[r]) * up_{ids[r, j]} x[r]; slot k the shared expert. One
// dispatch (+ mlp_gate_up per row when the shared expert's format cannot share the routed kernel).
void moe_gate_up_rows(Encoder& e, Act t, const Matrix& gate, const Matrix& up, const Matrix* shared_gate_up,
                      const Buffer& x, const Buffer& ids, uint32_t k, const Buffer& act, const MoeRows& rows,
                      const MoeRowsRouting* route = nullptr);
// x[r] += sum_j weights[r, j] down_{ids[r, j]} act[r, j] (+ sigmoid(logits[r, n_experts]) shared_down act[r, k]),
// moe_down's order and roundings per row. One dispatch (+ qmv over the rows into shared_out f32 [R, H] when
// the shared expert's format cannot share the routed kernel).
void moe_down_rows(Encoder& e, Act t, const Matrix& down, const Matrix* shared_down, const Buffer& act,
                   const Buffer& ids, const Buffer& weights, const Buffer& logits, uint32_t logits_stride,
                   uint32_t n_experts, uint32_t k, const Buffer& x, const MoeRows& rows,
                   const Buffer* shared_out = nullptr);

// Dense SwiGLU MLP (qwen3_next layers without experts): act = silu(gate x) * up x, one dispatch over
// the stacked [gate | up] rows; the down projection is qmv + the residual add by the caller.
void mlp_gate_up(Encoder& e, Act t, const Matrix& gate_up, const Buffer& x, const Buffer& act);

// ------------------------------------------------------------------------------------------ prefill
// logits f32 [M, stride] (router GEMM; column n_experts is the shared-expert gate logit) -> per row
// softmax over n_experts, top-k (ties: lower index), renormalised when norm: ids u32 [M, k], w f32 [M, k].
// The decode top-k's function (route_topk) per row; `t` selects the bfloat graph's roundings of the
// weights (the selected probabilities, their sum, the quotient). One dispatch.
void moe_topk_rows(Encoder& e, Act t, const Buffer& logits, uint32_t M, uint32_t stride, uint32_t n_experts,
                   uint32_t k, bool norm, const Buffer& ids, const Buffer& weights);

// The most tiles S slots over n_experts experts can need: with n = min(E, S) non-empty experts,
// sum ceil(c_e / t) <= n + floor((S - n) / t) (attained by n - 1 experts of one slot and one with the
// rest), so no routing overflows the map and none needs a read-back of the counts.
uint32_t moe_tile_capacity(uint32_t S, uint32_t n_experts, uint32_t tile_rows);
// The tile height for S slots over n_experts experts: 32 when the average rows per expert S / E is at
// least 32 (an expert's weight tile is then staged once per 32 rows: half the weight traffic of 16, and
// on average no more than one partly filled tile per expert), else 16 (less padding for sparse experts).
uint32_t moe_tile_rows(uint32_t S, uint32_t n_experts);
// bytes of moe_sort's scratch: one counter per (token block, expert)
uint64_t moe_sort_scratch_bytes(uint32_t n_experts);

// counting sort of the S = M*k (token, expert) pairs of ids u32 [M, k] by expert (histogram, scan,
// scatter; stable: within an expert, slots in (token, j) order, whatever the schedule) + the tile map:
// slot_rows u32 [S] (token of slot s), slot_of u32 [M*k] (slot of pair (m, j)), tm.tiles (each expert's
// ceil(count / tile_rows) tiles in expert order, then empty entries up to tm.capacity, which must be at
// least moe_tile_capacity(S, n_experts, tm.tile_rows); ops::TileMap: gemm.h). Ids >= n_experts count
// as n_experts - 1.
// `scratch`: moe_sort_scratch_bytes(n_experts). Three dispatches, nothing read back.
void moe_sort(Encoder& e, const Buffer& ids, uint32_t M, uint32_t k, uint32_t n_experts, const Buffer& scratch,
              const Buffer& slot_rows, const Buffer& slot_of, const TileMap& tm);

// x[m] += sum_j w[m, j] * y[slot_of[m, j]] (+ sigmoid(logits[m, n_experts]) * shared[m] when shared is
// given: T [M, H], the shared expert's output), summed in a fixed order (j ascending, then the shared
// expert) with moe_down's roundings; y f32 [S, H] (the grouped down GEMM's rows); x T [M, H] in place.
// One dispatch.
void moe_combine(Encoder& e, Act t, const Buffer& y, const Buffer& slot_of, const Buffer& weights, uint32_t M,
                 uint32_t k, uint32_t H, const Buffer* shared, const Buffer& logits, uint32_t logits_stride,
                 uint32_t n_experts, const Buffer& x);

// ------------------------------------------------------------------------------------------ the block
// One MoE layer's matrices for moe_prefill. router: the parts of the stacked [E router rows | shared
// gate row] in row order (one Matrix when the parts share a format; the graph's Stacked::parts).
struct MoeBlock {
    const std::vector<Matrix>* router = nullptr;
    const Matrix* gate = nullptr;             // stack [E, I, H]
    const Matrix* up = nullptr;               // stack [E, I, H]
    const Matrix* down = nullptr;             // stack [E, H, I]
    const Matrix* shared_gate_up = nullptr;   // [2 Is, H], or null: no shared expert
    const Matrix* shared_down = nullptr;      // [H, Is]
    uint32_t k = 0;                           // experts per token
    bool norm = true;                         // renormalise the k weights (norm_topk_prob)
};

// moe_prefill's named scratch, bounded by the chunk (max_rows M, S = M k slots)
struct MoeScratch {
    Buffer logits;      // f32 [M, E (+1)]   router logits (+ the shared-gate logit)
    Buffer ids;         // u32 [M, k]
    Buffer weights;     // f32 [M, k]
    Buffer sort;        // moe_sort_scratch_bytes(E)
    Buffer slot_rows;   // u32 [S]
    Buffer slot_of;     // u32 [S]
    Buffer tiles;       // u32x4 [moe_tile_capacity(S, E, 16)] (16 rows: the larger map)
    Buffer act;         // T [S, I]          routed SwiGLU activations, one row per slot
    Buffer y;           // f32 [S, H]        routed expert outputs, one row per slot
    Buffer shared_act;  // T [M, Is]         (shared expert only)
    Buffer shared_out;  // T [M, H]          (shared expert only)
};
MoeScratch moe_prefill_scratch(Device& d, Act t, const MoeBlock& b, uint32_t max_rows);

// The MoE block of a chunk of M rows, in place: x[m] += moe(xn[m]) for m < M; xn T [M, H] the
// post-attention-normed input, x T [M, H] the residual stream. Encodes the router GEMM (float logits,
// rounded to T) -> moe_topk_rows -> moe_sort (tile height moe_tile_rows(S, E)) -> gemm_grouped_swiglu ->
// gemm_grouped -> the shared expert (gemm swiglu, gemm) -> moe_combine: 8 dependency levels (the shared
// expert's two GEMMs share levels 1 and 2), nothing read back.
void moe_prefill(Encoder& e, Act t, const MoeBlock& b, const Buffer& xn, const Buffer& x, uint32_t M,
                 const MoeScratch& s, GemmRoute route = GemmRoute::Simdgroup);

}  // namespace qwenmetal::gpu::ops

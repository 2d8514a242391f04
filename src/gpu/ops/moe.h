// Host functions of metal/moe.metal: the sparse MoE block of one decode token in three kernels after
// the router GEMV (quant: qmv with f32 output over [router | shared_expert_gate] rows), and the
// prefill block of a chunk of M tokens (top-k for all rows, GPU counting sort + tile map, combine).
#pragma once
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
// x [H] (T); act [(k + 1), stride] (T). One dispatch.
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
// One dispatch.
void moe_down(Encoder& e, Act t, const Matrix& down, const Matrix* shared_down, const Buffer& act,
              const Buffer& ids, const Buffer& weights, const Buffer& logits, uint32_t n_experts, uint32_t k,
              const Buffer& x);

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
// least moe_tile_capacity(S, n_experts, tm.tile_rows)). Ids >= n_experts count as n_experts - 1.
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

}  // namespace qwenmetal::gpu::ops

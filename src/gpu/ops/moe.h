// Host functions of metal/moe.metal: the sparse MoE block of one decode token in three kernels after
// the router GEMV (quant: qmv with f32 output over [router | shared_expert_gate] rows).
#pragma once
#include "gpu/ops/quant.h"

namespace qwenmetal::gpu::ops {

// logits f32 [n_experts (+ 1 shared-gate logit, ignored here)] -> softmax over the n_experts,
// top-k (ties: lower index first), renormalised to sum 1 when `norm`; ids uint32 [k], weights f32 [k].
// One threadgroup.
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

}  // namespace qwenmetal::gpu::ops

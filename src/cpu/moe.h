// MoE family (docs/model.md §4.5): router softmax (fp32) -> top-k (ties to the lower expert id) ->
// renormalise; token-expert pairs grouped by expert (counting sort) so each chosen expert's weights are
// read once per prefill chunk; gate and up projections computed by the same task and SwiGLU applied
// before anything is written; the down projections of all chosen experts, scaled by their routing
// weights, plus the shared expert's down projection scaled by sigmoid(shared_expert_gate · x), summed
// straight into the residual stream by tasks that each own a block of output rows.
// Decode (few tokens) uses GEMV for every expert; prefill dequantizes one 16-row tile of an expert
// and multiplies all of that expert's tokens with it.
// Streaming (docs/cpu.md, "Streaming experts"): the stacks hold the cache's slots instead of all E
// experts; after routing, the active experts (ascending) are taken in batches of at most
// slots_per_layer: the batch is made resident (ExpertCache::acquire), its gate/up and down
// projections run on the slots, and every output element is summed in the resident order (experts
// ascending, then the shared expert), so streaming output equals resident output bit for bit.
#pragma once
#include <cstdint>

#include "core/expert_cache.h"
#include "cpu/tensor.h"
#include "core/threadpool.h"
#include "cpu/quant.h"

namespace qwenmetal::cpu {

struct MoeWeights {
    const WMat* router = nullptr;                       // [E, H]
    const WStack* gate = nullptr;                       // [E][I, H] (streaming: [slots][I, H])
    const WStack* up = nullptr;
    const WStack* down = nullptr;                       // [E][H, I] (streaming: [slots][H, I])
    ExpertCache* cache = nullptr;                       // non-null: the stacks are this cache's slots
    int layer = 0;                                      // the model's layer index (the cache's key)
    const WMat* shared_gate_proj = nullptr;             // [Is, H]  (null: no shared expert)
    const WMat* shared_up_proj = nullptr;
    const WMat* shared_down_proj = nullptr;             // [H, Is]
    const WMat* shared_expert_gate = nullptr;           // [1, H]
    int64_t top_k = 0;
    bool norm_topk = true;
};

struct MoeDims {
    int64_t H, E, I, Is, k;
};

// shared floats for L tokens; per-thread floats
size_t moe_shared_floats(const MoeDims& d, int64_t L, int64_t gemv_rows = kGemvMaxRows);
size_t moe_thread_floats(const MoeDims& d, int64_t L);
size_t moe_xvec_floats(const MoeDims& d, int64_t L);
size_t moe_xvec_count(const MoeDims& d, int64_t L);

// x[t] += MoE(xn[t]) for t < L (rows of stride H)
void moe_forward(ThreadPool& pool, Workspace& ws, float* shared, const MoeWeights& w, const MoeDims& d,
                 const float* xn, int64_t L, float* x);

// x[t] += down(silu(gate xn) * up xn): the dense SwiGLU MLP (qwen3_next mlp_only_layers)
void mlp_forward(ThreadPool& pool, Workspace& ws, float* shared, const WMat& gate, const WMat& up, const WMat& down,
                 const float* xn, int64_t L, int64_t H, float* x);
size_t mlp_shared_floats(int64_t I, int64_t L);

// router: probabilities of the top-k experts of one token (fp32 softmax over all E, ties to the lower
// id, renormalised if norm_topk)
void route_token(const float* logits, int64_t E, int64_t k, bool norm_topk, int32_t* idx, float* wts, float* probs);

}  // namespace qwenmetal::cpu

// Host functions of metal/attention.metal: gated full attention of one decode token after its
// stacked projection [q+gate | k | v] (quant: qmv).
#pragma once
#include <string>

#include "gpu/ops/common.h"

namespace qwenmetal::gpu::ops {

struct AttnShape {
    uint32_t n_heads, n_kv_heads, head_dim, rotary_dim;   // config.json
    bool output_gate;                                     // q projection rows per head: [q | gate]
    float rope_theta, eps;
};

// KV cache of one layer: K and V [n_kv_heads, capacity, head_dim] each (T_kv: f32 or bf16).
struct KVCache {
    Buffer k, v;
    uint32_t capacity = 0;
    bool f32 = false;
};

// q/k RMSNorm (q_norm_w, k_norm_w T [head_dim]) + partial RoPE at `position` + KV write at row
// `position`: proj T [q_rows + 2 * n_kv * hd]; q_out T [n_heads, head_dim]. One dispatch.
void attn_prepare(Encoder& e, Act t, const AttnShape& s, const Buffer& proj, const Buffer& q_norm_w,
                  const Buffer& k_norm_w, uint32_t position, const KVCache& kv, const Buffer& q_out);

// o[h] = softmax(q_h K^T / sqrt(hd)) V over keys 0..n_keys-1, times sigmoid(gate_h) when the shape
// has the output gate (gate: the proj rows after each head's q); o T [n_heads * head_dim].
// The route (single pass, split-K + combine, GQA-packed, two-pass fixed blocks) comes from the
// policy; `scratch` f32 holds partial results (attention_scratch_bytes).
struct AttnPolicy {
    uint32_t single_pass_max = 1024;      // n_keys <= this: one pass, one threadgroup per head group
    uint32_t split_max = 16384;           // <= this: split-K (key blocks per threadgroup) + combine
    uint32_t split_block = 256;           // keys per split-K threadgroup
    uint32_t long_block = 1024;           // very long contexts: fixed blocks, two passes
    bool gqa_pack = true;                 // one K/V read for all query heads of a KV head
    // the route name for n_keys: "single", "split", "two_pass"
    std::string route(uint32_t n_keys) const;
};
uint64_t attention_scratch_bytes(const AttnShape& s, uint32_t max_keys, const AttnPolicy& p);
void attention_decode(Encoder& e, Act t, const AttnShape& s, const AttnPolicy& pol, const Buffer& q,
                      const Buffer& proj, const KVCache& kv, uint32_t n_keys, const Buffer& scratch,
                      const Buffer& o);

}  // namespace qwenmetal::gpu::ops

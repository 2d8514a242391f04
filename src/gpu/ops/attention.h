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

// q/k RMSNorm (q_norm_w, k_norm_w T [head_dim]) + partial RoPE + KV write of `rows` tokens at
// positions position .. position + rows - 1 (rows = 1: decode): proj T [rows, proj_stride], each
// row [q_rows + 2 * n_kv * hd] (proj_stride 0: that length); q_out T [rows, n_heads * head_dim];
// K/V rows written at those positions (once). One dispatch. RoPE: row r rotates at position + r + rope_offset (a
// state's rope_delta: interleaved M-RoPE's delta after an image, qwenmetal.mrope; an MTP head layer's shift), or,
// with pair_pos (i32 [rows, rotary_dim / 2], host-written), frequency pair i of row r at pair_pos[r][i].
void attn_prepare(Encoder& e, Act t, const AttnShape& s, const Buffer& proj, const Buffer& q_norm_w,
                  const Buffer& k_norm_w, uint32_t position, const KVCache& kv, const Buffer& q_out,
                  uint32_t rows = 1, uint32_t proj_stride = 0, int32_t rope_offset = 0,
                  const Buffer* pair_pos = nullptr);

// o[h] = softmax(q_h K^T / sqrt(hd)) V over keys 0..n_keys-1, times sigmoid(gate_h) when the shape
// has the output gate (gate: the proj rows after each head's q); o T [n_heads * head_dim].
// The route (single pass, split-K + combine, GQA-packed, two-pass fixed blocks) comes from the
// policy; `scratch` f32 holds partial results (attention_scratch_bytes).
struct AttnPolicy {
    // The single pass has one threadgroup per (head chunk, kv head): 2 on the real model, so it is kept only
    // where the K/V read is tiny (64 keys: 128 KB); beyond, blocks of 32 keys give min(n / 32, 32) partials
    // per head, 64 threadgroups on the real model from 1024 keys on (docs/metal.md, attention_decode).
    uint32_t single_pass_max = 64;        // n_keys <= this: one pass, one threadgroup per head group
    uint32_t split_max = 1024;            // <= this: split-K (key blocks per threadgroup) + combine
    uint32_t split_block = 32;            // keys per split-K threadgroup
    uint32_t long_block = 32;             // longer contexts: fixed blocks, two passes (ATTN_LONG_MAX_PARTIALS)
    bool gqa_pack = true;                 // one K/V read for all query heads of a KV head
    // the route name for n_keys: "single", "split", "two_pass"
    std::string route(uint32_t n_keys) const;
};
uint64_t attention_scratch_bytes(const AttnShape& s, uint32_t max_keys, const AttnPolicy& p);
void attention_decode(Encoder& e, Act t, const AttnShape& s, const AttnPolicy& pol, const Buffer& q,
                      const Buffer& proj, const KVCache& kv, uint32_t n_keys, const Buffer& scratch,
                      const Buffer& o);
// attn_prepare of the token at `position` fused into attention_decode over keys 0..position (its first kernel
// normalises and rotates q and k itself and writes the K/V row): one dispatch and dependency level fewer, bit for
// bit the two calls. The decode graph's route.
// rope_offset: q and k rotate at position + rope_offset while the K/V row written is `position` (attn_prepare's;
// a state's rope_delta: M-RoPE after an image, an MTP head's layer caches, whose entries skip positions).
void attention_decode_prepared(Encoder& e, Act t, const AttnShape& s, const AttnPolicy& pol, const Buffer& proj,
                               const Buffer& q_norm_w, const Buffer& k_norm_w, uint32_t position, const KVCache& kv,
                               const Buffer& scratch, const Buffer& o, int32_t rope_offset = 0);
// Several independent decode rows over one cache (the verification graph: row r sees n_keys + r keys): the
// same kernels as attention_decode, every row's first kernel before any combine.
struct AttnDecodeRow {
    Buffer q, proj, scratch, o;
    uint32_t n_keys;
    const KVCache* kv = nullptr;   // the row's own cache (a batched decode step); null: the call's
};
void attention_decode_rows(Encoder& e, Act t, const AttnShape& s, const AttnPolicy& pol, const KVCache& kv,
                           const std::vector<AttnDecodeRow>& rows);

// Causal flash attention for M query rows at positions p0 .. p0 + M - 1 (q T [M, n_heads * hd],
// from attn_prepare with rows) over keys 0 .. p0 + M - 1 of the cache (earlier chunks + this
// one): online softmax, S = Q K^T and O += P V on 8x8 simdgroup matrices, each K/V tile read once
// per (query block, kv head) for all query heads of that kv head; gated by sigmoid(gate) from proj
// rows [M, proj_stride] (0: the stacked row's length) when the shape has the output gate;
// o T [M, n_heads * head_dim]. head_dim a multiple of 8, at most 256 (instantiations for head_dim up to 64,
// 128 and 256; the host takes the smallest that fits); n_heads / n_kv_heads <= 32.
// `mask`: causal (above), or every row over every key 0 .. p0 + M - 1 (causal false: a DFlash draft's block, whose
// rows attend to their context and to the whole block), optionally only keys > p0 + r - window (window > 0, with
// causal: a sliding-window layer).
struct AttnMask {
    bool causal = true;
    uint32_t window = 0;
};
void attention_prefill(Encoder& e, Act t, const AttnShape& s, const Buffer& q, const Buffer& proj,
                       uint32_t proj_stride, const KVCache& kv, uint32_t p0, uint32_t M, const Buffer& o,
                       const AttnMask& mask = AttnMask());

// How attention_prefill tiles a chunk of M rows (metal/attention.h): query rows per threadgroup,
// keys per tile, threads per threadgroup, threadgroups along the query rows, query heads per threadgroup,
// head chunks of a group, the instantiation's largest head_dim (64, 128 or 256).
struct AttnPrefillGeometry {
    uint32_t block_rows, tile_keys, threads, blocks, heads_per_tg, chunks, head_dim_max;
};
// The instantiation of attn_prefill serving head_dim: 64, 128 or 256 (0: none).
uint32_t attention_prefill_instance(uint32_t head_dim);
// The most query rows of one attention_prefill dispatch at positions p0.. (of M wanted, a multiple of 32
// unless M itself) whose modelled arithmetic time on `chip` stays within `seconds` (0: M); at least 32. The graph
// runs a long context's attention in such query blocks, one dispatch each, so that the command buffers it
// cuts stay far under the GPU watchdog (gpu/cost.h).
uint32_t attention_prefill_rows_within(const AttnShape& s, uint32_t p0, uint32_t M, double seconds,
                                       const ChipModel& chip);
// max_threads: the pipeline's limit (Device::max_threads); the block has fewer rows under a lower one
AttnPrefillGeometry attention_prefill_geometry(const AttnShape& s, uint32_t M, uint32_t max_threads = 512,
                                               bool kv_f32 = false);

}  // namespace qwenmetal::gpu::ops

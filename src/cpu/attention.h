// Attention family (gated GQA full attention, docs/model.md §4.3).
//  * attn_qk_rope_kv_write: per token, q/k RMSNorm + partial rotate-half RoPE (fp32 angles at absolute
//    positions) in place, and the key/value rows written into the KV cache (bf16 rounded to nearest
//    even, or fp32) — one pass, so q/k/v are touched once after their projection.
//  * attention: causal softmax(q·K^T/sqrt(hd))·V in fp32 with an online (flash-style) softmax over
//    blocks of keys. Each K/V row is loaded once for all the query heads of its GQA group. Prefill
//    splits work over (query row, kv head); decode splits the context into fixed 1024-key pieces
//    (kv head x piece tasks, combined by log-sum-exp), so long contexts use every thread and the result
//    does not depend on the thread count.
#pragma once
#include <cstdint>

#include "core/threadpool.h"
#include "cpu/quant.h"

namespace qwenmetal::cpu {

struct AttnDims {
    int64_t nh, nkv, hd, rotary_dim;
    int64_t q_stride;          // floats between consecutive query heads in the q buffer (hd or 2*hd with a gate)
    int64_t q_row;             // floats per token row of the q buffer
    float eps;
};

struct KVCacheView {
    void* k;                   // [capacity][nkv*hd]
    void* v;
    bool f32;                  // element type: float32, else bf16
};

constexpr int64_t kAttnKeyBlock = 256;     // keys per online-softmax block
constexpr int64_t kAttnSplit = 1024;       // keys per decode piece

// inv_freq[d] = theta^(-2d/rotary_dim), d < rotary_dim/2 (float64 pow, rounded once)
void rope_inv_freq(double theta, int64_t rotary_dim, float* inv_freq);

// RoPE positions: row i at pos0 + i + rope_delta (rope_delta 0: the index, the text path; M-RoPE after an image,
// an MTP head's layer caches that skip positions), or with
// pair_pos ([L][rotary_dim/2], interleaved M-RoPE: qwenmetal.mrope.pair_positions) frequency pair j of row i
// at pair_pos[i][j]; the cache row written is always pos0 + i.
void attn_qk_rope_kv_write(const AttnDims& d, float* q, float* k, int64_t k_row, const float* v, int64_t v_row,
                           int64_t L, int64_t pos0, const float* q_norm, const float* k_norm, const float* inv_freq,
                           const KVCacheView& cache, int64_t rope_delta = 0, const int32_t* pair_pos = nullptr);

size_t attention_thread_floats(const AttnDims& d);
size_t attention_shared_floats(const AttnDims& d, int64_t L, int64_t T);

// out[i][h*hd..] = softmax(q_i,h · K[0..pos0+i]) V for i < L; keys pos0..pos0+L-1 must be in the cache.
void attention(ThreadPool& pool, Workspace& ws, float* shared, const AttnDims& d, const float* q, int64_t L,
               int64_t pos0, const KVCacheView& cache, float* out, int64_t ldo);

// A block of L query rows at positions qpos0..qpos0+L-1 over the cached keys [0, T) with no causal mask (a
// DFlash draft's block: its queries see every context key and the whole block), or with window > 0 over the
// keys t with qpos - window < t <= qpos (a sliding-window layer). Tasks (query row, kv head); per-thread
// scratch attention_thread_floats(d); out[i][h*hd..].
void attention_block(ThreadPool& pool, Workspace& ws, const AttnDims& d, const float* q, int64_t L, int64_t qpos0,
                     int64_t T, int64_t window, const KVCacheView& cache, float* out, int64_t ldo);

}  // namespace qwenmetal::cpu

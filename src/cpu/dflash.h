// A DFlash block draft (docs/speculative.md, "DFlash drafts") run on the cpu engine: a small stack of dense
// Qwen3 decoder layers that proposes a block of tokens in one forward pass over the target's layer features,
// computed as python/qwenmetal/dflash.py's DFlashReference.forward + logits (the float32 ground truth):
//
//   ctx = hidden_norm(fc(features))                 the n new context rows [n, H] (no per-layer norm)
//   x   = embed(block) * input_embedding_scale      the block [L, H]: the TARGET's embedding rows
//   for each layer:
//       h = input_layernorm(x)                      DFlash2: h = conv_a0(h)
//       q = q_norm(q_proj(h)) per head, RoPE at p+n..p+n+L-1            (block rows only)
//       k = k_norm(k_proj([ctx; h])), v = v_proj([ctx; h]), RoPE at p..p+n+L-1
//       a = o_proj(softmax(q K^T / sqrt(hd)) V)     K, V = [cached context | new context | block]: no causal
//                                                   mask (a sliding layer: causal within its window), GQA
//       x += a                                      DFlash2: x += conv_a1(a)
//       h' = post_attention_layernorm(x)            DFlash2: h' = conv_m0(h')
//       m = down(silu(gate(h')) * up(h'))
//       x += m                                      DFlash2: x += conv_m1(m)
//   logits = lm_head(norm(x[1..L-1])) * output_multiplier (soft-capped when the config says so): the TARGET's
//   lm_head, in place in its own format
//   drafts = each row's argmax; DFlash2: the candidate selector's greedy walk (below)
//
// DFlash2's convolutions (DFlashReference._conv / _grouped_causal_conv) run over the block's rows only (the
// context rows are not convolved). A layer has two, attention_conv around the attention and mlp_conv around
// the MLP, each in two halves: its input row h_t gives the dynamic factors d = kernel_projection(h) [L][2][K][H/G]
// (the draft's matrix path: bf16 or MLX-quantized in place); the first half convolves h itself with
// base_kernel[0] + d[:, 0], the second convolves the sublayer's output with base_kernel[1] + d[:, 1]:
//
//   conv_s(y)[t, e] = sum_{j < K, j <= t} (base_kernel[s, j, e] + d[t, s, j, e / G]) * y[t - j, e]
//
// The selector (DFlashReference.select): per row t the top selector_top_k logits are the candidates; with
// prev the token drafted before (the block's first token for t = 0), the draft is the candidate c maximising
// logit[c] + <predecessor_codebook[prev] * hidden_projection(hn_t), successor_codebook[c]>, hn_t the final
// norm's row t + 1. Codebook rows are read in place (as the embedding's are).
//
// The draft's weights are read in place (bf16 or MLX-quantized; only the norm vectors are copied). It runs on
// the target engine's thread pool under the target engine's lock (one forward at a time over both), so it
// needs no threads of its own. The context K/V live in a DFlashCache the caller owns: a call appends its
// context rows' keys and values (post-RoPE, float32) when it commits, and leaves the cache as it was when it
// does not, or when it fails.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cpu/engine.h"
#include "cpu/tensor.h"

namespace qwenmetal {

// The draft's dimensions, from its config.json (python/qwenmetal/dflash.py, DFlashConfig)
struct DFlashDims {
    int64_t hidden = 0, layers = 0, inter = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, vocab = 0;
    int64_t n_target_layers = 0;         // len(target_layer_ids): features are [n, n_target_layers * hidden]
    float eps = 1e-6f;
    double rope_theta = 10000.0;
    std::vector<int64_t> window;         // per layer: 0 full attention, else the sliding window
    bool attention_bias = false;
    float input_embedding_scale = 1.f, output_multiplier = 1.f, softcap = 0.f;   // softcap 0: none
    // DFlash2 (all 0 for DFlash): conv_kernel_size K, conv_group_size G (channels per dynamic factor),
    // selector_rank R, selector_top_k
    int64_t conv_kernel = 0, conv_group = 0, selector_rank = 0, selector_top_k = 0;
    bool dflash2() const { return conv_kernel > 0; }
    int64_t features() const { return n_target_layers * hidden; }
    // width of a conv's dynamic factors per row: both halves, K taps, H/G groups
    int64_t conv_factors() const { return dflash2() ? 2 * conv_kernel * (hidden / conv_group) : 0; }
    int64_t kv_dim() const { return n_kv_heads * head_dim; }
};

// The draft's context cache: per layer the post-RoPE keys and the values of the context rows seen so far
// ([capacity][nkv*hd] float32 each, rows 0..position-1 valid); rows past `position` are a call's scratch.
class DFlashCache {
public:
    DFlashCache(int64_t layers, int64_t kv_dim)
        : layers_(layers), kv_dim_(kv_dim), k_(size_t(layers)), v_(size_t(layers)) {}
    DFlashCache(const DFlashCache& o);     // deep copy of the valid rows
    DFlashCache& operator=(const DFlashCache&) = delete;
    int64_t position = 0;
    int64_t capacity() const { return capacity_; }
    int64_t layers() const { return layers_; }
    int64_t kv_dim() const { return kv_dim_; }
    float* k(int64_t layer) const { return k_[size_t(layer)].get(); }
    float* v(int64_t layer) const { return v_[size_t(layer)].get(); }
    size_t nbytes() const { return size_t(2 * layers_) * size_t(position) * size_t(kv_dim_) * 4; }
    // room for `rows` rows (the valid ones kept); throws std::bad_alloc with the cache unchanged
    void reserve(int64_t rows);
    void reset() { position = 0; }

private:
    struct Free {
        void operator()(float* p) const { std::free(p); }
    };
    int64_t layers_, kv_dim_, capacity_ = 0;
    std::vector<std::unique_ptr<float, Free>> k_, v_;
};

class DFlashDraft {
public:
    // tensors: the draft's linear layers by DFlashDraft name ("fc", "layers.{i}.self_attn.q_proj", ...,
    // "layers.{i}.mlp.down_proj"); small: the norms ("hidden_norm", "norm", "layers.{i}.input_layernorm",
    // "layers.{i}.post_attention_layernorm", "layers.{i}.self_attn.q_norm"/"k_norm") and, with
    // attention_bias, "layers.{i}.self_attn.{q,k,v,o}_proj.bias". DFlash2 adds the linear layers
    // "layers.{i}.{attention,mlp}_conv.kernel_projection", "candidate_selector.{predecessor,successor}_codebook"
    // and "candidate_selector.hidden_projection", and the small "layers.{i}.{attention,mlp}_conv.base_kernel"
    // ([2][K][H] flattened). `target`: the engine whose embedding,
    // lm_head, thread pool and activation mode the draft uses (it must outlive the draft).
    DFlashDraft(const DFlashDims& dims, const std::map<std::string, TensorDesc>& tensors,
                const std::map<std::string, std::vector<float>>& small, Engine& target);
    DFlashDraft(const DFlashDraft&) = delete;
    DFlashDraft& operator=(const DFlashDraft&) = delete;

    const DFlashDims& dims() const { return d_; }
    std::unique_ptr<DFlashCache> new_cache() const { return std::make_unique<DFlashCache>(d_.layers, d_.kv_dim()); }
    size_t weight_bytes() const;

    // One draft call: the context features [n][features()] (n may be 0) of the tokens the target accepted
    // since the last committed call, and the block's token ids [L] (L >= 1). Writes the logits of block rows
    // 1..L-1 to `logits` ([L-1][vocab], caller-allocated) and, when `drafts` is not null, the greedy drafts of
    // those rows to it ([L-1]: each row's argmax, ties to the lower id; DFlash2: the candidate selector's walk
    // from block[0]). With `commit` the context rows' keys and values are
    // appended to the cache (position += n); without, the cache is left as it was. Everything that can fail
    // (arguments, cache growth, scratch) happens before the cache is touched.
    void forward(DFlashCache& cache, const float* features, int64_t n, const int64_t* block, int64_t L, bool commit,
                 float* logits, int64_t* drafts = nullptr);

private:
    struct Conv {                                            // DFlash2: one grouped dynamic causal convolution
        WMat projection;                                     // kernel_projection [2*K*(H/G)][H]
        std::vector<float> base;                             // base_kernel [2][K][H]
    };
    struct Layer {
        WMat q, k, v, o, gate, up, down;
        std::vector<float> input_norm, post_norm, q_norm, k_norm;
        std::vector<float> q_bias, k_bias, v_bias, o_bias;   // empty without attention_bias
        Conv attn_conv, mlp_conv;                            // DFlash2 only
    };
    void reserve(int64_t n, int64_t L);
    // DFlash2: the dynamic factors of the block rows h [L][H] into dyn_, then h = conv_0(h) in place
    void conv_first(ThreadPool& pool, const Conv& c, float* h, int64_t L);
    // DFlash2: x += conv_1(y) over the L block rows, with the factors conv_first left in dyn_
    void conv_second(const Conv& c, const float* y, int64_t L, float* x);
    // drafts of the L-1 rows hn [L-1][H] (final norm) with their logits [L-1][vocab]
    void select(ThreadPool& pool, const float* hn, const float* logits, int64_t rows, int64_t first,
                int64_t* drafts);
    // Y = X W^T (+ bias) over M rows in pieces of at most the target's prefill_chunk rows (bounded scratch)
    void project(ThreadPool& pool, const float* X, int64_t M, int64_t ldx, const WMat& W,
                 const std::vector<float>& bias, float* Y, int64_t ldy, bool accumulate);

    DFlashDims d_;
    Engine& target_;
    WMat fc_;
    std::vector<float> hidden_norm_, final_norm_;
    std::vector<Layer> layers_;
    WMat predecessor_, successor_, selector_proj_;          // DFlash2's candidate selector
    std::vector<float> inv_freq_;
    cpu::Workspace ws_;
    int64_t chunk_;
    FBuf ctx_, kvin_, x_, xn_, q_, k_, v_, o_, mlp_;
    FBuf dyn_, sub_;                                         // DFlash2: conv factors [L][2KG'], a sublayer's output
    FBuf proj_, rows_;                                       // selector: hidden projections, codebook rows
    std::vector<int64_t> cand_;                              // selector: [L-1][k] candidates, best first
    std::vector<float> cand_logit_;
};

}  // namespace qwenmetal

// A DFlash block draft (docs/speculative.md, "DFlash drafts") run on the cpu engine: a small stack of dense
// Qwen3 decoder layers that proposes a block of tokens in one forward pass over the target's layer features,
// computed as python/qwenmetal/dflash.py's DFlashReference.forward + logits (the float32 ground truth):
//
//   ctx = hidden_norm(fc(features))                 the n new context rows [n, H] (no per-layer norm)
//   x   = embed(block) * input_embedding_scale      the block [L, H]: the TARGET's embedding rows
//   for each layer:
//       h = input_layernorm(x)
//       q = q_norm(q_proj(h)) per head, RoPE at p+n..p+n+L-1            (block rows only)
//       k = k_norm(k_proj([ctx; h])), v = v_proj([ctx; h]), RoPE at p..p+n+L-1
//       x += o_proj(softmax(q K^T / sqrt(hd)) V)    K, V = [cached context | new context | block]: no causal
//                                                   mask (a sliding layer: causal within its window), GQA
//       x += down(silu(gate(h')) * up(h')), h' = post_attention_layernorm(x)
//   logits = lm_head(norm(x[1..L-1])) * output_multiplier (soft-capped when the config says so): the TARGET's
//   lm_head, in place in its own format
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
    int64_t features() const { return n_target_layers * hidden; }
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
    // attention_bias, "layers.{i}.self_attn.{q,k,v,o}_proj.bias". `target`: the engine whose embedding,
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
    // 1..L-1 to `logits` ([L-1][vocab], caller-allocated). With `commit` the context rows' keys and values are
    // appended to the cache (position += n); without, the cache is left as it was. Everything that can fail
    // (arguments, cache growth, scratch) happens before the cache is touched.
    void forward(DFlashCache& cache, const float* features, int64_t n, const int64_t* block, int64_t L, bool commit,
                 float* logits);

private:
    struct Layer {
        WMat q, k, v, o, gate, up, down;
        std::vector<float> input_norm, post_norm, q_norm, k_norm;
        std::vector<float> q_bias, k_bias, v_bias, o_bias;   // empty without attention_bias
    };
    void reserve(int64_t n, int64_t L);
    // Y = X W^T (+ bias) over M rows in pieces of at most the target's prefill_chunk rows (bounded scratch)
    void project(ThreadPool& pool, const float* X, int64_t M, int64_t ldx, const WMat& W,
                 const std::vector<float>& bias, float* Y, int64_t ldy, bool accumulate);

    DFlashDims d_;
    Engine& target_;
    WMat fc_;
    std::vector<float> hidden_norm_, final_norm_;
    std::vector<Layer> layers_;
    std::vector<float> inv_freq_;
    cpu::Workspace ws_;
    int64_t chunk_;
    FBuf ctx_, kvin_, x_, xn_, q_, k_, v_, o_, mlp_;
};

}  // namespace qwenmetal

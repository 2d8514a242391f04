// A DFlash block draft (docs/speculative.md, "DFlash drafts") on the Metal graph: the float32 computation of
// python/qwenmetal/dflash.py's DFlashReference.forward + logits (and of the cpu engine's, cpu/dflash.h), over
// the device interface (gpu/device.h), so it runs on MetalDevice and SimDevice alike:
//
//   ctx = hidden_norm(fc(features))                 the n new context rows [n, H] (the target's layer outputs)
//   x   = embed(block)                              the block [L, H]: the TARGET's embedding rows
//   for each layer:
//       h = input_layernorm(x)                      kvin = [ctx; h] [n + L, H]
//       q = q_proj(h) (block rows), [k | v] = [k_proj | v_proj](kvin) (all rows)      the prefill GEMMs
//       attn_prepare: q/k norm, RoPE at p.. (rows 0..n+L-1), the n + L K/V rows written at p.. of the
//           draft's cache (the block's past `position`: scratch, overwritten by the next call)
//       x += o_proj(attention_prefill(q) over keys 0..p+n+L-1)   no causal mask (a sliding layer: causal
//                                                                within its window)
//       x += down(swiglu([gate | up](post_attention_layernorm(x))))
//   logits = lm_head(norm(x[1..L-1]))                the TARGET's lm_head, f32 [L - 1, V]
//   (output_multiplier and the soft cap, when the config has them, are applied by the host to the read-back
//   logits, exactly as the reference computes them)
//
// p = the cache's position (context rows committed). A call is ONE command buffer -- the fc over the new
// context rows, every layer, the final norm and the lm_head of the block's rows -- unless the watchdog budget
// (GpuOptions::command_buffer_seconds of the target, gpu/cost.h) cuts it: the encoder then commits command
// buffers back to back with no host wait between them (docs/metal.md, "The DFlash draft graph"). More than
// `context_rows()` new context rows (a long prompt's first round) run as context-only passes of that many rows
// first (fc, hidden_norm and each layer's [k | v] + attn_prepare), in the same encoder, so the scratch stays
// bounded.
//
// The draft's weights are bound in place (bf16, or MLX affine 2..8-bit, as the target's GEMMs take them:
// WeightBinder); [k_proj | v_proj] and [gate_proj | up_proj] are stacked once at load. The target (a GpuEngine:
// its device, embedding, lm_head, activation type and KV element type) must outlive the draft; a call holds
// the engine's lock (GpuEngine::exclusive), so the draft and the target never run at once.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/weights.h"
#include "gpu/model.h"

namespace qwenmetal::gpu {

// The draft's dimensions, from its config.json (python/qwenmetal/dflash.py, DFlashConfig)
struct DFlashShape {
    uint32_t hidden = 0, layers = 0, inter = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, vocab = 0;
    uint32_t n_target_layers = 0;        // len(target_layer_ids): features are [n, n_target_layers * hidden]
    float eps = 1e-6f;
    double rope_theta = 10000.0;
    std::vector<uint32_t> window;        // per layer: 0 full attention, else the sliding window
    float output_multiplier = 1.f, softcap = 0.f;   // softcap 0: none
    uint32_t features() const { return n_target_layers * hidden; }
    uint32_t kv_dim() const { return n_kv_heads * head_dim; }
    uint32_t q_dim() const { return n_heads * head_dim; }
};

// The draft's context cache on the device: per layer K and V [n_kv_heads, capacity, head_dim] (the target's KV
// element type), post-RoPE, rows 0..position-1 valid; rows past `position` are a call's scratch (the block's
// keys and values). Capacity grows by need in multiples of the target's kv_block.
class GpuDFlashCache {
  public:
    // dev: the target's device, held (the cache's buffers are its allocations)
    GpuDFlashCache(std::shared_ptr<Device> dev, uint32_t layers, uint32_t n_kv_heads, uint32_t head_dim, bool kv_f32,
                   uint32_t block);
    GpuDFlashCache(const GpuDFlashCache& o);   // deep copy of the valid rows (device idle)
    GpuDFlashCache& operator=(const GpuDFlashCache&) = delete;
    int64_t position = 0;
    uint32_t capacity() const { return capacity_; }
    uint32_t layers() const { return uint32_t(kv.size()); }
    uint32_t kv_dim() const { return n_kv_ * hd_; }
    bool kv_f32() const { return kv_f32_; }
    const Device* device() const { return dev_.get(); }
    uint64_t nbytes() const { return 2 * kv.size() * uint64_t(position) * n_kv_ * hd_ * (kv_f32_ ? 4 : 2); }
    // room for `rows` rows, the valid ones kept (allocates before anything changes: strong guarantee)
    void reserve(int64_t rows);
    void reset() { position = 0; }
    std::vector<ops::KVCache> kv;              // per layer

  private:
    std::shared_ptr<Device> dev_;
    uint32_t n_kv_, hd_, block_, capacity_ = 0;
    bool kv_f32_;
};

class GpuDFlash {
  public:
    // `w`: the draft's tensors by DFlashDraft name ("fc", "hidden_norm", "norm", "layers.{i}.input_layernorm",
    // ".post_attention_layernorm", ".self_attn.{q,k,v,o}_proj", ".self_attn.{q,k}_norm", ".mlp.{gate,up,down}_proj").
    // std::invalid_argument for a shape that does not fit the target or the kernels.
    GpuDFlash(GpuEngine& target, const DFlashShape& shape, const WeightTable& w);
    GpuDFlash(const GpuDFlash&) = delete;
    GpuDFlash& operator=(const GpuDFlash&) = delete;
    ~GpuDFlash();

    const DFlashShape& shape() const { return s_; }
    std::unique_ptr<GpuDFlashCache> new_cache() const;
    uint64_t weight_bytes() const { return weight_bytes_; }   // the draft's own weights as bound
    uint64_t copied_bytes() const { return copied_bytes_; }   // of which copied at load (stacking)
    // context rows of one pass (a call with more new context rows runs context-only passes first)
    uint32_t context_rows() const { return ctx_rows_; }

    // One draft call: the context features [n][features()] f32 (n >= 0) of the tokens the target accepted since
    // the last committed call, and the block's token ids [L] (L >= 1). Writes the logits of block rows 1..L-1
    // to `logits` ([L-1][vocab], caller-allocated). With `commit` the context rows' keys and values join the
    // cache (position += n); without, the cache is left as it was. All-or-nothing: arguments, cache growth and
    // scratch are checked / allocated before anything runs, and the valid rows are only ever appended to.
    void forward(GpuDFlashCache& cache, const float* features, int64_t n, const int64_t* block, int64_t L,
                 bool commit, float* logits);
    // Encode, commit and wait one draft call of n context rows and a block of L at the cache's position (token
    // ids and features not written; the cache does not advance): what it cost. For encode-only costing.
    StepCost cost(GpuDFlashCache& cache, int64_t n, int64_t L);

  private:
    struct Layer {
        Buffer input_norm, post_norm, q_norm, k_norm;   // T [H], T [H], T [hd], T [hd]
        Matrix q, o;                                    // [nh hd, H], [H, nh hd]
        Stacked kv;                                     // [k | v] [2 nkv hd, H]
        Matrix gate_up, down;                           // [2 I, H], [H, I]
    };
    struct Scratch;
    void check_call(const GpuDFlashCache& cache, int64_t n, int64_t L) const;
    void ensure(uint32_t ctx_rows, uint32_t block_rows);
    // one pass into `e`: `rows` context rows at positions p.. (their features in the scratch) and, with_block,
    // the block of L rows after them (its ids in the scratch): K/V rows written, the block's logits
    void encode_context(Encoder& e, GpuDFlashCache& cache, int64_t p, uint32_t rows, bool with_block, uint32_t L);

    GpuEngine& target_;
    DFlashShape s_;
    Act act_;
    Matrix fc_;
    Buffer hidden_norm_, final_norm_;
    std::vector<Layer> layers_;
    std::unique_ptr<Scratch> sc_;
    uint32_t ctx_rows_ = 0;
    uint64_t weight_bytes_ = 0, copied_bytes_ = 0;
};

}  // namespace qwenmetal::gpu

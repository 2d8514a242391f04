// The C++ model shared by the C++ backends: its dimensions (mirrored from the Python ModelConfig,
// nothing hard-coded), the weights table (descriptors into the mmap'd checkpoint, or into buffers
// owned here when a dense checkpoint is quantized at load), the per-sequence State, and the Engine
// that runs the forward graph (forward.cpp) on a thread pool.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/expert_cache.h"
#include "core/interrupt.h"
#include "core/row_inputs.h"
#include "core/state_layout.h"
#include "cpu/tensor.h"
#include "core/threadpool.h"
#include "cpu/quant.h"

namespace qwenmetal {

// One canonical tensor as handed over by Python (see python/qwenmetal/cpu_backend.py).
struct TensorDesc {
    int bits = 0;                       // 0 dense, 4 or 8 quantized
    DType dtype = DType::F32;           // dense element type
    DType sdtype = DType::BF16;         // scales/biases (BF16 or F32)
    int group_size = 0;
    std::vector<int64_t> shape;         // logical [..., rows, cols]
    const void* data = nullptr;
    const void* scales = nullptr;
    const void* biases = nullptr;
    size_t stride = 0, sstride = 0;     // bytes between matrices along a leading (expert) axis
};

// The [rows, cols] matrix a descriptor holds (its first matrix along a leading axis), read in place.
inline WMat wmat_of(const TensorDesc& d, int64_t rows, int64_t cols) {
    WMat m;
    m.bits = d.bits;
    m.dtype = d.dtype;
    m.sdtype = d.sdtype;
    m.group_size = d.group_size;
    m.rows = rows;
    m.cols = cols;
    m.data = d.data;
    m.scales = d.scales;
    m.biases = d.biases;
    return m;
}

// the most rows of one speculative call (Engine::forward) or one batched step (Engine::forward_batch)
constexpr int64_t kMaxSpeculativeRows = 32;

// the most decoder layers one call returns the outputs of (LayerFeatures; a DFlash draft reads a few)
constexpr int64_t kMaxFeatureLayers = 8;

// The outputs of chosen decoder layers for every row a call runs (a DFlash draft's context features): the
// residual stream after layer layers[j] (after its MoE/MLP residual add, before the final norm), copied
// while the forward runs into out[row][j * hidden ..] ([n][layers.size() * hidden], float32,
// caller-allocated). `layers`: 1..kMaxFeatureLayers distinct indices of decoder layers, in any order.
struct LayerFeatures {
    std::vector<int64_t> layers;
    float* out = nullptr;
};

struct Options {
    int threads = 0;                    // 0: physical cores
    bool kv_f32 = false;                // KV cache element type: float32, else bf16
    int64_t prefill_chunk = 512;
    int quantize = 0;                   // 0, 4 or 8: quantize dense linears at load (group 64)
    int act_planes = 0;                 // activations: 0 "float", 1 "int8", 2 "int16" (docs/cpu.md)
};

// Routed experts streamed from the checkpoint files instead of read through the mapping (docs/cpu.md,
// "Streaming experts"): the files, each MoE layer's expert parts (contract order: gate, up, down, each
// weight | scales | biases, or just the matrix when dense), the cache's options, and the descriptors of
// the three stacks per layer (format and shape only: their data pointers are ignored).
struct StreamSpec {
    std::vector<std::string> files;
    std::map<int, std::vector<ExpertPart>> layers;
    ExpertCacheOptions cache;
    std::map<std::string, TensorDesc> stacks;    // "layers.{i}.mlp.switch_mlp.{gate,up,down}_proj"
};

struct AttnLayer {
    WMat q, k, v, o;
    std::vector<float> q_norm, k_norm;
};
struct GdnLayer {
    WMat qkv, z, b, a, out;
    std::vector<float> conv_t;          // [K][conv_dim] (transposed taps)
    std::vector<float> dt_bias, A_neg_exp, norm;   // A_neg_exp = -exp(A_log)
};
struct MoeLayer {
    WMat router, shared_gate_proj, shared_up_proj, shared_down_proj, shared_expert_gate;
    WStack gate, up, down;
    bool has_shared = false;
};
struct MlpLayer {
    WMat gate, up, down;
};
struct Layer {
    bool attention = false, moe = false;
    std::vector<float> input_norm, post_norm;
    AttnLayer attn;
    GdnLayer gdn;
    MoeLayer moe_w;
    MlpLayer mlp;
};

// One sequence's decode state. KV rows are [capacity][nkv*hd] per attention layer (bf16 or fp32),
// conv state [K-1][conv_dim] fp32 and recurrent state [nv][dv][dk] fp32 per GDN layer.
class State {
public:
    State(const Config& c, bool kv_f32);
    State(const State& o);                 // deep copy (capacity trimmed to the position)
    State& operator=(const State&) = delete;

    int64_t position = 0;
    // the next token's RoPE position minus its index: nonzero after an image (interleaved M-RoPE), and on an MTP
    // head's layer caches, whose entries skip positions (docs/speculative.md "n-layer heads"); a call's rows
    // without explicit positions (RowInputs) rotate at index + rope_delta, the cache row is the index
    int64_t rope_delta = 0;
    int64_t capacity() const { return capacity_; }
    bool kv_f32() const { return kv_f32_; }
    // bytes as stored for the tokens held (the KV cache counted up to `position`)
    size_t nbytes() const;
    size_t allocated_bytes() const;
    // make room for `tokens` KV rows; all allocation happens here, before any compute (throws
    // std::bad_alloc with the state unchanged)
    void reserve(int64_t tokens);
    void reset();

    int64_t n_attention() const { return n_attn_; }
    int64_t n_gdn() const { return n_gdn_; }
    int64_t kv_row_bytes() const { return kv_row_bytes_; }
    int64_t conv_floats() const { return conv_floats_; }
    int64_t ssm_floats() const { return ssm_floats_; }
    void* k(size_t attn_i) const { return kv_[2 * attn_i].get(); }
    void* v(size_t attn_i) const { return kv_[2 * attn_i + 1].get(); }
    float* conv(size_t gdn_i) const { return conv_[gdn_i].get(); }
    float* ssm(size_t gdn_i) const { return ssm_[gdn_i].get(); }
    // tokens of the chain of speculative calls that `Engine::rewind` can go back within (0: none)
    int64_t rewindable() const { return rewind_.n; }

private:
    // What a chain of speculative calls of n tokens keeps so that Engine::rewind can land on the state
    // after any first `keep` of them without running the weights again. The KV cache needs nothing (rolling
    // the position back truncates it); a GDN layer's conv and recurrent states cannot be truncated, so
    // per GDN layer: both states as they were before the call, the n raw conv inputs (the new conv
    // state is a window of [old state; inputs]) and the n prepared recurrence inputs, from which the
    // kept steps are re-applied with the decode kernel (docs/speculative.md has the memory cost).
    struct Rewind {
        int64_t n = 0, pos0 = 0;        // tokens of the call (0: nothing to rewind), position before it
        int64_t cap = 0;                // tokens the per-token buffers hold
        std::vector<float> conv, ssm;   // [n_gdn][conv_floats], [n_gdn][ssm_floats]: before the call
        std::vector<float> raw, act;    // [n_gdn][cap][conv_dim]: conv inputs; q|k|v after conv, SiLU, l2-norm
        std::vector<float> beta, g;     // [n_gdn][cap][nv]
    };
    Rewind rewind_;

    struct Free {
        void operator()(void* p) const { std::free(p); }
    };
    using Buf = std::unique_ptr<uint8_t, Free>;
    static Buf alloc(size_t bytes);

    int64_t n_attn_ = 0, n_gdn_ = 0, kv_row_bytes_ = 0, conv_floats_ = 0, ssm_floats_ = 0;
    bool kv_f32_;
    int64_t capacity_ = 0;
    std::vector<std::unique_ptr<uint8_t, Free>> kv_;
    std::vector<std::unique_ptr<float, Free>> conv_, ssm_;
    friend class Engine;
};

class Engine {
public:
    // stream: null = every weight in `tensors`; else the routed experts are streamed through an
    // ExpertCache into slot memory the engine owns (the stacks named in stream->stacks are not read
    // from `tensors`)
    Engine(const Config& c, const std::map<std::string, TensorDesc>& tensors,
           const std::map<std::string, std::vector<float>>& small, const Options& opt,
           const StreamSpec* stream = nullptr);
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    const Config& config() const { return cfg_; }
    const Options& options() const { return opt_; }
    int threads() const { return pool_->size(); }
    std::unique_ptr<State> new_state() const { return std::make_unique<State>(cfg_, opt_.kv_f32); }

    // Run `ids` at state.position..; logits rows for the last token (want == 1), every token
    // (want == 2) or none (0) written to `logits` ([1 or n, vocab], caller-allocated).
    // Everything that can fail (argument checks, KV growth, scratch) happens before the state is
    // touched; after that only `poll` (called between chunks, core/interrupt.h) and, when streaming,
    // an expert read can throw, and then the state is restored to the call's start: a failed or
    // interrupted call leaves it unchanged.
    //
    // speculative (the verification of drafted tokens, drafting with a model; docs/speculative.md): every
    // row is computed as a one-token call computes it (the GEMV per row, the recurrent GDN step, decode
    // attention per row), so its logits and state are bit for bit those of n one-token calls; at most
    // kMaxSpeculativeRows and prefill_chunk tokens, logits for every row (want 2). Consecutive speculative calls form a chain
    // that `rewind` can go back within; any other call on the state ends it.
    //
    // hidden_out (optional): the final-normed hidden rows [1 or n, hidden] beside the logits (an MTP head's
    // input), or of every row [n, hidden] with hidden_all (then any `want`: a prompt's rows for the head). hidden_in: required by an MTP head engine (is_mtp_head()), else null: the main model's
    // final-normed hidden state [n, hidden] at the positions before `ids`, which the head's input layer
    // combines with the ids' embeddings; its hidden_out is then the head's own normed output.
    //
    // features (optional, not with hidden_out, not on an MTP head): every row's outputs of the listed
    // layers (LayerFeatures), in any call (prefill across chunks, speculative); a speculative row's are bit
    // for bit those of a one-token call. A bad list throws before anything is touched.
    void forward(State& s, const int64_t* ids, int64_t n, int want, float* logits, InterruptPoll poll = nullptr,
                 bool speculative = false, const float* hidden_in = nullptr, float* hidden_out = nullptr,
                 bool hidden_all = false, const LayerFeatures* features = nullptr, const RowInputs* rows = nullptr);
    // One decode step for each of B (1..32, at most prefill_chunk) distinct states: row i runs ids[i] on
    // *states[i] at its own position, sharing every weight read with the other rows (the MoE reads the rows'
    // union of experts once); logits [B, vocab]. Row i's logits and state are bit for bit those of a one-token
    // forward() on states[i] alone. All-or-nothing for every state; each state's speculative chain ends.
    void forward_batch(State* const* states, const int64_t* ids, int64_t B, float* logits);
    // built from tensors holding "fc", "pre_fc_norm_embedding" and "pre_fc_norm_hidden": an MTP head,
    // x = fc([RMSNorm_e(embed(id)); RMSNorm_h(hidden)]) (embedding first) before its layers
    bool is_mtp_head() const { return mtp_; }
    // After a chain of speculative calls of n tokens in all: the state after its first `keep` (0..n)
    // tokens, bit for bit what one-token calls of just those leave (the position rolls back, the GDN
    // states are restored and the kept steps re-applied); ends the chain. Cannot fail once its
    // arguments are checked.
    void rewind(State& s, int64_t keep);
    // For a model that runs beside this one on its threads (a DFlash draft, cpu/dflash.h): the embedding and
    // the lm_head as this engine's forward reads them (in place, in their own format), and f(pool) run with
    // this engine's lock held, so the two never share the pool or run at once.
    const WMat& embedding() const { return embed_; }
    const WMat& lm_head_matrix() const { return lm_head_; }
    template <class F>
    void exclusive(F&& f) {
        std::lock_guard<std::mutex> lock(mu_);
        f(*pool_);
    }
    // bytes of weights the engine owns (quantized at load); the rest is the caller's mmap
    size_t owned_weight_bytes() const { return owned_bytes_; }
    size_t weight_bytes() const;
    // the expert cache when streaming, else null
    const ExpertCache* expert_cache() const { return cache_.get(); }
    // the cache's statistics (zero when not streaming) and the tokens run through forward() since the
    // last reset_expert_stats(); both wait for a running forward (they share its lock)
    ExpertCacheStats expert_stats(int64_t* tokens);
    void reset_expert_stats();

private:
    void check_state(const State& s) const;
    void reserve_scratch(int64_t L, int64_t T_end, bool speculative);
    // batch (forward_batch): row i is the one-token call on *batch[i] (L rows, `s` unused), else L tokens on s
    // features: the call's, with `feat_out` at this chunk's first row
    void forward_chunk(State& s, const int64_t* ids, int64_t L, bool logits_all, bool logits_last, float* logits,
                       bool speculative, const float* hidden_in, float* hidden_out, bool hidden_all,
                       State* const* batch = nullptr, const LayerFeatures* features = nullptr,
                       float* feat_out = nullptr, const RowInputs* rows = nullptr, int64_t row0 = 0);
    void check_features(const LayerFeatures& f) const;
    void reserve_rewind(State& s, int64_t n) const;
    void lm_head(const float* x, int64_t rows, float* out);
    WMat make_linear(const std::map<std::string, TensorDesc>& t, const std::string& name, int64_t rows,
                     int64_t cols, bool router);
    WStack make_stack(const std::map<std::string, TensorDesc>& t, const std::string& name, int64_t n, int64_t rows,
                      int64_t cols);
    // a stack of `slots` matrices over slot memory for the streamed parts parts[first..]; the bases of
    // the parts go to `bases`
    WStack make_slot_stack(const TensorDesc& d, const std::string& name, const std::vector<ExpertPart>& parts,
                           size_t first, int64_t slots, int64_t rows, int64_t cols, std::vector<void*>& bases);
    WMat quantize_owned(const void* src, DType dt, int64_t rows, int64_t cols, int bits);

    Config cfg_;
    Options opt_;
    std::unique_ptr<ThreadPool> pool_;
    cpu::Workspace ws_;
    std::mutex mu_;                      // one forward at a time per engine (scratch is shared)
    WMat embed_, lm_head_;
    std::vector<float> final_norm_;
    bool mtp_ = false;                   // an MTP head: fc_ and its two input norms
    WMat fc_;
    std::vector<float> fc_norm_e_, fc_norm_h_;
    std::vector<Layer> layers_;
    std::vector<int64_t> attn_index_, gdn_index_;   // layer -> index among attention / GDN layers
    std::vector<float> inv_freq_;
    std::vector<std::unique_ptr<uint8_t[]>> owned_;
    size_t owned_bytes_ = 0;
    struct FreeAligned {
        void operator()(void* p) const { std::free(p); }
    };
    std::vector<std::unique_ptr<uint8_t, FreeAligned>> slot_mem_;   // streamed experts' slots (64-aligned)
    std::unique_ptr<ExpertCache> cache_;
    int64_t tokens_ = 0;
    // activations of one chunk
    FBuf x_, xn_, buf_a_, buf_b_, buf_c_, shared_;
    // the GDN conv and recurrent states at the start of an interruptible multi-chunk call (the KV
    // cache is append-only: rolling the position back undoes it)
    std::vector<float> saved_;
};

}  // namespace qwenmetal

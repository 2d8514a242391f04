// The Metal backend's model, state and decode graph, over the device interface (gpu/device.h): the
// same code runs on MetalDevice (Apple) and SimDevice (the simulator, or encode-only costing).
//
//   GpuModel   weights on the device: one buffer per checkpoint mapping (wrapped without a copy),
//              tensors bound by offset; stacked projections built at load; small tensors converted
//   GpuState   one sequence: KV cache [n_kv, capacity, head_dim] per attention layer (bf16, or f32 for
//              exact tests), conv [K-1, conv_dim] and recurrent [nv, dv, dk] f32 per GDN layer
//   GpuEngine  scratch (one named buffer per logical tensor), the decode graph (forward.cpp), the
//              pipelined decode loop (one command buffer per token, two in flight), or in streaming
//              mode the per-layer command buffers around the expert cache's loads
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/expert_cache.h"
#include "core/interrupt.h"
#include "core/row_inputs.h"
#include "core/state_layout.h"
#include "core/weights.h"
#include "gpu/device.h"
#include "gpu/encoder.h"
#include "gpu/ops/attention.h"
#include "gpu/ops/gemm.h"
#include "gpu/ops/gdn.h"
#include "gpu/ops/moe.h"
#include "gpu/ops/quant.h"
#include "gpu/ops/sample.h"

namespace qwenmetal::gpu {

struct GpuOptions {
    Act act = Act::BF16;              // activation type of every kernel
    bool kv_f32 = false;              // KV cache element type
    ops::AttnPolicy attn;             // decode attention routes
    uint32_t kv_block = 256;          // KV capacity grows in multiples of this
    // prefill: rows per chunk (scratch is sized for it). The default is the modelled-cost optimum on the
    // real config (docs/metal.md, "The prefill graph")
    uint32_t prefill_chunk = kDefaultPrefillChunk;
    // modelled GPU time (gpu/cost.h, the slowest supported GPU) each prefill / verification command buffer
    // is cut to: a chunk runs as several command buffers committed back to back, and attention over a long
    // context in query blocks, so that none comes near macOS's GPU watchdog (0: one command buffer per chunk)
    double command_buffer_seconds = kCommandBufferTargetSeconds;
    bool gemm_route_auto = true;                       // the GEMM route of the device (ops::gemm_route)
    ops::GemmRoute gemm_route = ops::GemmRoute::Simdgroup;   // ... or this one when not auto
    ops::GdnRoute gdn_route = ops::GdnRoute::Auto;     // GDN prefill: by length from the cost model, or forced
    static constexpr uint32_t kDefaultPrefillChunk = 4096;
};

// Streaming mode (docs/metal.md, "Streaming mode"): the routed experts of every MoE layer are not bound
// from the mapping but read from their files by an ExpertCache into slot stacks (device buffers) when the
// routing asks for them. files / layers: as ExpertCache takes them (contract: core/expert_cache.h).
struct ExpertStreaming {
    std::vector<std::string> files;
    std::map<int, std::vector<ExpertPart>> layers;   // MoE layer index -> its parts (gate, up, down order)
    ExpertCacheOptions cache;
};

// A projection whose output rows are the concatenation of several checkpoint tensors (GDN
// [qkv | z | b | a], attention [q+gate | k | v], shared expert [gate | up], [router | shared gate]).
// Built at load as one Matrix when the parts share format, group size and scale type (rows are
// concatenated: exact, scales are per row); otherwise one Matrix per part, written to consecutive
// row ranges of the output (more dispatches in the same dependency level).
struct Stacked {
    std::vector<Matrix> parts;
    uint32_t rows = 0;
};

struct GpuLayer {
    bool attention = false, moe = false;
    uint32_t state_index = 0;                    // among the attention layers (KV cache) or the GDN layers
    Buffer input_norm, post_norm;                // T [H]
    // full attention
    Stacked attn_in;                             // [q_rows + 2 kvd, H]
    Matrix o_proj;                               // [H, nh*hd]
    Buffer q_norm, k_norm;                       // T [hd]
    // Gated DeltaNet
    Stacked gdn_in;                              // [conv_dim + value_dim + 2 nv, H]
    Matrix out_proj;                             // [H, value_dim]
    Buffer conv_w, A_log, dt_bias;               // f32 [conv_dim, K], [nv], [nv]
    Buffer gdn_norm;                             // T [dv]
    // sparse MoE
    Stacked router;                              // [E (+1 shared gate), H], f32 logits
    Matrix gate, up, down;                       // stacks [E, I, H], [E, I, H], [E, H, I]; streaming:
                                                 // the slot stacks [S, I, H], [S, I, H], [S, H, I]
    bool has_shared = false;
    Matrix shared_gate_up;                       // [2 Is, H]
    Matrix shared_down;                          // [H, Is]
    // dense MLP
    Matrix mlp_gate_up, mlp_down;                // [2 I, H], [H, I]
};

// Binds the tensors of a weights table as device matrices and vectors: each mapping one device buffer wrapping
// its memory (a tensor is a view of it by offset), or with `per_tensor` (streaming: no buffer may cover the routed
// experts' pages) each tensor a wrap of its own pages; a tensor whose offset is not 16-byte aligned, a stacked
// projection and float16 scales are copied once. The target model's weights (GpuModel) and a DFlash draft's
// (GpuDFlash) are bound by it. weight_bytes / copied_bytes: the bytes bound so far, and of them copied.
class WeightBinder {
  public:
    // one checkpoint file wrapped as a device buffer, for views of at most max_view bytes
    struct WrappedFile {
        const void* base;
        uint64_t size, max_view;
        Buffer buffer;
    };
    // `reuse`: files another binder on the same device wrapped; a mapping of the same (base, size) wrapped for
    // views as large as this table's is taken from there instead of being wrapped again (an MTP head over its
    // main model's files: each file is one device buffer, not two)
    WeightBinder(Device& dev, const WeightTable& w, Act act, bool per_tensor = false,
                 const std::vector<WrappedFile>* reuse = nullptr);
    // the files this binder wrapped (empty with per_tensor)
    const std::vector<WrappedFile>& files() const { return files_; }
    const WeightTable& table() const { return w_; }
    Buffer span(const Span& s, const std::string& what);
    Matrix matrix(const std::string& name);
    // the rows of several tensors concatenated: one matrix when they share format, group size and scale type
    Stacked stacked(const std::vector<std::string>& names);
    // a dense vector of `expect` values as the activation type (f32: float), converted once
    Buffer small(const std::string& name, bool f32, int64_t expect);
    Buffer owned(uint64_t bytes, const std::string& label);
    Buffer gathered(const Span& s, uint64_t stride, uint64_t count, uint64_t matrix_bytes, const std::string& what);
    uint64_t weight_bytes = 0, copied_bytes = 0;

  private:
    Device& dev_;
    const WeightTable& w_;
    Act act_;
    std::vector<Buffer> maps_;       // one per mapping (empty with per_tensor: see span())
    std::vector<WrappedFile> files_; // what each of maps_ wraps
};

class GpuModel {
  public:
    // `stream`: streaming mode (the routed experts become slot stacks filled by an ExpertCache). `share`: a model
    // on the same device whose wrapped file mappings this one reuses where the mapping is the same (base, size)
    // and was wrapped for views as large as this one's (an MTP head over its main model's files: each file is
    // one device buffer, not two)
    GpuModel(std::shared_ptr<Device> dev, const Config& c, const WeightTable& w, const GpuOptions& opt,
             const std::optional<ExpertStreaming>& stream = std::nullopt, const GpuModel* share = nullptr);
    Device& device() const { return *dev_; }
    const std::shared_ptr<Device>& device_ptr() const { return dev_; }
    const Config& config() const { return cfg_; }
    const GpuOptions& options() const { return opt_; }
    uint64_t weight_bytes() const { return weight_bytes_; }       // bytes of all weights as bound
    uint64_t copied_bytes() const { return copied_bytes_; }       // of which copied at load (stacking, alignment)
    // streaming mode: the cache that fills the slot stacks (null when every expert is resident)
    ExpertCache* experts() const { return experts_.get(); }
    uint64_t slot_bytes() const { return slot_bytes_; }           // device bytes of the slot stacks

    Matrix embed, lm_head;
    Buffer final_norm;                                            // T [H]
    std::vector<GpuLayer> layers;
    // An MTP head (a table holding "fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden"; docs/metal.md, "The MTP
    // head"): its input is fc([rmsnorm(embed(t), fc_norm_e); rmsnorm(h, fc_norm_h)]), its layers full attention
    bool mtp = false;
    Matrix fc;                                                    // [H, 2H]
    Buffer fc_norm_e, fc_norm_h;                                  // T [H]

  private:
    Matrix slot_stack(const WeightTable& w, const std::string& name, const ExpertPart* parts, uint32_t slots,
                      std::vector<void*>& bases);

    std::shared_ptr<Device> dev_;
    Config cfg_;
    GpuOptions opt_;
    std::vector<WeightBinder::WrappedFile> files_;   // what the binder wrapped (resident mode; GpuModel `share`)
    std::unique_ptr<ExpertCache> experts_;
    uint64_t weight_bytes_ = 0, copied_bytes_ = 0, slot_bytes_ = 0;
};

// the most tokens of one verification call, and of a chain of them (GpuEngine::verify)
constexpr uint32_t kMaxVerifyRows = 16;
// the most drafts of one MTP round (GpuEngine::mtp_draft), and the most pairs it takes (a round's verified rows;
// a prompt's are fed 256 at a time)
constexpr uint32_t kMaxMtpDrafts = 16;
constexpr uint32_t kMaxMtpPairs = 256;
// the most decoder layers one call returns the outputs of (FeatureRequest; a DFlash draft reads 5 of 40)
constexpr size_t kMaxFeatureLayers = 8;
// the most bytes of target features a prefill chunk holds on the device: a call with features cuts its chunks
// to fit (GpuEngine::feature_rows)
constexpr uint64_t kFeatureBytes = uint64_t(256) << 20;

// Target features (a DFlash draft's context, docs/speculative.md "DFlash drafts"): the residual stream after
// the decoder layers `layers` (0-based; distinct, any order, 1..kMaxFeatureLayers of them; the output of layer
// i is HF's output_hidden_states[i + 1]) for every row a call feeds, into `out`: f32 [n, layers.size() *
// hidden], row r the concatenation of the layers' rows in the given order. In the bfloat build the rows as the
// graph holds them (bf16), widened to float.
struct FeatureRequest {
    std::vector<int64_t> layers;
    float* out = nullptr;
};

// the most states of one batched decode step (GpuEngine::decode_batch): it runs on the verification
// graph's scratch and union-read MoE kernels, which are sized for this many rows
constexpr uint32_t kMaxBatchRows = kMaxVerifyRows;

class GpuState {
  public:
    GpuState(const GpuModel& m);
    GpuState(const GpuState& o);                  // deep copy (device idle)
    GpuState& operator=(const GpuState&) = delete;

    int64_t position = 0;
    // the next token's RoPE position minus its index, its cache row: nonzero after an image (interleaved M-RoPE),
    // and on an MTP head's layer caches, whose entries skip positions (mtp.cpp sets it per chain step); rows
    // without explicit positions (RowInputs) rotate at index + rope_delta
    int64_t rope_delta = 0;
    const GpuModel& model() const { return m_; }
    uint32_t capacity() const { return capacity_; }
    bool kv_f32() const { return kv_f32_; }
    // make room for `tokens` KV rows (allocates before anything changes: strong guarantee)
    void reserve(int64_t tokens);
    void reset();
    uint64_t nbytes() const;                      // as stored for the tokens held
    uint64_t kv_row_bytes() const { return kv_head_row_bytes_ * n_kv_; }      // one token, all KV heads
    uint64_t kv_head_row_bytes() const { return kv_head_row_bytes_; }
    uint32_t kv_heads() const { return n_kv_; }

    std::vector<ops::KVCache> kv;                 // per attention layer
    // Per GDN layer one slab of each kind (conv [K-1, conv_dim] f32, recurrent [nv, dv, dk] f32 states), a ring
    // of slots() states: the current state is slot `cur`. A decode step or a prefill chunk reads it and writes
    // the next slot (cur + 1 mod slots: ping-pong with 2), so a step whose result is discarded (the extra
    // pipelined step after a stop token, a failed command buffer) leaves the state as it was; commit_step()
    // advances. A verification grows the ring to its chain's rows + 1 (take_rows).
    std::vector<Buffer> conv_slab, ssm_slab;      // [n_gdn]
    uint32_t cur = 0;
    size_t n_gdn() const { return conv_slab.size(); }
    uint32_t slots() const { return slots_; }
    uint32_t next_slot() const { return (cur + 1) % slots_; }
    Buffer conv_at(size_t i, uint32_t slot) const { return conv_slab[i].view(slot * conv_bytes_, conv_bytes_); }
    Buffer ssm_at(size_t i, uint32_t slot) const { return ssm_slab[i].view(slot * ssm_bytes_, ssm_bytes_); }
    Buffer conv_in(size_t i) const { return conv_at(i, cur); }
    Buffer conv_next(size_t i) const { return conv_at(i, next_slot()); }
    Buffer ssm_in(size_t i) const { return ssm_at(i, cur); }
    Buffer ssm_next(size_t i) const { return ssm_at(i, next_slot()); }
    // a decode step (1 token) or a prefill chunk (`rows` tokens) is now the state
    void commit_step(uint32_t rows = 1) { position += rows; cur = next_slot(); }

    // backup / restore of the recurrent parts (the KV rows a failed call wrote are past `position`)
    struct Saved {
        int64_t position;
        uint32_t cur;
        std::vector<std::vector<uint8_t>> conv, ssm;
    };
    Saved save() const;
    void restore(const Saved& s);

    // ---- the chain of verification calls (GpuEngine::verify; docs/speculative.md) ----
    // A GDN state cannot be truncated, so every verified row writes the state after it into a slot of the
    // ring of its own: the chain is the slot before its first row (chain_base_) and the `rewindable()` slots
    // after it, one per row; the last is the current state. rewind(keep) makes slot chain_base_ + keep current.
    // A chain holds at most kMaxVerifyRows rows, so a ring of kMaxVerifyRows + 1 slots never overwrites the
    // state before it. Memory: the longest chain's rows + 1 states (at least 2). A copy of the state has no
    // chain (and a ring of 2).
    int64_t rewindable() const { return chain_len_; }
    // The slots the next `n` rows write: (first + r) mod slots(), after the current one (the chain's last).
    // Grows the ring to the open chain's rows + n + 1 slots first when it is shorter (allocated before anything
    // changes, then the chain's states copied into the new slabs: strong guarantee). The state is unchanged.
    uint32_t take_rows(uint32_t n);
    // the n rows of a verification call ran into the slots take_rows gave: they join the chain (opened at this
    // position when none is open), the last becomes the current state, the position advances
    void chain_rows(uint32_t n);
    // the state after the chain's first `keep` (0..rewindable()) rows; ends the chain. Cannot fail.
    void rewind(int64_t keep);
    // any other call: the chain ends where it is (its last row's state stays current)
    void end_chain() { chain_len_ = 0; }
    uint64_t pool_bytes() const;                  // device bytes of the ring's slots past the ping-pong pair

  private:
    void grow(uint32_t slots);
    uint32_t slots_ = 2, chain_base_ = 0;
    int64_t chain_len_ = 0, chain_pos0_ = 0;
    uint64_t conv_bytes_ = 0, ssm_bytes_ = 0;     // one state of a GDN layer
    const GpuModel& m_;
    Device& dev_;
    bool kv_f32_;
    uint32_t capacity_ = 0, n_kv_ = 0, block_ = 256;
    uint64_t kv_head_row_bytes_ = 0;
};

// What a decode step or a prefill chunk of the graph costs as encoded (encode-only or executed);
// per_level: the bytes and flops of each dependency level (the prefill costing's roofline).
struct StepCost {
    uint64_t dispatches = 0, levels = 0, command_buffers = 0, host_waits = 0;
    uint64_t bytes_read = 0, bytes_written = 0, flops = 0;
    std::vector<LevelStats> per_level;
    std::vector<uint64_t> command_buffer_levels;   // the first level of each command buffer (into per_level)
};

// The StepCost of what `e` encoded, with the device's counters (command buffers, host waits) since its last
// reset_counters()
StepCost cost_of(const Encoder& e, const Counters& k);

// f(); after a DeviceError (every command buffer of the call has completed by then: the calls wait for
// what they committed before they throw) the device gets a new queue (Device::recover), then the error goes up
template <class F>
auto recovering(Device& d, F&& f) -> decltype(f()) {
    try {
        return f();
    } catch (const DeviceError&) {
        d.recover();
        throw;
    }
}

struct SamplingConfig {
    bool greedy = true;
    ops::SampleParams params;
    uint32_t vocab = 0;               // choose among logits [0, vocab) (the tokenizer's ids); 0: all
    // structured output: a token bitmask over the model's logits (ops::apply_token_mask; host memory of
    // mask_words = ceil(config vocab / 32) words, read by GpuEngine::decode, which takes it for one token only)
    const uint32_t* mask = nullptr;
    uint64_t mask_words = 0;
    // the logits the token is chosen among: [0, chosen_vocab(config vocab))
    uint32_t chosen_vocab(int64_t model_vocab) const {
        return vocab && vocab < model_vocab ? vocab : uint32_t(model_vocab);
    }
};

class GpuEngine {
  public:
    GpuEngine(std::shared_ptr<GpuModel> m);
    ~GpuEngine();
    const GpuModel& model() const { return *m_; }
    std::unique_ptr<GpuState> new_state() const { return std::make_unique<GpuState>(*m_); }
    // f() under the engine's lock: what else runs on this engine's device and weights (a DFlash draft over its
    // embedding and lm_head, gpu/dflash.h) runs one call at a time with the engine's own calls
    template <class F>
    auto exclusive(F&& f) -> decltype(f()) {
        std::lock_guard<std::mutex> lock(mu_);
        return f();
    }

    // Prefill `ids` (host token ids) in chunks of prefill_chunk rows, each cut into command buffers committed
    // back to back (GpuOptions::command_buffer_seconds) with no host read-back inside it; logits of the last token (want 1), of every token (want 2: chunks
    // of at most logits_rows() rows, so the logits scratch stays bounded) or none (0).
    // All-or-nothing: on an error the state is restored. `poll` (core/interrupt.h) is called between
    // chunks; when it throws, the state is restored and the exception rethrown.
    // `feats` (optional): the target features of every row (FeatureRequest), copied out of the residual stream
    // by copy_f32 dispatches that add no dependency level (docs/metal.md, "Target features"); a call with
    // features runs chunks of at most feature_rows() rows.
    // `hidden` (optional, not with `feats`): every row's final-normed hidden state, f32 [n, hidden] (an MTP head's
    // input: the prompt's pairs): the final RMSNorm of the chunk's rows (one more dispatch per chunk; a one-token
    // call and a streaming step take the lm_head's fused norm output, as verify does).
    // `rows` (optional): explicit RoPE positions / embedding rows (RowInputs); not with expert streaming.
    void forward(GpuState& s, const int64_t* ids, int64_t n, int want, float* logits, InterruptPoll poll = nullptr,
                 const FeatureRequest* feats = nullptr, float* hidden = nullptr, const RowInputs* rows = nullptr);
    uint32_t prefill_chunk() const { return chunk_; }
    // rows of a prefill chunk that returns the features of `layers` layers (kFeatureBytes of them at most)
    uint32_t feature_rows(size_t layers) const;
    // std::invalid_argument naming the problem unless `layers` is a valid FeatureRequest::layers of this model
    void check_feature_layers(const std::vector<int64_t>& layers) const;
    // allocate the scratch of a prefill chunk of `rows` rows now (the first prefill would): the working-set
    // plan measures it on an encode-only device
    void reserve_prefill(uint32_t rows);
    uint32_t logits_rows() const;                 // rows of a want-2 chunk
    ops::GemmRoute gemm_route() const { return gemm_route_; }
    // streaming mode: the expert cache's counters and the tokens run (decoded or prefilled) since the last
    // reset_expert_stats(); zeros when not streaming. Both wait for a running call (the engine's lock).
    ExpertCacheStats expert_stats(int64_t* tokens);
    void reset_expert_stats();

    // Pipelined decode: `first` is the next input token; generates up to `n` tokens sampled on the
    // GPU (argmax or the GPU sampler), one command buffer per token with the next one committed
    // before the previous is waited on; stops after a token in `stop_ids` (the extra in-flight step
    // is discarded: its state changes are undone). Returns the tokens generated. All-or-nothing:
    // `poll` is called between steps; on an error or when it throws, the state is restored.
    // With a token mask (sc.mask) n must be 1 (the host advances its grammar after every token), the mask
    // must have ceil(vocab / 32) words and allow some token among those chosen from; it is uploaded to the
    // device and applied to the step's logits before argmax / sample (std::invalid_argument otherwise, with
    // nothing changed).
    std::vector<int32_t> decode(GpuState& s, int32_t first, int64_t n, const SamplingConfig& sc,
                                const std::vector<int32_t>& stop_ids, bool pipelined = true,
                                InterruptPoll poll = nullptr);

    // Encode (without waiting) one decode step at s.position on a fresh command buffer; what it cost.
    // `feature_layers` (all three costings): with the features of these layers taken (FeatureRequest).
    StepCost encode_cost(GpuState& s, const std::vector<int64_t>& feature_layers = {});
    // Encode, commit and wait one prefill chunk of `rows` tokens at s.position (logits of the last row, or
    // of every row: the cost of verifying rows - 1 drafted tokens as one chunk), then advance the state:
    // what it cost. For encode-only costing (token ids are not written: 0s).
    StepCost prefill_cost(GpuState& s, uint32_t rows, bool all_logits = false,
                          const std::vector<int64_t>& feature_layers = {});
    // Encode, commit and wait one verification of `rows` tokens at s.position (verify's graph; the state does
    // not advance): what it cost. For encode-only costing.
    StepCost verify_cost(GpuState& s, uint32_t rows, const std::vector<int64_t>& feature_layers = {});

    // The verification of drafted tokens (docs/speculative.md): `ids` (1..kMaxVerifyRows) at s.position..
    // as one command buffer in which every row is computed as a decode step computes it -- the
    // projections, the router and the lm_head as qmv over the rows (each weight read once for all of
    // them, per row the decode kernel's arithmetic), attention, the GDN conv and recurrence and the MoE
    // block per row -- so the logits of every row ([n, vocab] into `logits`) and the state after any
    // prefix of the rows are bit for bit those of decode steps. `hidden` (optional): the final-normed
    // rows [n, hidden]. `feats` (optional, not with `hidden`): the target features of every row (FeatureRequest),
    // row r bit for bit what a one-token forward() returns for it. Consecutive calls form a chain
    // (GpuState::rewindable, at most kMaxVerifyRows tokens); any other call on the state ends it.
    // All-or-nothing. Resident experts only.
    void verify(GpuState& s, const int64_t* ids, int64_t n, float* logits, float* hidden = nullptr,
                const FeatureRequest* feats = nullptr);
    // After verify calls of n tokens in all: the state after the first `keep` (0..n) of them; ends the chain.
    void rewind(GpuState& s, int64_t keep);

    // One drafting round of an MTP head (model().mtp; docs/metal.md, "The MTP head") as one command buffer
    // (the encoder's time budget may cut it, as a verification's): the m >= 1 pairs (hidden[r] f32 [H], the
    // main model's final-normed row, ids[r] the token after it) run through layer 0 at cache rows (= RoPE
    // positions) s.position.., and are kept; then k (0..kMaxMtpDrafts; 0: the pairs only, no logits) greedy
    // drafts: draft 1 the argmax of
    // the last pair's logits among [0, vocab) (0: all), draft j + 1 from (the head's normed output of step j,
    // draft j) through layer j mod n at RoPE position s.position + m - 1 + j, each layer's draft entries after
    // its kept ones (layer 0: after the pairs; others: from row 0) and dropped at the end. Drafts into
    // `drafts` [k]; `logits` (optional): every step's f32 [k, vocab]. All-or-nothing; returns the command
    // buffers run.
    size_t mtp_draft(GpuState& s, const float* hidden, const int64_t* ids, int64_t m, int64_t k, uint32_t vocab,
                     int32_t* drafts, float* logits = nullptr);
    // Encode, commit and wait the round of m pairs and k drafts at s.position (mtp_draft's graph, no host data;
    // the state does not advance): what it cost. For encode-only costing.
    StepCost mtp_cost(GpuState& s, int64_t m, int64_t k);

    // One decode step of B (1..kMaxBatchRows) independent sequences as one command buffer: row r is token
    // ids[r] on states[r] at its own position (its KV cache, its GDN halves). The verification graph over
    // per-row states: every weight read once for all rows (the projections, router and lm_head as qmv over
    // the rows, the union-read MoE), attention and the GDN conv / step per row on its own state, so row r's
    // logits ([B, vocab] into `logits`) and state are bit for bit a one-token forward() on states[r] alone.
    // All-or-nothing: arguments (distinct states of this model, ids in the vocabulary, an executing device,
    // resident experts) and every allocation (KV growth, scratch) are checked / done before any state
    // changes; on success each state has advanced one token (any open verify chain ended).
    void decode_batch(const std::vector<GpuState*>& states, const int64_t* ids, int64_t B, float* logits);
    // Encode, commit and wait one batched decode step over `states` at their positions (decode_batch's
    // graph; no state advances): what it cost. For encode-only costing.
    StepCost batch_cost(const std::vector<GpuState*>& states);

    // Every call above that runs command buffers: when one fails (a GPU fault, the watchdog) the call
    // throws DeviceError naming the kernels it ran, leaves the state as it was, and gives the device a new
    // command queue first (Device::recover), so the next call runs.

  private:
    void forward_impl(GpuState& s, const int64_t* ids, int64_t n, int want, float* logits, InterruptPoll poll,
                      const FeatureRequest* feats, float* hidden, const RowInputs* rows = nullptr);
    // rows [rows, H] of an activation buffer widened into out (the host side, after the wait)
    void widen_rows(const Buffer& src, uint32_t rows, float* out) const;
    std::vector<int32_t> decode_impl(GpuState& s, int32_t first, int64_t n, const SamplingConfig& sc,
                                     const std::vector<int32_t>& stop_ids, bool pipelined, InterruptPoll poll);
    void verify_impl(GpuState& s, const int64_t* ids, int64_t n, float* logits, float* hidden,
                     const FeatureRequest* feats);
    StepCost encode_cost_impl(GpuState& s, const std::vector<int64_t>& layers);
    StepCost prefill_cost_impl(GpuState& s, uint32_t rows, bool all_logits, const std::vector<int64_t>& layers);
    StepCost verify_cost_impl(GpuState& s, uint32_t rows, const std::vector<int64_t>& layers);
    struct Scratch;
    // Where the graph copies the target features of a call: per decoder layer its block of `feat_` (-1: not
    // taken), each block f32 [rows, hidden] (the call's rows: 1, a chunk's or a verification's)
    struct Taps {
        std::vector<int32_t> slot;
        uint64_t block = 0;                      // bytes of one layer's block
    };
    // the taps of `layers` for calls of up to `rows` rows, feat_ grown to hold them (allocated before anything
    // changes); nullopt when no layers are asked for
    std::optional<Taps> taps_for(const std::vector<int64_t>& layers, uint32_t rows);
    // after layer li: x's `rows` rows into the layer's block (when it is taken)
    void tap(Encoder& e, const Taps* taps, size_t li, const Buffer& x, uint32_t rows);
    // the blocks' `rows` rows into out rows [rows, L * hidden] (the host side, after the wait)
    void gather(const Taps& taps, const std::vector<int64_t>& layers, uint32_t rows, float* out) const;
    struct Chunk;
    struct Verify;
    // one row of the verification / batched graph: the state it runs on (its KV cache), its position, and
    // per GDN layer the conv / recurrent buffers it reads and writes (a batched row), or (a verification row,
    // chained through its state) the ring slot it writes: the rows' GDN run as gdn_conv_rows / gdn_step_rows
    struct RowPlan {
        GpuState* st = nullptr;
        int64_t position = 0;
        std::vector<Buffer> conv_in, conv_out, ssm_in, ssm_out;
        int64_t slot = -1;
    };
    static std::vector<RowPlan> verify_plan(GpuState& s, uint32_t rows, uint32_t first);
    static std::vector<RowPlan> batch_plan(const std::vector<GpuState*>& states);
    void decode_batch_impl(const std::vector<GpuState*>& states, const int64_t* ids, int64_t B, float* logits);
    StepCost batch_cost_impl(const std::vector<GpuState*>& states);
    void check_batch(const std::vector<GpuState*>& states, int64_t B);
    void ensure_verify(uint32_t rows);
    void encode_rows(Encoder& e, const std::vector<RowPlan>& rows, bool hidden, const Taps* taps = nullptr);
    void encode_rows_layer(Encoder& e, const std::vector<RowPlan>& rows, size_t li);
    // hidden: the lm_head's fused final norm also writes its normed input (Scratch::xn)
    void encode_step(Encoder& e, GpuState& s, int64_t position, uint32_t in_slot, uint32_t out_slot,
                     const SamplingConfig* sc, const Taps* taps = nullptr, bool hidden = false);
    // RoPE at position + s.rope_delta (an MTP head's layers set it per chain step)
    void encode_layer(Encoder& e, GpuState& s, size_t li, int64_t position);
    void encode_mixer(Encoder& e, GpuState& s, size_t li, int64_t position);
    size_t mtp_draft_impl(GpuState& s, const float* hidden, const int64_t* ids, int64_t m, int64_t k, uint32_t vocab,
                          int32_t* drafts, float* logits);
    StepCost mtp_cost_impl(GpuState& s, int64_t m, int64_t k);
    // mtp_draft's checks and allocations (KV room, scratch), before anything changes
    void mtp_prepare(GpuState& s, int64_t m, int64_t k, bool logits);
    // the round: R pairs from mtp_.hin / mtp_.tok, then K drafts into mtp_.tok[R..] (and mtp_.lg when logits)
    void encode_mtp_round(Encoder& e, GpuState& s, uint32_t R, uint32_t K, uint32_t vocab, bool logits);
    // x rows = fc([rmsnorm(embed(tok[r]), fc_norm_e); rmsnorm(hid[r], fc_norm_h)]), r < rows <= kMaxVerifyRows
    // (an MTP head's input rows: tok u32 [rows], hid T [rows, H], x T [rows, H])
    void encode_mtp_input(Encoder& e, const Buffer& tok, const Buffer& hid, uint32_t rows, const Buffer& x);
    // an MTP head's scratch (mtp.cpp): hidden rows in, the token ring of a round, its logits
    struct MtpScratch {
        uint32_t rows = 0, steps = 0;
        Buffer hin;          // T [rows, H]    the pairs' hidden rows (host-written)
        Buffer tok;          // u32 [rows + steps]  the pairs' ids (host-written), then the drafts
        Buffer emb;          // T [kMaxVerifyRows, H]
        Buffer cat;          // T [kMaxVerifyRows, 2H]   per row [rmsnorm(embedding); rmsnorm(hidden)]
        Buffer h;            // T [H]          the head's normed output: the next step's hidden
        Buffer lg;           // f32 [steps, V] every step's logits (when asked for)
    };
    MtpScratch mtp_;

    void encode_mlp(Encoder& e, size_t li);
    void encode_head(Encoder& e, int64_t position, uint32_t out_slot, const SamplingConfig* sc, bool hidden = false);
    // streaming mode: one token as per-layer command buffers around the expert cache (forward.cpp)
    void stream_step(GpuState& s, int64_t position, uint32_t in_slot, uint32_t out_slot, bool logits,
                     const SamplingConfig* sc, const Taps* taps = nullptr, bool hidden = false);
    void stream_forward(GpuState& s, const int64_t* ids, int64_t n, int want, float* logits, InterruptPoll poll,
                        const FeatureRequest* feats, float* hidden);
    void ensure_chunk(uint32_t rows, bool all_logits);
    // hidden: the rows' final RMSNorm into Chunk::xn; skip_embed: the host wrote ch.x (a chunk with embedding
    // rows, RowInputs)
    void encode_chunk(Encoder& e, GpuState& s, int64_t p0, uint32_t rows, int want, const Taps* taps = nullptr,
                      bool hidden = false, bool skip_embed = false);
    void encode_layer_rows(Encoder& e, GpuState& s, size_t li, int64_t p0, uint32_t rows);

    std::shared_ptr<GpuModel> m_;
    std::unique_ptr<Scratch> sc_;
    std::unique_ptr<Chunk> ch_;
    std::unique_ptr<Verify> vf_;
    Buffer feat_;                                 // the target features of a call (Taps), grown on demand
    uint32_t chunk_ = 0;
    int64_t stream_tokens_ = 0;                   // streaming: tokens run since reset_expert_stats()
    ops::GemmRoute gemm_route_ = ops::GemmRoute::Simdgroup;
    std::mutex mu_;
};

}  // namespace qwenmetal::gpu

// The decode graph of the Metal backend: one token of the hybrid Gated DeltaNet / gated attention /
// MoE model (docs/model.md §4) as one command buffer, read top to bottom over named scratch buffers.
// Every call below is the host function of one kernel (src/gpu/ops/<family>.cpp); the encoder puts
// memory barriers where a dispatch reads what an earlier one of its level wrote.
//
//   x  = embed(tokens[in])                         the input token is read on the GPU
//   for each layer:
//       proj = W_in rmsnorm(x)                     stacked [q+gate | k | v] or [qkv | z | b | a]; the
//                                                  input norm is fused into the GEMV
//       mix  = attention(proj) | gdn(proj)          attention: q/k norm, RoPE and the K/V write fused into its
//                                                  first pass; gdn: the conv fused into the in-projection
//       x   += W_out mix                           the residual add is fused into the GEMV
//       router = W_r rmsnorm(x), xn = rmsnorm(x)   post-attention norm fused into the router GEMV
//       x   += moe(xn)                             top-k fused into gate/up; residual into down
//           | mlp(rmsnorm(x))                      (dense layers: norm, gate/up, down + residual)
//   logits = lm_head rmsnorm(x) (float)            the final norm fused into the GEMV
//   tokens[out] = argmax(logits) | sample(logits)  read by the next step, and by the host (4 bytes)
//
// Dependency levels per token: GDN layer 6 (in-proj + conv, step, out-proj, router, gate/up, down),
// attention layer 6 or 7 (in-proj, attention in 1 or 2 passes, out-proj, router, gate/up, down); embed,
// lm_head and argmax 4.
//
// The prefill graph (GpuEngine::forward): a chunk of M tokens at positions p0.. as one command buffer,
// the same blocks over [M, ...] rows (chunk scratch, struct Chunk), nothing read back inside it:
//
//   x  = embed(ids)                                the host wrote the chunk's ids into ch.ids first
//   for each layer:
//       xn   = rmsnorm(x)                          rows
//       proj = gemm(xn, W_in)                      stacked parts: one GEMM each into its columns
//       mix  = attn_prepare + attention_prefill    (K/V rows written once; causal over cache + chunk)
//            | gdn_conv + gdn_prefill              (GDN states: read the current half, write the other)
//       x   += gemm(mix, W_out)                    the residual add fused
//       xn = rmsnorm(x); router = gemm(xn, W_r)    f32 logits rounded to T
//       x   += moe(xn)                             top-k rows, counting sort, grouped GEMMs, combine
//            | gemm(gemm(xn, [gate|up], swiglu), down, residual)      (dense layers)
//   logits = lm_head rmsnorm(x[M-1]) (want 1) | lm_head rmsnorm(x) (want 2, every row)
//
// The host waits once per chunk, then flips the GDN halves (GpuState::commit_step(M)), polls for an
// interrupt and writes the next chunk's ids.
//
// Target features (FeatureRequest; decode step, prefill chunk, verification and streaming step alike): after
// each listed layer, copy_f32 copies the rows of x into that layer's block of feat_ (float). It reads x, which
// the layer's last dispatch wrote, and writes only feat_, so it opens the level that the next layer's first
// dispatch (or the lm_head) opens anyway by reading x: no dependency level is added (docs/metal.md).
#include <algorithm>
#include <cstring>
#include <optional>

#include "core/dtype.h"
#include "gpu/model.h"
#include "gpu/scratch.h"
#include "gpu/ops/moe.h"
#include "gpu/ops/norm.h"
#include "metal/moe.h"

namespace qwenmetal::gpu {

namespace {
constexpr uint32_t kSlots = 4;      // token ring: step i reads slot i % 4 and writes (i + 1) % 4

ops::AttnShape attn_shape(const Config& c) {
    return ops::AttnShape{uint32_t(c.n_heads), uint32_t(c.n_kv_heads), uint32_t(c.head_dim), uint32_t(c.rotary_dim),
                          c.attn_output_gate, float(c.rope_theta), c.eps};
}
ops::GdnShape gdn_shape(const Config& c) {
    return ops::GdnShape{uint32_t(c.nk), uint32_t(c.nv), uint32_t(c.dk), uint32_t(c.dv), uint32_t(c.conv_kernel)};
}

// y[b, :st.rows] = st x[b] for b < batch: one qmv per part, into consecutive column ranges of y's rows
// [batch, st.rows] (each part normalises its input itself when the RMSNorm is fused; only the first
// stores the normalised input and runs a conv epilogue)
void stacked_qmv(Encoder& e, Act t, const Stacked& st, const Buffer& x, const Buffer& y, bool f32_out,
                 const ops::QmvFusion& fuse, uint32_t batch = 1) {
    const uint64_t es = f32_out ? 4 : act_size(t);
    uint64_t row = 0;
    ops::QmvFusion f = fuse;
    for (const Matrix& m : st.parts) {
        ops::qmv(e, t, m, x, y.view(row * es), batch, f32_out, 0, st.rows, f);
        f.xn = nullptr;
        f.conv = nullptr;
        row += m.rows;
    }
}

// the widest per-token rows of the graph's scratch, over the layers
struct LayerWidths {
    uint32_t in_rows = 0;     // a stacked in-projection's rows
    uint32_t inter = 0;       // a routed or the shared expert's intermediate size
    uint32_t dense = 0;       // a dense MLP's intermediate size (0: no dense layer)
};
LayerWidths layer_widths(const std::vector<GpuLayer>& layers) {
    LayerWidths w;
    for (const GpuLayer& L : layers) {
        w.in_rows = std::max(w.in_rows, L.attention ? L.attn_in.rows : L.gdn_in.rows);
        if (L.moe) w.inter = std::max({w.inter, L.gate.rows, L.has_shared ? L.shared_down.cols : 0u});
        else w.dense = std::max(w.dense, L.mlp_down.cols);
    }
    return w;
}

ops::QmvFusion normed(const Buffer& w, float eps, const Buffer* xn = nullptr) {
    ops::QmvFusion f;
    f.norm_w = &w;
    f.eps = eps;
    f.xn = xn;
    return f;
}
ops::QmvFusion residual(const Buffer& r) {
    ops::QmvFusion f;
    f.residual = &r;
    return f;
}
}  // namespace


GpuEngine::GpuEngine(std::shared_ptr<GpuModel> m)
    : m_(std::move(m)), sc_(std::make_unique<Scratch>()), ch_(std::make_unique<Chunk>()),
      vf_(std::make_unique<Verify>()) {
    const Config& c = m_->config();
    const GpuOptions& o = m_->options();
    if (o.prefill_chunk < 1) throw std::invalid_argument("metal backend: prefill_chunk must be >= 1");
    chunk_ = o.prefill_chunk;
    gemm_route_ = o.gemm_route_auto ? ops::gemm_route(m_->device().info()) : o.gemm_route;
    Device& d = m_->device();
    const Act t = m_->options().act;
    const uint64_t es = act_size(t);
    const LayerWidths w = layer_widths(m_->layers);
    const uint32_t in_rows = w.in_rows, inter = w.inter;
    const uint64_t nhd = uint64_t(c.n_heads) * c.head_dim;
    Scratch& s = *sc_;
    s.x = d.alloc(c.hidden * es, "x");
    s.xn = d.alloc(c.hidden * es, "xn");
    s.proj = d.alloc(in_rows * es, "proj");
    s.conv_act = d.alloc(std::max<int64_t>(c.conv_dim(), 1) * es, "conv_act");
    // the partials of every route are bounded (the two-pass route's count is capped): size for any context
    s.attn_part = d.alloc(std::max<uint64_t>(ops::attention_scratch_bytes(attn_shape(c), UINT32_MAX,
                                                                          m_->options().attn), 16), "attn_part");
    s.mix = d.alloc(std::max<uint64_t>(c.value_dim(), nhd) * es, "mix");
    s.router = d.alloc((c.n_experts + 1) * 4, "router");
    s.topk_ids = d.alloc(std::max<int64_t>(c.top_k, 1) * 4, "topk_ids");
    s.topk_w = d.alloc(std::max<int64_t>(c.top_k, 1) * 4, "topk_w");
    s.slot_ids = d.alloc(std::max<int64_t>(c.top_k, 1) * 4, "slot_ids");
    s.moe_act = d.alloc(std::max<uint64_t>((c.top_k + 1) * uint64_t(inter), 1) * es, "moe_act");
    s.moe_shared = d.alloc(c.hidden * 4, "moe_shared");
    s.mlp_act = d.alloc(std::max<uint32_t>(w.dense, 1) * es, "mlp_act");
    s.logits = d.alloc(c.vocab * 4, "logits");
    s.tokens = d.alloc(kSlots * 4, "tokens");
    s.sample = d.alloc(ops::sample_scratch_bytes(uint32_t(c.vocab)), "sample");
}

GpuEngine::~GpuEngine() = default;

// x += attention(x) | gdn(x) of layer li (its input norm fused into the in-projection)
void GpuEngine::encode_mixer(Encoder& e, GpuState& st, size_t li, int64_t position) {
    const Config& c = m_->config();
    const GpuLayer& L = m_->layers[li];
    const Act t = m_->options().act;
    const uint64_t es = act_size(t);
    Scratch& s = *sc_;
    if (L.attention) {
        // ---- gated full attention ----
        const ops::AttnShape as = attn_shape(c);
        const size_t ai = L.state_index;
        stacked_qmv(e, t, L.attn_in, s.x, s.proj, false, normed(L.input_norm, c.eps));   // proj = [q+gate | k | v]
        // mix = gated attention over keys 0..position, the q/k norm, RoPE and K/V write of this token fused in
        ops::attention_decode_prepared(e, t, as, m_->options().attn, s.proj, L.q_norm, L.k_norm, uint32_t(position),
                                       st.kv[ai], s.attn_part, s.mix, int32_t(st.rope_delta));
        ops::qmv(e, t, L.o_proj, s.mix, s.x, 1, false, 0, 0, residual(s.x));           // x += o_proj(mix)
    } else {
        // ---- Gated DeltaNet ----
        const ops::GdnShape gs = gdn_shape(c);
        const size_t gi = L.state_index;
        const uint64_t cd = gs.conv_dim(), vd = gs.value_dim(), nv = gs.nv;
        ops::QmvFusion f = normed(L.input_norm, c.eps);
        if (L.gdn_in.parts.front().rows >= cd) {
            // the conv of this token as the epilogue of the part holding q|k|v (one dependency level fewer)
            const Buffer cin = st.conv_in(gi), cnext = st.conv_next(gi);
            const ops::QmvConv conv{&L.conv_w, &cin, &cnext, &s.conv_act, gs.conv_kernel, uint32_t(cd)};
            f.conv = &conv;
            stacked_qmv(e, t, L.gdn_in, s.x, s.proj, false, f);                   // proj = [qkv | z | b | a], conv_act
        } else {
            stacked_qmv(e, t, L.gdn_in, s.x, s.proj, false, f);                   // proj = [qkv | z | b | a]
            ops::gdn_conv(e, t, gs, s.proj.view(0, cd * es), L.conv_w, st.conv_in(gi), st.conv_next(gi), s.conv_act);
        }
        ops::gdn_step(e, t, gs, s.conv_act, s.proj.view(cd * es, vd * es), s.proj.view((cd + vd) * es, nv * es),
                      s.proj.view((cd + vd + nv) * es, nv * es), L.A_log, L.dt_bias, L.gdn_norm, c.eps,
                      st.ssm_in(gi), st.ssm_next(gi), s.mix);                           // mix = gated-normed output
        ops::qmv(e, t, L.out_proj, s.mix, s.x, 1, false, 0, 0, residual(s.x));         // x += out_proj(mix)
    }
}

// x += mlp(rmsnorm(x)) of the dense layer li
void GpuEngine::encode_mlp(Encoder& e, size_t li) {
    const Config& c = m_->config();
    const GpuLayer& L = m_->layers[li];
    const Act t = m_->options().act;
    Scratch& s = *sc_;
    ops::rmsnorm(e, t, s.x, L.post_norm, s.xn, 1, uint32_t(c.hidden), c.eps);
    ops::mlp_gate_up(e, t, L.mlp_gate_up, s.xn, s.mlp_act);
    ops::qmv(e, t, L.mlp_down, s.mlp_act, s.x, 1, false, 0, 0, residual(s.x));         // x += mlp(xn)
}

void GpuEngine::encode_layer(Encoder& e, GpuState& st, size_t li, int64_t position) {
    const Config& c = m_->config();
    const GpuLayer& L = m_->layers[li];
    const Act t = m_->options().act;
    Scratch& s = *sc_;
    encode_mixer(e, st, li, position);
    if (L.moe) {
        const uint32_t E = uint32_t(c.n_experts), k = uint32_t(c.top_k);
        ops::QmvFusion rf = normed(L.post_norm, c.eps, &s.xn);
        rf.round = true;                                                                // bf16 logits, as MLX
        stacked_qmv(e, t, L.router, s.x, s.router, true, rf);                          // router logits, xn
        const ops::MoeRouting route{s.router, E, c.norm_topk, s.topk_w};
        ops::moe_gate_up(e, t, L.gate, L.up, L.has_shared ? &L.shared_gate_up : nullptr, s.xn, s.topk_ids, k,
                         s.moe_act, &route);                                            // top-k + SwiGLU
        ops::moe_down(e, t, L.down, L.has_shared ? &L.shared_down : nullptr, s.moe_act, s.topk_ids, s.topk_w,
                      s.router, E, k, s.x, &s.moe_shared);                              // x += moe(xn)
    } else {
        encode_mlp(e, li);
    }
}

void GpuEngine::encode_step(Encoder& e, GpuState& st, int64_t position, uint32_t in_slot, uint32_t out_slot,
                            const SamplingConfig* sc, const Taps* taps, bool hidden) {
    const Act t = m_->options().act;
    Scratch& s = *sc_;
    ops::embed(e, t, m_->embed, s.tokens.view(in_slot * 4, 4), 1, s.x);                // x = embed(token)
    for (size_t li = 0; li < m_->layers.size(); ++li) {
        encode_layer(e, st, li, position);
        tap(e, taps, li, s.x, 1);                                                       // features[li] = x
    }
    encode_head(e, position, out_slot, sc, hidden);
}

// ---------------------------------------------------------------------------------------------- target features
void GpuEngine::check_feature_layers(const std::vector<int64_t>& layers) const {
    const int64_t n = int64_t(m_->layers.size());
    if (layers.empty() || layers.size() > kMaxFeatureLayers)
        throw std::invalid_argument("metal backend: feature layers: 1.." + std::to_string(kMaxFeatureLayers) +
                                    " of them, got " + std::to_string(layers.size()));
    for (size_t i = 0; i < layers.size(); ++i) {
        if (layers[i] < 0 || layers[i] >= n)
            throw std::invalid_argument("metal backend: feature layer " + std::to_string(layers[i]) +
                                        " outside the model's layers 0.." + std::to_string(n - 1));
        for (size_t j = 0; j < i; ++j)
            if (layers[j] == layers[i])
                throw std::invalid_argument("metal backend: feature layer " + std::to_string(layers[i]) +
                                            " given twice (the layers must be distinct)");
    }
}

uint32_t GpuEngine::feature_rows(size_t layers) const {
    const uint64_t row = uint64_t(std::max<size_t>(layers, 1)) * uint64_t(m_->config().hidden) * 4;
    return uint32_t(std::max<uint64_t>(1, std::min<uint64_t>(chunk_, kFeatureBytes / row)));
}

std::optional<GpuEngine::Taps> GpuEngine::taps_for(const std::vector<int64_t>& layers, uint32_t rows) {
    if (layers.empty()) return std::nullopt;
    check_feature_layers(layers);
    Taps tp;
    tp.slot.assign(m_->layers.size(), -1);
    for (size_t j = 0; j < layers.size(); ++j) tp.slot[size_t(layers[j])] = int32_t(j);
    tp.block = uint64_t(rows) * uint64_t(m_->config().hidden) * 4;
    const uint64_t need = tp.block * layers.size();
    if (!feat_.valid() || feat_.length < need) feat_ = m_->device().alloc(need, "features");
    return tp;
}

void GpuEngine::tap(Encoder& e, const Taps* taps, size_t li, const Buffer& x, uint32_t rows) {
    if (!taps || taps->slot[li] < 0) return;
    const uint32_t H = uint32_t(m_->config().hidden);
    ops::copy_f32(e, m_->options().act, x, feat_.view(uint64_t(taps->slot[li]) * taps->block, uint64_t(rows) * H * 4),
                  rows, H);
}

void GpuEngine::gather(const Taps& taps, const std::vector<int64_t>& layers, uint32_t rows, float* out) const {
    const size_t H = size_t(m_->config().hidden), L = layers.size();
    const uint8_t* base = feat_.as<uint8_t>();
    for (size_t j = 0; j < L; ++j) {
        const float* blk = reinterpret_cast<const float*>(base + j * taps.block);
        for (uint32_t r = 0; r < rows; ++r) std::memcpy(out + (size_t(r) * L + j) * H, blk + size_t(r) * H, H * 4);
    }
}

// logits = lm_head rmsnorm(x) (f32); tokens[out_slot] = argmax | sample when sc is given, after the token mask
// (Scratch::mask, which decode_impl uploaded) when sc has one
void GpuEngine::encode_head(Encoder& e, int64_t position, uint32_t out_slot, const SamplingConfig* sc, bool hidden) {
    const Config& c = m_->config();
    const Act t = m_->options().act;
    Scratch& s = *sc_;
    ops::qmv(e, t, m_->lm_head, s.x, s.logits, 1, true, 0, 0,
             normed(m_->final_norm, c.eps, hidden ? &s.xn : nullptr));                    // logits (f32) [, xn]
    if (sc) {
        const Buffer tok = s.tokens.view(out_slot * 4, 4);
        const uint32_t V = sc->chosen_vocab(c.vocab);
        if (sc->mask) ops::apply_token_mask(e, s.logits, V, s.mask);
        if (sc->greedy) ops::argmax(e, s.logits, V, tok, s.sample);
        else {
            ops::SampleParams p = sc->params;
            p.position = uint64_t(position);
            ops::sample(e, s.logits, V, p, tok, s.sample);
        }
    }
}

// ---------------------------------------------------------------------------------------------- streaming
// One token in streaming mode (docs/metal.md, "Streaming mode"): the host must read a MoE layer's
// routing before it knows which experts to load, so the token is cut at every MoE layer's top-k:
//
//   cb 0:   embed, layer 0's mixer (+ the dense MLP of dense layers), router logits + xn, top-k
//   wait;   host reads the k ids; per batch of <= S experts: acquire (pread the misses into the slot
//           stacks), write the batch's slot ids; a batch before the last: its expert pass, commit, wait
//   cb l:   the last batch's expert pass (+ the shared expert), the next layer's mixer ... top-k
//   ...
//   cb L:   the last layer's expert pass, lm_head, argmax | sample
//
// The last batch's expert pass is never waited on alone: it opens the next command buffer (the host
// needs nothing from it). Host waits per token: sum over MoE layers of ceil(k / S), plus one.
// Every kernel is the resident graph's, with the slot stacks for the checkpoint stacks and slot ids for
// the expert ids; top-k is the same function as the fused one (moe_topk_rows: route_topk<T>), so with
// S >= k the token's arithmetic is the resident step's exactly. With S < k the routed sum is added to x
// batch by batch (one rounding of x per batch): equal within the backend's tolerance.
void GpuEngine::stream_step(GpuState& st, int64_t position, uint32_t in_slot, uint32_t out_slot, bool logits,
                            const SamplingConfig* sc, const Taps* taps, bool hidden) {
    const Config& c = m_->config();
    const Act t = m_->options().act;
    Device& d = m_->device();
    ExpertCache& cache = *m_->experts();
    Scratch& s = *sc_;
    const uint32_t E = uint32_t(c.n_experts), k = uint32_t(c.top_k), S = uint32_t(cache.slots_per_layer());
    std::unique_ptr<CommandBuffer> cb = d.command_buffer();
    std::optional<Encoder> e(std::in_place, d, *cb);
    auto run = [&] {                                   // commit and wait the open command buffer, open the next
        cb->commit();
        cb->wait();
        cb = d.command_buffer();
        e.emplace(d, *cb);
    };
    std::vector<int32_t> ids(k), slots(k);
    ops::embed(*e, t, m_->embed, s.tokens.view(in_slot * 4, 4), 1, s.x);              // x = embed(token)
    for (size_t li = 0; li < m_->layers.size(); ++li) {
        const GpuLayer& L = m_->layers[li];
        encode_mixer(*e, st, li, position);
        if (!L.moe) {
            encode_mlp(*e, li);
            tap(*e, taps, li, s.x, 1);                                                 // features[li] = x
            continue;
        }
        ops::QmvFusion rf = normed(L.post_norm, c.eps, &s.xn);
        rf.round = true;                                                               // bf16 logits, as MLX
        stacked_qmv(*e, t, L.router, s.x, s.router, true, rf);                         // router logits, xn
        ops::moe_topk_rows(*e, t, s.router, 1, E, E, k, c.norm_topk, s.topk_ids, s.topk_w);
        run();                                                                         // the host reads the ids
        const uint32_t* top = s.topk_ids.as<uint32_t>();
        for (uint32_t j = 0; j < k; ++j) ids[j] = int32_t(top[j]);
        for (uint32_t b0 = 0; b0 < k; b0 += S) {
            const uint32_t n = std::min(S, k - b0);
            const bool last = b0 + n == k;
            cache.acquire(int(li), ids.data() + b0, int(n), slots.data() + b0);       // misses: pread into slots
            uint32_t* dst = s.slot_ids.as<uint32_t>() + b0;
            for (uint32_t j = 0; j < n; ++j) dst[j] = uint32_t(slots[b0 + j]);
            const Buffer sid = s.slot_ids.view(b0 * 4, n * 4), w = s.topk_w.view(b0 * 4, n * 4);
            // the shared expert rides with the last batch (moe_down adds it after the routed slots)
            ops::moe_gate_up(*e, t, L.gate, L.up, last && L.has_shared ? &L.shared_gate_up : nullptr, s.xn, sid, n,
                             s.moe_act);                                               // SwiGLU of the batch
            ops::moe_down(*e, t, L.down, last && L.has_shared ? &L.shared_down : nullptr, s.moe_act, sid, w,
                          s.router, E, n, s.x, &s.moe_shared);                           // x += the batch's sum
            if (!last) run();                                                          // its slots are reused next
        }
        tap(*e, taps, li, s.x, 1);                                                     // features[li] = x
    }
    if (logits || sc || hidden) encode_head(*e, position, out_slot, sc, hidden);
    cb->commit();
    cb->wait();
    ++stream_tokens_;
}

// ---------------------------------------------------------------------------------------------- prefill
namespace {
ops::MoeBlock moe_block(const Config& c, const GpuLayer& L) {
    ops::MoeBlock b;
    b.router = &L.router.parts;
    b.gate = &L.gate;
    b.up = &L.up;
    b.down = &L.down;
    b.shared_gate_up = L.has_shared ? &L.shared_gate_up : nullptr;
    b.shared_down = L.has_shared ? &L.shared_down : nullptr;
    b.k = uint32_t(c.top_k);
    b.norm = c.norm_topk;
    return b;
}
}  // namespace

// One buffer per logical tensor of a prefill chunk of C rows (C: the largest chunk run so far; grown
// lazily, bounded by the chunk size). Row-major, one row per token of the chunk.
struct GpuEngine::Chunk {
    uint32_t rows = 0;        // C
    bool all_logits = false;  // logits sized for every row
    Buffer ids;               // u32 [C]                    the chunk's token ids (written by the host)
    Buffer x;                 // T [C, H]                   residual stream
    Buffer xn;                // T [C, H]                   normalised rows (input of a projection)
    Buffer proj;              // T [C, max in rows]         stacked in-projection rows of the layer
    Buffer conv_act;          // T [C, conv_dim]            GDN q | k | v after the conv and SiLU
    Buffer gdn;               // gdn_prefill_scratch_bytes(C) the chunked GDN form's per-chunk tensors
    Buffer q;                 // T [C, nh * hd]             attention queries after norm + RoPE
    Buffer mix;               // T [C, max(value_dim, nh * hd)]  block output before the out projection
    ops::MoeScratch moe;      // the MoE block's (ops::moe_prefill_scratch: router logits [C, E + 1], top-k,
                              // sorted slots, tile map, expert rows [C * k, ...], shared expert rows)
    Buffer mlp_act;           // T [C, I]                   dense-MLP SwiGLU rows
    Buffer logits;            // f32 [C, V] (want 2; else [1, V] is the decode scratch's)
    Buffer pair_pos;          // i32 [C, rotary_dim / 2]     explicit RoPE positions (RowInputs; host-written)
    bool pairs = false;       // this chunk's attn_prepare reads pair_pos
};

namespace {
// A want-2 chunk holds the logits of all its rows: at most this many bytes of them.
constexpr uint64_t kLogitsBytes = uint64_t(256) << 20;
}  // namespace

uint32_t GpuEngine::logits_rows() const {
    const uint64_t V = uint64_t(m_->config().vocab);
    return uint32_t(std::max<uint64_t>(1, std::min<uint64_t>(chunk_, kLogitsBytes / (V * 4))));
}

void GpuEngine::reserve_prefill(uint32_t rows) {
    std::lock_guard<std::mutex> lock(mu_);
    ensure_chunk(std::min(std::max<uint32_t>(rows, 1), chunk_), false);
}

void GpuEngine::ensure_chunk(uint32_t rows, bool all_logits) {
    Chunk& k = *ch_;
    if (rows <= k.rows && (!all_logits || k.all_logits)) return;
    const Config& c = m_->config();
    Device& d = m_->device();
    const uint64_t es = act_size(m_->options().act), C = std::max(rows, k.rows);
    const LayerWidths w = layer_widths(m_->layers);
    const uint32_t in_rows = w.in_rows, dense = w.dense;
    const GpuLayer* moe = nullptr;                     // every MoE layer has the config's shapes: one scratch
    for (const GpuLayer& L : m_->layers)
        if (L.moe && !moe) moe = &L;
    const uint64_t H = uint64_t(c.hidden), nhd = uint64_t(c.n_heads) * c.head_dim;
    auto alloc = [&](uint64_t bytes, const char* label) { return d.alloc(std::max<uint64_t>(bytes, 16), label); };
    Chunk n;                                           // everything allocated before anything changes
    n.rows = uint32_t(C);
    n.all_logits = all_logits || k.all_logits;
    n.ids = alloc(C * 4, "prefill.ids");
    n.x = alloc(C * H * es, "prefill.x");
    n.xn = alloc(C * H * es, "prefill.xn");
    n.proj = alloc(C * in_rows * es, "prefill.proj");
    n.conv_act = alloc(C * uint64_t(std::max<int64_t>(c.conv_dim(), 0)) * es, "prefill.conv_act");
    n.gdn = alloc(c.conv_dim() > 0 ? ops::gdn_prefill_scratch_bytes(gdn_shape(c), uint32_t(C)) : 0, "prefill.gdn");
    n.q = alloc(C * nhd * es, "prefill.q");
    n.mix = alloc(C * std::max<uint64_t>(uint64_t(std::max<int64_t>(c.value_dim(), 0)), nhd) * es, "prefill.mix");
    if (moe) n.moe = ops::moe_prefill_scratch(d, m_->options().act, moe_block(c, *moe), uint32_t(C));
    n.mlp_act = alloc(C * dense * es, "prefill.mlp_act");
    n.logits = n.all_logits ? alloc(C * uint64_t(c.vocab) * 4, "prefill.logits") : Buffer();
    n.pair_pos = alloc(C * uint64_t(c.rotary_dim / 2) * 4, "prefill.pair_pos");
    k = std::move(n);
}

// One layer over the chunk's rows (positions p0 .. p0 + rows - 1): the decode graph's blocks with every
// GEMV a GEMM over the rows and the recurrences / attention over the chunk.
void GpuEngine::encode_layer_rows(Encoder& e, GpuState& st, size_t li, int64_t p0, uint32_t rows) {
    const Config& c = m_->config();
    const GpuLayer& L = m_->layers[li];
    const Act t = m_->options().act;
    const uint64_t es = act_size(t);
    const uint32_t H = uint32_t(c.hidden);
    const ops::GemmRoute gr = gemm_route_;
    Chunk& ch = *ch_;
    ops::GemmFusion res;
    res.residual = &ch.x;
    // proj[:, :sp.rows] = xn sp^T: one GEMM per part into its column range of proj's rows
    auto stacked = [&](const Stacked& sp) {
        uint64_t col = 0;
        for (const Matrix& m : sp.parts) {
            ops::gemm(e, t, m, ch.xn, ch.proj.view(col * es), rows, false, H, sp.rows, ops::GemmFusion(), gr);
            col += m.rows;
        }
    };

    ops::rmsnorm(e, t, ch.x, L.input_norm, ch.xn, rows, H, c.eps);                        // xn = rmsnorm(x)
    if (L.attention) {
        // ---- gated full attention ----
        const ops::AttnShape as = attn_shape(c);
        const ops::KVCache& kv = st.kv[L.state_index];
        stacked(L.attn_in);                                                                // proj = [q+gate | k | v]
        ops::attn_prepare(e, t, as, ch.proj, L.q_norm, L.k_norm, uint32_t(p0), kv, ch.q, rows, L.attn_in.rows,
                          int32_t(st.rope_delta), ch.pairs ? &ch.pair_pos : nullptr);
        // mix = attention(q) over keys 0..p0+r: in query blocks short enough for one command buffer each
        const uint64_t qrow = uint64_t(c.n_heads) * c.head_dim * es;
        for (uint32_t r0 = 0, n = 0; r0 < rows; r0 += n) {
            n = ops::attention_prefill_rows_within(as, uint32_t(p0) + r0, rows - r0, m_->options().command_buffer_seconds,
                                                   kSlowestChip);
            ops::attention_prefill(e, t, as, ch.q.view(r0 * qrow), ch.proj.view(uint64_t(r0) * L.attn_in.rows * es),
                                   L.attn_in.rows, kv, uint32_t(p0) + r0, n, ch.mix.view(r0 * qrow));
        }
        ops::gemm(e, t, L.o_proj, ch.mix, ch.x, rows, false, 0, 0, res, gr);               // x += o_proj(mix)
    } else {
        // ---- Gated DeltaNet ----
        const ops::GdnShape gs = gdn_shape(c);
        const size_t gi = L.state_index;
        stacked(L.gdn_in);                                                                 // proj = [qkv | z | b | a]
        ops::gdn_conv(e, t, gs, ch.proj, L.conv_w, st.conv_in(gi), st.conv_next(gi), ch.conv_act, rows,
                      L.gdn_in.rows);                                                      // window: cur -> next half
        ops::gdn_prefill(e, t, gs, ch.conv_act, ch.proj, L.gdn_in.rows, L.A_log, L.dt_bias, L.gdn_norm, c.eps,
                         st.ssm_in(gi), st.ssm_next(gi), ch.mix, rows, ch.gdn, m_->options().gdn_route);
        ops::gemm(e, t, L.out_proj, ch.mix, ch.x, rows, false, 0, 0, res, gr);             // x += out_proj(mix)
    }

    ops::rmsnorm(e, t, ch.x, L.post_norm, ch.xn, rows, H, c.eps);                         // xn = rmsnorm(x)
    if (L.moe) {
        ops::moe_prefill(e, t, moe_block(c, L), ch.xn, ch.x, rows, ch.moe, gr);            // x += moe(xn)
    } else {
        ops::GemmFusion sw;
        sw.swiglu = true;
        ops::gemm(e, t, L.mlp_gate_up, ch.xn, ch.mlp_act, rows, false, 0, 0, sw, gr);       // act = swiglu(xn)
        ops::gemm(e, t, L.mlp_down, ch.mlp_act, ch.x, rows, false, 0, 0, res, gr);          // x += down(act)
    }
}

void GpuEngine::encode_chunk(Encoder& e, GpuState& st, int64_t p0, uint32_t rows, int want, const Taps* taps,
                             bool hidden, bool skip_embed) {
    const Config& c = m_->config();
    const Act t = m_->options().act;
    const uint64_t es = act_size(t), H = uint64_t(c.hidden);
    Chunk& ch = *ch_;
    if (!skip_embed)
        ops::embed(e, t, m_->embed, ch.ids.view(0, uint64_t(rows) * 4), rows, ch.x);      // x = embed(ids)
    for (size_t li = 0; li < m_->layers.size(); ++li) {
        encode_layer_rows(e, st, li, p0, rows);
        tap(e, taps, li, ch.x, rows);                                                      // features[li] = x
    }
    if (want == 1)                                                                         // the last row only
        ops::qmv(e, t, m_->lm_head, ch.x.view((rows - 1) * H * es, H * es), sc_->logits, 1, true, 0, 0,
                 normed(m_->final_norm, c.eps));
    else if (want == 2) {                                                                  // every row
        ops::rmsnorm(e, t, ch.x, m_->final_norm, ch.xn, rows, uint32_t(H), c.eps);
        ops::gemm(e, t, m_->lm_head, ch.xn, ch.logits, rows, true, 0, 0, ops::GemmFusion(), gemm_route_);
    }
    if (hidden && want != 2) ops::rmsnorm(e, t, ch.x, m_->final_norm, ch.xn, rows, uint32_t(H), c.eps);   // hidden rows
}

void GpuEngine::widen_rows(const Buffer& src, uint32_t rows, float* out) const {
    const size_t n = size_t(rows) * size_t(m_->config().hidden);
    if (m_->options().act == Act::F32) std::memcpy(out, src.data(), n * 4);
    else
        for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(src.as<uint16_t>()[i]);
}

void GpuEngine::forward_impl(GpuState& st, const int64_t* ids, int64_t n, int want, float* logits, InterruptPoll poll,
                             const FeatureRequest* feats, float* hidden, const RowInputs* rows) {
    const Config& c = m_->config();
    if (n < 1) throw std::invalid_argument("metal backend: no tokens");
    if (feats && hidden) throw std::invalid_argument("metal backend: forward returns hidden rows or layer features, not both");
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= c.vocab)
            throw std::invalid_argument("metal backend: token id " + std::to_string(ids[i]) + " outside the vocabulary");
    if (feats) check_feature_layers(feats->layers);
    if (rows) {
        if (m_->experts())
            throw std::invalid_argument("metal backend: explicit positions and embedding rows need resident experts "
                                        "(not expert streaming)");
        rows->check(n, "metal backend");
        if (!rows->pair_pos && st.position + st.rope_delta < 0)
            throw std::invalid_argument("metal backend: the rope delta puts a position below 0");
    }
    std::lock_guard<std::mutex> lock(mu_);
    Device& d = m_->device();
    if (!d.info().executes) throw std::invalid_argument("metal backend: an encode-only device cannot run forward()");
    if (m_->experts()) {                               // streaming: token by token through the expert cache
        st.reserve(st.position + n);
        st.end_chain();                                // any call but verify ends a verification chain
        stream_forward(st, ids, n, want, logits, poll, feats, hidden);
        return;
    }
    const size_t FL = feats ? feats->layers.size() : 0;
    if (n == 1 && !rows) {                             // one token: a decode step (decode() and verify() rows
        st.reserve(st.position + 1);                   // compute the same), the state advanced once it ran
        const std::optional<Taps> taps = feats ? taps_for(feats->layers, 1) : std::nullopt;
        st.end_chain();                                // any call but verify ends a verification chain
        const uint32_t id = uint32_t(ids[0]);
        std::memcpy(sc_->tokens.data(), &id, 4);
        auto cb = d.command_buffer();
        Encoder e(d, *cb);
        encode_step(e, st, st.position, 0, 1, nullptr, taps ? &*taps : nullptr, hidden != nullptr);
        cb->commit();
        cb->wait();
        st.commit_step();
        if (want) std::memcpy(logits, sc_->logits.data(), size_t(c.vocab) * 4);
        if (hidden) widen_rows(sc_->xn, 1, hidden);
        if (taps) gather(*taps, feats->layers, 1, feats->out);
        return;
    }
    int64_t C = want == 2 ? logits_rows() : chunk_;
    if (feats) C = std::min<int64_t>(C, feature_rows(FL));
    st.reserve(st.position + n);                       // KV growth first (strong guarantee)
    ensure_chunk(uint32_t(std::min<int64_t>(C, n)), want == 2);
    const std::optional<Taps> taps = feats ? taps_for(feats->layers, uint32_t(std::min<int64_t>(C, n))) : std::nullopt;
    st.end_chain();                                    // any call but verify ends a verification chain
    // one chunk needs no copy: the GDN halves are flipped only once its command buffer succeeded
    const bool multi = n > C;
    const GpuState::Saved saved = multi ? st.save() : GpuState::Saved{};
    const int64_t half = c.rotary_dim / 2, H = c.hidden;
    struct PairsOff {                                  // the chunk scratch's flag never outlives the call
        Chunk& ch;
        ~PairsOff() { ch.pairs = false; }
    } pairs_off{*ch_};
    try {
        for (int64_t i0 = 0; i0 < n; i0 += C) {
            if (poll && i0 > 0) poll();                // between chunks: nothing in flight
            const uint32_t M = uint32_t(std::min<int64_t>(C, n - i0));
            uint32_t* dst = ch_->ids.as<uint32_t>();
            for (uint32_t r = 0; r < M; ++r) dst[r] = uint32_t(ids[i0 + r]);
            const bool last = i0 + M == n;
            ch_->pairs = rows && rows->pair_pos;
            if (ch_->pairs) std::memcpy(ch_->pair_pos.data(), rows->pair_pos + i0 * half, size_t(M * half) * 4);
            bool host_x = false;                       // embedding rows in this chunk: embed, then the host's rows
            for (int64_t j = 0; rows && j < rows->n_embeds; ++j)
                host_x = host_x || (rows->embed_rows[j] >= i0 && rows->embed_rows[j] < i0 + M);
            if (host_x) {
                Encoder e0(d, m_->options().command_buffer_seconds);
                ops::embed(e0, m_->options().act, m_->embed, ch_->ids.view(0, uint64_t(M) * 4), M, ch_->x);
                e0.commit();
                e0.wait();
                const bool f32 = m_->options().act == Act::F32;
                for (int64_t j = 0; j < rows->n_embeds; ++j) {
                    const int64_t r = rows->embed_rows[j] - i0;
                    if (r < 0 || r >= M) continue;
                    const float* src = rows->embeds + j * H;
                    if (f32) std::memcpy(ch_->x.as<float>() + r * H, src, size_t(H) * 4);
                    else
                        for (int64_t k = 0; k < H; ++k) ch_->x.as<uint16_t>()[r * H + k] = f32_to_bf16(src[k]);
                }
            }
            Encoder e(d, m_->options().command_buffer_seconds);   // command buffers back to back, no waits
            encode_chunk(e, st, st.position, M, want == 2 ? 2 : (want == 1 && last ? 1 : 0), taps ? &*taps : nullptr,
                         hidden != nullptr, host_x);
            e.commit();
            e.wait();
            st.commit_step(M);                         // the chunk's written halves become current
            if (want == 2) std::memcpy(logits + i0 * c.vocab, ch_->logits.data(), size_t(M) * c.vocab * 4);
            else if (want == 1 && last) std::memcpy(logits, sc_->logits.data(), size_t(c.vocab) * 4);
            if (taps) gather(*taps, feats->layers, M, feats->out + size_t(i0) * FL * c.hidden);
            if (hidden) widen_rows(ch_->xn, M, hidden + size_t(i0) * c.hidden);
        }
    } catch (...) {
        if (multi) st.restore(saved);
        throw;
    }
    if (rows) st.rope_delta = rows->rope_delta;        // committed with the call
}

ExpertCacheStats GpuEngine::expert_stats(int64_t* tokens) {
    std::lock_guard<std::mutex> lock(mu_);
    *tokens = stream_tokens_;
    return m_->experts() ? m_->experts()->stats() : ExpertCacheStats{};
}

void GpuEngine::reset_expert_stats() {
    std::lock_guard<std::mutex> lock(mu_);
    if (m_->experts()) m_->experts()->reset_stats();
    stream_tokens_ = 0;
}

// Streaming prefill: each token is one stream_step (the routing of a token is known only after its
// top-k), the state advanced after each; all-or-nothing like the chunked prefill.
void GpuEngine::stream_forward(GpuState& st, const int64_t* ids, int64_t n, int want, float* logits,
                               InterruptPoll poll, const FeatureRequest* feats, float* hidden) {
    const Config& c = m_->config();
    const std::optional<Taps> taps = feats ? taps_for(feats->layers, 1) : std::nullopt;
    const size_t FL = feats ? feats->layers.size() : 0;
    const GpuState::Saved saved = st.save();
    try {
        for (int64_t i = 0; i < n; ++i) {
            if (poll && i > 0) poll();                 // between tokens: nothing in flight
            const uint32_t id = uint32_t(ids[i]);
            std::memcpy(sc_->tokens.data(), &id, 4);
            const bool want_logits = want == 2 || (want == 1 && i + 1 == n);
            stream_step(st, st.position, 0, 1, want_logits, nullptr, taps ? &*taps : nullptr, hidden != nullptr);
            st.commit_step();
            if (hidden) widen_rows(sc_->xn, 1, hidden + size_t(i) * c.hidden);
            if (want == 2) std::memcpy(logits + i * c.vocab, sc_->logits.data(), size_t(c.vocab) * 4);
            else if (want_logits) std::memcpy(logits, sc_->logits.data(), size_t(c.vocab) * 4);
            if (taps) gather(*taps, feats->layers, 1, feats->out + size_t(i) * FL * c.hidden);
        }
    } catch (...) {
        st.restore(saved);
        throw;
    }
}

std::vector<int32_t> GpuEngine::decode_impl(GpuState& st, int32_t first, int64_t n, const SamplingConfig& sc,
                                       const std::vector<int32_t>& stop_ids, bool pipelined, InterruptPoll poll) {
    const Config& c = m_->config();
    if (first < 0 || first >= c.vocab)
        throw std::invalid_argument("metal backend: token id " + std::to_string(first) + " outside the vocabulary");
    const uint32_t mask_words = ops::token_mask_words(uint64_t(c.vocab));
    if (sc.mask) {
        if (n != 1)
            throw std::invalid_argument("metal backend: a token mask decodes one token per call (n must be 1, got " +
                                        std::to_string(n) + ")");
        if (sc.mask_words != mask_words)
            throw std::invalid_argument("metal backend: the token mask must have ceil(vocab_size / 32) = " +
                                        std::to_string(mask_words) + " words, got " + std::to_string(sc.mask_words));
        const uint32_t V = sc.chosen_vocab(c.vocab);
        if (!ops::token_mask_allows_any(sc.mask, sc.mask_words, V))
            throw std::invalid_argument("metal backend: the token mask allows no token in [0, " + std::to_string(V) +
                                        ")");
    }
    std::vector<int32_t> out;
    if (n <= 0) return out;
    std::lock_guard<std::mutex> lock(mu_);
    Device& d = m_->device();
    if (sc.mask) {                                     // uploaded per call; the buffer is made on first use
        if (!sc_->mask.valid()) sc_->mask = d.alloc(uint64_t(mask_words) * 4, "token_mask");
        if (sc_->mask.data()) std::memcpy(sc_->mask.data(), sc.mask, uint64_t(mask_words) * 4);
    }
    st.end_chain();
    st.reserve(st.position + n);
    uint32_t tok0 = uint32_t(first);
    if (sc_->tokens.data()) std::memcpy(sc_->tokens.data(), &tok0, 4);
    const int64_t p0 = st.position;
    auto token_of = [&](int64_t i) {                   // the token step i wrote (slot (i + 1) % 4)
        uint32_t tok = 0;
        if (sc_->tokens.data()) std::memcpy(&tok, sc_->tokens.as<uint8_t>() + ((i + 1) % kSlots) * 4, 4);
        return int32_t(tok);
    };
    auto stops = [&](int32_t tok) { return std::find(stop_ids.begin(), stop_ids.end(), tok) != stop_ids.end(); };
    if (m_->experts()) {                               // streaming: one stream_step per token, none in flight
        const GpuState::Saved saved = st.save();
        try {
            for (int64_t i = 0; i < n; ++i) {
                if (poll && i > 0) poll();
                stream_step(st, p0 + i, uint32_t(i % kSlots), uint32_t((i + 1) % kSlots), true, &sc);
                st.commit_step();
                out.push_back(token_of(i));
                if (stops(out.back())) break;
            }
        } catch (...) {
            st.restore(saved);
            throw;
        }
        return out;
    }
    auto encode = [&](int64_t i) {                     // step i: position p0 + i, slots i % 4 -> (i + 1) % 4
        auto cb = d.command_buffer();
        Encoder e(d, *cb);
        encode_step(e, st, p0 + i, uint32_t(i % kSlots), uint32_t((i + 1) % kSlots), &sc);
        cb->commit();
        return cb;
    };
    // all-or-nothing: an error part-way (a failed command buffer) restores the state of the call's start
    const GpuState::Saved saved = st.save();
    try {
        // the ping-pong halves alternate with the step's parity, so step i + 1 can be encoded before
        // step i is committed to the state: it reads what step i writes
        std::unique_ptr<CommandBuffer> cur = encode(0), next;
        for (int64_t i = 0; i < n; ++i) {
            if (poll && i > 0) {                           // between steps: step i is in flight
                try {
                    poll();
                } catch (...) {
                    try {
                        cur->wait();                       // it writes the state's buffers: let it finish
                    } catch (...) {                    // superseded by the interrupt being rethrown
                    }
                    throw;
                }
            }
            const uint32_t slot = st.cur;
            st.cur = st.next_slot();                       // step i + 1 reads step i's output slot
            if (pipelined && i + 1 < n) next = encode(i + 1);   // committed before step i is waited on
            st.cur = slot;
            try {
                cur->wait();
            } catch (...) {
                try {
                    if (next) next->wait();            // in flight: let it finish (a faulted queue fails it too)
                } catch (...) {                        // the first failure is the one reported
                }
                throw;
            }
            st.commit_step();                              // step i is now the state
            out.push_back(token_of(i));
            if (stops(out.back()) || i + 1 == n) {
                if (next) next->wait();                    // discarded: its halves are never made current
                break;
            }
            if (!pipelined) next = encode(i + 1);
            cur = std::move(next);
        }
    } catch (...) {
        st.restore(saved);
        throw;
    }
    return out;
}

// ---------------------------------------------------------------------------------------------- verification
// The verification of drafted tokens (docs/speculative.md): R tokens at positions p0.. as one command
// buffer in which every row is computed as a decode step (encode_step) computes it, so its logits and the
// state after it are bit for bit those of R decode steps:
//
//   x  = embed(ids)                                 the host wrote the ids first
//   for each layer:
//       proj = W_in rmsnorm(x)                      qmv over the R rows: each weight read once for all
//                                                   of them, per row the decode kernel's arithmetic
//       mix[r] = attention(proj[r]) over keys 0..p0+r      attn_prepare writes the R K/V rows at once
//              | gdn(proj[r]) on the state after row r-1   into ring slot r of the state
//       x   += W_out mix                            qmv over the rows, the residual add fused
//       router = W_r rmsnorm(x), xn                 qmv over the rows
//       x[r] += moe(xn[r])                          top-k of every row, then the union-read MoE: each expert
//                                                   of the rows' union read once, per row the decode arithmetic
//            | mlp(rmsnorm(x[r]))                   (dense layers)
//   logits = lm_head rmsnorm(x) (float, [R, V])     qmv over the rows; xn keeps the normed rows (hidden)
//
// The GDN states after each row go to slots of the state's ring of their own (GpuState::take_rows), written by
// gdn_conv_rows / gdn_step_rows (one dispatch each for all the rows: 2 dependency levels per GDN layer);
// GpuState::rewind makes one of them current; the KV rows past a rewound position are overwritten by later calls.
//
// The same graph runs the batched decode step (decode_batch): a RowPlan per row names the state, position,
// KV cache and GDN buffers it uses, so rows may be one state's consecutive tokens (verify_plan) or one
// token on each of B states (batch_plan).


void GpuEngine::ensure_verify(uint32_t rows) {
    Verify& v = *vf_;
    if (rows <= v.rows) return;
    const Config& c = m_->config();
    Device& d = m_->device();
    const uint64_t es = act_size(m_->options().act), R = rows, H = uint64_t(c.hidden);
    const LayerWidths w = layer_widths(m_->layers);
    uint32_t router_rows = 1;
    for (const GpuLayer& L : m_->layers)
        if (L.moe) router_rows = std::max(router_rows, L.router.rows);
    const uint64_t nhd = uint64_t(c.n_heads) * c.head_dim, k = uint64_t(std::max<int64_t>(c.top_k, 1));
    const uint64_t part = std::max<uint64_t>(ops::attention_scratch_bytes(attn_shape(c), UINT32_MAX, m_->options().attn), 16);
    auto alloc = [&](uint64_t bytes, const char* label) { return d.alloc(std::max<uint64_t>(bytes, 16), label); };
    Verify n;                                          // everything allocated before anything changes
    n.rows = rows;
    n.ids = alloc(R * 4, "verify.ids");
    n.x = alloc(R * H * es, "verify.x");
    n.xn = alloc(R * H * es, "verify.xn");
    n.proj = alloc(R * w.in_rows * es, "verify.proj");
    n.conv_act = alloc(R * uint64_t(std::max<int64_t>(c.conv_dim(), 0)) * es, "verify.conv_act");
    n.q = alloc(R * nhd * es, "verify.q");
    for (uint32_t r = 0; r < rows; ++r) n.attn_part.push_back(alloc(part, "verify.attn_part"));
    n.mix = alloc(R * std::max<uint64_t>(uint64_t(std::max<int64_t>(c.value_dim(), 0)), nhd) * es, "verify.mix");
    n.router = alloc(R * router_rows * 4, "verify.router");
    n.topk_ids = alloc(R * k * 4, "verify.topk_ids");
    n.topk_w = alloc(R * k * 4, "verify.topk_w");
    n.act_row = (k + 1) * w.inter;
    n.moe_act = alloc(R * n.act_row * es, "verify.moe_act");
    n.moe_shared = alloc(R * H * 4, "verify.moe_shared");
    n.mlp_act = alloc(R * w.dense * es, "verify.mlp_act");
    n.logits = alloc(R * uint64_t(c.vocab) * 4, "verify.logits");
    v = std::move(n);
}

std::vector<GpuEngine::RowPlan> GpuEngine::verify_plan(GpuState& st, uint32_t rows, uint32_t first) {
    // row r at p0 + r on the one state: it reads the GDN state after row r - 1 (the current slot for row 0)
    // and writes slot first + r of the state's ring (GpuState::take_rows)
    std::vector<RowPlan> plan(rows);
    for (uint32_t r = 0; r < rows; ++r) {
        RowPlan& p = plan[r];
        p.st = &st;
        p.position = st.position + r;
        p.slot = (first + r) % st.slots();
    }
    return plan;
}

std::vector<GpuEngine::RowPlan> GpuEngine::batch_plan(const std::vector<GpuState*>& states) {
    // row r on states[r] at its position: a decode step's halves (read the current, write the other)
    std::vector<RowPlan> plan(states.size());
    for (size_t r = 0; r < states.size(); ++r) {
        GpuState& st = *states[r];
        RowPlan& p = plan[r];
        p.st = &st;
        p.position = st.position;
        for (size_t gi = 0; gi < st.n_gdn(); ++gi) {
            p.conv_in.push_back(st.conv_in(gi));
            p.ssm_in.push_back(st.ssm_in(gi));
            p.conv_out.push_back(st.conv_next(gi));
            p.ssm_out.push_back(st.ssm_next(gi));
        }
    }
    return plan;
}

// One layer over the rows: encode_layer's blocks, the GEMVs over all rows (each weight read once), the MoE
// union-read over the rows, attention and the GDN conv / step per row on its RowPlan (its state's KV cache,
// its GDN buffers).
void GpuEngine::encode_rows_layer(Encoder& e, const std::vector<RowPlan>& plan, size_t li) {
    const Config& c = m_->config();
    const GpuLayer& L = m_->layers[li];
    const Act t = m_->options().act;
    const uint64_t es = act_size(t), H = uint64_t(c.hidden);
    const uint64_t nhd = uint64_t(c.n_heads) * c.head_dim;
    const uint64_t mix_w = std::max<uint64_t>(uint64_t(std::max<int64_t>(c.value_dim(), 0)), nhd);
    const uint32_t rows = uint32_t(plan.size());
    Verify& v = *vf_;
    const uint32_t in_rows = L.attention ? L.attn_in.rows : L.gdn_in.rows;
    auto row = [](const Buffer& b, uint64_t stride, uint32_t r, uint64_t len) { return b.view(r * stride, len); };
    stacked_qmv(e, t, L.attention ? L.attn_in : L.gdn_in, v.x, v.proj, false, normed(L.input_norm, c.eps), rows);
    if (L.attention) {
        // ---- gated full attention ----
        const ops::AttnShape as = attn_shape(c);
        const size_t ai = L.state_index;
        // rows on one state at consecutive positions (a verification) write their K/V rows in one dispatch
        bool one_run = true;
        for (uint32_t r = 1; r < rows; ++r)
            one_run = one_run && plan[r].st == plan[0].st && plan[r].position == plan[0].position + r;
        if (one_run) {
            ops::attn_prepare(e, t, as, v.proj, L.q_norm, L.k_norm, uint32_t(plan[0].position), plan[0].st->kv[ai], v.q,
                              rows, in_rows, int32_t(plan[0].st->rope_delta));
        } else {
            for (uint32_t r = 0; r < rows; ++r)
                ops::attn_prepare(e, t, as, row(v.proj, in_rows * es, r, in_rows * es), L.q_norm, L.k_norm,
                                  uint32_t(plan[r].position), plan[r].st->kv[ai], row(v.q, nhd * es, r, nhd * es), 1, 0,
                                  int32_t(plan[r].st->rope_delta));
        }
        std::vector<ops::AttnDecodeRow> ar;                                             // mix[r] = gated attention
        for (uint32_t r = 0; r < rows; ++r)
            ar.push_back({row(v.q, nhd * es, r, nhd * es), row(v.proj, in_rows * es, r, in_rows * es),
                          v.attn_part[r], row(v.mix, mix_w * es, r, nhd * es), uint32_t(plan[r].position + 1),
                          &plan[r].st->kv[ai]});
        ops::attention_decode_rows(e, t, as, m_->options().attn, plan[0].st->kv[ai], ar);
        ops::qmv(e, t, L.o_proj, v.mix, v.x, rows, false, uint32_t(mix_w), uint32_t(H), residual(v.x));
    } else {
        // ---- Gated DeltaNet, per row on its buffers (a verification: row r steps the state after row r - 1) ----
        const ops::GdnShape gs = gdn_shape(c);
        const size_t gi = L.state_index;
        const uint64_t cd = gs.conv_dim(), vd = gs.value_dim(), nv = gs.nv;
        auto conv = [&](uint32_t r) {
            const Buffer p = row(v.proj, in_rows * es, r, in_rows * es), act = row(v.conv_act, cd * es, r, cd * es);
            ops::gdn_conv(e, t, gs, p.view(0, cd * es), L.conv_w, plan[r].conv_in[gi], plan[r].conv_out[gi], act);
        };
        auto step = [&](uint32_t r) {
            const Buffer p = row(v.proj, in_rows * es, r, in_rows * es), act = row(v.conv_act, cd * es, r, cd * es);
            ops::gdn_step(e, t, gs, act, p.view(cd * es, vd * es), p.view((cd + vd) * es, nv * es),
                          p.view((cd + vd + nv) * es, nv * es), L.A_log, L.dt_bias, L.gdn_norm, c.eps,
                          plan[r].ssm_in[gi], plan[r].ssm_out[gi], row(v.mix, mix_w * es, r, vd * es));
        };
        // rows chained through one state (a verification): the conv of every row, then the recurrence of every
        // row, one dispatch each, writing the state after each row into its slot of the state's ring (2 levels;
        // each row bit for bit gdn_conv / gdn_step of one token); rows on states of their own (a batched step):
        // every conv, then every step (2 levels)
        if (plan[0].slot >= 0) {
            GpuState& st = *plan[0].st;
            const ops::GdnRingSlots ring{st.slots(), st.cur, uint32_t(plan[0].slot)};
            ops::gdn_conv_rows(e, t, gs, v.proj, L.conv_w, st.conv_slab[gi], ring, v.conv_act, rows, in_rows);
            ops::gdn_step_rows(e, t, gs, v.conv_act, v.proj, in_rows, L.A_log, L.dt_bias, L.gdn_norm, c.eps,
                               st.ssm_slab[gi], ring, v.mix, rows, uint32_t(mix_w));
        } else {
            for (uint32_t r = 0; r < rows; ++r) conv(r);
            for (uint32_t r = 0; r < rows; ++r) step(r);
        }
        ops::qmv(e, t, L.out_proj, v.mix, v.x, rows, false, uint32_t(mix_w), uint32_t(H), residual(v.x));
    }

    if (L.moe) {
        const uint32_t E = uint32_t(c.n_experts), k = uint32_t(c.top_k), rr = L.router.rows;
        const uint64_t act_w = v.act_row;
        ops::QmvFusion rf = normed(L.post_norm, c.eps, &v.xn);
        rf.round = true;                                                                // bf16 logits, as MLX
        stacked_qmv(e, t, L.router, v.x, v.router, true, rf, rows);                    // router logits, xn
        // every row's top-k (route_topk, the function the decode step fuses into gate/up: fused here too up to
        // MOE_ROWS_TOPK_FUSED_MAX rows, else moe_topk_rows first), then the union-read MoE: each expert of the
        // rows' union read once for the rows that chose it, every row the decode arithmetic. Rows in groups of
        // at most MOE_ROWS_MAX_PAIRS / k (all of them for k <= 16).
        const bool fuse = rows <= MOE_ROWS_TOPK_FUSED_MAX;
        if (!fuse) ops::moe_topk_rows(e, t, v.router, rows, rr, E, k, c.norm_topk, v.topk_ids, v.topk_w);
        const uint32_t group = std::max<uint32_t>(1, std::min<uint32_t>(rows, MOE_ROWS_MAX_PAIRS / k));
        for (uint32_t r0 = 0; r0 < rows; r0 += group) {
            const uint32_t n = std::min(group, rows - r0);
            const ops::MoeRows mr{n, uint32_t(H), uint32_t(act_w)};
            const Buffer ids = v.topk_ids.view(uint64_t(r0) * k * 4), acts = v.moe_act.view(r0 * act_w * es);
            const ops::MoeRowsRouting route{v.router.view(uint64_t(r0) * rr * 4), rr, E, c.norm_topk,
                                            v.topk_w.view(uint64_t(r0) * k * 4)};
            ops::moe_gate_up_rows(e, t, L.gate, L.up, L.has_shared ? &L.shared_gate_up : nullptr,
                                  v.xn.view(r0 * H * es), ids, k, acts, mr, fuse ? &route : nullptr);   // SwiGLU
            const Buffer shared = v.moe_shared.view(uint64_t(r0) * H * 4);
            ops::moe_down_rows(e, t, L.down, L.has_shared ? &L.shared_down : nullptr, acts, ids,
                               v.topk_w.view(uint64_t(r0) * k * 4), v.router.view(uint64_t(r0) * rr * 4), rr, E, k,
                               v.x.view(r0 * H * es), mr, &shared);                               // x[r] += moe(xn[r])
        }
    } else {
        const uint32_t I = L.mlp_down.cols;
        ops::rmsnorm(e, t, v.x, L.post_norm, v.xn, rows, uint32_t(H), c.eps);
        for (uint32_t r = 0; r < rows; ++r)
            ops::mlp_gate_up(e, t, L.mlp_gate_up, row(v.xn, H * es, r, H * es), row(v.mlp_act, I * es, r, I * es));
        ops::qmv(e, t, L.mlp_down, v.mlp_act, v.x, rows, false, I, uint32_t(H), residual(v.x));   // x += mlp(xn)
    }
}

void GpuEngine::verify_impl(GpuState& st, const int64_t* ids, int64_t n, float* logits, float* hidden,
                            const FeatureRequest* feats) {
    const Config& c = m_->config();
    if (hidden && feats)
        throw std::invalid_argument("metal backend: verify returns hidden states or layer features, not both");
    if (feats) check_feature_layers(feats->layers);
    if (n < 1) throw std::invalid_argument("metal backend: no tokens to verify");
    if (n > int64_t(kMaxVerifyRows))
        throw std::invalid_argument("metal backend: at most " + std::to_string(kMaxVerifyRows) +
                                    " tokens per verification, got " + std::to_string(n));
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= c.vocab)
            throw std::invalid_argument("metal backend: token id " + std::to_string(ids[i]) + " outside the vocabulary");
    std::lock_guard<std::mutex> lock(mu_);
    Device& d = m_->device();
    if (!d.info().executes) throw std::invalid_argument("metal backend: an encode-only device cannot verify");
    if (m_->experts())
        throw std::invalid_argument("metal backend: verification runs on resident experts (not in streaming mode)");
    if (st.rewindable() + n > int64_t(kMaxVerifyRows))
        throw std::invalid_argument("metal backend: a verification chain holds at most " +
                                    std::to_string(kMaxVerifyRows) + " tokens (" + std::to_string(st.rewindable()) +
                                    " open); rewind first");
    const uint32_t R = uint32_t(n);
    st.reserve(st.position + n);                       // everything that can fail before the state changes
    ensure_verify(R);
    const std::optional<Taps> taps = feats ? taps_for(feats->layers, R) : std::nullopt;
    const uint32_t first = st.take_rows(R);             // the ring grown first (the state unchanged)
    {
        uint32_t* dst = vf_->ids.as<uint32_t>();
        for (uint32_t r = 0; r < R; ++r) dst[r] = uint32_t(ids[r]);
        Encoder e(d, m_->options().command_buffer_seconds);
        encode_rows(e, verify_plan(st, R, first), hidden != nullptr, taps ? &*taps : nullptr);
        e.commit();
        e.wait();                                      // a failure: the rows' slots are not the chain's, the
    }                                                  // state is as it was
    std::memcpy(logits, vf_->logits.data(), size_t(R) * c.vocab * 4);
    if (hidden) widen_rows(vf_->xn, R, hidden);
    if (taps) gather(*taps, feats->layers, R, feats->out);
    st.chain_rows(R);
}

void GpuEngine::encode_rows(Encoder& e, const std::vector<RowPlan>& plan, bool hidden, const Taps* taps) {
    const Config& c = m_->config();
    const Act t = m_->options().act;
    const uint32_t rows = uint32_t(plan.size());
    Verify& v = *vf_;
    ops::embed(e, t, m_->embed, v.ids.view(0, uint64_t(rows) * 4), rows, v.x);          // x = embed(ids)
    for (size_t li = 0; li < m_->layers.size(); ++li) {
        encode_rows_layer(e, plan, li);
        tap(e, taps, li, v.x, rows);                                                     // features[li] = x
    }
    ops::qmv(e, t, m_->lm_head, v.x, v.logits, rows, true, 0, 0,
             normed(m_->final_norm, c.eps, hidden ? &v.xn : nullptr));                   // logits (f32) [, hidden]
}

// ---------------------------------------------------------------------------------------------- batched decode
// One decode step of B independent sequences (docs/metal.md, "The batched decode step"): the verification
// graph (encode_rows) with row r on states[r] -- its position, its KV cache, its GDN halves (read the
// current, write the other, as a decode step) -- then every state's halves flipped.
void GpuEngine::check_batch(const std::vector<GpuState*>& states, int64_t B) {
    if (B < 1 || B > int64_t(kMaxBatchRows))
        throw std::invalid_argument("metal backend: a batched decode step takes 1.." + std::to_string(kMaxBatchRows) +
                                    " sequences, got " + std::to_string(B));
    if (int64_t(states.size()) != B)
        throw std::invalid_argument("metal backend: " + std::to_string(states.size()) + " states for " +
                                    std::to_string(B) + " tokens");
    for (size_t r = 0; r < states.size(); ++r) {
        if (!states[r]) throw std::invalid_argument("metal backend: state " + std::to_string(r) + " is null");
        if (&states[r]->model() != m_.get())
            throw std::invalid_argument("metal backend: state " + std::to_string(r) + " belongs to another model");
        for (size_t q = 0; q < r; ++q)
            if (states[q] == states[r])
                throw std::invalid_argument("metal backend: the same state twice in a batch (rows " +
                                            std::to_string(q) + " and " + std::to_string(r) + ")");
    }
    if (m_->experts())
        throw std::invalid_argument("metal backend: a batched decode step runs on resident experts (not in streaming mode)");
}

void GpuEngine::decode_batch_impl(const std::vector<GpuState*>& states, const int64_t* ids, int64_t B, float* logits) {
    const Config& c = m_->config();
    check_batch(states, B);
    for (int64_t i = 0; i < B; ++i)
        if (ids[i] < 0 || ids[i] >= c.vocab)
            throw std::invalid_argument("metal backend: token id " + std::to_string(ids[i]) + " outside the vocabulary");
    std::lock_guard<std::mutex> lock(mu_);
    Device& d = m_->device();
    if (!d.info().executes) throw std::invalid_argument("metal backend: an encode-only device cannot decode");
    for (GpuState* st : states) st->reserve(st->position + 1);   // everything that can fail before a state changes
    ensure_verify(uint32_t(B));
    uint32_t* dst = vf_->ids.as<uint32_t>();
    for (int64_t r = 0; r < B; ++r) dst[r] = uint32_t(ids[r]);
    Encoder e(d, m_->options().command_buffer_seconds);
    encode_rows(e, batch_plan(states), false);
    e.commit();
    e.wait();                                          // a failure leaves every state as it was (halves unflipped)
    std::memcpy(logits, vf_->logits.data(), size_t(B) * c.vocab * 4);
    for (GpuState* st : states) {
        st->end_chain();                               // the chain's last set is the current half read above
        st->commit_step();
    }
}

void GpuEngine::rewind(GpuState& st, int64_t keep) {
    std::lock_guard<std::mutex> lock(mu_);
    if (st.rewindable() == 0) throw std::invalid_argument("nothing to rewind (no open verify chain on this state)");
    if (keep < 0 || keep > st.rewindable())
        throw std::invalid_argument("rewind keeps 0.." + std::to_string(st.rewindable()) + " tokens, got " +
                                    std::to_string(keep));
    st.rewind(keep);
}

StepCost cost_of(const Encoder& e, const Counters& k) {
    StepCost r;
    r.dispatches = e.stats().dispatches;
    r.levels = e.stats().levels;
    r.bytes_read = e.stats().bytes_read;
    r.bytes_written = e.stats().bytes_written;
    r.flops = e.stats().flops;
    r.command_buffers = k.command_buffers;
    r.host_waits = k.host_waits;
    r.per_level = e.level_stats();
    r.command_buffer_levels = e.command_buffer_levels();
    if (r.command_buffer_levels.empty()) r.command_buffer_levels.push_back(0);
    return r;
}

StepCost GpuEngine::encode_cost_impl(GpuState& st, const std::vector<int64_t>& layers) {
    std::lock_guard<std::mutex> lock(mu_);
    Device& d = m_->device();
    const std::optional<Taps> taps = taps_for(layers, 1);
    d.reset_counters();
    auto cb = d.command_buffer();
    Encoder e(d, *cb);
    SamplingConfig greedy;
    encode_step(e, st, st.position, 0, 1, &greedy, taps ? &*taps : nullptr);
    cb->commit();
    cb->wait();
    return cost_of(e, d.counters());
}

StepCost GpuEngine::prefill_cost_impl(GpuState& st, uint32_t rows, bool all_logits,
                                      const std::vector<int64_t>& layers) {
    if (rows < 1) throw std::invalid_argument("prefill_cost: rows must be >= 1");
    std::lock_guard<std::mutex> lock(mu_);
    Device& d = m_->device();
    st.end_chain();
    st.reserve(st.position + rows);
    ensure_chunk(rows, all_logits);
    const std::optional<Taps> taps = taps_for(layers, rows);
    d.reset_counters();
    Encoder e(d, m_->options().command_buffer_seconds);
    encode_chunk(e, st, st.position, rows, all_logits ? 2 : 1, taps ? &*taps : nullptr);
    e.commit();
    e.wait();
    st.commit_step(rows);
    return cost_of(e, d.counters());
}

StepCost GpuEngine::verify_cost_impl(GpuState& st, uint32_t rows, const std::vector<int64_t>& layers) {
    if (rows < 1 || rows > kMaxVerifyRows)
        throw std::invalid_argument("verify_cost: rows must be in 1.." + std::to_string(kMaxVerifyRows));
    std::lock_guard<std::mutex> lock(mu_);
    Device& d = m_->device();
    st.end_chain();
    st.reserve(st.position + rows);
    ensure_verify(rows);
    const std::optional<Taps> taps = taps_for(layers, rows);
    const uint32_t first = st.take_rows(rows);
    d.reset_counters();
    Encoder e(d, m_->options().command_buffer_seconds);
    encode_rows(e, verify_plan(st, rows, first), false, taps ? &*taps : nullptr);
    e.commit();
    e.wait();                                          // costed only: the state does not advance
    return cost_of(e, d.counters());
}

StepCost GpuEngine::batch_cost_impl(const std::vector<GpuState*>& states) {
    check_batch(states, int64_t(states.size()));
    std::lock_guard<std::mutex> lock(mu_);
    Device& d = m_->device();
    for (GpuState* st : states) st->reserve(st->position + 1);
    ensure_verify(uint32_t(states.size()));
    d.reset_counters();
    Encoder e(d, m_->options().command_buffer_seconds);
    encode_rows(e, batch_plan(states), false);
    e.commit();
    e.wait();                                          // costed only: no state advances
    return cost_of(e, d.counters());
}

// ---------------------------------------------------------------------------------------------- recovery

void GpuEngine::forward(GpuState& s, const int64_t* ids, int64_t n, int want, float* logits, InterruptPoll poll,
                        const FeatureRequest* feats, float* hidden, const RowInputs* rows) {
    recovering(m_->device(), [&] { forward_impl(s, ids, n, want, logits, poll, feats, hidden, rows); });
}

std::vector<int32_t> GpuEngine::decode(GpuState& s, int32_t first, int64_t n, const SamplingConfig& sc,
                                       const std::vector<int32_t>& stop_ids, bool pipelined, InterruptPoll poll) {
    return recovering(m_->device(), [&] { return decode_impl(s, first, n, sc, stop_ids, pipelined, poll); });
}

void GpuEngine::verify(GpuState& s, const int64_t* ids, int64_t n, float* logits, float* hidden,
                       const FeatureRequest* feats) {
    recovering(m_->device(), [&] { verify_impl(s, ids, n, logits, hidden, feats); });
}

StepCost GpuEngine::encode_cost(GpuState& s, const std::vector<int64_t>& layers) {
    return recovering(m_->device(), [&] { return encode_cost_impl(s, layers); });
}

StepCost GpuEngine::prefill_cost(GpuState& s, uint32_t rows, bool all_logits, const std::vector<int64_t>& layers) {
    return recovering(m_->device(), [&] { return prefill_cost_impl(s, rows, all_logits, layers); });
}

StepCost GpuEngine::verify_cost(GpuState& s, uint32_t rows, const std::vector<int64_t>& layers) {
    return recovering(m_->device(), [&] { return verify_cost_impl(s, rows, layers); });
}

void GpuEngine::decode_batch(const std::vector<GpuState*>& states, const int64_t* ids, int64_t B, float* logits) {
    recovering(m_->device(), [&] { decode_batch_impl(states, ids, B, logits); });
}

StepCost GpuEngine::batch_cost(const std::vector<GpuState*>& states) {
    return recovering(m_->device(), [&] { return batch_cost_impl(states); });
}

}  // namespace qwenmetal::gpu

// The decode graph of the Metal backend: one token of the hybrid Gated DeltaNet / gated attention /
// MoE model (model-spec §4) as one command buffer, read top to bottom over named scratch buffers.
// Every call below is the host function of one kernel (src/gpu/ops/<family>.cpp); the encoder puts
// memory barriers where a dispatch reads what an earlier one of its level wrote.
//
//   x  = embed(tokens[in])                         the input token is read on the GPU
//   for each layer:
//       proj = W_in rmsnorm(x)                     stacked [q+gate | k | v] or [qkv | z | b | a]; the
//                                                  input norm is fused into the GEMV
//       mix  = attention(proj) | gdn(proj)
//       x   += W_out mix                           the residual add is fused into the GEMV
//       router = W_r rmsnorm(x), xn = rmsnorm(x)   post-attention norm fused into the router GEMV
//       x   += moe(xn)                             top-k fused into gate/up; residual into down
//           | mlp(rmsnorm(x))                      (dense layers: norm, gate/up, down + residual)
//   logits = lm_head rmsnorm(x) (float)            the final norm fused into the GEMV
//   tokens[out] = argmax(logits) | sample(logits)  read by the next step, and by the host (4 bytes)
//
// Dependency levels per token: GDN layer 7 (in-proj, conv, step, out-proj, router, gate/up, down),
// attention layer 8 or 9 (prepare, attention in 1 or 2 passes); embed, lm_head and argmax 4.
#include <algorithm>
#include <cstring>

#include "gpu/model.h"
#include "gpu/ops/moe.h"
#include "gpu/ops/norm.h"

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

// y[:st.rows] = st x: one qmv per part, into consecutive row ranges of y (each part normalises its
// input itself when the RMSNorm is fused; only the first stores the normalised input)
void stacked_qmv(Encoder& e, Act t, const Stacked& st, const Buffer& x, const Buffer& y, bool f32_out,
                 const ops::QmvFusion& fuse) {
    const uint64_t es = f32_out ? 4 : act_size(t);
    uint64_t row = 0;
    ops::QmvFusion f = fuse;
    for (const Matrix& m : st.parts) {
        ops::qmv(e, t, m, x, y.view(row * es, uint64_t(m.rows) * es), 1, f32_out, 0, 0, f);
        f.xn = nullptr;
        row += m.rows;
    }
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

// One buffer per logical tensor of a decode step (shapes for one token).
struct GpuEngine::Scratch {
    Buffer x;              // T [H]              residual stream
    Buffer xn;             // T [H]              normalised input of the current block
    Buffer proj;           // T [max in rows]    stacked input projection of the attention / GDN block
    Buffer conv_act;       // T [conv_dim]       GDN q | k | v after the conv and SiLU
    Buffer q;              // T [nh * hd]        attention queries after norm + RoPE
    Buffer attn_part;      // f32                attention partial results (split-K / two-pass routes)
    Buffer mix;            // T [max(value_dim, nh * hd)]  block output before the out projection
    Buffer router;         // f32 [E + 1]        router logits (+ the shared-expert gate logit)
    Buffer topk_ids;       // u32 [k]
    Buffer topk_w;         // f32 [k]
    Buffer moe_act;        // T [k + 1, max(I, Is)]  SwiGLU activations of the routed + shared experts
    Buffer mlp_act;        // T [I]              dense-MLP SwiGLU activations
    Buffer logits;         // f32 [V]
    Buffer tokens;         // u32 [kSlots]       token ring
    Buffer sample;         // f32/u32            argmax / sampler scratch
};

GpuEngine::GpuEngine(std::shared_ptr<GpuModel> m) : m_(std::move(m)), sc_(std::make_unique<Scratch>()) {
    const Config& c = m_->config();
    Device& d = m_->device();
    const Act t = m_->options().act;
    const uint64_t es = act_size(t);
    uint32_t in_rows = 0, inter = 0;
    bool any_mlp = false;
    for (const GpuLayer& L : m_->layers) {
        in_rows = std::max(in_rows, L.attention ? L.attn_in.rows : L.gdn_in.rows);
        if (L.moe) inter = std::max({inter, L.gate.rows, L.has_shared ? L.shared_down.cols : 0u});
        else any_mlp = true;
    }
    const uint64_t nhd = uint64_t(c.n_heads) * c.head_dim;
    Scratch& s = *sc_;
    s.x = d.alloc(c.hidden * es, "x");
    s.xn = d.alloc(c.hidden * es, "xn");
    s.proj = d.alloc(in_rows * es, "proj");
    s.conv_act = d.alloc(std::max<int64_t>(c.conv_dim(), 1) * es, "conv_act");
    s.q = d.alloc(nhd * es, "q");
    // the partials of every route are bounded (the two-pass route's count is capped): size for any context
    s.attn_part = d.alloc(std::max<uint64_t>(ops::attention_scratch_bytes(attn_shape(c), UINT32_MAX,
                                                                          m_->options().attn), 16), "attn_part");
    s.mix = d.alloc(std::max<uint64_t>(c.value_dim(), nhd) * es, "mix");
    s.router = d.alloc((c.n_experts + 1) * 4, "router");
    s.topk_ids = d.alloc(std::max<int64_t>(c.top_k, 1) * 4, "topk_ids");
    s.topk_w = d.alloc(std::max<int64_t>(c.top_k, 1) * 4, "topk_w");
    s.moe_act = d.alloc(std::max<uint64_t>((c.top_k + 1) * uint64_t(inter), 1) * es, "moe_act");
    s.mlp_act = d.alloc(std::max<int64_t>(any_mlp ? c.dense_inter : 1, 1) * es, "mlp_act");
    s.logits = d.alloc(c.vocab * 4, "logits");
    s.tokens = d.alloc(kSlots * 4, "tokens");
    s.sample = d.alloc(ops::sample_scratch_bytes(uint32_t(c.vocab)), "sample");
}

GpuEngine::~GpuEngine() = default;

void GpuEngine::encode_layer(Encoder& e, GpuState& st, size_t li, int64_t position) {
    const Config& c = m_->config();
    const GpuLayer& L = m_->layers[li];
    const Act t = m_->options().act;
    const uint64_t es = act_size(t);
    const uint32_t H = uint32_t(c.hidden);
    Scratch& s = *sc_;

    if (L.attention) {
        // ---- gated full attention ----
        const ops::AttnShape as = attn_shape(c);
        const size_t ai = L.state_index;
        stacked_qmv(e, t, L.attn_in, s.x, s.proj, false, normed(L.input_norm, c.eps));   // proj = [q+gate | k | v]
        ops::attn_prepare(e, t, as, s.proj, L.q_norm, L.k_norm, uint32_t(position), st.kv[ai], s.q);
        ops::attention_decode(e, t, as, m_->options().attn, s.q, s.proj, st.kv[ai], uint32_t(position + 1),
                              s.attn_part, s.mix);                                      // mix = gated attention
        ops::qmv(e, t, L.o_proj, s.mix, s.x, 1, false, 0, 0, residual(s.x));           // x += o_proj(mix)
    } else {
        // ---- Gated DeltaNet ----
        const ops::GdnShape gs = gdn_shape(c);
        const size_t gi = L.state_index;
        const uint64_t cd = gs.conv_dim(), vd = gs.value_dim(), nv = gs.nv;
        stacked_qmv(e, t, L.gdn_in, s.x, s.proj, false, normed(L.input_norm, c.eps));    // proj = [qkv | z | b | a]
        ops::gdn_conv(e, t, gs, s.proj.view(0, cd * es), L.conv_w, st.conv_in(gi), st.conv_next(gi), s.conv_act);
        ops::gdn_step(e, t, gs, s.conv_act, s.proj.view(cd * es, vd * es), s.proj.view((cd + vd) * es, nv * es),
                      s.proj.view((cd + vd + nv) * es, nv * es), L.A_log, L.dt_bias, L.gdn_norm, c.eps,
                      st.ssm_in(gi), st.ssm_next(gi), s.mix);                           // mix = gated-normed output
        ops::qmv(e, t, L.out_proj, s.mix, s.x, 1, false, 0, 0, residual(s.x));         // x += out_proj(mix)
    }

    if (L.moe) {
        const uint32_t E = uint32_t(c.n_experts), k = uint32_t(c.top_k);
        ops::QmvFusion rf = normed(L.post_norm, c.eps, &s.xn);
        rf.round = true;                                                                // bf16 logits, as MLX
        stacked_qmv(e, t, L.router, s.x, s.router, true, rf);                          // router logits, xn
        const ops::MoeRouting route{s.router, E, c.norm_topk, s.topk_w};
        ops::moe_gate_up(e, t, L.gate, L.up, L.has_shared ? &L.shared_gate_up : nullptr, s.xn, s.topk_ids, k,
                         s.moe_act, &route);                                            // top-k + SwiGLU
        ops::moe_down(e, t, L.down, L.has_shared ? &L.shared_down : nullptr, s.moe_act, s.topk_ids, s.topk_w,
                      s.router, E, k, s.x);                                             // x += moe(xn)
    } else {
        ops::rmsnorm(e, t, s.x, L.post_norm, s.xn, 1, H, c.eps);
        ops::mlp_gate_up(e, t, L.mlp_gate_up, s.xn, s.mlp_act);
        ops::qmv(e, t, L.mlp_down, s.mlp_act, s.x, 1, false, 0, 0, residual(s.x));     // x += mlp(xn)
    }
}

void GpuEngine::encode_step(Encoder& e, GpuState& st, int64_t position, uint32_t in_slot, uint32_t out_slot,
                            const SamplingConfig* sc) {
    const Config& c = m_->config();
    const Act t = m_->options().act;
    Scratch& s = *sc_;
    ops::embed(e, t, m_->embed, s.tokens.view(in_slot * 4, 4), 1, s.x);                // x = embed(token)
    for (size_t li = 0; li < m_->layers.size(); ++li) encode_layer(e, st, li, position);
    ops::qmv(e, t, m_->lm_head, s.x, s.logits, 1, true, 0, 0, normed(m_->final_norm, c.eps));   // logits (f32)
    if (sc) {
        const Buffer tok = s.tokens.view(out_slot * 4, 4);
        const uint32_t V = sc->vocab && sc->vocab < c.vocab ? sc->vocab : uint32_t(c.vocab);
        if (sc->greedy) ops::argmax(e, s.logits, V, tok, s.sample);
        else {
            ops::SampleParams p = sc->params;
            p.position = uint64_t(position);
            ops::sample(e, s.logits, V, p, tok, s.sample);
        }
    }
}

void GpuEngine::forward(GpuState& st, const int64_t* ids, int64_t n, int want, float* logits, InterruptPoll poll) {
    const Config& c = m_->config();
    if (n < 1) throw std::invalid_argument("metal backend: no tokens");
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= c.vocab)
            throw std::invalid_argument("metal backend: token id " + std::to_string(ids[i]) + " outside the vocabulary");
    std::lock_guard<std::mutex> lock(mu_);
    Device& d = m_->device();
    if (!d.info().executes) throw std::invalid_argument("metal backend: an encode-only device cannot run forward()");
    st.reserve(st.position + n);                       // KV growth first (strong guarantee)
    const GpuState::Saved saved = n > 1 ? st.save() : GpuState::Saved{};
    try {
        for (int64_t i = 0; i < n; ++i) {
            if (poll && i > 0) poll();                 // between tokens: nothing in flight
            uint32_t tok = uint32_t(ids[i]);
            std::memcpy(sc_->tokens.data(), &tok, 4);
            auto cb = d.command_buffer();
            Encoder e(d, *cb);
            encode_step(e, st, st.position, 0, 1, nullptr);
            cb->commit();
            cb->wait();
            st.commit_step();
            const bool keep = want == 2 || (want == 1 && i == n - 1);
            if (keep)
                std::memcpy(logits + (want == 2 ? i * c.vocab : 0), sc_->logits.data(), size_t(c.vocab) * 4);
        }
    } catch (...) {
        if (n > 1) st.restore(saved);                  // one token: the ping-pong halves were not flipped
        throw;
    }
}

std::vector<int32_t> GpuEngine::decode(GpuState& st, int32_t first, int64_t n, const SamplingConfig& sc,
                                       const std::vector<int32_t>& stop_ids, bool pipelined, InterruptPoll poll) {
    const Config& c = m_->config();
    if (first < 0 || first >= c.vocab)
        throw std::invalid_argument("metal backend: token id " + std::to_string(first) + " outside the vocabulary");
    std::vector<int32_t> out;
    if (n <= 0) return out;
    std::lock_guard<std::mutex> lock(mu_);
    Device& d = m_->device();
    st.reserve(st.position + n);
    uint32_t tok0 = uint32_t(first);
    if (sc_->tokens.data()) std::memcpy(sc_->tokens.data(), &tok0, 4);
    const int64_t p0 = st.position;
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
            st.cur ^= 1u;                                  // step i + 1 reads step i's output half
            if (pipelined && i + 1 < n) next = encode(i + 1);   // committed before step i is waited on
            st.cur ^= 1u;
            try {
                cur->wait();
            } catch (...) {
                if (next) next->wait();
                throw;
            }
            st.commit_step();                              // step i is now the state
            uint32_t tok = 0;
            if (sc_->tokens.data()) std::memcpy(&tok, sc_->tokens.as<uint8_t>() + ((i + 1) % kSlots) * 4, 4);
            out.push_back(int32_t(tok));
            const bool stop = std::find(stop_ids.begin(), stop_ids.end(), int32_t(tok)) != stop_ids.end();
            if (stop || i + 1 == n) {
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

StepCost GpuEngine::encode_cost(GpuState& st) {
    std::lock_guard<std::mutex> lock(mu_);
    Device& d = m_->device();
    d.reset_counters();
    auto cb = d.command_buffer();
    Encoder e(d, *cb);
    SamplingConfig greedy;
    encode_step(e, st, st.position, 0, 1, &greedy);
    cb->commit();
    cb->wait();
    const Counters k = d.counters();
    StepCost r;
    r.dispatches = e.stats().dispatches;
    r.levels = e.stats().levels;
    r.bytes_read = e.stats().bytes_read;
    r.bytes_written = e.stats().bytes_written;
    r.command_buffers = k.command_buffers;
    return r;
}

}  // namespace qwenmetal::gpu

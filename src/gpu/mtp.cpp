// The MTP head's drafting round on the Metal graph (docs/metal.md, "The MTP head"; the head's math:
// ReferenceMtp in python/qwenmetal/backends/reference.py). The head is a GpuModel of its own (built from the
// head's tensors over the main model's embedding and lm_head: n full-attention MoE layers, GpuModel::mtp), run
// by a GpuEngine of its own (its scratch, its KV caches in a GpuState), with the decode graph's layer encoding
// (encode_layer) and one input block in place of the embedding:
//
//   x      = fc([rmsnorm(embed(t), pre_fc_norm_embedding); rmsnorm(h, pre_fc_norm_hidden)])
//   x      = decoder layer j mod n (x)         attention at a RoPE position apart from its cache row
//   h      = rmsnorm(x, norm)                  the next step's hidden state (T, as the reference rounds it)
//   logits = lm_head h (f32); tokens[next] = argmax(logits)     read by the next step's embedding
//
// A round is one command buffer: the m pairs the verification returned through layer 0 as the verification
// graph's rows pass (encode_rows_layer: each weight read once for up to kMaxVerifyRows rows; only the last pair's
// logits are computed), then the k - 1 chained steps one token each (encode_layer); the host writes the pairs'
// ids and hidden rows before it and reads the k drafts (4 bytes each) after it. Nothing is read back in between:
// the chain's token goes from the argmax kernel to the next embedding through the token buffer, as in the
// decode loop.
#include <cstring>
#include <string>

#include "core/dtype.h"
#include "gpu/model.h"
#include "gpu/ops/norm.h"
#include "gpu/scratch.h"

namespace qwenmetal::gpu {

void GpuEngine::encode_mtp_input(Encoder& e, const Buffer& tok, const Buffer& hid, uint32_t rows, const Buffer& x) {
    const Config& c = m_->config();
    const Act t = m_->options().act;
    const uint32_t H = uint32_t(c.hidden);
    const uint64_t es = act_size(t), row = uint64_t(H) * es;
    MtpScratch& M = mtp_;
    ops::embed(e, t, m_->embed, tok.view(0, uint64_t(rows) * 4), rows, M.emb);              // embed(t) rows
    for (uint32_t r = 0; r < rows; ++r) {                                                   // side by side
        ops::rmsnorm(e, t, M.emb.view(r * row, row), m_->fc_norm_e, M.cat.view(2 * r * row, row), 1, H, c.eps);
        ops::rmsnorm(e, t, hid.view(r * row, row), m_->fc_norm_h, M.cat.view((2 * r + 1) * row, row), 1, H, c.eps);
    }
    ops::qmv(e, t, m_->fc, M.cat, x, rows);                                                  // x = fc(cat) rows
}

size_t GpuEngine::mtp_draft(GpuState& s, const float* hidden, const int64_t* ids, int64_t m, int64_t k,
                            uint32_t vocab, int32_t* drafts, float* logits) {
    try {
        return mtp_draft_impl(s, hidden, ids, m, k, vocab, drafts, logits);
    } catch (const DeviceError&) {
        m_->device().recover();
        throw;
    }
}

StepCost GpuEngine::mtp_cost(GpuState& s, int64_t m, int64_t k) {
    try {
        return mtp_cost_impl(s, m, k);
    } catch (const DeviceError&) {
        m_->device().recover();
        throw;
    }
}

void GpuEngine::mtp_prepare(GpuState& st, int64_t m, int64_t k, bool logits) {
    const Config& c = m_->config();
    if (!m_->mtp) throw std::invalid_argument("metal backend: mtp_draft needs an MTP head's model (its fc)");
    if (&st.model() != m_.get()) throw std::invalid_argument("metal backend: the state belongs to another model");
    if (m < 1 || m > int64_t(kMaxMtpPairs))
        throw std::invalid_argument("metal backend: an MTP round takes 1.." + std::to_string(kMaxMtpPairs) +
                                    " (hidden, token) pairs, got " + std::to_string(m));
    if (k < 0 || k > int64_t(kMaxMtpDrafts))
        throw std::invalid_argument("metal backend: an MTP round drafts 0.." + std::to_string(kMaxMtpDrafts) +
                                    " tokens, got " + std::to_string(k));
    if (m_->experts()) throw std::invalid_argument("metal backend: an MTP head runs on resident experts");
    Device& d = m_->device();
    const uint64_t es = act_size(m_->options().act), H = uint64_t(c.hidden), V = uint64_t(c.vocab);
    const uint32_t R = uint32_t(m), K = uint32_t(k);
    // everything that can fail before the state changes: KV room for the pairs and the drafts, scratch
    st.reserve(st.position + m + k);
    MtpScratch& M = mtp_;
    if (!M.hin.valid() || M.rows < R) {
        M.rows = std::max(R, 4 * kMaxVerifyRows);
        M.hin = d.alloc(M.rows * H * es, "mtp.hin");
        M.tok = Buffer{};
    }
    if (!M.tok.valid() || M.steps < K) {
        M.steps = std::max(M.steps, kMaxMtpDrafts);
        M.tok = d.alloc((M.rows + M.steps) * 4, "mtp.tok");
        M.lg = Buffer{};
    }
    if (!M.emb.valid()) {
        M.emb = d.alloc(kMaxVerifyRows * H * es, "mtp.emb");
        M.cat = d.alloc(kMaxVerifyRows * 2 * H * es, "mtp.cat");
        M.h = d.alloc(H * es, "mtp.h");
    }
    ensure_verify(std::min(R, kMaxVerifyRows));
    if (logits && !M.lg.valid()) M.lg = d.alloc(M.steps * V * 4, "mtp.logits");
}

void GpuEngine::encode_mtp_round(Encoder& e, GpuState& st, uint32_t R, uint32_t K, uint32_t vocab, bool logits) {
    const Config& c = m_->config();
    const Act t = m_->options().act;
    const uint64_t es = act_size(t), H = uint64_t(c.hidden), V = uint64_t(c.vocab);
    const uint32_t nl = uint32_t(m_->layers.size());
    const uint32_t Vs = vocab && vocab < V ? vocab : uint32_t(V);
    MtpScratch& M = mtp_;
    auto logits_of = [&](uint32_t j) { return logits ? M.lg.view(j * V * 4, V * 4) : sc_->logits; };
    auto tok_at = [&](uint32_t i) { return M.tok.view(uint64_t(i) * 4, 4); };
    auto head = [&](const Buffer& x, uint32_t j) {   // h = rmsnorm(x, norm); logits = lm_head h; draft j + 1 = argmax
        ops::rmsnorm(e, t, x, m_->final_norm, M.h, 1, uint32_t(H), c.eps);
        ops::qmv(e, t, m_->lm_head, M.h, logits_of(j), 1, true);
        ops::argmax(e, logits_of(j), Vs, tok_at(R + j), sc_->sample);
    };
    const int64_t p0 = st.position;
    // the state's rope_delta carries each step's RoPE position - cache row (0 for the pairs), set while encoding
    // (the kernels' params are copied at encode time) and restored however the round ends
    struct DeltaBack {
        GpuState& st;
        int64_t was;
        ~DeltaBack() { st.rope_delta = was; }
    } delta_back{st, st.rope_delta};
    st.rope_delta = 0;
    // the pairs through layer 0, kept: the verification graph's rows pass (each weight read once for up to
    // kMaxVerifyRows rows, every row the decode step's arithmetic) at cache rows = RoPE positions p0..
    Verify& v = *vf_;
    uint32_t last = 0;
    for (uint32_t b0 = 0; b0 < R; b0 += kMaxVerifyRows) {
        const uint32_t n = std::min(kMaxVerifyRows, R - b0);
        encode_mtp_input(e, M.tok.view(uint64_t(b0) * 4), M.hin.view(b0 * H * es), n, v.x);
        std::vector<RowPlan> plan(n);
        for (uint32_t r = 0; r < n; ++r) {
            plan[r].st = &st;
            plan[r].position = p0 + b0 + r;
        }
        encode_rows_layer(e, plan, 0);
        last = n - 1;
    }
    if (K > 0) head(v.x.view(last * H * es, H * es), 0);   // k = 0: the pairs only (a prompt's)
    // the chain: step j (1..k-1) through layer j mod n at RoPE position p0 + R - 1 + j; each layer's entries after
    // its kept rows (layer 0: the pairs; the others keep none)
    std::vector<int64_t> row(nl, 0);
    row[0] = p0 + R;
    for (uint32_t j = 1; j < K; ++j) {
        const uint32_t l = j % nl;
        const int64_t rope = p0 + R - 1 + j, at = row[l]++;
        encode_mtp_input(e, tok_at(R + j - 1), M.h, 1, sc_->x);
        st.rope_delta = rope - at;
        encode_layer(e, st, l, at);
        head(sc_->x, j);
    }
}

size_t GpuEngine::mtp_draft_impl(GpuState& st, const float* hidden, const int64_t* ids, int64_t m, int64_t k,
                                 uint32_t vocab, int32_t* drafts, float* logits) {
    const Config& c = m_->config();
    for (int64_t i = 0; i < m; ++i)
        if (ids[i] < 0 || ids[i] >= c.vocab)
            throw std::invalid_argument("metal backend: token id " + std::to_string(ids[i]) + " outside the vocabulary");
    std::lock_guard<std::mutex> lock(mu_);
    Device& d = m_->device();
    if (!d.info().executes) throw std::invalid_argument("metal backend: an encode-only device cannot draft");
    mtp_prepare(st, m, k, logits != nullptr);
    const Act t = m_->options().act;
    const uint64_t H = uint64_t(c.hidden), V = uint64_t(c.vocab);
    const uint32_t R = uint32_t(m), K = uint32_t(k);
    MtpScratch& M = mtp_;
    uint32_t* tk = M.tok.as<uint32_t>();
    for (uint32_t r = 0; r < R; ++r) tk[r] = uint32_t(ids[r]);
    if (t == Act::F32) std::memcpy(M.hin.data(), hidden, R * H * 4);
    else {
        uint16_t* hb = M.hin.as<uint16_t>();
        for (uint64_t i = 0; i < R * H; ++i) hb[i] = f32_to_bf16(hidden[i]);   // the rows are bf16 values widened
    }
    Encoder e(d, m_->options().command_buffer_seconds);
    encode_mtp_round(e, st, R, K, vocab, logits != nullptr);
    e.commit();
    e.wait();                                 // a failure: the pairs' rows are past the position, the state as it was
    for (uint32_t j = 0; j < K; ++j) drafts[j] = int32_t(tk[R + j]);
    if (logits) std::memcpy(logits, M.lg.data(), size_t(K) * V * 4);
    st.end_chain();
    st.position += m;                         // the pairs are kept; the drafts' rows past it are dropped
    return e.command_buffers();
}

StepCost GpuEngine::mtp_cost_impl(GpuState& st, int64_t m, int64_t k) {
    std::lock_guard<std::mutex> lock(mu_);
    Device& d = m_->device();
    mtp_prepare(st, m, k, false);
    d.reset_counters();
    Encoder e(d, m_->options().command_buffer_seconds);
    encode_mtp_round(e, st, uint32_t(m), uint32_t(k), 0, false);
    e.commit();
    e.wait();                                 // costed only: the state does not advance
    return cost_of(e, d.counters());
}

}  // namespace qwenmetal::gpu

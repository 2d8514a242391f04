// The forward graph of the hybrid Gated DeltaNet / gated attention / MoE model (docs/model.md §4),
// written to be read next to python/qwenmetal/reference.py. Every heavy step is a kernel of one
// family in src/cpu/ (quant, norm, attention, gdn, moe) run on the engine's thread pool.
//
//   x = embed(ids)                                            chunk of L <= prefill_chunk tokens
//   for each layer:
//       xn = RMSNorm(x)
//       x += GatedAttention(xn) | GatedDeltaNet(xn)           the output projection adds into x
//       xn = RMSNorm(x)
//       x += MoE(xn) | MLP(xn)                                the down projections add into x
//       [features: x copied out if the layer is listed]       a DFlash draft's context (LayerFeatures)
//   logits = RMSNorm(x[rows asked for]) @ lm_head^T
//
// A speculative call (the verification of drafted tokens) computes every row as a one-token call would,
// and keeps what rewind() needs to land on the state after any prefix of its tokens (docs/speculative.md).
//
// Activations are float32 throughout; weights stay in their stored format (4/8-bit or 16/32-bit
// floats) and are converted in registers. Scratch is sized by the chunk, never by the prompt.
#include <algorithm>
#include <stdexcept>

#include "cpu/engine.h"
#include "cpu/attention.h"
#include "core/fpenv.h"
#include "cpu/gdn.h"
#include "cpu/moe.h"
#include "cpu/norm.h"
#include "cpu/quant.h"

namespace qwenmetal {

using namespace cpu;

namespace {
AttnDims attn_dims(const Config& c) {
    const int64_t qs = c.attn_output_gate ? 2 * c.head_dim : c.head_dim;
    return AttnDims{c.n_heads, c.n_kv_heads, c.head_dim, c.rotary_dim, qs, c.q_proj_rows(), c.eps};
}
MoeDims moe_dims(const Config& c) {
    return MoeDims{c.hidden, c.n_experts, c.moe_inter, c.shared_inter, c.top_k};
}
}  // namespace

// Grow every scratch buffer a chunk of L tokens ending at context length T can need. Called before
// the state is touched: after it, the forward pass allocates nothing and cannot fail.
void Engine::reserve_scratch(int64_t L, int64_t T, bool speculative) {
    const Config& c = cfg_;
    const int64_t H = c.hidden, vd = c.value_dim(), kvd = c.n_kv_heads * c.head_dim;
    const int64_t cat = mtp_ ? 2 * H : 0;       // an MTP head's [embedding; hidden] rows
    int64_t Kmax = std::max({H, c.n_heads * c.head_dim, vd, c.moe_inter, c.shared_inter, c.dense_inter, cat});
    x_.get(L * H);
    xn_.get(L * H);
    buf_a_.get(L * std::max({c.conv_dim(), c.q_proj_rows(), vd}) + 16);
    buf_b_.get(L * std::max(vd + 4 * c.nv, 2 * kvd) + 16);
    buf_c_.get(L * std::max({c.conv_dim(), c.n_heads * c.head_dim, cat}) + 16);
    const AttnDims ad = attn_dims(c);
    const MoeDims md = moe_dims(c);
    // a speculative call runs the one-token attention per row, and the MoE's decode path for all rows
    size_t shared = attention_shared_floats(ad, speculative ? 1 : L, T);
    const int64_t gemv_rows = speculative ? std::max(L, kGemvMaxRows) : kGemvMaxRows;
    size_t per_thread = std::max(linear_thread_floats(Kmax), attention_thread_floats(ad));
    per_thread = std::max(per_thread, gdn_chunk_floats(c.dk, c.dv));
    size_t xv = linear_xvec_floats(Kmax, L), n_xv = size_t(L);
    if (c.n_experts > 0) {
        shared = std::max(shared, moe_shared_floats(md, L, gemv_rows));
        per_thread = std::max(per_thread, moe_thread_floats(md, L));
        xv = std::max(xv, moe_xvec_floats(md, L));
        n_xv = std::max(n_xv, moe_xvec_count(md, L));
    }
    if (c.dense_inter > 0) shared = std::max(shared, mlp_shared_floats(c.dense_inter, L));
    shared_.get(shared + 16);
    ws_.reserve(per_thread, xv, n_xv);
}

// Room for `total` tokens in the state's rewind buffers, keeping the rows of the chain so far (built
// aside and swapped in: a failed allocation leaves them as they were).
void Engine::reserve_rewind(State& s, int64_t total) const {
    State::Rewind& rw = s.rewind_;
    const size_t g = size_t(s.n_gdn()), cd = size_t(cfg_.conv_dim()), nv = size_t(cfg_.nv);
    rw.conv.resize(g * size_t(s.conv_floats()));
    rw.ssm.resize(g * size_t(s.ssm_floats()));
    if (rw.cap >= total) return;
    const int64_t cap = std::max<int64_t>(total, 2 * rw.cap);
    auto grow = [&](std::vector<float>& v, size_t width) {
        std::vector<float> w(g * size_t(cap) * width);
        for (size_t i = 0; i < g; ++i)
            std::copy_n(v.data() + i * size_t(rw.cap) * width, size_t(rw.n) * width, w.data() + i * size_t(cap) * width);
        return w;
    };
    std::vector<float> raw = grow(rw.raw, cd), act = grow(rw.act, cd), beta = grow(rw.beta, nv), gg = grow(rw.g, nv);
    rw.raw.swap(raw);
    rw.act.swap(act);
    rw.beta.swap(beta);
    rw.g.swap(gg);
    rw.cap = cap;
}

void Engine::check_features(const LayerFeatures& f) const {
    const int64_t n = int64_t(f.layers.size());
    if (n < 1 || n > kMaxFeatureLayers)
        throw std::invalid_argument("cpu engine: feature layers: 1.." + std::to_string(kMaxFeatureLayers) +
                                    " of them, got " + std::to_string(n));
    for (int64_t j = 0; j < n; ++j) {
        const int64_t l = f.layers[size_t(j)];
        if (l < 0 || l >= cfg_.n_layers)
            throw std::invalid_argument("cpu engine: feature layer " + std::to_string(l) + " outside the layers 0.." +
                                        std::to_string(cfg_.n_layers - 1));
        for (int64_t k = 0; k < j; ++k)
            if (f.layers[size_t(k)] == l)
                throw std::invalid_argument("cpu engine: feature layer " + std::to_string(l) + " listed twice");
    }
    if (!f.out) throw std::invalid_argument("cpu engine: no output for the layer features");
    if (mtp_) throw std::invalid_argument("cpu engine: an MTP head returns no layer features");
}

void Engine::forward(State& s, const int64_t* ids, int64_t n, int want, float* logits, InterruptPoll poll,
                     bool speculative, const float* hidden_in, float* hidden_out, bool hidden_all,
                     const LayerFeatures* features, const RowInputs* rows) {
    check_state(s);
    if (rows) {
        if (mtp_) throw std::invalid_argument("cpu engine: an MTP head takes no explicit positions or embedding rows");
        rows->check(n, "cpu engine");
    }
    if (features) {                                  // before anything, the chain included, is touched
        check_features(*features);
        if (hidden_out) throw std::invalid_argument("cpu engine: hidden states or layer features, not both");
    }
    if (mtp_ != (hidden_in != nullptr))
        throw std::invalid_argument(mtp_ ? "cpu engine: an MTP head needs the main model's hidden states"
                                         : "cpu engine: hidden states are an MTP head's input");
    if (hidden_out && want == 0 && !hidden_all)
        throw std::invalid_argument("cpu engine: hidden states come with logits (or for every row)");
    if (!speculative) s.rewind_.n = 0;               // any other call forgets the speculative chain
    if (n < 1) throw std::invalid_argument("cpu engine: no tokens");
    if (speculative && want != 2)
        throw std::invalid_argument("cpu engine: a speculative call returns the logits of every token");
    // the MoE decode path's per-thread gate/up rows hold 32 tokens of 128 rows (moe.cpp)
    const int64_t max_spec = std::min<int64_t>(opt_.prefill_chunk, kMaxSpeculativeRows);
    if (speculative && n > max_spec)
        throw std::invalid_argument("cpu engine: a speculative call takes at most " + std::to_string(max_spec) +
                                    " tokens (32, and at most prefill_chunk), got " + std::to_string(n));
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= cfg_.vocab)
            throw std::invalid_argument("cpu engine: token id " + std::to_string(ids[i]) + " outside the vocabulary");
    std::lock_guard<std::mutex> lock(mu_);
    const FlushDenormals ftz;   // also for the caller's work between parallel sections (fpenv.h)
    const int64_t chunk = opt_.prefill_chunk;
    s.reserve(s.position + n);                       // KV growth (strong guarantee)
    reserve_scratch(std::min(n, chunk), s.position + n, speculative);
    if (speculative) reserve_rewind(s, s.rewind_.n + n);
    ws_.gemv_rows = speculative ? std::max(n, kGemvMaxRows) : kGemvMaxRows;
    const bool interruptible = poll && n > chunk;    // a poll between chunks needs a way back
    const bool save = interruptible || cache_;       // ... and so does an expert read that fails
    const size_t conv = size_t(s.conv_floats()), ssm = size_t(s.ssm_floats()), n_gdn = size_t(s.n_gdn());
    if (save) {
        saved_.resize(n_gdn * (conv + ssm));
        for (size_t i = 0; i < n_gdn; ++i) {
            std::copy_n(s.conv(i), conv, saved_.data() + i * (conv + ssm));
            std::copy_n(s.ssm(i), ssm, saved_.data() + i * (conv + ssm) + conv);
        }
    }
    const int64_t pos0 = s.position;
    // ---- nothing below can throw but the poll and an expert read: the state is only changed by
    //      complete calls ----
    try {
        for (int64_t c0 = 0; c0 < n; c0 += chunk) {
            if (interruptible && c0 > 0) poll();
            const int64_t L = std::min(chunk, n - c0);
            const bool last = c0 + L == n;
            const int64_t H = cfg_.hidden;
            forward_chunk(s, ids + c0, L, want == 2, want == 1 && last,
                          want == 2 ? logits + c0 * cfg_.vocab : logits, speculative,
                          hidden_in ? hidden_in + c0 * H : nullptr,
                          hidden_out && (want == 2 || hidden_all) ? hidden_out + c0 * H : hidden_out, hidden_all,
                          nullptr, features,
                          features ? features->out + c0 * int64_t(features->layers.size()) * H : nullptr, rows, c0);
        }
    } catch (...) {
        if (save) {                                  // the KV cache is append-only: rolling back the position undoes it
            for (size_t i = 0; i < n_gdn; ++i) {
                std::copy_n(saved_.data() + i * (conv + ssm), conv, s.conv(i));
                std::copy_n(saved_.data() + i * (conv + ssm) + conv, ssm, s.ssm(i));
            }
            s.position = pos0;
        }
        throw;
    }
    if (speculative) {                               // the chain: this call's tokens follow the earlier ones
        if (s.rewind_.n == 0) s.rewind_.pos0 = pos0;
        s.rewind_.n += n;
    }
    if (rows) s.rope_delta = rows->rope_delta;       // committed with the call
    tokens_ += n;
}

// One decode step for each of B sequences: row i is ids[i] on *states[i], at that state's position. The
// weights are read once for all rows (the GEMV over the rows, the MoE's union of experts), and every row
// keeps a one-token call's arithmetic (as a speculative row does), so its logits and its state are bit for
// bit those of forward(*states[i], &ids[i], 1, want 1). All-or-nothing for every state, as forward().
void Engine::forward_batch(State* const* states, const int64_t* ids, int64_t B, float* logits) {
    if (mtp_) throw std::invalid_argument("cpu engine: an MTP head takes no batched steps");
    const int64_t max_rows = std::min<int64_t>(opt_.prefill_chunk, kMaxSpeculativeRows);
    if (B < 1 || B > max_rows)
        throw std::invalid_argument("cpu engine: a batched step takes 1.." + std::to_string(max_rows) +
                                    " rows (32, and at most prefill_chunk), got " + std::to_string(B));
    int64_t T = 0;
    for (int64_t i = 0; i < B; ++i) {
        if (states[i] == nullptr) throw std::invalid_argument("cpu engine: a batched step's state is missing");
        check_state(*states[i]);
        for (int64_t j = 0; j < i; ++j)
            if (states[j] == states[i])
                throw std::invalid_argument("cpu engine: a state appears twice in one batched step (rows " +
                                            std::to_string(j) + " and " + std::to_string(i) + ")");
        if (ids[i] < 0 || ids[i] >= cfg_.vocab)
            throw std::invalid_argument("cpu engine: token id " + std::to_string(ids[i]) + " outside the vocabulary");
        T = std::max(T, states[i]->position + 1);
    }
    std::lock_guard<std::mutex> lock(mu_);
    const FlushDenormals ftz;
    for (int64_t i = 0; i < B; ++i) states[i]->reserve(states[i]->position + 1);   // KV growth only
    reserve_scratch(B, T, true);                     // the speculative sizes: one-token attention, B GEMV rows
    ws_.gemv_rows = std::max(B, kGemvMaxRows);
    const size_t conv = size_t(states[0]->conv_floats()), ssm = size_t(states[0]->ssm_floats());
    const size_t n_gdn = size_t(states[0]->n_gdn()), per = n_gdn * (conv + ssm);
    if (cache_) {                                    // an expert read can fail mid-step: keep a way back
        saved_.resize(size_t(B) * per);
        for (int64_t r = 0; r < B; ++r)
            for (size_t i = 0; i < n_gdn; ++i) {
                std::copy_n(states[r]->conv(i), conv, saved_.data() + r * per + i * (conv + ssm));
                std::copy_n(states[r]->ssm(i), ssm, saved_.data() + r * per + i * (conv + ssm) + conv);
            }
    }
    // ---- nothing below can throw but an expert read: the positions move only at the end ----
    for (int64_t r = 0; r < B; ++r) states[r]->rewind_.n = 0;   // any call but verify ends a chain
    try {
        forward_chunk(*states[0], ids, B, true, false, logits, false, nullptr, nullptr, false, states);
    } catch (...) {
        for (int64_t r = 0; r < B; ++r)
            for (size_t i = 0; i < n_gdn; ++i) {
                std::copy_n(saved_.data() + r * per + i * (conv + ssm), conv, states[r]->conv(i));
                std::copy_n(saved_.data() + r * per + i * (conv + ssm) + conv, ssm, states[r]->ssm(i));
            }
        throw;
    }
    tokens_ += B;
}

void Engine::rewind(State& s, int64_t keep) {
    check_state(s);
    State::Rewind& rw = s.rewind_;
    if (rw.n == 0) throw std::invalid_argument("cpu engine: nothing to rewind (the state's last call was not speculative)");
    if (keep < 0 || keep > rw.n)
        throw std::invalid_argument("cpu engine: rewind keeps 0.." + std::to_string(rw.n) + " tokens, got " +
                                    std::to_string(keep));
    std::lock_guard<std::mutex> lock(mu_);
    const FlushDenormals ftz;
    const Config& c = cfg_;
    const Kernels& kk = kernels();
    const int64_t cd = c.conv_dim(), nv = c.nv, dk = c.dk, dv = c.dv, S = c.conv_kernel - 1;
    const int64_t rep = nv / c.nk, kd = c.key_dim(), cap = rw.cap;
    const size_t conv = size_t(s.conv_floats()), ssm = size_t(s.ssm_floats());
    std::vector<float> out(size_t(threads()) * size_t(dv));   // the re-applied steps' outputs, discarded
    if (keep < rw.n)
        for (size_t gi = 0; gi < size_t(s.n_gdn()); ++gi) {
            // conv state: the last K-1 rows of [the state before the call; its first `keep` inputs]
            const float* old = rw.conv.data() + gi * conv;
            const float* raw = rw.raw.data() + gi * size_t(cap * cd);
            for (int64_t r = 0; r < S; ++r) {
                const int64_t src = keep + r;
                const float* row = src < S ? old + src * cd : raw + (src - S) * cd;
                std::copy_n(row, cd, s.conv(gi) + r * cd);
            }
            // recurrent state: the one before the call, then the kept steps with the decode kernel
            const float* act = rw.act.data() + gi * size_t(cap * cd);
            const float* beta = rw.beta.data() + gi * size_t(cap * nv);
            const float* g = rw.g.data() + gi * size_t(cap * nv);
            float* St = s.ssm(gi);
            const float* S0 = rw.ssm.data() + gi * ssm;
            pool_->run(nv, [&](int64_t h, int th) {
                float* Sh = St + h * dv * dk;
                std::copy_n(S0 + h * dv * dk, dv * dk, Sh);
                const int64_t kh = h / rep;
                gdn_recurrent_head(kk, Sh, keep, act + kh * dk, act + kd + kh * dk, act + 2 * kd + h * dv, cd,
                                   beta + h, g + h, nv, out.data() + th * dv, 0, dk, dv);
            });
        }
    s.position = rw.pos0 + keep;
    rw.n = 0;
}

void Engine::lm_head(const float* xn, int64_t rows, float* out) {
    LinearOut o = {&lm_head_, out, cfg_.vocab, false};
    linear(*pool_, ws_, xn, rows, cfg_.hidden, &o, 1);
}

void Engine::forward_chunk(State& s, const int64_t* ids, int64_t L, bool logits_all, bool logits_last, float* logits,
                           bool speculative, const float* hidden_in, float* hidden_out, bool hidden_all,
                           State* const* batch, const LayerFeatures* features, float* feat_out,
                           const RowInputs* rows, int64_t row0) {
    const Config& c = cfg_;
    const Kernels& kk = kernels();
    ThreadPool& pool = *pool_;
    const int64_t H = c.hidden, pos0 = s.position;
    // row i's state: its own (a batched step: one token per state) or the call's
    float* x = x_.data();
    float* xn = xn_.data();

    // embedding rows (dequantized / converted)
    for (int64_t i = 0; i < L; ++i) kk.dequant(embed_, ids[i], 1, x + i * H, H);
    if (rows)                      // given rows (image features) instead of the lookup
        for (int64_t j = 0; j < rows->n_embeds; ++j) {
            const int64_t r = rows->embed_rows[j] - row0;
            if (r >= 0 && r < L) std::copy_n(rows->embeds + j * H, H, x + r * H);
        }
    const int32_t* pair_pos = rows && rows->pair_pos ? rows->pair_pos + row0 * (c.rotary_dim / 2) : nullptr;
    if (hidden_in) {               // an MTP head: x = fc([RMSNorm_e(embedding); RMSNorm_h(hidden)])
        float* cat = buf_c_.data();                    // [L][2H]
        for (int64_t i = 0; i < L; ++i) {
            rms_norm(x + i * H, fc_norm_e_.data(), c.eps, cat + i * 2 * H, H);
            rms_norm(hidden_in + i * H, fc_norm_h_.data(), c.eps, cat + i * 2 * H + H, H);
        }
        LinearOut o = {&fc_, x, H, false};
        linear(pool, ws_, cat, L, 2 * H, &o, 1);
    }

    for (int64_t li = 0; li < c.n_layers; ++li) {
        const Layer& ly = layers_[li];
        rms_norm_rows(pool, x, H, L, ly.input_norm.data(), c.eps, xn, H, H);

        if (ly.attention) {
            // ---- gated full attention ----
            const AttnLayer& A = ly.attn;
            const AttnDims d = attn_dims(c);
            const int64_t kvd = c.n_kv_heads * c.head_dim, od = c.n_heads * c.head_dim;
            float* qg = buf_a_.data();                 // [L][q_proj_rows]: per head [query | gate]
            float* kb = buf_b_.data();                 // [L][kvd]
            float* vb = kb + L * kvd;                  // [L][kvd]
            float* ob = buf_c_.data();                 // [L][nh*hd]
            LinearOut proj[3] = {{&A.q, qg, d.q_row, false}, {&A.k, kb, kvd, false}, {&A.v, vb, kvd, false}};
            linear(pool, ws_, xn, L, H, proj, 3);
            const size_t ai = static_cast<size_t>(attn_index_[li]);
            if (batch) {                               // row i: the one-token call on its own state
                for (int64_t i = 0; i < L; ++i) {
                    const State& si = *batch[i];
                    const KVCacheView ci{si.k(ai), si.v(ai), si.kv_f32()};
                    attn_qk_rope_kv_write(d, qg + i * d.q_row, kb + i * kvd, kvd, vb + i * kvd, kvd, 1, si.position,
                                          A.q_norm.data(), A.k_norm.data(), inv_freq_.data(), ci, si.rope_delta);
                    attention(pool, ws_, shared_.data(), d, qg + i * d.q_row, 1, si.position, ci, ob + i * od, od);
                }
            } else {
                const KVCacheView cache{s.k(ai), s.v(ai), s.kv_f32()};
                attn_qk_rope_kv_write(d, qg, kb, kvd, vb, kvd, L, pos0, A.q_norm.data(), A.k_norm.data(),
                                      inv_freq_.data(), cache, s.rope_delta, pair_pos);
                if (speculative)                       // row i as the one-token call at position pos0 + i
                    for (int64_t i = 0; i < L; ++i)
                        attention(pool, ws_, shared_.data(), d, qg + i * d.q_row, 1, pos0 + i, cache, ob + i * od, od);
                else
                    attention(pool, ws_, shared_.data(), d, qg, L, pos0, cache, ob, od);
            }
            if (c.attn_output_gate)
                for (int64_t i = 0; i < L; ++i)
                    for (int64_t h = 0; h < c.n_heads; ++h) {
                        const float* gate = qg + i * d.q_row + h * d.q_stride + c.head_dim;
                        float* o = ob + i * od + h * c.head_dim;
                        for (int64_t e = 0; e < c.head_dim; ++e) o[e] *= sigmoid(gate[e]);
                    }
            LinearOut out = {&A.o, x, H, true};        // x += o_proj(o)
            linear(pool, ws_, ob, L, od, &out, 1);
        } else {
            // ---- Gated DeltaNet ----
            const GdnLayer& G = ly.gdn;
            const int64_t cd = c.conv_dim(), vd = c.value_dim(), nv = c.nv;
            const size_t gi = static_cast<size_t>(gdn_index_[li]);
            float* qkv = buf_a_.data();                // [L][conv_dim]
            float* z = buf_b_.data();                  // [L][value_dim]
            float* bb = z + L * vd;                    // [L][nv]
            float* aa = bb + L * nv;
            float* beta = aa + L * nv;
            float* g = beta + L * nv;
            float* act = buf_c_.data();                // [L][conv_dim] conv + SiLU output
            LinearOut proj[4] = {{&G.qkv, qkv, cd, false}, {&G.z, z, vd, false}, {&G.b, bb, nv, false},
                                 {&G.a, aa, nv, false}};
            linear(pool, ws_, xn, L, H, proj, 4);
            // what rewind() needs: the states before the chain of speculative calls (at its first call),
            // and each call's inputs after the rows of the earlier ones
            State::Rewind& rw = s.rewind_;
            const bool chain_start = rw.n == 0;
            const size_t rw_rows = size_t(rw.cap * cd), rw_nv = size_t(rw.cap * nv);
            const size_t at_rows = size_t(rw.n * cd), at_nv = size_t(rw.n * nv);
            if (speculative) {
                if (chain_start) std::copy_n(s.conv(gi), s.conv_floats(), rw.conv.data() + gi * size_t(s.conv_floats()));
                std::copy_n(qkv, L * cd, rw.raw.data() + gi * rw_rows + at_rows);
            }
            if (batch)                                 // row i: one conv step on its own state
                for (int64_t i = 0; i < L; ++i)
                    gdn_conv_silu(pool, qkv + i * cd, cd, 1, cd, c.conv_kernel, G.conv_t.data(), batch[i]->conv(gi),
                                  act + i * cd, cd);
            else
                gdn_conv_silu(pool, qkv, cd, L, cd, c.conv_kernel, G.conv_t.data(), s.conv(gi), act, cd);
            const GdnDims gd{c.nk, nv, c.dk, c.dv, 1e-6f};
            for (int64_t i = 0; i < L; ++i)
                gdn_prepare_token(gd, act + i * cd, bb + i * nv, aa + i * nv, G.A_neg_exp.data(), G.dt_bias.data(),
                                  beta + i * nv, g + i * nv);
            if (speculative) {
                std::copy_n(act, L * cd, rw.act.data() + gi * rw_rows + at_rows);
                std::copy_n(beta, L * nv, rw.beta.data() + gi * rw_nv + at_nv);
                std::copy_n(g, L * nv, rw.g.data() + gi * rw_nv + at_nv);
            }
            float* o = qkv;                            // [L][value_dim] (qkv is consumed)
            float* S = s.ssm(gi);
            const int64_t rep = nv / c.nk, kd = c.key_dim();
            if (batch) {                               // one task per (row, value head): the decode step
                pool.run(L * nv, [&](int64_t task, int) {
                    const int64_t i = task / nv, h = task % nv, kh = h / rep;
                    const float* a = act + i * cd;
                    float* oh = o + i * vd + h * c.dv;
                    gdn_recurrent_head(kk, batch[i]->ssm(gi) + h * c.dv * c.dk, 1, a + kh * c.dk, a + kd + kh * c.dk,
                                       a + 2 * kd + h * c.dv, cd, beta + i * nv + h, g + i * nv + h, nv, oh, vd, c.dk,
                                       c.dv);
                    gated_rms_norm(oh, z + i * vd + h * c.dv, G.norm.data(), c.eps, oh, c.dv);
                });
            } else {
                pool.run(nv, [&](int64_t h, int th) {     // one task per value head
                    const int64_t kh = h / rep;
                    const float* q = act + kh * c.dk;
                    const float* k = act + kd + kh * c.dk;
                    const float* v = act + 2 * kd + h * c.dv;
                    float* Sh = S + h * c.dv * c.dk;
                    if (speculative && chain_start)        // the recurrent state before (this head's part)
                        std::copy_n(Sh, c.dv * c.dk, rw.ssm.data() + gi * size_t(s.ssm_floats()) + h * c.dv * c.dk);
                    if (L == 1 || speculative)
                        gdn_recurrent_head(kk, Sh, L, q, k, v, cd, beta + h, g + h, nv, o + h * c.dv, vd, c.dk, c.dv);
                    else
                        gdn_chunked_head(kk, Sh, L, q, k, v, cd, beta + h, g + h, nv, o + h * c.dv, vd, c.dk, c.dv,
                                         ws_.t(th));
                    for (int64_t i = 0; i < L; ++i) {
                        float* oh = o + i * vd + h * c.dv;
                        gated_rms_norm(oh, z + i * vd + h * c.dv, G.norm.data(), c.eps, oh, c.dv);
                    }
                });
            }
            LinearOut out = {&G.out, x, H, true};      // x += out_proj(y)
            linear(pool, ws_, o, L, vd, &out, 1);
        }

        rms_norm_rows(pool, x, H, L, ly.post_norm.data(), c.eps, xn, H, H);
        if (ly.moe) {
            const MoeLayer& m = ly.moe_w;
            MoeWeights w;
            w.router = &m.router;
            w.gate = &m.gate;
            w.up = &m.up;
            w.down = &m.down;
            if (m.has_shared) {
                w.shared_gate_proj = &m.shared_gate_proj;
                w.shared_up_proj = &m.shared_up_proj;
                w.shared_down_proj = &m.shared_down_proj;
                w.shared_expert_gate = &m.shared_expert_gate;
            }
            w.cache = cache_.get();
            w.layer = static_cast<int>(li);
            w.top_k = c.top_k;
            w.norm_topk = c.norm_topk;
            moe_forward(pool, ws_, shared_.data(), w, moe_dims(c), xn, L, x);
        } else {
            mlp_forward(pool, ws_, shared_.data(), ly.mlp.gate, ly.mlp.up, ly.mlp.down, xn, L, H, x);
        }
        if (features) {                                // the layer's output rows, if listed: its columns
            const int64_t nf = int64_t(features->layers.size());
            for (int64_t j = 0; j < nf; ++j)
                if (features->layers[size_t(j)] == li)
                    for (int64_t i = 0; i < L; ++i) std::copy_n(x + i * H, H, feat_out + (i * nf + j) * H);
        }
    }

    if (logits_all) {
        rms_norm_rows(pool, x, H, L, final_norm_.data(), c.eps, xn, H, H);
        lm_head(xn, L, logits);
        if (hidden_out) std::copy_n(xn, L * H, hidden_out);
    } else if (hidden_all && hidden_out) {          // every row's hidden state, the last row's logits if asked
        rms_norm_rows(pool, x, H, L, final_norm_.data(), c.eps, xn, H, H);
        std::copy_n(xn, L * H, hidden_out);
        if (logits_last) lm_head(xn + (L - 1) * H, 1, logits);
    } else if (logits_last) {
        rms_norm(x + (L - 1) * H, final_norm_.data(), c.eps, xn, H);
        lm_head(xn, 1, logits);
        if (hidden_out) std::copy_n(xn, H, hidden_out);
    }
    if (batch)
        for (int64_t i = 0; i < L; ++i) batch[i]->position += 1;
    else
        s.position += L;
}

}  // namespace qwenmetal

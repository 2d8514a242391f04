// The DFlash draft's forward on the cpu engine (cpu/dflash.h), written to be read next to
// python/qwenmetal/dflash.py's DFlashReference.forward / _attention / logits.
#include "cpu/dflash.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "core/fpenv.h"
#include "core/shape_str.h"
#include "cpu/attention.h"
#include "cpu/moe.h"
#include "cpu/norm.h"
#include "cpu/quant.h"

namespace qwenmetal {

using namespace cpu;

namespace {
WMat linear_of(const std::map<std::string, TensorDesc>& t, const std::string& name, int64_t rows, int64_t cols) {
    auto it = t.find(name);
    if (it == t.end()) throw std::invalid_argument("dflash draft: missing tensor " + name);
    const TensorDesc& d = it->second;
    if (d.shape != std::vector<int64_t>{rows, cols})
        throw std::invalid_argument("dflash draft: " + name + " has shape " + shape_str(d.shape) + ", expected " +
                                    shape_str({rows, cols}));
    if (d.bits) {
        check_affine("dflash draft: " + name, d.bits, d.group_size, cols);
        if (d.sdtype != DType::BF16 && d.sdtype != DType::F32)
            throw std::invalid_argument("dflash draft: " + name + ": scales must be bf16 or float32");
    }
    const WMat m = wmat_of(d, rows, cols);
    if (!m.data || (m.bits && (!m.scales || !m.biases)))
        throw std::invalid_argument("dflash draft: " + name + " has no data");
    return m;
}

AttnDims draft_attn_dims(const DFlashDims& d) {
    return AttnDims{d.n_heads, d.n_kv_heads, d.head_dim, d.head_dim, d.head_dim, d.n_heads * d.head_dim, d.eps};
}

// DFlashReference._grouped_causal_conv over L rows of width H, the rows from the last down so that `out` may
// be `y` (row t reads rows t-j <= t, none written yet): out[t] (+)= sum_{j < K, j <= t} (base[j] + dyn_t[j]) y[t-j],
// dyn_t = dyn + t * ldd, tap j's H/G group factors at dyn_t + j * H/G (channel e in group e / G).
void grouped_causal_conv(const float* y, int64_t L, int64_t H, const float* dyn, int64_t ldd, const float* base,
                         int64_t K, int64_t G, float* out, bool accumulate) {
    const int64_t groups = H / G;
    for (int64_t t = L - 1; t >= 0; --t) {
        const float* dt = dyn + t * ldd;
        float* o = out + t * H;
        for (int64_t e0 = 0; e0 < H; e0 += G) {
            const int64_t g = e0 / G;
            for (int64_t e = e0; e < e0 + G; ++e) {
                float acc = 0.f;
                for (int64_t j = 0; j < K && j <= t; ++j)
                    acc += (base[j * H + e] + dt[j * groups + g]) * y[(t - j) * H + e];
                o[e] = accumulate ? o[e] + acc : acc;
            }
        }
    }
}

// The k largest of v[0..n) into idx/val, largest first, ties to the lower index (np.argmax's for k = 1)
void top_k(const float* v, int64_t n, int64_t k, int64_t* idx, float* val) {
    int64_t have = 0;
    for (int64_t i = 0; i < n; ++i) {
        const float x = v[i];
        if (have == k && !(x > val[k - 1])) continue;
        int64_t j = have < k ? have++ : k - 1;
        for (; j > 0 && x > val[j - 1]; --j) {
            val[j] = val[j - 1];
            idx[j] = idx[j - 1];
        }
        val[j] = x;
        idx[j] = i;
    }
}
}  // namespace

// ------------------------------------------------------------------------------------------------
// DFlashCache
// ------------------------------------------------------------------------------------------------
DFlashCache::DFlashCache(const DFlashCache& o)
    : layers_(o.layers_), kv_dim_(o.kv_dim_), k_(size_t(o.layers_)), v_(size_t(o.layers_)) {
    reserve(o.position);
    const size_t n = size_t(o.position) * size_t(kv_dim_);
    for (int64_t i = 0; i < layers_ && n; ++i) {
        std::memcpy(k(i), o.k(i), n * 4);
        std::memcpy(v(i), o.v(i), n * 4);
    }
    position = o.position;
}

void DFlashCache::reserve(int64_t rows) {
    if (rows <= capacity_) return;
    int64_t cap = std::max<int64_t>(rows, capacity_ + capacity_ / 2);
    cap = ((cap + 255) / 256) * 256;
    const size_t bytes = size_t(cap) * size_t(kv_dim_) * 4;
    std::vector<std::unique_ptr<float, Free>> fresh;
    fresh.reserve(size_t(2 * layers_));
    for (int64_t i = 0; i < 2 * layers_; ++i) {
        void* p = std::aligned_alloc(64, ((bytes + 63) / 64) * 64 + 64);
        if (!p) throw std::bad_alloc();
        fresh.emplace_back(static_cast<float*>(p));
    }
    // nothing below can fail
    const size_t keep = size_t(position) * size_t(kv_dim_);
    for (int64_t i = 0; i < layers_; ++i) {
        if (keep) {
            std::memcpy(fresh[size_t(2 * i)].get(), k_[size_t(i)].get(), keep * 4);
            std::memcpy(fresh[size_t(2 * i + 1)].get(), v_[size_t(i)].get(), keep * 4);
        }
        k_[size_t(i)].swap(fresh[size_t(2 * i)]);
        v_[size_t(i)].swap(fresh[size_t(2 * i + 1)]);
    }
    capacity_ = cap;
}

// ------------------------------------------------------------------------------------------------
// DFlashDraft
// ------------------------------------------------------------------------------------------------
DFlashDraft::DFlashDraft(const DFlashDims& dims, const std::map<std::string, TensorDesc>& t,
                         const std::map<std::string, std::vector<float>>& small, Engine& target)
    : d_(dims), target_(target), ws_(target.threads()), chunk_(target.options().prefill_chunk) {
    const Config& tc = target.config();
    const DFlashDims& d = d_;
    auto positive = [](int64_t v, const char* what) {
        if (v < 1) throw std::invalid_argument(std::string("dflash draft: ") + what + " must be >= 1");
    };
    positive(d.hidden, "hidden_size");
    positive(d.layers, "num_hidden_layers");
    positive(d.inter, "intermediate_size");
    positive(d.n_heads, "num_attention_heads");
    positive(d.n_kv_heads, "num_key_value_heads");
    positive(d.head_dim, "head_dim");
    positive(d.n_target_layers, "len(target_layer_ids)");
    if (d.n_heads % d.n_kv_heads || d.n_heads / d.n_kv_heads > 256)
        throw std::invalid_argument("dflash draft: num_attention_heads must be a multiple of num_key_value_heads "
                                    "(at most 256 query heads per KV head)");
    if (d.head_dim % 2 || d.head_dim > 2048)
        throw std::invalid_argument("dflash draft: head_dim must be even and at most 2048");
    if (int64_t(d.window.size()) != d.layers)
        throw std::invalid_argument("dflash draft: one attention window per layer expected");
    if (d.hidden != tc.hidden || d.vocab != tc.vocab)
        throw std::invalid_argument("dflash draft: hidden_size " + std::to_string(d.hidden) + " / vocab_size " +
                                    std::to_string(d.vocab) + " do not match the target's " +
                                    std::to_string(tc.hidden) + " / " + std::to_string(tc.vocab));
    if (!(d.rope_theta > 0)) throw std::invalid_argument("dflash draft: rope_theta must be positive");
    if (d.dflash2()) {
        positive(d.conv_group, "conv_group_size");
        positive(d.selector_rank, "selector_rank");
        positive(d.selector_top_k, "selector_top_k");
        if (d.hidden % d.conv_group)
            throw std::invalid_argument("dflash draft: conv_group_size " + std::to_string(d.conv_group) +
                                        " does not divide hidden_size " + std::to_string(d.hidden));
        if (d.selector_top_k > d.vocab)
            throw std::invalid_argument("dflash draft: selector_top_k " + std::to_string(d.selector_top_k) +
                                        " exceeds vocab_size " + std::to_string(d.vocab));
    } else if (d.conv_kernel < 0 || d.conv_group || d.selector_rank || d.selector_top_k) {
        throw std::invalid_argument("dflash draft: DFlash2 fields without conv_kernel_size >= 1");
    }
    auto vec = [&](const std::string& name, int64_t n) -> std::vector<float> {
        auto it = small.find(name);
        if (it == small.end()) throw std::invalid_argument("dflash draft: missing tensor " + name);
        if (int64_t(it->second.size()) != n)
            throw std::invalid_argument("dflash draft: " + name + " has " + std::to_string(it->second.size()) +
                                        " values, expected " + std::to_string(n));
        return it->second;
    };
    const int64_t H = d.hidden, qd = d.n_heads * d.head_dim, kvd = d.kv_dim(), I = d.inter;
    fc_ = linear_of(t, "fc", H, d.features());
    hidden_norm_ = vec("hidden_norm", H);
    final_norm_ = vec("norm", H);
    for (int64_t i = 0; i < d.layers; ++i) {
        const std::string p = "layers." + std::to_string(i) + ".", a = p + "self_attn.", m = p + "mlp.";
        Layer L;
        L.input_norm = vec(p + "input_layernorm", H);
        L.post_norm = vec(p + "post_attention_layernorm", H);
        L.q = linear_of(t, a + "q_proj", qd, H);
        L.k = linear_of(t, a + "k_proj", kvd, H);
        L.v = linear_of(t, a + "v_proj", kvd, H);
        L.o = linear_of(t, a + "o_proj", H, qd);
        L.q_norm = vec(a + "q_norm", d.head_dim);
        L.k_norm = vec(a + "k_norm", d.head_dim);
        if (d.attention_bias) {
            L.q_bias = vec(a + "q_proj.bias", qd);
            L.k_bias = vec(a + "k_proj.bias", kvd);
            L.v_bias = vec(a + "v_proj.bias", kvd);
            L.o_bias = vec(a + "o_proj.bias", H);
        }
        L.gate = linear_of(t, m + "gate_proj", I, H);
        L.up = linear_of(t, m + "up_proj", I, H);
        L.down = linear_of(t, m + "down_proj", H, I);
        if (d.dflash2()) {
            for (auto [conv, name] : {std::pair{&L.attn_conv, "attention_conv"}, std::pair{&L.mlp_conv, "mlp_conv"}}) {
                conv->projection = linear_of(t, p + name + ".kernel_projection", d.conv_factors(), H);
                conv->base = vec(p + name + ".base_kernel", 2 * d.conv_kernel * H);
            }
        }
        layers_.push_back(std::move(L));
    }
    if (d.dflash2()) {
        predecessor_ = linear_of(t, "candidate_selector.predecessor_codebook", d.vocab, d.selector_rank);
        successor_ = linear_of(t, "candidate_selector.successor_codebook", d.vocab, d.selector_rank);
        selector_proj_ = linear_of(t, "candidate_selector.hidden_projection", d.selector_rank, H);
    }
    inv_freq_.resize(size_t(d.head_dim / 2));
    rope_inv_freq(d.rope_theta, d.head_dim, inv_freq_.data());
    ws_.planes = target.options().act_planes;
}

size_t DFlashDraft::weight_bytes() const {
    size_t n = fc_.nbytes();
    for (const Layer& L : layers_)
        n += L.q.nbytes() + L.k.nbytes() + L.v.nbytes() + L.o.nbytes() + L.gate.nbytes() + L.up.nbytes() +
             L.down.nbytes() + L.attn_conv.projection.nbytes() + L.mlp_conv.projection.nbytes();
    return n + predecessor_.nbytes() + successor_.nbytes() + selector_proj_.nbytes();
}

// Every scratch buffer a call of n context rows and a block of L can need: after this
// the forward allocates nothing.
void DFlashDraft::reserve(int64_t n, int64_t L) {
    const DFlashDims& d = d_;
    const int64_t H = d.hidden, qd = d.n_heads * d.head_dim, kvd = d.kv_dim(), M = n + L;
    const int64_t Kmax = std::max({d.features(), H, qd, d.inter});
    const int64_t rows = std::max(std::min(M, chunk_), L);        // the most rows of one linear call
    ws_.reserve(std::max(linear_thread_floats(Kmax), attention_thread_floats(draft_attn_dims(d))),
                linear_xvec_floats(Kmax, rows), size_t(rows));
    kvin_.get(size_t(M * H));
    x_.get(size_t(L * H));
    xn_.get(size_t(L * H));
    q_.get(size_t(L * qd));
    k_.get(size_t(M * kvd));
    v_.get(size_t(M * kvd));
    o_.get(size_t(L * qd));
    mlp_.get(mlp_shared_floats(d.inter, L) + 16);
    if (d.dflash2()) {
        dyn_.get(size_t(L * d.conv_factors()));
        sub_.get(size_t(L * H));
        proj_.get(size_t(L * d.selector_rank));
        rows_.get(size_t(2 * d.selector_rank));
    }
    const size_t k = size_t(d.dflash2() ? d.selector_top_k : 1);
    cand_.resize(std::max<size_t>(cand_.size(), size_t(L) * k));
    cand_logit_.resize(std::max<size_t>(cand_logit_.size(), size_t(L) * k));
}

void DFlashDraft::conv_first(ThreadPool& pool, const Conv& c, float* h, int64_t L) {
    static const std::vector<float> none;
    const int64_t H = d_.hidden, F = d_.conv_factors();
    project(pool, h, L, H, c.projection, none, dyn_.data(), F, false);
    grouped_causal_conv(h, L, H, dyn_.data(), F, c.base.data(), d_.conv_kernel, d_.conv_group, h, false);
}

void DFlashDraft::conv_second(const Conv& c, const float* y, int64_t L, float* x) {
    const int64_t H = d_.hidden, F = d_.conv_factors(), K = d_.conv_kernel;
    grouped_causal_conv(y, L, H, dyn_.data() + F / 2, F, c.base.data() + K * H, K, d_.conv_group, x, true);
}

void DFlashDraft::select(ThreadPool& pool, const float* hn, const float* logits, int64_t rows, int64_t first,
                         int64_t* drafts) {
    const DFlashDims& d = d_;
    const int64_t V = d.vocab, k = d.dflash2() ? d.selector_top_k : 1;
    int64_t* cand = cand_.data();
    float* val = cand_logit_.data();
    pool.run(rows, [&](int64_t t, int) { top_k(logits + t * V, V, k, cand + t * k, val + t * k); });
    if (!d.dflash2()) {                             // greedy: each row's argmax
        for (int64_t t = 0; t < rows; ++t) drafts[t] = cand[t];
        return;
    }
    static const std::vector<float> none;
    const int64_t R = d.selector_rank;
    float* proj = proj_.data();                     // hidden_projection(hn) [rows][R]
    project(pool, hn, rows, d.hidden, selector_proj_, none, proj, R, false);
    const Kernels& kk = kernels();
    float* w = rows_.data();                        // predecessor_codebook[prev] * proj[t]
    float* succ = w + R;                            // successor_codebook[candidate]
    int64_t prev = first;
    for (int64_t t = 0; t < rows; ++t) {
        kk.dequant(predecessor_, prev, 1, w, R);
        for (int64_t r = 0; r < R; ++r) w[r] *= proj[t * R + r];
        int64_t best = cand[t * k];
        float best_score = 0.f;
        for (int64_t c = 0; c < k; ++c) {           // the first of equal scores (candidates largest logit first)
            kk.dequant(successor_, cand[t * k + c], 1, succ, R);
            float dot = 0.f;
            for (int64_t r = 0; r < R; ++r) dot += succ[r] * w[r];
            const float score = val[t * k + c] + dot;
            if (c == 0 || score > best_score) {
                best = cand[t * k + c];
                best_score = score;
            }
        }
        drafts[t] = prev = best;
    }
}

void DFlashDraft::project(ThreadPool& pool, const float* X, int64_t M, int64_t ldx, const WMat& W,
                          const std::vector<float>& bias, float* Y, int64_t ldy, bool accumulate) {
    for (int64_t r0 = 0; r0 < M; r0 += chunk_) {
        const int64_t m = std::min(chunk_, M - r0);
        LinearOut o = {&W, Y + r0 * ldy, ldy, accumulate};
        linear(pool, ws_, X + r0 * ldx, m, ldx, &o, 1);
        if (!bias.empty())
            for (int64_t i = 0; i < m; ++i) {
                float* y = Y + (r0 + i) * ldy;
                for (int64_t j = 0; j < W.rows; ++j) y[j] += bias[size_t(j)];
            }
    }
}

void DFlashDraft::forward(DFlashCache& cache, const float* features, int64_t n, const int64_t* block, int64_t L,
                          bool commit, float* logits, int64_t* drafts) {
    const DFlashDims& d = d_;
    if (cache.layers() != d.layers || cache.kv_dim() != d.kv_dim())
        throw std::invalid_argument("dflash draft: this cache was made for another draft");
    if (n < 0) throw std::invalid_argument("dflash draft: negative context rows");
    if (n > 0 && !features) throw std::invalid_argument("dflash draft: no context features");
    if (L < 1) throw std::invalid_argument("dflash draft: the block is empty (it needs at least the sampled token)");
    if (L > 1 && !logits) throw std::invalid_argument("dflash draft: no output for the logits");
    for (int64_t i = 0; i < L; ++i)
        if (block[i] < 0 || block[i] >= d.vocab)
            throw std::invalid_argument("dflash draft: token id " + std::to_string(block[i]) +
                                        " outside the vocabulary");
    target_.exclusive([&](ThreadPool& pool) {
        const FlushDenormals ftz;
        const int64_t T0 = cache.position, M = n + L, T = T0 + M;
        cache.reserve(T);                              // strong guarantee: the valid rows kept
        reserve(n, L);
        // ---- nothing below can throw: the cache's valid rows are only appended to, at the end ----
        const Kernels& kk = kernels();
        const int64_t H = d.hidden, F = d.features(), qd = d.n_heads * d.head_dim, kvd = d.kv_dim();
        const AttnDims ad = draft_attn_dims(d);
        AttnDims ctx_dims = ad, q_dims = ad;
        ctx_dims.nh = 0;                               // keys of all M rows: no queries
        q_dims.nkv = 0;                                // queries of the block: no keys
        float* kvin = kvin_.data();                    // [M][H]: the context rows, then the block's normed rows
        float* x = x_.data();
        float* xn = xn_.data();
        float* q = q_.data();
        float* k = k_.data();
        float* v = v_.data();
        float* o = o_.data();
        static const std::vector<float> none;
        if (n) {                                       // ctx = hidden_norm(fc(features))
            project(pool, features, n, F, fc_, none, kvin, H, false);
            rms_norm_rows(pool, kvin, H, n, hidden_norm_.data(), d.eps, kvin, H, H);
        }
        const WMat& embed = target_.embedding();       // the block: the target's embedding rows, scaled
        for (int64_t i = 0; i < L; ++i) {
            kk.dequant(embed, block[i], 1, x + i * H, H);
            if (d.input_embedding_scale != 1.f)
                for (int64_t e = 0; e < H; ++e) x[i * H + e] *= d.input_embedding_scale;
        }
        float* h = kvin + n * H;                       // the block's normed rows follow the context's
        const bool conv = d.dflash2();                 // DFlash2: a sublayer's output goes to sub, then x += conv(sub)
        float* sub = conv ? sub_.data() : x;
        for (int64_t li = 0; li < d.layers; ++li) {
            const Layer& ly = layers_[size_t(li)];
            rms_norm_rows(pool, x, H, L, ly.input_norm.data(), d.eps, h, H, H);
            if (conv) conv_first(pool, ly.attn_conv, h, L);
            project(pool, h, L, H, ly.q, ly.q_bias, q, qd, false);
            project(pool, kvin, M, H, ly.k, ly.k_bias, k, kvd, false);
            project(pool, kvin, M, H, ly.v, ly.v_bias, v, kvd, false);
            const KVCacheView cv{cache.k(li), cache.v(li), true};
            // k_norm + RoPE at T0.. and every row's key and value written at T0..T-1 (past the valid rows);
            // q_norm + RoPE of the block's queries at T0+n..
            attn_qk_rope_kv_write(ctx_dims, q, k, kvd, v, kvd, M, T0, ly.q_norm.data(), ly.k_norm.data(),
                                  inv_freq_.data(), cv);
            attn_qk_rope_kv_write(q_dims, q, k, kvd, v, kvd, L, T0 + n, ly.q_norm.data(), ly.k_norm.data(),
                                  inv_freq_.data(), cv);
            attention_block(pool, ws_, ad, q, L, T0 + n, T, d.window[size_t(li)], cv, o, qd);
            project(pool, o, L, qd, ly.o, ly.o_bias, sub, H, !conv);   // x += o_proj(o) (DFlash2: sub = o_proj(o))
            if (conv) conv_second(ly.attn_conv, sub, L, x);
            rms_norm_rows(pool, x, H, L, ly.post_norm.data(), d.eps, xn, H, H);
            if (conv) {
                conv_first(pool, ly.mlp_conv, xn, L);
                std::fill(sub, sub + L * H, 0.f);      // mlp_forward adds its output
            }
            mlp_forward(pool, ws_, mlp_.data(), ly.gate, ly.up, ly.down, xn, L, H, sub);
            if (conv) conv_second(ly.mlp_conv, sub, L, x);
        }
        if (L > 1) {                                   // rows 1..L-1 through the target's lm_head
            rms_norm_rows(pool, x + H, H, L - 1, final_norm_.data(), d.eps, xn, H, H);
            LinearOut lo = {&target_.lm_head_matrix(), logits, d.vocab, false};
            linear(pool, ws_, xn, L - 1, H, &lo, 1);
            const size_t nl = size_t(L - 1) * size_t(d.vocab);
            if (d.output_multiplier != 1.f)
                for (size_t i = 0; i < nl; ++i) logits[i] *= d.output_multiplier;
            if (d.softcap > 0.f)
                for (size_t i = 0; i < nl; ++i) logits[i] = std::tanh(logits[i] / d.softcap) * d.softcap;
            if (drafts) select(pool, xn, logits, L - 1, block[0], drafts);
        }
        if (commit) cache.position = T0 + n;
    });
}

}  // namespace qwenmetal

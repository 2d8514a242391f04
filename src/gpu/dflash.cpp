// The DFlash draft's forward on the Metal graph (gpu/dflash.h), written to be read next to
// python/qwenmetal/dflash.py's DFlashReference.forward / _attention / logits and src/cpu/dflash.cpp.
#include "gpu/dflash.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "core/dtype.h"
#include "core/shape_str.h"
#include "gpu/ops/norm.h"
#include "metal/gemm.h"

namespace qwenmetal::gpu {

namespace {
// the most context rows of one pass (a first round over a long prompt runs in passes of this many rows)
constexpr uint32_t kMaxContextRows = 1024;

ops::AttnShape attn_shape(const DFlashShape& s) {
    return ops::AttnShape{s.n_heads, s.n_kv_heads, s.head_dim, s.head_dim, false, float(s.rope_theta), s.eps};
}

ops::QmvFusion norm_fused(const Buffer& w, float eps, const Buffer* xn = nullptr) {
    ops::QmvFusion f;
    f.norm_w = &w;
    f.eps = eps;
    f.xn = xn;
    return f;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// GpuDFlashCache
// ------------------------------------------------------------------------------------------------
GpuDFlashCache::GpuDFlashCache(std::shared_ptr<Device> dev, uint32_t layers, uint32_t n_kv_heads, uint32_t head_dim,
                               bool kv_f32, uint32_t block)
    : kv(layers), dev_(std::move(dev)), n_kv_(n_kv_heads), hd_(head_dim), block_(std::max<uint32_t>(block, 1)), kv_f32_(kv_f32) {
    reserve(1);
}

GpuDFlashCache::GpuDFlashCache(const GpuDFlashCache& o)
    : kv(o.kv.size()), dev_(o.dev_), n_kv_(o.n_kv_), hd_(o.hd_), block_(o.block_), kv_f32_(o.kv_f32_) {
    reserve(std::max<int64_t>(o.position, 1));
    const uint64_t row = uint64_t(hd_) * (kv_f32_ ? 4 : 2), hb = uint64_t(o.position) * row;
    for (size_t i = 0; i < kv.size() && hb; ++i)
        for (int j = 0; j < 2; ++j) {
            const Buffer& src = j ? o.kv[i].v : o.kv[i].k;
            const Buffer& dst = j ? kv[i].v : kv[i].k;
            if (!src.data() || !dst.data()) continue;
            for (uint32_t h = 0; h < n_kv_; ++h)
                std::memcpy(dst.as<uint8_t>() + h * capacity_ * row, src.as<uint8_t>() + h * o.capacity_ * row, hb);
        }
    position = o.position;
}

void GpuDFlashCache::reserve(int64_t rows) {
    if (rows <= int64_t(capacity_)) return;
    const uint64_t want = std::max<uint64_t>(uint64_t(rows), uint64_t(capacity_) + capacity_ / 2);
    const uint64_t cap = (want + block_ - 1) / block_ * block_;
    if (cap * hd_ > UINT32_MAX) throw std::invalid_argument("dflash draft: a context of " + std::to_string(rows) +
                                                            " rows exceeds the kernels' 32-bit offsets");
    const uint64_t row = uint64_t(hd_) * (kv_f32_ ? 4 : 2);
    std::vector<ops::KVCache> grown;                   // allocate everything first: strong guarantee
    for (size_t i = 0; i < kv.size(); ++i)
        grown.push_back(ops::KVCache{dev_->alloc(n_kv_ * cap * row, "dflash.kv.k"),
                                     dev_->alloc(n_kv_ * cap * row, "dflash.kv.v"), uint32_t(cap), kv_f32_});
    const uint64_t hb = uint64_t(position) * row;
    for (size_t i = 0; i < kv.size() && hb; ++i)
        for (int j = 0; j < 2; ++j) {
            const Buffer& src = j ? kv[i].v : kv[i].k;
            const Buffer& dst = j ? grown[i].v : grown[i].k;
            if (!src.data() || !dst.data()) continue;
            for (uint32_t h = 0; h < n_kv_; ++h)
                std::memcpy(dst.as<uint8_t>() + h * cap * row, src.as<uint8_t>() + h * capacity_ * row, hb);
        }
    kv = std::move(grown);
    capacity_ = uint32_t(cap);
}

// ------------------------------------------------------------------------------------------------
// GpuDFlash
// ------------------------------------------------------------------------------------------------
// One buffer per logical tensor of a pass of C context rows and a block of B rows (the largest so far).
struct GpuDFlash::Scratch {
    uint32_t ctx_rows = 0, block_rows = 0;   // C, B
    Buffer feat;     // T [C, F]                 the pass's context features (host-written, as T)
    Buffer fc;       // T [C, H]                 fc(features), before hidden_norm
    Buffer kvin;     // T [C + B, H]             K/V input rows: the context rows, then the block's normed rows
    Buffer proj;     // T [C + B, qd + 2 kvd]    [q | k | v] rows (q of the block's rows only)
    Buffer q;        // T [C + B, qd]            queries after q_norm + RoPE (the context rows': unused)
    Buffer ids;      // u32 [B]                  the block's token ids (host-written)
    Buffer x;        // T [B, H]                 the block's residual stream
    Buffer xn;       // T [B, H]                 post-attention normed rows; at the end the final-normed rows 1..
    Buffer mix;      // T [B, qd]                attention output
    Buffer act;      // T [B, I]                 SwiGLU activations
    Buffer logits;   // f32 [B - 1, V]           the lm_head of rows 1..
};

GpuDFlash::GpuDFlash(GpuEngine& target, const DFlashShape& shape, const WeightTable& w)
    : target_(target), s_(shape), sc_(std::make_unique<Scratch>()) {
    const GpuModel& tm = target.model();
    const Config& tc = tm.config();
    const DFlashShape& s = s_;
    act_ = tm.options().act;
    auto positive = [](uint32_t v, const char* what) {
        if (v < 1) throw std::invalid_argument(std::string("dflash draft: ") + what + " must be >= 1");
    };
    positive(s.hidden, "hidden_size");
    positive(s.layers, "num_hidden_layers");
    positive(s.inter, "intermediate_size");
    positive(s.n_heads, "num_attention_heads");
    positive(s.n_kv_heads, "num_key_value_heads");
    positive(s.head_dim, "head_dim");
    positive(s.n_target_layers, "len(target_layer_ids)");
    if (s.n_heads % s.n_kv_heads)
        throw std::invalid_argument("dflash draft: num_attention_heads must be a multiple of num_key_value_heads");
    if (s.window.size() != s.layers)
        throw std::invalid_argument("dflash draft: one attention window per layer expected");
    if (int64_t(s.hidden) != tc.hidden || int64_t(s.vocab) != tc.vocab)
        throw std::invalid_argument("dflash draft: hidden_size " + std::to_string(s.hidden) + " / vocab_size " +
                                    std::to_string(s.vocab) + " do not match the target's " +
                                    std::to_string(tc.hidden) + " / " + std::to_string(tc.vocab));
    if (!(s.rope_theta > 0)) throw std::invalid_argument("dflash draft: rope_theta must be positive");
    // the kernels' limits (attention_prefill: head_dim a multiple of 8 up to 256, 32 query heads per KV head)
    ops::attention_prefill_geometry(attn_shape(s), 1);
    const uint32_t H = s.hidden, qd = s.q_dim(), kvd = s.kv_dim(), I = s.inter;
    WeightBinder bind(tm.device(), w, act_);
    auto check_linear = [&](const std::string& name, uint32_t rows, uint32_t cols) {
        if (!w.has(name)) throw std::invalid_argument("dflash draft: missing tensor " + name);
        const std::vector<int64_t>& sh = w.get(name).shape;
        if (sh != std::vector<int64_t>{int64_t(rows), int64_t(cols)})
            throw std::invalid_argument("dflash draft: " + name + " has shape " + shape_str(sh) + ", expected " +
                                        shape_str({int64_t(rows), int64_t(cols)}));
    };
    auto linear = [&](const std::string& name, uint32_t rows, uint32_t cols) {
        check_linear(name, rows, cols);
        return bind.matrix(name);
    };
    fc_ = linear("fc", H, s.features());
    hidden_norm_ = bind.small("hidden_norm", false, H);
    final_norm_ = bind.small("norm", false, H);
    for (uint32_t i = 0; i < s.layers; ++i) {
        const std::string p = "layers." + std::to_string(i) + ".", a = p + "self_attn.", m = p + "mlp.";
        Layer L;
        L.input_norm = bind.small(p + "input_layernorm", false, H);
        L.post_norm = bind.small(p + "post_attention_layernorm", false, H);
        L.q = linear(a + "q_proj", qd, H);
        check_linear(a + "k_proj", kvd, H);
        check_linear(a + "v_proj", kvd, H);
        L.kv = bind.stacked({a + "k_proj", a + "v_proj"});
        L.o = linear(a + "o_proj", H, qd);
        L.q_norm = bind.small(a + "q_norm", false, s.head_dim);
        L.k_norm = bind.small(a + "k_norm", false, s.head_dim);
        check_linear(m + "gate_proj", I, H);
        check_linear(m + "up_proj", I, H);
        Stacked gu = bind.stacked({m + "gate_proj", m + "up_proj"});
        if (gu.parts.size() != 1)
            throw std::invalid_argument("dflash draft: " + m + "gate_proj and up_proj differ in format");
        L.gate_up = gu.parts[0];
        L.down = linear(m + "down_proj", H, I);
        layers_.push_back(std::move(L));
    }
    weight_bytes_ = bind.weight_bytes;
    copied_bytes_ = bind.copied_bytes;
    ctx_rows_ = std::max<uint32_t>(1, std::min(tm.options().prefill_chunk, kMaxContextRows));
}

GpuDFlash::~GpuDFlash() = default;

std::unique_ptr<GpuDFlashCache> GpuDFlash::new_cache() const {
    const GpuModel& tm = target_.model();
    return std::make_unique<GpuDFlashCache>(tm.device_ptr(), s_.layers, s_.n_kv_heads, s_.head_dim, tm.options().kv_f32,
                                            tm.options().kv_block);
}

void GpuDFlash::ensure(uint32_t ctx_rows, uint32_t block_rows) {
    Scratch& k = *sc_;
    if (ctx_rows <= k.ctx_rows && block_rows <= k.block_rows) return;
    Device& d = target_.model().device();
    const uint64_t es = act_size(act_), C = std::max(ctx_rows, k.ctx_rows), B = std::max(block_rows, k.block_rows);
    const uint64_t H = s_.hidden, qd = s_.q_dim(), kvd = s_.kv_dim();
    auto alloc = [&](uint64_t bytes, const char* label) { return d.alloc(std::max<uint64_t>(bytes, 16), label); };
    Scratch n;                                         // everything allocated before anything changes
    n.ctx_rows = uint32_t(C);
    n.block_rows = uint32_t(B);
    n.feat = alloc(C * s_.features() * es, "dflash.feat");
    n.fc = alloc(C * H * es, "dflash.fc");
    n.kvin = alloc((C + B) * H * es, "dflash.kvin");
    n.proj = alloc((C + B) * (qd + 2 * kvd) * es, "dflash.proj");
    n.q = alloc((C + B) * qd * es, "dflash.q");
    n.ids = alloc(B * 4, "dflash.ids");
    n.x = alloc(B * H * es, "dflash.x");
    n.xn = alloc(B * H * es, "dflash.xn");
    n.mix = alloc(B * qd * es, "dflash.mix");
    n.act = alloc(B * s_.inter * es, "dflash.act");
    n.logits = alloc((B - 1) * uint64_t(s_.vocab) * 4, "dflash.logits");
    k = std::move(n);
}

void GpuDFlash::check_call(const GpuDFlashCache& cache, int64_t n, int64_t L) const {
    const GpuModel& tm = target_.model();
    if (cache.device() != &tm.device() || cache.layers() != s_.layers || cache.kv_dim() != s_.kv_dim() ||
        cache.kv_f32() != tm.options().kv_f32)
        throw std::invalid_argument("dflash draft: this cache was made for another draft");
    if (n < 0) throw std::invalid_argument("dflash draft: negative context rows");
    if (L < 1) throw std::invalid_argument("dflash draft: the block is empty (it needs at least the sampled token)");
    if (L > int64_t(kMaxContextRows))
        throw std::invalid_argument("dflash draft: a block of " + std::to_string(L) + " rows, above " +
                                    std::to_string(kMaxContextRows));
    if (cache.position + n + L > int64_t(UINT32_MAX) / 2)
        throw std::invalid_argument("dflash draft: the context is too long");
}

// One pass: `nctx` context rows at positions p.. (their features in sc.feat) and, when L > 0, the block of L
// rows after them (its ids in sc.ids), into `e`.
void GpuDFlash::encode_context(Encoder& e, GpuDFlashCache& cache, int64_t p, uint32_t nctx, bool with_block,
                               uint32_t L) {
    const DFlashShape& s = s_;
    const GpuModel& tm = target_.model();
    const Act t = act_;
    const ops::GemmRoute gr = target_.gemm_route();
    const uint64_t es = act_size(t);
    const uint32_t H = s.hidden, qd = s.q_dim(), stride = qd + 2 * s.kv_dim();
    if (!with_block) L = 0;
    const uint32_t M = nctx + L;
    Scratch& k = *sc_;
    const ops::AttnShape as = attn_shape(s);
    if (nctx) {                                                                         // ctx = hidden_norm(fc(f))
        ops::gemm(e, t, fc_, k.feat, k.fc, nctx, false, 0, 0, ops::GemmFusion(), gr);
        ops::rmsnorm(e, t, k.fc, hidden_norm_, k.kvin, nctx, H, s.eps);
    }
    if (L) ops::embed(e, t, tm.embed, k.ids.view(0, uint64_t(L) * 4), L, k.x);          // x = embed(block)
    const Buffer h = k.kvin.view(uint64_t(nctx) * H * es);                              // the block's normed rows
    // a block of at most GEMM_SKINNY_MAX rows (a drafting round's): its q projection and the lm_head are qmv over
    // its rows (what gemm runs at that M) with the RMSNorm before them fused in, as the decode graph's GEMVs: one
    // dependency level fewer per layer and at the head
    const bool fused = L <= GEMM_SKINNY_MAX;
    ops::GemmFusion res;
    res.residual = &k.x;
    for (uint32_t li = 0; li < s.layers; ++li) {
        const Layer& ly = layers_[li];
        const ops::KVCache& kv = cache.kv[li];
        if (L && fused) {                                                               // q = q_proj(h), and h
            ops::qmv(e, t, ly.q, k.x, k.proj.view(uint64_t(nctx) * stride * es), L, false, H, stride,
                     norm_fused(ly.input_norm, s.eps, &h));
        } else if (L) {
            ops::rmsnorm(e, t, k.x, ly.input_norm, h, L, H, s.eps);                   // h = input_layernorm(x)
            ops::gemm(e, t, ly.q, h, k.proj.view(uint64_t(nctx) * stride * es), L, false, H, stride,
                      ops::GemmFusion(), gr);                                           // q = q_proj(h)
        }
        uint64_t col = qd;                                                              // [k | v] of every row
        for (const Matrix& m : ly.kv.parts) {
            ops::gemm(e, t, m, k.kvin, k.proj.view(col * es), M, false, H, stride, ops::GemmFusion(), gr);
            col += m.rows;
        }
        // q/k norm, RoPE at p.., the M K/V rows written at p.. of the cache (the block's: past `position`)
        ops::attn_prepare(e, t, as, k.proj, ly.q_norm, ly.k_norm, uint32_t(p), kv, k.q, M, stride);
        if (!L) continue;
        // mix = the block's queries over keys 0 .. p + M - 1: every key (a sliding layer: causal in its window)
        const uint32_t w = s.window[li];
        ops::attention_prefill(e, t, as, k.q.view(uint64_t(nctx) * qd * es), k.proj.view(uint64_t(nctx) * stride * es),
                               stride, kv, uint32_t(p) + nctx, L, k.mix, ops::AttnMask{w != 0, w});
        ops::gemm(e, t, ly.o, k.mix, k.x, L, false, 0, 0, res, gr);                     // x += o_proj(mix)
        ops::rmsnorm(e, t, k.x, ly.post_norm, k.xn, L, H, s.eps);
        ops::GemmFusion sw;
        sw.swiglu = true;
        ops::gemm(e, t, ly.gate_up, k.xn, k.act, L, false, 0, 0, sw, gr);              // act = swiglu(xn)
        ops::gemm(e, t, ly.down, k.act, k.x, L, false, 0, 0, res, gr);                 // x += down(act)
    }
    if (L > 1 && fused) {                                                               // rows 1.. -> the lm_head
        ops::qmv(e, t, tm.lm_head, k.x.view(uint64_t(H) * es), k.logits, L - 1, true, H, s.vocab,
                 norm_fused(final_norm_, s.eps));
    } else if (L > 1) {
        ops::rmsnorm(e, t, k.x.view(uint64_t(H) * es), final_norm_, k.xn, L - 1, H, s.eps);
        ops::gemm(e, t, tm.lm_head, k.xn, k.logits, L - 1, true, 0, 0, ops::GemmFusion(), gr);
    }
}

namespace {
// rows [r0, r0 + m) of the f32 features [n, F] into the device buffer as T
void write_features(const float* f, uint64_t r0, uint32_t m, uint32_t F, Act t, const Buffer& dst) {
    if (!f || !dst.data()) return;
    const float* src = f + r0 * F;
    const uint64_t count = uint64_t(m) * F;
    if (t == Act::F32) {
        std::memcpy(dst.data(), src, count * 4);
    } else {
        uint16_t* out = dst.as<uint16_t>();
        for (uint64_t i = 0; i < count; ++i) out[i] = f32_to_bf16(src[i]);
    }
}
}  // namespace

void GpuDFlash::forward(GpuDFlashCache& cache, const float* features, int64_t n, const int64_t* block, int64_t L,
                        bool commit, float* logits) {
    check_call(cache, n, L);
    if (n > 0 && !features) throw std::invalid_argument("dflash draft: no context features");
    if (L > 1 && !logits) throw std::invalid_argument("dflash draft: no output for the logits");
    for (int64_t i = 0; i < L; ++i)
        if (block[i] < 0 || block[i] >= int64_t(s_.vocab))
            throw std::invalid_argument("dflash draft: token id " + std::to_string(block[i]) + " outside the vocabulary");
    Device& d = target_.model().device();
    if (!d.info().executes) throw std::invalid_argument("dflash draft: an encode-only device cannot run forward()");
    target_.exclusive([&] {
        recovering(d, [&] {
            const int64_t p0 = cache.position;
            const uint32_t C = ctx_rows_;
            cache.reserve(p0 + n + L);                 // strong guarantee: the valid rows kept
            ensure(uint32_t(std::min<int64_t>(n, C)), uint32_t(L));
            // ---- from here the cache's valid rows are only appended to (rows past position are scratch) ----
            const uint32_t F = s_.features();
            int64_t r0 = 0;
            // context-only passes while more than C rows remain (a long prompt's first round): the host writes
            // each pass's features, so each is a command buffer of its own, waited on
            for (; n - r0 > int64_t(C); r0 += C) {
                write_features(features, uint64_t(r0), C, F, act_, sc_->feat);
                Encoder e(d, target_.model().options().command_buffer_seconds);
                encode_context(e, cache, p0 + r0, C, false, 0);
                e.commit();
                e.wait();
            }
            const uint32_t last = uint32_t(n - r0);
            write_features(features, uint64_t(r0), last, F, act_, sc_->feat);
            uint32_t* ids = sc_->ids.as<uint32_t>();
            for (int64_t i = 0; i < L; ++i) ids[i] = uint32_t(block[i]);
            Encoder e(d, target_.model().options().command_buffer_seconds);
            encode_context(e, cache, p0 + r0, last, true, uint32_t(L));
            e.commit();
            e.wait();
            const uint64_t nl = uint64_t(L - 1) * s_.vocab;
            if (nl) {
                std::memcpy(logits, sc_->logits.data(), nl * 4);
                // the reference's order: times output_multiplier, then the soft cap
                if (s_.output_multiplier != 1.f)
                    for (uint64_t i = 0; i < nl; ++i) logits[i] *= s_.output_multiplier;
                if (s_.softcap > 0.f)
                    for (uint64_t i = 0; i < nl; ++i) logits[i] = std::tanh(logits[i] / s_.softcap) * s_.softcap;
            }
            if (commit) cache.position = p0 + n;
        });
    });
}

StepCost GpuDFlash::cost(GpuDFlashCache& cache, int64_t n, int64_t L) {
    check_call(cache, n, L);
    if (n > int64_t(ctx_rows_))
        throw std::invalid_argument("dflash cost: at most " + std::to_string(ctx_rows_) + " context rows (one pass)");
    Device& d = target_.model().device();
    return target_.exclusive([&] {
        return recovering(d, [&] {
            cache.reserve(cache.position + n + L);
            ensure(uint32_t(n), uint32_t(L));
            d.reset_counters();
            Encoder e(d, target_.model().options().command_buffer_seconds);
            encode_context(e, cache, cache.position, uint32_t(n), true, uint32_t(L));
            e.commit();
            e.wait();                                  // costed only: the cache does not advance
            return cost_of(e, d.counters());
        });
    });
}

}  // namespace qwenmetal::gpu

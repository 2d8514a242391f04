// The vision tower's forward on the Metal graph (gpu/vision.h), written to be read next to
// python/qwenmetal/backends/reference_vision.py (VisionTower.embed / block / merge and the grid helpers).
#include "gpu/vision.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "core/dtype.h"
#include "core/shape_str.h"
#include "gpu/ops/attention.h"
#include "gpu/ops/gemm.h"
#include "gpu/ops/norm.h"
#include "gpu/ops/vision.h"

namespace qwenmetal::gpu {

namespace {
// a sanity bound on the patches of one call (reference_vision.MAX_VISION_PATCHES)
constexpr int64_t kMaxPatches = int64_t(1) << 20;

ops::AttnShape attn_shape(const VisionShape& s) {
    return ops::AttnShape{s.heads, s.heads, s.head_dim(), s.head_dim(), false, float(s.rope_theta), s.eps};
}

}  // namespace

// One buffer per logical tensor of a call of n patches (the largest so far).
struct GpuVision::Scratch {
    uint32_t n = 0;
    Buffer pix;        // T [n, patch_dim]        the pixels (host-written, as T)
    Buffer x;          // T [n, H]                the residual stream
    Buffer h;          // T [n, H]                layer-normed rows (the merger's: read as [n / m^2, m^2 H])
    Buffer qkv;        // T [n, 3H]               the qkv projection (bias not yet added)
    Buffer q;          // T [n, H]                rotated queries
    Buffer k, v;       // T [(heads + 1) n hd]    rotated keys, values: [heads, n, hd] (+ n hd of slack: a frame's
                       //                         view starts at its first row and still spans heads x n rows)
    Buffer mix;        // T [n, H]                attention output
    Buffer act;        // T [n, max(I, H)]        fc1 activations (the merger's: [n / m^2, m^2 H])
    Buffer out;        // T [n / m^2, out_hidden] the merged rows
    Buffer idx;        // u32 [n, 4]              position-table taps (host-written)
    Buffer wts;        // f32 [n, 4]              their weights
    Buffer cos, sin;   // f32 [n, hd]             rotary tables (host-written)
};

GpuVision::GpuVision(GpuEngine& engine, const VisionShape& shape, const WeightTable& w)
    : engine_(engine), s_(shape), sc_(std::make_unique<Scratch>()) {
    const GpuModel& tm = engine.model();
    const VisionShape& s = s_;
    act_ = tm.options().act;
    auto positive = [](uint32_t v, const char* what) {
        if (v < 1) throw std::invalid_argument(std::string("vision tower: ") + what + " must be >= 1");
    };
    positive(s.depth, "depth");
    positive(s.hidden, "hidden_size");
    positive(s.heads, "num_heads");
    positive(s.inter, "intermediate_size");
    positive(s.patch_dim, "the patch width");
    positive(s.merge, "spatial_merge_size");
    positive(s.out_hidden, "out_hidden_size");
    positive(s.grid_side, "the position grid side");
    if (s.hidden % s.heads) throw std::invalid_argument("vision tower: hidden_size must be a multiple of num_heads");
    if (!(s.rope_theta > 0)) throw std::invalid_argument("vision tower: the rotary theta must be positive");
    // the kernels' limits (attention_prefill: head_dim a multiple of 8 up to 256; GEMM rows a multiple of 4)
    ops::attention_prefill_geometry(attn_shape(s), 1);
    const uint32_t H = s.hidden, I = s.inter;
    for (uint32_t k : {s.patch_dim, H, I, s.merged_dim()})
        if (k % 4) throw std::invalid_argument("vision tower: the GEMM input widths must be multiples of 4, got " +
                                               std::to_string(k));
    WeightBinder bind(tm.device(), w, act_);
    auto linear = [&](const std::string& name, uint32_t rows, uint32_t cols) {
        if (!w.has(name)) throw std::invalid_argument("vision tower: missing tensor " + name);
        const std::vector<int64_t>& sh = w.get(name).shape;
        if (sh != std::vector<int64_t>{int64_t(rows), int64_t(cols)})
            throw std::invalid_argument("vision tower: " + name + " has shape " + shape_str(sh) + ", expected " +
                                        shape_str({int64_t(rows), int64_t(cols)}));
        return bind.matrix(name);
    };
    auto vec = [&](const std::string& name, uint64_t n) {
        if (!w.has(name)) throw std::invalid_argument("vision tower: missing tensor " + name);
        return bind.small(name, false, int64_t(n));
    };
    patch_ = linear("patch_embed.proj", H, s.patch_dim);
    patch_b_ = vec("patch_embed.proj.bias", H);
    pos_ = vec("pos_embed", uint64_t(s.grid_side) * s.grid_side * H);
    for (uint32_t i = 0; i < s.depth; ++i) {
        const std::string p = "blocks." + std::to_string(i) + ".";
        Block b;
        b.norm1 = vec(p + "norm1", H);
        b.norm1_b = vec(p + "norm1.bias", H);
        b.norm2 = vec(p + "norm2", H);
        b.norm2_b = vec(p + "norm2.bias", H);
        b.qkv = linear(p + "attn.qkv", 3 * H, H);
        b.qkv_b = vec(p + "attn.qkv.bias", 3 * H);
        b.proj = linear(p + "attn.proj", H, H);
        b.proj_b = vec(p + "attn.proj.bias", H);
        b.fc1 = linear(p + "mlp.linear_fc1", I, H);
        b.fc1_b = vec(p + "mlp.linear_fc1.bias", I);
        b.fc2 = linear(p + "mlp.linear_fc2", H, I);
        b.fc2_b = vec(p + "mlp.linear_fc2.bias", H);
        blocks_.push_back(std::move(b));
    }
    m_norm_ = vec("merger.norm", H);
    m_norm_b_ = vec("merger.norm.bias", H);
    m_fc1_ = linear("merger.linear_fc1", s.merged_dim(), s.merged_dim());
    m_fc1_b_ = vec("merger.linear_fc1.bias", s.merged_dim());
    m_fc2_ = linear("merger.linear_fc2", s.out_hidden, s.merged_dim());
    m_fc2_b_ = vec("merger.linear_fc2.bias", s.out_hidden);
    weight_bytes_ = bind.weight_bytes;
    copied_bytes_ = bind.copied_bytes;
}

GpuVision::~GpuVision() = default;

int64_t GpuVision::check_grid(const int64_t* grid, int64_t n_images) const {
    if (n_images < 1) throw std::invalid_argument("vision tower: grid_thw needs at least one image");
    int64_t n = 0;
    for (int64_t i = 0; i < n_images; ++i) {
        const int64_t t = grid[3 * i], h = grid[3 * i + 1], w = grid[3 * i + 2];
        const std::string g = "grid_thw[" + std::to_string(i) + "] = " + shape_str({t, h, w});
        if (t <= 0 || h <= 0 || w <= 0) throw std::invalid_argument("vision tower: " + g + ": every entry must be positive");
        if (h % s_.merge || w % s_.merge)
            throw std::invalid_argument("vision tower: " + g + ": height and width must be multiples of "
                                        "spatial_merge_size " + std::to_string(s_.merge));
        if (t > kMaxPatches || h > kMaxPatches || w > kMaxPatches || t * h * w > kMaxPatches - n)
            throw std::invalid_argument("vision tower: grid_thw asks for more than " + std::to_string(kMaxPatches) +
                                        " patches");
        n += t * h * w;
    }
    return n;
}

int64_t GpuVision::merged_rows(const int64_t* grid, int64_t n_images) const {
    return check_grid(grid, n_images) / (int64_t(s_.merge) * s_.merge);
}

void GpuVision::ensure(uint32_t n) {
    Scratch& k = *sc_;
    if (n <= k.n) return;
    Device& d = engine_.model().device();
    const uint64_t es = act_size(act_), N = n, H = s_.hidden, hd = s_.head_dim();
    auto alloc = [&](uint64_t bytes, const char* label) { return d.alloc(std::max<uint64_t>(bytes, 16), label); };
    Scratch c;                                       // everything allocated before anything changes
    c.n = n;
    c.pix = alloc(N * s_.patch_dim * es, "vision.pix");
    c.x = alloc(N * H * es, "vision.x");
    c.h = alloc(N * H * es, "vision.h");
    c.qkv = alloc(N * 3 * H * es, "vision.qkv");
    c.q = alloc(N * H * es, "vision.q");
    c.k = alloc((uint64_t(s_.heads) + 1) * N * hd * es, "vision.k");
    c.v = alloc((uint64_t(s_.heads) + 1) * N * hd * es, "vision.v");
    c.mix = alloc(N * H * es, "vision.mix");
    c.act = alloc(N * std::max<uint64_t>(s_.inter, H) * es, "vision.act");
    c.out = alloc(N / (s_.merge * s_.merge) * s_.out_hidden * es, "vision.out");
    c.idx = alloc(N * 16, "vision.idx");
    c.wts = alloc(N * 16, "vision.wts");
    c.cos = alloc(N * hd * 4, "vision.cos");
    c.sin = alloc(N * hd * 4, "vision.sin");
    k = std::move(c);
}

// The host-computed tables, as the reference computes them (reference_vision.interpolation_taps,
// rotary_positions, rotary_cos_sin): float32 arithmetic, cos/sin in double rounded to float.
void GpuVision::write_tables(const int64_t* grid, int64_t n_images) {
    Scratch& k = *sc_;
    uint32_t* idx = k.idx.as<uint32_t>();
    float* wts = k.wts.as<float>();
    float* cs = k.cos.as<float>();
    float* sn = k.sin.as<float>();
    if (!idx || !wts || !cs || !sn) return;          // an encode-only device
    const uint32_t m = s_.merge, side = s_.grid_side, hd = s_.head_dim(), q4 = hd / 4;
    std::vector<float> inv_freq(q4);
    const uint32_t spatial = hd / 2;
    for (uint32_t i = 0; i < q4; ++i)
        inv_freq[i] = float(1.0 / std::pow(s_.rope_theta, double(2 * i) / double(spatial)));
    uint64_t r = 0;
    for (int64_t im = 0; im < n_images; ++im) {
        const int64_t t = grid[3 * im], h = grid[3 * im + 1], w = grid[3 * im + 2];
        auto axis = [&](int64_t pos, int64_t size, uint32_t& lo_i, uint32_t& hi_i, float& wlo, float& whi) {
            const float src = float(pos) * float(side - 1) / float(std::max<int64_t>(size - 1, 1));
            const float lo = std::floor(src);
            const float frac = src - lo;
            const int64_t l = int64_t(lo);
            lo_i = uint32_t(std::min<int64_t>(l, side - 1));
            hi_i = uint32_t(std::min<int64_t>(l + 1, side - 1));
            wlo = 1.0f - frac;
            whi = frac;
        };
        for (int64_t f = 0; f < t; ++f)
            for (int64_t br = 0; br < h / m; ++br)
                for (int64_t bc = 0; bc < w / m; ++bc)
                    for (uint32_t ir = 0; ir < m; ++ir)
                        for (uint32_t ic = 0; ic < m; ++ic, ++r) {
                            const int64_t row = br * m + ir, col = bc * m + ic;
                            uint32_t r0, r1, c0, c1;
                            float wr0, wr1, wc0, wc1;
                            axis(row, h, r0, r1, wr0, wr1);
                            axis(col, w, c0, c1, wc0, wc1);
                            idx[4 * r + 0] = r0 * side + c0;
                            idx[4 * r + 1] = r0 * side + c1;
                            idx[4 * r + 2] = r1 * side + c0;
                            idx[4 * r + 3] = r1 * side + c1;
                            wts[4 * r + 0] = wr0 * wc0;
                            wts[4 * r + 1] = wr0 * wc1;
                            wts[4 * r + 2] = wr1 * wc0;
                            wts[4 * r + 3] = wr1 * wc1;
                            // angles [row f | col f] twice over the head
                            float* c = cs + r * hd;
                            float* s = sn + r * hd;
                            for (uint32_t i = 0; i < q4; ++i) {
                                const float ar = float(row) * inv_freq[i], ac = float(col) * inv_freq[i];
                                for (uint32_t rep = 0; rep < 2; ++rep) {
                                    c[rep * spatial + i] = float(std::cos(double(ar)));
                                    s[rep * spatial + i] = float(std::sin(double(ar)));
                                    c[rep * spatial + q4 + i] = float(std::cos(double(ac)));
                                    s[rep * spatial + q4 + i] = float(std::sin(double(ac)));
                                }
                            }
                        }
    }
}

void GpuVision::encode_all(Encoder& e, const int64_t* grid, int64_t n_images, uint32_t n) {
    const VisionShape& s = s_;
    const Act t = act_;
    const ops::GemmRoute gr = engine_.gemm_route();
    const uint64_t es = act_size(t), H = s.hidden, hd = s.head_dim();
    const ops::AttnShape as = attn_shape(s);
    const double budget = engine_.model().options().command_buffer_seconds;
    Scratch& k = *sc_;
    ops::gemm(e, t, patch_, k.pix, k.x, n, false, 0, 0, ops::GemmFusion(), gr);                 // x = pixels W^T
    ops::vision_pos_embed(e, t, k.x, patch_b_, pos_, s.grid_side * s.grid_side, k.idx, k.wts, n, s.hidden);
    ops::GemmFusion res;
    res.residual = &k.x;
    const ops::KVCache kv{k.k, k.v, n, t == Act::F32};
    for (const Block& b : blocks_) {
        ops::layer_norm(e, t, k.x, b.norm1, b.norm1_b, k.h, n, s.hidden, s.eps);
        ops::gemm(e, t, b.qkv, k.h, k.qkv, n, false, 0, 0, ops::GemmFusion(), gr);
        ops::vision_rope(e, t, s.heads, s.head_dim(), k.qkv, b.qkv_b, k.cos, k.sin, k.q, kv, n);
        // attention within each frame of each image: keys rows [s0, s0 + len) of every head, seen through a view
        // of the K/V buffers starting at row s0; a long frame's query rows in blocks, each over all its keys (the
        // block's rows at "positions" len - m .. len - 1: without the causal mask that is every key)
        uint64_t s0 = 0;
        for (int64_t im = 0; im < n_images; ++im)
            for (int64_t f = 0; f < grid[3 * im]; ++f) {
                const uint32_t len = uint32_t(grid[3 * im + 1] * grid[3 * im + 2]);
                const ops::KVCache fkv{k.k.view(s0 * hd * es), k.v.view(s0 * hd * es), n, kv.f32};
                const uint32_t rb = ops::attention_prefill_rows_within(as, len, len, budget, kSlowestChip);
                for (uint32_t r0 = 0; r0 < len; r0 += rb) {
                    const uint32_t m = std::min(rb, len - r0);
                    const Buffer q = k.q.view((s0 + r0) * H * es);
                    ops::attention_prefill(e, t, as, q, q, 0, fkv, len - m, m, k.mix.view((s0 + r0) * H * es),
                                           ops::AttnMask{false, 0});
                }
                s0 += len;
            }
        ops::gemm(e, t, b.proj, k.mix, k.x, n, false, 0, 0, res, gr);                            // x += proj(mix)
        ops::vision_bias_act(e, t, k.x, b.proj_b, n, s.hidden);
        ops::layer_norm(e, t, k.x, b.norm2, b.norm2_b, k.h, n, s.hidden, s.eps);
        ops::gemm(e, t, b.fc1, k.h, k.act, n, false, 0, 0, ops::GemmFusion(), gr);
        ops::vision_bias_act(e, t, k.act, b.fc1_b, n, s.inter,
                             s.gelu_tanh ? ops::VisionAct::GeluTanh : ops::VisionAct::GeluErf);
        ops::gemm(e, t, b.fc2, k.act, k.x, n, false, 0, 0, res, gr);                             // x += fc2(act)
        ops::vision_bias_act(e, t, k.x, b.fc2_b, n, s.hidden);
    }
    const uint32_t nm = n / (s.merge * s.merge);
    ops::layer_norm(e, t, k.x, m_norm_, m_norm_b_, k.h, n, s.hidden, s.eps);
    ops::gemm(e, t, m_fc1_, k.h, k.act, nm, false, 0, 0, ops::GemmFusion(), gr);
    ops::vision_bias_act(e, t, k.act, m_fc1_b_, nm, s.merged_dim(), ops::VisionAct::GeluErf);
    ops::gemm(e, t, m_fc2_, k.act, k.out, nm, false, 0, 0, ops::GemmFusion(), gr);
    ops::vision_bias_act(e, t, k.out, m_fc2_b_, nm, s.out_hidden);
}

void GpuVision::encode(const float* pixels, const int64_t* grid, int64_t n_images, float* out) {
    const int64_t n = check_grid(grid, n_images);
    if (!pixels || !out) throw std::invalid_argument("vision tower: no pixels or no output");
    Device& d = engine_.model().device();
    if (!d.info().executes) throw std::invalid_argument("vision tower: an encode-only device cannot run encode()");
    engine_.exclusive([&] {
        recovering(d, [&] {
            ensure(uint32_t(n));
            Scratch& k = *sc_;
            const uint64_t count = uint64_t(n) * s_.patch_dim;
            if (act_ == Act::F32) {
                std::memcpy(k.pix.data(), pixels, count * 4);
            } else {
                uint16_t* p = k.pix.as<uint16_t>();
                for (uint64_t i = 0; i < count; ++i) p[i] = f32_to_bf16(pixels[i]);
            }
            write_tables(grid, n_images);
            Encoder e(d, engine_.model().options().command_buffer_seconds);
            encode_all(e, grid, n_images, uint32_t(n));
            e.commit();
            e.wait();
            last_cbs_ = e.command_buffers();
            const uint64_t rows = uint64_t(n) / (s_.merge * s_.merge), m = rows * s_.out_hidden;
            if (act_ == Act::F32) {
                std::memcpy(out, k.out.data(), m * 4);
            } else {
                const uint16_t* o = k.out.as<uint16_t>();
                for (uint64_t i = 0; i < m; ++i) out[i] = bf16_to_f32(o[i]);
            }
        });
    });
}

StepCost GpuVision::cost(const int64_t* grid, int64_t n_images) {
    const int64_t n = check_grid(grid, n_images);
    Device& d = engine_.model().device();
    return engine_.exclusive([&] {
        return recovering(d, [&] {
            ensure(uint32_t(n));
            write_tables(grid, n_images);
            d.reset_counters();
            Encoder e(d, engine_.model().options().command_buffer_seconds);
            encode_all(e, grid, n_images, uint32_t(n));
            e.commit();
            e.wait();
            last_cbs_ = e.command_buffers();
            return cost_of(e, d.counters());
        });
    });
}

}  // namespace qwenmetal::gpu

// Engine construction (weights table, quantize-at-load) and the session State.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "cpu/engine.h"
#include "core/shape_str.h"
#include "cpu/attention.h"
#include "cpu/gdn.h"
#include "cpu/moe.h"

namespace qwenmetal {

// ------------------------------------------------------------------------------------------------
// State
// ------------------------------------------------------------------------------------------------
State::Buf State::alloc(size_t bytes) {
    void* p = std::aligned_alloc(64, ((bytes + 63) / 64) * 64 + 64);
    if (!p) throw std::bad_alloc();
    return Buf(static_cast<uint8_t*>(p));
}

State::State(const Config& c, bool kv_f32) : kv_f32_(kv_f32) {
    const StateLayout L = StateLayout::of(c);
    n_attn_ = L.n_attention;
    n_gdn_ = L.n_gdn;
    kv_row_bytes_ = L.kv_row_bytes(kv_f32);
    conv_floats_ = L.conv_floats;
    ssm_floats_ = L.ssm_floats;
    for (int64_t i = 0; i < 2 * n_attn_; ++i) kv_.emplace_back(alloc(0).release());
    for (int64_t i = 0; i < n_gdn_; ++i) {
        conv_.emplace_back(reinterpret_cast<float*>(alloc(conv_floats_ * 4).release()));
        ssm_.emplace_back(reinterpret_cast<float*>(alloc(ssm_floats_ * 4).release()));
    }
    reset();
}

State::State(const State& o)
    : position(o.position), rope_delta(o.rope_delta), n_attn_(o.n_attn_), n_gdn_(o.n_gdn_), kv_row_bytes_(o.kv_row_bytes_),
      conv_floats_(o.conv_floats_), ssm_floats_(o.ssm_floats_), kv_f32_(o.kv_f32_), capacity_(o.position) {
    const size_t kvb = size_t(capacity_) * kv_row_bytes_;
    for (int64_t i = 0; i < 2 * n_attn_; ++i) {
        kv_.emplace_back(alloc(kvb).release());
        if (kvb) std::memcpy(kv_.back().get(), o.kv_[i].get(), kvb);
    }
    for (int64_t i = 0; i < n_gdn_; ++i) {
        conv_.emplace_back(reinterpret_cast<float*>(alloc(conv_floats_ * 4).release()));
        std::memcpy(conv_.back().get(), o.conv_[i].get(), conv_floats_ * 4);
        ssm_.emplace_back(reinterpret_cast<float*>(alloc(ssm_floats_ * 4).release()));
        std::memcpy(ssm_.back().get(), o.ssm_[i].get(), ssm_floats_ * 4);
    }
}

size_t State::nbytes() const {
    return size_t(2 * n_attn_) * size_t(position) * kv_row_bytes_ + size_t(n_gdn_) * (conv_floats_ + ssm_floats_) * 4;
}

size_t State::allocated_bytes() const {
    return size_t(2 * n_attn_) * size_t(capacity_) * kv_row_bytes_ + size_t(n_gdn_) * (conv_floats_ + ssm_floats_) * 4;
}

void State::reserve(int64_t tokens) {
    if (tokens <= capacity_) return;
    int64_t cap = std::max<int64_t>(tokens, capacity_ + capacity_ / 2);
    cap = ((cap + 255) / 256) * 256;
    std::vector<std::unique_ptr<uint8_t, Free>> fresh;
    fresh.reserve(kv_.size());
    for (size_t i = 0; i < kv_.size(); ++i) fresh.emplace_back(alloc(size_t(cap) * kv_row_bytes_).release());
    // nothing below can fail
    for (size_t i = 0; i < kv_.size(); ++i) {
        if (position) std::memcpy(fresh[i].get(), kv_[i].get(), size_t(position) * kv_row_bytes_);
        kv_[i].swap(fresh[i]);
    }
    capacity_ = cap;
}

void State::reset() {
    position = 0;
    rope_delta = 0;
    for (auto& c : conv_) std::memset(c.get(), 0, conv_floats_ * 4);
    for (auto& s : ssm_) std::memset(s.get(), 0, ssm_floats_ * 4);
}

// ------------------------------------------------------------------------------------------------
// Engine construction
// ------------------------------------------------------------------------------------------------
WMat Engine::quantize_owned(const void* src, DType dt, int64_t rows, int64_t cols, int bits) {
    const int gs = 64;
    const size_t wbytes = size_t(rows) * cols * bits / 8, sbytes = size_t(rows) * (cols / gs) * 2;
    std::unique_ptr<uint8_t[]> buf(new uint8_t[wbytes + 2 * sbytes + 64]);
    uint8_t* base = buf.get();
    WMat m;
    m.bits = bits;
    m.sdtype = DType::BF16;
    m.group_size = gs;
    m.rows = rows;
    m.cols = cols;
    m.data = base;
    m.scales = base + wbytes;
    m.biases = base + wbytes + sbytes;
    const int64_t blk = 64;
    pool_->run((rows + blk - 1) / blk, [&](int64_t t, int) {
        const int64_t r0 = t * blk, n = std::min(blk, rows - r0);
        const uint8_t* s = static_cast<const uint8_t*>(src) + size_t(r0) * cols * dtype_size(dt);
        cpu::quantize_affine(s, dt, cols, n, cols, bits, gs,
                             reinterpret_cast<uint32_t*>(base + size_t(r0) * cols * bits / 8),
                             reinterpret_cast<uint16_t*>(base + wbytes) + r0 * (cols / gs),
                             reinterpret_cast<uint16_t*>(base + wbytes + sbytes) + r0 * (cols / gs));
    });
    owned_bytes_ += wbytes + 2 * sbytes;
    owned_.push_back(std::move(buf));
    return m;
}

static const TensorDesc& find(const std::map<std::string, TensorDesc>& t, const std::string& name) {
    auto it = t.find(name);
    if (it == t.end()) throw std::invalid_argument("cpu engine: missing tensor " + name);
    return it->second;
}

static void check_quant(const TensorDesc& d, const std::string& name) {
    if (d.bits == 0) return;
    const int64_t cols = d.shape.back();
    cpu::check_affine("cpu engine: " + name, d.bits, d.group_size, cols);
    if (d.sdtype != DType::BF16 && d.sdtype != DType::F32)
        throw std::invalid_argument("cpu engine: " + name + ": scales must be bf16 or float32");
}

WMat Engine::make_linear(const std::map<std::string, TensorDesc>& t, const std::string& name, int64_t rows,
                         int64_t cols, bool router) {
    const TensorDesc& d = find(t, name);
    if (d.shape != std::vector<int64_t>{rows, cols})
        throw std::invalid_argument("cpu engine: " + name + " has shape " + shape_str(d.shape) + ", expected " +
                                    shape_str({rows, cols}));
    check_quant(d, name);
    if (d.bits == 0 && opt_.quantize && cols % 64 == 0)
        return quantize_owned(d.data, d.dtype, rows, cols, router ? 8 : opt_.quantize);
    return wmat_of(d, rows, cols);
}

WStack Engine::make_stack(const std::map<std::string, TensorDesc>& t, const std::string& name, int64_t n,
                          int64_t rows, int64_t cols) {
    const TensorDesc& d = find(t, name);
    if (d.shape != std::vector<int64_t>{n, rows, cols})
        throw std::invalid_argument("cpu engine: " + name + " has shape " + shape_str(d.shape) + ", expected " +
                                    shape_str({n, rows, cols}));
    check_quant(d, name);
    WStack s;
    s.n = n;
    if (d.bits == 0 && opt_.quantize && cols % 64 == 0) {
        const int bits = opt_.quantize;
        const size_t wbytes = size_t(rows) * cols * bits / 8, sbytes = size_t(rows) * (cols / 64) * 2;
        std::unique_ptr<uint8_t[]> buf(new uint8_t[n * (wbytes + 2 * sbytes) + 64]);
        uint8_t* base = buf.get();
        uint8_t* sb = base + n * wbytes;
        uint8_t* bb = sb + n * sbytes;
        const int64_t blk = 64, nb = (rows + blk - 1) / blk;
        pool_->run(n * nb, [&](int64_t task, int) {
            const int64_t e = task / nb, r0 = (task % nb) * blk, m = std::min(blk, rows - r0);
            const uint8_t* src = static_cast<const uint8_t*>(d.data) + e * d.stride + size_t(r0) * cols * dtype_size(d.dtype);
            cpu::quantize_affine(src, d.dtype, cols, m, cols, bits, 64,
                                 reinterpret_cast<uint32_t*>(base + e * wbytes + size_t(r0) * cols * bits / 8),
                                 reinterpret_cast<uint16_t*>(sb + e * sbytes) + r0 * (cols / 64),
                                 reinterpret_cast<uint16_t*>(bb + e * sbytes) + r0 * (cols / 64));
        });
        WMat m;
        m.bits = bits;
        m.sdtype = DType::BF16;
        m.group_size = 64;
        m.rows = rows;
        m.cols = cols;
        m.data = base;
        m.scales = sb;
        m.biases = bb;
        s.base = m;
        s.stride = wbytes;
        s.sstride = sbytes;
        owned_bytes_ += n * (wbytes + 2 * sbytes);
        owned_.push_back(std::move(buf));
        return s;
    }
    s.base = wmat_of(d, rows, cols);
    s.stride = d.stride;
    s.sstride = d.sstride;
    return s;
}

WStack Engine::make_slot_stack(const TensorDesc& d, const std::string& name, const std::vector<ExpertPart>& parts,
                               size_t first, int64_t slots, int64_t rows, int64_t cols, std::vector<void*>& bases) {
    if (d.shape != std::vector<int64_t>{cfg_.n_experts, rows, cols})
        throw std::invalid_argument("cpu engine: " + name + " has shape " + shape_str(d.shape) + ", expected " +
                                    shape_str({cfg_.n_experts, rows, cols}));
    check_quant(d, name);
    WStack s;
    s.n = slots;
    s.base = wmat_of(d, rows, cols);
    // the parts of one expert of this matrix as the kernels read them: its rows, then (quantized) its
    // scale and bias rows
    std::vector<size_t> sizes{size_t(rows) * s.base.row_bytes()};
    if (d.bits) sizes.insert(sizes.end(), 2, size_t(rows) * s.base.srow_bytes());
    if (first + sizes.size() > parts.size())
        throw std::invalid_argument("cpu engine: streamed " + name + ": the layer has " + std::to_string(parts.size()) +
                                    " expert parts, too few for its format");
    for (size_t j = 0; j < sizes.size(); ++j) {
        if (parts[first + j].nbytes != sizes[j])
            throw std::invalid_argument("cpu engine: streamed " + name + ": expert part " + std::to_string(first + j) +
                                        " is " + std::to_string(parts[first + j].nbytes) + " bytes, expected " +
                                        std::to_string(sizes[j]));
        const size_t bytes = ((size_t(slots) * sizes[j] + 63) / 64) * 64;
        void* p = std::aligned_alloc(64, bytes ? bytes : 64);
        if (!p) throw std::bad_alloc();
        slot_mem_.emplace_back(static_cast<uint8_t*>(p));
        bases.push_back(p);
        owned_bytes_ += size_t(slots) * sizes[j];
    }
    s.base.data = bases[bases.size() - sizes.size()];
    s.stride = sizes[0];
    if (d.bits) {
        s.base.scales = bases[bases.size() - 2];
        s.base.biases = bases[bases.size() - 1];
        s.sstride = sizes[1];
    }
    return s;
}

Engine::Engine(const Config& c, const std::map<std::string, TensorDesc>& t,
               const std::map<std::string, std::vector<float>>& small, const Options& opt, const StreamSpec* stream)
    : cfg_(c), opt_(opt) {
    cfg_.validate();
    if (opt_.quantize != 0 && opt_.quantize != 4 && opt_.quantize != 8)
        throw std::invalid_argument("cpu engine: quantize must be None, 4 or 8");
    if (stream && opt_.quantize)
        throw std::invalid_argument("cpu engine: quantize (at load) cannot be combined with streamed experts: "
                                    "quantize the checkpoint with `qwenmetal convert` instead");
    std::map<int, std::vector<void*>> slot_bases;
    if (opt_.prefill_chunk < 1) throw std::invalid_argument("cpu engine: prefill_chunk must be >= 1");
    if (opt_.threads <= 0) opt_.threads = physical_cores();
    pool_ = std::make_unique<ThreadPool>(opt_.threads);
    ws_.resize(pool_->size());
    ws_.planes = opt_.act_planes;

    auto vec = [&](const std::string& name, int64_t n) -> std::vector<float> {
        auto it = small.find(name);
        if (it == small.end()) throw std::invalid_argument("cpu engine: missing tensor " + name);
        if (static_cast<int64_t>(it->second.size()) != n)
            throw std::invalid_argument("cpu engine: " + name + " has " + std::to_string(it->second.size()) +
                                        " values, expected " + std::to_string(n));
        return it->second;
    };
    const int64_t H = c.hidden;
    embed_ = make_linear(t, "embed_tokens", c.vocab, H, false);
    lm_head_ = c.tie_embeddings ? embed_ : make_linear(t, "lm_head", c.vocab, H, false);
    final_norm_ = vec("norm", H);
    if (t.count("fc")) {            // an MTP head (docs/model.md §9): its input is fc over [embedding; hidden]
        mtp_ = true;
        fc_ = make_linear(t, "fc", H, 2 * H, false);
        fc_norm_e_ = vec("pre_fc_norm_embedding", H);
        fc_norm_h_ = vec("pre_fc_norm_hidden", H);
    }
    int64_t na = 0, ng = 0;
    for (int64_t i = 0; i < c.n_layers; ++i) {
        const std::string p = "layers." + std::to_string(i) + ".";
        Layer L;
        L.attention = c.layer_is_attention[i];
        L.moe = c.layer_is_moe[i];
        L.input_norm = vec(p + "input_layernorm", H);
        L.post_norm = vec(p + "post_attention_layernorm", H);
        if (L.attention) {
            const std::string a = p + "self_attn.";
            L.attn.q = make_linear(t, a + "q_proj", c.q_proj_rows(), H, false);
            L.attn.k = make_linear(t, a + "k_proj", c.n_kv_heads * c.head_dim, H, false);
            L.attn.v = make_linear(t, a + "v_proj", c.n_kv_heads * c.head_dim, H, false);
            L.attn.o = make_linear(t, a + "o_proj", H, c.n_heads * c.head_dim, false);
            L.attn.q_norm = vec(a + "q_norm", c.head_dim);
            L.attn.k_norm = vec(a + "k_norm", c.head_dim);
            attn_index_.push_back(na++);
            gdn_index_.push_back(-1);
        } else {
            const std::string g = p + "linear_attn.";
            L.gdn.qkv = make_linear(t, g + "in_proj_qkv", c.conv_dim(), H, false);
            L.gdn.z = make_linear(t, g + "in_proj_z", c.value_dim(), H, false);
            L.gdn.b = make_linear(t, g + "in_proj_b", c.nv, H, false);
            L.gdn.a = make_linear(t, g + "in_proj_a", c.nv, H, false);
            L.gdn.out = make_linear(t, g + "out_proj", H, c.value_dim(), false);
            const std::vector<float> conv = vec(g + "conv1d", c.conv_dim() * c.conv_kernel);
            L.gdn.conv_t.resize(conv.size());
            for (int64_t ch = 0; ch < c.conv_dim(); ++ch)
                for (int64_t j = 0; j < c.conv_kernel; ++j)
                    L.gdn.conv_t[j * c.conv_dim() + ch] = conv[ch * c.conv_kernel + j];
            L.gdn.dt_bias = vec(g + "dt_bias", c.nv);
            L.gdn.A_neg_exp = vec(g + "A_log", c.nv);
            for (float& a : L.gdn.A_neg_exp) a = -std::exp(a);
            L.gdn.norm = vec(g + "norm", c.dv);
            attn_index_.push_back(-1);
            gdn_index_.push_back(ng++);
        }
        const std::string m = p + "mlp.";
        if (L.moe) {
            const int64_t E = c.n_experts, I = c.moe_inter, Is = c.shared_inter;
            L.moe_w.router = make_linear(t, m + "gate", E, H, true);
            if (stream) {
                auto lp = stream->layers.find(int(i));
                if (lp == stream->layers.end())
                    throw std::invalid_argument("cpu engine: streaming: no expert parts for MoE layer " +
                                                std::to_string(i));
                const std::vector<ExpertPart>& parts = lp->second;
                std::vector<void*>& bases = slot_bases[int(i)];
                const int64_t S = stream->cache.slots_per_layer;
                const char* names[3] = {"gate_proj", "up_proj", "down_proj"};
                WStack* stacks[3] = {&L.moe_w.gate, &L.moe_w.up, &L.moe_w.down};
                for (int j = 0; j < 3; ++j) {
                    const std::string name = m + "switch_mlp." + names[j];
                    auto it = stream->stacks.find(name);
                    if (it == stream->stacks.end())
                        throw std::invalid_argument("cpu engine: streaming: missing descriptor of " + name);
                    *stacks[j] = make_slot_stack(it->second, name, parts, bases.size(), S, j < 2 ? I : H,
                                                 j < 2 ? H : I, bases);
                }
                if (bases.size() != parts.size())
                    throw std::invalid_argument("cpu engine: streamed layer " + std::to_string(i) + " has " +
                                                std::to_string(parts.size()) + " expert parts, its format needs " +
                                                std::to_string(bases.size()));
            } else {
                L.moe_w.gate = make_stack(t, m + "switch_mlp.gate_proj", E, I, H);
                L.moe_w.up = make_stack(t, m + "switch_mlp.up_proj", E, I, H);
                L.moe_w.down = make_stack(t, m + "switch_mlp.down_proj", E, H, I);
            }
            L.moe_w.has_shared = Is > 0;
            if (Is > 0) {
                L.moe_w.shared_gate_proj = make_linear(t, m + "shared_expert.gate_proj", Is, H, false);
                L.moe_w.shared_up_proj = make_linear(t, m + "shared_expert.up_proj", Is, H, false);
                L.moe_w.shared_down_proj = make_linear(t, m + "shared_expert.down_proj", H, Is, false);
                L.moe_w.shared_expert_gate = make_linear(t, m + "shared_expert_gate", 1, H, true);
            }
        } else {
            const int64_t I = c.dense_inter;
            L.mlp.gate = make_linear(t, m + "gate_proj", I, H, false);
            L.mlp.up = make_linear(t, m + "up_proj", I, H, false);
            L.mlp.down = make_linear(t, m + "down_proj", H, I, false);
        }
        layers_.push_back(std::move(L));
    }
    inv_freq_.resize(std::max<int64_t>(1, c.rotary_dim / 2));
    cpu::rope_inv_freq(c.rope_theta, c.rotary_dim, inv_freq_.data());
    if (stream) {
        if (stream->layers.size() != slot_bases.size())
            throw std::invalid_argument("cpu engine: streaming: expert parts given for a layer that is not a "
                                        "MoE layer");
        ExpertCacheOptions co = stream->cache;
        co.num_experts = static_cast<int>(c.n_experts);
        cache_ = std::make_unique<ExpertCache>(stream->files, stream->layers, co, std::move(slot_bases));
    }
}

size_t Engine::weight_bytes() const {
    size_t n = embed_.nbytes() + (cfg_.tie_embeddings ? 0 : lm_head_.nbytes());
    for (const Layer& L : layers_) {
        if (L.attention) n += L.attn.q.nbytes() + L.attn.k.nbytes() + L.attn.v.nbytes() + L.attn.o.nbytes();
        else n += L.gdn.qkv.nbytes() + L.gdn.z.nbytes() + L.gdn.b.nbytes() + L.gdn.a.nbytes() + L.gdn.out.nbytes();
        if (L.moe) {
            const MoeLayer& m = L.moe_w;
            n += m.router.nbytes() + size_t(m.gate.n) * (m.gate.base.nbytes() + m.up.base.nbytes() + m.down.base.nbytes());
            if (m.has_shared)
                n += m.shared_gate_proj.nbytes() + m.shared_up_proj.nbytes() + m.shared_down_proj.nbytes() +
                     m.shared_expert_gate.nbytes();
        } else {
            n += L.mlp.gate.nbytes() + L.mlp.up.nbytes() + L.mlp.down.nbytes();
        }
    }
    return n;
}

ExpertCacheStats Engine::expert_stats(int64_t* tokens) {
    std::lock_guard<std::mutex> lock(mu_);
    *tokens = tokens_;
    return cache_ ? cache_->stats() : ExpertCacheStats{};
}

void Engine::reset_expert_stats() {
    std::lock_guard<std::mutex> lock(mu_);
    if (cache_) cache_->reset_stats();
    tokens_ = 0;
}

void Engine::check_state(const State& s) const {
    int64_t na = 0;
    for (uint8_t a : cfg_.layer_is_attention) na += a;
    const Config& c = cfg_;
    if (s.n_attn_ != na || s.n_gdn_ != c.n_layers - na || s.kv_f32() != opt_.kv_f32 ||
        s.kv_row_bytes_ != c.n_kv_heads * c.head_dim * (opt_.kv_f32 ? 4 : 2) ||
        s.conv_floats_ != (c.conv_kernel - 1) * c.conv_dim() || s.ssm_floats_ != c.nv * c.dv * c.dk)
        throw std::invalid_argument("cpu engine: this state was made for another model");
}

}  // namespace qwenmetal

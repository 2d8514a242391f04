// GpuModel (weights on the device) and GpuState (one sequence's device state).
#include <algorithm>
#include <cstring>

#include "gpu/model.h"

namespace qwenmetal::gpu {

namespace {

// the kernel format of tensor `name`: quantized at its width (the kernels take 2, 3, 4, 5, 6, 8 bits;
// another width is refused naming the tensor), or dense by its dtype
WFormat format_of(const WeightDesc& d, const std::string& name) {
    if (d.bits != 0) return quantized_format(uint32_t(d.bits), "metal backend: tensor '" + name + "'");
    switch (d.dtype) {
        case DType::BF16: return WFormat::BF16;
        case DType::F16: return WFormat::F16;
        default: return WFormat::F32;
    }
}

bool same_layout(const Matrix& a, const Matrix& b) {
    return a.fmt == b.fmt && a.cols == b.cols && a.group_size == b.group_size && a.scales_f32 == b.scales_f32 &&
           a.count == 1 && b.count == 1;
}

void store_act(Act t, float v, uint8_t* dst, size_t i) {
    if (t == Act::F32) {
        std::memcpy(dst + 4 * i, &v, 4);
    } else {
        const uint16_t h = f32_to_bf16(v);
        std::memcpy(dst + 2 * i, &h, 2);
    }
}

constexpr uint64_t kAlign = 16;   // vector loads of weights / scales

// streaming: MoE layer `layer`'s expert parts in the layout, which must be `count` of them
const std::vector<ExpertPart>& layer_parts(const ExpertStreaming& st, int layer, size_t count) {
    static const std::vector<ExpertPart> none;
    const auto it = st.layers.find(layer);
    const std::vector<ExpertPart>& p = it == st.layers.end() ? none : it->second;
    if (p.size() != count)
        throw std::invalid_argument("metal backend: streaming: MoE layer " + std::to_string(layer) + " has " +
                                    std::to_string(p.size()) + " expert parts in the layout, its stacks need " +
                                    std::to_string(count));
    return p;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// WeightBinder
// ------------------------------------------------------------------------------------------------
WeightBinder::WeightBinder(Device& dev, const WeightTable& w, Act act, bool per_tensor,
                           const std::vector<WrappedFile>* reuse)
    : dev_(dev), w_(w), act_(act) {
    if (per_tensor) return;
    // weights are only read; the largest tensor of each file is the largest view bound from it
    std::vector<uint64_t> largest(w.mappings.size(), 0);
    for (const auto& [name, t] : w.tensors)
        for (const Span* s : {&t.data, &t.scales, &t.biases})
            if (s->present()) largest[size_t(s->mapping)] = std::max(largest[size_t(s->mapping)], s->nbytes);
    for (size_t i = 0; i < w.mappings.size(); ++i) {
        const Mapping& mp = w.mappings[i];
        Buffer b;
        if (reuse && mp.base)
            for (const WrappedFile& f : *reuse)
                if (f.base == mp.base && f.size == mp.size && f.max_view >= largest[i]) {
                    b = f.buffer;
                    break;
                }
        if (!b.valid())
            b = mp.base ? dev_.wrap(mp.base, mp.size, mp.name, nullptr, nullptr, WrapHints{true, largest[i]})
                        : dev_.alloc(mp.size, mp.name);
        maps_.push_back(b);
        files_.push_back({mp.base, mp.size, largest[i], b});
    }
}

Buffer WeightBinder::owned(uint64_t bytes, const std::string& label) {
    Buffer b = dev_.alloc(bytes, label);
    copied_bytes += bytes;
    return b;
}

Buffer WeightBinder::span(const Span& s, const std::string& what) {
    const WeightTable& w = w_;
    if (!s.present()) throw std::invalid_argument("metal backend: tensor '" + what + "' has no data");
    const Mapping& mp = w.mappings.at(size_t(s.mapping));
    if (s.offset + s.nbytes > mp.size)
        throw std::invalid_argument("metal backend: tensor '" + what + "' lies outside its mapping " + mp.name);
    weight_bytes += s.nbytes;
    if (s.offset % kAlign == 0) {
        if (!maps_.empty()) return maps_[size_t(s.mapping)].view(s.offset, s.nbytes);
        // streaming: each tensor wraps only its own pages, so no buffer covers a routed expert's pages
        // (a whole-file buffer would make the device map, and on a GPU make resident, the expert stacks)
        return dev_.wrap(static_cast<const uint8_t*>(mp.base) + s.offset, s.nbytes, what, nullptr, nullptr,
                         WrapHints{true, s.nbytes});
    }
    // a tensor whose offset in its file is not 16-byte aligned: one aligned copy
    Buffer b = owned(s.nbytes, what);
    if (const uint8_t* src = w.host(s)) std::memcpy(b.data(), src, s.nbytes);
    return b;
}

// A stack whose matrices are not adjacent in their file (HF's fused experts viewed as gate / up): the
// kernels index experts by matrix size, so the matrices are gathered into one buffer, once.
Buffer WeightBinder::gathered(const Span& s, uint64_t stride, uint64_t count, uint64_t matrix_bytes,
                              const std::string& what) {
    const WeightTable& w = w_;
    if (!s.present()) throw std::invalid_argument("metal backend: tensor '" + what + "' has no data");
    if ((count - 1) * stride + matrix_bytes > s.nbytes)
        throw std::invalid_argument("metal backend: tensor '" + what + "': stride past its span");
    weight_bytes += count * matrix_bytes;
    Buffer b = owned(count * matrix_bytes, what);
    if (const uint8_t* src = w.host(s))
        for (uint64_t e = 0; e < count; ++e) std::memcpy(b.as<uint8_t>() + e * matrix_bytes, src + e * stride, matrix_bytes);
    return b;
}

namespace {
// a matrix's format and shape from its description (no buffers)
Matrix matrix_shape(const WeightDesc& d, const std::string& name) {
    if (d.shape.size() < 2) throw std::invalid_argument("metal backend: '" + name + "' is not a matrix");
    Matrix m;
    m.fmt = format_of(d, name);
    m.rows = uint32_t(d.rows());
    m.cols = uint32_t(d.cols());
    m.count = uint32_t(d.count());
    m.group_size = uint32_t(d.group_size);
    return m;
}
}  // namespace

Matrix WeightBinder::matrix(const std::string& name) {
    const WeightTable& w = w_;
    const WeightDesc& d = w.get(name);
    Matrix m = matrix_shape(d, name);
    const uint64_t wmat = uint64_t(m.rows) * m.row_bytes(), smat = uint64_t(m.rows) * m.srow_bytes();
    const bool strided = m.count > 1 && d.stride && d.stride != wmat;
    m.w = strided ? gathered(d.data, d.stride, m.count, wmat, name + ".weight") : span(d.data, name + ".weight");
    if (quantized(m.fmt)) {
        if (d.sdtype == DType::F16) {
            if (m.count > 1 && d.sstride && d.sstride != smat)
                throw std::invalid_argument("metal backend: '" + name + "': float16 scales of a strided stack");
            // the kernels read bf16 or f32 scales: f16 ones are widened to f32 once (exact)
            m.scales_f32 = true;
            const uint64_t n = d.scales.nbytes / 2;
            Buffer parts[2] = {owned(n * 4, name + ".scales"), owned(n * 4, name + ".biases")};
            const Span* src[2] = {&d.scales, &d.biases};
            for (int i = 0; i < 2; ++i) {
                const uint8_t* h = w.host(*src[i]);
                float* out = parts[i].as<float>();
                if (h && out)
                    for (uint64_t j = 0; j < n; ++j) out[j] = load_scalar(h, DType::F16, j);
            }
            m.scales = parts[0];
            m.biases = parts[1];
        } else {
            m.scales_f32 = d.sdtype == DType::F32;
            if (m.count > 1 && d.sstride && d.sstride != smat) {
                m.scales = gathered(d.scales, d.sstride, m.count, smat, name + ".scales");
                m.biases = gathered(d.biases, d.sstride, m.count, smat, name + ".biases");
            } else {
                m.scales = span(d.scales, name + ".scales");
                m.biases = span(d.biases, name + ".biases");
            }
        }
    }
    m.validate(name.c_str());
    return m;
}

// Streaming mode: the stack `name` as `slots` slot matrices in fresh device buffers (one per part:
// weight, scales, biases; or the dense weight), whose contents the expert cache fills: slot s of part p
// at bases[p] + s * parts[p].nbytes, so the slot stack has the checkpoint stack's layout with E -> S and
// the MoE kernels index it by slot id as they index the checkpoint stack by expert id.
Matrix GpuModel::slot_stack(const WeightTable& w, const std::string& name, const ExpertPart* parts, uint32_t slots,
                            std::vector<void*>& bases) {
    const WeightDesc& d = w.get(name);
    Matrix m = matrix_shape(d, name);
    if (quantized(m.fmt) && d.sdtype == DType::F16)
        throw std::invalid_argument("metal backend: streaming '" + name +
                                    "': float16 scales of routed experts are not supported (the kernels read bf16 or "
                                    "f32 scales; `qwenmetal convert` writes bf16)");
    m.scales_f32 = d.sdtype == DType::F32;
    m.count = slots;
    const uint64_t want[3] = {uint64_t(m.rows) * m.row_bytes(), uint64_t(m.rows) * m.srow_bytes(),
                              uint64_t(m.rows) * m.srow_bytes()};
    const char* suffix[3] = {".weight", ".scales", ".biases"};
    Buffer* dst[3] = {&m.w, &m.scales, &m.biases};
    for (int i = 0; i < (quantized(m.fmt) ? 3 : 1); ++i) {
        if (parts[i].nbytes != want[i])
            throw std::invalid_argument("metal backend: streaming '" + name + suffix[i] + "': an expert is " +
                                        std::to_string(parts[i].nbytes) + " bytes in the layout, the shape needs " +
                                        std::to_string(want[i]));
        *dst[i] = dev_->alloc(uint64_t(slots) * want[i], name + suffix[i] + " slots");
        slot_bytes_ += uint64_t(slots) * want[i];
        bases.push_back(dst[i]->data());
    }
    m.validate(name.c_str());
    return m;
}

Stacked WeightBinder::stacked(const std::vector<std::string>& names) {
    std::vector<Matrix> parts;
    for (const std::string& n : names) parts.push_back(matrix(n));
    Stacked st;
    for (const Matrix& p : parts) st.rows += p.rows;
    bool same = true;
    for (const Matrix& p : parts) same = same && same_layout(p, parts[0]);
    if (!same || parts.size() == 1) {
        st.parts = std::move(parts);
        return st;
    }
    // one matrix: rows concatenated (weights, scales and biases separately)
    Matrix m = parts[0];
    m.rows = st.rows;
    const std::string label = names[0] + "+" + std::to_string(names.size() - 1);
    m.w = owned(uint64_t(m.rows) * m.row_bytes(), label + ".weight");
    if (quantized(m.fmt)) {
        m.scales = owned(uint64_t(m.rows) * m.srow_bytes(), label + ".scales");
        m.biases = owned(uint64_t(m.rows) * m.srow_bytes(), label + ".biases");
    }
    uint64_t wo = 0, so = 0;
    for (const Matrix& p : parts) {
        const uint64_t wb = uint64_t(p.rows) * p.row_bytes(), sb = uint64_t(p.rows) * p.srow_bytes();
        if (m.w.data() && p.w.data()) {
            std::memcpy(m.w.as<uint8_t>() + wo, p.w.data(), wb);
            if (sb) {
                std::memcpy(m.scales.as<uint8_t>() + so, p.scales.data(), sb);
                std::memcpy(m.biases.as<uint8_t>() + so, p.biases.data(), sb);
            }
        }
        wo += wb;
        so += sb;
    }
    st.parts = {m};
    return st;
}

Buffer WeightBinder::small(const std::string& name, bool f32, int64_t expect) {
    const WeightTable& w = w_;
    const WeightDesc& d = w.get(name);
    int64_t n = 1;
    for (int64_t s : d.shape) n *= s;
    if (d.bits != 0 || n != expect)
        throw std::invalid_argument("metal backend: '" + name + "' must be a dense tensor of " + std::to_string(expect) +
                                    " values");
    const Act t = f32 ? Act::F32 : act_;
    Buffer b = owned(uint64_t(n) * act_size(t), name);
    const uint8_t* src = w.host(d.data);
    if (src && b.data())
        for (int64_t i = 0; i < n; ++i) store_act(t, load_scalar(src, d.dtype, size_t(i)), b.as<uint8_t>(), size_t(i));
    return b;
}

// ------------------------------------------------------------------------------------------------
// GpuModel
// ------------------------------------------------------------------------------------------------
GpuModel::GpuModel(std::shared_ptr<Device> dev, const Config& c, const WeightTable& w, const GpuOptions& opt,
                   const std::optional<ExpertStreaming>& stream, const GpuModel* share)
    : dev_(std::move(dev)), cfg_(c), opt_(opt) {
    if (share && share->dev_ != dev_) throw std::invalid_argument("metal backend: a shared model is on another device");
    cfg_.validate();
    const bool virt = w.is_virtual();
    if (virt && dev_->info().executes)
        throw std::invalid_argument("metal backend: a virtual weights table can only be encoded (encode-only device)");
    if (stream && (virt || !dev_->info().executes))
        throw std::invalid_argument("metal backend: streaming needs an executing device and real weights");
    const int S = stream ? stream->cache.slots_per_layer : 0;
    if (stream && (S < 1 || S > c.n_experts))
        throw std::invalid_argument("metal backend: expert_slots must be in [1, " + std::to_string(c.n_experts) +
                                    "], got " + std::to_string(S));
    WeightBinder bind(*dev_, w, opt_.act, stream.has_value(), share ? &share->files_ : nullptr);
    std::map<int, std::vector<void*>> bases;      // streaming: each MoE layer's slot stacks, in part order
    const int64_t H = c.hidden;
    int64_t n_attention = 0, n_gdn = 0;
    embed = bind.matrix("embed_tokens");
    lm_head = c.tie_embeddings || !w.has("lm_head") ? embed : bind.matrix("lm_head");
    final_norm = bind.small("norm", false, H);
    if (w.has("fc")) {             // an MTP head (docs/model.md §9): its input is fc over [embedding; hidden]
        mtp = true;
        fc = bind.matrix("fc");
        if (fc.rows != uint32_t(H) || fc.cols != uint32_t(2 * H))
            throw std::invalid_argument("metal backend: fc is [" + std::to_string(fc.rows) + ", " +
                                        std::to_string(fc.cols) + "], an MTP head's is [hidden, 2 hidden]");
        fc_norm_e = bind.small("pre_fc_norm_embedding", false, H);
        fc_norm_h = bind.small("pre_fc_norm_hidden", false, H);
        for (int64_t i = 0; i < c.n_layers; ++i)
            if (!c.layer_is_attention[size_t(i)])
                throw std::invalid_argument("metal backend: an MTP head's layers are full attention");
    }
    for (int64_t i = 0; i < c.n_layers; ++i) {
        const std::string p = "layers." + std::to_string(i) + ".";
        GpuLayer L;
        L.attention = c.layer_is_attention[size_t(i)] != 0;
        L.moe = c.layer_is_moe[size_t(i)] != 0;
        L.state_index = uint32_t(L.attention ? n_attention++ : n_gdn++);
        L.input_norm = bind.small(p + "input_layernorm", false, H);
        L.post_norm = bind.small(p + "post_attention_layernorm", false, H);
        if (L.attention) {
            const std::string a = p + "self_attn.";
            L.attn_in = bind.stacked({a + "q_proj", a + "k_proj", a + "v_proj"});
            L.o_proj = bind.matrix(a + "o_proj");
            L.q_norm = bind.small(a + "q_norm", false, c.head_dim);
            L.k_norm = bind.small(a + "k_norm", false, c.head_dim);
        } else {
            const std::string g = p + "linear_attn.";
            L.gdn_in = bind.stacked({g + "in_proj_qkv", g + "in_proj_z", g + "in_proj_b", g + "in_proj_a"});
            L.out_proj = bind.matrix(g + "out_proj");
            L.conv_w = bind.small(g + "conv1d", true, c.conv_dim() * c.conv_kernel);
            L.A_log = bind.small(g + "A_log", true, c.nv);
            L.dt_bias = bind.small(g + "dt_bias", true, c.nv);
            L.gdn_norm = bind.small(g + "norm", false, c.dv);
        }
        const std::string m = p + "mlp.";
        if (L.moe) {
            L.has_shared = w.has(m + "shared_expert.gate_proj");
            std::vector<std::string> r = {m + "gate"};
            if (L.has_shared) r.push_back(m + "shared_expert_gate");
            L.router = bind.stacked(r);
            const char* mats[3] = {"gate_proj", "up_proj", "down_proj"};
            Matrix* dst[3] = {&L.gate, &L.up, &L.down};
            if (!stream) {
                for (int j = 0; j < 3; ++j) *dst[j] = bind.matrix(m + "switch_mlp." + mats[j]);
            } else {
                // the layer's parts: 3 per quantized stack (weight, scales, biases), 1 per dense one
                size_t want = 0;
                for (const char* mat : mats) want += w.get(m + "switch_mlp." + mat).bits ? 3 : 1;
                const std::vector<ExpertPart>& parts = layer_parts(*stream, int(i), want);
                for (int j = 0, p0 = 0; j < 3; ++j) {
                    *dst[j] = slot_stack(w, m + "switch_mlp." + mats[j], parts.data() + p0, uint32_t(S),
                                         bases[int(i)]);
                    p0 += quantized(dst[j]->fmt) ? 3 : 1;
                }
            }
            if (L.has_shared) {
                Stacked gu = bind.stacked({m + "shared_expert.gate_proj", m + "shared_expert.up_proj"});
                if (gu.parts.size() != 1)
                    throw std::invalid_argument("metal backend: " + m + "shared_expert gate/up projections differ in format");
                L.shared_gate_up = gu.parts[0];
                L.shared_down = bind.matrix(m + "shared_expert.down_proj");
            }
        } else {
            Stacked gu = bind.stacked({m + "gate_proj", m + "up_proj"});
            if (gu.parts.size() != 1)
                throw std::invalid_argument("metal backend: " + m + "gate/up projections differ in format");
            L.mlp_gate_up = gu.parts[0];
            L.mlp_down = bind.matrix(m + "down_proj");
        }
        layers.push_back(std::move(L));
    }
    weight_bytes_ += bind.weight_bytes;
    copied_bytes_ += bind.copied_bytes;
    files_ = bind.files();
    if (stream) experts_ = std::make_unique<ExpertCache>(stream->files, stream->layers, stream->cache, bases);
}

// ------------------------------------------------------------------------------------------------
// GpuState
// ------------------------------------------------------------------------------------------------
GpuState::GpuState(const GpuModel& m)
    : m_(m), dev_(m.device()), kv_f32_(m.options().kv_f32), block_(std::max<uint32_t>(1, m.options().kv_block)) {
    const StateLayout L = StateLayout::of(m.config());
    n_kv_ = uint32_t(L.kv_heads);
    kv_head_row_bytes_ = uint64_t(L.kv_row_bytes(kv_f32_) / L.kv_heads);
    for (int64_t i = 0; i < L.n_attention; ++i) kv.push_back(ops::KVCache{Buffer(), Buffer(), 0, kv_f32_});
    conv_bytes_ = uint64_t(L.conv_floats) * 4;
    ssm_bytes_ = uint64_t(L.ssm_floats) * 4;
    for (int64_t i = 0; i < L.n_gdn; ++i) {                // a ring of two slots per layer (ping-pong)
        conv_slab.push_back(dev_.alloc(slots_ * conv_bytes_, "conv state"));
        ssm_slab.push_back(dev_.alloc(slots_ * ssm_bytes_, "recurrent state"));
    }
    reserve(1);
}

GpuState::GpuState(const GpuState& o)
    : position(o.position), rope_delta(o.rope_delta), kv(o.kv), m_(o.m_), dev_(o.dev_), kv_f32_(o.kv_f32_), capacity_(0), n_kv_(o.n_kv_),
      block_(o.block_), kv_head_row_bytes_(o.kv_head_row_bytes_) {
    for (ops::KVCache& k : kv) k = ops::KVCache{Buffer(), Buffer(), 0, kv_f32_};
    reserve(std::max<int64_t>(o.position, 1));
    const uint64_t hb = uint64_t(o.position) * kv_head_row_bytes_;
    for (size_t i = 0; i < kv.size(); ++i)
        for (int j = 0; j < 2; ++j) {
            const Buffer& src = j ? o.kv[i].v : o.kv[i].k;
            const Buffer& dst = j ? kv[i].v : kv[i].k;
            if (!src.data()) continue;
            for (uint32_t h = 0; h < n_kv_; ++h)
                std::memcpy(dst.as<uint8_t>() + h * capacity_ * kv_head_row_bytes_,
                            src.as<uint8_t>() + h * o.capacity_ * kv_head_row_bytes_, hb);
        }
    // the current slot of each ring becomes this copy's current (slot 0 of a ring of 2)
    conv_bytes_ = o.conv_bytes_;
    ssm_bytes_ = o.ssm_bytes_;
    for (size_t i = 0; i < o.n_gdn(); ++i) {
        conv_slab.push_back(dev_.alloc(slots_ * conv_bytes_, "conv state"));
        ssm_slab.push_back(dev_.alloc(slots_ * ssm_bytes_, "recurrent state"));
        if (o.conv_in(i).data() && conv_slab.back().data()) {
            std::memcpy(conv_slab.back().data(), o.conv_in(i).data(), conv_bytes_);
            std::memcpy(ssm_slab.back().data(), o.ssm_in(i).data(), ssm_bytes_);
        }
    }
}

void GpuState::reserve(int64_t tokens) {
    if (tokens <= int64_t(capacity_)) return;
    const uint32_t cap = uint32_t((uint64_t(tokens) + block_ - 1) / block_ * block_);
    std::vector<ops::KVCache> grown;
    for (size_t i = 0; i < kv.size(); ++i) {   // allocate everything first: strong guarantee
        ops::KVCache g{dev_.alloc(uint64_t(n_kv_) * cap * kv_head_row_bytes_, "kv.k"),
                       dev_.alloc(uint64_t(n_kv_) * cap * kv_head_row_bytes_, "kv.v"), cap, kv_f32_};
        grown.push_back(g);
    }
    const uint64_t hb = uint64_t(std::min<int64_t>(position, capacity_)) * kv_head_row_bytes_;
    for (size_t i = 0; i < kv.size(); ++i)
        for (int j = 0; j < 2; ++j) {
            const Buffer& src = j ? kv[i].v : kv[i].k;
            const Buffer& dst = j ? grown[i].v : grown[i].k;
            if (!src.valid() || !src.data() || !hb) continue;
            for (uint32_t h = 0; h < n_kv_; ++h)
                std::memcpy(dst.as<uint8_t>() + h * cap * kv_head_row_bytes_,
                            src.as<uint8_t>() + h * capacity_ * kv_head_row_bytes_, hb);
        }
    kv = std::move(grown);
    capacity_ = cap;
}

void GpuState::reset() {
    end_chain();
    position = 0;
    rope_delta = 0;
    cur = 0;
    for (const Buffer& b : conv_slab)
        if (b.data()) std::memset(b.data(), 0, b.length);
    for (const Buffer& b : ssm_slab)
        if (b.data()) std::memset(b.data(), 0, b.length);
}

uint64_t GpuState::nbytes() const {
    uint64_t n = uint64_t(position) * kv_row_bytes() * 2 * kv.size();
    n += n_gdn() * (conv_bytes_ + ssm_bytes_);
    return n;
}

GpuState::Saved GpuState::save() const {
    Saved s;
    s.position = position;
    s.cur = cur;
    for (size_t i = 0; i < n_gdn(); ++i) {
        const Buffer c = conv_in(i);
        const Buffer r = ssm_in(i);
        s.conv.emplace_back(c.as<uint8_t>(), c.as<uint8_t>() + (c.data() ? c.length : 0));
        s.ssm.emplace_back(r.as<uint8_t>(), r.as<uint8_t>() + (r.data() ? r.length : 0));
    }
    return s;
}

void GpuState::restore(const Saved& s) {
    position = s.position;
    cur = s.cur;
    for (size_t i = 0; i < n_gdn(); ++i) {
        if (conv_in(i).data()) std::memcpy(conv_in(i).data(), s.conv[i].data(), s.conv[i].size());
        if (ssm_in(i).data()) std::memcpy(ssm_in(i).data(), s.ssm[i].data(), s.ssm[i].size());
    }
}

// ---- the verification chain ----
void GpuState::grow(uint32_t slots) {
    // every slab allocated first (strong guarantee), then the live states -- the chain's (base .. base + len) or
    // the current one -- copied to slots 0.. of the new ring (host copies: the device is idle between calls)
    std::vector<Buffer> nc, ns;
    for (size_t i = 0; i < n_gdn(); ++i) {
        nc.push_back(dev_.alloc(slots * conv_bytes_, "conv state"));
        ns.push_back(dev_.alloc(slots * ssm_bytes_, "recurrent state"));
    }
    const uint32_t base = chain_len_ ? chain_base_ : cur, live = uint32_t(chain_len_) + 1;
    for (size_t i = 0; i < n_gdn(); ++i)
        for (uint32_t k = 0; k < live; ++k) {
            const uint32_t from = (base + k) % slots_;
            if (nc[i].data() && conv_slab[i].data()) {
                std::memcpy(nc[i].as<uint8_t>() + k * conv_bytes_, conv_at(i, from).data(), conv_bytes_);
                std::memcpy(ns[i].as<uint8_t>() + k * ssm_bytes_, ssm_at(i, from).data(), ssm_bytes_);
            }
        }
    conv_slab = std::move(nc);
    ssm_slab = std::move(ns);
    slots_ = slots;
    chain_base_ = 0;
    cur = live - 1;
}

uint32_t GpuState::take_rows(uint32_t n) {
    const uint32_t need = uint32_t(chain_len_) + n + 1;   // the state before the chain, its rows, these rows
    if (need > slots_) grow(need);
    return next_slot();
}

void GpuState::chain_rows(uint32_t n) {
    if (n == 0) return;
    if (chain_len_ == 0) {                         // the state before the chain: the current slot
        chain_base_ = cur;
        chain_pos0_ = position;
    }
    chain_len_ += n;
    position += n;
    cur = (cur + n) % slots_;
}

void GpuState::rewind(int64_t keep) {
    if (chain_len_ == 0) return;
    cur = uint32_t((chain_base_ + uint64_t(keep)) % slots_);
    position = chain_pos0_ + keep;
    chain_len_ = 0;
}

uint64_t GpuState::pool_bytes() const {
    return uint64_t(slots_ - std::min<uint32_t>(slots_, 2)) * n_gdn() * (conv_bytes_ + ssm_bytes_);
}

}  // namespace qwenmetal::gpu

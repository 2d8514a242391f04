// qwenmetal._core bindings of the C++ CPU engine: CpuEngine, CpuState and a few kernel entry points
// for the tests. The Python side (python/qwenmetal/cpu_backend.py) validates inputs and passes
// tensor descriptors (pointers into arrays it keeps alive); every compute call releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bindings/config.h"
#include "bindings/cpu_engine.h"
#include "bindings/expert_cache.h"
#include "bindings/forward_call.h"
#include "bindings/registry.h"
#include "bindings/weights_table.h"
#include "cpu/engine.h"
#include "cpu/attention.h"
#include "cpu/gdn.h"
#include "cpu/amx.h"
#include "cpu/gemm_vnni.h"
#include "cpu/cpu_info.h"
#include "cpu/kernels.h"
#include "cpu/moe.h"
#include "cpu/quant.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace qwenmetal;
using qwenmetal::bindings::new_array;
using qwenmetal::bindings::PyEngine;
using qwenmetal::RowInputs;
using qwenmetal::bindings::parse_desc;
using qwenmetal::bindings::parse_format;

namespace {

template <class T, int N>
using In = nb::ndarray<const T, nb::ndim<N>, nb::c_contig, nb::device::cpu>;
template <class T, int N>
using InOut = nb::ndarray<T, nb::ndim<N>, nb::c_contig, nb::device::cpu>;

// A linear tensor of the weights table as the CPU engine's pointer descriptor (the engine reads the
// mappings in place; a stack's strides are the table's, or the bytes of one matrix when contiguous).
TensorDesc desc_of(const WeightTable& w, const std::string& name, const WeightDesc& d) {
    TensorDesc t;
    t.bits = d.bits;
    t.dtype = d.dtype;
    t.sdtype = d.sdtype;
    t.group_size = d.group_size;
    t.shape = d.shape;
    if (t.shape.size() < 2) throw std::invalid_argument("cpu engine: '" + name + "' is not a matrix");
    t.data = w.host(d.data);
    if (!t.data) throw std::invalid_argument("cpu engine: '" + name + "' has no data (a virtual weights table)");
    if (d.bits) {
        if (d.sdtype == DType::F16)
            throw std::invalid_argument("cpu engine: '" + name + "': float16 scales (cpu_backend widens them first)");
        t.scales = w.host(d.scales);
        t.biases = w.host(d.biases);
    }
    const int64_t n = d.count();
    if (n > 1) {
        t.stride = d.stride ? size_t(d.stride) : size_t(d.data.nbytes / uint64_t(n));
        t.sstride = d.bits ? (d.sstride ? size_t(d.sstride) : size_t(d.scales.nbytes / uint64_t(n))) : 0;
    }
    return t;
}

WMat wmat_of(const TensorDesc& d) {
    WMat m;
    m.bits = d.bits;
    m.dtype = d.dtype;
    m.sdtype = d.sdtype;
    m.group_size = d.group_size;
    m.rows = d.shape[d.shape.size() - 2];
    m.cols = d.shape.back();
    m.data = d.data;
    m.scales = d.scales;
    m.biases = d.biases;
    return m;
}

// The streaming spec cpu_backend.py hands over: {files: [path], layers: {layer: [(file, offset, stride,
// nbytes)]}, slots_per_layer, policy ("lru" | "lfu" | "os"), stacks: {name: {bits, group_size, dtype,
// sdtype, shape}}} (the stacks' format; no data pointers); the I/O options are ExpertCacheOptions' defaults
StreamSpec parse_stream(const nb::dict& d) {
    StreamSpec s;
    bindings::parse_stream_tables(d, s.files, s.layers, s.cache);
    for (auto [k, v] : nb::cast<nb::dict>(d["stacks"]))
        s.stacks[nb::cast<std::string>(k)] = parse_format(nb::cast<nb::dict>(v));
    return s;
}

// ExpertCache statistics since the last reset, plus the tokens run through the engine in that time
nb::dict expert_stats(Engine& e) {
    int64_t tokens = 0;
    ExpertCacheStats st;
    {
        nb::gil_scoped_release release;
        st = e.expert_stats(&tokens);
    }
    return bindings::engine_expert_stats(e.expert_cache(), st, tokens, int(e.config().n_experts));
}

// `features` as given to forward()/verify(): a sequence of decoder-layer indices (Python ints, not bools);
// the engine checks the values (range, distinct, 1..8 of them)
std::vector<int64_t> parse_feature_layers(nb::handle features) {
    if (PyUnicode_Check(features.ptr()) || PyBytes_Check(features.ptr()) || !PySequence_Check(features.ptr()))
        throw std::invalid_argument("features must be a sequence of decoder-layer indices");
    std::vector<int64_t> out;
    for (nb::handle v : nb::borrow<nb::sequence>(features)) {
        if (PyBool_Check(v.ptr()) || !PyIndex_Check(v.ptr()))
            throw std::invalid_argument("features must be a sequence of decoder-layer indices");
        const long long i = PyLong_AsLongLong(nb::steal(PyNumber_Index(v.ptr())).ptr());
        if (i == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            throw std::invalid_argument("features: a layer index out of range");
        }
        out.push_back(int64_t(i));
    }
    return out;
}

// forward() and verify(): the ids run on the state (verify: speculative, every row as a one-token call),
// with the hidden-state options: `hidden`, an MTP head's input [n, hidden_size] (None for the main
// model), and `return_hidden`, which returns (logits, final-normed hidden rows) instead of the logits;
// `features` (decoder-layer indices, not with return_hidden) returns (logits, every row's outputs of those
// layers [n, len(features) * hidden_size])
nb::object engine_run(PyEngine& pe, State& s, In<int64_t, 1> ids, const std::string& logits, nb::handle consumed,
                      nb::handle hidden, int return_hidden, bool speculative, nb::handle features,
                      const RowInputs* rows = nullptr) {
    // return_hidden: 0 no, 1 the rows the logits are of, 2 every row (any logits mode)
    const int64_t n = static_cast<int64_t>(ids.shape(0)), H = pe.engine->config().hidden;
    std::optional<LayerFeatures> feats;
    nb::object fout = nb::none();
    if (!features.is_none()) {
        if (return_hidden) throw std::invalid_argument("hidden states or layer features, not both");
        feats.emplace();
        feats->layers = parse_feature_layers(features);
        const int64_t nf = int64_t(feats->layers.size());
        if (nf < 1 || nf > kMaxFeatureLayers)       // checked again by the engine; here before allocating
            throw std::invalid_argument("cpu engine: feature layers: 1.." + std::to_string(kMaxFeatureLayers) +
                                        " of them, got " + std::to_string(nf));
        auto a = bindings::new_array({size_t(std::max<int64_t>(n, 0)), size_t(nf * H)});
        feats->out = a.data();
        fout = nb::cast(a);
    }
    std::optional<In<float, 2>> hin;
    if (!hidden.is_none()) {
        hin = nb::cast<In<float, 2>>(hidden);
        if (int64_t(hin->shape(0)) != n || int64_t(hin->shape(1)) != H)
            throw std::invalid_argument("hidden must be float32 [" + std::to_string(n) + ", " + std::to_string(H) + "]");
    }
    nb::object hout = nb::none();
    float* hp = nullptr;
    if (return_hidden < 0 || return_hidden > 2) throw std::invalid_argument("return_hidden must be 0, 1 or 2");
    if (return_hidden) {
        if (logits == "none" && return_hidden == 1)
            throw std::invalid_argument("return_hidden=1 needs logits 'last' or 'all'");
        auto a = logits == "all" || return_hidden == 2 ? bindings::new_array({size_t(n), size_t(H)})
                                                       : bindings::new_array({size_t(H)});
        hp = a.data();
        hout = nb::cast(a);
    }
    nb::object out = bindings::forward_call(ids.data(), n, size_t(pe.engine->config().vocab), logits, consumed,
                                            [&](int want, float* dst, InterruptPoll poll) {
                                                pe.engine->forward(s, ids.data(), n, want, dst, poll, speculative,
                                                                   hin ? hin->data() : nullptr, hp, return_hidden == 2,
                                                                   feats ? &*feats : nullptr, rows);
                                            });
    if (feats) return nb::make_tuple(out, fout);
    return return_hidden ? nb::object(nb::make_tuple(out, hout)) : out;
}

nb::object engine_forward(PyEngine& pe, State& s, In<int64_t, 1> ids, const std::string& logits, nb::handle consumed,
                          nb::handle hidden, int return_hidden, nb::handle features, nb::handle pair_pos,
                          nb::handle embed_rows, nb::handle embeds, nb::handle rope_delta) {
    const Config& c = pe.engine->config();
    const bindings::RowArgs rows(pair_pos, embed_rows, embeds, rope_delta, int64_t(ids.shape(0)), c.rotary_dim / 2,
                                 c.hidden, s.rope_delta);
    return engine_run(pe, s, ids, logits, consumed, hidden, return_hidden, false, features, rows.get());
}

// the verification of drafted tokens: logits [n, vocab], every row bit for bit a one-token call's
nb::object engine_verify(PyEngine& pe, State& s, In<int64_t, 1> ids, nb::handle consumed, nb::handle hidden,
                         int return_hidden, nb::handle features) {
    return engine_run(pe, s, ids, "all", consumed, hidden, return_hidden, true, features);
}

// one decode step for each of the states (distinct), row i = ids[i]: logits [B, vocab], each row bit for bit
// the state's own one-token forward
nb::object engine_decode_batch(PyEngine& pe, nb::list states, In<int64_t, 1> ids, nb::handle consumed) {
    const int64_t n = static_cast<int64_t>(ids.shape(0));
    return bindings::batch_call<State>(states, ids.data(), n, size_t(pe.engine->config().vocab), consumed,
                                       [&](State* const* st, float* dst) {
                                           pe.engine->forward_batch(st, ids.data(), n, dst);
                                       });
}

// back to the state after the first `keep` tokens of the chain of verify calls; the dropped tokens leave `consumed`
// in the same call, so the session's tokens and state cannot part
void engine_rewind(PyEngine& pe, State& s, int64_t keep, nb::handle consumed) {
    bindings::rewind_call(s.rewindable() - keep, consumed, [&] { pe.engine->rewind(s, keep); });
}

// ---- kernel entry points for tests ----------------------------------------------------------------
struct IsaScope {
    const cpu::Kernels* saved;
    explicit IsaScope(const std::string& name) : saved(&cpu::kernels()) {
        if (name.empty()) return;
        for (cpu::Isa i : {cpu::Isa::Portable, cpu::Isa::AVX2, cpu::Isa::AVX512, cpu::Isa::NEON})
            if (name == cpu::isa_name(i)) {
                if (!cpu::set_isa(i)) throw std::invalid_argument("isa '" + name + "' is not available here");
                return;
            }
        throw std::invalid_argument("unknown isa '" + name + "'");
    }
    ~IsaScope() { cpu::set_isa(saved->isa); }
};

const char* const activation_names[3] = {"float", "int8", "int16"};
int activation_planes(const std::string& a) {
    for (int i = 0; i < 3; ++i)
        if (a == activation_names[i]) return i;
    throw std::invalid_argument("activations must be 'float', 'int8' or 'int16', not '" + a + "'");
}

// Y = X W^T, `repeats` times on one pool and workspace; *best = the fastest call's seconds
nb::object linear_impl(const nb::dict& desc, In<float, 2> X, int threads, const std::string& isa, int planes,
                       int repeats, double* best) {
    const TensorDesc d = parse_desc(desc);
    const WMat W = wmat_of(d);
    if (W.quantized()) cpu::check_affine("desc", W.bits, W.group_size, W.cols);
    if (static_cast<int64_t>(X.shape(1)) != W.cols) throw std::invalid_argument("X has the wrong width");
    const int64_t M = static_cast<int64_t>(X.shape(0));
    auto Y = new_array({size_t(M), size_t(W.rows)});
    {
        nb::gil_scoped_release release;
        IsaScope scope(isa);
        ThreadPool pool(threads);
        cpu::Workspace ws(pool.size());
        ws.planes = planes;
        ws.reserve(cpu::linear_thread_floats(W.cols), cpu::linear_xvec_floats(W.cols, M), size_t(M));
        cpu::LinearOut o = {&W, Y.data(), W.rows, false};
        *best = 1e30;
        for (int r = 0; r < repeats; ++r) {
            const auto t0 = std::chrono::steady_clock::now();
            cpu::linear(pool, ws, X.data(), M, W.cols, &o, 1);
            *best = std::min(*best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
    }
    return nb::cast(Y);
}

nb::object k_linear(const nb::dict& desc, In<float, 2> X, int threads, const std::string& isa, int planes) {
    double best;
    return linear_impl(desc, X, threads, isa, planes, 1, &best);
}

nb::tuple k_linear_timed(const nb::dict& desc, In<float, 2> X, int threads, const std::string& isa, int planes,
                         int repeats) {
    if (repeats < 1) throw std::invalid_argument("linear: repeats must be >= 1");
    double best;
    nb::object y = linear_impl(desc, X, threads, isa, planes, repeats, &best);
    return nb::make_tuple(y, best);
}

// Gated delta rule on one head: q, k [L, dk], v [L, dv], beta, g [L]; state [dv, dk] updated in place.
nb::object k_gdn(In<float, 2> q, In<float, 2> k, In<float, 2> v, In<float, 1> beta, In<float, 1> g,
                 InOut<float, 2> state, bool chunked, const std::string& isa) {
    const int64_t L = q.shape(0), dk = q.shape(1), dv = v.shape(1);
    if (k.shape(0) != size_t(L) || v.shape(0) != size_t(L) || k.shape(1) != size_t(dk) || beta.shape(0) != size_t(L) ||
        g.shape(0) != size_t(L) || state.shape(0) != size_t(dv) || state.shape(1) != size_t(dk))
        throw std::invalid_argument("gdn: inconsistent shapes");
    auto O = new_array({size_t(L), size_t(dv)});
    {
        nb::gil_scoped_release release;
        IsaScope scope(isa);
        const cpu::Kernels& kk = cpu::kernels();
        // q, k, v of one token share a stride in the engine; pack them so here too
        const int64_t ld = 2 * dk + dv;
        std::vector<float> qkv(size_t(L * ld));
        for (int64_t t = 0; t < L; ++t) {
            std::copy(q.data() + t * dk, q.data() + (t + 1) * dk, qkv.begin() + t * ld);
            std::copy(k.data() + t * dk, k.data() + (t + 1) * dk, qkv.begin() + t * ld + dk);
            std::copy(v.data() + t * dv, v.data() + (t + 1) * dv, qkv.begin() + t * ld + 2 * dk);
        }
        if (chunked) {
            std::vector<float> scratch(cpu::gdn_chunk_floats(dk, dv));
            cpu::gdn_chunked_head(kk, state.data(), L, qkv.data(), qkv.data() + dk, qkv.data() + 2 * dk, ld,
                                  beta.data(), g.data(), 1, O.data(), dv, dk, dv, scratch.data());
        } else {
            cpu::gdn_recurrent_head(kk, state.data(), L, qkv.data(), qkv.data() + dk, qkv.data() + 2 * dk, ld,
                                    beta.data(), g.data(), 1, O.data(), dv, dk, dv);
        }
    }
    return nb::cast(O);
}

// Causal GQA attention: q [L, nh, hd] (already normalised/rotated), keys/values [T, nkv, hd] float32
// with T = pos0 + L; the cache is stored as float32 or bf16 (kv_f32). Returns [L, nh*hd].
// Causal GQA attention of q [L, nh, hd] over keys/values [pos0 + L, nkv, hd]; `repeats` > 1 times the
// kernel alone (the cache is built once) and returns (output, best seconds) for kernel benchmarks.
nb::object attention_impl(In<float, 3> q, In<float, 3> keys, In<float, 3> values, int64_t pos0, bool kv_f32,
                          int threads, const std::string& isa, int repeats, double* best) {
    const int64_t L = q.shape(0), nh = q.shape(1), hd = q.shape(2), T = keys.shape(0), nkv = keys.shape(1);
    if (T != pos0 + L || values.shape(0) != size_t(T) || keys.shape(2) != size_t(hd) || nh % nkv)
        throw std::invalid_argument("attention: inconsistent shapes");
    auto O = new_array({size_t(L), size_t(nh * hd)});
    {
        nb::gil_scoped_release release;
        IsaScope scope(isa);
        const size_t n = size_t(T * nkv * hd);
        std::vector<float> kf, vf;
        std::vector<uint16_t> kb, vb;
        cpu::KVCacheView cv{nullptr, nullptr, kv_f32};
        if (kv_f32) {
            kf.assign(keys.data(), keys.data() + n);
            vf.assign(values.data(), values.data() + n);
            cv.k = kf.data();
            cv.v = vf.data();
        } else {
            kb.resize(n);
            vb.resize(n);
            for (size_t i = 0; i < n; ++i) {
                kb[i] = f32_to_bf16(keys.data()[i]);
                vb[i] = f32_to_bf16(values.data()[i]);
            }
            cv.k = kb.data();
            cv.v = vb.data();
        }
        cpu::AttnDims d{nh, nkv, hd, 0, hd, nh * hd, 1e-6f};
        ThreadPool pool(threads);
        cpu::Workspace ws(pool.size());
        ws.reserve(cpu::attention_thread_floats(d), 0);
        std::vector<float> shared(cpu::attention_shared_floats(d, L, T) + 1);
        *best = 1e30;
        for (int r = 0; r < repeats; ++r) {
            const auto t0 = std::chrono::steady_clock::now();
            cpu::attention(pool, ws, shared.data(), d, q.data(), L, pos0, cv, O.data(), nh * hd);
            *best = std::min(*best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
    }
    return nb::cast(O);
}

nb::object k_attention(In<float, 3> q, In<float, 3> keys, In<float, 3> values, int64_t pos0, bool kv_f32,
                       int threads, const std::string& isa) {
    double best;
    return attention_impl(q, keys, values, pos0, kv_f32, threads, isa, 1, &best);
}

nb::tuple k_attention_timed(In<float, 3> q, In<float, 3> keys, In<float, 3> values, int64_t pos0, bool kv_f32,
                            int threads, const std::string& isa, int repeats) {
    if (repeats < 1) throw std::invalid_argument("attention: repeats must be >= 1");
    double best;
    nb::object o = attention_impl(q, keys, values, pos0, kv_f32, threads, isa, repeats, &best);
    return nb::make_tuple(o, best);
}

nb::tuple k_route(In<float, 1> logits, int64_t k, bool norm_topk) {
    const int64_t E = logits.shape(0);
    if (k < 1 || k > E) throw std::invalid_argument("route: bad k");
    std::vector<int32_t> idx(static_cast<size_t>(k));
    std::vector<float> wts(static_cast<size_t>(k)), probs(static_cast<size_t>(E));
    cpu::route_token(logits.data(), E, k, norm_topk, idx.data(), wts.data(), probs.data());
    nb::list i, w;
    for (int64_t j = 0; j < k; ++j) {
        i.append(idx[j]);
        w.append(wts[j]);
    }
    return nb::make_tuple(i, w);
}

nb::tuple k_quantize(nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> w, int bits, int group_size) {
    const int64_t rows = w.shape(0), cols = w.shape(1);
    cpu::check_affine("quantize", bits, group_size, cols);
    uint32_t* wq = new uint32_t[size_t(rows * cols * bits / 32)];
    uint16_t* s = new uint16_t[size_t(rows * (cols / group_size))];
    uint16_t* b = new uint16_t[size_t(rows * (cols / group_size))];
    {
        nb::gil_scoped_release release;
        cpu::quantize_affine(w.data(), DType::F32, cols, rows, cols, bits, group_size, wq, s, b);
    }
    nb::capsule ow(wq, [](void* p) noexcept { delete[] static_cast<uint32_t*>(p); });
    nb::capsule os(s, [](void* p) noexcept { delete[] static_cast<uint16_t*>(p); });
    nb::capsule ob(b, [](void* p) noexcept { delete[] static_cast<uint16_t*>(p); });
    return nb::make_tuple(
        nb::ndarray<nb::numpy, uint32_t, nb::ndim<2>>(wq, {size_t(rows), size_t(cols * bits / 32)}, ow),
        nb::ndarray<nb::numpy, uint16_t, nb::ndim<2>>(s, {size_t(rows), size_t(cols / group_size)}, os),
        nb::ndarray<nb::numpy, uint16_t, nb::ndim<2>>(b, {size_t(rows), size_t(cols / group_size)}, ob));
}

// state <-> arrays (Session.save / Session.load): raw KV rows [P, nkv*hd] in the cache dtype (uint16 bits of
// bf16, or float32), conv [K-1, conv_dim] and ssm [nv*dv*dk] float32; Python does the layout
nb::tuple state_export(const State& s) {
    nb::list kv, conv, ssm;
    const size_t P = size_t(s.position), row = size_t(s.kv_row_bytes()) / (s.kv_f32() ? 4 : 2);
    for (int64_t i = 0; i < 2 * s.n_attention(); ++i) {
        const void* src = (i % 2) ? s.v(size_t(i / 2)) : s.k(size_t(i / 2));
        if (s.kv_f32()) {
            auto a = new_array({P, row});
            if (P) std::memcpy(a.data(), src, P * row * 4);
            kv.append(nb::cast(a));
        } else {
            uint16_t* p = new uint16_t[P * row + 1];
            if (P) std::memcpy(p, src, P * row * 2);
            nb::capsule owner(p, [](void* q) noexcept { delete[] static_cast<uint16_t*>(q); });
            kv.append(nb::cast(nb::ndarray<nb::numpy, uint16_t, nb::ndim<2>>(p, {P, row}, owner)));
        }
    }
    for (int64_t i = 0; i < s.n_gdn(); ++i) {
        auto c = new_array({size_t(s.conv_floats())});
        std::memcpy(c.data(), s.conv(size_t(i)), size_t(s.conv_floats()) * 4);
        conv.append(nb::cast(c));
        auto m = new_array({size_t(s.ssm_floats())});
        std::memcpy(m.data(), s.ssm(size_t(i)), size_t(s.ssm_floats()) * 4);
        ssm.append(nb::cast(m));
    }
    return nb::make_tuple(s.position, kv, conv, ssm);
}

void state_import(State& s, int64_t position, nb::list kv, nb::list conv, nb::list ssm) {
    const size_t row_bytes = size_t(s.kv_row_bytes());
    if (position < 0 || nb::len(kv) != size_t(2 * s.n_attention()) || nb::len(conv) != size_t(s.n_gdn()) ||
        nb::len(ssm) != size_t(s.n_gdn()))
        throw std::invalid_argument("state arrays do not match this model");
    std::vector<nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>> k;
    for (nb::handle h : kv) {
        auto a = nb::cast<nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>>(h);
        if (a.nbytes() != size_t(position) * row_bytes) throw std::invalid_argument("KV array of the wrong size");
        k.push_back(a);
    }
    std::vector<In<float, 1>> c, m;
    for (nb::handle h : conv) {
        c.push_back(nb::cast<In<float, 1>>(h));
        if (c.back().shape(0) != size_t(s.conv_floats())) throw std::invalid_argument("conv state of the wrong size");
    }
    for (nb::handle h : ssm) {
        m.push_back(nb::cast<In<float, 1>>(h));
        if (m.back().shape(0) != size_t(s.ssm_floats())) throw std::invalid_argument("recurrent state of the wrong size");
    }
    s.reserve(position);
    for (size_t i = 0; i < k.size(); ++i)
        if (position) std::memcpy((i % 2) ? s.v(i / 2) : s.k(i / 2), k[i].data(), size_t(position) * row_bytes);
    for (size_t i = 0; i < c.size(); ++i) {
        std::memcpy(s.conv(i), c[i].data(), size_t(s.conv_floats()) * 4);
        std::memcpy(s.ssm(i), m[i].data(), size_t(s.ssm_floats()) * 4);
    }
    s.position = position;
}

}  // namespace

namespace qwenmetal::bindings {

void register_cpu_engine(nb::module_& m) {
    nb::class_<State>(m, "CpuState", "One sequence's decode state, held in C++ (KV cache, conv and GDN states).")
        .def_prop_ro("position", [](const State& s) { return s.position; }, "tokens consumed so far")
        .def_rw("rope_delta", &State::rope_delta,
                "the next token's RoPE position minus its index, its cache row (M-RoPE after an image; an MTP "
                "head's layer caches skip positions)")
        .def_prop_ro("nbytes", [](const State& s) { return s.nbytes(); },
                     "bytes of state as stored (KV cache counted up to the position)")
        .def_prop_ro("allocated_nbytes", [](const State& s) { return s.allocated_bytes(); },
                     "bytes allocated, including KV capacity reserved ahead")
        .def_prop_ro("capacity", [](const State& s) { return s.capacity(); }, "tokens the KV cache can hold")
        .def_prop_ro("kv_dtype", [](const State& s) { return std::string(s.kv_f32() ? "float32" : "bfloat16"); })
        .def_prop_ro("rewindable", &State::rewindable, "tokens of the last verify() that rewind() can drop back within (0: none)")
        .def("copy", [](const State& s) { return std::make_unique<State>(s); }, "a deep, independent copy")
        .def("reset", &State::reset, "back to position 0 with zeroed recurrent state")
        .def("_export", &state_export, "(position, [k0, v0, ...] raw KV rows, [conv], [ssm]) copies")
        .def("_import", &state_import, "position"_a, "kv"_a, "conv"_a, "ssm"_a, "inverse of _export")
        .def("__repr__", [](const State& s) {
            return "CpuState(position=" + std::to_string(s.position) + ", " + std::to_string(s.nbytes()) + " bytes)";
        });

    nb::class_<PyEngine>(m, "CpuEngine", "The C++ CPU engine over one checkpoint's weights.")
        .def("__init__",
             [](PyEngine* self, nb::dict config, nb::list mappings, nb::dict tensors, nb::dict small, int threads,
                bool kv_f32, int64_t prefill_chunk, int quantize, nb::object keepalive, const std::string& activations,
                nb::object stream) {
                 Config c = parse_config(config);
                 const WeightTable w = bindings::parse_table(mappings, tensors);
                 std::map<std::string, TensorDesc> t;
                 for (const auto& [name, d] : w.tensors) t[name] = desc_of(w, name, d);
                 std::map<std::string, std::vector<float>> s;
                 for (auto [k, v] : small) {
                     auto a = nb::cast<In<float, 1>>(v);
                     s[nb::cast<std::string>(k)] = std::vector<float>(a.data(), a.data() + a.shape(0));
                 }
                 Options o;
                 o.threads = threads;
                 o.kv_f32 = kv_f32;
                 o.prefill_chunk = prefill_chunk;
                 o.quantize = quantize;
                 o.act_planes = activation_planes(activations);
                 std::unique_ptr<StreamSpec> spec;
                 if (!stream.is_none()) spec = std::make_unique<StreamSpec>(parse_stream(nb::cast<nb::dict>(stream)));
                 std::unique_ptr<Engine> e;
                 {
                     nb::gil_scoped_release release;
                     e = std::make_unique<Engine>(c, t, s, o, spec.get());
                 }
                 new (self) PyEngine{std::move(e), keepalive};
             },
             "config"_a, "mappings"_a, "tensors"_a, "small"_a, "threads"_a, "kv_f32"_a, "prefill_chunk"_a, "quantize"_a,
             "keepalive"_a, "activations"_a = "float", "stream"_a = nb::none())
        .def("new_state", [](PyEngine& pe) { return pe.engine->new_state(); })
        .def("forward", &engine_forward, "state"_a, "ids"_a, "logits"_a, "consumed"_a = nb::none(),
             "hidden"_a = nb::none(), "return_hidden"_a = 0, "features"_a = nb::none(), "pair_pos"_a = nb::none(),
             "embed_rows"_a = nb::none(), "embeds"_a = nb::none(), "rope_delta"_a = nb::none(),
             "Run ids (int64, 1-D) at the state's position, updating it in place; returns float32 logits "
             "[vocab] ('last'), [n, vocab] ('all') or None. The ids are appended to `consumed` (a session's "
             "token list) inside the call. The GIL is released; between chunks a call from the main thread "
             "runs Python's signal handlers. On error or interrupt the state is unchanged. hidden: an MTP head "
             "engine's input, the main model's final-normed hidden rows [n, hidden_size] before the ids; "
             "return_hidden: 1 returns (logits, the final-normed hidden rows of the logits), 2 (logits or None, "
             "every row's). features: decoder-layer indices (1..8, distinct, any order; not with return_hidden): "
             "returns (logits or None, every row's outputs of those layers, concatenated in that order "
             "[n, len(features) * hidden_size] float32: the residual stream after each, before the final norm). "
             "pair_pos: int32 [n, rotary_dim / 2] the rows' RoPE position per frequency pair (interleaved M-RoPE; "
             "default: index + the state's rope_delta); embeds float32 [m, hidden_size] replace the embedding "
             "lookup of the rows embed_rows (int64 [m], increasing); rope_delta: the state's delta after the call.")
        .def("verify", &engine_verify, "state"_a, "ids"_a, "consumed"_a = nb::none(), "hidden"_a = nb::none(),
             "return_hidden"_a = 0, "features"_a = nb::none(),
             "Run ids like forward(..., 'all'), each row computed as a one-token call computes it (at most 32 "
             "ids, and prefill_chunk), keeping what rewind() needs; consecutive verify() calls form one chain. "
             "Returns float32 logits [n, vocab]; with features (as forward's), (logits, features), each row's "
             "bit for bit a one-token call's.")
        .def("decode_batch", &engine_decode_batch, "states"_a, "ids"_a, "consumed"_a = nb::none(),
             "One decode step for each state (distinct): row i runs ids[i] on states[i] at its own position, the "
             "weights read once for all rows; returns float32 logits [n, vocab], row i bit for bit states[i]'s own "
             "one-token forward. All-or-nothing for every state; ids[i] is appended to consumed[i].")
        .def("rewind", &engine_rewind, "state"_a, "keep"_a, "consumed"_a = nb::none(),
             "After verify() calls of n ids in all: the state after the first `keep` (0..n) of them, bit for "
             "bit what one-token calls of those leave; the other n - keep ids leave the end of `consumed`.")
        .def_prop_ro("is_mtp_head", [](PyEngine& pe) { return pe.engine->is_mtp_head(); },
                     "built from an MTP head's tensors (fc, pre_fc_norm_embedding, pre_fc_norm_hidden)")
        .def_prop_ro("threads", [](PyEngine& pe) { return pe.engine->threads(); })
        .def_prop_ro("prefill_chunk", [](PyEngine& pe) { return pe.engine->options().prefill_chunk; })
        .def_prop_ro("activations", [](PyEngine& pe) {
            return std::string(activation_names[pe.engine->options().act_planes]);
        })
        .def_prop_ro("kv_dtype", [](PyEngine& pe) {
            return std::string(pe.engine->options().kv_f32 ? "float32" : "bfloat16");
        })
        .def_prop_ro("weight_nbytes", [](PyEngine& pe) { return pe.engine->weight_bytes(); },
                     "bytes of weights the forward pass reads from (mapped + owned)")
        .def_prop_ro("owned_weight_nbytes", [](PyEngine& pe) { return pe.engine->owned_weight_bytes(); },
                     "bytes of weights held in engine memory (quantized at load, streamed experts' slots)")
        .def("expert_stats", [](PyEngine& pe) { return expert_stats(*pe.engine); },
             "{streaming, slots_per_layer, policy, lookups, hits, misses, bytes_read, io_seconds, tokens} since "
             "the last reset_expert_stats (all zero when not streaming)")
        .def("reset_expert_stats", [](PyEngine& pe) { pe.engine->reset_expert_stats(); },
             nb::call_guard<nb::gil_scoped_release>());

    m.def("cpu_pool_flushes_denormals", [](int threads) {
        std::vector<char> flushed(64, 0);
        int ran = 0;
        {
            nb::gil_scoped_release release;
            ThreadPool pool(threads);
            std::atomic<int> mask{0};
            const int all = (1 << pool.size()) - 1;
            pool.run(static_cast<int64_t>(flushed.size()), [&](int64_t t, int th) {
                volatile float tiny = 1e-38f;   // a normal float whose half is denormal
                flushed[static_cast<size_t>(t)] = tiny * 0.5f == 0.f;
                // the first tasks wait (at most 5 s) until every thread has run one, so workers are covered
                mask.fetch_or(1 << th);
                const auto t0 = std::chrono::steady_clock::now();
                while (mask.load() != all && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5))
                    std::this_thread::yield();
            });
            ran = __builtin_popcount(static_cast<unsigned>(mask.load()));
        }
        nb::list out;
        for (char f : flushed) out.append(f != 0);
        return nb::make_tuple(out, ran);
    }, "threads"_a, "tests: per task of one pool run, whether a denormal result was flushed to zero "
                    "(core/fpenv.h), and how many of the pool's threads ran tasks");
    m.def("cpu_physical_cores", &physical_cores, "physical cores available to this process");
    m.def("cpu_isa", [] { return std::string(cpu::kernels().name); }, "the SIMD kernels in use");
    m.def("cpu_info", [] {
        const cpu::CpuInfo& ci = cpu::cpu_info();
        nb::dict d, kernels;
        d["vendor"] = ci.vendor;
        d["model_name"] = ci.model_name;
        d["family"] = ci.family;
        d["model"] = ci.model;
        d["stepping"] = ci.stepping;
        d["uarch"] = ci.uarch;
        d["isa"] = std::string(cpu::kernels().name);
        nb::list features;
        for (const std::string& f : ci.feature_names()) features.append(f);
        d["features"] = features;
        d["amx"] = cpu::amx_enabled();
        for (const auto& [family, variant] : cpu::kernel_choices()) kernels[family.c_str()] = variant;
        d["kernels"] = kernels;
        return d;
    }, "this CPU: {vendor, model_name, family, model, stepping, uarch, isa (== cpu_isa()), features, amx "
       "(AMX in use now), kernels: {kernel family: the variant it uses now}} (detected once, src/cpu/cpu_info.cpp)");
    m.def("cpu_isas", [] {
        nb::list l;
        for (cpu::Isa i : {cpu::Isa::Portable, cpu::Isa::AVX2, cpu::Isa::AVX512, cpu::Isa::NEON})
            if (cpu::kernels_for(i)) l.append(std::string(cpu::isa_name(i)));
        return l;
    }, "the SIMD kernel sets this CPU can run");
    m.def("cpu_set_isa", [](const std::string& name) {
        for (cpu::Isa i : {cpu::Isa::Portable, cpu::Isa::AVX2, cpu::Isa::AVX512, cpu::Isa::NEON})
            if (name == cpu::isa_name(i)) {
                if (!cpu::set_isa(i)) throw std::invalid_argument("isa '" + name + "' is not available here");
                return;
            }
        throw std::invalid_argument("unknown isa '" + name + "'");
    }, "select the SIMD kernels (tests and benchmarks)");
    m.def("cpu_linear", &k_linear, "desc"_a, "x"_a, "threads"_a = 1, "isa"_a = "", "planes"_a = 0,
          "Y = X W^T through the engine's GEMV (<= 3 rows) or GEMM path (tests); planes 1 / 2: inputs "
          "quantized per group of 64 to int8 / two int8 planes (activations='int8' / 'int16').");
    m.def("cpu_linear_timed", &k_linear_timed, "desc"_a, "x"_a, "threads"_a = 1, "isa"_a = "", "planes"_a = 0,
          "repeats"_a = 10, "cpu_linear run `repeats` times on one pool; (Y, fastest call in seconds) (benchmarks).");
    m.def("cpu_amx", [] { return cpu::amx_enabled(); }, "prefill GEMMs use the AMX tile unit (activations int8/int16)");
    m.def("cpu_amx_available", [] { return cpu::amx_available(); },
          "the CPU has AMX-INT8/BF16 and the OS granted the tile state (QWENMETAL_AMX=0 turns it off)");
    m.def("cpu_amx_orientation", [](int o) { cpu::g_amx_orientation = o; }, "orientation"_a,
          "tests: the AMX kernel's operand orientation, 0 = by its cost model, 1 = weights as B, 2 = weights as A");
    m.def("cpu_set_amx", [](bool on) { cpu::set_amx(on); }, "on",
          "allow (default, if available) or forbid AMX in the prefill GEMMs (tests: the AVX-512 kernels)");
    m.def("cpu_set_vnni_gemm", [](bool on) { cpu::set_vnni_gemm(on); }, "on",
          "allow (default) or forbid the AVX-512 VNNI prefill GEMM when AMX is not in use (tests: the older "
          "register tile); cpu_info()['kernels']['gemm_int'] names the kernel in use");
    m.def("cpu_vnni", [] { return cpu::vnni_enabled(); }, "the int8 GEMV uses AVX512-VNNI");
    m.def("cpu_set_vnni", [](bool on) { cpu::set_vnni(on); },
          "allow (default) or forbid VNNI in the int8 GEMV: AVX512-VNNI in the avx512 kernels, AVX-VNNI in the "
          "avx2 ones (tests: the AVX512BW / AVX2 vpmaddubsw fallbacks)");
    m.def("cpu_neon_dot", [] { return std::string(cpu::neon_dot_name(cpu::neon_dot())); },
          "the NEON integer kernels in use: 'i8mm', 'dotprod' or 'neon' (plain; also off arm64)");
    m.def("cpu_set_neon_dot", [](const std::string& variant) {
        for (cpu::NeonDot d : {cpu::NeonDot::Plain, cpu::NeonDot::DotProd, cpu::NeonDot::I8MM})
            if (variant == cpu::neon_dot_name(d)) {
                if (d > cpu::neon_dot_available())
                    throw std::invalid_argument("variant '" + variant + "' is not available on this CPU");
                cpu::set_neon_dot(d);
                return;
            }
        throw std::invalid_argument("unknown variant '" + variant + "' (neon, dotprod, i8mm)");
    }, "variant", "use the NEON integer kernels up to `variant` (tests: each one the CPU has)");
    m.def("cpu_gdn", &k_gdn, "q"_a, "k"_a, "v"_a, "beta"_a, "g"_a, "state"_a, "chunked"_a, "isa"_a = "",
          "Gated delta rule on one head, recurrent or chunked (tests).");
    m.def("cpu_attention", &k_attention, "q"_a, "keys"_a, "values"_a, "pos0"_a, "kv_f32"_a, "threads"_a = 1,
          "isa"_a = "", "Causal GQA attention through the engine's kernel (tests).");
    m.def("cpu_attention_timed", &k_attention_timed, "q"_a, "keys"_a, "values"_a, "pos0"_a, "kv_f32"_a,
          "threads"_a = 1, "isa"_a = "", "repeats"_a = 10,
          "cpu_attention run `repeats` times on one cache: (output, best seconds) for kernel benchmarks.");
    m.def("cpu_route", &k_route, "logits"_a, "k"_a, "norm_topk"_a, "Router top-k of one token (tests).");
    m.def("cpu_quantize", &k_quantize, "w"_a, "bits"_a, "group_size"_a,
          "MLX affine quantizer of the engine (float32 input; bf16 scales/biases as uint16).");
}

}  // namespace qwenmetal::bindings

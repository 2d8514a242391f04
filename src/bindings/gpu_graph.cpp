// gpu: the decode graph (src/gpu/forward.cpp) as the engine of the metal-sim / metal backends
// (python/qwenmetal/metal_backend.py): GpuEngine, GpuState. Compute releases the GIL; calls from the main
// thread run Python's signal handlers between tokens / steps (an interrupt restores the state).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <optional>

#include "bindings/config.h"
#include "bindings/expert_cache.h"
#include "bindings/forward_call.h"
#include "bindings/gpu.h"
#include "bindings/weights_table.h"
#include "gpu/model.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace qwenmetal::bindings {

using namespace qwenmetal::gpu;

namespace {

template <class T>
nb::ndarray<nb::numpy, T> copy_out(const void* src, std::vector<size_t> shape) {
    size_t n = 1;
    for (size_t s : shape) n *= s;
    T* p = new T[n ? n : 1];
    if (n) std::memcpy(p, src, n * sizeof(T));
    nb::capsule owner(p, [](void* q) noexcept { delete[] static_cast<T*>(q); });
    return nb::ndarray<nb::numpy, T>(p, shape.size(), shape.data(), owner);
}

}  // namespace

// a StepCost as a dict; level_bytes / level_flops: u64 arrays, one entry per dependency level
nb::dict cost_dict(const StepCost& c) {
    nb::dict d;
    d["dispatches"] = c.dispatches;
    d["levels"] = c.levels;
    d["command_buffers"] = c.command_buffers;
    d["host_waits"] = c.host_waits;
    d["bytes_read"] = c.bytes_read;
    d["bytes_written"] = c.bytes_written;
    d["flops"] = c.flops;
    std::vector<uint64_t> b, f;
    for (const LevelStats& l : c.per_level) {
        b.push_back(l.bytes);
        f.push_back(l.flops);
    }
    d["level_bytes"] = copy_out<uint64_t>(b.data(), {b.size()});
    d["level_flops"] = copy_out<uint64_t>(f.data(), {f.size()});
    // the first level of each command buffer (the graph cuts a prefill chunk into several)
    d["command_buffer_levels"] = copy_out<uint64_t>(c.command_buffer_levels.data(), {c.command_buffer_levels.size()});
    return d;
}

namespace {

void need_host(const Buffer& b, const char* what) {
    if (!b.data()) throw std::invalid_argument(std::string("metal backend: ") + what + " has no host contents (encode-only)");
}

}  // namespace

void register_gpu_graph(nb::module_& g) {
    nb::class_<GpuState>(g, "GpuState")
        .def_prop_ro("position", [](const GpuState& s) { return s.position; })
        .def_rw("rope_delta", &GpuState::rope_delta, "the next token's RoPE position minus its index (M-RoPE)")
        .def_prop_ro("nbytes", &GpuState::nbytes)
        .def_prop_ro("capacity", &GpuState::capacity)
        .def_prop_ro("rewindable", &GpuState::rewindable, "tokens of the open verify() chain (0: none)")
        .def_prop_ro("verify_bytes", &GpuState::pool_bytes,
                     "device bytes of the GDN state sets kept for verification rows")
        .def("copy", [](const GpuState& s) { return std::make_unique<GpuState>(s); })
        .def("reset", &GpuState::reset)
        // costing at a context length without computing it (encode-only states hold no contents)
        .def("_set_position", [](GpuState& s, int64_t p) {
            if (p < 0) throw std::invalid_argument("position must be >= 0");
            s.reserve(p + 1);
            s.end_chain();
            s.position = p;
        })
        // (position, [K, V of each attention layer as u8 [n_kv * position * head_row]], [conv f32], [ssm f32])
        .def("_export", [](const GpuState& s) {
            nb::list kv, conv, ssm;
            const uint64_t hr = s.kv_head_row_bytes(), P = uint64_t(s.position), cap = s.capacity();
            for (const ops::KVCache& c : s.kv)
                for (const Buffer* b : {&c.k, &c.v}) {
                    need_host(*b, "the KV cache");
                    std::vector<uint8_t> rows(s.kv_heads() * P * hr);
                    for (uint32_t h = 0; h < s.kv_heads(); ++h)
                        std::memcpy(rows.data() + h * P * hr, b->as<uint8_t>() + h * cap * hr, P * hr);
                    kv.append(copy_out<uint8_t>(rows.data(), {rows.size()}));
                }
            for (size_t i = 0; i < s.n_gdn(); ++i) {
                need_host(s.conv_in(i), "the conv state");
                conv.append(copy_out<float>(s.conv_in(i).data(), {size_t(s.conv_in(i).length / 4)}));
                ssm.append(copy_out<float>(s.ssm_in(i).data(), {size_t(s.ssm_in(i).length / 4)}));
            }
            return nb::make_tuple(s.position, kv, conv, ssm);
        })
        // the inverse of _export, on a fresh state
        .def("_import", [](GpuState& s, int64_t position, nb::list kv, nb::list conv, nb::list ssm) {
            using U8 = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
            using F32 = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
            if (kv.size() != 2 * s.kv.size() || conv.size() != s.n_gdn() || ssm.size() != s.n_gdn())
                throw std::invalid_argument("metal backend: state arrays do not match the model's layers");
            s.reserve(std::max<int64_t>(position, 1));
            s.end_chain();
            const uint64_t hr = s.kv_head_row_bytes(), P = uint64_t(position), cap = s.capacity();
            for (size_t i = 0; i < s.kv.size(); ++i)
                for (int j = 0; j < 2; ++j) {
                    U8 a = nb::cast<U8>(kv[2 * i + j]);
                    const Buffer& dst = j ? s.kv[i].v : s.kv[i].k;
                    need_host(dst, "the KV cache");
                    if (a.shape(0) != s.kv_heads() * P * hr)
                        throw std::invalid_argument("metal backend: KV array of the wrong size");
                    for (uint32_t h = 0; h < s.kv_heads(); ++h)
                        std::memcpy(dst.as<uint8_t>() + h * cap * hr, a.data() + h * P * hr, P * hr);
                }
            for (size_t i = 0; i < s.n_gdn(); ++i) {
                F32 c = nb::cast<F32>(conv[i]);
                F32 r = nb::cast<F32>(ssm[i]);
                if (c.size() * 4 != s.conv_in(i).length || r.size() * 4 != s.ssm_in(i).length)
                    throw std::invalid_argument("metal backend: GDN state array of the wrong size");
                need_host(s.conv_in(i), "the conv state");
                std::memcpy(s.conv_in(i).data(), c.data(), s.conv_in(i).length);
                std::memcpy(s.ssm_in(i).data(), r.data(), s.ssm_in(i).length);
            }
            s.position = position;
        });

    nb::class_<PyGpuEngine>(g, "GpuEngine")
        .def("__init__",
             [](PyGpuEngine* self, std::shared_ptr<Device> dev, nb::dict config, nb::list mappings, nb::dict tensors,
                const std::string& act, bool kv_f32, nb::dict policy, nb::object keep, nb::dict prefill,
                nb::object streaming, const PyGpuEngine* share) {
                 Config c = parse_config(config);
                 WeightTable w = parse_table(mappings, tensors);
                 GpuOptions o;
                 o.act = parse_act(act);
                 o.kv_f32 = kv_f32;
                 for (auto [k, v] : policy) {
                     const std::string key = nb::cast<std::string>(k);
                     if (key == "single_pass_max") o.attn.single_pass_max = nb::cast<uint32_t>(v);
                     else if (key == "split_max") o.attn.split_max = nb::cast<uint32_t>(v);
                     else if (key == "split_block") o.attn.split_block = nb::cast<uint32_t>(v);
                     else if (key == "long_block") o.attn.long_block = nb::cast<uint32_t>(v);
                     else if (key == "gqa_pack") o.attn.gqa_pack = nb::cast<bool>(v);
                     else if (key == "kv_block") o.kv_block = nb::cast<uint32_t>(v);
                     else throw std::invalid_argument("unknown attention policy key '" + key + "'");
                 }
                 for (auto [k, v] : prefill) {
                     const std::string key = nb::cast<std::string>(k);
                     if (key == "chunk") o.prefill_chunk = nb::cast<uint32_t>(v);
                     else if (key == "gemm_route") {
                         const std::string r = nb::cast<std::string>(v);
                         o.gemm_route_auto = r == "auto";
                         if (!o.gemm_route_auto) o.gemm_route = ops::parse_gemm_route(r);
                     } else if (key == "gdn_route") {
                         o.gdn_route = ops::parse_gdn_route(nb::cast<std::string>(v));
                     } else if (key == "command_buffer_seconds") {
                         o.command_buffer_seconds = nb::cast<double>(v);
                     } else throw std::invalid_argument("unknown prefill option '" + key + "'");
                 }
                 // streaming: cpu_backend.stream_spec's dict (its "stacks" unused: the GPU model reads the
                 // stacks' formats from the weights table)
                 std::optional<ExpertStreaming> stream;
                 if (!streaming.is_none()) {
                     stream.emplace();
                     parse_stream_tables(nb::cast<nb::dict>(streaming), stream->files, stream->layers, stream->cache);
                     stream->cache.num_experts = int(c.n_experts);
                 }
                 new (self) PyGpuEngine();
                 {
                     nb::gil_scoped_release r;
                     self->model = std::make_shared<GpuModel>(dev, c, w, o, stream, share ? share->model.get() : nullptr);
                     self->engine = std::make_unique<GpuEngine>(self->model);
                 }
                 self->keepalive = keep;
             },
             "device"_a, "config"_a, "mappings"_a, "tensors"_a, "act"_a, "kv_f32"_a, "policy"_a, "keep"_a,
             "prefill"_a = nb::dict(), "streaming"_a = nb::none(), "share"_a = nb::none())
        .def("new_state", [](PyGpuEngine& e) { return e.engine->new_state(); })
        .def("forward", [](PyGpuEngine& e, GpuState& s, nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig> ids,
                           const std::string& logits, nb::handle consumed, nb::handle pair_pos, nb::handle embed_rows,
                           nb::handle embeds, nb::handle rope_delta) {
            const int64_t n = int64_t(ids.shape(0));
            const Config& c = e.model->config();
            const bindings::RowArgs rows(pair_pos, embed_rows, embeds, rope_delta, n, c.rotary_dim / 2, c.hidden,
                                         s.rope_delta);
            return forward_call(ids.data(), n, size_t(c.vocab), logits, consumed,
                                [&](int want, float* dst, InterruptPoll poll) {
                                    e.engine->forward(s, ids.data(), n, want, dst, poll, nullptr, nullptr, rows.get());
                                });
        }, "state"_a, "ids"_a, "logits"_a, "consumed"_a = nb::none(), "pair_pos"_a = nb::none(),
           "embed_rows"_a = nb::none(), "embeds"_a = nb::none(), "rope_delta"_a = nb::none(),
           "Prefill ids; pair_pos int32 [n, rotary_dim / 2] (explicit M-RoPE positions per frequency pair), embeds "
           "float32 [m, hidden] at the rows embed_rows (int64 [m], increasing), rope_delta the state's delta after "
           "the call (the cpu engine's arguments).")
        .def("forward_hidden", [](PyGpuEngine& e, GpuState& s, nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig> ids,
                                  const std::string& logits, nb::handle consumed) {
            const int64_t n = int64_t(ids.shape(0));
            auto hid = new_array({size_t(n > 0 ? n : 0), size_t(e.model->config().hidden)});
            float* hp = hid.data();
            nb::object out = forward_call(ids.data(), n, size_t(e.model->config().vocab), logits, consumed,
                                          [&](int want, float* dst, InterruptPoll poll) {
                                              e.engine->forward(s, ids.data(), n, want, dst, poll, nullptr, hp);
                                          });
            return nb::make_tuple(out, nb::cast(hid));
        }, "state"_a, "ids"_a, "logits"_a, "consumed"_a = nb::none(),
           "forward() that also returns every row's final-normed hidden state: (logits or None, hidden f32 [n, "
           "hidden_size]) -- an MTP head's input over a prompt.")
        .def("forward_features", [](PyGpuEngine& e, GpuState& s,
                                    nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig> ids, const std::string& logits,
                                    nb::handle consumed, std::vector<int64_t> layers) {
            const int64_t n = int64_t(ids.shape(0));
            e.engine->check_feature_layers(layers);
            FeatureRequest fr{layers, nullptr};
            auto feats = new_array({size_t(n > 0 ? n : 0), layers.size() * size_t(e.model->config().hidden)});
            fr.out = feats.data();
            nb::object out = forward_call(ids.data(), n, size_t(e.model->config().vocab), logits, consumed,
                                          [&](int want, float* dst, InterruptPoll poll) {
                                              e.engine->forward(s, ids.data(), n, want, dst, poll, &fr);
                                          });
            return nb::make_tuple(out, nb::cast(feats));
        }, "state"_a, "ids"_a, "logits"_a, "consumed"_a, "layers"_a,
           "forward() that also returns the outputs of the decoder layers `layers` (0-based, distinct, 1..8, any "
           "order) for every row: (logits or None, features f32 [n, len(layers) * hidden]), the residual stream "
           "after each layer as the graph holds it, widened to float.")
        .def("verify", [](PyGpuEngine& e, GpuState& s, nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig> ids,
                          nb::handle consumed, bool return_hidden, std::optional<std::vector<int64_t>> features) {
            const int64_t n = int64_t(ids.shape(0));
            if (return_hidden && features)
                throw std::invalid_argument("verify returns hidden states or layer features, not both");
            nb::object hout = nb::none();
            float* hp = nullptr;
            if (return_hidden) {
                auto a = new_array({size_t(n), size_t(e.model->config().hidden)});
                hp = a.data();
                hout = nb::cast(a);
            }
            FeatureRequest fr;
            if (features) {
                e.engine->check_feature_layers(*features);
                fr.layers = *features;
                auto a = new_array({size_t(n), fr.layers.size() * size_t(e.model->config().hidden)});
                fr.out = a.data();
                hout = nb::cast(a);
            }
            nb::object out = forward_call(ids.data(), n, size_t(e.model->config().vocab), "all", consumed,
                                          [&](int, float* dst, InterruptPoll) {
                                              e.engine->verify(s, ids.data(), n, dst, hp, features ? &fr : nullptr);
                                          });
            return return_hidden || features ? nb::object(nb::make_tuple(out, hout)) : out;
        }, "state"_a, "ids"_a, "consumed"_a = nb::none(), "return_hidden"_a = false, "features"_a = nb::none(),
           "Run ids (1..16) with the logits of each ([n, vocab]), every row bit for bit a decode step's, keeping "
           "the GDN state after each row for rewind(); consecutive verify() calls form one chain (16 tokens at "
           "most). return_hidden: (logits, the final-normed rows [n, hidden]); features (decoder-layer indices, "
           "not with return_hidden): (logits, the layers' outputs [n, len(features) * hidden]), row r bit for bit "
           "a one-token forward_features'.")
        .def("rewind", [](PyGpuEngine& e, GpuState& s, int64_t keep, nb::handle consumed) {
            rewind_call(s.rewindable() - keep, consumed, [&] { e.engine->rewind(s, keep); });
        }, "state"_a, "keep"_a, "consumed"_a = nb::none(),
           "After verify() calls of n ids in all: the state after the first `keep` (0..n) of them; the dropped "
           "tokens leave `consumed`. Ends the chain.")
        .def_prop_ro("is_mtp_head", [](PyGpuEngine& e) { return e.model->mtp; },
                     "built from an MTP head's tensors (fc, pre_fc_norm_embedding, pre_fc_norm_hidden)")
        .def("mtp_draft", [](PyGpuEngine& e, GpuState& s, nb::ndarray<const float, nb::ndim<2>, nb::c_contig> hidden,
                             nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig> ids, int64_t k, uint32_t vocab,
                             bool return_logits) {
            const int64_t m = int64_t(ids.shape(0));
            if (int64_t(hidden.shape(0)) != m || int64_t(hidden.shape(1)) != e.model->config().hidden)
                throw std::invalid_argument("mtp_draft: hidden must be [len(ids), hidden_size]");
            if (k < 0) throw std::invalid_argument("mtp_draft: k must be >= 0");
            std::vector<int32_t> drafts(size_t(k), 0);
            nb::object lg = nb::none();
            float* lp = nullptr;
            if (return_logits && k > 0) {
                auto a = new_array({size_t(k), size_t(e.model->config().vocab)});
                lp = a.data();
                lg = nb::cast(a);
            }
            size_t cbs = 0;
            {
                nb::gil_scoped_release r;
                cbs = e.engine->mtp_draft(s, hidden.data(), ids.data(), m, k, vocab, drafts.data(), lp);
            }
            nb::list out;
            for (int32_t d : drafts) out.append(d);
            return nb::make_tuple(out, lg, cbs);
        }, "state"_a, "hidden"_a, "ids"_a, "k"_a, "vocab"_a = 0, "return_logits"_a = false,
           "An MTP head's drafting round in one command buffer: the pairs (hidden[r], ids[r]) through layer 0 (kept "
           "in the state), then k greedy drafts among [0, vocab) (0: all), step j through layer j mod n (dropped; "
           "k = 0: the pairs only). "
           "Returns (drafts, every step's logits [k, vocab] or None, the command buffers run).")
        .def("mtp_cost", [](PyGpuEngine& e, GpuState& s, int64_t pairs, int64_t k) {
            StepCost c;
            {
                nb::gil_scoped_release r;
                c = e.engine->mtp_cost(s, pairs, k);
            }
            return cost_dict(c);
        }, "state"_a, "pairs"_a, "k"_a,
           "Encode, commit and wait an MTP round of `pairs` pairs and k drafts at the state's position (mtp_draft's "
           "graph, no host data; the state does not advance): its cost. For encode-only costing.")
        .def("decode", [](PyGpuEngine& e, GpuState& s, int32_t first, int64_t n, bool greedy, float temperature,
                          uint32_t top_k, float top_p, float min_p, uint64_t seed, std::vector<int32_t> stop_ids,
                          bool pipelined, uint32_t vocab, nb::handle consumed, nb::handle mask) {
            SamplingConfig sc;
            sc.greedy = greedy;
            sc.vocab = vocab;
            sc.params.temperature = temperature;
            sc.params.top_k = top_k;
            sc.params.top_p = top_p;
            sc.params.min_p = min_p;
            sc.params.seed = seed;
            // the token mask: uint32 or int32 words as they are (no conversion: another dtype is an error)
            using U32 = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
            using I32 = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
            U32 a;                                     // held to the end of the call
            I32 b;
            if (!mask.is_none()) {
                if (nb::try_cast(mask, a, false)) {
                    sc.mask = a.data();
                    sc.mask_words = a.shape(0);
                } else if (nb::try_cast(mask, b, false)) {
                    sc.mask = reinterpret_cast<const uint32_t*>(b.data());
                    sc.mask_words = b.shape(0);
                } else {
                    throw std::invalid_argument("metal backend: the token mask must be a 1-D C-contiguous uint32 or "
                                                "int32 numpy array");
                }
            }
            Consumed sink(consumed);
            const InterruptPoll poll = interrupt_poll();
            std::vector<int32_t> out;
            {
                nb::gil_scoped_release r;
                out = e.engine->decode(s, first, n, sc, stop_ids, pipelined, poll);
            }
            // the inputs the state consumed: first and every generated token but the last
            if (!out.empty()) {
                sink.append(&first, 1);
                sink.append(out.data(), out.size() - 1);
            }
            return out;
        }, "state"_a, "first"_a, "n"_a, "greedy"_a = true, "temperature"_a = 1.0f, "top_k"_a = 0, "top_p"_a = 1.0f,
           "min_p"_a = 0.0f, "seed"_a = 0, "stop_ids"_a = std::vector<int32_t>(), "pipelined"_a = true,
           "vocab"_a = 0, "consumed"_a = nb::none(), "mask"_a = nb::none(),
           "Up to n tokens after `first` from the pipelined GPU decode loop. mask (n = 1 only): a token bitmask, "
           "uint32 or int32 [ceil(vocab_size / 32)], bit i % 32 of word i / 32 allowing token i (llguidance's "
           "layout), applied to the step's logits before argmax / sampling; it must allow some token of [0, vocab).")
        // features: the costing with the target features of these layers taken (empty: none)
        .def("encode_cost", [](PyGpuEngine& e, GpuState& s, std::vector<int64_t> features) {
            StepCost c;
            {
                nb::gil_scoped_release r;
                c = e.engine->encode_cost(s, features);
            }
            return cost_dict(c);
        }, "state"_a, "features"_a = std::vector<int64_t>())
        .def("prefill_cost", [](PyGpuEngine& e, GpuState& s, uint32_t rows, bool all_logits,
                                std::vector<int64_t> features) {
            StepCost c;
            {
                nb::gil_scoped_release r;
                c = e.engine->prefill_cost(s, rows, all_logits, features);
            }
            return cost_dict(c);
        }, "state"_a, "rows"_a, "all_logits"_a = false, "features"_a = std::vector<int64_t>())
        .def("verify_cost", [](PyGpuEngine& e, GpuState& s, uint32_t rows, std::vector<int64_t> features) {
            StepCost c;
            {
                nb::gil_scoped_release r;
                c = e.engine->verify_cost(s, rows, features);
            }
            return cost_dict(c);
        }, "state"_a, "rows"_a, "features"_a = std::vector<int64_t>())
        .def("decode_batch", [](PyGpuEngine& e, nb::list states,
                                nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig> ids, nb::handle consumed) {
            const int64_t B = int64_t(ids.shape(0));
            return bindings::batch_call<GpuState>(states, ids.data(), B, size_t(e.model->config().vocab), consumed,
                                                  [&](GpuState* const* st, float* dst) {
                                                      e.engine->decode_batch(std::vector<GpuState*>(st, st + B),
                                                                             ids.data(), B, dst);
                                                  });
        }, "states"_a, "ids"_a, "consumed"_a = nb::none(),
           "One decode step of B (1..16) independent states in one command buffer: row r is ids[r] on states[r] "
           "at its own position; logits [B, vocab], row r bit for bit a one-token forward on states[r] alone. "
           "All-or-nothing; on success every state advanced one token and ids[r] appended to consumed[r].")
        .def("batch_cost", [](PyGpuEngine& e, nb::list states) {
            std::vector<GpuState*> st;
            for (nb::handle h : states) st.push_back(nb::cast<GpuState*>(h));
            StepCost c;
            {
                nb::gil_scoped_release r;
                c = e.engine->batch_cost(st);
            }
            return cost_dict(c);
        }, "states"_a, "encode-only costing of decode_batch over these states (none advances)")
        .def_prop_ro("prefill_chunk", [](PyGpuEngine& e) { return e.engine->prefill_chunk(); })
        .def("reserve_prefill", [](PyGpuEngine& e, uint32_t rows) { e.engine->reserve_prefill(rows); }, "rows"_a,
             nb::call_guard<nb::gil_scoped_release>(), "allocate a prefill chunk's scratch now (memory planning)")
        .def_prop_ro("logits_rows", [](PyGpuEngine& e) { return e.engine->logits_rows(); })
        .def_prop_ro("gemm_route", [](PyGpuEngine& e) {
            return std::string(ops::gemm_route_name(e.engine->gemm_route()));
        })
        .def_prop_ro("device", [](PyGpuEngine& e) { return e.model->device_ptr(); })
        .def_prop_ro("weight_bytes", [](PyGpuEngine& e) { return e.model->weight_bytes(); })
        .def_prop_ro("copied_bytes", [](PyGpuEngine& e) { return e.model->copied_bytes(); })
        .def_prop_ro("slot_bytes", [](PyGpuEngine& e) { return e.model->slot_bytes(); })
        .def("expert_stats", [](PyGpuEngine& e) {
            int64_t tokens = 0;
            ExpertCacheStats st;
            {
                nb::gil_scoped_release r;          // waits for a running call (the engine's lock)
                st = e.engine->expert_stats(&tokens);
            }
            return engine_expert_stats(e.model->experts(), st, tokens, int(e.model->config().n_experts));
        }, "{streaming, slots_per_layer, policy, lookups, hits, misses, bytes_read, io_seconds, tokens} since the "
           "last reset_expert_stats (zeros when not streaming)")
        .def("reset_expert_stats", [](PyGpuEngine& e) { e.engine->reset_expert_stats(); },
             nb::call_guard<nb::gil_scoped_release>());
}

}  // namespace qwenmetal::bindings

// qwenmetal._core bindings of a DFlash draft on the cpu engine (src/cpu/dflash.h): CpuDFlashDraft, built over
// a CpuEngine (the target: its embedding, lm_head and threads), and its context cache CpuDFlashCache. The
// Python side (python/qwenmetal/backends/cpu.py, CpuBackend.dflash_draft) passes the draft's dimensions and
// tensor descriptors (pointers into arrays it keeps alive); forward and propose release the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bindings/cpu_engine.h"
#include "bindings/forward_call.h"
#include "bindings/registry.h"
#include "cpu/dflash.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace qwenmetal;

namespace {

template <class T, int N>
using In = nb::ndarray<const T, nb::ndim<N>, nb::c_contig, nb::device::cpu>;

struct PyDFlash {
    std::unique_ptr<DFlashDraft> draft;
    nb::object engine;        // the target's CpuEngine: its weights and pool outlive the draft
    nb::object keepalive;     // the arrays the draft's descriptors point into
};

// the draft's config as CpuBackend.dflash_draft hands it over (python/qwenmetal/dflash.py, DFlashConfig)
DFlashDims parse_dims(const nb::dict& c) {
    auto i64 = [&](const char* k) { return nb::cast<int64_t>(c[k]); };
    auto f32 = [&](const char* k) { return nb::cast<float>(c[k]); };
    const std::string variant = nb::cast<std::string>(c["variant"]);
    if (variant != "dflash" && variant != "dflash2")
        throw std::invalid_argument("dflash draft: unknown variant '" + variant + "' (known: dflash, dflash2)");
    DFlashDims d;
    d.hidden = i64("hidden_size");
    d.layers = i64("num_hidden_layers");
    d.inter = i64("intermediate_size");
    d.n_heads = i64("num_attention_heads");
    d.n_kv_heads = i64("num_key_value_heads");
    d.head_dim = i64("head_dim");
    d.vocab = i64("vocab_size");
    d.n_target_layers = i64("num_feature_layers");
    d.eps = f32("rms_norm_eps");
    d.rope_theta = nb::cast<double>(c["rope_theta"]);
    for (nb::handle w : nb::cast<nb::list>(c["windows"])) d.window.push_back(nb::cast<int64_t>(w));
    d.attention_bias = nb::cast<bool>(c["attention_bias"]);
    d.input_embedding_scale = f32("input_embedding_scale");
    d.output_multiplier = f32("output_multiplier");
    d.softcap = f32("final_logit_softcapping");
    if (variant == "dflash2") {
        d.conv_kernel = i64("conv_kernel_size");
        d.conv_group = i64("conv_group_size");
        d.selector_rank = i64("selector_rank");
        d.selector_top_k = i64("selector_top_k");
        if (d.conv_kernel < 1) throw std::invalid_argument("dflash draft: conv_kernel_size must be >= 1");
    }
    return d;
}

nb::ndarray<nb::numpy, int64_t> new_ids(size_t n) {
    int64_t* p = new int64_t[n ? n : 1];
    nb::capsule owner(p, [](void* q) noexcept { delete[] static_cast<int64_t*>(q); });
    return nb::ndarray<nb::numpy, int64_t>(p, {n}, owner);
}

// forward (the logits) and propose (the drafts and the logits): one call of DFlashDraft::forward
nb::object dflash_call(PyDFlash& p, DFlashCache& cache, In<float, 2> features, In<int64_t, 1> block, bool commit,
                       bool drafts) {
    const DFlashDims& d = p.draft->dims();
    const int64_t n = int64_t(features.shape(0)), L = int64_t(block.shape(0));
    if (int64_t(features.shape(1)) != d.features())
        throw std::invalid_argument("context features must be float32 [n, " + std::to_string(d.features()) +
                                    "], got [" + std::to_string(n) + ", " + std::to_string(features.shape(1)) + "]");
    if (L < 1) throw std::invalid_argument("dflash draft: the block is empty (it needs at least the sampled token)");
    auto out = bindings::new_array({size_t(L - 1), size_t(d.vocab)});
    auto ids = new_ids(drafts ? size_t(L - 1) : 0);
    {
        nb::gil_scoped_release release;
        p.draft->forward(cache, n ? features.data() : nullptr, n, block.data(), L, commit, out.data(),
                         drafts ? ids.data() : nullptr);
    }
    return drafts ? nb::make_tuple(ids, out) : nb::cast(out);
}

nb::object dflash_forward(PyDFlash& p, DFlashCache& cache, In<float, 2> features, In<int64_t, 1> block, bool commit) {
    return dflash_call(p, cache, features, block, commit, false);
}

nb::object dflash_propose(PyDFlash& p, DFlashCache& cache, In<float, 2> features, In<int64_t, 1> block, bool commit) {
    return dflash_call(p, cache, features, block, commit, true);
}

}  // namespace

namespace qwenmetal::bindings {

void register_dflash(nb::module_& m) {
    nb::class_<DFlashCache>(m, "CpuDFlashCache",
                            "A DFlash draft's context cache (per layer the post-RoPE keys and the values of the "
                            "context rows seen so far, float32), held in C++.")
        .def_prop_ro("position", [](const DFlashCache& c) { return c.position; }, "context rows cached")
        .def_prop_ro("nbytes", &DFlashCache::nbytes, "bytes of keys and values held for the cached rows")
        .def_prop_ro("capacity", &DFlashCache::capacity, "rows the cache can hold before it grows")
        .def("copy", [](const DFlashCache& c) { return std::make_unique<DFlashCache>(c); }, "a deep, independent copy")
        .def("reset", &DFlashCache::reset, "back to no context")
        .def("__repr__", [](const DFlashCache& c) {
            return "CpuDFlashCache(position=" + std::to_string(c.position) + ")";
        });

    nb::class_<PyDFlash>(m, "CpuDFlashDraft",
                         "A DFlash draft's forward on the cpu engine, over a target CpuEngine's embedding, lm_head "
                         "and threads (src/cpu/dflash.h).")
        .def("__init__",
             [](PyDFlash* self, nb::object engine, nb::dict config, nb::dict tensors, nb::dict small,
                nb::object keepalive) {
                 PyEngine& pe = nb::cast<PyEngine&>(engine);
                 const DFlashDims dims = parse_dims(config);
                 std::map<std::string, TensorDesc> t;
                 for (auto [k, v] : tensors) t[nb::cast<std::string>(k)] = parse_desc(nb::cast<nb::dict>(v));
                 std::map<std::string, std::vector<float>> s;
                 for (auto [k, v] : small) {
                     auto a = nb::cast<In<float, 1>>(v);
                     s[nb::cast<std::string>(k)] = std::vector<float>(a.data(), a.data() + a.shape(0));
                 }
                 auto draft = std::make_unique<DFlashDraft>(dims, t, s, *pe.engine);
                 new (self) PyDFlash{std::move(draft), engine, keepalive};
             },
             "engine"_a, "config"_a, "tensors"_a, "small"_a, "keepalive"_a)
        .def("new_cache", [](PyDFlash& p) { return p.draft->new_cache(); }, "an empty context cache")
        .def("forward", &dflash_forward, "cache"_a, "features"_a, "block"_a, "commit"_a = true,
             "One draft call: the context features [n, len(target_layer_ids) * hidden] float32 (n >= 0) of the "
             "tokens the target accepted since the last committed call, and the block's token ids [L] int64 "
             "(L >= 1: the sampled token, then mask tokens). Returns the logits of block rows 1..L-1 "
             "[L - 1, vocab] float32 (through the target's lm_head). commit: append the context rows' keys and "
             "values to `cache`; otherwise, and on any error, the cache is left as it was.")
        .def("propose", &dflash_propose, "cache"_a, "features"_a, "block"_a, "commit"_a = true,
             "forward, and the greedy drafts of block rows 1..L-1: (drafts [L - 1] int64, logits [L - 1, vocab]). "
             "The drafts are each row's argmax (ties to the lower id), or for a DFlash2 draft its candidate "
             "selector's walk from block[0].")
        .def_prop_ro("weight_nbytes", [](PyDFlash& p) { return p.draft->weight_bytes(); },
                     "bytes of the draft's own weights (read in place)");
}

}  // namespace qwenmetal::bindings

// gpu: a DFlash draft on the Metal graph (src/gpu/dflash.h): GpuDFlashDraft, built over a GpuEngine (the target:
// its device, embedding, lm_head, activation and KV types), and its context cache GpuDFlashCache. The Python side
// (python/qwenmetal/backends/metal.py, _GpuBackend.dflash_draft) passes the draft's dimensions and its weights
// table (spans of the draft's safetensors mappings, as the target's); forward releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <memory>
#include <string>

#include "bindings/forward_call.h"
#include "bindings/gpu.h"
#include "bindings/weights_table.h"
#include "gpu/dflash.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace qwenmetal::bindings {

using namespace qwenmetal::gpu;

namespace {

template <class T, int N>
using In = nb::ndarray<const T, nb::ndim<N>, nb::c_contig, nb::device::cpu>;

struct PyGpuDFlash {
    std::unique_ptr<GpuDFlash> draft;
    nb::object engine;        // the target's GpuEngine: its model and device outlive the draft
    nb::object keepalive;     // the arrays the draft's mappings point into
};

// the draft's config as _GpuBackend.dflash_draft hands it over (python/qwenmetal/dflash.py, DFlashConfig)
DFlashShape parse_dflash_shape(const nb::dict& c) {
    auto u32 = [&](const char* k) { return nb::cast<uint32_t>(c[k]); };
    auto f32 = [&](const char* k) { return nb::cast<float>(c[k]); };
    const std::string variant = nb::cast<std::string>(c["variant"]);
    if (variant != "dflash")
        throw std::invalid_argument("dflash draft: variant '" + variant + "' is not run natively (only 'dflash'; "
                                    "the numpy reference runs DFlash2)");
    if (nb::cast<bool>(c["attention_bias"]))
        throw std::invalid_argument("dflash draft: attention_bias is not run on the Metal graph (the numpy "
                                    "reference runs it)");
    if (f32("input_embedding_scale") != 1.f)
        throw std::invalid_argument("dflash draft: input_embedding_scale other than 1 is not run on the Metal graph "
                                    "(the numpy reference runs it)");
    DFlashShape s;
    s.hidden = u32("hidden_size");
    s.layers = u32("num_hidden_layers");
    s.inter = u32("intermediate_size");
    s.n_heads = u32("num_attention_heads");
    s.n_kv_heads = u32("num_key_value_heads");
    s.head_dim = u32("head_dim");
    s.vocab = u32("vocab_size");
    s.n_target_layers = u32("num_feature_layers");
    s.eps = f32("rms_norm_eps");
    s.rope_theta = nb::cast<double>(c["rope_theta"]);
    for (nb::handle w : nb::cast<nb::list>(c["windows"])) s.window.push_back(nb::cast<uint32_t>(w));
    s.output_multiplier = f32("output_multiplier");
    s.softcap = f32("final_logit_softcapping");
    return s;
}

nb::object gpu_dflash_forward(PyGpuDFlash& p, GpuDFlashCache& cache, In<float, 2> features, In<int64_t, 1> block,
                          bool commit) {
    const DFlashShape& s = p.draft->shape();
    const int64_t n = int64_t(features.shape(0)), L = int64_t(block.shape(0));
    if (int64_t(features.shape(1)) != int64_t(s.features()))
        throw std::invalid_argument("context features must be float32 [n, " + std::to_string(s.features()) +
                                    "], got [" + std::to_string(n) + ", " + std::to_string(features.shape(1)) + "]");
    if (L < 1) throw std::invalid_argument("dflash draft: the block is empty (it needs at least the sampled token)");
    auto out = new_array({size_t(L - 1), size_t(s.vocab)});
    {
        nb::gil_scoped_release release;
        p.draft->forward(cache, n ? features.data() : nullptr, n, block.data(), L, commit, out.data());
    }
    return nb::cast(out);
}

}  // namespace

void register_gpu_dflash(nb::module_& g) {
    nb::class_<GpuDFlashCache>(g, "GpuDFlashCache",
                               "A DFlash draft's context cache on the device (per layer the post-RoPE keys and the "
                               "values of the context rows seen so far, in the target's KV type).")
        .def_prop_ro("position", [](const GpuDFlashCache& c) { return c.position; }, "context rows cached")
        .def_prop_ro("nbytes", &GpuDFlashCache::nbytes, "bytes of keys and values held for the cached rows")
        .def_prop_ro("capacity", &GpuDFlashCache::capacity, "rows the cache can hold before it grows")
        .def("copy", [](const GpuDFlashCache& c) { return std::make_unique<GpuDFlashCache>(c); },
             "a deep, independent copy")
        .def("reset", &GpuDFlashCache::reset, "back to no context")
        // costing at a context length without computing it (encode-only caches hold no contents)
        .def("_set_position", [](GpuDFlashCache& c, int64_t p) {
            if (p < 0) throw std::invalid_argument("position must be >= 0");
            c.reserve(p + 1);
            c.position = p;
        })
        .def("__repr__", [](const GpuDFlashCache& c) {
            return "GpuDFlashCache(position=" + std::to_string(c.position) + ")";
        });

    nb::class_<PyGpuDFlash>(g, "GpuDFlashDraft",
                            "A DFlash draft's forward on the Metal graph, over a target GpuEngine's device, "
                            "embedding and lm_head (src/gpu/dflash.h).")
        .def("__init__",
             [](PyGpuDFlash* self, nb::object engine, nb::dict config, nb::list mappings, nb::dict tensors,
                nb::object keepalive) {
                 PyGpuEngine& pe = nb::cast<PyGpuEngine&>(engine);
                 const DFlashShape shape = parse_dflash_shape(config);
                 const WeightTable w = parse_table(mappings, tensors);
                 std::unique_ptr<GpuDFlash> d;
                 {
                     nb::gil_scoped_release r;
                     d = std::make_unique<GpuDFlash>(*pe.engine, shape, w);
                 }
                 new (self) PyGpuDFlash{std::move(d), engine, keepalive};
             },
             "engine"_a, "config"_a, "mappings"_a, "tensors"_a, "keepalive"_a)
        .def("new_cache", [](PyGpuDFlash& p) { return p.draft->new_cache(); }, "an empty context cache")
        .def("forward", &gpu_dflash_forward, "cache"_a, "features"_a, "block"_a, "commit"_a = true,
             "One draft call: the context features [n, len(target_layer_ids) * hidden] float32 (n >= 0) of the "
             "tokens the target accepted since the last committed call, and the block's token ids [L] int64 "
             "(L >= 1: the sampled token, then mask tokens). Returns the logits of block rows 1..L-1 "
             "[L - 1, vocab] float32 (through the target's lm_head). One command buffer (unless the watchdog budget "
             "cuts it, or more than context_rows new context rows run as passes of their own first). commit: "
             "append the context rows' keys and values to `cache`; otherwise, and on any error, the cache is left "
             "as it was.")
        .def("cost", [](PyGpuDFlash& p, GpuDFlashCache& cache, int64_t n, int64_t L) {
            StepCost c;
            {
                nb::gil_scoped_release r;
                c = p.draft->cost(cache, n, L);
            }
            return cost_dict(c);
        }, "cache"_a, "n"_a, "L"_a,
           "Encode, commit and wait one draft call of n context rows (at most context_rows) and a block of L at the "
           "cache's position (nothing written, the cache not advanced): dispatches, levels, command buffers, bytes "
           "and flops per level, as GpuEngine.verify_cost. For encode-only costing.")
        .def_prop_ro("context_rows", [](PyGpuDFlash& p) { return p.draft->context_rows(); },
                     "the most new context rows one pass takes")
        .def_prop_ro("weight_nbytes", [](PyGpuDFlash& p) { return p.draft->weight_bytes(); },
                     "bytes of the draft's own weights as bound (in place)")
        .def_prop_ro("copied_nbytes", [](PyGpuDFlash& p) { return p.draft->copied_bytes(); },
                     "device bytes copied at load (the stacked [k | v] and [gate | up] projections)");
}

}  // namespace qwenmetal::bindings

// qwenmetal._core.ExpertCache: the expert cache (src/core/expert_cache.h) from Python, for the tests and
// for streaming stats. Slot memory is numpy uint8 arrays the caller passes (one per layer per part, of
// slots_per_layer * nbytes bytes); the binding keeps them alive. A mutex makes concurrent Python calls
// take turns (the C++ cache allows one acquire at a time); acquire releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "bindings/expert_cache.h"
#include "bindings/registry.h"
#include "core/expert_cache.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace qwenmetal;

namespace {

using Bytes = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Ids = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using PartTuple = std::tuple<int32_t, uint64_t, uint64_t, uint64_t>;   // (file, offset, stride, nbytes)

struct PyExpertCache {
    std::vector<nb::object> keep;   // the slot arrays
    std::unique_ptr<ExpertCache> cache;
    std::mutex mu;

    PyExpertCache(std::vector<std::string> files, std::map<int, std::vector<PartTuple>> layers,
                  std::map<int, std::vector<Bytes>> slots, int num_experts, int slots_per_layer,
                  const std::string& policy, int io_threads, bool direct_io, uint64_t read_chunk);
};

PyExpertCache::PyExpertCache(std::vector<std::string> files, std::map<int, std::vector<PartTuple>> layers,
                             std::map<int, std::vector<Bytes>> slots, int num_experts, int slots_per_layer,
                             const std::string& policy, int io_threads, bool direct_io, uint64_t read_chunk) {
    ExpertCacheOptions opt;
    opt.slots_per_layer = slots_per_layer;
    opt.policy = parse_cache_policy(policy);
    opt.io_threads = io_threads;
    opt.direct_io = direct_io;
    opt.num_experts = num_experts;
    opt.read_chunk = read_chunk;
    std::map<int, std::vector<ExpertPart>> parts;
    std::map<int, std::vector<void*>> bases;
    for (auto& [l, ps] : layers) {
        auto s = slots.find(l);
        if (s == slots.end() || s->second.size() != ps.size())
            throw std::invalid_argument("slots[" + std::to_string(l) + "] must hold one array per part (" +
                                        std::to_string(ps.size()) + ")");
        for (size_t p = 0; p < ps.size(); ++p) {
            const auto& [file, offset, stride, nbytes] = ps[p];
            Bytes& a = s->second[p];
            if (a.shape(0) != uint64_t(slots_per_layer) * nbytes)
                throw std::invalid_argument("slots[" + std::to_string(l) + "][" + std::to_string(p) + "] must have " +
                                            "slots_per_layer * nbytes bytes, has " + std::to_string(a.shape(0)));
            parts[l].push_back(ExpertPart{file, offset, stride, nbytes});
            bases[l].push_back(a.data());
            keep.push_back(nb::cast(a));
        }
    }
    if (slots.size() != layers.size()) throw std::invalid_argument("slots must have exactly the layers of layers");
    cache = std::make_unique<ExpertCache>(std::move(files), std::move(parts), opt, std::move(bases));
}

nb::ndarray<nb::numpy, int32_t, nb::ndim<1>> acquire(PyExpertCache& c, int layer, Ids experts) {
    const size_t n = experts.shape(0);
    int32_t* out = new int32_t[n ? n : 1];
    nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<int32_t*>(p); });
    {
        nb::gil_scoped_release release;
        std::lock_guard<std::mutex> lk(c.mu);
        c.cache->acquire(layer, experts.data(), int(n), out);
    }
    return nb::ndarray<nb::numpy, int32_t, nb::ndim<1>>(out, {n}, owner);
}

nb::dict stats(PyExpertCache& c) {
    ExpertCacheStats s;
    {
        std::lock_guard<std::mutex> lk(c.mu);
        s = c.cache->stats();
    }
    return bindings::expert_stats_dict(s);
}

}  // namespace

namespace qwenmetal::bindings {
nb::dict expert_stats_dict(const ExpertCacheStats& s) {
    nb::dict d;
    d["lookups"] = s.lookups;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["bytes_read"] = s.bytes_read;
    d["io_seconds"] = s.io_seconds;
    return d;
}

nb::dict engine_expert_stats(const ExpertCache* cache, const ExpertCacheStats& s, int64_t tokens, int n_experts) {
    nb::dict d = expert_stats_dict(s);
    d["streaming"] = cache != nullptr;
    d["slots_per_layer"] = cache ? cache->slots_per_layer() : n_experts;
    d["policy"] = cache ? nb::cast(std::string(cache_policy_name(cache->options().policy))) : nb::none();
    d["tokens"] = tokens;
    return d;
}

void parse_stream_tables(const nb::dict& d, std::vector<std::string>& files,
                         std::map<int, std::vector<ExpertPart>>& layers, ExpertCacheOptions& cache) {
    for (nb::handle f : nb::cast<nb::list>(d["files"])) files.push_back(nb::cast<std::string>(f));
    for (auto [k, v] : nb::cast<nb::dict>(d["layers"])) {
        std::vector<ExpertPart>& parts = layers[nb::cast<int>(k)];
        for (nb::handle h : nb::cast<nb::list>(v)) {
            nb::tuple t = nb::cast<nb::tuple>(h);
            parts.push_back(ExpertPart{nb::cast<int32_t>(t[0]), nb::cast<uint64_t>(t[1]), nb::cast<uint64_t>(t[2]),
                                       nb::cast<uint64_t>(t[3])});
        }
    }
    cache.slots_per_layer = nb::cast<int>(d["slots_per_layer"]);
    cache.policy = parse_cache_policy(nb::cast<std::string>(d["policy"]));
    cache.direct_io = d.contains("direct_io") && nb::cast<bool>(d["direct_io"]);
}

void register_expert_cache(nb::module_& m) {
    nb::class_<PyExpertCache>(m, "ExpertCache",
                              "Fixed slots per MoE layer of routed experts streamed from files with parallel pread.")
        .def(nb::init<std::vector<std::string>, std::map<int, std::vector<PartTuple>>, std::map<int, std::vector<Bytes>>,
                      int, int, const std::string&, int, bool, uint64_t>(),
             "files"_a, "layers"_a, "slots"_a, "num_experts"_a, "slots_per_layer"_a,
             "policy"_a = "lru", "io_threads"_a = 4, "direct_io"_a = false, "read_chunk"_a = uint64_t(1) << 20,
             "files: paths; layers: {layer: [(file index, offset, stride, nbytes) per part]}; slots: {layer: "
             "[uint8 array of slots_per_layer * nbytes per part]}; policy 'lru' | 'lfu' | 'os'.")
        .def("acquire", &acquire, "layer"_a, "experts"_a,
             "Make the distinct experts (int32) of a layer resident at once; returns their slots (GIL released).")
        .def("stats", &stats, "lookups, hits, misses, bytes_read, io_seconds since creation or reset_stats().")
        .def("reset_stats", [](PyExpertCache& c) {
            std::lock_guard<std::mutex> lk(c.mu);
            c.cache->reset_stats();
        })
        .def_prop_ro("slots_per_layer", [](PyExpertCache& c) { return c.cache->slots_per_layer(); })
        .def_prop_ro("policy", [](PyExpertCache& c) { return std::string(cache_policy_name(c.cache->options().policy)); });
}
}  // namespace qwenmetal::bindings

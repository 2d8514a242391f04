// Shared by the bindings that own an ExpertCache (expert_cache.cpp, cpu_engine.cpp, gpu_graph.cpp).
#pragma once
#include <nanobind/nanobind.h>

#include <map>
#include <string>
#include <vector>

#include "core/expert_cache.h"

namespace qwenmetal::bindings {
// ExpertCacheStats as a dict: lookups, hits, misses, bytes_read, io_seconds
nanobind::dict expert_stats_dict(const ExpertCacheStats& s);
// An engine's expert counters (its `expert_stats()`): {streaming, slots_per_layer, policy, the stats above,
// tokens}; `cache` null: not streaming (slots_per_layer = n_experts, policy None, zeros)
nanobind::dict engine_expert_stats(const ExpertCache* cache, const ExpertCacheStats& s, int64_t tokens,
                                   int n_experts);
// The backend-independent part of a streaming spec (cpu_backend.stream_spec): files, layers {layer:
// [(file, offset, stride, nbytes)]}, slots_per_layer and policy into `files`, `layers` and `cache` (the
// I/O options stay ExpertCacheOptions' defaults)
void parse_stream_tables(const nanobind::dict& d, std::vector<std::string>& files,
                         std::map<int, std::vector<ExpertPart>>& layers, ExpertCacheOptions& cache);
}  // namespace qwenmetal::bindings

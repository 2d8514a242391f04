// Shared by the bindings that own an ExpertCache (expert_cache.cpp, gpu_graph.cpp; the CPU engine's).
#pragma once
#include <nanobind/nanobind.h>

#include "core/expert_cache.h"

namespace qwenmetal::bindings {
// ExpertCacheStats as a dict: lookups, hits, misses, bytes_read, io_seconds
nanobind::dict expert_stats_dict(const ExpertCacheStats& s);
}  // namespace qwenmetal::bindings

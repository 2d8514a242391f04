// The simulator's threadgroup-memory bank counts (msl::BankCounts) as a Python dict, shared by the
// msl_sim and gpu bindings.
#pragma once
#include <nanobind/nanobind.h>

#include "msl_sim/runtime.h"

namespace qwenmetal::bindings {

inline nanobind::dict bank_dict(const msl::BankCounts& b) {
    nanobind::dict d;
    d["accesses"] = b.accesses;
    d["conflicted"] = b.conflicted;
    d["replays"] = b.replays;
    d["dropped"] = b.dropped;
    d["max_degree"] = b.max_degree;
    d["replays_per_access"] = b.accesses ? double(b.replays) / double(b.accesses) : 0.0;
    return d;
}

}  // namespace qwenmetal::bindings

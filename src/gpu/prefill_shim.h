// TEMPORARY (branch graph only; each part is deleted when the kernel branch providing the real function
// merges): the interface contract's prefill host functions built from the decode kernels, row by row,
// in the same command buffer, so the chunked graph (forward.cpp) runs and is tested before they land.
#pragma once
#include <algorithm>

#include "gpu/ops/attention.h"
#include "gpu/ops/gemm.h"
#include "gpu/ops/gdn.h"
#include "gpu/ops/moe.h"
#include "gpu/ops/quant.h"

namespace qwenmetal::gpu::ops {

// ---- gemm route (branch tensor) ----
inline GemmRoute gemm_route(const DeviceInfo&) { return GemmRoute::Simdgroup; }

}  // namespace qwenmetal::gpu::ops

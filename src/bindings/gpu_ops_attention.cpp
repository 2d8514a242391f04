// gpu.ops: attention family (metal/attention.metal, src/gpu/ops/attention.cpp).
#include "bindings/gpu.h"

namespace nb = nanobind;

namespace qwenmetal::bindings {

void register_gpu_ops_attention(nb::module_& ops) { (void)ops; }

}  // namespace qwenmetal::bindings

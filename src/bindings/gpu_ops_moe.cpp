// gpu.ops: moe family (metal/moe.metal, src/gpu/ops/moe.cpp).
#include "bindings/gpu.h"

namespace nb = nanobind;

namespace qwenmetal::bindings {

void register_gpu_ops_moe(nb::module_& ops) { (void)ops; }

}  // namespace qwenmetal::bindings

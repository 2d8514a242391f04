// gpu.ops: gdn family (metal/gdn.metal, src/gpu/ops/gdn.cpp).
#include "bindings/gpu.h"

namespace nb = nanobind;

namespace qwenmetal::bindings {

void register_gpu_ops_gdn(nb::module_& ops) { (void)ops; }

}  // namespace qwenmetal::bindings

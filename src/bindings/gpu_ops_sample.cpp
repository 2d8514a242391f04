// gpu.ops: sample family (metal/sample.metal, src/gpu/ops/sample.cpp).
#include "bindings/gpu.h"

namespace nb = nanobind;

namespace qwenmetal::bindings {

void register_gpu_ops_sample(nb::module_& ops) { (void)ops; }

}  // namespace qwenmetal::bindings

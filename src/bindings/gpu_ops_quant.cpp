// gpu.ops: quant family (metal/quant.metal, src/gpu/ops/quant.cpp).
#include "bindings/gpu.h"

namespace nb = nanobind;

namespace qwenmetal::bindings {

void register_gpu_ops_quant(nb::module_& ops) { (void)ops; }

}  // namespace qwenmetal::bindings

// gpu: the decode graph (src/gpu/forward.cpp) as the engine of the metal-sim / metal backends.
#include "bindings/gpu.h"

namespace nb = nanobind;

namespace qwenmetal::bindings {

void register_gpu_graph(nb::module_& g) { (void)g; }

}  // namespace qwenmetal::bindings

// Forwarder: MetalPerformancePrimitives resolves to msl_sim's emulation of mpp::tensor_ops::matmul2d
// (msl_sim/tensor.h) in the simulator, and to the declarations of check_as.h in clang check mode.
#pragma once
#include <metal_tensor>

// mpp::tensor_ops::matmul2d_descriptor as MetalPerformancePrimitives documents it (MPPTensorOpsMatMul2d.h):
// plain C++, shared by the simulator's emulation (msl_sim/tensor.h) and the clang check mode (check_as.h).
// `dynamic_extent` (metal::) is declared by the includer.
#pragma once

namespace mpp {
namespace tensor_ops {

struct matmul2d_descriptor {
    enum class mode { multiply, multiply_accumulate };
    int m, n, k;
    bool transpose_left, transpose_right;
    bool relaxed_precision;
    mode matmul_mode;
    constexpr matmul2d_descriptor(int m_, int n_, int k_ = static_cast<int>(metal::dynamic_extent), bool tl = false,
                                  bool tr = false, bool relaxed = false, mode md = mode::multiply)
        : m(m_), n(n_), k(k_), transpose_left(tl), transpose_right(tr), relaxed_precision(relaxed), matmul_mode(md) {}
};

}  // namespace tensor_ops
}  // namespace mpp

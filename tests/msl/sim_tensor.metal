// Kernels for tests/test_sim_tensor.py: the simulator's emulation of Metal 4's tensor API
// (src/msl_sim/include/msl_sim/tensor.h) — device and threadgroup tensors, slices, the transposes and the
// two modes of mpp::tensor_ops::matmul2d, and the checks (divergence, non-uniform operands, bounds, reads
// of unwritten threadgroup memory).
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

// Operand extents: the left operand is M x K, the right K x N (each stored transposed or not), the
// destination M x N; bad = 1 makes the planted error of the error-case kernels happen.
struct MmParams {
    int M, N, K, bad;
};

typedef dextents<int32_t, 2> ext2;
constant constexpr int kMmRows = 8;   // rows of the destination per SIMD-group (descriptor m)
constant constexpr int kMmCols = 16;  // descriptor n

// Two SIMD-groups; SIMD-group s computes destination rows [8 s, 8 s + 8) of the device tensors, through
// slices of the left operand and of the destination.
template <class TA, class TB, class TD, bool TL, bool TR, bool ACC, int KD>
kernel void mm_device(constant MmParams& p [[buffer(0)]], device TA* a [[buffer(1)]], device TB* b [[buffer(2)]],
                      device TD* d [[buffer(3)]], uint sg [[simdgroup_index_in_threadgroup]]) {
    constexpr auto desc = matmul2d_descriptor(kMmRows, kMmCols, KD, TL, TR, false,
                                              ACC ? matmul2d_descriptor::mode::multiply_accumulate
                                                  : matmul2d_descriptor::mode::multiply);
    matmul2d<desc, execution_simdgroup> op;
    auto A = tensor<device TA, ext2, tensor_inline>(a, TL ? ext2(p.M, p.K) : ext2(p.K, p.M));
    auto B = tensor<device TB, ext2, tensor_inline>(b, TR ? ext2(p.K, p.N) : ext2(p.N, p.K));
    auto D = tensor<device TD, ext2, tensor_inline>(d, ext2(p.N, p.M));
    const int r0 = int(sg) * kMmRows;
    auto As = TL ? A.slice(r0, 0) : A.slice(0, r0);
    auto Ds = D.slice(0, r0);
    op.run(As, B, Ds);
}
INSTANTIATE_KERNEL("mm_f32_nn", mm_device, float, float, float, false, false, false, -1)
INSTANTIATE_KERNEL("mm_f32_nt", mm_device, float, float, float, false, true, false, -1)
INSTANTIATE_KERNEL("mm_f32_tn", mm_device, float, float, float, true, false, false, -1)
INSTANTIATE_KERNEL("mm_f32_tt", mm_device, float, float, float, true, true, false, -1)
INSTANTIATE_KERNEL("mm_f32_nt_acc", mm_device, float, float, float, false, true, true, -1)
INSTANTIATE_KERNEL("mm_f32_nt_k8", mm_device, float, float, float, false, true, false, 8)
INSTANTIATE_KERNEL("mm_bf16_nt_f32", mm_device, bfloat, bfloat, float, false, true, true, -1)
INSTANTIATE_KERNEL("mm_bf16_nt_bf16", mm_device, bfloat, bfloat, bfloat, false, true, false, -1)
INSTANTIATE_KERNEL("mm_f16_nt_f16", mm_device, half, half, half, false, true, false, -1)

// The kernels' pattern: operands staged into threadgroup memory by all 64 threads, a barrier (skipped
// when p.bad: the emulation must report the unwritten reads), then one matmul2d per SIMD-group into a
// zeroed threadgroup float tile (multiply_accumulate), which the threads copy out. M, N <= 16, K <= 32.
kernel void mm_threadgroup(constant MmParams& p [[buffer(0)]], device const float* a [[buffer(1)]],
                           device const float* b [[buffer(2)]], device float* d [[buffer(3)]],
                           uint tid [[thread_index_in_threadgroup]], uint sg [[simdgroup_index_in_threadgroup]]) {
    threadgroup float As[16 * 32];
    threadgroup float Bs[16 * 32];
    threadgroup float Cs[16 * 16];
    for (int i = int(tid); i < p.M * p.K; i += 64) As[i] = a[i];
    for (int i = int(tid); i < p.N * p.K; i += 64) Bs[i] = b[i];
    for (int i = int(tid); i < 16 * 16; i += 64) Cs[i] = 0.0f;
    if (p.bad == 0) threadgroup_barrier(mem_flags::mem_threadgroup);
    constexpr auto desc = matmul2d_descriptor(kMmRows, kMmCols, static_cast<int>(dynamic_extent), false, true, false,
                                              matmul2d_descriptor::mode::multiply_accumulate);
    matmul2d<desc, execution_simdgroup> op;
    auto A = tensor<threadgroup float, ext2, tensor_inline>(As, ext2(p.K, p.M));
    auto B = tensor<threadgroup float, ext2, tensor_inline>(Bs, ext2(p.K, p.N));
    auto C = tensor<threadgroup float, ext2, tensor_inline>(Cs, ext2(16, 16));
    auto Asl = A.slice(0, int(sg) * kMmRows);
    auto Csl = C.slice(0, int(sg) * kMmRows);
    op.run(Asl, B, Csl);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = int(tid); i < p.M * p.N; i += 64) d[i] = Cs[(i / p.N) * 16 + i % p.N];
}

// Error cases (one SIMD-group, device operands M x K, N x K (transposed), M x N).
//   bad = 1: only lanes 0..15 call run (divergent control flow)
//   bad = 2: each lane passes its own slice (operands not SIMD-group-uniform)
//   bad = 3: the left tensor claims twice the rows its buffer has, sliced from row 4 (out of bounds)
kernel void mm_errors(constant MmParams& p [[buffer(0)]], device float* a [[buffer(1)]], device float* b [[buffer(2)]],
                      device float* d [[buffer(3)]], uint lane [[thread_index_in_simdgroup]]) {
    constexpr auto desc = matmul2d_descriptor(kMmRows, kMmCols, static_cast<int>(dynamic_extent), false, true);
    matmul2d<desc, execution_simdgroup> op;
    auto A = tensor<device float, ext2, tensor_inline>(a, ext2(p.K, p.bad == 3 ? 2 * p.M : p.M));
    auto B = tensor<device float, ext2, tensor_inline>(b, ext2(p.K, p.N));
    auto D = tensor<device float, ext2, tensor_inline>(d, ext2(p.N, p.M));
    auto As = A.slice(0, p.bad == 2 ? int(lane % 2) : p.bad == 3 ? 4 : 0);
    if (p.bad != 1 || lane < 16) op.run(As, B, D);
}

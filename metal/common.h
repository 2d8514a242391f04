// Shared definitions for qwenmetal's Metal kernels (metal/*.metal). Kernels include only
// <metal_stdlib> and headers from this folder. The same sources compile unmodified with Apple's
// Metal compiler, with the Metal-on-CPU simulator (src/msl_sim/, C++17) and with clang's
// address-space check (tools/msl_check.py). House rules for kernels (enforced by tools/msl_lint.py
// where it can; see docs/metal.md):
//   * only what MSL has: no std::, new/delete, exceptions, virtual, double, printf, recursion;
//   * templates are instantiated only through INSTANTIATE_KERNEL(host_name, function, args...);
//   * every kernel parameter carries an attribute ([[buffer(i)]], [[thread_position_in_grid]], ...);
//   * threadgroup memory is declared at kernel scope, as arrays (T name[N]; also for one value);
//   * SIMD-group functions only in SIMD-group-uniform control flow, barriers only in
//     threadgroup-uniform control flow.
#pragma once
#include <metal_stdlib>
using namespace metal;

#ifndef INSTANTIATE_KERNEL
// Apple's Metal compiler: an explicit instantiation exported under a host name. (The simulator
// and the clang check define their own INSTANTIATE_KERNEL in the <metal_stdlib> shim.)
#define INSTANTIATE_KERNEL(name, func, ...) \
    template [[host_name(name)]] [[kernel]] decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;
#endif

enum : uint { SIMD_WIDTH = 32 };

// v rounded to the activation type T and back: where the bfloat build rounds as MLX's bf16 graph does
// (the reference's bfloat16 mode); the identity for T = float, so the float build is unchanged.
template <typename T>
inline float rnd(float v) {
    return float(T(v));
}

// SwiGLU of one gate and one up product (float accumulations), rounded as the bf16 graph rounds:
// gate and up to T, silu = T(g * T(sigmoid(g))), the product rounded by the caller's store to T.
// Shared by the decode expert kernels (moe.metal) and the GEMM epilogue (gemm_tile.h).
template <typename T>
inline float swiglu_act(float g, float u) {
    const float gr = rnd<T>(g);
    const float silu = rnd<T>(gr * rnd<T>(1.0f / (1.0f + exp(-gr))));
    return silu * rnd<T>(u);
}

// Sum of one float per thread over the whole threadgroup; every thread receives the total.
// One simd_sum per SIMD-group, one threadgroup barrier, then every SIMD-group reduces the
// partial sums itself (a second simd_sum) instead of a second barrier + broadcast.
// `partial` needs one slot per SIMD-group (32 covers 1024 threads). Call it from
// threadgroup-uniform control flow only.
inline float threadgroup_sum(float v, threadgroup float* partial, uint lane, uint sg, uint nsg) {
    v = simd_sum(v);
    if (lane == 0) {
        partial[sg] = v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float t = lane < nsg ? partial[lane] : 0.0f;
    return simd_sum(t);
}

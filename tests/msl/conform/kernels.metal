// Planted violations of the kernel-function rules (tools/msl_conform.py, tests/test_msl_conform.py).
// Every line that must be reported carries "EXPECT: <rule> ..."; nothing else in this file may be.
#include <metal_stdlib>
#include "common.h"
using namespace metal;

kernel float returns_a_value(device float* y [[buffer(0)]]) {  // EXPECT: MSL-KERNEL
    return y[0];
}

kernel void callee(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    y[i] = 1.0f;
}

kernel void caller(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    callee(y, i);  // EXPECT: MSL-KERNEL
}

kernel void overloaded(device float* y [[buffer(0)]]) {
    y[0] = 1.0f;
}
kernel void overloaded(device uint* y [[buffer(0)]]) {  // EXPECT: MSL-KERNEL MSL-HOST-NAME
    y[0] = 1u;
}

template <typename T>
kernel void fill(device T* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    y[i] = T(0);
}
INSTANTIATE_KERNEL("fill_f32", fill, float)
INSTANTIATE_KERNEL("fill_u32", fill, uint)
INSTANTIATE_KERNEL("fill_f32", fill, int)  // EXPECT: MSL-HOST-NAME

// the attribute-list spelling: [[kernel, max_total_threads_per_threadgroup(N)]]
[[kernel, max_total_threads_per_threadgroup(128)]] void list_form(device float* y [[buffer(0)]],
                                                               uint i [[thread_position_in_grid]]) {
    y[i] = 2.0f;
}
[[kernel, max_total_threads_per_threadgroup(4096)]]  // EXPECT: MSL-KERNEL
void list_form_too_many(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    y[i] = 3.0f;
}
[[kernel]] void bracket_form(device float* y [[buffer(0)]], uint2 i [[thread_position_in_grid]],
                             uint t [[threads_per_grid]]) {  // EXPECT: MSL-ATTR-WIDTH MSL-ATTR-MATCH
    y[i.x] = float(t);
}

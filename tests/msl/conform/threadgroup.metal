// Planted violations of the threadgroup-memory rules (tools/msl_conform.py, tests/test_msl_conform.py).
// Every line that must be reported carries "EXPECT: <rule> ..."; nothing else in this file may be.
#include <metal_stdlib>
#include "common.h"
using namespace metal;

typedef half4 h4;  // 8 bytes (2.2 Table 2.3)

threadgroup float program_scope[16];  // EXPECT: MSL-TG-SCOPE

// helpers take threadgroup memory as pointers; they do not declare it
inline float helper_sum(threadgroup const float* t, uint n) {
    threadgroup float own[32];  // EXPECT: MSL-TG-SCOPE
    float s = 0.0f;
    for (uint i = 0; i < n; ++i) {
        s += t[i] + own[i];
    }
    return s;
}

inline float stack_array(uint n) {
    float a[n];  // EXPECT: MSL-VLA
    a[0] = 1.0f;
    return a[0];
}

// the size depends on the template parameter: 4096 x 4 + 1 KiB + 8 fits, 8192 x 4 + 1 KiB + 8 does not
template <uint N>
kernel void staged(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
    threadgroup float tile[N];
    threadgroup float3 vecs[64];  // 64 x 16 = 1 KiB (a float3 takes 16 bytes)
    threadgroup h4 one[1];        // 8 bytes
    tile[tid] = y[tid];
    vecs[tid % 64u] = float3(tile[tid]);
    one[0] = h4(vecs[0].x);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    y[tid] = helper_sum(tile, 4u) + stack_array(1u) + float(one[0].x) + program_scope[0];
}
INSTANTIATE_KERNEL("staged_4096", staged, 4096)
INSTANTIATE_KERNEL("staged_8192", staged, 8192)  // EXPECT: MSL-TG-SIZE

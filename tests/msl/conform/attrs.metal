// Planted violations of the kernel attribute rules (tools/msl_conform.py, tests/test_msl_conform.py).
// Every line that must be reported carries "EXPECT: <rule> ..."; nothing else in this file may be.
#include <metal_stdlib>
#include "common.h"
using namespace metal;

// the bug the seven kernels had: a scalar [[threads_per_threadgroup]] next to a uint2 grid position
kernel void scalar_among_vectors(device float* y [[buffer(0)]], uint2 tg [[threadgroup_position_in_grid]],
                                 uint nthreads [[threads_per_threadgroup]]) {  // EXPECT: MSL-ATTR-WIDTH
    y[tg.x] = float(nthreads);
}

// two vector widths
kernel void two_widths(device float* y [[buffer(0)]], uint3 tg [[threadgroup_position_in_grid]],
                       uint2 tpg [[threads_per_threadgroup]]) {  // EXPECT: MSL-ATTR-WIDTH
    y[tg.x] = float(tpg.x);
}

// all scalars, all uint: fine
kernel void all_scalars(device float* y [[buffer(0)]], uint tg [[threadgroup_position_in_grid]],
                        uint nthreads [[threads_per_threadgroup]], uint tid [[thread_index_in_threadgroup]]) {
    y[tg] = float(nthreads + tid);
}

// types the attributes do not take
kernel void wrong_types(device float* y [[buffer(0)]],
                        int gid [[thread_position_in_grid]],          // EXPECT: MSL-ATTR-TYPE
                        uint4 tpg [[threads_per_grid]],               // EXPECT: MSL-ATTR-TYPE
                        uint2 lane [[thread_index_in_simdgroup]],     // EXPECT: MSL-ATTR-TYPE
                        float sg [[simdgroup_index_in_threadgroup]]) {  // EXPECT: MSL-ATTR-TYPE
    y[gid] = float(tpg.x + lane.x) + sg;
}

// pairs whose types must match (5.2.3.6 notes)
kernel void mismatched_pairs(device float* y [[buffer(0)]],
                             uint2 gid [[thread_position_in_grid]],
                             ushort2 grid [[threads_per_grid]],                   // EXPECT: MSL-ATTR-MATCH
                             uint2 pos [[thread_position_in_threadgroup]],
                             uint2 tpt [[threads_per_threadgroup]],
                             ushort tid [[thread_index_in_threadgroup]],          // EXPECT: MSL-ATTR-MATCH
                             uint lane [[thread_index_in_simdgroup]],
                             ushort sg [[simdgroup_index_in_threadgroup]]) {      // EXPECT: MSL-ATTR-MATCH
    y[gid.x] = float(grid.x + pos.x + tpt.x + tid + lane + sg);
}

// attributes where they do not belong
inline float helper(device const float* x [[buffer(1)]], uint i [[thread_index_in_simdgroup]]) {  // EXPECT: MSL-ATTR-KIND MSL-ATTR-KIND
    return x[i];
}

[[max_total_threads_per_threadgroup(256)]] inline float not_a_kernel(float v) {  // EXPECT: MSL-ATTR-KIND
    return v;
}

kernel void graphics_attribute(device float* y [[buffer(0)]], uint v [[vertex_id]]) {  // EXPECT: MSL-ATTR-KIND
    y[v] = helper(y, v) + not_a_kernel(1.0f);
}

kernel void unknown_attribute(device float* y [[buffer(0)]],
                              float4 p [[position]]) {  // EXPECT: MSL-ATTR-KIND MSL-PARAM-ATTR
    y[0] = p.x;
}

// every kernel parameter carries an attribute
kernel void unattributed(device float* y [[buffer(0)]],
                         uint n) {  // EXPECT: MSL-PARAM-ATTR
    y[0] = float(n);
}

// a template kernel: checked per instantiation, with its concrete types
template <typename I>
kernel void templated_index(device float* y [[buffer(0)]], I gid [[thread_position_in_grid]]) {  // EXPECT: MSL-ATTR-TYPE
    y[0] = float(gid);
}
INSTANTIATE_KERNEL("templated_index_uint", templated_index, uint)
INSTANTIATE_KERNEL("templated_index_int", templated_index, int)

[[max_total_threads_per_threadgroup(2048)]] kernel void too_many_threads(device float* y [[buffer(0)]]) {  // EXPECT: MSL-KERNEL
    y[0] = 0.0f;
}

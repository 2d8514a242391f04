// conform-version: 3.0
// Planted violations of the language-version rule when the family is pinned to MSL 3.0 (tools/msl_conform.py,
// tests/test_msl_conform.py): bfloat and bfloat SIMD-group matrices are MSL 3.1. Every line that must be
// reported carries "EXPECT: <rule> ..."; nothing else in this file may be.
#include <metal_stdlib>
using namespace metal;

kernel void bfloat_before_31(device bfloat* y [[buffer(0)]],        // EXPECT: MSL-VERSION
                             device atomic_float* sums [[buffer(1)]],  // fine at 3.0
                             uint i [[thread_position_in_grid]]) {
    simdgroup_bfloat8x8 m;  // EXPECT: MSL-VERSION
    (void)m;
    atomic_fetch_add_explicit(&sums[i], 1.0f, memory_order_relaxed);
    y[i] = bfloat(1.0f);  // EXPECT: MSL-VERSION
}

// Planted violations of the resource-location rules (tools/msl_conform.py, tests/test_msl_conform.py).
// Every line that must be reported carries "EXPECT: <rule> ..."; nothing else in this file may be.
#include <metal_stdlib>
using namespace metal;

struct Params {
    uint n;
    float scale;
};

// fine: device and constant pointers and references, a threadgroup pointer at [[threadgroup(0)]]
kernel void good(constant Params& p [[buffer(0)]], device const float* x [[buffer(1)]], device float& y [[buffer(30)]],
                 threadgroup float* scratch [[threadgroup(0)]], uint i [[thread_position_in_grid]]) {
    scratch[0] = x[i] * p.scale;
    y = scratch[0];
}

kernel void index_too_large(device float* y [[buffer(31)]],  // EXPECT: MSL-BUFFER
                            uint i [[thread_position_in_grid]]) {
    y[i] = 0.0f;
}

kernel void not_a_pointer(device float* y [[buffer(0)]],
                          uint n [[buffer(1)]],  // EXPECT: MSL-BUFFER
                          uint i [[thread_position_in_grid]]) {
    y[i] = float(n);
}

kernel void wrong_space(device float* y [[buffer(0)]],
                        threadgroup float* t [[buffer(1)]],  // EXPECT: MSL-BUFFER
                        device float* d [[threadgroup(0)]],  // EXPECT: MSL-BUFFER
                        uint i [[thread_position_in_grid]]) {
    y[i] = t[i] + d[i];
}

kernel void duplicate_index(device float* y [[buffer(2)]],
                            device const float* x [[buffer(2)]],  // EXPECT: MSL-BUFFER-DUP
                            uint i [[thread_position_in_grid]]) {
    y[i] = x[i];
}

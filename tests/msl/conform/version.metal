// Planted violations of the language-version rule at the default version, MSL 3.1 (tools/msl_conform.py,
// tests/test_msl_conform.py): the same file is clean at MSL 4.0. Every line that must be reported at 3.1
// carries "EXPECT: <rule> ..."; nothing else in this file may be.
#include <metal_stdlib>
#include <metal_tensor>  // EXPECT: MSL-VERSION
using namespace metal;

template <typename T>
inline float pick(T v) {
    if constexpr (sizeof(T) == 4) {  // EXPECT: MSL-VERSION
        return float(v);
    } else {
        return 0.0f;
    }
}

kernel void newer_features(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    auto twice = [](float v) { return 2.0f * v; };  // EXPECT: MSL-VERSION
    y[i] = twice(pick(y[i]));
}

[[required_threads_per_threadgroup(64)]] kernel void fixed_size(device float* y [[buffer(0)]]) {  // EXPECT: MSL-VERSION
    y[0] = 1.0f;
}

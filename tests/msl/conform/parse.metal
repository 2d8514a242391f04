// A planted parse error (tools/msl_conform.py, tests/test_msl_conform.py): reported, not a crash.
// Every line that must be reported carries "EXPECT: <rule> ..."; nothing else in this file may be.
#include <metal_stdlib>
using namespace metal;

kernel void broken(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    y[i] = undeclared_value;  // EXPECT: MSL-PARSE
}

// Planted violations of the type rules (tools/msl_conform.py, tests/test_msl_conform.py).
// Every line that must be reported carries "EXPECT: <rule> ..."; nothing else in this file may be.
#include <metal_stdlib>
using namespace metal;

inline double twice(float x) {  // EXPECT: MSL-DOUBLE
    return 2.0f * x;
}

kernel void scalars(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    double d = 0.5f;                 // EXPECT: MSL-DOUBLE
    long double ld = 0.25f;          // EXPECT: MSL-DOUBLE
    long long ll = 1;                // EXPECT: MSL-DOUBLE
    y[i] = float((double)y[i]) + float(d + ld + ll) + float(twice(1.0f));  // EXPECT: MSL-DOUBLE
}

kernel void atomics(device atomic_uint* counts [[buffer(0)]],       // fine
                    device atomic_float* sums [[buffer(1)]],        // fine (MSL 3.0+)
                    device atomic_ulong* wide [[buffer(2)]],        // EXPECT: MSL-ATOMIC
                    constant atomic_uint* read_only [[buffer(3)]],  // EXPECT: MSL-ATOMIC
                    uint i [[thread_position_in_grid]], uint tid [[thread_index_in_threadgroup]]) {
    threadgroup atomic_uint hist[16];  // fine
    threadgroup atomic_float tsum[4];  // EXPECT: MSL-ATOMIC
    atomic_int local;                  // EXPECT: MSL-ATOMIC
    atomic_fetch_add_explicit(&hist[i % 16u], 1u, memory_order_relaxed);
    atomic_fetch_add_explicit(&counts[i], 1u, memory_order_relaxed);
    atomic_fetch_add_explicit(&sums[i], 1.0f, memory_order_relaxed);
    atomic_fetch_add_explicit(&tsum[tid % 4u], 1.0f, memory_order_relaxed);  // EXPECT: MSL-ATOMIC
    (void)wide;
    (void)read_only;
    (void)local;
}

// a template is checked per instantiation: fine for float, reported (at its declaration) for int
template <typename T>
inline T first_of(thread simdgroup_matrix<T, 8, 8>& m) {  // EXPECT: MSL-SIMDGROUP-MATRIX
    return m.thread_elements()[0];
}

kernel void matrices(device float* y [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
    simdgroup_float8x8 a;                 // fine
    simdgroup_matrix<bfloat, 8, 8> b;     // fine (MSL 3.1+)
    simdgroup_matrix<int, 8, 8> c;        // EXPECT: MSL-SIMDGROUP-MATRIX
    simdgroup_matrix<float, 4, 4> d;      // EXPECT: MSL-SIMDGROUP-MATRIX
    (void)a;
    (void)b;
    (void)c;
    (void)d;
    y[lane] = first_of(a) + float(first_of(c));
}

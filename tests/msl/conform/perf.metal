// Planted violations of the performance rules (tools/msl_conform.py PERF-*, tests/test_msl_conform.py), with
// near-misses that must not fire. Every line that must be reported carries "EXPECT: <rule> ..."; nothing else
// in this file may be. (An EXPECT on a line with a perf-ok annotation stands in a block comment before it, so
// that it is not read as the annotation's reason.)
#include <metal_stdlib>
#include "common.h"
using namespace metal;

#define ROWS 4
constant uint COLS = 8;

struct PerfParams {
    uint n;
    uint stride;
    uint c;
};

struct Frag {
    float v[4];
};

// a 64-bit multiply outside any loop of its own: a call of it inside a loop is reported at the call
inline ulong row_offset(uint row, uint stride) {
    return ulong(row) * stride;
}

// a thread array behind a helper's pointer parameter: the caller's array, once inlined
inline float pick_runtime(thread const float* a, uint i) {
    return a[i];                         // EXPECT: PERF-STACK-ARRAY
}
inline float pick_folded(thread const float* a, uint i) {
    return a[i * 2u];                    // every call passes a folded i: fine
}

// PERF-STACK-ARRAY and PERF-INT64-LOOP
template <uint N>
kernel void stack_and_wide(constant PerfParams& p [[buffer(0)]], device float* y [[buffer(1)]],
                           uint tid [[thread_position_in_grid]]) {
    float acc[N];
    for (uint i = 0; i < N; ++i) {       // compile-time bound (a template parameter): unrolled, in registers
        acc[i] = 0.0f;
    }
    for (uint i = 0; i < ROWS; ++i) {    // a #define bound; nested arithmetic of folded indices
        acc[(i * 2u + 1u) % N] += 1.0f;
        const uint j = i + 1u;           // a const local of folded values
        acc[j % N] += 2.0f;
    }
    for (uint i = 0; i < COLS && i < p.n; ++i) {   // a constant bound with a run-time guard: N guarded copies
        acc[i % N] += y[i];
    }
    for (uint i = 0; i < p.n; ++i) {
        acc[i % N] += y[i];              // EXPECT: PERF-STACK-ARRAY
    }
    acc[p.c % N] = 1.0f;                 // EXPECT: PERF-STACK-ARRAY
    Frag f;
    for (uint k = 0; k < 4u; ++k) {
        f.v[k] = 0.0f;
    }
    f.v[tid % 4u] = 3.0f;                // EXPECT: PERF-STACK-ARRAY
    for (uint i = 0; i < N / 2u; ++i) {
        acc[i] += pick_folded(acc, i) + pick_runtime(acc, p.c % N);
    }
    acc[p.n % N] = 4.0f;  // perf-ok(PERF-STACK-ARRAY): a deliberate exception, with its reason
    acc[p.c % 2u] = 5.0f; /* EXPECT: PERF-STACK-ARRAY PERF-ANNOTATION */ // perf-ok(PERF-STACK-ARRAY)

    const ulong base = ulong(tid) * p.stride;   // 64-bit outside loops: fine
    float s = 0.0f;
    for (uint i = 0; i < p.n; ++i) {
        s += y[ulong(i) * p.stride];     // EXPECT: PERF-INT64-LOOP
        s += y[i * p.stride];            // 32-bit multiply in a loop: fine
        s += y[base + i];                // a 64-bit add: fine
        s += y[row_offset(i, p.stride)]; // EXPECT: PERF-INT64-LOOP
    }
    ulong w = base;
    while (w < p.n) {
        w <<= 1;                         // EXPECT: PERF-INT64-LOOP
    }
    for (uint i = 0; i < COLS; ++i) {
        s += float(ulong(i) * 3u);       // folded once unrolled: fine
    }
    // perf-ok(PERF-INT64-LOOP): an annotation alone on its line covers the next line
    for (uint i = 0; i < p.n; ++i) { s += y[ulong(i) * p.stride + 1u]; }
    s += 1.0f;  /* EXPECT: PERF-ANNOTATION */ // perf-ok(PERF-INT64-LOOP): stale, nothing 64-bit here
    s += 2.0f;  /* EXPECT: PERF-ANNOTATION */ // perf-ok(PERF-NO-SUCH-RULE): not a rule
    y[tid] = s + acc[0] + f.v[0] + float(w);
}
INSTANTIATE_KERNEL("stack_and_wide_8", stack_and_wide, 8)

// PERF-TG-COLUMN
kernel void columns(device float* y [[buffer(0)]], device half* z [[buffer(1)]],
                    uint tid [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float a[32 * 32];
    threadgroup float b[8][32];
    threadgroup half h[16 * 64];
    threadgroup float pad33[32 * 33];
    threadgroup float pad36[8 * 36];
    const uint row = lane / 4u;          // lane-varying through a local
    float s = 0.0f;
    for (uint k = 0; k < 32u; ++k) {
        s += a[tid * 32u + k];           // EXPECT: PERF-TG-COLUMN
        s += a[k * 32u + lane];          // the row is uniform, the lanes walk a row: fine
        s += b[row][k];                  // EXPECT: PERF-TG-COLUMN
        s += float(h[(lane % 16u) * 64u + k]);   // EXPECT: PERF-TG-COLUMN
        s += pad33[tid * 33u + k];       // padded to 33 words: fine
        s += pad36[row * 36u + k];       // padded by 16 bytes: fine
    }
    simdgroup_float8x8 m;
    simdgroup_load(m, a, 32);                    // EXPECT: PERF-TG-COLUMN
    simdgroup_load(m, pad36, 36);                // padded: fine
    simdgroup_half8x8 mh;
    simdgroup_load(mh, h, 64);                   // EXPECT: PERF-TG-COLUMN
    simdgroup_store(m, pad36, 36);
    y[tid] = s + float(z[0]);
}

// PERF-SIMDMAT-LOOP
kernel void fragments(constant PerfParams& p [[buffer(0)]], device const float* x [[buffer(1)]],
                      device float* y [[buffer(2)]], uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float stage[8 * 36];
    simdgroup_float8x8 q[4];
    simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (uint c = 0; c < 4u; ++c) {                  // compile-time bound around register fragments: fine
        simdgroup_load(q[c], x + c * 8u, 32);
    }
    for (uint t = 0; t < p.n; ++t) {                 // the run-time tile loop
        simdgroup_float8x8 k;
        simdgroup_load(k, stage, 36);                // does not step with t: fine
        for (uint c = 0; c < 4u; ++c) {
            simdgroup_multiply_accumulate(acc, q[c], k, acc);
        }
        const uint off = t * 8u;
        simdgroup_load(k, x + off, p.stride);       // EXPECT: PERF-SIMDMAT-LOOP
    }
    for (uint c = 0; c < p.c; ++c) {
        simdgroup_multiply_accumulate(acc, q[c], q[0], acc);   // EXPECT: PERF-SIMDMAT-LOOP PERF-STACK-ARRAY
    }
    simdgroup_store(acc, stage, 36);
    y[lane] = stage[lane];
}

// Kernels exercising the simulator's model of MSL (tests/test_sim_runtime.py): SIMD-group
// functions, vectors and swizzles, half/bfloat, atomics, simdgroup matrices, builtins, dynamic
// threadgroup memory. Each writes what it computed so the test can compare with numpy.
#include <metal_stdlib>
using namespace metal;

enum : uint { NOPS = 20 };

// out[op * 32 + lane] for each SIMD-group function; x has 32 values
kernel void simd_ops(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                     uint lane [[thread_index_in_simdgroup]]) {
    const float v = x[lane];
    float r[NOPS];
    r[0] = simd_sum(v);
    r[1] = simd_max(v);
    r[2] = simd_min(v);
    r[3] = simd_prefix_inclusive_sum(v);
    r[4] = simd_prefix_exclusive_sum(v);
    r[5] = simd_shuffle(v, ushort(31 - lane));
    r[6] = simd_shuffle_xor(v, ushort(5));
    r[7] = simd_shuffle_up(v, ushort(3));
    r[8] = simd_shuffle_down(v, ushort(3));
    r[9] = simd_broadcast(v, ushort(7));
    r[10] = simd_broadcast_first(v);
    r[11] = float(uint(static_cast<simd_vote::vote_t>(simd_ballot(lane % 3 == 0))));
    r[12] = simd_all(v > -1000.0f) ? 1.0f : 0.0f;
    r[13] = simd_any(lane == 5) ? 1.0f : 0.0f;
    r[14] = simd_product(1.0f + float(lane % 2) * 0.5f);
    r[15] = simd_shuffle_rotate_up(v, ushort(1));
    r[16] = simd_shuffle_rotate_down(v, ushort(2));
    r[17] = float(simd_sum(int(lane)));
    r[18] = float(simd_or(1u << (lane % 8)));
    r[19] = simd_is_first() ? 1.0f : 0.0f;
    simdgroup_barrier(mem_flags::mem_none);
    for (uint k = 0; k < NOPS; ++k) {
        out[k * 32 + lane] = r[k];
    }
}

// two SIMD-groups of a 64-thread group each sum their own lanes; a 48-thread group has a partial
// second SIMD-group of 16 lanes
kernel void simd_partial(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                         uint tid [[thread_index_in_threadgroup]], uint sg [[simdgroup_index_in_threadgroup]],
                         uint nsg [[simdgroups_per_threadgroup]], uint tpg [[threads_per_threadgroup]]) {
    const float s = simd_sum(x[tid]);
    out[tid] = s + 1000.0f * float(sg) + 100000.0f * float(nsg) + 0.0f * float(tpg);
}

// vectors: out has 32 floats
kernel void vectors(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                    device const float4* x4 [[buffer(2)]], uint tid [[thread_position_in_grid]]) {
    if (tid != 0) {
        return;
    }
    float4 v = float4(x[0], x[1], x[2], x[3]);
    float4 w = v.wzyx;                    // swizzle read
    float2 a = v.xy + v.zw;               // swizzle arithmetic
    float3 b = float3(a, 5.0f);           // vector + scalar constructor
    float4 c = float4(b.zy, a);           // two half vectors
    v.xy = v.zw;                          // swizzle write
    float4 d = v * 2.0f - w;              // vector-scalar, vector-vector
    half4 h = half4(d);                   // conversion
    float4 e = float4(h) + float4(1.0f);  // broadcast constructor
    uint2 u = uint2(7u, 9u) >> 1u;
    const float4 f = x4[1];
    out[0] = w.x; out[1] = w.y; out[2] = w.z; out[3] = w.w;
    out[4] = a.x; out[5] = a.y;
    out[6] = b.x; out[7] = b.y; out[8] = b.z;
    out[9] = c.x; out[10] = c.y; out[11] = c.z; out[12] = c.w;
    out[13] = v.x; out[14] = v.y; out[15] = v.z; out[16] = v.w;
    out[17] = d.x; out[18] = d.w;
    out[19] = e.y; out[20] = float(u.x); out[21] = float(u.y);
    out[22] = dot(f, f); out[23] = length(f.xy); out[24] = f.r + f.a;
    out[25] = max(f, float4(6.0f)).x; out[26] = clamp(f.y, 0.0f, 5.5f); out[27] = select(1.0f, 2.0f, f.z > 6.0f);
    out[28] = all(f > float4(0.0f)) ? 1.0f : 0.0f; out[29] = any(f > float4(7.5f)) ? 1.0f : 0.0f;
    out[30] = float(sizeof(float3)); out[31] = float(sizeof(packed_float3));
}

// bfloat / half rounding of float inputs
kernel void round16(device const float* x [[buffer(0)]], device bfloat* yb [[buffer(1)]], device half* yh [[buffer(2)]],
                    device float* back [[buffer(3)]], uint i [[thread_position_in_grid]]) {
    yb[i] = bfloat(x[i]);
    yh[i] = half(x[i]);
    back[i] = float(yb[i]) + float(yh[i]);
}

// device atomics: counters[0] += 1 per thread, counters[1] = max(tid), fsum[0] += x[tid]
kernel void atomics_device(device atomic_uint* counters [[buffer(0)]], device atomic_float* fsum [[buffer(1)]],
                           device const float* x [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
    atomic_fetch_add_explicit(&counters[0], 1u, memory_order_relaxed);
    atomic_fetch_max_explicit(&counters[1], gid, memory_order_relaxed);
    atomic_fetch_add_explicit(&fsum[0], x[gid], memory_order_relaxed);
}

// threadgroup atomics: count the threads with an even index, per group
kernel void atomics_tg(device uint* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]],
                       uint tg [[threadgroup_position_in_grid]]) {
    threadgroup atomic_uint count[1];
    if (tid == 0) {
        atomic_store_explicit(&count[0], 0u, memory_order_relaxed);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid % 2 == 0) {
        atomic_fetch_add_explicit(&count[0], 1u, memory_order_relaxed);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {
        out[tg] = atomic_load_explicit(&count[0], memory_order_relaxed);
    }
}

// C[M, N] = A[M, K] B[K, N] with 8x8 simdgroup matrices; one SIMD-group per 8x8 output tile,
// A and B tiles staged through threadgroup memory, M, N, K multiples of 8
struct GemmParams {
    uint M, N, K;
};
template <typename T>
kernel void sg_gemm(device const T* A [[buffer(0)]], device const T* B [[buffer(1)]], device float* C [[buffer(2)]],
                    constant GemmParams& p [[buffer(3)]], uint2 tg [[threadgroup_position_in_grid]],
                    uint lane [[thread_index_in_simdgroup]]) {
    threadgroup T As[64];
    threadgroup T Bs[64];
    simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (uint k0 = 0; k0 < p.K; k0 += 8) {
        for (uint e = lane; e < 64; e += 32) {
            As[e] = A[(tg.y * 8 + e / 8) * p.K + k0 + e % 8];
            Bs[e] = B[(k0 + e / 8) * p.N + tg.x * 8 + e % 8];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        simdgroup_matrix<T, 8, 8> a;
        simdgroup_matrix<T, 8, 8> b;
        simdgroup_load(a, As, 8);
        simdgroup_load(b, Bs, 8);
        simdgroup_multiply_accumulate(acc, a, b, acc);
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    simdgroup_store(acc, C, p.N, ulong2(tg.x * 8, tg.y * 8));
}
INSTANTIATE_KERNEL("sg_gemm_f32", sg_gemm, float)
INSTANTIATE_KERNEL("sg_gemm_f16", sg_gemm, half)
INSTANTIATE_KERNEL("sg_gemm_bf16", sg_gemm, bfloat)

// builtins of a 3-D grid: out[linear global id * 8 + k]
kernel void builtins(device uint* out [[buffer(0)]], uint3 gid [[thread_position_in_grid]],
                     uint3 lid [[thread_position_in_threadgroup]], uint3 tg [[threadgroup_position_in_grid]],
                     uint3 ntg [[threads_per_threadgroup]], uint3 ngrid [[threadgroups_per_grid]],
                     uint tidx [[thread_index_in_threadgroup]], uint3 nthreads [[threads_per_grid]]) {
    const uint linear = (gid.z * nthreads.y + gid.y) * nthreads.x + gid.x;
    device uint* o = out + linear * 8;
    o[0] = gid.x;
    o[1] = gid.y;
    o[2] = gid.z;
    o[3] = lid.x + 100u * lid.y + 10000u * lid.z;
    o[4] = tg.x + 100u * tg.y + 10000u * tg.z;
    o[5] = ntg.x + 100u * ntg.y + 10000u * ntg.z;
    o[6] = ngrid.x + 100u * ngrid.y + 10000u * ngrid.z;
    o[7] = tidx;
}

// [[threadgroup(0)]] memory sized by the host: reverse each group's slice
kernel void tg_dynamic(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                       threadgroup float* scratch [[threadgroup(0)]], uint tid [[thread_index_in_threadgroup]],
                       uint gid [[thread_position_in_grid]], uint n [[threads_per_threadgroup]]) {
    scratch[tid] = x[gid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    y[gid] = scratch[n - 1 - tid];
}

// a tree reduction with a barrier inside the halving loop (256 threads)
kernel void tree_sum(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                     uint tid [[thread_index_in_threadgroup]], uint tg [[threadgroup_position_in_grid]]) {
    threadgroup float s[256];
    s[tid] = x[tg * 256 + tid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint stride = 128; stride > 0; stride /= 2) {
        if (tid < stride) {
            s[tid] += s[tid + stride];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (tid == 0) {
        y[tg] = s[0];
    }
}

// a copy used by the command-buffer tests: y = x + 1
kernel void add_one(device const float* x [[buffer(0)]], device float* y [[buffer(1)]], uint i [[thread_position_in_grid]]) {
    y[i] = x[i] + 1.0f;
}

// a pointer to the start of a threadgroup array declared right after another: it belongs to the second
// array (an end pointer of the first is the same address), so every access here is in bounds
kernel void tg_adjacent(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
    threadgroup float a[32];
    threadgroup float b[32];
    threadgroup float* pb = &b[0];
    a[tid] = 1.0f;
    pb[tid] = float(tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    y[tid] = a[tid] + pb[31 - tid];
}

// writes past the end of a threadgroup array (checked mode reports it)
kernel void tg_oob(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
    threadgroup float t[64];
    t[tid + 8] = 1.0f;
    y[tid] = 0.0f;
}

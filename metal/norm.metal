// RMSNorm, the residual add fused with it, and rows of the residual stream copied out as float.
//
//   rmsnorm_{f32,bf16}:      y = T(w * T(x * rsqrt(mean(x^2) + eps)))
//   add_rmsnorm_{f32,bf16}:  h = x + r   (stored: the residual stream)
//                            y = T(w * T(h * rsqrt(mean(h^2) + eps)))
//   layer_norm_{f32,bf16}:   y = T((x - mean) * rsqrt(var + eps) * w + b)   (biased variance of the row, two
//                            passes over it; the vision tower's LayerNorm, docs/vision.md)
//   copy_f32_{f32,bf16}:     y = float(x)  (exact: the rows of x as the graph holds them; a DFlash draft's
//                            target features, taken after chosen decoder layers)
// w is the multiplicative gain as the canonical weights store it (1 + w for Qwen's
// zero-centred norms is folded in at load). Statistics in float; the bfloat build rounds as
// MLX's mx.fast.rms_norm does (x * inv, then the product with w), the float build computes
// x * inv * w; add_rmsnorm normalises h as stored (rounded to T), exactly what a separate add
// followed by rmsnorm would see, and may run in place (h == x).
//
// Why fused: after every attention / MoE branch the decoder adds the branch output to the
// residual stream and normalises it for the next block; one kernel reads x and r once and
// saves a dispatch and a round trip of h through memory per layer (Lily and llama.cpp fuse it too).
//
// Thread mapping: one threadgroup per row (grid = (rows, 1, 1)), any number of threads that is
// a multiple of 32 (the host picks about H / 4, at most 1024: 512 for H = 2048). Each thread
// walks the row in steps of threads * 4 and handles 4 consecutive elements per step as one vector
// load (a scalar tail when H % 4 != 0). Per-thread sums of squares are reduced by
// threadgroup_sum (common.h: simd_sum, one barrier, simd_sum); the second pass re-reads its own
// elements (the same thread wrote h, so no barrier is needed) and stores y.
//
// Simulator-verified, hardware-unverified.
#include "common.h"
#include "norm.h"

template <typename T>
inline float load4_sumsq(device const T* x, uint i, uint H, thread float* v) {
    float ss = 0.0f;
    if ((H & 3u) == 0) {  // rows start 4-aligned: one vector load
        device const vec<T, 4>* x4 = (device const vec<T, 4>*)(x + i);
        const vec<T, 4> q = x4[0];
        for (int j = 0; j < 4; ++j) {
            v[j] = float(q[j]);
        }
    } else {
        for (uint j = 0; j < 4; ++j) {
            v[j] = i + j < H ? float(x[i + j]) : 0.0f;
        }
    }
    for (int j = 0; j < 4; ++j) {
        ss += v[j] * v[j];
    }
    return ss;
}

template <typename T>
inline void store_normed(device const T* src, device const T* w, device T* y, uint i, uint H, float inv) {
    for (uint j = 0; j < 4 && i + j < H; ++j) {
        y[i + j] = T(rnd<T>(float(src[i + j]) * inv) * float(w[i + j]));   // as MLX: w * T(x * inv)
    }
}

template <typename T>
kernel void rmsnorm(constant NormParams& p [[buffer(0)]], device const T* x [[buffer(1)]],
                    device const T* w [[buffer(2)]], device T* y [[buffer(3)]], uint row [[threadgroup_position_in_grid]],
                    uint tid [[thread_index_in_threadgroup]], uint nthreads [[threads_per_threadgroup]],
                    uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]],
                    uint nsg [[simdgroups_per_threadgroup]]) {
    threadgroup float partial[SIMD_WIDTH];
    const ulong base = ulong(row) * p.H;
    float ss = 0.0f;
    for (uint i = tid * 4; i < p.H; i += nthreads * 4) {
        float v[4];
        ss += load4_sumsq(x + base, i, p.H, v);
    }
    const float inv = rsqrt(threadgroup_sum(ss, partial, lane, sg, nsg) / float(p.H) + p.eps);
    for (uint i = tid * 4; i < p.H; i += nthreads * 4) {
        store_normed(x + base, w, y + base, i, p.H, inv);
    }
}

template <typename T>
kernel void add_rmsnorm(constant NormParams& p [[buffer(0)]], device const T* x [[buffer(1)]],
                        device const T* r [[buffer(2)]], device const T* w [[buffer(3)]], device T* h [[buffer(4)]],
                        device T* y [[buffer(5)]],
                        uint row [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                        uint nthreads [[threads_per_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                        uint sg [[simdgroup_index_in_threadgroup]], uint nsg [[simdgroups_per_threadgroup]]) {
    threadgroup float partial[SIMD_WIDTH];
    const ulong base = ulong(row) * p.H;
    float ss = 0.0f;
    for (uint i = tid * 4; i < p.H; i += nthreads * 4) {
        for (uint j = 0; j < 4 && i + j < p.H; ++j) {
            const T hv = T(float(x[base + i + j]) + float(r[base + i + j]));
            h[base + i + j] = hv;
            ss += float(hv) * float(hv);
        }
    }
    const float inv = rsqrt(threadgroup_sum(ss, partial, lane, sg, nsg) / float(p.H) + p.eps);
    for (uint i = tid * 4; i < p.H; i += nthreads * 4) {
        store_normed((device const T*)(h + base), w, y + base, i, p.H, inv);
    }
}

// LayerNorm: the mean, then the variance of x - mean (a second pass over the row, as the reference computes it;
// its own threadgroup slots, so no barrier is needed between the two sums), then y. Statistics in float, y
// rounded once to T.
template <typename T>
kernel void layer_norm(constant NormParams& p [[buffer(0)]], device const T* x [[buffer(1)]],
                       device const T* w [[buffer(2)]], device const T* b [[buffer(3)]], device T* y [[buffer(4)]],
                       uint row [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                       uint nthreads [[threads_per_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                       uint sg [[simdgroup_index_in_threadgroup]], uint nsg [[simdgroups_per_threadgroup]]) {
    threadgroup float partial[SIMD_WIDTH];
    threadgroup float partial2[SIMD_WIDTH];
    const ulong base = ulong(row) * p.H;
    device const T* xr = x + base;
    device T* yr = y + base;
    float s = 0.0f;
    for (uint i = tid; i < p.H; i += nthreads) {
        s += float(xr[i]);
    }
    const float mean = threadgroup_sum(s, partial, lane, sg, nsg) / float(p.H);
    float ss = 0.0f;
    for (uint i = tid; i < p.H; i += nthreads) {
        const float d = float(xr[i]) - mean;
        ss += d * d;
    }
    const float inv = rsqrt(threadgroup_sum(ss, partial2, lane, sg, nsg) / float(p.H) + p.eps);
    for (uint i = tid; i < p.H; i += nthreads) {
        yr[i] = T((float(xr[i]) - mean) * inv * float(w[i]) + float(b[i]));
    }
}

// y[row] = float(x[row]): the same thread mapping as rmsnorm (one threadgroup per row, 4 elements per step),
// no reduction and no threadgroup memory
template <typename T>
kernel void copy_f32(constant CopyParams& p [[buffer(0)]], device const T* x [[buffer(1)]],
                     device float* y [[buffer(2)]], uint row [[threadgroup_position_in_grid]],
                     uint tid [[thread_index_in_threadgroup]], uint nthreads [[threads_per_threadgroup]]) {
    const ulong base = ulong(row) * p.H;
    device const T* xr = x + base;
    device float* yr = y + base;
    for (uint i = tid * 4; i < p.H; i += nthreads * 4) {
        for (uint j = 0; j < 4 && i + j < p.H; ++j) {
            yr[i + j] = float(xr[i + j]);
        }
    }
}

INSTANTIATE_KERNEL("rmsnorm_f32", rmsnorm, float)
INSTANTIATE_KERNEL("rmsnorm_bf16", rmsnorm, bfloat)
INSTANTIATE_KERNEL("add_rmsnorm_f32", add_rmsnorm, float)
INSTANTIATE_KERNEL("add_rmsnorm_bf16", add_rmsnorm, bfloat)
INSTANTIATE_KERNEL("layer_norm_f32", layer_norm, float)
INSTANTIATE_KERNEL("layer_norm_bf16", layer_norm, bfloat)
INSTANTIATE_KERNEL("copy_f32_f32", copy_f32, float)
INSTANTIATE_KERNEL("copy_f32_bf16", copy_f32, bfloat)

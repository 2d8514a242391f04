// Affine-quantized matrix-vector products (MLX format): the decode-time projections.
//
// Format (docs/model.md): W[N, K] is stored row-major as uint32 words, 32/BITS values per word,
// lowest bits first; each row has K / group_size groups with one scale and one bias each
// (activation dtype), and w = scale * q + bias with q unsigned.
//
// Thread mapping (as MLX's qmv_fast): a threadgroup is 2 SIMD-groups of 32 lanes; each SIMD-group
// computes QMV_ROWS = 4 consecutive output rows, so a threadgroup covers 8 rows and the grid is
// (ceil(N / 8), number of input vectors, 1). Per step a lane takes one 8-byte word pair (uint2)
// of each of its 4 rows: 16 values at 4 bits, 8 at 8 bits, so the 32 lanes of a SIMD-group read
// 256 contiguous bytes of a row per step (512 inputs at 4 bits, 256 at 8 bits) and K needs no
// multiple-of-512 rule (lanes past K idle). The lane's slice of x is loaded once per step as
// vectors, converted to float registers and reused for all 4 rows. Per group the dot product is
// factored: sum(w*x) = scale * sum(q*x) + bias * sum(x), with sum(x) computed once per step and
// shared by the rows. At 4 bits the nibbles are never shifted: x is pre-scaled by 1, 1/16,
// 1/256, 1/4096 and multiplied by the masked halfword (q << 4i exactly cancels; MLX's trick).
// Accumulation is float; one simd_sum per row at the end, lane 0 stores.
//
// Variants:
//   qmv{4,8}_{f32,bf16,f16}         y[N] (activation dtype) = W x       (grid.y: batch of vectors)
//   qmv{4,8}_{bf16,f16}_f32out      the same with float output (logits: keeps the lm_head exact)
//   gather_qmv{4,8}_{f32,bf16,f16}  stacked expert matrices W[E, N, K]; slot s (grid.y) uses
//                                   expert ids[s] and input x + s * x_stride (x_stride 0: all
//                                   slots share one x, as gate/up do in decode), writes y[s, N]
//
// Simulator-verified, hardware-unverified.
#include "common.h"

struct QmvParams {
    uint K;           // input features, a multiple of group_size
    uint N;           // output rows
    uint group_size;  // 32, 64 or 128
    uint x_stride;    // elements between the input vectors of consecutive grid.y (0: shared x)
    uint y_stride;    // elements between consecutive output vectors (usually N)
};

enum : uint { QMV_ROWS = 4, QMV_SIMDGROUPS = 2 };

// sum_i q_i * xs_i over 16 nibbles (two words), xs pre-scaled by 1, 1/16, 1/256, 1/4096 per nibble
// position inside each 16-bit half
inline float qdot4(uint2 q, thread const float* xs) {
    float acc = 0.0f;
    for (int wd = 0; wd < 2; ++wd) {
        const uint word = q[wd];
        for (int h = 0; h < 2; ++h) {
            const uint u = (word >> (16 * h)) & 0xFFFFu;
            thread const float* x4 = xs + 8 * wd + 4 * h;
            acc += x4[0] * float(u & 0x000Fu) + x4[1] * float(u & 0x00F0u) + x4[2] * float(u & 0x0F00u) +
                   x4[3] * float(u & 0xF000u);
        }
    }
    return acc;
}

// sum_i q_i * x_i over 8 bytes (two words)
inline float qdot8(uint2 q, thread const float* x) {
    float acc = 0.0f;
    for (int wd = 0; wd < 2; ++wd) {
        const uint word = q[wd];
        for (int b = 0; b < 4; ++b) {
            acc += x[4 * wd + b] * float((word >> (8 * b)) & 0xFFu);
        }
    }
    return acc;
}

// The 4 rows row0 .. row0+3 of y = W x for one SIMD-group (see the header for the mapping).
// w / scales / biases point at row 0 of this matrix, x at this input vector, y at this output.
template <typename T, typename O, int BITS>
inline void qmv_simdgroup(device const uint32_t* w, device const T* scales, device const T* biases,
                          device const T* x, device O* y, uint K, uint N, uint group_size, uint row0, uint lane) {
    const int VALS = BITS == 4 ? 16 : 8;  // inputs per lane per step: one uint2 of weights
    const uint STEP = 32 * VALS;
    const uint words_per_row = K * BITS / 32;
    const uint groups_per_row = K / group_size;
    device const uint2* w2 = (device const uint2*)w;
    device const vec<T, 4>* x4 = (device const vec<T, 4>*)x;

    uint rows[QMV_ROWS];
    for (uint r = 0; r < QMV_ROWS; ++r) {
        rows[r] = min(row0 + r, N - 1);  // rows past N re-read the last row and are not stored
    }
    float acc[QMV_ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};

    for (uint k0 = lane * VALS; k0 < K; k0 += STEP) {
        float xs[16];
        float xsum = 0.0f;
        for (int i = 0; i < VALS; i += 4) {
            const vec<T, 4> v = x4[(k0 + i) / 4];
            for (int j = 0; j < 4; ++j) {
                const float f = float(v[j]);
                xsum += f;
                xs[i + j] = BITS == 4 ? f * (j == 0 ? 1.0f : j == 1 ? 0.0625f : j == 2 ? 0.00390625f : 0.000244140625f) : f;
            }
        }
        const uint g = k0 / group_size;
        for (uint r = 0; r < QMV_ROWS; ++r) {
            const uint2 q = w2[(rows[r] * words_per_row + k0 * BITS / 32) / 2];
            const float d = BITS == 4 ? qdot4(q, xs) : qdot8(q, xs);
            const uint si = rows[r] * groups_per_row + g;
            acc[r] += float(scales[si]) * d + float(biases[si]) * xsum;
        }
    }
    for (uint r = 0; r < QMV_ROWS; ++r) {
        const float total = simd_sum(acc[r]);
        if (lane == 0 && row0 + r < N) {
            y[row0 + r] = O(total);
        }
    }
}

// y[b] = W x[b]  for b = grid.y; scales/biases [N, K/group_size]; w [N, K*BITS/32]
template <typename T, typename O, int BITS>
kernel void qmv(device const uint32_t* w [[buffer(0)]], device const T* scales [[buffer(1)]],
                device const T* biases [[buffer(2)]], device const T* x [[buffer(3)]], device O* y [[buffer(4)]],
                constant QmvParams& p [[buffer(5)]], uint3 tgid [[threadgroup_position_in_grid]],
                uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]]) {
    const uint row0 = (tgid.x * QMV_SIMDGROUPS + sg) * QMV_ROWS;
    if (row0 >= p.N) {
        return;  // SIMD-group-uniform: the whole SIMD-group leaves (no barriers in this kernel)
    }
    qmv_simdgroup<T, O, BITS>(w, scales, biases, x + tgid.y * p.x_stride, y + tgid.y * p.y_stride, p.K, p.N,
                              p.group_size, row0, lane);
}

// Stacked experts: w [E, N, K*BITS/32], scales/biases [E, N, K/group_size], ids [slots] (uint),
// x [slots, K] (x_stride = K) or [K] (x_stride = 0), y [slots, N]; grid (ceil(N/8), slots, 1).
// The expert index comes from device memory, so the router's top-k can stay on the GPU.
template <typename T, int BITS>
kernel void gather_qmv(device const uint32_t* w [[buffer(0)]], device const T* scales [[buffer(1)]],
                       device const T* biases [[buffer(2)]], device const T* x [[buffer(3)]], device T* y [[buffer(4)]],
                       device const uint* ids [[buffer(5)]], constant QmvParams& p [[buffer(6)]],
                       uint3 tgid [[threadgroup_position_in_grid]], uint lane [[thread_index_in_simdgroup]],
                       uint sg [[simdgroup_index_in_threadgroup]]) {
    const uint row0 = (tgid.x * QMV_SIMDGROUPS + sg) * QMV_ROWS;
    if (row0 >= p.N) {
        return;
    }
    const uint slot = tgid.y;
    const ulong e = ids[slot];
    const ulong w_per_expert = ulong(p.N) * (p.K * BITS / 32);
    const ulong s_per_expert = ulong(p.N) * (p.K / p.group_size);
    qmv_simdgroup<T, T, BITS>(w + e * w_per_expert, scales + e * s_per_expert, biases + e * s_per_expert,
                              x + slot * p.x_stride, y + slot * p.y_stride, p.K, p.N, p.group_size, row0, lane);
}

INSTANTIATE_KERNEL("qmv4_f32", qmv, float, float, 4)
INSTANTIATE_KERNEL("qmv4_bf16", qmv, bfloat, bfloat, 4)
INSTANTIATE_KERNEL("qmv4_f16", qmv, half, half, 4)
INSTANTIATE_KERNEL("qmv8_f32", qmv, float, float, 8)
INSTANTIATE_KERNEL("qmv8_bf16", qmv, bfloat, bfloat, 8)
INSTANTIATE_KERNEL("qmv8_f16", qmv, half, half, 8)
INSTANTIATE_KERNEL("qmv4_bf16_f32out", qmv, bfloat, float, 4)
INSTANTIATE_KERNEL("qmv4_f16_f32out", qmv, half, float, 4)
INSTANTIATE_KERNEL("qmv8_bf16_f32out", qmv, bfloat, float, 8)
INSTANTIATE_KERNEL("qmv8_f16_f32out", qmv, half, float, 8)
INSTANTIATE_KERNEL("gather_qmv4_f32", gather_qmv, float, 4)
INSTANTIATE_KERNEL("gather_qmv4_bf16", gather_qmv, bfloat, 4)
INSTANTIATE_KERNEL("gather_qmv4_f16", gather_qmv, half, 4)
INSTANTIATE_KERNEL("gather_qmv8_f32", gather_qmv, float, 8)
INSTANTIATE_KERNEL("gather_qmv8_bf16", gather_qmv, bfloat, 8)
INSTANTIATE_KERNEL("gather_qmv8_f16", gather_qmv, half, 8)

// The vision tower's own kernels (docs/vision.md, "The vision tower in the Metal graph"); everything else the
// tower runs is the prefill graph's (gemm, layer_norm of the norm family, attention_prefill without the causal
// mask). The numpy reference is python/qwenmetal/backends/reference_vision.py.
//
//   vision_bias_act_{f32,bf16}:  y = T(act(T(y + b)))       the linear layers' biases (the GEMMs have none), with
//                                the blocks' GELU-tanh or the merger's exact GELU after fc1
//   vision_pos_embed_{f32,bf16}: x = T(T(x + b) + sum_j w_j * table[idx_j])   the patch embedding's bias and the
//                                bilinearly resampled position embedding (4 taps per patch, host-computed:
//                                reference_vision.interpolation_taps)
//   vision_rope_{f32,bf16}:      q, k = rotate(qkv + bias) by the 2-D rotary cos/sin rows (host-computed:
//                                reference_vision.rotary_cos_sin), v = qkv + bias; q to q_out, k and v to the
//                                K/V buffers the non-causal attention_prefill reads
//
// Thread mapping: bias_act and pos_embed take one threadgroup per row and walk it in steps of the threadgroup
// size (no reduction, no threadgroup memory); rope takes one threadgroup per (head, row), thread d owning elements
// d, d + threads, ... of the head (its rotate-half partner re-read, not exchanged).
//
// Arithmetic in float. GELU-tanh uses precise::tanh; the exact GELU's erf (not in the Metal standard library) is
// Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7), so 0.5 x (1 + erf(x / sqrt 2)) is within
// 0.75e-7 |x| of the reference's float64 value.
//
// Simulator-verified, hardware-unverified.
#include "common.h"
#include "vision.h"

// erf(x), |error| < 1.5e-7 (Abramowitz & Stegun 7.1.26)
inline float vision_erf(float x) {
    const float a = fabs(x);
    const float t = 1.0f / (1.0f + 0.3275911f * a);
    const float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f +
                                                                                          t * 1.061405429f))));
    const float y = 1.0f - poly * exp(-a * a);
    return x < 0.0f ? -y : y;
}

inline float vision_act(float v, uint act) {
    if (act == VISION_ACT_GELU_TANH) {
        return 0.5f * v * (1.0f + precise::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    }
    if (act == VISION_ACT_GELU_ERF) {
        return 0.5f * v * (1.0f + vision_erf(v * 0.7071067811865476f));
    }
    return v;
}

template <typename T>
kernel void vision_bias_act(constant VisionBiasParams& p [[buffer(0)]], device T* y [[buffer(1)]],
                            device const T* b [[buffer(2)]], uint row [[threadgroup_position_in_grid]],
                            uint tid [[thread_index_in_threadgroup]], uint nthreads [[threads_per_threadgroup]]) {
    device T* yr = y + ulong(row) * p.stride;
    for (uint i = tid; i < p.N; i += nthreads) {
        const float v = rnd<T>(float(yr[i]) + float(b[i]));
        yr[i] = T(vision_act(v, p.act));
    }
}

template <typename T>
kernel void vision_pos_embed(constant VisionPosParams& p [[buffer(0)]], device T* x [[buffer(1)]],
                             device const T* b [[buffer(2)]], device const T* table [[buffer(3)]],
                             device const uint* idx [[buffer(4)]], device const float* w [[buffer(5)]],
                             uint row [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                             uint nthreads [[threads_per_threadgroup]]) {
    device T* xr = x + ulong(row) * p.H;
    const ulong t0 = ulong(min(idx[4 * row + 0], p.table_rows - 1)) * p.H;
    const ulong t1 = ulong(min(idx[4 * row + 1], p.table_rows - 1)) * p.H;
    const ulong t2 = ulong(min(idx[4 * row + 2], p.table_rows - 1)) * p.H;
    const ulong t3 = ulong(min(idx[4 * row + 3], p.table_rows - 1)) * p.H;
    const float w0 = w[4 * row + 0], w1 = w[4 * row + 1], w2 = w[4 * row + 2], w3 = w[4 * row + 3];
    for (uint i = tid; i < p.H; i += nthreads) {
        const float pos = ((float(table[t0 + i]) * w0 + float(table[t1 + i]) * w1) + float(table[t2 + i]) * w2) +
                          float(table[t3 + i]) * w3;
        xr[i] = T(rnd<T>(float(xr[i]) + float(b[i])) + pos);
    }
}

template <typename T>
kernel void vision_rope(constant VisionRopeParams& p [[buffer(0)]], device const T* qkv [[buffer(1)]],
                        device const T* bias [[buffer(2)]], device const float* cos_t [[buffer(3)]],
                        device const float* sin_t [[buffer(4)]], device T* q_out [[buffer(5)]],
                        device T* k_cache [[buffer(6)]], device T* v_cache [[buffer(7)]],
                        uint2 tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                        uint2 tpg [[threads_per_threadgroup]]) {
    const uint hd = p.head_dim, g = tg.x, r = tg.y, half_d = hd / 2;
    const uint H = p.n_heads * hd;
    device const T* row = qkv + ulong(r) * p.qkv_stride;
    device const float* c = cos_t + ulong(r) * hd;
    device const float* s = sin_t + ulong(r) * hd;
    device T* q_row = q_out + ulong(r) * H + g * hd;
    const ulong kv_row = (ulong(g) * p.capacity + r) * hd;
    device T* k_row = k_cache + kv_row;
    device T* v_row = v_cache + kv_row;
    const uint qo = g * hd, ko = H + g * hd, vo = 2 * H + g * hd;
    for (uint d = tid; d < hd; d += tpg.x) {
        const bool lo = d < half_d;
        const uint dp = lo ? d + half_d : d - half_d;
        const float qd = rnd<T>(float(row[qo + d]) + float(bias[qo + d]));
        const float qp = rnd<T>(float(row[qo + dp]) + float(bias[qo + dp]));
        const float kd = rnd<T>(float(row[ko + d]) + float(bias[ko + d]));
        const float kp = rnd<T>(float(row[ko + dp]) + float(bias[ko + dp]));
        q_row[d] = T(qd * c[d] + (lo ? -qp : qp) * s[d]);
        k_row[d] = T(kd * c[d] + (lo ? -kp : kp) * s[d]);
        v_row[d] = T(float(row[vo + d]) + float(bias[vo + d]));
    }
}

INSTANTIATE_KERNEL("vision_bias_act_f32", vision_bias_act, float)
INSTANTIATE_KERNEL("vision_bias_act_bf16", vision_bias_act, bfloat)
INSTANTIATE_KERNEL("vision_pos_embed_f32", vision_pos_embed, float)
INSTANTIATE_KERNEL("vision_pos_embed_bf16", vision_pos_embed, bfloat)
INSTANTIATE_KERNEL("vision_rope_f32", vision_rope, float)
INSTANTIATE_KERNEL("vision_rope_bf16", vision_rope, bfloat)

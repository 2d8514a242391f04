// Gated DeltaNet decode, one token: the causal conv step and the recurrence step.
//
//   gdn_conv_{f32,bf16}:  act[c] = silu(sum_j conv_w[c, j] * win_j[c]),  win = (conv_state rows, oldest
//                         first, then qkv[c]); conv_state shifted in place (drop the oldest row, append qkv)
//   gdn_step_{f32,bf16}:  per value head h (key head kh = h / (nv / nk)):
//                         q = l2norm(q_kh) * dk^-1/2, k = l2norm(k_kh), beta = sigmoid(b[h]),
//                         decay = exp(-exp(A_log[h]) * softplus(a[h] + dt_bias[h]));
//                         S = decay S; kv = S k; S += (beta (v - kv)) k^T; o = S q   (S[h] is [dv, dk]);
//                         y = o * rsqrt(mean(o^2) + eps) * norm_w * silu(z)
// Everything is computed in float (the conv and recurrent states are float); activations are read as T and
// the outputs rounded to T once on store. The math and its order follow python/qwenmetal/reference.py
// (causal_conv1d, silu, l2norm, sigmoid, softplus, gdn_recurrent, gated_rms_norm in float mode).
//
// Simulator-verified, hardware-unverified.
#include "common.h"
#include "gdn.h"

// overflow-free logistic function, as the reference's sigmoid
inline float gdn_sigmoid(float x) {
    const float e = exp(-fabs(x));
    return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

// log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|)); MSL has no log1p, so log1p(e) is computed as
// log(u) * e / (u - 1) with u = 1 + e (exact to a few ulps also where e is below float epsilon, where the
// plain log(1 + e) would return 0: softplus of a very negative argument stays exp(x), not 0).
inline float gdn_softplus(float x) {
    const float e = exp(-fabs(x));
    const float u = 1.0f + e;
    const float l1p = u == 1.0f ? e : log(u) * e / (u - 1.0f);
    return max(x, 0.0f) + l1p;
}

// Causal depthwise conv step fused with SiLU and the conv-state shift.
//
// Why fused: the conv of one token is K multiply-adds per channel; the state shift and the SiLU touch the
// same channel's values, so one pass reads qkv, the state and the taps once and writes act and the state
// once (Lily's conv1d_step_bf16 does the same).
//
// Thread mapping: one thread per channel, GDN_CONV_THREADS threads per threadgroup, grid
// ceil(C / GDN_CONV_THREADS) (threads past C return; there is no SIMD-group function or barrier). Tap j
// of channel c is conv_w[c * K + j] (the canonical [conv_dim, K] layout: K consecutive floats per channel).
// Step j reads window row j (state row j, or qkv for j = K-1) and writes it to row j-1 of conv_out, which
// may be conv_state itself (step j-1 has already read that row) or the other half of a ping-pong pair
// (the graph's: a discarded step leaves the state intact); no window copy in registers, any K >= 2 works. Consecutive
// threads read consecutive channels of each state row (coalesced).
template <typename T>
kernel void gdn_conv(constant GdnConvParams& p [[buffer(0)]], device const T* qkv [[buffer(1)]],
                     device const float* conv_w [[buffer(2)]], device const float* conv_state [[buffer(3)]],
                     device float* conv_out [[buffer(4)]], device T* act [[buffer(5)]],
                     uint c [[thread_position_in_grid]]) {
    if (c >= p.C) {
        return;
    }
    const uint S = p.K - 1u;
    device const float* w = conv_w + ulong(c) * p.K;
    float acc = 0.0f;
    for (uint j = 0; j < p.K; ++j) {
        const float x = j < S ? conv_state[ulong(j) * p.C + c] : float(qkv[c]);
        acc += x * w[j];
        if (j > 0) {
            conv_out[ulong(j - 1u) * p.C + c] = x;
        }
    }
    const float xr = rnd<T>(acc);                 // as the bf16 graph: conv output rounded, then MLX's silu
    act[c] = T(xr * rnd<T>(gdn_sigmoid(xr)));     // (sigmoid rounded, product rounded); float: x * sigmoid(x)
}

// One token of the gated delta rule for one value head, fused with the q/k l2norm, the gates and the
// gated RMSNorm.
//
// Why fused: the state (nv * dv * dk floats: 2 MiB per layer for the real model) is the dominant traffic of
// the step; it is read once and written once here. The q/k normalisation, beta and the decay are a few
// hundred flops per head recomputed where they are used, and the gated norm needs only o of the head,
// which the threadgroup holds, so no intermediate (normalised q/k, gates, o) goes through device memory
// (Lily's gdn_step_gated fuses the same).
//
// Thread mapping: one threadgroup per value head (grid = (nv, 1, 1)), nsg = min(dv, 32) SIMD-groups.
// Lane l of every SIMD-group holds elements l, l + 32, ... of the head's q and k in registers (each
// SIMD-group loads and normalises them itself with two simd_sums: no barrier). SIMD-group sg walks the state
// rows r = sg, sg + nsg, ... (dv index): per row the lanes load their strided dk slice (consecutive lanes,
// consecutive floats: coalesced), decay it, reduce kv = S[r] . k with simd_sum, apply the rank-1 update,
// reduce o[r] = S[r] . q with simd_sum and store the slice back; lane 0 stages o[r] in threadgroup memory.
// Rows are independent, so a thread keeps only one row slice (<= GDN_STEP_MAX_DK_PER_LANE floats) in
// registers at a time. The sum of o^2 over the head is reduced by threadgroup_sum (its barrier also
// publishes the staged o), then all threads compute y in steps of the threadgroup size.
template <typename T>
kernel void gdn_step(constant GdnStepParams& p [[buffer(0)]], device const T* act [[buffer(1)]],
                     device const T* z [[buffer(2)]], device const T* b [[buffer(3)]],
                     device const T* a [[buffer(4)]], device const float* A_log [[buffer(5)]],
                     device const float* dt_bias [[buffer(6)]], device const T* norm_w [[buffer(7)]],
                     device const float* state [[buffer(8)]], device float* state_out [[buffer(9)]],
                     device T* y [[buffer(10)]],
                     uint h [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                     uint nthreads [[threads_per_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                     uint sg [[simdgroup_index_in_threadgroup]], uint nsg [[simdgroups_per_threadgroup]]) {
    threadgroup float o_tg[GDN_STEP_MAX_DV];
    threadgroup float partial[SIMD_WIDTH];
    const uint dk = p.dk, dv = p.dv, key_dim = p.nk * p.dk;
    const uint kh = h / p.group;
    const uint nper = (dk + SIMD_WIDTH - 1u) / SIMD_WIDTH;   // <= GDN_STEP_MAX_DK_PER_LANE (host-checked)

    // q and k of the key head, lane-strided, normalised in float
    device const T* qh = act + ulong(kh) * dk;
    device const T* kh_ptr = act + key_dim + ulong(kh) * dk;
    float qv[GDN_STEP_MAX_DK_PER_LANE], kv[GDN_STEP_MAX_DK_PER_LANE];
    float qss = 0.0f, kss = 0.0f;
    for (uint j = 0; j < GDN_STEP_MAX_DK_PER_LANE; ++j) {
        const uint i = lane + j * SIMD_WIDTH;
        const bool in = j < nper && i < dk;
        qv[j] = in ? float(qh[i]) : 0.0f;
        kv[j] = in ? float(kh_ptr[i]) : 0.0f;
        qss += qv[j] * qv[j];
        kss += kv[j] * kv[j];
    }
    const float qsum = simd_sum(qss), ksum = simd_sum(kss);
    if (sizeof(T) == 2) {
        // the bf16 graph (MLX normalize_qk): n = T(x rsqrt(mean(x^2) + eps / dk)) = T(sqrt(dk) l2norm(x)),
        // then q = T(n T(1/dk)), k = T(n T(dk^-1/2)) (MLX casts the Python float factors to bf16)
        const float fdk = float(dk);
        const float qn = rsqrt(qsum / fdk + p.l2_eps / fdk), kn = rsqrt(ksum / fdk + p.l2_eps / fdk);
        const float qf = rnd<T>(1.0f / fdk), kf = rnd<T>(p.q_scale);
        for (uint j = 0; j < GDN_STEP_MAX_DK_PER_LANE; ++j) {
            qv[j] = rnd<T>(rnd<T>(qv[j] * qn) * qf);
            kv[j] = rnd<T>(rnd<T>(kv[j] * kn) * kf);
        }
    } else {
        const float qinv = rsqrt(qsum + p.l2_eps);
        const float kinv = rsqrt(ksum + p.l2_eps);
        for (uint j = 0; j < GDN_STEP_MAX_DK_PER_LANE; ++j) {
            qv[j] = qv[j] * qinv * p.q_scale;
            kv[j] = kv[j] * kinv;
        }
    }

    // gates (float, from the T-rounded projections)
    const float beta = rnd<T>(gdn_sigmoid(float(b[h])));
    const float g_log = -exp(A_log[h]) * gdn_softplus(float(a[h]) + dt_bias[h]);
    const float decay = exp(g_log);

    device const T* vh = act + 2u * key_dim + ulong(h) * dv;
    device const float* Sh = state + ulong(h) * dv * dk;
    device float* Oh = state_out + ulong(h) * dv * dk;   // may be Sh (in place): each row is read, then written
    float oss = 0.0f;
    for (uint r = sg; r < dv; r += nsg) {   // SIMD-group-uniform: r depends on sg only
        device const float* srow = Sh + ulong(r) * dk;
        device float* orow = Oh + ulong(r) * dk;
        float s[GDN_STEP_MAX_DK_PER_LANE];
        float skv = 0.0f;
        for (uint j = 0; j < GDN_STEP_MAX_DK_PER_LANE; ++j) {
            const uint i = lane + j * SIMD_WIDTH;
            s[j] = (j < nper && i < dk) ? srow[i] * decay : 0.0f;
            skv += s[j] * kv[j];
        }
        const float delta = (float(vh[r]) - simd_sum(skv)) * beta;
        float so = 0.0f;
        for (uint j = 0; j < GDN_STEP_MAX_DK_PER_LANE; ++j) {
            s[j] += delta * kv[j];
            so += s[j] * qv[j];
            const uint i = lane + j * SIMD_WIDTH;
            if (j < nper && i < dk) {
                orow[i] = s[j];
            }
        }
        const float o = rnd<T>(simd_sum(so));   // the recurrence output, rounded as the bf16 graph does
        if (lane == 0) {
            o_tg[r] = o;
        }
        oss += o * o;
    }

    // gated RMSNorm over the head's dv outputs (one SIMD-group's lanes all hold the same oss: count lane 0)
    const float total = threadgroup_sum(lane == 0 ? oss : 0.0f, partial, lane, sg, nsg);
    const float inv = rsqrt(total / float(dv) + p.eps);
    device const T* zh = z + ulong(h) * dv;
    device T* yh = y + ulong(h) * dv;
    for (uint i = tid; i < dv; i += nthreads) {
        const float zi = float(zh[i]);
        // bf16 graph: n = T(w T(o inv)), y = T(n silu_f32(z)); float: o inv w silu(z)
        yh[i] = T(rnd<T>(float(norm_w[i]) * rnd<T>(o_tg[i] * inv)) * (zi * gdn_sigmoid(zi)));
    }
}

INSTANTIATE_KERNEL("gdn_conv_f32", gdn_conv, float)
INSTANTIATE_KERNEL("gdn_conv_bf16", gdn_conv, bfloat)
INSTANTIATE_KERNEL("gdn_step_f32", gdn_step, float)
INSTANTIATE_KERNEL("gdn_step_bf16", gdn_step, bfloat)

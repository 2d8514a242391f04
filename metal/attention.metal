// Gated full attention of one decode token (the full-attention layers of Qwen3.6: q/k RMSNorm,
// partial rotate-half RoPE, GQA, output gate sigmoid(gate) * o).
//
// The token's stacked projection proj T [q_rows | k (n_kv * hd) | v (n_kv * hd)] holds, per query
// head h, [q (hd) | gate (hd)] at h * q_stride (q_stride = 2 hd with the output gate, hd without).
// The KV cache of a layer is K and V [n_kv_heads, capacity, head_dim] each, in KV = float or
// bfloat independent of the activation type T: the rows of one kv head are contiguous, so a block
// of keys is one coalesced range.
//
//   attn_prepare_{f32,bf16}_kv{f32,bf16}
//       q_out[h] = rope(rmsnorm(q_h) * q_norm_w); K[j, pos] = rope(rmsnorm(k_j) * k_norm_w);
//       V[j, pos] = v_j. One dispatch for the norm, the rotation and the cache write of q, k and v
//       (Lily needs three: q_norm_rope_split, k_norm_rope_scatter, scatter_kv).
//   attn_decode_single_{f32,bf16}_kv{f32,bf16}
//       o = softmax(q K^T / sqrt(hd)) V over all keys, times sigmoid(gate): one pass (short contexts).
//   attn_decode_partial_{f32,bf16}_kv{f32,bf16}
//       the same over the blocks of one partial, leaving (max, sum, unnormalised acc) in scratch:
//       pass 1 of the split-K and of the two-pass routes.
//   attn_decode_combine_{f32,bf16}
//       pass 2: merges a head's partials, normalises and applies the output gate.
//
// Rounding follows the reference (python/qwenmetal/reference.py): the norm is
// T(w * T(x * inv)), RoPE in float rounded once to T, and the output T(T(o) * T(sigmoid(gate))).
// Everything else is float. Softmax works in the exp2 domain (q pre-scaled by log2(e)/sqrt(hd)).
//
// Simulator-verified, hardware-unverified.
#include "common.h"
#include "attention.h"

// T(w * T(x * inv)): the reference's RMSNorm rounding (a no-op chain for float)
template <typename T>
inline float attn_normed(device const T* x, device const T* w, uint d, float inv) {
    return float(T(float(w[d]) * float(T(float(x[d]) * inv))));
}

// Overflow-free logistic function (the reference's form).
inline float attn_sigmoid(float x) {
    const float e = exp(-abs(x));
    return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

// T(T(o) * T(sigmoid(gate))) with the gate, T(o) without
template <typename T>
inline T attn_gated(float o, device const T* gate, uint d, uint output_gate) {
    if (output_gate == 0) {
        return T(o);
    }
    return T(float(T(o)) * float(T(attn_sigmoid(float(gate[d])))));
}

// attn_prepare: q/k RMSNorm + partial RoPE + KV write, fused.
//
// Why fused: all three read the same few kilobytes of proj; one dispatch instead of three and no
// intermediate buffer for the normalised k (it goes straight into its cache row).
//
// Thread mapping: one threadgroup per head, grid (n_heads + n_kv_heads, 1, 1): threadgroups
// 0 .. n_heads-1 take query head g, the others kv head j = g - n_heads (its k, and the copy of its
// v row). Threads: head_dim rounded up to 32, at most ATTN_PREPARE_MAX_THREADS; thread tid owns
// elements tid, tid + threads, ... The sum of squares goes through threadgroup_sum (common.h);
// a rotating element d < rotary_dim also recomputes its partner d +- rotary_dim / 2 (one more
// load and multiply) instead of exchanging it through threadgroup memory and a second barrier.
// angle = float(pos) * inv_freq[i] in float (the table comes with the params, see attention.h),
// cos/sin precise: the angle reaches ~1e5 radians at long contexts, where fast sin/cos lose all
// accuracy.
template <typename T, typename KV>
kernel void attn_prepare(constant AttnPrepareParams& p [[buffer(0)]], device const T* proj [[buffer(1)]],
                         device const T* q_norm_w [[buffer(2)]], device const T* k_norm_w [[buffer(3)]],
                         device T* q_out [[buffer(4)]], device KV* k_cache [[buffer(5)]],
                         device KV* v_cache [[buffer(6)]], uint g [[threadgroup_position_in_grid]],
                         uint tid [[thread_index_in_threadgroup]], uint nthreads [[threads_per_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]],
                         uint nsg [[simdgroups_per_threadgroup]]) {
    threadgroup float partial[SIMD_WIDTH];
    const uint hd = p.head_dim;
    const bool is_q = g < p.n_heads;
    const uint j = is_q ? 0u : g - p.n_heads;
    device const T* x = is_q ? proj + ulong(g) * p.q_stride : proj + p.q_rows + ulong(j) * hd;
    device const T* w = is_q ? q_norm_w : k_norm_w;

    float ss = 0.0f;
    for (uint d = tid; d < hd; d += nthreads) {
        const float v = float(x[d]);
        ss += v * v;
    }
    const float inv = rsqrt(threadgroup_sum(ss, partial, lane, sg, nsg) / float(hd) + p.eps);

    const uint half_rot = p.rotary_dim / 2;
    const ulong row = (ulong(j) * p.capacity + p.position) * hd;
    device const T* v_in = proj + p.q_rows + ulong(p.n_kv_heads) * hd + ulong(j) * hd;
    for (uint d = tid; d < hd; d += nthreads) {
        float y = attn_normed(x, w, d, inv);
        if (d < p.rotary_dim) {
            const bool lo = d < half_rot;
            const uint i = lo ? d : d - half_rot;
            const float yp = attn_normed(x, w, lo ? d + half_rot : i, inv);
            const float ang = float(p.position) * p.inv_freq[i];
            const float c = precise::cos(ang), s = precise::sin(ang);
            y = lo ? y * c - yp * s : y * c + yp * s;
        }
        const T yt = T(y);
        if (is_q) {
            q_out[ulong(g) * hd + d] = yt;
        } else {
            k_cache[row + d] = KV(float(yt));
            v_cache[row + d] = KV(float(v_in[d]));
        }
    }
}

// Load keys [t0, t0 + n) of one kv head (K and V rows, contiguous) into the float tiles.
template <typename KV>
inline void attn_load_tile(device const KV* k, device const KV* v, ulong base, uint n_elems, bool vec4,
                           threadgroup float* kt, threadgroup float* vt, uint tid, uint nthreads) {
    if (vec4) {
        device const vec<KV, 4>* k4 = (device const vec<KV, 4>*)(k + base);
        device const vec<KV, 4>* v4 = (device const vec<KV, 4>*)(v + base);
        for (uint e = tid; e * 4 < n_elems; e += nthreads) {
            const float4 a = float4(k4[e]);
            const float4 b = float4(v4[e]);
            for (uint c = 0; c < 4; ++c) {
                kt[4 * e + c] = a[c];
                vt[4 * e + c] = b[c];
            }
        }
    } else {
        for (uint e = tid; e < n_elems; e += nthreads) {
            kt[e] = float(k[base + e]);
            vt[e] = float(v[base + e]);
        }
    }
}

// Online-softmax attention of one chunk of a GQA group over the blocks of one partial, shared by
// attn_decode_single and attn_decode_partial.
//
// GQA packing: a threadgroup serves heads_per_tg query heads that share kv head j; every K/V row
// is read from device memory once per threadgroup into threadgroup tiles (tile_keys rows of K
// and V, converted to float) and used by all of them. With gqa_pack off the host sets
// heads_per_tg = 1 (each query head reads K/V itself).
//
// Thread mapping: grid (n_partials, head chunks, n_kv_heads); threadgroup of
// heads_per_tg * key_split SIMD-groups. SIMD-group sg serves head hh = sg % heads_per_tg of the
// chunk and takes keys ks, ks + key_split, ... (ks = sg / heads_per_tg) of each tile. Lane l
// holds q and the accumulator at elements l + 32 i (conflict-free threadgroup reads); a score is
// one simd_sum. Per tile: all threads load it (coalesced, 4-vectors when head_dim % 4 == 0),
// barrier, every SIMD-group consumes it, barrier. Partial `part` takes blocks part,
// part + n_partials, ... of `block` keys each.
//
// On return each SIMD-group's accumulator is in kt[sg * head_dim ..] and its running (max, sum)
// in ml[2 sg], ml[2 sg + 1], visible to the whole threadgroup (attn_merge combines them).
template <typename T, typename KV>
inline void attn_partial_pass(constant AttnDecodeParams& p, device const T* q, device const KV* k_cache,
                              device const KV* v_cache, uint part, uint chunk, uint j, uint tid, uint nthreads,
                              uint lane, uint sg, threadgroup float* kt, threadgroup float* vt,
                              threadgroup float* ml) {
    const uint hd = p.head_dim, HP = p.heads_per_tg, KS = p.key_split;
    const uint hh = sg % HP, ks = sg / HP;
    const uint gi = chunk * HP + hh;             // index in the GQA group
    const bool active = gi < p.group;            // SIMD-group-uniform
    const uint h = j * p.group + (active ? gi : 0u);

    float qr[ATTN_LANE_ELEMS];
    float acc[ATTN_LANE_ELEMS];
    for (uint i = 0; i < ATTN_LANE_ELEMS; ++i) {
        const uint d = lane + SIMD_WIDTH * i;
        qr[i] = active && d < hd ? float(q[ulong(h) * hd + d]) * p.scale : 0.0f;
        acc[i] = 0.0f;
    }
    float m = ATTN_NEG_INIT, l = 0.0f;

    const ulong head_base = ulong(j) * p.capacity * hd;
    const bool vec4 = (hd & 3u) == 0;
    bool first = true;
    for (uint b = part; b < p.n_blocks; b += p.n_partials) {
        const uint b0 = b * p.block;
        const uint b1 = min(b0 + p.block, p.n_keys);
        for (uint t0 = b0; t0 < b1; t0 += p.tile_keys) {
            const uint nt = min(p.tile_keys, b1 - t0);
            if (!first) {
                threadgroup_barrier(mem_flags::mem_threadgroup);  // everyone is done with the last tile
            }
            first = false;
            attn_load_tile(k_cache, v_cache, head_base + ulong(t0) * hd, nt * hd, vec4, kt, vt, tid, nthreads);
            threadgroup_barrier(mem_flags::mem_threadgroup);
            if (active) {
                for (uint t = ks; t < nt; t += KS) {
                    threadgroup const float* kr = kt + t * hd;
                    threadgroup const float* vr = vt + t * hd;
                    float s = 0.0f;
                    for (uint i = 0; i < ATTN_LANE_ELEMS; ++i) {
                        const uint d = lane + SIMD_WIDTH * i;
                        if (d < hd) {
                            s += qr[i] * kr[d];
                        }
                    }
                    s = simd_sum(s);
                    const float m_new = max(m, s);
                    const float corr = exp2(m - m_new);
                    const float pr = exp2(s - m_new);
                    l = l * corr + pr;
                    for (uint i = 0; i < ATTN_LANE_ELEMS; ++i) {
                        const uint d = lane + SIMD_WIDTH * i;
                        acc[i] = acc[i] * corr + (d < hd ? pr * vr[d] : 0.0f);
                    }
                    m = m_new;
                }
            }
        }
    }

    threadgroup_barrier(mem_flags::mem_threadgroup);  // the K tile becomes the accumulator array
    for (uint i = 0; i < ATTN_LANE_ELEMS; ++i) {
        const uint d = lane + SIMD_WIDTH * i;
        if (d < hd) {
            kt[sg * hd + d] = acc[i];
        }
    }
    if (lane == 0) {
        ml[2 * sg] = m;
        ml[2 * sg + 1] = l;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Merge the key_split SIMD-group results of head eh of the chunk at element d:
// *M = max_k m_k, *L = sum_k l_k 2^(m_k - M), return sum_k acc_k[d] 2^(m_k - M).
inline float attn_merge(threadgroup const float* kt, threadgroup const float* ml, uint HP, uint KS, uint hd,
                        uint eh, uint d, thread float* M, thread float* L) {
    float mx = ATTN_NEG_INIT;
    for (uint k = 0; k < KS; ++k) {
        mx = max(mx, ml[2 * (k * HP + eh)]);
    }
    float sum = 0.0f, a = 0.0f;
    for (uint k = 0; k < KS; ++k) {
        const uint s2 = k * HP + eh;
        const float wk = exp2(ml[2 * s2] - mx);
        sum += ml[2 * s2 + 1] * wk;
        a += kt[s2 * hd + d] * wk;
    }
    *M = mx;
    *L = sum;
    return a;
}

// attn_decode_single: the whole attention of a token in one pass (short contexts): one partial
// covering all keys (the host sets n_partials = n_blocks = 1), merged, normalised and multiplied
// by sigmoid(gate) on store. Grid (1, head chunks, n_kv_heads).
template <typename T, typename KV>
kernel void attn_decode_single(constant AttnDecodeParams& p [[buffer(0)]], device const T* q [[buffer(1)]],
                               device const T* proj [[buffer(2)]], device const KV* k_cache [[buffer(3)]],
                               device const KV* v_cache [[buffer(4)]], device T* o [[buffer(5)]],
                               uint3 tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                               uint nthreads [[threads_per_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                               uint sg [[simdgroup_index_in_threadgroup]]) {
    threadgroup float kt[ATTN_TILE_FLOATS];
    threadgroup float vt[ATTN_TILE_FLOATS];
    threadgroup float ml[2 * ATTN_MAX_SIMDGROUPS];
    attn_partial_pass(p, q, k_cache, v_cache, tg.x, tg.y, tg.z, tid, nthreads, lane, sg, kt, vt, ml);
    const uint hd = p.head_dim, HP = p.heads_per_tg;
    for (uint e = tid; e < HP * hd; e += nthreads) {
        const uint eh = e / hd, d = e - eh * hd;
        const uint gi = tg.y * HP + eh;
        if (gi < p.group) {
            float M, L;
            const float a = attn_merge(kt, ml, HP, p.key_split, hd, eh, d, &M, &L);
            const uint h = tg.z * p.group + gi;
            o[ulong(h) * hd + d] = attn_gated(a / L, proj + ulong(h) * p.q_stride + hd, d, p.output_gate);
        }
    }
}

// attn_decode_partial: pass 1 of the split-K route (one block of `block` keys per partial) and of
// the two-pass route (at most ATTN_LONG_MAX_PARTIALS partials, each looping over every
// n_partials-th block of long_block keys, so scratch is bounded whatever the context). Stores
// the merged, unnormalised accumulator and (max, sum) of each head to scratch:
// acc f32 [n_heads, n_partials, head_dim], then ml f32 [n_heads, n_partials, 2].
// Grid (n_partials, head chunks, n_kv_heads).
template <typename T, typename KV>
kernel void attn_decode_partial(constant AttnDecodeParams& p [[buffer(0)]], device const T* q [[buffer(1)]],
                                device const KV* k_cache [[buffer(2)]], device const KV* v_cache [[buffer(3)]],
                                device float* scratch [[buffer(4)]], uint3 tg [[threadgroup_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]], uint nthreads [[threads_per_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]]) {
    threadgroup float kt[ATTN_TILE_FLOATS];
    threadgroup float vt[ATTN_TILE_FLOATS];
    threadgroup float ml[2 * ATTN_MAX_SIMDGROUPS];
    attn_partial_pass(p, q, k_cache, v_cache, tg.x, tg.y, tg.z, tid, nthreads, lane, sg, kt, vt, ml);
    const uint hd = p.head_dim, HP = p.heads_per_tg;
    device float* mls = scratch + ulong(p.n_heads) * p.n_partials * hd;
    for (uint e = tid; e < HP * hd; e += nthreads) {
        const uint eh = e / hd, d = e - eh * hd;
        const uint gi = tg.y * HP + eh;
        if (gi < p.group) {
            float M, L;
            const float a = attn_merge(kt, ml, HP, p.key_split, hd, eh, d, &M, &L);
            const ulong slot = ulong(tg.z * p.group + gi) * p.n_partials + tg.x;
            scratch[slot * hd + d] = a;
            if (d == 0) {
                mls[2 * slot] = M;
                mls[2 * slot + 1] = L;
            }
        }
    }
}

// attn_decode_combine: pass 2 of the split-K and two-pass routes, with the output gate fused.
// o[h, d] = gate(sum_p acc_p[d] 2^(m_p - M) / sum_p l_p 2^(m_p - M)), M = max_p m_p.
//
// Thread mapping: one threadgroup per query head, grid (n_heads, 1, 1); head_dim rounded up to
// 32 threads (at most ATTN_MAX_HEAD_DIM), one element each. Every thread walks the head's
// n_partials (max, sum) pairs itself: a few hundred bytes from cache, no barrier.
template <typename T>
kernel void attn_decode_combine(constant AttnCombineParams& p [[buffer(0)]], device const float* scratch [[buffer(1)]],
                                device const T* proj [[buffer(2)]], device T* o [[buffer(3)]],
                                uint h [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                                uint nthreads [[threads_per_threadgroup]]) {
    const uint hd = p.head_dim, P = p.n_partials;
    device const float* acc = scratch + ulong(h) * P * hd;
    device const float* mls = scratch + ulong(p.n_heads) * P * hd + ulong(h) * P * 2;
    float M = ATTN_NEG_INIT;
    for (uint k = 0; k < P; ++k) {
        M = max(M, mls[2 * k]);
    }
    for (uint d = tid; d < hd; d += nthreads) {
        float L = 0.0f, a = 0.0f;
        for (uint k = 0; k < P; ++k) {
            const float wk = exp2(mls[2 * k] - M);
            L += mls[2 * k + 1] * wk;
            a += acc[ulong(k) * hd + d] * wk;
        }
        o[ulong(h) * hd + d] = attn_gated(a / L, proj + ulong(h) * p.q_stride + hd, d, p.output_gate);
    }
}

INSTANTIATE_KERNEL("attn_prepare_f32_kvf32", attn_prepare, float, float)
INSTANTIATE_KERNEL("attn_prepare_f32_kvbf16", attn_prepare, float, bfloat)
INSTANTIATE_KERNEL("attn_prepare_bf16_kvf32", attn_prepare, bfloat, float)
INSTANTIATE_KERNEL("attn_prepare_bf16_kvbf16", attn_prepare, bfloat, bfloat)
INSTANTIATE_KERNEL("attn_decode_single_f32_kvf32", attn_decode_single, float, float)
INSTANTIATE_KERNEL("attn_decode_single_f32_kvbf16", attn_decode_single, float, bfloat)
INSTANTIATE_KERNEL("attn_decode_single_bf16_kvf32", attn_decode_single, bfloat, float)
INSTANTIATE_KERNEL("attn_decode_single_bf16_kvbf16", attn_decode_single, bfloat, bfloat)
INSTANTIATE_KERNEL("attn_decode_partial_f32_kvf32", attn_decode_partial, float, float)
INSTANTIATE_KERNEL("attn_decode_partial_f32_kvbf16", attn_decode_partial, float, bfloat)
INSTANTIATE_KERNEL("attn_decode_partial_bf16_kvf32", attn_decode_partial, bfloat, float)
INSTANTIATE_KERNEL("attn_decode_partial_bf16_kvbf16", attn_decode_partial, bfloat, bfloat)
INSTANTIATE_KERNEL("attn_decode_combine_f32", attn_decode_combine, float)
INSTANTIATE_KERNEL("attn_decode_combine_bf16", attn_decode_combine, bfloat)

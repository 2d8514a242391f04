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
//       q_out[r, h] = rope(rmsnorm(q_h) * q_norm_w); K[j, pos] = rope(rmsnorm(k_j) * k_norm_w);
//       V[j, pos] = v_j for rows r of proj at pos = position + r (rows = 1: decode). One dispatch
//       for the norm, the rotation and the cache write of q, k and v (Lily needs three:
//       q_norm_rope_split, k_norm_rope_scatter, scatter_kv).
//   attn_decode_single_{f32,bf16}_kv{f32,bf16}
//       o = softmax(q K^T / sqrt(hd)) V over all keys, times sigmoid(gate): one pass (short contexts).
//   attn_decode_partial_{f32,bf16}_kv{f32,bf16}
//       the same over the blocks of one partial, leaving (max, sum, unnormalised acc) in scratch:
//       pass 1 of the split-K and of the two-pass routes.
//   attn_decode_{single,partial}_prep_{f32,bf16}_kv{f32,bf16}
//       the same with attn_prepare of the token fused in (the decode graph's route): they read its
//       stacked projection and write its K/V row themselves, bit for bit prepare + attend.
//   attn_decode_combine_{f32,bf16}
//       pass 2: merges a head's partials, normalises and applies the output gate.
//   attn_prefill_d{64,128,256}_{f32,bf16}_kv{f32,bf16}
//       causal flash attention of a prefill chunk (M query rows at positions p0 ..) over the cache
//       (earlier chunks + this one), every K/V tile read once for all query heads of its kv head,
//       S = Q K^T and O += P V on 8x8 simdgroup matrices, the output gate fused; one instantiation
//       per largest head_dim served (64, 128, 256: compile-time loop bounds).
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

// Element d of a normalised, rotated head (attn_prepare's arithmetic, shared with the fused decode prepare):
// rmsnorm(x) * w, then rotate-half RoPE at `position` (the RoPE position of d's frequency pair, see
// attn_rope_position) for d < rotary_dim. A rotating element recomputes its
// partner d +- rotary_dim / 2 (one more load and multiply) rather than exchanging it. angle =
// float(pos) * inv_freq[i] in float (the table comes with the params, see attention.h), cos/sin precise: the
// angle reaches ~1e5 radians at long contexts, where fast sin/cos lose all accuracy.
template <typename T>
inline float attn_normed_rope(constant AttnPrepareParams& p, device const T* x, device const T* w, uint d, float inv,
                              int position) {
    float y = attn_normed(x, w, d, inv);
    if (d < p.rotary_dim) {
        const uint half_rot = p.rotary_dim / 2;
        const bool lo = d < half_rot;
        const uint i = lo ? d : d - half_rot;
        const float yp = attn_normed(x, w, lo ? d + half_rot : i, inv);
        const float ang = float(position) * p.inv_freq[i];
        const float c = precise::cos(ang), s = precise::sin(ang);
        y = lo ? y * c - yp * s : y * c + yp * s;
    }
    return y;
}

// The RoPE position of a row whose cache row is `row_position` (every pair, no explicit positions): row_position
// + rope_offset (the state's rope_delta: M-RoPE's delta after an image, an MTP head layer's shift). float(int(position)
// + 0) is float(position): the text path is unchanged bit for bit. The fused decode prepare's position too.
inline int attn_row_rope_position(constant AttnPrepareParams& p, uint row_position) {
    return int(row_position) + p.rope_offset;
}

// The RoPE position of element d's frequency pair: the row's explicit per-pair position (pair_row: the row's
// pair_pos, read only with pair_positions), else attn_row_rope_position.
inline int attn_rope_position(constant AttnPrepareParams& p, uint row_position, device const int* pair_row, uint d) {
    if (p.pair_positions != 0u && d < p.rotary_dim) {
        const uint half_rot = p.rotary_dim / 2;
        return pair_row[d < half_rot ? d : d - half_rot];
    }
    return attn_row_rope_position(p, row_position);
}

// attn_prepare: q/k RMSNorm + partial RoPE + KV write, fused.
//
// Why fused: all three read the same few kilobytes of proj; one dispatch instead of three and no
// intermediate buffer for the normalised k (it goes straight into its cache row).
//
// Thread mapping: one threadgroup per (head, token row), grid (n_heads + n_kv_heads, rows, 1):
// threadgroups (g < n_heads, r) take query head g of row r, the others kv head j = g - n_heads
// (its k, and the copy of its v row) of row r, at position + r. Threads: head_dim rounded up to 32, at most ATTN_PREPARE_MAX_THREADS; thread tid owns
// elements tid, tid + threads, ... The sum of squares goes through threadgroup_sum (common.h), the
// elements through attn_normed_rope.
template <typename T, typename KV>
kernel void attn_prepare(constant AttnPrepareParams& p [[buffer(0)]], device const T* proj [[buffer(1)]],
                         device const T* q_norm_w [[buffer(2)]], device const T* k_norm_w [[buffer(3)]],
                         device T* q_out [[buffer(4)]], device KV* k_cache [[buffer(5)]],
                         device KV* v_cache [[buffer(6)]], device const int* pair_pos [[buffer(7)]],
                         uint2 tg [[threadgroup_position_in_grid]],
                         uint tid [[thread_index_in_threadgroup]], uint2 tpg [[threads_per_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]],
                         uint nsg [[simdgroups_per_threadgroup]]) {
    const uint nthreads = tpg.x;   // 1-D threadgroups (the grid attributes of a kernel share one width)
    threadgroup float partial[SIMD_WIDTH];
    const uint hd = p.head_dim, g = tg.x;
    const uint position = p.position + tg.y;
    proj += ulong(tg.y) * p.proj_stride;
    q_out += ulong(tg.y) * p.n_heads * hd;
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

    const ulong row = (ulong(j) * p.capacity + position) * hd;
    device const T* v_in = proj + p.q_rows + ulong(p.n_kv_heads) * hd + ulong(j) * hd;
    device T* q_row = q_out + ulong(g) * hd;             // the 64-bit row bases once, outside the loop
    device KV* k_row = k_cache + row;
    device KV* v_row = v_cache + row;
    device const int* pair_row = pair_pos + ulong(tg.y) * (p.rotary_dim / 2);   // read only with pair_positions
    for (uint d = tid; d < hd; d += nthreads) {
        const T yt = T(attn_normed_rope(p, x, w, d, inv, attn_rope_position(p, position, pair_row, d)));
        if (is_q) {
            q_row[d] = yt;
        } else {
            k_row[d] = KV(float(yt));
            v_row[d] = KV(float(v_in[d]));
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

// One SIMD-group's query head in registers: lane l holds elements l + 32 i, pre-scaled into the exp2
// domain (a struct so that both ways of filling it return it by value; indexed only in unrolled loops).
struct AttnLaneQ {
    float v[ATTN_LANE_ELEMS];
    bool active;   // the head exists (gi < group): SIMD-group-uniform
};

// The query head of SIMD-group sg in threadgroup (chunk, kv head j): head j * group + chunk * HP + sg % HP.
inline uint attn_head_of(constant AttnDecodeParams& p, uint chunk, uint j, uint sg, thread bool* active) {
    const uint gi = chunk * p.heads_per_tg + sg % p.heads_per_tg;   // index in the GQA group
    *active = gi < p.group;
    return j * p.group + (*active ? gi : 0u);
}

// q of a prepared token, read from q [n_heads, head_dim] (attn_prepare's output).
template <typename T>
inline AttnLaneQ attn_lane_q(constant AttnDecodeParams& p, device const T* q, uint chunk, uint j, uint lane, uint sg) {
    AttnLaneQ r;
    const uint h = attn_head_of(p, chunk, j, sg, &r.active);
    device const T* qh = q + ulong(h) * p.head_dim;
    for (uint i = 0; i < ATTN_LANE_ELEMS; ++i) {
        const uint d = lane + SIMD_WIDTH * i;
        r.v[i] = r.active && d < p.head_dim ? float(qh[d]) * p.scale : 0.0f;
    }
    return r;
}

// 1 / rms of a head's hd <= 32 * ATTN_LANE_ELEMS elements by one SIMD-group, summed in exactly
// attn_prepare's order: there, ceil(hd / 32) SIMD-groups of one element per thread each simd_sum their
// squares and threadgroup_sum adds those partials with a second simd_sum. Here partial w is the simd_sum of
// elements 32 w + lane, kept by lane w, then the same second simd_sum: bit for bit attn_prepare's value.
template <typename T>
inline float attn_head_inv_rms(device const T* x, uint hd, float eps, uint lane) {
    float part = 0.0f;
    for (uint i = 0; i < ATTN_LANE_ELEMS; ++i) {
        const uint d = lane + SIMD_WIDTH * i;
        const float v = d < hd ? float(x[d]) : 0.0f;
        const float sq = simd_sum(v * v);
        part = lane == i ? sq : part;
    }
    return rsqrt(simd_sum(lane < ATTN_LANE_ELEMS ? part : 0.0f) / float(hd) + eps);
}

// The fused prepare of attn_decode_*_prep: the token at r.position = n_keys - 1 is normalised and rotated
// here instead of by a separate attn_prepare dispatch (one dependency level fewer per attention layer).
// Every SIMD-group computes its own query head's q in registers (the key_split SIMD-groups of a head
// repeat it: a few hundred multiplies). The threadgroup whose keys include the token's (its partial holds
// the last block) also computes the kv head's new k and v rows into last_row [k | v] (float, as a tile
// holds them: float(KV(T(k)))), which its tile load uses in place of the cache row; head chunk 0 of that
// partial writes them to the cache for the next tokens. No threadgroup reads that cache row in this
// dispatch, so the write needs no fence. The arithmetic is attn_prepare's (attn_normed_rope, and
// attn_head_inv_rms's summation order): q, k and v are bit for bit what attn_prepare writes.
template <typename T, typename KV>
inline void attn_prep_token(constant AttnDecodeParams& p, constant AttnPrepareParams& r, device const T* proj,
                            device const T* q_norm_w, device const T* k_norm_w, device KV* k_cache,
                            device KV* v_cache, uint part, uint chunk, uint j, uint lane, uint sg,
                            threadgroup float* last_row, thread AttnLaneQ* q) {
    const uint hd = p.head_dim;
    const bool owner = ((p.n_keys - 1) / p.block) % p.n_partials == part;
    if (owner && sg == 0) {
        device const T* x = proj + r.q_rows + j * hd;   // 32-bit: n_heads * q_stride + 2 n_kv_heads hd < 2^32
        device const T* v_in = proj + r.q_rows + r.n_kv_heads * hd + j * hd;
        const float inv = attn_head_inv_rms(x, hd, r.eps, lane);
        const ulong row = (ulong(j) * r.capacity + r.position) * hd;   // 64-bit once, outside the loop
        device KV* k_row = k_cache + row;
        device KV* v_row = v_cache + row;
        for (uint i = 0; i < ATTN_LANE_ELEMS; ++i) {
            const uint d = lane + SIMD_WIDTH * i;
            if (d < hd) {
                const KV kk = KV(float(T(attn_normed_rope(r, x, k_norm_w, d, inv, attn_row_rope_position(r, r.position)))));
                const KV vv = KV(float(v_in[d]));
                last_row[d] = float(kk);
                last_row[hd + d] = float(vv);
                if (chunk == 0) {
                    k_row[d] = kk;
                    v_row[d] = vv;
                }
            }
        }
    }
    const uint h = attn_head_of(p, chunk, j, sg, &q->active);
    if (q->active) {
        device const T* x = proj + h * r.q_stride;     // 32-bit: the host checks n_heads * q_stride
        const float inv = attn_head_inv_rms(x, hd, r.eps, lane);
        for (uint i = 0; i < ATTN_LANE_ELEMS; ++i) {
            const uint d = lane + SIMD_WIDTH * i;
            q->v[i] = d < hd ? float(T(attn_normed_rope(r, x, q_norm_w, d, inv, attn_row_rope_position(r, r.position)))) * p.scale
                             : 0.0f;
        }
    } else {
        for (uint i = 0; i < ATTN_LANE_ELEMS; ++i) {
            q->v[i] = 0.0f;
        }
    }
    if (owner) {
        threadgroup_barrier(mem_flags::mem_threadgroup);   // last_row is complete before any tile load
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
// part + n_partials, ... of `block` keys each. Keys from dev_keys on (only the last one, and only in the
// fused prepare's owner) come from last_row instead of the cache.
//
// On return each SIMD-group's accumulator is in kt[sg * head_dim ..] and its running (max, sum)
// in ml[2 sg], ml[2 sg + 1], visible to the whole threadgroup (attn_merge combines them).
template <typename KV>
inline void attn_partial_pass(constant AttnDecodeParams& p, AttnLaneQ q, device const KV* k_cache,
                              device const KV* v_cache, uint dev_keys, threadgroup const float* last_row, uint part,
                              uint j, uint tid, uint nthreads, uint lane, uint sg, threadgroup float* kt,
                              threadgroup float* vt, threadgroup float* ml) {
    const uint hd = p.head_dim, HP = p.heads_per_tg, KS = p.key_split;
    const uint ks = sg / HP;
    const bool active = q.active;

    float acc[ATTN_LANE_ELEMS];
    for (uint i = 0; i < ATTN_LANE_ELEMS; ++i) {
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
            // t0 * hd < capacity * head_dim < 2^32 (the host checks): 32-bit within the head
            const uint nd = min(nt, dev_keys - min(dev_keys, t0));   // rows of this tile in device memory
            attn_load_tile(k_cache, v_cache, head_base + t0 * hd, nd * hd, vec4, kt, vt, tid, nthreads);
            if (nd < nt) {   // the fused prepare's own key (the last one): k | v from threadgroup memory
                for (uint e = tid; e < hd; e += nthreads) {
                    kt[nd * hd + e] = last_row[e];
                    vt[nd * hd + e] = last_row[hd + e];
                }
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
            if (active) {
                for (uint t = ks; t < nt; t += KS) {
                    threadgroup const float* kr = kt + t * hd;
                    threadgroup const float* vr = vt + t * hd;
                    float s = 0.0f;
                    for (uint i = 0; i < ATTN_LANE_ELEMS; ++i) {
                        const uint d = lane + SIMD_WIDTH * i;
                        if (d < hd) {
                            s += q.v[i] * kr[d];
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

// The single pass's store: the key_split results of every head of the chunk merged, normalised and
// multiplied by sigmoid(gate).
template <typename T>
inline void attn_single_store(constant AttnDecodeParams& p, device const T* proj, device T* o, uint chunk, uint j,
                              uint tid, uint nthreads, threadgroup const float* kt, threadgroup const float* ml) {
    const uint hd = p.head_dim, HP = p.heads_per_tg;
    for (uint e = tid; e < HP * hd; e += nthreads) {
        const uint eh = e / hd, d = e - eh * hd;
        const uint gi = chunk * HP + eh;
        if (gi < p.group) {
            float M, L;
            const float a = attn_merge(kt, ml, HP, p.key_split, hd, eh, d, &M, &L);
            // head h's rows at 32-bit offsets (n_heads * head_dim and n_heads * q_stride < 2^32: the host checks)
            const uint h = j * p.group + gi;
            o[h * hd + d] = attn_gated(a / L, proj + h * p.q_stride + hd, d, p.output_gate);
        }
    }
}

// Pass 1's store: the merged, unnormalised accumulator and (max, sum) of every head of the chunk to its
// slot of scratch: acc f32 [n_heads, n_partials, head_dim], then ml f32 [n_heads, n_partials, 2].
inline void attn_partial_store(constant AttnDecodeParams& p, device float* scratch, uint part, uint chunk, uint j,
                               uint tid, uint nthreads, threadgroup const float* kt, threadgroup const float* ml) {
    const uint hd = p.head_dim, HP = p.heads_per_tg;
    device float* mls = scratch + ulong(p.n_heads) * p.n_partials * hd;
    for (uint e = tid; e < HP * hd; e += nthreads) {
        const uint eh = e / hd, d = e - eh * hd;
        const uint gi = chunk * HP + eh;
        if (gi < p.group) {
            float M, L;
            const float a = attn_merge(kt, ml, HP, p.key_split, hd, eh, d, &M, &L);
            // the scratch's slots at 32-bit offsets (n_heads * n_partials * head_dim < 2^32: the host checks)
            const uint slot = (j * p.group + gi) * p.n_partials + part;
            scratch[slot * hd + d] = a;
            if (d == 0) {
                mls[2 * slot] = M;
                mls[2 * slot + 1] = L;
            }
        }
    }
}

// attn_decode_single: the whole attention of a token in one pass (short contexts): one partial
// covering all keys (the host sets n_partials = n_blocks = 1), merged, normalised and multiplied
// by sigmoid(gate) on store. Grid (1, head chunks, n_kv_heads).
template <typename T, typename KV>
[[kernel, max_total_threads_per_threadgroup(SIMD_WIDTH * ATTN_MAX_SIMDGROUPS)]]
void attn_decode_single(constant AttnDecodeParams& p [[buffer(0)]], device const T* q [[buffer(1)]],
                        device const T* proj [[buffer(2)]], device const KV* k_cache [[buffer(3)]],
                        device const KV* v_cache [[buffer(4)]], device T* o [[buffer(5)]],
                        uint3 tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                        uint3 tpg [[threads_per_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                        uint sg [[simdgroup_index_in_threadgroup]]) {
    const uint nthreads = tpg.x;   // 1-D threadgroups (the grid attributes of a kernel share one width)
    threadgroup float kt[ATTN_TILE_FLOATS];
    threadgroup float vt[ATTN_TILE_FLOATS];
    threadgroup float ml[2 * ATTN_MAX_SIMDGROUPS];
    const AttnLaneQ qr = attn_lane_q(p, q, tg.y, tg.z, lane, sg);
    attn_partial_pass(p, qr, k_cache, v_cache, p.n_keys, kt, tg.x, tg.z, tid, nthreads, lane, sg, kt, vt, ml);
    attn_single_store(p, proj, o, tg.y, tg.z, tid, nthreads, kt, ml);
}

// attn_decode_partial: pass 1 of the split-K route (one block of `block` keys per partial) and of
// the two-pass route (at most ATTN_LONG_MAX_PARTIALS partials, each looping over every
// n_partials-th block of long_block keys, so scratch is bounded whatever the context). Stores
// the merged, unnormalised accumulator and (max, sum) of each head to scratch (attn_partial_store).
// Grid (n_partials, head chunks, n_kv_heads).
template <typename T, typename KV>
[[kernel, max_total_threads_per_threadgroup(SIMD_WIDTH * ATTN_MAX_SIMDGROUPS)]]
void attn_decode_partial(constant AttnDecodeParams& p [[buffer(0)]], device const T* q [[buffer(1)]],
                         device const KV* k_cache [[buffer(2)]], device const KV* v_cache [[buffer(3)]],
                         device float* scratch [[buffer(4)]], uint3 tg [[threadgroup_position_in_grid]],
                         uint tid [[thread_index_in_threadgroup]], uint3 tpg [[threads_per_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]]) {
    const uint nthreads = tpg.x;   // 1-D threadgroups (the grid attributes of a kernel share one width)
    threadgroup float kt[ATTN_TILE_FLOATS];
    threadgroup float vt[ATTN_TILE_FLOATS];
    threadgroup float ml[2 * ATTN_MAX_SIMDGROUPS];
    const AttnLaneQ qr = attn_lane_q(p, q, tg.y, tg.z, lane, sg);
    attn_partial_pass(p, qr, k_cache, v_cache, p.n_keys, kt, tg.x, tg.z, tid, nthreads, lane, sg, kt, vt, ml);
    attn_partial_store(p, scratch, tg.x, tg.y, tg.z, tid, nthreads, kt, ml);
}

// attn_decode_single_prep / attn_decode_partial_prep: attn_decode_single / attn_decode_partial of the
// token at r.position = n_keys - 1 with attn_prepare fused in (attn_prep_token): they read the token's
// stacked projection instead of q and write its K/V cache row themselves. Bit for bit attn_prepare
// followed by the unfused kernel. The decode graph's route: one dependency level fewer per attention layer.
template <typename T, typename KV>
[[kernel, max_total_threads_per_threadgroup(SIMD_WIDTH * ATTN_MAX_SIMDGROUPS)]]
void attn_decode_single_prep(constant AttnDecodeParams& p [[buffer(0)]], constant AttnPrepareParams& r [[buffer(1)]],
                             device const T* proj [[buffer(2)]], device const T* q_norm_w [[buffer(3)]],
                             device const T* k_norm_w [[buffer(4)]], device KV* k_cache [[buffer(5)]],
                             device KV* v_cache [[buffer(6)]], device T* o [[buffer(7)]],
                             uint3 tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                             uint3 tpg [[threads_per_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                             uint sg [[simdgroup_index_in_threadgroup]]) {
    const uint nthreads = tpg.x;   // 1-D threadgroups (the grid attributes of a kernel share one width)
    threadgroup float kt[ATTN_TILE_FLOATS];
    threadgroup float vt[ATTN_TILE_FLOATS];
    threadgroup float ml[2 * ATTN_MAX_SIMDGROUPS];
    threadgroup float last_row[2 * ATTN_MAX_HEAD_DIM];
    AttnLaneQ qr;
    attn_prep_token(p, r, proj, q_norm_w, k_norm_w, k_cache, v_cache, tg.x, tg.y, tg.z, lane, sg, last_row, &qr);
    attn_partial_pass<KV>(p, qr, k_cache, v_cache, p.n_keys - 1, last_row, tg.x, tg.z, tid, nthreads, lane, sg, kt, vt,
                      ml);
    attn_single_store(p, proj, o, tg.y, tg.z, tid, nthreads, kt, ml);
}

template <typename T, typename KV>
[[kernel, max_total_threads_per_threadgroup(SIMD_WIDTH * ATTN_MAX_SIMDGROUPS)]]
void attn_decode_partial_prep(constant AttnDecodeParams& p [[buffer(0)]], constant AttnPrepareParams& r [[buffer(1)]],
                              device const T* proj [[buffer(2)]], device const T* q_norm_w [[buffer(3)]],
                              device const T* k_norm_w [[buffer(4)]], device KV* k_cache [[buffer(5)]],
                              device KV* v_cache [[buffer(6)]], device float* scratch [[buffer(7)]],
                              uint3 tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                              uint3 tpg [[threads_per_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                              uint sg [[simdgroup_index_in_threadgroup]]) {
    const uint nthreads = tpg.x;   // 1-D threadgroups (the grid attributes of a kernel share one width)
    threadgroup float kt[ATTN_TILE_FLOATS];
    threadgroup float vt[ATTN_TILE_FLOATS];
    threadgroup float ml[2 * ATTN_MAX_SIMDGROUPS];
    threadgroup float last_row[2 * ATTN_MAX_HEAD_DIM];
    AttnLaneQ qr;
    attn_prep_token(p, r, proj, q_norm_w, k_norm_w, k_cache, v_cache, tg.x, tg.y, tg.z, lane, sg, last_row, &qr);
    attn_partial_pass<KV>(p, qr, k_cache, v_cache, p.n_keys - 1, last_row, tg.x, tg.z, tid, nthreads, lane, sg, kt, vt,
                      ml);
    attn_partial_store(p, scratch, tg.x, tg.y, tg.z, tid, nthreads, kt, ml);
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
            a += acc[k * hd + d] * wk;   // P * head_dim < 2^32
        }
        o[h * hd + d] = attn_gated(a / L, proj + h * p.q_stride + hd, d, p.output_gate);
    }
}

// attn_prefill: causal flash attention of a prefill chunk, with the output gate fused.
// o[r, h] = gate(softmax_t(q[r, h] . K[j, t] / sqrt(hd)) V[j, t]) over keys t <= p0 + r
// (j = h / group): the keys of earlier chunks (0 .. p0-1, already in the cache) and the causal
// part of this chunk (written by attn_prepare with rows).
//
// Two other masks (AttnPrefillParams): causal 0, every row over every key 0 .. p0 + rows - 1 (a DFlash draft's
// block attends to its context and to the whole block); a window w > 0 (with causal: a sliding layer), only
// keys t > p0 + r - w. Non-causal, every threadgroup reads every key; a window, the threadgroup starts at the
// tile holding its first row's first visible key. A row whose first sub-steps are wholly masked (below its
// window) keeps m at ATTN_NEG_INIT and accumulates exp2(0) = 1 terms there, but its own key (t = p0 + r) is
// always visible, and the first visible score multiplies that finite garbage by exp2(ATTN_NEG_INIT - m) = 0:
// the result is exactly that of skipping the masked keys.
//
// Why this shape: GQA sharing and tensor-core-style arithmetic. A threadgroup serves block_rows
// query rows for heads_per_tg query heads of kv head j (the whole group when it has at most 16
// heads), so every K/V tile is read from device memory once per (query block, head chunk, kv head)
// instead of once per query head (8x fewer K/V bytes on the real model, G = 8). The products run on
// 8x8 simdgroup matrices with float accumulation: S = Q K^T for 8 query rows x 8 keys, O += P V.
//
// Instantiations: D = 64, 128, 256 is the largest head_dim served (the host takes the smallest
// D >= head_dim); every loop over the hd / 8 column chunks runs to the compile-time D / 8 and skips
// the chunks past head_dim with a uniform branch, so the O fragment array is indexed only by
// unrolled constants and stays in registers. KB = ATTN_PREFILL_TILE_KEYS(D, sizeof(KV)) keys per
// tile: 16, or 8 for a float cache at D = 256 (16 rows would not fit next to V).
//
// Thread mapping: grid (ceil(M / block_rows), head chunks, n_kv_heads); heads_per_tg * block_rows / 8
// SIMD-groups (<= 16, 512 threads; the real model: 8 heads x 16 rows). SIMD-group sg takes query
// head gi = chunk * heads_per_tg + sg % heads_per_tg of the group (idle when gi >= group) and the 8
// query rows r0 = q0 + 8 (sg / heads_per_tg) .. r0 + 7. Fragment layout (the simdgroup_matrix lane layout MLX's steel kernels
// use): lane l holds row fr = 4 b4 + 2 b2 + b1 and columns fc = 4 b3 + 2 b0, fc + 1 of each 8x8
// fragment (b_i the bits of l), so the 4 lanes of a row differ in bits 0 and 3 (simd_shuffle_xor 1
// and 8). O: hd / 8 fragments of float accumulators in registers. Q: not held; each SIMD-group reads
// its hd / 8 Q fragments from device memory once per tile (a cache hit after the first): Q and O in
// registers would be D / 2 floats per lane (128 at D = 256, the most a thread can have), and the Q of
// 8 heads x 16 rows does not fit threadgroup memory next to the tiles (docs/metal.md). Per tile of
// KB keys: all threads copy the K and V rows of kv head j into threadgroup memory in the cache's type (rows padded by
// 16 bytes; keys past the end zeroed), barrier, each SIMD-group consumes the tile, barrier: one
// barrier per 8 keys at KB = 16. A SIMD-group's step over a tile: S_k = sum_c Q_c K_{k,c}^T per
// 8-key sub-step k (K^T fragments read element-wise from the tile, converted to float), the scale
// log2(e)/sqrt(hd) (the softmax runs in exp2), the causal mask (key <= the row's position), the
// row max and sum over the lane's 2 KB / 8 scores and the row's 4 lanes, the online-softmax update in the exp2 domain once per tile, P written over S in
// place, every O fragment's two elements scaled by the row's correction in place (no extra MMA),
// then O_c += P_k V_{k,c}. At the end lane l divides its elements by the row sum, applies the gate
// and stores them: no staging through threadgroup memory anywhere.
//
// Causal skipping: the threadgroup loads only keys < p0 + q0 + block_rows (tiles wholly above the
// diagonal of its last row are never read) and a SIMD-group skips every 8-key sub-step above the
// diagonal of its own last row; only the sub-steps crossing the diagonal are masked. Key 0 is
// visible to every row, so the first tile leaves a finite running max (exp2 of a masked score is
// then 0, and a wholly masked sub-step is an exact no-op: the result of a row does not depend on
// which rows share its threadgroup). Rows >= M compute on row M - 1's q and are not stored.
//
// Threadgroup memory: the K and V tiles, KB x (D + 16 B) each in the cache's type: 16.5 KB at
// D = 256 with a bf16 cache (KB 16) or a float one (KB 8), 16.5 KB at D = 128 float. Registers per
// lane: O, D / 4 floats (64 at D = 256), the 2 KB / 8 scores and one Q, K or V fragment (2 each).
template <typename T, typename KV, uint D>
[[kernel, max_total_threads_per_threadgroup(SIMD_WIDTH * ATTN_PREFILL_MAX_SIMDGROUPS)]]
void attn_prefill(constant AttnPrefillParams& p [[buffer(0)]], device const T* q [[buffer(1)]],
                  device const T* proj [[buffer(2)]], device const KV* k_cache [[buffer(3)]],
                  device const KV* v_cache [[buffer(4)]], device T* o [[buffer(5)]],
                  uint3 tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                  uint3 tpg [[threads_per_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                  uint sg [[simdgroup_index_in_threadgroup]]) {
    constexpr uint NC = D / ATTN_MMA;                                   // column chunks of the widest head
    constexpr uint KB = ATTN_PREFILL_TILE_KEYS(D, sizeof(KV));          // keys per tile
    constexpr uint NS = KB / ATTN_MMA;                                  // 8-key sub-steps per tile
    constexpr uint DP = D + ATTN_PREFILL_PAD_BYTES / sizeof(KV);        // padded tile row, elements
    const uint nthreads = tpg.x;   // 1-D threadgroups (the grid attributes of a kernel share one width)
    threadgroup KV kt[KB * DP];
    threadgroup KV vt[KB * DP];

    const uint hd = p.head_dim, nc = hd / ATTN_MMA, j = tg.z, HP = p.heads_per_tg;
    const uint gi = tg.y * HP + sg % HP;                  // the SIMD-group's head within the group
    const uint h = j * p.group + min(gi, p.group - 1);   // (gi >= group: an idle SIMD-group)
    const uint q0 = tg.x * p.block_rows;                  // first query row of the threadgroup
    const uint r0 = q0 + (sg / HP) * ATTN_MMA;            // first query row of the SIMD-group
    const uint n_keys = p.p0 + p.rows;
    // keys the threadgroup reads: [kbeg, kend) (causal: up to its last row; a window: from the tile holding its
    // first row's first visible key)
    const uint kend = p.causal ? min(p.p0 + q0 + p.block_rows, n_keys) : n_keys;
    const uint lo0 = p.window && p.p0 + q0 + 1u > p.window ? p.p0 + q0 + 1u - p.window : 0u;
    const uint kbeg = lo0 / KB * KB;
    const bool active = r0 < p.rows && gi < p.group;                 // SIMD-group-uniform
    // keys this SIMD-group sees
    const uint last = active ? (p.causal ? min(p.p0 + r0 + ATTN_MMA, n_keys) : n_keys) : 0u;
    const uint fr = 4 * ((lane >> 4) & 1) + 2 * ((lane >> 2) & 1) + ((lane >> 1) & 1);   // fragment row
    const uint fc = 4 * ((lane >> 3) & 1) + 2 * (lane & 1);                             // and columns
    const uint row = r0 + fr;                             // the lane's query row
    const bool row_ok = row < p.rows && active;
    const uint qpos = p.p0 + row;                         // its position
    const uint hi = p.causal ? qpos : n_keys - 1u;        // its visible keys: lo .. hi
    const uint lo = p.window && qpos + 1u > p.window ? qpos + 1u - p.window : 0u;
    const ulong q_row = ulong(row) * p.n_heads * hd + ulong(h) * hd;

    // rows >= M (the last block's padding) read row M - 1: finite, never stored
    device const T* qr = q + ulong(min(row, p.rows - 1)) * p.n_heads * hd + ulong(h) * hd + fc;
    simdgroup_float8x8 om[NC];
    for (uint c = 0; c < NC; ++c) {
        om[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }

    float m = ATTN_NEG_INIT, l = 0.0f;                    // running max and sum of the lane's row
    const ulong head_base = ulong(j) * p.capacity * hd;
    const uint hd4 = hd / 4;                              // 4-vectors per row (hd is a multiple of 8)
    for (uint t0 = kbeg; t0 < kend; t0 += KB) {
        const uint nt = min(KB, kend - t0);
        if (t0 > kbeg) {
            threadgroup_barrier(mem_flags::mem_threadgroup);  // everyone is done with the last tile
        }
        // t0 * hd < capacity * head_dim < 2^32 (the host checks): 32-bit within the head
        device const vec<KV, 4>* k4 = (device const vec<KV, 4>*)(k_cache + head_base + t0 * hd);
        device const vec<KV, 4>* v4 = (device const vec<KV, 4>*)(v_cache + head_base + t0 * hd);
        for (uint e = tid; e < KB * hd4; e += nthreads) {
            const uint key = e / hd4, d = 4 * (e - key * hd4);
            const bool in = key < nt;
            const float4 a = in ? float4(k4[e]) : float4(0.0f);
            const float4 b = in ? float4(v4[e]) : float4(0.0f);
            for (uint i = 0; i < 4; ++i) {
                kt[key * DP + d + i] = KV(a[i]);
                vt[key * DP + d + i] = KV(b[i]);
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (active && t0 < last) {
            simdgroup_float8x8 sm[NS];
            for (uint k = 0; k < NS; ++k) {
                sm[k] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            }
            for (uint c = 0; c < NC; ++c) {
                if (c < nc) {
                    // Q fragment from device memory (a cache hit after the first tile), once per tile: the
                    // lane's row, columns fc, fc + 1 of chunk c
                    simdgroup_float8x8 qf;
                    qf.thread_elements()[0] = float(qr[c * ATTN_MMA]);
                    qf.thread_elements()[1] = float(qr[c * ATTN_MMA + 1]);
                    for (uint k = 0; k < NS; ++k) {
                        if (t0 + k * ATTN_MMA < last) {       // SIMD-group-uniform
                            // K^T fragment: element (d, key) = K[key][d], the lane's (fr, fc), (fr, fc + 1)
                            simdgroup_float8x8 km;
                            const uint kb = (k * ATTN_MMA + fc) * DP + c * ATTN_MMA + fr;
                            km.thread_elements()[0] = float(kt[kb]);
                            km.thread_elements()[1] = float(kt[kb + DP]);
                            simdgroup_multiply_accumulate(sm[k], qf, km, sm[k]);
                        }
                    }
                }
            }
            float mx = ATTN_NEG_INIT;
            for (uint k = 0; k < NS; ++k) {
                // sub-steps past the SIMD-group's last key stay 0 and are masked for every row
                const uint key = t0 + k * ATTN_MMA + fc;
                const float sa = key <= hi && key >= lo ? sm[k].thread_elements()[0] * p.scale : ATTN_NEG_INIT;
                const float sb = key + 1 <= hi && key + 1 >= lo ? sm[k].thread_elements()[1] * p.scale
                                                                 : ATTN_NEG_INIT;
                sm[k].thread_elements()[0] = sa;
                sm[k].thread_elements()[1] = sb;
                mx = max(mx, max(sa, sb));
            }
            mx = max(mx, simd_shuffle_xor(mx, 1));
            mx = max(mx, simd_shuffle_xor(mx, 8));
            const float m_new = max(m, mx);
            const float corr = exp2(m - m_new);
            float ps = 0.0f;
            for (uint k = 0; k < NS; ++k) {
                const float pa = exp2(sm[k].thread_elements()[0] - m_new);
                const float pb = exp2(sm[k].thread_elements()[1] - m_new);
                sm[k].thread_elements()[0] = pa;
                sm[k].thread_elements()[1] = pb;
                ps += pa + pb;
            }
            ps += simd_shuffle_xor(ps, 1);
            ps += simd_shuffle_xor(ps, 8);
            l = l * corr + ps;
            m = m_new;
            for (uint c = 0; c < NC; ++c) {
                if (c < nc) {
                    om[c].thread_elements() *= corr;
                    for (uint k = 0; k < NS; ++k) {
                        if (t0 + k * ATTN_MMA < last) {       // SIMD-group-uniform
                            // V fragment: element (key, d) = V[key][d], the lane's (fr, fc), (fr, fc + 1)
                            simdgroup_float8x8 vm;
                            const uint vb = (k * ATTN_MMA + fr) * DP + c * ATTN_MMA + fc;
                            vm.thread_elements()[0] = float(vt[vb]);
                            vm.thread_elements()[1] = float(vt[vb + 1]);
                            simdgroup_multiply_accumulate(om[c], sm[k], vm, om[c]);
                        }
                    }
                }
            }
        }
    }

    if (row_ok) {
        device const T* gate = proj + ulong(row) * p.proj_stride + ulong(h) * p.q_stride + hd;
        for (uint c = 0; c < NC; ++c) {
            if (c < nc) {
                for (uint e = 0; e < 2; ++e) {
                    const uint d = c * ATTN_MMA + fc + e;
                    o[q_row + d] = attn_gated(om[c].thread_elements()[e] / l, gate, d, p.output_gate);
                }
            }
        }
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
INSTANTIATE_KERNEL("attn_decode_single_prep_f32_kvf32", attn_decode_single_prep, float, float)
INSTANTIATE_KERNEL("attn_decode_single_prep_f32_kvbf16", attn_decode_single_prep, float, bfloat)
INSTANTIATE_KERNEL("attn_decode_single_prep_bf16_kvf32", attn_decode_single_prep, bfloat, float)
INSTANTIATE_KERNEL("attn_decode_single_prep_bf16_kvbf16", attn_decode_single_prep, bfloat, bfloat)
INSTANTIATE_KERNEL("attn_decode_partial_prep_f32_kvf32", attn_decode_partial_prep, float, float)
INSTANTIATE_KERNEL("attn_decode_partial_prep_f32_kvbf16", attn_decode_partial_prep, float, bfloat)
INSTANTIATE_KERNEL("attn_decode_partial_prep_bf16_kvf32", attn_decode_partial_prep, bfloat, float)
INSTANTIATE_KERNEL("attn_decode_partial_prep_bf16_kvbf16", attn_decode_partial_prep, bfloat, bfloat)
INSTANTIATE_KERNEL("attn_decode_combine_f32", attn_decode_combine, float)
INSTANTIATE_KERNEL("attn_decode_combine_bf16", attn_decode_combine, bfloat)
INSTANTIATE_KERNEL("attn_prefill_d64_f32_kvf32", attn_prefill, float, float, 64u)
INSTANTIATE_KERNEL("attn_prefill_d64_f32_kvbf16", attn_prefill, float, bfloat, 64u)
INSTANTIATE_KERNEL("attn_prefill_d64_bf16_kvf32", attn_prefill, bfloat, float, 64u)
INSTANTIATE_KERNEL("attn_prefill_d64_bf16_kvbf16", attn_prefill, bfloat, bfloat, 64u)
INSTANTIATE_KERNEL("attn_prefill_d128_f32_kvf32", attn_prefill, float, float, 128u)
INSTANTIATE_KERNEL("attn_prefill_d128_f32_kvbf16", attn_prefill, float, bfloat, 128u)
INSTANTIATE_KERNEL("attn_prefill_d128_bf16_kvf32", attn_prefill, bfloat, float, 128u)
INSTANTIATE_KERNEL("attn_prefill_d128_bf16_kvbf16", attn_prefill, bfloat, bfloat, 128u)
INSTANTIATE_KERNEL("attn_prefill_d256_f32_kvf32", attn_prefill, float, float, 256u)
INSTANTIATE_KERNEL("attn_prefill_d256_f32_kvbf16", attn_prefill, float, bfloat, 256u)
INSTANTIATE_KERNEL("attn_prefill_d256_bf16_kvf32", attn_prefill, bfloat, float, 256u)
INSTANTIATE_KERNEL("attn_prefill_d256_bf16_kvbf16", attn_prefill, bfloat, bfloat, 256u)

// Gated DeltaNet: the causal conv and the recurrence, for one decode token or a prefill chunk of M tokens.
//
//   gdn_conv_{f32,bf16}:  act[m, c] = silu(sum_j conv_w[c, j] * win[m + j][c]),  win = (conv_state rows, oldest
//                         first, then the M qkv rows); conv_out <- the last K-1 rows of win
//   gdn_step_{f32,bf16}_dk{32,64,128,256}:  (dk up to 32 ... 256: 1 ... 8 state elements per lane)
//                         M tokens in order, per value head h (key head kh = h / (nv / nk)):
//                         q = l2norm(q_kh) * dk^-1/2, k = l2norm(k_kh), beta = sigmoid(b[h]),
//                         decay = exp(-exp(A_log[h]) * softplus(a[h] + dt_bias[h]));
//                         S = decay S; kv = S k; S += (beta (v - kv)) k^T; o = S q   (S[h] is [dv, dk]);
//                         y = o * rsqrt(mean(o^2) + eps) * norm_w * silu(z)
//                         (the decode step: M = 1; the prefill's scan route: M = the chunk)
//   gdn_conv_rows_{f32,bf16}, gdn_step_rows_{f32,bf16}_dk{32..256}: a verification's rows chained through one
//                         state, each kernel one dispatch for all rows, writing the state after EVERY row into
//                         that row's slot of a ring (GdnRing); row r bit for bit a one-token gdn_conv / gdn_step
//   the prefill's chunked route, three kernels over the same math (docs/model.md §6, WY/UT form):
//   gdn_prep_{f32,bf16}:  normalised q, k (float [M, nk, dk]) and beta, g_log (float [M, nv]) into scratch
//   gdn_chunk_{f32,bf16}: the recurrence over blocks of C tokens on simdgroup_matrix: o (float [M, nv dv])
//   gdn_norm_{f32,bf16}:  the gated RMSNorm of o into y
// Everything is computed in float (the conv and recurrent states are float); activations are read as T and
// the outputs rounded to T once on store. The math and its order follow python/qwenmetal/reference.py
// (causal_conv1d, silu, l2norm, sigmoid, softplus, gdn_recurrent / gdn_chunked, gated_rms_norm). The
// normalisation, gates and gated norm are the inline functions below, shared by both routes.
//
// Simulator-verified, hardware-unverified.
#include "common.h"
#include "gdn.h"
#include "gdn_conv.h"

// log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|)); MSL has no log1p, so log1p(e) is computed as
// log(u) * e / (u - 1) with u = 1 + e (exact to a few ulps also where e is below float epsilon, where the
// plain log(1 + e) would return 0: softplus of a very negative argument stays exp(x), not 0).
inline float gdn_softplus(float x) {
    const float e = exp(-fabs(x));
    const float u = 1.0f + e;
    const float l1p = u == 1.0f ? e : log(u) * e / (u - 1.0f);
    return max(x, 0.0f) + l1p;
}

// beta = sigmoid(b), rounded as the bf16 graph
template <typename T>
inline float gdn_beta(T b) {
    return rnd<T>(gdn_sigmoid(float(b)));
}

// g = log decay = -exp(A_log) softplus(a + dt_bias) <= 0, float from the T-rounded a (HF's precision)
inline float gdn_log_decay(float a, float A_log, float dt_bias) {
    return -exp(A_log) * gdn_softplus(a + dt_bias);
}

// q and k of one key head, lane-strided (lane l holds elements l, l + 32, ... l + 32 (DPL - 1); zeros past dk;
// 32 DPL >= dk), loaded and normalised in float by one SIMD-group (two simd_sums): q = l2norm(q) q_scale,
// k = l2norm(k). The zeros add nothing to the sums, so every DPL >= dk / 32 gives the same bits.
template <typename T, uint DPL>
inline void gdn_qk_normalize(device const T* qh, device const T* kh, uint dk, float q_scale, float l2_eps,
                             uint lane, thread float* qv, thread float* kv) {
    float qss = 0.0f, kss = 0.0f;
    for (uint j = 0; j < DPL; ++j) {
        const uint i = lane + j * SIMD_WIDTH;
        const bool in = i < dk;
        qv[j] = in ? float(qh[i]) : 0.0f;
        kv[j] = in ? float(kh[i]) : 0.0f;
        qss += qv[j] * qv[j];
        kss += kv[j] * kv[j];
    }
    const float qsum = simd_sum(qss), ksum = simd_sum(kss);
    if (sizeof(T) == 2) {
        // the bf16 graph (MLX normalize_qk): n = T(x rsqrt(mean(x^2) + eps / dk)) = T(sqrt(dk) l2norm(x)),
        // then q = T(n T(1/dk)), k = T(n T(dk^-1/2)) (MLX casts the Python float factors to bf16)
        const float fdk = float(dk);
        const float qn = rsqrt(qsum / fdk + l2_eps / fdk), kn = rsqrt(ksum / fdk + l2_eps / fdk);
        const float qf = rnd<T>(1.0f / fdk), kf = rnd<T>(q_scale);
        for (uint j = 0; j < DPL; ++j) {
            qv[j] = rnd<T>(rnd<T>(qv[j] * qn) * qf);
            kv[j] = rnd<T>(rnd<T>(kv[j] * kn) * kf);
        }
    } else {
        const float qinv = rsqrt(qsum + l2_eps);
        const float kinv = rsqrt(ksum + l2_eps);
        for (uint j = 0; j < DPL; ++j) {
            qv[j] = qv[j] * qinv * q_scale;
            kv[j] = kv[j] * kinv;
        }
    }
}

// one element of the gated RMSNorm: o (already rounded to T) times inv = rsqrt(mean(o^2) + eps), the gain and
// silu(z). bf16 graph: n = T(w T(o inv)), y = T(n silu_f32(z)); float: o inv w silu(z)
template <typename T>
inline T gdn_gated_out(float o, float inv, float w, float z) {
    return T(rnd<T>(w * rnd<T>(o * inv)) * (z * gdn_sigmoid(z)));
}

// Causal depthwise conv over M rows fused with SiLU and the conv-state update.
//
// Why fused: the conv of one token is K multiply-adds per channel; the state update and the SiLU touch the
// same channel's values, so one pass reads qkv, the state and the taps once and writes act and the state
// once (Lily's conv1d_step_bf16 / conv1d_prefill_bf16 do the same).
//
// Thread mapping: one thread per (channel, block of p.block rows): GDN_CONV_THREADS threads per threadgroup
// along the channels, grid (ceil(C / GDN_CONV_THREADS), ceil(rows / p.block)) (threads past C return; there is
// no SIMD-group function or barrier). A thread computes rows m0 .. m0 + block - 1 of its channel: row m's output
// reads window rows m..m+K-1 (window row i < K-1 is state row i, later ones qkv row i - (K-1), `stride` elements
// apart; the row pointers advance by additions, no 64-bit multiply in the loops). Tap j of channel c is
// conv_w[c * K + j] (the canonical [conv_dim, K] layout). Since block >= K - 1 (host-checked), only row block 0
// reads the state, so row block 0 also writes the new state after its outputs: window rows M..M+K-2 go to
// conv_out rows 0..K-2, which may be conv_state itself (row r reads window row M + r > r, not yet overwritten,
// and no other thread reads that channel's state) or the other half of a ping-pong pair (the graph's: a
// discarded step leaves the state intact). Consecutive threads read consecutive channels of each row
// (coalesced). Every output is the same sum in the same order as with one thread per channel: the row blocks
// change only which thread computes it.
template <typename T>
kernel void gdn_conv(constant GdnConvParams& p [[buffer(0)]], device const T* qkv [[buffer(1)]],
                     device const float* conv_w [[buffer(2)]], device const float* conv_state [[buffer(3)]],
                     device float* conv_out [[buffer(4)]], device T* act [[buffer(5)]],
                     uint2 pos [[thread_position_in_grid]]) {
    const uint c = pos.x;
    if (c >= p.C) {
        return;
    }
    const uint S = p.K - 1u, C = p.C, stride = p.stride;
    const uint m0 = pos.y * p.block, m1 = min(p.rows, m0 + p.block);
    device const float* w = conv_w + c * p.K;   // C K < 2^32: host-checked
    device const float* st = conv_state + c;    // state row i of this channel: st[i C], i < S (S C < 2^32)
    // qkv row max(m - S, 0) of this channel: the first qkv row in row m's window
    device const T* xm = qkv + c + (m0 > S ? ulong(m0 - S) * stride : 0ul);
    device T* out = act + ulong(m0) * C + c;
    for (uint m = m0; m < m1; ++m) {
        float acc = 0.0f;
        device const float* sj = st + (m < S ? m * C : 0u);
        device const T* xj = xm;
        for (uint j = 0; j < p.K; ++j) {
            float v;
            if (m + j < S) {   // window row m + j: state row m + j, else qkv row m + j - S
                v = *sj;
                sj += C;
            } else {
                v = float(*xj);
                xj += stride;
            }
            acc += v * w[j];
        }
        *out = gdn_conv_silu<T>(acc);   // rounded, then MLX's silu, as the bf16 graph (and QMV_CONV's epilogue)
        out += C;
        if (m >= S) {
            xm += stride;
        }
    }
    if (pos.y == 0u) {   // the only row block that reads the state: its reads are above, its writes below
        device float* so = conv_out + c;
        device const T* xs = qkv + c + (p.rows > S ? ulong(p.rows - S) * stride : 0ul);
        for (uint r = 0; r < S; ++r) {   // window row rows + r
            if (p.rows + r < S) {
                *so = st[(p.rows + r) * C];
            } else {
                *so = float(*xs);
                xs += stride;
            }
            so += C;
        }
    }
}

// The conv of the rows of a verification chained through one state (GpuEngine::verify): gdn_conv's window over
// all the rows in one dispatch, and the window after EVERY row into that row's slot of the ring (`slab`,
// GdnRing): row m's output is gdn_conv's sum over window rows m..m+K-1 (the state in slot ring.in, then the qkv
// rows) in the same order, i.e. a one-row gdn_conv on the state row m - 1 left, and slot (first + m) gets window
// rows m+1..m+K-1 (exact copies), which is that one-row conv's new state.
//
// Thread mapping: one thread per channel, all rows (a verification has at most 16), GDN_CONV_THREADS per
// threadgroup; offsets are 32-bit ((rows + K) stride and slots x stride < 2^32: host-checked).
template <typename T>
kernel void gdn_conv_rows(constant GdnConvParams& p [[buffer(0)]], constant GdnRing& ring [[buffer(1)]],
                          device const T* qkv [[buffer(2)]], device const float* conv_w [[buffer(3)]],
                          device float* slab [[buffer(4)]], device T* act [[buffer(5)]],
                          uint c [[thread_position_in_grid]]) {
    if (c >= p.C) {
        return;
    }
    const uint S = p.K - 1u, C = p.C, stride = p.stride;
    constant GdnRing& g = ring;
    device const float* w = conv_w + c * p.K;
    device const float* st = slab + (g.in * g.stride + c);   // state row i of this channel: st[i C]
    device float* so = slab + (g.first * g.stride + c);      // the slot row m writes
    device T* out = act + c;
    uint slot = g.first;
    for (uint m = 0; m < p.rows; ++m) {
        float acc = 0.0f;
        for (uint j = 0; j < p.K; ++j) {
            const uint i = m + j;   // window row i: state row i, else qkv row i - S
            const float v = i < S ? st[i * C] : float(qkv[(i - S) * stride + c]);
            acc += v * w[j];
        }
        *out = gdn_conv_silu<T>(acc);   // as gdn_conv (and QMV_CONV's epilogue)
        out += C;
        for (uint r = 0; r < S; ++r) {   // the window after row m: rows m + 1 .. m + S
            const uint i = m + 1u + r;
            so[r * C] = i < S ? st[i * C] : float(qkv[(i - S) * stride + c]);
        }
        so += g.stride;
        if (++slot == g.slots) {
            slot = 0;
            so -= g.slots * g.stride;
        }
    }
}

// M tokens of the gated delta rule for one value head, in order, fused with the q/k l2norm, the gates and the
// gated RMSNorm: the decode step (M = 1) and the prefill's register scan.
//
// Why fused: the state (nv * dv * dk floats: 2 MiB per layer for the real model) is the dominant traffic; it is
// read once and written once per call, and kept in registers across the M tokens. The q/k normalisation, beta
// and the decay are a few hundred flops per head and token recomputed where they are used, and the gated norm
// needs only o of the head, which the threadgroup holds, so no intermediate (normalised q/k, gates, o) goes
// through device memory (Lily's gdn_step_gated / gdn_prefill_regscan fuse the same).
//
// Thread mapping: one threadgroup per value head (grid = (nv, 1, 1)), nsg = min(dv, 32) SIMD-groups.
// SIMD-group sg owns the state rows r = sg, sg + nsg, ... (dv index, <= GDN_STEP_MAX_ROWS_PER_SG of them), lane l
// elements l, l + 32, ..., l + 32 (DPL - 1) of each (DPL, the template parameter, is the host's pick from dk:
// ceil(dk / 32) rounded up to 1, 2, 4 or 8; 4 at dk = 128, so no lane carries zero padding there): the thread's
// GDN_STEP_MAX_ROWS_PER_SG x DPL floats of state live in registers from the first token to the last, indexed
// only by compile-time loop counters. Per token, every SIMD-group loads and normalises q and k itself (two
// simd_sums: no barrier); per row, it decays its slice, reduces kv = S[r] . k with simd_sum, applies the rank-1
// update, reduces o[r] = S[r] . q with simd_sum; lane 0 stages o[r] in threadgroup memory. The sum of o^2 over
// the head is reduced by threadgroup_sum (its barrier also publishes the staged o), all threads compute y in
// steps of the threadgroup size, and a barrier ends the token (o_tg and the partial sums are reused). The
// token's rows are reached by advancing pointers (no 64-bit multiply in the token loop).
// this thread's slice of a head's state (rows sg + i nsg, elements lane + 32 j) to Oh (the head's [dv, dk])
template <uint DPL>
inline void gdn_state_store(device float* Oh, thread const float* s, uint dv, uint dk, uint sg, uint nsg, uint lane) {
    for (uint i = 0; i < GDN_STEP_MAX_ROWS_PER_SG; ++i) {
        const uint r = sg + i * nsg;
        for (uint j = 0; j < DPL; ++j) {
            const uint e = lane + j * SIMD_WIDTH;
            if (r < dv && e < dk) {
                Oh[r * dk + e] = s[i * DPL + j];
            }
        }
    }
}

// The body of gdn_step and gdn_step_rows (one value head h): the same float operations in the same order, so a
// row of gdn_step_rows is bit for bit a one-token gdn_step on the state before it. Sh: the head's state read;
// Oh: where the head's state goes -- RING false: once, after the last token (gdn_step); RING true: after EVERY
// token m, into slot (ring_first + m) mod ring_slots (Oh is the head in slot ring_first; the slots are
// ring_stride floats apart, advanced by additions with a wrap: no 64-bit multiply in the token loop).
template <typename T, uint DPL, bool RING>
inline void gdn_step_heads(constant GdnParams& p, uint ring_slots, uint ring_first, uint ring_stride, device const T* act, device const T* z,
                           device const T* b, device const T* a, device const float* A_log,
                           device const float* dt_bias, device const T* norm_w, device const float* Sh,
                           device float* Oh, device T* y, threadgroup float* o_tg, threadgroup float* partial,
                           uint h, uint tid, uint nthreads, uint lane, uint sg, uint nsg) {
    constexpr uint R = GDN_STEP_MAX_ROWS_PER_SG;
    const uint dk = p.dk, dv = p.dv, key_dim = p.nk * p.dk;
    const uint kh = h / p.group;

    // this thread's slice of the state: rows sg + i nsg, elements lane + 32 j (zeros outside); dv dk < 2^32
    // (host-checked), so a row's offset is 32-bit
    float s[R * DPL];
    for (uint i = 0; i < R; ++i) {
        const uint r = sg + i * nsg;
        for (uint j = 0; j < DPL; ++j) {
            const uint e = lane + j * SIMD_WIDTH;
            s[i * DPL + j] = (r < dv && e < dk) ? Sh[r * dk + e] : 0.0f;
        }
    }
    const float A = A_log[h], dtb = dt_bias[h];
    device const T* row = act;                 // act row m
    device const T* bm = b + h;                // b, a, z of row m (gate_stride apart)
    device const T* am = a + h;
    device const T* zh = z + ulong(h) * dv;
    device T* yh = y + ulong(h) * dv;          // y row m (y_stride apart)
    uint slot = ring_first;                    // RING: the slot token m writes
    const ulong wrap = ulong(ring_slots) * ring_stride;
    for (uint m = 0; m < p.rows; ++m) {
        float qv[DPL], kv[DPL];
        gdn_qk_normalize<T, DPL>(row + kh * dk, row + key_dim + kh * dk, dk, p.q_scale, p.l2_eps, lane, qv, kv);
        const float beta = gdn_beta<T>(*bm);
        const float decay = exp(gdn_log_decay(float(*am), A, dtb));
        device const T* vh = row + 2u * key_dim + h * dv;
        float oss = 0.0f;
        for (uint i = 0; i < R; ++i) {
            const uint r = sg + i * nsg;
            if (r < dv) {   // SIMD-group-uniform: r depends on sg only
                float skv = 0.0f;
                for (uint j = 0; j < DPL; ++j) {
                    s[i * DPL + j] *= decay;
                    skv += s[i * DPL + j] * kv[j];
                }
                const float delta = (float(vh[r]) - simd_sum(skv)) * beta;
                float so = 0.0f;
                for (uint j = 0; j < DPL; ++j) {
                    s[i * DPL + j] += delta * kv[j];
                    so += s[i * DPL + j] * qv[j];
                }
                const float o = rnd<T>(simd_sum(so));   // the recurrence output, rounded as the bf16 graph does
                if (lane == 0) {
                    o_tg[r] = o;
                }
                oss += o * o;
            }
        }
        if (RING) {   // the state after token m, into its slot (this head's rows only)
            gdn_state_store<DPL>(Oh, s, dv, dk, sg, nsg, lane);
            Oh += ring_stride;
            if (++slot == ring_slots) {
                slot = 0;
                Oh -= wrap;
            }
        }
        // gated RMSNorm over the head's dv outputs (one SIMD-group's lanes all hold the same oss: count lane 0);
        // common.h's threadgroup_sum written out (the simulator's translation passes no threadgroup pointer
        // parameter on to a helper of common.h): the same sums in the same order
        const float part = simd_sum(lane == 0 ? oss : 0.0f);
        if (lane == 0) {
            partial[sg] = part;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        const float total = simd_sum(lane < nsg ? partial[lane] : 0.0f);
        const float inv = rsqrt(total / float(dv) + p.eps);
        for (uint i = tid; i < dv; i += nthreads) {
            yh[i] = gdn_gated_out<T>(o_tg[i], inv, float(norm_w[i]), float(zh[i]));
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);   // o_tg and partial are rewritten by the next token
        row += p.act_stride;
        bm += p.gate_stride;
        am += p.gate_stride;
        zh += p.gate_stride;
        yh += p.y_stride;
    }
    if (!RING) {
        gdn_state_store<DPL>(Oh, s, dv, dk, sg, nsg, lane);   // may be Sh (in place): this head's rows only
    }
}

template <typename T, uint DPL>
[[kernel, max_total_threads_per_threadgroup(SIMD_WIDTH * GDN_STEP_MAX_SIMDGROUPS)]]
void gdn_step(constant GdnParams& p [[buffer(0)]], device const T* act [[buffer(1)]],
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
    const ulong head = ulong(h) * p.dv * p.dk;
    gdn_step_heads<T, DPL, false>(p, 0u, 0u, 0u, act, z, b, a, A_log, dt_bias, norm_w, state + head, state_out + head, y,
                                  o_tg, partial, h, tid, nthreads, lane, sg, nsg);
}

// The rows of a verification chained through one state (GpuEngine::verify): gdn_step over the rows in order,
// the state in registers, writing the state after EVERY row into that row's slot of the ring (`slab`: GdnRing).
// Row r is bit for bit a one-token gdn_step on the state row r - 1 left (the same body, gdn_step_heads), so
// rewinding to any row installs exactly a decode step's state, in one dispatch (one dependency level) for
// all the rows instead of one per row.
template <typename T, uint DPL>
[[kernel, max_total_threads_per_threadgroup(SIMD_WIDTH * GDN_STEP_MAX_SIMDGROUPS)]]
void gdn_step_rows(constant GdnParams& p [[buffer(0)]], constant GdnRing& ring [[buffer(1)]],
                   device const T* act [[buffer(2)]], device const T* z [[buffer(3)]],
                   device const T* b [[buffer(4)]], device const T* a [[buffer(5)]],
                   device const float* A_log [[buffer(6)]], device const float* dt_bias [[buffer(7)]],
                   device const T* norm_w [[buffer(8)]], device float* slab [[buffer(9)]],
                   device T* y [[buffer(10)]],
                   uint h [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                   uint nthreads [[threads_per_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                   uint sg [[simdgroup_index_in_threadgroup]], uint nsg [[simdgroups_per_threadgroup]]) {
    threadgroup float o_tg[GDN_STEP_MAX_DV];
    threadgroup float partial[SIMD_WIDTH];
    constant GdnRing& g = ring;
    const uint head = h * p.dv * p.dk;   // slots x stride < 2^32: host-checked
    gdn_step_heads<T, DPL, true>(p, g.slots, g.first, g.stride, act, z, b, a, A_log, dt_bias, norm_w, slab + (g.in * g.stride + head),
                                 slab + (g.first * g.stride + head), y, o_tg, partial, h, tid, nthreads, lane, sg,
                                 nsg);
}

// The chunked route's inputs: per (key head, token) the normalised q and k, per (value head, token) beta and the
// log decay g, with exactly gdn_step's functions, into float scratch (the chunk kernel reads them as
// simdgroup_matrix tiles, and each is read by every threadgroup of the head: normalising once is cheaper).
//
// Thread mapping: one SIMD-group per (key head kh, row m): grid (nk, M + pad8(block)); the lanes hold q and k
// lane-strided as gdn_step's; lane j < group writes beta and g of value head kh * group + j. Rows
// m >= rows (the padding the chunk kernel's last block reads past the chunk) are written as zeros.
template <typename T>
kernel void gdn_prep(constant GdnParams& p [[buffer(0)]], device const T* act [[buffer(1)]],
                     device const T* b [[buffer(2)]], device const T* a [[buffer(3)]],
                     device const float* A_log [[buffer(4)]], device const float* dt_bias [[buffer(5)]],
                     device float* qn [[buffer(6)]], device float* kn [[buffer(7)]],
                     device float* beta [[buffer(8)]], device float* g [[buffer(9)]],
                     uint2 pos [[threadgroup_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
    const uint kh = pos.x, m = pos.y, dk = p.dk;
    const ulong o = (ulong(m) * p.nk + kh) * dk;
    constexpr uint DPL = GDN_CHUNK_MAX_DK / SIMD_WIDTH;   // the chunked route's dk <= GDN_CHUNK_MAX_DK
    float qv[DPL], kv[DPL];
    const bool real = m < p.rows;   // threadgroup-uniform
    if (real) {
        device const T* row = act + ulong(m) * p.act_stride;
        gdn_qk_normalize<T, DPL>(row + kh * dk, row + (p.nk + kh) * dk, dk, p.q_scale, p.l2_eps, lane, qv, kv);
    }
    for (uint j = 0; j < DPL; ++j) {
        const uint i = lane + j * SIMD_WIDTH;
        if (i < dk) {
            qn[o + i] = real ? qv[j] : 0.0f;
            kn[o + i] = real ? kv[j] : 0.0f;
        }
    }
    if (lane < p.group) {
        const uint h = kh * p.group + lane;
        const ulong gi = ulong(m) * p.gate_stride + h;
        beta[ulong(m) * p.nv + h] = real ? gdn_beta<T>(b[gi]) : 0.0f;
        g[ulong(m) * p.nv + h] = real ? gdn_log_decay(float(a[gi]), A_log[h], dt_bias[h]) : 0.0f;
    }
}

// A[i, j] = x_i . y_j over dk for the 8x8 blocks (ib, jb <= ib) of the block's cp x cp matrix (row stride
// GDN_CHUNK_LDA), the blocks dealt round-robin to the nsg SIMD-groups; x_i, y_j are rows ld floats apart, read
// as tiles from device memory (y transposed on load). Compile-time loop bounds with uniform guards (nb = cp / 8
// blocks, nkb = dk / 8 tiles of the sum), as gdn_chunk's register tiles; offsets are 32-bit (64 ld < 2^32:
// host-checked).
inline void gdn_chunk_gram(threadgroup float* A, device const float* x, device const float* y, uint ld, uint nkb,
                           uint nb, uint sg, uint nsg) {
    for (uint ib = 0; ib < GDN_CHUNK_MAX / 8u; ++ib) {
        for (uint jb = 0; jb <= ib; ++jb) {
            const uint t = ib * (ib + 1u) / 2u + jb;   // the block's index in row-major lower-triangle order
            if (ib < nb && t % nsg == sg) {   // SIMD-group-uniform (the blocks past nb come after all others)
                simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
                for (uint kb = 0; kb < GDN_CHUNK_MAX_DK / 8u; ++kb) {
                    if (kb < nkb) {
                        simdgroup_float8x8 xa, yb;
                        simdgroup_load(xa, x + ib * 8u * ld + kb * 8u, ld);
                        simdgroup_load(yb, y + jb * 8u * ld + kb * 8u, ld, ulong2(0, 0), true);
                        simdgroup_multiply_accumulate(acc, xa, yb, acc);
                    }
                }
                simdgroup_store(acc, A + ib * 8u * GDN_CHUNK_LDA + jb * 8u, GDN_CHUNK_LDA);
            }
        }
    }
}

// The decay mask in log space on the lower blocks of A: A_ij = s_i A_ij exp(G_i - G_j) for j <= i, 0 above the
// diagonal (s = beta: the WY matrix L, whose diagonal the solve never reads; s = 1: the intra-block attention M);
// the exponent is formed only for j <= i, so G_i - G_j <= 0: no overflow.
inline void gdn_chunk_mask(threadgroup float* A, threadgroup const float* G, threadgroup const float* B, uint cp,
                           bool with_beta, uint tid, uint nthreads) {
    for (uint e = tid; e < cp * cp; e += nthreads) {
        const uint i = e / cp, j = e % cp;
        if (j / 8u <= i / 8u) {
            threadgroup float* Aij = A + i * GDN_CHUNK_LDA + j;
            *Aij = j <= i ? (with_beta ? B[i] : 1.0f) * *Aij * exp(G[i] - G[j]) : 0.0f;
        }
    }
}

// The recurrence over M tokens in blocks of C tokens, chunked (WY/UT) form on simdgroup_matrix, for one
// value head and one tile of 8 * GDN_CHUNK_SIMDGROUPS value columns. Per block (HF layout: S is [dk, dv]), with
// G = cumsum(g), Gamma = exp(G), D_ij = exp(G_i - G_j):
//   L = strict_lower(beta_i k_i.k_j D_ij)                          (gram + mask)
//   V_new = (I + L)^-1 [beta (V - Gamma (K S))]                     (KS tiles; forward substitution)
//   O = Gamma (Q S) + lower_incl(q_i.k_j D_ij) V_new               (diag(Gamma) tile x QS tile + M V_new)
//   S = Gamma_C S + K^T (exp(G_C - G) V_new)
// which is U - W S with U = T^-1 (beta V), W = T^-1 (beta Gamma K) of docs/model.md §6 regrouped so that only
// K S ([C, 8] per SIMD-group) is formed, not W; the triangular solve runs on the panel V_new itself (C
// dependent rows), not on T^-1. Rows past the block (its padding to a multiple of 8, and the chunk's end) are
// exact no-ops: g = 0 in the cumsum, a zero right-hand side, no solve, no o stored. The value columns are independent in every line above, so tiles of them run in parallel
// threadgroups (each recomputes the block's C x C matrices: cheap next to the [C, dk] x [dk, 8] products).
//
// Why fused: the state tile stays in registers (fp32) across all blocks of the chunk; q, k, beta, g come from
// gdn_prep's scratch and o goes to scratch for gdn_norm (the norm needs a whole head, split over tiles here).
//
// Thread mapping: grid (nv, ceil(dv / (8 nsg))), nsg = GDN_CHUNK_SIMDGROUPS SIMD-groups; SIMD-group sg owns
// value columns [8 cb, 8 cb + 8), cb = tile nsg + sg (a SIMD-group past dv only helps with the gram matrices),
// and holds its state tile as dk / 8 simdgroup_float8x8 (S[kb] = rows 8 kb.. of [dk, 8]) of an array of
// GDN_CHUNK_MAX_DK / 8: every loop over S[] and O[] has a compile-time bound and skips the tiles past dk / 8
// (or past the block's cp / 8) by a uniform guard, so the compiler can keep both arrays in registers. Per block:
// threads t < cp compute G and beta; after a barrier all threads write the diag(Gamma) tiles (row-major,
// consecutive threads on consecutive words); all SIMD-groups compute the lower 8x8 blocks of K K^T (then Q K^T)
// into the shared cp x cp matrix (rows GDN_CHUNK_LDA = GDN_CHUNK_MAX + 4 floats apart: the 8 rows of a tile
// load or store start 4 banks apart, not all on one bank as with a 64-float stride), all threads mask it; each SIMD-group computes its K S panel into its own
// threadgroup panel, forms the right-hand side, solves it (lane = column l % 8, quarter l / 8 of the sum over
// j; two simd_shuffle_xor, one simdgroup_barrier per row), computes O and updates its state tile, and writes
// its o panel. Threadgroup barriers separate the phases that share the cp x cp matrix.
template <typename T>
[[kernel, max_total_threads_per_threadgroup(SIMD_WIDTH * GDN_CHUNK_SIMDGROUPS)]]
void gdn_chunk(constant GdnParams& p [[buffer(0)]], device const T* act [[buffer(1)]],
               device const float* qn [[buffer(2)]], device const float* kn [[buffer(3)]],
               device const float* beta [[buffer(4)]], device const float* g [[buffer(5)]],
               device const float* state [[buffer(6)]], device float* state_out [[buffer(7)]],
               device float* o [[buffer(8)]],
               uint2 tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
               uint2 tpg [[threads_per_threadgroup]], uint lane [[thread_index_in_simdgroup]],
               uint sg [[simdgroup_index_in_threadgroup]], uint nsg [[simdgroups_per_threadgroup]]) {
    constexpr uint MAX_KB = GDN_CHUNK_MAX_DK / 8u, MAX_B = GDN_CHUNK_MAX / 8u, LDA = GDN_CHUNK_LDA;
    const uint nthreads = tpg.x;   // 1-D threadgroups (the grid attributes of a kernel share one width)
    // X_tg first: the simulator resolves a pointer into a threadgroup array by address, and the start of an
    // array declared right after another one is also that one's end
    threadgroup float X_tg[GDN_CHUNK_SIMDGROUPS * GDN_CHUNK_MAX * 8];  // per SIMD-group: KS, V_new, O panels
    threadgroup float A_tg[GDN_CHUNK_MAX * GDN_CHUNK_LDA];             // L, then M, of the block (padded rows)
    threadgroup float D_tg[GDN_CHUNK_MAX * 8];                         // diag(Gamma) of each 8-row block
    threadgroup float G_tg[GDN_CHUNK_MAX];                             // cumulative log decay
    threadgroup float B_tg[GDN_CHUNK_MAX];                             // beta
    const uint h = tg.x, cb = tg.y * nsg + sg, dk = p.dk, dv = p.dv, nv = p.nv;
    const bool active = cb * 8u < dv;   // SIMD-group-uniform
    const uint kh = h / p.group, nkb = dk / 8u, bc = p.block, cp = (bc + 7u) & ~7u, nb = cp / 8u;
    const uint ld = p.nk * dk;   // row stride of qn, kn
    threadgroup float* X = X_tg + sg * GDN_CHUNK_MAX * 8u;

    // the state tile, transposed on load: S[kb](r, c) = state[h][8 cb + c][8 kb + r]
    device const float* Sh = state + (ulong(h) * dv + cb * 8u) * dk;
    simdgroup_float8x8 S[MAX_KB];
    for (uint kb = 0; kb < MAX_KB; ++kb) {
        if (active && kb < nkb) {
            simdgroup_load(S[kb], Sh + kb * 8u, dk, ulong2(0, 0), true);
        }
    }
    // the block's rows, advanced by additions (no 64-bit multiply in the block loop): q, k rows of key head kh,
    // g and beta of head h, v and o columns of the SIMD-group's tile
    device const float* qb0 = qn + kh * dk;
    device const float* kb0 = kn + kh * dk;
    device const float* gb = g + h;
    device const float* betab = beta + h;
    device const T* vcol = act + 2u * ld + h * dv + cb * 8u;
    device float* ocol = o + h * dv + cb * 8u;
    // The block loop's trip count is run time (the chunk's length); it indexes no register array: every loop
    // over S[] and O[] inside has a compile-time bound.
    for (uint m0 = 0; m0 < p.rows; m0 += bc) {
        const uint n = min(bc, p.rows - m0);
        if (tid < cp) {
            float G = 0.0f;   // cumsum in token order, as the reference
            for (uint j = 0; j <= tid; ++j) {
                G += j < n ? gb[j * nv] : 0.0f;
            }
            G_tg[tid] = G;
            B_tg[tid] = betab[tid * nv];   // rows >= n: unused (zero right-hand side, the solve stops at n)
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint e = tid; e < cp * 8u; e += nthreads) {   // diag(Gamma) tiles, row-major: e = 8 row + column
            const uint i = e / 8u;
            D_tg[e] = (i % 8u == e % 8u) ? exp(G_tg[i]) : 0.0f;   // read in the O phase, barriers below
        }
        gdn_chunk_gram(A_tg, kb0, kb0, ld, nkb, nb, sg, nsg);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        gdn_chunk_mask(A_tg, G_tg, B_tg, cp, true, tid, nthreads);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (active) {
            for (uint ib = 0; ib < MAX_B; ++ib) {   // X = K S
                if (ib < nb) {
                    simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
                    for (uint kb = 0; kb < MAX_KB; ++kb) {
                        if (kb < nkb) {
                            simdgroup_float8x8 kt;
                            simdgroup_load(kt, kb0 + ib * 8u * ld + kb * 8u, ld);
                            simdgroup_multiply_accumulate(acc, kt, S[kb], acc);
                        }
                    }
                    simdgroup_store(acc, X + ib * 64u, 8);
                }
            }
            simdgroup_barrier(mem_flags::mem_threadgroup);
            for (uint e = lane; e < cp * 8u; e += SIMD_WIDTH) {   // X = beta (V - Gamma K S)
                const uint i = e / 8u;
                X[e] = i < n ? B_tg[i] * (float(vcol[i * p.act_stride + e % 8u]) - exp(G_tg[i]) * X[e]) : 0.0f;
            }
            simdgroup_barrier(mem_flags::mem_threadgroup);
            const uint col = lane & 7u, part = lane >> 3;   // (I + L) V_new = X, row by row
            for (uint i = 1; i < n; ++i) {
                float acc = 0.0f;
                for (uint j = part; j < i; j += 4u) {
                    acc += A_tg[i * LDA + j] * X[j * 8u + col];
                }
                acc += simd_shuffle_xor(acc, ushort(8));
                acc += simd_shuffle_xor(acc, ushort(16));
                if (part == 0) {
                    X[i * 8u + col] -= acc;
                }
                simdgroup_barrier(mem_flags::mem_threadgroup);
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);   // every SIMD-group is done with L
        gdn_chunk_gram(A_tg, qb0, kb0, ld, nkb, nb, sg, nsg);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        gdn_chunk_mask(A_tg, G_tg, B_tg, cp, false, tid, nthreads);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (active) {
            simdgroup_float8x8 O[MAX_B];
            for (uint ib = 0; ib < MAX_B; ++ib) {   // O = diag(Gamma) (Q S) + M V_new
                if (ib < nb) {
                    simdgroup_float8x8 qs = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
                    for (uint kb = 0; kb < MAX_KB; ++kb) {
                        if (kb < nkb) {
                            simdgroup_float8x8 qt;
                            simdgroup_load(qt, qb0 + ib * 8u * ld + kb * 8u, ld);
                            simdgroup_multiply_accumulate(qs, qt, S[kb], qs);
                        }
                    }
                    simdgroup_float8x8 dg;
                    // perf-ok(PERF-SIMDMAT-LOOP): inside the chunk's block loop, sequential by nature (the recurrence carries S from block to block); its fragments are indexed by compile-time loop variables
                    simdgroup_load(dg, D_tg + ib * 64u, 8);
                    simdgroup_multiply(O[ib], dg, qs);
                    for (uint jb = 0; jb <= ib; ++jb) {
                        simdgroup_float8x8 mt, vt;
                        simdgroup_load(mt, A_tg + ib * 8u * LDA + jb * 8u, LDA);
                        // perf-ok(PERF-SIMDMAT-LOOP): inside the chunk's block loop, sequential by nature (the recurrence carries S from block to block); its fragments are indexed by compile-time loop variables
                        simdgroup_load(vt, X + jb * 64u, 8);
                        simdgroup_multiply_accumulate(O[ib], mt, vt, O[ib]);
                    }
                }
            }
            simdgroup_barrier(mem_flags::mem_threadgroup);
            const float Gc = G_tg[cp - 1u];   // G of the block's last token (padded rows add g = 0)
            for (uint e = lane; e < cp * 8u; e += SIMD_WIDTH) {
                X[e] *= exp(Gc - G_tg[e / 8u]);   // V_new scaled to the block's end
            }
            simdgroup_barrier(mem_flags::mem_threadgroup);
            const float gc = exp(Gc);
            for (uint kb = 0; kb < MAX_KB; ++kb) {   // S = Gamma_C S + K^T (exp(G_C - G) V_new)
                if (kb < nkb) {
                    S[kb].thread_elements() *= gc;
                    for (uint jb = 0; jb < MAX_B; ++jb) {
                        if (jb < nb) {
                            simdgroup_float8x8 kt, vt;
                            simdgroup_load(kt, kb0 + jb * 8u * ld + kb * 8u, ld, ulong2(0, 0), true);
                            // perf-ok(PERF-SIMDMAT-LOOP): inside the chunk's block loop, sequential by nature (the recurrence carries S from block to block); its fragments are indexed by compile-time loop variables
                            simdgroup_load(vt, X + jb * 64u, 8);
                            simdgroup_multiply_accumulate(S[kb], kt, vt, S[kb]);
                        }
                    }
                }
            }
            simdgroup_barrier(mem_flags::mem_threadgroup);
            for (uint ib = 0; ib < MAX_B; ++ib) {
                if (ib < nb) {
                    // perf-ok(PERF-SIMDMAT-LOOP): inside the chunk's block loop, sequential by nature (the recurrence carries S from block to block); its fragments are indexed by compile-time loop variables
                    simdgroup_store(O[ib], X + ib * 64u, 8);
                }
            }
            simdgroup_barrier(mem_flags::mem_threadgroup);
            for (uint e = lane; e < n * 8u; e += SIMD_WIDTH) {   // o rounded as the bf16 graph does
                ocol[(e / 8u) * nv * dv + e % 8u] = rnd<T>(X[e]);
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);   // G, beta, diag(Gamma), A are rewritten by the next block
        qb0 += bc * ld;
        kb0 += bc * ld;
        gb += bc * nv;
        betab += bc * nv;
        vcol += bc * p.act_stride;
        ocol += bc * nv * dv;
    }
    device float* Oh = state_out + (ulong(h) * dv + cb * 8u) * dk;   // may be `state` (in place): this tile only,
    for (uint kb = 0; kb < MAX_KB; ++kb) {                           // read before
        if (active && kb < nkb) {
            simdgroup_store(S[kb], Oh + kb * 8u, dk, ulong2(0, 0), true);
        }
    }
}

// The gated RMSNorm of the chunked route's o (float scratch [M, nv dv], already rounded to T) with gdn_step's
// per-element function: y[m, h] = gdn_gated_out(o, rsqrt(mean(o^2) + eps), norm_w, z).
//
// Thread mapping: one SIMD-group per (value head, row): grid (nv, M); lanes stride over dv, one simd_sum.
template <typename T>
kernel void gdn_norm(constant GdnParams& p [[buffer(0)]], device const float* o [[buffer(1)]],
                     device const T* z [[buffer(2)]], device const T* norm_w [[buffer(3)]], device T* y [[buffer(4)]],
                     uint2 pos [[threadgroup_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
    const uint h = pos.x, m = pos.y, dv = p.dv;
    device const float* oh = o + (ulong(m) * p.nv + h) * dv;
    float ss = 0.0f;
    for (uint i = lane; i < dv; i += SIMD_WIDTH) {
        ss += oh[i] * oh[i];
    }
    const float inv = rsqrt(simd_sum(ss) / float(dv) + p.eps);
    device const T* zh = z + ulong(m) * p.gate_stride + ulong(h) * dv;
    device T* yh = y + ulong(m) * p.y_stride + ulong(h) * dv;
    for (uint i = lane; i < dv; i += SIMD_WIDTH) {
        yh[i] = gdn_gated_out<T>(oh[i], inv, float(norm_w[i]), float(zh[i]));
    }
}

INSTANTIATE_KERNEL("gdn_conv_f32", gdn_conv, float)
INSTANTIATE_KERNEL("gdn_conv_bf16", gdn_conv, bfloat)
INSTANTIATE_KERNEL("gdn_conv_rows_f32", gdn_conv_rows, float)
INSTANTIATE_KERNEL("gdn_conv_rows_bf16", gdn_conv_rows, bfloat)
INSTANTIATE_KERNEL("gdn_step_f32_dk32", gdn_step, float, 1u)
INSTANTIATE_KERNEL("gdn_step_f32_dk64", gdn_step, float, 2u)
INSTANTIATE_KERNEL("gdn_step_f32_dk128", gdn_step, float, 4u)
INSTANTIATE_KERNEL("gdn_step_f32_dk256", gdn_step, float, 8u)
INSTANTIATE_KERNEL("gdn_step_bf16_dk32", gdn_step, bfloat, 1u)
INSTANTIATE_KERNEL("gdn_step_bf16_dk64", gdn_step, bfloat, 2u)
INSTANTIATE_KERNEL("gdn_step_bf16_dk128", gdn_step, bfloat, 4u)
INSTANTIATE_KERNEL("gdn_step_bf16_dk256", gdn_step, bfloat, 8u)
INSTANTIATE_KERNEL("gdn_step_rows_f32_dk32", gdn_step_rows, float, 1u)
INSTANTIATE_KERNEL("gdn_step_rows_f32_dk64", gdn_step_rows, float, 2u)
INSTANTIATE_KERNEL("gdn_step_rows_f32_dk128", gdn_step_rows, float, 4u)
INSTANTIATE_KERNEL("gdn_step_rows_f32_dk256", gdn_step_rows, float, 8u)
INSTANTIATE_KERNEL("gdn_step_rows_bf16_dk32", gdn_step_rows, bfloat, 1u)
INSTANTIATE_KERNEL("gdn_step_rows_bf16_dk64", gdn_step_rows, bfloat, 2u)
INSTANTIATE_KERNEL("gdn_step_rows_bf16_dk128", gdn_step_rows, bfloat, 4u)
INSTANTIATE_KERNEL("gdn_step_rows_bf16_dk256", gdn_step_rows, bfloat, 8u)
INSTANTIATE_KERNEL("gdn_prep_f32", gdn_prep, float)
INSTANTIATE_KERNEL("gdn_prep_bf16", gdn_prep, bfloat)
INSTANTIATE_KERNEL("gdn_chunk_f32", gdn_chunk, float)
INSTANTIATE_KERNEL("gdn_chunk_bf16", gdn_chunk, bfloat)
INSTANTIATE_KERNEL("gdn_norm_f32", gdn_norm, float)
INSTANTIATE_KERNEL("gdn_norm_bf16", gdn_norm, bfloat)

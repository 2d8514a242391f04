// The sparse MoE block of one decode token, and the dense SwiGLU MLP, after the router GEMV (qmv with
// float output over the stacked [router rows | shared_expert_gate row], metal/quant.metal):
//
//   moe_topk_<T>        per row: logits[0, E) -> softmax (float) -> top-k (ties: lower expert index
//                       first) -> renormalised (optional): ids uint [rows, k], weights float [rows, k]
//   moe_gate_up_<w>_<T> act[s, :inter] = silu(gate_{ids[s]} x) * up_{ids[s]} x for s < k, and
//                       act[k, :shared_inter] for the shared expert (its stacked [gate | up] matrix)
//   moe_down_<w>_<T>    x[:H] += sum_s weights[s] down_{ids[s]} act[s]
//                                + sigmoid(logits[E]) shared_down act[k]     (in place: the residual add)
//   mlp_gate_up_<w>_<T> act[:inter] = silu(gate x) * up x over one stacked [gate | up] matrix
// <w> as in quant.metal (q4_sbf16, ..., qn_sbf16, qn_sf32, bf16, f16, f32); the shared expert has the
// routed experts' format (its group size may differ), or both are taken as qn with a width each
// (MoeGateUpParams.bits / shared_bits: 2- or 3-bit routed experts beside a 4-bit shared expert).
//
// Prefill (a chunk of M tokens, below): moe_topk over the M rows, the counting sort of the (token,
// expert) pairs with the grouped GEMM's tile map (moe_sort_count / _scan / _scatter), and
// moe_combine_<T> (weighted combine + gated shared expert + residual, moe_down's roundings).
//
// Every projection runs metal/quant_dot.h's rows_dot: exactly qmv's inner loop and thread mapping
// (2 SIMD-groups x 4 rows, one word pair per lane per row and step). Float accumulation; the bfloat
// build rounds where MLX's bf16 graph rounds (gate, up, SwiGLU, each expert's output, the weighted
// terms and sums: rnd<T>, the identity for float; docs/metal.md "Rounding").
//
// Simulator-verified, hardware-unverified.
#include "common.h"
#include "moe.h"
#include "quant.h"
#include "quant_dot.h"

// Router top-k for one SIMD-group: softmax over logits[0, n) in float, then k rounds of a SIMD-group
// argmax over the experts ranked below the previous pick in the order (probability descending, index
// ascending); lane j < k receives pick j (`id`, and its probability, renormalised over the k picks in
// order 0 .. k-1 when `norm`). Lane l keeps the probabilities of experts l, l + 32, ... in registers.
// The max and the sum of the softmax are simd_max / simd_sum; p_e = exp(l_e - max) / sum, as the
// float32 reference computes it; in each round every lane scans its experts in ascending order (strict
// > keeps the lower index), simd_max gives the value, simd_min over the lanes holding it the lowest
// index. k <= 32, n <= MOE_MAX_EXPERTS. Call from SIMD-group-uniform control flow.
template <typename T>
inline void route_topk(device const float* logits, uint n, uint k, bool norm, uint lane, thread uint& id,
                       thread float& weight) {
    // probs[j] is expert lane + 32 j: every loop over j runs to the array's constant length with the
    // SIMD-group-uniform guard j < per inside (the slots past it are skipped, never read), so the
    // unrolled loops index the array with constants and it stays in registers (a loop bounded by the
    // run-time `per` would index it dynamically: stack memory)
    constexpr uint PER = MOE_MAX_EXPERTS / SIMD_WIDTH;
    const uint per = (n + SIMD_WIDTH - 1u) / SIMD_WIDTH;
    float probs[PER];
    float m = logits[0];
    for (uint e = lane; e < n; e += SIMD_WIDTH) {
        m = max(m, logits[e]);
    }
    m = simd_max(m);
    float s = 0.0f;
    for (uint j = 0; j < PER; ++j) {
        if (j < per) {
            const uint e = lane + j * SIMD_WIDTH;
            probs[j] = e < n ? exp(logits[e] - m) : 0.0f;
            s += probs[j];
        }
    }
    s = simd_sum(s);
    for (uint j = 0; j < PER; ++j) {
        if (j < per) {
            probs[j] = probs[j] / s;
        }
    }
    float prev_v = 2.0f;  // above every probability: round 0 may take any expert
    uint prev_i = 0;
    float mine_v = 0.0f, total = 0.0f;
    uint mine_i = 0;
    for (uint r = 0; r < k; ++r) {
        float bv = -1.0f;  // below every probability
        uint bi = 0xFFFFFFFFu;
        for (uint j = 0; j < PER; ++j) {
            if (j < per) {
                const uint e = lane + j * SIMD_WIDTH;
                const float v = probs[j];
                const bool below = v < prev_v || (v == prev_v && e > prev_i);
                if (e < n && below && v > bv) {
                    bv = v;
                    bi = e;
                }
            }
        }
        const float best = simd_max(bv);
        const uint best_i = simd_min(bv == best ? bi : 0xFFFFFFFFu);
        prev_v = best;
        prev_i = best_i;
        total += rnd<T>(best);   // the bf16 graph: the selected probabilities rounded, their sum rounded
        if (lane == r) {
            mine_v = rnd<T>(best);
            mine_i = best_i;
        }
    }
    id = mine_i;
    weight = norm ? rnd<T>(mine_v / rnd<T>(total)) : mine_v;
}

// Router top-k for M rows of logits (decode: M = 1). Why on the GPU: the expert ids then never visit
// the host, so everything after the router GEMV is encoded in the same command buffer. The decode graph
// fuses route_topk into moe_gate_up instead (one dependency level fewer); prefill runs this kernel once
// for the chunk's rows, before the counting sort.
//
// Thread mapping: grid (ceil(rows / MOE_TOPK_ROWS), 1, 1) x (32 min(rows, MOE_TOPK_ROWS), 1, 1); SIMD-group
// sg of threadgroup g runs route_topk on row g MOE_TOPK_ROWS + sg (a SIMD-group past the last row returns
// as a whole); lane j < k stores pick j. T only selects the roundings (rnd<T>): logits are float.
// Buffers: 0 params, 1 logits float [rows, stride], 2 ids uint [rows, k], 3 weights float [rows, k].
template <typename T>
[[kernel, max_total_threads_per_threadgroup(QMV_LANES * MOE_TOPK_ROWS)]]
void moe_topk(constant MoeTopkParams& p [[buffer(0)]], device const float* logits [[buffer(1)]],
              device uint* ids [[buffer(2)]], device float* weights [[buffer(3)]],
              uint3 tgid [[threadgroup_position_in_grid]], uint lane [[thread_index_in_simdgroup]],
              uint sg [[simdgroup_index_in_threadgroup]]) {
    const uint row = tgid.x * MOE_TOPK_ROWS + sg;
    if (row >= p.rows) {
        return;
    }
    uint id;
    float w;
    route_topk<T>(logits + ulong(row) * p.stride, p.n_experts, p.k, p.norm != 0, lane, id, w);
    if (lane < p.k) {
        ids[ulong(row) * p.k + lane] = id;
        weights[ulong(row) * p.k + lane] = w;
    }
}

// The bf16 graph's roundings of the combine, shared by moe_down (decode) and moe_combine (prefill):
// one routed expert's weighted output T(w T(d)); the shared-expert gate T(sigmoid(logit)); and the
// routed sum (already rounded) plus the gated shared output, T(routed + T(gate T(d))).
template <typename T>
inline float moe_weighted(float w, float d) {
    return rnd<T>(w * rnd<T>(d));
}
template <typename T>
inline float moe_shared_gate(float logit) {
    return rnd<T>(1.0f / (1.0f + exp(-logit)));
}
template <typename T>
inline float moe_plus_shared(float routed, float gate, float d) {
    return rnd<T>(routed + rnd<T>(gate * rnd<T>(d)));
}

// 4 outputs act[row0 .. row0+3] = silu(g) * u of one SIMD-group: rows_dot over the gate rows, then
// over the up rows (qmv's loop twice; x is re-read from cache, weights once).
template <int FMT, typename S, typename T, typename WP, typename SP, typename XP>
inline void swiglu_rows(WP gw, SP gs_, SP gb, WP uw, SP us, SP ub, XP x4, uint K, uint gsz, uint bits, uint row0,
                        uint nrows, uint lane, device T* act) {
    float g[QMV_ROWS], u[QMV_ROWS];
    rows_dot<FMT, S, T>(gw, gs_, gb, x4, K, gsz, bits, row0, nrows, lane, g);
    rows_dot<FMT, S, T>(uw, us, ub, x4, K, gsz, bits, row0, nrows, lane, u);
    if (lane == 0) {
        for (uint r = 0; r < QMV_ROWS && row0 + r < nrows; ++r) {
            act[row0 + r] = T(swiglu_act<T>(g[r], u[r]));   // rounded as the bf16 graph (common.h)
        }
    }
}

// Routed gate/up + SwiGLU for the k slots and the shared expert, one dispatch. Why fused: gate, up
// and the SwiGLU of all 9 experts of a token in one dispatch (Lily's moe_gather_gemv_q4_gate_up),
// the expert index read from device memory; only the gate/up rows of the chosen experts are read.
//
// With p.topk (MOE_TOPK_FUSED), the router top-k is fused in: every SIMD-group of a routed slot runs
// route_topk on the router logits itself (256 floats from cache, a few hundred flops) and takes its
// slot's pick with simd_shuffle, so the top-k costs no dependency level; SIMD-group 0 of threadgroup
// (0, 0) stores the ids and weights for moe_down. Without it, ids come from device memory (moe_topk).
//
// Thread mapping: grid (ceil(act_stride / 8), k + 1 with a shared expert else k, 1) x (32, 2, 1);
// grid.y is the slot (slot k: the shared expert, its gate rows 0 .. shared_inter-1 and up rows
// shared_inter .. of its stacked matrix), grid.x a block of 8 outputs, 4 per SIMD-group. A
// SIMD-group whose first output is past the slot's rows returns as a whole.
// Buffers: 0 params, 1-3 gate stack (w, scales, biases) [count, inter, K], 4-6 up stack, 7-9 the
// shared [gate | up] matrix [2 shared_inter, K] (without one: any buffer, unused), 10 x [K],
// 11 router logits float [n_experts] (fused top-k only), 12 ids uint [k] (read; written with the fused
// top-k), 13 act [k (+1), act_stride], 14 routing weights float [k] (written with the fused top-k).
template <int FMT, typename S, typename T>
[[kernel, max_total_threads_per_threadgroup(QMV_LANES * QMV_SIMDGROUPS)]]
void moe_gate_up(constant MoeGateUpParams& p [[buffer(0)]], device const uint32_t* gw [[buffer(1)]],
                 device const S* gsc [[buffer(2)]], device const S* gbi [[buffer(3)]],
                 device const uint32_t* uw [[buffer(4)]], device const S* usc [[buffer(5)]],
                 device const S* ubi [[buffer(6)]], device const uint32_t* shw [[buffer(7)]],
                 device const S* shsc [[buffer(8)]], device const S* shbi [[buffer(9)]],
                 device const T* x [[buffer(10)]], device const float* logits [[buffer(11)]],
                 device uint* ids [[buffer(12)]], device T* act [[buffer(13)]],
                 device float* weights [[buffer(14)]], uint3 tgid [[threadgroup_position_in_grid]],
                 uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]]) {
    typedef typename WDot<FMT, S, T>::wvec WV;
    const uint slot = tgid.y;
    const uint row0 = (tgid.x * QMV_SIMDGROUPS + sg) * QMV_ROWS;
    device const vec<T, 4>* x4 = (device const vec<T, 4>*)x;
    device T* arow = act + ulong(slot) * p.act_stride;
    if (slot < p.k) {
        uint expert;
        if ((p.topk & MOE_TOPK_FUSED) != 0u) {
            uint id;
            float w;
            route_topk<T>(logits, p.n_experts, p.k, (p.topk & MOE_TOPK_NORM) != 0u, lane, id, w);
            if (tgid.x == 0u && slot == 0u && sg == 0u && lane < p.k) {
                ids[lane] = id;
                weights[lane] = w;
            }
            expert = simd_shuffle(id, ushort(slot));
        } else {
            expert = ids[slot];
        }
        if (row0 >= p.inter) {
            return;
        }
        const ulong e = min(expert, p.count - 1u);
        const ulong wo = e * matrix_units<FMT, S, T>(p.inter, p.K, p.bits);
        const ulong so = e * matrix_scales<FMT, S, T>(p.inter, p.K, p.group_size);
        swiglu_rows<FMT, S, T>((device const WV*)gw + wo, gsc + so, gbi + so, (device const WV*)uw + wo, usc + so,
                               ubi + so, x4, p.K, p.group_size, p.bits, row0, p.inter, lane, arow);
    } else {
        if (row0 >= p.shared_inter) {
            return;
        }
        const ulong wo = matrix_units<FMT, S, T>(p.shared_inter, p.K, p.shared_bits);
        const ulong so = matrix_scales<FMT, S, T>(p.shared_inter, p.K, p.shared_group_size);
        device const WV* sw = (device const WV*)shw;
        swiglu_rows<FMT, S, T>(sw, shsc, shbi, sw + wo, shsc + so, shbi + so, x4, p.K, p.shared_group_size,
                               p.shared_bits, row0, p.shared_inter, lane, arow);
    }
}

// Routed down projections weighted by the routing weights + the gated shared expert + the residual
// add, one dispatch. Why fused: the k + 1 down projections, their weighted sum and the add into the
// residual stream never round-trip through memory (Lily's moe_gather_gemv_q4_down_combine, plus
// the residual add), and the sum is taken in a fixed order (slots 0 .. k-1, then the shared expert:
// deterministic whatever the schedule).
//
// Thread mapping: grid (ceil(H / 8), 1, 1) x (32, 2, 1); each SIMD-group owns 4 output rows and runs
// rows_dot once per slot over that slot's expert rows and act row (inter = 512 at 4 bits: one step,
// every lane busy), adding weights[s] * result; then the shared expert times sigmoid(its logit);
// lane 0 adds the total to x and stores (each row is read and written by one thread only).
// Buffers: 0 params, 1-3 down stack [count, H, inter], 4-6 shared down [H, shared_inter] (without
// one: any buffer, unused; p.shared_given: 4 is its product float [H], 5-6 unused), 7 act [k (+1), act_stride],
// 8 ids uint [k], 9 weights float [k],
// 10 the shared-gate logit float [1] (the router GEMV's row n_experts), 11 x [H] (read and written).
template <int FMT, typename S, typename T>
[[kernel, max_total_threads_per_threadgroup(QMV_LANES * QMV_SIMDGROUPS)]]
void moe_down(constant MoeDownParams& p [[buffer(0)]], device const uint32_t* dw [[buffer(1)]],
              device const S* dsc [[buffer(2)]], device const S* dbi [[buffer(3)]],
              device const uint32_t* shw [[buffer(4)]], device const S* shsc [[buffer(5)]],
              device const S* shbi [[buffer(6)]], device const T* act [[buffer(7)]],
              device const uint* ids [[buffer(8)]], device const float* weights [[buffer(9)]],
              device const float* shared_logit [[buffer(10)]], device T* x [[buffer(11)]],
              uint3 tgid [[threadgroup_position_in_grid]], uint lane [[thread_index_in_simdgroup]],
              uint sg [[simdgroup_index_in_threadgroup]]) {
    typedef typename WDot<FMT, S, T>::wvec WV;
    const uint row0 = (tgid.x * QMV_SIMDGROUPS + sg) * QMV_ROWS;
    if (row0 >= p.H) {
        return;
    }
    const ulong wpe = matrix_units<FMT, S, T>(p.H, p.inter, p.bits);
    const ulong spe = matrix_scales<FMT, S, T>(p.H, p.inter, p.group_size);
    device const WV* dv = (device const WV*)dw;
    float total[QMV_ROWS];
    for (uint r = 0; r < QMV_ROWS; ++r) {
        total[r] = 0.0f;
    }
    device const T* act_s = act;   // slot s's activations: a row per slot, stepped by a pointer add
    for (uint s = 0; s < p.k; ++s) {
        const ulong e = min(ids[s], p.count - 1u);
        const float ws = weights[s];
        device const vec<T, 4>* a4 = (device const vec<T, 4>*)act_s;
        act_s += p.act_stride;
        float d[QMV_ROWS];
        // perf-ok(PERF-INT64-LOOP): the expert's matrix offsets, once per routed slot (k iterations), not per row
        rows_dot<FMT, S, T>(dv + e * wpe, dsc + e * spe, dbi + e * spe, a4, p.inter, p.group_size, p.bits, row0, p.H,
                            lane, d);
        for (uint r = 0; r < QMV_ROWS; ++r) {
            total[r] += moe_weighted<T>(ws, d[r]);   // bf16 graph: expert output and weighted output rounded
        }
    }
    for (uint r = 0; r < QMV_ROWS; ++r) {
        total[r] = rnd<T>(total[r]);                 // ... the sum over the k experts rounded once
    }
    if (p.shared_inter != 0) {
        float d[QMV_ROWS];
        if (p.shared_given != 0u) {   // computed apart by qmv (the same rows_dot, another weight format)
            device const float* given = reinterpret_cast<device const float*>(shw);
            for (uint r = 0; r < QMV_ROWS; ++r) {
                d[r] = row0 + r < p.H ? given[row0 + r] : 0.0f;
            }
        } else {
            device const vec<T, 4>* a4 = (device const vec<T, 4>*)(act + ulong(p.k) * p.act_stride);
            rows_dot<FMT, S, T>((device const WV*)shw, shsc, shbi, a4, p.shared_inter, p.shared_group_size,
                                p.shared_bits, row0, p.H, lane, d);
        }
        const float gate = moe_shared_gate<T>(shared_logit[0]);
        for (uint r = 0; r < QMV_ROWS; ++r) {
            total[r] = moe_plus_shared<T>(total[r], gate, d[r]);   // routed + gated shared, rounded
        }
    }
    if (lane == 0) {
        for (uint r = 0; r < QMV_ROWS && row0 + r < p.H; ++r) {
            x[row0 + r] = T(float(x[row0 + r]) + total[r]);
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// The union-read MoE of R rows (the verification graph and the batched decode step; docs/metal.md,
// "The union-read MoE"). Run per row, moe_gate_up / moe_down read each row's k experts, so R rows read
// up to R k experts even where they share them; these two read each expert of the rows' union once (per
// output block: one threadgroup column) for every row that chose it, with rows_dot_sel (each weight unit
// loaded once for up to MOE_ROWS_MB rows). Every row keeps exactly its single-row arithmetic: its dot
// products are rows_dot's (rows_dot_sel, vector by vector the same steps), its SwiGLU, weighted terms,
// sums and roundings are moe_gate_up's / moe_down's in the same order (slots 0 .. k-1, then the shared
// expert), so a row's output is bit for bit the single-row kernels' on that row.
// ids [R, k] come from moe_topk_rows (route_topk: the function the single-row kernel fuses; one dependency
// level of its own), or, for R <= MOE_ROWS_TOPK_FUSED_MAX, from route_topk fused into moe_gate_up_rows.

// A pair is (row r, slot j), index r k + j. The leader of an expert is the first pair routed to it.
// Gate/up + SwiGLU over the union. Thread mapping: grid (ceil(act_stride / 8), R k (+1 with a shared
// expert), 1) x (32, 2, 1); grid.y is a pair: a threadgroup whose pair is not its expert's leader returns;
// a leader's runs the expert's 8-row block over the pairs routed to it (ascending), MOE_ROWS_MB at a time
// (at most one pair per row: top-k picks distinct experts). grid.y = R k: the shared expert over every row.
// First the threadgroup stages every pair's expert in threadgroup memory (one barrier): read from ids, or
// with p.topk (MOE_TOPK_FUSED) routed here, SIMD-group sg running route_topk on rows sg, sg + 2, ...;
// threadgroup (0, 0) then stores the ids and weights for moe_down_rows.
// Buffers: 0 params, 1-3 gate stack [count, inter, K], 4-6 up stack, 7-9 the shared [gate | up] matrix
// (without one: any buffer, unused), 10 x [R, x_stride], 11 ids uint [R, k] (read; written with the fused
// top-k), 12 act [R, act_row], 13 router logits float [R, logits_stride] (fused top-k only), 14 routing
// weights float [R, k] (written with the fused top-k).
template <int FMT, typename S, typename T>
[[kernel, max_total_threads_per_threadgroup(QMV_LANES * QMV_SIMDGROUPS)]]
void moe_gate_up_rows(constant MoeGateUpRowsParams& p [[buffer(0)]], device const uint32_t* gw [[buffer(1)]],
                      device const S* gsc [[buffer(2)]], device const S* gbi [[buffer(3)]],
                      device const uint32_t* uw [[buffer(4)]], device const S* usc [[buffer(5)]],
                      device const S* ubi [[buffer(6)]], device const uint32_t* shw [[buffer(7)]],
                      device const S* shsc [[buffer(8)]], device const S* shbi [[buffer(9)]],
                      device const T* x [[buffer(10)]], device uint* ids [[buffer(11)]],
                      device T* act [[buffer(12)]], device const float* logits [[buffer(13)]],
                      device float* weights [[buffer(14)]], uint3 tgid [[threadgroup_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                      uint sg [[simdgroup_index_in_threadgroup]]) {
    typedef typename WDot<FMT, S, T>::wvec WV;
    threadgroup uint tids[MOE_ROWS_MAX_PAIRS];
    const uint n = p.rows * p.k, pair = tgid.y;
    if ((p.topk & MOE_TOPK_FUSED) != 0u) {
        const bool store = tgid.x == 0u && tgid.y == 0u;
        for (uint r = sg; r < p.rows; r += QMV_SIMDGROUPS) {
            uint id;
            float w;
            route_topk<T>(logits + r * p.logits_stride, p.n_experts, p.k, (p.topk & MOE_TOPK_NORM) != 0u, lane, id,
                          w);
            if (lane < p.k) {
                tids[r * p.k + lane] = id;
                if (store) {
                    ids[r * p.k + lane] = id;
                    weights[r * p.k + lane] = w;
                }
            }
        }
    } else {
        for (uint q = tid; q < n; q += QMV_LANES * QMV_SIMDGROUPS) {
            tids[q] = ids[q];
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint row0 = (tgid.x * QMV_SIMDGROUPS + sg) * QMV_ROWS;
    device const vec<T, 4>* x4 = (device const vec<T, 4>*)x;
    const uint xs4 = p.x_stride / 4u;
    if (pair < n) {
        if (row0 >= p.inter) {
            return;
        }
        const uint expert = min(tids[pair], p.count - 1u);
        uint seen = 0u;                          // an earlier pair has this expert: its leader reads it
        for (uint q = lane; q < pair; q += SIMD_WIDTH) {
            seen = seen | (min(tids[q], p.count - 1u) == expert ? 1u : 0u);
        }
        if (simd_max(seen) != 0u) {
            return;
        }
        const ulong wo = ulong(expert) * matrix_units<FMT, S, T>(p.inter, p.K, p.bits);
        const ulong so = ulong(expert) * matrix_scales<FMT, S, T>(p.inter, p.K, p.group_size);
        device const WV* gv = (device const WV*)gw + wo;
        device const WV* uv = (device const WV*)uw + wo;
        uint q = pair;
        while (q < n) {
            uint sel[MOE_ROWS_MB], xo[MOE_ROWS_MB];
            uint nb = 0u;
            for (uint b = 0; b < MOE_ROWS_MB; ++b) {
                while (q < n && min(tids[q], p.count - 1u) != expert) {
                    ++q;
                }
                sel[b] = q < n ? q : pair;
                xo[b] = (sel[b] / p.k) * xs4;
                if (q < n) {
                    ++nb;
                    ++q;
                }
            }
            if (nb == 0u) {
                break;
            }
            float g[MOE_ROWS_MB * QMV_ROWS], u[MOE_ROWS_MB * QMV_ROWS];
            // perf-ok(PERF-INT64-LOOP): rows_dot_x forms its first row's 64-bit offset once per call, here once per batch of up to MOE_ROWS_MB rows (one pass for a decode step's rows); its weight loop is 32-bit
            rows_dot_sel<FMT, S, T, MOE_ROWS_MB>(gv, gsc + so, gbi + so, x4, xo, p.K, p.group_size, p.bits, row0,
                                                 p.inter, nb, lane, g);
            // perf-ok(PERF-INT64-LOOP): rows_dot_x forms its first row's 64-bit offset once per call, here once per batch of up to MOE_ROWS_MB rows (one pass for a decode step's rows); its weight loop is 32-bit
            rows_dot_sel<FMT, S, T, MOE_ROWS_MB>(uv, usc + so, ubi + so, x4, xo, p.K, p.group_size, p.bits, row0,
                                                 p.inter, nb, lane, u);
            if (lane == 0u) {
                for (uint b = 0; b < MOE_ROWS_MB; ++b) {
                    if (b < nb) {
                        device T* arow = act + (sel[b] / p.k) * p.act_row + (sel[b] % p.k) * p.act_stride;
                        for (uint r = 0; r < QMV_ROWS && row0 + r < p.inter; ++r) {
                            arow[row0 + r] = T(swiglu_act<T>(g[b * QMV_ROWS + r], u[b * QMV_ROWS + r]));
                        }
                    }
                }
            }
        }
    } else {
        if (row0 >= p.shared_inter) {
            return;
        }
        const ulong wo = matrix_units<FMT, S, T>(p.shared_inter, p.K, p.shared_bits);
        const ulong so = matrix_scales<FMT, S, T>(p.shared_inter, p.K, p.shared_group_size);
        device const WV* sw = (device const WV*)shw;
        for (uint r0 = 0; r0 < p.rows; r0 += MOE_ROWS_MB) {
            const uint nb = min(MOE_ROWS_MB, p.rows - r0);
            uint xo[MOE_ROWS_MB];
            for (uint b = 0; b < MOE_ROWS_MB; ++b) {
                xo[b] = min(r0 + b, p.rows - 1u) * xs4;
            }
            float g[MOE_ROWS_MB * QMV_ROWS], u[MOE_ROWS_MB * QMV_ROWS];
            // perf-ok(PERF-INT64-LOOP): rows_dot_x forms its first row's 64-bit offset once per call, here once per batch of up to MOE_ROWS_MB rows (one pass for a decode step's rows); its weight loop is 32-bit
            rows_dot_sel<FMT, S, T, MOE_ROWS_MB>(sw, shsc, shbi, x4, xo, p.K, p.shared_group_size, p.shared_bits,
                                                 row0, p.shared_inter, nb, lane, g);
            // perf-ok(PERF-INT64-LOOP): rows_dot_x forms its first row's 64-bit offset once per call, here once per batch of up to MOE_ROWS_MB rows (one pass for a decode step's rows); its weight loop is 32-bit
            rows_dot_sel<FMT, S, T, MOE_ROWS_MB>(sw + wo, shsc + so, shbi + so, x4, xo, p.K, p.shared_group_size,
                                                 p.shared_bits, row0, p.shared_inter, nb, lane, u);
            if (lane == 0u) {
                for (uint b = 0; b < MOE_ROWS_MB; ++b) {
                    if (b < nb) {
                        device T* arow = act + (r0 + b) * p.act_row + p.k * p.act_stride;
                        for (uint r = 0; r < QMV_ROWS && row0 + r < p.shared_inter; ++r) {
                            arow[row0 + r] = T(swiglu_act<T>(g[b * QMV_ROWS + r], u[b * QMV_ROWS + r]));
                        }
                    }
                }
            }
        }
    }
}

// Down projections over the union + each row's weighted sum, gated shared expert and residual add.
// Thread mapping: grid (ceil(H / 8), 1, 1) x (32, 2, 1); each SIMD-group owns 4 output rows of every row.
// First the threadgroup marks each pair's expert leader and links the pairs of an expert (lead, next:
// thread t for pairs t, t + 64, ...; one barrier). Then each SIMD-group walks the leaders in order and
// runs the expert's 4 rows over its pairs (rows_dot_sel), keeping each pair's result in threadgroup
// memory (its own region: lane 0 writes and later reads it, no other lane touches it: no padding or
// barrier needed); then per row, in moe_down's order: the k weighted terms (slots 0 .. k-1) summed and
// rounded, plus the gated shared expert (its down rows over the rows, MOE_ROWS_MB at a time), added to
// x by lane 0.
// Buffers: 0 params, 1-3 down stack [count, H, inter], 4-6 shared down [H, shared_inter] (without one:
// any buffer, unused; p.shared_given: 4 is its product float [R, H], 5-6 unused), 7 act [R, act_row],
// 8 ids uint [R, k], 9 weights float [R, k], 10 router logits float [R, logits_stride] (column n_experts:
// the shared-gate logit; read with a shared expert only), 11 x [R, x_stride] (read and written).
template <int FMT, typename S, typename T>
[[kernel, max_total_threads_per_threadgroup(QMV_LANES * QMV_SIMDGROUPS)]]
void moe_down_rows(constant MoeDownRowsParams& p [[buffer(0)]], device const uint32_t* dw [[buffer(1)]],
                   device const S* dsc [[buffer(2)]], device const S* dbi [[buffer(3)]],
                   device const uint32_t* shw [[buffer(4)]], device const S* shsc [[buffer(5)]],
                   device const S* shbi [[buffer(6)]], device const T* act [[buffer(7)]],
                   device const uint* ids [[buffer(8)]], device const float* weights [[buffer(9)]],
                   device const float* logits [[buffer(10)]], device T* x [[buffer(11)]],
                   uint3 tgid [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                   uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]]) {
    typedef typename WDot<FMT, S, T>::wvec WV;
    threadgroup uint lead[MOE_ROWS_MAX_PAIRS];
    threadgroup uint next[MOE_ROWS_MAX_PAIRS];
    threadgroup float part[QMV_SIMDGROUPS * MOE_ROWS_MAX_PAIRS * QMV_ROWS];
    const uint n = p.rows * p.k;
    for (uint q = tid; q < n; q += QMV_LANES * QMV_SIMDGROUPS) {
        const uint e = min(ids[q], p.count - 1u);
        uint first = 1u, nx = n;
        for (uint j = 0; j < q && first != 0u; ++j) {
            first = min(ids[j], p.count - 1u) == e ? 0u : 1u;
        }
        for (uint j = q + 1u; j < n && nx == n; ++j) {
            nx = min(ids[j], p.count - 1u) == e ? j : n;
        }
        lead[q] = first;
        next[q] = nx;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint row0 = (tgid.x * QMV_SIMDGROUPS + sg) * QMV_ROWS;
    if (row0 >= p.H) {
        return;
    }
    const ulong wpe = matrix_units<FMT, S, T>(p.H, p.inter, p.bits);
    const ulong spe = matrix_scales<FMT, S, T>(p.H, p.inter, p.group_size);
    device const WV* dv = (device const WV*)dw;
    device const vec<T, 4>* a4 = (device const vec<T, 4>*)act;
    threadgroup float* mine = part + sg * (MOE_ROWS_MAX_PAIRS * QMV_ROWS);
    for (uint q0 = 0; q0 < n; ++q0) {
        if (lead[q0] == 0u) {
            continue;
        }
        const ulong e = min(ids[q0], p.count - 1u);
        // the expert's matrix, located once per expert run (not per batch of rows)
        // perf-ok(PERF-INT64-LOOP): once per run of rows sharing an expert, outside the dot loops; can pass 2^32
        const ulong eo = e * wpe, es = e * spe;
        device const WV* dve = dv + eo;
        device const S* dsce = dsc + es;
        device const S* dbie = dbi + es;
        uint q = q0;
        while (q < n) {
            uint sel[MOE_ROWS_MB], xo[MOE_ROWS_MB];
            uint nb = 0u;
            for (uint b = 0; b < MOE_ROWS_MB; ++b) {
                sel[b] = q < n ? q : q0;
                xo[b] = ((sel[b] / p.k) * p.act_row + (sel[b] % p.k) * p.act_stride) / 4u;
                if (q < n) {
                    ++nb;
                    q = next[q];
                }
            }
            float d[MOE_ROWS_MB * QMV_ROWS];
            // perf-ok(PERF-INT64-LOOP): rows_dot_x forms its first row's 64-bit offset once per call, here once per batch of up to MOE_ROWS_MB rows (one pass for a decode step's rows); its weight loop is 32-bit
            rows_dot_sel<FMT, S, T, MOE_ROWS_MB>(dve, dsce, dbie, a4, xo, p.inter,
                                                 p.group_size, p.bits, row0, p.H, nb, lane, d);
            if (lane == 0u) {
                for (uint b = 0; b < MOE_ROWS_MB; ++b) {
                    if (b < nb) {
                        for (uint r = 0; r < QMV_ROWS; ++r) {
                            mine[sel[b] * QMV_ROWS + r] = d[b * QMV_ROWS + r];
                        }
                    }
                }
            }
        }
    }
    device const float* given = reinterpret_cast<device const float*>(shw);
    for (uint r0 = 0; r0 < p.rows; r0 += MOE_ROWS_MB) {
        const uint nb = min(MOE_ROWS_MB, p.rows - r0);
        float d[MOE_ROWS_MB * QMV_ROWS];
        for (uint i = 0; i < MOE_ROWS_MB * QMV_ROWS; ++i) {
            d[i] = 0.0f;
        }
        if (p.shared_inter != 0u && p.shared_given == 0u) {
            uint xo[MOE_ROWS_MB];
            for (uint b = 0; b < MOE_ROWS_MB; ++b) {
                xo[b] = (min(r0 + b, p.rows - 1u) * p.act_row + p.k * p.act_stride) / 4u;
            }
            // perf-ok(PERF-INT64-LOOP): rows_dot_x forms its first row's 64-bit offset once per call, here once per batch of up to MOE_ROWS_MB rows (one pass for a decode step's rows); its weight loop is 32-bit
            rows_dot_sel<FMT, S, T, MOE_ROWS_MB>((device const WV*)shw, shsc, shbi, a4, xo, p.shared_inter,
                                                 p.shared_group_size, p.shared_bits, row0, p.H, nb, lane, d);
        }
        if (lane == 0u) {
            for (uint b = 0; b < MOE_ROWS_MB; ++b) {
                if (b < nb) {
                    const uint r = r0 + b;
                    float total[QMV_ROWS];
                    for (uint i = 0; i < QMV_ROWS; ++i) {
                        total[i] = 0.0f;
                    }
                    for (uint s = 0; s < p.k; ++s) {
                        const float ws = weights[r * p.k + s];
                        for (uint i = 0; i < QMV_ROWS; ++i) {
                            total[i] += moe_weighted<T>(ws, mine[(r * p.k + s) * QMV_ROWS + i]);
                        }
                    }
                    for (uint i = 0; i < QMV_ROWS; ++i) {
                        total[i] = rnd<T>(total[i]);
                    }
                    if (p.shared_inter != 0u) {
                        const float gate = moe_shared_gate<T>(logits[r * p.logits_stride + p.n_experts]);
                        for (uint i = 0; i < QMV_ROWS; ++i) {
                            float v = d[b * QMV_ROWS + i];
                            if (p.shared_given != 0u) {
                                v = row0 + i < p.H ? given[r * p.H + row0 + i] : 0.0f;
                            }
                            total[i] = moe_plus_shared<T>(total[i], gate, v);
                        }
                    }
                    device T* xr = x + r * p.x_stride;
                    for (uint i = 0; i < QMV_ROWS && row0 + i < p.H; ++i) {
                        xr[row0 + i] = T(float(xr[row0 + i]) + total[i]);
                    }
                }
            }
        }
    }
}

// Dense SwiGLU MLP gate/up (qwen3_next layers without experts): the shared-expert path of
// moe_gate_up on its own. Grid (ceil(inter / 8), 1, 1) x (32, 2, 1), 4 outputs per SIMD-group.
// Buffers: 0 params, 1-3 the [gate | up] matrix [2 inter, K], 4 x [K], 5 act [inter].
template <int FMT, typename S, typename T>
[[kernel, max_total_threads_per_threadgroup(QMV_LANES * QMV_SIMDGROUPS)]]
void mlp_gate_up(constant MlpGateUpParams& p [[buffer(0)]], device const uint32_t* w [[buffer(1)]],
                 device const S* scales [[buffer(2)]], device const S* biases [[buffer(3)]],
                 device const T* x [[buffer(4)]], device T* act [[buffer(5)]],
                 uint3 tgid [[threadgroup_position_in_grid]], uint lane [[thread_index_in_simdgroup]],
                 uint sg [[simdgroup_index_in_threadgroup]]) {
    typedef typename WDot<FMT, S, T>::wvec WV;
    const uint row0 = (tgid.x * QMV_SIMDGROUPS + sg) * QMV_ROWS;
    if (row0 >= p.inter) {
        return;
    }
    const ulong wo = matrix_units<FMT, S, T>(p.inter, p.K, p.bits);
    const ulong so = matrix_scales<FMT, S, T>(p.inter, p.K, p.group_size);
    device const WV* wv = (device const WV*)w;
    swiglu_rows<FMT, S, T>(wv, scales, biases, wv + wo, scales + so, biases + so, (device const vec<T, 4>*)x, p.K,
                           p.group_size, p.bits, row0, p.inter, lane, act);
}

// ---------------------------------------------------------------------------------------------------
// Prefill: the MoE block of a chunk of M tokens. After the router GEMM (float logits [M, E (+1)]) and
// moe_topk over the M rows, the S = M k (token, expert) pairs ("slots" once sorted) are counting-sorted
// by expert on the GPU so that the grouped GEMM (gemm.metal) runs each expert's weights over all its
// rows at once, in tiles of tile_rows slots; moe_combine then adds the k weighted expert outputs of each
// token, the gated shared expert and the residual. Nothing is read back: the tile map has a capacity
// bounded from the shapes and its unused entries are empty.
//
// The sort is three dispatches over a scratch of MOE_SORT_BLOCKS x E counters:
//   moe_sort_count    counts[g, e]   = pairs of token block g routed to expert e
//   moe_sort_scan     counts[g, e]  := first slot of block g's pairs of expert e (expert base + the
//                                      blocks before g), and the tile map
//   moe_sort_scatter  slot_of[p], slot_rows[slot] for every pair p, in (token, j) order within an expert
// Every step is integer counting in a fixed order, so the result is the same under any schedule.

// One thread per expert e walks the pairs of its token block in order: the ids are staged through
// threadgroup memory (one per thread per step, so all threads read the same word: a broadcast) and the
// thread counts those equal to e; with SCATTER it gives them consecutive slots from `start`
// (slot_of[p] = slot, slot_rows[slot] = token). Returns the count. All threads of the threadgroup call
// it (barriers); threads past the last expert only stage.
template <bool SCATTER>
inline uint sort_block(constant MoeSortParams& p, device const uint* ids, threadgroup uint* staged, uint e, uint g,
                       uint tid, uint nthreads, uint start, device uint* slot_of, device uint* slot_rows) {
    const uint lo = g * p.block_pairs, hi = min(lo + p.block_pairs, p.n_pairs);
    uint c = 0;
    for (uint base = lo; base < hi; base += nthreads) {
        const uint n = min(nthreads, hi - base);
        if (tid < n) {
            staged[tid] = min(ids[base + tid], p.n_experts - 1u);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (e < p.n_experts) {
            for (uint i = 0; i < n; ++i) {
                if (staged[i] == e) {
                    if (SCATTER) {
                        slot_of[base + i] = start + c;
                        slot_rows[start + c] = (base + i) / p.k;
                    }
                    ++c;
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);  // staged is overwritten next step
    }
    return c;
}

// Histogram per token block. Thread mapping: grid (blocks, ceil(E / t), 1) x (t, 1, 1), t = E rounded
// up to 32, at most MOE_SORT_THREADS; thread i of threadgroup (g, y) counts expert y t + i in block g.
// Buffers: 0 params, 1 ids uint [S], 2 counts uint [blocks, E] (scratch).
kernel void moe_sort_count(constant MoeSortParams& p [[buffer(0)]], device const uint* ids [[buffer(1)]],
                           device uint* counts [[buffer(2)]], uint3 tgid [[threadgroup_position_in_grid]],
                           uint tid [[thread_index_in_threadgroup]], uint3 tpg [[threads_per_threadgroup]]) {
    const uint nthreads = tpg.x;   // 1-D threadgroups (the grid attributes of a kernel share one width)
    threadgroup uint staged[MOE_SORT_THREADS];
    const uint e = tgid.y * nthreads + tid;
    const uint c = sort_block<false>(p, ids, staged, e, tgid.x, tid, nthreads, 0u, counts, counts);
    if (e < p.n_experts) {
        counts[ulong(tgid.x) * p.n_experts + e] = c;
    }
}

// Exclusive prefix sum of one uint per thread over the threadgroup, in thread order; `total` receives
// the sum over all threads. simd_prefix_exclusive_sum within each SIMD-group, one barrier, then every
// SIMD-group scans the per-SIMD-group sums itself. `partial`: one slot per SIMD-group. Call from
// threadgroup-uniform control flow.
inline uint threadgroup_exclusive_sum(uint v, threadgroup uint* partial, uint lane, uint sg, uint nsg,
                                      thread uint& total) {
    const uint before_me = simd_prefix_exclusive_sum(v);
    const uint sg_sum = simd_sum(v);
    if (lane == 0) {
        partial[sg] = sg_sum;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint t = lane < nsg ? partial[lane] : 0u;
    total = simd_sum(t);
    return simd_shuffle(simd_prefix_exclusive_sum(t), ushort(sg)) + before_me;
}

// Expert bases, block offsets and the tile map, in one threadgroup. Thread i owns the experts
// [i per, (i + 1) per), per = ceil(E / MOE_SCAN_THREADS): it sums their counts over the blocks (slots)
// and their tiles (ceil(count / tile_rows)); two threadgroup exclusive sums give its first slot and
// first tile; it then rewrites counts[g, e] as the first slot of block g's pairs of e and writes e's
// tile entries {e, first slot, rows, 0} (rows = tile_rows, the last tile the rest). Entries from the
// total number of tiles up to the capacity are set empty (all zero), striding over the threads, so the
// grouped GEMM's fixed grid finds every entry written. Grid (1, 1, 1) x (MOE_SCAN_THREADS, 1, 1).
// Buffers: 0 params, 1 counts uint [blocks, E] (read, rewritten), 2 tiles uint4 [capacity].
[[kernel, max_total_threads_per_threadgroup(MOE_SCAN_THREADS)]]
void moe_sort_scan(constant MoeSortParams& p [[buffer(0)]], device uint* counts [[buffer(1)]],
                   device uint4* tiles [[buffer(2)]], uint tid [[thread_index_in_threadgroup]],
                   uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]]) {
    threadgroup uint slot_part[MOE_SCAN_THREADS / SIMD_WIDTH];
    threadgroup uint tile_part[MOE_SCAN_THREADS / SIMD_WIDTH];
    const uint E = p.n_experts, t = p.tile_rows;
    const uint per = (E + MOE_SCAN_THREADS - 1u) / MOE_SCAN_THREADS;
    const uint e0 = min(tid * per, E), e1 = min(e0 + per, E);
    uint slots = 0, ntiles = 0;
    for (uint e = e0; e < e1; ++e) {
        uint c = 0;
        device const uint* ce = counts + e;   // column e of the blocks x E counts, stepped by a row
        for (uint g = 0; g < p.blocks; ++g, ce += E) {
            c += *ce;
        }
        slots += c;
        ntiles += (c + t - 1u) / t;
    }
    const uint nsg = MOE_SCAN_THREADS / SIMD_WIDTH;
    uint all_slots, all_tiles;
    uint slot = threadgroup_exclusive_sum(slots, slot_part, lane, sg, nsg, all_slots);
    uint tile = threadgroup_exclusive_sum(ntiles, tile_part, lane, sg, nsg, all_tiles);
    for (uint e = e0; e < e1; ++e) {
        uint run = slot;
        device uint* ce = counts + e;
        for (uint g = 0; g < p.blocks; ++g, ce += E) {
            const uint n = *ce;
            *ce = run;
            run += n;
        }
        for (uint f = slot; f < run; f += t) {
            tiles[tile++] = uint4(e, f, min(t, run - f), 0u);
        }
        slot = run;
    }
    for (uint i = all_tiles + tid; i < p.capacity; i += MOE_SCAN_THREADS) {
        tiles[i] = uint4(0u);
    }
}

// Stable scatter: the count pass again, each thread now handing out the slots of its expert's pairs
// in its block from counts[g, e] (the scan's block offset) in pair order, i.e. (token, j) ascending.
// Thread mapping as moe_sort_count. Buffers: 0 params, 1 ids uint [S], 2 counts uint [blocks, E] (the
// block offsets), 3 slot_of uint [S], 4 slot_rows uint [S].
kernel void moe_sort_scatter(constant MoeSortParams& p [[buffer(0)]], device const uint* ids [[buffer(1)]],
                             device const uint* offsets [[buffer(2)]], device uint* slot_of [[buffer(3)]],
                             device uint* slot_rows [[buffer(4)]], uint3 tgid [[threadgroup_position_in_grid]],
                             uint tid [[thread_index_in_threadgroup]],
                             uint3 tpg [[threads_per_threadgroup]]) {
    const uint nthreads = tpg.x;   // 1-D threadgroups (the grid attributes of a kernel share one width)
    threadgroup uint staged[MOE_SORT_THREADS];
    const uint e = tgid.y * nthreads + tid;
    const uint start = e < p.n_experts ? offsets[ulong(tgid.x) * p.n_experts + e] : 0u;
    sort_block<true>(p, ids, staged, e, tgid.x, tid, nthreads, start, slot_of, slot_rows);
}

// Weighted combine + gated shared expert + residual for M rows:
//   x[m, h] = T(x[m, h] + T(T(sum_j T(w[m, j] T(y[slot_of[m, j], h]))) + T(T(sigmoid(l_m)) shared[m, h])))
// with l_m = logits[m, n_experts] (without a shared expert the bracket ends after the routed sum). The
// k terms are added in order j = 0 .. k-1 (fixed: deterministic under any schedule), with moe_down's
// roundings (moe_weighted, moe_plus_shared). Why one kernel: the k expert outputs of a token, the
// shared expert and the residual add are read once and written once, in the order the decode adds them.
// Thread mapping: grid (ceil(H / t), M, 1) x (t, 1, 1), t = MOE_COMBINE_THREADS (H < 256: H rounded up
// to 32); thread h of row m owns x[m, h]; slot ids and weights are re-read by every thread (cache).
// Buffers: 0 params, 1 y float [S, H], 2 slot_of uint [M, k], 3 weights float [M, k], 4 shared T [M, H]
// (without one: a stand-in, unread), 5 logits float [M, logits_stride], 6 x T [M, H] (read and written).
template <typename T>
kernel void moe_combine(constant MoeCombineParams& p [[buffer(0)]], device const float* y [[buffer(1)]],
                        device const uint* slot_of [[buffer(2)]], device const float* weights [[buffer(3)]],
                        device const T* shared [[buffer(4)]], device const float* logits [[buffer(5)]],
                        device T* x [[buffer(6)]], uint3 gid [[thread_position_in_grid]]) {
    const uint h = gid.x, m = gid.y;
    if (h >= p.H) {
        return;
    }
    float routed = 0.0f;
    const ulong pair0 = ulong(m) * p.k;   // the token's first (slot, weight) pair, formed once
    for (uint j = 0; j < p.k; ++j) {
        const ulong pair = pair0 + j;
        const ulong s = min(slot_of[pair], p.n_slots - 1u);
        // perf-ok(PERF-INT64-LOOP): one row offset per routed slot (k iterations, no inner loop); slots x H can pass 2^32
        routed += moe_weighted<T>(weights[pair], y[s * p.H + h]);
    }
    routed = rnd<T>(routed);   // the sum over the k experts rounded once
    const ulong xi = ulong(m) * p.H + h;
    if (p.shared != 0) {
        const float gate = moe_shared_gate<T>(logits[ulong(m) * p.logits_stride + p.n_experts]);
        routed = moe_plus_shared<T>(routed, gate, float(shared[xi]));
    }
    x[xi] = T(float(x[xi]) + routed);
}

// instantiations (written out: the embedded-source table reads the host names literally)
INSTANTIATE_KERNEL("moe_topk_f32", moe_topk, float)
INSTANTIATE_KERNEL("moe_topk_bf16", moe_topk, bfloat)
INSTANTIATE_KERNEL("moe_combine_f32", moe_combine, float)
INSTANTIATE_KERNEL("moe_combine_bf16", moe_combine, bfloat)
INSTANTIATE_KERNEL("moe_gate_up_q4_sbf16_f32", moe_gate_up, WFMT_Q4, bfloat, float)
INSTANTIATE_KERNEL("moe_gate_up_q4_sbf16_bf16", moe_gate_up, WFMT_Q4, bfloat, bfloat)
INSTANTIATE_KERNEL("moe_down_q4_sbf16_f32", moe_down, WFMT_Q4, bfloat, float)
INSTANTIATE_KERNEL("moe_down_q4_sbf16_bf16", moe_down, WFMT_Q4, bfloat, bfloat)
INSTANTIATE_KERNEL("mlp_gate_up_q4_sbf16_f32", mlp_gate_up, WFMT_Q4, bfloat, float)
INSTANTIATE_KERNEL("mlp_gate_up_q4_sbf16_bf16", mlp_gate_up, WFMT_Q4, bfloat, bfloat)
INSTANTIATE_KERNEL("moe_gate_up_q4_sf32_f32", moe_gate_up, WFMT_Q4, float, float)
INSTANTIATE_KERNEL("moe_gate_up_q4_sf32_bf16", moe_gate_up, WFMT_Q4, float, bfloat)
INSTANTIATE_KERNEL("moe_down_q4_sf32_f32", moe_down, WFMT_Q4, float, float)
INSTANTIATE_KERNEL("moe_down_q4_sf32_bf16", moe_down, WFMT_Q4, float, bfloat)
INSTANTIATE_KERNEL("mlp_gate_up_q4_sf32_f32", mlp_gate_up, WFMT_Q4, float, float)
INSTANTIATE_KERNEL("mlp_gate_up_q4_sf32_bf16", mlp_gate_up, WFMT_Q4, float, bfloat)
INSTANTIATE_KERNEL("moe_gate_up_q8_sbf16_f32", moe_gate_up, WFMT_Q8, bfloat, float)
INSTANTIATE_KERNEL("moe_gate_up_q8_sbf16_bf16", moe_gate_up, WFMT_Q8, bfloat, bfloat)
INSTANTIATE_KERNEL("moe_down_q8_sbf16_f32", moe_down, WFMT_Q8, bfloat, float)
INSTANTIATE_KERNEL("moe_down_q8_sbf16_bf16", moe_down, WFMT_Q8, bfloat, bfloat)
INSTANTIATE_KERNEL("mlp_gate_up_q8_sbf16_f32", mlp_gate_up, WFMT_Q8, bfloat, float)
INSTANTIATE_KERNEL("mlp_gate_up_q8_sbf16_bf16", mlp_gate_up, WFMT_Q8, bfloat, bfloat)
INSTANTIATE_KERNEL("moe_gate_up_q8_sf32_f32", moe_gate_up, WFMT_Q8, float, float)
INSTANTIATE_KERNEL("moe_gate_up_q8_sf32_bf16", moe_gate_up, WFMT_Q8, float, bfloat)
INSTANTIATE_KERNEL("moe_down_q8_sf32_f32", moe_down, WFMT_Q8, float, float)
INSTANTIATE_KERNEL("moe_down_q8_sf32_bf16", moe_down, WFMT_Q8, float, bfloat)
INSTANTIATE_KERNEL("mlp_gate_up_q8_sf32_f32", mlp_gate_up, WFMT_Q8, float, float)
INSTANTIATE_KERNEL("mlp_gate_up_q8_sf32_bf16", mlp_gate_up, WFMT_Q8, float, bfloat)
// the run-time width (routed experts at 2, 3, 5, 6 bits, or two widths in one block)
INSTANTIATE_KERNEL("moe_gate_up_qn_sbf16_f32", moe_gate_up, WFMT_QN, bfloat, float)
INSTANTIATE_KERNEL("moe_gate_up_qn_sbf16_bf16", moe_gate_up, WFMT_QN, bfloat, bfloat)
INSTANTIATE_KERNEL("moe_down_qn_sbf16_f32", moe_down, WFMT_QN, bfloat, float)
INSTANTIATE_KERNEL("moe_down_qn_sbf16_bf16", moe_down, WFMT_QN, bfloat, bfloat)
INSTANTIATE_KERNEL("mlp_gate_up_qn_sbf16_f32", mlp_gate_up, WFMT_QN, bfloat, float)
INSTANTIATE_KERNEL("mlp_gate_up_qn_sbf16_bf16", mlp_gate_up, WFMT_QN, bfloat, bfloat)
INSTANTIATE_KERNEL("moe_gate_up_qn_sf32_f32", moe_gate_up, WFMT_QN, float, float)
INSTANTIATE_KERNEL("moe_gate_up_qn_sf32_bf16", moe_gate_up, WFMT_QN, float, bfloat)
INSTANTIATE_KERNEL("moe_down_qn_sf32_f32", moe_down, WFMT_QN, float, float)
INSTANTIATE_KERNEL("moe_down_qn_sf32_bf16", moe_down, WFMT_QN, float, bfloat)
INSTANTIATE_KERNEL("mlp_gate_up_qn_sf32_f32", mlp_gate_up, WFMT_QN, float, float)
INSTANTIATE_KERNEL("mlp_gate_up_qn_sf32_bf16", mlp_gate_up, WFMT_QN, float, bfloat)
INSTANTIATE_KERNEL("moe_gate_up_bf16_f32", moe_gate_up, WFMT_DENSE, bfloat, float)
INSTANTIATE_KERNEL("moe_gate_up_bf16_bf16", moe_gate_up, WFMT_DENSE, bfloat, bfloat)
INSTANTIATE_KERNEL("moe_down_bf16_f32", moe_down, WFMT_DENSE, bfloat, float)
INSTANTIATE_KERNEL("moe_down_bf16_bf16", moe_down, WFMT_DENSE, bfloat, bfloat)
INSTANTIATE_KERNEL("mlp_gate_up_bf16_f32", mlp_gate_up, WFMT_DENSE, bfloat, float)
INSTANTIATE_KERNEL("mlp_gate_up_bf16_bf16", mlp_gate_up, WFMT_DENSE, bfloat, bfloat)
INSTANTIATE_KERNEL("moe_gate_up_f16_f32", moe_gate_up, WFMT_DENSE, half, float)
INSTANTIATE_KERNEL("moe_gate_up_f16_bf16", moe_gate_up, WFMT_DENSE, half, bfloat)
INSTANTIATE_KERNEL("moe_down_f16_f32", moe_down, WFMT_DENSE, half, float)
INSTANTIATE_KERNEL("moe_down_f16_bf16", moe_down, WFMT_DENSE, half, bfloat)
INSTANTIATE_KERNEL("mlp_gate_up_f16_f32", mlp_gate_up, WFMT_DENSE, half, float)
INSTANTIATE_KERNEL("mlp_gate_up_f16_bf16", mlp_gate_up, WFMT_DENSE, half, bfloat)
INSTANTIATE_KERNEL("moe_gate_up_f32_f32", moe_gate_up, WFMT_DENSE, float, float)
INSTANTIATE_KERNEL("moe_gate_up_f32_bf16", moe_gate_up, WFMT_DENSE, float, bfloat)
INSTANTIATE_KERNEL("moe_down_f32_f32", moe_down, WFMT_DENSE, float, float)
INSTANTIATE_KERNEL("moe_down_f32_bf16", moe_down, WFMT_DENSE, float, bfloat)
INSTANTIATE_KERNEL("mlp_gate_up_f32_f32", mlp_gate_up, WFMT_DENSE, float, float)
INSTANTIATE_KERNEL("mlp_gate_up_f32_bf16", mlp_gate_up, WFMT_DENSE, float, bfloat)
// the union-read MoE of R rows
INSTANTIATE_KERNEL("moe_gate_up_rows_q4_sbf16_f32", moe_gate_up_rows, WFMT_Q4, bfloat, float)
INSTANTIATE_KERNEL("moe_down_rows_q4_sbf16_f32", moe_down_rows, WFMT_Q4, bfloat, float)
INSTANTIATE_KERNEL("moe_gate_up_rows_q4_sbf16_bf16", moe_gate_up_rows, WFMT_Q4, bfloat, bfloat)
INSTANTIATE_KERNEL("moe_down_rows_q4_sbf16_bf16", moe_down_rows, WFMT_Q4, bfloat, bfloat)
INSTANTIATE_KERNEL("moe_gate_up_rows_q4_sf32_f32", moe_gate_up_rows, WFMT_Q4, float, float)
INSTANTIATE_KERNEL("moe_down_rows_q4_sf32_f32", moe_down_rows, WFMT_Q4, float, float)
INSTANTIATE_KERNEL("moe_gate_up_rows_q4_sf32_bf16", moe_gate_up_rows, WFMT_Q4, float, bfloat)
INSTANTIATE_KERNEL("moe_down_rows_q4_sf32_bf16", moe_down_rows, WFMT_Q4, float, bfloat)
INSTANTIATE_KERNEL("moe_gate_up_rows_q8_sbf16_f32", moe_gate_up_rows, WFMT_Q8, bfloat, float)
INSTANTIATE_KERNEL("moe_down_rows_q8_sbf16_f32", moe_down_rows, WFMT_Q8, bfloat, float)
INSTANTIATE_KERNEL("moe_gate_up_rows_q8_sbf16_bf16", moe_gate_up_rows, WFMT_Q8, bfloat, bfloat)
INSTANTIATE_KERNEL("moe_down_rows_q8_sbf16_bf16", moe_down_rows, WFMT_Q8, bfloat, bfloat)
INSTANTIATE_KERNEL("moe_gate_up_rows_q8_sf32_f32", moe_gate_up_rows, WFMT_Q8, float, float)
INSTANTIATE_KERNEL("moe_down_rows_q8_sf32_f32", moe_down_rows, WFMT_Q8, float, float)
INSTANTIATE_KERNEL("moe_gate_up_rows_q8_sf32_bf16", moe_gate_up_rows, WFMT_Q8, float, bfloat)
INSTANTIATE_KERNEL("moe_down_rows_q8_sf32_bf16", moe_down_rows, WFMT_Q8, float, bfloat)
INSTANTIATE_KERNEL("moe_gate_up_rows_qn_sbf16_f32", moe_gate_up_rows, WFMT_QN, bfloat, float)
INSTANTIATE_KERNEL("moe_down_rows_qn_sbf16_f32", moe_down_rows, WFMT_QN, bfloat, float)
INSTANTIATE_KERNEL("moe_gate_up_rows_qn_sbf16_bf16", moe_gate_up_rows, WFMT_QN, bfloat, bfloat)
INSTANTIATE_KERNEL("moe_down_rows_qn_sbf16_bf16", moe_down_rows, WFMT_QN, bfloat, bfloat)
INSTANTIATE_KERNEL("moe_gate_up_rows_qn_sf32_f32", moe_gate_up_rows, WFMT_QN, float, float)
INSTANTIATE_KERNEL("moe_down_rows_qn_sf32_f32", moe_down_rows, WFMT_QN, float, float)
INSTANTIATE_KERNEL("moe_gate_up_rows_qn_sf32_bf16", moe_gate_up_rows, WFMT_QN, float, bfloat)
INSTANTIATE_KERNEL("moe_down_rows_qn_sf32_bf16", moe_down_rows, WFMT_QN, float, bfloat)
INSTANTIATE_KERNEL("moe_gate_up_rows_bf16_f32", moe_gate_up_rows, WFMT_DENSE, bfloat, float)
INSTANTIATE_KERNEL("moe_down_rows_bf16_f32", moe_down_rows, WFMT_DENSE, bfloat, float)
INSTANTIATE_KERNEL("moe_gate_up_rows_bf16_bf16", moe_gate_up_rows, WFMT_DENSE, bfloat, bfloat)
INSTANTIATE_KERNEL("moe_down_rows_bf16_bf16", moe_down_rows, WFMT_DENSE, bfloat, bfloat)
INSTANTIATE_KERNEL("moe_gate_up_rows_f16_f32", moe_gate_up_rows, WFMT_DENSE, half, float)
INSTANTIATE_KERNEL("moe_down_rows_f16_f32", moe_down_rows, WFMT_DENSE, half, float)
INSTANTIATE_KERNEL("moe_gate_up_rows_f16_bf16", moe_gate_up_rows, WFMT_DENSE, half, bfloat)
INSTANTIATE_KERNEL("moe_down_rows_f16_bf16", moe_down_rows, WFMT_DENSE, half, bfloat)
INSTANTIATE_KERNEL("moe_gate_up_rows_f32_f32", moe_gate_up_rows, WFMT_DENSE, float, float)
INSTANTIATE_KERNEL("moe_down_rows_f32_f32", moe_down_rows, WFMT_DENSE, float, float)
INSTANTIATE_KERNEL("moe_gate_up_rows_f32_bf16", moe_gate_up_rows, WFMT_DENSE, float, bfloat)
INSTANTIATE_KERNEL("moe_down_rows_f32_bf16", moe_down_rows, WFMT_DENSE, float, bfloat)

// The sparse MoE block of one decode token, and the dense SwiGLU MLP, after the router GEMV (qmv with
// float output over the stacked [router rows | shared_expert_gate row], metal/quant.metal):
//
//   moe_topk_f32        logits[0, E) -> softmax (float) -> top-k (ties: lower expert index first)
//                       -> renormalised (optional): ids uint [k], weights float [k]
//   moe_gate_up_<w>_<T> act[s, :inter] = silu(gate_{ids[s]} x) * up_{ids[s]} x for s < k, and
//                       act[k, :shared_inter] for the shared expert (its stacked [gate | up] matrix)
//   moe_down_<w>_<T>    x[:H] += sum_s weights[s] down_{ids[s]} act[s]
//                                + sigmoid(logits[E]) shared_down act[k]     (in place: the residual add)
//   mlp_gate_up_<w>_<T> act[:inter] = silu(gate x) * up x over one stacked [gate | up] matrix
// <w> as in quant.metal (q4_sbf16, ..., bf16, f16, f32); the shared expert has the routed experts'
// format (its group size may differ).
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
    float probs[MOE_MAX_EXPERTS / SIMD_WIDTH];
    const uint per = (n + SIMD_WIDTH - 1u) / SIMD_WIDTH;
    float m = logits[0];
    for (uint e = lane; e < n; e += SIMD_WIDTH) {
        m = max(m, logits[e]);
    }
    m = simd_max(m);
    float s = 0.0f;
    for (uint j = 0; j < per; ++j) {
        const uint e = lane + j * SIMD_WIDTH;
        probs[j] = e < n ? exp(logits[e] - m) : 0.0f;
        s += probs[j];
    }
    s = simd_sum(s);
    for (uint j = 0; j < per; ++j) {
        probs[j] = probs[j] / s;
    }
    float prev_v = 2.0f;  // above every probability: round 0 may take any expert
    uint prev_i = 0;
    float mine_v = 0.0f, total = 0.0f;
    uint mine_i = 0;
    for (uint r = 0; r < k; ++r) {
        float bv = -1.0f;  // below every probability
        uint bi = 0xFFFFFFFFu;
        for (uint j = 0; j < per; ++j) {
            const uint e = lane + j * SIMD_WIDTH;
            const float v = probs[j];
            const bool below = v < prev_v || (v == prev_v && e > prev_i);
            if (e < n && below && v > bv) {
                bv = v;
                bi = e;
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

// Router top-k on its own (one SIMD-group). Why on the GPU: the expert ids then never visit the host,
// so gate/up and down can be encoded in the same command buffer right after the router GEMV. The
// decode graph fuses it into moe_gate_up instead (one dependency level fewer); this kernel is the
// same function, tested on its own.
kernel void moe_topk_f32(constant MoeTopkParams& p [[buffer(0)]], device const float* logits [[buffer(1)]],
                         device uint* ids [[buffer(2)]], device float* weights [[buffer(3)]],
                         uint lane [[thread_index_in_simdgroup]]) {
    uint id;
    float w;
    route_topk<float>(logits, p.n_experts, p.k, p.norm != 0, lane, id, w);
    if (lane < p.k) {
        ids[lane] = id;
        weights[lane] = w;
    }
}

// 4 outputs act[row0 .. row0+3] = silu(g) * u of one SIMD-group: rows_dot over the gate rows, then
// over the up rows (qmv's loop twice; x is re-read from cache, weights once).
template <int FMT, typename S, typename T, typename WP, typename SP, typename XP>
inline void swiglu_rows(WP gw, SP gs_, SP gb, WP uw, SP us, SP ub, XP x4, uint K, uint gsz, uint row0, uint nrows,
                        uint lane, device T* act) {
    float g[QMV_ROWS], u[QMV_ROWS];
    rows_dot<FMT, S, T>(gw, gs_, gb, x4, K, gsz, row0, nrows, lane, g);
    rows_dot<FMT, S, T>(uw, us, ub, x4, K, gsz, row0, nrows, lane, u);
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
kernel void moe_gate_up(constant MoeGateUpParams& p [[buffer(0)]], device const uint32_t* gw [[buffer(1)]],
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
        const ulong wo = e * matrix_units<FMT, S, T>(p.inter, p.K);
        const ulong so = e * matrix_scales<FMT, S, T>(p.inter, p.K, p.group_size);
        swiglu_rows<FMT, S, T>((device const WV*)gw + wo, gsc + so, gbi + so, (device const WV*)uw + wo, usc + so,
                               ubi + so, x4, p.K, p.group_size, row0, p.inter, lane, arow);
    } else {
        if (row0 >= p.shared_inter) {
            return;
        }
        const ulong wo = matrix_units<FMT, S, T>(p.shared_inter, p.K);
        const ulong so = matrix_scales<FMT, S, T>(p.shared_inter, p.K, p.shared_group_size);
        device const WV* sw = (device const WV*)shw;
        swiglu_rows<FMT, S, T>(sw, shsc, shbi, sw + wo, shsc + so, shbi + so, x4, p.K, p.shared_group_size, row0,
                               p.shared_inter, lane, arow);
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
// one: any buffer, unused), 7 act [k (+1), act_stride], 8 ids uint [k], 9 weights float [k],
// 10 the shared-gate logit float [1] (the router GEMV's row n_experts), 11 x [H] (read and written).
template <int FMT, typename S, typename T>
kernel void moe_down(constant MoeDownParams& p [[buffer(0)]], device const uint32_t* dw [[buffer(1)]],
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
    const ulong wpe = matrix_units<FMT, S, T>(p.H, p.inter);
    const ulong spe = matrix_scales<FMT, S, T>(p.H, p.inter, p.group_size);
    device const WV* dv = (device const WV*)dw;
    float total[QMV_ROWS];
    for (uint r = 0; r < QMV_ROWS; ++r) {
        total[r] = 0.0f;
    }
    for (uint s = 0; s < p.k; ++s) {
        const ulong e = min(ids[s], p.count - 1u);
        const float ws = weights[s];
        device const vec<T, 4>* a4 = (device const vec<T, 4>*)(act + ulong(s) * p.act_stride);
        float d[QMV_ROWS];
        rows_dot<FMT, S, T>(dv + e * wpe, dsc + e * spe, dbi + e * spe, a4, p.inter, p.group_size, row0, p.H, lane, d);
        for (uint r = 0; r < QMV_ROWS; ++r) {
            total[r] += rnd<T>(ws * rnd<T>(d[r]));   // bf16 graph: expert output and weighted output rounded
        }
    }
    for (uint r = 0; r < QMV_ROWS; ++r) {
        total[r] = rnd<T>(total[r]);                 // ... the sum over the k experts rounded once
    }
    if (p.shared_inter != 0) {
        device const vec<T, 4>* a4 = (device const vec<T, 4>*)(act + ulong(p.k) * p.act_stride);
        float d[QMV_ROWS];
        rows_dot<FMT, S, T>((device const WV*)shw, shsc, shbi, a4, p.shared_inter, p.shared_group_size, row0, p.H,
                            lane, d);
        const float gate = rnd<T>(1.0f / (1.0f + exp(-shared_logit[0])));
        for (uint r = 0; r < QMV_ROWS; ++r) {
            total[r] = rnd<T>(total[r] + rnd<T>(gate * rnd<T>(d[r])));   // routed + gated shared, rounded
        }
    }
    if (lane == 0) {
        for (uint r = 0; r < QMV_ROWS && row0 + r < p.H; ++r) {
            x[row0 + r] = T(float(x[row0 + r]) + total[r]);
        }
    }
}

// Dense SwiGLU MLP gate/up (qwen3_next layers without experts): the shared-expert path of
// moe_gate_up on its own. Grid (ceil(inter / 8), 1, 1) x (32, 2, 1), 4 outputs per SIMD-group.
// Buffers: 0 params, 1-3 the [gate | up] matrix [2 inter, K], 4 x [K], 5 act [inter].
template <int FMT, typename S, typename T>
kernel void mlp_gate_up(constant MlpGateUpParams& p [[buffer(0)]], device const uint32_t* w [[buffer(1)]],
                        device const S* scales [[buffer(2)]], device const S* biases [[buffer(3)]],
                        device const T* x [[buffer(4)]], device T* act [[buffer(5)]],
                        uint3 tgid [[threadgroup_position_in_grid]], uint lane [[thread_index_in_simdgroup]],
                        uint sg [[simdgroup_index_in_threadgroup]]) {
    typedef typename WDot<FMT, S, T>::wvec WV;
    const uint row0 = (tgid.x * QMV_SIMDGROUPS + sg) * QMV_ROWS;
    if (row0 >= p.inter) {
        return;
    }
    const ulong wo = matrix_units<FMT, S, T>(p.inter, p.K);
    const ulong so = matrix_scales<FMT, S, T>(p.inter, p.K, p.group_size);
    device const WV* wv = (device const WV*)w;
    swiglu_rows<FMT, S, T>(wv, scales, biases, wv + wo, scales + so, biases + so, (device const vec<T, 4>*)x, p.K,
                           p.group_size, row0, p.inter, lane, act);
}

// instantiations (written out: the embedded-source table reads the host names literally)
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

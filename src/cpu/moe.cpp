#include "cpu/moe.h"

#include <cmath>

#include "cpu/norm.h"

namespace qwenmetal::cpu {

// output rows per MoE task (gate/up: rows of I per expert; down: rows of H over all experts): 64 rather
// than 16 so that a prefill GEMM call covers enough rows for the AMX kernel to reuse its transposed
// operand (docs/cpu.md). Decode (GEMV) tasks are longer, one weight stream each: 128 rows of one
// expert's gate and up, 256 rows of one expert's down projection (measured with per-section timers:
// gate/up 4.38 → 4.17 ms, down 2.88 → 2.55 ms per token on the 8-layer model)
constexpr int64_t kMoeRows = 64, kMoeDecodeRowsGU = 128, kMoeDecodeRowsDown = 256;

void route_token(const float* logits, int64_t E, int64_t k, bool norm_topk, int32_t* idx, float* wts, float* probs) {
    float mx = logits[0];
    for (int64_t e = 1; e < E; ++e) mx = logits[e] > mx ? logits[e] : mx;
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) {
        probs[e] = std::exp(logits[e] - mx);
        sum += probs[e];
    }
    for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
    for (int64_t j = 0; j < k; ++j) {      // repeated argmax: ties go to the lower expert id
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e) {
            bool taken = false;
            for (int64_t i = 0; i < j; ++i) taken |= idx[i] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        idx[j] = static_cast<int32_t>(best);
        wts[j] = probs[best];
    }
    if (norm_topk) {
        float s = 0.f;
        for (int64_t j = 0; j < k; ++j) s += wts[j];
        for (int64_t j = 0; j < k; ++j) wts[j] /= s;
    }
}

// shared layout (floats): logits L*E | probs E | wts L*k | sg L | hs L*2*Is | idx L*k (int) | pair order
// L*k (int) | expert start E+1 (int) | slot of each expert E (int) | slots of a batch E (int) | He L*k*I
// (SwiGLU outputs, in expert order) | decode down outputs (L*k + L)*H for L <= gemv_rows. L is the
// largest chunk; a call's last chunk may be shorter and take the decode path, so that part is sized for
// min(L, gemv_rows) tokens whatever L is.
size_t moe_shared_floats(const MoeDims& d, int64_t L, int64_t gemv_rows) {
    const int64_t P = L * d.k;
    // decode (a chunk of <= gemv_rows tokens — also the last chunk of a longer call): per-slot down outputs
    const int64_t Ld = L < gemv_rows ? L : gemv_rows, dec = (Ld * d.k + Ld) * d.H;
    return size_t(L * d.E + d.E + P + L + 2 * L * d.Is + P + P + d.E + 1 + 2 * d.E + P * d.I + dec + 64);
}

size_t moe_thread_floats(const MoeDims& d, int64_t L) {
    (void)L;
    const int64_t mx = d.H > d.I ? d.H : d.I;
    return size_t(2 * kMoeRows * 64 + 2 * mx + 64);
}

// prepared inputs: the L token rows (width H), the L*k SwiGLU rows (width I), the L shared rows (width Is)
size_t moe_xvec_floats(const MoeDims& d, int64_t L) {
    return size_t(L * xvec_floats(d.H) + L * d.k * xvec_floats(d.I) + L * xvec_floats(d.Is > 0 ? d.Is : 1));
}
size_t moe_xvec_count(const MoeDims& d, int64_t L) { return size_t(L * (2 + 2 * d.k)); }   // + a pointer scratch of L*k

void moe_forward(ThreadPool& pool, Workspace& ws, float* shared, const MoeWeights& w, const MoeDims& d,
                 const float* xn, int64_t L, float* x) {
    const Kernels& kk = kernels();
    const int64_t H = d.H, E = d.E, I = d.I, Is = d.Is, k = d.k, P = L * k;
    const bool has_shared = w.shared_down_proj != nullptr && Is > 0;
    float* logits = shared;
    float* probs = logits + L * E;
    float* wts = probs + E;
    float* sg = wts + P;
    float* hs = sg + L;                                  // [L][2*Is]: gate | up, then silu(gate)*up in place
    int32_t* idx = reinterpret_cast<int32_t*>(hs + 2 * L * Is);
    int32_t* order = idx + P;                            // pairs sorted by expert (pair = t*k + slot)
    int32_t* estart = order + P;                         // [E+1]
    int32_t* slot_of = estart + E + 1;                   // [E]: the stack index holding expert e
    int32_t* bslot = slot_of + E;                        // [E]: slots of one streamed batch
    float* He = reinterpret_cast<float*>(bslot + E);     // [P][I] in expert order

    // 1. router logits, shared-expert gate/up and the shared-expert gate scalar: one section on xn
    //    (this also prepares the L token rows as XVecs 0..L-1, reused by the experts below)
    {
        LinearOut outs[4];
        int n = 0;
        outs[n++] = {w.router, logits, E, false};
        if (has_shared) {
            outs[n++] = {w.shared_gate_proj, hs, 2 * Is, false};
            outs[n++] = {w.shared_up_proj, hs + Is, 2 * Is, false};
            outs[n++] = {w.shared_expert_gate, sg, 1, false};
        }
        linear(pool, ws, xn, L, H, outs, n);
    }
    // 2. routing + grouping by expert (counting sort, stable: token order within an expert)
    for (int64_t t = 0; t < L; ++t) route_token(logits + t * E, E, k, w.norm_topk, idx + t * k, wts + t * k, probs);
    for (int64_t e = 0; e <= E; ++e) estart[e] = 0;
    for (int64_t p = 0; p < P; ++p) ++estart[idx[p] + 1];
    for (int64_t e = 0; e < E; ++e) estart[e + 1] += estart[e];
    int32_t* cursor = reinterpret_cast<int32_t*>(probs);   // reuse: E ints
    for (int64_t e = 0; e < E; ++e) cursor[e] = estart[e];
    for (int64_t p = 0; p < P; ++p) order[cursor[idx[p]]++] = static_cast<int32_t>(p);
    int64_t n_active = 0;
    int32_t* elist = cursor;                              // experts with tokens, ascending
    for (int64_t e = 0; e < E; ++e)
        if (estart[e + 1] > estart[e]) elist[n_active++] = static_cast<int32_t>(e);
    if (has_shared)
        for (int64_t t = 0; t < L; ++t) {
            sg[t] = sigmoid(sg[t]);
            float* h = hs + t * 2 * Is;
            kk.silu_mul(h, h + Is, Is);
        }
    // input rows: XVec t (t < L) = token t (prepared by linear() above); L + q = SwiGLU row of pair
    // slot q (expert order); L + P + t = shared-expert row of token t
    const XVec** xv = ws.xvp.data();
    const XVec** tok_of_slot = xv + L + P + L;           // scratch pointer array: token XVec of each slot
    for (int64_t q = 0; q < P; ++q) tok_of_slot[q] = xv[order[q] / k];
    const size_t xoff = size_t(L) * xvec_floats(H);      // the SwiGLU rows' XVec data, then the shared rows'
    if (has_shared) prepare_xvecs(ws, hs, L, 2 * Is, Is, L + P, xoff + size_t(P) * xvec_floats(I));

    const bool dec = L <= ws.gemv_rows;
    const int64_t RG = dec ? kMoeDecodeRowsGU : kMoeRows;
    const int64_t nb_i = (I + RG - 1) / RG;
    float* Y = He + P * I;                               // decode: [P + L][H] pair outputs, then shared rows
    // The active experts elist[b0, b1) (their pairs are the contiguous run estart[elist[b0]] ..
    // estart[elist[b1-1] + 1) of the expert order), read from stack index slot_of[e]; `last`: the shared
    // expert's down projection too. Resident: one batch of all active experts, slot_of[e] = e.
    auto run_batch = [&](int64_t b0, int64_t b1, bool last) {
        const int64_t nbe = b1 - b0, q_lo = estart[elist[b0]], q_hi = estart[elist[b1 - 1] + 1];
        // 3. gate/up + SwiGLU: tasks = (expert with tokens) x (block of rows of I); an expert's weights
        //    are read once for all of its tokens
        pool.run(nbe * nb_i, [&](int64_t task, int th) {
            const int64_t e = elist[b0 + task / nb_i];
            const int64_t r0 = (task % nb_i) * RG, r1 = (r0 + RG < I) ? r0 + RG : I;
            const int64_t p0 = estart[e], ne = estart[e + 1] - p0;
            const WMat Wg = w.gate->at(slot_of[e]), Wu = w.up->at(slot_of[e]);
            float* gb = ws.t(th);                           // [up to 64 tokens][RG]
            float* ub = gb + kMoeRows * 64;
            for (int64_t q0 = 0; q0 < ne; q0 += 64) {
                const int64_t nq = (ne - q0 < 64) ? ne - q0 : 64;
                const XVec* const* X = tok_of_slot + p0 + q0;
                if (nq <= ws.gemv_rows) {          // each token bit for bit its one-token GEMV
                    kk.gemv_multi(Wg, X, nq, gb - r0, RG, r0, r1, false);
                    kk.gemv_multi(Wu, X, nq, ub - r0, RG, r0, r1, false);
                } else {
                    kk.gemm_x(Wg, X, nq, gb - r0, kMoeRows, r0, r1, false);
                    kk.gemm_x(Wu, X, nq, ub - r0, kMoeRows, r0, r1, false);
                }
                for (int64_t q = 0; q < nq; ++q) {
                    float* hq = He + (p0 + q0 + q) * I + r0;
                    for (int64_t r = 0; r < r1 - r0; ++r) hq[r] = gb[q * RG + r];
                    kk.silu_mul(hq, ub + q * RG, r1 - r0);
                }
            }
        });
        // prepare the batch's SwiGLU rows as inputs of the down projections
        {
            float* base = ws.xvec.data() + xoff;
            const int q8 = ws.planes;
            pool.run((q_hi - q_lo + 15) / 16, [&](int64_t b, int) {
                for (int64_t q = q_lo + b * 16; q < q_hi && q < q_lo + (b + 1) * 16; ++q) {
                    kk.xvec_prepare(He + q * I, I, base + q * xvec_floats(I), &ws.xv[L + q], q8);
                    ws.xvp[L + q] = &ws.xv[L + q];
                }
            });
        }
        // 4. down projections. Decode: one task per (matrix, 256-row block), each a single weight
        //    stream, into per-pair rows Y (summed into x after the last batch). Prefill: tasks own
        //    blocks of 64 output rows and loop over the batch's experts (ascending id), then the shared
        //    expert after the last batch, so each (token, row) is summed by one task at a time in a
        //    fixed order. Neither depends on the thread count or on the batching.
        if (dec) {
            const int64_t RD = kMoeDecodeRowsDown, nbd = (H + RD - 1) / RD;
            const int64_t n_mat = nbe + (last && has_shared ? 1 : 0);
            pool.run(n_mat * nbd, [&](int64_t task, int) {
                const int64_t a = task / nbd, r0 = (task % nbd) * RD, r1 = (r0 + RD < H) ? r0 + RD : H;
                if (a < nbe) {
                    const int64_t e = elist[b0 + a], p0 = estart[e], ne = estart[e + 1] - p0;
                    const WMat Wd = w.down->at(slot_of[e]);
                    kk.gemv_multi(Wd, ws.xvp.data() + L + p0, ne, Y + p0 * H, H, r0, r1, false);
                } else {
                    kk.gemv_multi(*w.shared_down_proj, ws.xvp.data() + L + P, L, Y + P * H, H, r0, r1, false);
                }
            });
            return;
        }
        const int64_t nb_h = (H + kMoeRows - 1) / kMoeRows;
        pool.run(nb_h, [&](int64_t task, int th) {
            const int64_t r0 = task * kMoeRows, r1 = (r0 + kMoeRows < H) ? r0 + kMoeRows : H, n = r1 - r0;
            float* yb = ws.t(th);                           // [up to 64 tokens][kMoeRows]
            for (int64_t a = b0; a < b1; ++a) {
                const int64_t e = elist[a];
                const int64_t p0 = estart[e], ne = estart[e + 1] - p0;
                const WMat Wd = w.down->at(slot_of[e]);
                for (int64_t q0 = 0; q0 < ne; q0 += 64) {
                    const int64_t nq = (ne - q0 < 64) ? ne - q0 : 64;
                    const XVec* const* X = ws.xvp.data() + L + p0 + q0;
                    if (nq <= kGemvMaxRows)
                        for (int64_t q = 0; q < nq; ++q) kk.gemv(Wd, *X[q], yb + q * kMoeRows - r0, r0, r1, false);
                    else
                        kk.gemm_x(Wd, X, nq, yb - r0, kMoeRows, r0, r1, false);
                    for (int64_t q = 0; q < nq; ++q) {
                        const int64_t p = order[p0 + q0 + q], t = p / k;
                        const float wt = wts[p];
                        for (int64_t r = 0; r < n; ++r) x[t * H + r0 + r] += wt * yb[q * kMoeRows + r];
                    }
                }
            }
            if (last && has_shared)
                for (int64_t t0 = 0; t0 < L; t0 += 64) {
                    const int64_t nt = (L - t0 < 64) ? L - t0 : 64;
                    const XVec* const* X = ws.xvp.data() + L + P + t0;
                    if (nt <= kGemvMaxRows)
                        for (int64_t q = 0; q < nt; ++q)
                            kk.gemv(*w.shared_down_proj, *X[q], yb + q * kMoeRows - r0, r0, r1, false);
                    else
                        kk.gemm_x(*w.shared_down_proj, X, nt, yb - r0, kMoeRows, r0, r1, false);
                    for (int64_t q = 0; q < nt; ++q)
                        for (int64_t r = 0; r < n; ++r) x[(t0 + q) * H + r0 + r] += sg[t0 + q] * yb[q * kMoeRows + r];
                }
        });
    };
    if (w.cache == nullptr) {
        for (int64_t e = 0; e < E; ++e) slot_of[e] = static_cast<int32_t>(e);
        run_batch(0, n_active, true);
    } else {
        const int64_t S = w.cache->slots_per_layer();
        for (int64_t b0 = 0; b0 < n_active; b0 += S) {     // n_active >= 1: every token picks k >= 1 experts
            const int64_t b1 = (b0 + S < n_active) ? b0 + S : n_active;
            w.cache->acquire(w.layer, elist + b0, static_cast<int>(b1 - b0), bslot);
            for (int64_t a = b0; a < b1; ++a) slot_of[elist[a]] = bslot[a - b0];
            run_batch(b0, b1, b1 == n_active);
        }
    }
    if (dec) {                                           // the decode sums, experts ascending then shared
        for (int64_t a = 0; a < n_active; ++a) {
            const int64_t e = elist[a];
            for (int64_t q = estart[e]; q < estart[e + 1]; ++q) {
                const int64_t p = order[q], t = p / k;
                kk.axpy(x + t * H, wts[p], Y + q * H, H);
            }
        }
        if (has_shared)
            for (int64_t t = 0; t < L; ++t) kk.axpy(x + t * H, sg[t], Y + (P + t) * H, H);
    }
}

size_t mlp_shared_floats(int64_t I, int64_t L) { return size_t(2 * L * I + 16); }

void mlp_forward(ThreadPool& pool, Workspace& ws, float* shared, const WMat& gate, const WMat& up, const WMat& down,
                 const float* xn, int64_t L, int64_t H, float* x) {
    const int64_t I = gate.rows;
    float* h = shared;     // [L][2I]
    LinearOut outs[2] = {{&gate, h, 2 * I, false}, {&up, h + I, 2 * I, false}};
    linear(pool, ws, xn, L, H, outs, 2);
    for (int64_t t = 0; t < L; ++t)
        kernels().silu_mul(h + t * 2 * I, h + t * 2 * I + I, I);
    LinearOut o = {&down, x, H, true};
    linear(pool, ws, h, L, 2 * I, &o, 1);
}

}  // namespace qwenmetal::cpu

#include "cpu/gdn.h"

#include <cmath>
#include <limits>

#include "cpu/norm.h"

namespace qwenmetal::cpu {

void gdn_conv_silu(ThreadPool& pool, const float* x, int64_t ldx, int64_t L, int64_t C, int64_t K, const float* wT,
                   float* state, float* out, int64_t ldo) {
    const Kernels& kk = kernels();
    const int64_t blk = 256, nblk = (C + blk - 1) / blk, S = K - 1;
    pool.run(nblk, [&](int64_t b, int) {
        const int64_t c0 = b * blk, c1 = (c0 + blk < C) ? c0 + blk : C;
        for (int64_t t = 0; t < L; ++t) {
            float* o = out + t * ldo;
            for (int64_t c = c0; c < c1; ++c) o[c] = 0.f;
            for (int64_t j = 0; j < K; ++j) {       // input row t+j of [state; x]
                const int64_t r = t + j;
                const float* src = r < S ? state + r * C : x + (r - S) * ldx;
                const float* w = wT + j * C;
                for (int64_t c = c0; c < c1; ++c) o[c] += w[c] * src[c];
            }
            kk.silu_mul(o + c0, nullptr, c1 - c0);
        }
        for (int64_t r = 0; r < S; ++r) {           // new state = last K-1 rows of [state; x]
            const int64_t src = L + r;
            float* dst = state + r * C;
            if (src < S) {
                const float* s = state + src * C;
                for (int64_t c = c0; c < c1; ++c) dst[c] = s[c];
            } else {
                const float* s = x + (src - S) * ldx;
                for (int64_t c = c0; c < c1; ++c) dst[c] = s[c];
            }
        }
    });
}

void gdn_prepare_token(const GdnDims& d, float* act, const float* b, const float* a, const float* A_neg_exp,
                       const float* dt_bias, float* beta, float* g) {
    const float qscale = 1.f / std::sqrt(static_cast<float>(d.dk));
    float* q = act;
    float* k = act + d.nk * d.dk;
    for (int64_t h = 0; h < d.nk; ++h) {
        l2_normalize(q + h * d.dk, d.dk, d.eps, qscale);
        l2_normalize(k + h * d.dk, d.dk, d.eps, 1.f);
    }
    for (int64_t h = 0; h < d.nv; ++h) {
        beta[h] = sigmoid(b[h]);
        g[h] = A_neg_exp[h] * softplus(a[h] + dt_bias[h]);
    }
}

void gdn_recurrent_head(const Kernels& kk, float* S, int64_t L, const float* q, const float* k, const float* v,
                        int64_t ld, const float* beta, const float* g, int64_t ldbg, float* o, int64_t ldo,
                        int64_t dk, int64_t dv) {
    for (int64_t t = 0; t < L; ++t)
        kk.gdn_step(S, dv, dk, q + t * ld, k + t * ld, v + t * ld, beta[t * ldbg], std::exp(g[t * ldbg]), o + t * ldo);
}

size_t gdn_chunk_floats(int64_t dk, int64_t dv) {
    const int64_t C = kGdnChunk;
    return size_t(3 * C * C + 2 * C + C * (6 * dk + 4 * dv) + dk * dv + 64);
}

// Per value head, state S [dv][dk] (MLX layout), tokens t < L with rows at stride ld (q, k, v) and
// ldbg (beta, g), output rows at stride ldo. Notation as reference.gdn_chunked (HF layout S^T). Every
// product is a gemm_nn whose right operand is built (or kept) row-major [K][N], so no product transposes
// an operand: the state is worked on as S^T [dk][dv] (transposed once per call, in and out), k also as
// k^T [dk][C] for k_i.k_j and q_i.k_j, and the chunk's left operands of the state update as (.)^T.
void gdn_chunked_head(const Kernels& kk, float* S, int64_t L, const float* q, const float* k, const float* v,
                      int64_t ld, const float* beta, const float* g, int64_t ldbg, float* o, int64_t ldo, int64_t dk,
                      int64_t dv, float* scratch) {
    const int64_t C = kGdnChunk;
    float* KK = scratch;               // [C][C]  k_i.k_j, then Lmat
    float* QK = KK + C * C;            // [C][C]  q_i.k_j, then M
    float* Ti = QK + C * C;            // [C][C]  T^-1
    float* bV = Ti + C * C;            // [C][dv] beta v
    float* bK = bV + C * dv;           // [C][dk] beta gamma k
    float* U = bK + C * dk;            // [C][dv]
    float* Wm = U + C * dv;            // [C][dk]
    float* Vn = Wm + C * dk;           // [C][dv] V_new
    float* KdT = Vn + C * dv;          // [dk][C] (exp(G_C - G_i) k_i)^T
    float* QS = KdT + dk * C;          // [C][dv]
    float* G = QS + C * dv;            // [C]
    float* gam = G + C;                // [C]
    float* Kc = gam + C;               // [C][dk] contiguous copies of this chunk's k and q, and k^T
    float* Qc = Kc + C * dk;
    float* KcT = Qc + C * dk;          // [dk][C]
    float* ST = KcT + dk * C;          // [dk][dv] the state, transposed
    for (int64_t e = 0; e < dv; ++e)
        for (int64_t j = 0; j < dk; ++j) ST[j * dv + e] = S[e * dk + j];
    for (int64_t c0 = 0; c0 < L; c0 += C) {
        const int64_t n = (L - c0 < C) ? L - c0 : C;
        for (int64_t i = 0; i < n; ++i) {
            for (int64_t e = 0; e < dk; ++e) {
                Kc[i * dk + e] = KcT[e * C + i] = k[(c0 + i) * ld + e];
                Qc[i * dk + e] = q[(c0 + i) * ld + e];
            }
            G[i] = (i ? G[i - 1] : 0.f) + g[(c0 + i) * ldbg];
            gam[i] = std::exp(G[i]);
        }
        kk.gemm_nn(Kc, dk, n, KcT, C, n, dk, KK, C, false);       // k_i . k_j
        kk.gemm_nn(Qc, dk, n, KcT, C, n, dk, QK, C, false);       // q_i . k_j
        for (int64_t i = 0; i < n; ++i) {
            const float bi = beta[(c0 + i) * ldbg];
            for (int64_t j = 0; j < n; ++j) {
                const float D = j <= i ? std::exp(G[i] - G[j]) : 0.f;     // masked before exp
                KK[i * C + j] = j < i ? bi * KK[i * C + j] * D : 0.f;    // Lmat (strictly lower)
                QK[i * C + j] = j <= i ? QK[i * C + j] * D : 0.f;        // M (lower, incl. diagonal)
            }
        }
        // T^-1 by forward substitution: row i = e_i - sum_{j<i} Lmat_ij row_j
        for (int64_t i = 0; i < n; ++i) {
            float* ti = Ti + i * C;
            for (int64_t j = 0; j < n; ++j) ti[j] = j == i ? 1.f : 0.f;
            for (int64_t j = 0; j < i; ++j) {
                const float lij = KK[i * C + j];
                if (lij != 0.f) {
                    const float* tj = Ti + j * C;
                    for (int64_t m = 0; m <= j; ++m) ti[m] -= lij * tj[m];
                }
            }
        }
        for (int64_t i = 0; i < n; ++i) {
            const float bi = beta[(c0 + i) * ldbg], bg = bi * gam[i];
            for (int64_t e = 0; e < dv; ++e) bV[i * dv + e] = bi * v[(c0 + i) * ld + e];
            for (int64_t e = 0; e < dk; ++e) bK[i * dk + e] = bg * Kc[i * dk + e];
        }
        kk.gemm_nn(Ti, C, n, bV, dv, dv, n, U, dv, false);        // U = T^-1 (beta v)
        kk.gemm_nn(Ti, C, n, bK, dk, dk, n, Wm, dk, false);       // W = T^-1 (beta gamma k)
        kk.gemm_nn(Wm, dk, n, ST, dv, dv, dk, Vn, dv, false);     // W S^T
        kk.gemm_nn(Qc, dk, n, ST, dv, dv, dk, QS, dv, false);     // q S^T
        for (int64_t e = 0; e < n * dv; ++e) Vn[e] = U[e] - Vn[e];
        // O = (gamma q) S^T + M V_new
        for (int64_t i = 0; i < n; ++i) {
            float* oi = o + (c0 + i) * ldo;
            for (int64_t e = 0; e < dv; ++e) oi[e] = gam[i] * QS[i * dv + e];
        }
        kk.gemm_nn(QK, C, n, Vn, dv, dv, n, o + c0 * ldo, ldo, true);
        // S^T = gamma_C S^T + (k exp(G_C - G))^T V_new
        const float GC = G[n - 1], gC = gam[n - 1];
        for (int64_t i = 0; i < n; ++i) {
            const float f = std::exp(GC - G[i]);
            for (int64_t e = 0; e < dk; ++e) KdT[e * C + i] = f * Kc[i * dk + e];
        }
        for (int64_t e = 0; e < dv * dk; ++e) ST[e] *= gC;
        kk.gemm_nn(KdT, C, dk, Vn, dv, dv, n, ST, dv, true);
    }
    for (int64_t e = 0; e < dv; ++e)
        for (int64_t j = 0; j < dk; ++j) S[e * dk + j] = ST[j * dv + e];
}

}  // namespace qwenmetal::cpu

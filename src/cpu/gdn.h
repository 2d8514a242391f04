// Gated DeltaNet family (docs/model.md §4.4, §6).
//  * gdn_conv_silu: depthwise causal conv (kernel K, taps transposed to [K][C] at load so the loop runs
//    along channels) with its K-1 row state, then SiLU; state updated in place.
//  * gdn_prepare_token: split q|k|v, L2-normalise q and k per key head (q also times dk^-0.5),
//    beta = sigmoid(b), g = -exp(A_log)·softplus(a + dt_bias) in fp32 log space.
//  * gdn_recurrent_head: the fp32 state update S <- exp(g)S; S += beta(v - S k) ⊗ k; o = S q, one pass
//    over the state rows per token (decode).
//  * gdn_chunked_head: the chunked WY/UT form over sub-chunks of C tokens (prefill): cumulative log
//    decay, masked decay matrix, unit-lower-triangular T inverted by forward substitution, then the
//    state is read and written once per sub-chunk instead of once per token, with the inner products
//    done as small row-major GEMMs (gemm_nn) on operands built in that layout.
// Heads are independent: the forward pass splits both over value heads; the gated RMSNorm is applied
// per head right after (norm.h).
#pragma once
#include <cstdint>

#include "core/threadpool.h"
#include "cpu/kernels.h"

namespace qwenmetal::cpu {

void gdn_conv_silu(ThreadPool& pool, const float* x, int64_t ldx, int64_t L, int64_t C, int64_t K, const float* wT,
                   float* state, float* out, int64_t ldo);

struct GdnDims {
    int64_t nk, nv, dk, dv;
    float eps;           // l2norm eps (1e-6)
};

// act: one token's conv output [q(nk*dk) | k(nk*dk) | v(nv*dv)], normalised in place; b, a: [nv]
void gdn_prepare_token(const GdnDims& d, float* act, const float* b, const float* a, const float* A_neg_exp,
                       const float* dt_bias, float* beta, float* g);

void gdn_recurrent_head(const Kernels& kk, float* S, int64_t L, const float* q, const float* k, const float* v,
                        int64_t ld, const float* beta, const float* g, int64_t ldbg, float* o, int64_t ldo,
                        int64_t dk, int64_t dv);

constexpr int64_t kGdnChunk = 64;
size_t gdn_chunk_floats(int64_t dk, int64_t dv);
void gdn_chunked_head(const Kernels& kk, float* S, int64_t L, const float* q, const float* k, const float* v,
                      int64_t ld, const float* beta, const float* g, int64_t ldbg, float* o, int64_t ldo, int64_t dk,
                      int64_t dv, float* scratch);

}  // namespace qwenmetal::cpu

// Host functions of metal/gdn.metal: the Gated DeltaNet layer of one decode token after its
// stacked input projection [qkv | z | b | a] (quant: qmv).
#pragma once
#include "gpu/ops/common.h"

namespace qwenmetal::gpu::ops {

struct GdnShape {
    uint32_t nk, nv, dk, dv, conv_kernel;      // heads, head dims, conv taps (config.json)
    uint32_t conv_dim() const { return 2 * nk * dk + nv * dv; }
    uint32_t value_dim() const { return nv * dv; }
};

// Causal depthwise conv step + SiLU: act[c] = silu(sum_j conv_w[c, j] * window_j[c]) over the window
// (conv_state rows oldest first, then qkv); the shifted window goes to conv_out (f32 [K-1, conv_dim]),
// which may be conv_state itself (in place) or its ping-pong partner.
// qkv (T) is the first conv_dim elements of the projection; conv_w f32 [conv_dim, K]; act T [conv_dim].
void gdn_conv(Encoder& e, Act t, const GdnShape& s, const Buffer& qkv, const Buffer& conv_w,
              const Buffer& conv_state, const Buffer& conv_out, const Buffer& act);

// One token of the recurrence, per value head (one threadgroup each): q, k l2-normalised (q scaled
// by dk^-1/2), beta = sigmoid(b), g = exp(-exp(A_log) * softplus(a + dt_bias)); S = g S;
// S += k (beta (v - S^T k))^T; o = S^T q; y = rmsnorm(o) * norm_w * silu(z) (eps).
// act T [conv_dim] (q | k | v); z T [value_dim]; b, a T [nv] (the projection's tail); A_log, dt_bias
// f32 [nv]; norm_w T [dv]; state f32 [nv, dv, dk] read, the updated state written to state_out
// (the same buffer: in place; another: ping-pong, so a discarded step leaves the state intact); y T [value_dim].
void gdn_step(Encoder& e, Act t, const GdnShape& s, const Buffer& act, const Buffer& z, const Buffer& b,
              const Buffer& a, const Buffer& A_log, const Buffer& dt_bias, const Buffer& norm_w, float eps,
              const Buffer& state, const Buffer& state_out, const Buffer& y);

}  // namespace qwenmetal::gpu::ops

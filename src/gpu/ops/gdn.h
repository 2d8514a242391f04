// Host functions of metal/gdn.metal: the Gated DeltaNet layer after its stacked input projection
// [qkv | z | b | a] (quant: qmv / gemm), for one decode token (gdn_conv, gdn_step) or a prefill chunk of M
// tokens (gdn_conv with rows, gdn_prefill: the register scan or the chunked WY/UT form).
#pragma once
#include "gpu/ops/common.h"

namespace qwenmetal::gpu::ops {

struct GdnShape {
    uint32_t nk, nv, dk, dv, conv_kernel;      // heads, head dims, conv taps (config.json)
    uint32_t conv_dim() const { return 2 * nk * dk + nv * dv; }
    uint32_t value_dim() const { return nv * dv; }
};

// Causal depthwise conv + SiLU over `rows` tokens: act[m, c] = silu(sum_j conv_w[c, j] * win[m + j][c]) over the
// window win = (conv_state rows oldest first, then the qkv rows); the last K-1 window rows go to conv_out
// (f32 [K-1, conv_dim]), which may be conv_state itself (in place) or its ping-pong partner.
// qkv T [rows, qkv_stride] (the first conv_dim columns: the projection rows; qkv_stride 0 = conv_dim);
// conv_w f32 [conv_dim, K]; act T [rows, conv_dim].
void gdn_conv(Encoder& e, Act t, const GdnShape& s, const Buffer& qkv, const Buffer& conv_w,
              const Buffer& conv_state, const Buffer& conv_out, const Buffer& act, uint32_t rows = 1,
              uint32_t qkv_stride = 0);

// One token of the recurrence, per value head (one threadgroup each): q, k l2-normalised (q scaled
// by dk^-1/2), beta = sigmoid(b), g = exp(-exp(A_log) * softplus(a + dt_bias)); S = g S;
// S += k (beta (v - S^T k))^T; o = S^T q; y = rmsnorm(o) * norm_w * silu(z) (eps).
// act T [conv_dim] (q | k | v); z T [value_dim]; b, a T [nv] (the projection's tail); A_log, dt_bias
// f32 [nv]; norm_w T [dv]; state f32 [nv, dv, dk] read, the updated state written to state_out
// (the same buffer: in place; another: ping-pong, so a discarded step leaves the state intact); y T [value_dim].
void gdn_step(Encoder& e, Act t, const GdnShape& s, const Buffer& act, const Buffer& z, const Buffer& b,
              const Buffer& a, const Buffer& A_log, const Buffer& dt_bias, const Buffer& norm_w, float eps,
              const Buffer& state, const Buffer& state_out, const Buffer& y);

// A verification's rows chained through one state (GpuEngine::verify), in 2 dispatches whatever the rows:
// every row's state goes to a slot of a ring (one buffer `slab` of `slots` states, each state_bytes apart: conv
// (K-1) conv_dim f32, recurrent nv dv dk f32): the rows read slot `in`, row r writes slot (first + r) mod slots.
// Row r is bit for bit gdn_conv / gdn_step of one token on the state row r - 1 left. Needs 1 <= rows < slots and
// `in` none of the rows' slots (the state before the rows survives them: the exact rewind).
struct GdnRingSlots {
    uint32_t slots = 0, in = 0, first = 0;
};
// The conv of `rows` tokens: qkv T [rows, qkv_stride] (0: conv_dim); conv_w f32 [conv_dim, K]; conv_slab f32
// [slots, K-1, conv_dim]; act T [rows, conv_dim].
void gdn_conv_rows(Encoder& e, Act t, const GdnShape& s, const Buffer& qkv, const Buffer& conv_w,
                   const Buffer& conv_slab, const GdnRingSlots& ring, const Buffer& act, uint32_t rows,
                   uint32_t qkv_stride = 0);
// The recurrence of `rows` tokens after gdn_conv_rows: act T [rows, conv_dim]; proj T [rows, proj_stride] the
// stacked in-projection rows [qkv | z | b | a] (as gdn_prefill); ssm_slab f32 [slots, nv, dv, dk]; y T rows of
// value_dim, y_stride elements apart (0: value_dim).
void gdn_step_rows(Encoder& e, Act t, const GdnShape& s, const Buffer& act, const Buffer& proj, uint32_t proj_stride,
                   const Buffer& A_log, const Buffer& dt_bias, const Buffer& norm_w, float eps,
                   const Buffer& ssm_slab, const GdnRingSlots& ring, const Buffer& y, uint32_t rows,
                   uint32_t y_stride = 0);

// M tokens of the recurrence after gdn_conv: act T [M, conv_dim] (q | k | v); proj T [M, proj_stride] the stacked
// in-projection rows [qkv | z | b | a] (z at column conv_dim, b at conv_dim + value_dim, a after b); A_log,
// dt_bias f32 [nv]; norm_w T [dv]; state f32 [nv, dv, dk] read, the state after the M tokens written to
// state_out (same buffer or disjoint); y T [M, value_dim] (gated RMSNorm output, as gdn_step).
//   Scan:    gdn_step's kernel over the M tokens (one dispatch, state in registers, tokens in order).
//   Chunked: gdn_prep (normalised q/k, beta, g into scratch), gdn_chunk (blocks of `block` tokens, 1..64;
//            0 = the fewest blocks of <= 64 tokens, balanced, on simdgroup_matrix), gdn_norm (3 dispatches); needs dk, dv multiples of 8 and
//            dk <= GDN_CHUNK_MAX_DK, and scratch of gdn_prefill_scratch_bytes(s, M) bytes.
//   Auto:    gdn_route(s, M).
enum class GdnRoute : uint8_t { Auto = 0, Scan = 1, Chunked = 2 };
void gdn_prefill(Encoder& e, Act t, const GdnShape& s, const Buffer& act, const Buffer& proj, uint32_t proj_stride,
                 const Buffer& A_log, const Buffer& dt_bias, const Buffer& norm_w, float eps, const Buffer& state,
                 const Buffer& state_out, const Buffer& y, uint32_t M, const Buffer& scratch,
                 GdnRoute route = GdnRoute::Auto, uint32_t block = 0);
// scratch of the chunked route for up to max_rows tokens (float: q, k [max_rows + 64, nk, dk], beta, g
// [max_rows + 64, nv], o [max_rows, nv dv])
uint64_t gdn_prefill_scratch_bytes(const GdnShape& s, uint32_t max_rows);

// The cost model of the two routes for M tokens (declared flops and bytes of their dispatches, and a
// modelled time: see gdn_prefill_cost in gdn.cpp for the constants). A model, not a measurement.
struct GdnCost {
    uint64_t flops = 0, bytes = 0;   // summed over the route's dispatches, as they declare them
    uint32_t dispatches = 0;
    double seconds = 0;              // modelled: dispatch levels + critical path + max(flops, bytes) roofline
};
GdnCost gdn_prefill_cost(const GdnShape& s, uint32_t M, GdnRoute route, uint32_t block = 0);
// Scan or Chunked: the route with the lower modelled time (Scan when the shape does not fit the chunked kernel)
GdnRoute gdn_route(const GdnShape& s, uint32_t M);
// "auto" / "scan" / "chunked" (the Python options' and bindings' names); parse throws invalid_argument
GdnRoute parse_gdn_route(const std::string& name);
const char* gdn_route_name(GdnRoute r);
// whether the chunked kernel supports the shape (dk, dv multiples of 8, dk <= GDN_CHUNK_MAX_DK)
bool gdn_chunked_fits(const GdnShape& s);

}  // namespace qwenmetal::gpu::ops

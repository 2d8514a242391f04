// TEMPORARY (branch graph only; each part is deleted when the kernel branch providing the real function
// merges): the interface contract's prefill host functions built from the decode kernels, row by row,
// in the same command buffer, so the chunked graph (forward.cpp) runs and is tested before they land.
#pragma once
#include <algorithm>

#include "gpu/ops/attention.h"
#include "gpu/ops/gemm.h"
#include "gpu/ops/gdn.h"
#include "gpu/ops/moe.h"
#include "gpu/ops/quant.h"

namespace qwenmetal::gpu::ops {

// ---- gemm route (branch tensor) ----
inline GemmRoute gemm_route(const DeviceInfo&) { return GemmRoute::Simdgroup; }

// ---- gdn (branch gdn) ----
enum class GdnRoute : uint8_t { Auto = 0, Scan = 1, Chunked = 2 };
inline uint64_t gdn_prefill_scratch_bytes(const GdnShape&, uint32_t) { return 16; }
inline void gdn_conv(Encoder& e, Act t, const GdnShape& s, const Buffer& qkv, const Buffer& conv_w,
                     const Buffer& conv_state, const Buffer& conv_out, const Buffer& act, uint32_t rows,
                     uint32_t qkv_stride) {
    const uint64_t es = act_size(t), cd = s.conv_dim();
    for (uint32_t r = 0; r < rows; ++r)
        gdn_conv(e, t, s, qkv.view(r * qkv_stride * es, cd * es), conv_w, r ? conv_out : conv_state, conv_out,
                 act.view(r * cd * es, cd * es));
}
inline void gdn_prefill(Encoder& e, Act t, const GdnShape& s, const Buffer& act, const Buffer& proj,
                        uint32_t proj_stride, const Buffer& A_log, const Buffer& dt_bias, const Buffer& norm_w,
                        float eps, const Buffer& state, const Buffer& state_out, const Buffer& y, uint32_t M,
                        const Buffer&, GdnRoute = GdnRoute::Auto) {
    const uint64_t es = act_size(t), cd = s.conv_dim(), vd = s.value_dim(), nv = s.nv;
    for (uint32_t r = 0; r < M; ++r) {
        const Buffer p = proj.view(r * proj_stride * es, proj_stride * es);
        gdn_step(e, t, s, act.view(r * cd * es, cd * es), p.view(cd * es, vd * es), p.view((cd + vd) * es, nv * es),
                 p.view((cd + vd + nv) * es, nv * es), A_log, dt_bias, norm_w, eps, r ? state_out : state, state_out,
                 y.view(r * vd * es, vd * es));
    }
}

// ---- attention (branch attn) ----
inline void attn_prepare(Encoder& e, Act t, const AttnShape& s, const Buffer& proj, const Buffer& q_norm_w,
                         const Buffer& k_norm_w, uint32_t position, const KVCache& kv, const Buffer& q_out,
                         uint32_t rows, uint32_t proj_stride) {
    const uint64_t es = act_size(t), qd = uint64_t(s.n_heads) * s.head_dim;
    for (uint32_t r = 0; r < rows; ++r)
        attn_prepare(e, t, s, proj.view(r * proj_stride * es, proj_stride * es), q_norm_w, k_norm_w, position + r, kv,
                     q_out.view(r * qd * es, qd * es));
}
inline void attention_prefill(Encoder& e, Act t, const AttnShape& s, const Buffer& q, const Buffer& proj,
                              uint32_t proj_stride, const KVCache& kv, uint32_t p0, uint32_t M, const Buffer& o) {
    const uint64_t es = act_size(t), qd = uint64_t(s.n_heads) * s.head_dim;
    AttnPolicy pol;
    pol.single_pass_max = UINT32_MAX;
    const Buffer scratch = e.device().alloc(std::max<uint64_t>(attention_scratch_bytes(s, p0 + M, pol), 16), "shim");
    for (uint32_t r = 0; r < M; ++r)
        attention_decode(e, t, s, pol, q.view(r * qd * es, qd * es), proj.view(r * proj_stride * es, proj_stride * es),
                         kv, p0 + r + 1, scratch, o.view(r * qd * es, qd * es));
}

}  // namespace qwenmetal::gpu::ops

#include "gpu/ops/gdn.h"

#include <cmath>

#include "metal/gdn.h"

namespace qwenmetal::gpu::ops {

namespace {
void check_shape(const GdnShape& s, const char* op) {
    check(s.nk > 0 && s.nv > 0 && s.dk > 0 && s.dv > 0, op, "nk, nv, dk and dv must be positive");
    check(s.nv % s.nk == 0, op,
          "nv (" + std::to_string(s.nv) + ") must be a multiple of nk (" + std::to_string(s.nk) + ")");
    check(s.conv_kernel >= 2, op, "conv_kernel must be at least 2, got " + std::to_string(s.conv_kernel));
    check(uint64_t(2) * s.nk * s.dk + uint64_t(s.nv) * s.dv <= UINT32_MAX, op, "conv_dim exceeds 2^32 - 1");
}
}  // namespace

void gdn_conv(Encoder& e, Act t, const GdnShape& s, const Buffer& qkv, const Buffer& conv_w,
              const Buffer& conv_state, const Buffer& conv_out, const Buffer& act) {
    const char* op = "gdn_conv";
    check_shape(s, op);
    const uint32_t C = s.conv_dim(), K = s.conv_kernel;
    const uint64_t es = act_size(t), nx = uint64_t(C) * es, nw = uint64_t(C) * K * 4,
                   ns = uint64_t(C) * (K - 1) * 4;
    need(qkv, nx, op, "qkv");
    need(conv_w, nw, op, "conv_w");
    need(conv_state, ns, op, "conv_state");
    need(conv_out, ns, op, "conv_out");
    need(act, nx, op, "act");
    const bool same = same_or_disjoint(conv_out, conv_state, ns, op, "conv_out", "conv_state");
    const GdnConvParams p{C, K};
    e.dispatch(std::string("gdn_conv_") + act_suffix(t), Dims{ceil_div(C, GDN_CONV_THREADS), 1, 1},
               Dims{GDN_CONV_THREADS, 1, 1},
               {Arg::params(p), Arg::in(qkv.view(0, nx)), Arg::in(conv_w.view(0, nw)),
                same ? Arg::inout(conv_state.view(0, ns)) : Arg::in(conv_state.view(0, ns)),
                same ? Arg::inout(conv_out.view(0, ns), 0, 0) : Arg::out(conv_out.view(0, ns)),
                Arg::out(act.view(0, nx))});
}

void gdn_step(Encoder& e, Act t, const GdnShape& s, const Buffer& act, const Buffer& z, const Buffer& b,
              const Buffer& a, const Buffer& A_log, const Buffer& dt_bias, const Buffer& norm_w, float eps,
              const Buffer& state, const Buffer& state_out, const Buffer& y) {
    const char* op = "gdn_step";
    check_shape(s, op);
    check(s.dk <= GDN_STEP_MAX_DK, op,
          "dk = " + std::to_string(s.dk) + " exceeds GDN_STEP_MAX_DK = " + std::to_string(GDN_STEP_MAX_DK) +
              " (32 lanes x GDN_STEP_MAX_DK_PER_LANE elements per lane)");
    check(s.dv <= GDN_STEP_MAX_DV, op,
          "dv = " + std::to_string(s.dv) + " exceeds GDN_STEP_MAX_DV = " + std::to_string(GDN_STEP_MAX_DV));
    const uint64_t es = act_size(t), nact = uint64_t(s.conv_dim()) * es, nz = uint64_t(s.value_dim()) * es,
                   nh = uint64_t(s.nv) * es, nhf = uint64_t(s.nv) * 4, nw = uint64_t(s.dv) * es,
                   nst = uint64_t(s.nv) * s.dv * s.dk * 4;
    need(act, nact, op, "act");
    need(z, nz, op, "z");
    need(b, nh, op, "b");
    need(a, nh, op, "a");
    need(A_log, nhf, op, "A_log");
    need(dt_bias, nhf, op, "dt_bias");
    need(norm_w, nw, op, "norm_w");
    need(state, nst, op, "state");
    need(state_out, nst, op, "state_out");
    need(y, nz, op, "y");
    const bool same = same_or_disjoint(state_out, state, nst, op, "state_out", "state");
    const GdnStepParams p{s.nk, s.nv, s.dk, s.dv, s.nv / s.nk, float(1.0 / std::sqrt(double(s.dk))),
                          GDN_L2NORM_EPS, eps};
    const uint32_t nsg = s.dv < GDN_STEP_MAX_SIMDGROUPS ? s.dv : GDN_STEP_MAX_SIMDGROUPS;
    e.dispatch(std::string("gdn_step_") + act_suffix(t), Dims{s.nv, 1, 1}, Dims{32 * nsg, 1, 1},
               {Arg::params(p), Arg::in(act.view(0, nact)), Arg::in(z.view(0, nz)), Arg::in(b.view(0, nh)),
                Arg::in(a.view(0, nh)), Arg::in(A_log.view(0, nhf)), Arg::in(dt_bias.view(0, nhf)),
                Arg::in(norm_w.view(0, nw)),
                same ? Arg::inout(state.view(0, nst)) : Arg::in(state.view(0, nst)),
                same ? Arg::inout(state_out.view(0, nst), 0, 0) : Arg::out(state_out.view(0, nst)),
                Arg::out(y.view(0, nz))});
}

}  // namespace qwenmetal::gpu::ops

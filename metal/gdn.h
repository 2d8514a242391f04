// gdn family: parameters shared by metal/gdn.metal and its host functions (src/gpu/ops/gdn.cpp).
// uint32_t comes from <metal_stdlib> in kernels and from <cstdint> on the host (src/gpu/ops/gdn.cpp includes
// it first, through gpu/ops/gdn.h); the header itself includes nothing, as tools/msl_lint.py requires.
#pragma once

struct GdnConvParams {
    uint32_t C;     // channels (conv_dim = 2 nk dk + nv dv)
    uint32_t K;     // taps (conv_kernel); the state holds K - 1 rows
};
static_assert(sizeof(GdnConvParams) == 8, "GdnConvParams: 2 x 4 bytes, as the host packs it");

struct GdnStepParams {
    uint32_t nk, nv;   // key heads, value heads (nv a multiple of nk)
    uint32_t dk, dv;   // head dims
    uint32_t group;    // nv / nk: value head h reads key head h / group
    float q_scale;     // dk^-1/2, rounded to float by the host (as the reference's F32(dk ** -0.5))
    float l2_eps;      // added to sum(x^2) in the q/k l2norm (GDN_L2NORM_EPS)
    float eps;         // added to mean(o^2) in the gated RMSNorm (rms_norm_eps)
};
static_assert(sizeof(GdnStepParams) == 32, "GdnStepParams: 8 x 4 bytes, as the host packs it");

// gdn_conv: one thread per channel
#define GDN_CONV_THREADS 256u
// gdn_step: one threadgroup per value head; min(dv, GDN_STEP_MAX_SIMDGROUPS) SIMD-groups, SIMD-group
// sg owns state rows sg, sg + nsg, ...; lane l owns dk elements l, l + 32, ... of each row (at most
// GDN_STEP_MAX_DK_PER_LANE of them, so dk <= 32 * GDN_STEP_MAX_DK_PER_LANE); o of the head is staged in
// threadgroup memory for the norm (dv <= GDN_STEP_MAX_DV).
#define GDN_STEP_MAX_SIMDGROUPS 32u
#define GDN_STEP_MAX_DK_PER_LANE 8u
#define GDN_STEP_MAX_DK (32u * GDN_STEP_MAX_DK_PER_LANE)
#define GDN_STEP_MAX_DV 1024u
#define GDN_L2NORM_EPS 1e-6f

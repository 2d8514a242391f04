// The Gated DeltaNet's per-channel conv arithmetic, shared by gdn_conv (metal/gdn.metal) and the conv
// epilogue of the decode in-projection (qmv with QMV_CONV, metal/quant.metal), so that both compute the
// same float operations in the same order: the fused decode step is bit for bit the unfused one.
// Kernel-side only (no host declarations).
#pragma once
#include "common.h"

// overflow-free logistic function, as the reference's sigmoid
inline float gdn_sigmoid(float x) {
    const float e = exp(-fabs(x));
    return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

// the conv output of one channel and token from its K-tap accumulation: rounded to T, then MLX's silu
// (sigmoid rounded, product rounded), as the bf16 graph computes it
template <typename T>
inline T gdn_conv_silu(float acc) {
    const float xr = rnd<T>(acc);
    return T(xr * rnd<T>(gdn_sigmoid(xr)));
}

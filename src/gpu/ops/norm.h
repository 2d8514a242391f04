// Host functions of metal/norm.metal.
#pragma once
#include "gpu/ops/common.h"

namespace qwenmetal::gpu::ops {

// y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w          x, y [rows, H]; w [H]
void rmsnorm(Encoder& e, Act t, const Buffer& x, const Buffer& w, const Buffer& y, uint32_t rows, uint32_t H,
             float eps);
// h = x + r (stored, may alias x); y = rmsnorm(h) * w  x, r, h, y [rows, H]; w [H]
void add_rmsnorm(Encoder& e, Act t, const Buffer& x, const Buffer& r, const Buffer& w, const Buffer& h,
                 const Buffer& y, uint32_t rows, uint32_t H, float eps);

// y[r] = (x[r] - mean(x[r])) * rsqrt(var(x[r]) + eps) * w + b   x, y T [rows, H]; w, b T [H] (the vision tower)
void layer_norm(Encoder& e, Act t, const Buffer& x, const Buffer& w, const Buffer& b, const Buffer& y, uint32_t rows,
                uint32_t H, float eps);
// y[r] = float(x[r])                                   x T [rows, H]; y f32 [rows, H] (exact: T widens)
void copy_f32(Encoder& e, Act t, const Buffer& x, const Buffer& y, uint32_t rows, uint32_t H);

}  // namespace qwenmetal::gpu::ops

// Norm family: RMSNorm (statistics in fp32, shifted weight), the GDN gated RMSNorm, L2 norm, and the
// scalar activations, written to match python/qwenmetal/reference.py operation for operation.
#pragma once
#include <cmath>
#include <cstdint>

#include "core/threadpool.h"

namespace qwenmetal::cpu {

inline float sigmoid(float x) {           // overflow-free, as reference.sigmoid
    const float e = std::exp(-std::fabs(x));
    return x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
}
inline float silu(float x) { return x * sigmoid(x); }
inline float softplus(float x) { return (x > 0.f ? x : 0.f) + std::log1p(std::exp(-std::fabs(x))); }

// out = x * rsqrt(mean(x^2) + eps) * w over one row of n (out may alias x)
void rms_norm(const float* x, const float* w, float eps, float* out, int64_t n);
// the same over `rows` rows of stride ld, split over threads when there are many
void rms_norm_rows(ThreadPool& pool, const float* x, int64_t ld, int64_t rows, const float* w, float eps, float* out,
                   int64_t ldo, int64_t n);
// out = x * rsqrt(mean(x^2)+eps) * w * silu(z)   (GDN output norm, one head)
void gated_rms_norm(const float* x, const float* z, const float* w, float eps, float* out, int64_t n);
// x *= scale / sqrt(sum(x^2) + eps)   (eps on the sum, as HF/FLA l2norm)
void l2_normalize(float* x, int64_t n, float eps, float scale);

}  // namespace qwenmetal::cpu

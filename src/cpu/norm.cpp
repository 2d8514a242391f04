#include "cpu/norm.h"

namespace qwenmetal::cpu {

void rms_norm(const float* x, const float* w, float eps, float* out, int64_t n) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

void rms_norm_rows(ThreadPool& pool, const float* x, int64_t ld, int64_t rows, const float* w, float eps, float* out,
                   int64_t ldo, int64_t n) {
    if (rows * n < 65536) {
        for (int64_t r = 0; r < rows; ++r) rms_norm(x + r * ld, w, eps, out + r * ldo, n);
        return;
    }
    const int64_t per = 16;
    pool.run((rows + per - 1) / per, [&](int64_t t, int) {
        const int64_t r1 = (t + 1) * per < rows ? (t + 1) * per : rows;
        for (int64_t r = t * per; r < r1; ++r) rms_norm(x + r * ld, w, eps, out + r * ldo, n);
    });
}

void gated_rms_norm(const float* x, const float* z, const float* w, float eps, float* out, int64_t n) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i] * silu(z[i]);
}

void l2_normalize(float* x, int64_t n, float eps, float scale) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    const float f = (1.f / std::sqrt(ss + eps)) * scale;
    for (int64_t i = 0; i < n; ++i) x[i] *= f;
}

}  // namespace qwenmetal::cpu

#include "cpu/attention.h"

#include <cmath>
#include <limits>

#include "cpu/norm.h"

namespace qwenmetal::cpu {

void rope_inv_freq(double theta, int64_t rotary_dim, float* inv_freq) {
    for (int64_t d = 0; d < rotary_dim / 2; ++d)
        inv_freq[d] = static_cast<float>(std::pow(theta, -2.0 * static_cast<double>(d) / static_cast<double>(rotary_dim)));
}

static void rope_row(float* x, int64_t half, const float* cs, const float* sn) {
    for (int64_t d = 0; d < half; ++d) {
        const float x1 = x[d], x2 = x[d + half];
        x[d] = x1 * cs[d] - x2 * sn[d];
        x[d + half] = x2 * cs[d] + x1 * sn[d];
    }
}

void attn_qk_rope_kv_write(const AttnDims& d, float* q, float* k, int64_t k_row, const float* v, int64_t v_row,
                           int64_t L, int64_t pos0, const float* q_norm, const float* k_norm, const float* inv_freq,
                           const KVCacheView& cache, int64_t rope_delta, const int32_t* pair_pos) {
    const int64_t half = d.rotary_dim / 2, kvrow = d.nkv * d.hd;
    float cs[1024], sn[1024];
    for (int64_t i = 0; i < L; ++i) {
        const float pos = static_cast<float>(pos0 + i + rope_delta);
        for (int64_t j = 0; j < half; ++j) {
            const float p = pair_pos ? static_cast<float>(pair_pos[i * half + j]) : pos;
            const float ang = p * inv_freq[j];                   // float32 angle, accurate cos/sin
            cs[j] = static_cast<float>(std::cos(static_cast<double>(ang)));
            sn[j] = static_cast<float>(std::sin(static_cast<double>(ang)));
        }
        for (int64_t h = 0; h < d.nh; ++h) {
            float* qh = q + i * d.q_row + h * d.q_stride;
            rms_norm(qh, q_norm, d.eps, qh, d.hd);
            rope_row(qh, half, cs, sn);
        }
        const int64_t t = pos0 + i;
        for (int64_t h = 0; h < d.nkv; ++h) {
            float* kh = k + i * k_row + h * d.hd;
            rms_norm(kh, k_norm, d.eps, kh, d.hd);
            rope_row(kh, half, cs, sn);
            const float* vh = v + i * v_row + h * d.hd;
            if (cache.f32) {
                float* kc = static_cast<float*>(cache.k) + t * kvrow + h * d.hd;
                float* vc = static_cast<float*>(cache.v) + t * kvrow + h * d.hd;
                for (int64_t e = 0; e < d.hd; ++e) {
                    kc[e] = kh[e];
                    vc[e] = vh[e];
                }
            } else {
                uint16_t* kc = static_cast<uint16_t*>(cache.k) + t * kvrow + h * d.hd;
                uint16_t* vc = static_cast<uint16_t*>(cache.v) + t * kvrow + h * d.hd;
                for (int64_t e = 0; e < d.hd; ++e) {
                    kc[e] = f32_to_bf16(kh[e]);
                    vc[e] = f32_to_bf16(vh[e]);
                }
            }
        }
    }
}

size_t attention_thread_floats(const AttnDims& d) {
    const int64_t G = d.nh / d.nkv;
    return size_t(G * kAttnKeyBlock + G * d.hd + 2 * G + 16);
}

size_t attention_shared_floats(const AttnDims& d, int64_t L, int64_t T) {
    if (L != 1) return 0;
    const int64_t G = d.nh / d.nkv, nsplit = (T + kAttnSplit - 1) / kAttnSplit;
    return size_t(d.nkv * nsplit * G * (d.hd + 2));
}

// keys [t0, t1) of kv head j for the G query heads qh[g]: running max m, sum l, unnormalised acc
static void attend_range(const Kernels& kk, const float* const* qh, int64_t G, int64_t hd, float scale,
                         const KVCacheView& c, int64_t row, int64_t off, int64_t t0, int64_t t1, float* m, float* l,
                         float* acc, float* s) {
    const float ninf = -std::numeric_limits<float>::infinity();
    for (int64_t g = 0; g < G; ++g) {
        m[g] = ninf;
        l[g] = 0.f;
        for (int64_t e = 0; e < hd; ++e) acc[g * hd + e] = 0.f;
    }
    const size_t es = c.f32 ? 4 : 2;
    for (int64_t b0 = t0; b0 < t1; b0 += kAttnKeyBlock) {
        const int64_t nb = (t1 - b0 < kAttnKeyBlock) ? t1 - b0 : kAttnKeyBlock;
        const size_t at = size_t(b0 * row + off) * es;
        kk.attn_block(qh, G, static_cast<const char*>(c.k) + at, static_cast<const char*>(c.v) + at, c.f32, row, nb,
                      hd, scale, m, l, acc, s, kAttnKeyBlock);
    }
}

void attention(ThreadPool& pool, Workspace& ws, float* shared, const AttnDims& d, const float* q, int64_t L,
               int64_t pos0, const KVCacheView& cache, float* out, int64_t ldo) {
    const Kernels& kk = kernels();
    const int64_t G = d.nh / d.nkv, hd = d.hd, row = d.nkv * d.hd;
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    if (L == 1) {
        const int64_t T = pos0 + 1, nsplit = (T + kAttnSplit - 1) / kAttnSplit, part = G * (hd + 2);
        pool.run(d.nkv * nsplit, [&](int64_t task, int th) {
            const int64_t j = task / nsplit, sp = task % nsplit;
            float* base = ws.t(th);
            const float* qh[256];
            for (int64_t g = 0; g < G; ++g) qh[g] = q + (j * G + g) * d.q_stride;
            float* p = shared + task * part;          // [m G][l G][acc G*hd]
            const int64_t t0 = sp * kAttnSplit, t1 = (t0 + kAttnSplit < T) ? t0 + kAttnSplit : T;
            attend_range(kk, qh, G, hd, scale, cache, row, j * hd, t0, t1, p, p + G, p + 2 * G, base);
        });
        for (int64_t j = 0; j < d.nkv; ++j)
            for (int64_t g = 0; g < G; ++g) {
                float mx = -std::numeric_limits<float>::infinity();
                for (int64_t sp = 0; sp < nsplit; ++sp) {
                    const float ms = shared[(j * nsplit + sp) * part + g];
                    mx = ms > mx ? ms : mx;
                }
                float* o = out + (j * G + g) * hd;
                for (int64_t e = 0; e < hd; ++e) o[e] = 0.f;
                float lsum = 0.f;
                for (int64_t sp = 0; sp < nsplit; ++sp) {
                    const float* p = shared + (j * nsplit + sp) * part;
                    const float f = std::exp(p[g] - mx);
                    lsum += p[G + g] * f;
                    kk.axpy(o, f, p + 2 * G + g * hd, hd);
                }
                const float inv = 1.f / lsum;
                for (int64_t e = 0; e < hd; ++e) o[e] *= inv;
            }
        return;
    }
    // causal rows: row i sees keys 0 .. pos0 + i, a window as long as the whole context
    attention_block(pool, ws, d, q, L, pos0, pos0 + L, pos0 + L, cache, out, ldo);
}

void attention_block(ThreadPool& pool, Workspace& ws, const AttnDims& d, const float* q, int64_t L, int64_t qpos0,
                     int64_t T, int64_t window, const KVCacheView& cache, float* out, int64_t ldo) {
    const Kernels& kk = kernels();
    const int64_t G = d.nh / d.nkv, hd = d.hd, row = d.nkv * d.hd;
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    pool.run(L * d.nkv, [&](int64_t task, int th) {
        const int64_t i = task / d.nkv, j = task % d.nkv;
        float* s = ws.t(th);
        float* acc = s + G * kAttnKeyBlock;
        float* m = acc + G * hd;
        float* l = m + G;
        const float* qh[256];
        for (int64_t g = 0; g < G; ++g) qh[g] = q + i * d.q_row + (j * G + g) * d.q_stride;
        int64_t t0 = 0, t1 = T;
        if (window > 0) {
            const int64_t qpos = qpos0 + i;
            t0 = qpos - window + 1 > 0 ? qpos - window + 1 : 0;
            t1 = qpos + 1 < T ? qpos + 1 : T;
        }
        attend_range(kk, qh, G, hd, scale, cache, row, j * hd, t0, t1, m, l, acc, s);
        for (int64_t g = 0; g < G; ++g) {
            float* o = out + i * ldo + (j * G + g) * hd;
            const float inv = 1.f / l[g];
            for (int64_t e = 0; e < hd; ++e) o[e] = acc[g * hd + e] * inv;
        }
    });
}

}  // namespace qwenmetal::cpu

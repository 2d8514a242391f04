// The vision tower on the cpu engine (vision.h; the numpy original: backends/reference_vision.py).
#include "cpu/vision.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <utility>

#include "cpu/attention.h"
#include "cpu/kernels.h"

namespace qwenmetal::cpu {

namespace {

constexpr int64_t kRowTask = 16;    // rows per task of the row-wise passes (norms, biases, activations)

// fn(r0, r1) over [0, rows) in blocks of kRowTask rows, on the pool
template <class F>
void rows_run(ThreadPool& pool, int64_t rows, F&& fn) {
    const int64_t tasks = (rows + kRowTask - 1) / kRowTask;
    pool.run(tasks, [&](int64_t t, int) {
        const int64_t r0 = t * kRowTask, r1 = std::min(rows, r0 + kRowTask);
        fn(r0, r1);
    });
}

void need(bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("vision tower: " + what);
}

void check_matrix(const WMat& m, const std::string& name, int64_t rows, int64_t cols) {
    need(!m.empty(), "'" + name + "' has no data");
    need(m.rows == rows && m.cols == cols, "'" + name + "' is [" + std::to_string(m.rows) + ", " +
                                               std::to_string(m.cols) + "], expected [" + std::to_string(rows) +
                                               ", " + std::to_string(cols) + "]");
    if (m.quantized()) check_affine(name, m.bits, m.group_size, m.cols);
}

void check_vector(const std::vector<float>& v, const std::string& name, size_t n) {
    need(v.size() == n, "'" + name + "' has " + std::to_string(v.size()) + " values, expected " + std::to_string(n));
}

// exact GELU (torch nn.GELU()); the tanh approximation is a SIMD kernel (Kernels::gelu_tanh)
inline float gelu_erf(float x) { return 0.5f * x * (1.f + std::erf(x * 0.70710678118654752f)); }

// (row, column) of patch k of one h x w frame in the processor's spatial-merge-block order (blocks of
// merge x merge patches row-major, the patches of a block row-major)
inline std::pair<int64_t, int64_t> block_order(int64_t k, int64_t w, int64_t merge) {
    const int64_t per_block = merge * merge, bw = w / merge;
    const int64_t b = k / per_block, in = k % per_block;
    return {(b / bw) * merge + in / merge, (b % bw) * merge + in % merge};
}

}  // namespace

VisionTower::VisionTower(const VisionDims& d, VisionWeights w) : d_(d), w_(std::move(w)) {
    need(d.hidden > 0 && d.heads > 0 && d.head_dim > 0 && d.inter > 0 && d.depth > 0 && d.in_channels > 0 &&
             d.temporal_patch > 0 && d.patch > 0 && d.merge > 0 && d.side > 0 && d.out_hidden > 0,
         "every dimension must be positive");
    need(d.heads * d.head_dim == d.hidden, "heads x head_dim must equal hidden");
    need(d.head_dim % 4 == 0, "head_dim must be a multiple of 4 (2-D rotary)");
    need(d.head_dim <= 256, "head_dim above 256 is not supported");
    const int64_t H = d.hidden, M4 = d.merged_dim();
    check_matrix(w_.patch, "patch_embed.proj", H, d.patch_dim());
    check_vector(w_.patch_b, "patch_embed.proj.bias", size_t(H));
    check_vector(w_.pos_embed, "pos_embed", size_t(d.side * d.side * H));
    need(int64_t(w_.blocks.size()) == d.depth, "expected " + std::to_string(d.depth) + " blocks");
    for (int64_t i = 0; i < d.depth; ++i) {
        const VisionBlock& b = w_.blocks[size_t(i)];
        const std::string p = "blocks." + std::to_string(i) + ".";
        check_vector(b.norm1, p + "norm1", size_t(H));
        check_vector(b.norm1_b, p + "norm1.bias", size_t(H));
        check_vector(b.norm2, p + "norm2", size_t(H));
        check_vector(b.norm2_b, p + "norm2.bias", size_t(H));
        check_matrix(b.qkv, p + "attn.qkv", 3 * H, H);
        check_vector(b.qkv_b, p + "attn.qkv.bias", size_t(3 * H));
        check_matrix(b.proj, p + "attn.proj", H, H);
        check_vector(b.proj_b, p + "attn.proj.bias", size_t(H));
        check_matrix(b.fc1, p + "mlp.linear_fc1", d.inter, H);
        check_vector(b.fc1_b, p + "mlp.linear_fc1.bias", size_t(d.inter));
        check_matrix(b.fc2, p + "mlp.linear_fc2", H, d.inter);
        check_vector(b.fc2_b, p + "mlp.linear_fc2.bias", size_t(H));
    }
    check_vector(w_.merger_norm, "merger.norm", size_t(H));
    check_vector(w_.merger_norm_b, "merger.norm.bias", size_t(H));
    check_matrix(w_.merger_fc1, "merger.linear_fc1", M4, M4);
    check_vector(w_.merger_fc1_b, "merger.linear_fc1.bias", size_t(M4));
    check_matrix(w_.merger_fc2, "merger.linear_fc2", d.out_hidden, M4);
    check_vector(w_.merger_fc2_b, "merger.linear_fc2.bias", size_t(d.out_hidden));
}

size_t VisionTower::weight_bytes() const {
    size_t n = w_.patch.nbytes() + w_.merger_fc1.nbytes() + w_.merger_fc2.nbytes();
    for (const VisionBlock& b : w_.blocks) n += b.qkv.nbytes() + b.proj.nbytes() + b.fc1.nbytes() + b.fc2.nbytes();
    return n;
}

int64_t VisionTower::check(int64_t n_patches, const int64_t* grid, int64_t n_images) const {
    need(n_images > 0, "grid_thw must hold at least one image");
    int64_t total = 0;
    for (int64_t i = 0; i < n_images; ++i) {
        const int64_t t = grid[3 * i], h = grid[3 * i + 1], w = grid[3 * i + 2];
        const std::string at = "grid_thw[" + std::to_string(i) + "] = [" + std::to_string(t) + ", " +
                               std::to_string(h) + ", " + std::to_string(w) + "]";
        need(t > 0 && h > 0 && w > 0, at + ": every entry must be positive");
        need(h % d_.merge == 0 && w % d_.merge == 0,
             at + ": height and width must be multiples of spatial_merge_size " + std::to_string(d_.merge));
        need(t <= kVisionMaxPatches && h <= kVisionMaxPatches && w <= kVisionMaxPatches &&
                 t * h <= kVisionMaxPatches && t * h * w <= kVisionMaxPatches,
             at + ": more than " + std::to_string(kVisionMaxPatches) + " patches");
        total += t * h * w;
        need(total <= kVisionMaxPatches, "grid_thw asks for more than " + std::to_string(kVisionMaxPatches) + " patches");
    }
    need(total == n_patches, "pixel_values has " + std::to_string(n_patches) + " patches, grid_thw describes " +
                                 std::to_string(total));
    return total / (d_.merge * d_.merge);
}

void VisionTower::gemm(ThreadPool& pool, const WMat& W, const std::vector<float>& bias, const float* X, int64_t M,
                       int64_t ldx, float* Y, int64_t ldy, bool accumulate) {
    for (int64_t m0 = 0; m0 < M; m0 += kVisionChunk) {
        const int64_t m = std::min(kVisionChunk, M - m0);
        const LinearOut o = {&W, Y + m0 * ldy, ldy, accumulate};
        linear(pool, ws_, X + m0 * ldx, m, ldx, &o, 1);
    }
    const float* b = bias.data();
    const int64_t N = W.rows;
    rows_run(pool, M, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            float* y = Y + r * ldy;
            for (int64_t j = 0; j < N; ++j) y[j] += b[j];
        }
    });
}

void VisionTower::layer_norm(ThreadPool& pool, const float* x, int64_t rows, const std::vector<float>& w,
                             const std::vector<float>& b, float* out) {
    const int64_t H = d_.hidden;
    const float eps = d_.eps;
    rows_run(pool, rows, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const float* xr = x + r * H;
            float* o = out + r * H;
            double s = 0.0;
            for (int64_t j = 0; j < H; ++j) s += xr[j];
            const float mean = static_cast<float>(s / double(H));
            double v = 0.0;
            for (int64_t j = 0; j < H; ++j) {
                const float dj = xr[j] - mean;
                v += double(dj) * double(dj);
            }
            const float inv = 1.f / std::sqrt(static_cast<float>(v / double(H)) + eps);
            for (int64_t j = 0; j < H; ++j) o[j] = (xr[j] - mean) * inv * w[size_t(j)] + b[size_t(j)];
        }
    });
}

// full (bidirectional) attention within each segment [bounds[s], bounds[s+1]) -- one frame of one image -- over
// the rotated q, k and v of qkv [n][3H]. Tasks (query block of one segment, head); a task runs an online
// softmax over key blocks of kAttnKeyBlock keys with GEMMs: S = (scale·Q) K^T (gemm_tile: the key block
// transposed once, broadcast-FMA tiles), per row the running max / sum and exp (exp_shift), acc += P V
// (gemm_nn). Scratch per thread: vision_attention_floats.
static size_t vision_attention_floats(int64_t hd) {
    return size_t(kVisionQueryBlock * (2 * hd + kAttnKeyBlock + 2) + 64);
}

void VisionTower::attention(ThreadPool& pool, const float* qkv, const std::vector<int64_t>& bounds, int64_t n,
                            float* out) {
    const Kernels& kk = kernels();
    const int64_t H = d_.hidden, hd = d_.head_dim, nh = d_.heads, ld = 3 * H;
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    std::vector<std::pair<int64_t, int64_t>> qblocks;   // (first query row, segment)
    for (size_t s = 0; s + 1 < bounds.size(); ++s)
        for (int64_t q0 = bounds[s]; q0 < bounds[s + 1]; q0 += kVisionQueryBlock) qblocks.emplace_back(q0, int64_t(s));
    (void)n;
    pool.run(int64_t(qblocks.size()) * nh, [&](int64_t task, int th) {
        const auto [q0, s] = qblocks[size_t(task / nh)];
        const int64_t h = task % nh;
        const int64_t t0 = bounds[size_t(s)], t1 = bounds[size_t(s) + 1];
        const int64_t G = std::min(kVisionQueryBlock, t1 - q0);
        float* q = ws_.t(th);                            // [G][hd] scaled queries
        float* sc = q + kVisionQueryBlock * hd;          // [G][kAttnKeyBlock] scores / probabilities
        float* acc = sc + kVisionQueryBlock * kAttnKeyBlock;
        float* m = acc + kVisionQueryBlock * hd;
        float* l = m + kVisionQueryBlock;
        for (int64_t g = 0; g < G; ++g) {
            const float* src = qkv + (q0 + g) * ld + h * hd;
            for (int64_t e = 0; e < hd; ++e) q[g * hd + e] = src[e] * scale;
            m[g] = -std::numeric_limits<float>::infinity();
            l[g] = 0.f;
            std::fill(acc + g * hd, acc + (g + 1) * hd, 0.f);
        }
        for (int64_t b0 = t0; b0 < t1; b0 += kAttnKeyBlock) {
            const int64_t nb = std::min(kAttnKeyBlock, t1 - b0);
            const float* k = qkv + b0 * ld + H + h * hd;
            kk.gemm_tile(q, hd, G, k, ld, nb, hd, sc, kAttnKeyBlock, false);
            for (int64_t g = 0; g < G; ++g) {
                float* row = sc + g * kAttnKeyBlock;
                float bm = row[0];
                for (int64_t t = 1; t < nb; ++t) bm = row[t] > bm ? row[t] : bm;
                const float mn = m[g] > bm ? m[g] : bm;
                const float corr = std::exp(m[g] - mn);
                if (corr != 1.f)
                    for (int64_t e = 0; e < hd; ++e) acc[g * hd + e] *= corr;
                m[g] = mn;
                l[g] = l[g] * corr + kk.exp_shift(row, nb, -mn);
            }
            kk.gemm_nn(sc, kAttnKeyBlock, G, k + H, ld, hd, nb, acc, hd, true);
        }
        for (int64_t g = 0; g < G; ++g) {
            float* o = out + (q0 + g) * H + h * hd;
            const float inv = 1.f / l[g];
            for (int64_t e = 0; e < hd; ++e) o[e] = acc[g * hd + e] * inv;
        }
    });
}

void VisionTower::encode(ThreadPool& pool, const float* pixels, int64_t n, const int64_t* grid, int64_t n_images,
                         float* out) {
    const int64_t n_merged = check(n, grid, n_images);
    const VisionDims& d = d_;
    const int64_t H = d.hidden, hd = d.head_dim, nh = d.heads, I = d.inter, M4 = d.merged_dim();
    const int64_t kmax = std::max({d.patch_dim(), H, I, M4});

    // scratch (everything before the first kernel: a failed allocation leaves nothing half-done)
    ws_.resize(pool.size());
    ws_.planes = 0;
    ws_.gemv_rows = kGemvMaxRows;
    const size_t attn_floats = vision_attention_floats(hd);
    ws_.reserve(std::max(linear_thread_floats(kmax), attn_floats), linear_xvec_floats(kmax, kVisionChunk),
                size_t(kVisionChunk));
    float* x = x_.get(size_t(n * H));
    float* hbuf = h_.get(size_t(n * H));
    float* qkv = qkv_.get(size_t(n * 3 * H));
    float* att = att_.get(size_t(n * H));
    float* mlp = mlp_.get(size_t(kVisionChunk * std::max(I, M4)));
    float* cs = cos_.get(size_t(n * hd));
    float* sn = sin_.get(size_t(n * hd));

    // per patch: (row, column) in its frame and the frame's (h, w); the frames' bounds
    std::vector<int64_t> rows(static_cast<size_t>(n), 0), cols(static_cast<size_t>(n), 0), fh(static_cast<size_t>(n), 0),
        fw(static_cast<size_t>(n), 0);
    std::vector<int64_t> bounds{0};
    for (int64_t i = 0, at = 0; i < n_images; ++i) {
        const int64_t t = grid[3 * i], h = grid[3 * i + 1], w = grid[3 * i + 2];
        for (int64_t f = 0; f < t; ++f) {
            for (int64_t k = 0; k < h * w; ++k, ++at) {
                const auto [r, c] = block_order(k, w, d.merge);
                rows[size_t(at)] = r;
                cols[size_t(at)] = c;
                fh[size_t(at)] = h;
                fw[size_t(at)] = w;
            }
            bounds.push_back(at);
        }
    }

    // 1. patch embedding, 2. + the bilinearly resampled position table (reference_vision.interpolation_taps)
    gemm(pool, w_.patch, w_.patch_b, pixels, n, d.patch_dim(), x, H, false);
    const int64_t side = d.side;
    const float* table = w_.pos_embed.data();
    rows_run(pool, n, [&](int64_t r0, int64_t r1) {
        for (int64_t p = r0; p < r1; ++p) {
            int64_t lo[2], hi[2];
            float w0[2], w1[2];
            const int64_t pos[2] = {rows[size_t(p)], cols[size_t(p)]}, size[2] = {fh[size_t(p)], fw[size_t(p)]};
            for (int a = 0; a < 2; ++a) {
                const float src = static_cast<float>(pos[a]) * static_cast<float>(side - 1) /
                                  static_cast<float>(std::max<int64_t>(size[a] - 1, 1));
                const float fl = std::floor(src);
                const float frac = src - fl;
                const int64_t l0 = static_cast<int64_t>(fl);
                lo[a] = std::min(l0, side - 1);
                hi[a] = std::min(l0 + 1, side - 1);
                w0[a] = 1.f - frac;
                w1[a] = frac;
            }
            const int64_t idx[4] = {lo[0] * side + lo[1], lo[0] * side + hi[1], hi[0] * side + lo[1],
                                    hi[0] * side + hi[1]};
            const float wt[4] = {w0[0] * w0[1], w0[0] * w1[1], w1[0] * w0[1], w1[0] * w1[1]};
            float* xr = x + p * H;
            const float* e[4] = {table + idx[0] * H, table + idx[1] * H, table + idx[2] * H, table + idx[3] * H};
            for (int64_t j = 0; j < H; ++j) {
                float s = e[0][j] * wt[0];
                s += e[1][j] * wt[1];
                s += e[2][j] * wt[2];
                s += e[3][j] * wt[3];
                xr[j] += s;
            }
        }
    });

    // 3. the 2-D rotary tables [n][hd]: angles [row f | col f] twice, f = theta^(-4i/hd) (float32 products,
    // cos / sin in float64, rounded)
    const int64_t nq = hd / 4, spatial = hd / 2;
    std::vector<float> inv_freq(static_cast<size_t>(nq), 0.f);
    for (int64_t i = 0; i < nq; ++i)
        inv_freq[size_t(i)] = static_cast<float>(1.0 / std::pow(d.rope_theta, double(2 * i) / double(spatial)));
    rows_run(pool, n, [&](int64_t r0, int64_t r1) {
        for (int64_t p = r0; p < r1; ++p) {
            float* c = cs + p * hd;
            float* s = sn + p * hd;
            for (int64_t a = 0; a < 2; ++a)
                for (int64_t i = 0; i < nq; ++i) {
                    const float ang = static_cast<float>(a ? cols[size_t(p)] : rows[size_t(p)]) * inv_freq[size_t(i)];
                    const float cv = static_cast<float>(std::cos(double(ang)));
                    const float sv = static_cast<float>(std::sin(double(ang)));
                    c[a * nq + i] = c[spatial + a * nq + i] = cv;
                    s[a * nq + i] = s[spatial + a * nq + i] = sv;
                }
        }
    });

    // 4. the blocks
    const int64_t half = hd / 2;
    for (int64_t bi = 0; bi < d.depth; ++bi) {
        const VisionBlock& b = w_.blocks[size_t(bi)];
        layer_norm(pool, x, n, b.norm1, b.norm1_b, hbuf);
        gemm(pool, b.qkv, b.qkv_b, hbuf, n, H, qkv, 3 * H, false);
        // rotate-half over each head of q and k, in place
        rows_run(pool, n, [&](int64_t r0, int64_t r1) {
            float tmp[256];
            for (int64_t p = r0; p < r1; ++p) {
                const float* c = cs + p * hd;
                const float* s = sn + p * hd;
                for (int64_t part = 0; part < 2; ++part)
                    for (int64_t h = 0; h < nh; ++h) {
                        float* v = qkv + p * 3 * H + part * H + h * hd;
                        for (int64_t e = 0; e < half; ++e) {
                            tmp[e] = v[e] * c[e] - v[e + half] * s[e];
                            tmp[e + half] = v[e + half] * c[e + half] + v[e] * s[e + half];
                        }
                        std::copy(tmp, tmp + hd, v);
                    }
            }
        });
        attention(pool, qkv, bounds, n, att);
        gemm(pool, b.proj, b.proj_b, att, n, H, x, H, true);
        layer_norm(pool, x, n, b.norm2, b.norm2_b, hbuf);
        for (int64_t m0 = 0; m0 < n; m0 += kVisionChunk) {
            const int64_t m = std::min(kVisionChunk, n - m0);
            gemm(pool, b.fc1, b.fc1_b, hbuf + m0 * H, m, H, mlp, I, false);
            const bool tanh_act = d.gelu_tanh;
            const Kernels& kk = kernels();
            rows_run(pool, m, [&](int64_t r0, int64_t r1) {
                for (int64_t r = r0; r < r1; ++r) {
                    float* y = mlp + r * I;
                    if (tanh_act)
                        kk.gelu_tanh(y, I);
                    else
                        for (int64_t j = 0; j < I; ++j) y[j] = gelu_erf(y[j]);
                }
            });
            gemm(pool, b.fc2, b.fc2_b, mlp, m, I, x + m0 * H, H, true);
        }
    }

    // 5. the merger: LayerNorm per patch, merge^2 consecutive rows as one [4H] row, fc2(gelu_erf(fc1 .))
    layer_norm(pool, x, n, w_.merger_norm, w_.merger_norm_b, hbuf);
    for (int64_t m0 = 0; m0 < n_merged; m0 += kVisionChunk) {
        const int64_t m = std::min(kVisionChunk, n_merged - m0);
        gemm(pool, w_.merger_fc1, w_.merger_fc1_b, hbuf + m0 * M4, m, M4, mlp, M4, false);
        rows_run(pool, m, [&](int64_t r0, int64_t r1) {
            for (int64_t r = r0; r < r1; ++r) {
                float* y = mlp + r * M4;
                for (int64_t j = 0; j < M4; ++j) y[j] = gelu_erf(y[j]);
            }
        });
        gemm(pool, w_.merger_fc2, w_.merger_fc2_b, mlp, m, M4, out + m0 * d.out_hidden, d.out_hidden, false);
    }
}

}  // namespace qwenmetal::cpu

#include "cpu/quant.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace qwenmetal::cpu {

void check_affine(const std::string& name, int bits, int group_size, int64_t cols) {
    const bool width = bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8;
    const bool group = group_size == 32 || group_size == 64 || group_size == 128;
    if (!width || !group || cols <= 0 || cols % group_size != 0)
        throw std::invalid_argument(name + ": unsupported quantization (" + std::to_string(bits) + "-bit, group " +
                                    std::to_string(group_size) + ", " + std::to_string(cols) +
                                    " inputs): the CPU kernels take bits 2, 3, 4, 5, 6, 8 and groups 32, 64, 128");
}

void dequantize_affine(const uint32_t* w, const float* scales, const float* biases, float* out,
                       size_t rows, size_t in_features, int bits, int group_size) {
    const size_t row_bytes = in_features * bits / 8;
    const size_t groups = in_features / group_size;
    for (size_t r = 0; r < rows; ++r) {
        const uint8_t* wr = reinterpret_cast<const uint8_t*>(w) + r * row_bytes;
        const float* sr = scales + r * groups;
        const float* br = biases + r * groups;
        float* o = out + r * in_features;
        for (size_t k = 0; k < in_features; ++k) {
            const size_t g = k / group_size;
            o[k] = sr[g] * static_cast<float>(affine_q(wr, bits, int64_t(k))) + br[g];
        }
    }
}

void quantize_affine(const void* src, DType dtype, int64_t ld, int64_t rows, int64_t cols, int bits, int group_size,
                     uint32_t* wq, uint16_t* scales, uint16_t* biases) {
    const float n_bins = static_cast<float>((1 << bits) - 1);
    const float eps = 1e-7f;
    const int64_t groups = cols / group_size;
    const int64_t words = cols * bits / 32;
    float buf[128];
    for (int64_t r = 0; r < rows; ++r) {
        uint32_t* wr = wq + r * words;
        for (int64_t g = 0; g < groups; ++g) {
            for (int i = 0; i < group_size; ++i) buf[i] = load_scalar(src, dtype, size_t(r * ld + g * group_size + i));
            float mx = buf[0], mn = buf[0];
            for (int i = 1; i < group_size; ++i) {
                mx = buf[i] > mx ? buf[i] : mx;
                mn = buf[i] < mn ? buf[i] : mn;
            }
            const bool mask = std::fabs(mn) > std::fabs(mx);
            float scale = (mx - mn) / n_bins;
            scale = scale > eps ? scale : eps;
            scale = mask ? scale : -scale;
            const float edge = mask ? mn : mx;
            const float q0 = std::nearbyint(edge / scale);
            float bias = 0.f;
            if (q0 != 0.f) {
                scale = edge / q0;
                bias = edge;
            }
            // the group's values into the row's bit stream (a group is group_size·bits/32 whole words,
            // zeroed first; a 3/5/6-bit value may straddle two words)
            uint32_t* wg = wr + g * group_size * bits / 32;
            std::memset(wg, 0, size_t(group_size) * bits / 8);
            for (int i = 0; i < group_size; ++i) {
                float q = std::nearbyint((buf[i] - bias) / scale);
                q = q < 0.f ? 0.f : (q > n_bins ? n_bins : q);
                const uint32_t v = static_cast<uint32_t>(q);
                const int bit = bits * i, s = bit & 31;
                wg[bit >> 5] |= v << s;
                if (s + bits > 32) wg[(bit >> 5) + 1] |= v >> (32 - s);
            }
            scales[r * groups + g] = f32_to_bf16(scale);
            biases[r * groups + g] = f32_to_bf16(bias);
        }
    }
}

void prepare_xvecs(Workspace& ws, const float* X, int64_t M, int64_t ldx, int64_t K, int64_t first,
                   size_t float_offset) {
    const Kernels& kk = kernels();
    float* base = ws.xvec.data() + float_offset;
    const int q8 = ws.planes;
    for (int64_t m = 0; m < M; ++m) {
        kk.xvec_prepare(X + m * ldx, K, base + m * xvec_floats(K), &ws.xv[first + m], q8);
        ws.xvp[first + m] = &ws.xv[first + m];
    }
}

namespace {
// QWENMETAL_GEMM=tile: prefill through dequantized 16-row tiles + gemm_tile instead of the register-tile
// kernel (for comparisons; see docs/cpu.md)
bool use_tile_gemm() {
    static const bool v = [] {
        const char* e = std::getenv("QWENMETAL_GEMM");
        return e && std::string(e) == "tile";
    }();
    return v;
}
}  // namespace

void linear_rows(const WMat& W, const float* X, int64_t M, int64_t ldx, const XVec* const* xv, float* tile,
                 int64_t r0, int64_t r1, float* y, int64_t ldy, bool accumulate, int64_t gemv_rows) {
    const Kernels& kk = kernels();
    if (M <= gemv_rows) {                // each row bit for bit the GEMV's, weights unpacked once where possible
        kk.gemv_multi(W, xv, M, y, ldy, r0, r1, accumulate);
        return;
    }
    const bool int_gemm = kk.int_gemm() && int_kernels_apply(W, *xv[0]);
    if (!use_tile_gemm() && (int_gemm || !(kk.tile_gemm_min_rows && M >= kk.tile_gemm_min_rows))) {
        kk.gemm_x(W, xv, M, y, ldy, r0, r1, accumulate);
        return;
    }
    const int64_t K = W.cols;
    for (int64_t r = r0; r < r1; r += kRowBlock) {
        const int64_t n = (r1 - r < kRowBlock) ? r1 - r : kRowBlock;
        kk.dequant(W, r, n, tile, K);
        kk.gemm_tile(X, ldx, M, tile, K, n, K, y + r, ldy, accumulate);
    }
}

void linear(ThreadPool& pool, Workspace& ws, const float* X, int64_t M, int64_t ldx, const LinearOut* outs, int n) {
    // tasks of `unit` rows, or of a multiple of it for very tall matrices (at most 256 tasks per matrix:
    // the lm_head gets ~250 tasks of ~1000 rows, fewer atomic hand-outs). Prefill (GEMM) tasks are at least 64 rows: the AMX kernel then reuses each transposed operand
    // over 4 row blocks (docs/cpu.md). Decode (GEMV) tasks are up to 128 rows, but at least 4 tasks per
    // thread: every task starts a cold weight stream (the software prefetch runs ahead within it), and
    // 16-row tasks (16 KiB of a 2048-wide 4-bit matrix) left a quarter of the stream unprefetched —
    // measured 36.5–39.3 → 31.3–33.5 ms/token (8-layer model, 2 threads, alternating runs). Each row is
    // computed the same way whatever its task, so the partition never changes a result.
    const int64_t threads = pool.size();
    int64_t start[9], bs[8];
    start[0] = 0;
    for (int i = 0; i < n; ++i) {
        const int64_t rows = outs[i].W->rows;
        const int64_t unit = M > ws.gemv_rows
                                 ? 4 * kRowBlock
                                 : std::clamp<int64_t>(rows / (4 * threads) / kRowBlock * kRowBlock, kRowBlock,
                                                       8 * kRowBlock);
        bs[i] = unit * std::max<int64_t>(1, (rows + unit * 256 - 1) / (unit * 256));
        start[i + 1] = start[i] + (rows + bs[i] - 1) / bs[i];
    }
    prepare_xvecs(ws, X, M, ldx, outs[0].W->cols);
    const XVec* const* xv = ws.xvp.data();
    pool.run(start[n], [&](int64_t task, int th) {
        int i = 0;
        while (task >= start[i + 1]) ++i;
        const LinearOut& o = outs[i];
        const int64_t r0 = (task - start[i]) * bs[i];
        const int64_t r1 = (r0 + bs[i] < o.W->rows) ? r0 + bs[i] : o.W->rows;
        linear_rows(*o.W, X, M, ldx, xv, ws.t(th), r0, r1, o.y, o.ldy, o.accumulate, ws.gemv_rows);
    });
}

}  // namespace qwenmetal::cpu

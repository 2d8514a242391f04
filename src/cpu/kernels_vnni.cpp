// AVX-512 VNNI prefill GEMM (gemm_vnni.h): 4-bit group-64 weights × int8/int16-quantized inputs on CPUs
// without a usable AMX tile unit; below it, the same kernel on ymm for AVX-VNNI CPUs without AVX-512.
//
// What it computes is the formula of the AMX kernel (kernels_amx.cpp), per weight row r and input m:
//   y = Σ_g s[r,g]·xsg[m,g]·float(C[r,m,g]) + Σ_g b[r,g]·xqx[m,g],  C = Σ_{k in g} q[r,k]·c_m[k] (int32)
// with c = xq (int8) or 256·xq + xq2 (int16: C = 256·C1 + C2).
//
// Layout: "rows in lanes". 16 weight rows are transposed once per K chunk (q4_tiles.h, the AMX kernel's
// B-tile preparation) so that vector wb[g][j] holds, in int32 lane n, the four u8 weights of row n at
// group positions 4j..4j+3. One `vpdpbusd` of that vector with the input's four int8 values at those
// positions broadcast to every lane (an embedded-broadcast memory operand) adds 64 products into the 16
// rows' int32 sums; 16 of them finish a group's C for 16 rows and one input. A register tile of MI
// inputs (8) × 16 rows keeps C, the fp32 accumulator and the bias accumulator of each input in zmm
// registers (3·8 = 24), so each weight vector is loaded once per 8 inputs and the per-group fold
// (int→float, s·xsg, FMA; the bias FMA) is 4 ops per 16 rows against 16 (int8) / 32 (int16) integer
// dot products. The old register tile (kernels_x86.cpp q4i8_block: one row, lanes = 2 groups × 8
// partial sums) paid cvt + mul + FMA per 2 dot products and reduced horizontally at the end.
// The weights keep the checkpoint's layout (the transpose and nibble unpack are paid once per 16 rows
// and K chunk, in L1, and shared by every input of the call) rather than being repacked at load.
//
// K is processed in chunks of kChunk groups (the transposed block, 16 KiB, stays in L1 while every input
// runs over it); chunk boundaries depend only on K and a chunk's sum is added into Y in chunk order, and
// every (row, input) goes through the same operations whatever MI tile, row block or call it falls in,
// so results do not depend on M, r0/r1 or the thread partition.
#include "cpu/gemm_vnni.h"

#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QM_HAVE_VNNI_GEMM 1
#include <immintrin.h>

#include "cpu/q4_tiles.h"
#endif

namespace qwenmetal::cpu {

#if QM_HAVE_VNNI_GEMM

// every function here that uses the instructions (this file is built for the baseline ISA)
#define QM_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")))

namespace {

// groups per K chunk: 16 rows × 16 groups of transposed weights = 16 KiB (L1 on every AVX-512 core)
constexpr int kChunk = 16;
// inputs per register tile: 3 zmm per input (C, fp32 sum, bias sum) = 24 of 32 registers
constexpr int kInputs = 8;

// one row block's operands for the chunk's groups (rows past the block's nr are zero)
struct alignas(64) Block {
    uint8_t wb[kChunk][16][64];   // weights, rows in lanes (q4_rows_in_lanes)
    float sv[kChunk][16];         // scales [group][row]
    float bv[kChunk][16];         // biases [group][row]
};

QM_VNNI_TARGET inline __m512i bcast4(const int8_t* p) {   // the 4 bytes at p in every dword (folds into a {1to16} operand)
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// MI inputs X[0..MI) × the block's 16 rows × the chunk's gn groups (input groups from g0); adds (or,
// store_only, writes) the chunk's sums into Y[m·ldy + n] for n < nr
template <int P, int MI>
QM_VNNI_TARGET inline void tile(const Block& bk, int gn, const XVec* const* X, int64_t g0, float* Y, int64_t ldy, int nr,
                 bool store_only) {
    const int8_t* x1[MI];
    const int8_t* x2[MI];
    const float* xs[MI];
    const float* xb[MI];
    __m512 acc[MI], bacc[MI];
    for (int m = 0; m < MI; ++m) {
        x1[m] = X[m]->xg + 64 * g0;
        x2[m] = P == 2 ? X[m]->xg2 + 64 * g0 : x1[m];
        xs[m] = X[m]->xsg + g0;
        xb[m] = X[m]->xqx + g0;
        acc[m] = _mm512_setzero_ps();
        bacc[m] = _mm512_setzero_ps();
    }
    for (int g = 0; g < gn; ++g) {
        __m512i c[MI];
#pragma GCC unroll 8
        for (int m = 0; m < MI; ++m) c[m] = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
            const __m512i w = _mm512_load_si512(bk.wb[g][j]);
#pragma GCC unroll 8
            for (int m = 0; m < MI; ++m) c[m] = _mm512_dpbusd_epi32(c[m], w, bcast4(x1[m] + 64 * g + 4 * j));
        }
        if constexpr (P == 2) {   // C = 256·C1 + C2 (|C| < 2^25: exact in int32)
#pragma GCC unroll 8
            for (int m = 0; m < MI; ++m) c[m] = _mm512_slli_epi32(c[m], 8);
#pragma GCC unroll 16
            for (int j = 0; j < 16; ++j) {
                const __m512i w = _mm512_load_si512(bk.wb[g][j]);
#pragma GCC unroll 8
                for (int m = 0; m < MI; ++m) c[m] = _mm512_dpbusd_epi32(c[m], w, bcast4(x2[m] + 64 * g + 4 * j));
            }
        }
        const __m512 sc = _mm512_load_ps(bk.sv[g]), bs = _mm512_load_ps(bk.bv[g]);
#pragma GCC unroll 8
        for (int m = 0; m < MI; ++m) {   // the AMX kernel's fold1: acc += float(C)·(s·xsg)
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c[m]), _mm512_mul_ps(sc, _mm512_set1_ps(xs[m][g])), acc[m]);
            bacc[m] = _mm512_fmadd_ps(bs, _mm512_set1_ps(xb[m][g]), bacc[m]);
        }
    }
    const __mmask16 ymask = mask16(nr);
    for (int m = 0; m < MI; ++m) {
        float* y = Y + m * ldy;
        const __m512 v = _mm512_add_ps(acc[m], bacc[m]);
        _mm512_mask_storeu_ps(y, ymask, store_only ? v : _mm512_add_ps(_mm512_maskz_loadu_ps(ymask, y), v));
    }
}

template <int P>
QM_VNNI_TARGET void gemm(const WMat& W, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0, int64_t r1,
          bool accumulate) {
    const int64_t G = W.cols / 64;
    Block bk;
    for (int64_t rb = r0; rb < r1; rb += 16) {
        const int nr = r1 - rb < 16 ? static_cast<int>(r1 - rb) : 16;
        for (int64_t g0 = 0; g0 < G; g0 += kChunk) {
            const int gn = static_cast<int>(G - g0 < kChunk ? G - g0 : kChunk);   // even: K % 128 == 0
            const bool store_only = g0 == 0 && !accumulate;
            q4_rows_in_lanes(W, rb, nr, g0, gn, bk.wb);
            q4_params_in_lanes(W, false, rb, nr, g0, gn, bk.sv);
            q4_params_in_lanes(W, true, rb, nr, g0, gn, bk.bv);
            if (g0 + kChunk >= G && rb + 16 < r1)   // the next row block's first lines and parameters
                q4_prefetch_block(W, rb + 16, r1 - rb - 16 < 16 ? static_cast<int>(r1 - rb - 16) : 16, 0,
                                  static_cast<int>(G < 8 ? G : 8));
            float* Yb = Y + rb;
            int64_t m = 0;
            for (; m + kInputs <= M; m += kInputs) tile<P, kInputs>(bk, gn, X + m, g0, Yb + m * ldy, ldy, nr, store_only);
            if (M - m >= 4) { tile<P, 4>(bk, gn, X + m, g0, Yb + m * ldy, ldy, nr, store_only); m += 4; }
            if (M - m >= 2) { tile<P, 2>(bk, gn, X + m, g0, Yb + m * ldy, ldy, nr, store_only); m += 2; }
            if (M - m >= 1) tile<P, 1>(bk, gn, X + m, g0, Yb + m * ldy, ldy, nr, store_only);
        }
    }
}

}  // namespace

void q4_gemm_vnni(const WMat& W, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0, int64_t r1,
                  bool accumulate) {
    if (M <= 0 || r1 <= r0) return;
    if (X[0]->planes == 2) gemm<2>(W, X, M, Y, ldy, r0, r1, accumulate);
    else gemm<1>(W, X, M, Y, ldy, r0, r1, accumulate);
}

// ---- the same kernel on ymm with AVX-VNNI: 8 rows in the lanes ----
// For CPUs with AVX-VNNI (the VEX `vpdpbusd` on ymm) but no AVX-512: Intel client chips from Alder Lake
// on. (A `vpmaddubsw` + `vpmaddwd` version for AVX2-only CPUs measured slower than their GEMV per input
// row at every M on a Zen 5 guest, docs/cpu.md, so they keep that.) Per row block of 8 and group, one 32-byte
// load per row (the group's 64 nibbles) and an 8×8 dword transpose give wb[g][j] (j < 8: the low
// nibbles of dword j of each row = group positions 4j..4j+3; j ≥ 8: the high nibbles, positions
// 32 + 4(j − 8)..), the zmm layout with half the lanes, so the tile loop, its broadcast offsets and the
// fold are the zmm kernel's: every (row, input) goes through the same integer sums and the same float
// operations, and the result is bit-identical to the AVX-512 VNNI GEMM (tested).
#define QM_AVX2_TARGET __attribute__((target("avx2,fma,avxvnni")))

namespace {
namespace ymm {

constexpr int kChunk = 16;    // 16 groups × 16 vectors × 32 bytes = 8 KiB of weights per block
constexpr int kInputs = 6;

struct alignas(32) Block {
    uint8_t wb[kChunk][16][32];
    float sv[kChunk][8];
    float bv[kChunk][8];
};

// 8×8 transpose of 32-bit elements: r[i] lane j -> r[j] lane i
QM_AVX2_TARGET inline void transpose8(__m256i r[8]) {
    __m256i t[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {   // r[4i+j] 128-bit lane L: rows 4i..4i+3 of column 4L+j
        r[4 * i + 0] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; ++j) {
        t[j] = _mm256_permute2x128_si256(r[j], r[4 + j], 0x20);
        t[4 + j] = _mm256_permute2x128_si256(r[j], r[4 + j], 0x31);
    }
    for (int i = 0; i < 8; ++i) r[i] = t[i];
}

// weights, scales and biases of rows [rb, rb + nr) (nr ≤ 8; rows past nr zero), groups [g0, g0 + gn)
QM_AVX2_TARGET inline void prepare(const WMat& W, int64_t rb, int nr, int64_t g0, int gn, Block& bk) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i v[8];
    for (int g = 0; g < gn; ++g) {
        for (int n = 0; n < 8; ++n) {
            if (n < nr && g % 2 == 0)   // one prefetch per 64-byte line
                _mm_prefetch(reinterpret_cast<const char*>(W.row(rb + n) + 32 * (g0 + g) + kRowPrefetch), _MM_HINT_T0);
            v[n] = n < nr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W.row(rb + n) + 32 * (g0 + g)))
                          : _mm256_setzero_si256();
        }
        transpose8(v);
        for (int j = 0; j < 8; ++j) {
            _mm256_store_si256(reinterpret_cast<__m256i*>(bk.wb[g][j]), _mm256_and_si256(v[j], m4));
            _mm256_store_si256(reinterpret_cast<__m256i*>(bk.wb[g][8 + j]),
                               _mm256_and_si256(_mm256_srli_epi16(v[j], 4), m4));
        }
    }
    for (int which = 0; which < 2; ++which) {   // bf16 -> fp32 (<< 16), 8 groups per transpose
        float (*out)[8] = which ? bk.bv : bk.sv;
        for (int h = 0; h < gn; h += 8) {
            const int k = gn - h < 8 ? gn - h : 8;
            for (int n = 0; n < 8; ++n) {
                alignas(16) uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                if (n < nr)
                    std::memcpy(t, (which ? W.brow(rb + n) : W.srow(rb + n)) + 2 * (g0 + h), 2 * size_t(k));
                v[n] = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(t))), 16);
            }
            transpose8(v);
            for (int g = 0; g < k; ++g) _mm256_store_si256(reinterpret_cast<__m256i*>(out[h + g]), v[g]);
        }
    }
}

QM_AVX2_TARGET inline __m256i bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// the zmm tile() with 8 lanes; the bias sums (which need no integers) in a second loop over the same
// groups in the same order, so a tile keeps 2 registers per input (C and the sum) and covers 6 inputs
template <int P, int MI>
QM_AVX2_TARGET inline void tile(const Block& bk, int gn, const XVec* const* X, int64_t g0, float* Y, int64_t ldy, int nr,
                                bool store_only) {
    const int8_t* x1[MI];
    const int8_t* x2[MI];
    const float* xs[MI];
    __m256 acc[MI];
    for (int m = 0; m < MI; ++m) {
        x1[m] = X[m]->xg + 64 * g0;
        x2[m] = P == 2 ? X[m]->xg2 + 64 * g0 : x1[m];
        xs[m] = X[m]->xsg + g0;
        acc[m] = _mm256_setzero_ps();
    }
    for (int g = 0; g < gn; ++g) {
        __m256i c[MI];
        for (int m = 0; m < MI; ++m) c[m] = _mm256_setzero_si256();
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
            const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(bk.wb[g][j]));
            for (int m = 0; m < MI; ++m) c[m] = _mm256_dpbusd_avx_epi32(c[m], w, bcast4(x1[m] + 64 * g + 4 * j));
        }
        if constexpr (P == 2) {
            for (int m = 0; m < MI; ++m) c[m] = _mm256_slli_epi32(c[m], 8);
#pragma GCC unroll 16
            for (int j = 0; j < 16; ++j) {
                const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(bk.wb[g][j]));
                for (int m = 0; m < MI; ++m) c[m] = _mm256_dpbusd_avx_epi32(c[m], w, bcast4(x2[m] + 64 * g + 4 * j));
            }
        }
        const __m256 sc = _mm256_load_ps(bk.sv[g]);
        for (int m = 0; m < MI; ++m)
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c[m]), _mm256_mul_ps(sc, _mm256_set1_ps(xs[m][g])), acc[m]);
    }
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i ymask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), lanes);
    for (int m = 0; m < MI; ++m) {
        const float* xb = X[m]->xqx + g0;
        __m256 bacc = _mm256_setzero_ps();
        for (int g = 0; g < gn; ++g) bacc = _mm256_fmadd_ps(_mm256_load_ps(bk.bv[g]), _mm256_set1_ps(xb[g]), bacc);
        float* y = Y + m * ldy;
        const __m256 v = _mm256_add_ps(acc[m], bacc);
        _mm256_maskstore_ps(y, ymask, store_only ? v : _mm256_add_ps(_mm256_maskload_ps(y, ymask), v));
    }
}

template <int P>
QM_AVX2_TARGET void gemm(const WMat& W, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0, int64_t r1,
                         bool accumulate) {
    const int64_t G = W.cols / 64;
    Block bk;
    for (int64_t rb = r0; rb < r1; rb += 8) {
        const int nr = r1 - rb < 8 ? static_cast<int>(r1 - rb) : 8;
        for (int64_t g0 = 0; g0 < G; g0 += kChunk) {
            const int gn = static_cast<int>(G - g0 < kChunk ? G - g0 : kChunk);
            const bool store_only = g0 == 0 && !accumulate;
            prepare(W, rb, nr, g0, gn, bk);
            float* Yb = Y + rb;
            int64_t m = 0;
            for (; m + kInputs <= M; m += kInputs)
                tile<P, kInputs>(bk, gn, X + m, g0, Yb + m * ldy, ldy, nr, store_only);
            if (M - m >= 4) { tile<P, 4>(bk, gn, X + m, g0, Yb + m * ldy, ldy, nr, store_only); m += 4; }
            if (M - m >= 2) { tile<P, 2>(bk, gn, X + m, g0, Yb + m * ldy, ldy, nr, store_only); m += 2; }
            if (M - m >= 1) tile<P, 1>(bk, gn, X + m, g0, Yb + m * ldy, ldy, nr, store_only);
        }
    }
}

}  // namespace ymm
}  // namespace

void q4_gemm_avxvnni(const WMat& W, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0, int64_t r1,
                     bool accumulate) {
    if (M <= 0 || r1 <= r0) return;
    if (X[0]->planes == 2) ymm::gemm<2>(W, X, M, Y, ldy, r0, r1, accumulate);
    else ymm::gemm<1>(W, X, M, Y, ldy, r0, r1, accumulate);
}

#endif  // QM_HAVE_VNNI_GEMM

}  // namespace qwenmetal::cpu

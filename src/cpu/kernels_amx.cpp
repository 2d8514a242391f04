// Intel AMX prefill GEMM for 4-bit group-64 weights × int8/int16-quantized inputs (amx.h).
//
// What it computes (the formula of kernels.inc q4i8_rows_generic), per weight row r and input m:
//   y = Σ_g s[r,g]·xsg[m,g]·float(C[r,m,g]) + Σ_g b[r,g]·xqx[m,g],  C = Σ_{k in g} q[r,k]·c_m[k] (int32)
// with c = xq (planes 1) or 256·xq + xq2 (planes 2: C = 256·C1 + C2 from the two plane products, in int32).
//
// The tile unit computes the integer products C per group of 64 inputs, 16 rows × 16 inputs at a time
// (`tdpbsud` / `tdpbusd`: C[16×16] int32 += A[16×64 bytes] · B[64×16 bytes], one operand signed, the
// other unsigned, B in the "VNNI" layout B[j][4n + i] = element 4j + i of column n). The AVX-512 part
// then folds each group's C into fp32 accumulators with its scales: acc += float(C)·(s·xsg). The bias
// term Σ_g b·xqx (≈ 1/4 of that work if done with FMAs) is left to the tile unit too: `tdpbf16ps` of the
// bf16 biases with xqx split exactly into three bf16 (hi + mid + lo), so every product is exact.
//
// Measured on the test box (Emerald Rapids, KVM): a tdpbsud (16×16×64) takes 16 cycles, a tile load ~9,
// a tile store ~17; and while tiles are in use the core runs 512-bit multiplies, FMAs and int->float
// conversions on ONE port (adds and integer adds keep two; ymm ops keep two, so no gain there). So the
// fold, 3 such operations per 16 outputs and group (cvt, s·xsg, fma; planes 2 adds a shift and an add),
// is the bottleneck (~48 cycles per 16×16 group against 16 for the product); it is kept at that and the
// tile work is issued one group ahead so that it overlaps with the fold.
//
// Two orientations, chosen per call by a cost model of the preparation (use_t); the results are
// bit-identical (every output element goes through the same operations in the same order), so the
// choice never shows in the output:
//  * R ("rows in lanes"): inputs are A (s8, `tdpbsud`): a row of A = one input's group = exactly
//    XVec::xg (64 bytes: the group's even elements, then its odd ones), so A is a strided `tileloadd`
//    straight from the XVecs when 16 inputs are at one stride (else copied). Weights are B: a 16×16 dword
//    transpose of 16 rows' packed bytes; position p < 32 of a group is element 2p = the low nibble of
//    byte p, p ≥ 32 the high nibble of byte p − 32, so B row j < 8 is (dword j of each row) & 15 and row
//    8 + j is (dword j >> 4) & 15 — one transpose of 64 bytes × 16 rows gives two groups. Built once per
//    16-row block and K chunk, reused by every 16-input tile. Accumulators: one zmm per input, lanes =
//    the 16 rows (a row of Y directly). Best when a call has few row blocks (the engine's 16-row tasks).
//  * T ("tokens in lanes"): weights are A (u8, `tdpbusd`): a row of A = one weight row's group unpacked
//    (32 low nibbles, then 32 high ones: the xg order again) by one GFNI affine, no transpose; inputs
//    are B: the 16×16 dword transpose of the inputs' groups, built once per 16-input tile and K chunk
//    and reused by every row block. Accumulators: one zmm per weight row, lanes = inputs; transposed at
//    the end. Best for one or two input tiles and many row blocks (an MoE expert's rows in one call).
//
// K is processed in chunks of kChunk groups (bounded stack). Chunk boundaries depend only on K, and a
// chunk's partial sums are added into Y in chunk order, so results do not depend on how rows or inputs
// are split between calls or threads.
#include "cpu/amx.h"
#include "cpu/cpu_info.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define QM_HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu/q4_tiles.h"
#endif

namespace qwenmetal::cpu {

namespace {

// The formula in plain scalar code: the fallback when AMX is unavailable (slow; correct).
void q4_gemm_scalar(const WMat& W, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0, int64_t r1,
                    bool accumulate) {
    const int64_t G = W.cols / 64;
    for (int64_t m = 0; m < M; ++m) {
        const XVec& x = *X[m];
        const bool two = x.planes == 2;
        for (int64_t r = r0; r < r1; ++r) {
            const uint8_t* w = W.row(r);
            const uint16_t* sr = reinterpret_cast<const uint16_t*>(W.srow(r));
            const uint16_t* br = reinterpret_cast<const uint16_t*>(W.brow(r));
            float acc = 0.f, bsum = 0.f;
            for (int64_t g = 0; g < G; ++g) {
                int32_t c1 = 0, c2 = 0;
                for (int j = 0; j < 32; ++j) {
                    const int32_t lo = w[32 * g + j] & 15, hi = w[32 * g + j] >> 4;
                    c1 += lo * x.xg[64 * g + j] + hi * x.xg[64 * g + 32 + j];
                    if (two) c2 += lo * x.xg2[64 * g + j] + hi * x.xg2[64 * g + 32 + j];
                }
                const int32_t c = two ? 256 * c1 + c2 : c1;
                acc += bf16_to_f32(sr[g]) * x.xsg[g] * static_cast<float>(c);
                bsum += bf16_to_f32(br[g]) * x.xqx[g];
            }
            float& y = Y[m * ldy + r];
            y = accumulate ? y + (acc + bsum) : acc + bsum;
        }
    }
}

std::atomic<bool> g_amx_on{true};

}  // namespace

std::atomic<int> g_amx_orientation{0};

#if QM_HAVE_AMX

namespace {

bool detect_amx() {
    if (const char* e = std::getenv("QWENMETAL_AMX"); e && std::strcmp(e, "0") == 0) return false;
    const CpuFeatures& f = cpu_info().f;   // CPU support and XCR0 tile state (cpu_info.cpp)
    if (!(f.avx512_core() && f.gfni && f.amx_tile && f.amx_int8 && f.amx_bf16)) return false;
    // Linux ≥ 5.16: a process must ask for the (8 KB) tile data state before its first tile instruction;
    // the permission is per process (all threads, present and future)
    constexpr int kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
    unsigned long perm = 0;
    if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &perm) != 0) return false;
    return (perm >> kXfeatureXtiledata) & 1;
}

}  // namespace

bool amx_available() {
    static const bool v = detect_amx();
    return v;
}

// ------------------------------------------------------------------------------------------------
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("amx-tile,amx-int8,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,gfni"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,gfni")
#endif

// Tile instructions as inline asm (tile numbers must be literals). The compiler's _tile_loadd does not
// tell it that the instruction reads memory, so it could drop or sink the stores that fill our buffers;
// here a tile load from a buffer this file writes names it as an "m" input (`mem`), and a tile store's
// destination (1 KB, as chars: it holds int32 or float) is an "=m" output. The XVecs (read in place)
// are not written during a call. No "memory" clobber: it would force the accumulators out of registers.
#define QM_TILE_LOAD(t, base, stride, mem)                                                                    \
    __asm__ volatile("{tileloadd\t(%0,%1,1), %%tmm" #t "|tileloadd\t%%tmm" #t ", [%0+%1*1]}" ::"r"(base),    \
                     "r"(static_cast<long>(stride)), "m"(mem))
#define QM_TILE_STORE(t, base)                                                                                \
    __asm__ volatile("{tilestored\t%%tmm" #t ", (%1,%2,1)|tilestored\t[%1+%2*1], %%tmm" #t "}"               \
                     : "=m"(*reinterpret_cast<char(*)[1024]>(base))                                           \
                     : "r"(base), "r"(64L))
#define QM_TILE_ZERO(t) __asm__ volatile("tilezero\t%%tmm" #t ::)
// C (s32) += A (s8) · B (u8)  /  A (u8) · B (s8)  /  C (f32) += A (bf16 pairs) · B (bf16 pairs)
#define QM_TDPBSUD(c, a, b) __asm__ volatile("tdpbsud\t%%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#define QM_TDPBUSD(c, a, b) __asm__ volatile("tdpbusd\t%%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#define QM_TDPBF16PS(c, a, b) __asm__ volatile("tdpbf16ps\t%%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

namespace {

// groups of 64 inputs per K chunk: a chunk's xsg / xqx are one 16-float vector per input, and its bias
// term one bf16 tile product (8 of the 16 pairs used). 32 KB of B tiles per pass (R).
constexpr int kChunk = 16;
static_assert(kChunk % 2 == 0 && kChunk <= 16, "kChunk: even, at most 16 (per-input rows of 16 floats)");
// R: 16-row blocks per pass over an input tile (its A rows are then re-read from L1 for the second
// block; 2 and 4 measured the same, 1 slower with two planes, and 4 would need ~113 KB of stack)
constexpr int kBlocks = 2;
// R: inputs per pass over the rows. A pass re-reads its inputs' A rows for every row block and K chunk:
// 128 inputs' K chunk is 256 KiB with two planes and stays in L2, all 512 of a prefill chunk (1 MiB) did
// not. The weights are prepared again per pass. One thread, 2048 x 2048 weights, median of 15 rounds
// alternating in one process (Xeon family 6 model 167): 512 inputs 105 -> 126 GMAC/s, 2048 inputs
// 100 -> 112; 512 x 2048 weights at 512 inputs 91 -> 98 (256 per pass: 115 / 112 / 99, 64: slower).
constexpr int64_t kPassInputs = 128;

// ldtilecfg operand (palette 1): every tile 16 rows × 64 bytes
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

inline void load_tile_config() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

// xqx (n ≤ 16 groups of one input) split into three bf16 rows hi + mid + lo = xqx exactly (truncations:
// x − hi keeps the low 16 significant bits, r − mid the low 8, which a bf16 holds): the bias operand
// of tdpbf16ps. out[i] gets 16 bf16 (32 bytes).
inline void split_bf16x3(const float* x, int n, uint16_t* out0, uint16_t* out1, uint16_t* out2) {
    const __m512 v = _mm512_maskz_loadu_ps(mask16(n), x);
    const __m512i hm = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), hm));
    const __m512 r1 = _mm512_sub_ps(v, hi);
    const __m512 mid = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r1), hm));
    const __m512 lo = _mm512_sub_ps(r1, mid);
    const __m512 parts[3] = {hi, mid, lo};
    uint16_t* out[3] = {out0, out1, out2};
    for (int i = 0; i < 3; ++i)   // the upper 16 bits of each (the lower ones are zero): the bf16
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[i]),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(parts[i]), 16)));
}

// The fold of one group for one accumulator row: acc += float(C)·(u·v), u·v = s[r,g]·xsg[m,g] (one is a
// broadcast scalar, the other a vector, depending on the orientation; the product is the same).
// C = 256·C1 + C2 for two planes (int32, exact: |C| < 2^25).
template <int P>
inline __m512 fold1(__m512 acc, const int32_t* c1, const int32_t* c2, __m512 u, __m512 v) {
    __m512i c = _mm512_load_si512(c1);
    if constexpr (P == 2) c = _mm512_add_epi32(_mm512_slli_epi32(c, 8), _mm512_load_si512(c2));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_mul_ps(u, v), acc);
}

// ================================================================================================
// Orientation R: C[m][r] (inputs × rows), inputs = A (s8), weights = B (u8)
// ================================================================================================
template <int P>
struct PassR {
    // per row block: B tiles (VNNI layout), fp32 scales [group][16 rows], and the biases as a bf16 B
    // tile (row j = the bf16 pair (b[n][2j], b[n][2j+1]) of each row n; rows ≥ gn/2 zero). Rows past
    // r1 are zero.
    alignas(64) uint8_t wb[kBlocks][kChunk][16][64];
    alignas(64) float sv[kBlocks][kChunk][16];
    alignas(64) uint16_t wbias[kBlocks][16][32];
    // the current 16-input tile: xsg per input and group, xqx split into three bf16 (the bias A tiles;
    // columns ≥ kChunk zero), A rows copied here when the XVecs are not at one stride (or for the tail:
    // rows ≥ mt zero)
    alignas(64) float xs[16][16];
    alignas(64) uint16_t xb3[3][16][32];
    alignas(64) int8_t ab[P][16][kChunk * 64];
    alignas(64) int32_t cb[2][P][16][16];   // stored C tiles, two sets (even / odd group)
    alignas(64) float cbias[16][16];
};

// B tiles, scales and bias tile of rows [rb, rb + nr) for the chunk's groups [g0, g0 + gn)
template <int P>
inline void r_prepare_weights(const WMat& W, int64_t rb, int nr, int64_t g0, int gn, PassR<P>& ps, int blk) {
    q4_rows_in_lanes(W, rb, nr, g0, gn, ps.wb[blk]);
    q4_params_in_lanes(W, false, rb, nr, g0, gn, ps.sv[blk]);
    __m512i v[16];
    // biases: the raw bf16 pairs of 16 rows (≤ 8 dwords per row), transposed as dwords
    for (int n = 0; n < 16; ++n)
        v[n] = n < nr ? _mm512_zextsi256_si512(_mm256_maskz_loadu_epi16(
                            mask16(gn), reinterpret_cast<const uint16_t*>(W.brow(rb + n)) + g0))
                      : _mm512_setzero_si512();
    transpose16(v);
    for (int j = 0; j < 16; ++j) _mm512_store_si512(ps.wbias[blk][j], v[j]);
}

// The tile part of group g: C = A·B per plane, stored to cb[S]. Set S (0/1) alternates between
// consecutive groups; its tiles: P = 1: C tmm0 / tmm2, A tmm4 / tmm5, B tmm6 / tmm7; P = 2: C tmm0,1 /
// tmm2,3, A tmm4,5 (the two planes' products alternate between them), B tmm6 / tmm7. Tiles are not
// renamed: a tile reused by the next group would make its load wait for the previous product.
template <int P, int S>
inline void r_issue(PassR<P>& ps, const int8_t* a1, const int8_t* a2, int64_t astr, const uint8_t* b, int32_t* c1,
                    int32_t* c2) {
    if constexpr (S == 0) {
        QM_TILE_ZERO(0);
        QM_TILE_LOAD(4, a1, astr, ps.ab);
        QM_TILE_LOAD(6, b, 64, ps.wb);
        QM_TDPBSUD(0, 4, 6);
        if constexpr (P == 2) {
            QM_TILE_ZERO(1);
            QM_TILE_LOAD(5, a2, astr, ps.ab);
            QM_TDPBSUD(1, 5, 6);
        }
        QM_TILE_STORE(0, c1);
        if constexpr (P == 2) QM_TILE_STORE(1, c2);
    } else {
        QM_TILE_ZERO(2);
        if constexpr (P == 1) {
            QM_TILE_LOAD(5, a1, astr, ps.ab);
            QM_TILE_LOAD(7, b, 64, ps.wb);
            QM_TDPBSUD(2, 5, 7);
        } else {
            QM_TILE_LOAD(4, a1, astr, ps.ab);
            QM_TILE_LOAD(7, b, 64, ps.wb);
            QM_TDPBSUD(2, 4, 7);
            QM_TILE_ZERO(3);
            QM_TILE_LOAD(5, a2, astr, ps.ab);
            QM_TDPBSUD(3, 5, 7);
        }
        QM_TILE_STORE(2, c1);
        if constexpr (P == 2) QM_TILE_STORE(3, c2);
    }
}

template <int P>
inline void r_fold(const PassR<P>& ps, int blk, int s, int g, __m512 acc[16]) {
    const __m512 sc = _mm512_load_ps(ps.sv[blk][g]);
#pragma GCC unroll 16
    for (int m = 0; m < 16; ++m)
        acc[m] = fold1<P>(acc[m], ps.cb[s][0][m], ps.cb[s][P - 1][m], sc, _mm512_set1_ps(ps.xs[m][g]));
}

// One row block × one 16-input tile × the chunk: A rows of group g at a1/a2 + 64·g (row stride astr);
// the result is added to (or, store_only, written into) Y[m][0..nr) for m < mt. The 16 accumulators are
// local here so that they live in registers (an array passed around stays in memory).
// Software pipeline: the tile unit computes group g+1 while group g is folded.
template <int P>
inline void r_tile(PassR<P>& ps, int blk, int gn, const int8_t* a1, const int8_t* a2, int64_t astr, float* Y,
                   int64_t ldy, int mt, int nr, bool store_only) {
    // bias term of the chunk: Σ_g xqx[m,g]·b[r,g] as three bf16 products (hi, mid, lo) into cbias[m][r]
    QM_TILE_ZERO(0);
    QM_TILE_LOAD(6, ps.wbias[blk][0], 64, ps.wbias);
    QM_TILE_LOAD(4, ps.xb3[0][0], 64, ps.xb3);
    QM_TILE_LOAD(5, ps.xb3[1][0], 64, ps.xb3);
    QM_TDPBF16PS(0, 4, 6);
    QM_TDPBF16PS(0, 5, 6);
    QM_TILE_LOAD(4, ps.xb3[2][0], 64, ps.xb3);
    QM_TDPBF16PS(0, 4, 6);
    QM_TILE_STORE(0, ps.cbias[0]);

    __m512 acc[16];
#pragma GCC unroll 16
    for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
    int32_t* c00 = ps.cb[0][0][0];
    int32_t* c01 = ps.cb[0][P - 1][0];
    int32_t* c10 = ps.cb[1][0][0];
    int32_t* c11 = ps.cb[1][P - 1][0];
    r_issue<P, 0>(ps, a1, a2, astr, ps.wb[blk][0][0], c00, c01);
    for (int g = 0; g < gn; g += 2) {
        r_issue<P, 1>(ps, a1 + 64 * (g + 1), a2 + 64 * (g + 1), astr, ps.wb[blk][g + 1][0], c10, c11);
        r_fold<P>(ps, blk, 0, g, acc);
        if (g + 2 < gn) r_issue<P, 0>(ps, a1 + 64 * (g + 2), a2 + 64 * (g + 2), astr, ps.wb[blk][g + 2][0], c00, c01);
        r_fold<P>(ps, blk, 1, g + 1, acc);
    }
    const __mmask16 ymask = mask16(nr);
#pragma GCC unroll 16
    for (int m = 0; m < 16; ++m) {
        if (m < mt) {
            float* y = Y + m * ldy;
            const __m512 v = _mm512_add_ps(acc[m], _mm512_load_ps(ps.cbias[m]));
            _mm512_mask_storeu_ps(y, ymask, store_only ? v : _mm512_add_ps(_mm512_maskz_loadu_ps(ymask, y), v));
        }
    }
}

template <int P>
void gemm_r(const WMat& W, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0, int64_t r1,
            bool accumulate) {
    const int64_t G = W.cols / 64;
    PassR<P> ps;
    std::memset(ps.xb3, 0, sizeof(ps.xb3));
    for (int64_t m0 = 0; m0 < M; m0 += kPassInputs) {            // inputs whose A rows stay in L2
        const int64_t mend = M - m0 < kPassInputs ? M : m0 + kPassInputs;
        for (int64_t rs = r0; rs < r1; rs += 16 * kBlocks) {          // up to kBlocks row blocks
            const int nb = static_cast<int>((r1 - rs + 15) / 16 < kBlocks ? (r1 - rs + 15) / 16 : kBlocks);
            for (int64_t g0 = 0; g0 < G; g0 += kChunk) {
                const int gn = static_cast<int>(G - g0 < kChunk ? G - g0 : kChunk);   // even: K % 128 == 0
                const bool store_only = g0 == 0 && !accumulate;
                for (int b = 0; b < nb; ++b) {
                    const int64_t rb = rs + 16 * b;
                    r_prepare_weights<P>(W, rb, r1 - rb < 16 ? static_cast<int>(r1 - rb) : 16, g0, gn, ps, b);
                }
                for (int64_t t0 = m0; t0 < mend; t0 += 16) {
                    const XVec* const* Xt = X + t0;
                    const int mt = mend - t0 < 16 ? static_cast<int>(mend - t0) : 16;
                    // A straight from the XVecs when their xg (and xg2) are 16 rows at one stride, else copied
                    bool direct = mt == 16;
                    const int64_t stride = direct ? Xt[1]->xg - Xt[0]->xg : 0;
                    for (int m = 1; m < mt && direct; ++m) {
                        direct = Xt[m]->xg - Xt[m - 1]->xg == stride;
                        if (P == 2) direct = direct && Xt[m]->xg2 - Xt[m - 1]->xg2 == stride;
                    }
                    const int8_t *a1, *a2;
                    int64_t astr;
                    if (direct) {
                        a1 = Xt[0]->xg + 64 * g0;
                        a2 = P == 2 ? Xt[0]->xg2 + 64 * g0 : a1;
                        astr = stride;
                    } else {
                        for (int m = 0; m < 16; ++m)
                            for (int p = 0; p < P; ++p) {
                                const int8_t* src = m < mt ? (p ? Xt[m]->xg2 : Xt[m]->xg) + 64 * g0 : nullptr;
                                for (int g = 0; g < gn; ++g)
                                    _mm512_store_si512(ps.ab[p][m] + 64 * g,
                                                       src ? _mm512_loadu_si512(src + 64 * g) : _mm512_setzero_si512());
                            }
                        a1 = ps.ab[0][0];
                        a2 = ps.ab[P - 1][0];
                        astr = kChunk * 64;
                    }
                    // per input: xsg of the chunk's groups, xqx split into three bf16 (bias A tiles)
                    for (int m = 0; m < 16; ++m) {
                        if (m < mt) {
                            _mm512_storeu_ps(ps.xs[m], _mm512_maskz_loadu_ps(mask16(gn), Xt[m]->xsg + g0));
                            split_bf16x3(Xt[m]->xqx + g0, gn, ps.xb3[0][m], ps.xb3[1][m], ps.xb3[2][m]);
                        } else {
                            _mm512_storeu_ps(ps.xs[m], _mm512_setzero_ps());
                            for (int i = 0; i < 3; ++i)   // its first 16 bf16 (the rest stay zero)
                                _mm256_storeu_si256(reinterpret_cast<__m256i*>(ps.xb3[i][m]), _mm256_setzero_si256());
                        }
                    }
                    for (int b = 0; b < nb; ++b) {
                        const int64_t rb = rs + 16 * b;
                        const int nr = r1 - rb < 16 ? static_cast<int>(r1 - rb) : 16;
                        r_tile<P>(ps, b, gn, a1, a2, astr, Y + t0 * ldy + rb, ldy, mt, nr, store_only);
                    }
                }
            }
        }
    }
}

// ================================================================================================
// Orientation T: C[r][m] (rows × inputs), weights = A (u8), inputs = B (s8)
// ================================================================================================
template <int P>
struct PassT {
    // the input tile for the chunk: B tiles (VNNI: row j = dword j of each input's group), xsg as
    // [group][16 inputs], xqx split into three bf16 and transposed as pairs (B tiles of the bias term)
    alignas(64) int8_t xb[P][kChunk][16][64];
    alignas(64) float xs[kChunk][16];
    alignas(64) uint16_t xq3[3][16][32];
    // the current row block: unpacked weights (A rows: a row's groups at stride kChunk·64), fp32
    // scales [row][group], bf16 biases [row][32] (groups ≥ gn zero)
    alignas(64) uint8_t wa[16][kChunk * 64];
    alignas(64) float sv[16][16];
    alignas(64) uint16_t wbias[16][32];
    alignas(64) int32_t cb[2][P][16][16];
    alignas(64) float cbias[16][16];
};

// the input tile (mt ≤ 16 inputs) for the chunk's groups [g0, g0 + gn)
template <int P>
inline void t_prepare_inputs(const XVec* const* X, int mt, int64_t g0, int gn, PassT<P>& ps) {
    __m512i v[16];
    for (int p = 0; p < P; ++p)
        for (int g = 0; g < gn; ++g) {
            for (int m = 0; m < 16; ++m)
                v[m] = m < mt ? _mm512_loadu_si512((p ? X[m]->xg2 : X[m]->xg) + 64 * (g0 + g)) : _mm512_setzero_si512();
            transpose16(v);
            for (int j = 0; j < 16; ++j) _mm512_store_si512(ps.xb[p][g][j], v[j]);
        }
    for (int m = 0; m < 16; ++m)
        v[m] = _mm512_castps_si512(m < mt ? _mm512_maskz_loadu_ps(mask16(gn), X[m]->xsg + g0) : _mm512_setzero_ps());
    transpose16(v);
    for (int g = 0; g < kChunk; ++g) _mm512_store_si512(ps.xs[g], v[g]);
    alignas(64) uint16_t parts[3][16][16];
    for (int m = 0; m < 16; ++m) {
        if (m < mt) split_bf16x3(X[m]->xqx + g0, gn, parts[0][m], parts[1][m], parts[2][m]);
        else
            for (int i = 0; i < 3; ++i) std::memset(parts[i][m], 0, 32);
    }
    for (int i = 0; i < 3; ++i) {   // pairs of groups (dwords) of 16 inputs, transposed
        for (int m = 0; m < 16; ++m)
            v[m] = _mm512_zextsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(parts[i][m])));
        transpose16(v);
        for (int j = 0; j < 16; ++j) _mm512_store_si512(ps.xq3[i][j], v[j]);
    }
}

// unpacked weights, scales and biases of rows [rb, rb + nr) for the chunk. A group's 32 packed bytes are
// broadcast to both halves of a zmm and one GFNI affine transform (a per-qword bit matrix) takes the low
// nibbles in the lower half and the high nibbles in the upper half: the A row in one op (the store, 1 KB
// per group of 16 rows, is what this costs).
template <int P>
inline void t_prepare_weights(const WMat& W, int64_t rb, int nr, int64_t g0, int gn, PassT<P>& ps) {
    constexpr long long kLo = 0x0102040800000000LL, kHi = 0x1020408000000000LL;   // bit i <- bit i / bit i+4
    const __m512i nib = _mm512_set_epi64(kHi, kHi, kHi, kHi, kLo, kLo, kLo, kLo);
    for (int n = 0; n < 16; ++n) {
        uint8_t* out = ps.wa[n];
        if (n < nr) {
            const uint8_t* w = W.row(rb + n) + 32 * g0;
            for (int g = 0; g < gn; ++g) {
                const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * g));
                const __m512i b = _mm512_broadcast_i64x4(packed);
                _mm512_store_si512(out + 64 * g, _mm512_gf2p8affine_epi64_epi8(b, nib, 0));
            }
            _mm512_storeu_ps(ps.sv[n], _mm512_castsi512_ps(_mm512_slli_epi32(
                                           _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(
                                               mask16(gn), reinterpret_cast<const uint16_t*>(W.srow(rb + n)) + g0)),
                                           16)));
            _mm512_store_si512(ps.wbias[n], _mm512_zextsi256_si512(_mm256_maskz_loadu_epi16(
                                                 mask16(gn), reinterpret_cast<const uint16_t*>(W.brow(rb + n)) + g0)));
        } else {
            std::memset(out, 0, 64 * static_cast<size_t>(gn));
            _mm512_storeu_ps(ps.sv[n], _mm512_setzero_ps());
            _mm512_store_si512(ps.wbias[n], _mm512_setzero_si512());
        }
    }
}

template <int P, int S>
inline void t_issue(PassT<P>& ps, int g, int32_t* c1, int32_t* c2) {
    if constexpr (S == 0) {
        QM_TILE_ZERO(0);
        QM_TILE_LOAD(4, ps.wa[0] + 64 * g, kChunk * 64, ps.wa);
        QM_TILE_LOAD(6, ps.xb[0][g][0], 64, ps.xb);
        QM_TDPBUSD(0, 4, 6);
        if constexpr (P == 2) {
            QM_TILE_ZERO(1);
            QM_TILE_LOAD(5, ps.xb[1][g][0], 64, ps.xb);
            QM_TDPBUSD(1, 4, 5);
        }
        QM_TILE_STORE(0, c1);
        if constexpr (P == 2) QM_TILE_STORE(1, c2);
    } else {
        QM_TILE_ZERO(2);
        QM_TILE_LOAD(7, ps.wa[0] + 64 * g, kChunk * 64, ps.wa);
        if constexpr (P == 1) {
            QM_TILE_LOAD(5, ps.xb[0][g][0], 64, ps.xb);
            QM_TDPBUSD(2, 7, 5);
        } else {
            QM_TILE_LOAD(6, ps.xb[0][g][0], 64, ps.xb);
            QM_TDPBUSD(2, 7, 6);
            QM_TILE_ZERO(3);
            QM_TILE_LOAD(5, ps.xb[1][g][0], 64, ps.xb);
            QM_TDPBUSD(3, 7, 5);
        }
        QM_TILE_STORE(2, c1);
        if constexpr (P == 2) QM_TILE_STORE(3, c2);
    }
}

template <int P>
inline void t_fold(const PassT<P>& ps, int s, int g, __m512 acc[16]) {
    const __m512 xv = _mm512_load_ps(ps.xs[g]);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r)
        acc[r] = fold1<P>(acc[r], ps.cb[s][0][r], ps.cb[s][P - 1][r], _mm512_set1_ps(ps.sv[r][g]), xv);
}

// One row block × the input tile × the chunk; Y[m][0..nr) for m < mt as in r_tile
template <int P>
inline void t_tile(PassT<P>& ps, int gn, float* Y, int64_t ldy, int mt, int nr, bool store_only) {
    QM_TILE_ZERO(0);   // bias term: cbias[r][m] = Σ_g b[r,g]·xqx[m,g]
    QM_TILE_LOAD(4, ps.wbias[0], 64, ps.wbias);
    QM_TILE_LOAD(6, ps.xq3[0][0], 64, ps.xq3);
    QM_TILE_LOAD(5, ps.xq3[1][0], 64, ps.xq3);
    QM_TDPBF16PS(0, 4, 6);
    QM_TDPBF16PS(0, 4, 5);
    QM_TILE_LOAD(6, ps.xq3[2][0], 64, ps.xq3);
    QM_TDPBF16PS(0, 4, 6);
    QM_TILE_STORE(0, ps.cbias[0]);

    __m512 acc[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    int32_t* c00 = ps.cb[0][0][0];
    int32_t* c01 = ps.cb[0][P - 1][0];
    int32_t* c10 = ps.cb[1][0][0];
    int32_t* c11 = ps.cb[1][P - 1][0];
    t_issue<P, 0>(ps, 0, c00, c01);
    for (int g = 0; g < gn; g += 2) {
        t_issue<P, 1>(ps, g + 1, c10, c11);
        t_fold<P>(ps, 0, g, acc);
        if (g + 2 < gn) t_issue<P, 0>(ps, g + 2, c00, c01);
        t_fold<P>(ps, 1, g + 1, acc);
    }
    __m512i v[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) v[r] = _mm512_castps_si512(_mm512_add_ps(acc[r], _mm512_load_ps(ps.cbias[r])));
    transpose16(v);   // v[m] lane r
    const __mmask16 ymask = mask16(nr);
    for (int m = 0; m < mt; ++m) {
        float* y = Y + m * ldy;
        const __m512 o = _mm512_castsi512_ps(v[m]);
        _mm512_mask_storeu_ps(y, ymask, store_only ? o : _mm512_add_ps(_mm512_maskz_loadu_ps(ymask, y), o));
    }
}

template <int P>
void gemm_t(const WMat& W, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0, int64_t r1,
            bool accumulate) {
    const int64_t G = W.cols / 64;
    PassT<P> ps;
    for (int64_t t0 = 0; t0 < M; t0 += 16) {
        const int mt = M - t0 < 16 ? static_cast<int>(M - t0) : 16;
        for (int64_t g0 = 0; g0 < G; g0 += kChunk) {
            const int gn = static_cast<int>(G - g0 < kChunk ? G - g0 : kChunk);
            const bool store_only = g0 == 0 && !accumulate;
            t_prepare_inputs<P>(X + t0, mt, g0, gn, ps);
            for (int64_t rb = r0; rb < r1; rb += 16) {
                const int nr = r1 - rb < 16 ? static_cast<int>(r1 - rb) : 16;
                t_prepare_weights<P>(W, rb, nr, g0, gn, ps);
                t_tile<P>(ps, gn, Y + t0 * ldy + rb, ldy, mt, nr, store_only);
            }
        }
    }
}

// Orientation by a cost model of the per-call preparation (cycles per group, measured):
//   R: passes·nb·Wt + nt·Ga   (weight transpose per row block and pass of kPassInputs inputs; A rows
//      copied per input tile unless at one stride)
//   T: nt·(At + nb·Wu) (input transpose per tile; weight unpack per tile and block)
// One weight transpose covers two groups (4-bit packing) while inputs need one per group and plane, so
// At > Wt: R wins for one row block (the engine's 16-row tasks), T for one or two input tiles and many
// row blocks (an MoE expert's rows in one call).
inline bool use_t(const XVec* const* X, int64_t M, int64_t r0, int64_t r1, int P) {
    constexpr int64_t kWt = 64, kWu = 27, kAt = 64, kAtFixed = 16, kGa = 16;
    const int64_t nt = (M + 15) / 16, nb = (r1 - r0 + 15) / 16, passes = (M + kPassInputs - 1) / kPassInputs;
    bool direct = M >= 16;
    for (int m = 1; m < 16 && direct; ++m) direct = X[m]->xg - X[m - 1]->xg == X[1]->xg - X[0]->xg;
    const int64_t cost_r = passes * nb * kWt + (direct ? 0 : nt * kGa * P);
    const int64_t cost_t = nt * (kAt * P + kAtFixed + nb * kWu);
    return cost_t < cost_r;
}

template <int P>
void gemm_amx(const WMat& W, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0, int64_t r1,
              bool accumulate, int orient) {
    load_tile_config();
    if (orient == 0 ? use_t(X, M, r0, r1, P) : orient == 2) gemm_t<P>(W, X, M, Y, ldy, r0, r1, accumulate);
    else gemm_r<P>(W, X, M, Y, ldy, r0, r1, accumulate);
    _tile_release();
}

}  // namespace

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

void q4_gemm_amx(const WMat& W, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0, int64_t r1,
                 bool accumulate) {
    if (M <= 0 || r1 <= r0) return;
    if (!amx_available()) {
        q4_gemm_scalar(W, X, M, Y, ldy, r0, r1, accumulate);
        return;
    }
    const int orient = g_amx_orientation.load(std::memory_order_relaxed);
    if (X[0]->planes == 2) gemm_amx<2>(W, X, M, Y, ldy, r0, r1, accumulate, orient);
    else gemm_amx<1>(W, X, M, Y, ldy, r0, r1, accumulate, orient);
}

#else  // not x86-64 Linux

bool amx_available() { return false; }

void q4_gemm_amx(const WMat& W, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0, int64_t r1,
                 bool accumulate) {
    q4_gemm_scalar(W, X, M, Y, ldy, r0, r1, accumulate);
}

#endif

void set_amx(bool on) { g_amx_on.store(on, std::memory_order_relaxed); }
bool amx_enabled() { return amx_available() && g_amx_on.load(std::memory_order_relaxed); }

}  // namespace qwenmetal::cpu

// AVX2+FMA and AVX-512 instantiations of kernels.inc. The whole file is built for the baseline
// x86-64 target; only the functions inside the `#pragma GCC target` regions use AVX2/AVX-512, and
// they are reached only through the dispatch table after cpuid said the CPU has the features (so
// no AVX instruction can leak into code that runs on an older CPU, unlike per-file -m flags whose
// inline functions may be merged with the baseline copies by the linker).
#include <cstring>

#include "cpu/kernels.h"
#include "cpu/amx.h"
#include "cpu/cpu_info.h"
#include "cpu/gemm_vnni.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

namespace qwenmetal::cpu {

// int8 GEMV: prefetch (T0) this far ahead in the weight stream (docs/cpu.md: NTA / 512 B streamed at
// 6.4 GB/s, T0 / 4 KiB at 12.4 GB/s = the single-core DRAM bandwidth of the test machine)
constexpr int64_t kQ8Prefetch = 4096;

// Tables of the SIMD unpack of one 2/3/5/6-bit chunk (32 values = BITS dwords of the row's bit stream)
// into 32/W vectors of W int32 lanes, value W·j + i in lane i of vector j. The chunk is loaded with a
// dword mask (exactly its BITS dwords: nothing past the row is touched, the rest reads as zero). For
// vector j, `win` copies the 4 chunk dwords from d0 = ⌊BITS·W·j / 32⌋ into every 128-bit lane (a 16-byte
// window that holds all of the vector's bits); `ctrl` (pshufb) puts into 32-bit lane i the two window
// bytes that contain value W·j + i (a value of ≤ 6 bits at an in-byte offset ≤ 7 spans ≤ 2 bytes) and
// `shift` (srlv) moves it down by its offset in the first byte; then AND with 2^BITS − 1.
// At 2 bits no value straddles a byte and W values lie in one dword: `shift` alone (over that dword
// broadcast) does it, `win`/`ctrl` are unused.
template <int W>
struct alignas(64) QbTable {
    int32_t win[32 / W][W];
    int8_t ctrl[32 / W][4 * W];
    int32_t shift[32 / W][W];
};
template <int BITS, int W>
constexpr QbTable<W> make_qb_table() {
    QbTable<W> t{};
    for (int j = 0; j < 32 / W; ++j) {
        const int d0 = BITS * W * j / 32;
        for (int i = 0; i < W; ++i) {
            const int bit = BITS * (W * j + i) - 32 * d0, byte = bit / 8;   // value W·j+i's bit in the window
            t.win[j][i] = d0 + i % 4;
            t.ctrl[j][4 * i] = static_cast<int8_t>(byte);
            t.ctrl[j][4 * i + 1] = static_cast<int8_t>(byte + 1 < 16 ? byte + 1 : -128);
            t.ctrl[j][4 * i + 2] = t.ctrl[j][4 * i + 3] = -128;                        // -128: a zero byte
            t.shift[j][i] = BITS == 2 ? 2 * ((W * j) % 16 + i) : bit % 8;
        }
    }
    return t;
}
template <int BITS, int W>
inline constexpr QbTable<W> kQb = make_qb_table<BITS, W>();

// ------------------------------------------------------------------------------------------------
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace {
namespace avx2 {
struct VT {
    static constexpr int W = 8;
    static constexpr int MM_NR = 1, MM_MX = 6;     // register tile of gemm_x (16 ymm registers)
    static constexpr int64_t TILE_GEMM_MIN_ROWS = 16;   // 16 registers: the L1/L2 tile wins from 16 rows
    using V = __m256;
    static inline V zero() { return _mm256_setzero_ps(); }
    static inline V set1(float a) { return _mm256_set1_ps(a); }
    static inline V load(const float* p) { return _mm256_loadu_ps(p); }
    static inline V loadn(const float* p, int n) {
        alignas(32) float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int i = 0; i < n; ++i) t[i] = p[i];
        return _mm256_load_ps(t);
    }
    static inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
    static inline void storen(float* p, V v, int n) {
        alignas(32) float t[8];
        _mm256_store_ps(t, v);
        for (int i = 0; i < n; ++i) p[i] = t[i];
    }
    static inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static inline V add(V a, V b) { return _mm256_add_ps(a, b); }
    static inline V div(V a, V b) { return _mm256_div_ps(a, b); }
    static inline V max(V a, V b) { return _mm256_max_ps(a, b); }
    static inline float reduce_max(V v) {
        __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        s = _mm_max_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    // out[i] = Σ a[i] for 8 vectors: a transposing add tree (17 shuffles + 7 adds instead of 8 reduces)
    static inline void reduce_w(const V* a, float* out) {
        V b[4];
        for (int i = 0; i < 4; ++i)   // 128-bit lane L of b[i]: 4 partial sums of a[2i + L]
            b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                                 _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
        const V e = _mm256_add_ps(_mm256_unpacklo_ps(b[0], b[1]), _mm256_unpackhi_ps(b[0], b[1]));
        const V f = _mm256_add_ps(_mm256_unpacklo_ps(b[2], b[3]), _mm256_unpackhi_ps(b[2], b[3]));
        const V r = _mm256_add_ps(_mm256_shuffle_ps(e, f, 0x44), _mm256_shuffle_ps(e, f, 0xEE));
        // r[4L + i] = Σ a[2i + L]
        _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
    // for the exp of kernels.inc (vexp): round to nearest, p·2^n for integral n in [-126, 127]
    static constexpr bool EXP_POLY = true;
    static inline V min(V a, V b) { return _mm256_min_ps(a, b); }
    static inline V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static inline V pow2n(V p, V n) {
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    }
    static inline float reduce(V v) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    static inline V load_bf16(const uint16_t* p) {
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
    }
    static inline V loadn_bf16(const uint16_t* p, int n) {
        alignas(16) uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int i = 0; i < n; ++i) t[i] = p[i];
        return load_bf16(t);
    }
    static inline V load_f16(const uint16_t* p) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    static inline V loadn_f16(const uint16_t* p, int n) {
        alignas(16) uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int i = 0; i < n; ++i) t[i] = p[i];
        return load_f16(t);
    }
    static inline void q4(const uint8_t* p, V& even, V& odd) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        even = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
        odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
    }
    static inline void q4_natural(const uint8_t* p, V& a, V& b) {
        V e, o;
        q4(p, e, o);
        const V lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);
        a = _mm256_permute2f128_ps(lo, hi, 0x20);
        b = _mm256_permute2f128_ps(lo, hi, 0x31);
    }
    static inline V q8(const uint8_t* p) {
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    }
    // the shifted lanes of qb -> float values: at 2/3 bits vpermps (which reads the low 3 bits of each
    // index) from a table of 0..2^BITS-1, one shuffle instead of AND + convert
    template <int BITS>
    static inline V qb_value(__m256i v) {
        constexpr int k = (1 << BITS) - 1;
        if constexpr (BITS <= 3)
            return _mm256_permutevar8x32_ps(_mm256_setr_ps(0, 1 & k, 2 & k, 3 & k, 4 & k, 5 & k, 6 & k, 7 & k), v);
        else return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(k)));
    }
    static inline __m256i ldi(const void* q) { return _mm256_load_si256(static_cast<const __m256i*>(q)); }
    // 2/3/5/6 bits: one 32-value chunk -> 4 vectors (tables: QbTable)
    template <int BITS>
    static inline void qb(const uint8_t* p, V* out) {
        constexpr const QbTable<8>& t = kQb<BITS, 8>;
        if constexpr (BITS == 2) {
            for (int j = 0; j < 4; ++j) {
                int32_t w;
                std::memcpy(&w, p + 4 * (j / 2), 4);
                const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(w), ldi(t.shift[j]));
                out[j] = qb_value<BITS>(v);
            }
        } else {
            const __m256i first = _mm256_cmpgt_epi32(_mm256_set1_epi32(BITS), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            const __m256i c = _mm256_maskload_epi32(reinterpret_cast<const int*>(p), first);   // the BITS dwords
            for (int j = 0; j < 4; ++j) {
                __m256i v = _mm256_permutevar8x32_epi32(c, ldi(t.win[j]));
                v = _mm256_shuffle_epi8(v, ldi(t.ctrl[j]));
                v = _mm256_srlv_epi32(v, ldi(t.shift[j]));
                out[j] = qb_value<BITS>(v);
            }
        }
    }
    // ---- int8-activation GEMV (kernels.inc q4i8_gemv): one group (32 weight bytes) per step; with
    // AVX-VNNI (Alder Lake and later client Intel, Zen 5, Sapphire Rapids: the VEX-encoded vpdpbusd on
    // ymm) two vpdpbusd instead of maddubs, maddubs, add, madd: 5 instead of 8 integer ops per group
    static constexpr bool Q8_SIMD = true, Q8_GEMM = true, XQ_SIMD = false, QB_SIMD = true, Q8_TILE_EXACT = false;
    static constexpr int Q8B = 32, Q8E = 1;
    static bool int_gemm() { return avx_vnni_gemm_enabled(); }   // Kernels::int_gemm
    // prefill (kernels.inc q4i8_gemm): from kAvxVnniGemmMinInputs inputs on the ymm rows-in-lanes GEMM
    // with AVX-VNNI (kernels_vnni.cpp), else (fewer inputs, no AVX-VNNI, switched off) the GEMV once per
    // input row
    static void q4i8_gemm(const WMat& Wm, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0,
                          int64_t r1, bool accumulate) {
        if (M >= kAvxVnniGemmMinInputs && avx_vnni_gemm_enabled()) {
            q4_gemm_avxvnni(Wm, X, M, Y, ldy, r0, r1, accumulate);
            return;
        }
        for (int64_t m = 0; m < M; ++m) q4i8_gemv(Wm, *X[m], Y + m * ldy, r0, r1, accumulate);
    }
    static void q4i8_gemv(const WMat& Wm, const XVec& X, float* y, int64_t r0, int64_t r1, bool accumulate) {
        const bool two = X.planes == 2;
        if (avx_vnni_enabled()) {
            if (two) for (int64_t r = r0; r < r1; ++r) q4i8_rows<2, true>(Wm, X, y, r, accumulate);
            else for (int64_t r = r0; r < r1; ++r) q4i8_rows<1, true>(Wm, X, y, r, accumulate);
        } else {
            if (two) for (int64_t r = r0; r < r1; ++r) q4i8_rows<2, false>(Wm, X, y, r, accumulate);
            else for (int64_t r = r0; r < r1; ++r) q4i8_rows<1, false>(Wm, X, y, r, accumulate);
        }
    }
    // acc + Σ lo·xe + hi·xo per int32 lane (4 byte pairs each): vpdpbusd (AVX-VNNI), or maddubs
    // (u8 ≤ 15 × s8 (|·| ≤ 127) pairs, ≤ 3810 each, two added ≤ 7620: no int16 saturation) + madd with ones
    template <bool VNNI>
    __attribute__((target("avx2,fma,f16c,avxvnni")))
    static inline __m256i dot4(__m256i acc, __m256i lo, __m256i hi, __m256i xe, __m256i xo) {
        if constexpr (VNNI) {
            return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, lo, xe), hi, xo);
        } else {
            return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xe),
                                                                            _mm256_maddubs_epi16(hi, xo)),
                                                           _mm256_set1_epi16(1)));
        }
    }
    // one weight row; PL = 1 (int8) or 2 (int16: the integer is 256·Σq·xq + Σq·xq2); compiled with
    // avxvnni enabled, the VNNI=false instantiation uses only AVX2 instructions
    template <int PL, bool VNNI>
    __attribute__((target("avx2,fma,f16c,avxvnni")))
    static inline void q4i8_rows(const WMat& Wm, const XVec& X, float* y, int64_t r, bool accumulate) {
        const int64_t G = Wm.cols / 64;
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        const uint8_t* wr = Wm.row(r);
        const uint16_t* sr = reinterpret_cast<const uint16_t*>(Wm.srow(r));
        const uint16_t* br = reinterpret_cast<const uint16_t*>(Wm.brow(r));
        __m256 acc = _mm256_setzero_ps(), bacc = _mm256_setzero_ps();
        // per 8 groups: their scales s·sx as one vector (bf16 load + shift + multiply) and the bias term
        // b·Σx̂ by one FMA; each group's scale then reaches all lanes by one vpermps (instead of a scalar
        // bf16 convert, multiply and broadcast per group, and a scalar bias FMA)
        for (int64_t g0 = 0; g0 < G; g0 += 8) {
            const int n = G - g0 < 8 ? static_cast<int>(G - g0) : 8;
            const __m256 s8 = _mm256_mul_ps(n == 8 ? load_bf16(sr + g0) : loadn_bf16(sr + g0, n),
                                            n == 8 ? load(X.xsg + g0) : loadn(X.xsg + g0, n));
            bacc = _mm256_fmadd_ps(n == 8 ? load_bf16(br + g0) : loadn_bf16(br + g0, n),
                                   n == 8 ? load(X.xqx + g0) : loadn(X.xqx + g0, n), bacc);
#pragma GCC unroll 8
            for (int j = 0; j < 8; ++j) {
                const int64_t g = g0 + j;
                if (g == G) break;
                _mm_prefetch(reinterpret_cast<const char*>(wr + 32 * g + kQ8Prefetch), _MM_HINT_T0);
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + 32 * g));
                const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                const auto ld = [&](const int8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); };
                __m256i is = dot4<VNNI>(_mm256_setzero_si256(), lo, hi, ld(X.xq + 64 * g), ld(X.xq + 64 * g + 32));
                if constexpr (PL == 2)
                    is = dot4<VNNI>(_mm256_slli_epi32(is, 8), lo, hi, ld(X.xq2 + 64 * g), ld(X.xq2 + 64 * g + 32));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_permutevar8x32_ps(s8, _mm256_set1_epi32(j)), acc);
            }
        }
        const float v = reduce(acc) + reduce(bacc);
        y[r] = accumulate ? y[r] + v : v;
    }
};
#include "cpu/kernels.inc"
}  // namespace avx2
}  // namespace
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// ------------------------------------------------------------------------------------------------
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif
namespace {
namespace avx512 {
struct VT {
    static constexpr int W = 16;
    static constexpr int MM_NR = 2, MM_MX = 8;     // register tile of gemm_x (32 zmm registers)
    static constexpr int64_t TILE_GEMM_MIN_ROWS = 0;    // zmm tile loads saturate L2: register tile always
    using V = __m512;
    static inline __mmask16 mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
    static inline V zero() { return _mm512_setzero_ps(); }
    static inline V set1(float a) { return _mm512_set1_ps(a); }
    static inline V load(const float* p) { return _mm512_loadu_ps(p); }
    static inline V loadn(const float* p, int n) { return _mm512_maskz_loadu_ps(mask(n), p); }
    static inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
    static inline void storen(float* p, V v, int n) { _mm512_mask_storeu_ps(p, mask(n), v); }
    static inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static inline V add(V a, V b) { return _mm512_add_ps(a, b); }
    static inline V div(V a, V b) { return _mm512_div_ps(a, b); }
    static inline V max(V a, V b) { return _mm512_max_ps(a, b); }
    static inline float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
    // out[i] = Σ a[i] for 16 vectors: a transposing add tree (31 shuffles + 15 adds + 1 permute instead
    // of 16 reduces)
    static inline void reduce_w(const V* a, float* out) {
        V b[8], c[4];
        for (int i = 0; i < 8; ++i)   // b[i] 128-bit lanes 0,1: partial sums of a[2i]; 2,3: of a[2i+1]
            b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                                 _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
        for (int j = 0; j < 4; ++j)   // c[j] lane L: 4 partial sums of a[4j + L]
            c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88),
                                 _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xDD));
        const V e = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
        const V f = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
        const V r = _mm512_add_ps(_mm512_shuffle_ps(e, f, 0x44), _mm512_shuffle_ps(e, f, 0xEE));
        // r[4L + m] = Σ a[4m + L]
        const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_storeu_ps(out, _mm512_permutexvar_ps(idx, r));
    }
    // for the exp of kernels.inc (vexp): round to nearest, p·2^n by vscalefps
    static constexpr bool EXP_POLY = true;
    static inline V min(V a, V b) { return _mm512_min_ps(a, b); }
    static inline V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static inline V pow2n(V p, V n) { return _mm512_scalef_ps(p, n); }
    static inline float reduce(V v) {
        __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        t = _mm_add_ps(t, _mm_movehl_ps(t, t));
        t = _mm_add_ss(t, _mm_movehdup_ps(t));
        return _mm_cvtss_f32(t);
    }
    static inline V bf16_bits(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
    static inline V load_bf16(const uint16_t* p) {
        return bf16_bits(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
    static inline V loadn_bf16(const uint16_t* p, int n) { return bf16_bits(_mm256_maskz_loadu_epi16(mask(n), p)); }
    static inline V load_f16(const uint16_t* p) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
    static inline V loadn_f16(const uint16_t* p, int n) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask(n), p)); }
    static inline void q4(const uint8_t* p, V& even, V& odd) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        even = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
        odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
    }
    static inline void q4_natural(const uint8_t* p, V& a, V& b) {
        V e, o;
        q4(p, e, o);
        const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
        a = _mm512_permutex2var_ps(e, lo, o);
        b = _mm512_permutex2var_ps(e, hi, o);
    }
    static inline V q8(const uint8_t* p) {
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
    // the shifted lanes of qb -> float values: at 2/3 bits vpermps (which reads the low 4 bits of each
    // index) from a table of (0..15) & (2^BITS-1), one shuffle instead of AND + convert
    template <int BITS>
    static inline V qb_value(__m512i v) {
        constexpr int k = (1 << BITS) - 1;
        if constexpr (BITS <= 3)
            return _mm512_permutexvar_ps(v, _mm512_setr_ps(0, 1 & k, 2 & k, 3 & k, 4 & k, 5 & k, 6 & k, 7 & k, 8 & k,
                                                           9 & k, 10 & k, 11 & k, 12 & k, 13 & k, 14 & k, 15 & k));
        else return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(k)));
    }
    // 2/3/5/6 bits: one 32-value chunk -> 2 vectors (tables: QbTable)
    template <int BITS>
    static inline void qb(const uint8_t* p, V* out) {
        constexpr const QbTable<16>& t = kQb<BITS, 16>;
        if constexpr (BITS == 2) {
            for (int j = 0; j < 2; ++j) {
                int32_t w;
                std::memcpy(&w, p + 4 * j, 4);
                const __m512i v = _mm512_srlv_epi32(_mm512_set1_epi32(w), _mm512_load_si512(t.shift[j]));
                out[j] = qb_value<BITS>(v);
            }
        } else {
            const __mmask8 first = static_cast<__mmask8>((1u << BITS) - 1u);
            const __m512i c = _mm512_zextsi256_si512(_mm256_maskz_loadu_epi32(first, p));   // the BITS dwords
            for (int j = 0; j < 2; ++j) {
                __m512i v = _mm512_permutexvar_epi32(_mm512_load_si512(t.win[j]), c);
                v = _mm512_shuffle_epi8(v, _mm512_load_si512(t.ctrl[j]));
                v = _mm512_srlv_epi32(v, _mm512_load_si512(t.shift[j]));
                out[j] = qb_value<BITS>(v);
            }
        }
    }
    // acc + Σ lo·xe + hi·xo per int32 lane (4 byte pairs each): vpdpbusd, or the AVX512BW pair
    // maddubs (u8 ≤ 15 × s8, ≤ 3810 per pair: no int16 saturation) + madd with ones
    template <bool VNNI>
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
    static inline __m512i dot4(__m512i acc, __m512i lo, __m512i hi, __m512i xe, __m512i xo, __m512i ones) {
        if constexpr (VNNI) {
            return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, lo, xe), hi, xo);
        } else {
            return _mm512_add_epi32(
                acc, _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(lo, xe), _mm512_maddubs_epi16(hi, xo)),
                                       ones));
        }
    }
    // ---- int8-activation GEMV (kernels.inc q4i8_gemv): one 64-byte load = two groups; the int32
    // lanes 0-7 hold group 2p, 8-15 group 2p+1, scaled by a per-lane vector of s·sx
    static constexpr bool Q8_SIMD = true, Q8_GEMM = true, XQ_SIMD = true, QB_SIMD = true, Q8_TILE_EXACT = true;
    static bool int_gemm() { return Q8_GEMM; }   // Kernels::int_gemm
    // one group of 64 inputs -> its int8 plane(s) (kernels.inc xq_prepare: same integers as the scalar
    // code there): the even / odd elements separated on floats (4 permutes), x·inv rounded to nearest
    // even by cvtps2dq, the residual (x − sx·q)·256·inv likewise, each narrowed to 16 bytes by vpmovdb.
    // Writes the 32 even then 32 odd values to `ev`/`od` of plane 1 (and `ev2`/`od2` of plane 2) in the
    // GEMV layout and to `gq`/`gq2` (64 contiguous bytes) in the AMX layout. Returns false, writing
    // nothing, if the group holds a NaN or infinity (the scalar code handles those).
    static inline bool xq_group(const float* x, int planes, float& amax_out, int32_t& sum, int32_t& sum2,
                                int8_t* ev, int8_t* od, int8_t* ev2, int8_t* od2, int8_t* gq, int8_t* gq2) {
        const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
        __m512 v[4];
        __m512 am = _mm512_setzero_ps();
        __mmask16 bad = 0;
        for (int j = 0; j < 4; ++j) {
            const __m512 a = _mm512_loadu_ps(x + 16 * j);
            bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(a, a), _mm512_setzero_ps(), _CMP_NEQ_UQ);   // NaN or ±inf
            am = _mm512_max_ps(am, _mm512_abs_ps(a));
        }
        if (bad) return false;
        const float amax = _mm512_reduce_max_ps(am);
        amax_out = amax;
        const float sx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        v[0] = _mm512_permutex2var_ps(_mm512_loadu_ps(x), ie, _mm512_loadu_ps(x + 16));        // even 0..15
        v[1] = _mm512_permutex2var_ps(_mm512_loadu_ps(x + 32), ie, _mm512_loadu_ps(x + 48));   // even 16..31
        v[2] = _mm512_permutex2var_ps(_mm512_loadu_ps(x), io, _mm512_loadu_ps(x + 16));        // odd 0..15
        v[3] = _mm512_permutex2var_ps(_mm512_loadu_ps(x + 32), io, _mm512_loadu_ps(x + 48));   // odd 16..31
        const __m512 vinv = _mm512_set1_ps(inv), vsx = _mm512_set1_ps(sx), vinv2 = _mm512_set1_ps(256.f * inv);
        const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
        __m512i s1 = _mm512_setzero_si512(), s2 = _mm512_setzero_si512();
        int8_t* dst1[4] = {ev, ev + 16, od, od + 16};
        int8_t* dst2[4] = {ev2, ev2 + 16, od2, od2 + 16};
        for (int j = 0; j < 4; ++j) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[j], vinv));
            q = _mm512_max_epi32(_mm512_min_epi32(q, lim), nlim);
            s1 = _mm512_add_epi32(s1, q);
            const __m128i b = _mm512_cvtepi32_epi8(q);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst1[j]), b);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(gq + 16 * j), b);
            if (planes == 2) {
                const __m512 r = _mm512_sub_ps(v[j], _mm512_mul_ps(vsx, _mm512_cvtepi32_ps(q)));
                __m512i q2 = _mm512_cvtps_epi32(_mm512_mul_ps(r, vinv2));
                q2 = _mm512_max_epi32(_mm512_min_epi32(q2, lim), nlim);
                s2 = _mm512_add_epi32(s2, q2);
                const __m128i b2 = _mm512_cvtepi32_epi8(q2);
                _mm_storeu_si128(reinterpret_cast<__m128i*>(dst2[j]), b2);
                _mm_storeu_si128(reinterpret_cast<__m128i*>(gq2 + 16 * j), b2);
            }
        }
        sum = _mm512_reduce_add_epi32(s1);
        sum2 = _mm512_reduce_add_epi32(s2);
        return true;
    }
    static constexpr int Q8B = 64, Q8E = 8;
    // (compiled with avx512vnni enabled; the VNNI=false instantiation uses only AVX512BW instructions
    // and is the one called on CPUs without VNNI)
    // (VNNI: vpdpbusd, else the AVX512BW pair maddubs+madd; PL = 1 (int8) or 2 (int16: the integer is
    // 256·Σq·xq + Σq·xq2, accumulated in one int32 vector: dpbusd plane 1, shift by 8, dpbusd plane 2))
    template <int NR, bool VNNI, int PL>
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
    static inline void q4i8_rows_t(const WMat& Wm, const XVec& X, float* y, int64_t r, bool accumulate) {
        const int64_t G = Wm.cols / 64, P = G / 2;
        const __m512i m4 = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi16(1);
        const __m512i pair_idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);   // + 2·(p mod 8)
        const uint8_t* wr[NR];
        const uint16_t* sr[NR];
        const uint16_t* br[NR];
        __m512 acc[NR];
        for (int i = 0; i < NR; ++i) {
            wr[i] = Wm.row(r + i);
            sr[i] = reinterpret_cast<const uint16_t*>(Wm.srow(r + i));
            br[i] = reinterpret_cast<const uint16_t*>(Wm.brow(r + i));
            acc[i] = _mm512_setzero_ps();
        }
        // the scales s·sx of 16 groups (8 weight loads) at once: one bf16 load + shift + multiply, then one
        // vpermps per 64-byte load spreads the pair's two into lanes 0-7 / 8-15 (instead of a scalar load,
        // broadcast, masked vpermw and a multiply per load); same products s·sx, same result
        for (int64_t p0 = 0; p0 < P; p0 += 8) {
            const int n = G - 2 * p0 < 16 ? static_cast<int>(G - 2 * p0) : 16;
            const __m512 sx16 = loadn(X.xsg + 2 * p0, n);
            __m512 s16[NR];
            for (int i = 0; i < NR; ++i) s16[i] = _mm512_mul_ps(loadn_bf16(sr[i] + 2 * p0, n), sx16);
#pragma GCC unroll 8
            for (int j = 0; j < 8; ++j) {
                const int64_t p = p0 + j;
                if (p == P) break;
                const __m512i sidx = _mm512_add_epi32(pair_idx, _mm512_set1_epi32(2 * j));
                const __m512i xe = _mm512_load_si512(X.xq + 128 * p);
                const __m512i xo = _mm512_load_si512(X.xq + 128 * p + 64);
                for (int i = 0; i < NR; ++i) {
                    _mm_prefetch(reinterpret_cast<const char*>(wr[i] + 64 * p + kQ8Prefetch), _MM_HINT_T0);
                    const __m512i v = _mm512_loadu_si512(wr[i] + 64 * p);
                    const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    __m512i is = dot4<VNNI>(_mm512_setzero_si512(), lo, hi, xe, xo, ones);
                    if constexpr (PL == 2) {
                        const __m512i xe2 = _mm512_load_si512(X.xq2 + 128 * p);
                        const __m512i xo2 = _mm512_load_si512(X.xq2 + 128 * p + 64);
                        is = dot4<VNNI>(_mm512_slli_epi32(is, 8), lo, hi, xe2, xo2, ones);
                    }
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_permutexvar_ps(sidx, s16[i]), acc[i]);
                }
            }
        }
        for (int i = 0; i < NR; ++i) {       // bias part: Σ b·Σx, 16 groups per step
            __m512 b = acc[i];
            for (int64_t g = 0; g < G; g += 16) {
                const int n = G - g < 16 ? static_cast<int>(G - g) : 16;
                b = _mm512_fmadd_ps(loadn_bf16(br[i] + g, n), loadn(X.xqx + g, n), b);
            }
            const float v = reduce(b);
            y[r + i] = accumulate ? y[r + i] + v : v;
        }
    }

    // int8 register tile (prefill, activations="int8"): NR weight rows x MX input rows; each 64-byte
    // weight load is unpacked once (and its scale vector built once) for the MX inputs. Used with
    // NR = 1, MX = 16 (then 8/4/2/1): the ops per (row, input) are the same for any NR (the x loads are
    // memory operands), and 2 x 8 ran out of zmm registers (spills)
    template <int NR, int MX, bool VNNI, int PL>
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
    static inline void q4i8_block(const WMat& Wm, const XVec* const* X, float* Y, int64_t ldy, int64_t r,
                                  bool accumulate) {
        const int64_t G = Wm.cols / 64, P = G / 2;
        const __m512i m4 = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi16(1);
        const __m512i sidx = _mm512_set_epi32(1 << 16, 1 << 16, 1 << 16, 1 << 16, 1 << 16, 1 << 16, 1 << 16, 1 << 16,
                                              0, 0, 0, 0, 0, 0, 0, 0);
        const uint8_t* wr[NR];
        const uint16_t* sr[NR];
        const uint16_t* br[NR];
        __m512 acc[NR][MX];
        for (int i = 0; i < NR; ++i) {
            wr[i] = Wm.row(r + i);
            sr[i] = reinterpret_cast<const uint16_t*>(Wm.srow(r + i));
            br[i] = reinterpret_cast<const uint16_t*>(Wm.brow(r + i));
            for (int m = 0; m < MX; ++m) acc[i][m] = _mm512_setzero_ps();
        }
        for (int64_t p = 0; p < P; ++p) {
            __m512i lo[NR], hi[NR];
            __m512 sv[NR];
            for (int i = 0; i < NR; ++i) {
                const __m512i v = _mm512_loadu_si512(wr[i] + 64 * p);
                lo[i] = _mm512_and_si512(v, m4);
                hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                uint32_t sw;
                std::memcpy(&sw, sr[i] + 2 * p, 4);
                sv[i] = _mm512_castsi512_ps(
                    _mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, sidx, _mm512_set1_epi32(static_cast<int>(sw))));
            }
            for (int m = 0; m < MX; ++m) {
                const __m512i xe = _mm512_load_si512(X[m]->xq + 128 * p);
                const __m512i xo = _mm512_load_si512(X[m]->xq + 128 * p + 64);
                const __m512 sxv = _mm512_load_ps(X[m]->xqs + 16 * p);
                for (int i = 0; i < NR; ++i) {
                    __m512i is = dot4<VNNI>(_mm512_setzero_si512(), lo[i], hi[i], xe, xo, ones);
                    if constexpr (PL == 2) {
                        const __m512i xe2 = _mm512_load_si512(X[m]->xq2 + 128 * p);
                        const __m512i xo2 = _mm512_load_si512(X[m]->xq2 + 128 * p + 64);
                        is = dot4<VNNI>(_mm512_slli_epi32(is, 8), lo[i], hi[i], xe2, xo2, ones);
                    }
                    acc[i][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(sv[i], sxv), acc[i][m]);
                }
            }
        }
        for (int i = 0; i < NR; ++i)
            for (int m = 0; m < MX; ++m) {
                __m512 b = acc[i][m];
                for (int64_t g = 0; g < G; g += 16) {
                    const int n = G - g < 16 ? static_cast<int>(G - g) : 16;
                    b = _mm512_fmadd_ps(loadn_bf16(br[i] + g, n), loadn(X[m]->xqx + g, n), b);
                }
                const float v = reduce(b);
                float* y = Y + m * ldy + r + i;
                *y = accumulate ? *y + v : v;
            }
    }
    template <int MX, bool VNNI, int PL>
    static void q4i8_mrows(const WMat& Wm, const XVec* const* X, float* Y, int64_t ldy, int64_t r0, int64_t r1,
                           bool accumulate) {
        for (int64_t r = r0; r < r1; ++r) q4i8_block<1, MX, VNNI, PL>(Wm, X, Y, ldy, r, accumulate);
    }
    template <bool VNNI, int PL>
    static void q4i8_gemm_t(const WMat& Wm, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0,
                            int64_t r1, bool accumulate) {
        int64_t m = 0;
        for (; m + 16 <= M; m += 16) q4i8_mrows<16, VNNI, PL>(Wm, X + m, Y + m * ldy, ldy, r0, r1, accumulate);
        for (; m + 8 <= M; m += 8) q4i8_mrows<8, VNNI, PL>(Wm, X + m, Y + m * ldy, ldy, r0, r1, accumulate);
        if (M - m >= 4) { q4i8_mrows<4, VNNI, PL>(Wm, X + m, Y + m * ldy, ldy, r0, r1, accumulate); m += 4; }
        if (M - m >= 2) { q4i8_mrows<2, VNNI, PL>(Wm, X + m, Y + m * ldy, ldy, r0, r1, accumulate); m += 2; }
        if (M - m >= 1) q4i8_mrows<1, VNNI, PL>(Wm, X + m, Y + m * ldy, ldy, r0, r1, accumulate);
    }
    static void q4i8_gemm(const WMat& Wm, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0,
                          int64_t r1, bool accumulate) {
        if (amx_enabled()) {   // the tile unit where the CPU and the OS allow it (kernels_amx.cpp)
            q4_gemm_amx(Wm, X, M, Y, ldy, r0, r1, accumulate);
            return;
        }
        if (vnni_gemm_enabled()) {   // else the VNNI GEMM, rows in lanes (kernels_vnni.cpp)
            q4_gemm_vnni(Wm, X, M, Y, ldy, r0, r1, accumulate);
            return;
        }
        q4i8_gemv_multi(Wm, X, M, Y, ldy, r0, r1, accumulate);   // else the register tile
    }
    // a speculative verification's rows (kernels.inc gemv_multi): the register tile q4i8_block without the
    // AMX / rows-in-lanes GEMMs. Per (row, input) it runs q4i8_rows_t<1>'s arithmetic in its order (the
    // products s·sx, the groups in order into the same lanes, the bias part, the reduction), so every
    // output is bit for bit the GEMV's (tests/test_speculative.py); each weight load is unpacked once
    static void q4i8_gemv_multi(const WMat& Wm, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0,
                                int64_t r1, bool accumulate) {
        const bool two = X[0]->planes == 2;
        if (vnni_enabled()) {
            if (two) q4i8_gemm_t<true, 2>(Wm, X, M, Y, ldy, r0, r1, accumulate);
            else q4i8_gemm_t<true, 1>(Wm, X, M, Y, ldy, r0, r1, accumulate);
        } else {
            if (two) q4i8_gemm_t<false, 2>(Wm, X, M, Y, ldy, r0, r1, accumulate);
            else q4i8_gemm_t<false, 1>(Wm, X, M, Y, ldy, r0, r1, accumulate);
        }
    }
    static void q4i8_gemv(const WMat& Wm, const XVec& X, float* y, int64_t r0, int64_t r1, bool accumulate) {
        // one row at a time: the weight stream stays sequential, which (with the T0 prefetch 4 KiB
        // ahead) streams at the single-core DRAM bandwidth; 4 rows per pass (sharing the x loads)
        // measured 9-10 GB/s vs 12.4 (docs/cpu.md)
        const bool two = X.planes == 2;
        if (vnni_enabled()) {
            if (two) for (int64_t r = r0; r < r1; ++r) q4i8_rows_t<1, true, 2>(Wm, X, y, r, accumulate);
            else for (int64_t r = r0; r < r1; ++r) q4i8_rows_t<1, true, 1>(Wm, X, y, r, accumulate);
        } else {
            if (two) for (int64_t r = r0; r < r1; ++r) q4i8_rows_t<1, false, 2>(Wm, X, y, r, accumulate);
            else for (int64_t r = r0; r < r1; ++r) q4i8_rows_t<1, false, 1>(Wm, X, y, r, accumulate);
        }
    }
};
#include "cpu/kernels.inc"
}  // namespace avx512
}  // namespace
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

const Kernels* kernels_avx2() {
    if (!cpu_info().f.avx2_core()) return nullptr;
    return avx2::table(Isa::AVX2, "avx2");
}

const Kernels* kernels_avx512() {
    if (!cpu_info().f.avx512_core()) return nullptr;
    return avx512::table(Isa::AVX512, "avx512");
}

}  // namespace qwenmetal::cpu

#else  // not x86-64

namespace qwenmetal::cpu {
const Kernels* kernels_avx2() { return nullptr; }
const Kernels* kernels_avx512() { return nullptr; }
}  // namespace qwenmetal::cpu

#endif

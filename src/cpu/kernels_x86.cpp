// AVX2+FMA and AVX-512 instantiations of kernels.inc. The whole file is built for the baseline
// x86-64 target; only the functions inside the `#pragma GCC target` regions use AVX2/AVX-512, and
// they are reached only through the dispatch table after cpuid said the CPU has the features (so
// no AVX instruction can leak into code that runs on an older CPU, unlike per-file -m flags whose
// inline functions may be merged with the baseline copies by the linker).
#include "cpu/kernels.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

namespace qwenmetal::cpu {

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
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
        return nullptr;
    return avx2::table(Isa::AVX2, "avx2");
}

const Kernels* kernels_avx512() {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
          __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
        return nullptr;
    return avx512::table(Isa::AVX512, "avx512");
}

}  // namespace qwenmetal::cpu

#else  // not x86-64

namespace qwenmetal::cpu {
const Kernels* kernels_avx2() { return nullptr; }
const Kernels* kernels_avx512() { return nullptr; }
}  // namespace qwenmetal::cpu

#endif

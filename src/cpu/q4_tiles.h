// Operand preparation shared by the two integer prefill GEMMs for 4-bit group-64 weights (the AMX
// kernel, kernels_amx.cpp, and the AVX-512 VNNI kernel, kernels_vnni.cpp): 16 weight rows transposed
// into "rows in lanes" vectors, the layout of an AMX B tile and the u8 operand of a `vpdpbusd` whose
// 16 int32 lanes are 16 weight rows.
//
// The functions are compiled for AVX-512 F/BW/VL/DQ by the target region below and have internal
// linkage (each translation unit gets its own copy, so the linker never merges them with baseline
// code); callers compiled for a superset of those ISAs inline them. Call only on CPUs with AVX-512.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "cpu/tensor.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
#endif

namespace qwenmetal::cpu {
namespace {

inline __mmask16 mask16(int n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFFu : (1u << n) - 1u); }

// 16×16 transpose of 32-bit elements: r[i] lane j -> r[j] lane i (unpack 32, unpack 64, 128-bit shuffles)
inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {   // r[4i+j] 128-bit lane L: rows 4i..4i+3 of column 4L+j
        r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; ++j) {   // gather lane L of r[j], r[4+j], r[8+j], r[12+j] into column 4L+j
        const __m512i a = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88), b = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xDD);
        const __m512i c = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88),
                      d = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xDD);
        t[j] = _mm512_shuffle_i32x4(a, c, 0x88);
        t[4 + j] = _mm512_shuffle_i32x4(b, d, 0x88);
        t[8 + j] = _mm512_shuffle_i32x4(a, c, 0xDD);
        t[12 + j] = _mm512_shuffle_i32x4(b, d, 0xDD);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// The 4-bit weights of rows [rb, rb + nr) (nr ≤ 16; rows past nr are zero) and groups [g0, g0 + gn)
// (gn even) as wb[g][j], 64 bytes whose dword n belongs to row rb + n: position p < 32 of a group in the
// XVec::xg order (the group's even elements, then its odd ones) is element 2p = the low nibble of byte
// p, p ≥ 32 the high nibble of byte p − 32, so wb[g][j] (j < 8) = (dword j of each row) & 15 holds
// positions 4j..4j+3 and wb[g][8 + j] = (dword j >> 4) & 15 positions 32 + 4j..; one 16×16 dword
// transpose of 64 packed bytes × 16 rows gives two groups.
// Each row is read 64 bytes at a time, 16 rows interleaved: more concurrent streams than the hardware
// prefetchers follow (Zen 4: an expert call with its weights in DRAM ran 1.15-1.6x slower without the
// software prefetch 4 lines ahead in each row; docs/cpu.md "Zen 4 (measured)").
constexpr int kRowPrefetch = 256;
inline void q4_rows_in_lanes(const WMat& W, int64_t rb, int nr, int64_t g0, int gn, uint8_t (*wb)[16][64]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i v[16];
    for (int g = 0; g < gn; g += 2) {       // two groups = 64 packed bytes per row
        for (int n = 0; n < 16; ++n) {
            if (n < nr) _mm_prefetch(reinterpret_cast<const char*>(W.row(rb + n) + 32 * (g0 + g) + kRowPrefetch), _MM_HINT_T0);
            v[n] = n < nr ? _mm512_loadu_si512(W.row(rb + n) + 32 * (g0 + g)) : _mm512_setzero_si512();
        }
        transpose16(v);                      // v[d] = dword d of each of the 16 rows
        for (int h = 0; h < 2; ++h)
            for (int j = 0; j < 8; ++j) {
                const __m512i d = v[8 * h + j];
                _mm512_store_si512(wb[g + h][j], _mm512_and_si512(d, m4));
                _mm512_store_si512(wb[g + h][8 + j], _mm512_and_si512(_mm512_srli_epi16(d, 4), m4));
            }
    }
}

// Prefetch into L2 what q4_rows_in_lanes and q4_params_in_lanes will read for rows [rb, rb + nr) and
// groups [g0, g0 + gn): one line per 64 weight bytes of each row, and each row's scale and bias lines.
// The VNNI GEMM calls it for the next row block's first 8 groups (the lines the 4-lines-ahead prefetch
// above cannot reach from the block before) after preparing a block's last K chunk. Measured on a Zen 5
// guest: 8-layer prefill of 128 tokens +9 % (median of 4 alternating rounds), 4 layers and 512 tokens
// unchanged; prefetching the whole next chunk instead was 10 % slower (docs/cpu.md "Zen 5 (measured)").
inline void q4_prefetch_block(const WMat& W, int64_t rb, int nr, int64_t g0, int gn) {
    for (int n = 0; n < nr; ++n) {
        const char* w = reinterpret_cast<const char*>(W.row(rb + n) + 32 * g0);
        for (int b = 0; b < 32 * gn; b += 64) _mm_prefetch(w + b, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(W.srow(rb + n) + 2 * g0), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(W.brow(rb + n) + 2 * g0), _MM_HINT_T1);
    }
}

// The bf16 scales (biases = false) or biases (true) of rows [rb, rb + nr) for groups [g0, g0 + gn)
// (gn ≤ 16) as fp32 out[g][n] (row rb + n; rows past nr zero): 16 rows in the lanes of one vector.
inline void q4_params_in_lanes(const WMat& W, bool biases, int64_t rb, int nr, int64_t g0, int gn, float (*out)[16]) {
    __m512i v[16];
    for (int n = 0; n < 16; ++n) {
        const uint16_t* p = reinterpret_cast<const uint16_t*>(biases ? W.brow(rb + n) : W.srow(rb + n));
        v[n] = n < nr ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask16(gn), p + g0)), 16)
                      : _mm512_setzero_si512();
    }
    transpose16(v);
    for (int g = 0; g < gn; ++g) _mm512_store_si512(out[g], v[g]);
}

}  // namespace
}  // namespace qwenmetal::cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

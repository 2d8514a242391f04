// AVX-512 VNNI prefill GEMM for MLX 4-bit group-64 weights with bf16 scales and biases, times inputs
// quantized per group of 64 into one (int8) or two (int16) int8 planes: the integer prefill kernel of
// CPUs with AVX512-VNNI but no usable AMX (Zen 4/5, Ice Lake / Cascade Lake servers; Sapphire Rapids
// with QWENMETAL_AMX=0). Design and measurements: kernels_vnni.cpp, docs/cpu.md.
#pragma once
#include <cstdint>

#include "cpu/kernels.h"
#include "cpu/tensor.h"

namespace qwenmetal::cpu {

// Prefill GEMMs (4-bit g64 weights, int8/int16 inputs, AVX-512 kernels) use this kernel when AMX is not
// in use and vnni_enabled(); set_vnni_gemm(false) keeps them on the older register tile (tests, benchmarks)
// and the avx2 kernels on the GEMV per input row.
void set_vnni_gemm(bool on);
bool vnni_gemm_enabled();

// Y[m*ldy + r] (+)= Σ_k W[r,k]·x̂_m[k] for m < M, r in [r0, r1); the contract of q4_gemm_amx (amx.h):
// W.cols % 128 == 0, every X[m] prepared with planes 1 or 2 (all the same), X[m]->K == W.cols; per row
// and input y = Σ_chunks (Σ_g s·xsg·float(C) + Σ_g b·xqx) with the same integers C and the same fold as
// the AMX kernel (only the bias sums are rounded differently: FMAs here, the tile unit there). The
// result depends only on (W, X[m], r). Allocates nothing (~18 KB of stack). Only call when
// vnni_available().
void q4_gemm_vnni(const WMat& W, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0, int64_t r1,
                  bool accumulate);

// The same GEMM on ymm with AVX-VNNI, for CPUs without AVX-512 (8 rows in the lanes; kernels_vnni.cpp).
// Same contract, integers and fold as q4_gemm_vnni: bit-identical results. The avx2 kernels use it for
// int8/int16 prefill calls of at least kAvxVnniGemmMinInputs inputs while avx_vnni_gemm_enabled()
// (AVX-VNNI in use and set_vnni_gemm not off); fewer inputs run the GEMV once per input row, which
// measured faster there (docs/cpu.md "AVX-VNNI prefill GEMM").
void q4_gemm_avxvnni(const WMat& W, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0, int64_t r1,
                     bool accumulate);
constexpr int64_t kAvxVnniGemmMinInputs = 16;
bool avx_vnni_gemm_enabled();

}  // namespace qwenmetal::cpu

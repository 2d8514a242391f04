// Intel AMX prefill GEMM for MLX 4-bit group-64 weights with bf16 scales and biases, times inputs
// already quantized per group of 64 into one (int8) or two (int16) int8 planes (XVec::xg / xg2,
// prepared by Kernels::xvec_prepare with planes 1 or 2). Design and measurements: kernels_amx.cpp.
#pragma once
#include <atomic>
#include <cstdint>

#include "cpu/tensor.h"
#include "cpu/kernels.h"

namespace qwenmetal::cpu {

// true when the CPU has AMX-TILE, AMX-INT8, AMX-BF16, AVX-512 (F/BW/VL/DQ) and GFNI, the OS enables the
// tile state in XCR0 and granted XTILEDATA to this process (arch_prctl ARCH_REQ_XCOMP_PERM, requested
// once, thread-safe static init); always false on anything but x86-64 Linux. QWENMETAL_AMX=0 in the
// environment makes it false (read once, at the first call).
bool amx_available();
// tests: off forces the AVX-512 kernels; on only takes effect if available
void set_amx(bool on);
bool amx_enabled();
// tests: the operand orientation of q4_gemm_amx, 0 = chosen per call by its cost model, 1 = weights as B
// ("R"), 2 = weights as A ("T"); the results are bit-identical either way (kernels_amx.cpp)
extern std::atomic<int> g_amx_orientation;

// Y[m*ldy + r] (+)= Σ_k W[r,k]·x̂_m[k] for m < M, r in [r0, r1): W 4-bit group-64 with BF16 scales and
// biases, W.cols % 128 == 0; every X[m] prepared with planes 1 or 2 (all the same), X[m]->K == W.cols.
// x̂ is the quantized input (xsg·c per group), so per row and input
//   y = Σ_g s[r,g]·xsg[g]·float(C[r,g]) + Σ_g b[r,g]·xqx[g],  C = Σ_{k in g} q[r,k]·c[k] (exact int32).
// The result depends only on (W, X[m], r): not on M, r0/r1, the internal orientation or the thread
// partition. No alignment requirement on Y or the XVec planes (64-byte aligned planes at one
// stride let the inputs be read in place). Safe to call from any thread concurrently (each call
// configures its own tiles and releases them before returning); allocates nothing (≤ 81 KB of stack).
// Must only be called when amx_enabled(); otherwise (or on a non-x86 build) it computes the same
// formula with slow scalar code.
void q4_gemm_amx(const WMat& W, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0, int64_t r1,
                 bool accumulate);

}  // namespace qwenmetal::cpu

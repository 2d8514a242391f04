// The SIMD inner loops of the CPU engine, one implementation per instruction set, chosen once at
// run time (cpuid): AVX-512 (F/BW/VL/DQ + FMA), AVX2+FMA, NEON (arm64) and a portable path.
// All variants are the same source (kernels.inc) instantiated over a small vector-traits struct,
// so they compute the same thing in the same order within a row; they differ only in vector width.
//
// Everything here is single-threaded and writes only its own outputs: the callers (quant, moe, gdn,
// attention) split work over threads by output rows / heads / experts.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "cpu/tensor.h"

namespace qwenmetal::cpu {

enum class Isa : int { Portable = 0, AVX2 = 1, AVX512 = 2, NEON = 3 };

// The input vector of a GEMV, prepared once per call and shared by all threads: `xp` is x in the
// lane order the 4-bit unpack produces (even elements then odd elements of every 2W block), and
// xs32/xs64/xs128 are the sums of x over groups of 32/64/128 inputs (the bias term of
// Σ (s·q + b)·x = s·Σ q·x + b·Σ x).
struct XVec {
    const float* x = nullptr;
    const float* xp = nullptr;
    const float* xs32 = nullptr;
    const float* xs64 = nullptr;
    const float* xs128 = nullptr;
    int64_t K = 0;
    // optional integer copy of x (activations="int8" / "int16"): per group of 64 inputs
    // x ≈ sx·(xq + xq2/256), xq and xq2 in [-127, 127] (int16: two planes, xq2 quantizes the residual
    // x − sx·xq with step sx/256, ≈ 16-bit fixed point per group; int8: xq only, xq2 = nullptr),
    // laid out per block of 2·B inputs (B = bytes per SIMD load: 64 avx512, 32 otherwise) as the even
    // elements then the odd ones (the order the nibble unpack produces); xqs: sx per group, repeated
    // Q8E times (avx512: 8, so one 16-float load covers the two groups of a 64-byte weight load)
    // xqx: per group sx·(Σxq + Σxq2/256), the sum of the quantized x (the bias term uses it, so the
    // integer GEMV is exactly the dot product of the dequantized weights with the quantized x)
    // xg/xg2: the same planes laid out per group of 64 (64 contiguous bytes: the group's 32 even
    // elements then its 32 odd ones), 64-byte aligned: the rows of an AMX tile (prefill GEMM);
    // xsg: sx per group, once
    const int8_t* xq = nullptr;
    const int8_t* xq2 = nullptr;
    const float* xqs = nullptr;
    const float* xqx = nullptr;
    const int8_t* xg = nullptr;
    const int8_t* xg2 = nullptr;
    const float* xsg = nullptr;
    int planes = 0;     // 0: float only, 1: int8, 2: int16 (two int8 planes)
    const float* xs(int gs) const { return gs == 32 ? xs32 : gs == 64 ? xs64 : xs128; }
};

// The integer-input kernels (activations="int8"/"int16") cover 4-bit group-64 weights with bf16 scales
// and K % 128 == 0, for an input prepared with an integer copy of the same K
inline bool int_kernels_apply(const WMat& W, const XVec& X) {
    return X.xq && W.bits == 4 && W.group_size == 64 && W.sdtype == DType::BF16 && W.cols % 128 == 0 && W.cols == X.K;
}

struct Kernels {
    Isa isa;
    const char* name;
    int width;   // float lanes
    // from this many input rows on, float-input prefill GEMMs go through dequantized 16-row tiles
    // (gemm_tile) instead of the register-tile kernel (gemm_x); 0 = never (measured per ISA, docs/cpu.md).
    // Inputs the integer kernels take (int_kernels_apply) go to gemm_x while int_gemm() says the table's
    // integer prefill GEMM is in use (avx2: avx_vnni_gemm_enabled(); else the GEMV per input row, which loses
    // to the float tiles from tile_gemm_min_rows on).
    int64_t tile_gemm_min_rows;
    bool (*int_gemm)();
    // x [K] -> XVec using `scratch` (at least xvec_floats(K) floats); planes 1 (int8) / 2 (int16): also
    // the integer copy of x (when K % 128 == 0), which makes gemv / gemm_x use the integer dot-product
    // kernels for 4-bit g64 weights
    void (*xvec_prepare)(const float* x, int64_t K, float* scratch, XVec* out, int planes);
    // y[r] (+)= Σ_k W[r,k]·x[k] for r in [r0, r1); y indexed by absolute row
    void (*gemv)(const WMat& W, const XVec& x, float* y, int64_t r0, int64_t r1, bool accumulate);
    // rows [r0, r0+n) of W as float32 into out [n, W.cols] (row stride ldo)
    void (*dequant)(const WMat& W, int64_t r0, int64_t n, float* out, int64_t ldo);
    // Y[m, j] (+)= Σ_k X[m,k]·T[j,k] for m < M, j < N (T: dequantized weight tile, row stride ldt)
    void (*gemm_tile)(const float* X, int64_t ldx, int64_t M, const float* T, int64_t ldt, int64_t N, int64_t K,
                      float* Y, int64_t ldy, bool accumulate);
    // Y[m, n] (+)= Σ_k X[m,k]·B[k,n] for m < M, n < N (B row-major, row stride ldb; small K and N: the GDN
    // chunk products)
    void (*gemm_nn)(const float* X, int64_t ldx, int64_t M, const float* B, int64_t ldb, int64_t N, int64_t K,
                    float* Y, int64_t ldy, bool accumulate);
    // Y[m, r] (+)= Σ_k W[r,k]·x_m[k] for M prepared inputs X[m] (row m of Y at Y + m*ldy), r in [r0, r1):
    // prefill; weights unpacked once per register tile and reused for several input rows
    void (*gemm_x)(const WMat& W, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0, int64_t r1,
                   bool accumulate);
    float (*dot)(const float* a, const float* b, int64_t n);
    void (*axpy)(float* y, float a, const float* x, int64_t n);          // y += a x
    // attention over one block of nb cached keys / values (rows `ld` elements apart, float32 or bf16)
    // for the G query heads q[g] that share them (GQA: each row is loaded once per tile of heads):
    // scores s[g·lds + t] = scale·q[g]·k_t, online-softmax update of the running max m[g], sum l[g]
    // and unnormalised output acc[g·hd ..], then acc += P·V
    void (*attn_block)(const float* const* q, int64_t G, const void* k, const void* v, bool f32, int64_t ld,
                       int64_t nb, int64_t hd, float scale, float* m, float* l, float* acc, float* s, int64_t lds);
    // g[i] = silu(g[i])·u[i] (u null: silu alone), vectorised (exp ≤ 2 ulp): SwiGLU, the GDN conv output
    void (*silu_mul)(float* g, const float* u, int64_t n);
    // one Gated DeltaNet decode step for one value head, state S [dv][dk] (fp32, updated in place):
    // S *= decay; d = (v - S k)·beta; S += d ⊗ k; o = S q
    void (*gdn_step)(float* S, int64_t dv, int64_t dk, const float* q, const float* k, const float* v, float beta,
                     float decay, float* o);
    // Y[m, r] (+)= Σ_k W[r,k]·x_m[k] for M prepared inputs, r in [r0, r1), each output bit for bit what gemv
    // computes for that input (a speculative verification, docs/speculative.md): weights unpacked once for
    // all M where the ISA has an exact tile (AVX-512 int8/int16), else gemv per input
    void (*gemv_multi)(const WMat& W, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0, int64_t r1,
                       bool accumulate);
    // s[i] = exp(s[i] + shift) for i < n, returning their sum (a softmax row: shift = -max); exp as attn_block's
    float (*exp_shift)(float* s, int64_t n, float shift);
    // x[i] = gelu_tanh(x[i]) = x / (1 + exp(-2u)), u = sqrt(2/pi)·(x + 0.044715·x³) (the vision tower's MLP)
    void (*gelu_tanh)(float* x, int64_t n);
};

size_t xvec_floats(int64_t K);

// The int8-activation GEMV on AVX-512 uses VNNI (vpdpbusd) when the CPU has it, else AVX512BW
// vpmaddubsw + vpmaddwd (same integers, same result); on AVX2 likewise AVX-VNNI (VEX vpdpbusd on ymm)
// else vpmaddubsw. One switch for both (tests switch it off to check the fallbacks).
bool vnni_available();
void set_vnni(bool on);
bool vnni_enabled();       // AVX512-VNNI in the avx512 kernels
bool avx_vnni_enabled();   // AVX-VNNI in the avx2 kernels

// The int8/int16-activation kernels of the NEON table (kernels_neon.cpp) in three variants with the
// same integers and the same result bits: plain NEON widening multiplies (smull/sadalp), FEAT_DotProd
// (sdot) and FEAT_I8MM (smmla in the prefill GEMM; its GEMV is sdot's). The CPU's comes from
// cpu_info() (getauxval on Linux, sysctlbyname on macOS); tests cap it to force each one.
enum class NeonDot : int { Plain = 0, DotProd = 1, I8MM = 2 };
NeonDot neon_dot_available();   // Plain off arm64
void set_neon_dot(NeonDot cap); // use at most this variant (default: the best the CPU has)
NeonDot neon_dot();             // the variant in use: min(available, cap)
const char* neon_dot_name(NeonDot d);   // "neon", "dotprod", "i8mm"

// The kernels in use (best for this CPU, or QWENMETAL_ISA=portable|avx2|avx512 to force one).
const Kernels& kernels();
// A specific implementation, or nullptr if this build/CPU lacks it (tests compare them).
const Kernels* kernels_for(Isa isa);
// Select the implementation used by kernels(); returns false if unavailable.
bool set_isa(Isa isa);
const char* isa_name(Isa isa);
Isa best_isa();

// per-ISA tables (defined in kernels_*.cpp; nullptr-returning stubs where not compiled)
const Kernels* kernels_portable();
const Kernels* kernels_avx2();
const Kernels* kernels_avx512();
const Kernels* kernels_neon();

}  // namespace qwenmetal::cpu

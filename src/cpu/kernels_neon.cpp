// The NEON (arm64) instantiation of kernels.inc and its integer-activation kernels in three variants
// chosen at run time: plain NEON (every arm64 CPU), FEAT_DotProd (sdot: Apple M1+, Graviton2+,
// Cortex-A76+) and FEAT_I8MM (smmla: Apple M2+, Graviton3+). The file is built for the baseline
// armv8-a; the sdot / smmla code sits in `#pragma GCC target` regions and is reached only after
// cpu_info() (getauxval on Linux, sysctlbyname on macOS) said the CPU has the feature.
#include <atomic>
#include <cmath>
#include <cstring>

#include "cpu/cpu_info.h"
#include "cpu/kernels.h"

#if defined(__aarch64__)
#include <arm_neon.h>

namespace qwenmetal::cpu {

namespace {
namespace neon {
// Tables of the NEON unpack of one 2/3/5/6-bit chunk (32 values = BITS dwords of the row's bit stream)
// into 8 vectors of 4 lanes, value 4j + i in lane i of vector j: `ctrl` (a vqtbl2q index over the chunk's
// bytes) puts into 32-bit lane i the two bytes that contain the value (≤ 6 bits at an in-byte offset
// ≤ 7 span ≤ 2 bytes; index 0xFF reads as zero) and `shift` (vshlq by a negative count) moves it down
// by its offset in the first byte; then AND with 2^BITS − 1 (the x86 QbTable's scheme without `win`:
// one lookup sees all 32 chunk bytes).
struct alignas(16) QbTableNeon {
    uint8_t ctrl[8][16];
    int32_t shift[8][4];
};
template <int BITS>
constexpr QbTableNeon make_qb_table_neon() {
    QbTableNeon t{};
    for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 4; ++i) {
            const int bit = BITS * (4 * j + i), byte = bit / 8;
            t.ctrl[j][4 * i] = static_cast<uint8_t>(byte);
            t.ctrl[j][4 * i + 1] = static_cast<uint8_t>(byte + 1);   // < 4·BITS + 1 ≤ 25: inside the 32 bytes
            t.ctrl[j][4 * i + 2] = t.ctrl[j][4 * i + 3] = 0xFF;
            t.shift[j][i] = -(bit % 8);
        }
    return t;
}
template <int BITS>
inline constexpr QbTableNeon kQbNeon = make_qb_table_neon<BITS>();

struct VT {
    static constexpr int W = 4;
    static constexpr int MM_NR = 1, MM_MX = 4;
    static constexpr int64_t TILE_GEMM_MIN_ROWS = 0;
    // the integer kernels (Q8_SIMD / Q8_GEMM): the variant neon_dot() picks, defined below
    static constexpr bool Q8_SIMD = true, Q8_GEMM = true, XQ_SIMD = false, QB_SIMD = true, Q8_TILE_EXACT = false;
    static bool int_gemm() { return Q8_GEMM; }   // Kernels::int_gemm
    static constexpr int Q8B = 32, Q8E = 1;
    using V = float32x4_t;
    static inline V zero() { return vdupq_n_f32(0.f); }
    static inline V set1(float a) { return vdupq_n_f32(a); }
    static inline V load(const float* p) { return vld1q_f32(p); }
    static inline V loadn(const float* p, int n) {
        float t[4] = {0.f, 0.f, 0.f, 0.f};
        for (int i = 0; i < n; ++i) t[i] = p[i];
        return vld1q_f32(t);
    }
    static inline void store(float* p, V a) { vst1q_f32(p, a); }
    static inline void storen(float* p, V a, int n) {
        float t[4];
        vst1q_f32(t, a);
        for (int i = 0; i < n; ++i) p[i] = t[i];
    }
    static inline V fma(V a, V b, V c) { return vfmaq_f32(c, a, b); }
    static inline V mul(V a, V b) { return vmulq_f32(a, b); }
    static inline float reduce(V a) { return vaddvq_f32(a); }
    static inline V add(V a, V b) { return vaddq_f32(a, b); }
    static inline V div(V a, V b) { return vdivq_f32(a, b); }
    static inline V max(V a, V b) { return vmaxq_f32(a, b); }
    static inline float reduce_max(V a) { return vmaxvq_f32(a); }
    static inline void reduce_w(const V* a, float* out) {   // pairwise adds: out = (Σa0, Σa1, Σa2, Σa3)
        vst1q_f32(out, vpaddq_f32(vpaddq_f32(a[0], a[1]), vpaddq_f32(a[2], a[3])));
    }
    // for the exp of kernels.inc (vexp, the polynomial instead of std::exp per lane): round to nearest
    // (frintn), p·2^n for integral n in [-126, 127] by building 2^n's exponent bits
    static constexpr bool EXP_POLY = true;
    static inline V min(V a, V b) { return vminq_f32(a, b); }
    static inline V round(V x) { return vrndnq_f32(x); }
    static inline V pow2n(V p, V n) {
        const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
        return vmulq_f32(p, vreinterpretq_f32_s32(e));
    }
    static inline V load_bf16(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
    static inline V loadn_bf16(const uint16_t* p, int n) {
        uint16_t t[4] = {0, 0, 0, 0};
        for (int i = 0; i < n; ++i) t[i] = p[i];
        return load_bf16(t);
    }
    static inline V load_f16(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
    static inline V loadn_f16(const uint16_t* p, int n) {
        uint16_t t[4] = {0, 0, 0, 0};
        for (int i = 0; i < n; ++i) t[i] = p[i];
        return load_f16(t);
    }
    static inline uint32x4_t bytes4(const uint8_t* p) {
        uint32_t w;
        std::memcpy(&w, p, 4);
        const uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(w));
        return vmovl_u16(vget_low_u16(vmovl_u8(b)));
    }
    static inline void q4(const uint8_t* p, V& even, V& odd) {
        const uint32x4_t v = bytes4(p);
        even = vcvtq_f32_u32(vandq_u32(v, vdupq_n_u32(15)));
        odd = vcvtq_f32_u32(vshrq_n_u32(v, 4));
    }
    static inline void q4_natural(const uint8_t* p, V& a, V& b) {
        V e, o;
        q4(p, e, o);
        a = vzip1q_f32(e, o);
        b = vzip2q_f32(e, o);
    }
    static inline V q8(const uint8_t* p) { return vcvtq_f32_u32(bytes4(p)); }
    // 2/3/5/6 bits: one 32-value chunk (its BITS dwords, copied so that nothing past them is read) -> 8
    // vectors by table lookup (kQbNeon); the same integers as the scalar reader, so the same floats
    template <int BITS>
    static inline void qb(const uint8_t* p, V* out) {
        constexpr const QbTableNeon& t = kQbNeon<BITS>;
        alignas(16) uint8_t c[32] = {};
        std::memcpy(c, p, 4 * BITS);
        const uint8x16x2_t tb = {{vld1q_u8(c), vld1q_u8(c + 16)}};
        const uint32x4_t mask = vdupq_n_u32((1u << BITS) - 1u);
        for (int j = 0; j < 8; ++j) {
            const uint32x4_t v = vreinterpretq_u32_u8(vqtbl2q_u8(tb, vld1q_u8(t.ctrl[j])));
            out[j] = vcvtq_f32_u32(vandq_u32(vshlq_u32(v, vld1q_s32(t.shift[j])), mask));
        }
    }
    static void q4i8_gemv(const WMat& Wm, const XVec& X, float* y, int64_t r0, int64_t r1, bool accumulate);
    static void q4i8_gemm(const WMat& Wm, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0,
                          int64_t r1, bool accumulate);
};
#include "cpu/kernels.inc"

// the integer kernels, once per variant (kernels_neon_int.inc), each built for its own target
namespace plain {
constexpr int kDot = 0;
#define QM_NEON_I8MM 0
#include "cpu/kernels_neon_int.inc"
#undef QM_NEON_I8MM
}  // namespace plain

// a region whose functions are built for extra arm64 features: gcc's target pragma (arm_neon.h declares
// sdot for +dotprod and smmla for armv8.2-a+i8mm; FEAT_DotProd is an armv8.2 option), clang's attribute
#define QM_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define QM_TARGET_BEGIN(gcc_arch, clang_features) \
    QM_PRAGMA(clang attribute push(__attribute__((target(clang_features))), apply_to = function))
#define QM_TARGET_END QM_PRAGMA(clang attribute pop)
#else
#define QM_TARGET_BEGIN(gcc_arch, clang_features) QM_PRAGMA(GCC push_options) QM_PRAGMA(GCC target(gcc_arch))
#define QM_TARGET_END QM_PRAGMA(GCC pop_options)
#endif

QM_TARGET_BEGIN("arch=armv8.2-a+dotprod", "dotprod")
namespace sdot {
constexpr int kDot = 1;
#define QM_NEON_I8MM 0
#include "cpu/kernels_neon_int.inc"
#undef QM_NEON_I8MM
}  // namespace sdot
QM_TARGET_END

QM_TARGET_BEGIN("arch=armv8.2-a+dotprod+i8mm", "dotprod,i8mm")
namespace mmla {
constexpr int kDot = 2;
#define QM_NEON_I8MM 1
#include "cpu/kernels_neon_int.inc"
#undef QM_NEON_I8MM
}  // namespace mmla
QM_TARGET_END

// the GEMV needs no i8mm (one input: half of each smmla block would be wasted), so it is sdot's there
void VT::q4i8_gemv(const WMat& Wm, const XVec& X, float* y, int64_t r0, int64_t r1, bool accumulate) {
    if (neon_dot() == NeonDot::Plain) plain::q4i8_gemv(Wm, X, y, r0, r1, accumulate);
    else sdot::q4i8_gemv(Wm, X, y, r0, r1, accumulate);
}
void VT::q4i8_gemm(const WMat& Wm, const XVec* const* X, int64_t M, float* Y, int64_t ldy, int64_t r0, int64_t r1,
                   bool accumulate) {
    switch (neon_dot()) {
        case NeonDot::Plain: return plain::q4i8_gemm(Wm, X, M, Y, ldy, r0, r1, accumulate);
        case NeonDot::DotProd: return sdot::q4i8_gemm(Wm, X, M, Y, ldy, r0, r1, accumulate);
        case NeonDot::I8MM: return mmla::q4i8_gemm(Wm, X, M, Y, ldy, r0, r1, accumulate);
    }
}
}  // namespace neon

}  // namespace

const Kernels* kernels_neon() { return neon::table(Isa::NEON, "neon"); }

}  // namespace qwenmetal::cpu

#else  // not arm64

namespace qwenmetal::cpu {
const Kernels* kernels_neon() { return nullptr; }
}  // namespace qwenmetal::cpu

#endif

namespace qwenmetal::cpu {
namespace {
std::atomic<int> g_neon_dot_cap{static_cast<int>(NeonDot::I8MM)};
}
NeonDot neon_dot_available() {   // (every i8mm CPU has dotprod, and the i8mm GEMM's tails use sdot)
    const CpuFeatures& f = cpu_info().f;
    return f.dotprod ? (f.i8mm ? NeonDot::I8MM : NeonDot::DotProd) : NeonDot::Plain;
}
void set_neon_dot(NeonDot cap) { g_neon_dot_cap.store(static_cast<int>(cap), std::memory_order_relaxed); }
NeonDot neon_dot() {
    static const int avail = static_cast<int>(neon_dot_available());
    const int cap = g_neon_dot_cap.load(std::memory_order_relaxed);
    return static_cast<NeonDot>(cap < avail ? cap : avail);
}
const char* neon_dot_name(NeonDot d) {
    switch (d) {
        case NeonDot::DotProd: return "dotprod";
        case NeonDot::I8MM: return "i8mm";
        default: return "neon";
    }
}
}  // namespace qwenmetal::cpu

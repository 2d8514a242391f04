// Portable instantiation of kernels.inc (plain C++ over 4-float blocks that compilers vectorise for
// the baseline ISA) and the run-time choice between all the instantiations.
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cpu/cpu_info.h"
#include "cpu/gemm_vnni.h"
#include "cpu/kernels.h"

namespace qwenmetal::cpu {

namespace {
namespace portable {
struct VT {
    static constexpr int W = 4;
    static constexpr int MM_NR = 1, MM_MX = 4;
    static constexpr int64_t TILE_GEMM_MIN_ROWS = 0;
    static constexpr bool Q8_SIMD = false, Q8_GEMM = false, XQ_SIMD = false, QB_SIMD = false, Q8_TILE_EXACT = false;
    static bool int_gemm() { return Q8_GEMM; }   // Kernels::int_gemm
    static constexpr int Q8B = 32, Q8E = 1;
    struct V {
        float v[4];
    };
    static inline V zero() { return V{{0.f, 0.f, 0.f, 0.f}}; }
    static inline V set1(float a) { return V{{a, a, a, a}}; }
    static inline V load(const float* p) { return V{{p[0], p[1], p[2], p[3]}}; }
    static inline V loadn(const float* p, int n) {
        V r = zero();
        for (int i = 0; i < n; ++i) r.v[i] = p[i];
        return r;
    }
    static inline void store(float* p, V a) {
        for (int i = 0; i < 4; ++i) p[i] = a.v[i];
    }
    static inline void storen(float* p, V a, int n) {
        for (int i = 0; i < n; ++i) p[i] = a.v[i];
    }
    static inline V fma(V a, V b, V c) {
        V r;
        for (int i = 0; i < 4; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];
        return r;
    }
    static inline V mul(V a, V b) {
        V r;
        for (int i = 0; i < 4; ++i) r.v[i] = a.v[i] * b.v[i];
        return r;
    }
    static inline float reduce(V a) { return (a.v[0] + a.v[2]) + (a.v[1] + a.v[3]); }
    static inline V add(V a, V b) {
        V r;
        for (int i = 0; i < 4; ++i) r.v[i] = a.v[i] + b.v[i];
        return r;
    }
    static inline V div(V a, V b) {
        V r;
        for (int i = 0; i < 4; ++i) r.v[i] = a.v[i] / b.v[i];
        return r;
    }
    static inline V max(V a, V b) {
        V r;
        for (int i = 0; i < 4; ++i) r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
        return r;
    }
    static inline float reduce_max(V a) {
        const float x = a.v[0] > a.v[1] ? a.v[0] : a.v[1], y = a.v[2] > a.v[3] ? a.v[2] : a.v[3];
        return x > y ? x : y;
    }
    static inline void reduce_w(const V* a, float* out) {
        for (int i = 0; i < 4; ++i) out[i] = reduce(a[i]);
    }
    static constexpr bool EXP_POLY = false;   // vexp: std::exp per lane
    static inline V exp(V a) {
        V r;
        for (int i = 0; i < 4; ++i) r.v[i] = std::exp(a.v[i]);
        return r;
    }
    static inline V load_bf16(const uint16_t* p) {
        return V{{bf16_to_f32(p[0]), bf16_to_f32(p[1]), bf16_to_f32(p[2]), bf16_to_f32(p[3])}};
    }
    static inline V loadn_bf16(const uint16_t* p, int n) {
        V r = zero();
        for (int i = 0; i < n; ++i) r.v[i] = bf16_to_f32(p[i]);
        return r;
    }
    static inline V load_f16(const uint16_t* p) {
        return V{{f16_to_f32(p[0]), f16_to_f32(p[1]), f16_to_f32(p[2]), f16_to_f32(p[3])}};
    }
    static inline V loadn_f16(const uint16_t* p, int n) {
        V r = zero();
        for (int i = 0; i < n; ++i) r.v[i] = f16_to_f32(p[i]);
        return r;
    }
    static inline void q4(const uint8_t* p, V& even, V& odd) {
        for (int i = 0; i < 4; ++i) {
            even.v[i] = static_cast<float>(p[i] & 15);
            odd.v[i] = static_cast<float>(p[i] >> 4);
        }
    }
    static inline void q4_natural(const uint8_t* p, V& a, V& b) {
        a = V{{float(p[0] & 15), float(p[0] >> 4), float(p[1] & 15), float(p[1] >> 4)}};
        b = V{{float(p[2] & 15), float(p[2] >> 4), float(p[3] & 15), float(p[3] >> 4)}};
    }
    static inline V q8(const uint8_t* p) { return V{{float(p[0]), float(p[1]), float(p[2]), float(p[3])}}; }
};
#include "cpu/kernels.inc"
}  // namespace portable
}  // namespace

const Kernels* kernels_portable() { return portable::table(Isa::Portable, "portable"); }

// x, sums per 32/64/128, then (16-float aligned) the integer planes xq, xq2, xg, xg2 (K bytes each),
// the scales (K/8 floats), the sums per group (K/64) and the scales once per group (K/64)
// (rounded up to 16 floats: consecutive XVecs then keep their planes 64-byte aligned at one stride, so
// the AMX kernel reads 16 of them as one strided tile)
size_t xvec_floats(int64_t K) {
    const size_t n = size_t(K + K / 32 + K / 64 + K / 128 + 16) + size_t(K + K / 8 + 2 * (K / 64) + 32);
    return (n + 15) / 16 * 16;
}

const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::AVX2: return "avx2";
        case Isa::AVX512: return "avx512";
        case Isa::NEON: return "neon";
        default: return "portable";
    }
}

const Kernels* kernels_for(Isa isa) {
    switch (isa) {
        case Isa::AVX2: return kernels_avx2();
        case Isa::AVX512: return kernels_avx512();
        case Isa::NEON: return kernels_neon();
        default: return kernels_portable();
    }
}

Isa best_isa() {
    for (Isa i : {Isa::AVX512, Isa::AVX2, Isa::NEON})
        if (kernels_for(i)) return i;
    return Isa::Portable;
}

namespace {
const Kernels* initial() {
    if (const char* e = std::getenv("QWENMETAL_ISA")) {
        const std::string s(e);
        for (Isa i : {Isa::Portable, Isa::AVX2, Isa::AVX512, Isa::NEON})
            if (s == isa_name(i) && kernels_for(i)) return kernels_for(i);
    }
    return kernels_for(best_isa());
}
std::atomic<const Kernels*> g_active{nullptr};
}  // namespace

const Kernels& kernels() {
    const Kernels* k = g_active.load(std::memory_order_acquire);
    if (!k) {
        k = initial();
        g_active.store(k, std::memory_order_release);
    }
    return *k;
}

namespace {
std::atomic<bool> g_vnni{true};
std::atomic<bool> g_vnni_gemm{true};
}
bool vnni_available() {
    return cpu_info().f.avx512_vnni && kernels_avx512() != nullptr;
}
void set_vnni(bool on) { g_vnni.store(on, std::memory_order_relaxed); }
bool vnni_enabled() {
    static const bool avail = vnni_available();
    return avail && g_vnni.load(std::memory_order_relaxed);
}
// the VNNI prefill GEMM (kernels_vnni.cpp); the switch lives with the other kernel switches so that
// cpu_info's report links without the x86 kernels (the arm64 checker)
void set_vnni_gemm(bool on) { g_vnni_gemm.store(on, std::memory_order_relaxed); }
bool vnni_gemm_enabled() { return vnni_enabled() && g_vnni_gemm.load(std::memory_order_relaxed); }
bool avx_vnni_gemm_enabled() { return avx_vnni_enabled() && g_vnni_gemm.load(std::memory_order_relaxed); }
bool avx_vnni_enabled() {
    static const bool avail = cpu_info().f.avx_vnni && kernels_avx2() != nullptr;
    return avail && g_vnni.load(std::memory_order_relaxed);
}

bool set_isa(Isa isa) {
    const Kernels* k = kernels_for(isa);
    if (!k) return false;
    g_active.store(k, std::memory_order_release);
    return true;
}

}  // namespace qwenmetal::cpu

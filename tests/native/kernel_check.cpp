// Every kernel of the best SIMD table (NEON on arm64) against the portable one on random data, and on
// arm64 every integer-activation variant the CPU has (plain NEON, dotprod, i8mm: cpu::set_neon_dot)
// bit for bit against the portable integer kernel. tests/test_arm64.py cross-compiles this with the CPU
// kernels and runs it under qemu-aarch64 as three CPUs (-cpu max: i8mm, cortex-a76: dotprod,
// cortex-a72: neither); by hand:
//   aarch64-linux-gnu-g++ -std=c++17 -O2 -static -Isrc tests/native/kernel_check.cpp src/cpu/kernels_portable.cpp
//       src/cpu/kernels_neon.cpp src/cpu/kernels_x86.cpp src/cpu/kernels_amx.cpp src/cpu/cpu_info.cpp
//       src/cpu/quant.cpp src/core/threadpool.cpp -pthread -o /tmp/kc && qemu-aarch64 -cpu max /tmp/kc
// (the same command with g++ checks the best x86 table, integer kernels within a tolerance).
// Prints one line per check and "all ok" / "FAILED n"; the exit status is non-zero on any failure.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include "cpu/cpu_info.h"
#include "cpu/kernels.h"
#include "cpu/quant.h"
using namespace qwenmetal;
using namespace qwenmetal::cpu;
static std::mt19937 rng(1);
static float rnd() { return std::normal_distribution<float>(0.f, 1.f)(rng); }
static double maxdiff(const std::vector<float>& a, const std::vector<float>& b) {
    double m = 0, s = 0;
    for (size_t i = 0; i < a.size(); ++i) { m = std::fmax(m, std::fabs(a[i] - b[i])); s = std::fmax(s, std::fabs(b[i])); }
    return m / (s > 0 ? s : 1);
}
// the same float bits, NaN where the other is NaN
static bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
    for (size_t i = 0; i < a.size(); ++i)
        if (std::isnan(a[i]) ? !std::isnan(b[i]) : std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return false;
    return true;
}

struct Quantized {   // a 4-bit (or other width) group-64 matrix with bf16 scales, as the engine reads it
    std::vector<uint32_t> wq;
    std::vector<uint16_t> s, b, bf;
    WMat m;
    Quantized(const std::vector<float>& w, int64_t R, int64_t K, int bits)
        : wq(R * K * (bits ? bits : 32) / 32), s(R * K / 64), b(R * K / 64), bf(R * K) {
        if (bits) {
            quantize_affine(w.data(), DType::F32, K, R, K, bits, 64, wq.data(), s.data(), b.data());
            m.bits = bits; m.group_size = 64; m.sdtype = DType::BF16; m.data = wq.data(); m.scales = s.data(); m.biases = b.data();
        } else {
            for (size_t i = 0; i < w.size(); ++i) bf[i] = f32_to_bf16(w[i]);
            m.dtype = DType::BF16; m.data = bf.data();
        }
        m.rows = R; m.cols = K;
    }
};

// Y (M inputs × R rows) for rows [r0, r1) of table T: M == 1 through the GEMV, else the GEMM;
// planes 0 float, 1 int8, 2 int16; accumulate onto a fixed pattern to check that too
static std::vector<float> run(const Kernels* T, const WMat& m, const std::vector<float>& x, int64_t M, int planes,
                              int64_t r0, int64_t r1, bool accumulate) {
    const int64_t K = m.cols, R = m.rows;
    std::vector<float> y(M * R), scratch(M * xvec_floats(K));
    for (size_t i = 0; i < y.size(); ++i) y[i] = 0.25f * float(i % 7);
    std::vector<XVec> xv(M);
    std::vector<const XVec*> px(M);
    for (int64_t i = 0; i < M; ++i) {
        T->xvec_prepare(x.data() + i * K, K, scratch.data() + i * xvec_floats(K), &xv[i], planes);
        px[i] = &xv[i];
    }
    if (M == 1) T->gemv(m, xv[0], y.data(), r0, r1, accumulate);
    else T->gemm_x(m, px.data(), M, y.data(), R, r0, r1, accumulate);
    return y;
}

int main() {
    const Kernels* A = kernels_for(Isa::NEON);
    if (!A) A = kernels_for(best_isa());
    const Kernels* P = kernels_portable();
    const bool neon = A->isa == Isa::NEON;
    std::printf("checking %s against %s\n", A->name, P->name);
    std::printf("neon_dot: %s\n", neon ? neon_dot_name(neon_dot_available()) : "-");
    std::printf("features:");
    for (const std::string& f : cpu_info().feature_names()) std::printf(" %s", f.c_str());
    std::printf("\n");
    for (const auto& [family, variant] : kernel_choices())
        std::printf("kernel %s: %s\n", family.c_str(), variant.c_str());
    int fails = 0;
    const int64_t R = 37, K = 256;
    std::vector<float> w(R * K), x(9 * K);
    for (auto& v : w) v = rnd();
    for (auto& v : x) v = rnd();

    // float activations: every weight format, GEMV / register-tile GEMM, dequant, tile GEMM
    for (int bits : {2, 3, 4, 5, 6, 8, 0}) {
        Quantized q(w, R, K, bits);
        for (int M : {1, 5}) {
            const double d = maxdiff(run(A, q.m, x, M, 0, 0, R, false), run(P, q.m, x, M, 0, 0, R, false));
            std::printf("bits %d M %d: %.2e\n", bits, M, d);
            fails += d > 1e-5;
        }
        std::vector<float> ta(R * K), tp(R * K);
        A->dequant(q.m, 0, R, ta.data(), K); P->dequant(q.m, 0, R, tp.data(), K);
        double d = maxdiff(ta, tp); std::printf("dequant bits %d: %.2e\n", bits, d); fails += d > 0;
        std::vector<float> ga(5 * R), gp(5 * R);
        A->gemm_tile(x.data(), K, 5, ta.data(), K, R, K, ga.data(), R, false);
        P->gemm_tile(x.data(), K, 5, tp.data(), K, R, K, gp.data(), R, false);
        d = maxdiff(ga, gp); std::printf("gemm_tile: %.2e\n", d); fails += d > 1e-5;
    }

    // integer activations on 4-bit g64 weights: a zero group (row 3, group 1), an input outlier, a NaN
    // input in row 6 of the inputs (its outputs NaN, the others untouched); every NEON variant up to
    // what the CPU has, bit-identical to the portable kernel for row ranges with odd starts and ends
    {
        std::vector<float> wz = w, xz = x;
        for (int k = 64; k < 128; ++k) wz[3 * K + k] = 0.f;
        xz[5] = 40.f;
        xz[6 * K + 77] = NAN;
        Quantized q(wz, R, K, 4);
        const int top = neon ? static_cast<int>(neon_dot_available()) : 0;
        for (int planes : {1, 2}) {
            for (int M : {1, 2, 3, 4, 5, 7, 8, 9}) {
                const std::vector<float> yf = run(P, q.m, xz, M, 0, 0, R, false);   // exact float product
                for (int r0 : {0, 3})
                    for (int64_t r1 : {R, R - 2}) {
                        const bool accumulate = r0 == 3;
                        const std::vector<float> yp = run(P, q.m, xz, M, planes, r0, r1, accumulate);
                        for (int v = 0; v <= top; ++v) {
                            set_neon_dot(static_cast<NeonDot>(v));
                            const std::vector<float> ya = run(A, q.m, xz, M, planes, r0, r1, accumulate);
                            const bool ok = neon ? same_bits(ya, yp) : maxdiff(ya, yp) < 1e-5;
                            if (!ok || (r0 == 0 && r1 == R))
                                std::printf("int%d %s M %d rows [%d, %lld)%s: %s (%.2e)\n", planes == 2 ? 16 : 8,
                                            neon ? neon_dot_name(static_cast<NeonDot>(v)) : A->name, M, r0,
                                            static_cast<long long>(r1), accumulate ? " +=" : "",
                                            ok ? (neon ? "same bits" : "ok") : "DIFFERS", maxdiff(ya, yp));
                            fails += !ok;
                        }
                        set_neon_dot(NeonDot::I8MM);
                        if (r0 != 0 || r1 != R) continue;
                        // against the float product: int16 within 1e-4 of the largest output, int8 roughly;
                        // NaN exactly in the rows of the NaN input
                        std::vector<float> a, b;
                        bool nan_ok = true;
                        for (int64_t i = 0; i < M * R; ++i) {
                            nan_ok &= std::isnan(yp[i]) == std::isnan(yf[i]);
                            if (!std::isnan(yf[i])) { a.push_back(yp[i]); b.push_back(yf[i]); }
                        }
                        const double d = maxdiff(a, b);
                        const bool ok = nan_ok && d < (planes == 2 ? 1e-4 : 5e-2);
                        std::printf("int%d M %d vs float: %.2e%s\n", planes == 2 ? 16 : 8, M, d,
                                    nan_ok ? "" : " NaN MISMATCH");
                        fails += !ok;
                    }
            }
        }
    }

    std::vector<float> S(12 * 20), S2, q(20), k(20), v(12), oa(12), op(12);
    for (auto& t : S) t = rnd();
    for (auto& t : q) t = rnd();
    for (auto& t : k) t = rnd();
    for (auto& t : v) t = rnd();
    S2 = S;
    A->gdn_step(S.data(), 12, 20, q.data(), k.data(), v.data(), 0.7f, 0.9f, oa.data());
    P->gdn_step(S2.data(), 12, 20, q.data(), k.data(), v.data(), 0.7f, 0.9f, op.data());
    double d = std::fmax(maxdiff(oa, op), maxdiff(S, S2)); std::printf("gdn_step: %.2e\n", d); fails += d > 1e-5;
    // gemm_nn (the GDN chunk products): 7 rows (a 4-row block and 3 single rows), 37 columns of a B with
    // row stride 40 (a masked last column block), K = 19, accumulating into a non-zero Y
    {
        std::vector<float> X(7 * 19), B(19 * 40), Ya(7 * 37), Yp;
        for (auto& t : X) t = rnd();
        for (auto& t : B) t = rnd();
        for (auto& t : Ya) t = rnd();
        Yp = Ya;
        A->gemm_nn(X.data(), 19, 7, B.data(), 40, 37, 19, Ya.data(), 37, true);
        P->gemm_nn(X.data(), 19, 7, B.data(), 40, 37, 19, Yp.data(), 37, true);
        const double dn = maxdiff(Ya, Yp); std::printf("gemm_nn: %.2e\n", dn); fails += dn > 1e-5;
    }
    d = std::fabs(A->dot(x.data(), w.data(), 37) - P->dot(x.data(), w.data(), 37));
    std::printf("dot: %.2e\n", d); fails += d > 1e-4;

    // SiLU (the table's exp: a polynomial where VT::EXP_POLY) on [-8, 8] and at ±100 (the clamp keeps it
    // finite), with and without the multiplier, 37 values (a tail)
    {
        std::vector<float> g(37), u(37), ga, gp;
        for (int i = 0; i < 37; ++i) { g[i] = -8.f + 16.f * i / 36.f + 0.1f * rnd(); u[i] = rnd(); }
        g[0] = -100.f;
        g[36] = 100.f;
        for (bool mul : {false, true}) {
            ga = gp = g;
            A->silu_mul(ga.data(), mul ? u.data() : nullptr, 37);
            P->silu_mul(gp.data(), mul ? u.data() : nullptr, 37);
            bool finite = true;
            for (float t : ga) finite &= std::isfinite(t);
            d = maxdiff(ga, gp); std::printf("silu_mul%s: %.2e\n", mul ? " u" : "", d); fails += d > 1e-5 || !finite;
        }
    }
    // one attention block (online softmax + P·V), 5 heads sharing 13 keys of 20 dims, f32 and bf16 cache
    for (bool f32 : {true, false}) {
        const int64_t G = 5, nb = 13, hd = 20, lds = 16;
        std::vector<float> qh(G * hd), kf(nb * hd), vf(nb * hd);
        std::vector<uint16_t> kb(nb * hd), vb(nb * hd);
        for (auto& t : qh) t = rnd();
        for (size_t i = 0; i < kf.size(); ++i) { kf[i] = rnd(); vf[i] = rnd(); kb[i] = f32_to_bf16(kf[i]); vb[i] = f32_to_bf16(vf[i]); }
        std::vector<const float*> qp(G);
        for (int64_t g = 0; g < G; ++g) qp[g] = qh.data() + g * hd;
        std::vector<float> out[2];
        int t = 0;
        for (const Kernels* T : {A, P}) {
            std::vector<float> m(G, -INFINITY), l(G, 0.f), acc(G * hd, 0.f), sc(G * lds);
            const void* kk = f32 ? static_cast<const void*>(kf.data()) : kb.data();
            const void* vv = f32 ? static_cast<const void*>(vf.data()) : vb.data();
            T->attn_block(qp.data(), G, kk, vv, f32, hd, nb, hd, 0.3f, m.data(), l.data(), acc.data(), sc.data(), lds);
            for (int64_t g = 0; g < G; ++g) acc.push_back(l[g]), acc.push_back(m[g]);
            out[t++] = acc;
        }
        d = maxdiff(out[0], out[1]); std::printf("attn_block %s: %.2e\n", f32 ? "f32" : "bf16", d); fails += d > 1e-5;
    }
    std::printf(fails ? "FAILED %d\n" : "all ok\n", fails);
    return fails != 0;
}

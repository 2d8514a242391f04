// Compare every SIMD kernel of the best ISA table (NEON on arm64) against the portable one on random data.
// Not part of the pytest run (the Python tests cover all x86 tables through qwenmetal._core); this is how
// the NEON path is checked from an x86 machine:
//   aarch64-linux-gnu-g++ -std=c++17 -O2 -static -Isrc tests/native/kernel_check.cpp src/cpu/kernels_portable.cpp \
//       src/cpu/kernels_x86.cpp src/cpu/kernels_amx.cpp src/cpu/quant.cpp src/cpu/threadpool.cpp -pthread -o /tmp/kc && \
//       qemu-aarch64 /tmp/kc   (the same command with g++ checks the best x86 table)
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>
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
int main() {
    const Kernels* A = kernels_for(Isa::NEON);
    if (!A) A = kernels_for(best_isa());
    const Kernels* P = kernels_portable();
    std::printf("checking %s against %s\n", A->name, P->name);
    int fails = 0;
    const int64_t R = 37, K = 256;
    std::vector<float> w(R * K), x(5 * K);
    for (auto& v : w) v = rnd();
    for (auto& v : x) v = rnd();
    for (int bits : {2, 3, 4, 5, 6, 8, 0}) {
        WMat m;
        std::vector<uint32_t> wq(R * K * (bits ? bits : 32) / 32);
        std::vector<uint16_t> s(R * K / 64), b(R * K / 64), bf(R * K);
        if (bits) {
            quantize_affine(w.data(), DType::F32, K, R, K, bits, 64, wq.data(), s.data(), b.data());
            m.bits = bits; m.group_size = 64; m.sdtype = DType::BF16; m.data = wq.data(); m.scales = s.data(); m.biases = b.data();
        } else {
            for (size_t i = 0; i < w.size(); ++i) bf[i] = f32_to_bf16(w[i]);
            m.dtype = DType::BF16; m.data = bf.data();
        }
        m.rows = R; m.cols = K;
        for (int M : {1, 5}) {
            std::vector<float> ya(M * R), yp(M * R), sa(M * xvec_floats(K)), sp(M * xvec_floats(K));
            std::vector<XVec> xa(M), xp(M);
            std::vector<const XVec*> pa(M), pp(M);
            for (int i = 0; i < M; ++i) {
                A->xvec_prepare(x.data() + i * K, K, sa.data() + i * xvec_floats(K), &xa[i], false); pa[i] = &xa[i];
                P->xvec_prepare(x.data() + i * K, K, sp.data() + i * xvec_floats(K), &xp[i], false); pp[i] = &xp[i];
            }
            if (M == 1) { A->gemv(m, xa[0], ya.data(), 0, R, false); P->gemv(m, xp[0], yp.data(), 0, R, false); }
            else { A->gemm_x(m, pa.data(), M, ya.data(), R, 0, R, false); P->gemm_x(m, pp.data(), M, yp.data(), R, 0, R, false); }
            double d = maxdiff(ya, yp);
            std::printf("bits %d M %d: %.2e\n", bits, M, d);
            fails += d > 1e-5;
        }
        std::vector<float> ta(R * K), tp(R * K);
        A->dequant(m, 0, R, ta.data(), K); P->dequant(m, 0, R, tp.data(), K);
        double d = maxdiff(ta, tp); std::printf("dequant bits %d: %.2e\n", bits, d); fails += d > 0;
        std::vector<float> ga(5 * R), gp(5 * R);
        A->gemm_tile(x.data(), K, 5, ta.data(), K, R, K, ga.data(), R, false);
        P->gemm_tile(x.data(), K, 5, tp.data(), K, R, K, gp.data(), R, false);
        d = maxdiff(ga, gp); std::printf("gemm_tile: %.2e\n", d); fails += d > 1e-5;
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
    d = std::fabs(A->dot(x.data(), w.data(), 37) - P->dot(x.data(), w.data(), 37));
    std::printf("dot: %.2e\n", d); fails += d > 1e-4;
    std::printf(fails ? "FAILED %d\n" : "all ok\n", fails);
    return fails != 0;
}

// qwenmetal._core bindings for `qwenmetal bench`: a memory read-bandwidth kernel.
//
// bench_read_bytes(buffer) streams every byte of a C-contiguous buffer through the widest loads this CPU
// has (AVX-512, else AVX2, else plain 64-bit loads; chosen at run time, since wheels are built without
// -march=native), with four independent accumulators so that the loop is bound by memory, not by a
// dependency chain. The GIL is released, so Python threads reading their own parts of one buffer run in
// parallel; the benchmark times them (python/qwenmetal/bench.py).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define QM_BENCH_X86 1
#endif

#include "bindings/registry.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

uint64_t read_scalar(const uint8_t* p, size_t n) {
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        uint64_t w[4];
        std::memcpy(w, p + i, 32);
        a0 ^= w[0];
        a1 ^= w[1];
        a2 ^= w[2];
        a3 ^= w[3];
    }
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        std::memcpy(&w, p + i, 8);
        a0 ^= w;
    }
    for (; i < n; ++i) a1 ^= p[i];               // a trailing partial word, byte by byte
    return a0 ^ a1 ^ a2 ^ a3;
}

#ifdef QM_BENCH_X86
__attribute__((target("avx2"))) uint64_t read_avx2(const uint8_t* p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
        a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
    }
    a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    uint64_t out[4];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), a0);
    return out[0] ^ out[1] ^ out[2] ^ out[3] ^ read_scalar(p + i, n - i);
}

__attribute__((target("avx512f"))) uint64_t read_avx512(const uint8_t* p, size_t n) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
        a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
        a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 64));
        a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 128));
        a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 192));
    }
    a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    uint64_t out[8];
    _mm512_storeu_si512(out, a0);
    uint64_t r = 0;
    for (uint64_t v : out) r ^= v;
    return r ^ read_scalar(p + i, n - i);
}
#endif

const char* read_isa() {
#ifdef QM_BENCH_X86
    if (__builtin_cpu_supports("avx512f")) return "avx512";
    if (__builtin_cpu_supports("avx2")) return "avx2";
#endif
    return "scalar";
}

uint64_t read_bytes(const uint8_t* p, size_t n) {
#ifdef QM_BENCH_X86
    if (__builtin_cpu_supports("avx512f")) return read_avx512(p, n);
    if (__builtin_cpu_supports("avx2")) return read_avx2(p, n);
#endif
    return read_scalar(p, n);
}

}  // namespace

namespace qwenmetal::bindings {

void register_bench(nb::module_& m) {
    m.def(
        "bench_read_bytes",
        [](nb::ndarray<nb::c_contig, nb::device::cpu> buf) {
            const auto* p = static_cast<const uint8_t*>(buf.data());
            const size_t n = buf.nbytes();
            nb::gil_scoped_release release;
            return read_bytes(p, n);
        },
        "buffer"_a,
        "Read every byte of a C-contiguous buffer with the widest loads this CPU has (GIL released); returns "
        "the XOR of its 64-bit words (so the reads cannot be optimised away). For measuring read "
        "bandwidth.");
    m.def("bench_read_isa", &read_isa, "The instruction set bench_read_bytes uses on this CPU.");
}

}  // namespace qwenmetal::bindings

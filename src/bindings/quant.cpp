// qwenmetal._core bindings for the quant family and build facts.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>

#include "bindings/registry.h"
#include "cpu/quant.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

template <class T>
using Mat = nb::ndarray<const T, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

nb::ndarray<nb::numpy, float, nb::ndim<2>> dequantize(Mat<uint32_t> w, Mat<float> scales, Mat<float> biases,
                                                      int bits, int group_size) {
    if (bits <= 0 || bits > 8)
        throw std::invalid_argument("bits must be 2, 3, 4, 5, 6 or 8, got " + std::to_string(bits));
    const size_t rows = w.shape(0), packed = w.shape(1);
    const size_t in_features = packed * 32 / bits;
    if (packed * 32 % bits != 0)
        throw std::invalid_argument(std::to_string(packed) + " words are not a whole number of " +
                                    std::to_string(bits) + "-bit values");
    qwenmetal::cpu::check_affine("dequantize_affine (bits / group_size)", bits, group_size, int64_t(in_features));
    const size_t groups = in_features / group_size;
    if (scales.shape(0) != rows || scales.shape(1) != groups || biases.shape(0) != rows || biases.shape(1) != groups)
        throw std::invalid_argument("scales and biases must be [rows, in_features / group_size] = [" +
                                    std::to_string(rows) + ", " + std::to_string(groups) + "]");
    float* out = new float[rows * in_features];
    nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<float*>(p); });
    {
        nb::gil_scoped_release release;
        qwenmetal::cpu::dequantize_affine(w.data(), scales.data(), biases.data(), out, rows, in_features, bits,
                                          group_size);
    }
    return nb::ndarray<nb::numpy, float, nb::ndim<2>>(out, {rows, in_features}, owner);
}

nb::dict build_info() {
    nb::dict d;
#if defined(__clang__)
    d["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
    d["compiler"] = std::string("gcc ") + __VERSION__;
#else
    d["compiler"] = std::string("unknown");
#endif
#if defined(__x86_64__) || defined(_M_X64)
    d["arch"] = "x86_64";
    __builtin_cpu_init();
    d["avx2"] = static_cast<bool>(__builtin_cpu_supports("avx2"));
    d["fma"] = static_cast<bool>(__builtin_cpu_supports("fma"));
    d["avx512f"] = static_cast<bool>(__builtin_cpu_supports("avx512f"));
#elif defined(__aarch64__)
    d["arch"] = "arm64";
    d["neon"] = true;
#else
    d["arch"] = "other";
#endif
#if defined(__APPLE__)
    d["metal"] = true;
#else
    d["metal"] = false;
#endif
    return d;
}

}  // namespace

namespace qwenmetal::bindings {
void register_quant(nb::module_& m) {
    m.def("dequantize_affine", &dequantize, "w"_a, "scales"_a, "biases"_a, "bits"_a, "group_size"_a,
          "Dequantize MLX affine-packed rows: float32 [rows, in] = scale * q + bias (GIL released).");
    m.def("build_info", &build_info, "Compiler, architecture and the SIMD features this CPU has.");
}
}  // namespace qwenmetal::bindings

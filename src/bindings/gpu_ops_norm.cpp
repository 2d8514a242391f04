// gpu.ops: norm family (metal/norm.metal, src/gpu/ops/norm.cpp).
#include <nanobind/stl/string.h>

#include "bindings/gpu.h"
#include "gpu/ops/norm.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace qwenmetal::bindings {

void register_gpu_ops_norm(nb::module_& ops) {
    ops.def("rmsnorm", [](gpu::Encoder& e, const std::string& t, const gpu::Buffer& x, const gpu::Buffer& w,
                          const gpu::Buffer& y, uint32_t rows, uint32_t H, float eps) {
        gpu::ops::rmsnorm(e, gpu::parse_act(t), x, w, y, rows, H, eps);
    }, "encoder"_a, "dtype"_a, "x"_a, "w"_a, "y"_a, "rows"_a, "H"_a, "eps"_a);
    ops.def("add_rmsnorm", [](gpu::Encoder& e, const std::string& t, const gpu::Buffer& x, const gpu::Buffer& r,
                              const gpu::Buffer& w, const gpu::Buffer& h, const gpu::Buffer& y, uint32_t rows,
                              uint32_t H, float eps) {
        gpu::ops::add_rmsnorm(e, gpu::parse_act(t), x, r, w, h, y, rows, H, eps);
    }, "encoder"_a, "dtype"_a, "x"_a, "r"_a, "w"_a, "h"_a, "y"_a, "rows"_a, "H"_a, "eps"_a);
    ops.def("layer_norm", [](gpu::Encoder& e, const std::string& t, const gpu::Buffer& x, const gpu::Buffer& w,
                             const gpu::Buffer& b, const gpu::Buffer& y, uint32_t rows, uint32_t H, float eps) {
        gpu::ops::layer_norm(e, gpu::parse_act(t), x, w, b, y, rows, H, eps);
    }, "encoder"_a, "dtype"_a, "x"_a, "w"_a, "b"_a, "y"_a, "rows"_a, "H"_a, "eps"_a,
       "y = LayerNorm(x) * w + b over rows [rows, H] (biased variance)");
    ops.def("copy_f32", [](gpu::Encoder& e, const std::string& t, const gpu::Buffer& x, const gpu::Buffer& y,
                           uint32_t rows, uint32_t H) {
        gpu::ops::copy_f32(e, gpu::parse_act(t), x, y, rows, H);
    }, "encoder"_a, "dtype"_a, "x"_a, "y"_a, "rows"_a, "H"_a, "y (float32) = x rows [rows, H] widened");
}

}  // namespace qwenmetal::bindings

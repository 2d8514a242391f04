// gpu.ops: quant family (metal/quant.metal, src/gpu/ops/quant.cpp), and gpu.Matrix, the weight
// descriptor every GEMV-like op takes.
#include <nanobind/stl/string.h>
#include <nanobind/stl/optional.h>

#include "bindings/gpu.h"
#include "gpu/ops/quant.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace qwenmetal::bindings {

namespace {
gpu::WFormat parse_format(const std::string& s) {
    // 'q<digit>': quantized at that width (quantized_format refuses the widths MLX affine has not)
    if (s.size() == 2 && s[0] == 'q' && s[1] >= '0' && s[1] <= '9')
        return gpu::quantized_format(uint32_t(s[1] - '0'), "gpu.Matrix fmt");
    if (s == "bf16" || s == "bfloat16") return gpu::WFormat::BF16;
    if (s == "f16" || s == "float16") return gpu::WFormat::F16;
    if (s == "f32" || s == "float32") return gpu::WFormat::F32;
    throw std::invalid_argument("weight format must be 'q2', 'q3', 'q4', 'q5', 'q6', 'q8', 'bf16', 'f16' or 'f32', got '" +
                                s + "'");
}
}  // namespace

void register_gpu_ops_quant(nb::module_& ops) {
    nb::module_ g = nb::module_::import_("qwenmetal._core").attr("gpu");
    nb::class_<gpu::Matrix>(g, "Matrix",
                            "A [rows, cols] weight matrix, or a stack of `count` of them, in device buffers.\n"
                            "fmt 'q2'/'q3'/'q4'/'q5'/'q6'/'q8' (MLX affine: w uint32 words, scales and biases bf16,\n"
                            "or float32 with scales_f32) or 'bf16'/'f16'/'f32' (dense: w only).")
        .def("__init__",
             [](gpu::Matrix* m, const std::string& fmt, uint32_t rows, uint32_t cols, const gpu::Buffer& w,
                const gpu::Buffer* scales, const gpu::Buffer* biases, uint32_t group_size, uint32_t count,
                bool scales_f32) {
                 new (m) gpu::Matrix();
                 m->fmt = parse_format(fmt);
                 m->rows = rows;
                 m->cols = cols;
                 m->group_size = gpu::quantized(m->fmt) ? group_size : 0;
                 m->count = count;
                 m->scales_f32 = scales_f32;
                 m->w = w;
                 if (scales) m->scales = *scales;
                 if (biases) m->biases = *biases;
             },
             "fmt"_a, "rows"_a, "cols"_a, "w"_a, "scales"_a = nb::none(), "biases"_a = nb::none(),
             "group_size"_a = 64, "count"_a = 1, "scales_f32"_a = false)
        .def_prop_ro("fmt", [](const gpu::Matrix& m) { return std::string(gpu::format_name(m.fmt)); })
        .def_rw("rows", &gpu::Matrix::rows)
        .def_rw("cols", &gpu::Matrix::cols)
        .def_rw("group_size", &gpu::Matrix::group_size)
        .def_rw("count", &gpu::Matrix::count)
        .def_rw("scales_f32", &gpu::Matrix::scales_f32)
        .def_rw("w", &gpu::Matrix::w)
        .def_rw("scales", &gpu::Matrix::scales)
        .def_rw("biases", &gpu::Matrix::biases)
        .def_prop_ro("variant", &gpu::Matrix::variant)
        .def_prop_ro("row_bytes", &gpu::Matrix::row_bytes)
        .def_prop_ro("matrix_bytes", &gpu::Matrix::matrix_bytes)
        .def("validate", [](const gpu::Matrix& m, const std::string& what) { m.validate(what.c_str()); },
             "what"_a = "Matrix")
        .def("__repr__", [](const gpu::Matrix& m) {
            return "gpu.Matrix(" + m.variant() + ", " + std::to_string(m.rows) + " x " + std::to_string(m.cols) +
                   (gpu::quantized(m.fmt) ? ", group_size=" + std::to_string(m.group_size) : std::string()) +
                   (m.count != 1 ? ", count=" + std::to_string(m.count) : std::string()) + ")";
        });

    ops.def("can_pair", &gpu::can_pair, "a"_a, "b"_a,
            "whether one MoE kernel reads both matrices (routed experts and shared expert); else the shared runs apart");
    ops.def("qmv", [](gpu::Encoder& e, const std::string& t, const gpu::Matrix& W, const gpu::Buffer& x,
                      const gpu::Buffer& y, uint32_t batch, bool f32_out, uint32_t x_stride, uint32_t y_stride,
                      std::optional<gpu::Buffer> norm_w, float eps, std::optional<gpu::Buffer> xn,
                      std::optional<gpu::Buffer> residual, bool round, std::optional<gpu::Buffer> conv_w,
                      std::optional<gpu::Buffer> conv_state, std::optional<gpu::Buffer> conv_out,
                      std::optional<gpu::Buffer> act, uint32_t conv_taps, uint32_t conv_channels) {
        gpu::ops::QmvFusion f;
        f.norm_w = norm_w ? &*norm_w : nullptr;
        f.eps = eps;
        f.xn = xn ? &*xn : nullptr;
        f.residual = residual ? &*residual : nullptr;
        f.round = round;
        gpu::ops::QmvConv conv{conv_w ? &*conv_w : nullptr, conv_state ? &*conv_state : nullptr,
                               conv_out ? &*conv_out : nullptr, act ? &*act : nullptr, conv_taps,
                               conv_channels};
        if (conv_w || conv_state || conv_out || act || conv_taps) f.conv = &conv;
        gpu::ops::qmv(e, gpu::parse_act(t), W, x, y, batch, f32_out, x_stride, y_stride, f);
    }, "encoder"_a, "dtype"_a, "W"_a, "x"_a, "y"_a, "batch"_a = 1, "f32_out"_a = false, "x_stride"_a = 0,
       "y_stride"_a = 0, "norm_w"_a = nb::none(), "eps"_a = 1e-6f, "xn"_a = nb::none(), "residual"_a = nb::none(),
       "round"_a = false, "conv_w"_a = nb::none(), "conv_state"_a = nb::none(), "conv_out"_a = nb::none(),
       "act"_a = nb::none(), "conv_taps"_a = 0, "conv_channels"_a = 0,
       "y[b, :rows] = W x[b, :cols] for b < batch (y float with f32_out); with norm_w the input is rmsnorm(x) * "
       "norm_w (also stored to xn if given), with residual y = residual + W x (residual may be y); with round a "
       "float output holds the product rounded to the activation type. Batches 2..16 read each weight once. "
       "With conv_w/conv_state/conv_out/act/conv_taps (batch 1): the Gated DeltaNet's causal conv of this token "
       "as the epilogue, row c < conv_channels (default: all rows) being channel c (act = silu(conv), conv_out = "
       "the shifted state).");
    ops.def("embed", [](gpu::Encoder& e, const std::string& t, const gpu::Matrix& E, const gpu::Buffer& ids,
                        uint32_t n, const gpu::Buffer& y) {
        gpu::ops::embed(e, gpu::parse_act(t), E, ids, n, y);
    }, "encoder"_a, "dtype"_a, "E"_a, "ids"_a, "n"_a, "y"_a, "y[i] = row ids[i] of E (dequantized) for i < n.");
}

}  // namespace qwenmetal::bindings

// gpu.ops: vision family (metal/vision.metal, src/gpu/ops/vision.cpp): the vision tower's own kernels.
#include <nanobind/stl/string.h>

#include "bindings/gpu.h"
#include "gpu/ops/vision.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace qwenmetal::bindings {

namespace {
gpu::ops::VisionAct parse_vision_act(const std::string& a) {
    if (a == "none") return gpu::ops::VisionAct::None;
    if (a == "gelu_tanh") return gpu::ops::VisionAct::GeluTanh;
    if (a == "gelu_erf") return gpu::ops::VisionAct::GeluErf;
    throw std::invalid_argument("vision_bias_act: act must be 'none', 'gelu_tanh' or 'gelu_erf', got '" + a + "'");
}
}  // namespace

void register_gpu_ops_vision(nb::module_& ops) {
    ops.def("vision_bias_act", [](gpu::Encoder& e, const std::string& t, const gpu::Buffer& y, const gpu::Buffer& b,
                                  uint32_t rows, uint32_t N, const std::string& act, uint32_t stride) {
        gpu::ops::vision_bias_act(e, gpu::parse_act(t), y, b, rows, N, parse_vision_act(act), stride);
    }, "encoder"_a, "dtype"_a, "y"_a, "b"_a, "rows"_a, "N"_a, "act"_a = "none", "stride"_a = 0,
       "y[r, :N] = act(y[r, :N] + b) in place (act: 'none', 'gelu_tanh', 'gelu_erf')");
    ops.def("vision_pos_embed", [](gpu::Encoder& e, const std::string& t, const gpu::Buffer& x, const gpu::Buffer& b,
                                   const gpu::Buffer& table, uint32_t table_rows, const gpu::Buffer& idx,
                                   const gpu::Buffer& w, uint32_t rows, uint32_t H) {
        gpu::ops::vision_pos_embed(e, gpu::parse_act(t), x, b, table, table_rows, idx, w, rows, H);
    }, "encoder"_a, "dtype"_a, "x"_a, "b"_a, "table"_a, "table_rows"_a, "idx"_a, "w"_a, "rows"_a, "H"_a,
       "x[r] = (x[r] + b) + sum_j w[r, j] table[idx[r, j]] in place (idx u32 [rows, 4], w f32 [rows, 4])");
    ops.def("vision_rope", [](gpu::Encoder& e, const std::string& t, uint32_t n_heads, uint32_t head_dim,
                              const gpu::Buffer& qkv, const gpu::Buffer& bias, const gpu::Buffer& cos,
                              const gpu::Buffer& sin, const gpu::Buffer& q_out, const gpu::Buffer& k_cache,
                              const gpu::Buffer& v_cache, uint32_t capacity, uint32_t rows, uint32_t stride) {
        gpu::ops::vision_rope(e, gpu::parse_act(t), n_heads, head_dim, qkv, bias, cos, sin, q_out,
                              gpu::ops::KVCache{k_cache, v_cache, capacity, gpu::parse_act(t) == gpu::Act::F32}, rows,
                              stride);
    }, "encoder"_a, "dtype"_a, "n_heads"_a, "head_dim"_a, "qkv"_a, "bias"_a, "cos"_a, "sin"_a, "q_out"_a, "k_cache"_a,
       "v_cache"_a, "capacity"_a, "rows"_a, "stride"_a = 0,
       "q, k = rotate-half(qkv + bias) by cos/sin [rows, head_dim] f32, v = qkv + bias; q to q_out [rows, heads * "
       "head_dim], k and v to [heads, capacity, head_dim]");
}

}  // namespace qwenmetal::bindings

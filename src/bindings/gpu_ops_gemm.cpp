// gpu.ops: gemm family (metal/gemm.metal, src/gpu/ops/gemm.cpp), and gpu.TileMap, the MoE tile map the
// grouped GEMMs read.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "bindings/gpu.h"
#include "gpu/ops/gemm.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace qwenmetal::bindings {

void register_gpu_ops_gemm(nb::module_& ops) {
    nb::module_ g = nb::module_::import_("qwenmetal._core").attr("gpu");
    nb::class_<gpu::ops::TileMap>(g, "TileMap",
                                  "The MoE tile map: tiles u32x4 [capacity] {expert, first slot, n_rows, 0}; "
                                  "tile_rows 16 or 32.")
        .def("__init__",
             [](gpu::ops::TileMap* t, const gpu::Buffer& tiles, uint32_t capacity, uint32_t tile_rows) {
                 new (t) gpu::ops::TileMap{tiles, capacity, tile_rows};
             },
             "tiles"_a, "capacity"_a, "tile_rows"_a = 16)
        .def_rw("tiles", &gpu::ops::TileMap::tiles)
        .def_rw("capacity", &gpu::ops::TileMap::capacity)
        .def_rw("tile_rows", &gpu::ops::TileMap::tile_rows);

    ops.def("gemm_route", [](const gpu::Device& d) {
        return gpu::ops::gemm_route_name(gpu::ops::gemm_route(d.info()));
    }, "device"_a, "The GEMM route of a device: 'tensor' where it has Metal 4 tensor ops (M5), else 'simdgroup'.");
    ops.def("gemm", [](gpu::Encoder& e, const std::string& t, const gpu::Matrix& W, const gpu::Buffer& x,
                       const gpu::Buffer& y, uint32_t M, bool f32_out, uint32_t x_stride, uint32_t y_stride,
                       std::optional<gpu::Buffer> residual, bool round, bool swiglu, const std::string& route) {
        gpu::ops::GemmFusion f;
        f.residual = residual ? &*residual : nullptr;
        f.round = round;
        f.swiglu = swiglu;
        gpu::ops::gemm(e, gpu::parse_act(t), W, x, y, M, f32_out, x_stride, y_stride, f, gpu::ops::parse_gemm_route(route));
    }, "encoder"_a, "dtype"_a, "W"_a, "x"_a, "y"_a, "M"_a, "f32_out"_a = false, "x_stride"_a = 0, "y_stride"_a = 0,
       "residual"_a = nb::none(), "round"_a = false, "swiglu"_a = false, "route"_a = "simdgroup",
       "Y[m, :N] = X[m, :K] W^T for m < M (y float with f32_out; with residual y = residual + X W^T; with "
       "swiglu W is a stacked [gate | up] and y = silu(gate x) * (up x)). M <= 16 without swiglu runs qmv.");
    ops.def("gemm_grouped_swiglu", [](gpu::Encoder& e, const std::string& t, const gpu::Matrix& gate,
                                      const gpu::Matrix& up, const gpu::Buffer& x, const gpu::Buffer& slot_rows,
                                      const gpu::ops::TileMap& tm, uint32_t S, const gpu::Buffer& act,
                                      const std::string& route) {
        gpu::ops::gemm_grouped_swiglu(e, gpu::parse_act(t), gate, up, x, slot_rows, tm, S, act, gpu::ops::parse_gemm_route(route));
    }, "encoder"_a, "dtype"_a, "gate"_a, "up"_a, "x"_a, "slot_rows"_a, "tm"_a, "S"_a, "act"_a,
       "route"_a = "simdgroup",
       "act[s] = silu(gate_e x[slot_rows[s]]) * (up_e x[slot_rows[s]]) for every slot s of every tile-map entry.");
    ops.def("gemm_grouped", [](gpu::Encoder& e, const std::string& t, const gpu::Matrix& W, const gpu::Buffer& act,
                               const gpu::ops::TileMap& tm, uint32_t S, const gpu::Buffer& y,
                               const std::string& route) {
        gpu::ops::gemm_grouped(e, gpu::parse_act(t), W, act, tm, S, y, gpu::ops::parse_gemm_route(route));
    }, "encoder"_a, "dtype"_a, "W"_a, "act"_a, "tm"_a, "S"_a, "y"_a, "route"_a = "simdgroup",
       "y[s] = W_e act[s] (float, rounded to the activation type) for every slot s of every tile-map entry.");
}

}  // namespace qwenmetal::bindings

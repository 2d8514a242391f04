// gpu.ops: gdn family (metal/gdn.metal, src/gpu/ops/gdn.cpp).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>

#include "bindings/gpu.h"
#include "gpu/ops/gdn.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace qwenmetal::bindings {

void register_gpu_ops_gdn(nb::module_& ops) {
    using gpu::ops::GdnShape;
    nb::class_<GdnShape>(ops, "GdnShape")
        .def("__init__", [](GdnShape* self, uint32_t nk, uint32_t nv, uint32_t dk, uint32_t dv,
                            uint32_t conv_kernel) { new (self) GdnShape{nk, nv, dk, dv, conv_kernel}; },
             "nk"_a, "nv"_a, "dk"_a, "dv"_a, "conv_kernel"_a)
        .def_rw("nk", &GdnShape::nk)
        .def_rw("nv", &GdnShape::nv)
        .def_rw("dk", &GdnShape::dk)
        .def_rw("dv", &GdnShape::dv)
        .def_rw("conv_kernel", &GdnShape::conv_kernel)
        .def_prop_ro("conv_dim", &GdnShape::conv_dim)
        .def_prop_ro("value_dim", &GdnShape::value_dim)
        .def("__repr__", [](const GdnShape& s) {
            return "GdnShape(nk=" + std::to_string(s.nk) + ", nv=" + std::to_string(s.nv) + ", dk=" +
                   std::to_string(s.dk) + ", dv=" + std::to_string(s.dv) +
                   ", conv_kernel=" + std::to_string(s.conv_kernel) + ")";
        });
    ops.def("gdn_conv", [](gpu::Encoder& e, const std::string& t, const GdnShape& s, const gpu::Buffer& qkv,
                           const gpu::Buffer& conv_w, const gpu::Buffer& conv_state, const gpu::Buffer& act,
                           std::optional<gpu::Buffer> conv_out, uint32_t rows, uint32_t qkv_stride) {
        gpu::ops::gdn_conv(e, gpu::parse_act(t), s, qkv, conv_w, conv_state, conv_out ? *conv_out : conv_state, act,
                           rows, qkv_stride);
    }, "encoder"_a, "dtype"_a, "shape"_a, "qkv"_a, "conv_w"_a, "conv_state"_a, "act"_a, "conv_out"_a = nb::none(),
       "rows"_a = 1, "qkv_stride"_a = 0,
       "conv_out: where the last K-1 window rows go (default: conv_state, in place); rows: tokens (oldest "
       "first); qkv_stride: elements between qkv rows (0: conv_dim)");
    ops.def("gdn_step", [](gpu::Encoder& e, const std::string& t, const GdnShape& s, const gpu::Buffer& act,
                           const gpu::Buffer& z, const gpu::Buffer& b, const gpu::Buffer& a, const gpu::Buffer& A_log,
                           const gpu::Buffer& dt_bias, const gpu::Buffer& norm_w, float eps,
                           const gpu::Buffer& state, const gpu::Buffer& y, std::optional<gpu::Buffer> state_out) {
        gpu::ops::gdn_step(e, gpu::parse_act(t), s, act, z, b, a, A_log, dt_bias, norm_w, eps, state,
                           state_out ? *state_out : state, y);
    }, "encoder"_a, "dtype"_a, "shape"_a, "act"_a, "z"_a, "b"_a, "a"_a, "A_log"_a, "dt_bias"_a, "norm_w"_a,
       "eps"_a, "state"_a, "y"_a, "state_out"_a = nb::none(),
       "state_out: where the updated state goes (default: state, in place)");
    ops.def("gdn_conv_rows", [](gpu::Encoder& e, const std::string& t, const GdnShape& s, const gpu::Buffer& qkv,
                                const gpu::Buffer& conv_w, const gpu::Buffer& conv_slab, uint32_t slots, uint32_t in,
                                uint32_t first, const gpu::Buffer& act, uint32_t rows, uint32_t qkv_stride) {
        gpu::ops::gdn_conv_rows(e, gpu::parse_act(t), s, qkv, conv_w, conv_slab, {slots, in, first}, act, rows,
                                qkv_stride);
    }, "encoder"_a, "dtype"_a, "shape"_a, "qkv"_a, "conv_w"_a, "conv_slab"_a, "slots"_a, "in_slot"_a, "first"_a,
       "act"_a, "rows"_a, "qkv_stride"_a = 0,
       "a verification's conv over `rows` chained tokens: reads slot in_slot of conv_slab [slots, K-1, conv_dim], "
       "writes the window after row r into slot (first + r) % slots");
    ops.def("gdn_step_rows", [](gpu::Encoder& e, const std::string& t, const GdnShape& s, const gpu::Buffer& act,
                                const gpu::Buffer& proj, uint32_t proj_stride, const gpu::Buffer& A_log,
                                const gpu::Buffer& dt_bias, const gpu::Buffer& norm_w, float eps,
                                const gpu::Buffer& ssm_slab, uint32_t slots, uint32_t in, uint32_t first,
                                const gpu::Buffer& y, uint32_t rows, uint32_t y_stride) {
        gpu::ops::gdn_step_rows(e, gpu::parse_act(t), s, act, proj, proj_stride, A_log, dt_bias, norm_w, eps,
                                ssm_slab, {slots, in, first}, y, rows, y_stride);
    }, "encoder"_a, "dtype"_a, "shape"_a, "act"_a, "proj"_a, "proj_stride"_a, "A_log"_a, "dt_bias"_a, "norm_w"_a,
       "eps"_a, "ssm_slab"_a, "slots"_a, "in_slot"_a, "first"_a, "y"_a, "rows"_a, "y_stride"_a = 0,
       "a verification's recurrence over `rows` chained tokens: reads slot in_slot of ssm_slab [slots, nv, dv, dk], "
       "writes the state after row r into slot (first + r) % slots");
    ops.def("gdn_prefill", [](gpu::Encoder& e, const std::string& t, const GdnShape& s, const gpu::Buffer& act,
                              const gpu::Buffer& proj, uint32_t proj_stride, const gpu::Buffer& A_log,
                              const gpu::Buffer& dt_bias, const gpu::Buffer& norm_w, float eps, const gpu::Buffer& state,
                              const gpu::Buffer& y, uint32_t M, const gpu::Buffer& scratch, const std::string& route,
                              std::optional<gpu::Buffer> state_out, uint32_t block) {
        gpu::ops::gdn_prefill(e, gpu::parse_act(t), s, act, proj, proj_stride, A_log, dt_bias, norm_w, eps, state,
                              state_out ? *state_out : state, y, M, scratch, gpu::ops::parse_gdn_route(route), block);
    }, "encoder"_a, "dtype"_a, "shape"_a, "act"_a, "proj"_a, "proj_stride"_a, "A_log"_a, "dt_bias"_a, "norm_w"_a,
       "eps"_a, "state"_a, "y"_a, "M"_a, "scratch"_a, "route"_a = "auto", "state_out"_a = nb::none(), "block"_a = 0,
       "M tokens of the recurrence; route: 'auto' (gdn_route), 'scan' or 'chunked'; block: the chunked route's "
       "tokens per block (0: the fewest blocks of <= 64 tokens, balanced); state_out: default state (in place)");
    ops.def("gdn_prefill_scratch_bytes", &gpu::ops::gdn_prefill_scratch_bytes, "shape"_a, "max_rows"_a);
    ops.def("gdn_route",
            [](const GdnShape& s, uint32_t M) { return gpu::ops::gdn_route_name(gpu::ops::gdn_route(s, M)); },
            "shape"_a, "M"_a, "the route Auto takes for M tokens: 'scan' or 'chunked' (the cost model)");
    ops.def("gdn_prefill_cost", [](const GdnShape& s, uint32_t M, const std::string& route, uint32_t block) {
        const gpu::ops::GdnCost c = gpu::ops::gdn_prefill_cost(s, M, gpu::ops::parse_gdn_route(route), block);
        nb::dict d;
        d["flops"] = c.flops;
        d["bytes"] = c.bytes;
        d["dispatches"] = c.dispatches;
        d["seconds"] = c.seconds;
        return d;
    }, "shape"_a, "M"_a, "route"_a, "block"_a = 0,
       "the cost model of a route ('scan' / 'chunked'): declared flops and bytes (bf16 build), dispatches, "
       "modelled seconds (a model, not a measurement)");
}

}  // namespace qwenmetal::bindings

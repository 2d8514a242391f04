// gpu.ops: moe family (metal/moe.metal, src/gpu/ops/moe.cpp).
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings/gpu.h"
#include "gpu/ops/moe.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace qwenmetal::bindings {

void register_gpu_ops_moe(nb::module_& ops) {
    ops.def("moe_topk", [](gpu::Encoder& e, const gpu::Buffer& logits, uint32_t n_experts, uint32_t k, bool norm,
                           const gpu::Buffer& ids, const gpu::Buffer& weights) {
        gpu::ops::moe_topk(e, logits, n_experts, k, norm, ids, weights);
    }, "encoder"_a, "logits"_a, "n_experts"_a, "k"_a, "norm"_a, "ids"_a, "weights"_a);
    ops.def("moe_gate_up", [](gpu::Encoder& e, const std::string& t, const gpu::Matrix& gate, const gpu::Matrix& up,
                              const gpu::Matrix* shared_gate_up, const gpu::Buffer& x, const gpu::Buffer& ids,
                              uint32_t k, const gpu::Buffer& act, const gpu::Buffer* logits, uint32_t n_experts,
                              bool norm, const gpu::Buffer* weights) {
        if (bool(logits) != bool(weights))
            throw std::invalid_argument("moe_gate_up: the fused top-k needs both logits and weights");
        gpu::ops::MoeRouting r;
        if (logits) r = gpu::ops::MoeRouting{*logits, n_experts, norm, *weights};
        gpu::ops::moe_gate_up(e, gpu::parse_act(t), gate, up, shared_gate_up, x, ids, k, act, logits ? &r : nullptr);
    }, "encoder"_a, "dtype"_a, "gate"_a, "up"_a, "shared_gate_up"_a.none(), "x"_a, "ids"_a, "k"_a, "act"_a,
       "logits"_a.none() = nb::none(), "n_experts"_a = 0, "norm"_a = true, "weights"_a.none() = nb::none(),
       "With logits and weights the router top-k is fused in: ids and weights are written, not read.");
    ops.def("moe_down", [](gpu::Encoder& e, const std::string& t, const gpu::Matrix& down,
                           const gpu::Matrix* shared_down, const gpu::Buffer& act, const gpu::Buffer& ids,
                           const gpu::Buffer& weights, const gpu::Buffer* logits, uint32_t n_experts, uint32_t k,
                           const gpu::Buffer& x, const gpu::Buffer* shared_out) {
        gpu::ops::moe_down(e, gpu::parse_act(t), down, shared_down, act, ids, weights,
                           logits ? *logits : gpu::Buffer{}, n_experts, k, x, shared_out);
    }, "encoder"_a, "dtype"_a, "down"_a, "shared_down"_a.none(), "act"_a, "ids"_a, "weights"_a, "logits"_a.none(),
       "n_experts"_a, "k"_a, "x"_a, "shared_out"_a.none() = nb::none(),
       "shared_out (f32 [H]): where a shared expert the routed kernel cannot read has its down projection");
    // the union-read MoE of R rows
    ops.def("moe_expected_union", &gpu::ops::moe_expected_union, "n_experts"_a, "k"_a, "rows"_a);
    ops.def("moe_gate_up_rows", [](gpu::Encoder& e, const std::string& t, const gpu::Matrix& gate,
                                   const gpu::Matrix& up, const gpu::Matrix* shared_gate_up, const gpu::Buffer& x,
                                   const gpu::Buffer& ids, uint32_t k, const gpu::Buffer& act, uint32_t rows,
                                   uint32_t x_stride, uint32_t act_row, const gpu::Buffer* logits,
                                   uint32_t logits_stride, uint32_t n_experts, bool norm, const gpu::Buffer* weights) {
        if (bool(logits) != bool(weights))
            throw std::invalid_argument("moe_gate_up_rows: the fused top-k needs both logits and weights");
        gpu::ops::MoeRowsRouting r;
        if (logits) r = gpu::ops::MoeRowsRouting{*logits, logits_stride, n_experts, norm, *weights};
        gpu::ops::moe_gate_up_rows(e, gpu::parse_act(t), gate, up, shared_gate_up, x, ids, k, act,
                                   gpu::ops::MoeRows{rows, x_stride, act_row}, logits ? &r : nullptr);
    }, "encoder"_a, "dtype"_a, "gate"_a, "up"_a, "shared_gate_up"_a.none(), "x"_a, "ids"_a, "k"_a, "act"_a, "rows"_a,
       "x_stride"_a = 0, "act_row"_a = 0, "logits"_a.none() = nb::none(), "logits_stride"_a = 0, "n_experts"_a = 0,
       "norm"_a = true, "weights"_a.none() = nb::none(),
       "With logits and weights (rows <= 4) the router top-k is fused in: ids and weights are written, not read.");
    ops.def("moe_down_rows", [](gpu::Encoder& e, const std::string& t, const gpu::Matrix& down,
                                const gpu::Matrix* shared_down, const gpu::Buffer& act, const gpu::Buffer& ids,
                                const gpu::Buffer& weights, const gpu::Buffer* logits, uint32_t logits_stride,
                                uint32_t n_experts, uint32_t k, const gpu::Buffer& x, uint32_t rows, uint32_t x_stride,
                                uint32_t act_row, const gpu::Buffer* shared_out) {
        gpu::ops::moe_down_rows(e, gpu::parse_act(t), down, shared_down, act, ids, weights,
                                logits ? *logits : gpu::Buffer{}, logits_stride, n_experts, k, x,
                                gpu::ops::MoeRows{rows, x_stride, act_row}, shared_out);
    }, "encoder"_a, "dtype"_a, "down"_a, "shared_down"_a.none(), "act"_a, "ids"_a, "weights"_a, "logits"_a.none(),
       "logits_stride"_a, "n_experts"_a, "k"_a, "x"_a, "rows"_a, "x_stride"_a = 0, "act_row"_a = 0,
       "shared_out"_a.none() = nb::none());
    ops.def("mlp_gate_up", [](gpu::Encoder& e, const std::string& t, const gpu::Matrix& gate_up,
                              const gpu::Buffer& x, const gpu::Buffer& act) {
        gpu::ops::mlp_gate_up(e, gpu::parse_act(t), gate_up, x, act);
    }, "encoder"_a, "dtype"_a, "gate_up"_a, "x"_a, "act"_a);
    // prefill
    ops.def("moe_topk_rows", [](gpu::Encoder& e, const std::string& t, const gpu::Buffer& logits, uint32_t M,
                                uint32_t stride, uint32_t n_experts, uint32_t k, bool norm, const gpu::Buffer& ids,
                                const gpu::Buffer& weights) {
        gpu::ops::moe_topk_rows(e, gpu::parse_act(t), logits, M, stride, n_experts, k, norm, ids, weights);
    }, "encoder"_a, "dtype"_a, "logits"_a, "M"_a, "stride"_a, "n_experts"_a, "k"_a, "norm"_a, "ids"_a, "weights"_a);
    ops.def("moe_tile_capacity", &gpu::ops::moe_tile_capacity, "S"_a, "n_experts"_a, "tile_rows"_a);
    ops.def("moe_tile_rows", &gpu::ops::moe_tile_rows, "S"_a, "n_experts"_a);
    ops.def("moe_sort_scratch_bytes", &gpu::ops::moe_sort_scratch_bytes, "n_experts"_a);
    ops.def("moe_sort", [](gpu::Encoder& e, const gpu::Buffer& ids, uint32_t M, uint32_t k, uint32_t n_experts,
                           const gpu::Buffer& scratch, const gpu::Buffer& slot_rows, const gpu::Buffer& slot_of,
                           const gpu::ops::TileMap& tm) {
        gpu::ops::moe_sort(e, ids, M, k, n_experts, scratch, slot_rows, slot_of, tm);
    }, "encoder"_a, "ids"_a, "M"_a, "k"_a, "n_experts"_a, "scratch"_a, "slot_rows"_a, "slot_of"_a, "tm"_a);
    ops.def("moe_combine", [](gpu::Encoder& e, const std::string& t, const gpu::Buffer& y, const gpu::Buffer& slot_of,
                              const gpu::Buffer& weights, uint32_t M, uint32_t k, uint32_t H,
                              const gpu::Buffer* shared, const gpu::Buffer* logits, uint32_t logits_stride,
                              uint32_t n_experts, const gpu::Buffer& x) {
        gpu::ops::moe_combine(e, gpu::parse_act(t), y, slot_of, weights, M, k, H, shared,
                              logits ? *logits : gpu::Buffer{}, logits_stride, n_experts, x);
    }, "encoder"_a, "dtype"_a, "y"_a, "slot_of"_a, "weights"_a, "M"_a, "k"_a, "H"_a, "shared"_a.none(),
       "logits"_a.none(), "logits_stride"_a, "n_experts"_a, "x"_a);
    ops.def("moe_prefill", [](gpu::Encoder& e, const std::string& t, const std::vector<gpu::Matrix>& router,
                              const gpu::Matrix& gate, const gpu::Matrix& up, const gpu::Matrix& down,
                              const gpu::Matrix* shared_gate_up, const gpu::Matrix* shared_down, uint32_t k,
                              bool norm, const gpu::Buffer& xn, const gpu::Buffer& x, uint32_t M,
                              const gpu::Buffer& logits, const gpu::Buffer& ids, const gpu::Buffer& weights,
                              const gpu::Buffer& sort, const gpu::Buffer& slot_rows, const gpu::Buffer& slot_of,
                              const gpu::Buffer& tiles, const gpu::Buffer& act, const gpu::Buffer& y,
                              const gpu::Buffer* shared_act, const gpu::Buffer* shared_out) {
        const gpu::ops::MoeBlock b{&router, &gate, &up, &down, shared_gate_up, shared_down, k, norm};
        const gpu::ops::MoeScratch s{logits, ids, weights, sort, slot_rows, slot_of, tiles, act, y,
                                     shared_act ? *shared_act : gpu::Buffer{},
                                     shared_out ? *shared_out : gpu::Buffer{}};
        gpu::ops::moe_prefill(e, gpu::parse_act(t), b, xn, x, M, s);
    }, "encoder"_a, "dtype"_a, "router"_a, "gate"_a, "up"_a, "down"_a, "shared_gate_up"_a.none(),
       "shared_down"_a.none(), "k"_a, "norm"_a, "xn"_a, "x"_a, "M"_a, "logits"_a, "ids"_a, "weights"_a, "sort"_a,
       "slot_rows"_a, "slot_of"_a, "tiles"_a, "act"_a, "y"_a, "shared_act"_a.none() = nb::none(),
       "shared_out"_a.none() = nb::none(),
       "The MoE block of M rows in place on x (router GEMM, top-k, sort, grouped GEMMs, shared expert, combine); "
       "the scratch buffers as ops::MoeScratch (sizes: moe_prefill_scratch); the simdgroup GEMM route.");
    ops.def("moe_prefill_scratch", [](gpu::Device& d, const std::string& t, const std::vector<gpu::Matrix>& router,
                                      const gpu::Matrix& gate, const gpu::Matrix& up, const gpu::Matrix& down,
                                      const gpu::Matrix* shared_gate_up, const gpu::Matrix* shared_down, uint32_t k,
                                      uint32_t max_rows) {
        const gpu::ops::MoeBlock b{&router, &gate, &up, &down, shared_gate_up, shared_down, k, true};
        const gpu::ops::MoeScratch s = gpu::ops::moe_prefill_scratch(d, gpu::parse_act(t), b, max_rows);
        std::map<std::string, gpu::Buffer> out{
            {"logits", s.logits}, {"ids", s.ids}, {"weights", s.weights}, {"sort", s.sort},
            {"slot_rows", s.slot_rows}, {"slot_of", s.slot_of}, {"tiles", s.tiles}, {"act", s.act}, {"y", s.y}};
        if (shared_gate_up) {
            out["shared_act"] = s.shared_act;
            out["shared_out"] = s.shared_out;
        }
        return out;
    }, "device"_a, "dtype"_a, "router"_a, "gate"_a, "up"_a, "down"_a, "shared_gate_up"_a.none(),
       "shared_down"_a.none(), "k"_a, "max_rows"_a,
       "moe_prefill's scratch for chunks of up to max_rows rows, allocated on the device: {name: Buffer} "
       "(the keyword arguments of moe_prefill).");
}

}  // namespace qwenmetal::bindings

// gpu: the vision tower on the Metal graph (src/gpu/vision.h): GpuVisionTower, built over a GpuEngine (its device,
// activation type, GEMM route and command-buffer budget). The Python side (python/qwenmetal/backends/metal.py,
// _GpuBackend.vision_encoder) passes the tower's dimensions and its weights table (spans of the checkpoint's
// mappings, as the text model's); encode releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <memory>
#include <string>

#include "bindings/forward_call.h"
#include "bindings/gpu.h"
#include "bindings/weights_table.h"
#include "gpu/vision.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace qwenmetal::bindings {

using namespace qwenmetal::gpu;

namespace {

template <class T, int N>
using In = nb::ndarray<const T, nb::ndim<N>, nb::c_contig, nb::device::cpu>;

struct PyGpuVision {
    std::unique_ptr<GpuVision> tower;
    nb::object engine;        // the GpuEngine: its model and device outlive the tower
    nb::object keepalive;     // the arrays the tower's mappings point into
};

// the tower's config as _GpuBackend.vision_encoder hands it over (python/qwenmetal/config.py, VisionConfig)
VisionShape parse_vision_shape(const nb::dict& c) {
    auto u32 = [&](const char* k) { return nb::cast<uint32_t>(c[k]); };
    VisionShape s;
    s.depth = u32("depth");
    s.hidden = u32("hidden_size");
    s.heads = u32("num_heads");
    s.inter = u32("intermediate_size");
    s.patch_dim = u32("patch_dim");
    s.merge = u32("spatial_merge_size");
    s.out_hidden = u32("out_hidden_size");
    s.grid_side = u32("grid_side");
    s.rope_theta = nb::cast<double>(c["rope_theta"]);
    const std::string act = nb::cast<std::string>(c["hidden_act"]);
    if (act != "gelu_pytorch_tanh" && act != "gelu")
        throw std::invalid_argument("vision tower: hidden_act '" + act + "' is not run (gelu_pytorch_tanh, gelu)");
    s.gelu_tanh = act == "gelu_pytorch_tanh";
    return s;
}

void check_grid_array(const In<int64_t, 2>& grid) {
    if (grid.shape(1) != 3 || grid.shape(0) == 0)
        throw std::invalid_argument("grid_thw must be int64 [n_images, 3] with at least one image, got [" +
                                    std::to_string(grid.shape(0)) + ", " + std::to_string(grid.shape(1)) + "]");
}

}  // namespace

void register_gpu_vision(nb::module_& g) {
    nb::class_<PyGpuVision>(g, "GpuVisionTower",
                            "The vision tower's forward on the Metal graph, over a GpuEngine's device and options "
                            "(src/gpu/vision.h).")
        .def("__init__",
             [](PyGpuVision* self, nb::object engine, nb::dict config, nb::list mappings, nb::dict tensors,
                nb::object keepalive) {
                 PyGpuEngine& pe = nb::cast<PyGpuEngine&>(engine);
                 const VisionShape shape = parse_vision_shape(config);
                 const WeightTable w = parse_table(mappings, tensors);
                 std::unique_ptr<GpuVision> t;
                 {
                     nb::gil_scoped_release r;
                     t = std::make_unique<GpuVision>(*pe.engine, shape, w);
                 }
                 new (self) PyGpuVision{std::move(t), engine, keepalive};
             },
             "engine"_a, "config"_a, "mappings"_a, "tensors"_a, "keepalive"_a)
        .def("encode",
             [](PyGpuVision& p, In<float, 2> pixels, In<int64_t, 2> grid) {
                 check_grid_array(grid);
                 const VisionShape& s = p.tower->shape();
                 const int64_t rows = p.tower->merged_rows(grid.data(), int64_t(grid.shape(0)));
                 const int64_t n = rows * s.merge * s.merge;
                 if (int64_t(pixels.shape(0)) != n || pixels.shape(1) != s.patch_dim)
                     throw std::invalid_argument("pixel_values must be float32 [" + std::to_string(n) + ", " +
                                                 std::to_string(s.patch_dim) + "], got [" +
                                                 std::to_string(pixels.shape(0)) + ", " +
                                                 std::to_string(pixels.shape(1)) + "]");
                 auto out = new_array({size_t(rows), size_t(s.out_hidden)});
                 {
                     nb::gil_scoped_release r;
                     p.tower->encode(pixels.data(), grid.data(), int64_t(grid.shape(0)), out.data());
                 }
                 return nb::cast(out);
             },
             "pixel_values"_a, "grid_thw"_a,
             "The merged rows [n_merged, out_hidden_size] float32 of pixel_values [n_patches, patch_dim] float32 "
             "(each image's patches in merge-block order) and grid_thw [n_images, 3] int64. One encoder, cut into "
             "command buffers by the engine's budget, committed back to back.")
        .def("cost",
             [](PyGpuVision& p, In<int64_t, 2> grid) {
                 check_grid_array(grid);
                 StepCost c;
                 {
                     nb::gil_scoped_release r;
                     c = p.tower->cost(grid.data(), int64_t(grid.shape(0)));
                 }
                 return cost_dict(c);
             },
             "grid_thw"_a,
             "Encode, commit and wait one call for grid_thw (no pixels written, nothing read back): dispatches, "
             "levels, command buffers, bytes and flops per level, as GpuEngine.verify_cost. For encode-only costing.")
        .def_prop_ro("last_command_buffers", [](PyGpuVision& p) { return p.tower->last_command_buffers(); },
                     "command buffers of the last encode or cost call")
        .def_prop_ro("weight_nbytes", [](PyGpuVision& p) { return p.tower->weight_bytes(); },
                     "bytes of the tower's weights as bound")
        .def_prop_ro("copied_nbytes", [](PyGpuVision& p) { return p.tower->copied_bytes(); },
                     "device bytes copied at load (biases, norms and the position table as the activation type)");
}

}  // namespace qwenmetal::bindings

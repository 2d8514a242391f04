// qwenmetal._core bindings of the vision tower on the cpu engine (src/cpu/vision.h): CpuVisionTower. The
// Python side (python/qwenmetal/backends/cpu.py, CpuVisionEncoder) passes the tower's dimensions, the linear
// layers' descriptors (pointers into arrays it keeps alive) and the small float32 tensors (biases, norms,
// the position table). The tower runs either on a CpuEngine's threads under that engine's lock (never at
// the same time as its forward) or on a pool of its own; encode releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bindings/cpu_engine.h"
#include "bindings/forward_call.h"
#include "bindings/registry.h"
#include "cpu/vision.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace qwenmetal;

namespace {

template <class T, int N>
using In = nb::ndarray<const T, nb::ndim<N>, nb::c_contig, nb::device::cpu>;

struct PyVision {
    std::unique_ptr<cpu::VisionTower> tower;
    std::unique_ptr<ThreadPool> pool;   // its own threads (no engine given)
    std::mutex mu;                      // one encode at a time on its own pool (the scratch is the tower's)
    nb::object engine;                  // the CpuEngine whose threads it runs on (None: its own pool)
    nb::object keepalive;               // the arrays the descriptors point into
};

cpu::VisionDims parse_vision_dims(const nb::dict& c) {
    auto i64 = [&](const char* k) { return nb::cast<int64_t>(c[k]); };
    cpu::VisionDims d;
    d.hidden = i64("hidden_size");
    d.heads = i64("num_heads");
    d.head_dim = i64("head_dim");
    d.inter = i64("intermediate_size");
    d.depth = i64("depth");
    d.in_channels = i64("in_channels");
    d.temporal_patch = i64("temporal_patch_size");
    d.patch = i64("patch_size");
    d.merge = i64("spatial_merge_size");
    d.side = i64("grid_side");
    d.out_hidden = i64("out_hidden_size");
    const std::string act = nb::cast<std::string>(c["hidden_act"]);
    if (act != "gelu_pytorch_tanh" && act != "gelu")
        throw std::invalid_argument("vision tower: unknown hidden_act '" + act + "' (known: gelu_pytorch_tanh, gelu)");
    d.gelu_tanh = act == "gelu_pytorch_tanh";
    d.rope_theta = nb::cast<double>(c["rope_theta"]);
    return d;
}

cpu::VisionWeights parse_weights(const cpu::VisionDims& d, const nb::dict& linear, const nb::dict& small) {
    auto mat = [&](const std::string& name) {
        if (!linear.contains(name.c_str())) throw std::invalid_argument("vision tower: missing '" + name + "'");
        const TensorDesc t = bindings::parse_desc(nb::cast<nb::dict>(linear[name.c_str()]));
        if (t.shape.size() != 2) throw std::invalid_argument("vision tower: '" + name + "' is not a matrix");
        if (t.bits == 0 && t.dtype != DType::F32 && t.dtype != DType::BF16 && t.dtype != DType::F16)
            throw std::invalid_argument("vision tower: '" + name + "' has an unsupported dtype");
        return wmat_of(t, t.shape[0], t.shape[1]);
    };
    auto vec = [&](const std::string& name) {
        if (!small.contains(name.c_str())) throw std::invalid_argument("vision tower: missing '" + name + "'");
        auto a = nb::cast<In<float, 1>>(small[name.c_str()]);
        return std::vector<float>(a.data(), a.data() + a.shape(0));
    };
    cpu::VisionWeights w;
    w.patch = mat("patch_embed.proj");
    w.patch_b = vec("patch_embed.proj.bias");
    w.pos_embed = vec("pos_embed");
    for (int64_t i = 0; i < d.depth; ++i) {
        const std::string p = "blocks." + std::to_string(i) + ".";
        cpu::VisionBlock b;
        b.norm1 = vec(p + "norm1");
        b.norm1_b = vec(p + "norm1.bias");
        b.norm2 = vec(p + "norm2");
        b.norm2_b = vec(p + "norm2.bias");
        b.qkv = mat(p + "attn.qkv");
        b.qkv_b = vec(p + "attn.qkv.bias");
        b.proj = mat(p + "attn.proj");
        b.proj_b = vec(p + "attn.proj.bias");
        b.fc1 = mat(p + "mlp.linear_fc1");
        b.fc1_b = vec(p + "mlp.linear_fc1.bias");
        b.fc2 = mat(p + "mlp.linear_fc2");
        b.fc2_b = vec(p + "mlp.linear_fc2.bias");
        w.blocks.push_back(std::move(b));
    }
    w.merger_norm = vec("merger.norm");
    w.merger_norm_b = vec("merger.norm.bias");
    w.merger_fc1 = mat("merger.linear_fc1");
    w.merger_fc1_b = vec("merger.linear_fc1.bias");
    w.merger_fc2 = mat("merger.linear_fc2");
    w.merger_fc2_b = vec("merger.linear_fc2.bias");
    return w;
}

nb::object vision_encode(PyVision& v, In<float, 2> pixels, In<int64_t, 2> grid) {
    const cpu::VisionDims& d = v.tower->dims();
    if (grid.shape(1) != 3) throw std::invalid_argument("vision tower: grid_thw must be [n_images, 3]");
    if (int64_t(pixels.shape(1)) != d.patch_dim())
        throw std::invalid_argument("vision tower: pixel_values must be [n_patches, " + std::to_string(d.patch_dim()) +
                                    "]");
    const int64_t n = int64_t(pixels.shape(0)), n_images = int64_t(grid.shape(0));
    const int64_t n_merged = v.tower->check(n, grid.data(), n_images);
    auto out = bindings::new_array({size_t(n_merged), size_t(d.out_hidden)});
    {
        nb::gil_scoped_release release;
        if (v.engine.is_none()) {
            std::lock_guard<std::mutex> lock(v.mu);
            v.tower->encode(*v.pool, pixels.data(), n, grid.data(), n_images, out.data());
        } else {
            // the engine's lock also serialises encodes: the tower's scratch is used by one call at a time
            bindings::PyEngine* pe = nb::inst_ptr<bindings::PyEngine>(v.engine);
            pe->engine->exclusive(
                [&](ThreadPool& pool) { v.tower->encode(pool, pixels.data(), n, grid.data(), n_images, out.data()); });
        }
    }
    return nb::cast(out);
}

}  // namespace

namespace qwenmetal::bindings {

void register_vision(nb::module_& m) {
    nb::class_<PyVision>(m, "CpuVisionTower",
                         "The vision tower on the cpu engine (src/cpu/vision.h): Qwen3.5/3.6's ViT over the "
                         "checkpoint's weights, read in place.")
        .def("__init__",
             [](PyVision* self, nb::dict config, nb::dict linear, nb::dict small, nb::object engine, int threads,
                nb::object keepalive) {
                 const cpu::VisionDims d = parse_vision_dims(config);
                 auto tower = std::make_unique<cpu::VisionTower>(d, parse_weights(d, linear, small));
                 std::unique_ptr<ThreadPool> pool;
                 if (engine.is_none()) {
                     if (threads < 1) throw std::invalid_argument("vision tower: threads must be >= 1");
                     pool = std::make_unique<ThreadPool>(threads);
                 } else {
                     (void)nb::cast<PyEngine&>(engine);   // a CpuEngine, or a TypeError here
                 }
                 new (self) PyVision{std::move(tower), std::move(pool), {}, engine, keepalive};
             },
             "config"_a, "linear"_a, "small"_a, "engine"_a = nb::none(), "threads"_a = 1, "keepalive"_a = nb::none())
        .def("encode", &vision_encode, "pixel_values"_a, "grid_thw"_a,
             "pixel_values [n_patches, C*T*P*P] float32, grid_thw [n_images, 3] int64 -> [n_merged, out_hidden] "
             "float32. Bad shapes raise ValueError before anything runs. The GIL is released.")
        .def_prop_ro("weight_nbytes", [](PyVision& v) { return v.tower->weight_bytes(); },
                     "bytes of the linear weights it reads in place")
        .def_prop_ro("threads", [](PyVision& v) {
            return v.engine.is_none() ? v.pool->size() : -1;
        }, "its own pool's threads (-1: it runs on a CpuEngine's)");
}

}  // namespace qwenmetal::bindings

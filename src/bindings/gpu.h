// Shared by the gpu binding files (gpu.cpp, gpu_ops_<family>.cpp, gpu_graph.cpp).
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <memory>
#include <string>

#include "gpu/device.h"
#include "gpu/encoder.h"
#include "gpu/ops/common.h"

namespace qwenmetal::gpu {
class GpuModel;
class GpuEngine;
struct StepCost;
}  // namespace qwenmetal::gpu

namespace qwenmetal::bindings {

// the Python gpu.GpuEngine (gpu_graph.cpp); a DFlash draft over it (gpu_dflash.cpp) holds the object
struct PyGpuEngine {
    std::shared_ptr<gpu::GpuModel> model;
    std::unique_ptr<gpu::GpuEngine> engine;
    nanobind::object keepalive;     // the numpy arrays (mmap views) the mappings point into
};

// a StepCost as a dict (gpu_graph.cpp); level_bytes / level_flops: u64 arrays, one entry per dependency level
nanobind::dict cost_dict(const gpu::StepCost& c);

// a device buffer over a numpy array's memory, keeping the array alive
gpu::Buffer wrap_array(gpu::Device& dev, nanobind::ndarray<nanobind::c_contig, nanobind::device::cpu> a,
                       const std::string& label);

// one registration function per kernel family (src/bindings/gpu_ops_<family>.cpp)
void register_gpu_ops_norm(nanobind::module_& ops);
void register_gpu_ops_quant(nanobind::module_& ops);
void register_gpu_ops_gdn(nanobind::module_& ops);
void register_gpu_ops_attention(nanobind::module_& ops);
void register_gpu_ops_moe(nanobind::module_& ops);
void register_gpu_ops_sample(nanobind::module_& ops);
void register_gpu_ops_gemm(nanobind::module_& ops);
void register_gpu_ops_vision(nanobind::module_& ops);
#ifdef __APPLE__
void register_metal_device(nanobind::module_& g);   // src/bindings/gpu_metal.cpp
#endif
// the decode graph and the metal-sim backend's engine (gpu_graph.cpp)
void register_gpu_graph(nanobind::module_& g);
// a DFlash draft on the graph (gpu_dflash.cpp): GpuDFlashDraft, GpuDFlashCache
void register_gpu_dflash(nanobind::module_& g);
// the vision tower on the graph (gpu_vision.cpp): GpuVisionTower
void register_gpu_vision(nanobind::module_& g);

}  // namespace qwenmetal::bindings

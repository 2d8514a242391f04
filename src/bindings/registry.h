// Each part of qwenmetal._core registers its functions and classes from its own file.
#pragma once
#include <nanobind/nanobind.h>

namespace qwenmetal::bindings {
void register_quant(nanobind::module_& m);   // quant.cpp: affine dequantizer, build facts
void register_cpu_engine(nanobind::module_& m);   // cpu_engine.cpp: CpuEngine, CpuState, kernel test hooks
void register_msl_sim(nanobind::module_& m);   // msl_sim.cpp: the Metal-on-CPU simulator (submodule msl_sim)
void register_gpu(nanobind::module_& m);   // gpu*.cpp: device interface, SimDevice, host ops, decode graph
void register_bench(nanobind::module_& m);   // bench.cpp: memory read-bandwidth kernel for `qwenmetal bench`
void register_expert_cache(nanobind::module_& m);
void register_vision(nanobind::module_& m);   // vision.cpp: the vision tower on the cpu engine (CpuVisionTower)
void register_dflash(nanobind::module_& m);   // dflash.cpp: a DFlash draft on the cpu engine (CpuDFlashDraft)   // expert_cache.cpp: ExpertCache (slots of streamed experts)
}  // namespace qwenmetal::bindings

// Each part of qwenmetal._core registers its functions and classes from its own file.
#pragma once
#include <nanobind/nanobind.h>

namespace qwenmetal::bindings {
void register_quant(nanobind::module_& m);   // quant.cpp: affine dequantizer, build facts
}  // namespace qwenmetal::bindings

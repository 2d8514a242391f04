// qwenmetal._core.gpu.MetalDevice: the Metal device (src/metal/device.h) for Python. Compiled on Apple
// only (elsewhere this file is empty); type-checked on Linux by tools/metal_device_check.py with
// -DQWENMETAL_CHECK_METAL_BINDINGS. register_gpu (gpu.cpp) calls register_metal_device(g) after the
// Device base class is registered.
#if defined(__APPLE__) || defined(QWENMETAL_CHECK_METAL_BINDINGS)
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu/device.h"
#include "metal/device.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace qwenmetal::bindings {

void register_metal_device(nb::module_& g);

static nb::dict report_dict(const gpu::MetalLibraryReport& r) {
    nb::dict d;
    d["family"] = r.family;
    d["origin"] = r.origin;
    d["ok"] = r.ok;
    d["log"] = r.log;
    d["seconds"] = r.seconds;
    d["pipeline_seconds"] = r.pipeline_seconds;
    d["pipelines"] = r.pipelines;
    d["language_version"] = r.language_version;
    d["kernels"] = r.kernels;
    return d;
}

void register_metal_device(nb::module_& g) {
    using gpu::MetalDevice;
    nb::class_<MetalDevice, gpu::Device>(g, "MetalDevice",
                                         "The system's Metal GPU (src/metal/device.h); hardware-unverified until "
                                         "run on a Mac (docs/mac-first-run.md).")
        .def("__init__",
             [](MetalDevice* self, bool fast_math) {
                 gpu::MetalOptions o;
                 o.fast_math = fast_math;
                 new (self) MetalDevice(o);
             },
             "fast_math"_a = false)
        .def("compile_all",
             [](MetalDevice& d) {
                 std::vector<gpu::MetalLibraryReport> reports;
                 {
                     nb::gil_scoped_release nogil;
                     reports = d.compile_all();
                 }
                 nb::list out;
                 for (const auto& r : reports) out.append(report_dict(r));
                 return out;
             },
             "Compile every embedded kernel family this GPU runs and all their pipelines now, in parallel; one dict per "
             "family {family, origin, ok, log, seconds, pipeline_seconds, pipelines, language_version, kernels}. "
             "Never raises for a compile error.")
        .def("add_source",
             [](MetalDevice& d, const std::string& name, const std::string& source) {
                 gpu::MetalLibraryReport r;
                 {
                     nb::gil_scoped_release nogil;
                     r = d.add_source(name, source);
                 }
                 return report_dict(r);
             },
             "name"_a, "source"_a, "Compile extra MSL as a library; its kernels are then dispatchable by name.")
        .def("kernel_names", &MetalDevice::kernel_names)
        .def(
            "wrap_checked",
            [](MetalDevice& d, nb::ndarray<nb::c_contig, nb::device::cpu> a, const std::string& label) {
                nb::object owner = nb::find(a);
                auto* held = new nb::object(owner);
                std::shared_ptr<void> keep(held, [](void* p) {
                    nb::gil_scoped_acquire acquire;
                    delete static_cast<nb::object*>(p);
                });
                bool copied = false;
                gpu::Buffer b = d.wrap(a.data(), a.nbytes(), label, std::move(keep), &copied);
                return nb::make_tuple(b, copied);
            },
            "array"_a, "label"_a = "",
            "(buffer, copied): Device.wrap, and whether the array was copied (False: the GPU uses its memory).")
        .def_static("embedded_families", &MetalDevice::embedded_families)
        .def_static("embedded_source", &MetalDevice::embedded_source, "family"_a,
                    "The flattened MSL of one family, as compiled by newLibraryWithSource: (for `xcrun metal`).");
}

}  // namespace qwenmetal::bindings
#endif

// qwenmetal._core.msl_sim: the Metal-on-CPU simulator runtime (src/msl_sim/) for Python.
// The Python face is qwenmetal/sim.py; this module is its thin layer.
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "bindings/registry.h"
#include "bindings/sim_counters.h"
#include "msl_sim/runtime.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

nb::dict record_dict(const msl::DispatchRecord& r) {
    nb::dict d;
    d["kernel"] = r.kernel;
    d["level"] = r.level;
    d["threadgroups"] = nb::make_tuple(r.groups[0], r.groups[1], r.groups[2]);
    d["threads_per_threadgroup"] = nb::make_tuple(r.threads_per_group[0], r.threads_per_group[1], r.threads_per_group[2]);
    d["threads"] = r.threads;
    if (r.tg_memory >= 0) d["threadgroup_memory"] = r.tg_memory;
    else d["threadgroup_memory"] = nb::none();
    nb::list bufs;
    for (const msl::BufferRecord& b : r.buffers) {
        nb::dict e;
        e["index"] = b.index;
        e["nbytes"] = b.size;
        e["read"] = b.read >= 0 ? nb::object(nb::int_(b.read)) : nb::none();
        e["written"] = b.written >= 0 ? nb::object(nb::int_(b.written)) : nb::none();
        e["params"] = b.is_params;
        bufs.append(e);
    }
    d["buffers"] = bufs;
    d["bytes_read"] = r.bytes_read;
    d["bytes_written"] = r.bytes_written;
    d["executed"] = r.executed;
    if (r.executed) {
        d["simd_ops"] = r.simd_ops;
        d["barriers"] = r.barriers;
        d["seconds"] = r.seconds;
        if (r.banks_counted) d["banks"] = qwenmetal::bindings::bank_dict(r.banks);
    }
    return d;
}

// bindings: a list with one entry per buffer index: None (unbound), or a tuple
// (ptr:int | bytes, nbytes:int, addr:int, read:int, written:int); a bytes object is a setBytes blob.
std::vector<msl::Binding> parse_bindings(const nb::list& lst, std::vector<std::string>& keep) {
    std::vector<msl::Binding> out;
    for (nb::handle h : lst) {
        msl::Binding b;
        if (h.is_none()) {
            out.push_back(b);
            continue;
        }
        nb::tuple t = nb::cast<nb::tuple>(h);
        if (t.size() != 5) throw msl::SimError("msl_sim: a binding is (ptr or bytes, nbytes, addr, read, written)");
        if (nb::isinstance<nb::bytes>(t[0])) {
            nb::bytes by = nb::cast<nb::bytes>(t[0]);
            keep.emplace_back(by.c_str(), by.size());
            b.ptr = keep.back().empty() ? nullptr : &keep.back()[0];
            b.size = keep.back().size();
            b.is_params = true;
        } else {
            b.ptr = reinterpret_cast<void*>(nb::cast<uintptr_t>(t[0]));
            b.size = nb::cast<uint64_t>(t[1]);
        }
        b.addr = nb::cast<uint64_t>(t[2]);
        b.read = nb::cast<int64_t>(t[3]);
        b.written = nb::cast<int64_t>(t[4]);
        b.bound = true;
        out.push_back(b);
    }
    return out;
}

}  // namespace

namespace qwenmetal::bindings {

void register_msl_sim(nb::module_& m) {
    nb::module_ s = m.def_submodule("msl_sim", "Metal-on-CPU simulator runtime (see qwenmetal.sim)");
    nb::exception<msl::SimError>(s, "MetalSimError", PyExc_RuntimeError);

    nb::class_<msl::Library>(s, "Library")
        .def_prop_ro("origin", &msl::Library::origin)
        .def_prop_ro("compiler", &msl::Library::compiler)
        .def("kernels",
             [](const msl::Library& lib) {
                 nb::list out;
                 for (const msl::KernelInfo* k : lib.kernels()) {
                     nb::dict d;
                     d["name"] = k->name;
                     d["file"] = k->file ? k->file : "";
                     d["line"] = k->line;
                     d["checked"] = bool(k->checked);
                     out.append(d);
                 }
                 return out;
             })
        .def("observed_threadgroup_memory", &msl::Library::observed_tg_memory, "kernel"_a);

    s.def("builtin_library", &msl::Library::builtin, "The kernels linked into _core at build time.");
    s.def("load_library", &msl::Library::load, "path"_a, "Load a kernel plugin .so built by qwenmetal.sim.compile.");

    nb::class_<msl::CommandBuffer>(s, "CommandBuffer")
        .def(nb::init<bool, bool>(), "execute"_a = true, "concurrent"_a = true)
        .def(
            "dispatch",
            [](msl::CommandBuffer& cb, msl::Library& lib, const std::string& kernel, std::array<uint32_t, 3> groups,
               std::array<uint32_t, 3> threads, nb::list bindings, const std::string& schedule, uint64_t seed, int workers,
               std::vector<uint32_t> tg_memory, bool count_banks) {
                std::vector<std::string> keep;
                keep.reserve(bindings.size());
                std::vector<msl::Binding> b = parse_bindings(bindings, keep);
                msl::DispatchOptions opt;
                opt.schedule = msl::parse_schedule(schedule);
                opt.seed = seed;
                opt.workers = workers;
                opt.tg_memory = std::move(tg_memory);
                opt.count_banks = count_banks;
                const msl::DispatchRecord* rec;
                {
                    nb::gil_scoped_release release;
                    rec = &cb.dispatch(lib, kernel, groups.data(), threads.data(), std::move(b), opt);
                }
                return record_dict(*rec);
            },
            "library"_a, "kernel"_a, "threadgroups"_a, "threads_per_threadgroup"_a, "bindings"_a, "schedule"_a = "forward",
            "seed"_a = 0, "workers"_a = 0, "threadgroup_memory"_a = std::vector<uint32_t>(), "count_banks"_a = false)
        .def("barrier", &msl::CommandBuffer::barrier)
        .def_prop_ro("level", &msl::CommandBuffer::level)
        .def_prop_ro("executes", &msl::CommandBuffer::executes)
        .def_prop_ro("concurrent", &msl::CommandBuffer::concurrent)
        .def("records", [](const msl::CommandBuffer& cb) {
            nb::list out;
            for (const msl::DispatchRecord& r : cb.records()) out.append(record_dict(r));
            return out;
        });

    s.def("info", []() {
        nb::dict d;
        d["abi_version"] = msl::kAbiVersion;
        d["fiber_switch"] = msl::fiber_switch_name();
        d["simd_width"] = msl::kSimdWidth;
        d["max_threads_per_threadgroup"] = msl::kMaxThreadsPerGroup;
        d["max_threadgroup_memory"] = msl::kMaxThreadgroupMemory;
        return d;
    });
}

}  // namespace qwenmetal::bindings

// qwenmetal._core.gpu: the GPU device interface (src/gpu/device.h) and the host op functions
// (src/gpu/ops/) for Python, so that tests drive every kernel through the function that owns it.
// Families register their ops in src/bindings/gpu_ops_<family>.cpp (submodule gpu.ops).
#include "bindings/gpu.h"

#include <nanobind/stl/function.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "bindings/registry.h"
#include "bindings/sim_counters.h"
#include "gpu/windows.h"
#include "msl_sim/sim_device.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace qwenmetal::bindings {

using namespace qwenmetal::gpu;

gpu::Buffer wrap_array(Device& dev, nb::ndarray<nb::c_contig, nb::device::cpu> a, const std::string& label) {
    // keep the numpy array alive as long as the device buffer lives (its deleter takes the GIL)
    nb::object owner = nb::find(a);
    auto* held = new nb::object(owner);
    std::shared_ptr<void> keep(held, [](void* p) {
        nb::gil_scoped_acquire g;
        delete static_cast<nb::object*>(p);
    });
    return dev.wrap(a.data(), a.nbytes(), label, std::move(keep));
}

static msl::Schedule schedule_of(const std::string& s) {
    try {
        return msl::parse_schedule(s);
    } catch (const std::exception& e) {
        throw std::invalid_argument(e.what());
    }
}

void register_gpu(nb::module_& m) {
    nb::module_ g = m.def_submodule("gpu", "GPU device interface (simulator-verified, hardware-unverified)");
    nb::exception<DeviceError>(g, "DeviceError", PyExc_RuntimeError);
    g.def("slowest_chip", [] {
        nb::dict d;
        d["name"] = kSlowestChip.name;
        d["bandwidth_gbs"] = kSlowestChip.bandwidth_gbs;
        d["peak_tflops"] = kSlowestChip.peak_tflops;
        d["level_latency_s"] = kSlowestChip.level_latency_s;
        d["watchdog_seconds"] = kWatchdogBudgetSeconds;
        d["command_buffer_seconds"] = kCommandBufferTargetSeconds;
        return d;
    }, "the GPU time model of src/gpu/cost.h: the slowest supported Apple GPU and the command-buffer budgets");
    g.def("plan_windows", [](uint64_t bytes, uint64_t max_len, uint64_t max_view, uint64_t page) {
        std::vector<std::pair<uint64_t, uint64_t>> out;
        for (const Window& w : plan_windows(bytes, max_len, max_view, page)) out.emplace_back(w.start, w.length);
        return out;
    }, "bytes"_a, "max_len"_a, "max_view"_a, "page"_a = 16384,
       "[(start, length)]: the overlapping buffers MetalDevice.wrap maps a range past maxBufferLength as "
       "(src/gpu/windows.h)");
    g.def("window_of", [](const std::vector<std::pair<uint64_t, uint64_t>>& w, uint64_t offset, uint64_t length) {
        std::vector<Window> ws;
        for (const auto& [s, n] : w) ws.push_back(Window{s, n});
        const size_t i = window_of(ws, offset, length);
        return i == SIZE_MAX ? -1 : int64_t(i);
    }, "windows"_a, "offset"_a, "length"_a, "the window that holds [offset, offset + length) whole, or -1");

    nb::class_<gpu::Buffer>(g, "Buffer")
        .def_prop_ro("nbytes", [](const gpu::Buffer& b) { return b.length; })
        .def_prop_ro("offset", [](const gpu::Buffer& b) { return b.offset; })
        .def_prop_ro("address", &gpu::Buffer::address)
        .def_prop_ro("label", [](const gpu::Buffer& b) { return b.alloc ? b.alloc->label() : std::string(); })
        .def("view", &gpu::Buffer::view, "offset"_a, "nbytes"_a = 0)
        .def("to_bytes",
             [](const gpu::Buffer& b) {
                 if (!b.data()) throw std::invalid_argument("gpu.Buffer.to_bytes: a virtual buffer has no contents");
                 return nb::bytes(static_cast<const char*>(b.data()), b.length);
             })
        .def("write", [](const gpu::Buffer& b, nb::bytes data, uint64_t offset) {
            if (!b.data()) throw std::invalid_argument("gpu.Buffer.write: a virtual buffer has no contents");
            if (offset + data.size() > b.length) throw std::invalid_argument("gpu.Buffer.write: past the end");
            std::memcpy(static_cast<uint8_t*>(b.data()) + offset, data.c_str(), data.size());
        }, "data"_a, "offset"_a = 0)
        .def("__repr__", [](const gpu::Buffer& b) {
            return "gpu.Buffer(" + (b.alloc ? b.alloc->label() : std::string("unset")) + ", offset=" +
                   std::to_string(b.offset) + ", nbytes=" + std::to_string(b.length) + ")";
        });

    nb::class_<gpu::CommandBuffer>(g, "CommandBuffer")
        .def("barrier", &gpu::CommandBuffer::barrier)
        .def("commit", [](gpu::CommandBuffer& cb) { cb.commit(); })
        .def("wait", &gpu::CommandBuffer::wait, nb::call_guard<nb::gil_scoped_release>())
        .def_prop_ro("completed", &gpu::CommandBuffer::completed);

    nb::class_<Encoder>(g, "Encoder")
        .def(nb::init<Device&, gpu::CommandBuffer&>(), "device"_a, "command_buffer"_a, nb::keep_alive<1, 2>(),
             nb::keep_alive<1, 3>())
        .def("barrier", &Encoder::barrier)
        .def_prop_ro("dispatches", [](const Encoder& e) { return e.stats().dispatches; })
        .def_prop_ro("levels", [](const Encoder& e) { return e.stats().levels; })
        .def_prop_ro("bytes_read", [](const Encoder& e) { return e.stats().bytes_read; })
        .def_prop_ro("bytes_written", [](const Encoder& e) { return e.stats().bytes_written; })
        .def_prop_ro("flops", [](const Encoder& e) { return e.stats().flops; });

    nb::class_<Device>(g, "Device")
        .def_prop_ro("info", [](const Device& d) {
            const DeviceInfo& i = d.info();
            nb::dict r;
            r["name"] = i.name;
            r["family"] = i.family;
            r["max_buffer_length"] = i.max_buffer_length;
            r["max_threads_per_threadgroup"] = i.max_threads_per_threadgroup;
            r["max_threadgroup_memory"] = i.max_threadgroup_memory;
            r["simd_reductions"] = i.simd_reductions;
            r["simdgroup_matrix"] = i.simdgroup_matrix;
            r["tensor_ops"] = i.tensor_ops;
            r["executes"] = i.executes;
            r["working_set"] = i.working_set;
            return r;
        })
        .def("alloc", &Device::alloc, "nbytes"_a, "label"_a = "")
        .def("wrap", &wrap_array, "array"_a, "label"_a = "",
             "A buffer over the array's memory (no copy where the device allows); keeps the array alive.")
        .def("command_buffer", &Device::command_buffer)
        .def("has_kernel", &Device::has_kernel)
        .def("prepare", &Device::prepare)
        .def("max_threads", &Device::max_threads, "kernel"_a,
             "the pipeline's maxTotalThreadsPerThreadgroup (host functions size threadgroups from it)")
        .def("recover", &Device::recover, nb::call_guard<nb::gil_scoped_release>(),
             "a new command queue after a failed command buffer (nothing may be in flight)")
        .def("counters", [](const Device& d) {
            const Counters c = d.counters();
            nb::dict r;
            r["command_buffers"] = c.command_buffers;
            r["host_waits"] = c.host_waits;
            r["dispatches"] = c.dispatches;
            r["barriers"] = c.barriers;
            return r;
        })
        .def("reset_counters", &Device::reset_counters)
        .def(
            "dispatch",
            [](Device&, gpu::CommandBuffer& cb, const std::string& kernel, const std::vector<uint32_t>& groups,
               const std::vector<uint32_t>& threads, nb::list args, const std::vector<uint32_t>& tg_memory) {
                auto dims = [](const std::vector<uint32_t>& v, const char* what) {
                    if (v.empty() || v.size() > 3) throw std::invalid_argument(std::string(what) + ": 1 to 3 sizes");
                    Dims d;
                    d.x = v[0];
                    if (v.size() > 1) d.y = v[1];
                    if (v.size() > 2) d.z = v[2];
                    return d;
                };
                std::vector<Arg> a;
                for (nb::handle h : args) {
                    if (nb::isinstance<nb::bytes>(h)) {
                        nb::bytes b = nb::borrow<nb::bytes>(h);
                        Arg p;
                        p.kind = Arg::kBytes;
                        p.bytes.assign(reinterpret_cast<const uint8_t*>(b.c_str()),
                                       reinterpret_cast<const uint8_t*>(b.c_str()) + b.size());
                        a.push_back(std::move(p));
                    } else {
                        a.push_back(Arg::inout(nb::cast<gpu::Buffer>(h)));
                    }
                }
                cb.dispatch(kernel, dims(groups, "threadgroups"), dims(threads, "threads_per_threadgroup"), a,
                            tg_memory);
            },
            "command_buffer"_a, "kernel"_a, "threadgroups"_a, "threads_per_threadgroup"_a, "args"_a,
            "tg_memory"_a = std::vector<uint32_t>(),
            "Encode one dispatch directly (tests): args bind [[buffer(0..)]] in order, bytes by setBytes, "
            "buffers as read-write; tg_memory: [[threadgroup(i)]] lengths.");

    nb::class_<SimDevice, Device>(g, "SimDevice")
        .def("__init__", [](SimDevice* self, bool execute, const std::string& schedule, uint64_t seed, int workers,
                            bool keep_records, bool tensor_ops, uint32_t pipeline_max_threads, uint64_t working_set,
                            double watchdog_seconds, bool count_banks) {
            SimOptions o;
            o.execute = execute;
            o.schedule = schedule_of(schedule);
            o.seed = seed;
            o.workers = workers;
            o.keep_records = keep_records;
            o.tensor_ops = tensor_ops;
            o.pipeline_max_threads = pipeline_max_threads;
            o.working_set = working_set;
            o.watchdog_seconds = watchdog_seconds;
            o.count_banks = count_banks;
            new (self) SimDevice(o);
        }, "execute"_a = true, "schedule"_a = "forward", "seed"_a = 0, "workers"_a = 0, "keep_records"_a = false,
             "tensor_ops"_a = false, "pipeline_max_threads"_a = 1024, "working_set"_a = 0,
             "watchdog_seconds"_a = kWatchdogBudgetSeconds, "count_banks"_a = false)
        .def("inject_fault", [](SimDevice& d, uint32_t after, const std::string& kind) {
            if (kind != "error" && kind != "timeout")
                throw std::invalid_argument("SimDevice.inject_fault: kind must be 'error' or 'timeout', got '" + kind + "'");
            d.inject_fault(after, kind == "timeout" ? Fault::timeout : Fault::error);
        }, "after"_a = 0, "kind"_a = "error",
             "the after-th command buffer committed from now on (0: the next) fails part-way, as a GPU fault would")
        .def_prop_ro("max_command_buffer_seconds", &SimDevice::max_command_buffer_seconds,
                     "the longest modelled GPU time (slowest supported GPU) of a command buffer since reset_counters()")
        .def_prop_ro("faults", &SimDevice::faults)
        .def_prop_ro("allocated_bytes", &SimDevice::allocated_bytes,
                     "bytes of every alloc() so far (not wrap()): scratch, state and KV cache")
        .def_prop_ro("wrapped_bytes", &SimDevice::wrapped_bytes,
                     "bytes of every wrap() so far: the weights' file mappings as device buffers")
        .def_prop_ro("faulted", &SimDevice::faulted,
                     "a command buffer failed and recover() was not called since: later ones are ignored")
        .def("records", [](const SimDevice& d) {
            nb::list out;
            for (const msl::DispatchRecord& r : d.records()) {
                nb::dict e;
                e["kernel"] = r.kernel;
                e["level"] = r.level;
                e["threadgroups"] = nb::make_tuple(r.groups[0], r.groups[1], r.groups[2]);
                e["threads_per_threadgroup"] =
                    nb::make_tuple(r.threads_per_group[0], r.threads_per_group[1], r.threads_per_group[2]);
                e["bytes_read"] = r.bytes_read;
                e["bytes_written"] = r.bytes_written;
                e["threadgroup_memory"] = r.tg_memory;
                e["barriers"] = r.barriers;
                e["simd_ops"] = r.simd_ops;
                e["flops"] = r.flops;
                e["command_buffer"] = r.command_buffer;
                if (r.banks_counted) e["banks"] = bank_dict(r.banks);
                out.append(e);
            }
            return out;
        })
        .def("kernel_stats", [](const SimDevice& d) {
            nb::dict out;
            for (const auto& [name, k] : d.kernel_stats()) {
                nb::dict e;
                e["dispatches"] = k.dispatches;
                e["threadgroups"] = k.threadgroups;
                e["threads_per_threadgroup"] = k.max_threads_per_group;
                e["min_threads_per_threadgroup"] = k.min_threads_per_group;
                e["threadgroup_memory"] = k.tg_memory >= 0 ? nb::object(nb::int_(k.tg_memory)) : nb::none();
                e["bytes"] = k.bytes;
                e["flops"] = k.flops;
                e["counted_dispatches"] = k.executed;
                e["banks"] = k.executed ? nb::object(bank_dict(k.banks)) : nb::none();
                out[name.c_str()] = e;
            }
            return out;
        }, "per pipeline since the device was made or reset_kernel_stats(): dispatches, threadgroups, threads per "
           "threadgroup (largest), threadgroup memory (bytes, None when unknown), declared bytes and FLOPs, and "
           "(count_banks) the threadgroup-memory bank conflicts")
        .def("reset_kernel_stats", &SimDevice::reset_kernel_stats);

#ifdef __APPLE__
    register_metal_device(g);
#endif

    nb::module_ ops = g.def_submodule("ops", "host functions of the Metal kernels, one per kernel");
    register_gpu_ops_norm(ops);
    register_gpu_ops_quant(ops);
    register_gpu_ops_gdn(ops);
    register_gpu_ops_attention(ops);
    register_gpu_ops_moe(ops);
    register_gpu_ops_sample(ops);
    register_gpu_ops_gemm(ops);
    register_gpu_ops_vision(ops);
    register_gpu_graph(g);
    register_gpu_dflash(g);
    register_gpu_vision(g);
}

}  // namespace qwenmetal::bindings

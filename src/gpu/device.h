// The GPU device interface: what the Metal host graph (src/gpu/) needs from a device, in pure C++.
// Two implementations: MetalDevice (src/metal/device.mm, Apple only, a thin layer over
// MTLDevice / MTLBuffer / MTLComputePipelineState / MTLCommandBuffer) and SimDevice
// (src/msl_sim/sim_device.h: the same kernels executed by the Metal-on-CPU simulator, or only
// encoded and costed). Nothing above this header knows which one runs.
//
//   Allocation     one device buffer (MTLBuffer with shared storage, or simulator memory)
//   Buffer         (allocation, offset, length): what a kernel argument binds
//   CommandBuffer  one MTLCommandBuffer with one concurrent compute encoder: dispatches in
//                  threadgroups, memory barriers (dependency levels), commit, wait, completion
//   Device         buffers (fresh, or wrapping host memory without a copy), command buffers,
//                  pipelines by kernel name, counters
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace qwenmetal::gpu {

// A device-side failure (kernel compile error, command buffer error, simulator check).
class DeviceError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

class Allocation {
  public:
    virtual ~Allocation() = default;
    // Host-visible memory (shared storage); nullptr for a virtual (encode-only) buffer.
    virtual void* contents() const = 0;
    virtual uint64_t length() const = 0;
    // A stable identity of the first byte (GPU address, host address, or a virtual address):
    // two buffers overlap iff their [address + offset, + length) ranges do.
    virtual uint64_t address() const = 0;
    virtual const std::string& label() const = 0;
};

struct Buffer {
    std::shared_ptr<Allocation> alloc;
    uint64_t offset = 0, length = 0;

    bool valid() const { return alloc != nullptr; }
    // host pointer of the first byte (nullptr for virtual buffers)
    void* data() const {
        void* p = alloc ? alloc->contents() : nullptr;
        return p ? static_cast<uint8_t*>(p) + offset : nullptr;
    }
    template <class T>
    T* as() const { return static_cast<T*>(data()); }
    uint64_t address() const { return alloc ? alloc->address() + offset : 0; }
    // a sub-range [off, off + len) of this view (len 0: to the end)
    Buffer view(uint64_t off, uint64_t len = 0) const {
        if (off > length || (len && off + len > length))
            throw std::out_of_range("gpu::Buffer::view: [" + std::to_string(off) + ", +" + std::to_string(len) +
                                    ") outside a " + std::to_string(length) + "-byte buffer");
        return Buffer{alloc, offset + off, len ? len : length - off};
    }
};

struct Dims {
    uint32_t x = 1, y = 1, z = 1;
};

// One kernel argument, bound at [[buffer(index)]] in the order given (params first, then inputs,
// then outputs). `read`/`written` declare the byte counts of the range the kernel touches (for
// costing; the hazard range is the whole view).
struct Arg {
    enum Kind : uint8_t { kBytes, kIn, kOut, kInOut };
    Kind kind = kIn;
    Buffer buf;                       // kIn / kOut / kInOut
    std::vector<uint8_t> bytes;       // kBytes: setBytes (the params struct)
    uint64_t read = 0, written = 0;

    template <class P>
    static Arg params(const P& p) {
        Arg a;
        a.kind = kBytes;
        a.bytes.assign(reinterpret_cast<const uint8_t*>(&p), reinterpret_cast<const uint8_t*>(&p) + sizeof(P));
        return a;
    }
    static Arg in(const Buffer& b, uint64_t bytes_read = UINT64_MAX) {
        return Arg{kIn, b, {}, bytes_read == UINT64_MAX ? b.length : bytes_read, 0};
    }
    static Arg out(const Buffer& b, uint64_t bytes_written = UINT64_MAX) {
        return Arg{kOut, b, {}, 0, bytes_written == UINT64_MAX ? b.length : bytes_written};
    }
    static Arg inout(const Buffer& b, uint64_t bytes_read = UINT64_MAX, uint64_t bytes_written = UINT64_MAX) {
        return Arg{kInOut, b, {}, bytes_read == UINT64_MAX ? b.length : bytes_read,
                   bytes_written == UINT64_MAX ? b.length : bytes_written};
    }
    bool reads() const { return kind == kIn || kind == kInOut; }
    bool writes() const { return kind == kOut || kind == kInOut; }
};

class CommandBuffer {
  public:
    virtual ~CommandBuffer() = default;
    // dispatchThreadgroups on the concurrent compute encoder; args bind [[buffer(0..)]] in order;
    // tg_memory: [[threadgroup(i)]] lengths (setThreadgroupMemoryLength); flops: the arithmetic the host
    // function declares (a multiply-add = 2), for devices that model GPU time (SimDevice's watchdog check)
    virtual void dispatch(const std::string& kernel, Dims groups, Dims threads, const std::vector<Arg>& args,
                          const std::vector<uint32_t>& tg_memory = {}, uint64_t flops = 0) = 0;
    // memoryBarrierWithScope:MTLBarrierScopeBuffers: later dispatches see earlier writes
    virtual void barrier() = 0;
    // endEncoding + commit; `on_complete` runs once the GPU is done (addCompletedHandler)
    virtual void commit(std::function<void()> on_complete = nullptr) = 0;
    // waitUntilCompleted; throws DeviceError with the command buffer's error if it failed
    virtual void wait() = 0;
    virtual bool completed() const = 0;
};

struct DeviceInfo {
    std::string name;                 // "Apple M3 Max", "msl_sim (forward schedule)", ...
    std::string family;               // "apple9", "simulator", ...
    uint64_t max_buffer_length = 0;
    uint32_t max_threads_per_threadgroup = 1024;
    uint32_t max_threadgroup_memory = 32768;
    bool simd_reductions = true;      // simd_sum / shuffles (missing on paravirtual GPUs)
    bool simdgroup_matrix = true;
    bool tensor_ops = false;          // Metal 4 tensor operations (MetalPerformancePrimitives matmul2d): M5, apple10
    bool unified_memory = true;
    bool executes = true;             // false: encode-only (virtual buffers, nothing runs)
    // recommendedMaxWorkingSetSize: the bytes of buffers the GPU can keep resident without paging
    // (about 2/3 to 3/4 of a Mac's memory); 0 when unknown / unlimited
    uint64_t working_set = 0;
};

// What the caller knows of a wrapped range (Device::wrap).
struct WrapHints {
    // the GPU only reads it (weights): Metal then need not track hazards on it (an untracked buffer) and the
    // device keeps it resident (MTLResidencySet)
    bool read_only = false;
    // the largest view ever bound from it (the largest tensor of a weights file): a range over the device's
    // maximum buffer length is mapped as overlapping buffers that each such view fits in whole
    uint64_t max_view = 0;
};

// "N dispatches of k1, k2, ..." for an error message about a command buffer (kernels: distinct names in
// encoding order)
inline std::string describe_kernels(uint64_t dispatches, const std::vector<std::string>& kernels) {
    if (kernels.empty()) return "no dispatches";
    std::string s = std::to_string(dispatches) + " dispatches of ";
    for (size_t i = 0; i < kernels.size() && i < 12; ++i) s += (i ? ", " : "") + kernels[i];
    if (kernels.size() > 12) s += ", ... (" + std::to_string(kernels.size()) + " kernels)";
    return s;
}

// What a device counted since it was made (or reset_counters()).
struct Counters {
    uint64_t command_buffers = 0;     // committed
    uint64_t host_waits = 0;          // wait() calls: the host blocking on the GPU
    uint64_t dispatches = 0;
    uint64_t barriers = 0;            // dependency levels closed
};

class Device {
  public:
    virtual ~Device() = default;
    virtual const DeviceInfo& info() const = 0;
    // a zero-filled buffer (shared storage)
    virtual Buffer alloc(uint64_t bytes, const std::string& label) = 0;
    // host memory used in place where the device allows (newBufferWithBytesNoCopy over its pages; a range
    // past the maximum buffer length as overlapping buffers, gpu/windows.h), else copied once; `keep` is held
    // as long as the buffer lives. `copied` (if given) tells which happened.
    virtual Buffer wrap(const void* ptr, uint64_t bytes, const std::string& label, std::shared_ptr<void> keep,
                        bool* copied = nullptr, const WrapHints& hints = WrapHints()) = 0;
    virtual std::unique_ptr<CommandBuffer> command_buffer() = 0;
    // compile / look up a pipeline now (first use does it too); throws DeviceError naming the kernel
    virtual void prepare(const std::string& kernel) = 0;
    // the pipeline's maxTotalThreadsPerThreadgroup (compiling it if needed): Metal lowers it below the
    // device's 1024 for register-heavy kernels, and a kernel declaring
    // [[max_total_threads_per_threadgroup(N)]] gets N. Host functions size threadgroups from it.
    virtual uint32_t max_threads(const std::string& kernel) = 0;
    // After a command buffer failed (a GPU fault, the watchdog), macOS ignores the process's later
    // command buffers on that queue: make the device usable again (a new command queue). Call it only
    // with nothing in flight.
    virtual void recover() = 0;
    virtual bool has_kernel(const std::string& kernel) const = 0;
    virtual Counters counters() const = 0;
    virtual void reset_counters() = 0;
};

}  // namespace qwenmetal::gpu

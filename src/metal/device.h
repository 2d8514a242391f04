// MetalDevice: gpu::Device (src/gpu/device.h) on the system's Metal GPU. Pure C++ interface; the
// implementation (src/metal/device.mm, the only Objective-C++ file, built on Apple only) is a thin
// layer over MTLDevice / MTLBuffer / MTLComputePipelineState / MTLCommandBuffer:
//
//   alloc    newBufferWithLength: with MTLResourceStorageModeShared, which Apple documents as
//            cleared to zero (no memset of our own: it would commit every page of large buffers
//            up front; tests/test_metal_device.py looks at a fresh buffer on a Mac)
//   wrap     newBufferWithBytesNoCopy: over the page-aligned span around [ptr, ptr + bytes) (the
//            Buffer's offset points at ptr; `keep` is held by the allocation, deallocator nil),
//            else (span over maxBufferLength, or Metal refuses) a copy: *copied = true
//   kernels  the MSL embedded in the binary (src/metal/msl_sources.h), one library per kernel family,
//            compiled with newLibraryWithSource: at the first use of one of its kernels; pipelines
//            (newComputePipelineStateWithFunction:) cached by kernel name
//   commands one MTLCommandQueue; a CommandBuffer is one MTLCommandBuffer with one concurrent compute
//            encoder (MTLDispatchTypeConcurrent): setBytes / setBuffer:offset:atIndex: /
//            setThreadgroupMemoryLength, dispatchThreadgroups, memoryBarrierWithScope:Buffers;
//            commit with a completed handler; wait = waitUntilCompleted + the command buffer's error
//
// Every failure is a gpu::DeviceError naming what failed (the kernel, the family with the Metal
// compiler's log, the command buffer's error and the kernels it ran). Hardware-unverified until run
// on a Mac (docs/mac-first-run.md).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "gpu/device.h"

namespace qwenmetal::gpu {

struct MetalOptions {
    // MTLCompileOptions.fastMathEnabled. Off by default: the kernels are verified in the simulator
    // with precise libm math (exp, division, rsqrt, NaN/Inf), and decode is memory-bound.
    bool fast_math = false;
};

// One kernel family's library (compile_all / add_source).
struct MetalLibraryReport {
    std::string family;               // "norm"
    std::string origin;               // "metal/norm.metal"
    bool ok = false;                  // newLibraryWithSource: returned a library
    std::string log;                  // the compiler's messages (errors, or warnings when ok)
    double seconds = 0;               // compile time of the library (newLibraryWithSource:)
    double pipeline_seconds = 0;      // compile_all: the time to make the pipelines of all its kernels
    size_t pipelines = 0;             // compile_all: the pipelines made
    std::string language_version;     // the MSL version it was compiled as (MTLCompileOptions.languageVersion)
    std::vector<std::string> kernels; // the library's functionNames (ok), else the embedded table's names
};

class MetalDevice : public Device {
  public:
    // the system default device (MTLCreateSystemDefaultDevice); DeviceError if there is none
    explicit MetalDevice(const MetalOptions& opt = MetalOptions());
    ~MetalDevice() override;
    MetalDevice(const MetalDevice&) = delete;
    MetalDevice& operator=(const MetalDevice&) = delete;

    const DeviceInfo& info() const override;
    Buffer alloc(uint64_t bytes, const std::string& label) override;
    Buffer wrap(const void* ptr, uint64_t bytes, const std::string& label, std::shared_ptr<void> keep,
                bool* copied = nullptr, const WrapHints& hints = WrapHints()) override;
    std::unique_ptr<CommandBuffer> command_buffer() override;
    void prepare(const std::string& kernel) override;
    bool has_kernel(const std::string& kernel) const override;
    Counters counters() const override;
    void reset_counters() override;
    uint32_t max_threads(const std::string& kernel) override;
    void recover() override;

    // Compile every embedded family this GPU runs and every pipeline of its kernels now, the families in
    // parallel (MetalBackend does it at load, so no dispatch waits for a compiler; `qwenmetal selftest`'s
    // compile gate); never throws for a compile error: one report per family, in name order.
    std::vector<MetalLibraryReport> compile_all();
    // Compile extra MSL (a test's kernel) as a library named `family`; its kernels are then found
    // by name like the embedded ones. Throws DeviceError with the compiler's log on failure.
    MetalLibraryReport add_source(const std::string& family, const std::string& source);
    // every kernel host name known: the embedded table's, then add_source's
    std::vector<std::string> kernel_names() const;
    // the embedded family's flattened source ("" if unknown), e.g. to run `xcrun metal` on it
    static std::string embedded_source(const std::string& family);
    static std::vector<std::string> embedded_families();

    struct Impl;

  private:
    // shared with the command buffers, which stay valid if they outlive the device object
    std::shared_ptr<Impl> impl_;
};

// the system default Metal device; throws DeviceError if there is none
std::unique_ptr<Device> make_metal_device(const MetalOptions& opt = MetalOptions());

}  // namespace qwenmetal::gpu

// MetalDevice (src/metal/device.h): gpu::Device over Metal. The only Objective-C++ file of the
// project; built with -fobjc-arc on Apple only. Type-checked on Linux against the declarations in
// src/metal/decls/ (tools/metal_device_check.py); hardware-unverified until run on a Mac.
//
// Conventions of this file:
//   * ARC owns every Objective-C object (ids in C++ members and containers are strong references);
//   * public entry points run their Objective-C calls inside @autoreleasepool (Python threads have
//     no run loop to drain autoreleased objects), and C++ exceptions are thrown only after the pool
//     block has ended: helpers report errors through a std::string instead of throwing;
//   * every buffer bound into a command buffer is kept alive (its gpu::Allocation, which owns the
//     host memory of a wrapped buffer) until the GPU has completed it.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include "metal/device.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "metal/msl_sources.h"

namespace qwenmetal::gpu {

namespace {

std::string to_std(NSString* s) {
    if (s == nil) return std::string();
    const char* p = s.UTF8String;
    return p ? std::string(p) : std::string();
}

NSString* to_ns(const std::string& s) {
    NSString* r = [NSString stringWithUTF8String:s.c_str()];
    return r ? r : [NSString stringWithUTF8String:""];
}

std::string describe(NSError* e) {
    if (e == nil) return "no error object";
    return to_std(e.localizedDescription) + " (" + to_std(e.domain) + " code " + std::to_string(long(e.code)) + ")";
}

constexpr uint64_t kMaxSetBytes = 4096;  // setBytes:length:atIndex: is for data under 4 KB
constexpr size_t kMaxBufferArgs = 31;    // the buffer argument table of a compute function

class MetalAllocation : public Allocation {
  public:
    MetalAllocation(id<MTLBuffer> buf, std::string label, std::shared_ptr<void> keep)
        : keep_(std::move(keep)), buf_(buf), label_(std::move(label)) {
        contents_ = [buf_ contents];
        length_ = uint64_t(buf_.length);
        if (!label_.empty()) buf_.label = to_ns(label_);
    }
    void* contents() const override { return contents_; }
    uint64_t length() const override { return length_; }
    uint64_t address() const override { return reinterpret_cast<uint64_t>(contents_); }
    const std::string& label() const override { return label_; }
    id<MTLBuffer> buffer() const { return buf_; }

  private:
    // declared first: destroyed after buf_, so the wrapped host memory outlives the MTLBuffer
    std::shared_ptr<void> keep_;
    id<MTLBuffer> buf_;
    void* contents_ = nullptr;
    uint64_t length_ = 0;
    std::string label_;
};

struct Family {
    std::string name, origin;
    const char* source = nullptr;          // embedded, or source_text
    std::string source_text;               // add_source
    std::vector<std::string> table;        // kernel names from the embedded table
    bool tried = false, ok = false;
    std::string log;
    double seconds = 0;
    id<MTLLibrary> library = nil;
    std::vector<std::string> functions;    // functionNames once compiled
    bool needs_tensor_ops = false;         // includes <metal_tensor>: compiled only where info.tensor_ops
};

// State shared by a MetalCommandBuffer and its completed handler (which may outlive it).
struct CommandState {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::string error;
    std::function<void()> on_complete;
    std::vector<std::shared_ptr<Allocation>> bound;  // alive until the GPU is done
};

}  // namespace

struct MetalDevice::Impl {
    MetalOptions opt;
    DeviceInfo info;
    uint64_t page = 16384;
    id<MTLDevice> device = nil;
    id<MTLCommandQueue> queue = nil;

    mutable std::mutex mu;                 // families, pipelines
    std::vector<Family> families;
    std::unordered_map<std::string, size_t> table;   // kernel -> family (embedded table)
    std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines;

    mutable std::mutex counters_mu;
    Counters counters;

    // compile families[i] once (mu held); false if it failed (families[i].log says why)
    bool compile(size_t i) {
        Family& f = families[i];
        if (f.tried) return f.ok;
        f.tried = true;
        if (f.needs_tensor_ops && !info.tensor_ops) {  // older macOS / GPUs cannot compile it: never tried
            f.log = "not compiled: it needs Metal 4 tensor operations (GPU family apple10, macOS 26)";
            return false;
        }
        const auto t0 = std::chrono::steady_clock::now();
        @autoreleasepool {
            MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
            options.fastMathEnabled = opt.fast_math ? YES : NO;  // mathMode replaces it from macOS 15
#pragma clang diagnostic pop
            NSString* src = [NSString stringWithUTF8String:(f.source ? f.source : f.source_text.c_str())];
            NSError* error = nil;
            id<MTLLibrary> lib = src ? [device newLibraryWithSource:src options:options error:&error] : nil;
            if (src == nil) {
                f.log = "the source is not valid UTF-8";
            } else if (error != nil) {
                f.log = to_std(error.localizedDescription);  // errors, or only warnings if lib != nil
            }
            if (lib != nil) {
                f.library = lib;
                f.ok = true;
                NSArray<NSString*>* names = lib.functionNames;
                for (NSUInteger k = 0; k < names.count; ++k) f.functions.push_back(to_std([names objectAtIndex:k]));
            }
        }
        f.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        return f.ok;
    }

    static bool has(const std::vector<std::string>& v, const std::string& s) {
        return std::find(v.begin(), v.end(), s) != v.end();
    }

    // the family whose library exports `kernel`, compiling what is needed (mu held); SIZE_MAX if none.
    // `err` explains a miss caused by a compile failure.
    size_t find(const std::string& kernel, std::string* err) {
        auto t = table.find(kernel);
        if (t != table.end()) {
            if (compile(t->second) && has(families[t->second].functions, kernel)) return t->second;
            Family& f = families[t->second];
            if (err)
                *err = f.ok ? "kernel '" + kernel + "': " + f.origin + " compiled but does not export it"
                            : "kernel '" + kernel + "': " + f.origin + " did not compile with the Metal compiler:\n" +
                                  f.log;
            return SIZE_MAX;
        }
        // not in the embedded table (e.g. a host name built by a macro, or add_source): search
        // every library, compiling the remaining families
        for (size_t i = 0; i < families.size(); ++i)
            if (compile(i) && has(families[i].functions, kernel)) return i;
        if (err) {
            *err = "no Metal kernel named '" + kernel + "' in the embedded sources";
            for (const Family& f : families)
                if (f.tried && !f.ok) *err += "; " + f.origin + " did not compile:\n" + f.log;
        }
        return SIZE_MAX;
    }

    // the cached pipeline of `kernel`, or nil with `err` set
    id<MTLComputePipelineState> pipeline(const std::string& kernel, std::string* err) {
        std::lock_guard<std::mutex> lk(mu);
        auto p = pipelines.find(kernel);
        if (p != pipelines.end()) return p->second;
        const size_t i = find(kernel, err);
        if (i == SIZE_MAX) return nil;
        id<MTLComputePipelineState> pso = nil;
        @autoreleasepool {
            id<MTLFunction> fn = [families[i].library newFunctionWithName:to_ns(kernel)];
            if (fn == nil) {
                *err = "kernel '" + kernel + "': newFunctionWithName: found no function of that name in " +
                       families[i].origin;
            } else {
                NSError* error = nil;
                pso = [device newComputePipelineStateWithFunction:fn error:&error];
                if (pso == nil) {
                    *err = "kernel '" + kernel + "': newComputePipelineStateWithFunction: failed: " + describe(error);
                } else if (pso.threadExecutionWidth != 32) {
                    *err = "kernel '" + kernel + "': the kernels assume 32-wide SIMD-groups, this GPU runs it " +
                           std::to_string(pso.threadExecutionWidth) + " wide";
                    pso = nil;
                }
            }
        }
        if (pso != nil) pipelines[kernel] = pso;
        return pso;
    }

    void add_counts(uint64_t cbs, uint64_t dispatches, uint64_t barriers) {
        std::lock_guard<std::mutex> lk(counters_mu);
        counters.command_buffers += cbs;
        counters.dispatches += dispatches;
        counters.barriers += barriers;
    }
};

// ---------------------------------------------------------------------------------------------
class MetalCommandBuffer : public CommandBuffer {
  public:
    MetalCommandBuffer(std::shared_ptr<MetalDevice::Impl> d, std::string* err)
        : keep_(std::move(d)), dev_(*keep_), st_(std::make_shared<CommandState>()) {
        @autoreleasepool {
            cb_ = [dev_.queue commandBuffer];
            if (cb_ != nil) enc_ = [cb_ computeCommandEncoderWithDispatchType:MTLDispatchTypeConcurrent];
            if (cb_ == nil) *err = "MTLCommandQueue commandBuffer returned nil";
            else if (enc_ == nil) *err = "computeCommandEncoderWithDispatchType:MTLDispatchTypeConcurrent returned nil";
        }
    }

    ~MetalCommandBuffer() override {
        // an encoder must be ended before its command buffer goes away, committed or not
        if (enc_ != nil) {
            @autoreleasepool {
                [enc_ endEncoding];
                enc_ = nil;
            }
        }
    }

    void dispatch(const std::string& kernel, Dims g, Dims t, const std::vector<Arg>& args,
                  const std::vector<uint32_t>& tg_memory, uint64_t /*flops: a model's input, not Metal's*/) override {
        if (committed_) throw DeviceError("gpu::CommandBuffer: dispatch after commit");
        std::string err;
        @autoreleasepool {
            err = encode(kernel, g, t, args, tg_memory);
        }
        if (!err.empty()) throw DeviceError(err);
    }

    void barrier() override {
        if (committed_) throw DeviceError("gpu::CommandBuffer: barrier after commit");
        @autoreleasepool {
            [enc_ memoryBarrierWithScope:MTLBarrierScopeBuffers];
        }
        ++barriers_;
    }

    void commit(std::function<void()> on_complete) override {
        if (committed_) throw DeviceError("gpu::CommandBuffer: committed twice");
        committed_ = true;
        st_->on_complete = std::move(on_complete);
        std::shared_ptr<CommandState> st = st_;
        std::string kernels = kernel_list();
        @autoreleasepool {
            [enc_ endEncoding];
            enc_ = nil;
            [cb_ addCompletedHandler:^(id<MTLCommandBuffer> done) {
                std::string error;
                if (done.status == MTLCommandBufferStatusError || done.error != nil)
                    error = "Metal command buffer failed: " + describe(done.error) + "; it ran " + kernels;
                std::function<void()> fn;
                {
                    std::lock_guard<std::mutex> lk(st->mu);
                    fn = std::move(st->on_complete);
                }
                if (error.empty() && fn) {
                    try {
                        fn();
                    } catch (const std::exception& e) {
                        error = std::string("command buffer completion handler: ") + e.what();
                    } catch (...) {
                        error = "command buffer completion handler: unknown exception";
                    }
                }
                {
                    std::lock_guard<std::mutex> lk(st->mu);
                    st->done = true;
                    st->error = std::move(error);
                }
                st->cv.notify_all();
            }];
            [cb_ commit];
        }
        dev_.add_counts(1, dispatches_, barriers_);
    }

    void wait() override {
        if (!committed_) throw DeviceError("gpu::CommandBuffer: wait before commit");
        {
            std::lock_guard<std::mutex> lk(dev_.counters_mu);
            ++dev_.counters.host_waits;
        }
        @autoreleasepool {
            [cb_ waitUntilCompleted];
        }
        std::string error;
        {
            // the completed handler may run just after waitUntilCompleted returns
            std::unique_lock<std::mutex> lk(st_->mu);
            st_->cv.wait(lk, [&] { return st_->done; });
            error = st_->error;
            st_->bound.clear();
        }
        if (!error.empty()) throw DeviceError(error);
    }

    bool completed() const override {
        std::lock_guard<std::mutex> lk(st_->mu);
        return st_->done;
    }

  private:
    // encode one dispatch (inside the caller's autorelease pool); "" or the error
    std::string encode(const std::string& kernel, Dims g, Dims t, const std::vector<Arg>& args,
                       const std::vector<uint32_t>& tg_memory) {
        std::string err;
        id<MTLComputePipelineState> pso = dev_.pipeline(kernel, &err);
        if (pso == nil) return err;
        const uint64_t threads = uint64_t(t.x) * t.y * t.z;
        if (threads == 0 || threads > pso.maxTotalThreadsPerThreadgroup)
            return "kernel '" + kernel + "': " + std::to_string(threads) + " threads per threadgroup (" +
                   std::to_string(t.x) + "x" + std::to_string(t.y) + "x" + std::to_string(t.z) +
                   "), its pipeline allows 1 to " + std::to_string(pso.maxTotalThreadsPerThreadgroup);
        if (args.size() > kMaxBufferArgs)
            return "kernel '" + kernel + "': " + std::to_string(args.size()) + " arguments, Metal binds at most " +
                   std::to_string(kMaxBufferArgs);
        uint64_t tg_total = pso.staticThreadgroupMemoryLength;
        std::vector<uint64_t> tg_len(tg_memory.size());
        for (size_t j = 0; j < tg_memory.size(); ++j) {
            tg_len[j] = (uint64_t(tg_memory[j]) + 15) / 16 * 16;  // a multiple of 16 bytes
            tg_total += tg_len[j];
        }
        if (tg_total > dev_.info.max_threadgroup_memory)
            return "kernel '" + kernel + "': " + std::to_string(tg_total) + " bytes of threadgroup memory, the device has " +
                   std::to_string(dev_.info.max_threadgroup_memory);
        std::vector<id<MTLBuffer>> bufs(args.size(), nil);
        for (size_t i = 0; i < args.size(); ++i) {
            const Arg& a = args[i];
            if (a.kind == Arg::kBytes) {
                if (a.bytes.empty() || a.bytes.size() > kMaxSetBytes)
                    return "kernel '" + kernel + "': argument " + std::to_string(i) + " is " +
                           std::to_string(a.bytes.size()) + " bytes of setBytes data (1 to 4096 allowed)";
                continue;
            }
            if (!a.buf.alloc) continue;  // bound as nil
            auto* m = dynamic_cast<MetalAllocation*>(a.buf.alloc.get());
            if (m == nullptr)
                return "kernel '" + kernel + "': buffer argument " + std::to_string(i) + " ('" + a.buf.alloc->label() +
                       "') was not made by this MetalDevice";
            if (a.buf.offset + a.buf.length > m->length())
                return "kernel '" + kernel + "': buffer argument " + std::to_string(i) + " views past its allocation";
            bufs[i] = m->buffer();
        }
        // everything is valid: encode
        [enc_ setComputePipelineState:pso];
        for (size_t i = 0; i < args.size(); ++i) {
            const Arg& a = args[i];
            if (a.kind == Arg::kBytes) {
                [enc_ setBytes:a.bytes.data() length:a.bytes.size() atIndex:i];
            } else {
                [enc_ setBuffer:bufs[i] offset:a.buf.offset atIndex:i];
                if (a.buf.alloc) {
                    std::lock_guard<std::mutex> lk(st_->mu);
                    st_->bound.push_back(a.buf.alloc);
                }
            }
        }
        for (size_t j = 0; j < tg_len.size(); ++j) [enc_ setThreadgroupMemoryLength:tg_len[j] atIndex:j];
        if (uint64_t(g.x) * g.y * g.z > 0)
            [enc_ dispatchThreadgroups:MTLSizeMake(g.x, g.y, g.z) threadsPerThreadgroup:MTLSizeMake(t.x, t.y, t.z)];
        ++dispatches_;
        if (!Impl::has(kernels_, kernel)) kernels_.push_back(kernel);
        return std::string();
    }

    std::string kernel_list() const { return describe_kernels(dispatches_, kernels_); }

    using Impl = MetalDevice::Impl;
    std::shared_ptr<Impl> keep_;
    Impl& dev_;
    std::shared_ptr<CommandState> st_;
    id<MTLCommandBuffer> cb_ = nil;
    id<MTLComputeCommandEncoder> enc_ = nil;
    bool committed_ = false;
    uint64_t dispatches_ = 0, barriers_ = 0;
    std::vector<std::string> kernels_;
};

// ---------------------------------------------------------------------------------------------
MetalDevice::MetalDevice(const MetalOptions& opt) : impl_(std::make_shared<Impl>()) {
    Impl& d = *impl_;
    d.opt = opt;
    const long page = sysconf(_SC_PAGESIZE);
    if (page > 0) d.page = uint64_t(page);
    std::string err;
    @autoreleasepool {
        d.device = MTLCreateSystemDefaultDevice();
        if (d.device == nil) {
            err = "MTLCreateSystemDefaultDevice returned nil: no Metal GPU is available to this process";
        } else {
            d.queue = [d.device newCommandQueue];
            if (d.queue == nil) err = "newCommandQueue returned nil";
            DeviceInfo& i = d.info;
            i.name = to_std(d.device.name);
            const bool paravirtual = i.name.find("Paravirtual") != std::string::npos;
            // the highest Apple family (each includes the ones below), else Metal3, else unknown
            // MTLGPUFamilyApple10 (M5) is spelled by its value so that SDKs older than macOS 26 still build
            const MTLGPUFamily apple10 = static_cast<MTLGPUFamily>(1010);
            if (@available(macOS 26.0, *)) {
                if ([d.device supportsFamily:apple10]) i.family = "apple10";
            }
            if (@available(macOS 14.0, *)) {
                if (i.family.empty() && [d.device supportsFamily:MTLGPUFamilyApple9]) i.family = "apple9";
            }
            if (@available(macOS 13.0, *)) {
                if (i.family.empty() && [d.device supportsFamily:MTLGPUFamilyApple8]) i.family = "apple8";
            }
            static const MTLGPUFamily older[] = {MTLGPUFamilyApple7, MTLGPUFamilyApple6, MTLGPUFamilyApple5,
                                                 MTLGPUFamilyApple4, MTLGPUFamilyApple3, MTLGPUFamilyApple2,
                                                 MTLGPUFamilyApple1};
            for (int k = 0; k < 7 && i.family.empty(); ++k)
                if ([d.device supportsFamily:older[k]]) i.family = "apple" + std::to_string(7 - k);
            const bool apple7 = i.family == "apple7" || i.family == "apple8" || i.family == "apple9" ||
                                i.family == "apple10";
            if (@available(macOS 13.0, *)) {
                if (i.family.empty() && [d.device supportsFamily:MTLGPUFamilyMetal3]) i.family = "metal3";
            }
            if (i.family.empty()) i.family = "unknown";
            // SIMD-group reductions and simdgroup matrices: Apple7 (M1) and later. The paravirtual GPU
            // of macOS VMs (GitHub's macos-14 runners) reports Apple5 and supports neither.
            i.simd_reductions = apple7 && !paravirtual;
            i.simdgroup_matrix = apple7 && !paravirtual;
            // Metal 4 tensor operations (<metal_tensor>, MetalPerformancePrimitives): apple10 on macOS 26
            i.tensor_ops = i.family == "apple10" && !paravirtual;
            i.max_buffer_length = uint64_t(d.device.maxBufferLength);
            i.max_threads_per_threadgroup = uint32_t(d.device.maxThreadsPerThreadgroup.width);
            i.max_threadgroup_memory = uint32_t(d.device.maxThreadgroupMemoryLength);
            i.unified_memory = d.device.hasUnifiedMemory;
            i.working_set = uint64_t(d.device.recommendedMaxWorkingSetSize);
            i.executes = true;
        }
    }
    if (!err.empty()) throw DeviceError("MetalDevice: " + err);
    for (size_t k = 0; k < kMslSourceCount; ++k) {
        const MslSource& s = kMslSources[k];
        Family f;
        f.name = s.family;
        f.origin = s.origin;
        f.source = s.source;
        f.needs_tensor_ops = std::strstr(s.source, "#include <metal_tensor>") != nullptr;
        for (size_t j = 0; j < s.kernel_count; ++j) {
            f.table.push_back(s.kernels[j]);
            d.table.emplace(s.kernels[j], d.families.size());
        }
        d.families.push_back(std::move(f));
    }
}

MetalDevice::~MetalDevice() = default;

const DeviceInfo& MetalDevice::info() const { return impl_->info; }

Buffer MetalDevice::alloc(uint64_t bytes, const std::string& label) {
    Impl& d = *impl_;
    const uint64_t n = bytes ? bytes : 16;
    if (n > d.info.max_buffer_length)
        throw DeviceError("MetalDevice::alloc('" + label + "'): " + std::to_string(n) +
                          " bytes is more than maxBufferLength " + std::to_string(d.info.max_buffer_length));
    std::shared_ptr<MetalAllocation> a;
    @autoreleasepool {
        id<MTLBuffer> buf = [d.device newBufferWithLength:n options:MTLResourceStorageModeShared];
        if (buf != nil) a = std::make_shared<MetalAllocation>(buf, label, nullptr);
    }
    if (!a) throw DeviceError("MetalDevice::alloc('" + label + "'): newBufferWithLength: " + std::to_string(n) +
                              " bytes returned nil (out of memory?)");
    return Buffer{a, 0, bytes};
}

Buffer MetalDevice::wrap(const void* ptr, uint64_t bytes, const std::string& label, std::shared_ptr<void> keep,
                         bool* copied) {
    Impl& d = *impl_;
    if (copied) *copied = false;
    if (ptr == nullptr || bytes == 0) {
        Buffer b = alloc(0, label);
        b.length = 0;
        return b;
    }
    const uint64_t p = reinterpret_cast<uint64_t>(ptr);
    const uint64_t base = p / d.page * d.page;
    const uint64_t end = (p + bytes + d.page - 1) / d.page * d.page;
    std::shared_ptr<MetalAllocation> a;
    bool was_copied = false;
    @autoreleasepool {
        if (end - base <= d.info.max_buffer_length) {
            // the pages around [ptr, ptr + bytes), used in place; the memory stays owned by `keep`
            id<MTLBuffer> buf = [d.device newBufferWithBytesNoCopy:reinterpret_cast<void*>(base)
                                                            length:end - base
                                                           options:MTLResourceStorageModeShared
                                                       deallocator:nil];
            if (buf != nil) a = std::make_shared<MetalAllocation>(buf, label, std::move(keep));
        }
        if (!a && bytes <= d.info.max_buffer_length) {
            id<MTLBuffer> buf = [d.device newBufferWithBytes:ptr length:bytes options:MTLResourceStorageModeShared];
            if (buf != nil) a = std::make_shared<MetalAllocation>(buf, label, nullptr);
            was_copied = true;
        }
    }
    if (!a)
        throw DeviceError("MetalDevice::wrap('" + label + "'): " + std::to_string(bytes) +
                          " bytes could neither be wrapped nor copied (maxBufferLength " +
                          std::to_string(d.info.max_buffer_length) + ")");
    if (copied) *copied = was_copied;
    return Buffer{a, was_copied ? 0 : p - base, bytes};
}

std::unique_ptr<CommandBuffer> MetalDevice::command_buffer() {
    std::string err;
    auto cb = std::make_unique<MetalCommandBuffer>(impl_, &err);
    if (!err.empty()) throw DeviceError("MetalDevice::command_buffer: " + err);
    return cb;
}

void MetalDevice::prepare(const std::string& kernel) {
    std::string err;
    bool ok = false;
    @autoreleasepool {
        ok = impl_->pipeline(kernel, &err) != nil;
    }
    if (!ok) throw DeviceError(err);
}

uint32_t MetalDevice::max_threads(const std::string& kernel) {
    std::string err;
    uint32_t n = 0;
    @autoreleasepool {
        id<MTLComputePipelineState> pso = impl_->pipeline(kernel, &err);
        if (pso != nil) n = uint32_t(pso.maxTotalThreadsPerThreadgroup);
    }
    if (n == 0) throw DeviceError(err);
    return n;
}

void MetalDevice::recover() {
    // macOS ignores a queue's command buffers after one caused a GPU error ("Ignored (for causing
    // prior/excessive GPU errors)"): later work goes to a new queue
    Impl& d = *impl_;
    bool ok = false;
    @autoreleasepool {
        id<MTLCommandQueue> q = [d.device newCommandQueue];
        if (q != nil) {
            d.queue = q;
            ok = true;
        }
    }
    if (!ok) throw DeviceError("MetalDevice::recover: newCommandQueue returned nil");
}

bool MetalDevice::has_kernel(const std::string& kernel) const {
    Impl& d = *impl_;
    std::lock_guard<std::mutex> lk(d.mu);
    if (d.pipelines.count(kernel) || d.table.count(kernel)) return true;
    return d.find(kernel, nullptr) != SIZE_MAX;
}

Counters MetalDevice::counters() const {
    std::lock_guard<std::mutex> lk(impl_->counters_mu);
    return impl_->counters;
}

void MetalDevice::reset_counters() {
    std::lock_guard<std::mutex> lk(impl_->counters_mu);
    impl_->counters = Counters();
}

static MetalLibraryReport report_of(const Family& f) {
    MetalLibraryReport r;
    r.family = f.name;
    r.origin = f.origin;
    r.ok = f.ok;
    r.log = f.log;
    r.seconds = f.seconds;
    r.kernels = f.ok ? f.functions : f.table;
    return r;
}

std::vector<MetalLibraryReport> MetalDevice::compile_all() {
    Impl& d = *impl_;
    std::lock_guard<std::mutex> lk(d.mu);
    std::vector<MetalLibraryReport> out;
    for (size_t i = 0; i < d.families.size(); ++i) {
        if (d.families[i].source == nullptr) continue;  // add_source libraries are reported there
        if (d.families[i].needs_tensor_ops && !d.info.tensor_ops) continue;  // not for this GPU
        d.compile(i);
        out.push_back(report_of(d.families[i]));
    }
    return out;
}

MetalLibraryReport MetalDevice::add_source(const std::string& family, const std::string& source) {
    Impl& d = *impl_;
    std::lock_guard<std::mutex> lk(d.mu);
    for (const Family& f : d.families)
        if (f.name == family) throw DeviceError("MetalDevice::add_source: a library named '" + family + "' exists");
    Family f;
    f.name = family;
    f.origin = "<" + family + ">";
    f.source_text = source;
    d.families.push_back(std::move(f));
    const size_t i = d.families.size() - 1;
    if (!d.compile(i)) {
        const std::string log = d.families[i].log;
        d.families.pop_back();
        throw DeviceError("MetalDevice::add_source('" + family + "'): the Metal compiler failed:\n" + log);
    }
    return report_of(d.families[i]);
}

std::vector<std::string> MetalDevice::kernel_names() const {
    Impl& d = *impl_;
    std::lock_guard<std::mutex> lk(d.mu);
    std::vector<std::string> out;
    for (const Family& f : d.families)
        if (!f.needs_tensor_ops || d.info.tensor_ops)
            for (const std::string& k : (f.ok ? f.functions : f.table))
                if (!Impl::has(out, k)) out.push_back(k);
    return out;
}

std::string MetalDevice::embedded_source(const std::string& family) {
    for (size_t k = 0; k < kMslSourceCount; ++k)
        if (family == kMslSources[k].family) return std::string(kMslSources[k].source, kMslSources[k].length);
    return std::string();
}

std::vector<std::string> MetalDevice::embedded_families() {
    std::vector<std::string> out;
    for (size_t k = 0; k < kMslSourceCount; ++k) out.push_back(kMslSources[k].family);
    return out;
}

std::unique_ptr<Device> make_metal_device(const MetalOptions& opt) { return std::make_unique<MetalDevice>(opt); }

}  // namespace qwenmetal::gpu

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
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gpu/windows.h"
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

// MTLCompileOptions.languageVersion of a "major.minor" version (MslSource::language_version), never below
// 3.1 (bfloat); by value, (major << 16) + minor, so that SDKs without the newest enumerators still build
MTLLanguageVersion language_version(const std::string& v) {
    const size_t dot = v.find('.');
    const unsigned long major = std::stoul(v.substr(0, dot)), minor = dot == std::string::npos ? 0 : std::stoul(v.substr(dot + 1));
    return std::max(MTLLanguageVersion3_1, static_cast<MTLLanguageVersion>((major << 16) + minor));
}

// The weights' residency set (macOS 15 and later): the buffers the GPU only reads, made resident once as a
// set the queue carries, instead of by every command buffer that binds them. Additions and removals are
// committed before the next command buffer. Before macOS 15 there is none (active() false): Metal makes a
// buffer resident when a command buffer uses it, and may page it out in between.
class Residency {
  public:
    explicit Residency(id<MTLDevice> device) {
        if (@available(macOS 15.0, *)) {
            MTLResidencySetDescriptor* desc = [[MTLResidencySetDescriptor alloc] init];
            desc.label = to_ns("qwenmetal weights");
            desc.initialCapacity = 64;
            NSError* error = nil;
            set_ = [device newResidencySetWithDescriptor:desc error:&error];   // nil: plain residency
        }
    }
    bool active() const { return set_ != nil; }
    void add(id<MTLBuffer> b) {
        if (@available(macOS 15.0, *)) {
            std::lock_guard<std::mutex> lk(mu_);
            if (set_ == nil) return;
            [(id<MTLResidencySet>)set_ addAllocation:b];
            dirty_ = true;
        }
    }
    void remove(id<MTLBuffer> b) {
        if (@available(macOS 15.0, *)) {
            std::lock_guard<std::mutex> lk(mu_);
            if (set_ == nil) return;
            [(id<MTLResidencySet>)set_ removeAllocation:b];
            dirty_ = true;
        }
    }
    void attach(id<MTLCommandQueue> q) {
        if (@available(macOS 15.0, *)) {
            if (set_ != nil) [q addResidencySet:(id<MTLResidencySet>)set_];
        }
    }
    void commit() {
        if (@available(macOS 15.0, *)) {
            std::lock_guard<std::mutex> lk(mu_);
            if (set_ == nil || !dirty_) return;
            [(id<MTLResidencySet>)set_ commit];
            [(id<MTLResidencySet>)set_ requestResidency];
            dirty_ = false;
        }
    }

  private:
    std::mutex mu_;
    id set_ = nil;        // id<MTLResidencySet>, typed where macOS 15 is checked
    bool dirty_ = false;
};

// One device allocation: one MTLBuffer, or (a host range past maxBufferLength) several over overlapping
// windows of it (gpu/windows.h), a view bound from the window that holds it whole.
class MetalAllocation : public Allocation {
  public:
    MetalAllocation(id<MTLBuffer> buf, std::string label, std::shared_ptr<void> keep,
                    std::shared_ptr<Residency> residency = nullptr)
        : MetalAllocation({Window{0, uint64_t(buf.length)}}, {buf}, [buf contents], std::move(label), std::move(keep),
                          std::move(residency)) {}
    MetalAllocation(std::vector<Window> windows, std::vector<id<MTLBuffer>> bufs, void* contents, std::string label,
                    std::shared_ptr<void> keep, std::shared_ptr<Residency> residency)
        : keep_(std::move(keep)), windows_(std::move(windows)), bufs_(std::move(bufs)), contents_(contents),
          label_(std::move(label)), residency_(std::move(residency)) {
        length_ = windows_.back().start + windows_.back().length;
        for (size_t i = 0; i < bufs_.size(); ++i) {
            if (!label_.empty())
                bufs_[i].label = to_ns(bufs_.size() == 1 ? label_ : label_ + " [window " + std::to_string(i) + "]");
            if (residency_) residency_->add(bufs_[i]);
        }
    }
    ~MetalAllocation() override {
        if (residency_)
            for (id<MTLBuffer> b : bufs_) residency_->remove(b);
    }
    void* contents() const override { return contents_; }
    uint64_t length() const override { return length_; }
    uint64_t address() const override { return reinterpret_cast<uint64_t>(contents_); }
    const std::string& label() const override { return label_; }
    // the buffer holding [offset, offset + length) whole and the view's offset in it; nil if none does
    id<MTLBuffer> buffer_for(uint64_t offset, uint64_t length, uint64_t* in_buffer) const {
        const size_t i = window_of(windows_, offset, length);
        if (i == SIZE_MAX) return nil;
        *in_buffer = offset - windows_[i].start;
        return bufs_[i];
    }

  private:
    // declared first: destroyed after the buffers, so the wrapped host memory outlives every MTLBuffer
    std::shared_ptr<void> keep_;
    std::vector<Window> windows_;
    std::vector<id<MTLBuffer>> bufs_;
    void* contents_ = nullptr;
    uint64_t length_ = 0;
    std::string label_;
    std::shared_ptr<Residency> residency_;
};

struct Family {
    std::string name, origin;
    const char* source = nullptr;          // embedded, or source_text
    std::string source_text;               // add_source
    std::string version = "3.1";           // its MSL version: MTLCompileOptions.languageVersion
    std::vector<std::string> table;        // kernel names from the embedded table
    bool tried = false, ok = false;
    std::string log;
    double seconds = 0;                    // newLibraryWithSource:
    double pipeline_seconds = 0;           // compile_all: the pipelines of all its functions
    id<MTLLibrary> library = nil;
    std::vector<std::string> functions;    // functionNames once compiled
    bool needs_tensor_ops = false;         // includes <metal_tensor>: compiled only where info.tensor_ops
    const char* text() const { return source ? source : source_text.c_str(); }
};

// What compiling one family gives (library_of): no shared state, so families compile on threads of their own.
struct LibraryResult {
    bool ok = false;
    std::string log;
    double seconds = 0;
    id<MTLLibrary> library = nil;
    std::vector<std::string> functions;
};

LibraryResult library_of(id<MTLDevice> device, const char* text, const std::string& version, bool fast_math) {
    LibraryResult r;
    const auto t0 = std::chrono::steady_clock::now();
    @autoreleasepool {
        MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
        options.fastMathEnabled = fast_math ? YES : NO;  // mathMode replaces it from macOS 15
#pragma clang diagnostic pop
        options.languageVersion = language_version(version);   // pinned: what the sources are checked against
        NSString* src = [NSString stringWithUTF8String:text];
        NSError* error = nil;
        id<MTLLibrary> lib = src ? [device newLibraryWithSource:src options:options error:&error] : nil;
        if (src == nil) {
            r.log = "the source is not valid UTF-8";
        } else if (error != nil) {
            r.log = to_std(error.localizedDescription);  // errors, or only warnings if lib != nil
        }
        if (lib != nil) {
            r.library = lib;
            r.ok = true;
            NSArray<NSString*>* names = lib.functionNames;
            for (NSUInteger k = 0; k < names.count; ++k) r.functions.push_back(to_std([names objectAtIndex:k]));
        }
    }
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
}

// the pipeline of `kernel` in `lib`, or nil with `err` set
id<MTLComputePipelineState> pipeline_of(id<MTLDevice> device, id<MTLLibrary> lib, const std::string& kernel,
                                        const std::string& origin, std::string* err) {
    id<MTLComputePipelineState> pso = nil;
    @autoreleasepool {
        id<MTLFunction> fn = [lib newFunctionWithName:to_ns(kernel)];
        if (fn == nil) {
            *err = "kernel '" + kernel + "': newFunctionWithName: found no function of that name in " + origin;
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
    return pso;
}

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
    std::shared_ptr<Residency> residency;  // the weights' residency set (macOS 15+)

    mutable std::mutex mu;                 // families, pipelines
    std::vector<Family> families;
    std::unordered_map<std::string, size_t> table;   // kernel -> family (embedded table)
    std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines;

    mutable std::mutex counters_mu;
    Counters counters;

    // families[i]'s library compiled (mu held), a result of library_of stored
    void store(size_t i, LibraryResult r) {
        Family& f = families[i];
        f.tried = true;
        f.ok = r.ok;
        f.log = std::move(r.log);
        f.seconds = r.seconds;
        f.library = r.library;
        f.functions = std::move(r.functions);
    }

    // compile families[i] once (mu held); false if it failed (families[i].log says why)
    bool compile(size_t i) {
        Family& f = families[i];
        if (f.tried) return f.ok;
        if (f.needs_tensor_ops && !info.tensor_ops) {  // older macOS / GPUs cannot compile it: never tried
            f.tried = true;
            f.log = "not compiled: it needs Metal 4 tensor operations (GPU family apple10, macOS 26)";
            return false;
        }
        store(i, library_of(device, f.text(), f.version, opt.fast_math));
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

    // the cached pipeline of `kernel` (compile_all makes them all at load), or nil with `err` set
    id<MTLComputePipelineState> pipeline(const std::string& kernel, std::string* err) {
        std::lock_guard<std::mutex> lk(mu);
        auto p = pipelines.find(kernel);
        if (p != pipelines.end()) return p->second;
        const size_t i = find(kernel, err);
        if (i == SIZE_MAX) return nil;
        id<MTLComputePipelineState> pso = pipeline_of(device, families[i].library, kernel, families[i].origin, err);
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
        std::vector<uint64_t> offs(args.size(), 0);   // each view's offset in the buffer bound
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
            bufs[i] = m->buffer_for(a.buf.offset, a.buf.length, &offs[i]);
            if (bufs[i] == nil)
                return "kernel '" + kernel + "': buffer argument " + std::to_string(i) + " ('" + a.buf.alloc->label() +
                       "', " + std::to_string(a.buf.length) + " bytes at " + std::to_string(a.buf.offset) +
                       ") lies in no one of its windows: a view larger than the wrap's max_view";
        }
        // everything is valid: encode
        [enc_ setComputePipelineState:pso];
        for (size_t i = 0; i < args.size(); ++i) {
            const Arg& a = args[i];
            if (a.kind == Arg::kBytes) {
                [enc_ setBytes:a.bytes.data() length:a.bytes.size() atIndex:i];
            } else {
                [enc_ setBuffer:bufs[i] offset:offs[i] atIndex:i];
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
            d.residency = std::make_shared<Residency>(d.device);
            if (d.queue != nil) d.residency->attach(d.queue);
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
        f.version = s.language_version;
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
                         bool* copied, const WrapHints& hints) {
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
    // weights: no hazard tracking (the GPU never writes them, so there is nothing to order) and resident as
    // one set; written buffers keep Metal's tracking, which orders them across command buffers
    const MTLResourceOptions options = static_cast<MTLResourceOptions>(
        hints.read_only ? (MTLResourceStorageModeShared | MTLResourceHazardTrackingModeUntracked) : MTLResourceStorageModeShared);
    const std::shared_ptr<Residency> residency = hints.read_only && d.residency->active() ? d.residency : nullptr;
    std::string err;
    @autoreleasepool {
        if (end - base <= d.info.max_buffer_length) {
            // the pages around [ptr, ptr + bytes), used in place; the memory stays owned by `keep`
            id<MTLBuffer> buf = [d.device newBufferWithBytesNoCopy:reinterpret_cast<void*>(base)
                                                            length:end - base
                                                           options:options
                                                       deallocator:nil];
            if (buf != nil) a = std::make_shared<MetalAllocation>(buf, label, std::move(keep), residency);
        } else if (hints.max_view > 0) {
            // past maxBufferLength: overlapping windows of its pages, each view bound from one that holds it
            try {
                const std::vector<Window> w = plan_windows(end - base, d.info.max_buffer_length, hints.max_view, d.page);
                std::vector<id<MTLBuffer>> bufs;
                for (const Window& x : w) {
                    id<MTLBuffer> buf = [d.device newBufferWithBytesNoCopy:reinterpret_cast<void*>(base + x.start)
                                                                    length:x.length
                                                                   options:options
                                                               deallocator:nil];
                    if (buf == nil) break;
                    bufs.push_back(buf);
                }
                if (bufs.size() == w.size())
                    a = std::make_shared<MetalAllocation>(w, bufs, reinterpret_cast<void*>(base), label, std::move(keep),
                                                          residency);
            } catch (const std::exception& e) {
                err = e.what();
            }
        }
        if (!a && bytes <= d.info.max_buffer_length) {
            id<MTLBuffer> buf = [d.device newBufferWithBytes:ptr length:bytes options:options];
            if (buf != nil) a = std::make_shared<MetalAllocation>(buf, label, nullptr, residency);
            was_copied = true;
        }
    }
    if (!a)
        throw DeviceError("MetalDevice::wrap('" + label + "'): " + std::to_string(bytes) +
                          " bytes could neither be wrapped nor copied (maxBufferLength " +
                          std::to_string(d.info.max_buffer_length) + (err.empty() ? "" : "; " + err) + ")");
    if (copied) *copied = was_copied;
    return Buffer{a, was_copied ? 0 : p - base, bytes};
}

std::unique_ptr<CommandBuffer> MetalDevice::command_buffer() {
    @autoreleasepool {
        impl_->residency->commit();   // weights wrapped or freed since the last command buffer
    }
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
            d.residency->attach(q);
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
    r.pipeline_seconds = f.pipeline_seconds;
    r.language_version = f.version;
    r.kernels = f.ok ? f.functions : f.table;
    return r;
}

std::vector<MetalLibraryReport> MetalDevice::compile_all() {
    Impl& d = *impl_;
    // the families this GPU runs, each compiled with all its pipelines on a thread of its own (a device's
    // compile calls are thread-safe); the results are stored under the lock afterwards
    struct Job {
        size_t i;
        const char* text;
        std::string version, origin;
        LibraryResult lib;
        std::vector<std::pair<std::string, id<MTLComputePipelineState>>> pipelines;
        std::string pipeline_log;
        double pipeline_seconds = 0;
    };
    std::vector<Job> jobs;
    {
        std::lock_guard<std::mutex> lk(d.mu);
        for (size_t i = 0; i < d.families.size(); ++i) {
            const Family& f = d.families[i];
            if (f.source == nullptr) continue;                     // add_source libraries are reported there
            if (f.needs_tensor_ops && !d.info.tensor_ops) continue;  // not for this GPU
            Job j;
            j.i = i;
            j.text = f.tried ? nullptr : f.text();
            j.version = f.version;
            j.origin = f.origin;
            if (f.tried) {                                          // compiled at first use: its library stands
                j.lib.ok = f.ok;
                j.lib.library = f.library;
                j.lib.functions = f.functions;
            }
            jobs.push_back(std::move(j));
        }
    }
    std::vector<std::thread> threads;
    for (Job& j : jobs)
        threads.emplace_back([&d, &j] {
            @autoreleasepool {
                if (j.text) j.lib = library_of(d.device, j.text, j.version, d.opt.fast_math);
                const auto t0 = std::chrono::steady_clock::now();
                for (const std::string& k : j.lib.functions) {
                    std::string err;
                    id<MTLComputePipelineState> pso = pipeline_of(d.device, j.lib.library, k, j.origin, &err);
                    if (pso != nil) j.pipelines.emplace_back(k, pso);
                    else j.pipeline_log += err + "\n";
                }
                j.pipeline_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            }
        });
    for (std::thread& t : threads) t.join();
    std::lock_guard<std::mutex> lk(d.mu);
    std::vector<MetalLibraryReport> out;
    for (Job& j : jobs) {
        Family& f = d.families[j.i];
        if (!f.tried) d.store(j.i, std::move(j.lib));
        f.pipeline_seconds = j.pipeline_seconds;
        for (auto& [k, pso] : j.pipelines) d.pipelines.emplace(k, pso);
        if (!j.pipeline_log.empty()) {
            f.ok = false;                                            // a kernel without a pipeline cannot run
            f.log += (f.log.empty() ? "" : "\n") + j.pipeline_log;
        }
        MetalLibraryReport r = report_of(f);
        r.pipelines = j.pipelines.size();
        out.push_back(std::move(r));
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

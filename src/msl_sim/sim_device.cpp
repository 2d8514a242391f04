#include "msl_sim/sim_device.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>

namespace qwenmetal::gpu {

namespace {

class SimAllocation : public Allocation {
  public:
    SimAllocation(void* p, uint64_t n, uint64_t addr, std::string label, std::shared_ptr<void> keep, bool owned)
        : p_(p), n_(n), addr_(addr), label_(std::move(label)), keep_(std::move(keep)), owned_(owned) {}
    ~SimAllocation() override {
        if (owned_) std::free(p_);
    }
    void* contents() const override { return p_; }
    uint64_t length() const override { return n_; }
    uint64_t address() const override { return addr_; }
    const std::string& label() const override { return label_; }

  private:
    void* p_;
    uint64_t n_, addr_;
    std::string label_;
    std::shared_ptr<void> keep_;
    bool owned_;
};

struct Step {
    bool barrier = false;
    std::string kernel;
    uint32_t groups[3], threads[3];
    std::vector<Arg> args;
    std::vector<uint32_t> tg_memory;
    uint64_t flops = 0;
};

// The modelled GPU time of a command buffer's steps on `chip` (gpu/cost.h): levels one after another.
double modelled_seconds(const std::vector<Step>& steps, const ChipModel& chip) {
    double t = 0;
    uint64_t bytes = 0, flops = 0;
    bool open = false;
    for (const Step& s : steps) {
        if (s.barrier) {
            if (open) t += level_seconds(bytes, flops, chip);
            bytes = flops = 0;
            open = false;
            continue;
        }
        for (const Arg& a : s.args) bytes += a.read + a.written;
        flops += s.flops;
        open = true;
    }
    return open ? t + level_seconds(bytes, flops, chip) : t;
}

std::string ms(double seconds) { return std::to_string(int64_t(seconds * 1e3 + 0.5)) + " ms"; }

}  // namespace

struct SimDevice::Job {
    std::vector<Step> steps;
    std::function<void()> on_complete;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::string error;
    // how a GPU would fail it (decided when committed): "" runs it; else the error, after `run` dispatches
    std::string fault;
    size_t run = 0;
    std::string kernels;      // describe_kernels() of its dispatches
    double seconds = 0;       // modelled on kSlowestChip
};

class SimCommandBuffer : public CommandBuffer {
  public:
    explicit SimCommandBuffer(SimDevice& d) : dev_(d), job_(std::make_shared<SimDevice::Job>()) {}
    void dispatch(const std::string& kernel, Dims g, Dims t, const std::vector<Arg>& args,
                  const std::vector<uint32_t>& tg_memory, uint64_t flops) override {
        if (committed_) throw DeviceError("gpu::CommandBuffer: dispatch after commit");
        const uint64_t threads = uint64_t(t.x) * t.y * t.z;
        const uint32_t limit = dev_.max_threads(kernel);
        if (threads == 0 || threads > limit)   // Metal's validation of dispatchThreadgroups
            throw DeviceError("kernel '" + kernel + "': " + std::to_string(threads) + " threads per threadgroup (" +
                              std::to_string(t.x) + "x" + std::to_string(t.y) + "x" + std::to_string(t.z) +
                              "), its pipeline allows 1 to " + std::to_string(limit));
        ++dispatches_;
        if (std::find(kernels_.begin(), kernels_.end(), kernel) == kernels_.end()) kernels_.push_back(kernel);
        Step s;
        s.flops = flops;
        s.kernel = kernel;
        s.groups[0] = g.x, s.groups[1] = g.y, s.groups[2] = g.z;
        s.threads[0] = t.x, s.threads[1] = t.y, s.threads[2] = t.z;
        s.args = args;
        s.tg_memory = tg_memory;
        job_->steps.push_back(std::move(s));
    }
    void barrier() override {
        if (committed_) throw DeviceError("gpu::CommandBuffer: barrier after commit");
        Step s;
        s.barrier = true;
        job_->steps.push_back(std::move(s));
    }
    void commit(std::function<void()> on_complete) override {
        if (committed_) throw DeviceError("gpu::CommandBuffer: committed twice");
        committed_ = true;
        job_->on_complete = std::move(on_complete);
        job_->kernels = describe_kernels(dispatches_, kernels_);
        job_->seconds = modelled_seconds(job_->steps, kSlowestChip);
        dev_.submit(job_);
    }
    void wait() override {
        if (!committed_) throw DeviceError("gpu::CommandBuffer: wait before commit");
        {
            std::lock_guard<std::mutex> lk(dev_.mu_);
            ++dev_.counters_.host_waits;
        }
        std::unique_lock<std::mutex> lk(job_->mu);
        job_->cv.wait(lk, [&] { return job_->done; });
        if (!job_->error.empty()) throw DeviceError(job_->error);
    }
    bool completed() const override {
        std::lock_guard<std::mutex> lk(job_->mu);
        return job_->done;
    }

  private:
    SimDevice& dev_;
    std::shared_ptr<SimDevice::Job> job_;
    bool committed_ = false;
    uint64_t dispatches_ = 0;
    std::vector<std::string> kernels_;
};

SimDevice::SimDevice(const SimOptions& opt, std::shared_ptr<msl::Library> lib)
    : opt_(opt), lib_(lib ? std::move(lib) : msl::Library::builtin()) {
    static const char* names[] = {"forward", "reverse", "random"};
    info_.name = std::string("msl_sim (") + names[int(opt.schedule)] + " schedule" +
                 (opt.execute ? "" : ", encode-only") +
                 (opt.tensor_ops ? ", tensor ops" : "") + ")";
    info_.family = "simulator";
    info_.max_buffer_length = 1ull << 40;
    info_.max_threads_per_threadgroup = msl::kMaxThreadsPerGroup;
    info_.max_threadgroup_memory = msl::kMaxThreadgroupMemory;
    info_.executes = opt.execute;
    info_.tensor_ops = opt.tensor_ops;
    info_.working_set = opt.working_set;
    if (opt.pipeline_max_threads < 32 || opt.pipeline_max_threads > msl::kMaxThreadsPerGroup ||
        opt.pipeline_max_threads % 32)
        throw std::invalid_argument("SimDevice: pipeline_max_threads must be a multiple of 32 from 32 to 1024, got " +
                          std::to_string(opt.pipeline_max_threads));
    worker_ = std::thread([this] { run_queue(); });
}

SimDevice::~SimDevice() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
    collect();
}

Buffer SimDevice::alloc(uint64_t bytes, const std::string& label) {
    const uint64_t n = bytes ? bytes : 16;
    {
        std::lock_guard<std::mutex> lk(mu_);
        allocated_ += n;
    }
    if (!opt_.execute) {
        std::lock_guard<std::mutex> lk(mu_);
        const uint64_t a = next_virtual_;
        next_virtual_ += (n + 4095) / 4096 * 4096 + 4096;
        return Buffer{std::make_shared<SimAllocation>(nullptr, n, a, label, nullptr, false), 0, bytes};
    }
    void* p = std::aligned_alloc(64, (n + 63) / 64 * 64);
    if (!p) throw std::bad_alloc();
    std::memset(p, 0, (n + 63) / 64 * 64);
    return Buffer{std::make_shared<SimAllocation>(p, n, reinterpret_cast<uint64_t>(p), label, nullptr, true), 0,
                  bytes};
}

Buffer SimDevice::wrap(const void* ptr, uint64_t bytes, const std::string& label, std::shared_ptr<void> keep,
                       bool* copied, const WrapHints&) {
    if (copied) *copied = false;
    {
        std::lock_guard<std::mutex> lk(mu_);
        wrapped_ += bytes;
    }
    if (!opt_.execute) {                 // a virtual range of its own, not counted as allocated
        std::lock_guard<std::mutex> lk(mu_);
        const uint64_t a = next_virtual_, n = bytes ? bytes : 16;
        next_virtual_ += (n + 4095) / 4096 * 4096 + 4096;
        return Buffer{std::make_shared<SimAllocation>(nullptr, n, a, label, nullptr, false), 0, bytes};
    }
    void* p = const_cast<void*>(ptr);
    return Buffer{std::make_shared<SimAllocation>(p, bytes, reinterpret_cast<uint64_t>(p), label, std::move(keep), false),
                  0, bytes};
}

std::unique_ptr<CommandBuffer> SimDevice::command_buffer() {
    collect();
    return std::make_unique<SimCommandBuffer>(*this);
}

void SimDevice::prepare(const std::string& kernel) {
    try {
        lib_->get(kernel);
    } catch (const msl::SimError& e) {
        throw DeviceError(e.what());
    }
}

bool SimDevice::has_kernel(const std::string& kernel) const { return lib_->find(kernel) != nullptr; }

uint32_t SimDevice::max_threads(const std::string& kernel) {
    const msl::KernelInfo* k = lib_->find(kernel);
    if (!k) prepare(kernel);   // throws DeviceError listing the kernels
    return k && k->max_threads ? k->max_threads : opt_.pipeline_max_threads;
}

void SimDevice::recover() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return queue_.empty() && !busy_; });   // nothing of the old queue still runs
    faulted_ = false;
}

void SimDevice::inject_fault(uint32_t after, Fault kind) {
    std::lock_guard<std::mutex> lk(mu_);
    fault_countdown_ = int64_t(after);
    fault_kind_ = kind;
}

double SimDevice::max_command_buffer_seconds() const {
    std::lock_guard<std::mutex> lk(mu_);
    return max_cb_seconds_;
}

uint64_t SimDevice::wrapped_bytes() const {
    std::lock_guard<std::mutex> lk(mu_);
    return wrapped_;
}

uint64_t SimDevice::allocated_bytes() const {
    std::lock_guard<std::mutex> lk(mu_);
    return allocated_;
}

uint64_t SimDevice::faults() const {
    std::lock_guard<std::mutex> lk(mu_);
    return faults_;
}

bool SimDevice::faulted() const {
    std::lock_guard<std::mutex> lk(mu_);
    return faulted_;
}

Counters SimDevice::counters() const {
    std::lock_guard<std::mutex> lk(mu_);
    return counters_;
}

void SimDevice::reset_counters() {
    collect();
    std::lock_guard<std::mutex> lk(mu_);
    counters_ = Counters();
    records_.clear();
    max_cb_seconds_ = 0;
}

std::vector<msl::DispatchRecord> SimDevice::records() const {
    std::lock_guard<std::mutex> lk(mu_);
    return records_;
}

std::map<std::string, KernelStats> SimDevice::kernel_stats() const {
    std::lock_guard<std::mutex> lk(mu_);
    return kstats_;
}

void SimDevice::reset_kernel_stats() {
    std::lock_guard<std::mutex> lk(mu_);
    kstats_.clear();
}

void SimDevice::submit(std::shared_ptr<Job> job) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        ++counters_.command_buffers;
        max_cb_seconds_ = std::max(max_cb_seconds_, job->seconds);
        // how the GPU would treat it, in commit order
        size_t n = 0;
        for (const Step& s : job->steps) n += !s.barrier;
        if (faulted_) {
            job->fault = "Ignored (for causing prior/excessive GPU errors) "
                         "(00000004:kIOGPUCommandBufferCallbackErrorSubmissionsIgnored): an earlier command buffer "
                         "of this queue failed and the queue was not recreated";
        } else if (fault_countdown_ == 0) {
            job->fault = fault_kind_ == Fault::timeout
                             ? "Caused GPU Timeout Error (00000002:kIOGPUCommandBufferCallbackErrorTimeout), "
                               "injected by SimDevice"
                             : "a GPU page fault, injected by SimDevice";
            job->run = n / 2;
        } else if (opt_.watchdog_seconds > 0 && job->seconds > opt_.watchdog_seconds) {
            job->fault = std::string("Impacting Interactivity (0000000e:kIOGPUCommandBufferCallbackError"
                                     "ImpactingInteractivity): modelled ") + ms(job->seconds) + " on the " +
                         kSlowestChip.name + ", over the " + ms(opt_.watchdog_seconds) +
                         " budget that keeps command buffers under macOS's GPU watchdog";
            job->run = n / 2;
        }
        if (fault_countdown_ >= 0) --fault_countdown_;
        if (!job->fault.empty()) {
            ++faults_;
            faulted_ = true;
        }
        queue_.push_back(std::move(job));
    }
    cv_.notify_all();
}

void SimDevice::run_queue() {
    for (;;) {
        std::shared_ptr<Job> job;
        {
            std::unique_lock<std::mutex> lk(mu_);
            cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
            if (queue_.empty()) return;
            job = queue_.front();
            queue_.pop_front();
            busy_ = true;
        }
        std::string error;
        msl::CommandBuffer cb(opt_.execute, true);
        uint64_t dispatches = 0, barriers = 0;
        try {
            msl::DispatchOptions dopt;
            dopt.schedule = opt_.schedule;
            dopt.workers = opt_.workers;
            dopt.count_banks = opt_.count_banks;
            for (const Step& s : job->steps) {
                if (!job->fault.empty() && dispatches == job->run)
                    throw DeviceError("Metal command buffer failed: " + job->fault + "; it ran " + job->kernels);
                if (s.barrier) {
                    cb.barrier();
                    ++barriers;
                    continue;
                }
                std::vector<msl::Binding> b(s.args.size());
                for (size_t i = 0; i < s.args.size(); ++i) {
                    const Arg& a = s.args[i];
                    msl::Binding& m = b[i];
                    m.bound = true;
                    if (a.kind == Arg::kBytes) {
                        m.ptr = const_cast<uint8_t*>(a.bytes.data());
                        m.size = a.bytes.size();
                        m.addr = reinterpret_cast<uint64_t>(m.ptr);
                        m.is_params = true;
                        continue;
                    }
                    m.ptr = a.buf.data();
                    m.size = a.buf.length;
                    m.addr = a.buf.address();
                    m.read = int64_t(a.read);
                    m.written = int64_t(a.written);
                }
                dopt.seed = opt_.seed + dispatches;
                dopt.tg_memory = s.tg_memory;
                cb.dispatch(*lib_, s.kernel, s.groups, s.threads, std::move(b), dopt);
                ++dispatches;
            }
            if (!job->fault.empty())   // every dispatch ran (run == all of them)
                throw DeviceError("Metal command buffer failed: " + job->fault + "; it ran " + job->kernels);
        } catch (const std::exception& e) {
            error = e.what();
        }
        {
            std::lock_guard<std::mutex> lk(mu_);
            counters_.dispatches += dispatches;
            counters_.barriers += barriers;
            const int64_t cbi = cb_index_++;
            size_t i = 0;
            for (const Step& s : job->steps) {
                if (s.barrier) continue;
                if (i >= cb.records().size()) break;
                msl::DispatchRecord r = cb.records()[i++];
                r.flops = s.flops;
                r.command_buffer = cbi;
                KernelStats& k = kstats_[r.kernel];
                const uint32_t tpg = r.threads_per_group[0] * r.threads_per_group[1] * r.threads_per_group[2];
                k.min_threads_per_group = k.dispatches ? std::min(k.min_threads_per_group, tpg) : tpg;
                k.max_threads_per_group = std::max(k.max_threads_per_group, tpg);
                ++k.dispatches;
                k.threadgroups += uint64_t(r.groups[0]) * r.groups[1] * r.groups[2];
                k.tg_memory = std::max(k.tg_memory, r.tg_memory);
                k.bytes += r.bytes_read + r.bytes_written;
                k.flops += r.flops;
                if (r.banks_counted) {
                    ++k.executed;
                    k.banks.accesses += r.banks.accesses;
                    k.banks.conflicted += r.banks.conflicted;
                    k.banks.replays += r.banks.replays;
                    k.banks.dropped += r.banks.dropped;
                    k.banks.max_degree = std::max(k.banks.max_degree, r.banks.max_degree);
                }
                if (opt_.keep_records) records_.push_back(std::move(r));
            }
        }
        if (error.empty() && job->on_complete) {
            try {
                job->on_complete();
            } catch (const std::exception& e) {
                error = e.what();
            }
        }
        {
            std::lock_guard<std::mutex> lk(job->mu);
            job->done = true;
            job->error = std::move(error);
        }
        job->cv.notify_all();
        // The job's buffers may hold host memory owned by Python (numpy arrays kept alive by a deleter
        // that takes the GIL): the queue thread never drops the last reference. Finished jobs are
        // released by the threads that call into the device (collect()).
        {
            std::lock_guard<std::mutex> lk(mu_);
            finished_.push_back(std::move(job));
            busy_ = false;
        }
        cv_.notify_all();
    }
}

void SimDevice::collect() {
    std::vector<std::shared_ptr<Job>> done;
    {
        std::lock_guard<std::mutex> lk(mu_);
        done.swap(finished_);
    }
}

}  // namespace qwenmetal::gpu

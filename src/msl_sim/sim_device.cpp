#include "msl_sim/sim_device.h"

#include <cstdlib>
#include <cstring>
#include <exception>

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
};

}  // namespace

struct SimDevice::Job {
    std::vector<Step> steps;
    std::function<void()> on_complete;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::string error;
};

class SimCommandBuffer : public CommandBuffer {
  public:
    explicit SimCommandBuffer(SimDevice& d) : dev_(d), job_(std::make_shared<SimDevice::Job>()) {}
    void dispatch(const std::string& kernel, Dims g, Dims t, const std::vector<Arg>& args,
                  const std::vector<uint32_t>& tg_memory) override {
        if (committed_) throw DeviceError("gpu::CommandBuffer: dispatch after commit");
        Step s;
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
                       bool* copied) {
    if (copied) *copied = false;
    if (!opt_.execute) {
        Buffer b = alloc(bytes, label);
        return b;
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

Counters SimDevice::counters() const {
    std::lock_guard<std::mutex> lk(mu_);
    return counters_;
}

void SimDevice::reset_counters() {
    collect();
    std::lock_guard<std::mutex> lk(mu_);
    counters_ = Counters();
    records_.clear();
}

std::vector<msl::DispatchRecord> SimDevice::records() const {
    std::lock_guard<std::mutex> lk(mu_);
    return records_;
}

void SimDevice::submit(std::shared_ptr<Job> job) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        ++counters_.command_buffers;
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
        }
        std::string error;
        msl::CommandBuffer cb(opt_.execute, true);
        uint64_t dispatches = 0, barriers = 0;
        try {
            msl::DispatchOptions dopt;
            dopt.schedule = opt_.schedule;
            dopt.workers = opt_.workers;
            for (const Step& s : job->steps) {
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
        } catch (const std::exception& e) {
            error = e.what();
        }
        {
            std::lock_guard<std::mutex> lk(mu_);
            counters_.dispatches += dispatches;
            counters_.barriers += barriers;
            if (opt_.keep_records) records_.insert(records_.end(), cb.records().begin(), cb.records().end());
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
        std::lock_guard<std::mutex> lk(mu_);
        finished_.push_back(std::move(job));
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

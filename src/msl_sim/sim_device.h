// SimDevice: gpu::Device (src/gpu/device.h) over the Metal-on-CPU simulator. Command buffers are
// recorded as encoded and replayed into an msl::CommandBuffer when committed, on one queue thread
// in commit order (as a Metal command queue runs them), so commit returns at once and wait()
// blocks: two command buffers can be in flight exactly as on a GPU. The simulator's checks
// (barriers, divergence, uninitialised threadgroup memory, bounds, missing memory barriers between
// dispatches of one level) turn into DeviceError at wait().
//
// Encode-only (execute = false): buffers are virtual (an address range, no memory), nothing runs,
// and every committed command buffer's dispatch records are kept for costing.
//
// Apple's runtime limits, modelled so that CI fails where a Mac would (docs/metal.md, "Runtime limits"):
//   * GPU time: every committed command buffer's time is modelled on the slowest supported GPU
//     (gpu/cost.h); one above `watchdog_seconds` fails as macOS's watchdog would abort it;
//   * per-pipeline thread limit: max_threads(kernel) is the kernel's declared
//     [[max_total_threads_per_threadgroup(N)]], else `pipeline_max_threads` (Metal lowers it below 1024
//     for register-heavy pipelines); a dispatch above it is refused when encoded;
//   * working set: info().working_set is `working_set` (recommendedMaxWorkingSetSize);
//   * GPU faults: inject_fault() makes a later command buffer fail part-way (its first half of dispatches
//     run); after any fault the queue ignores every later command buffer until recover(), as macOS does.
#pragma once
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gpu/cost.h"
#include "gpu/device.h"
#include "msl_sim/runtime.h"

namespace qwenmetal::gpu {

struct SimOptions {
    bool execute = true;
    msl::Schedule schedule = msl::Schedule::forward;
    uint64_t seed = 0;
    int workers = 0;                  // simulator threads per dispatch (0: all cores)
    bool keep_records = false;        // keep every dispatch record of committed command buffers
    bool tensor_ops = false;          // claim Metal 4 tensor ops (DeviceInfo::tensor_ops): the M5 routes run emulated
    uint32_t pipeline_max_threads = 1024;   // maxTotalThreadsPerThreadgroup of pipelines declaring no limit
    uint64_t working_set = 0;         // DeviceInfo::working_set (0: unlimited)
    double watchdog_seconds = kWatchdogBudgetSeconds;   // modelled GPU time a command buffer may take (0: any)
    bool count_banks = false;         // count threadgroup-memory bank conflicts per kernel (kernel_stats)
};

// What the device saw of one pipeline (kernel_stats): dispatch shapes, threadgroup memory, and (executing
// with count_banks) its threadgroup-memory bank conflicts (msl::BankCounts).
struct KernelStats {
    uint64_t dispatches = 0;
    uint64_t threadgroups = 0;        // summed over dispatches
    uint32_t max_threads_per_group = 0, min_threads_per_group = 0;
    int64_t tg_memory = -1;           // bytes per threadgroup, the largest seen (-1: unknown, encode-only)
    uint64_t bytes = 0, flops = 0;    // declared, summed
    uint64_t executed = 0;            // dispatches that ran with bank counting
    msl::BankCounts banks;
};

// A command buffer failure SimDevice injects (inject_fault).
enum class Fault : uint8_t { error, timeout };

class SimDevice : public Device {
  public:
    explicit SimDevice(const SimOptions& opt = SimOptions(), std::shared_ptr<msl::Library> lib = nullptr);
    ~SimDevice() override;

    const DeviceInfo& info() const override { return info_; }
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

    // the `after`-th command buffer committed from now on (0: the next) fails part-way
    void inject_fault(uint32_t after, Fault kind);
    // the longest modelled GPU time (kSlowestChip) of a command buffer committed since reset_counters()
    double max_command_buffer_seconds() const;
    // command buffers that failed as a GPU would fail them (watchdog, injected, ignored after a fault)
    uint64_t faults() const;
    bool faulted() const;             // a fault happened and recover() has not been called since
    // bytes of every alloc() so far (not wrap(): the weights), freed or not: what a graph's scratch, state
    // and KV cache take (the working-set plan measures them on an encode-only device)
    uint64_t allocated_bytes() const;
    // bytes of every wrap() so far (the weights' file mappings as device buffers)
    uint64_t wrapped_bytes() const;

    const SimOptions& options() const { return opt_; }
    msl::Library& library() const { return *lib_; }
    // dispatch records of the command buffers committed since reset_counters() (keep_records)
    std::vector<msl::DispatchRecord> records() const;
    // per pipeline, every dispatch since the device was made or reset_kernel_stats() (not reset_counters())
    std::map<std::string, KernelStats> kernel_stats() const;
    void reset_kernel_stats();

  private:
    friend class SimCommandBuffer;
    struct Job;
    void submit(std::shared_ptr<Job> job);
    void run_queue();
    void collect();                   // release finished jobs on the calling thread

    SimOptions opt_;
    std::shared_ptr<msl::Library> lib_;
    DeviceInfo info_;
    uint64_t next_virtual_ = 1ull << 40;

    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::shared_ptr<Job>> queue_;
    std::vector<std::shared_ptr<Job>> finished_;
    bool stop_ = false;
    bool busy_ = false;               // the queue thread is running a job
    std::thread worker_;
    Counters counters_;
    std::vector<msl::DispatchRecord> records_;
    std::map<std::string, KernelStats> kstats_;
    int64_t cb_index_ = 0;            // command buffers run by the queue (DispatchRecord::command_buffer)
    // modelled limits (mu_)
    double max_cb_seconds_ = 0;
    uint64_t allocated_ = 0, wrapped_ = 0;
    uint64_t faults_ = 0;
    int64_t fault_countdown_ = -1;    // commits left before the injected fault (-1: none pending)
    Fault fault_kind_ = Fault::error;
    bool faulted_ = false;            // the queue ignores command buffers until recover()
};

}  // namespace qwenmetal::gpu

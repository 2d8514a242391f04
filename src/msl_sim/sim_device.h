// SimDevice: gpu::Device (src/gpu/device.h) over the Metal-on-CPU simulator. Command buffers are
// recorded as encoded and replayed into an msl::CommandBuffer when committed, on one queue thread
// in commit order (as a Metal command queue runs them), so commit returns at once and wait()
// blocks: two command buffers can be in flight exactly as on a GPU. The simulator's checks
// (barriers, divergence, uninitialised threadgroup memory, bounds, missing memory barriers between
// dispatches of one level) turn into DeviceError at wait().
//
// Encode-only (execute = false): buffers are virtual (an address range, no memory), nothing runs,
// and every committed command buffer's dispatch records are kept for costing.
#pragma once
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

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
};

class SimDevice : public Device {
  public:
    explicit SimDevice(const SimOptions& opt = SimOptions(), std::shared_ptr<msl::Library> lib = nullptr);
    ~SimDevice() override;

    const DeviceInfo& info() const override { return info_; }
    Buffer alloc(uint64_t bytes, const std::string& label) override;
    Buffer wrap(const void* ptr, uint64_t bytes, const std::string& label, std::shared_ptr<void> keep,
                bool* copied = nullptr) override;
    std::unique_ptr<CommandBuffer> command_buffer() override;
    void prepare(const std::string& kernel) override;
    bool has_kernel(const std::string& kernel) const override;
    Counters counters() const override;
    void reset_counters() override;

    const SimOptions& options() const { return opt_; }
    msl::Library& library() const { return *lib_; }
    // dispatch records of the command buffers committed since reset_counters() (keep_records)
    std::vector<msl::DispatchRecord> records() const;

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
    std::thread worker_;
    Counters counters_;
    std::vector<msl::DispatchRecord> records_;
};

}  // namespace qwenmetal::gpu

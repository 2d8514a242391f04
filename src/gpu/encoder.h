// The encoder every host op function writes through: one command buffer's concurrent compute
// encoder, with memory barriers inserted from each argument's declared access. A dispatch that
// reads or writes a range written in the current dependency level, or writes a range read in
// it, starts a new level (memoryBarrierWithScope(Buffers)); everything else runs concurrently.
// The simulator checks independently that no barrier is missing (msl::CommandBuffer's hazard
// check), so a wrong declaration fails a test rather than racing on a GPU.
//
// With a time budget the encoder owns its command buffers and cuts the work into several, committed
// back to back with no host wait between them: before a dispatch that would take the current command
// buffer past the budget (modelled on the slowest Apple GPU, gpu/cost.h), the current one is committed
// and a new one begun. One queue runs them in order, so the result is that of one command buffer.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu/cost.h"
#include "gpu/device.h"

namespace qwenmetal::gpu {

struct EncodeStats {
    uint64_t dispatches = 0;
    uint64_t levels = 0;          // dependency levels (barriers + 1 once anything is encoded)
    uint64_t bytes_read = 0;      // declared, summed over dispatches
    uint64_t bytes_written = 0;
    uint64_t flops = 0;           // declared arithmetic (multiply-add = 2), summed over dispatches
};

// What one dependency level moves and computes (summed over its dispatches).
struct LevelStats {
    uint64_t bytes = 0, flops = 0;
};

class Encoder {
  public:
    // one command buffer, owned (committed, waited) by the caller
    Encoder(Device& dev, CommandBuffer& cb) : dev_(dev), cb_(&cb) {}
    // command buffers of its own, each at most `seconds` of modelled time on `chip` (unless one dispatch
    // alone is longer); commit() and wait() below
    Encoder(Device& dev, double seconds, const ChipModel& chip = kSlowestChip);
    ~Encoder();
    Encoder(const Encoder&) = delete;
    Encoder& operator=(const Encoder&) = delete;
    Device& device() const { return dev_; }

    // `flops`: the arithmetic the dispatch does (a multiply-add counts 2), declared by the host function
    // for the costing's compute roofline (0 for kernels whose cost is their bytes)
    void dispatch(const std::string& kernel, Dims groups, Dims threads, const std::vector<Arg>& args,
                  const std::vector<uint32_t>& tg_memory = {}, uint64_t flops = 0);
    // an explicit barrier (a host op that knows better than the declarations; rarely needed)
    void barrier();
    const EncodeStats& stats() const { return stats_; }
    const std::vector<LevelStats>& level_stats() const { return per_level_; }

    // Own command buffers only: commit the last one (the earlier ones were committed when the next began).
    void commit();
    // Own command buffers only: wait for every committed one, in order; after all have completed, throw
    // the first one's DeviceError, if any (nothing of this encoder is in flight when it throws).
    void wait();
    // the command buffers begun so far (1 for a caller's), and the first dependency level of each
    // (an index into level_stats())
    size_t command_buffers() const { return first_level_.empty() ? 1 : first_level_.size(); }
    const std::vector<uint64_t>& command_buffer_levels() const { return first_level_; }

  private:
    struct Range {
        uint64_t lo, hi;
        bool write;
    };
    void begin_command_buffer();
    Device& dev_;
    CommandBuffer* cb_ = nullptr;
    std::vector<Range> level_;
    EncodeStats stats_;
    std::vector<LevelStats> per_level_;
    // own command buffers (a budget was given)
    std::vector<std::unique_ptr<CommandBuffer>> own_;
    std::vector<uint64_t> first_level_;
    double budget_ = 0;
    ChipModel chip_ = kSlowestChip;
    double closed_seconds_ = 0;   // modelled time of the current command buffer's finished levels
    uint64_t cb_dispatches_ = 0;  // dispatches in the current command buffer
    bool waited_ = false;
};

// Grid helpers for host op functions.
inline uint32_t ceil_div(uint64_t a, uint64_t b) { return uint32_t((a + b - 1) / b); }

}  // namespace qwenmetal::gpu

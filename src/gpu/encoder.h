// The encoder every host op function writes through: one command buffer's concurrent compute
// encoder, with memory barriers inserted from each argument's declared access. A dispatch that
// reads or writes a range written in the current dependency level, or writes a range read in
// it, starts a new level (memoryBarrierWithScope(Buffers)); everything else runs concurrently.
// The simulator checks independently that no barrier is missing (msl::CommandBuffer's hazard
// check), so a wrong declaration fails a test rather than racing on a GPU.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

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
    Encoder(Device& dev, CommandBuffer& cb) : dev_(dev), cb_(cb) {}
    Device& device() const { return dev_; }
    CommandBuffer& command_buffer() const { return cb_; }

    // `flops`: the arithmetic the dispatch does (a multiply-add counts 2), declared by the host function
    // for the costing's compute roofline (0 for kernels whose cost is their bytes)
    void dispatch(const std::string& kernel, Dims groups, Dims threads, const std::vector<Arg>& args,
                  const std::vector<uint32_t>& tg_memory = {}, uint64_t flops = 0);
    // an explicit barrier (a host op that knows better than the declarations; rarely needed)
    void barrier();
    const EncodeStats& stats() const { return stats_; }
    const std::vector<LevelStats>& level_stats() const { return per_level_; }

  private:
    struct Range {
        uint64_t lo, hi;
        bool write;
    };
    Device& dev_;
    CommandBuffer& cb_;
    std::vector<Range> level_;
    EncodeStats stats_;
    std::vector<LevelStats> per_level_;
};

// Grid helpers for host op functions.
inline uint32_t ceil_div(uint64_t a, uint64_t b) { return uint32_t((a + b - 1) / b); }

}  // namespace qwenmetal::gpu

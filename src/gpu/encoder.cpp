#include "gpu/encoder.h"

namespace qwenmetal::gpu {

void Encoder::dispatch(const std::string& kernel, Dims groups, Dims threads, const std::vector<Arg>& args,
                       const std::vector<uint32_t>& tg_memory, uint64_t flops) {
    std::vector<Range> mine;
    bool conflict = false;
    for (const Arg& a : args) {
        if (a.kind == Arg::kBytes) continue;
        if (!a.buf.valid()) throw DeviceError("gpu::Encoder: '" + kernel + "' given an unset buffer");
        if (a.buf.length == 0) continue;
        const Range r{a.buf.address(), a.buf.address() + a.buf.length, a.writes()};
        for (const Range& o : level_)
            if (r.lo < o.hi && o.lo < r.hi && (r.write || o.write)) conflict = true;
        mine.push_back(r);
    }
    if (conflict) barrier();
    if (stats_.levels == 0) {
        stats_.levels = 1;
        per_level_.emplace_back();
    }
    cb_.dispatch(kernel, groups, threads, args, tg_memory);
    level_.insert(level_.end(), mine.begin(), mine.end());
    ++stats_.dispatches;
    stats_.flops += flops;
    per_level_.back().flops += flops;
    for (const Arg& a : args) {
        stats_.bytes_read += a.read;
        stats_.bytes_written += a.written;
        per_level_.back().bytes += a.read + a.written;
    }
}

void Encoder::barrier() {
    if (level_.empty()) return;   // consecutive barriers collapse
    cb_.barrier();
    level_.clear();
    ++stats_.levels;
    per_level_.emplace_back();
}

}  // namespace qwenmetal::gpu

#include "gpu/encoder.h"

namespace qwenmetal::gpu {

Encoder::Encoder(Device& dev, double seconds, const ChipModel& chip) : dev_(dev), budget_(seconds), chip_(chip) {
    begin_command_buffer();
}

Encoder::~Encoder() {
    // a command buffer committed and never waited for still holds its buffers: let it finish before the
    // caller's scratch can go away (errors were the caller's to collect with wait())
    if (!waited_)
        for (auto& cb : own_)
            try {
                if (cb) cb->wait();
            } catch (...) {
            }
}

void Encoder::begin_command_buffer() {
    if (!own_.empty()) own_.back()->commit();
    own_.push_back(dev_.command_buffer());
    cb_ = own_.back().get();
    level_.clear();
    closed_seconds_ = 0;
    cb_dispatches_ = 0;
    first_level_.push_back(stats_.levels);     // the next dispatch opens this level
}

void Encoder::dispatch(const std::string& kernel, Dims groups, Dims threads, const std::vector<Arg>& args,
                       const std::vector<uint32_t>& tg_memory, uint64_t flops) {
    std::vector<Range> mine;
    bool conflict = false;
    uint64_t bytes = 0;
    for (const Arg& a : args) {
        bytes += a.read + a.written;
        if (a.kind == Arg::kBytes) continue;
        if (!a.buf.valid()) throw DeviceError("gpu::Encoder: '" + kernel + "' given an unset buffer");
        if (a.buf.length == 0) continue;
        const Range r{a.buf.address(), a.buf.address() + a.buf.length, a.writes()};
        for (const Range& o : level_)
            if (r.lo < o.hi && o.lo < r.hi && (r.write || o.write)) conflict = true;
        mine.push_back(r);
    }
    if (budget_ > 0 && cb_dispatches_ > 0) {
        // the current command buffer's modelled time with this dispatch in it
        const LevelStats& cur = per_level_.back();
        const double t = conflict ? closed_seconds_ + level_seconds(cur.bytes, cur.flops, chip_) +
                                        level_seconds(bytes, flops, chip_)
                                  : closed_seconds_ + level_seconds(cur.bytes + bytes, cur.flops + flops, chip_);
        if (t > budget_) {
            begin_command_buffer();            // the dispatch opens a new command buffer and level
            conflict = false;
            ++stats_.levels;
            per_level_.emplace_back();
        }
    }
    if (conflict) barrier();
    if (stats_.levels == 0) {
        stats_.levels = 1;
        per_level_.emplace_back();
    }
    cb_->dispatch(kernel, groups, threads, args, tg_memory, flops);
    ++cb_dispatches_;
    level_.insert(level_.end(), mine.begin(), mine.end());
    ++stats_.dispatches;
    stats_.flops += flops;
    per_level_.back().flops += flops;
    per_level_.back().bytes += bytes;
    for (const Arg& a : args) {
        stats_.bytes_read += a.read;
        stats_.bytes_written += a.written;
    }
}

void Encoder::barrier() {
    if (level_.empty()) return;   // consecutive barriers collapse
    cb_->barrier();
    level_.clear();
    closed_seconds_ += level_seconds(per_level_.back().bytes, per_level_.back().flops, chip_);
    ++stats_.levels;
    per_level_.emplace_back();
}

void Encoder::commit() {
    if (own_.empty()) throw DeviceError("gpu::Encoder::commit: the command buffer is the caller's");
    own_.back()->commit();
}

void Encoder::wait() {
    if (own_.empty()) throw DeviceError("gpu::Encoder::wait: the command buffer is the caller's");
    waited_ = true;
    std::string first;
    for (size_t i = 0; i < own_.size(); ++i) {
        try {
            own_[i]->wait();
        } catch (const DeviceError& e) {
            if (first.empty())
                first = own_.size() == 1 ? std::string(e.what())
                                         : "command buffer " + std::to_string(i + 1) + " of " +
                                               std::to_string(own_.size()) + ": " + e.what();
        }
    }
    if (!first.empty()) throw DeviceError(first);
}

}  // namespace qwenmetal::gpu

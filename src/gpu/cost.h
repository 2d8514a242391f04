// The GPU time model of a command buffer, and the budget that keeps every command buffer far below
// macOS's GPU watchdog.
//
// macOS aborts a command buffer that holds the GPU too long (seconds; the error is
// kIOGPUCommandBufferCallbackErrorImpactingInteractivity or a timeout), and a process that caused it
// has its later command buffers ignored until it makes a new queue. A prefill chunk of thousands of rows
// over every layer, or one attention dispatch over a long context, is far beyond that on the slowest
// Apple GPU. So the graph cuts long work into command buffers committed back to back (no host wait
// between them) against a modelled time, and SimDevice fails any command buffer whose modelled time
// exceeds a budget (docs/metal.md, "Runtime limits").
//
// The model: a command buffer is its dependency levels run one after another; the dispatches of one level
// overlap, so a level costs max(bytes / bandwidth, flops / peak) plus a fixed per-level latency. Bytes and
// flops are what the host functions declare. Modelled, not measured: it assumes a kernel reaches the chip's
// peak, so real kernels take longer — the budget leaves a 10x margin below the watchdog for that.
#pragma once
#include <algorithm>
#include <cstdint>

namespace qwenmetal::gpu {

struct ChipModel {
    const char* name;
    double bandwidth_gbs;     // memory bandwidth, GB/s
    double peak_tflops;       // FP32 arithmetic peak (the simdgroup_matrix rate on M1-M4), TFLOP/s
    double level_latency_s;   // per dependency level: a barrier's drain and refill
};

// The slowest Apple GPU the project supports: the 7-core M1 (MacBook Air 2020): LPDDR4X-4266 on a 128-bit
// bus (68.25 GB/s), 7 cores x 128 FP32 lanes x 2 x 1.278 GHz = 2.29 TFLOP/s. The level latency is the one
// calibrated for the decode model (python/qwenmetal/metal_backend.py, LEVEL_LATENCY_S).
inline constexpr ChipModel kSlowestChip{"M1 (7-core GPU)", 68.25, 2.29, 4.0e-6};

// One level's modelled seconds on `chip`.
inline double level_seconds(uint64_t bytes, uint64_t flops, const ChipModel& chip) {
    return std::max(double(bytes) / (chip.bandwidth_gbs * 1e9), double(flops) / (chip.peak_tflops * 1e12)) +
           chip.level_latency_s;
}

// What SimDevice fails (a command buffer modelled above it on kSlowestChip), well under the watchdog.
inline constexpr double kWatchdogBudgetSeconds = 0.5;
// What the graph aims each command buffer at: half the budget, so the check keeps a margin.
inline constexpr double kCommandBufferTargetSeconds = 0.25;

}  // namespace qwenmetal::gpu

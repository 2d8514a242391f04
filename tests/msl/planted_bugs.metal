// Planted bugs (tests/test_sim_planted.py): each kernel has one mistake a real GPU would hide or
// corrupt on. The simulator must report every one with the kernel name and the source line;
// the line carrying the mistake is marked "BUG:<name>" so the test can find it.
#include <metal_stdlib>
using namespace metal;

// A barrier inside a branch only half of the threadgroup takes.
kernel void divergent_barrier(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
    threadgroup float t[64];
    t[tid] = float(tid);
    if (tid < 32) {
        threadgroup_barrier(mem_flags::mem_threadgroup);  // BUG:divergent-barrier
    }
    y[tid] = t[tid];
}

// Thread i reads the slot thread i-1 wrote, with no barrier in between. In forward order every
// writer runs before its reader, so the forward schedule computes the right answer; the reverse
// and random schedules read slots nobody has written yet.
kernel void missing_barrier(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                            uint tid [[thread_index_in_threadgroup]], uint gid [[thread_position_in_grid]]) {
    threadgroup float t[64];
    t[tid] = x[gid];
    // BUG:missing-barrier belongs here: threadgroup_barrier(mem_flags::mem_threadgroup);
    y[gid] = t[tid == 0 ? 0 : tid - 1];  // BUG:missing-barrier-read
}

// The same missing barrier where no slot is ever unwritten: a tile reused across loop iterations
// without the barrier that must separate the last read of one iteration from the next write.
// Nothing is poisoned; only the result depends on the schedule.
kernel void missing_barrier_reuse(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                                  uint tid [[thread_index_in_threadgroup]], uint gid [[thread_position_in_grid]]) {
    threadgroup float t[64];
    float acc = 0.0f;
    for (uint it = 0; it < 3; ++it) {
        t[tid] = x[gid] * float(it + 1);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        acc += t[(tid + 1) % 64];
        // BUG:missing-barrier-reuse: threadgroup_barrier(mem_flags::mem_threadgroup) is needed here
    }
    y[gid] = acc;
}

// Only the first 32 slots are written; every thread reads its own.
kernel void uninit_tg_read(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
    threadgroup float t[64];
    if (tid < 32) {
        t[tid] = 1.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    y[tid] = t[tid] * 2.0f;  // BUG:uninit-read
}

// A stencil without a bounds check: the last thread reads one element past the end of x.
kernel void oob_read(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                     uint i [[thread_position_in_grid]]) {
    y[i] = x[i] + x[i + 1];  // BUG:oob-read
}

// A SIMD-group reduction taken by only half of the SIMD-group.
kernel void divergent_simd(device float* y [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
    float v = float(lane);
    if (lane < 16) {
        v = simd_sum(v);  // BUG:divergent-simd
    }
    y[lane] = v;
}

// 36 KB of threadgroup memory (the limit is 32 KB).
kernel void too_much_tg(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
    threadgroup float big[9216];  // BUG:tg-overflow
    big[tid] = 1.0f;
    y[tid] = big[tid];
}

// Reads buffer(1), which the host does not bind.
kernel void reads_two(device const float* x [[buffer(0)]], device const float* z [[buffer(1)]],
                      device float* y [[buffer(2)]], uint i [[thread_position_in_grid]]) {
    y[i] = x[i] + z[i];
}

// A simd_shuffle_down reading past the last lane of a partial SIMD-group (48-thread groups).
kernel void shuffle_inactive(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
    y[tid] = simd_shuffle_down(float(tid), 1);  // BUG:shuffle-inactive
}

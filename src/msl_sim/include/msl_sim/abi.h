// msl_sim ABI: the plain structs shared by the simulator runtime (src/msl_sim/runtime.cpp, linked
// into qwenmetal._core) and kernel code (metal/*.metal compiled as C++ against the shim headers,
// either linked into _core at build time or loaded at run time as a plugin .so with a C entry
// point). Only fixed-layout C-style data crosses this boundary: no std:: types, no exceptions.
// Any layout change must bump kAbiVersion (plugins built against another version are refused).
#pragma once
#include <cstddef>
#include <cstdint>

namespace msl {

constexpr uint32_t kAbiVersion = 6;
constexpr int kSimdWidth = 32;                   // Apple GPUs: 32-wide SIMD-groups
constexpr uint32_t kMaxThreadsPerGroup = 1024;   // maxTotalThreadsPerThreadgroup upper bound
constexpr uint32_t kMaxThreadgroupMemory = 32768;  // 32 KB on every Apple GPU family
constexpr int kMaxBuffers = 31;                  // Metal argument table: buffer(0) .. buffer(30)
constexpr int kMaxTgVars = 64;                   // kernel-scope threadgroup declarations per kernel
constexpr int kMaxTgArgs = 8;                    // [[threadgroup(n)]] parameters
constexpr int kLogCap = 64;                      // pending "read of poisoned threadgroup slot" entries
constexpr int kBankLogCap = 256;                 // bank counting: a lane's threadgroup accesses kept per sync interval

struct Lane;
struct Group;

// Computes the results of one SIMD-group collective for every active lane. `lanes` has 32
// entries (nullptr where the lane does not exist); `active` has bit i set for lanes taking part.
// Returns nullptr, or an error message (e.g. a shuffle reading an inactive lane).
typedef const char* (*ResolveFn)(Lane* const* lanes, uint32_t active);

enum LaneState : uint8_t { LANE_RUN = 0, LANE_AT_SIMD = 1, LANE_AT_BARRIER = 2, LANE_DONE = 3 };

// An access to a threadgroup slot that still held the poison pattern when it was indexed. If
// the slot still holds poison at the thread's next synchronisation point, the access was a read
// of memory no thread had written (uninitialised, or written by another thread without a
// barrier in between).
struct AccessEntry {
    const void* addr;
    uint32_t size;
    uint8_t poison;
    uint8_t pad_[3];
    int32_t line;
    const char* file;
    const char* name;
};

struct Lane {
    uint8_t state;
    uint8_t pad_[3];
    uint32_t index;             // thread_index_in_threadgroup
    uint32_t lane;              // thread_index_in_simdgroup
    uint32_t sg;                // simdgroup_index_in_threadgroup
    uint32_t tpitg[3];          // thread_position_in_threadgroup
    uint32_t tpig[3];           // thread_position_in_grid
    Group* grp;
    // the synchronisation point the lane is parked at
    const char* op;             // "simd_sum", "threadgroup_barrier", ...
    const char* file;
    int32_t line;
    int32_t pad2_;
    ResolveFn resolve;
    const void* in;
    void* out;
    int64_t aux;
    // checked mode: pending poisoned-slot accesses
    int32_t nlog;
    int32_t pad3_;
    AccessEntry log[kLogCap];
    // bank counting (nullptr: off): the lane's threadgroup-memory accesses since its last synchronisation
    // point, one entry each: byte offset into the group's arena (bits 0-15), bytes (bits 16-30), bit 31 set
    // when the entry continues the previous access (the second element of a simdgroup_load lane)
    uint32_t* banks;
    int32_t nbanks;
    int32_t pad4_;
    uint64_t banks_dropped;     // accesses past kBankLogCap in one interval (not evaluated)
};

struct Buffer {
    void* ptr;                  // nullptr: not bound
    uint64_t size;              // bytes
    int32_t is_params;          // bound with setBytes
    int32_t pad_;
};

struct TgVar {
    const void* key;
    uint32_t off, size;
    int32_t line;
    int32_t pad_;
    const char* name;
};

struct Api {
    uint32_t abi_version;
    // Switch from the lane's fiber to the scheduler; returns when the scheduler resumes it.
    void (*park)(Lane* l);
    // Report an error for this lane and abandon its fiber (never returns).
    void (*fail)(Lane* l, const char* msg, const char* file, int line);
};

struct Group {
    const Api* api;
    void* rt;                   // the runtime's own state for this group (opaque to kernels)
    const char* kernel;         // kernel name as looked up by the host
    Buffer* bufs;
    int32_t nbufs;
    int32_t checked;            // kernel compiled in checked mode
    uint32_t tgpig[3];          // threadgroup_position_in_grid
    uint32_t tg_size[3];        // threads_per_threadgroup
    uint32_t grid_tgs[3];       // threadgroups_per_grid
    uint32_t nthreads, nsg;
    char* arena;                // threadgroup memory of this group, poisoned at group start
    uint32_t arena_cap;         // kMaxThreadgroupMemory
    uint32_t arena_used;
    int32_t nvars;
    int32_t ntg_args;
    TgVar vars[kMaxTgVars];
    uint32_t tg_arg_off[kMaxTgArgs];
    uint32_t tg_arg_size[kMaxTgArgs];
    uint64_t simd_ops;          // counters, summed by the runtime
    uint64_t barriers;
};

// One kernel entry point: sets the plugin's current lane and calls the kernel with every
// argument bound through its default (see shim: [[buffer(i)]] etc.).
typedef void (*KernelFn)(Lane* l);

struct KernelInfo {
    const char* name;           // host name (INSTANTIATE_KERNEL's first argument, or the function name)
    KernelFn fn;
    const char* file;           // source file and line of the instantiation / definition
    int32_t line;
    int32_t checked;
    uint32_t max_threads;       // [[max_total_threads_per_threadgroup(N)]]: N; 0 when the kernel declares none
    uint32_t pad_;
    // the kernel library's "a dispatch counts banks" flag (msl::g_bank_counting of its shared object): the
    // runtime raises it while a counting dispatch runs, so the accesses of every other dispatch cost one load
    int* bank_counting;
};

struct KernelTable {
    uint32_t abi_version;
    uint32_t count;
    const KernelInfo* kernels;
    const char* compiler;       // __VERSION__ of the compiler that built the kernels
};

}  // namespace msl

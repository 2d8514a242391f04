// msl_sim runtime: executes Metal compute kernels (compiled as C++ against the shim in
// src/msl_sim/include) on the CPU with Metal's execution model, and records what a Metal
// command buffer would do. Part of qwenmetal._core on every platform.
//
//   Library        kernels linked in at build time (builtin()) or loaded from a plugin .so
//                  built at run time (load()), looked up by their Metal host name
//   CommandBuffer  encodes dispatches (dispatchThreadgroups) separated by memory barriers
//                  (dependency levels, as in a concurrent compute encoder); executes each
//                  dispatch when created with execute=true, or only records it (encode-only:
//                  costing a whole model without its weights); keeps per-dispatch counters
//
// Errors (a kernel's, or a host's misuse) are thrown as msl::SimError with the kernel name,
// the threadgroup and the source line.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "msl_sim/abi.h"

namespace msl {

class SimError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

class Library {
  public:
    static std::shared_ptr<Library> builtin();                       // kernels linked into _core
    static std::shared_ptr<Library> load(const std::string& path);   // plugin .so (msl_library_plugin)
    ~Library();

    const KernelInfo* find(const std::string& name) const;           // nullptr if absent
    const KernelInfo& get(const std::string& name) const;            // throws SimError listing names
    std::vector<const KernelInfo*> kernels() const { return kernels_; }
    const std::string& origin() const { return origin_; }
    const std::string& compiler() const { return compiler_; }

    // threadgroup memory a kernel was seen to use (static declarations do not depend on the
    // data, so one execution tells it for good); -1 when it has never run
    int64_t observed_tg_memory(const std::string& name) const;
    void observe_tg_memory(const std::string& name, uint32_t bytes);

  private:
    Library() = default;
    void add_table(const KernelTable* t, const std::string& where);
    std::vector<const KernelInfo*> kernels_;
    std::map<std::string, const KernelInfo*> by_name_;
    std::string origin_, compiler_;
    void* handle_ = nullptr;
    mutable std::mutex mu_;
    std::map<std::string, uint32_t> tg_seen_;
};

enum class Schedule { forward, reverse, random };
Schedule parse_schedule(const std::string& s);

struct Binding {
    void* ptr = nullptr;        // host memory (execute mode); nullptr with size > 0: virtual buffer
    uint64_t size = 0;          // bytes bound
    uint64_t addr = 0;          // identity for hazard checks: the host address, or a virtual one
    int64_t read = -1;          // bytes the host wrapper declares the kernel reads (-1: undeclared)
    int64_t written = -1;       // bytes it declares the kernel writes (-1: undeclared)
    bool is_params = false;     // setBytes: the runtime keeps a copy
    bool bound = false;
};

struct DispatchOptions {
    Schedule schedule = Schedule::forward;
    uint64_t seed = 0;
    int workers = 0;                        // 0: all cores
    std::vector<uint32_t> tg_memory;        // [[threadgroup(i)]] lengths (setThreadgroupMemoryLength)
    bool count_banks = false;               // count threadgroup-memory bank conflicts (BankCounts)
};

// Threadgroup-memory bank conflicts of one dispatch (DispatchOptions::count_banks; docs/metal.md, "What the
// simulator counts"). Threadgroup memory is modelled as 32 banks of 4-byte words (word address mod 32). A
// SIMD-group access is the n-th threadgroup access of each lane of one SIMD-group since their last
// synchronisation point (the lanes run in lock step between them). Its cycles are the largest number of
// distinct words any one bank serves (one word read by several lanes is a broadcast); the extra cycles
// (replays) are those above ceil(distinct words / 32), the fewest any layout of that many words could take.
struct BankCounts {
    uint64_t accesses = 0;                  // SIMD-group accesses evaluated
    uint64_t conflicted = 0;                // of which with at least one replay
    uint64_t replays = 0;                   // extra cycles summed over them
    uint64_t dropped = 0;                   // lane accesses past kBankLogCap in one interval (not evaluated)
    uint64_t max_degree = 0;                // largest number of distinct words on one bank in one access
};

struct BufferRecord {
    int index;
    uint64_t size;
    int64_t read, written;
    bool is_params;
};

struct DispatchRecord {
    std::string kernel;
    int level = 0;                          // dependency level: memory barriers encoded before it
    uint32_t groups[3] = {1, 1, 1};
    uint32_t threads_per_group[3] = {1, 1, 1};
    uint64_t threads = 0;
    int64_t tg_memory = -1;                 // bytes per threadgroup (-1: unknown in encode-only)
    std::vector<BufferRecord> buffers;
    uint64_t bytes_read = 0, bytes_written = 0;   // sums of the declared ranges
    bool executed = false;
    uint64_t simd_ops = 0;                  // SIMD-group collectives resolved (per SIMD-group)
    uint64_t barriers = 0;                  // threadgroup barriers released (per threadgroup)
    double seconds = 0.0;                   // wall time of the simulation
    bool banks_counted = false;             // DispatchOptions::count_banks was set (and it executed)
    BankCounts banks;
    // set by gpu::SimDevice on the records it keeps: the FLOPs the host function declared, and the index of
    // the command buffer (in commit order since the device was made)
    uint64_t flops = 0;
    int64_t command_buffer = -1;
};

class CommandBuffer {
  public:
    explicit CommandBuffer(bool execute = true, bool concurrent = true) : execute_(execute), concurrent_(concurrent) {}
    const DispatchRecord& dispatch(Library& lib, const std::string& kernel, const uint32_t groups[3],
                                   const uint32_t threads[3], std::vector<Binding> bindings,
                                   const DispatchOptions& opt = DispatchOptions());
    void barrier();                          // memoryBarrierWithScope(Buffers): next level
    bool executes() const { return execute_; }
    bool concurrent() const { return concurrent_; }
    int level() const { return level_; }
    const std::vector<DispatchRecord>& records() const { return records_; }

  private:
    struct Access {
        uint64_t lo, hi;
        bool write;
        size_t dispatch;
        int index;
    };
    bool execute_, concurrent_;
    int level_ = 0;
    int in_level_ = 0;
    std::vector<DispatchRecord> records_;
    std::vector<Access> level_accesses_;
};

// Runs one dispatch now (what CommandBuffer does in execute mode).
void execute(Library& lib, const KernelInfo& k, const uint32_t groups[3], const uint32_t threads[3],
             const std::vector<Binding>& bindings, const DispatchOptions& opt, DispatchRecord& rec);

std::string fiber_switch_name();             // "x86-64 assembly" or "ucontext"

}  // namespace msl

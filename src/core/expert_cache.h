// The expert cache: routed experts of a model too large for memory, streamed from the checkpoint's
// files into a fixed number of slots per MoE layer, keyed by (layer, expert). Device-agnostic: the
// slot memory is the caller's (CPU heap or a device buffer's host-visible contents); the cache only
// decides which expert lives in which slot and fills the misses with parallel pread on a small I/O
// thread pool. Used by the CPU engine and the GPU streaming graph (docs/streaming.md).
//
// Thread safety: one acquire (or stats/reset_stats) at a time per cache; callers serialise. The I/O
// pool's threads only ever touch the slots of the acquire that is running.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace qwenmetal {

class ThreadPool;

// One part of an expert (a weight, scales or biases matrix, or a dense matrix) in a checkpoint file:
// expert e's bytes are [offset + e * stride, + nbytes) of files[file].
struct ExpertPart {
    int32_t file = 0;
    uint64_t offset = 0, stride = 0, nbytes = 0;
};

// LRU: evict the least recently used slot. LFU: evict the slot whose expert was asked for least
// often since the cache was made (counts survive eviction), ties broken by LRU. OS: no reuse, every
// acquire preads every expert (the OS page cache decides what is fast).
enum class CachePolicy { LRU, LFU, OS };

struct ExpertCacheOptions {
    int slots_per_layer = 1;
    CachePolicy policy = CachePolicy::LRU;
    int io_threads = 4;
    bool direct_io = false;   // Linux O_DIRECT (aligned bounce buffers), macOS F_NOCACHE; not with OS
    int num_experts = 0;      // experts per MoE layer (required: acquire checks ids against it)
    uint64_t read_chunk = uint64_t(1) << 20;   // bytes per read task: big parts are split so the I/O threads share them
};

// lookups = experts asked for; hits + misses = lookups. LRU/LFU: a hit is an expert already in a slot.
// OS: a hit is an expert whose every part the page cache held (Linux: preadv2 RWF_NOWAIT read it all;
// macOS has no such probe and counts every lookup a miss). bytes_read: bytes read from the files into
// slots (OS: every lookup's bytes, hits included); io_seconds: wall time of the reads.
struct ExpertCacheStats {
    uint64_t lookups = 0, hits = 0, misses = 0, bytes_read = 0;
    double io_seconds = 0;
};

class ExpertCache {
public:
    // files: paths opened read-only once; layers[l]: that MoE layer's parts (the layer index is the
    // model's layer index; non-MoE layers have no entry); bases[l][p] points at slots_per_layer *
    // parts[p].nbytes bytes of the caller's memory, slot s of part p at bases[l][p] + s * parts[p].nbytes
    // (the slots of part p form a [S, ...] stack like the checkpoint's [E, ...] tensor).
    // Bad arguments throw std::invalid_argument naming them; a file that cannot be opened, or is too
    // short for its parts, throws std::runtime_error naming it.
    ExpertCache(std::vector<std::string> files, std::map<int, std::vector<ExpertPart>> layers,
                ExpertCacheOptions opt, std::map<int, std::vector<void*>> bases);
    ~ExpertCache();
    ExpertCache(const ExpertCache&) = delete;
    ExpertCache& operator=(const ExpertCache&) = delete;

    int slots_per_layer() const { return opt_.slots_per_layer; }
    const ExpertCacheOptions& options() const { return opt_; }

    // experts[0..n): distinct ids in [0, num_experts), n <= slots_per_layer. Makes all n resident at
    // once (none evicted by this call), loading the misses with parallel pread on the I/O pool;
    // slots[i] = slot of experts[i]. Bad arguments throw std::invalid_argument before anything changes;
    // I/O errors throw std::runtime_error naming file and offset, the failed slots left empty (the
    // experts that did load, and every hit, stay cached).
    void acquire(int layer, const int32_t* experts, int n, int32_t* slots);

    ExpertCacheStats stats() const { return stats_; }
    void reset_stats() { stats_ = ExpertCacheStats{}; }

private:
    struct File {
        std::string path;
        int fd = -1;
        uint64_t size = 0;
    };
    struct Layer {
        std::vector<ExpertPart> parts;
        std::vector<uint8_t*> bases;
        std::vector<int32_t> slot_expert;   // [S]: expert in the slot, -1 empty
        std::vector<uint64_t> slot_used;    // [S]: tick of the slot's last acquire (LRU, LFU ties)
        std::vector<uint64_t> slot_pin;     // [S]: acquire number that last claimed the slot
        std::vector<int32_t> expert_slot;   // [E]: slot of the expert, -1 not resident
        std::vector<uint64_t> expert_count; // [E]: times asked for (LFU)
        std::vector<uint64_t> expert_seen;  // [E]: acquire number that last named it (distinctness)
    };
    struct Read {            // one part of one missing expert
        int32_t slot_index;  // index into the call's misses
        int32_t part;
        std::string error;   // empty: read fully
        bool cached = true;  // OS policy: the page cache held all of it
    };
    int victim(Layer& L) const;
    void read_part(const Layer& L, int32_t expert, int32_t slot, Read& r, int thread);

    std::vector<File> files_;
    std::map<int, Layer> layers_;
    ExpertCacheOptions opt_;
    std::unique_ptr<ThreadPool> pool_;
    std::vector<void*> bounce_;       // direct_io: one aligned bounce buffer per I/O thread
    uint64_t tick_ = 0;
    ExpertCacheStats stats_;
};

CachePolicy parse_cache_policy(const std::string& name);   // "lru" | "lfu" | "os"; invalid_argument otherwise
const char* cache_policy_name(CachePolicy p);

}  // namespace qwenmetal

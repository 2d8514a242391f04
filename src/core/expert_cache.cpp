#include "core/expert_cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "core/threadpool.h"

namespace qwenmetal {

namespace {

// O_DIRECT wants the file offset, the length and the buffer aligned to the device's logical block;
// 4096 covers every block size in use (512 and 4096).
constexpr uint64_t kDirectAlign = 4096;

uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

std::string where(const std::string& path, uint64_t offset, uint64_t len) {
    return "expert cache: reading '" + path + "' at offset " + std::to_string(offset) + " (" +
           std::to_string(len) + " bytes)";
}

// pread until `len` bytes or end of file (retrying EINTR and short reads). Returns the bytes read, or
// -errno. `probe`: try a page-cache-only read first (Linux RWF_NOWAIT); `cached` stays true only if
// that read got every byte.
int64_t pread_full(int fd, uint8_t* dst, uint64_t len, uint64_t off, bool probe, bool& cached) {
    uint64_t got = 0;
#if defined(__linux__) && defined(RWF_NOWAIT)
    if (probe) {
        for (;;) {
            iovec iov{dst, size_t(len)};
            const ssize_t r = preadv2(fd, &iov, 1, off_t(off), RWF_NOWAIT);
            if (r < 0 && errno == EINTR) continue;
            if (r > 0) got = uint64_t(r);
            break;          // EAGAIN (not all cached), EOPNOTSUPP (filesystem without it): read normally
        }
        if (got < len) cached = false;
    }
#else
    if (probe) cached = false;   // no page-cache probe on this OS: every read counts as a miss
#endif
    while (got < len) {
        const ssize_t r = pread(fd, dst + got, size_t(len - got), off_t(off + got));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -int64_t(errno);
        }
        if (r == 0) break;
        got += uint64_t(r);
    }
    return int64_t(got);
}

}  // namespace

CachePolicy parse_cache_policy(const std::string& name) {
    if (name == "lru") return CachePolicy::LRU;
    if (name == "lfu") return CachePolicy::LFU;
    if (name == "os") return CachePolicy::OS;
    throw std::invalid_argument("expert cache policy must be 'lru', 'lfu' or 'os', got '" + name + "'");
}

const char* cache_policy_name(CachePolicy p) {
    switch (p) {
        case CachePolicy::LRU: return "lru";
        case CachePolicy::LFU: return "lfu";
        case CachePolicy::OS: return "os";
    }
    return "?";
}

ExpertCache::ExpertCache(std::vector<std::string> files, std::map<int, std::vector<ExpertPart>> layers,
                         ExpertCacheOptions opt, std::map<int, std::vector<void*>> bases)
    : opt_(opt) {
    const int E = opt.num_experts, S = opt.slots_per_layer;
    if (E < 1) throw std::invalid_argument("expert cache: num_experts must be >= 1, got " + std::to_string(E));
    if (S < 1 || S > E)
        throw std::invalid_argument("expert cache: slots_per_layer must be in [1, num_experts=" + std::to_string(E) +
                                    "], got " + std::to_string(S));
    if (opt.io_threads < 1 || opt.io_threads > 64)
        throw std::invalid_argument("expert cache: io_threads must be in [1, 64], got " +
                                    std::to_string(opt.io_threads));
    if (opt.read_chunk < 1) throw std::invalid_argument("expert cache: read_chunk must be >= 1");
    if (opt.direct_io && opt.policy == CachePolicy::OS)
        throw std::invalid_argument("expert cache: direct_io bypasses the page cache that policy 'os' relies on");
    if (bases.size() != layers.size())
        throw std::invalid_argument("expert cache: bases must have one entry per layer of layers");
    for (auto& [l, parts] : layers) {
        const std::string ln = "expert cache: layer " + std::to_string(l);
        auto b = bases.find(l);
        if (b == bases.end()) throw std::invalid_argument(ln + " has parts but no entry in bases");
        if (parts.empty()) throw std::invalid_argument(ln + ": parts is empty");
        if (b->second.size() != parts.size())
            throw std::invalid_argument(ln + ": bases has " + std::to_string(b->second.size()) + " pointers for " +
                                        std::to_string(parts.size()) + " parts");
        Layer L;
        for (size_t p = 0; p < parts.size(); ++p) {
            const ExpertPart& part = parts[p];
            const std::string pn = ln + " part " + std::to_string(p);
            if (part.file < 0 || size_t(part.file) >= files.size())
                throw std::invalid_argument(pn + ": file index " + std::to_string(part.file) + " out of range [0, " +
                                            std::to_string(files.size()) + ")");
            if (part.nbytes == 0) throw std::invalid_argument(pn + ": nbytes is 0");
            if (E > 1 && part.stride < part.nbytes)
                throw std::invalid_argument(pn + ": stride " + std::to_string(part.stride) + " < nbytes " +
                                            std::to_string(part.nbytes) + " (experts would overlap)");
            if (!b->second[p]) throw std::invalid_argument(pn + ": bases pointer is null");
            L.bases.push_back(static_cast<uint8_t*>(b->second[p]));
        }
        L.parts = std::move(parts);
        L.slot_expert.assign(size_t(S), -1);
        L.slot_used.assign(size_t(S), 0);
        L.slot_pin.assign(size_t(S), 0);
        L.expert_slot.assign(size_t(E), -1);
        L.expert_count.assign(size_t(E), 0);
        L.expert_seen.assign(size_t(E), 0);
        layers_.emplace(l, std::move(L));
    }
    struct Closer {   // closes what was opened if a later file or check throws
        std::vector<File>& f;
        bool armed = true;
        ~Closer() {
            if (armed)
                for (File& x : f) ::close(x.fd);
        }
    } closer{files_};
    for (std::string& path : files) {
        int flags = O_RDONLY | O_CLOEXEC;
#if defined(__linux__)
        if (opt.direct_io) flags |= O_DIRECT;
#endif
        const int fd = ::open(path.c_str(), flags);
        if (fd < 0) {
            const int err = errno;
            if (opt.direct_io && err == EINVAL)
                throw std::runtime_error("expert cache: '" + path +
                                         "' is on a filesystem without O_DIRECT; use direct_io=false");
            throw std::runtime_error("expert cache: cannot open '" + path + "': " + std::strerror(err));
        }
        struct stat st {};
        if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
            ::close(fd);
            throw std::runtime_error("expert cache: '" + path + "' is not a regular file");
        }
#if defined(__APPLE__)
        if (opt.direct_io) ::fcntl(fd, F_NOCACHE, 1);   // advisory: reads bypass the unified buffer cache
#endif
        files_.push_back(File{std::move(path), fd, uint64_t(st.st_size)});
    }
    for (const auto& [l, L] : layers_)
        for (size_t p = 0; p < L.parts.size(); ++p) {
            const ExpertPart& part = L.parts[p];
            const File& f = files_[size_t(part.file)];
            const uint64_t end = part.offset + uint64_t(E - 1) * part.stride + part.nbytes;
            if (end > f.size)
                throw std::runtime_error("expert cache: '" + f.path + "' is " + std::to_string(f.size) +
                                         " bytes but layer " + std::to_string(l) + " part " + std::to_string(p) +
                                         " of expert " + std::to_string(E - 1) + " ends at byte " +
                                         std::to_string(end) + " (truncated?)");
        }
    pool_ = std::make_unique<ThreadPool>(opt.io_threads, ThreadPool::Wait::Sleep);
    if (opt.direct_io) {
        for (int t = 0; t < opt.io_threads; ++t) {
            void* p = std::aligned_alloc(kDirectAlign, round_up(opt.read_chunk, kDirectAlign) + kDirectAlign);
            if (!p) {
                for (void* q : bounce_) std::free(q);
                throw std::bad_alloc();
            }
            bounce_.push_back(p);
        }
    }
    closer.armed = false;
}

ExpertCache::~ExpertCache() {
    for (File& f : files_) ::close(f.fd);
    for (void* p : bounce_) std::free(p);
}

// A slot for a missing expert: an empty one first, else the policy's choice among the slots this
// acquire has not claimed (there is one: n <= slots_per_layer).
int ExpertCache::victim(Layer& L) const {
    int best = -1;
    for (int s = 0; s < opt_.slots_per_layer; ++s) {
        if (L.slot_pin[size_t(s)] == tick_) continue;
        if (L.slot_expert[size_t(s)] < 0) return s;
        if (best < 0) {
            best = s;
            continue;
        }
        const uint64_t cs = L.expert_count[size_t(L.slot_expert[size_t(s)])];
        const uint64_t cb = L.expert_count[size_t(L.slot_expert[size_t(best)])];
        const bool older = L.slot_used[size_t(s)] < L.slot_used[size_t(best)];
        if (opt_.policy == CachePolicy::LFU ? (cs < cb || (cs == cb && older)) : older) best = s;
    }
    return best;
}

void ExpertCache::acquire(int layer, const int32_t* experts, int n, int32_t* slots) {
    auto it = layers_.find(layer);
    if (it == layers_.end())
        throw std::invalid_argument("expert cache: layer " + std::to_string(layer) + " has no routed experts");
    Layer& L = it->second;
    const int S = opt_.slots_per_layer, E = opt_.num_experts;
    if (n < 0 || n > S)
        throw std::invalid_argument("expert cache: n must be in [0, slots_per_layer=" + std::to_string(S) + "], got " +
                                    std::to_string(n));
    if (n == 0) return;
    if (!experts || !slots) throw std::invalid_argument("expert cache: experts and slots must not be null");
    const uint64_t call = ++tick_;
    for (int i = 0; i < n; ++i) {
        const int32_t e = experts[i];
        if (e < 0 || e >= E)
            throw std::invalid_argument("expert cache: experts[" + std::to_string(i) + "] = " + std::to_string(e) +
                                        " out of range [0, " + std::to_string(E) + ")");
        if (L.expert_seen[size_t(e)] == call)
            throw std::invalid_argument("expert cache: experts must be distinct, " + std::to_string(e) + " repeats");
        L.expert_seen[size_t(e)] = call;
    }

    // hits claim their slots first, so no miss of this call can evict them
    std::vector<int32_t> miss;   // indices i of experts to read
    for (int i = 0; i < n; ++i) {
        const int32_t e = experts[i];
        ++stats_.lookups;
        ++L.expert_count[size_t(e)];
        const int32_t s = opt_.policy == CachePolicy::OS ? -1 : L.expert_slot[size_t(e)];
        if (s >= 0) {
            ++stats_.hits;
            slots[i] = s;
            L.slot_pin[size_t(s)] = call;
            L.slot_used[size_t(s)] = call;
        } else {
            miss.push_back(i);
        }
    }
    for (int32_t i : miss) {
        // OS: no reuse, expert i simply takes slot i
        const int s = opt_.policy == CachePolicy::OS ? i : victim(L);
        const int32_t old = L.slot_expert[size_t(s)];
        if (old >= 0) L.expert_slot[size_t(old)] = -1;
        L.slot_expert[size_t(s)] = -1;   // empty until its read succeeds
        L.slot_pin[size_t(s)] = call;
        slots[i] = s;
    }
    if (miss.empty()) return;

    // one task per read_chunk bytes of every part of every missing expert
    struct Task {
        int32_t m, part;
        uint64_t begin, len;
    };
    std::vector<Task> tasks;
    for (size_t m = 0; m < miss.size(); ++m)
        for (size_t p = 0; p < L.parts.size(); ++p)
            for (uint64_t b = 0; b < L.parts[p].nbytes; b += opt_.read_chunk)
                tasks.push_back(Task{int32_t(m), int32_t(p), b, std::min(opt_.read_chunk, L.parts[p].nbytes - b)});
    std::vector<std::string> errors(tasks.size());
    std::vector<char> cached(tasks.size(), 1);
    const bool probe = opt_.policy == CachePolicy::OS;
    const auto t0 = std::chrono::steady_clock::now();
    pool_->run(int64_t(tasks.size()), [&](int64_t t, int thread) {
        const Task& k = tasks[size_t(t)];
        const int32_t i = miss[size_t(k.m)];
        const ExpertPart& part = L.parts[size_t(k.part)];
        const File& f = files_[size_t(part.file)];
        const uint64_t off = part.offset + uint64_t(experts[i]) * part.stride + k.begin;
        uint8_t* dst = L.bases[size_t(k.part)] + uint64_t(slots[i]) * part.nbytes + k.begin;
        bool hit = true;
        if (opt_.direct_io) {
            // read the aligned superset of [off, off + len) into this thread's bounce buffer
            const uint64_t a0 = off / kDirectAlign * kDirectAlign;
            const uint64_t alen = round_up(off + k.len, kDirectAlign) - a0;
            uint8_t* bounce = static_cast<uint8_t*>(bounce_[size_t(thread)]);
            const int64_t r = pread_full(f.fd, bounce, alen, a0, false, hit);
            if (r < 0) {
                errors[size_t(t)] = where(f.path, off, k.len) + ": " + std::strerror(int(-r));
            } else if (uint64_t(r) < off - a0 + k.len) {
                errors[size_t(t)] = where(f.path, off, k.len) + ": end of file (truncated?)";
            } else {
                std::memcpy(dst, bounce + (off - a0), size_t(k.len));
            }
        } else {
            const int64_t r = pread_full(f.fd, dst, k.len, off, probe, hit);
            if (r < 0)
                errors[size_t(t)] = where(f.path, off, k.len) + ": " + std::strerror(int(-r));
            else if (uint64_t(r) < k.len)
                errors[size_t(t)] = where(f.path, off, k.len) + ": end of file after " + std::to_string(r) +
                                    " bytes (truncated?)";
        }
        cached[size_t(t)] = hit ? 1 : 0;
    });
    stats_.io_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    // install the experts whose every task succeeded; the first error (in task order) is thrown
    std::vector<char> ok(miss.size(), 1), all_cached(miss.size(), 1);
    const std::string* first_error = nullptr;
    for (size_t t = 0; t < tasks.size(); ++t) {
        const size_t m = size_t(tasks[t].m);
        if (!errors[t].empty()) {
            ok[m] = 0;
            if (!first_error) first_error = &errors[t];
        } else {
            stats_.bytes_read += tasks[t].len;
        }
        if (!cached[t]) all_cached[m] = 0;
    }
    for (size_t m = 0; m < miss.size(); ++m) {
        const bool hit = probe && ok[m] && all_cached[m];
        ++(hit ? stats_.hits : stats_.misses);
        if (!ok[m] || opt_.policy == CachePolicy::OS) continue;
        const int32_t i = miss[m], s = slots[i];
        L.slot_expert[size_t(s)] = experts[i];
        L.expert_slot[size_t(experts[i])] = s;
        L.slot_used[size_t(s)] = call;
    }
    if (first_error) throw std::runtime_error(*first_error);
}

}  // namespace qwenmetal

#include "core/threadpool.h"

#include "core/fpenv.h"

#include <chrono>
#include <fstream>
#include <set>
#include <string>
#include <utility>

#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define QM_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define QM_PAUSE() asm volatile("yield")
#else
#define QM_PAUSE() ((void)0)
#endif

namespace qwenmetal {

ThreadPool::ThreadPool(int n_threads, Wait wait) : n_(n_threads < 1 ? 1 : n_threads), wait_(wait) {
    for (int i = 1; i < n_; ++i) threads_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        stop_.store(true, std::memory_order_release);
        generation_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
}

// Run tasks of section `gen` until none is left or the section is over. Its fn/ctx/n are read under
// the seqlock: if the caller is already publishing a later section, the read is discarded.
void ThreadPool::work(int id, uint64_t gen) {
    if (sec_end_.load(std::memory_order_acquire) != gen) return;
    const Fn fn = fn_.load(std::memory_order_relaxed);
    void* ctx = ctx_.load(std::memory_order_relaxed);
    const int64_t n = n_tasks_.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (sec_begin_.load(std::memory_order_relaxed) != gen) return;
    const uint64_t tag = (gen & 0xffffffffu) << 32;
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
        if ((t & ~uint64_t(0xffffffffu)) != tag) return;          // another section
        const int64_t task = static_cast<int64_t>(t & 0xffffffffu);
        if (task >= n) return;
        if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire))
            continue;                                              // t reloaded
        fn(ctx, task, id);
        if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == n && wait_ == Wait::Sleep && id != 0) {
            std::lock_guard<std::mutex> lk(done_mu_);   // under the lock: the caller cannot miss it
            done_cv_.notify_one();
        }
        t = ticket_.load(std::memory_order_acquire);
    }
}

namespace {
// Spin this long for the next parallel section before sleeping: decode issues a few hundred short
// sections per token, too close together to sleep in between, but a pool must not burn a core
// when the machine is shared or the caller does something else.
constexpr auto kSpin = std::chrono::microseconds(200);
}  // namespace

void ThreadPool::worker(int id) {
    flush_denormals_this_thread();   // for the worker's lifetime (fpenv.h)
    uint64_t seen = 0;
    for (;;) {
        uint64_t g = generation_.load(std::memory_order_acquire);
        if (g == seen && wait_ == Wait::Spin) {
            const auto t0 = std::chrono::steady_clock::now();
            for (int spin = 0; g == seen; ++spin) {
                QM_PAUSE();
                g = generation_.load(std::memory_order_acquire);
                if ((spin & 63) == 63 && std::chrono::steady_clock::now() - t0 > kSpin) break;
            }
        }
        if (g == seen) {
            std::unique_lock<std::mutex> lk(mu_);
            cv_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
            g = generation_.load(std::memory_order_acquire);
        }
        seen = g;
        if (stop_.load(std::memory_order_acquire)) return;
        work(id, g);
    }
}

void ThreadPool::run_impl(int64_t n_tasks, Fn fn, void* ctx) {
    if (n_tasks <= 0) return;
    const FlushDenormals ftz;   // the caller computes like the workers (fpenv.h), for this call only
    if (n_ == 1 || n_tasks == 1) {
        for (int64_t t = 0; t < n_tasks; ++t) fn(ctx, t, 0);
        return;
    }
    // new section (the previous one is complete: every task claimed and done): seqlock-publish
    // fn/ctx/n, open the ticket, then bump the generation that wakes the workers
    const uint64_t gen = generation_.load(std::memory_order_relaxed) + 1;
    sec_begin_.store(gen, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    fn_.store(fn, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    n_tasks_.store(n_tasks, std::memory_order_relaxed);
    sec_end_.store(gen, std::memory_order_release);
    done_.store(0, std::memory_order_release);
    ticket_.store((gen & 0xffffffffu) << 32, std::memory_order_release);
    {
        std::lock_guard<std::mutex> lk(mu_);
        generation_.store(gen, std::memory_order_release);
    }
    cv_.notify_all();
    work(0, gen);
    // wait for tasks other threads claimed and are still running (not for workers still asleep)
    if (wait_ == Wait::Sleep) {
        std::unique_lock<std::mutex> lk(done_mu_);
        done_cv_.wait(lk, [&] { return done_.load(std::memory_order_acquire) == n_tasks; });
        return;
    }
    for (int spin = 0; done_.load(std::memory_order_acquire) != n_tasks; ++spin) {
        if (spin < 4096) QM_PAUSE();
        else std::this_thread::yield();     // a worker was descheduled mid-task: give it the core
    }
}

int physical_cores() {
    int logical = static_cast<int>(std::thread::hardware_concurrency());
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    std::vector<int> cpus;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        for (int c = 0; c < CPU_SETSIZE; ++c)
            if (CPU_ISSET(c, &set)) cpus.push_back(c);
    }
    if (!cpus.empty()) {
        std::set<std::pair<std::string, std::string>> cores;
        bool ok = true;
        for (int c : cpus) {
            std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/";
            std::ifstream fc(base + "core_id"), fp(base + "physical_package_id");
            std::string core, pkg;
            if (!(fc >> core) || !(fp >> pkg)) { ok = false; break; }
            cores.insert({pkg, core});
        }
        if (ok && !cores.empty()) return static_cast<int>(cores.size());
        return static_cast<int>(cpus.size());
    }
#endif
    return logical > 0 ? logical : 1;
}

}  // namespace qwenmetal

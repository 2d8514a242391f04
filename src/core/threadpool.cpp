#include "core/threadpool.h"

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

ThreadPool::ThreadPool(int n_threads) : n_(n_threads < 1 ? 1 : n_threads) {
    for (int i = 1; i < n_; ++i) threads_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        stop_ = true;
        generation_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
}

void ThreadPool::work(int id) {
    const Fn fn = fn_;
    void* ctx = ctx_;
    for (;;) {
        int64_t t = next_.fetch_add(1, std::memory_order_relaxed);
        if (t >= n_tasks_) break;
        fn(ctx, t, id);
    }
}

namespace {
// Spin this long for the next parallel section before sleeping: decode issues a few hundred short
// sections per token, too close together to sleep in between, but a pool must not burn a core
// when the machine is shared or the caller does something else.
constexpr auto kSpin = std::chrono::microseconds(200);
}  // namespace

void ThreadPool::worker(int id) {
    uint64_t seen = 0;
    for (;;) {
        uint64_t g = generation_.load(std::memory_order_acquire);
        if (g == seen) {
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
        if (stop_) return;
        work(id);
        active_.fetch_sub(1, std::memory_order_acq_rel);
    }
}

void ThreadPool::run_impl(int64_t n_tasks, Fn fn, void* ctx) {
    if (n_tasks <= 0) return;
    if (n_ == 1 || n_tasks == 1) {
        for (int64_t t = 0; t < n_tasks; ++t) fn(ctx, t, 0);
        return;
    }
    fn_ = fn;
    ctx_ = ctx;
    n_tasks_ = n_tasks;
    next_.store(0, std::memory_order_relaxed);
    active_.store(n_ - 1, std::memory_order_relaxed);
    {
        std::lock_guard<std::mutex> lk(mu_);
        generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    work(0);
    // wait for the workers still finishing a task (or not yet woken: they find no task left)
    for (int spin = 0; active_.load(std::memory_order_acquire) != 0; ++spin) {
        if (spin < 4096) QM_PAUSE();
        else std::this_thread::yield();     // a worker was descheduled: give it the core
    }
    fn_ = nullptr;
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

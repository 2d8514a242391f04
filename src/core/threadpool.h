// A persistent pool of worker threads. `run(n, fn)` calls fn(task, thread) for every task in
// [0, n) — tasks are handed out dynamically from an atomic ticket (section number | next task), the
// calling thread works too — and returns when all tasks are done. It does not wait for workers that
// have not woken up yet (on an oversubscribed machine a descheduled worker would otherwise stall
// every section): a late worker reads the section's parameters under a seqlock and can only claim a
// task of that section, by compare-and-swap on the ticket, so it never runs or skips a task of a
// later section. Kernels make each task write its own outputs with a fixed
// summation order, so results never depend on the number of threads or on who ran what.
// Wait::Sleep is for pools whose tasks block (the expert cache's preads): idle workers sleep at once
// instead of spinning for the next section, and the caller sleeps until the last task is done instead of
// spinning on the count.
// Workers compute with denormals flushed to zero, and so does the caller during run() (fpenv.h).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <type_traits>
#include <mutex>
#include <thread>
#include <vector>

namespace qwenmetal {

class ThreadPool {
public:
    using Fn = void (*)(void* ctx, int64_t task, int thread);
    enum class Wait { Spin, Sleep };

    explicit ThreadPool(int n_threads, Wait wait = Wait::Spin);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    int size() const { return n_; }
    // fn(task, thread) for every task; `fn` is any callable, passed by reference (no allocation,
    // so a running forward pass cannot fail half-way on memory)
    template <class F>
    void run(int64_t n_tasks, F&& fn) {
        using G = std::remove_reference_t<F>;
        run_impl(n_tasks, [](void* c, int64_t t, int th) { (*static_cast<G*>(c))(t, th); },
                 const_cast<void*>(static_cast<const void*>(&fn)));
    }

private:
    void run_impl(int64_t n_tasks, Fn fn, void* ctx);
    void worker(int id);
    void work(int id, uint64_t gen);

    int n_;
    Wait wait_;
    std::vector<std::thread> threads_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::atomic<uint64_t> generation_{0};
    std::atomic<uint64_t> ticket_{0};     // (section & 0xffffffff) << 32 | next task
    std::atomic<int64_t> done_{0};        // tasks of the current section completed
    // the current section's parameters, published under a seqlock (sec_begin_ / sec_end_ = its number)
    std::atomic<uint64_t> sec_begin_{0}, sec_end_{0};
    std::atomic<int64_t> n_tasks_{0};
    std::atomic<Fn> fn_{nullptr};
    std::atomic<void*> ctx_{nullptr};
    std::atomic<bool> stop_{false};
    std::mutex done_mu_;                  // Wait::Sleep: the caller waits on done_cv_ for done_ == n
    std::condition_variable done_cv_;
};

// Physical cores available to this process (hyper-threads counted once), at least 1.
int physical_cores();

}  // namespace qwenmetal

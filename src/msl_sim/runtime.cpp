// msl_sim runtime: fibers, the bulk-synchronous threadgroup scheduler, dispatch, command buffers.
// See runtime.h for the interface and docs/verification.md ("Metal simulator") for the model.
//
// Fibers. Every thread of a threadgroup is a fiber with its own mmap'd stack (64 KB by default,
// QWENMETAL_SIM_STACK_KB; a PROT_NONE guard page below each). On x86-64 ELF hosts the switch is
// the 15-instruction routine below: it saves the callee-saved registers (what the SysV ABI
// requires a call to preserve) and swaps stacks. The MXCSR / x87 control words are not swapped:
// all fibers of a worker share them, and kernels cannot change them. Elsewhere, or with
// QWENMETAL_SIM_FIBERS=ucontext, it is getcontext/makecontext/swapcontext (portable, ~10x
// slower because glibc's swapcontext also saves the signal mask with a system call).
//
// Scheduling. A threadgroup runs on one OS thread: every runnable fiber runs until it parks at
// a SIMD-group function or a barrier (the order of fibers per round is forward, reverse or
// seeded random). Then each SIMD-group whose lanes all wait at the same SIMD-group call is
// resolved by the kernel-side resolve function; lanes of one SIMD-group waiting at different
// calls, at a barrier, or already exited are a divergence error (the call is in divergent
// control flow). When no SIMD-group work remains, every
// live thread must wait at the same threadgroup_barrier: then all are released; threads that
// exited while others wait, or waits at different barriers, are errors. Threadgroups are
// spread over worker threads (one fiber set each).
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700  // macOS exposes the (deprecated) ucontext functions only with it
#define _DARWIN_C_SOURCE 1 // ... and keeps MAP_ANONYMOUS etc. visible with this
#endif
#include "msl_sim/runtime.h"

#include <dlfcn.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <thread>

// ------------------------------------------------------------------------------------------
// x86-64 context switch
#if defined(__x86_64__) && defined(__ELF__)
#define MSL_SIM_ASM_SWITCH 1
asm(R"(
    .text
    .p2align 4
    .globl msl_sim_switch
    .hidden msl_sim_switch
    .type msl_sim_switch, @function
msl_sim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size msl_sim_switch, .-msl_sim_switch

    .p2align 4
    .globl msl_sim_fiber_start
    .hidden msl_sim_fiber_start
    .type msl_sim_fiber_start, @function
msl_sim_fiber_start:
    movq %rbx, %rdi
    call *%r12
    ud2
    .size msl_sim_fiber_start, .-msl_sim_fiber_start
)");
extern "C" void msl_sim_switch(void** save_sp, void* load_sp);
extern "C" void msl_sim_fiber_start();
#else
#define MSL_SIM_ASM_SWITCH 0
#endif

namespace msl {
namespace {

std::string site(const char* file, int line) {
    if (!file || !*file) return line > 0 ? "line " + std::to_string(line) : std::string();
    return std::string(file) + ":" + std::to_string(line);
}

std::string kernel_where(const KernelInfo& k) {
    return "kernel '" + std::string(k.name) + "' (" + site(k.file, k.line) + ")";
}

size_t env_size(const char* name, size_t dflt) {
    const char* v = std::getenv(name);
    if (!v || !*v) return dflt;
    long x = std::atol(v);
    return x > 0 ? size_t(x) : dflt;
}

bool use_ucontext() {
#if MSL_SIM_ASM_SWITCH
    static const bool uc = [] {
        const char* v = std::getenv("QWENMETAL_SIM_FIBERS");
        return v && std::strcmp(v, "ucontext") == 0;
    }();
    return uc;
#else
    return true;
#endif
}

struct Worker {
    std::vector<Lane> lanes;
    std::vector<void*> sp;
    std::vector<ucontext_t> uc;
    void* sched_sp = nullptr;
    ucontext_t sched_uc;
    char* stacks = nullptr;
    size_t map_bytes = 0, stack_bytes = 0;
    uint32_t nstacks = 0;
    alignas(64) char arena[kMaxThreadgroupMemory];
    Group G;
    const KernelInfo* kernel = nullptr;
    bool uc_mode = false;
    // error raised inside a fiber
    bool err_set = false;
    std::string err, err_file;
    int err_line = 0;
    int err_thread = -1;
    // counters of the current dispatch
    uint64_t simd_ops = 0, barriers = 0;
    uint32_t arena_peak = 0;
    // bank counting (count_banks): kBankLogCap entries per lane
    bool count_banks = false;
    std::vector<uint32_t> bank_store;
    BankCounts banks;

    ~Worker() {
        if (stacks) munmap(stacks, map_bytes);
    }
    void ensure(uint32_t n) {
        const size_t want = ((env_size("QWENMETAL_SIM_STACK_KB", 64) * 1024) + 4095) & ~size_t(4095);
        if (n <= nstacks && want == stack_bytes) return;
        if (stacks) munmap(stacks, map_bytes);
        stack_bytes = want + 4096;  // + guard page
        map_bytes = stack_bytes * n;
        void* p = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            stacks = nullptr;
            nstacks = 0;
            throw SimError("msl_sim: cannot map fiber stacks");
        }
        stacks = static_cast<char*>(p);
        for (uint32_t i = 0; i < n; ++i) mprotect(stacks + size_t(i) * stack_bytes, 4096, PROT_NONE);
        nstacks = n;
        lanes.assign(n, Lane());
        sp.assign(n, nullptr);
        uc.resize(n);
    }
};

inline void to_sched(Worker* W, Lane* l) {
    const size_t i = l->index;
#if MSL_SIM_ASM_SWITCH
    if (!W->uc_mode) {
        msl_sim_switch(&W->sp[i], W->sched_sp);
        return;
    }
#endif
    swapcontext(&W->uc[i], &W->sched_uc);
}

void api_park(Lane* l) { to_sched(static_cast<Worker*>(l->grp->rt), l); }

void api_fail(Lane* l, const char* msg, const char* file, int line) {
    Worker* W = static_cast<Worker*>(l->grp->rt);
    if (!W->err_set) {
        W->err_set = true;
        W->err = msg ? msg : "error";
        W->err_file = file ? file : "";
        W->err_line = line;
        W->err_thread = int(l->index);
    }
    l->state = LANE_DONE;
    to_sched(W, l);
    std::abort();  // an abandoned fiber is never resumed
}

const Api kApi = {kAbiVersion, &api_park, &api_fail};

extern "C" void msl_sim_fiber_main(Lane* l) {
    Worker* W = static_cast<Worker*>(l->grp->rt);
    W->kernel->fn(l);
    l->state = LANE_DONE;
    to_sched(W, l);
    std::abort();
}

void uc_entry(unsigned lo, unsigned hi) {
    Lane* l = reinterpret_cast<Lane*>((uintptr_t(hi) << 32) | uintptr_t(lo));
    msl_sim_fiber_main(l);
}

void start_fiber(Worker& W, uint32_t i) {
    Lane* l = &W.lanes[i];
    char* base = W.stacks + size_t(i) * W.stack_bytes + 4096;
    // stack tops are staggered by a few cache lines ("colouring"): with equal spacing every
    // fiber's hot frame would map to the same L1 set and evict the others on each switch
    char* top = W.stacks + size_t(i + 1) * W.stack_bytes - size_t(i % 61) * 64;
#if MSL_SIM_ASM_SWITCH
    if (!W.uc_mode) {
        // initial frame, popped by msl_sim_switch: r15 r14 r13 r12 rbx rbp, return address; after
        // the ret, rsp is 16-byte aligned for the call in msl_sim_fiber_start
        uint64_t* s = reinterpret_cast<uint64_t*>((uintptr_t(top) & ~uintptr_t(15)) - 72);
        s[0] = s[1] = s[2] = 0;                                              // r15 r14 r13
        s[3] = uint64_t(reinterpret_cast<uintptr_t>(&msl_sim_fiber_main));  // r12: entry
        s[4] = uint64_t(reinterpret_cast<uintptr_t>(l));                     // rbx: its argument
        s[5] = 0;                                                            // rbp
        s[6] = uint64_t(reinterpret_cast<uintptr_t>(&msl_sim_fiber_start));  // return address
        W.sp[i] = s;
        return;
    }
#endif
    ucontext_t& u = W.uc[i];
    getcontext(&u);
    u.uc_stack.ss_sp = base;
    u.uc_stack.ss_size = size_t(top - base);
    u.uc_link = nullptr;
    const uintptr_t p = reinterpret_cast<uintptr_t>(l);
    makecontext(&u, reinterpret_cast<void (*)()>(&uc_entry), 2, unsigned(p & 0xffffffffu), unsigned(p >> 32));
}

inline void resume(Worker& W, uint32_t i) {
#if MSL_SIM_ASM_SWITCH
    if (!W.uc_mode) {
        msl_sim_switch(&W.sched_sp, W.sp[i]);
        return;
    }
#endif
    swapcontext(&W.sched_uc, &W.uc[i]);
}

// Bank conflicts of SIMD-group `s`'s accesses logged since its lanes' last synchronisation point (every lane
// of it is parked or has exited), then the logs are cleared. See BankCounts (runtime.h) for the model.
void count_banks(Worker& W, uint32_t s, uint32_t n) {
    Lane* L[32];
    int m = 0;
    for (uint32_t k = 0; k < 32 && s * 32 + k < n; ++k) {
        Lane* l = &W.lanes[s * 32 + k];
        W.banks.dropped += l->banks_dropped;
        l->banks_dropped = 0;
        if (l->nbanks) L[m++] = l;
    }
    if (!m) return;
    int pos[32] = {};
    uint16_t words[32 * 64];
    for (;;) {
        int nw = 0;
        bool any = false;
        for (int i = 0; i < m; ++i) {
            Lane* l = L[i];
            int& p = pos[i];
            if (p >= l->nbanks) continue;
            any = true;
            do {   // one access: an entry and the entries that continue it
                const uint32_t e = l->banks[p++];
                const uint32_t off = e & 0xffffu, size = (e >> 16) & 0x7fffu;
                const uint32_t w0 = off / 4, w1 = (off + (size ? size : 1) - 1) / 4;
                for (uint32_t w = w0; w <= w1 && w < w0 + 64 && nw < int(sizeof words / sizeof words[0]); ++w)
                    words[nw++] = uint16_t(w);
            } while (p < l->nbanks && (l->banks[p] & 0x80000000u));
        }
        if (!any) break;
        std::sort(words, words + nw);
        const int nu = int(std::unique(words, words + nw) - words);
        uint32_t per_bank[32] = {};
        uint32_t deg = 0;
        for (int i = 0; i < nu; ++i) deg = std::max(deg, ++per_bank[words[i] & 31]);
        const uint32_t ideal = uint32_t((nu + 31) / 32);
        ++W.banks.accesses;
        if (deg > ideal) {
            ++W.banks.conflicted;
            W.banks.replays += deg - ideal;
        }
        W.banks.max_degree = std::max<uint64_t>(W.banks.max_degree, deg);
    }
    for (int i = 0; i < m; ++i) L[i]->nbanks = 0;
}

void count_all_banks(Worker& W, uint32_t n) {
    for (uint32_t s = 0; s * 32 < n; ++s) count_banks(W, s, n);
}

struct Launch {
    const KernelInfo* kernel;
    uint32_t groups[3], tpg[3], nthreads;
    Buffer bufs[kMaxBuffers];
    int nbufs;
    uint32_t tg_arg_off[kMaxTgArgs], tg_arg_size[kMaxTgArgs];
    int ntg_args;
    uint32_t dyn_total;
    Schedule sched;
    uint64_t seed;
    bool count_banks;
};

uint64_t splitmix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

std::string lane_op(const Lane& l) {
    if (l.state == LANE_DONE) return "exited";
    return std::string(l.op ? l.op : "?") + " (" + site(l.file, l.line) + ")";
}

struct GroupFailure {
    std::string msg, file;
    int line;
    int thread;
};

[[noreturn]] void group_fail(std::string msg, const char* file = nullptr, int line = 0, int thread = -1) {
    throw GroupFailure{std::move(msg), file ? file : "", line, thread};
}

void run_group(Worker& W, const Launch& L, const uint32_t tg[3]) {
    Group& G = W.G;
    G.api = &kApi;
    G.rt = &W;
    G.kernel = L.kernel->name;
    G.bufs = const_cast<Buffer*>(L.bufs);
    G.nbufs = L.nbufs;
    G.checked = L.kernel->checked;
    for (int d = 0; d < 3; ++d) {
        G.tgpig[d] = tg[d];
        G.tg_size[d] = L.tpg[d];
        G.grid_tgs[d] = L.groups[d];
    }
    const uint32_t n = L.nthreads;
    G.nthreads = n;
    G.nsg = (n + 31) / 32;
    G.arena = W.arena;
    G.arena_cap = kMaxThreadgroupMemory;
    G.arena_used = L.dyn_total;
    G.nvars = 0;
    G.ntg_args = L.ntg_args;
    for (int i = 0; i < L.ntg_args; ++i) {
        G.tg_arg_off[i] = L.tg_arg_off[i];
        G.tg_arg_size[i] = L.tg_arg_size[i];
    }
    if (L.dyn_total) std::memset(W.arena, 0xFF, L.dyn_total);  // poison [[threadgroup(n)]] memory
    W.err_set = false;

    for (uint32_t i = 0; i < n; ++i) {
        Lane& l = W.lanes[i];
        l.state = LANE_RUN;
        l.index = i;
        l.lane = i % 32;
        l.sg = i / 32;
        l.tpitg[0] = i % L.tpg[0];
        l.tpitg[1] = (i / L.tpg[0]) % L.tpg[1];
        l.tpitg[2] = i / (L.tpg[0] * L.tpg[1]);
        for (int d = 0; d < 3; ++d) l.tpig[d] = tg[d] * L.tpg[d] + l.tpitg[d];
        l.grp = &G;
        l.op = nullptr;
        l.file = nullptr;
        l.line = 0;
        l.resolve = nullptr;
        l.nlog = 0;
        l.banks = W.count_banks ? W.bank_store.data() + size_t(i) * kBankLogCap : nullptr;
        l.nbanks = 0;
        l.banks_dropped = 0;
        start_fiber(W, i);
    }

    std::vector<uint32_t> order(n);
    for (uint32_t i = 0; i < n; ++i) order[i] = L.sched == Schedule::reverse ? n - 1 - i : i;
    const uint64_t gid = (uint64_t(tg[2]) * L.groups[1] + tg[1]) * L.groups[0] + tg[0];
    std::mt19937_64 rng(splitmix(L.seed ^ splitmix(gid + 1)));

    for (;;) {
        if (L.sched == Schedule::random) std::shuffle(order.begin(), order.end(), rng);
        for (uint32_t i : order) {
            if (W.lanes[i].state != LANE_RUN) continue;
            resume(W, i);
            if (W.err_set) group_fail(W.err, W.err_file.c_str(), W.err_line, W.err_thread);
        }
        // SIMD-group rendezvous
        bool progress = false;
        for (uint32_t s = 0; s < G.nsg; ++s) {
            Lane* lanes[32] = {};
            uint32_t act = 0;
            const Lane* first = nullptr;
            bool diverged = false;
            for (uint32_t k = 0; k < 32 && s * 32 + k < n; ++k) {
                Lane& l = W.lanes[s * 32 + k];
                lanes[k] = &l;
                if (l.state == LANE_AT_SIMD) {
                    if (!first) first = &l;
                    if (l.resolve == first->resolve && l.line == first->line &&
                        (l.file == first->file || (l.file && first->file && std::strcmp(l.file, first->file) == 0)))
                        act |= 1u << k;
                    else
                        diverged = true;
                }
            }
            if (!first) continue;
            // every lane of the SIMD-group must take part: lanes waiting at another SIMD-group
            // call, at a barrier, or already exited mean the call is in divergent control flow
            // (Metal would run it over the active lanes only; the project's kernels may not
            // rely on that, see docs/metal.md)
            for (uint32_t k = 0; k < 32 && s * 32 + k < n; ++k)
                if (lanes[k]->state == LANE_AT_BARRIER || lanes[k]->state == LANE_DONE) diverged = true;
            if (diverged) {
                std::map<std::string, int> by;
                for (uint32_t k = 0; k < 32 && s * 32 + k < n; ++k) by[lane_op(*lanes[k])]++;
                std::ostringstream os;
                os << "SIMD-group " << s << " diverges at a SIMD-group function (reached by only part of the "
                   << "SIMD-group):";
                bool c = false;
                for (auto& kv : by) {
                    os << (c ? ";" : "") << " " << kv.second << " lane" << (kv.second > 1 ? "s" : "")
                       << (kv.first == "exited" ? " exited" : " at " + kv.first);
                    c = true;
                }
                group_fail(os.str(), first->file, first->line);
            }
            const char* err = first->resolve(lanes, act);
            if (err) group_fail(std::string(first->op ? first->op : "SIMD-group function") + ": " + err, first->file, first->line);
            for (uint32_t k = 0; k < 32; ++k)
                if (act >> k & 1) lanes[k]->state = LANE_RUN;
            if (W.count_banks) count_banks(W, s, n);
            ++W.simd_ops;
            progress = true;
        }
        if (progress) continue;
        // threadgroup barrier
        uint32_t done = 0, at_bar = 0;
        const Lane* b0 = nullptr;
        const Lane* other = nullptr;
        for (uint32_t i = 0; i < n; ++i) {
            const Lane& l = W.lanes[i];
            if (l.state == LANE_DONE) {
                ++done;
            } else if (l.state == LANE_AT_BARRIER) {
                ++at_bar;
                if (!b0) b0 = &l;
                else if (!other && (l.line != b0->line || (l.file != b0->file && l.file && b0->file && std::strcmp(l.file, b0->file))))
                    other = &l;
            }
        }
        if (done == n) {
            if (W.count_banks) count_all_banks(W, n);
            break;
        }
        if (at_bar + done != n) group_fail("deadlock: threads neither run, wait at a barrier, nor exited");
        if (done > 0)
            group_fail(std::to_string(done) + " thread" + (done > 1 ? "s" : "") + " exited while " + std::to_string(at_bar) +
                           " wait at threadgroup_barrier: a barrier reached by only part of the threadgroup "
                           "(barrier in divergent control flow, or an early return before it)",
                       b0->file, b0->line);
        if (other) {
            uint32_t n0 = 0;
            for (uint32_t i = 0; i < n; ++i)
                if (W.lanes[i].line == b0->line) ++n0;
            group_fail("threads wait at different threadgroup_barrier calls: " + std::to_string(n0) + " at " +
                           site(b0->file, b0->line) + ", " + std::to_string(n - n0) + " at " + site(other->file, other->line) +
                           " (barrier in divergent control flow)",
                       b0->file, b0->line);
        }
        if (W.count_banks) count_all_banks(W, n);
        for (uint32_t i = 0; i < n; ++i) W.lanes[i].state = LANE_RUN;
        ++W.barriers;
    }
    W.arena_peak = std::max(W.arena_peak, G.arena_used);
}

std::mutex g_pool_mu;
std::vector<std::unique_ptr<Worker>> g_pool;

std::unique_ptr<Worker> take_worker() {
    std::lock_guard<std::mutex> lk(g_pool_mu);
    if (g_pool.empty()) return std::unique_ptr<Worker>(new Worker());
    std::unique_ptr<Worker> w = std::move(g_pool.back());
    g_pool.pop_back();
    return w;
}
void give_worker(std::unique_ptr<Worker> w) {
    std::lock_guard<std::mutex> lk(g_pool_mu);
    if (g_pool.size() < 8) g_pool.push_back(std::move(w));
}

}  // namespace

// ------------------------------------------------------------------------------------------
// Library

extern "C" const KernelTable* const* msl_sim_builtin_tables();  // generated at build time

Library::~Library() = default;  // plugins stay loaded: kernels may still be referenced

void Library::add_table(const KernelTable* t, const std::string& where) {
    if (!t) return;
    if (t->abi_version != kAbiVersion)
        throw SimError("msl_sim: " + where + " was built for simulator ABI " + std::to_string(t->abi_version) +
                       ", this runtime is ABI " + std::to_string(kAbiVersion) + ": rebuild it");
    if (t->compiler && compiler_.empty()) compiler_ = t->compiler;
    for (uint32_t i = 0; i < t->count; ++i) {
        const KernelInfo* k = &t->kernels[i];
        auto it = by_name_.find(k->name);
        if (it != by_name_.end())
            throw SimError("msl_sim: kernel name '" + std::string(k->name) + "' defined twice (" +
                           site(it->second->file, it->second->line) + " and " + site(k->file, k->line) + ")");
        by_name_[k->name] = k;
        kernels_.push_back(k);
    }
}

std::shared_ptr<Library> Library::builtin() {
    static std::shared_ptr<Library> lib = [] {
        std::shared_ptr<Library> l(new Library());
        l->origin_ = "builtin";
        for (const KernelTable* const* t = msl_sim_builtin_tables(); t && *t; ++t) l->add_table(*t, "a builtin kernel file");
        return l;
    }();
    return lib;
}

std::shared_ptr<Library> Library::load(const std::string& path) {
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) throw SimError(std::string("msl_sim: cannot load kernel library: ") + dlerror());
    typedef const KernelTable* (*Entry)();
    Entry e = reinterpret_cast<Entry>(dlsym(h, "msl_library_plugin"));
    if (!e) throw SimError("msl_sim: " + path + " has no msl_library_plugin entry point");
    std::shared_ptr<Library> l(new Library());
    l->origin_ = path;
    l->handle_ = h;
    l->add_table(e(), path);
    return l;
}

const KernelInfo* Library::find(const std::string& name) const {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : it->second;
}

const KernelInfo& Library::get(const std::string& name) const {
    const KernelInfo* k = find(name);
    if (!k) {
        std::string names;
        for (const KernelInfo* x : kernels_) names += (names.empty() ? "" : ", ") + std::string(x->name);
        throw SimError("msl_sim: no kernel named '" + name + "' in " + origin_ + " (kernels: " +
                       (names.empty() ? "none" : names) + ")");
    }
    return *k;
}

int64_t Library::observed_tg_memory(const std::string& name) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = tg_seen_.find(name);
    return it == tg_seen_.end() ? -1 : int64_t(it->second);
}
void Library::observe_tg_memory(const std::string& name, uint32_t bytes) {
    std::lock_guard<std::mutex> lk(mu_);
    uint32_t& v = tg_seen_[name];
    v = std::max(v, bytes);
}

Schedule parse_schedule(const std::string& s) {
    if (s == "forward") return Schedule::forward;
    if (s == "reverse") return Schedule::reverse;
    if (s == "random") return Schedule::random;
    throw SimError("msl_sim: schedule must be 'forward', 'reverse' or 'random', not '" + s + "'");
}

std::string fiber_switch_name() { return use_ucontext() ? "ucontext" : "x86-64 assembly"; }

// ------------------------------------------------------------------------------------------
// dispatch

static void validate_shape(const KernelInfo& k, const uint32_t groups[3], const uint32_t threads[3],
                           const std::vector<Binding>& bindings, const DispatchOptions& opt, uint32_t* dyn_total) {
    const uint64_t nt = uint64_t(threads[0]) * threads[1] * threads[2];
    if (nt == 0 || threads[0] == 0 || threads[1] == 0 || threads[2] == 0)
        throw SimError("msl_sim: " + kernel_where(k) + ": threads per threadgroup must be positive");
    if (nt > kMaxThreadsPerGroup)
        throw SimError("msl_sim: " + kernel_where(k) + ": " + std::to_string(nt) + " threads per threadgroup (" +
                       std::to_string(threads[0]) + "x" + std::to_string(threads[1]) + "x" + std::to_string(threads[2]) +
                       "), over Metal's limit of 1024");
    if (groups[0] == 0 || groups[1] == 0 || groups[2] == 0)
        throw SimError("msl_sim: " + kernel_where(k) + ": the grid must have at least one threadgroup in each dimension");
    if (bindings.size() > size_t(kMaxBuffers))
        throw SimError("msl_sim: " + kernel_where(k) + ": more than 31 buffers bound");
    if (opt.tg_memory.size() > size_t(kMaxTgArgs))
        throw SimError("msl_sim: " + kernel_where(k) + ": more than 8 threadgroup memory arguments");
    uint64_t dyn = 0;
    for (uint32_t b : opt.tg_memory) dyn += (uint64_t(b) + 15) & ~uint64_t(15);
    if (dyn > kMaxThreadgroupMemory)
        throw SimError("msl_sim: " + kernel_where(k) + ": " + std::to_string(dyn) +
                       " bytes of threadgroup memory requested, over the 32768-byte limit");
    *dyn_total = uint32_t(dyn);
}

void execute(Library& lib, const KernelInfo& k, const uint32_t groups[3], const uint32_t threads[3],
             const std::vector<Binding>& bindings, const DispatchOptions& opt, DispatchRecord& rec) {
    uint32_t dyn_total = 0;
    validate_shape(k, groups, threads, bindings, opt, &dyn_total);
    Launch L;
    std::memset(&L, 0, sizeof L);
    L.kernel = &k;
    for (int d = 0; d < 3; ++d) {
        L.groups[d] = groups[d];
        L.tpg[d] = threads[d];
    }
    L.nthreads = threads[0] * threads[1] * threads[2];
    std::vector<std::vector<uint64_t>> params;  // setBytes copies, 16-byte aligned
    L.nbufs = int(bindings.size());
    for (size_t i = 0; i < bindings.size(); ++i) {
        const Binding& b = bindings[i];
        if (!b.bound) continue;
        if (!b.ptr && b.size)
            throw SimError("msl_sim: " + kernel_where(k) + ": buffer(" + std::to_string(i) +
                           ") is a virtual buffer (no memory): only an encode-only command buffer accepts it");
        if (b.is_params) {
            params.emplace_back((b.size + 15) / 8 + 2, 0);
            std::memcpy(params.back().data(), b.ptr, b.size);
            L.bufs[i].ptr = params.back().data();
        } else {
            L.bufs[i].ptr = b.ptr;
        }
        L.bufs[i].size = b.size;
        L.bufs[i].is_params = b.is_params;
    }
    uint32_t off = 0;
    L.ntg_args = int(opt.tg_memory.size());
    for (size_t i = 0; i < opt.tg_memory.size(); ++i) {
        L.tg_arg_off[i] = off;
        L.tg_arg_size[i] = opt.tg_memory[i];
        off += (opt.tg_memory[i] + 15) & ~15u;
    }
    L.dyn_total = dyn_total;
    L.sched = opt.schedule;
    L.seed = opt.seed;
    L.count_banks = opt.count_banks;

    const uint64_t total = uint64_t(groups[0]) * groups[1] * groups[2];
    std::vector<uint64_t> perm;
    if (opt.schedule == Schedule::random) {
        perm.resize(total);
        for (uint64_t i = 0; i < total; ++i) perm[i] = i;
        std::mt19937_64 rng(splitmix(opt.seed));
        std::shuffle(perm.begin(), perm.end(), rng);
    }
    unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    uint64_t nw = opt.workers > 0 ? uint64_t(opt.workers) : uint64_t(env_size("QWENMETAL_SIM_WORKERS", hw));
    nw = std::max<uint64_t>(1, std::min<uint64_t>(nw, total));

    std::atomic<uint64_t> next{0};
    std::atomic<bool> failed{false};
    std::mutex err_mu;
    std::string first_err;
    std::atomic<uint64_t> simd_ops{0}, barriers{0};
    std::atomic<uint32_t> arena_peak{0};
    BankCounts banks;   // err_mu

    auto work = [&]() {
        std::unique_ptr<Worker> W = take_worker();
        W->kernel = &k;
        W->uc_mode = use_ucontext();
        W->simd_ops = W->barriers = 0;
        W->arena_peak = 0;
        W->count_banks = L.count_banks;
        W->banks = BankCounts();
        try {
            W->ensure(L.nthreads);
            if (L.count_banks && W->bank_store.size() < size_t(L.nthreads) * kBankLogCap)
                W->bank_store.resize(size_t(L.nthreads) * kBankLogCap);
        } catch (SimError& e) {
            std::lock_guard<std::mutex> lk(err_mu);
            if (!failed.exchange(true)) first_err = e.what();
            give_worker(std::move(W));
            return;
        }
        for (uint64_t g; !failed.load(std::memory_order_relaxed) && (g = next.fetch_add(1)) < total;) {
            uint64_t gg = opt.schedule == Schedule::reverse ? total - 1 - g : (perm.empty() ? g : perm[g]);
            uint32_t tg[3] = {uint32_t(gg % groups[0]), uint32_t((gg / groups[0]) % groups[1]),
                              uint32_t(gg / (uint64_t(groups[0]) * groups[1]))};
            try {
                run_group(*W, L, tg);
            } catch (GroupFailure& f) {
                std::ostringstream os;
                os << "msl_sim: ";
                if (!f.file.empty() || f.line) os << site(f.file.c_str(), f.line) << ": ";
                os << kernel_where(k) << ", threadgroup (" << tg[0] << "," << tg[1] << "," << tg[2] << ")";
                if (f.thread >= 0) os << ", thread " << f.thread;
                os << ": " << f.msg;
                std::lock_guard<std::mutex> lk(err_mu);
                if (!failed.exchange(true)) first_err = os.str();
            } catch (std::exception& e) {
                std::lock_guard<std::mutex> lk(err_mu);
                if (!failed.exchange(true)) first_err = std::string("msl_sim: ") + kernel_where(k) + ": " + e.what();
            }
        }
        simd_ops += W->simd_ops;
        barriers += W->barriers;
        if (L.count_banks) {
            std::lock_guard<std::mutex> lk(err_mu);
            banks.accesses += W->banks.accesses;
            banks.conflicted += W->banks.conflicted;
            banks.replays += W->banks.replays;
            banks.dropped += W->banks.dropped;
            banks.max_degree = std::max(banks.max_degree, W->banks.max_degree);
        }
        uint32_t p = arena_peak.load();
        while (W->arena_peak > p && !arena_peak.compare_exchange_weak(p, W->arena_peak)) {
        }
        give_worker(std::move(W));
    };

    // raise the kernel library's counting flag for the dispatch (its accesses log themselves while it is up)
    struct CountingFlag {
        int* f;
        explicit CountingFlag(int* p) : f(p) {
            if (f) __atomic_add_fetch(f, 1, __ATOMIC_SEQ_CST);
        }
        ~CountingFlag() {
            if (f) __atomic_sub_fetch(f, 1, __ATOMIC_SEQ_CST);
        }
    } counting(opt.count_banks ? k.bank_counting : nullptr);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> ts;
    for (uint64_t i = 1; i < nw; ++i) ts.emplace_back(work);
    work();
    for (auto& t : ts) t.join();
    rec.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (failed) throw SimError(first_err);
    rec.executed = true;
    rec.simd_ops = simd_ops;
    rec.barriers = barriers;
    rec.banks_counted = opt.count_banks;
    rec.banks = banks;
    rec.tg_memory = int64_t(arena_peak.load());
    lib.observe_tg_memory(k.name, arena_peak.load() - dyn_total);
}

// ------------------------------------------------------------------------------------------
// command buffer

const DispatchRecord& CommandBuffer::dispatch(Library& lib, const std::string& kernel, const uint32_t groups[3],
                                              const uint32_t threads[3], std::vector<Binding> bindings,
                                              const DispatchOptions& opt) {
    const KernelInfo& k = lib.get(kernel);
    uint32_t dyn_total = 0;
    validate_shape(k, groups, threads, bindings, opt, &dyn_total);
    DispatchRecord rec;
    rec.kernel = kernel;
    rec.level = level_;
    for (int d = 0; d < 3; ++d) {
        rec.groups[d] = groups[d];
        rec.threads_per_group[d] = threads[d];
    }
    rec.threads = uint64_t(groups[0]) * groups[1] * groups[2] * threads[0] * threads[1] * threads[2];
    for (size_t i = 0; i < bindings.size(); ++i) {
        const Binding& b = bindings[i];
        if (!b.bound) continue;
        rec.buffers.push_back(BufferRecord{int(i), b.size, b.read, b.written, b.is_params});
        if (b.read > 0) rec.bytes_read += uint64_t(b.read);
        if (b.written > 0) rec.bytes_written += uint64_t(b.written);
    }
    // hazards between dispatches of one dependency level (concurrent encoder)
    const size_t me = records_.size();
    std::vector<Access> mine;
    for (size_t i = 0; i < bindings.size(); ++i) {
        const Binding& b = bindings[i];
        if (!b.bound || b.is_params || b.size == 0) continue;
        const bool writes = b.written != 0;  // undeclared (-1) counts as a write
        const bool reads = b.read != 0;
        if (!reads && !writes) continue;
        mine.push_back(Access{b.addr, b.addr + b.size, writes, me, int(i)});
    }
    if (concurrent_) {
        for (const Access& a : mine)
            for (const Access& o : level_accesses_)
                if (a.lo < o.hi && o.lo < a.hi && (a.write || o.write))
                    throw SimError("msl_sim: dispatch " + std::to_string(me) + " ('" + kernel + "', buffer(" +
                                   std::to_string(a.index) + ")) and dispatch " + std::to_string(o.dispatch) + " ('" +
                                   records_[o.dispatch].kernel + "', buffer(" + std::to_string(o.index) +
                                   ")) in dependency level " + std::to_string(level_) +
                                   " touch the same memory and at least one writes it: a memory barrier is missing "
                                   "between them (they may run concurrently on the GPU)");
    }
    if (execute_) {
        execute(lib, k, groups, threads, bindings, opt, rec);
    } else {
        const int64_t seen = lib.observed_tg_memory(kernel);
        rec.tg_memory = seen >= 0 ? seen + int64_t(dyn_total) : (dyn_total ? -1 : -1);
    }
    level_accesses_.insert(level_accesses_.end(), mine.begin(), mine.end());
    records_.push_back(std::move(rec));
    ++in_level_;
    if (!concurrent_) barrier();
    return records_.back();
}

void CommandBuffer::barrier() {
    if (in_level_ == 0) return;  // consecutive barriers collapse
    ++level_;
    in_level_ = 0;
    level_accesses_.clear();
}

}  // namespace msl

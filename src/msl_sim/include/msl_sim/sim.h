// msl_sim kernel-side shim: what a Metal compute kernel sees when it is compiled as C++17 for the
// simulator. Included through <metal_stdlib>; the kernel source is first rewritten by
// tools/mslpp.py (kernel-scope `threadgroup` declarations, [[threadgroup(n)]], registration of
// non-template kernels and, in checked mode, device pointers and subscripts).
//
// Execution model (the runtime is src/msl_sim/runtime.cpp): every thread of a threadgroup is a
// fiber; a thread runs until it reaches a synchronisation point (a SIMD-group function, a
// barrier) and parks there. The runtime resolves a SIMD-group function once every live lane of
// the SIMD-group has parked at the same call site, and a barrier once every thread of the group
// has; anything else is reported as an error with the kernel name and the source line.
//
// MSL_SIM_CHECKED (1 by default): device/constant pointers are bounds-checked (dptr), threadgroup
// arrays are bounds-checked and their reads of never-written (poisoned) slots are reported.
#pragma once
#ifndef MSL_SIM_CHECKED
#define MSL_SIM_CHECKED 1
#endif

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <type_traits>

#include "msl_sim/abi.h"
#include "msl_sim/math.h"
#include "msl_sim/types.h"

namespace msl {

inline thread_local Lane* tls_lane = nullptr;
inline Lane* cur() { return tls_lane; }

[[noreturn]] __attribute__((noinline)) inline void fail(const char* msg, const char* file = nullptr, int line = 0) {
    Lane* l = cur();
    l->grp->api->fail(l, msg, file, line);
    __builtin_unreachable();
}

inline thread_local char tls_msg[512];
template <class... A> inline const char* fmt(const char* f, A... a) {
    std::snprintf(tls_msg, sizeof tls_msg, f, a...);
    return tls_msg;
}

// ---------------------------------------------------------------- threadgroup memory
// Poison written over every threadgroup allocation at group start: 0xFF bytes for floating
// types (a NaN in float, half and bfloat), 0xBE for 4- and 8-byte integers and structs. Reads of
// a slot that still holds it are reported (checked mode); 1- and 2-byte integers are poisoned
// but not tracked (their poison values are too likely to be written on purpose).
template <class S> constexpr bool is_float_like() {
    return std::is_floating_point<S>::value || std::is_same<S, metal::half>::value || std::is_same<S, metal::bfloat>::value;
}
template <class E> constexpr uint8_t poison_byte() {
    typedef typename std::remove_cv<typename std::remove_all_extents<E>::type>::type S;
    if constexpr (is_float_like<S>()) return 0xFF;
    else if constexpr (metal::vt<S>::n > 0) return is_float_like<typename metal::vt<S>::E>() ? 0xFF : 0xBE;
    else return 0xBE;
}
template <class E> constexpr bool poison_tracked() {
    typedef typename std::remove_cv<E>::type S;
    return !(std::is_integral<S>::value && sizeof(S) < 4);
}

inline bool all_bytes(const void* p, size_t n, uint8_t b) {
    const uint8_t* q = static_cast<const uint8_t*>(p);
    for (size_t i = 0; i < n; ++i)
        if (q[i] != b) return false;
    return true;
}

inline const char* tg_name_of(Group* G, const void* addr, long* index, uint32_t elem) {
    const char* base = G->arena;
    for (int i = 0; i < G->nvars; ++i) {
        const TgVar& v = G->vars[i];
        const char* a = base + v.off;
        if (static_cast<const char*>(addr) >= a && static_cast<const char*>(addr) < a + v.size) {
            *index = elem ? long((static_cast<const char*>(addr) - a) / elem) : 0;
            return v.name;
        }
    }
    *index = -1;
    return "threadgroup memory";
}

// Called at every synchronisation point of a thread and when it exits: nobody else ran since
// the logged accesses, so a logged slot still holding poison was read before any thread wrote it.
inline void flush_log(Lane* l, int keep = 0) {
    int n = l->nlog - keep;
    for (int i = 0; i < n; ++i) {
        const AccessEntry& e = l->log[i];
        if (all_bytes(e.addr, e.size, e.poison)) {
            long idx;
            const char* name = tg_name_of(l->grp, e.addr, &idx, e.size);
            fail(fmt("read of threadgroup memory %s[%ld] that no thread has written (uninitialised, or written by "
                     "another thread without a threadgroup_barrier in between)",
                     name, idx),
                 e.file, e.line);
        }
    }
    if (keep > 0) std::memmove(l->log, l->log + n, sizeof(AccessEntry) * size_t(keep));
    l->nlog = keep > 0 ? keep : 0;
}

template <class E> inline void note_tg_access(const E* p, const char* file, int line) {
    constexpr uint8_t pb = poison_byte<E>();
    if constexpr (!poison_tracked<E>()) return;
    if (!all_bytes(p, sizeof(E), pb)) return;
    Lane* l = cur();
    if (l->nlog == kLogCap) flush_log(l, 8);  // the latest few may still be pending writes
    AccessEntry& e = l->log[l->nlog++];
    e.addr = p;
    e.size = uint32_t(sizeof(E));
    e.poison = pb;
    e.line = line;
    e.file = file;
    e.name = nullptr;
}

// Bank counting (enabled per dispatch: DispatchOptions::count_banks): every threadgroup-memory access of
// a lane is logged with its arena offset and size; the runtime (runtime.cpp, count_banks) groups the n-th
// access of each lane of a SIMD-group since their last synchronisation point into one SIMD-group access
// and counts its bank conflicts. Addresses outside the group's arena (device memory) are ignored.
inline int g_bank_counting = 0;   // dispatches of this library counting banks now (KernelInfo::bank_counting)
inline void note_bank(const void* p, size_t size, bool cont = false) {
    if (__builtin_expect(__atomic_load_n(&g_bank_counting, __ATOMIC_RELAXED) == 0, 1)) return;
    Lane* l = cur();
    if (l->banks == nullptr) return;
    const ptrdiff_t off = static_cast<const char*>(p) - l->grp->arena;
    if (off < 0 || off >= ptrdiff_t(l->grp->arena_cap)) return;
    if (l->nbanks == kBankLogCap) {
        if (!cont) ++l->banks_dropped;
        return;
    }
    l->banks[l->nbanks++] = uint32_t(off) | (uint32_t(size < 0x7fff ? size : 0x7fff) << 16) | (cont ? 0x80000000u : 0u);
}

template <class A> struct tg_array;
template <class E, size_t N> struct tg_array<E[N]> {
    E d[N];
    typedef typename std::conditional<std::is_array<E>::value, tg_array<E>&, E&>::type ref;
    ref at(size_t i, const char* file, int line) {
#if MSL_SIM_CHECKED
        if (i >= N) fail(fmt("threadgroup array index %ld out of bounds [0, %zu)", long(i), N), file, line);
        if constexpr (!std::is_array<E>::value) note_tg_access(&d[i], file, line);
#endif
        if constexpr (!std::is_array<E>::value) note_bank(&d[i], sizeof(E));
        if constexpr (std::is_array<E>::value) return *reinterpret_cast<tg_array<E>*>(&d[i]);
        else return d[i];
    }
    ref operator[](size_t i) { return at(i, nullptr, 0); }
    operator E*() const { return const_cast<E*>(d); }
    E* operator+(ptrdiff_t k) const { return const_cast<E*>(d) + k; }
};
template <class A> struct is_tg_array : std::false_type {};
template <class A> struct is_tg_array<tg_array<A>> : std::true_type {};

template <class A> struct tg_ref { typedef A& type; };
template <class E, size_t N> struct tg_ref<E[N]> { typedef tg_array<E[N]>& type; };

// A kernel-scope `threadgroup T name[N];` (rewritten by mslpp to tg_var<T[N], ID>(...)): one
// object per threadgroup, allocated in the group's 32 KB arena by the first thread that reaches
// the declaration, poisoned.
template <class A, int ID> inline typename tg_ref<A>::type tg_var(const char* name, const char* file, int line) {
    static const char key = 0;
    typedef typename std::remove_reference<typename tg_ref<A>::type>::type R;
    Group* G = cur()->grp;
    for (int i = 0; i < G->nvars; ++i)
        if (G->vars[i].key == &key) return *reinterpret_cast<R*>(G->arena + G->vars[i].off);
    const uint32_t align = alignof(A) < 16 ? 16u : uint32_t(alignof(A));
    const uint32_t off = (G->arena_used + align - 1) & ~(align - 1);
    if (uint64_t(off) + sizeof(A) > G->arena_cap)
        fail(fmt("threadgroup memory: declaring %s (%zu bytes) brings the threadgroup's total to %llu bytes, over the "
                 "%u-byte limit",
                 name, sizeof(A), (unsigned long long)(uint64_t(off) + sizeof(A)), G->arena_cap),
             file, line);
    if (G->nvars == kMaxTgVars) fail("more than 64 threadgroup declarations", file, line);
    std::memset(G->arena + off, poison_byte<A>(), sizeof(A));
    TgVar& v = G->vars[G->nvars++];
    v.key = &key;
    v.off = off;
    v.size = uint32_t(sizeof(A));
    v.line = line;
    v.name = name;
    G->arena_used = off + uint32_t(sizeof(A));
    return *reinterpret_cast<R*>(G->arena + off);
}

// ---------------------------------------------------------------- checked device pointers
template <class T> struct dptr;
template <class A> struct is_dptr : std::false_type {};
template <class T> struct is_dptr<dptr<T>> : std::true_type {};

inline void find_bounds(const void* p, const char** lo, const char** hi, int* buf) {
    *lo = *hi = nullptr;
    *buf = -1;
    Lane* l = cur();
    if (!l || !p) return;
    Group* G = l->grp;
    for (int i = 0; i < G->nbufs; ++i) {
        const char* a = static_cast<const char*>(G->bufs[i].ptr);
        if (a && static_cast<const char*>(p) >= a && static_cast<const char*>(p) <= a + G->bufs[i].size) {
            *lo = a;
            *hi = a + G->bufs[i].size;
            *buf = i;
            return;
        }
    }
}

[[noreturn]] __attribute__((noinline, cold)) inline void oob(const void* q, size_t n, const char* lo, const char* hi,
                                                             int buf, const char* file, int line) {
    long off = long(static_cast<const char*>(q) - lo);
    fail(fmt("out-of-bounds device access: bytes [%ld, %ld) of buffer(%d), which has %ld bytes%s", off, off + long(n), buf,
             long(hi - lo), line ? "" : " (at an access the rewriter did not annotate: line unknown)"),
         file, line);
}

template <class T> struct dptr {
    T* p;
    const char* lo;
    const char* hi;
    int buf;
    typedef T element_type;

    dptr() = default;
    dptr(std::nullptr_t) : p(nullptr), lo(nullptr), hi(nullptr), buf(-1) {}
    dptr(T* q) : p(q) { find_bounds(q, &lo, &hi, &buf); }
    dptr(T* q, const char* l, const char* h, int b) : p(q), lo(l), hi(h), buf(b) {}
    template <class U, typename std::enable_if<std::is_convertible<U*, T*>::value, int>::type = 0>
    dptr(const dptr<U>& o) : p(o.p), lo(o.lo), hi(o.hi), buf(o.buf) {}
    template <class U, typename std::enable_if<!std::is_convertible<U*, T*>::value, int>::type = 0>
    explicit dptr(const dptr<U>& o)
        : p(reinterpret_cast<T*>(const_cast<typename std::remove_const<U>::type*>(o.p))), lo(o.lo), hi(o.hi), buf(o.buf) {}

    void check(const T* q, const char* file, int line) const {
        if (lo && (reinterpret_cast<const char*>(q) < lo || reinterpret_cast<const char*>(q) + sizeof(T) > hi))
            oob(q, sizeof(T), lo, hi, buf, file, line);
    }
    T& at(ptrdiff_t i, const char* file, int line) const {
        check(p + i, file, line);
        return p[i];
    }
    T& operator[](ptrdiff_t i) const { return at(i, nullptr, 0); }
    T& operator*() const { return at(0, nullptr, 0); }
    T* operator->() const {
        check(p, nullptr, 0);
        return p;
    }
    T* get() const { return p; }
    dptr operator+(ptrdiff_t k) const { return dptr(p + k, lo, hi, buf); }
    dptr operator-(ptrdiff_t k) const { return dptr(p - k, lo, hi, buf); }
    ptrdiff_t operator-(const dptr& o) const { return p - o.p; }
    dptr& operator+=(ptrdiff_t k) { p += k; return *this; }
    dptr& operator-=(ptrdiff_t k) { p -= k; return *this; }
    dptr& operator++() { ++p; return *this; }
    dptr& operator--() { --p; return *this; }
    dptr operator++(int) { dptr t = *this; ++p; return t; }
    dptr operator--(int) { dptr t = *this; --p; return t; }
    explicit operator bool() const { return p != nullptr; }
    bool operator==(const dptr& o) const { return p == o.p; }
    bool operator!=(const dptr& o) const { return p != o.p; }
    bool operator<=(const dptr& o) const { return p <= o.p; }
    bool operator>(const dptr& o) const { return p > o.p; }
    bool operator>=(const dptr& o) const { return p >= o.p; }
    bool operator<(const dptr& o) const { return p < o.p; }
};
template <class T> inline dptr<T> operator+(ptrdiff_t k, const dptr<T>& d) { return d + k; }

// Checked threadgroup pointer (mslpp rewrites `threadgroup T*` to it in checked mode): bounds of
// the threadgroup variable it points into, and the same poisoned-read tracking as tg_array.
// The threadgroup variable a raw pointer points into. A pointer one past the end of a variable is
// also the first byte of the next one when the two are adjacent in the arena: strict containment
// wins, and the one-past-the-end match (an end pointer, never dereferenced) is the fallback.
inline void find_tg_bounds(const void* p, const char** lo, const char** hi) {
    *lo = *hi = nullptr;
    Lane* l = cur();
    if (!l || !p) return;
    Group* G = l->grp;
    const char* q = static_cast<const char*>(p);
    for (int end_ok = 0; end_ok < 2; ++end_ok) {
        auto match = [&](const char* a, long size) {
            if (q >= a && (q < a + size || (end_ok && q == a + size))) {
                *lo = a;
                *hi = a + size;
                return true;
            }
            return false;
        };
        for (int i = 0; i < G->nvars; ++i)
            if (match(G->arena + G->vars[i].off, long(G->vars[i].size))) return;
        for (int i = 0; i < G->ntg_args; ++i)
            if (match(G->arena + G->tg_arg_off[i], long(G->tg_arg_size[i]))) return;
    }
}

template <class T> struct tgptr {
    T* p;
    const char* lo;
    const char* hi;
    typedef T element_type;

    tgptr() = default;
    tgptr(std::nullptr_t) : p(nullptr), lo(nullptr), hi(nullptr) {}
    tgptr(T* q) : p(q) { find_tg_bounds(q, &lo, &hi); }
    tgptr(T* q, const char* l, const char* h) : p(q), lo(l), hi(h) {}
    template <class A, typename std::enable_if<std::is_convertible<typename std::remove_all_extents<A>::type*, T*>::value, int>::type = 0>
    tgptr(tg_array<A>& a)
        : p(reinterpret_cast<typename std::remove_all_extents<A>::type*>(a.d)),
          lo(reinterpret_cast<const char*>(a.d)),
          hi(reinterpret_cast<const char*>(a.d) + sizeof(A)) {}
    template <class U, typename std::enable_if<std::is_convertible<U*, T*>::value, int>::type = 0>
    tgptr(const tgptr<U>& o) : p(o.p), lo(o.lo), hi(o.hi) {}
    template <class U, typename std::enable_if<!std::is_convertible<U*, T*>::value, int>::type = 0>
    explicit tgptr(const tgptr<U>& o)
        : p(reinterpret_cast<T*>(const_cast<typename std::remove_const<U>::type*>(o.p))), lo(o.lo), hi(o.hi) {}

    T& at(ptrdiff_t i, const char* file, int line) const {
        const char* q = reinterpret_cast<const char*>(p + i);
        if (lo && (q < lo || q + sizeof(T) > hi))
            fail(fmt("out-of-bounds threadgroup access: bytes [%ld, %ld) of a %ld-byte threadgroup variable%s", long(q - lo),
                     long(q - lo + long(sizeof(T))), long(hi - lo), line ? "" : " (line unknown)"),
                 file, line);
        note_tg_access(p + i, file, line);
        note_bank(p + i, sizeof(T));
        return p[i];
    }
    T& operator[](ptrdiff_t i) const { return at(i, nullptr, 0); }
    T& operator*() const { return at(0, nullptr, 0); }
    T* operator->() const { return p; }
    T* get() const { return p; }
    tgptr operator+(ptrdiff_t k) const { return tgptr(p + k, lo, hi); }
    tgptr operator-(ptrdiff_t k) const { return tgptr(p - k, lo, hi); }
    ptrdiff_t operator-(const tgptr& o) const { return p - o.p; }
    tgptr& operator+=(ptrdiff_t k) { p += k; return *this; }
    tgptr& operator-=(ptrdiff_t k) { p -= k; return *this; }
    tgptr& operator++() { ++p; return *this; }
    tgptr& operator--() { --p; return *this; }
    tgptr operator++(int) { tgptr t = *this; ++p; return t; }
    tgptr operator--(int) { tgptr t = *this; --p; return t; }
    explicit operator bool() const { return p != nullptr; }
    bool operator==(const tgptr& o) const { return p == o.p; }
    bool operator!=(const tgptr& o) const { return p != o.p; }
    bool operator<(const tgptr& o) const { return p < o.p; }
    bool operator<=(const tgptr& o) const { return p <= o.p; }
    bool operator>(const tgptr& o) const { return p > o.p; }
    bool operator>=(const tgptr& o) const { return p >= o.p; }
};
template <class A> struct is_tgptr : std::false_type {};
template <class T> struct is_tgptr<tgptr<T>> : std::true_type {};

// raw pointer behind a pointer argument (bounds-checked for n elements)
template <class T> inline T* raw(T* p, size_t = 1) { return p; }
template <class T> inline T* raw(const dptr<T>& d, size_t n = 1) {
    if (d.lo && (reinterpret_cast<const char*>(d.p) < d.lo || reinterpret_cast<const char*>(d.p + n) > d.hi))
        oob(d.p, sizeof(T) * n, d.lo, d.hi, d.buf, nullptr, 0);
    return d.p;
}
template <class T> inline T* raw(const tgptr<T>& t, size_t = 1) { return t.p; }
template <class A> inline typename std::remove_all_extents<A>::type* raw(const tg_array<A>& a, size_t = 1) {
    return reinterpret_cast<typename std::remove_all_extents<A>::type*>(const_cast<tg_array<A>&>(a).d);
}

// Subscripts of device pointers and threadgroup arrays, rewritten by mslpp (checked mode) from
// `name[i]` to `::msl::idx(__FILE__, __LINE__, name, (i))` so errors carry the source line.
template <class A, class I> inline decltype(auto) idx(const char* file, int line, A&& a, I i) {
    typedef typename std::remove_cv<typename std::remove_reference<A>::type>::type D;
    if constexpr (is_tg_array<D>::value) return a.at(size_t(i), file, line);
    else if constexpr (is_dptr<D>::value || is_tgptr<D>::value) return a.at(ptrdiff_t(i), file, line);
    else return (a[i]);
}
template <class To, class From> inline To ptr_cast(From f) {
    if constexpr (is_dptr<To>::value) return To(f);
    else return reinterpret_cast<To>(f);
}

// ---------------------------------------------------------------- kernel arguments
template <class T> struct is_ptr_like : std::is_pointer<T> {};
struct BufArg {
    int i;
    alignas(16) mutable unsigned char store[sizeof(dptr<char>)];
    template <class T> operator T&() const {
        Lane* l = cur();
        Group* G = l->grp;
        if (i < 0 || i >= G->nbufs || !G->bufs[i].ptr) fail(fmt("kernel reads unbound buffer(%d)", i));
        const Buffer& b = G->bufs[i];
        if constexpr (std::is_pointer<T>::value) {
            T* slot = new (store) T(static_cast<T>(b.ptr));
            return *slot;
        } else if constexpr (is_dptr<T>::value) {
            typedef typename T::element_type E;
            const char* a = static_cast<const char*>(b.ptr);
            T* slot = new (store) T(static_cast<E*>(b.ptr), a, a + b.size, i);
            return *slot;
        } else {
            if (b.size < sizeof(T))
                fail(fmt("buffer(%d) has %llu bytes; the kernel binds it to a %zu-byte object", i,
                         (unsigned long long)b.size, sizeof(T)));
            return *static_cast<T*>(b.ptr);
        }
    }
};
inline BufArg buf_arg(int i) { return BufArg{i, {}}; }

struct TgArg {
    int i;
    template <class T, typename std::enable_if<std::is_pointer<T>::value, int>::type = 0> operator T() const {
        Group* G = cur()->grp;
        if (i < 0 || i >= G->ntg_args || G->tg_arg_size[i] == 0)
            fail(fmt("kernel uses [[threadgroup(%d)]] but the host set no threadgroup memory length for it", i));
        return reinterpret_cast<T>(G->arena + G->tg_arg_off[i]);
    }
    template <class E> operator tgptr<E>() const {
        E* p = operator E*();
        const char* a = reinterpret_cast<const char*>(p);
        return tgptr<E>(p, a, a + cur()->grp->tg_arg_size[i]);
    }
};
inline TgArg tg_arg(int i) { return TgArg{i}; }

struct Builtin {
    uint32_t v[3];
    template <class T> operator T() const {
        if constexpr (std::is_arithmetic<T>::value) return T(v[0]);
        else if constexpr (T::size == 2) return T(typename T::value_type(v[0]), typename T::value_type(v[1]));
        else return T(typename T::value_type(v[0]), typename T::value_type(v[1]), typename T::value_type(v[2]));
    }
};
inline Builtin b3(const uint32_t* v) { return Builtin{{v[0], v[1], v[2]}}; }
inline Builtin b1(uint32_t x) { return Builtin{{x, 0, 0}}; }
inline Builtin grid_threads() {
    Group* G = cur()->grp;
    return Builtin{{G->grid_tgs[0] * G->tg_size[0], G->grid_tgs[1] * G->tg_size[1], G->grid_tgs[2] * G->tg_size[2]}};
}
struct tail_t {
    constexpr tail_t(int) {}
};
struct eater {
    constexpr int operator[](int) const { return 0; }
};
constexpr eater eat{};

// ---------------------------------------------------------------- synchronisation
inline void park(Lane* l) {
#if MSL_SIM_CHECKED
    if (l->nlog) flush_log(l);
#endif
    l->grp->api->park(l);
    tls_lane = l;
}
inline void kernel_exit(Lane* l) {
#if MSL_SIM_CHECKED
    if (l->nlog) flush_log(l);
#endif
    (void)l;
}

// Parks the current lane at a SIMD-group function: `in` / `out` are its operands and results (read and
// written by `resolve` once every lane of the SIMD-group waits at the same call site).
inline void park_at_simd(const void* in, void* out, int64_t aux, const char* op, const char* file, int line,
                         ResolveFn resolve) {
    Lane* l = cur();
    l->in = in;
    l->out = out;
    l->aux = aux;
    l->op = op;
    l->file = file;
    l->line = line;
    l->resolve = resolve;
    l->state = LANE_AT_SIMD;
    park(l);
}

template <class T, class R, class Op> struct Collective {
    static const char* resolve(Lane* const* L, uint32_t act) {
        T in[32];
        R out[32];
        int64_t aux[32];
        for (int i = 0; i < 32; ++i)
            if (act >> i & 1) {
                in[i] = *static_cast<const T*>(L[i]->in);
                aux[i] = L[i]->aux;
            }
        const char* err = Op::run(in, out, act, aux);
        if (err) return err;
        for (int i = 0; i < 32; ++i)
            if (act >> i & 1) *static_cast<R*>(L[i]->out) = out[i];
        return nullptr;
    }
};
template <class R, class Op, class T> inline R collective(const T& x, int64_t aux, const char* op, const char* file, int line) {
    R out;
    park_at_simd(&x, &out, aux, op, file, line, &Collective<T, R, Op>::resolve);
    return out;
}

template <class T> inline T emax(const T& a, const T& b) {
    if constexpr (metal::vt<T>::n > 0) return metal::max(a, b);
    else return a < b ? b : a;
}
template <class T> inline T emin(const T& a, const T& b) {
    if constexpr (metal::vt<T>::n > 0) return metal::min(a, b);
    else return b < a ? b : a;
}
struct CSum { template <class T> static T f(const T& a, const T& b) { return T(a + b); } };
struct CProd { template <class T> static T f(const T& a, const T& b) { return T(a * b); } };
struct CMax { template <class T> static T f(const T& a, const T& b) { return emax(a, b); } };
struct CMin { template <class T> static T f(const T& a, const T& b) { return emin(a, b); } };
struct CAnd { template <class T> static T f(const T& a, const T& b) { return T(a & b); } };
struct COr { template <class T> static T f(const T& a, const T& b) { return T(a | b); } };
struct CXor { template <class T> static T f(const T& a, const T& b) { return T(a ^ b); } };

// Reductions combine active lanes pairwise (butterfly order: (l0+l1)+(l2+l3), ...) and give every
// lane the result. The hardware's order is not documented: compare with tolerances.
template <class C> struct OpReduce {
    template <class T> static const char* run(const T* in, T* out, uint32_t act, const int64_t*) {
        T v[32];
        bool has[32];
        for (int i = 0; i < 32; ++i) {
            has[i] = act >> i & 1;
            if (has[i]) v[i] = in[i];
        }
        for (int s = 1; s < 32; s *= 2)
            for (int i = 0; i < 32; i += 2 * s) {
                if (has[i] && has[i + s]) v[i] = C::f(v[i], v[i + s]);
                else if (has[i + s]) {
                    v[i] = v[i + s];
                    has[i] = true;
                }
            }
        for (int i = 0; i < 32; ++i)
            if (act >> i & 1) out[i] = v[0];
        return nullptr;
    }
};
template <class C, bool Inclusive> struct OpPrefix {
    template <class T> static const char* run(const T* in, T* out, uint32_t act, const int64_t*) {
        bool first = true;
        T acc{};
        for (int i = 0; i < 32; ++i) {
            if (!(act >> i & 1)) continue;
            if (first) {
                out[i] = Inclusive ? in[i] : T(std::is_same<C, CProd>::value ? 1 : 0);
                acc = in[i];
                first = false;
            } else {
                out[i] = Inclusive ? C::f(acc, in[i]) : acc;
                acc = C::f(acc, in[i]);
            }
        }
        return nullptr;
    }
};
enum ShufKind { SH_IDX, SH_XOR, SH_UP, SH_DOWN, SH_ROT_UP, SH_ROT_DOWN, SH_FIRST };
template <int K> struct OpShuffle {
    template <class T> static const char* run(const T* in, T* out, uint32_t act, const int64_t* aux) {
        int first = __builtin_ctz(act);
        for (int i = 0; i < 32; ++i) {
            if (!(act >> i & 1)) continue;
            long a = long(aux[i]), src = i;
            switch (K) {
                case SH_IDX: src = a; break;
                case SH_XOR: src = i ^ a; break;
                case SH_UP: src = i - a < 0 ? i : i - a; break;
                case SH_DOWN: src = i + a >= 32 ? i : i + a; break;
                case SH_ROT_UP: src = ((i - a) % 32 + 32) % 32; break;
                case SH_ROT_DOWN: src = (i + a) % 32; break;
                case SH_FIRST: src = first; break;
            }
            if (src < 0 || src >= 32 || !(act >> src & 1))
                return fmt("lane %d reads lane %ld, which is not active in this SIMD-group", i, src);
            out[i] = in[src];
        }
        return nullptr;
    }
};
struct OpBallot {
    static const char* run(const bool* in, uint64_t* out, uint32_t act, const int64_t*) {
        uint64_t m = 0;
        for (int i = 0; i < 32; ++i)
            if ((act >> i & 1) && in[i]) m |= uint64_t(1) << i;
        for (int i = 0; i < 32; ++i)
            if (act >> i & 1) out[i] = m;
        return nullptr;
    }
};
struct OpActive {  // active mask / is_first / barrier
    static const char* run(const int* in, uint64_t* out, uint32_t act, const int64_t*) {
        (void)in;
        int first = __builtin_ctz(act);
        for (int i = 0; i < 32; ++i)
            if (act >> i & 1) out[i] = (uint64_t(act) << 1) | (i == first ? 1u : 0u);
        return nullptr;
    }
};
inline uint64_t active_info(const char* op, const char* file, int line) {
    int dummy = 0;
    return collective<uint64_t, OpActive>(dummy, 0, op, file, line);
}

}  // namespace msl

// ================================================================ the metal namespace
namespace metal {

#define MSL_SITE const char *file_ = __builtin_FILE(), int line_ = __builtin_LINE()

enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4, mem_threadgroup_imageblock = 8 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(unsigned(a) | unsigned(b)); }

inline void threadgroup_barrier(mem_flags = mem_flags::mem_threadgroup, MSL_SITE) {
    msl::Lane* l = msl::cur();
    l->op = "threadgroup_barrier";
    l->file = file_;
    l->line = line_;
    l->state = msl::LANE_AT_BARRIER;
    msl::park(l);
}
inline void simdgroup_barrier(mem_flags = mem_flags::mem_none, MSL_SITE) {
    msl::active_info("simdgroup_barrier", file_, line_);
}

template <class T> inline T simd_sum(T x, MSL_SITE) { return msl::collective<T, msl::OpReduce<msl::CSum>>(x, 0, "simd_sum", file_, line_); }
template <class T> inline T simd_product(T x, MSL_SITE) { return msl::collective<T, msl::OpReduce<msl::CProd>>(x, 0, "simd_product", file_, line_); }
template <class T> inline T simd_max(T x, MSL_SITE) { return msl::collective<T, msl::OpReduce<msl::CMax>>(x, 0, "simd_max", file_, line_); }
template <class T> inline T simd_min(T x, MSL_SITE) { return msl::collective<T, msl::OpReduce<msl::CMin>>(x, 0, "simd_min", file_, line_); }
template <class T> inline T simd_and(T x, MSL_SITE) { return msl::collective<T, msl::OpReduce<msl::CAnd>>(x, 0, "simd_and", file_, line_); }
template <class T> inline T simd_or(T x, MSL_SITE) { return msl::collective<T, msl::OpReduce<msl::COr>>(x, 0, "simd_or", file_, line_); }
template <class T> inline T simd_xor(T x, MSL_SITE) { return msl::collective<T, msl::OpReduce<msl::CXor>>(x, 0, "simd_xor", file_, line_); }
template <class T> inline T simd_prefix_inclusive_sum(T x, MSL_SITE) {
    return msl::collective<T, msl::OpPrefix<msl::CSum, true>>(x, 0, "simd_prefix_inclusive_sum", file_, line_);
}
template <class T> inline T simd_prefix_exclusive_sum(T x, MSL_SITE) {
    return msl::collective<T, msl::OpPrefix<msl::CSum, false>>(x, 0, "simd_prefix_exclusive_sum", file_, line_);
}
template <class T> inline T simd_prefix_inclusive_product(T x, MSL_SITE) {
    return msl::collective<T, msl::OpPrefix<msl::CProd, true>>(x, 0, "simd_prefix_inclusive_product", file_, line_);
}
template <class T> inline T simd_prefix_exclusive_product(T x, MSL_SITE) {
    return msl::collective<T, msl::OpPrefix<msl::CProd, false>>(x, 0, "simd_prefix_exclusive_product", file_, line_);
}
template <class T> inline T simd_shuffle(T x, ushort lane, MSL_SITE) {
    return msl::collective<T, msl::OpShuffle<msl::SH_IDX>>(x, lane, "simd_shuffle", file_, line_);
}
template <class T> inline T simd_broadcast(T x, ushort lane, MSL_SITE) {
    return msl::collective<T, msl::OpShuffle<msl::SH_IDX>>(x, lane, "simd_broadcast", file_, line_);
}
template <class T> inline T simd_shuffle_xor(T x, ushort mask, MSL_SITE) {
    return msl::collective<T, msl::OpShuffle<msl::SH_XOR>>(x, mask, "simd_shuffle_xor", file_, line_);
}
template <class T> inline T simd_shuffle_up(T x, ushort delta, MSL_SITE) {
    return msl::collective<T, msl::OpShuffle<msl::SH_UP>>(x, delta, "simd_shuffle_up", file_, line_);
}
template <class T> inline T simd_shuffle_down(T x, ushort delta, MSL_SITE) {
    return msl::collective<T, msl::OpShuffle<msl::SH_DOWN>>(x, delta, "simd_shuffle_down", file_, line_);
}
template <class T> inline T simd_shuffle_rotate_up(T x, ushort delta, MSL_SITE) {
    return msl::collective<T, msl::OpShuffle<msl::SH_ROT_UP>>(x, delta, "simd_shuffle_rotate_up", file_, line_);
}
template <class T> inline T simd_shuffle_rotate_down(T x, ushort delta, MSL_SITE) {
    return msl::collective<T, msl::OpShuffle<msl::SH_ROT_DOWN>>(x, delta, "simd_shuffle_rotate_down", file_, line_);
}
template <class T> inline T simd_broadcast_first(T x, MSL_SITE) {
    return msl::collective<T, msl::OpShuffle<msl::SH_FIRST>>(x, 0, "simd_broadcast_first", file_, line_);
}

struct simd_vote {
    typedef uint64_t vote_t;
    vote_t v;
    explicit simd_vote(vote_t m = 0) : v(m) {}
    explicit operator vote_t() const { return v; }
    bool all() const;
    bool any() const { return v != 0; }
};
inline simd_vote simd_ballot(bool b, MSL_SITE) {
    return simd_vote(msl::collective<uint64_t, msl::OpBallot>(b, 0, "simd_ballot", file_, line_));
}
inline bool simd_all(bool b, MSL_SITE) {
    uint64_t m = msl::collective<uint64_t, msl::OpBallot>(b, 0, "simd_all", file_, line_);
    uint64_t a = msl::active_info("simd_all", file_, line_) >> 1;
    return m == a;
}
inline bool simd_any(bool b, MSL_SITE) { return msl::collective<uint64_t, msl::OpBallot>(b, 0, "simd_any", file_, line_) != 0; }
inline bool simd_is_first(MSL_SITE) { return msl::active_info("simd_is_first", file_, line_) & 1; }
inline simd_vote simd_active_threads_mask(MSL_SITE) {
    return simd_vote(msl::active_info("simd_active_threads_mask", file_, line_) >> 1);
}

// ---------------------------------------------------------------- atomics
enum memory_order { memory_order_relaxed, memory_order_acquire, memory_order_release, memory_order_acq_rel, memory_order_seq_cst };
template <class T> struct _atomic {
    T v;
};
template <class T> using atomic = _atomic<T>;
typedef _atomic<int> atomic_int;
typedef _atomic<uint> atomic_uint;
typedef _atomic<float> atomic_float;
typedef _atomic<bool> atomic_bool;
typedef _atomic<ulong> atomic_ulong;

template <class P> inline auto atomic_target(const P& obj) -> decltype(&msl::raw(obj)->v) { return &msl::raw(obj)->v; }

#define MSL_ATOMIC_RMW(name, expr, intrinsic)                                                      \
    template <class P, class U> inline auto name(const P& obj, U val, memory_order = memory_order_relaxed, memory_order = memory_order_relaxed) \
        -> typename std::remove_pointer<decltype(atomic_target(obj))>::type {                      \
        auto* p = atomic_target(obj);                                                              \
        typedef typename std::remove_pointer<decltype(p)>::type T;                                 \
        T v = T(val);                                                                              \
        if constexpr (std::is_integral<T>::value && intrinsic) {                                   \
            return (expr);                                                                         \
        } else {                                                                                   \
            T old;                                                                                 \
            __atomic_load(p, &old, __ATOMIC_RELAXED);                                              \
            for (;;) {                                                                             \
                T nv = msl_atomic_op_##name(old, v);                                               \
                if (__atomic_compare_exchange(p, &old, &nv, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) return old; \
            }                                                                                      \
        }                                                                                          \
    }
template <class T> inline T msl_atomic_op_atomic_fetch_add_explicit(T a, T b) { return T(a + b); }
template <class T> inline T msl_atomic_op_atomic_fetch_sub_explicit(T a, T b) { return T(a - b); }
template <class T> inline T msl_atomic_op_atomic_fetch_and_explicit(T a, T b) { return T(a & b); }
template <class T> inline T msl_atomic_op_atomic_fetch_or_explicit(T a, T b) { return T(a | b); }
template <class T> inline T msl_atomic_op_atomic_fetch_xor_explicit(T a, T b) { return T(a ^ b); }
template <class T> inline T msl_atomic_op_atomic_fetch_min_explicit(T a, T b) { return b < a ? b : a; }
template <class T> inline T msl_atomic_op_atomic_fetch_max_explicit(T a, T b) { return a < b ? b : a; }
template <class T> inline T msl_atomic_op_atomic_exchange_explicit(T, T b) { return b; }
MSL_ATOMIC_RMW(atomic_fetch_add_explicit, __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST), true)
MSL_ATOMIC_RMW(atomic_fetch_sub_explicit, __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST), true)
MSL_ATOMIC_RMW(atomic_fetch_and_explicit, __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST), true)
MSL_ATOMIC_RMW(atomic_fetch_or_explicit, __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST), true)
MSL_ATOMIC_RMW(atomic_fetch_xor_explicit, __atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST), true)
MSL_ATOMIC_RMW(atomic_fetch_min_explicit, v, false)
MSL_ATOMIC_RMW(atomic_fetch_max_explicit, v, false)
MSL_ATOMIC_RMW(atomic_exchange_explicit, v, false)
#undef MSL_ATOMIC_RMW
template <class P> inline auto atomic_load_explicit(const P& obj, memory_order = memory_order_relaxed)
    -> typename std::remove_pointer<decltype(atomic_target(obj))>::type {
    auto* p = atomic_target(obj);
    typename std::remove_pointer<decltype(p)>::type r;
    __atomic_load(p, &r, __ATOMIC_SEQ_CST);
    return r;
}
template <class P, class U> inline void atomic_store_explicit(const P& obj, U val, memory_order = memory_order_relaxed) {
    auto* p = atomic_target(obj);
    typename std::remove_pointer<decltype(p)>::type v = val;
    __atomic_store(p, &v, __ATOMIC_SEQ_CST);
}
template <class P, class E, class U>
inline bool atomic_compare_exchange_weak_explicit(const P& obj, E* expected, U desired, memory_order = memory_order_relaxed,
                                                  memory_order = memory_order_relaxed) {
    auto* p = atomic_target(obj);
    typename std::remove_pointer<decltype(p)>::type d = desired;
    return __atomic_compare_exchange(p, expected, &d, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

// ---------------------------------------------------------------- simdgroup_matrix (8x8)
// Each lane holds 2 elements. The lane -> (row, col) layout is the one MLX's steel MMA fragments
// use (row = 4*b4 + 2*b2 + b1, col = 4*b3 + 2*b0 for lane bits b4..b0, elements col and col+1).
// It is not documented by Apple: kernels that index thread_elements() directly are only as right
// as this assumption (load/store/multiply_accumulate are self-consistent regardless).
template <class T, int R, int C> struct simdgroup_matrix {
    static_assert(R == 8 && C == 8, "msl_sim models 8x8 simdgroup matrices only");
    vec<T, 2> e;
    simdgroup_matrix() = default;
    explicit simdgroup_matrix(T diag) {
        uint ln = msl::cur()->lane;
        int r = int(4 * ((ln >> 4) & 1) + 2 * ((ln >> 2) & 1) + ((ln >> 1) & 1));
        int c = int(4 * ((ln >> 3) & 1) + 2 * (ln & 1));
        e.e[0] = (r == c) ? diag : T(0);
        e.e[1] = (r == c + 1) ? diag : T(0);
    }
    vec<T, 2>& thread_elements() { return e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

inline void sg_coord(uint ln, int* r, int* c) {
    *r = int(4 * ((ln >> 4) & 1) + 2 * ((ln >> 2) & 1) + ((ln >> 1) & 1));
    *c = int(4 * ((ln >> 3) & 1) + 2 * (ln & 1));
}
template <class T, int R, int C> inline simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T v) {
    simdgroup_matrix<T, R, C> m;
    m.e.e[0] = m.e.e[1] = v;
    return m;
}
template <class T, class P>
inline void simdgroup_load(simdgroup_matrix<T, 8, 8>& m, const P& src, ulong elements_per_row = 8, vec<ulong, 2> origin = vec<ulong, 2>(0),
                           bool transpose = false) {
    int r, c;
    sg_coord(msl::cur()->lane, &r, &c);
    for (int j = 0; j < 2; ++j) {
        ulong rr = ulong(r), cc = ulong(c + j);
        ulong off = transpose ? (origin.y + cc) * elements_per_row + origin.x + rr : (origin.y + rr) * elements_per_row + origin.x + cc;
        auto* q = msl::raw(src + ptrdiff_t(off));
        msl::note_bank(q, sizeof(*q), j == 1);   // one SIMD-group access: the lane's two elements
        m.e.e[j] = T(*q);
    }
}
template <class T, class P>
inline void simdgroup_store(const simdgroup_matrix<T, 8, 8>& m, const P& dst, ulong elements_per_row = 8,
                            vec<ulong, 2> origin = vec<ulong, 2>(0), bool transpose = false) {
    int r, c;
    sg_coord(msl::cur()->lane, &r, &c);
    for (int j = 0; j < 2; ++j) {
        ulong rr = ulong(r), cc = ulong(c + j);
        ulong off = transpose ? (origin.y + cc) * elements_per_row + origin.x + rr : (origin.y + rr) * elements_per_row + origin.x + cc;
        auto* q = msl::raw(dst + ptrdiff_t(off));
        msl::note_bank(q, sizeof(*q), j == 1);
        *q = m.e.e[j];
    }
}
}  // namespace metal

namespace msl {
template <class TA, class TB, class TC> struct MmaIn {
    metal::vec<TA, 2> a;
    metal::vec<TB, 2> b;
    metal::vec<TC, 2> c;
};
struct OpMma {
    template <class TA, class TB, class TC, class TD>
    static const char* run(const MmaIn<TA, TB, TC>* in, metal::vec<TD, 2>* out, uint32_t act, const int64_t*) {
        if (act != 0xffffffffu) return "simdgroup_multiply_accumulate needs all 32 lanes of the SIMD-group active";
        float A[8][8], B[8][8], C[8][8];
        for (uint ln = 0; ln < 32; ++ln) {
            int r, c;
            metal::sg_coord(ln, &r, &c);
            for (int j = 0; j < 2; ++j) {
                A[r][c + j] = float(in[ln].a.e[j]);
                B[r][c + j] = float(in[ln].b.e[j]);
                C[r][c + j] = float(in[ln].c.e[j]);
            }
        }
        for (uint ln = 0; ln < 32; ++ln) {
            int r, c;
            metal::sg_coord(ln, &r, &c);
            for (int j = 0; j < 2; ++j) {
                float s = C[r][c + j];
                for (int k = 0; k < 8; ++k) s = std::fma(A[r][k], B[k][c + j], s);
                out[ln].e[j] = TD(s);
            }
        }
        return nullptr;
    }
};
template <class TA, class TB, class TC, class TD> struct CollectiveMma {
    static const char* resolve(Lane* const* L, uint32_t act) {
        MmaIn<TA, TB, TC> in[32];
        metal::vec<TD, 2> out[32];
        for (int i = 0; i < 32; ++i)
            if (act >> i & 1) in[i] = *static_cast<const MmaIn<TA, TB, TC>*>(L[i]->in);
        const char* err = OpMma::run(in, out, act, nullptr);
        if (err) return err;
        for (int i = 0; i < 32; ++i)
            if (act >> i & 1) *static_cast<metal::vec<TD, 2>*>(L[i]->out) = out[i];
        return nullptr;
    }
};
}  // namespace msl

namespace metal {
template <class TD, class TA, class TB, class TC>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                          const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c, MSL_SITE) {
    msl::MmaIn<TA, TB, TC> in{a.e, b.e, c.e};
    vec<TD, 2> out;
    msl::park_at_simd(&in, &out, 0, "simdgroup_multiply_accumulate", file_, line_,
                      &msl::CollectiveMma<TA, TB, TC, TD>::resolve);
    d.e = out;
}
template <class TD, class TA, class TB>
inline void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a, const simdgroup_matrix<TB, 8, 8>& b,
                               MSL_SITE) {
    simdgroup_matrix<TD, 8, 8> z = make_filled_simdgroup_matrix<TD, 8, 8>(TD(0));
    simdgroup_multiply_accumulate(d, a, b, z, file_, line_);
}
#undef MSL_SITE
}  // namespace metal

inline bool metal::simd_vote::all() const { return v == (msl::active_info("simd_vote::all", __FILE__, __LINE__) >> 1); }

// ---------------------------------------------------------------- kernel registry
namespace msl {
namespace {
struct Registry {
    KernelInfo k[512];
    uint32_t n = 0;
};
inline Registry& registry() {
    static Registry r;
    return r;
}
struct Registrar {
    Registrar(const char* name, KernelFn fn, const char* file, int line, uint32_t max_threads = 0) {
        Registry& r = registry();
        if (r.n < 512) r.k[r.n++] = KernelInfo{name, fn, file, line, MSL_SIM_CHECKED, max_threads, 0, &g_bank_counting};
    }
};
}  // namespace
}  // namespace msl

#define MSL_CAT_(a, b) a##b
#define MSL_CAT(a, b) MSL_CAT_(a, b)
// Metal: template [[host_name(name)]] [[kernel]] decltype(func<Args>) func<Args>;  (metal/common.h)
#define INSTANTIATE_KERNEL(name, func, ...)                                                        \
    static ::msl::Registrar MSL_CAT(msl_kernel_reg_, __COUNTER__)(                                 \
        name, [](::msl::Lane* l_) { ::msl::tls_lane = l_; func<__VA_ARGS__>(); ::msl::kernel_exit(l_); }, __FILE__, __LINE__);
#define MSL_REGISTER_KERNEL(func, line)                                                            \
    static ::msl::Registrar MSL_CAT(msl_kernel_reg_, __COUNTER__)(                                 \
        #func, [](::msl::Lane* l_) { ::msl::tls_lane = l_; func(); ::msl::kernel_exit(l_); }, __FILE__, line);
// tools/mslpp.py writes these for kernels declared [[kernel, max_total_threads_per_threadgroup(N)]]
#define MSL_INSTANTIATE_KERNEL_MT(max_threads, name, func, ...)                                    \
    static ::msl::Registrar MSL_CAT(msl_kernel_reg_, __COUNTER__)(                                 \
        name, [](::msl::Lane* l_) { ::msl::tls_lane = l_; func<__VA_ARGS__>(); ::msl::kernel_exit(l_); }, __FILE__, \
        __LINE__, (max_threads));
#define MSL_REGISTER_KERNEL_MT(func, line, max_threads)                                            \
    static ::msl::Registrar MSL_CAT(msl_kernel_reg_, __COUNTER__)(                                 \
        #func, [](::msl::Lane* l_) { ::msl::tls_lane = l_; func(); ::msl::kernel_exit(l_); }, __FILE__, line, \
        (max_threads));
#define MSL_EXPORT_LIBRARY(id)                                                                     \
    extern "C" __attribute__((visibility("default"))) const ::msl::KernelTable* MSL_CAT(msl_library_, id)() { \
        static ::msl::KernelTable t;                                                               \
        t.abi_version = ::msl::kAbiVersion;                                                        \
        t.count = ::msl::registry().n;                                                             \
        t.kernels = ::msl::registry().k;                                                           \
        t.compiler = __VERSION__;                                                                  \
        return &t;                                                                                 \
    }

// ---------------------------------------------------------------- MSL keywords and attributes
// Defined last so that no standard header sees them. Each attribute closes the attribute list,
// gives the parameter a default argument and swallows the closing ]] with a dummy parameter:
//   uint lid [[thread_index_in_simdgroup]]
//   -> uint lid [[ ]] = ::msl::b1(...), ::msl::tail_t = ::msl::eat[::msl::eat[0 ]]
// so the runtime calls every kernel with no arguments and each binds itself.
#define kernel
#define device
#define constant
#define threadgroup
#define thread
#define MSL_ARG(expr) ]] = expr, ::msl::tail_t = ::msl::eat[::msl::eat[0
#define buffer(i) MSL_ARG(::msl::buf_arg(i))
#define threadgroup_arg(i) MSL_ARG(::msl::tg_arg(i))
#define thread_position_in_grid MSL_ARG(::msl::b3(::msl::cur()->tpig))
#define thread_position_in_threadgroup MSL_ARG(::msl::b3(::msl::cur()->tpitg))
#define threadgroup_position_in_grid MSL_ARG(::msl::b3(::msl::cur()->grp->tgpig))
#define threads_per_threadgroup MSL_ARG(::msl::b3(::msl::cur()->grp->tg_size))
#define dispatch_threads_per_threadgroup MSL_ARG(::msl::b3(::msl::cur()->grp->tg_size))
#define threadgroups_per_grid MSL_ARG(::msl::b3(::msl::cur()->grp->grid_tgs))
#define threads_per_grid MSL_ARG(::msl::grid_threads())
#define thread_index_in_threadgroup MSL_ARG(::msl::b1(::msl::cur()->index))
#define thread_index_in_simdgroup MSL_ARG(::msl::b1(::msl::cur()->lane))
#define simdgroup_index_in_threadgroup MSL_ARG(::msl::b1(::msl::cur()->sg))
#define simdgroups_per_threadgroup MSL_ARG(::msl::b1(::msl::cur()->grp->nsg))
#define threads_per_simdgroup MSL_ARG(::msl::b1(32))
#define thread_execution_width MSL_ARG(::msl::b1(32))

#pragma GCC diagnostic push
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wuser-defined-literals"
#else
#pragma GCC diagnostic ignored "-Wliteral-suffix"
#endif
inline metal::half operator"" h(long double v) { return metal::half(float(v)); }
inline metal::half operator"" h(unsigned long long v) { return metal::half(float(v)); }
inline metal::bfloat operator"" bf(long double v) { return metal::bfloat(float(v)); }
#pragma GCC diagnostic pop

using namespace metal;

// msl_sim check mode: <metal_stdlib> for `clang++ -fsyntax-only -DMSL_SIM_CHECK_AS` (clang >= 15).
// Declarations only, nothing runs. MSL's address spaces become distinct clang address spaces,
//   device -> address_space(1), constant -> const address_space(2), threadgroup -> address_space(3)
// so that passing a threadgroup pointer where a device pointer is expected, assigning across
// address spaces, dropping an address space, or writing through `constant` are type errors.
// Vectors are clang ext_vector_type (swizzles, element-wise operators, address spaces work as
// for builtin types); MSL-style vector constructors (float4(a, b), vec<T,4>(x)) are rewritten by
// tools/mslpp.py --mode check into ::msl_check::make<float4>(a, b), declared below.
// Not a full MSL compiler: argument types of builtins are checked only as far as declared here.
#pragma once
#if !defined(__clang__)
#error "MSL_SIM_CHECK_AS is for clang++ >= 15 (-fsyntax-only)"
#endif
#include <stddef.h>
#include <stdint.h>

#define device __attribute__((address_space(1)))
#define constant const __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread
#define kernel
#define INSTANTIATE_KERNEL(name, func, ...) template decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;

namespace metal {
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;
typedef __bf16 bfloat;

template <class T, int N> using vec = T __attribute__((ext_vector_type(N)));
#define MSL_CHECK_VEC(T, name)                                                                     \
    typedef vec<T, 2> name##2;                                                                     \
    typedef vec<T, 3> name##3;                                                                     \
    typedef vec<T, 4> name##4;                                                                     \
    typedef vec<T, 2> packed_##name##2;                                                            \
    typedef vec<T, 3> packed_##name##3;                                                            \
    typedef vec<T, 4> packed_##name##4;
MSL_CHECK_VEC(float, float)
MSL_CHECK_VEC(half, half)
MSL_CHECK_VEC(bfloat, bfloat)
MSL_CHECK_VEC(int, int)
MSL_CHECK_VEC(uint, uint)
MSL_CHECK_VEC(short, short)
MSL_CHECK_VEC(ushort, ushort)
MSL_CHECK_VEC(char, char)
MSL_CHECK_VEC(uchar, uchar)
MSL_CHECK_VEC(long, long)
MSL_CHECK_VEC(ulong, ulong)
MSL_CHECK_VEC(bool, bool)
#undef MSL_CHECK_VEC

enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4, mem_threadgroup_imageblock = 8 };
mem_flags operator|(mem_flags, mem_flags);
void threadgroup_barrier(mem_flags = mem_flags::mem_threadgroup);
void simdgroup_barrier(mem_flags = mem_flags::mem_none);

template <class T> T simd_sum(T);
template <class T> T simd_product(T);
template <class T> T simd_max(T);
template <class T> T simd_min(T);
template <class T> T simd_and(T);
template <class T> T simd_or(T);
template <class T> T simd_xor(T);
template <class T> T simd_prefix_inclusive_sum(T);
template <class T> T simd_prefix_exclusive_sum(T);
template <class T> T simd_prefix_inclusive_product(T);
template <class T> T simd_prefix_exclusive_product(T);
template <class T> T simd_shuffle(T, ushort);
template <class T> T simd_broadcast(T, ushort);
template <class T> T simd_shuffle_xor(T, ushort);
template <class T> T simd_shuffle_up(T, ushort);
template <class T> T simd_shuffle_down(T, ushort);
template <class T> T simd_shuffle_rotate_up(T, ushort);
template <class T> T simd_shuffle_rotate_down(T, ushort);
template <class T> T simd_broadcast_first(T);
struct simd_vote {
    typedef uint64_t vote_t;
    explicit operator vote_t() const;
    bool all() const;
    bool any() const;
};
simd_vote simd_ballot(bool);
bool simd_all(bool);
bool simd_any(bool);
bool simd_is_first();
simd_vote simd_active_threads_mask();

// math (scalar and vector alike)
#define MSL_CHECK_F1(name) template <class T> T name(T);
MSL_CHECK_F1(sqrt) MSL_CHECK_F1(rsqrt) MSL_CHECK_F1(exp) MSL_CHECK_F1(exp2) MSL_CHECK_F1(exp10) MSL_CHECK_F1(log)
MSL_CHECK_F1(log2) MSL_CHECK_F1(log10) MSL_CHECK_F1(sin) MSL_CHECK_F1(cos) MSL_CHECK_F1(tan) MSL_CHECK_F1(asin)
MSL_CHECK_F1(acos) MSL_CHECK_F1(atan) MSL_CHECK_F1(sinh) MSL_CHECK_F1(cosh) MSL_CHECK_F1(tanh) MSL_CHECK_F1(asinh)
MSL_CHECK_F1(acosh) MSL_CHECK_F1(atanh) MSL_CHECK_F1(floor) MSL_CHECK_F1(ceil) MSL_CHECK_F1(round) MSL_CHECK_F1(rint)
MSL_CHECK_F1(trunc) MSL_CHECK_F1(fabs) MSL_CHECK_F1(fract) MSL_CHECK_F1(saturate) MSL_CHECK_F1(sign) MSL_CHECK_F1(rcp)
MSL_CHECK_F1(abs) MSL_CHECK_F1(popcount) MSL_CHECK_F1(clz) MSL_CHECK_F1(ctz) MSL_CHECK_F1(normalize)
#undef MSL_CHECK_F1
#define MSL_CHECK_F2(name) template <class T> T name(T, T);
MSL_CHECK_F2(pow) MSL_CHECK_F2(powr) MSL_CHECK_F2(fmax) MSL_CHECK_F2(fmin) MSL_CHECK_F2(fmod) MSL_CHECK_F2(atan2)
MSL_CHECK_F2(copysign) MSL_CHECK_F2(fdim) MSL_CHECK_F2(divide) MSL_CHECK_F2(step) MSL_CHECK_F2(max) MSL_CHECK_F2(min)
MSL_CHECK_F2(mulhi)
#undef MSL_CHECK_F2
template <class T> T clamp(T, T, T);
template <class T> T fma(T, T, T);
template <class T> T mix(T, T, T);
template <class T, class C> T select(T, T, C);
template <class T> T extract_bits(T, uint, uint);
template <class T> T insert_bits(T, T, uint, uint);
template <class T> auto dot(T, T) -> decltype(T()[0]);
template <class T> auto length(T) -> decltype(T()[0]);
template <class T> auto length_squared(T) -> decltype(T()[0]);
template <class T> auto distance(T, T) -> decltype(T()[0]);
template <class T> T cross(T, T);
template <class T> bool isnan(T);
template <class T> bool isinf(T);
template <class T> bool isfinite(T);
template <class T> bool signbit(T);
template <class T> bool all(T);
template <class T> bool any(T);
namespace precise {
using metal::cos;
using metal::divide;
using metal::exp;
using metal::exp2;
using metal::log;
using metal::log2;
using metal::pow;
using metal::rsqrt;
using metal::sin;
using metal::sqrt;
using metal::tanh;
}  // namespace precise
namespace fast {
using metal::cos;
using metal::divide;
using metal::exp;
using metal::exp2;
using metal::log;
using metal::log2;
using metal::pow;
using metal::rsqrt;
using metal::sin;
using metal::sqrt;
using metal::tanh;
}  // namespace fast

template <class To, class From> To as_type(From);
template <class T> struct numeric_limits {
    static T min();
    static T max();
    static T lowest();
    static T epsilon();
    static T infinity();
    static T quiet_NaN();
};

// atomics: one overload per address space, so a wrong address space does not match
enum memory_order { memory_order_relaxed, memory_order_acquire, memory_order_release, memory_order_acq_rel, memory_order_seq_cst };
template <class T> using atomic = _Atomic(T);
typedef _Atomic(int) atomic_int;
typedef _Atomic(uint) atomic_uint;
typedef _Atomic(float) atomic_float;
typedef _Atomic(bool) atomic_bool;
typedef _Atomic(ulong) atomic_ulong;
// non-template overloads per atomic type and address space (deduction through _Atomic(T) fails)
#define MSL_CHECK_ATOMIC_AS(AS, A)                                                                 \
    A atomic_fetch_add_explicit(AS _Atomic(A)*, A, memory_order = memory_order_relaxed);           \
    A atomic_fetch_sub_explicit(AS _Atomic(A)*, A, memory_order = memory_order_relaxed);           \
    A atomic_fetch_and_explicit(AS _Atomic(A)*, A, memory_order = memory_order_relaxed);           \
    A atomic_fetch_or_explicit(AS _Atomic(A)*, A, memory_order = memory_order_relaxed);            \
    A atomic_fetch_xor_explicit(AS _Atomic(A)*, A, memory_order = memory_order_relaxed);           \
    A atomic_fetch_min_explicit(AS _Atomic(A)*, A, memory_order = memory_order_relaxed);           \
    A atomic_fetch_max_explicit(AS _Atomic(A)*, A, memory_order = memory_order_relaxed);           \
    A atomic_exchange_explicit(AS _Atomic(A)*, A, memory_order = memory_order_relaxed);            \
    A atomic_load_explicit(AS _Atomic(A)*, memory_order = memory_order_relaxed);                   \
    void atomic_store_explicit(AS _Atomic(A)*, A, memory_order = memory_order_relaxed);            \
    bool atomic_compare_exchange_weak_explicit(AS _Atomic(A)*, thread A*, A, memory_order, memory_order);
#define MSL_CHECK_ATOMIC(A) MSL_CHECK_ATOMIC_AS(device, A) MSL_CHECK_ATOMIC_AS(threadgroup, A)
MSL_CHECK_ATOMIC(int)
MSL_CHECK_ATOMIC(uint)
MSL_CHECK_ATOMIC(float)
MSL_CHECK_ATOMIC(ulong)
#undef MSL_CHECK_ATOMIC
#undef MSL_CHECK_ATOMIC_AS

// simdgroup matrices: loads and stores exist for device and threadgroup memory only
template <class T, int R, int C> struct simdgroup_matrix {
    simdgroup_matrix();
    explicit simdgroup_matrix(T);
    thread vec<T, 2>& thread_elements();
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
template <class T, int R, int C> simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T);
template <class T, class U>
void simdgroup_load(thread simdgroup_matrix<T, 8, 8>&, const device U*, ulong = 8, ulong2 = 0, bool = false);
template <class T, class U>
void simdgroup_load(thread simdgroup_matrix<T, 8, 8>&, const threadgroup U*, ulong = 8, ulong2 = 0, bool = false);
template <class T, class U>
void simdgroup_store(thread const simdgroup_matrix<T, 8, 8>&, device U*, ulong = 8, ulong2 = 0, bool = false);
template <class T, class U>
void simdgroup_store(thread const simdgroup_matrix<T, 8, 8>&, threadgroup U*, ulong = 8, ulong2 = 0, bool = false);
template <class TD, class TA, class TB, class TC>
void simdgroup_multiply_accumulate(thread simdgroup_matrix<TD, 8, 8>&, thread const simdgroup_matrix<TA, 8, 8>&,
                                   thread const simdgroup_matrix<TB, 8, 8>&, thread const simdgroup_matrix<TC, 8, 8>&);
template <class TD, class TA, class TB>
void simdgroup_multiply(thread simdgroup_matrix<TD, 8, 8>&, thread const simdgroup_matrix<TA, 8, 8>&,
                        thread const simdgroup_matrix<TB, 8, 8>&);

#if __cplusplus >= 202002L
// Metal 4 tensors and MetalPerformancePrimitives' matmul2d: the subset msl_sim emulates (msl_sim/tensor.h),
// for files that include <metal_tensor> (checked as C++20: the descriptor is a class-type template
// parameter). The element type carries the address space: tensor<device float, ...> is built from a
// device float*, tensor<threadgroup float, ...> from a threadgroup float*.
constexpr size_t dynamic_extent = size_t(-1);
template <class I, size_t R> struct dextents {
    static_assert(R == 2, "rank-2 tensors only");
    dextents(I, I);
    I extent(size_t) const;
    static constexpr size_t rank();
};
struct tensor_inline {};
struct execution_simdgroup {};
template <class T, class Extents, class Layout = tensor_inline> struct tensor;
template <class T, class I> struct tensor<T, dextents<I, 2>, tensor_inline> {
    typedef T element_type;
    tensor(thread T*, dextents<I, 2>);
    dextents<I, 2> extents() const;
    tensor slice(I, I) const;
};
#endif
}  // namespace metal

#if __cplusplus >= 202002L
#include "msl_sim/tensor_descriptor.h"
namespace mpp {
namespace tensor_ops {
template <matmul2d_descriptor Descriptor, class Scope> class matmul2d {
  public:
    template <class L, class R, class D> void run(thread L&, thread R&, thread D&) const;
};
}  // namespace tensor_ops
}  // namespace mpp
#endif

namespace msl_check {
// MSL vector constructors (float4(x), float4(a.xy, b.zw), half4(f4), ...), rewritten by mslpp
template <class V, class... A> V make(A... a);
}  // namespace msl_check

#pragma clang diagnostic ignored "-Wuser-defined-literals"
metal::half operator"" h(long double);
metal::half operator"" h(unsigned long long);
metal::bfloat operator"" bf(long double);

#define INFINITY (__builtin_inff())
#define NAN (__builtin_nanf(""))
#define FLT_MAX __FLT_MAX__
#define MAXFLOAT __FLT_MAX__
#define HALF_MAX 65504.0f
#define HALF_MIN 6.103515625e-05f
#define M_PI_F 3.14159265358979323846f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LN2_F 0.693147180559945309417f
#define M_SQRT2_F 1.41421356237309504880f

using namespace metal;

#if defined(MSL_SIM_CONFORM)
// tools/msl_conform.py: MSL attributes as clang annotations (after everything above, which they would break)
#include "msl_sim/conform.h"
#endif

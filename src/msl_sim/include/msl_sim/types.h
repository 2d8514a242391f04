// msl_sim: MSL scalar and vector types for the simulator (host C++17).
//   half   = _Float16 (g++ >= 12, clang >= 15); arithmetic rounds to half per operation.
//   bfloat = a 16-bit struct, round-to-nearest-even from float; arithmetic happens in float
//            (bfloat op bfloat yields float and rounds when stored back into a bfloat).
//   vec<T,N> (float4, half2, uint3, ...): components .x.y.z.w / .r.g.b.a, operator[], every
//            swizzle (.xy, .zyx, .rgba, ... readable and assignable), element-wise operators,
//            MSL constructors (float4(x), float4(a.xy, b.zw), float4(x, y, z, w), explicit
//            float4(half4)). 3-component vectors are 4-element aligned as in Metal.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "msl_sim/swizzles.inc"

namespace metal {

typedef _Float16 half;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;  // 64-bit as in MSL (LP64 hosts)
using ::int8_t;
using ::int16_t;
using ::int32_t;
using ::int64_t;
using ::uint8_t;
using ::uint16_t;
using ::uint32_t;
using ::uint64_t;
using ::size_t;
typedef ptrdiff_t ptrdiff_t;

struct bfloat {
    uint16_t bits;
    bfloat() = default;
    bfloat(float f) : bits(from_float(f)) {}
    template <class U, typename std::enable_if<std::is_arithmetic<U>::value || std::is_same<U, half>::value, int>::type = 0>
    bfloat(U u) : bits(from_float(float(u))) {}
    operator float() const {
        uint32_t u = uint32_t(bits) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    static uint16_t from_float(float f) {
        uint32_t u;
        std::memcpy(&u, &f, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // NaN stays NaN
        u += 0x7fffu + ((u >> 16) & 1u);                                          // round to nearest even
        return uint16_t(u >> 16);
    }
    bfloat& operator+=(float o) { return *this = bfloat(float(*this) + o); }
    bfloat& operator-=(float o) { return *this = bfloat(float(*this) - o); }
    bfloat& operator*=(float o) { return *this = bfloat(float(*this) * o); }
    bfloat& operator/=(float o) { return *this = bfloat(float(*this) / o); }
};

template <class T, int N> struct vec;
template <class T, int S, int... I> struct swz;

// ---- traits: what a vector-like argument is
template <class A> struct vt { static constexpr int n = 0; };
template <class T, int N> struct vt<vec<T, N>> { typedef T E; static constexpr int n = N; };
template <class T, int S, int... I> struct vt<swz<T, S, I...>> { typedef T E; static constexpr int n = sizeof...(I); };
template <class A> struct is_msl_scalar
    : std::integral_constant<bool, std::is_arithmetic<A>::value || std::is_same<A, half>::value ||
                                       std::is_same<A, bfloat>::value> {};
template <class A> constexpr int ncomp() { return vt<A>::n ? vt<A>::n : 1; }

template <class A, class B, class = void> struct vbin {};
template <class A, class B>
struct vbin<A, B, typename std::enable_if<(vt<A>::n > 0) && (vt<B>::n > 0)>::type> {
    static_assert(vt<A>::n == vt<B>::n, "MSL: vector operands must have the same number of components");
    static_assert(std::is_same<typename vt<A>::E, typename vt<B>::E>::value,
                  "MSL: vector operands must have the same element type (convert explicitly)");
    typedef vec<typename vt<A>::E, vt<A>::n> type;
};
template <class A, class B>
struct vbin<A, B, typename std::enable_if<(vt<A>::n > 0) && is_msl_scalar<B>::value>::type> {
    typedef vec<typename vt<A>::E, vt<A>::n> type;
};
template <class A, class B>
struct vbin<A, B, typename std::enable_if<is_msl_scalar<A>::value && (vt<B>::n > 0)>::type> {
    typedef vec<typename vt<B>::E, vt<B>::n> type;
};

template <class A> struct is_vec : std::false_type {};
template <class T, int N> struct is_vec<vec<T, N>> : std::true_type {};
template <class V, class A> inline typename V::value_type vget(const A& a, int i) {
    if constexpr (is_vec<A>::value) return a.e[i];
    else if constexpr (vt<A>::n > 0) return a.d[A::idx[i]];
    else return typename V::value_type(a);
}

// ---- swizzle proxy: lives in the vector's union, aliases its storage
template <class T, int S, int... I> struct swz {
    T d[S];
    typedef vec<T, int(sizeof...(I))> V;
    static constexpr int idx[sizeof...(I)] = {I...};
    operator V() const { return V(d[I]...); }
    swz& operator=(const V& v) {
        int k = 0;
        int dummy[] = {((d[I] = v.e[k++]), 0)...};
        (void)dummy;
        return *this;
    }
    swz& operator=(const swz& o) { return *this = V(o); }
    template <class B> swz& operator+=(const B& b) { return *this = V(*this) + b; }
    template <class B> swz& operator-=(const B& b) { return *this = V(*this) - b; }
    template <class B> swz& operator*=(const B& b) { return *this = V(*this) * b; }
    template <class B> swz& operator/=(const B& b) { return *this = V(*this) / b; }
};

#define MSL_DECL_SWZ(name, ...) swz<T, kStore, __VA_ARGS__> name;

#define MSL_VEC_COMMON(N)                                                                          \
    typedef T value_type;                                                                          \
    static constexpr int size = N;                                                                 \
    vec() = default;                                                                               \
    vec(const vec&) = default;                                                                     \
    vec& operator=(const vec& o) {                                                                 \
        for (int i = 0; i < kStore; ++i) e[i] = o.e[i];                                            \
        return *this;                                                                              \
    }                                                                                              \
    vec(T s) {                                                                                     \
        for (int i = 0; i < kStore; ++i) e[i] = s;                                                 \
    }                                                                                              \
    template <class U, typename std::enable_if<is_msl_scalar<U>::value && !std::is_same<U, T>::value, int>::type = 0> \
    vec(U s) {                                                                                     \
        for (int i = 0; i < kStore; ++i) e[i] = T(s);                                              \
    }                                                                                              \
    template <class U, typename std::enable_if<!std::is_same<U, T>::value, int>::type = 0>          \
    explicit vec(const vec<U, N>& o) {                                                             \
        for (int i = 0; i < N; ++i) e[i] = T(o.e[i]);                                              \
        for (int i = N; i < kStore; ++i) e[i] = T(0);                                              \
    }                                                                                              \
    template <class A0, class A1, class... A,                                                      \
              typename std::enable_if<ncomp<A0>() + ncomp<A1>() + (0 + ... + ncomp<A>()) == N, int>::type = 0> \
    vec(const A0& a0, const A1& a1, const A&... a) {                                               \
        int k = 0;                                                                                 \
        fill(k, a0);                                                                               \
        fill(k, a1);                                                                               \
        int dummy[] = {0, (fill(k, a), 0)...};                                                     \
        (void)dummy;                                                                               \
        for (int i = N; i < kStore; ++i) e[i] = T(0);                                              \
    }                                                                                              \
    template <class A> void fill(int& k, const A& a) {                                             \
        if constexpr (vt<A>::n > 0) {                                                              \
            vec<typename vt<A>::E, vt<A>::n> v(a);                                                 \
            for (int i = 0; i < vt<A>::n; ++i) e[k++] = T(v.e[i]);                                \
        } else {                                                                                   \
            e[k++] = T(a);                                                                         \
        }                                                                                          \
    }                                                                                              \
    T& operator[](int i) { return e[i]; }                                                          \
    const T& operator[](int i) const { return e[i]; }                                              \
    template <class B> vec& operator+=(const B& b) { return *this = *this + b; }                    \
    template <class B> vec& operator-=(const B& b) { return *this = *this - b; }                    \
    template <class B> vec& operator*=(const B& b) { return *this = *this * b; }                    \
    template <class B> vec& operator/=(const B& b) { return *this = *this / b; }                    \
    template <class B> vec& operator%=(const B& b) { return *this = *this % b; }                    \
    template <class B> vec& operator&=(const B& b) { return *this = *this & b; }                    \
    template <class B> vec& operator|=(const B& b) { return *this = *this | b; }                    \
    template <class B> vec& operator^=(const B& b) { return *this = *this ^ b; }                    \
    template <class B> vec& operator<<=(const B& b) { return *this = *this << b; }                  \
    template <class B> vec& operator>>=(const B& b) { return *this = *this >> b; }

template <class T> struct alignas(sizeof(T) * 2) vec<T, 2> {
    static constexpr int kStore = 2;
    union {
        T e[2];
        struct { T x, y; };
        struct { T r, g; };
        MSL_SWIZZLES_2(MSL_DECL_SWZ)
    };
    MSL_VEC_COMMON(2)
};
template <class T> struct alignas(sizeof(T) * 4) vec<T, 3> {
    static constexpr int kStore = 4;
    union {
        T e[4];
        struct { T x, y, z; };
        struct { T r, g, b; };
        MSL_SWIZZLES_3(MSL_DECL_SWZ)
    };
    MSL_VEC_COMMON(3)
};
template <class T> struct alignas(sizeof(T) * 4) vec<T, 4> {
    static constexpr int kStore = 4;
    union {
        T e[4];
        struct { T x, y, z, w; };
        struct { T r, g, b, a; };
        MSL_SWIZZLES_4(MSL_DECL_SWZ)
    };
    MSL_VEC_COMMON(4)
};
#undef MSL_VEC_COMMON
#undef MSL_DECL_SWZ

// ---- element-wise operators (vector op vector, vector op scalar, scalar op vector)
#define MSL_VEC_BINOP(op)                                                                          \
    template <class A, class B, class V = typename vbin<A, B>::type>                               \
    inline V operator op(const A& a, const B& b) {                                                 \
        V r;                                                                                       \
        for (int i = 0; i < V::size; ++i)                                                          \
            r.e[i] = typename V::value_type(vget<V>(a, i) op vget<V>(b, i));                       \
        return r;                                                                                  \
    }
MSL_VEC_BINOP(+)
MSL_VEC_BINOP(-)
MSL_VEC_BINOP(*)
MSL_VEC_BINOP(/)
MSL_VEC_BINOP(%)
MSL_VEC_BINOP(&)
MSL_VEC_BINOP(|)
MSL_VEC_BINOP(^)
MSL_VEC_BINOP(<<)
MSL_VEC_BINOP(>>)
#undef MSL_VEC_BINOP
#define MSL_VEC_CMP(op)                                                                            \
    template <class A, class B, class V = typename vbin<A, B>::type>                               \
    inline vec<bool, V::size> operator op(const A& a, const B& b) {                                \
        vec<bool, V::size> r;                                                                      \
        for (int i = 0; i < V::size; ++i) r.e[i] = vget<V>(a, i) op vget<V>(b, i);                 \
        return r;                                                                                  \
    }
MSL_VEC_CMP(==)
MSL_VEC_CMP(!=)
MSL_VEC_CMP(<)
MSL_VEC_CMP(>)
MSL_VEC_CMP(<=)
MSL_VEC_CMP(>=)
MSL_VEC_CMP(&&)
MSL_VEC_CMP(||)
#undef MSL_VEC_CMP
template <class A, class V = vec<typename vt<A>::E, vt<A>::n>> inline V operator-(const A& a) {
    V v(a), r;
    for (int i = 0; i < V::size; ++i) r.e[i] = typename V::value_type(-v.e[i]);
    return r;
}
template <class A, class V = vec<typename vt<A>::E, vt<A>::n>> inline V operator+(const A& a) { return V(a); }
template <class A, class V = vec<typename vt<A>::E, vt<A>::n>> inline V operator~(const A& a) {
    V v(a), r;
    for (int i = 0; i < V::size; ++i) r.e[i] = typename V::value_type(~v.e[i]);
    return r;
}
template <class A, class V = vec<typename vt<A>::E, vt<A>::n>> inline vec<bool, V::size> operator!(const A& a) {
    V v(a);
    vec<bool, V::size> r;
    for (int i = 0; i < V::size; ++i) r.e[i] = !v.e[i];
    return r;
}

// ---- packed vectors (no padding, element alignment)
template <class T, int N> struct packed_vec {
    T e[N];
    packed_vec() = default;
    packed_vec(const vec<T, N>& v) {
        for (int i = 0; i < N; ++i) e[i] = v.e[i];
    }
    operator vec<T, N>() const {
        vec<T, N> v;
        for (int i = 0; i < N; ++i) v.e[i] = e[i];
        for (int i = N; i < vec<T, N>::kStore; ++i) v.e[i] = T(0);
        return v;
    }
    T& operator[](int i) { return e[i]; }
    const T& operator[](int i) const { return e[i]; }
};

#define MSL_VEC_TYPEDEFS(T, name)                                                                  \
    typedef vec<T, 2> name##2;                                                                     \
    typedef vec<T, 3> name##3;                                                                     \
    typedef vec<T, 4> name##4;                                                                     \
    typedef packed_vec<T, 2> packed_##name##2;                                                     \
    typedef packed_vec<T, 3> packed_##name##3;                                                     \
    typedef packed_vec<T, 4> packed_##name##4;
MSL_VEC_TYPEDEFS(float, float)
MSL_VEC_TYPEDEFS(half, half)
MSL_VEC_TYPEDEFS(bfloat, bfloat)
MSL_VEC_TYPEDEFS(int, int)
MSL_VEC_TYPEDEFS(uint, uint)
MSL_VEC_TYPEDEFS(short, short)
MSL_VEC_TYPEDEFS(ushort, ushort)
MSL_VEC_TYPEDEFS(char, char)
MSL_VEC_TYPEDEFS(uchar, uchar)
MSL_VEC_TYPEDEFS(long, long)
MSL_VEC_TYPEDEFS(ulong, ulong)
MSL_VEC_TYPEDEFS(bool, bool)
#undef MSL_VEC_TYPEDEFS

// ---- numeric limits (std's, plus half and bfloat)
template <class T> struct numeric_limits : std::numeric_limits<T> {};
template <> struct numeric_limits<half> {
    static constexpr bool is_specialized = true;
    static half min() { return half(6.103515625e-05f); }
    static half max() { return half(65504.0f); }
    static half lowest() { return half(-65504.0f); }
    static half epsilon() { return half(0.0009765625f); }
    static half infinity() { return half(std::numeric_limits<float>::infinity()); }
    static half quiet_NaN() { return half(std::numeric_limits<float>::quiet_NaN()); }
};
template <> struct numeric_limits<bfloat> {
    static constexpr bool is_specialized = true;
    static bfloat min() { return bfloat(1.17549435e-38f); }
    static bfloat max() { return bfloat(3.38953139e38f); }
    static bfloat lowest() { return bfloat(-3.38953139e38f); }
    static bfloat epsilon() { return bfloat(0.0078125f); }
    static bfloat infinity() { return bfloat(std::numeric_limits<float>::infinity()); }
    static bfloat quiet_NaN() { return bfloat(std::numeric_limits<float>::quiet_NaN()); }
};

template <class To, class From> inline To as_type(const From& f) {
    static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
    To t;
    std::memcpy(static_cast<void*>(&t), static_cast<const void*>(&f), sizeof(To));
    return t;
}

}  // namespace metal

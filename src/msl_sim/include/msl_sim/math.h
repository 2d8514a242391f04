// msl_sim: the MSL math, integer, geometric and relational functions kernels use, for scalars
// (float, half, bfloat, integers) and vectors. Precise libm everywhere: the simulator does not
// model Metal's fast-math defaults (see docs/verification.md).
#pragma once
#include <cfloat>
#include <cmath>

#include "msl_sim/types.h"

namespace metal {

template <class A> using vec_of = vec<typename vt<A>::E, vt<A>::n>;

#define MSL_MATH1(name, expr)                                                                      \
    inline float name(float x) { return (expr); }                                                  \
    inline half name(half h) { return half(name(float(h))); }                                      \
    inline bfloat name(bfloat b) { return bfloat(name(float(b))); }                                \
    template <class A, class V = vec_of<A>> inline V name(const A& a) {                            \
        V v(a), r;                                                                                 \
        for (int i = 0; i < V::size; ++i) r.e[i] = name(v.e[i]);                                   \
        return r;                                                                                  \
    }
MSL_MATH1(sqrt, std::sqrt(x))
MSL_MATH1(rsqrt, 1.0f / std::sqrt(x))
MSL_MATH1(exp, std::exp(x))
MSL_MATH1(exp2, std::exp2(x))
MSL_MATH1(exp10, std::pow(10.0f, x))
MSL_MATH1(log, std::log(x))
MSL_MATH1(log2, std::log2(x))
MSL_MATH1(log10, std::log10(x))
MSL_MATH1(sin, std::sin(x))
MSL_MATH1(cos, std::cos(x))
MSL_MATH1(tan, std::tan(x))
MSL_MATH1(asin, std::asin(x))
MSL_MATH1(acos, std::acos(x))
MSL_MATH1(atan, std::atan(x))
MSL_MATH1(sinh, std::sinh(x))
MSL_MATH1(cosh, std::cosh(x))
MSL_MATH1(tanh, std::tanh(x))
MSL_MATH1(asinh, std::asinh(x))
MSL_MATH1(acosh, std::acosh(x))
MSL_MATH1(atanh, std::atanh(x))
MSL_MATH1(floor, std::floor(x))
MSL_MATH1(ceil, std::ceil(x))
MSL_MATH1(round, std::round(x))
MSL_MATH1(rint, std::rint(x))
MSL_MATH1(trunc, std::trunc(x))
MSL_MATH1(fabs, std::fabs(x))
MSL_MATH1(fract, x - std::floor(x))
MSL_MATH1(saturate, std::fmin(std::fmax(x, 0.0f), 1.0f))
MSL_MATH1(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f))
MSL_MATH1(rcp, 1.0f / x)
#undef MSL_MATH1

#define MSL_MATH2(name, expr)                                                                      \
    inline float name(float x, float y) { return (expr); }                                         \
    inline half name(half a, half b) { return half(name(float(a), float(b))); }                    \
    inline bfloat name(bfloat a, bfloat b) { return bfloat(name(float(a), float(b))); }            \
    template <class A, class B, class V = typename vbin<A, B>::type> inline V name(const A& a, const B& b) { \
        V r;                                                                                       \
        for (int i = 0; i < V::size; ++i) r.e[i] = name(vget<V>(a, i), vget<V>(b, i));             \
        return r;                                                                                  \
    }
MSL_MATH2(pow, std::pow(x, y))
MSL_MATH2(powr, std::pow(x, y))
MSL_MATH2(fmax, std::fmax(x, y))
MSL_MATH2(fmin, std::fmin(x, y))
MSL_MATH2(fmod, std::fmod(x, y))
MSL_MATH2(atan2, std::atan2(x, y))
MSL_MATH2(copysign, std::copysign(x, y))
MSL_MATH2(fdim, std::fdim(x, y))
MSL_MATH2(divide, x / y)
MSL_MATH2(step, y < x ? 0.0f : 1.0f)
#undef MSL_MATH2

// min/max/clamp/abs for every scalar type (integers too) and vectors
template <class T, typename std::enable_if<is_msl_scalar<T>::value, int>::type = 0> inline T max(T a, T b) {
    return a < b ? b : a;
}
template <class T, typename std::enable_if<is_msl_scalar<T>::value, int>::type = 0> inline T min(T a, T b) {
    return b < a ? b : a;
}
template <class A, class B, class V = typename vbin<A, B>::type> inline V max(const A& a, const B& b) {
    V r;
    for (int i = 0; i < V::size; ++i) r.e[i] = max(vget<V>(a, i), vget<V>(b, i));
    return r;
}
template <class A, class B, class V = typename vbin<A, B>::type> inline V min(const A& a, const B& b) {
    V r;
    for (int i = 0; i < V::size; ++i) r.e[i] = min(vget<V>(a, i), vget<V>(b, i));
    return r;
}
template <class T, typename std::enable_if<is_msl_scalar<T>::value, int>::type = 0>
inline T clamp(T x, T lo, T hi) {
    return min(max(x, lo), hi);
}
template <class A, class B, class C, class V = vec_of<A>> inline V clamp(const A& x, const B& lo, const C& hi) {
    V r;
    for (int i = 0; i < V::size; ++i) r.e[i] = clamp(vget<V>(x, i), vget<V>(lo, i), vget<V>(hi, i));
    return r;
}
template <class T, typename std::enable_if<is_msl_scalar<T>::value, int>::type = 0> inline T abs(T x) {
    return x < T(0) ? T(-x) : x;
}
template <class A, class V = vec_of<A>> inline V abs(const A& a) {
    V v(a), r;
    for (int i = 0; i < V::size; ++i) r.e[i] = abs(v.e[i]);
    return r;
}
template <class T, typename std::enable_if<is_msl_scalar<T>::value, int>::type = 0> inline T fma(T a, T b, T c) {
    return T(std::fma(float(a), float(b), float(c)));
}
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
template <class A, class B, class C, class V = vec_of<A>> inline V fma(const A& a, const B& b, const C& c) {
    V r;
    for (int i = 0; i < V::size; ++i) r.e[i] = fma(vget<V>(a, i), vget<V>(b, i), vget<V>(c, i));
    return r;
}
template <class T, typename std::enable_if<is_msl_scalar<T>::value, int>::type = 0> inline T mix(T a, T b, T t) {
    return T(a + (b - a) * t);
}
template <class A, class B, class C, class V = vec_of<A>> inline V mix(const A& a, const B& b, const C& t) {
    V r;
    for (int i = 0; i < V::size; ++i) r.e[i] = mix(vget<V>(a, i), vget<V>(b, i), vget<V>(t, i));
    return r;
}
template <class T, typename std::enable_if<is_msl_scalar<T>::value, int>::type = 0>
inline T select(T a, T b, bool c) {
    return c ? b : a;
}
template <class A, class B, class C, class V = vec_of<A>> inline V select(const A& a, const B& b, const C& c) {
    V r;
    for (int i = 0; i < V::size; ++i) {
        bool ci;
        if constexpr (vt<C>::n > 0) ci = vec_of<C>(c).e[i];
        else ci = bool(c);
        r.e[i] = ci ? vget<V>(b, i) : vget<V>(a, i);
    }
    return r;
}

// relational
template <class T, typename std::enable_if<is_msl_scalar<T>::value, int>::type = 0> inline bool isnan(T x) {
    return std::isnan(float(x));
}
template <class T, typename std::enable_if<is_msl_scalar<T>::value, int>::type = 0> inline bool isinf(T x) {
    return std::isinf(float(x));
}
template <class T, typename std::enable_if<is_msl_scalar<T>::value, int>::type = 0> inline bool isfinite(T x) {
    return std::isfinite(float(x));
}
template <class T, typename std::enable_if<is_msl_scalar<T>::value, int>::type = 0> inline bool signbit(T x) {
    return std::signbit(float(x));
}
#define MSL_REL_VEC(name)                                                                          \
    template <class A, class V = vec_of<A>> inline vec<bool, V::size> name(const A& a) {           \
        V v(a);                                                                                    \
        vec<bool, V::size> r;                                                                      \
        for (int i = 0; i < V::size; ++i) r.e[i] = name(v.e[i]);                                   \
        return r;                                                                                  \
    }
MSL_REL_VEC(isnan)
MSL_REL_VEC(isinf)
MSL_REL_VEC(isfinite)
MSL_REL_VEC(signbit)
#undef MSL_REL_VEC
inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }
template <int N> inline bool all(const vec<bool, N>& v) {
    for (int i = 0; i < N; ++i)
        if (!v.e[i]) return false;
    return true;
}
template <int N> inline bool any(const vec<bool, N>& v) {
    for (int i = 0; i < N; ++i)
        if (v.e[i]) return true;
    return false;
}

// geometric
template <class A, class B, class V = typename vbin<A, B>::type> inline typename V::value_type dot(const A& a, const B& b) {
    float s = 0.0f;
    for (int i = 0; i < V::size; ++i) s += float(vget<V>(a, i)) * float(vget<V>(b, i));
    return typename V::value_type(s);
}
template <class A, class V = vec_of<A>> inline typename V::value_type length_squared(const A& a) { return dot(V(a), V(a)); }
template <class A, class V = vec_of<A>> inline typename V::value_type length(const A& a) {
    return typename V::value_type(std::sqrt(float(dot(V(a), V(a)))));
}
template <class A, class V = vec_of<A>> inline V normalize(const A& a) {
    V v(a);
    return v * typename V::value_type(1.0f / std::sqrt(float(dot(v, v))));
}
template <class A, class B, class V = typename vbin<A, B>::type> inline typename V::value_type distance(const A& a, const B& b) {
    return length(V(a) - V(b));
}
template <class T> inline vec<T, 3> cross(const vec<T, 3>& a, const vec<T, 3>& b) {
    return vec<T, 3>(a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x);
}

// integer
template <class T, typename std::enable_if<std::is_integral<T>::value, int>::type = 0> inline T popcount(T x) {
    return T(__builtin_popcountll((unsigned long long)(typename std::make_unsigned<T>::type)(x)));
}
template <class T, typename std::enable_if<std::is_integral<T>::value, int>::type = 0> inline T clz(T x) {
    typedef typename std::make_unsigned<T>::type U;
    U u = U(x);
    if (!u) return T(sizeof(T) * 8);
    return T(__builtin_clzll((unsigned long long)u) - int(64 - sizeof(T) * 8));
}
template <class T, typename std::enable_if<std::is_integral<T>::value, int>::type = 0> inline T ctz(T x) {
    typedef typename std::make_unsigned<T>::type U;
    U u = U(x);
    if (!u) return T(sizeof(T) * 8);
    return T(__builtin_ctzll((unsigned long long)u));
}
inline uint mulhi(uint a, uint b) { return uint((uint64_t(a) * uint64_t(b)) >> 32); }
inline int mulhi(int a, int b) { return int((int64_t(a) * int64_t(b)) >> 32); }
template <class T, typename std::enable_if<std::is_integral<T>::value, int>::type = 0>
inline T extract_bits(T x, uint offset, uint bits) {
    typedef typename std::make_unsigned<T>::type U;
    if (bits == 0) return T(0);
    U mask = bits >= sizeof(T) * 8 ? U(~U(0)) : U((U(1) << bits) - 1);
    return T((U(x) >> offset) & mask);
}
template <class T, typename std::enable_if<std::is_integral<T>::value, int>::type = 0>
inline T insert_bits(T base, T insert, uint offset, uint bits) {
    typedef typename std::make_unsigned<T>::type U;
    U mask = bits >= sizeof(T) * 8 ? U(~U(0)) : U((U(1) << bits) - 1);
    return T((U(base) & ~U(mask << offset)) | ((U(insert) & mask) << offset));
}

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

}  // namespace metal

#ifndef M_PI_F
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f
#endif
#ifndef MAXFLOAT
#define MAXFLOAT FLT_MAX
#endif
#define HALF_MAX 65504.0f
#define HALF_MIN 6.103515625e-05f
#define HALF_EPSILON 0.0009765625f

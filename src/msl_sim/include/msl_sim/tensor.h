// msl_sim: the subset of Metal 4's tensor API that the project's kernels use, emulated for the simulator
// (what <metal_tensor> and <MetalPerformancePrimitives/MetalPerformancePrimitives.h> resolve to here).
// Written from Apple's documented semantics — the Metal Shading Language 4 specification ("Tensors") and the
// documentation comment of MetalPerformancePrimitives' MPPTensorOpsMatMul2d.h — not from any
// implementation, and never checked against an Apple GPU (docs/metal.md, "gemm_tensor.metal").
//
// Emulated:
//   tensor<T, dextents<int32_t, 2>, tensor_inline>(data, dextents(e0, e1))  over device or threadgroup
//       memory, default strides (1, e0): element (x, y) is data[x + y * e0]; extent 0 is the contiguous one.
//   .slice(x, y): the same memory with the origin moved to (x, y), extents (e0 - x, e1 - y).
//   .extents().extent(i)
//   mpp::tensor_ops::matmul2d_descriptor(m, n, k, transpose_left, transpose_right, relaxed_precision, mode)
//   mpp::tensor_ops::matmul2d<descriptor, execution_simdgroup>::run(left, right, destination), with
//       left  M x K: extents (K, M)  (transpose_left: stored K x M, extents (M, K)),
//       right K x N: extents (N, K)  (transpose_right: stored N x K, extents (K, N)),
//       destination M x N: extents (N, M), a device or threadgroup tensor (no cooperative_tensor);
//       mode::multiply writes D = A B, mode::multiply_accumulate writes D = D + A B, over the descriptor's
//       m x n tile at the tensors' origins; k = dynamic_extent takes K from the operands (they must agree).
//       Edge checking as documented: an element outside an operand's extents reads as zero, a destination
//       element outside its extents is not written.
//       Accumulation is float, in k order (fma), from the destination's value in multiply_accumulate
//       mode; relaxed_precision is accepted and ignored (the hardware's order and precision are not
//       documented: compare with tolerances).
// Checked like the other SIMD-group functions: every lane of the SIMD-group calls run at the same call
// site (the runtime reports divergence), all 32 lanes pass the same tensors (SIMD-group-uniform operands),
// reads stay inside the operand's buffer or threadgroup variable, and the threadgroup elements it reads
// have been written when the SIMD-group calls it (the poison of sim.h, checked mode; see check_written).
// Not emulated (a kernel using them does not compile here): execution_simdgroups<N> and execution_thread
// scopes, cooperative tensors, tensor_handle / tensor_offset layouts, explicit strides, static extents and
// static_slice, integer and 4-/2-bit/fp8 operand types, reductions, convolution.
// Needs C++20 (class-type template parameter: the descriptor); mslpp.cxx_std() picks it for such files.
#pragma once
#include <cmath>
#include <type_traits>

#include "msl_sim/sim.h"

namespace metal {

constexpr size_t dynamic_extent = size_t(-1);

template <class I, size_t R> struct dextents {
    static_assert(R == 2, "msl_sim emulates rank-2 tensors only (docs/metal.md, gemm_tensor.metal)");
    I e[2];
    constexpr dextents(I e0, I e1) : e{e0, e1} {}
    constexpr I extent(size_t r) const { return e[r]; }
    static constexpr size_t rank() { return R; }
};

struct tensor_inline {};
struct execution_simdgroup {};
template <int N> struct execution_simdgroups {};

template <class T, class Extents, class Layout = tensor_inline> struct tensor;

template <class T, class I, class Layout> struct tensor<T, dextents<I, 2>, Layout> {
    static_assert(std::is_same<Layout, tensor_inline>::value, "msl_sim emulates tensor_inline tensors only");
    typedef T element_type;
    typedef dextents<I, 2> extents_type;

    T* data_;
    const char* lo_;  // the buffer or threadgroup variable the data lies in (nullptr: unknown, fast mode)
    const char* hi_;
    bool tg_;         // threadgroup memory
    extents_type ext_;
    I stride_[2];

    tensor(msl::dptr<T> p, extents_type e) : data_(p.p), lo_(p.lo), hi_(p.hi), tg_(false), ext_(e), stride_{1, e.e[0]} {}
    tensor(msl::tgptr<T> p, extents_type e) : data_(p.p), lo_(p.lo), hi_(p.hi), tg_(true), ext_(e), stride_{1, e.e[0]} {}
    template <size_t N>
    tensor(msl::tg_array<T[N]>& a, extents_type e)
        : data_(a.d), lo_(reinterpret_cast<const char*>(a.d)), hi_(reinterpret_cast<const char*>(a.d + N)), tg_(true),
          ext_(e), stride_{1, e.e[0]} {}
    tensor(T* p, extents_type e) : data_(p), lo_(nullptr), hi_(nullptr), tg_(false), ext_(e), stride_{1, e.e[0]} {
        int buf;
        msl::find_bounds(p, &lo_, &hi_, &buf);
        if (!lo_) {
            msl::find_tg_bounds(p, &lo_, &hi_);
            tg_ = lo_ != nullptr;
        }
    }

    extents_type extents() const { return ext_; }
    tensor slice(I x, I y) const {
        tensor t = *this;
        t.data_ = data_ + ptrdiff_t(x) * stride_[0] + ptrdiff_t(y) * stride_[1];
        t.ext_ = extents_type(ext_.e[0] > x ? ext_.e[0] - x : I(0), ext_.e[1] > y ? ext_.e[1] - y : I(0));
        return t;
    }
};

}  // namespace metal

#include "msl_sim/tensor_descriptor.h"

namespace msl {

// One operand as every lane passes it to run (compared across lanes: SIMD-group-uniform operands).
struct TensorView {
    char* data;
    const char* lo;
    const char* hi;
    int64_t e0, e1, s0, s1;
    int32_t tg;
    int32_t elem;
    bool operator!=(const TensorView& o) const {
        return data != o.data || e0 != o.e0 || e1 != o.e1 || s0 != o.s0 || s1 != o.s1 || tg != o.tg;
    }
};
template <class TT> inline TensorView view_of(const TT& t) {
    return TensorView{reinterpret_cast<char*>(const_cast<typename std::remove_cv<typename TT::element_type>::type*>(t.data_)),
                      t.lo_,
                      t.hi_,
                      int64_t(t.ext_.e[0]),
                      int64_t(t.ext_.e[1]),
                      int64_t(t.stride_[0]),
                      int64_t(t.stride_[1]),
                      t.tg_ ? 1 : 0,
                      int32_t(sizeof(typename TT::element_type))};
}
struct MatmulIn {
    TensorView a, b, d;
};

template <class E> constexpr bool tensor_float_type() {
    return std::is_same<E, float>::value || std::is_same<E, metal::half>::value || std::is_same<E, metal::bfloat>::value;
}
// The floating-point rows of the documented operand-type table (MPPTensorOpsMatMul2d.h): a float destination
// takes any of float, half, bfloat on either side; a half or bfloat destination takes half and bfloat
// operands, except half x half -> bfloat and bfloat x bfloat -> half.
template <class A, class B, class D> constexpr bool matmul2d_types_documented() {
    constexpr bool a_hb = std::is_same<A, metal::half>::value || std::is_same<A, metal::bfloat>::value;
    constexpr bool b_hb = std::is_same<B, metal::half>::value || std::is_same<B, metal::bfloat>::value;
    if (std::is_same<D, float>::value) return tensor_float_type<A>() && tensor_float_type<B>();
    if (!tensor_float_type<D>() || !a_hb || !b_hb) return false;
    if (std::is_same<A, B>::value) return std::is_same<A, D>::value;
    return true;
}

template <class E> inline const char* read_elem(const TensorView& v, int64_t x, int64_t y, const char* what, float* out) {
    if (x >= v.e0 || y >= v.e1) {  // outside the extents: edge-checked, reads as zero
        *out = 0.0f;
        return nullptr;
    }
    const char* p = v.data + (x * v.s0 + y * v.s1) * int64_t(sizeof(E));
    if (v.lo && (p < v.lo || p + sizeof(E) > v.hi))
        return fmt("%s element (%lld, %lld) lies outside its %s (bytes [%ld, %ld) of %ld)", what, (long long)x, (long long)y,
                   v.tg ? "threadgroup variable" : "buffer", long(p - v.lo), long(p - v.lo + long(sizeof(E))),
                   long(v.hi - v.lo));
    *out = float(*reinterpret_cast<const E*>(p));
    return nullptr;
}

// Checked mode, at the call site of run (before the lane parks): the lane looks at its share (every 32nd)
// of the elements (x < xe, y < ye) of a threadgroup operand. Run reads its operands when the SIMD-group
// reaches it, so an element still holding the poison then was never written, or is written by another
// SIMD-group after the call (a threadgroup_barrier between the staging and run is missing): the simulator
// runs every thread to its next synchronisation point before it resolves SIMD-group functions, so only
// this check, made when each lane arrives, sees the missing barrier.
template <class E> inline void check_written(const TensorView& v, int64_t xe, int64_t ye, const char* what, const char* file,
                                             int line) {
#if MSL_SIM_CHECKED
    if (!v.tg) return;
    xe = xe < v.e0 ? xe : v.e0;
    ye = ye < v.e1 ? ye : v.e1;
    for (int64_t i = cur()->lane; i < xe * ye; i += 32) {
        const int64_t x = i % xe, y = i / xe;
        const char* p = v.data + (x * v.s0 + y * v.s1) * int64_t(sizeof(E));
        if (v.lo && (p < v.lo || p + sizeof(E) > v.hi)) continue;  // reported by the resolve
        if (all_bytes(p, sizeof(E), poison_byte<E>()))
            fail(fmt("matmul2d::run: %s element (%lld, %lld) is threadgroup memory that no thread has written when "
                     "the SIMD-group calls run (uninitialised, or written by another SIMD-group without a "
                     "threadgroup_barrier before run)",
                     what, (long long)x, (long long)y),
                 file, line);
    }
#else
    (void)v, (void)xe, (void)ye, (void)what, (void)file, (void)line;
#endif
}

template <mpp::tensor_ops::matmul2d_descriptor D, class TA, class TB, class TD> struct Matmul2d {
    // the elements run reads, in extent coordinates (x < xe, y < ye), of each operand
    static void check_operands(const MatmulIn& in, const char* file, int line) {
        const int64_t K = D.k == static_cast<int>(metal::dynamic_extent) ? (D.transpose_left ? in.a.e1 : in.a.e0) : D.k;
        if (D.transpose_left) check_written<TA>(in.a, D.m, K, "left", file, line);
        else check_written<TA>(in.a, K, D.m, "left", file, line);
        if (D.transpose_right) check_written<TB>(in.b, K, D.n, "right", file, line);
        else check_written<TB>(in.b, D.n, K, "right", file, line);
        if (D.matmul_mode == mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate)
            check_written<TD>(in.d, D.n, D.m, "destination", file, line);
    }
    static const char* resolve(Lane* const* L, uint32_t act) {
        if (act != 0xffffffffu) return "needs all 32 lanes of the SIMD-group (execution_simdgroup scope)";
        const MatmulIn& in = *static_cast<const MatmulIn*>(L[0]->in);
        for (int i = 1; i < 32; ++i) {
            const MatmulIn& o = *static_cast<const MatmulIn*>(L[i]->in);
            const char* which = o.a != in.a ? "left" : o.b != in.b ? "right" : o.d != in.d ? "destination" : nullptr;
            if (which)
                return fmt("lane %d passes another %s tensor than lane 0: run's operands must be SIMD-group-uniform", i, which);
        }
        const TensorView &a = in.a, &b = in.b, &d = in.d;
        // left: M x K, extents (K, M), or (M, K) transposed; right: K x N, extents (N, K), or (K, N) transposed
        const int64_t kl = D.transpose_left ? a.e1 : a.e0;
        const int64_t kr = D.transpose_right ? b.e0 : b.e1;
        int64_t K = D.k;
        if (D.k == static_cast<int>(metal::dynamic_extent)) {
            if (kl != kr) return fmt("k = dynamic_extent, but the left operand's K extent (%lld) differs from the right's (%lld)",
                                     (long long)kl, (long long)kr);
            K = kl;
        }
        const bool acc = D.matmul_mode == mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate;
        float out[D.m * D.n];
        for (int m = 0; m < D.m; ++m)
            for (int n = 0; n < D.n; ++n) {
                float s = 0.0f;
                if (m >= d.e1 || n >= d.e0) continue;  // not written
                if (acc) {
                    const char* err = read_elem<TD>(d, n, m, "destination", &s);
                    if (err) return err;
                }
                for (int64_t k = 0; k < K; ++k) {
                    float x, y;
                    const char* err = D.transpose_left ? read_elem<TA>(a, m, k, "left", &x) : read_elem<TA>(a, k, m, "left", &x);
                    if (err) return err;
                    err = D.transpose_right ? read_elem<TB>(b, k, n, "right", &y) : read_elem<TB>(b, n, k, "right", &y);
                    if (err) return err;
                    s = std::fma(x, y, s);
                }
                out[m * D.n + n] = s;
            }
        // written after every read: the destination may alias an operand
        for (int m = 0; m < D.m && m < d.e1; ++m)
            for (int n = 0; n < D.n && n < d.e0; ++n) {
                char* p = d.data + (int64_t(n) * d.s0 + int64_t(m) * d.s1) * int64_t(sizeof(TD));
                if (d.lo && (p < d.lo || p + sizeof(TD) > d.hi))
                    return fmt("destination element (%d, %d) lies outside its %s", n, m, d.tg ? "threadgroup variable" : "buffer");
                *reinterpret_cast<TD*>(p) = TD(out[m * D.n + n]);
            }
        return nullptr;
    }
};

}  // namespace msl

namespace mpp {
namespace tensor_ops {

template <matmul2d_descriptor Descriptor, class Scope> class matmul2d {
    static_assert(std::is_same<Scope, metal::execution_simdgroup>::value,
                  "msl_sim emulates matmul2d with the execution_simdgroup scope only (docs/metal.md, gemm_tensor.metal)");
    static_assert(Descriptor.m > 0 && Descriptor.n > 0 && Descriptor.m * Descriptor.n <= 4096,
                  "matmul2d: m and n must be positive (the emulation holds at most 4096 destination elements)");

  public:
    static constexpr matmul2d_descriptor descriptor = Descriptor;
    template <class L, class R, class Dst>
    void run(L& left, R& right, Dst& destination, const char* file_ = __builtin_FILE(), int line_ = __builtin_LINE()) const {
        typedef typename std::remove_cv<typename L::element_type>::type TA;
        typedef typename std::remove_cv<typename R::element_type>::type TB;
        typedef typename std::remove_cv<typename Dst::element_type>::type TD;
        static_assert(msl::tensor_float_type<TA>() && msl::tensor_float_type<TB>() && msl::tensor_float_type<TD>(),
                      "msl_sim emulates float, half and bfloat matmul2d operands only");
        static_assert(msl::matmul2d_types_documented<TA, TB, TD>(),
                      "matmul2d: this (left, right, destination) type combination is not in Apple's documented table");
        msl::MatmulIn in{msl::view_of(left), msl::view_of(right), msl::view_of(destination)};
        msl::Matmul2d<Descriptor, TA, TB, TD>::check_operands(in, file_, line_);
        msl::park_at_simd(&in, nullptr, 0, "matmul2d::run", file_, line_, &msl::Matmul2d<Descriptor, TA, TB, TD>::resolve);
    }
};

}  // namespace tensor_ops
}  // namespace mpp

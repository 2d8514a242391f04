#include "gpu/ops/norm.h"

#include "metal/norm.h"

namespace qwenmetal::gpu::ops {

namespace {
// about H / 4 threads (one 4-vector each per step), a multiple of 32, within the pipeline's limit
Dims norm_threads(Encoder& e, const std::string& kernel, uint32_t H) {
    const uint32_t t = (H / 4 + 31) / 32 * 32;
    return Dims{fit_threads(e, kernel, t > NORM_MAX_THREADS ? NORM_MAX_THREADS : t), 1, 1};
}
}  // namespace

void rmsnorm(Encoder& e, Act t, const Buffer& x, const Buffer& w, const Buffer& y, uint32_t rows, uint32_t H,
             float eps) {
    const char* op = "rmsnorm";
    check(rows > 0 && H > 0, op, "rows and H must be positive");
    const uint64_t es = act_size(t), n = uint64_t(rows) * H * es;
    need(x, n, op, "x");
    need(w, H * es, op, "w");
    need(y, n, op, "y");
    const NormParams p{H, eps};
    const std::string kernel = std::string("rmsnorm_") + act_suffix(t);
    e.dispatch(kernel, Dims{rows, 1, 1}, norm_threads(e, kernel, H),
               {Arg::params(p), Arg::in(x.view(0, n)), Arg::in(w.view(0, H * es)), Arg::out(y.view(0, n))});
}

void add_rmsnorm(Encoder& e, Act t, const Buffer& x, const Buffer& r, const Buffer& w, const Buffer& h,
                 const Buffer& y, uint32_t rows, uint32_t H, float eps) {
    const char* op = "add_rmsnorm";
    check(rows > 0 && H > 0, op, "rows and H must be positive");
    const uint64_t es = act_size(t), n = uint64_t(rows) * H * es;
    need(x, n, op, "x");
    need(r, n, op, "r");
    need(w, H * es, op, "w");
    need(h, n, op, "h");
    need(y, n, op, "y");
    const NormParams p{H, eps};
    const bool in_place = h.address() == x.address();
    const std::string kernel = std::string("add_rmsnorm_") + act_suffix(t);
    e.dispatch(kernel, Dims{rows, 1, 1}, norm_threads(e, kernel, H),
               {Arg::params(p), in_place ? Arg::inout(x.view(0, n)) : Arg::in(x.view(0, n)), Arg::in(r.view(0, n)),
                Arg::in(w.view(0, H * es)), Arg::out(h.view(0, n)), Arg::out(y.view(0, n))});
}

void layer_norm(Encoder& e, Act t, const Buffer& x, const Buffer& w, const Buffer& b, const Buffer& y, uint32_t rows,
                uint32_t H, float eps) {
    const char* op = "layer_norm";
    check(rows > 0 && H > 0, op, "rows and H must be positive");
    const uint64_t es = act_size(t), n = uint64_t(rows) * H * es;
    need(x, n, op, "x");
    need(w, H * es, op, "w");
    need(b, H * es, op, "b");
    need(y, n, op, "y");
    check(y.address() + n <= x.address() || x.address() + n <= y.address(), op, "y must not overlap x");
    const NormParams p{H, eps};
    const std::string kernel = std::string("layer_norm_") + act_suffix(t);
    e.dispatch(kernel, Dims{rows, 1, 1}, norm_threads(e, kernel, H),
               {Arg::params(p), Arg::in(x.view(0, n)), Arg::in(w.view(0, H * es)), Arg::in(b.view(0, H * es)),
                Arg::out(y.view(0, n))});
}

void copy_f32(Encoder& e, Act t, const Buffer& x, const Buffer& y, uint32_t rows, uint32_t H) {
    const char* op = "copy_f32";
    check(rows > 0 && H > 0, op, "rows and H must be positive");
    const uint64_t n = uint64_t(rows) * H;
    need(x, n * act_size(t), op, "x");
    need(y, n * 4, op, "y");
    const CopyParams p{H};
    const std::string kernel = std::string("copy_f32_") + act_suffix(t);
    e.dispatch(kernel, Dims{rows, 1, 1}, norm_threads(e, kernel, H),
               {Arg::params(p), Arg::in(x.view(0, n * act_size(t))), Arg::out(y.view(0, n * 4))});
}

}  // namespace qwenmetal::gpu::ops

#include "gpu/ops/gemm.h"

#include <algorithm>

#include "metal/gemm.h"

namespace qwenmetal::gpu::ops {

namespace {

void check_route(const Encoder& e, GemmRoute route, const char* op) {
    const DeviceInfo& info = e.device().info();
    check(route == GemmRoute::Simdgroup || info.tensor_ops, op,
          "route Tensor (Metal 4 tensor ops) is not available on this device (" + info.name +
              "): DeviceInfo::tensor_ops is false (M5, GPU family apple10; gemm_route() picks the device's route)");
}

// x / y row-major views: the bytes of `rows` rows of `cols` elements at `stride`
uint64_t span(uint32_t rows, uint32_t stride, uint32_t cols, uint64_t es) {
    return (uint64_t(rows - 1) * stride + cols) * es;
}

// One dispatch of a gemm_<w>_<T> kernel (gemm_tensor_<w>_<T> on the Tensor route: metal/gemm_tensor.metal,
// the same buffers, grid and params); what differs between the dense and the grouped GEMMs is
// the params, the row bindings and the declarations.
struct GemmCall {
    const char* op = "gemm";
    GemmParams p{};
    const Matrix* wa = nullptr;   // binding 1-3 (the gate part with swiglu)
    const Matrix* wb = nullptr;   // binding 4-6 (the up part of grouped swiglu; else wa again, unread)
    uint64_t w_rows_read = 0;     // declared rows read of wa (and of wb when it is its own stack)
    Buffer x;                     // view, and the bytes it declares read
    uint64_t x_read = 0;
    const Buffer* slot_rows = nullptr;
    uint64_t slot_rows_bytes = 0;
    const Buffer* tiles = nullptr;
    uint64_t tiles_bytes = 0;
    const Buffer* residual = nullptr;
    Buffer y;                     // view
    uint64_t y_written = 0;
    bool f32_out = false;         // a bf16 build storing float (the _f32out variant)
    GemmRoute route = GemmRoute::Simdgroup;
    Dims groups{1, 1, 1};
    uint64_t flops = 0;
};

void encode(Encoder& e, Act t, const GemmCall& c) {
    // The kernels index inside a tile with 32-bit offsets (gemm_tile.h: Apple GPUs run 64-bit integer
    // multiplies several times slower): X rows as vec4 offsets row * x_stride / 4 (0xFFFFFFFF marks an
    // absent row), Y rows of a tile i * y_stride, weight rows of a tile i * (units per row <= K).
    check(uint64_t(c.p.x_rows) * (c.p.x_stride / 4) < 0xFFFFFFFFull, c.op,
          "x is too large for 32-bit row offsets (" + std::to_string(c.p.x_rows) + " rows of " +
              std::to_string(c.p.x_stride) + " elements)");
    check(uint64_t(GEMM_BM) * c.p.y_stride < 0xFFFFFFFFull, c.op, "y_stride too large for 32-bit tile offsets");
    check(uint64_t(GEMM_BN) * c.p.K < 0xFFFFFFFFull, c.op, "K too large for 32-bit tile offsets");
    std::vector<Arg> args{Arg::params(c.p)};
    matrix_args(args, *c.wa, c.w_rows_read);
    matrix_args(args, *c.wb, c.wb == c.wa ? 0 : c.w_rows_read);
    args.push_back(Arg::in(c.x, c.x_read));
    // unused slots bind a buffer the dispatch binds anyway, declared as not accessed
    args.push_back(c.slot_rows ? Arg::in(c.slot_rows->view(0, c.slot_rows_bytes)) : Arg::in(c.x, 0));
    args.push_back(c.tiles ? Arg::in(c.tiles->view(0, c.tiles_bytes)) : Arg::in(c.x, 0));
    const bool in_place = c.residual && c.residual->address() == c.y.address();
    if (c.residual && !in_place) args.push_back(Arg::in(c.residual->view(0, c.y.length), c.y_written));
    else args.push_back(Arg::in(c.y, 0));
    args.push_back(in_place ? Arg::inout(c.y, c.y_written, c.y_written) : Arg::out(c.y, c.y_written));
    const std::string kernel = std::string(c.route == GemmRoute::Tensor ? "gemm_tensor_" : "gemm_") +
                               c.wa->variant() + "_" + act_suffix(t) + (c.f32_out ? "_f32out" : "");
    e.dispatch(kernel, c.groups, Dims{GEMM_THREADS, 1, 1}, args, {}, c.flops);
}

void check_tile_map(const TileMap& tm, uint32_t S, const char* op) {
    check(tm.tile_rows == GEMM_BM_SMALL || tm.tile_rows == GEMM_BM, op,
          "tile_rows must be 16 or 32, got " + std::to_string(tm.tile_rows));
    check(tm.capacity > 0, op, "the tile map's capacity must be positive");
    check(S > 0, op, "S (slots) must be positive");
    need(tm.tiles, uint64_t(tm.capacity) * 16, op, "tm.tiles");
    check(tm.tiles.offset % 16 == 0, op, "tm.tiles offset must be 16-byte aligned (uint4 entries)");
}

GemmParams grouped_params(const Matrix& W, const TileMap& tm, uint32_t S, uint32_t x_rows, uint32_t flags) {
    return GemmParams{S, W.rows, W.cols, quantized(W.fmt) ? W.group_size : 0, W.cols, W.rows, flags,
                      tm.tile_rows, x_rows, W.rows, W.count, 0, W.qbits()};
}

}  // namespace

GemmRoute gemm_route(const DeviceInfo& info) { return info.tensor_ops ? GemmRoute::Tensor : GemmRoute::Simdgroup; }

GemmRoute parse_gemm_route(const std::string& name) {
    if (name == "simdgroup") return GemmRoute::Simdgroup;
    if (name == "tensor") return GemmRoute::Tensor;
    throw std::invalid_argument("gemm route must be 'simdgroup' or 'tensor', got '" + name + "'");
}

const char* gemm_route_name(GemmRoute r) { return r == GemmRoute::Tensor ? "tensor" : "simdgroup"; }

void gemm(Encoder& e, Act t, const Matrix& W, const Buffer& x, const Buffer& y, uint32_t M, bool f32_out,
          uint32_t x_stride, uint32_t y_stride, const GemmFusion& f, GemmRoute route) {
    const char* op = "gemm";
    check_route(e, route, op);
    W.validate("gemm: W");
    check(W.count == 1, op, "W must be one matrix (count 1), got a stack of " + std::to_string(W.count));
    check(M > 0, op, "M must be positive");
    if (f.swiglu) {
        check(W.rows % 2 == 0, op, "swiglu needs a stacked [gate | up] W of even rows, got " + std::to_string(W.rows));
        check(!f.residual, op, "swiglu takes no residual");
        check(!f32_out, op, "swiglu output is the activation type (no f32_out)");
    }
    check(!f.round || f32_out, op, "round needs f32_out (a float output holding the rounded product)");
    if (M <= GEMM_SKINNY_MAX && !f.swiglu) {
        QmvFusion q;
        q.residual = f.residual;
        q.round = f.round;
        qmv(e, t, W, x, y, M, f32_out, x_stride, y_stride, q);
        return;
    }
    const uint32_t N = f.swiglu ? W.rows / 2 : W.rows, K = W.cols;
    const uint32_t xs = x_stride ? x_stride : K, ys = y_stride ? y_stride : N;
    check(xs >= K, op, "x_stride " + std::to_string(xs) + " < cols " + std::to_string(K));
    check(ys >= N, op, "y_stride " + std::to_string(ys) + " < N " + std::to_string(N));
    check(xs % 4 == 0, op, "x_stride must be a multiple of 4 (vector loads)");
    const uint64_t es = act_size(t), os = f32_out ? 4 : es;
    const uint64_t xn = span(M, xs, K, es), yn = span(M, ys, N, os);
    need(x, xn, op, "x");
    need(y, yn, op, "y");
    check(x.offset % (4 * es) == 0, op, "x offset must be 4-element aligned");
    uint32_t flags = 0;
    if (f.residual) {
        need(*f.residual, yn, op, "residual");
        same_or_disjoint(*f.residual, y, yn, op, "residual", "y");
        flags |= GEMM_ADD;
    }
    if (f.round) flags |= GEMM_ROUND;
    if (f.swiglu) flags |= GEMM_SWIGLU;
    // 16-row tiles for a chunk of at most 16 rows (SwiGLU at skinny M), else 32
    const uint32_t bm = M <= GEMM_BM_SMALL ? GEMM_BM_SMALL : GEMM_BM;
    GemmCall c;
    c.route = route;
    c.p = GemmParams{M, N, K, quantized(W.fmt) ? W.group_size : 0, xs, ys, flags, bm, M, W.rows, 1,
                     f.swiglu ? N : 0, W.qbits()};
    c.wa = c.wb = &W;
    // Weights declared read once per dispatch: the ideal (each weight tile is re-read by every row
    // block of M, from the cache on a GPU whose L2 holds the matrix); x read once, y written once.
    c.w_rows_read = W.rows;
    c.x = x.view(0, xn);
    c.x_read = uint64_t(M) * K * es;
    c.residual = f.residual;
    c.y = y.view(0, yn);
    c.y_written = uint64_t(M) * N * os;
    c.f32_out = f32_out && t != Act::F32;  // float activations already give float output
    const uint32_t cols = f.swiglu ? GEMM_BN / 2 : GEMM_BN;
    c.groups = Dims{ceil_div(N, cols), ceil_div(M, bm), 1};
    c.flops = 2ull * M * W.rows * K;  // swiglu: 2 M (2N) K
    encode(e, t, c);
}

void gemm_grouped_swiglu(Encoder& e, Act t, const Matrix& gate, const Matrix& up, const Buffer& x,
                         const Buffer& slot_rows, const TileMap& tm, uint32_t S, const Buffer& act,
                         GemmRoute route) {
    const char* op = "gemm_grouped_swiglu";
    check_route(e, route, op);
    gate.validate("gemm_grouped_swiglu: gate");
    up.validate("gemm_grouped_swiglu: up");
    check(gate.fmt == up.fmt && gate.rows == up.rows && gate.cols == up.cols && gate.count == up.count &&
              gate.group_size == up.group_size && gate.scales_f32 == up.scales_f32,
          op, "gate and up must be stacks of the same shape and format");
    check_tile_map(tm, S, op);
    const uint32_t I = gate.rows, H = gate.cols;
    const uint64_t es = act_size(t), xrow = uint64_t(H) * es;
    check(x.length >= xrow, op, "x holds " + std::to_string(x.length) + " bytes, less than one row of " +
                                    std::to_string(xrow));
    check(x.offset % (4 * es) == 0, op, "x offset must be 4-element aligned");
    need(slot_rows, uint64_t(S) * 4, op, "slot_rows");
    need(act, uint64_t(S) * I * es, op, "act");
    const uint32_t x_rows = uint32_t(std::min<uint64_t>(x.length / xrow, 0xFFFFFFFFu));
    GemmCall c;
    c.op = op;
    c.route = route;
    c.p = grouped_params(gate, tm, S, x_rows, GEMM_SWIGLU | GEMM_TILEMAP | GEMM_GATHER);
    c.p.N = I;
    c.p.y_stride = I;
    c.wa = &gate;
    c.wb = &up;
    // at most min(E, S) experts hold slots: their gate and up matrices, each read once (the ideal, as gemm)
    c.w_rows_read = uint64_t(std::min(gate.count, S)) * I;
    c.x = x.view(0, uint64_t(x_rows) * xrow);
    c.x_read = uint64_t(std::min(x_rows, S)) * xrow;   // the distinct token rows the slots gather
    c.slot_rows = &slot_rows;
    c.slot_rows_bytes = uint64_t(S) * 4;
    c.tiles = &tm.tiles;
    c.tiles_bytes = uint64_t(tm.capacity) * 16;
    c.y = act.view(0, uint64_t(S) * I * es);
    c.y_written = uint64_t(S) * I * es;
    c.groups = Dims{ceil_div(I, GEMM_BN / 2), tm.capacity, 1};
    c.flops = 2ull * S * (2ull * I) * H;
    encode(e, t, c);
}

void gemm_grouped(Encoder& e, Act t, const Matrix& W, const Buffer& act, const TileMap& tm, uint32_t S,
                  const Buffer& y, GemmRoute route) {
    const char* op = "gemm_grouped";
    check_route(e, route, op);
    W.validate("gemm_grouped: W");
    check_tile_map(tm, S, op);
    const uint32_t N = W.rows, K = W.cols;
    const uint64_t es = act_size(t);
    need(act, uint64_t(S) * K * es, op, "act");
    check(act.offset % (4 * es) == 0, op, "act offset must be 4-element aligned");
    need(y, uint64_t(S) * N * 4, op, "y");
    GemmCall c;
    c.op = op;
    c.route = route;
    // y float holding the product rounded to T (identity for float activations)
    c.p = grouped_params(W, tm, S, S, GEMM_ROUND | GEMM_TILEMAP);
    c.wa = c.wb = &W;
    c.w_rows_read = uint64_t(std::min(W.count, S)) * N;   // as gemm_grouped_swiglu
    c.x = act.view(0, uint64_t(S) * K * es);
    c.x_read = uint64_t(S) * K * es;
    c.tiles = &tm.tiles;
    c.tiles_bytes = uint64_t(tm.capacity) * 16;
    c.y = y.view(0, uint64_t(S) * N * 4);
    c.y_written = uint64_t(S) * N * 4;
    c.f32_out = t != Act::F32;
    c.groups = Dims{ceil_div(N, GEMM_BN), tm.capacity, 1};
    c.flops = 2ull * S * N * K;
    encode(e, t, c);
}

}  // namespace qwenmetal::gpu::ops

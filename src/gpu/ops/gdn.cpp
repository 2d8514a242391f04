#include "gpu/ops/gdn.h"

#include <algorithm>
#include <cmath>

#include "metal/gdn.h"

namespace qwenmetal::gpu::ops {

namespace {
void check_shape(const GdnShape& s, const char* op) {
    check(s.nk > 0 && s.nv > 0 && s.dk > 0 && s.dv > 0, op, "nk, nv, dk and dv must be positive");
    check(s.nv % s.nk == 0, op,
          "nv (" + std::to_string(s.nv) + ") must be a multiple of nk (" + std::to_string(s.nk) + ")");
    check(s.conv_kernel >= 2, op, "conv_kernel must be at least 2, got " + std::to_string(s.conv_kernel));
    check(uint64_t(2) * s.nk * s.dk + uint64_t(s.nv) * s.dv <= UINT32_MAX, op, "conv_dim exceeds 2^32 - 1");
}

void check_scan_shape(const GdnShape& s, const char* op) {
    check(s.dk <= GDN_STEP_MAX_DK, op,
          "dk = " + std::to_string(s.dk) + " exceeds GDN_STEP_MAX_DK = " + std::to_string(GDN_STEP_MAX_DK) +
              " (32 lanes x at most GDN_STEP_MAX_DK_PER_LANE elements per lane: gdn_step is instantiated for dk <= 32,"
              " 64, 128 and 256)");
    check(s.dv <= GDN_STEP_MAX_DV, op,
          "dv = " + std::to_string(s.dv) + " exceeds GDN_STEP_MAX_DV = " + std::to_string(GDN_STEP_MAX_DV) +
              " (32 SIMD-groups x GDN_STEP_MAX_ROWS_PER_SG state rows in registers)");
}

uint32_t step_simdgroups(const GdnShape& s) { return std::min(s.dv, GDN_STEP_MAX_SIMDGROUPS); }
// gdn_step's state elements per lane (its template parameter): the smallest of 1, 2, 4, 8 with 32 x that >= dk
// (4 at dk = 128); dk <= GDN_STEP_MAX_DK is checked first (check_scan_shape)
uint32_t step_per_lane(const GdnShape& s) {
    uint32_t d = 1;
    while (32 * d < s.dk) d *= 2;
    return d;
}
std::string step_kernel(Act t, const GdnShape& s) {
    return std::string("gdn_step_") + act_suffix(t) + "_dk" + std::to_string(32 * step_per_lane(s));
}
// the block size: as asked, or the fewest blocks of <= GDN_CHUNK_MAX tokens, balanced (65 tokens: 2 x 33, not
// 64 + 1: the last block's critical path costs about as much as a full one)
uint32_t chunk_block(uint32_t M, uint32_t block) {
    if (block) return block;
    const uint32_t n = ceil_div(M, GDN_CHUNK_MAX);
    return ceil_div(M, n);
}
uint32_t chunk_tiles(const GdnShape& s) { return ceil_div(s.dv, 8 * GDN_CHUNK_SIMDGROUPS); }
uint32_t pad8(uint32_t n) { return (n + 7) & ~7u; }

// Per-dispatch arithmetic (a multiply-add = 2; exp, rsqrt, sigmoid counted as a few flops each), shared by the
// dispatches and the cost model.
uint64_t step_flops(const GdnShape& s, uint32_t M) {
    // per token and value head: the recurrence (decay 1, kv 2, update 2, o 2 per state element), q/k
    // normalised by each of the nsg SIMD-groups, gates, the gated norm
    return uint64_t(M) * s.nv *
           (7ull * s.dv * s.dk + uint64_t(step_simdgroups(s)) * 6 * s.dk + 20 + 10ull * s.dv);
}
uint64_t prep_flops(const GdnShape& s, uint32_t M) { return uint64_t(M) * (6ull * s.nk * s.dk + 20ull * s.nv); }
uint64_t norm_flops(const GdnShape& s, uint32_t M) { return uint64_t(M) * s.nv * 10ull * s.dv; }

// gdn_chunk: flops and the critical path of one threadgroup (dependent syncs and MMAs), summed over the blocks
struct ChunkWork {
    uint64_t flops = 0;
    uint64_t syncs = 0, mmas = 0;   // one threadgroup's critical path
};
ChunkWork chunk_work(const GdnShape& s, uint32_t M, uint32_t bc) {
    const uint64_t mma = 1024;   // 8 x 8 x 8 multiply-adds
    const uint64_t cp = pad8(bc), nb = cp / 8, tri = nb * (nb + 1) / 2, nkb = s.dk / 8, nsg = GDN_CHUNK_SIMDGROUPS;
    const uint64_t tgs = uint64_t(s.nv) * chunk_tiles(s);
    const uint64_t active = uint64_t(s.nv) * (s.dv / 8);   // SIMD-groups owning value columns
    ChunkWork w;
    for (uint64_t m0 = 0; m0 < M; m0 += bc) {
        const uint64_t n = std::min<uint64_t>(bc, M - m0);
        w.flops += tgs * (2 * tri * nkb * mma + 6 * cp * cp + 4 * cp);   // two gram matrices + masks, G
        w.flops += active * (nb * nkb * mma + 32 * cp + 16 * n * (n - 1) / 2 +   // K S, rhs, the solve
                             (nb * (nkb + 1) + tri) * mma +                      // O
                             nkb * (16 + nb * mma) + 16 * cp);                   // the state update
        w.syncs += 8 + n;
        w.mmas += 2 * ((tri + nsg - 1) / nsg) * nkb + nb * nkb + nb * (nkb + 1) + tri + nkb * nb;
    }
    return w;
}

// Bytes each dispatch declares (read + written), for the cost model; the dispatches below declare the same
// views (tests/metal/test_gdn.py checks that the two agree).
struct Sizes {
    uint64_t es, kd, C, V, nv, nst, rows_pad;
    Sizes(const GdnShape& s, Act t, uint32_t M, uint32_t bc)
        : es(act_size(t)), kd(uint64_t(s.nk) * s.dk), C(s.conv_dim()), V(s.value_dim()), nv(s.nv),
          nst(uint64_t(s.nv) * s.dv * s.dk * 4), rows_pad(uint64_t(M) + pad8(bc)) {}
};
uint64_t step_bytes(const GdnShape& s, const Sizes& z, uint32_t M) {
    return M * (z.C + 2 * z.V + 2 * z.nv) * z.es + 8 * z.nv + s.dv * z.es + 2 * z.nst;
}
uint64_t prep_bytes(const Sizes& z, uint32_t M) {
    return M * (2 * z.kd + 2 * z.nv) * z.es + 8 * z.nv + z.rows_pad * (2 * z.kd + 2 * z.nv) * 4;
}
uint64_t chunk_bytes(const Sizes& z, uint32_t M) {
    return M * z.V * z.es + z.rows_pad * 2 * z.kd * 4 + (z.rows_pad + M) * z.nv * 4 + 2 * z.nst + M * z.V * 4;
}
uint64_t norm_bytes(const GdnShape& s, const Sizes& z, uint32_t M) {
    return M * z.V * 4 + M * z.V * z.es + s.dv * z.es + M * z.V * z.es;
}

// The buffers both routes read and write whole: the per-head weights, the state pair and y [rows, value_dim].
// Returns whether state_out is state (in place).
bool check_head_buffers(const GdnShape& s, Act t, const Buffer& A_log, const Buffer& dt_bias, const Buffer& norm_w,
                        const Buffer& state, const Buffer& state_out, const Buffer& y, uint32_t rows, const char* op) {
    const uint64_t nst = uint64_t(s.nv) * s.dv * s.dk * 4;
    need(A_log, uint64_t(s.nv) * 4, op, "A_log");
    need(dt_bias, uint64_t(s.nv) * 4, op, "dt_bias");
    need(norm_w, uint64_t(s.dv) * act_size(t), op, "norm_w");
    need(state, nst, op, "state");
    need(state_out, nst, op, "state_out");
    need(y, uint64_t(rows) * s.value_dim() * act_size(t), op, "y");
    return same_or_disjoint(state_out, state, nst, op, "state_out", "state");
}

GdnParams make_params(const GdnShape& s, float eps, uint32_t rows, uint32_t gate_stride, uint32_t block) {
    return GdnParams{s.nk, s.nv, s.dk, s.dv, s.nv / s.nk, float(1.0 / std::sqrt(double(s.dk))), GDN_L2NORM_EPS, eps,
                     rows, s.conv_dim(), gate_stride, s.value_dim(), block};
}

// gdn_step's kernel over `rows` tokens: the decode step (rows = 1) and the prefill scan
void encode_scan(Encoder& e, Act t, const GdnShape& s, const Buffer& act, const Buffer& z, const Buffer& b,
                 const Buffer& a, const Buffer& A_log, const Buffer& dt_bias, const Buffer& norm_w, float eps,
                 const Buffer& state, const Buffer& state_out, const Buffer& y, uint32_t rows, uint32_t gate_stride,
                 const char* op) {
    const uint64_t es = act_size(t), C = s.conv_dim(), V = s.value_dim(), nv = s.nv, gs = gate_stride,
                   nst = uint64_t(s.nv) * s.dv * s.dk * 4;
    // the views span the strided rows; the bytes declared are the rows' elements
    const uint64_t nact = rows * C * es, nz = ((rows - 1) * gs + V) * es, nh = ((rows - 1) * gs + nv) * es,
                   ny = rows * V * es, nw = uint64_t(s.dv) * es;
    need(act, nact, op, "act");
    need(z, nz, op, "z");
    need(b, nh, op, "b");
    need(a, nh, op, "a");
    const bool same = check_head_buffers(s, t, A_log, dt_bias, norm_w, state, state_out, y, rows, op);
    const GdnParams p = make_params(s, eps, rows, gate_stride, 0);
    e.dispatch(step_kernel(t, s), Dims{s.nv, 1, 1}, Dims{32 * step_simdgroups(s), 1, 1},
               {Arg::params(p), Arg::in(act.view(0, nact)), Arg::in(z.view(0, nz), rows * V * es),
                Arg::in(b.view(0, nh), rows * nv * es), Arg::in(a.view(0, nh), rows * nv * es),
                Arg::in(A_log.view(0, nv * 4)), Arg::in(dt_bias.view(0, nv * 4)), Arg::in(norm_w.view(0, nw)),
                same ? Arg::inout(state.view(0, nst)) : Arg::in(state.view(0, nst)),
                same ? Arg::inout(state_out.view(0, nst), 0, 0) : Arg::out(state_out.view(0, nst)),
                Arg::out(y.view(0, ny))},
               {}, step_flops(s, rows));
}
}  // namespace

namespace {
// The conv's shape and the buffers every conv reads and writes per row (qkv rows `stride` apart, the taps, the
// activations): {stride, qkv bytes, act bytes, tap bytes}.
struct ConvArgs {
    uint32_t stride;
    uint64_t nx, na, nw;
};
ConvArgs check_conv(Act t, const GdnShape& s, const Buffer& qkv, const Buffer& conv_w, const Buffer& act,
                    uint32_t rows, uint32_t qkv_stride, const char* op) {
    check_shape(s, op);
    const uint32_t C = s.conv_dim(), K = s.conv_kernel;
    const uint32_t stride = qkv_stride ? qkv_stride : C;
    check(rows >= 1, op, "rows must be at least 1");
    check(uint64_t(C) * K <= UINT32_MAX, op, "conv_dim x conv_kernel exceeds 2^32 - 1 (the kernel's 32-bit tap offsets)");
    check(stride >= C, op, "qkv_stride (" + std::to_string(stride) + ") is below conv_dim (" + std::to_string(C) + ")");
    const uint64_t es = act_size(t);
    const ConvArgs a{stride, (uint64_t(rows - 1) * stride + C) * es, uint64_t(rows) * C * es, uint64_t(C) * K * 4};
    need(qkv, a.nx, op, "qkv");
    need(conv_w, a.nw, op, "conv_w");
    need(act, a.na, op, "act");
    return a;
}
}  // namespace

void gdn_conv(Encoder& e, Act t, const GdnShape& s, const Buffer& qkv, const Buffer& conv_w,
              const Buffer& conv_state, const Buffer& conv_out, const Buffer& act, uint32_t rows,
              uint32_t qkv_stride) {
    const char* op = "gdn_conv";
    const auto [stride, nx, na, nw] = check_conv(t, s, qkv, conv_w, act, rows, qkv_stride, op);
    const uint32_t C = s.conv_dim(), K = s.conv_kernel;
    const uint64_t ns = uint64_t(C) * (K - 1) * 4;
    need(conv_state, ns, op, "conv_state");
    need(conv_out, ns, op, "conv_out");
    const bool same = same_or_disjoint(conv_out, conv_state, ns, op, "conv_out", "conv_state");
    // rows per thread: at least K - 1, so that only row block 0 reads the state (and writes it after)
    const uint32_t block = std::max(GDN_CONV_ROWS, K - 1);
    const GdnConvParams p{C, K, rows, stride, block};
    const std::string kernel = std::string("gdn_conv_") + act_suffix(t);
    const uint32_t threads = fit_threads(e, kernel, GDN_CONV_THREADS);   // one channel per thread
    e.dispatch(kernel, Dims{ceil_div(C, threads), ceil_div(rows, block), 1}, Dims{threads, 1, 1},
               {Arg::params(p), Arg::in(qkv.view(0, nx), na), Arg::in(conv_w.view(0, nw)),
                same ? Arg::inout(conv_state.view(0, ns)) : Arg::in(conv_state.view(0, ns)),
                same ? Arg::inout(conv_out.view(0, ns), 0, 0) : Arg::out(conv_out.view(0, ns)),
                Arg::out(act.view(0, na))},
               {}, uint64_t(rows) * C * (2ull * K + 4));   // taps, then SiLU
}

void gdn_step(Encoder& e, Act t, const GdnShape& s, const Buffer& act, const Buffer& z, const Buffer& b,
              const Buffer& a, const Buffer& A_log, const Buffer& dt_bias, const Buffer& norm_w, float eps,
              const Buffer& state, const Buffer& state_out, const Buffer& y) {
    const char* op = "gdn_step";
    check_shape(s, op);
    check_scan_shape(s, op);
    encode_scan(e, t, s, act, z, b, a, A_log, dt_bias, norm_w, eps, state, state_out, y, 1, 0, op);
}

namespace {
// the ring's arguments: slots x state floats < 2^32 (the kernels' 32-bit offsets), 1 <= rows < slots, `in` a slot
// and none of the rows' (first .. first + rows - 1, mod slots)
GdnRing check_ring(const GdnRingSlots& r, uint64_t state_floats, uint32_t rows, const Buffer& slab, const char* op) {
    check(rows >= 1, op, "rows must be at least 1");
    check(r.slots >= 2 && rows < r.slots, op,
          "rows (" + std::to_string(rows) + ") must be below the ring's slots (" + std::to_string(r.slots) + ")");
    check(r.in < r.slots && r.first < r.slots, op,
          "ring slots in = " + std::to_string(r.in) + ", first = " + std::to_string(r.first) + " outside 0.." +
              std::to_string(r.slots - 1));
    check((r.in + r.slots - r.first) % r.slots >= rows, op,
          "the rows' slots (" + std::to_string(r.first) + " + 0.." + std::to_string(rows - 1) + " mod " +
              std::to_string(r.slots) + ") include the slot they read (" + std::to_string(r.in) + ")");
    check(uint64_t(r.slots) * state_floats <= UINT32_MAX, op,
          "slots x state floats exceeds 2^32 - 1 (the kernels' 32-bit offsets)");
    need(slab, uint64_t(r.slots) * state_floats * 4, op, "slab");
    return GdnRing{r.slots, r.in, r.first, uint32_t(state_floats)};
}
}  // namespace

void gdn_conv_rows(Encoder& e, Act t, const GdnShape& s, const Buffer& qkv, const Buffer& conv_w,
                   const Buffer& conv_slab, const GdnRingSlots& ring, const Buffer& act, uint32_t rows,
                   uint32_t qkv_stride) {
    const char* op = "gdn_conv_rows";
    const auto [stride, nx, na, nw] = check_conv(t, s, qkv, conv_w, act, rows, qkv_stride, op);
    const uint32_t C = s.conv_dim(), K = s.conv_kernel;
    const uint64_t S = K - 1, nst = uint64_t(C) * S;
    const GdnRing g = check_ring(ring, nst, rows, conv_slab, op);
    check((uint64_t(rows) + K) * stride <= UINT32_MAX && uint64_t(rows) * C <= UINT32_MAX, op,
          "rows x qkv_stride exceeds 2^32 - 1 (the kernel's 32-bit row offsets)");
    const GdnConvParams p{C, K, rows, stride, 0};
    const std::string kernel = std::string("gdn_conv_rows_") + act_suffix(t);
    const uint32_t threads = fit_threads(e, kernel, GDN_CONV_THREADS);   // one channel per thread
    // the slab: the state read (slot in), the rows' states written (rows slots)
    e.dispatch(kernel, Dims{ceil_div(C, threads), 1, 1}, Dims{threads, 1, 1},
               {Arg::params(p), Arg::params(g), Arg::in(qkv.view(0, nx), na), Arg::in(conv_w.view(0, nw)),
                Arg::inout(conv_slab.view(0, uint64_t(g.slots) * nst * 4), nst * 4, rows * nst * 4),
                Arg::out(act.view(0, na))},
               {}, uint64_t(rows) * C * (2ull * K + 4));   // taps, then SiLU
}

void gdn_step_rows(Encoder& e, Act t, const GdnShape& s, const Buffer& act, const Buffer& proj, uint32_t proj_stride,
                   const Buffer& A_log, const Buffer& dt_bias, const Buffer& norm_w, float eps,
                   const Buffer& ssm_slab, const GdnRingSlots& ring, const Buffer& y, uint32_t rows,
                   uint32_t y_stride) {
    const char* op = "gdn_step_rows";
    check_shape(s, op);
    check_scan_shape(s, op);
    const uint64_t es = act_size(t), C = s.conv_dim(), V = s.value_dim(), nv = s.nv,
                   nst = uint64_t(s.nv) * s.dv * s.dk;
    const GdnRing g = check_ring(ring, nst, rows, ssm_slab, op);
    const uint32_t ys = y_stride ? y_stride : uint32_t(V);
    check(ys >= V, op, "y_stride (" + std::to_string(ys) + ") is below value_dim (" + std::to_string(V) + ")");
    check(proj_stride >= C + V + 2 * nv, op,
          "proj_stride (" + std::to_string(proj_stride) + ") is below conv_dim + value_dim + 2 nv (" +
              std::to_string(C + V + 2 * nv) + ")");
    need(proj, ((uint64_t(rows) - 1) * proj_stride + C + V + 2 * nv) * es, op, "proj");
    const uint64_t gs = proj_stride, nact = uint64_t(rows) * C * es, nz = ((rows - 1) * gs + V) * es,
                   nh = ((rows - 1) * gs + nv) * es, ny = ((rows - 1) * uint64_t(ys) + V) * es,
                   nw = uint64_t(s.dv) * es;
    need(act, nact, op, "act");
    need(A_log, nv * 4, op, "A_log");
    need(dt_bias, nv * 4, op, "dt_bias");
    need(norm_w, nw, op, "norm_w");
    need(y, ny, op, "y");
    const Buffer z = proj.view(C * es), b = proj.view((C + V) * es), a = proj.view((C + V + nv) * es);
    GdnParams p = make_params(s, eps, rows, proj_stride, 0);
    p.y_stride = ys;
    const std::string kernel = std::string("gdn_step_rows_") + act_suffix(t) + "_dk" + std::to_string(32 * step_per_lane(s));
    e.dispatch(kernel, Dims{s.nv, 1, 1}, Dims{32 * step_simdgroups(s), 1, 1},
               {Arg::params(p), Arg::params(g), Arg::in(act.view(0, nact)), Arg::in(z.view(0, nz), rows * V * es),
                Arg::in(b.view(0, nh), rows * nv * es), Arg::in(a.view(0, nh), rows * nv * es),
                Arg::in(A_log.view(0, nv * 4)), Arg::in(dt_bias.view(0, nv * 4)), Arg::in(norm_w.view(0, nw)),
                Arg::inout(ssm_slab.view(0, uint64_t(g.slots) * nst * 4), nst * 4, rows * nst * 4),
                Arg::out(y.view(0, ny), rows * V * es)},
               {}, step_flops(s, rows));
}

bool gdn_chunked_fits(const GdnShape& s) {
    // the kernel's row offsets within a block are 32-bit: GDN_CHUNK_MAX rows of act (conv_dim) and o (value_dim)
    return s.dk % 8 == 0 && s.dv % 8 == 0 && s.dk <= GDN_CHUNK_MAX_DK &&
           uint64_t(GDN_CHUNK_MAX) * s.conv_dim() <= UINT32_MAX;
}

uint64_t gdn_prefill_scratch_bytes(const GdnShape& s, uint32_t max_rows) {
    const uint64_t rp = uint64_t(max_rows) + GDN_CHUNK_MAX;
    return 4 * (rp * (2ull * s.nk * s.dk + 2ull * s.nv) + uint64_t(max_rows) * s.value_dim());
}

// The model (constants of the slowest modelled device, M1 Max; the route choice uses the same for every device):
//   seconds = dispatches x 4 us (the decode costing's per-level latency, docs/metal.md)
//           + critical path: dependent syncs (a simd_sum / barrier round, 50 ns) + dependent 8x8 MMAs (10 ns)
//           + max(flops / 10.4 TFLOP/s, bytes / 400 GB/s)
// The scan's critical path is M tokens x (2 simd_sums per state row of a SIMD-group + the norm's reduction and
// barriers); the chunked one is per block the phase barriers, one sync per row of the triangular solve and one
// SIMD-group's chain of MMAs. Constants are estimates (unmeasured: no Apple GPU has run this).
GdnCost gdn_prefill_cost(const GdnShape& s, uint32_t M, GdnRoute route, uint32_t block) {
    const char* op = "gdn_prefill_cost";
    check_shape(s, op);
    check(M >= 1, op, "M must be at least 1");
    check(route != GdnRoute::Auto, op, "route must be Scan or Chunked");
    constexpr double kLevel = 4e-6, kSync = 50e-9, kMma = 10e-9, kFlops = 10.4e12, kBytes = 400e9;
    const uint32_t bc = chunk_block(M, block);
    const Sizes z(s, Act::BF16, M, bc);
    GdnCost c;
    double path = 0;
    if (route == GdnRoute::Scan) {
        const uint32_t rows_per_sg = ceil_div(s.dv, step_simdgroups(s));
        c.flops = step_flops(s, M);
        c.bytes = step_bytes(s, z, M);
        c.dispatches = 1;
        path = double(M) * (2.0 * rows_per_sg + 4.0) * kSync;
    } else {
        const ChunkWork w = chunk_work(s, M, bc);
        c.flops = prep_flops(s, M) + w.flops + norm_flops(s, M);
        c.bytes = prep_bytes(z, M) + chunk_bytes(z, M) + norm_bytes(s, z, M);
        c.dispatches = 3;
        path = double(w.syncs + 4) * kSync + double(w.mmas) * kMma;
    }
    c.seconds = c.dispatches * kLevel + path + std::max(double(c.flops) / kFlops, double(c.bytes) / kBytes);
    return c;
}

GdnRoute gdn_route(const GdnShape& s, uint32_t M) {
    if (!gdn_chunked_fits(s) || M < 2) return GdnRoute::Scan;
    const bool chunked =
        gdn_prefill_cost(s, M, GdnRoute::Chunked).seconds < gdn_prefill_cost(s, M, GdnRoute::Scan).seconds;
    return chunked ? GdnRoute::Chunked : GdnRoute::Scan;
}

GdnRoute parse_gdn_route(const std::string& name) {
    if (name == "auto") return GdnRoute::Auto;
    if (name == "scan") return GdnRoute::Scan;
    if (name == "chunked") return GdnRoute::Chunked;
    throw std::invalid_argument("gdn route must be 'auto', 'scan' or 'chunked', got '" + name + "'");
}

const char* gdn_route_name(GdnRoute r) {
    return r == GdnRoute::Auto ? "auto" : r == GdnRoute::Chunked ? "chunked" : "scan";
}

void gdn_prefill(Encoder& e, Act t, const GdnShape& s, const Buffer& act, const Buffer& proj, uint32_t proj_stride,
                 const Buffer& A_log, const Buffer& dt_bias, const Buffer& norm_w, float eps, const Buffer& state,
                 const Buffer& state_out, const Buffer& y, uint32_t M, const Buffer& scratch, GdnRoute route,
                 uint32_t block) {
    const char* op = "gdn_prefill";
    check_shape(s, op);
    check(M >= 1, op, "M must be at least 1");
    const uint64_t es = act_size(t), C = s.conv_dim(), V = s.value_dim(), nv = s.nv;
    check(proj_stride >= C + V + 2 * nv, op,
          "proj_stride (" + std::to_string(proj_stride) + ") is below conv_dim + value_dim + 2 nv (" +
              std::to_string(C + V + 2 * nv) + ")");
    need(proj, ((uint64_t(M) - 1) * proj_stride + C + V + 2 * nv) * es, op, "proj");
    if (route == GdnRoute::Auto) route = gdn_route(s, M);
    const Buffer z = proj.view(C * es, proj.length - C * es), b = proj.view((C + V) * es, proj.length - (C + V) * es),
                 a = proj.view((C + V + nv) * es, proj.length - (C + V + nv) * es);
    if (route == GdnRoute::Scan) {
        check_scan_shape(s, op);
        encode_scan(e, t, s, act, z, b, a, A_log, dt_bias, norm_w, eps, state, state_out, y, M, proj_stride, op);
        return;
    }
    check(gdn_chunked_fits(s), op,
          "the chunked route needs dk and dv multiples of 8, dk <= GDN_CHUNK_MAX_DK = " +
              std::to_string(GDN_CHUNK_MAX_DK) + " and GDN_CHUNK_MAX x conv_dim < 2^32, got dk = " +
              std::to_string(s.dk) + ", dv = " + std::to_string(s.dv) + ", conv_dim = " + std::to_string(s.conv_dim()));
    check(block <= GDN_CHUNK_MAX, op,
          "block = " + std::to_string(block) + " exceeds GDN_CHUNK_MAX = " + std::to_string(GDN_CHUNK_MAX));
    const uint32_t bc = chunk_block(M, block);
    const Sizes zs(s, t, M, bc);
    const uint64_t kd = zs.kd, nst = zs.nst, rp = zs.rows_pad, nact = (uint64_t(M - 1) * C + C) * es,
                   nqk = rp * kd * 4, ng = rp * nv * 4, no = uint64_t(M) * V * 4, ny = uint64_t(M) * V * es,
                   nz = ((uint64_t(M) - 1) * proj_stride + V) * es, nh = ((uint64_t(M) - 1) * proj_stride + nv) * es,
                   nw = uint64_t(s.dv) * es;
    need(act, nact, op, "act");
    const bool same = check_head_buffers(s, t, A_log, dt_bias, norm_w, state, state_out, y, M, op);
    need(scratch, 2 * nqk + 2 * ng + no, op, "scratch");
    const Buffer qn = scratch.view(0, nqk), kn = scratch.view(nqk, nqk), beta = scratch.view(2 * nqk, ng),
                 g = scratch.view(2 * nqk + ng, ng), o = scratch.view(2 * nqk + 2 * ng, no);
    const GdnParams p = make_params(s, eps, M, proj_stride, bc);
    const std::string sfx = act_suffix(t);
    // q | k of every row (the views span the rows; the bytes declared are the q and k elements)
    const uint64_t nqk_act = (uint64_t(M - 1) * C + 2 * kd) * es;
    e.dispatch("gdn_prep_" + sfx, Dims{s.nk, uint32_t(rp), 1}, Dims{32, 1, 1},
               {Arg::params(p), Arg::in(act.view(0, nqk_act), uint64_t(M) * 2 * kd * es),
                Arg::in(b.view(0, nh), uint64_t(M) * nv * es), Arg::in(a.view(0, nh), uint64_t(M) * nv * es),
                Arg::in(A_log.view(0, nv * 4)), Arg::in(dt_bias.view(0, nv * 4)), Arg::out(qn), Arg::out(kn),
                Arg::out(beta), Arg::out(g)},
               {}, prep_flops(s, M));
    const ChunkWork w = chunk_work(s, M, bc);
    e.dispatch("gdn_chunk_" + sfx, Dims{s.nv, chunk_tiles(s), 1}, Dims{32 * GDN_CHUNK_SIMDGROUPS, 1, 1},
               {Arg::params(p), Arg::in(act.view(0, nact), uint64_t(M) * V * es), Arg::in(qn), Arg::in(kn),
                Arg::in(beta), Arg::in(g, uint64_t(M) * nv * 4),
                same ? Arg::inout(state.view(0, nst)) : Arg::in(state.view(0, nst)),
                same ? Arg::inout(state_out.view(0, nst), 0, 0) : Arg::out(state_out.view(0, nst)), Arg::out(o)},
               {}, w.flops);
    e.dispatch("gdn_norm_" + sfx, Dims{s.nv, M, 1}, Dims{32, 1, 1},
               {Arg::params(p), Arg::in(o), Arg::in(z.view(0, nz), uint64_t(M) * V * es), Arg::in(norm_w.view(0, nw)),
                Arg::out(y.view(0, ny))},
               {}, norm_flops(s, M));
}

}  // namespace qwenmetal::gpu::ops

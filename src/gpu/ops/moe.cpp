#include "gpu/ops/moe.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "metal/moe.h"
#include "metal/quant.h"

namespace qwenmetal::gpu::ops {

namespace {

const Dims kGemvThreads{QMV_LANES, QMV_SIMDGROUPS, 1};

// moe_topk and moe_topk_rows: one kernel (moe_topk_<T>), `op` names the caller in errors
void topk_rows(Encoder& e, Act t, const Buffer& logits, uint32_t M, uint32_t stride, uint32_t n_experts, uint32_t k,
               bool norm, const Buffer& ids, const Buffer& weights, const char* op) {
    check(n_experts >= 1 && n_experts <= MOE_MAX_EXPERTS, op,
          "n_experts must be in [1, " + std::to_string(MOE_MAX_EXPERTS) + "], got " + std::to_string(n_experts));
    check(k >= 1 && k <= n_experts && k <= MOE_MAX_TOPK, op,
          "k must be in [1, min(n_experts, " + std::to_string(MOE_MAX_TOPK) + ")], got " + std::to_string(k));
    check(M >= 1, op, "M must be at least 1");
    check(stride >= n_experts, op,
          "stride must be at least n_experts = " + std::to_string(n_experts) + ", got " + std::to_string(stride));
    const uint64_t ln = (uint64_t(M - 1) * stride + n_experts) * 4, kn = uint64_t(M) * k * 4;
    need(logits, ln, op, "logits");
    need(ids, kn, op, "ids");
    need(weights, kn, op, "weights");
    const MoeTopkParams p{n_experts, k, norm ? 1u : 0u, M, stride};
    // flops: max, exp, sum and divide per expert and row (the selection's compares are not arithmetic)
    e.dispatch(std::string("moe_topk_") + act_suffix(t), Dims{ceil_div(M, MOE_TOPK_ROWS), 1, 1},
               Dims{QMV_LANES * std::min(M, MOE_TOPK_ROWS), 1, 1},
               {Arg::params(p), Arg::in(logits.view(0, ln), uint64_t(M) * n_experts * 4), Arg::out(ids.view(0, kn)),
                Arg::out(weights.view(0, kn))},
               {}, uint64_t(M) * n_experts * 4);
}

}  // namespace

void moe_topk(Encoder& e, const Buffer& logits, uint32_t n_experts, uint32_t k, bool norm, const Buffer& ids,
              const Buffer& weights) {
    topk_rows(e, Act::F32, logits, 1, n_experts, n_experts, k, norm, ids, weights, "moe_topk");
}

namespace {
// What the routed gate/up or down dispatch does with the shared expert: none, paired into the dispatch (its
// bits and group size go to the params, the variant names both formats), or apart (a format the routed kernel
// cannot read: run by another kernel beside it). Checks the routed stacks, k and the shared expert's shape.
struct SharedExpert {
    const Matrix* apart = nullptr;      // run by another kernel
    const Matrix* fused = nullptr;      // paired into the dispatch
    uint32_t inter = 0, group_size = 0, bits = 0;
    std::string variant;                // the dispatch's kernel variant
};
void pair(SharedExpert& se, const Matrix& routed, const Matrix& s, const char* op, const char* name) {
    if (!can_pair(routed, s)) {
        se.apart = &s;
        return;
    }
    se.fused = &s;
    se.variant = paired_variant(routed, s, op, name);
    se.bits = s.qbits();
    se.group_size = quantized(s.fmt) ? s.group_size : 0;
}
void check_k(uint32_t k, const Matrix& stack, const char* op) {
    check(k >= 1 && k <= stack.count, op,
          "k must be in [1, experts in the stack = " + std::to_string(stack.count) + "], got " + std::to_string(k));
}
SharedExpert gate_up_shared(const Matrix& gate, const Matrix& up, const Matrix* shared, uint32_t k, const char* op) {
    gate.validate((std::string(op) + ": gate").c_str());
    up.validate((std::string(op) + ": up").c_str());
    check(up.fmt == gate.fmt && up.scales_f32 == gate.scales_f32, op,
          "up (" + up.variant() + ", " + format_name(up.fmt) + ") must have the format of gate (" + gate.variant() +
              ", " + format_name(gate.fmt) + ")");
    check(up.rows == gate.rows && up.cols == gate.cols && up.count == gate.count && up.group_size == gate.group_size,
          op, "gate and up stacks must have the same shape");
    check_k(k, gate, op);
    SharedExpert se;
    se.variant = gate.variant();
    if (shared) {
        shared->validate((std::string(op) + ": shared_gate_up").c_str());
        check(shared->count == 1 && shared->cols == gate.cols && shared->rows % 2 == 0, op,
              "shared_gate_up must be one [2 * shared_inter, H] matrix");
        se.inter = shared->rows / 2;
        pair(se, gate, *shared, op, "shared_gate_up");
    }
    return se;
}
SharedExpert down_shared(const Matrix& down, const Matrix* shared, uint32_t k, const char* op) {
    down.validate((std::string(op) + ": down").c_str());
    check_k(k, down, op);
    SharedExpert se;
    se.variant = down.variant();
    if (shared) {
        shared->validate((std::string(op) + ": shared_down").c_str());
        check(shared->count == 1 && shared->rows == down.rows, op, "shared_down must be one [H, shared_inter] matrix");
        se.inter = shared->cols;
        pair(se, down, *shared, op, "shared_down");
    }
    return se;
}
// A down dispatch's three shared-expert buffers: the projection run apart (`apart_out`, f32, already
// computed), the paired matrix, or for no shared expert the routed stack again, declared unread
void shared_down_args(std::vector<Arg>& args, const Buffer* apart_out, const Matrix* shared_down, uint32_t H) {
    if (apart_out) {
        args.push_back(Arg::in(*apart_out));
        args.push_back(Arg::in(*apart_out, 0));
        args.push_back(Arg::in(*apart_out, 0));
    } else if (shared_down) {
        matrix_args(args, *shared_down, H);
    } else {
        for (int i = 1; i <= 3; ++i) args.push_back(Arg::in(args[size_t(i)].buf, 0));
    }
}
}  // namespace

void moe_gate_up(Encoder& e, Act t, const Matrix& gate, const Matrix& up, const Matrix* shared_gate_up,
                 const Buffer& x, const Buffer& ids, uint32_t k, const Buffer& act, const MoeRouting* route) {
    const char* op = "moe_gate_up";
    // a shared expert in a format the routed kernel cannot read (mlx_lm.convert can leave one side dense)
    // runs apart: mlp_gate_up into its slot of act, beside this dispatch
    const SharedExpert se = gate_up_shared(gate, up, shared_gate_up, k, op);
    const Matrix *apart = se.apart, *fused = se.fused;
    const uint32_t H = gate.cols, inter = gate.rows, shared_inter = se.inter, shared_gs = se.group_size;
    const uint32_t shared_bits = se.bits;
    const std::string& variant = se.variant;
    const uint32_t stride = std::max(inter, shared_inter), slots = k + (fused ? 1 : 0);
    const uint64_t es = act_size(t), an = uint64_t(k + (shared_gate_up ? 1 : 0)) * stride * es;
    need(x, uint64_t(H) * es, op, "x");
    need(ids, uint64_t(k) * 4, op, "ids");
    need(act, an, op, "act");
    check(x.offset % (4 * es) == 0, op, "x offset must be 4-element aligned");
    uint32_t topk = 0;
    if (route) {
        check(route->n_experts >= k && route->n_experts <= MOE_MAX_EXPERTS && k <= MOE_MAX_TOPK, op,
              "fused top-k needs k <= min(n_experts, " + std::to_string(MOE_MAX_TOPK) + ") and n_experts <= " +
                  std::to_string(MOE_MAX_EXPERTS));
        need(route->logits, uint64_t(route->n_experts) * 4, op, "route.logits");
        need(route->weights, uint64_t(k) * 4, op, "route.weights");
        topk = MOE_TOPK_FUSED | (route->norm ? MOE_TOPK_NORM : 0u);
    }
    const MoeGateUpParams p{H, inter, quantized(gate.fmt) ? gate.group_size : 0, gate.count, k,
                            fused ? shared_inter : 0u, shared_gs, stride, route ? route->n_experts : 0u, topk,
                            gate.qbits(), shared_bits};
    std::vector<Arg> args{Arg::params(p)};
    matrix_args(args, gate, uint64_t(k) * inter);  // only the k chosen experts' rows are read
    matrix_args(args, up, uint64_t(k) * inter);
    if (fused) {
        matrix_args(args, *fused, fused->rows);
    } else {  // unused slots: bind the gate stack again, declared unread
        for (int i = 1; i <= 3; ++i) args.push_back(Arg::in(args[size_t(i)].buf, 0));
    }
    // the routed slots (and the fused shared one): the shared slot apart is mlp_gate_up's
    const Buffer xv = x.view(0, uint64_t(H) * es), av = act.view(0, uint64_t(slots) * stride * es);
    args.push_back(Arg::in(xv));
    args.push_back(route ? Arg::in(route->logits.view(0, uint64_t(route->n_experts) * 4)) : Arg::in(xv, 0));
    args.push_back(route ? Arg::out(ids.view(0, uint64_t(k) * 4)) : Arg::in(ids.view(0, uint64_t(k) * 4)));
    args.push_back(Arg::out(av, (uint64_t(k) * inter + (fused ? shared_inter : 0u)) * es));
    args.push_back(route ? Arg::out(route->weights.view(0, uint64_t(k) * 4)) : Arg::in(av, 0));
    e.dispatch("moe_gate_up_" + variant + "_" + act_suffix(t), Dims{ceil_div(stride, QMV_TG_ROWS), slots, 1},
               kGemvThreads, args);
    if (apart) mlp_gate_up(e, t, *apart, x, act.view(uint64_t(k) * stride * es, uint64_t(shared_inter) * es));
}

void moe_down(Encoder& e, Act t, const Matrix& down, const Matrix* shared_down, const Buffer& act,
              const Buffer& ids, const Buffer& weights, const Buffer& logits, uint32_t n_experts, uint32_t k,
              const Buffer& x, const Buffer* shared_out) {
    const char* op = "moe_down";
    // a shared expert the routed kernel cannot read: its down projection by qmv (the same rows_dot) into
    // shared_out first, which this dispatch then combines as it would its own
    const SharedExpert se = down_shared(down, shared_down, k, op);
    const Matrix* apart = se.apart;
    const uint32_t H = down.rows, inter = down.cols, shared_inter = se.inter, shared_gs = se.group_size;
    const uint32_t shared_bits = se.bits;
    const std::string& variant = se.variant;
    if (shared_down) {
        need(logits, (uint64_t(n_experts) + 1) * 4, op, "logits (n_experts + 1 with a shared expert)");
        if (apart) {
            check(shared_out != nullptr, op, "shared_down (" + apart->variant() + ") cannot run in one dispatch with "
                                         "the routed experts (" + down.variant() + "): give shared_out, f32 [H]");
            need(*shared_out, uint64_t(H) * 4, op, "shared_out");
        }
    }
    const uint32_t stride = std::max(inter, shared_inter), slots = k + (shared_down ? 1 : 0);
    const uint64_t es = act_size(t), an = uint64_t(slots) * stride * es, xn = uint64_t(H) * es;
    need(act, an, op, "act");
    check(act.offset % (4 * es) == 0, op, "act offset must be 4-element aligned");
    need(ids, uint64_t(k) * 4, op, "ids");
    need(weights, uint64_t(k) * 4, op, "weights");
    need(x, xn, op, "x");
    const MoeDownParams p{H, inter, quantized(down.fmt) ? down.group_size : 0, down.count, k, shared_inter,
                          shared_gs, stride, down.qbits(), shared_bits, apart ? 1u : 0u};
    std::vector<Arg> args{Arg::params(p)};
    matrix_args(args, down, uint64_t(k) * H);  // only the k chosen experts' rows are read
    std::optional<Buffer> so;
    if (apart) {
        so = shared_out->view(0, uint64_t(H) * 4);
        qmv(e, t, *apart, act.view(uint64_t(k) * stride * es, uint64_t(shared_inter) * es), *so, 1, true);
    }
    shared_down_args(args, so ? &*so : nullptr, shared_down, H);
    const Buffer wv = weights.view(0, uint64_t(k) * 4);
    args.push_back(Arg::in(act.view(0, an), (uint64_t(k) * inter + shared_inter) * es));
    args.push_back(Arg::in(ids.view(0, uint64_t(k) * 4)));
    args.push_back(Arg::in(wv));
    // the shared-gate logit alone (logits[n_experts]); without a shared expert a stand-in, unread
    args.push_back(shared_down ? Arg::in(logits.view(uint64_t(n_experts) * 4, 4)) : Arg::in(wv, 0));
    args.push_back(Arg::inout(x.view(0, xn)));
    e.dispatch("moe_down_" + variant + "_" + act_suffix(t), Dims{ceil_div(H, QMV_TG_ROWS), 1, 1},
               kGemvThreads, args);
}

// ------------------------------------------------------------------------------- the union-read MoE
double moe_expected_union(uint32_t n_experts, uint32_t k, uint32_t rows) {
    if (n_experts == 0) return 0.0;
    const double miss = 1.0 - double(std::min(k, n_experts)) / double(n_experts);   // a row misses an expert
    return double(n_experts) * (1.0 - std::pow(miss, double(rows)));
}

namespace {
void check_rows(const MoeRows& r, uint32_t k, uint32_t x_stride, uint32_t act_row, const char* op) {
    check(r.rows >= 1 && r.rows <= MOE_ROWS_MAX, op,
          "rows must be in [1, " + std::to_string(MOE_ROWS_MAX) + "], got " + std::to_string(r.rows));
    check(uint64_t(r.rows) * k <= MOE_ROWS_MAX_PAIRS, op,
          "rows * k must be at most " + std::to_string(MOE_ROWS_MAX_PAIRS));
    check(x_stride % 4 == 0 && act_row % 4 == 0, op, "x_stride and act_row must be multiples of 4 elements");
    check(uint64_t(r.rows) * std::max(x_stride, act_row) < (uint64_t(1) << 32), op, "rows too long for 32-bit offsets");
}
// the rows of `per_expert` rows each that the modelled union of R rows reads (at least one expert's)
uint64_t union_rows(uint32_t count, uint32_t k, uint32_t R, uint64_t per_expert) {
    const double u = std::max(std::min(moe_expected_union(count, k, R), double(uint64_t(R) * k)), double(k));
    return uint64_t(std::llround(u * double(per_expert)));
}
}  // namespace

void moe_gate_up_rows(Encoder& e, Act t, const Matrix& gate, const Matrix& up, const Matrix* shared_gate_up,
                      const Buffer& x, const Buffer& ids, uint32_t k, const Buffer& act, const MoeRows& rows,
                      const MoeRowsRouting* route) {
    const char* op = "moe_gate_up_rows";
    const SharedExpert se = gate_up_shared(gate, up, shared_gate_up, k, op);
    const Matrix *apart = se.apart, *fused = se.fused;
    const uint32_t H = gate.cols, inter = gate.rows, R = rows.rows, shared_inter = se.inter;
    const uint32_t shared_gs = se.group_size, shared_bits = se.bits;
    const std::string& variant = se.variant;
    const uint32_t stride = std::max(inter, shared_inter), slots = k + (shared_gate_up ? 1 : 0);
    const uint32_t xs = rows.x_stride ? rows.x_stride : H, ar = rows.act_row ? rows.act_row : (k + 1) * stride;
    check_rows(rows, k, xs, ar, op);
    check(xs >= H && ar >= slots * stride && stride % 4 == 0, op,
          "x rows must hold H, act rows (k + 1) slots of a multiple of 4 elements");
    const uint64_t es = act_size(t);
    need(x, (uint64_t(R - 1) * xs + H) * es, op, "x");
    need(ids, uint64_t(R) * k * 4, op, "ids");
    need(act, (uint64_t(R - 1) * ar + uint64_t(slots) * stride) * es, op, "act");
    check(x.offset % (4 * es) == 0 && act.offset % (4 * es) == 0, op, "x and act offsets must be 4-element aligned");
    uint32_t topk = 0;
    uint64_t ln = 0;
    if (route) {
        check(R <= MOE_ROWS_TOPK_FUSED_MAX, op,
              "the fused top-k takes at most " + std::to_string(MOE_ROWS_TOPK_FUSED_MAX) + " rows, got " +
                  std::to_string(R));
        check(route->n_experts >= k && route->n_experts <= MOE_MAX_EXPERTS && k <= MOE_MAX_TOPK, op,
              "fused top-k needs k <= min(n_experts, " + std::to_string(MOE_MAX_TOPK) + ") and n_experts <= " +
                  std::to_string(MOE_MAX_EXPERTS));
        check(route->stride >= route->n_experts, op, "route.stride must be at least n_experts");
        ln = (uint64_t(R - 1) * route->stride + route->n_experts) * 4;
        need(route->logits, ln, op, "route.logits");
        need(route->weights, uint64_t(R) * k * 4, op, "route.weights");
        topk = MOE_TOPK_FUSED | (route->norm ? MOE_TOPK_NORM : 0u);
    }
    const MoeGateUpRowsParams p{H, inter, quantized(gate.fmt) ? gate.group_size : 0, gate.count, k,
                                fused ? shared_inter : 0u, shared_gs, stride, gate.qbits(), shared_bits, R, xs, ar,
                                route ? route->n_experts : 0u, topk, route ? route->stride : 0u};
    std::vector<Arg> args{Arg::params(p)};
    const uint64_t read = union_rows(gate.count, k, R, inter);   // the modelled union's rows (each read once)
    matrix_args(args, gate, read);
    matrix_args(args, up, read);
    if (fused) {
        matrix_args(args, *fused, fused->rows);
    } else {
        for (int i = 1; i <= 3; ++i) args.push_back(Arg::in(args[size_t(i)].buf, 0));
    }
    const Buffer xv = x.view(0, (uint64_t(R - 1) * xs + H) * es), iv = ids.view(0, uint64_t(R) * k * 4);
    args.push_back(Arg::in(xv, uint64_t(R) * H * es));
    args.push_back(route ? Arg::out(iv) : Arg::in(iv));
    args.push_back(Arg::out(act.view(0, (uint64_t(R - 1) * ar + uint64_t(slots) * stride) * es),
                            uint64_t(R) * (uint64_t(k) * inter + (fused ? shared_inter : 0u)) * es));
    // fused top-k: every threadgroup reads the rows' logits (from cache after the first), one stores the picks
    args.push_back(route ? Arg::in(route->logits.view(0, ln), uint64_t(R) * route->n_experts * 4) : Arg::in(xv, 0));
    args.push_back(route ? Arg::out(route->weights.view(0, uint64_t(R) * k * 4)) : Arg::in(xv, 0));
    e.dispatch("moe_gate_up_rows_" + variant + "_" + act_suffix(t),
               Dims{ceil_div(stride, QMV_TG_ROWS), R * k + (fused ? 1 : 0), 1}, kGemvThreads, args);
    if (apart)
        for (uint32_t r = 0; r < R; ++r)
            mlp_gate_up(e, t, *apart, x.view(uint64_t(r) * xs * es, uint64_t(H) * es),
                        act.view((uint64_t(r) * ar + uint64_t(k) * stride) * es, uint64_t(shared_inter) * es));
}

void moe_down_rows(Encoder& e, Act t, const Matrix& down, const Matrix* shared_down, const Buffer& act,
                   const Buffer& ids, const Buffer& weights, const Buffer& logits, uint32_t logits_stride,
                   uint32_t n_experts, uint32_t k, const Buffer& x, const MoeRows& rows, const Buffer* shared_out) {
    const char* op = "moe_down_rows";
    const SharedExpert se = down_shared(down, shared_down, k, op);
    const Matrix* apart = se.apart;
    const uint32_t H = down.rows, inter = down.cols, R = rows.rows, shared_inter = se.inter;
    const uint32_t shared_gs = se.group_size, shared_bits = se.bits;
    const std::string& variant = se.variant;
    if (shared_down) {
        check(logits_stride > n_experts, op, "logits rows must hold the shared-gate logit (column n_experts)");
        need(logits, (uint64_t(R - 1) * logits_stride + n_experts + 1) * 4, op, "logits");
        if (apart) {
            check(shared_out != nullptr, op, "shared_down (" + apart->variant() + ") cannot run in one dispatch with "
                                         "the routed experts (" + down.variant() + "): give shared_out, f32 [R, H]");
            need(*shared_out, uint64_t(R) * H * 4, op, "shared_out");
        }
    }
    const uint32_t stride = std::max(inter, shared_inter), slots = k + (shared_down ? 1 : 0);
    const uint32_t xs = rows.x_stride ? rows.x_stride : H, ar = rows.act_row ? rows.act_row : (k + 1) * stride;
    check_rows(rows, k, xs, ar, op);
    check(xs >= H && ar >= slots * stride && stride % 4 == 0, op,
          "x rows must hold H, act rows (k + 1) slots of a multiple of 4 elements");
    const uint64_t es = act_size(t), an = (uint64_t(R - 1) * ar + uint64_t(slots) * stride) * es;
    const uint64_t xn = (uint64_t(R - 1) * xs + H) * es;
    need(act, an, op, "act");
    check(act.offset % (4 * es) == 0, op, "act offset must be 4-element aligned");
    need(ids, uint64_t(R) * k * 4, op, "ids");
    need(weights, uint64_t(R) * k * 4, op, "weights");
    need(x, xn, op, "x");
    const MoeDownRowsParams p{H, inter, quantized(down.fmt) ? down.group_size : 0, down.count, k, shared_inter,
                              shared_gs, stride, down.qbits(), shared_bits, apart ? 1u : 0u, R, ar, xs,
                              logits_stride, n_experts};
    std::vector<Arg> args{Arg::params(p)};
    matrix_args(args, down, union_rows(down.count, k, R, H));   // the modelled union's rows (each read once)
    std::optional<Buffer> so;
    if (apart) {
        so = shared_out->view(0, uint64_t(R) * H * 4);
        qmv(e, t, *apart, act.view(uint64_t(k) * stride * es, an - uint64_t(k) * stride * es), *so, R, true, ar, H);
    }
    shared_down_args(args, so ? &*so : nullptr, shared_down, H);
    const Buffer wv = weights.view(0, uint64_t(R) * k * 4);
    args.push_back(Arg::in(act.view(0, an), uint64_t(R) * (uint64_t(k) * inter + shared_inter) * es));
    args.push_back(Arg::in(ids.view(0, uint64_t(R) * k * 4)));
    args.push_back(Arg::in(wv));
    if (shared_down) {
        const uint64_t ln = (uint64_t(R - 1) * logits_stride + n_experts + 1) * 4;
        args.push_back(Arg::in(logits.view(0, ln), uint64_t(R) * 4));   // the shared-gate logits only
    } else {
        args.push_back(Arg::in(wv, 0));
    }
    args.push_back(Arg::inout(x.view(0, xn), uint64_t(R) * H * es, uint64_t(R) * H * es));
    e.dispatch("moe_down_rows_" + variant + "_" + act_suffix(t), Dims{ceil_div(H, QMV_TG_ROWS), 1, 1},
               kGemvThreads, args);
}

void mlp_gate_up(Encoder& e, Act t, const Matrix& gate_up, const Buffer& x, const Buffer& act) {
    const char* op = "mlp_gate_up";
    gate_up.validate("mlp_gate_up: gate_up");
    check(gate_up.count == 1 && gate_up.rows % 2 == 0, op, "gate_up must be one [2 * inter, K] matrix");
    const uint32_t K = gate_up.cols, inter = gate_up.rows / 2;
    const uint64_t es = act_size(t);
    need(x, uint64_t(K) * es, op, "x");
    need(act, uint64_t(inter) * es, op, "act");
    check(x.offset % (4 * es) == 0, op, "x offset must be 4-element aligned");
    const MlpGateUpParams p{K, inter, quantized(gate_up.fmt) ? gate_up.group_size : 0, gate_up.qbits()};
    std::vector<Arg> args{Arg::params(p)};
    matrix_args(args, gate_up, gate_up.rows);
    args.push_back(Arg::in(x.view(0, uint64_t(K) * es)));
    args.push_back(Arg::out(act.view(0, uint64_t(inter) * es)));
    e.dispatch("mlp_gate_up_" + gate_up.variant() + "_" + act_suffix(t), Dims{ceil_div(inter, QMV_TG_ROWS), 1, 1},
               kGemvThreads, args);
}

// ------------------------------------------------------------------------------------------ prefill
void moe_topk_rows(Encoder& e, Act t, const Buffer& logits, uint32_t M, uint32_t stride, uint32_t n_experts,
                   uint32_t k, bool norm, const Buffer& ids, const Buffer& weights) {
    topk_rows(e, t, logits, M, stride, n_experts, k, norm, ids, weights, "moe_topk_rows");
}

uint32_t moe_tile_capacity(uint32_t S, uint32_t n_experts, uint32_t tile_rows) {
    check(tile_rows >= 1, "moe_tile_capacity", "tile_rows must be at least 1");
    const uint32_t n = std::min(n_experts, S);
    return n + (S - n) / tile_rows;
}

uint32_t moe_tile_rows(uint32_t S, uint32_t n_experts) {
    return uint64_t(S) >= 32ull * n_experts ? 32 : 16;
}

uint64_t moe_sort_scratch_bytes(uint32_t n_experts) { return uint64_t(MOE_SORT_BLOCKS) * n_experts * 4; }

void moe_sort(Encoder& e, const Buffer& ids, uint32_t M, uint32_t k, uint32_t n_experts, const Buffer& scratch,
              const Buffer& slot_rows, const Buffer& slot_of, const TileMap& tm) {
    const char* op = "moe_sort";
    check(M >= 1 && k >= 1, op, "M and k must be at least 1");
    check(uint64_t(M) * k <= UINT32_MAX, op, "M * k must fit in 32 bits");
    check(n_experts >= 1 && n_experts <= MOE_MAX_EXPERTS, op,
          "n_experts must be in [1, " + std::to_string(MOE_MAX_EXPERTS) + "], got " + std::to_string(n_experts));
    check(tm.tile_rows == 16 || tm.tile_rows == 32, op,
          "tile_rows must be 16 or 32, got " + std::to_string(tm.tile_rows));
    const uint32_t S = M * k, cap = moe_tile_capacity(S, n_experts, tm.tile_rows);
    check(tm.capacity >= cap, op,
          "tile map capacity must be at least moe_tile_capacity = " + std::to_string(cap) + ", got " +
              std::to_string(tm.capacity));
    const uint64_t sn = uint64_t(S) * 4, tn = uint64_t(tm.capacity) * 16;
    need(ids, sn, op, "ids");
    need(scratch, moe_sort_scratch_bytes(n_experts), op, "scratch");
    need(slot_rows, sn, op, "slot_rows");
    need(slot_of, sn, op, "slot_of");
    need(tm.tiles, tn, op, "tiles");
    const uint32_t block_tokens = ceil_div(M, MOE_SORT_BLOCKS), blocks = ceil_div(M, block_tokens);
    // one expert per thread (count and scatter share the grid: the smaller pipeline limit of the two)
    const uint32_t threads = std::min(fit_threads(e, "moe_sort_count", std::min(MOE_SORT_THREADS, ceil_div(n_experts, QMV_LANES) * QMV_LANES)),
                                      fit_threads(e, "moe_sort_scatter", MOE_SORT_THREADS));
    const MoeSortParams p{S, k, n_experts, block_tokens * k, blocks, tm.tile_rows, tm.capacity};
    const Buffer idv = ids.view(0, sn), counts = scratch.view(0, uint64_t(blocks) * n_experts * 4);
    const Dims grid{blocks, ceil_div(n_experts, threads), 1};
    // integer counting only: no flops declared
    e.dispatch("moe_sort_count", grid, Dims{threads, 1, 1}, {Arg::params(p), Arg::in(idv), Arg::out(counts)});
    e.dispatch("moe_sort_scan", Dims{1, 1, 1}, Dims{MOE_SCAN_THREADS, 1, 1},
               {Arg::params(p), Arg::inout(counts), Arg::out(tm.tiles.view(0, tn))});
    e.dispatch("moe_sort_scatter", grid, Dims{threads, 1, 1},
               {Arg::params(p), Arg::in(idv), Arg::in(counts), Arg::out(slot_of.view(0, sn)),
                Arg::out(slot_rows.view(0, sn))});
}

void moe_combine(Encoder& e, Act t, const Buffer& y, const Buffer& slot_of, const Buffer& weights, uint32_t M,
                 uint32_t k, uint32_t H, const Buffer* shared, const Buffer& logits, uint32_t logits_stride,
                 uint32_t n_experts, const Buffer& x) {
    const char* op = "moe_combine";
    check(M >= 1 && k >= 1 && H >= 1, op, "M, k and H must be at least 1");
    const uint64_t es = act_size(t), S = uint64_t(M) * k, yn = S * H * 4, kn = S * 4, xn = uint64_t(M) * H * es;
    need(y, yn, op, "y");
    need(slot_of, kn, op, "slot_of");
    need(weights, kn, op, "weights");
    need(x, xn, op, "x");
    uint64_t ln = 0;
    if (shared) {
        check(logits_stride >= n_experts + 1, op,
              "logits_stride must be at least n_experts + 1 = " + std::to_string(n_experts + 1) +
                  " with a shared expert, got " + std::to_string(logits_stride));
        need(*shared, xn, op, "shared");
        ln = (uint64_t(M - 1) * logits_stride + n_experts + 1) * 4;
        need(logits, ln, op, "logits");
    }
    const MoeCombineParams p{H, k, uint32_t(S), logits_stride, n_experts, shared ? 1u : 0u};
    const std::string kernel = std::string("moe_combine_") + act_suffix(t);
    const uint32_t threads = fit_threads(e, kernel, std::min(MOE_COMBINE_THREADS, ceil_div(H, QMV_LANES) * QMV_LANES));
    const Buffer wv = weights.view(0, kn);
    std::vector<Arg> args{Arg::params(p), Arg::in(y.view(0, yn)), Arg::in(slot_of.view(0, kn)), Arg::in(wv)};
    // without a shared expert: stand-ins, unread
    args.push_back(shared ? Arg::in(shared->view(0, xn)) : Arg::in(wv, 0));
    args.push_back(shared ? Arg::in(logits.view(0, ln), uint64_t(M) * 4) : Arg::in(wv, 0));
    args.push_back(Arg::inout(x.view(0, xn)));
    // flops: per output a multiply-add per expert, the gated shared term's multiply-add, the residual add
    e.dispatch(kernel, Dims{ceil_div(H, threads), M, 1}, Dims{threads, 1, 1},
               args, {}, uint64_t(M) * H * (2 * k + 1 + (shared ? 2 : 0)));
}

namespace {

// the block's shapes, checked: n_experts, hidden, routed and shared intermediate sizes, logit columns
struct BlockShape {
    uint32_t E, H, I, Is, n_logits;
};

BlockShape block_shape(const MoeBlock& b, const char* op) {
    check(b.router && !b.router->empty() && b.gate && b.up && b.down, op, "router, gate, up and down must be set");
    check(bool(b.shared_gate_up) == bool(b.shared_down), op, "shared_gate_up and shared_down go together");
    const Matrix& g = *b.gate;
    BlockShape s{g.count, g.cols, g.rows, b.shared_down ? b.shared_down->cols : 0u, 0};
    check(b.up->count == s.E && b.up->rows == s.I && b.up->cols == s.H && b.down->count == s.E &&
              b.down->rows == s.H && b.down->cols == s.I,
          op, "gate, up [E, I, H] and down [E, H, I] must have matching shapes");
    check(b.k >= 1 && b.k <= s.E, op, "k must be in [1, n_experts = " + std::to_string(s.E) + "], got " +
                                          std::to_string(b.k));
    if (b.shared_gate_up)
        check(b.shared_gate_up->rows == 2 * s.Is && b.shared_gate_up->cols == s.H && b.shared_down->rows == s.H, op,
              "the shared expert must be [2 Is, H] and [H, Is]");
    for (const Matrix& m : *b.router) {
        check(m.cols == s.H, op, "router parts must have H columns");
        s.n_logits += m.rows;
    }
    const uint32_t want = s.E + (b.shared_gate_up ? 1 : 0);
    check(s.n_logits == want, op,
          std::string("router rows must be n_experts") + (b.shared_gate_up ? " + 1 (shared gate)" : "") + " = " +
              std::to_string(want) + ", got " + std::to_string(s.n_logits));
    return s;
}

}  // namespace

MoeScratch moe_prefill_scratch(Device& d, Act t, const MoeBlock& b, uint32_t max_rows) {
    const BlockShape sh = block_shape(b, "moe_prefill_scratch");
    check(max_rows >= 1, "moe_prefill_scratch", "max_rows must be at least 1");
    const uint64_t es = act_size(t), M = max_rows, S = M * b.k;
    MoeScratch s;
    s.logits = d.alloc(M * sh.n_logits * 4, "moe_logits");
    s.ids = d.alloc(S * 4, "moe_ids");
    s.weights = d.alloc(S * 4, "moe_weights");
    s.sort = d.alloc(moe_sort_scratch_bytes(sh.E), "moe_sort");
    s.slot_rows = d.alloc(S * 4, "moe_slot_rows");
    s.slot_of = d.alloc(S * 4, "moe_slot_of");
    s.tiles = d.alloc(uint64_t(moe_tile_capacity(uint32_t(S), sh.E, 16)) * 16, "moe_tiles");
    s.act = d.alloc(S * sh.I * es, "moe_act");
    s.y = d.alloc(S * sh.H * 4, "moe_y");
    if (sh.Is) {
        s.shared_act = d.alloc(M * sh.Is * es, "moe_shared_act");
        s.shared_out = d.alloc(M * sh.H * es, "moe_shared_out");
    }
    return s;
}

void moe_prefill(Encoder& e, Act t, const MoeBlock& b, const Buffer& xn, const Buffer& x, uint32_t M,
                 const MoeScratch& s, GemmRoute route) {
    const char* op = "moe_prefill";
    const BlockShape sh = block_shape(b, op);
    check(M >= 1, op, "M must be at least 1");
    const uint32_t S = M * b.k;
    // router logits [M, n_logits], float holding the product rounded to T (the bf16 graph's logits)
    need(s.logits, uint64_t(M) * sh.n_logits * 4, op, "scratch.logits");
    GemmFusion rf;
    rf.round = true;
    uint64_t col = 0;
    for (const Matrix& part : *b.router) {
        gemm(e, t, part, xn, s.logits.view(col * 4, s.logits.length - col * 4), M, true, sh.H, sh.n_logits, rf,
             route);
        col += part.rows;
    }
    // the shared expert reads only xn: encoded here, its gate/up shares the router's dependency level and
    // its down the top-k's
    if (b.shared_gate_up) {
        GemmFusion sw;
        sw.swiglu = true;
        gemm(e, t, *b.shared_gate_up, xn, s.shared_act, M, false, 0, 0, sw, route);
        gemm(e, t, *b.shared_down, s.shared_act, s.shared_out, M, false, 0, 0, GemmFusion(), route);
    }
    moe_topk_rows(e, t, s.logits, M, sh.n_logits, sh.E, b.k, b.norm, s.ids, s.weights);
    const uint32_t tr = moe_tile_rows(S, sh.E);
    const TileMap tm{s.tiles, moe_tile_capacity(S, sh.E, tr), tr};
    moe_sort(e, s.ids, M, b.k, sh.E, s.sort, s.slot_rows, s.slot_of, tm);
    gemm_grouped_swiglu(e, t, *b.gate, *b.up, xn.view(0, uint64_t(M) * sh.H * act_size(t)), s.slot_rows, tm, S, s.act,
                        route);
    gemm_grouped(e, t, *b.down, s.act, tm, S, s.y, route);
    moe_combine(e, t, s.y, s.slot_of, s.weights, M, b.k, sh.H, b.shared_gate_up ? &s.shared_out : nullptr, s.logits,
                sh.n_logits, sh.E, x);
}

}  // namespace ops

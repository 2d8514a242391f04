#include "gpu/ops/quant.h"

#include "metal/quant.h"

namespace qwenmetal::gpu {

const char* format_name(WFormat f) {
    switch (f) {
        case WFormat::Q2: return "q2";
        case WFormat::Q3: return "q3";
        case WFormat::Q4: return "q4";
        case WFormat::Q5: return "q5";
        case WFormat::Q6: return "q6";
        case WFormat::Q8: return "q8";
        case WFormat::BF16: return "bf16";
        case WFormat::F16: return "f16";
        case WFormat::F32: return "f32";
    }
    return "?";
}

namespace {
[[noreturn]] void bad(const char* what, const std::string& msg) {
    throw std::invalid_argument(std::string(what) + ": " + msg);
}
// the formats of the run-time-width kernels (WFMT_QN)
bool runtime_width(WFormat f) {
    return f == WFormat::Q2 || f == WFormat::Q3 || f == WFormat::Q5 || f == WFormat::Q6;
}
}  // namespace

WFormat quantized_format(uint32_t bits, const std::string& what) {
    switch (bits) {
        case 2: return WFormat::Q2;
        case 3: return WFormat::Q3;
        case 4: return WFormat::Q4;
        case 5: return WFormat::Q5;
        case 6: return WFormat::Q6;
        case 8: return WFormat::Q8;
        default:
            throw std::invalid_argument(what + ": " + std::to_string(bits) +
                                        "-bit weights are not supported (bits 2, 3, 4, 5, 6 or 8)");
    }
}

void Matrix::validate(const char* what) const {
    if (rows == 0 || cols == 0 || count == 0)
        bad(what, "rows, cols and count must be positive (got " + std::to_string(rows) + " x " +
                      std::to_string(cols) + ", count " + std::to_string(count) + ")");
    const uint64_t n = uint64_t(count) * rows;
    if (quantized(fmt)) {
        if (group_size != 32 && group_size != 64 && group_size != 128)
            bad(what, "group_size must be 32, 64 or 128, got " + std::to_string(group_size));
        if (cols % group_size)
            bad(what, "cols " + std::to_string(cols) + " is not a multiple of group_size " + std::to_string(group_size));
        need(scales, n * srow_bytes(), what, "scales");
        need(biases, n * srow_bytes(), what, "biases");
        const uint64_t sa = scales_f32 ? 4 : 2;
        if (scales.offset % sa || biases.offset % sa) bad(what, "scales/biases offsets must be element-aligned");
    } else if (cols % QMV_VALS_DENSE) {
        bad(what, "dense weights need cols a multiple of " + std::to_string(QMV_VALS_DENSE) + ", got " +
                      std::to_string(cols));
    }
    need(w, n * row_bytes(), what, "w");
    if (w.offset % 16) bad(what, "w offset must be a multiple of 16 bytes (vector loads)");
}

std::string Matrix::variant() const {
    if (!quantized(fmt)) return format_name(fmt);
    return std::string(runtime_width(fmt) ? "qn" : format_name(fmt)) + (scales_f32 ? "_sf32" : "_sbf16");
}

bool can_pair(const Matrix& a, const Matrix& b) {
    return a.variant() == b.variant() || (quantized(a.fmt) && quantized(b.fmt) && a.scales_f32 == b.scales_f32);
}

std::string paired_variant(const Matrix& a, const Matrix& b, const char* op, const char* what) {
    if (a.variant() == b.variant()) return a.variant();
    if (can_pair(a, b)) return a.scales_f32 ? "qn_sf32" : "qn_sbf16";
    throw std::invalid_argument(std::string(op) + ": " + what + " (" + format_name(b.fmt) + ", " + b.variant() +
                                ") cannot run in one dispatch with the routed experts (" + format_name(a.fmt) + ", " +
                                a.variant() + "): both must have one format, or both be quantized with one scale type");
}

void matrix_args(std::vector<Arg>& args, const Matrix& M, uint64_t rows_read) {
    const uint64_t n = uint64_t(M.count) * M.rows, r = rows_read;
    const Buffer wv = M.w.view(0, n * M.row_bytes());
    args.push_back(Arg::in(wv, r * M.row_bytes()));
    if (quantized(M.fmt)) {
        args.push_back(Arg::in(M.scales.view(0, n * M.srow_bytes()), r * M.srow_bytes()));
        args.push_back(Arg::in(M.biases.view(0, n * M.srow_bytes()), r * M.srow_bytes()));
    } else {
        args.push_back(Arg::in(wv, 0));
        args.push_back(Arg::in(wv, 0));
    }
}

namespace ops {

namespace {
uint32_t vals_per_lane(WFormat f) {
    if (runtime_width(f)) return QMV_VALS_QN;
    return f == WFormat::Q4 ? QMV_VALS_Q4 : f == WFormat::Q8 ? QMV_VALS_Q8 : QMV_VALS_DENSE;
}
// input vectors per threadgroup of qmv (the kernel variant): 1 (decode), else the smallest of 4, 8, 16
// that holds the batch (the vectors past it are skipped), QMV_MULTI_MAX for larger batches (chunks of 16);
// the run-time-width format has only the decode kernel and b16 (metal/quant.metal's instantiations)
uint32_t qmv_vectors(WFormat f, uint32_t batch) {
    if (batch == 1) return 1;
    if (runtime_width(f)) return QMV_MULTI_MAX;
    uint32_t mb = QMV_MULTI_MIN;
    while (mb < batch && mb < QMV_MULTI_MAX) mb *= 2;
    return mb;
}
}  // namespace

void qmv(Encoder& e, Act t, const Matrix& W, const Buffer& x, const Buffer& y, uint32_t batch, bool f32_out,
         uint32_t x_stride, uint32_t y_stride, const QmvFusion& fuse) {
    const char* op = "qmv";
    W.validate("qmv: W");
    check(W.count == 1, op, "W must be one matrix (count 1), got a stack of " + std::to_string(W.count));
    check(batch > 0, op, "batch must be positive");
    const uint32_t xs = x_stride ? x_stride : W.cols, ys = y_stride ? y_stride : W.rows;
    check(xs >= W.cols, op, "x_stride " + std::to_string(xs) + " < cols " + std::to_string(W.cols));
    check(ys >= W.rows, op, "y_stride " + std::to_string(ys) + " < rows " + std::to_string(W.rows));
    check(xs % 4 == 0, op, "x_stride must be a multiple of 4 (vector loads)");
    const bool f32o = f32_out && t != Act::F32;  // float activations already give float output
    const uint64_t es = act_size(t), os = f32_out ? 4 : es;
    const uint64_t xn = (uint64_t(batch - 1) * xs + W.cols) * es, yn = (uint64_t(batch - 1) * ys + W.rows) * os;
    need(x, xn, op, "x");
    need(y, yn, op, "y");
    check(x.offset % (4 * es) == 0, op, "x offset must be 4-element aligned");
    uint32_t flags = 0;
    if (fuse.norm_w) {
        need(*fuse.norm_w, uint64_t(W.cols) * es, op, "norm_w");
        check(fuse.norm_w->offset % (4 * es) == 0, op, "norm_w offset must be 4-element aligned");
        flags |= QMV_NORM;
        if (fuse.xn) {
            need(*fuse.xn, xn, op, "xn");
            flags |= QMV_NORM_OUT;
        }
    } else {
        check(!fuse.xn, op, "xn needs norm_w");
    }
    if (fuse.residual) {
        need(*fuse.residual, yn, op, "residual");
        same_or_disjoint(*fuse.residual, y, yn, op, "residual", "y");
        flags |= QMV_ADD;
    }
    if (fuse.round) flags |= QMV_ROUND;
    const QmvConv* cv = fuse.conv;
    uint64_t nw = 0, ns = 0, na = 0;
    uint32_t cc = 0;
    bool conv_in_place = false;
    if (cv) {
        check(batch == 1, op, "the conv epilogue takes one vector (batch 1), got " + std::to_string(batch));
        check(!f32_out || t == Act::F32, op, "the conv epilogue needs output in the activation type");
        check(!fuse.residual && !fuse.round, op, "the conv epilogue excludes the residual add and rounding");
        check(cv->conv_w && cv->conv_state && cv->conv_out && cv->act, op, "the conv epilogue needs all its buffers");
        check(cv->taps >= 2, op, "the conv needs at least 2 taps, got " + std::to_string(cv->taps));
        cc = cv->channels ? cv->channels : W.rows;
        check(cc <= W.rows, op, "conv channels " + std::to_string(cc) + " > rows " + std::to_string(W.rows));
        nw = uint64_t(cc) * cv->taps * 4;
        ns = uint64_t(cc) * (cv->taps - 1) * 4;
        na = uint64_t(cc) * es;
        need(*cv->conv_w, nw, op, "conv_w");
        need(*cv->conv_state, ns, op, "conv_state");
        need(*cv->conv_out, ns, op, "conv_out");
        need(*cv->act, na, op, "act");
        conv_in_place = same_or_disjoint(*cv->conv_out, *cv->conv_state, ns, op, "conv_out", "conv_state");
        flags |= QMV_CONV;
    }
    const QmvParams p{W.cols, W.rows, quantized(W.fmt) ? W.group_size : 0, xs, ys, flags, fuse.eps, batch,
                      W.qbits(), cv ? cv->taps : 0u, cc};
    const uint32_t mb = qmv_vectors(W.fmt, batch), chunks = ceil_div(batch, mb);
    const std::string kernel = std::string(mb == 1 ? "qmv_" : "qmv_b" + std::to_string(mb) + "_") + W.variant() +
                               "_" + act_suffix(t) + (f32o ? "_f32out" : "");
    std::vector<Arg> args{Arg::params(p)};
    matrix_args(args, W, uint64_t(W.rows) * chunks);  // each chunk of mb vectors reads the weights once
    // unused slots bind a buffer the dispatch binds anyway, declared as not accessed
    const Buffer xv = x.view(0, xn), yv = y.view(0, yn);
    args.push_back(Arg::in(xv, uint64_t(batch) * W.cols * es));
    args.push_back(fuse.norm_w ? Arg::in(fuse.norm_w->view(0, uint64_t(W.cols) * es)) : Arg::in(xv, 0));
    const bool in_place = fuse.residual && fuse.residual->address() == y.address();
    if (fuse.residual && !in_place) args.push_back(Arg::in(fuse.residual->view(0, yn), uint64_t(batch) * W.rows * os));
    else args.push_back(Arg::in(yv, 0));
    args.push_back(in_place ? Arg::inout(yv, uint64_t(batch) * W.rows * os, uint64_t(batch) * W.rows * os)
                            : Arg::out(yv, uint64_t(batch) * W.rows * os));
    args.push_back(fuse.xn ? Arg::out(fuse.xn->view(0, xn), uint64_t(batch) * W.cols * es) : Arg::in(xv, 0));
    if (cv) {
        const Buffer sv = cv->conv_state->view(0, ns), ov = cv->conv_out->view(0, ns);
        args.push_back(Arg::in(cv->conv_w->view(0, nw)));
        args.push_back(conv_in_place ? Arg::inout(sv) : Arg::in(sv));
        args.push_back(conv_in_place ? Arg::inout(ov, 0, 0) : Arg::out(ov));
        args.push_back(Arg::out(cv->act->view(0, na)));
    } else {
        for (int i = 0; i < 4; ++i) args.push_back(Arg::in(xv, 0));
    }
    e.dispatch(kernel, Dims{ceil_div(W.rows, QMV_TG_ROWS), chunks, 1}, Dims{QMV_LANES, QMV_SIMDGROUPS, 1}, args, {},
               2 * uint64_t(W.rows) * W.cols * batch + uint64_t(cc) * (cv ? 2ull * cv->taps + 4 : 0));
}

void embed(Encoder& e, Act t, const Matrix& E, const Buffer& ids, uint32_t n, const Buffer& y) {
    const char* op = "embed";
    E.validate("embed: E");
    check(E.count == 1, op, "E must be one table (count 1)");
    check(n > 0, op, "n must be positive");
    const uint64_t es = act_size(t), yn = uint64_t(n) * E.cols * es;
    need(ids, uint64_t(n) * 4, op, "ids");
    need(y, yn, op, "y");
    // threads: one per VALS values of a row (a multiple of 32, at most EMBED_MAX_THREADS and the pipeline's limit)
    const std::string kernel = "embed_" + E.variant() + "_" + act_suffix(t);
    const uint32_t per = ceil_div(E.cols, vals_per_lane(E.fmt));
    const uint32_t threads = fit_threads(e, kernel, std::min<uint32_t>((per + 31) / 32 * 32, EMBED_MAX_THREADS));
    const EmbedParams p{E.cols, E.rows, quantized(E.fmt) ? E.group_size : 0, E.qbits()};
    // n ids touch at most n rows of the table
    std::vector<Arg> args{Arg::params(p)};
    matrix_args(args, E, n < E.rows ? n : E.rows);
    args.push_back(Arg::in(ids.view(0, uint64_t(n) * 4)));
    args.push_back(Arg::out(y.view(0, yn)));
    // a quantized value is one multiply-add (scale * q + bias); a dense one only a conversion
    e.dispatch(kernel, Dims{n, 1, 1}, Dims{threads, 1, 1}, args, {},
               quantized(E.fmt) ? 2 * uint64_t(n) * E.cols : 0);
}

}  // namespace ops
}  // namespace qwenmetal::gpu

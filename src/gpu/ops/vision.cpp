#include "gpu/ops/vision.h"

#include <algorithm>

#include "metal/vision.h"

namespace qwenmetal::gpu::ops {

namespace {
// about n / 4 threads, a multiple of 32, within the pipeline's limit (each walks the row in steps of the group)
Dims row_threads(Encoder& e, const std::string& kernel, uint32_t n) {
    const uint32_t t = (n / 4 + 31) / 32 * 32;
    return Dims{fit_threads(e, kernel, t > VISION_MAX_THREADS ? VISION_MAX_THREADS : t), 1, 1};
}
}  // namespace

void vision_bias_act(Encoder& e, Act t, const Buffer& y, const Buffer& b, uint32_t rows, uint32_t N, VisionAct act,
                     uint32_t stride) {
    const char* op = "vision_bias_act";
    check(rows > 0 && N > 0, op, "rows and N must be positive");
    check(act == VisionAct::None || act == VisionAct::GeluTanh || act == VisionAct::GeluErf, op, "unknown activation");
    if (!stride) stride = N;
    check(stride >= N, op, "stride " + std::to_string(stride) + " below N " + std::to_string(N));
    const uint64_t es = act_size(t), n = (uint64_t(rows - 1) * stride + N) * es;
    need(y, n, op, "y");
    need(b, N * es, op, "b");
    const VisionBiasParams p{N, stride, uint32_t(act), 0};
    const std::string kernel = std::string("vision_bias_act_") + act_suffix(t);
    const uint64_t touched = uint64_t(rows) * N * es;
    e.dispatch(kernel, Dims{rows, 1, 1}, row_threads(e, kernel, N),
               {Arg::params(p), Arg::inout(y.view(0, n), touched, touched), Arg::in(b.view(0, N * es))}, {},
               uint64_t(rows) * N * (act == VisionAct::None ? 1 : 10));
}

void vision_pos_embed(Encoder& e, Act t, const Buffer& x, const Buffer& b, const Buffer& table, uint32_t table_rows,
                      const Buffer& idx, const Buffer& w, uint32_t rows, uint32_t H) {
    const char* op = "vision_pos_embed";
    check(rows > 0 && H > 0 && table_rows > 0, op, "rows, H and table_rows must be positive");
    const uint64_t es = act_size(t), n = uint64_t(rows) * H * es;
    need(x, n, op, "x");
    need(b, H * es, op, "b");
    need(table, uint64_t(table_rows) * H * es, op, "table");
    need(idx, uint64_t(rows) * 16, op, "idx");
    need(w, uint64_t(rows) * 16, op, "w");
    const VisionPosParams p{H, table_rows};
    const std::string kernel = std::string("vision_pos_embed_") + act_suffix(t);
    // every row reads 4 table rows (the declared bytes: those, not the whole table)
    const uint64_t table_read = std::min<uint64_t>(uint64_t(rows) * 4, table_rows) * H * es;
    e.dispatch(kernel, Dims{rows, 1, 1}, row_threads(e, kernel, H),
               {Arg::params(p), Arg::inout(x.view(0, n)), Arg::in(b.view(0, H * es)),
                Arg::in(table.view(0, uint64_t(table_rows) * H * es), table_read), Arg::in(idx.view(0, rows * 16ull)),
                Arg::in(w.view(0, rows * 16ull))},
               {}, uint64_t(rows) * H * 9);
}

void vision_rope(Encoder& e, Act t, uint32_t n_heads, uint32_t head_dim, const Buffer& qkv, const Buffer& bias,
                 const Buffer& cos, const Buffer& sin, const Buffer& q_out, const KVCache& kv, uint32_t rows,
                 uint32_t stride) {
    const char* op = "vision_rope";
    check(rows > 0 && n_heads > 0 && head_dim > 0, op, "rows, n_heads and head_dim must be positive");
    check(head_dim % 2 == 0, op, "head_dim must be even (rotate-half)");
    check(kv.f32 == (t == Act::F32), op, "the K/V buffers must hold the activation type");
    const uint64_t H = uint64_t(n_heads) * head_dim;
    if (!stride) stride = uint32_t(3 * H);
    check(stride >= 3 * H, op, "stride " + std::to_string(stride) + " below 3 * n_heads * head_dim");
    check(rows <= kv.capacity, op, std::to_string(rows) + " rows outside K/V buffers of " +
                                       std::to_string(kv.capacity) + " rows");
    check(uint64_t(kv.capacity) * H <= UINT32_MAX, op, "K/V buffers beyond the kernels' 32-bit head offsets");
    const uint64_t es = act_size(t), in_bytes = (uint64_t(rows - 1) * stride + 3 * H) * es;
    const uint64_t cs = uint64_t(rows) * head_dim * 4, q_bytes = uint64_t(rows) * H * es;
    const uint64_t cache = uint64_t(n_heads) * kv.capacity * head_dim * es;
    need(qkv, in_bytes, op, "qkv");
    need(bias, 3 * H * es, op, "bias");
    need(cos, cs, op, "cos");
    need(sin, cs, op, "sin");
    need(q_out, q_bytes, op, "q_out");
    need(kv.k, cache, op, "k");
    need(kv.v, cache, op, "v");
    const VisionRopeParams p{n_heads, head_dim, kv.capacity, stride};
    const std::string kernel = std::string("vision_rope_") + act_suffix(t);
    const uint32_t threads = (head_dim + 31) / 32 * 32;
    e.dispatch(kernel, Dims{n_heads, rows, 1},
               Dims{fit_threads(e, kernel, threads > VISION_ROPE_MAX_THREADS ? VISION_ROPE_MAX_THREADS : threads), 1, 1},
               {Arg::params(p), Arg::in(qkv.view(0, in_bytes), uint64_t(rows) * 3 * H * es),
                Arg::in(bias.view(0, 3 * H * es)), Arg::in(cos.view(0, cs)), Arg::in(sin.view(0, cs)),
                Arg::out(q_out.view(0, q_bytes)), Arg::out(kv.k.view(0, cache), q_bytes),
                Arg::out(kv.v.view(0, cache), q_bytes)},
               {}, uint64_t(rows) * H * 12);
}

}  // namespace qwenmetal::gpu::ops

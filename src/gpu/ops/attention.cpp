#include "gpu/ops/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "metal/attention.h"

namespace qwenmetal::gpu::ops {

namespace {

uint64_t kv_size(const KVCache& kv) { return kv.f32 ? 4 : 2; }
const char* kv_suffix(const KVCache& kv) { return kv.f32 ? "kvf32" : "kvbf16"; }
uint32_t q_stride(const AttnShape& s) { return s.output_gate ? 2 * s.head_dim : s.head_dim; }

void check_heads(const AttnShape& s, const char* op) {
    check(s.n_heads > 0 && s.n_kv_heads > 0 && s.head_dim > 0, op, "head counts and head_dim must be positive");
    check(s.n_heads % s.n_kv_heads == 0, op,
          "n_heads (" + std::to_string(s.n_heads) + ") must be a multiple of n_kv_heads (" +
              std::to_string(s.n_kv_heads) + ")");
    // the kernels index a head's rows, and the decode scratch's partial slots, with 32-bit offsets
    check(uint64_t(s.n_heads) * 2 * s.head_dim * ATTN_LONG_MAX_PARTIALS <= UINT32_MAX, op,
          "n_heads x head_dim too large for the kernels' 32-bit offsets");
}

void check_cache(const AttnShape& s, const KVCache& kv, const char* op) {
    check(kv.capacity > 0, op, "the KV cache capacity must be positive");
    check(uint64_t(kv.capacity) * s.head_dim <= UINT32_MAX, op,
          "a KV head of " + std::to_string(kv.capacity) + " rows x " + std::to_string(s.head_dim) +
              " exceeds the kernels' 32-bit offsets within a head");
    const uint64_t bytes = uint64_t(s.n_kv_heads) * kv.capacity * s.head_dim * kv_size(kv);
    need(kv.k, bytes, op, "k cache");
    need(kv.v, bytes, op, "v cache");
}

// How the decode kernels split the heads of a GQA group and the keys of a tile (metal/attention.h).
struct Geometry {
    uint32_t group, heads_per_tg, chunks, key_split, tile_keys;
    uint32_t simdgroups() const { return heads_per_tg * key_split; }
};

Geometry geometry(const AttnShape& s, bool gqa_pack) {
    Geometry g{};
    g.group = s.n_heads / s.n_kv_heads;
    // packing: as few chunks of at most ATTN_MAX_SIMDGROUPS heads as possible, of equal size
    g.chunks = gqa_pack ? ceil_div(g.group, ATTN_MAX_SIMDGROUPS) : g.group;
    g.heads_per_tg = gqa_pack ? ceil_div(g.group, g.chunks) : 1;
    g.tile_keys = ATTN_TILE_FLOATS / s.head_dim;
    // the remaining SIMD-groups split every tile's keys (no more of them than a tile has keys)
    g.key_split = std::max(1u, std::min(ATTN_MAX_SIMDGROUPS / g.heads_per_tg, g.tile_keys));
    return g;
}

// The pass-1 layout of a route: keys per block, blocks, partial results per head.
struct Split {
    uint32_t block, n_blocks, n_partials;
};

Split split_of(const AttnPolicy& p, const std::string& route, uint32_t n_keys) {
    if (route == "single") return Split{n_keys, 1, 1};
    if (route == "split") {
        const uint32_t nb = ceil_div(n_keys, p.split_block);
        return Split{p.split_block, nb, nb};
    }
    const uint32_t nb = ceil_div(n_keys, p.long_block);
    return Split{p.long_block, nb, std::min(nb, ATTN_LONG_MAX_PARTIALS)};
}

uint64_t partial_bytes(const AttnShape& s, uint32_t n_partials) {
    return uint64_t(s.n_heads) * n_partials * (s.head_dim + 2) * 4;
}

void check_policy(const AttnPolicy& p, const char* op) {
    check(p.split_block > 0 && p.long_block > 0, op, "split_block and long_block must be positive");
}

}  // namespace

std::string AttnPolicy::route(uint32_t n_keys) const {
    if (n_keys <= single_pass_max) return "single";
    if (n_keys <= split_max) return "split";
    return "two_pass";
}

namespace {

void check_rotary(const AttnShape& s, const char* op) {
    check(s.rotary_dim % 2 == 0 && s.rotary_dim <= s.head_dim && s.rotary_dim <= 2 * ATTN_MAX_ROTARY_HALF, op,
          "rotary_dim (" + std::to_string(s.rotary_dim) + ") must be even, at most head_dim and at most " +
              std::to_string(2 * ATTN_MAX_ROTARY_HALF));
}

// RoPE runs at position + rope_offset (a state's rope_delta): never below 0
void check_rope_offset(uint32_t position, int32_t rope_offset, const char* op) {
    check(int64_t(position) + rope_offset >= 0, op, "rope_offset puts position " + std::to_string(position) +
          " below 0");
}

AttnPrepareParams prepare_params(const AttnShape& s, const KVCache& kv, uint32_t position, uint64_t stride,
                                 int32_t rope_offset = 0, bool pair_positions = false) {
    AttnPrepareParams p{};
    p.n_heads = s.n_heads;
    p.n_kv_heads = s.n_kv_heads;
    p.head_dim = s.head_dim;
    p.rotary_dim = s.rotary_dim;
    p.q_stride = q_stride(s);
    p.q_rows = s.n_heads * q_stride(s);
    p.position = position;
    p.capacity = kv.capacity;
    p.proj_stride = uint32_t(stride);
    p.eps = s.eps;
    p.rope_offset = rope_offset;
    p.pair_positions = pair_positions ? 1 : 0;
    for (uint32_t i = 0; i < s.rotary_dim / 2; ++i)   // the reference's rope_tables: float(theta^(-2i/rd))
        p.inv_freq[i] = float(std::pow(double(s.rope_theta), -2.0 * i / double(s.rotary_dim)));
    return p;
}

}  // namespace

void attn_prepare(Encoder& e, Act t, const AttnShape& s, const Buffer& proj, const Buffer& q_norm_w,
                  const Buffer& k_norm_w, uint32_t position, const KVCache& kv, const Buffer& q_out,
                  uint32_t rows, uint32_t proj_stride, int32_t rope_offset, const Buffer* pair_pos) {
    const char* op = "attn_prepare";
    check_heads(s, op);
    check_rotary(s, op);
    check_cache(s, kv, op);
    check(rows > 0, op, "rows must be positive");
    check(uint64_t(position) + rows <= kv.capacity, op,
          (rows == 1 ? "position " + std::to_string(position)
                     : "positions " + std::to_string(position) + ".." + std::to_string(uint64_t(position) + rows - 1)) +
              " outside a cache of " + std::to_string(kv.capacity) + " rows");
    const uint64_t es = act_size(t), hd = s.head_dim, kvd = uint64_t(s.n_kv_heads) * hd;
    const uint64_t q_rows = uint64_t(s.n_heads) * q_stride(s), row_len = q_rows + 2 * kvd;
    const uint64_t stride = proj_stride ? proj_stride : row_len;
    check(stride >= row_len, op,
          "proj_stride " + std::to_string(stride) + " below the stacked row of " + std::to_string(row_len));
    const uint64_t proj_bytes = ((rows - 1) * stride + row_len) * es;
    const uint64_t q_bytes = uint64_t(rows) * s.n_heads * hd * es;
    need(proj, proj_bytes, op, "proj");
    need(q_norm_w, hd * es, op, "q_norm_w");
    need(k_norm_w, hd * es, op, "k_norm_w");
    need(q_out, q_bytes, op, "q_out");
    const uint64_t pair_bytes = uint64_t(rows) * (s.rotary_dim / 2) * 4;
    if (pair_pos) need(*pair_pos, pair_bytes, op, "pair_pos");
    if (!pair_pos) check_rope_offset(position, rope_offset, op);

    const AttnPrepareParams p = prepare_params(s, kv, position, stride, rope_offset, pair_pos != nullptr);
    const std::string kernel = std::string("attn_prepare_") + act_suffix(t) + "_" + kv_suffix(kv);
    const uint32_t threads = fit_threads(e, kernel, std::min<uint32_t>(ceil_div(hd, 32) * 32, ATTN_PREPARE_MAX_THREADS));
    const uint64_t cache_bytes = kvd * kv.capacity * kv_size(kv), row_bytes = kvd * kv_size(kv) * rows;
    e.dispatch(kernel, Dims{s.n_heads + s.n_kv_heads, rows, 1}, Dims{threads, 1, 1},
               {Arg::params(p), Arg::in(proj.view(0, proj_bytes), rows * (uint64_t(s.n_heads) * hd + 2 * kvd) * es),
                Arg::in(q_norm_w.view(0, hd * es)), Arg::in(k_norm_w.view(0, hd * es)),
                Arg::out(q_out.view(0, q_bytes)), Arg::out(kv.k.view(0, cache_bytes), row_bytes),
                Arg::out(kv.v.view(0, cache_bytes), row_bytes),
                // without explicit positions the kernel never reads buffer 7: the norm weight stands in
                pair_pos ? Arg::in(pair_pos->view(0, pair_bytes)) : Arg::in(q_norm_w.view(0, hd * es), 0)});
}

uint64_t attention_scratch_bytes(const AttnShape& s, uint32_t max_keys, const AttnPolicy& p) {
    check_policy(p, "attention_scratch_bytes");
    uint64_t bytes = 0;
    // each route's partial count grows with n_keys, so its largest reachable n_keys decides
    if (max_keys > p.single_pass_max && p.split_max > p.single_pass_max)
        bytes = std::max(bytes, partial_bytes(s, split_of(p, "split", std::min(max_keys, p.split_max)).n_partials));
    if (max_keys > std::max(p.single_pass_max, p.split_max))
        bytes = std::max(bytes, partial_bytes(s, split_of(p, "two_pass", max_keys).n_partials));
    return bytes;
}

namespace {

// The token's prepare fused into the first kernel of its decode (attention_decode_prepared).
struct FusedPrepare {
    Buffer q_norm_w, k_norm_w;
    int32_t rope_offset = 0;
};

void decode_rows(Encoder& e, Act t, const AttnShape& s, const AttnPolicy& pol, const KVCache& kv0,
                 const std::vector<AttnDecodeRow>& rows, const FusedPrepare* fp) {
    const char* op = fp ? "attention_decode_prepared" : "attention_decode";
    check_heads(s, op);
    check_policy(pol, op);
    check(s.head_dim <= ATTN_MAX_HEAD_DIM, op,
          "head_dim " + std::to_string(s.head_dim) + " above the kernels' " + std::to_string(ATTN_MAX_HEAD_DIM));
    const uint64_t es = act_size(t), hd = s.head_dim, qo_bytes = uint64_t(s.n_heads) * hd * es;
    const uint64_t q_rows = uint64_t(s.n_heads) * q_stride(s);
    const Geometry g = geometry(s, pol.gqa_pack);
    const Dims threads{g.simdgroups() * 32, 1, 1};
    // Each row's combine reads only its own partials: every first kernel, then every combine, so that rows
    // share two barrier levels instead of chaining.
    struct Combine {
        AttnCombineParams c;
        Buffer sb, gate_src, o;
        uint64_t gate_read;
    };
    std::vector<Combine> combines;
    for (const AttnDecodeRow& r : rows) {
        const KVCache& kv = r.kv ? *r.kv : kv0;
        check_cache(s, kv, op);
        const uint64_t cache_bytes = uint64_t(s.n_kv_heads) * kv.capacity * hd * kv_size(kv);
        const Buffer kb = kv.k.view(0, cache_bytes), vb = kv.v.view(0, cache_bytes);
        const std::string tkv = std::string(act_suffix(t)) + "_" + kv_suffix(kv);
        check(r.n_keys > 0 && r.n_keys <= kv.capacity, op,
              "n_keys " + std::to_string(r.n_keys) + " outside 1 .. capacity " + std::to_string(kv.capacity));
        if (!fp) need(r.q, qo_bytes, op, "q");
        need(r.o, qo_bytes, op, "o");
        // the fused prepare reads the whole stacked row [q (+gate) | k | v]
        const uint64_t row_len = q_rows + (fp ? 2 * uint64_t(s.n_kv_heads) * hd : 0);
        if (s.output_gate || fp) need(r.proj, row_len * es, op, "proj");
        // without the gate the unfused kernels never read proj: any bound buffer will do
        const Buffer gate_src = s.output_gate || fp ? r.proj.view(0, row_len * es) : r.q.view(0, qo_bytes);
        const uint64_t gate_read = s.output_gate ? qo_bytes : 0;
        const std::string route = pol.route(r.n_keys);
        const Split sp = split_of(pol, route, r.n_keys);

        AttnDecodeParams p{};
        p.n_heads = s.n_heads;
        p.n_kv_heads = s.n_kv_heads;
        p.head_dim = s.head_dim;
        p.group = g.group;
        p.heads_per_tg = g.heads_per_tg;
        p.key_split = g.key_split;
        p.n_keys = r.n_keys;
        p.capacity = kv.capacity;
        p.block = sp.block;
        p.n_blocks = sp.n_blocks;
        p.n_partials = sp.n_partials;
        p.tile_keys = g.tile_keys;
        p.q_stride = q_stride(s);
        p.output_gate = s.output_gate ? 1 : 0;
        p.scale = float(1.4426950408889634 / std::sqrt(double(s.head_dim)));

        // every threadgroup (one per head chunk) reads its kv head's first n_keys rows (the fused prepare: the
        // first n_keys - 1, the last one it writes)
        const uint64_t keys_read = fp ? r.n_keys - 1 : r.n_keys;
        const uint64_t kv_read = uint64_t(s.n_kv_heads) * keys_read * hd * kv_size(kv) * g.chunks;
        const Dims grid{sp.n_partials, g.chunks, s.n_kv_heads};
        const uint64_t sbytes = route == "single" ? 0 : partial_bytes(s, sp.n_partials);
        if (route != "single") need(r.scratch, sbytes, op, ("scratch (" + route + " route)").c_str());
        const Buffer sb = route == "single" ? Buffer{} : r.scratch.view(0, sbytes);
        const std::string first = route == "single" ? "attn_decode_single_" : "attn_decode_partial_";
        if (fp) {
            const AttnPrepareParams pp = prepare_params(s, kv, r.n_keys - 1, row_len, fp->rope_offset);
            const uint64_t new_row = uint64_t(s.n_kv_heads) * hd * kv_size(kv);
            // reads: q (+ gate) of every head and the k, v rows once, the two norm weights
            const uint64_t proj_read = (uint64_t(s.n_heads) * hd + gate_read / es + 2 * uint64_t(s.n_kv_heads) * hd) * es;
            e.dispatch(first + "prep_" + tkv, grid, threads,
                       {Arg::params(p), Arg::params(pp), Arg::in(r.proj.view(0, row_len * es), proj_read),
                        Arg::in(fp->q_norm_w.view(0, hd * es)), Arg::in(fp->k_norm_w.view(0, hd * es)),
                        Arg::inout(kb, kv_read, new_row), Arg::inout(vb, kv_read, new_row),
                        route == "single" ? Arg::out(r.o.view(0, qo_bytes)) : Arg::out(sb)});
            if (route == "single") continue;
        } else if (route == "single") {
            e.dispatch("attn_decode_single_" + tkv, grid, threads,
                       {Arg::params(p), Arg::in(r.q.view(0, qo_bytes)), Arg::in(gate_src, gate_read),
                        Arg::in(kb, kv_read), Arg::in(vb, kv_read), Arg::out(r.o.view(0, qo_bytes))});
            continue;
        } else {
            e.dispatch("attn_decode_partial_" + tkv, grid, threads,
                       {Arg::params(p), Arg::in(r.q.view(0, qo_bytes)), Arg::in(kb, kv_read), Arg::in(vb, kv_read),
                        Arg::out(sb)});
        }
        AttnCombineParams c{};
        c.n_heads = s.n_heads;
        c.head_dim = s.head_dim;
        c.n_partials = sp.n_partials;
        c.q_stride = q_stride(s);
        c.output_gate = p.output_gate;
        combines.push_back({c, sb, gate_src, r.o.view(0, qo_bytes), gate_read});
    }
    const std::string combine = std::string("attn_decode_combine_") + act_suffix(t);
    const uint32_t combine_threads = combines.empty() ? 32 : fit_threads(e, combine, ceil_div(hd, 32) * 32);
    for (const Combine& m : combines)
        e.dispatch(combine, Dims{s.n_heads, 1, 1}, Dims{combine_threads, 1, 1},
                   {Arg::params(m.c), Arg::in(m.sb), Arg::in(m.gate_src, m.gate_read), Arg::out(m.o)});
}

}  // namespace

void attention_decode(Encoder& e, Act t, const AttnShape& s, const AttnPolicy& pol, const Buffer& q,
                      const Buffer& proj, const KVCache& kv, uint32_t n_keys, const Buffer& scratch,
                      const Buffer& o) {
    decode_rows(e, t, s, pol, kv, {AttnDecodeRow{q, proj, scratch, o, n_keys}}, nullptr);
}

void attention_decode_rows(Encoder& e, Act t, const AttnShape& s, const AttnPolicy& pol, const KVCache& kv0,
                           const std::vector<AttnDecodeRow>& rows) {
    decode_rows(e, t, s, pol, kv0, rows, nullptr);
}

void attention_decode_prepared(Encoder& e, Act t, const AttnShape& s, const AttnPolicy& pol, const Buffer& proj,
                               const Buffer& q_norm_w, const Buffer& k_norm_w, uint32_t position, const KVCache& kv,
                               const Buffer& scratch, const Buffer& o, int32_t rope_offset) {
    const char* op = "attention_decode_prepared";
    check_heads(s, op);
    check_rotary(s, op);
    check_cache(s, kv, op);
    check(uint64_t(position) < kv.capacity, op,
          "position " + std::to_string(position) + " outside a cache of " + std::to_string(kv.capacity) + " rows");
    const uint64_t es = act_size(t);
    need(q_norm_w, s.head_dim * es, op, "q_norm_w");
    need(k_norm_w, s.head_dim * es, op, "k_norm_w");
    check_rope_offset(position, rope_offset, op);
    const FusedPrepare fp{q_norm_w, k_norm_w, rope_offset};
    // the q buffer of an unfused row is not read: proj stands in
    decode_rows(e, t, s, pol, kv, {AttnDecodeRow{proj, proj, scratch, o, position + 1}}, &fp);
}

uint32_t attention_prefill_rows_within(const AttnShape& s, uint32_t p0, uint32_t M, double seconds,
                                       const ChipModel& chip) {
    // the flops attention_prefill declares for rows 0..q-1: 4 nh hd per (query row, visible key)
    auto seconds_of = [&](uint64_t q) {
        const double visible = double(q) * p0 + double(q) * double(q + 1) / 2;
        return 4.0 * s.n_heads * s.head_dim * visible / (chip.peak_tflops * 1e12);
    };
    if (seconds <= 0 || seconds_of(M) <= seconds) return M;   // 0: no limit
    uint32_t q = 32;
    while (q + 32 < M && seconds_of(q + 32) <= seconds) q += 32;
    return std::min(q, M);
}

uint32_t attention_prefill_instance(uint32_t head_dim) {
    for (uint32_t d : {64u, 128u, 256u})
        if (head_dim <= d) return d;
    return 0;
}

AttnPrefillGeometry attention_prefill_geometry(const AttnShape& s, uint32_t M, uint32_t max_threads, bool kv_f32) {
    const char* op = "attention_prefill";
    check_heads(s, op);
    check(s.head_dim % ATTN_MMA == 0 && attention_prefill_instance(s.head_dim) != 0, op,
          "head_dim " + std::to_string(s.head_dim) + " must be a multiple of " + std::to_string(ATTN_MMA) +
              " and at most 256 (the kernels are instantiated for head_dim up to 64, 128 and 256)");
    const uint32_t group = s.n_heads / s.n_kv_heads;
    check(group <= 32, op, "n_heads / n_kv_heads = " + std::to_string(group) + " above the kernel's 32");
    check(M > 0, op, "M (rows) must be positive");
    check(max_threads >= 32, op, "the pipeline allows " + std::to_string(max_threads) + " threads, below one SIMD-group");
    AttnPrefillGeometry g{};
    // at most ATTN_PREFILL_MAX_SIMDGROUPS SIMD-groups (8 rows of one head each) within the pipeline's limit: the
    // group's heads in as few equal chunks as fit, then as many 8-row groups as the remaining SIMD-groups allow,
    // no more rows than the chunk has
    const uint32_t sgs = std::min(ATTN_PREFILL_MAX_SIMDGROUPS, max_threads / 32);
    g.chunks = ceil_div(group, sgs);
    g.heads_per_tg = ceil_div(group, g.chunks);
    g.block_rows = std::min(ATTN_MMA * std::max(1u, sgs / g.heads_per_tg), ceil_div(M, ATTN_MMA) * ATTN_MMA);
    g.head_dim_max = attention_prefill_instance(s.head_dim);
    g.tile_keys = ATTN_PREFILL_TILE_KEYS(g.head_dim_max, kv_f32 ? 4u : 2u);
    g.threads = g.heads_per_tg * (g.block_rows / ATTN_MMA) * 32;
    g.blocks = ceil_div(M, g.block_rows);
    return g;
}

void attention_prefill(Encoder& e, Act t, const AttnShape& s, const Buffer& q, const Buffer& proj,
                       uint32_t proj_stride, const KVCache& kv, uint32_t p0, uint32_t M, const Buffer& o,
                       const AttnMask& mask) {
    const char* op = "attention_prefill";
    check_heads(s, op);
    check(mask.causal || mask.window == 0, op, "a window needs the causal mask (a sliding-window layer is causal)");
    const uint32_t dmax = attention_prefill_instance(s.head_dim);
    const std::string kernel = "attn_prefill_d" + std::to_string(dmax ? dmax : 256) + "_" + act_suffix(t) + "_" +
                               kv_suffix(kv);
    const AttnPrefillGeometry g = attention_prefill_geometry(s, M, e.device().max_threads(kernel), kv.f32);
    check_cache(s, kv, op);
    check(uint64_t(p0) + M <= kv.capacity, op,
          "keys 0.." + std::to_string(uint64_t(p0) + M - 1) + " outside a cache of " + std::to_string(kv.capacity) +
              " rows");
    const uint64_t es = act_size(t), hd = s.head_dim, kvd = uint64_t(s.n_kv_heads) * hd;
    const uint64_t q_rows = uint64_t(s.n_heads) * q_stride(s);
    const uint64_t stride = proj_stride ? proj_stride : q_rows + 2 * kvd;
    check(stride >= q_rows, op,
          "proj_stride " + std::to_string(stride) + " below the q rows of " + std::to_string(q_rows));
    const uint64_t qo_bytes = uint64_t(M) * s.n_heads * hd * es;
    need(q, qo_bytes, op, "q");
    need(o, qo_bytes, op, "o");
    const uint64_t proj_bytes = ((M - 1) * stride + q_rows) * es;
    if (s.output_gate) need(proj, proj_bytes, op, "proj");
    // without the gate the kernel never reads proj: any bound buffer will do
    const Buffer gate_src = s.output_gate ? proj.view(0, proj_bytes) : q.view(0, qo_bytes);
    const uint64_t gate_read = s.output_gate ? qo_bytes : 0;

    AttnPrefillParams p{};
    p.n_heads = s.n_heads;
    p.n_kv_heads = s.n_kv_heads;
    p.head_dim = s.head_dim;
    p.group = s.n_heads / s.n_kv_heads;
    p.block_rows = g.block_rows;
    p.heads_per_tg = g.heads_per_tg;
    p.rows = M;
    p.p0 = p0;
    p.capacity = kv.capacity;
    p.q_stride = q_stride(s);
    p.proj_stride = uint32_t(stride);
    p.output_gate = s.output_gate ? 1 : 0;
    p.scale = float(1.4426950408889634 / std::sqrt(double(s.head_dim)));
    p.causal = mask.causal ? 1 : 0;
    p.window = mask.window;

    // block b reads keys kbeg_b .. kend_b - 1 of its kv head, once per head chunk (once for all its query heads
    // when the group fits one threadgroup): kend_b = min(p0 + (b + 1) block_rows, p0 + M) causal, p0 + M
    // otherwise; kbeg_b the tile holding its first row's first key in the window (0 without one). The arithmetic
    // is that of the visible scores: QK^T and PV, 2 hd flops per (query head, key) each
    const uint64_t n_keys = uint64_t(p0) + M, W = mask.window;
    uint64_t keys_read = 0, visible = 0;
    for (uint32_t b = 0; b < g.blocks; ++b) {
        const uint64_t first = uint64_t(p0) + uint64_t(b) * g.block_rows;
        const uint64_t kend = mask.causal ? std::min<uint64_t>(first + g.block_rows, n_keys) : n_keys;
        const uint64_t lo = W && first + 1 > W ? first + 1 - W : 0;
        keys_read += kend - lo / g.tile_keys * g.tile_keys;
    }
    for (uint64_t r = 0; r < M; ++r) {
        const uint64_t pos = uint64_t(p0) + r, hi = mask.causal ? pos + 1 : n_keys;
        visible += hi - (W && pos + 1 > W ? pos + 1 - W : 0);
    }
    const uint64_t kv_read = uint64_t(s.n_kv_heads) * g.chunks * keys_read * hd * kv_size(kv);
    const uint64_t flops = 4 * uint64_t(s.n_heads) * hd * visible;
    const uint64_t cache_bytes = kvd * kv.capacity * kv_size(kv);
    e.dispatch(kernel, Dims{g.blocks, g.chunks, s.n_kv_heads},
               Dims{g.threads, 1, 1},
               {Arg::params(p), Arg::in(q.view(0, qo_bytes)), Arg::in(gate_src, gate_read),
                Arg::in(kv.k.view(0, cache_bytes), kv_read), Arg::in(kv.v.view(0, cache_bytes), kv_read),
                Arg::out(o.view(0, qo_bytes))},
               {}, flops);
}

}  // namespace qwenmetal::gpu::ops

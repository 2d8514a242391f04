// gpu.ops: attention family (metal/attention.metal, src/gpu/ops/attention.cpp).
//
// The shape (AttnShape), the cache (KVCache) and the route policy (AttnPolicy) are flat keyword
// arguments, so a test can lower the route thresholds:
//     ops.attention_decode(enc, "float32", q, proj, k, v, n_keys, scratch, o, n_heads=4, n_kv_heads=2,
//                          head_dim=32, capacity=64, kv_dtype="float32", single_pass_max=8, split_max=32)
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>

#include "bindings/gpu.h"
#include "gpu/ops/attention.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace qwenmetal::bindings {

namespace {

gpu::ops::AttnShape make_shape(uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim, uint32_t rotary_dim,
                               bool output_gate, float rope_theta, float eps) {
    return gpu::ops::AttnShape{n_heads, n_kv_heads, head_dim, rotary_dim, output_gate, rope_theta, eps};
}

gpu::ops::KVCache make_cache(const gpu::Buffer& k, const gpu::Buffer& v, uint32_t capacity, const std::string& kv_dtype) {
    return gpu::ops::KVCache{k, v, capacity, gpu::parse_act(kv_dtype) == gpu::Act::F32};
}

gpu::ops::AttnPolicy make_policy(uint32_t single_pass_max, uint32_t split_max, uint32_t split_block,
                                 uint32_t long_block, bool gqa_pack) {
    gpu::ops::AttnPolicy p;
    p.single_pass_max = single_pass_max;
    p.split_max = split_max;
    p.split_block = split_block;
    p.long_block = long_block;
    p.gqa_pack = gqa_pack;
    return p;
}

}  // namespace

void register_gpu_ops_attention(nb::module_& ops) {
    const gpu::ops::AttnPolicy d;

    ops.def("attn_prepare",
            [](gpu::Encoder& e, const std::string& t, const gpu::Buffer& proj, const gpu::Buffer& q_norm_w,
               const gpu::Buffer& k_norm_w, uint32_t position, const gpu::Buffer& k_cache, const gpu::Buffer& v_cache,
               const gpu::Buffer& q_out, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
               uint32_t rotary_dim, uint32_t capacity, bool output_gate, float rope_theta, float eps,
               const std::string& kv_dtype, uint32_t rows, uint32_t proj_stride, int32_t rope_offset,
               const std::optional<gpu::Buffer>& pair_pos) {
                gpu::ops::attn_prepare(e, gpu::parse_act(t),
                                       make_shape(n_heads, n_kv_heads, head_dim, rotary_dim, output_gate, rope_theta, eps),
                                       proj, q_norm_w, k_norm_w, position, make_cache(k_cache, v_cache, capacity, kv_dtype),
                                       q_out, rows, proj_stride, rope_offset, pair_pos ? &*pair_pos : nullptr);
            },
            "encoder"_a, "dtype"_a, "proj"_a, "q_norm_w"_a, "k_norm_w"_a, "position"_a, "k_cache"_a, "v_cache"_a,
            "q_out"_a, nb::kw_only(), "n_heads"_a, "n_kv_heads"_a, "head_dim"_a, "rotary_dim"_a, "capacity"_a,
            "output_gate"_a = true, "rope_theta"_a = 1e7f, "eps"_a = 1e-6f, "kv_dtype"_a = "bfloat16", "rows"_a = 1,
            "proj_stride"_a = 0, "rope_offset"_a = 0, "pair_pos"_a = nb::none(),
            "q/k RMSNorm + partial RoPE + K/V write of `rows` tokens at positions position.. (proj rows "
            "`proj_stride` elements apart, 0: packed), one dispatch. RoPE at position + r + rope_offset, or with "
            "pair_pos (i32 [rows, rotary_dim / 2]) frequency pair i of row r at pair_pos[r, i] (M-RoPE).");

    ops.def("attention_prefill",
            [](gpu::Encoder& e, const std::string& t, const gpu::Buffer& q, const gpu::Buffer& proj,
               const gpu::Buffer& k_cache, const gpu::Buffer& v_cache, uint32_t p0, uint32_t M, const gpu::Buffer& o,
               uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim, uint32_t capacity, bool output_gate,
               const std::string& kv_dtype, uint32_t proj_stride, bool causal, uint32_t window) {
                gpu::ops::attention_prefill(e, gpu::parse_act(t),
                                            make_shape(n_heads, n_kv_heads, head_dim, 0, output_gate, 0.0f, 0.0f), q,
                                            proj, proj_stride, make_cache(k_cache, v_cache, capacity, kv_dtype), p0, M, o,
                                            gpu::ops::AttnMask{causal, window});
            },
            "encoder"_a, "dtype"_a, "q"_a, "proj"_a, "k_cache"_a, "v_cache"_a, "p0"_a, "M"_a, "o"_a, nb::kw_only(),
            "n_heads"_a, "n_kv_heads"_a, "head_dim"_a, "capacity"_a, "output_gate"_a = true, "kv_dtype"_a = "bfloat16",
            "proj_stride"_a = 0, "causal"_a = true, "window"_a = 0,
            "flash attention of M query rows at positions p0.. over cache keys 0..p0+M-1, gated: causal (row r sees "
            "keys <= p0 + r) or not (every row every key); window > 0 (causal only): keys > p0 + r - window.");

    ops.def("attention_prefill_geometry",
            [](uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim, uint32_t M, const std::string& kv_dtype) {
                const gpu::ops::AttnPrefillGeometry g = gpu::ops::attention_prefill_geometry(
                    make_shape(n_heads, n_kv_heads, head_dim, 0, true, 0.0f, 0.0f), M, 512,
                    gpu::parse_act(kv_dtype) == gpu::Act::F32);
                return nb::make_tuple(g.block_rows, g.tile_keys, g.threads, g.blocks, g.heads_per_tg, g.chunks,
                                      g.head_dim_max);
            },
            "n_heads"_a, "n_kv_heads"_a, "head_dim"_a, "M"_a, nb::kw_only(), "kv_dtype"_a = "bfloat16",
            "attention_prefill's tiling of M rows: (block_rows, tile_keys, threads, blocks, heads_per_tg, chunks, "
            "head_dim_max).");

    ops.def("attention_decode",
            [](gpu::Encoder& e, const std::string& t, const gpu::Buffer& q, const gpu::Buffer& proj,
               const gpu::Buffer& k_cache, const gpu::Buffer& v_cache, uint32_t n_keys,
               const std::optional<gpu::Buffer>& scratch, const gpu::Buffer& o, uint32_t n_heads, uint32_t n_kv_heads,
               uint32_t head_dim, uint32_t capacity, bool output_gate, const std::string& kv_dtype,
               uint32_t single_pass_max, uint32_t split_max, uint32_t split_block, uint32_t long_block, bool gqa_pack) {
                gpu::ops::attention_decode(e, gpu::parse_act(t),
                                           make_shape(n_heads, n_kv_heads, head_dim, 0, output_gate, 0.0f, 0.0f),
                                           make_policy(single_pass_max, split_max, split_block, long_block, gqa_pack),
                                           q, proj, make_cache(k_cache, v_cache, capacity, kv_dtype), n_keys,
                                           scratch ? *scratch : gpu::Buffer{}, o);
            },
            "encoder"_a, "dtype"_a, "q"_a, "proj"_a, "k_cache"_a, "v_cache"_a, "n_keys"_a, "scratch"_a.none(), "o"_a,
            nb::kw_only(), "n_heads"_a, "n_kv_heads"_a, "head_dim"_a, "capacity"_a, "output_gate"_a = true,
            "kv_dtype"_a = "bfloat16", "single_pass_max"_a = d.single_pass_max, "split_max"_a = d.split_max,
            "split_block"_a = d.split_block, "long_block"_a = d.long_block, "gqa_pack"_a = d.gqa_pack,
            "o = softmax(q K^T / sqrt(hd)) V over keys 0..n_keys-1, times sigmoid(gate); route from the policy.");

    ops.def("attention_decode_prepared",
            [](gpu::Encoder& e, const std::string& t, const gpu::Buffer& proj, const gpu::Buffer& q_norm_w,
               const gpu::Buffer& k_norm_w, uint32_t position, const gpu::Buffer& k_cache, const gpu::Buffer& v_cache,
               const std::optional<gpu::Buffer>& scratch, const gpu::Buffer& o, uint32_t n_heads, uint32_t n_kv_heads,
               uint32_t head_dim, uint32_t rotary_dim, uint32_t capacity, bool output_gate, float rope_theta, float eps,
               const std::string& kv_dtype, uint32_t single_pass_max, uint32_t split_max, uint32_t split_block,
               uint32_t long_block, bool gqa_pack, int32_t rope_offset) {
                gpu::ops::attention_decode_prepared(
                    e, gpu::parse_act(t), make_shape(n_heads, n_kv_heads, head_dim, rotary_dim, output_gate, rope_theta, eps),
                    make_policy(single_pass_max, split_max, split_block, long_block, gqa_pack), proj, q_norm_w, k_norm_w,
                    position, make_cache(k_cache, v_cache, capacity, kv_dtype), scratch ? *scratch : gpu::Buffer{}, o,
                    rope_offset);
            },
            "encoder"_a, "dtype"_a, "proj"_a, "q_norm_w"_a, "k_norm_w"_a, "position"_a, "k_cache"_a, "v_cache"_a,
            "scratch"_a.none(), "o"_a, nb::kw_only(), "n_heads"_a, "n_kv_heads"_a, "head_dim"_a, "rotary_dim"_a,
            "capacity"_a, "output_gate"_a = true, "rope_theta"_a = 1e7f, "eps"_a = 1e-6f, "kv_dtype"_a = "bfloat16",
            "single_pass_max"_a = d.single_pass_max, "split_max"_a = d.split_max, "split_block"_a = d.split_block,
            "long_block"_a = d.long_block, "gqa_pack"_a = d.gqa_pack, "rope_offset"_a = 0,
            "attn_prepare of the token at `position` fused into attention_decode over keys 0..position: the K/V row "
            "written and o computed by the decode kernels themselves, one dispatch fewer. rope_offset: q and k rotate "
            "at position + rope_offset (the K/V row is still `position`).");

    ops.def("attention_scratch_bytes",
            [](uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim, uint32_t max_keys, uint32_t single_pass_max,
               uint32_t split_max, uint32_t split_block, uint32_t long_block, bool gqa_pack) {
                return gpu::ops::attention_scratch_bytes(
                    make_shape(n_heads, n_kv_heads, head_dim, 0, true, 0.0f, 0.0f), max_keys,
                    make_policy(single_pass_max, split_max, split_block, long_block, gqa_pack));
            },
            "n_heads"_a, "n_kv_heads"_a, "head_dim"_a, "max_keys"_a, nb::kw_only(),
            "single_pass_max"_a = d.single_pass_max, "split_max"_a = d.split_max, "split_block"_a = d.split_block,
            "long_block"_a = d.long_block, "gqa_pack"_a = d.gqa_pack,
            "f32 scratch bytes attention_decode needs for any n_keys <= max_keys under this policy.");

    ops.def("attention_route",
            [](uint32_t n_keys, uint32_t single_pass_max, uint32_t split_max, uint32_t split_block,
               uint32_t long_block, bool gqa_pack) {
                return make_policy(single_pass_max, split_max, split_block, long_block, gqa_pack).route(n_keys);
            },
            "n_keys"_a, nb::kw_only(), "single_pass_max"_a = d.single_pass_max, "split_max"_a = d.split_max,
            "split_block"_a = d.split_block, "long_block"_a = d.long_block, "gqa_pack"_a = d.gqa_pack,
            "AttnPolicy::route: 'single', 'split' or 'two_pass'.");
}

}  // namespace qwenmetal::bindings

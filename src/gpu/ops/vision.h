// Host functions of metal/vision.metal: the vision tower's own kernels (docs/vision.md, "The vision tower in the
// Metal graph"). One dispatch each.
#pragma once
#include "gpu/ops/attention.h"
#include "gpu/ops/common.h"

namespace qwenmetal::gpu::ops {

enum class VisionAct : uint32_t { None = 0, GeluTanh = 1, GeluErf = 2 };

// y[r, c] = act(y[r, c] + b[c]) in place for r < rows, c < N; y T [rows, stride] (stride 0: N); b T [N]
void vision_bias_act(Encoder& e, Act t, const Buffer& y, const Buffer& b, uint32_t rows, uint32_t N,
                     VisionAct act = VisionAct::None, uint32_t stride = 0);
// x[r] = (x[r] + b) + sum_j w[r, j] * table[idx[r, j]] for r < rows, j < 4: x T [rows, H] in place, b T [H],
// table T [table_rows, H], idx u32 [rows, 4] (each < table_rows), w f32 [rows, 4]
void vision_pos_embed(Encoder& e, Act t, const Buffer& x, const Buffer& b, const Buffer& table, uint32_t table_rows,
                      const Buffer& idx, const Buffer& w, uint32_t rows, uint32_t H);
// For each row r < rows and head h: q = rotate(qkv[r, q_h] + bias), k = rotate(qkv[r, k_h] + bias), v = qkv[r, v_h]
// + bias, rotate-half over the whole head by cos/sin f32 [rows, head_dim]; q_out T [rows, n_heads * head_dim];
// k and v to kv (T = the KV type: kv.f32 == (t == F32)) at rows 0 .. rows - 1 of each head. qkv T [rows, stride]
// (stride 0: 3 * n_heads * head_dim), each row [q | k | v] of n_heads heads; bias T [3 * n_heads * head_dim].
void vision_rope(Encoder& e, Act t, uint32_t n_heads, uint32_t head_dim, const Buffer& qkv, const Buffer& bias,
                 const Buffer& cos, const Buffer& sin, const Buffer& q_out, const KVCache& kv, uint32_t rows,
                 uint32_t stride = 0);

}  // namespace qwenmetal::gpu::ops

// vision family: parameters shared by metal/vision.metal and its host functions (src/gpu/ops/vision.cpp), the
// vision tower's own kernels (docs/vision.md, "The vision tower in the Metal graph"). No dimension of a model is a
// constant here.
#pragma once
#ifndef __METAL_VERSION__
#include <cstdint>
#endif

// the activation vision_bias_act applies after the bias
#define VISION_ACT_NONE 0u
#define VISION_ACT_GELU_TANH 1u   // gelu_pytorch_tanh: the tower blocks' MLP
#define VISION_ACT_GELU_ERF 2u    // exact GELU (torch's nn.GELU()): the patch merger

// one threadgroup per row; threads about N / 4 (vision_bias_act) or H / 4 (vision_pos_embed), a multiple of 32,
// at most VISION_MAX_THREADS; each thread walks its row in steps of the threadgroup size
#define VISION_MAX_THREADS 1024u

// vision_bias_act_*: y[r, c] = act(y[r, c] + b[c]) in place, rows of `stride` elements, columns c < N
struct VisionBiasParams {
    uint32_t N;        // columns with a bias
    uint32_t stride;   // elements per row of y (>= N)
    uint32_t act;      // VISION_ACT_*
    uint32_t pad;
};
static_assert(sizeof(VisionBiasParams) == 16, "VisionBiasParams: 4 x 4 bytes, as the host packs it");

// vision_pos_embed_*: x[r] = (x[r] + b) + sum_j w[r, j] * table[idx[r, j]] (4 taps per row: the bilinear
// resampling of the learned position table, host-computed taps)
struct VisionPosParams {
    uint32_t H;        // elements per row
    uint32_t table_rows;   // rows of the table (an index at or above it is a host bug: the host checks)
};
static_assert(sizeof(VisionPosParams) == 8, "VisionPosParams: 2 x 4 bytes, as the host packs it");

// vision_rope_*: the qkv projection's bias added, the 2-D rotary embedding applied to q and k (rotate-half over
// the whole head by host-computed cos/sin rows), q written out and k, v written to the tower's K/V buffers
// [n_heads, capacity, head_dim]; one threadgroup per (head, row)
struct VisionRopeParams {
    uint32_t n_heads;
    uint32_t head_dim;     // even
    uint32_t capacity;     // K/V rows per head
    uint32_t qkv_stride;   // elements per row of qkv (>= 3 * n_heads * head_dim)
};
static_assert(sizeof(VisionRopeParams) == 16, "VisionRopeParams: 4 x 4 bytes, as the host packs it");
#define VISION_ROPE_MAX_THREADS 256u

// attention family: parameters and thread geometry shared by metal/attention.metal and its host
// functions (src/gpu/ops/attention.cpp). No model dimension is a constant here: the limits below
// size register and threadgroup arrays (the real model, 16 q / 2 kv heads x 256, is inside them).
#pragma once
#ifndef __METAL_VERSION__
#include <cstdint>
#endif

// rotary_dim <= 2 * ATTN_MAX_ROTARY_HALF (the inv_freq table in AttnPrepareParams: 560 bytes of
// setBytes)
#define ATTN_MAX_ROTARY_HALF 128u

// attn_prepare_*: q/k RMSNorm + partial RoPE + KV-cache write of `rows` tokens at consecutive
// positions (rows = 1: decode), one threadgroup per (head, row). RoPE position of row r: position + r +
// rope_offset (the state's rope_delta: M-RoPE after an image, an MTP head's layers; 0 for text), or with
// pair_positions
// frequency pair i of row r at pair_pos[r * rotary_dim / 2 + i] (attn_prepare's buffer 7: the rows' M-RoPE
// positions per pair, qwenmetal.mrope.pair_positions); the cache row is always position + r.
struct AttnPrepareParams {
    uint32_t n_heads;      // query heads
    uint32_t n_kv_heads;   // key/value heads
    uint32_t head_dim;
    uint32_t rotary_dim;   // even, <= head_dim; the first rotary_dim dims rotate (rotate-half pairs)
    uint32_t q_stride;     // proj elements per query head: head_dim, or 2 * head_dim with the output gate
    uint32_t q_rows;       // n_heads * q_stride: where k starts in proj
    uint32_t position;     // absolute position of row 0 = the cache row written; row r: position + r
    uint32_t capacity;     // cache rows per kv head
    uint32_t proj_stride;  // proj elements per token row
    float eps;             // RMSNorm epsilon
    // RoPE position - cache row (GpuState::rope_delta): an M-RoPE delta after an image, an MTP head's layer
    // caches whose entries skip positions (docs/speculative.md "n-layer heads"); 0: at the row
    int32_t rope_offset;
    uint32_t pair_positions;  // 1: attn_prepare reads each row's per-pair RoPE positions from buffer 7
    // theta^(-2i / rotary_dim), i < rotary_dim / 2, correctly rounded to float on the host (as the
    // reference's rope_tables): the angle float(position) * inv_freq[i] then matches it bit for bit
    // at every position; a kernel-side pow is off by ulps, which at position 1e5 moves the angle by
    // more than the float32 tolerance of a test.
    float inv_freq[ATTN_MAX_ROTARY_HALF];
};
static_assert(sizeof(AttnPrepareParams) == 48 + 4 * ATTN_MAX_ROTARY_HALF,
              "AttnPrepareParams: 12 x 4 bytes + the inv_freq table, as the host packs it");

// attn_decode_single_* / attn_decode_partial_*: one threadgroup per (partial, head chunk, kv head).
struct AttnDecodeParams {
    uint32_t n_heads;
    uint32_t n_kv_heads;
    uint32_t head_dim;
    uint32_t group;        // n_heads / n_kv_heads: query heads sharing one kv head
    uint32_t heads_per_tg; // query heads of a group handled by one threadgroup (1: no GQA packing)
    uint32_t key_split;    // SIMD-groups per query head, splitting the keys of every tile
    uint32_t n_keys;       // keys 0 .. n_keys-1 are attended
    uint32_t capacity;     // cache rows per kv head
    uint32_t block;        // keys per block
    uint32_t n_blocks;     // ceil(n_keys / block)
    uint32_t n_partials;   // threadgroups along grid.x; partial p takes blocks p, p + n_partials, ...
    uint32_t tile_keys;    // keys per threadgroup-memory tile (ATTN_TILE_FLOATS / head_dim)
    uint32_t q_stride;     // proj elements per query head (gate at + head_dim)
    uint32_t output_gate;  // 1: o *= sigmoid(gate)
    float scale;           // log2(e) / sqrt(head_dim): scores in the exp2 domain
};
static_assert(sizeof(AttnDecodeParams) == 60, "AttnDecodeParams: 15 x 4 bytes, as the host packs it");

// attn_decode_combine_*: one threadgroup per query head.
struct AttnCombineParams {
    uint32_t n_heads;
    uint32_t head_dim;
    uint32_t n_partials;   // partial results per query head in scratch
    uint32_t q_stride;
    uint32_t output_gate;
};
static_assert(sizeof(AttnCombineParams) == 20, "AttnCombineParams: 5 x 4 bytes, as the host packs it");

// Per lane, a query head's q and output accumulator are ATTN_LANE_ELEMS floats (elements
// lane + 32 i): head_dim <= 32 * ATTN_LANE_ELEMS.
#define ATTN_LANE_ELEMS 8u
#define ATTN_MAX_HEAD_DIM 256u
// SIMD-groups of a decode threadgroup (heads_per_tg * key_split <= this); also the most query
// heads one threadgroup packs
#define ATTN_MAX_SIMDGROUPS 8u
// floats of each of the K and V tiles in threadgroup memory (2 x 8 KB); the per-SIMD-group
// accumulators of the final reduction reuse the K tile (ATTN_MAX_SIMDGROUPS * ATTN_MAX_HEAD_DIM)
#define ATTN_TILE_FLOATS 2048u
// the two-pass route writes at most this many partial results per query head (32: 64 threadgroups on the
// real model's 2 kv heads, about two per core of the largest GPU, and 0.5 MB of scratch)
#define ATTN_LONG_MAX_PARTIALS 32u
// attn_prepare: threads per threadgroup (one element of a head each, looping beyond)
#define ATTN_PREPARE_MAX_THREADS 256u
// running maximum before any key: finite (fast math assumes no infinities), exp2 of it is 0
#define ATTN_NEG_INIT (-1.0e30f)

// attn_prefill_d{64,128,256}_*: flash attention of a chunk (causal, or every key: AttnPrefillParams.causal), one threadgroup per (query block,
// head chunk, kv head). The instantiation's D (64, 128 or 256) is the largest head_dim it serves: the
// host picks the smallest D >= head_dim, so every register array and loop has a compile-time bound.
struct AttnPrefillParams {
    uint32_t n_heads;
    uint32_t n_kv_heads;
    uint32_t head_dim;     // a multiple of 8 (the 8x8 simdgroup matrices), <= the instantiation's D
    uint32_t group;        // n_heads / n_kv_heads: query heads of one kv head
    uint32_t block_rows;   // query rows (tokens) per threadgroup: a multiple of ATTN_MMA
    uint32_t heads_per_tg; // query heads of the group per threadgroup (head chunk tg.y of grid.y)
    uint32_t rows;         // M: query rows of the chunk
    uint32_t p0;           // position of query row 0; keys 0 .. p0 + rows - 1 exist
    uint32_t capacity;     // cache rows per kv head
    uint32_t q_stride;     // proj elements per query head (gate at + head_dim)
    uint32_t proj_stride;  // proj elements per token row
    uint32_t output_gate;  // 1: o *= sigmoid(gate)
    float scale;           // log2(e) / sqrt(head_dim): scores in the exp2 domain
    // the mask: causal 1 (a prompt chunk): row r sees keys 0 .. p0 + r; causal 0 (a DFlash draft's block): every
    // row sees every key 0 .. p0 + rows - 1. window > 0 (with causal: a sliding layer): only keys > pos - window
    uint32_t causal;
    uint32_t window;
};
static_assert(sizeof(AttnPrefillParams) == 60, "AttnPrefillParams: 15 x 4 bytes, as the host packs it");

// side of the simdgroup matrices (8x8): the query rows of one SIMD-group and the keys of one
// sub-step of a tile
#define ATTN_MMA 8u
// SIMD-groups of a prefill threadgroup (heads_per_tg * block_rows / ATTN_MMA <= this): 512 threads,
// the size the kernel declares. A group of more heads is split into equal head chunks.
#define ATTN_PREFILL_MAX_SIMDGROUPS 16u
// the threadgroup K and V tile rows are padded by 16 bytes (4 floats or 8 bfloats), so the 8 rows a
// fragment load touches start on different banks
#define ATTN_PREFILL_PAD_BYTES 16u
// bytes of each of the K and V tiles at most: 16 keys of 256 bfloats (+ pad), or 16 keys of 128 floats
#define ATTN_PREFILL_TILE_BYTES 8448u
// keys per tile of an instantiation: 16 where 16 padded rows of D elements of kv_size bytes fit
// ATTN_PREFILL_TILE_BYTES, else 8 (float cache at D = 256)
#define ATTN_PREFILL_TILE_KEYS(d, kv_size) \
    ((16u * ((d) + ATTN_PREFILL_PAD_BYTES / (kv_size)) * (kv_size) <= ATTN_PREFILL_TILE_BYTES) ? 16u : 8u)

// gdn family: parameters shared by metal/gdn.metal and its host functions (src/gpu/ops/gdn.cpp).
// uint32_t comes from <metal_stdlib> in kernels and from <cstdint> on the host (src/gpu/ops/gdn.cpp includes
// it first, through gpu/ops/gdn.h); the header itself includes nothing, as tools/msl_lint.py requires.
#pragma once

struct GdnConvParams {
    uint32_t C;        // channels (conv_dim = 2 nk dk + nv dv)
    uint32_t K;        // taps (conv_kernel); the state holds K - 1 rows
    uint32_t rows;     // tokens of the chunk (oldest first); act is [rows, C]
    uint32_t stride;   // elements between consecutive qkv rows (the stacked projection's row)
    uint32_t block;    // rows per thread (grid y: row blocks); >= K - 1, so only row block 0 reads the state
};
static_assert(sizeof(GdnConvParams) == 20, "GdnConvParams: 5 x 4 bytes, as the host packs it");

// The ring of states a chain of verification rows writes (GpuState's slabs: one buffer per GDN layer and kind,
// `slots` states `stride` floats apart): the rows read slot `in`, row r writes slot (first + r) mod slots, so
// one binding holds every row's state (Metal has 31 buffer slots; a verification has up to 16 rows). The
// host checks in is none of the rows' slots and slots x stride < 2^32 (32-bit offsets in the kernels).
struct GdnRing {
    uint32_t slots;    // states in the ring
    uint32_t in;       // the slot the first row reads
    uint32_t first;    // the slot row 0 writes
    uint32_t stride;   // floats between consecutive slots (one state: conv (K-1) C, recurrent nv dv dk)
};
static_assert(sizeof(GdnRing) == 16, "GdnRing: 4 x 4 bytes, as the host packs it");

// One struct for every recurrence kernel (gdn_step, gdn_prep, gdn_chunk, gdn_norm): each reads the fields it needs.
struct GdnParams {
    uint32_t nk, nv;       // key heads, value heads (nv a multiple of nk)
    uint32_t dk, dv;       // head dims
    uint32_t group;        // nv / nk: value head h reads key head h / group
    float q_scale;         // dk^-1/2, rounded to float by the host (as the reference's F32(dk ** -0.5))
    float l2_eps;          // added to sum(x^2) in the q/k l2norm (GDN_L2NORM_EPS)
    float eps;             // added to mean(o^2) in the gated RMSNorm (rms_norm_eps)
    uint32_t rows;         // M: tokens, in order
    uint32_t act_stride;   // elements between rows of act (q | k | v)
    uint32_t gate_stride;  // elements between rows of z, b and a (the stacked projection's row)
    uint32_t y_stride;     // elements between rows of y
    uint32_t block;        // gdn_chunk: tokens per block (1..GDN_CHUNK_MAX); the others: 0
};
static_assert(sizeof(GdnParams) == 52, "GdnParams: 13 x 4 bytes, as the host packs it");

// gdn_conv: one thread per (channel, block of rows): GDN_CONV_THREADS channels per threadgroup, grid y the
// blocks of GDN_CONV_ROWS rows (the host raises the block to K - 1 when the taps need it)
#define GDN_CONV_THREADS 256u
#define GDN_CONV_ROWS 32u
// gdn_step (the decode step and the prefill scan): one threadgroup per value head; min(dv, GDN_STEP_MAX_SIMDGROUPS)
// SIMD-groups, SIMD-group sg owns state rows sg, sg + nsg, ... (at most GDN_STEP_MAX_ROWS_PER_SG of them); lane l
// owns dk elements l, l + 32, ... of each row: DPL of them, a template parameter the host picks from dk (the
// smallest of 1, 2, 4, 8 with 32 DPL >= dk: 4 at dk = 128), so the state stays in registers
// (GDN_STEP_MAX_ROWS_PER_SG x DPL floats per thread) across the tokens; o of the head is staged in
// threadgroup memory.
#define GDN_STEP_MAX_SIMDGROUPS 32u
#define GDN_STEP_MAX_DK_PER_LANE 8u
#define GDN_STEP_MAX_ROWS_PER_SG 4u
#define GDN_STEP_MAX_DK (32u * GDN_STEP_MAX_DK_PER_LANE)
#define GDN_STEP_MAX_DV (GDN_STEP_MAX_SIMDGROUPS * GDN_STEP_MAX_ROWS_PER_SG)
#define GDN_L2NORM_EPS 1e-6f
// gdn_chunk (the prefill's chunked WY/UT route): one threadgroup per (value head, tile of
// 8 * GDN_CHUNK_SIMDGROUPS value columns); blocks of up to GDN_CHUNK_MAX tokens (padded to a multiple of 8 with
// no-op rows); the state tile [dk, 8] of each SIMD-group lives in GDN_CHUNK_MAX_DK / 8 simdgroup_float8x8
// registers indexed only by compile-time loop counters (the tiles past dk / 8 are skipped by a uniform guard).
// Threadgroup memory: the block's [C, C] matrix with rows GDN_CHUNK_LDA floats apart (GDN_CHUNK_MAX + 4: the
// 8 rows of an 8x8 tile start 4 banks apart instead of on the same bank), one [C, 8] panel per SIMD-group,
// diag(Gamma) per 8-row block, G and beta = (C LDA + 8 C * GDN_CHUNK_SIMDGROUPS + 8 C + 2 C) * 4 bytes
// = 28,160 B at C = 64 (the simulator's and Apple's limit is 32 KB; C = 72 would need 35,136 B).
#define GDN_CHUNK_SIMDGROUPS 4u
#define GDN_CHUNK_MAX 64u
#define GDN_CHUNK_LDA (GDN_CHUNK_MAX + 4u)
#define GDN_CHUNK_MAX_DK 128u

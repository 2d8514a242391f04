// moe family: parameters and limits shared by metal/moe.metal and its host functions
// (src/gpu/ops/moe.cpp). The GEMV geometry (QMV_ROWS, QMV_SIMDGROUPS) is quant's (metal/quant.h).
#pragma once
// Host side: uint32_t comes from <cstdint>, included first by src/gpu/ops/common.h (msl_lint
// admits no non-Metal #include in kernel headers, guarded or not).

// moe_topk: per row, softmax over n_experts router logits, top-k, optional renormalisation
struct MoeTopkParams {
    uint32_t n_experts;   // logits read per row: [0, n_experts)
    uint32_t k;           // experts chosen, 1 .. min(n_experts, MOE_MAX_TOPK)
    uint32_t norm;        // 1: weights renormalised to sum 1 (norm_topk_prob)
    uint32_t rows;        // M (decode: 1)
    uint32_t stride;      // floats between logit rows (>= n_experts)
};
static_assert(sizeof(MoeTopkParams) == 20, "MoeTopkParams: 5 x 4 bytes, as the host packs it");

// moe_gate_up: act[s] = silu(gate_e x) * up_e x for the k routed slots, slot k the shared expert
struct MoeGateUpParams {
    uint32_t K;                  // input features (hidden size)
    uint32_t inter;              // rows of one routed expert's gate (= up)
    uint32_t group_size;         // routed experts' quantization group (dense: unused)
    uint32_t count;              // experts in the stacks (ids are clamped to count - 1)
    uint32_t k;                  // routed slots
    uint32_t shared_inter;       // rows of the shared expert's gate (its [gate | up] matrix has twice as many); 0: none
    uint32_t shared_group_size;
    uint32_t act_stride;         // elements between act rows: max(inter, shared_inter)
    uint32_t n_experts;          // router logits (fused top-k)
    uint32_t topk;               // MOE_TOPK_FUSED | MOE_TOPK_NORM, or 0: ids read from device memory
    uint32_t bits;               // WFMT_QN: the routed experts' width; other formats: unused
    uint32_t shared_bits;        // WFMT_QN: the shared expert's width
};
static_assert(sizeof(MoeGateUpParams) == 48, "MoeGateUpParams: 12 x 4 bytes, as the host packs it");
#define MOE_TOPK_FUSED 1u
#define MOE_TOPK_NORM 2u

// moe_down: x[:H] += sum_s w_s down_{ids[s]} act[s] + sigmoid(shared logit) shared_down act[k]
struct MoeDownParams {
    uint32_t H;                  // output rows (hidden size)
    uint32_t inter;              // columns of one routed expert's down projection
    uint32_t group_size;
    uint32_t count;              // experts in the stack (ids are clamped to count - 1)
    uint32_t k;
    uint32_t shared_inter;       // columns of the shared down projection; 0: no shared expert
    uint32_t shared_group_size;
    uint32_t act_stride;
    uint32_t bits;               // WFMT_QN: the routed experts' width; other formats: unused
    uint32_t shared_bits;        // WFMT_QN: the shared expert's width
    uint32_t shared_given;       // 1: the shared down projection was computed apart (a format the routed
                                 // kernel cannot read): buffer 4 holds it, float [H]
};
static_assert(sizeof(MoeDownParams) == 44, "MoeDownParams: 11 x 4 bytes, as the host packs it");

// moe_gate_up_rows / moe_down_rows: the union-read MoE of R rows (a verification or a batched decode
// step). Row r's routing is ids [R, k] (moe_topk_rows); each expert of the rows' union is read by one
// column of threadgroups for every row that chose it, each row's arithmetic that of moe_gate_up /
// moe_down on that row alone (bit for bit). Rows live at x_stride (x) and act_row (act) elements apart;
// within a row, act is moe_gate_up's [k (+1), act_stride].
struct MoeGateUpRowsParams {
    uint32_t K;                  // input features (hidden size)
    uint32_t inter;              // rows of one routed expert's gate (= up)
    uint32_t group_size;         // routed experts' quantization group (dense: unused)
    uint32_t count;              // experts in the stacks (ids are clamped to count - 1)
    uint32_t k;                  // routed slots per row
    uint32_t shared_inter;       // rows of the shared expert's gate; 0: none (or run apart)
    uint32_t shared_group_size;
    uint32_t act_stride;         // elements between a row's act slots: max(inter, shared_inter)
    uint32_t bits;               // WFMT_QN: the routed experts' width
    uint32_t shared_bits;        // WFMT_QN: the shared expert's width
    uint32_t rows;               // R, 1 .. MOE_ROWS_MAX; rows * k <= MOE_ROWS_MAX_PAIRS
    uint32_t x_stride;           // elements between x rows (a multiple of 4)
    uint32_t act_row;            // elements between act rows (a multiple of 4)
    uint32_t n_experts;          // router logits per row (fused top-k)
    uint32_t topk;               // MOE_TOPK_FUSED | MOE_TOPK_NORM (R <= MOE_ROWS_TOPK_FUSED_MAX), or 0: ids read
    uint32_t logits_stride;      // floats between router-logit rows (fused top-k)
};
static_assert(sizeof(MoeGateUpRowsParams) == 64, "MoeGateUpRowsParams: 16 x 4 bytes, as the host packs it");

struct MoeDownRowsParams {
    uint32_t H;                  // output rows (hidden size)
    uint32_t inter;              // columns of one routed expert's down projection
    uint32_t group_size;
    uint32_t count;              // experts in the stack (ids are clamped to count - 1)
    uint32_t k;
    uint32_t shared_inter;       // columns of the shared down projection; 0: no shared expert
    uint32_t shared_group_size;
    uint32_t act_stride;         // elements between a row's act slots (a multiple of 4)
    uint32_t bits;
    uint32_t shared_bits;
    uint32_t shared_given;       // 1: the shared down projections were computed apart: buffer 4, float [R, H]
    uint32_t rows;               // R
    uint32_t act_row;            // elements between act rows (a multiple of 4)
    uint32_t x_stride;           // elements between x rows
    uint32_t logits_stride;      // floats between router-logit rows
    uint32_t n_experts;          // the shared-gate logit is column n_experts of a row
};
static_assert(sizeof(MoeDownRowsParams) == 64, "MoeDownRowsParams: 16 x 4 bytes, as the host packs it");
// rows of one union-read call, (row, slot) pairs of it (the down kernel keeps one partial per pair and
// SIMD-group in threadgroup memory), and vectors per weight load (rows_dot_sel's MB)
#define MOE_ROWS_MAX 16u
#define MOE_ROWS_MAX_PAIRS 256u
#define MOE_ROWS_MB 4u
// rows whose router top-k moe_gate_up_rows may fuse (each SIMD-group routes half of them: the work grows
// with R in every threadgroup, so larger batches route in moe_topk_rows first)
#define MOE_ROWS_TOPK_FUSED_MAX 4u

// mlp_gate_up: act = silu(gate x) * up x over one stacked [gate | up] matrix
struct MlpGateUpParams {
    uint32_t K;                  // input features
    uint32_t inter;              // gate rows (the matrix has 2 * inter)
    uint32_t group_size;
    uint32_t bits;               // WFMT_QN: the matrix's width; other formats: unused
};
static_assert(sizeof(MlpGateUpParams) == 16, "MlpGateUpParams: 4 x 4 bytes, as the host packs it");

// moe_topk: one SIMD-group per row, up to MOE_TOPK_ROWS rows per threadgroup; each lane owns experts
// lane, lane + 32, ... in registers
#define MOE_TOPK_ROWS 4u
#define MOE_MAX_EXPERTS 1024u
#define MOE_MAX_TOPK 32u

// moe_sort_count / moe_sort_scan / moe_sort_scatter: counting sort of the S = M * k (token, expert)
// pairs by expert, and the tile map of the grouped GEMM
struct MoeSortParams {
    uint32_t n_pairs;      // S = M * k, pair p = (token p / k, choice p % k)
    uint32_t k;
    uint32_t n_experts;    // E; ids >= E are taken as E - 1 (never an out-of-bounds slot)
    uint32_t block_pairs;  // pairs per token block (a multiple of k); block g = pairs [g block_pairs, ...)
    uint32_t blocks;       // token blocks, 1 .. MOE_SORT_BLOCKS
    uint32_t tile_rows;    // 16 or 32
    uint32_t capacity;     // tile-map entries (moe_tile_capacity)
};
static_assert(sizeof(MoeSortParams) == 28, "MoeSortParams: 7 x 4 bytes, as the host packs it");
// token blocks of the count and scatter passes: the scratch holds one count per (block, expert)
#define MOE_SORT_BLOCKS 32u
// count / scatter: experts per threadgroup at most (one per thread), also the ids staged per step
#define MOE_SORT_THREADS 256u
// scan: one threadgroup; thread t owns experts [t per, (t + 1) per), per = ceil(E / MOE_SCAN_THREADS)
#define MOE_SCAN_THREADS 256u

// moe_combine: x[m] += sum_j w[m, j] y[slot_of[m, j]] (+ sigmoid(logit) shared[m])
struct MoeCombineParams {
    uint32_t H;              // columns of x, y, shared
    uint32_t k;
    uint32_t n_slots;        // S: rows of y (slot ids are clamped below it)
    uint32_t logits_stride;  // floats between router-logit rows
    uint32_t n_experts;      // the shared-gate logit is column n_experts
    uint32_t shared;         // 1: add the gated shared expert
};
static_assert(sizeof(MoeCombineParams) == 24, "MoeCombineParams: 6 x 4 bytes, as the host packs it");
#define MOE_COMBINE_THREADS 256u

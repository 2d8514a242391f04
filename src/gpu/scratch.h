// The scratch of a decode step (GpuEngine::Scratch) and of the verification graph (GpuEngine::Verify), shared by
// the graphs (forward.cpp) and the MTP head's round (mtp.cpp), which runs the same layer encodings over them.
#pragma once
#include "gpu/model.h"

namespace qwenmetal::gpu {

// One buffer per logical tensor of a decode step (shapes for one token).
struct GpuEngine::Scratch {
    Buffer x;              // T [H]              residual stream
    Buffer xn;             // T [H]              normalised input of the current block
    Buffer proj;           // T [max in rows]    stacked input projection of the attention / GDN block
    Buffer conv_act;       // T [conv_dim]       GDN q | k | v after the conv and SiLU
    Buffer attn_part;      // f32                attention partial results (split-K / two-pass routes)
    Buffer mix;            // T [max(value_dim, nh * hd)]  block output before the out projection
    Buffer router;         // f32 [E + 1]        router logits (+ the shared-expert gate logit)
    Buffer topk_ids;       // u32 [k]
    Buffer topk_w;         // f32 [k]
    Buffer slot_ids;       // u32 [k]            streaming: the expert cache slots of topk_ids (host-written)
    Buffer moe_act;        // T [k + 1, max(I, Is)]  SwiGLU activations of the routed + shared experts
    Buffer moe_shared;     // f32 [H]            the shared expert's down projection, when it runs apart
                           //                    (a format the routed kernel cannot read: ops::moe_down)
    Buffer mlp_act;        // T [I]              dense-MLP SwiGLU activations
    Buffer logits;         // f32 [V]
    Buffer tokens;         // u32 [kSlots]       token ring
    Buffer sample;         // f32/u32            argmax / sampler scratch
    Buffer mask;           // u32 [ceil(V / 32)] token bitmask (host-written per masked decode; allocated on first use)
};

// One buffer per logical tensor of a verification call of R rows (R: the most rows verified so far, at
// most kMaxVerifyRows): the decode scratch's tensors with one row per token.
struct GpuEngine::Verify {
    uint32_t rows = 0;            // R
    Buffer ids;                   // u32 [R]                    the token ids (written by the host)
    Buffer x;                     // T [R, H]                   residual stream
    Buffer xn;                    // T [R, H]                   normalised rows (the router's; the head's: hidden)
    Buffer proj;                  // T [R, max in rows]         stacked in-projection rows
    Buffer conv_act;              // T [R, conv_dim]            GDN q | k | v after the conv and SiLU
    Buffer q;                     // T [R, nh * hd]             attention queries after norm + RoPE
    std::vector<Buffer> attn_part;  // f32, one per row: the rows' attention dispatches run side by side
    Buffer mix;                   // T [R, max(value_dim, nh * hd)]  block output before the out projection
    Buffer router;                // f32 [R, router rows]       router logits (+ the shared-expert gate logit)
    Buffer topk_ids;              // u32 [R, k]
    Buffer topk_w;                // f32 [R, k]
    Buffer moe_act;               // T [R, act_row]             SwiGLU activations of the routed + shared experts
    uint64_t act_row = 0;         // (k + 1) * max(I, Is): moe_act's row, as the decode scratch's
    Buffer moe_shared;            // f32 [R, H]                 the shared expert's down projection run apart
    Buffer mlp_act;               // T [R, I]                   dense-MLP SwiGLU activations
    Buffer logits;                // f32 [R, V]
};

// what an encoded call cost: the encoder's statistics and the device's counters since its reset_counters()
StepCost cost_of(const Encoder& e, const Counters& k);

}  // namespace qwenmetal::gpu

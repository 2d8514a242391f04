// The decode step's scratch (GpuEngine::Scratch), shared by the decode graph (forward.cpp) and the MTP head's
// round (mtp.cpp), which runs the same layer encoding over it.
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
};

}  // namespace qwenmetal::gpu

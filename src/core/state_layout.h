// The per-sequence state of the hybrid model, as every backend holds it (docs/model.md §5): per full
// attention layer a K and a V cache of n_kv_heads x head_dim values per token (keys after RoPE); per
// Gated DeltaNet layer the last K-1 pre-conv rows [K-1, conv_dim] and the recurrent state
// [nv, dv, dk], both float32. The CPU engine (src/cpu/engine.h State) and the GPU graph
// (src/gpu/model.h GpuState) size their buffers from it; Session.save/load use the same shapes
// (python/qwenmetal/session_io.py).
#pragma once
#include <cstdint>

#include "core/config.h"

namespace qwenmetal {

struct StateLayout {
    int64_t n_attention = 0, n_gdn = 0;   // layers of each kind
    int64_t kv_heads = 0, head_dim = 0;   // one K (or V) row of one token: kv_heads * head_dim values
    int64_t conv_floats = 0;              // (K-1) * conv_dim per GDN layer
    int64_t ssm_floats = 0;               // nv * dv * dk per GDN layer

    static StateLayout of(const Config& c) {
        StateLayout s;
        for (int64_t i = 0; i < c.n_layers; ++i) (c.layer_is_attention[size_t(i)] ? s.n_attention : s.n_gdn) += 1;
        s.kv_heads = c.n_kv_heads;
        s.head_dim = c.head_dim;
        s.conv_floats = (c.conv_kernel - 1) * c.conv_dim();
        s.ssm_floats = c.nv * c.dv * c.dk;
        return s;
    }
    // bytes of one token's K (or V) row of one layer, all KV heads
    int64_t kv_row_bytes(bool kv_f32) const { return kv_heads * head_dim * (kv_f32 ? 4 : 2); }
};

}  // namespace qwenmetal

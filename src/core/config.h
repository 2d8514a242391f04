// The model's dimensions, read from config.json once (python/qwenmetal/config.py) and handed to
// C++ as one dict (config_dict in python/qwenmetal/cpu_backend.py, parsed by
// bindings/config.h): nothing about the 35B model is a constant in code. Shared by the CPU engine
// (src/cpu/) and the GPU graph (src/gpu/).
#pragma once
#include <cstdint>
#include <vector>

namespace qwenmetal {

struct Config {
    int64_t vocab = 0, hidden = 0, n_layers = 0;
    std::vector<uint8_t> layer_is_attention, layer_is_moe;
    // full attention
    int64_t n_heads = 0, n_kv_heads = 0, head_dim = 0, rotary_dim = 0;
    bool attn_output_gate = true;
    double rope_theta = 10000.0;
    // Gated DeltaNet
    int64_t nk = 0, nv = 0, dk = 0, dv = 0, conv_kernel = 0;
    // MoE / MLP
    int64_t n_experts = 0, top_k = 0, moe_inter = 0, shared_inter = 0, dense_inter = 0;
    bool norm_topk = true;
    float eps = 1e-6f;
    bool tie_embeddings = false;

    int64_t key_dim() const { return nk * dk; }
    int64_t value_dim() const { return nv * dv; }
    int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
    int64_t q_proj_rows() const { return n_heads * head_dim * (attn_output_gate ? 2 : 1); }
    void validate() const;
};

}  // namespace qwenmetal

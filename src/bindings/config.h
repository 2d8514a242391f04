// The one crossing of the model config from Python to C++: the dict built by
// qwenmetal.cpu_backend.config_dict, parsed for both C++ backends.
#pragma once
#include <nanobind/nanobind.h>

#include "core/config.h"

namespace qwenmetal::bindings {

inline Config parse_config(const nanobind::dict& d) {
    Config c;
    auto i64 = [&](const char* k) { return nanobind::cast<int64_t>(d[k]); };
    c.vocab = i64("vocab_size");
    c.hidden = i64("hidden_size");
    c.n_layers = i64("num_hidden_layers");
    for (nanobind::handle v : nanobind::cast<nanobind::list>(d["layer_is_attention"])) c.layer_is_attention.push_back(nanobind::cast<bool>(v));
    for (nanobind::handle v : nanobind::cast<nanobind::list>(d["layer_is_moe"])) c.layer_is_moe.push_back(nanobind::cast<bool>(v));
    c.n_heads = i64("num_attention_heads");
    c.n_kv_heads = i64("num_key_value_heads");
    c.head_dim = i64("head_dim");
    c.rotary_dim = i64("rotary_dim");
    c.attn_output_gate = nanobind::cast<bool>(d["attn_output_gate"]);
    c.rope_theta = nanobind::cast<double>(d["rope_theta"]);
    c.nk = i64("linear_num_key_heads");
    c.nv = i64("linear_num_value_heads");
    c.dk = i64("linear_key_head_dim");
    c.dv = i64("linear_value_head_dim");
    c.conv_kernel = i64("linear_conv_kernel_dim");
    c.n_experts = i64("num_experts");
    c.top_k = i64("num_experts_per_tok");
    c.moe_inter = i64("moe_intermediate_size");
    c.shared_inter = i64("shared_expert_intermediate_size");
    c.dense_inter = i64("intermediate_size");
    c.norm_topk = nanobind::cast<bool>(d["norm_topk_prob"]);
    c.eps = nanobind::cast<float>(d["rms_norm_eps"]);
    c.tie_embeddings = nanobind::cast<bool>(d["tie_word_embeddings"]);
    return c;
}

}  // namespace qwenmetal::bindings

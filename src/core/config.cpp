#include "core/config.h"

#include <stdexcept>
#include <string>

namespace qwenmetal {

void Config::validate() const {
    auto need = [](bool ok, const std::string& what) {
        if (!ok) throw std::invalid_argument("model config: " + what);
    };
    need(vocab > 0 && hidden > 0 && n_layers > 0, "vocab, hidden and layers must be positive");
    need(static_cast<int64_t>(layer_is_attention.size()) == n_layers &&
             static_cast<int64_t>(layer_is_moe.size()) == n_layers, "one layer type per layer");
    need(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0, "attention heads must be a multiple of kv heads");
    need(n_heads / n_kv_heads <= 256, "at most 256 query heads per kv head");
    need(rotary_dim % 2 == 0 && rotary_dim <= head_dim && rotary_dim / 2 <= 1024, "rotary dims");
    need(nk > 0 && nv > 0 && nv % nk == 0 && dk > 0 && dv > 0 && conv_kernel > 0, "GDN dims");
    need(top_k <= 64, "at most 64 experts per token");
    need(n_experts == 0 || top_k <= n_experts, "experts per token exceeds experts");
}

}  // namespace qwenmetal

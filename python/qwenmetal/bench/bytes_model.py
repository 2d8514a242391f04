"""Bytes one decode step reads (and writes), from the checkpoint's actual tensor sizes: the figure the
effective bandwidth and ``bandwidth_ratio`` are computed from."""
from __future__ import annotations

from typing import Mapping

# bytes per stored element of the KV cache, by the engine's kv_dtype option
KV_ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# the numpy reference keeps its caches in float32
BACKEND_KV_DEFAULT = {"reference": "float32", "cpu": "bfloat16"}
STATE_ELEMENT_BYTES = 4          # GDN recurrent and conv state: float32 (mamba_ssm_dtype)

def tensor_sizes(weights) -> dict:
    """Canonical tensor name -> bytes as stored (packed weights + scales + biases for quantized ones)."""
    return {k: int(v.nbytes) for k, v in weights.tensors.items()}


def _category(name: str) -> str:
    if name == "lm_head":
        return "lm_head"
    if name == "embed_tokens":
        return "embedding"
    if ".mlp.switch_mlp." in name:
        return "routed_experts"
    if ".mlp.shared_expert." in name:
        return "shared_expert"
    if name.endswith(".mlp.gate") or name.endswith(".mlp.shared_expert_gate"):
        return "router"
    if ".linear_attn." in name:
        return "gdn"
    if ".self_attn." in name:
        return "attention"
    return "norms"


def decode_bytes(config, sizes: Mapping[str, int], context: int, kv_element_bytes: int = 2,
                 state_element_bytes: int = STATE_ELEMENT_BYTES) -> dict:
    """Bytes one decode step reads (and, for caches and state, writes) at `context` tokens already cached.

    Weights: every tensor except the routed experts (all of it), top-k/E of each layer's routed experts
    (experts of a layer are equal in size), one row of the embedding, all of lm_head. KV cache: per
    attention layer, K and V of `context` cached tokens read plus the new token's written. GDN: per linear
    layer, the recurrent state [nv, dk, dv] and the conv state [conv_dim, K-1] read and written.
    """
    c = config
    parts = {k: 0 for k in ("lm_head", "embedding", "routed_experts", "shared_expert", "router", "gdn",
                            "attention", "norms")}
    for name, n in sizes.items():
        cat = _category(name)
        if cat == "routed_experts":
            n = n * c.num_experts_per_tok // c.num_experts
        elif cat == "embedding":
            n = n // c.vocab_size
        parts[cat] += int(n)
    weights = sum(parts.values())
    held = session_bytes(c, int(context) + 1, kv_element_bytes, state_element_bytes)
    kv = held["kv_cache"]
    state = 2 * held["gdn_state"]      # read and written
    return {"total": weights + kv + state, "weights": weights, "kv_cache": kv, "gdn_state": state,
            "weight_parts": parts}


def session_bytes(config, context: int, kv_element_bytes: int = 2,
                  state_element_bytes: int = STATE_ELEMENT_BYTES) -> dict:
    """Bytes one session holds at `context` tokens: the KV cache (K and V of every attention layer) and the
    GDN state (recurrent [nv, dk, dv] and conv [conv_dim, K-1] of every linear layer)."""
    c = config
    kv_token = 2 * c.num_key_value_heads * c.head_dim * kv_element_bytes       # K and V, one layer, one token
    kv = len(c.full_attention_layers) * kv_token * int(context)
    state = len(c.linear_attention_layers) * state_element_bytes * (
        c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
        + c.conv_dim * (c.linear_conv_kernel_dim - 1))
    return {"kv_cache": kv, "gdn_state": state}

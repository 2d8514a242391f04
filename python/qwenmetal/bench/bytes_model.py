"""Bytes one decode step reads (and writes), from the checkpoint's actual tensor sizes: the figure the
effective bandwidth and ``bandwidth_ratio`` are computed from."""
from __future__ import annotations

from typing import Mapping

from ..config import KV_ELEMENT_BYTES, STATE_ELEMENT_BYTES, session_bytes

# the numpy reference keeps its caches in float32
BACKEND_KV_DEFAULT = {"reference": "float32", "cpu": "bfloat16"}
__all__ = ["KV_ELEMENT_BYTES", "STATE_ELEMENT_BYTES", "BACKEND_KV_DEFAULT", "session_bytes", "decode_bytes",
           "tensor_sizes"]

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

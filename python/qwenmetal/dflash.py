"""DFlash block-diffusion drafts: their checkpoints, and a numpy float32 reference of the draft and of its
drafting round (docs/speculative.md, "DFlash drafts").

A DFlash draft (Chen et al., "DFlash: Block Diffusion for Flash Speculative Decoding", 2026) is a small stack of
Qwen3 decoder layers that proposes a whole block of tokens in one forward pass. It owns no embedding and no
lm_head: it reads the *target's*. Its inputs each round are

* the **context features**: the target's hidden states after the layers ``target_layer_ids`` (concatenated
  along the hidden axis, ``[n, len(ids) * H]``) for the n tokens the target has accepted since the last
  round, projected by ``hidden_norm(fc(features))`` to ``[n, H]``;
* the **noise block**: the target's embedding of ``[t, mask, mask, ...]`` (``block_size`` tokens, t the last
  sampled token, ``mask_token_id`` for the rest), times ``input_embedding_scale``.

In every layer the block's queries attend, without a causal mask, to keys and values made from the context
features (``k_norm(k_proj(ctx))``, ``v_proj(ctx)`` -- the features skip ``input_layernorm``) and from the block
itself. The context keys and values of a round are appended to the draft's KV cache, so each round adds only its
new n rows; the block's own keys are not kept. RoPE positions are absolute: the context rows sit at the cache's
position ``p .. p+n-1`` and the block at ``p+n .. p+n+block-1``, where p counts the context rows already cached.
The final norm's rows 1.. go through the target's lm_head and give the drafts of the block's positions 1..
(greedy: their argmax).

This is what both published runtimes compute: ``dflash`` (``DFlashDraftModel`` with a transformers
``DynamicCache`` cropped back after each call) and ``dflash-mlx`` (``DFlashDraftModel`` with a context-only
cache). tests/test_dflash.py checks the reference against both at 1e-4.

Checkpoint layout (a ``save_pretrained`` of ``DFlashDraftModel``; an optional ``model.`` prefix is accepted)::

    config.json   model_type "qwen3", architectures ["DFlashDraftModel"] (or "DFlash2DraftModel"),
                  the Qwen3 fields, block_size, num_target_layers,
                  dflash_config {target_layer_ids, mask_token_id, (block_size)}
    fc [H, len(target_layer_ids) * H]     hidden_norm [H]     norm [H]
    layers.{i}.input_layernorm [H]   layers.{i}.post_attention_layernorm [H]
    layers.{i}.self_attn.{q_proj [nh*hd, H], k_proj/v_proj [nkv*hd, H], o_proj [H, nh*hd], q_norm/k_norm [hd]}
    layers.{i}.mlp.{gate_proj/up_proj [I, H], down_proj [H, I]}

Norm weights are plain (``y = x_normed * w``, Qwen3's ``Qwen3RMSNorm``). The matrices are bf16 in the published
files, or MLX affine-quantized (``weight`` uint32 + ``scales`` + ``biases``, a ``quantization`` block in
config.json) in an MLX copy; the norms stay float.

**DFlash2** (``DFlash2DraftModel`` in the ``dflash`` package) adds, per layer, two grouped dynamic causal
convolutions over the block (``attention_conv``/``mlp_conv``: ``base_kernel [2, K, H]``,
``kernel_projection [2*K*(H/G), H]``) and a ``candidate_selector`` (``predecessor_codebook``/
``successor_codebook [V, R]``, ``hidden_projection [R, H]``) that walks the block picking each draft among
the top-k of its logits with a low-rank bigram score. Both are loaded and run by the reference here, and by
the cpu engine (`CpuBackend.dflash_draft`).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from .backends.reference import ReferenceModel, rms_norm, rope, silu, softmax
from .config import ModelConfig, QuantizationConfig, read_config_json
from .errors import CheckpointError
from .safetensors_io import TensorSource
from .speculative import Drafter
from .weights import ConfigDim, QuantizedTensor, TensorReader, split_part, to_float32

__all__ = [
    "VARIANTS", "DFlashConfig", "DFlashDraft", "DFlashCache", "DFlashReference", "DFlashRound", "NativeDFlash",
    "drafting_block", "build_target_layer_ids", "load_dflash_draft", "check_target", "dflash_generate_greedy",
    "DFlashDrafter",
]

F32 = np.float32
#: config.json ``architectures`` entry -> variant
VARIANTS = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}
#: the ``dflash_config`` keys each variant defines (anything else is a variant this reader does not know)
_DFLASH_KEYS = frozenset({"target_layer_ids", "block_size", "mask_token_id", "num_target_layers",
                          "input_embedding_scale", "output_multiplier", "final_logit_softcapping"})
_DFLASH2_KEYS = frozenset({"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"})
_LAYER_TYPES = ("full_attention", "sliding_attention")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple:
    """The default ``target_layer_ids`` of a draft whose config.json gives none: one layer in the target's
    middle for a one-layer draft, else ``num_draft_layers`` layers spread evenly over 1 .. L-3."""
    if num_draft_layers <= 1:
        return (num_target_layers // 2,)
    span = (num_target_layers - 3) - 1
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashConfig:
    """A DFlash draft's config.json: the Qwen3 decoder fields and ``dflash_config``."""

    variant: str                    # "dflash" | "dflash2"
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool
    layer_types: tuple              # "full_attention" | "sliding_attention", one per layer
    sliding_window: int | None
    target_layer_ids: tuple         # the target layers whose outputs make the context features
    block_size: int
    mask_token_id: int
    num_target_layers: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # DFlash2
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    model_type: str = "qwen3"
    quantization: QuantizationConfig | None = None
    raw: Mapping[str, Any] = field(default=None, repr=False, compare=False)

    @property
    def feature_size(self) -> int:
        """Width of the context features the target hands over: ``len(target_layer_ids) * hidden_size``."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "DFlashConfig":
        path, data = read_config_json(path, "a DFlash draft's")
        try:
            return cls.from_dict(data)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DFlashConfig":
        if not isinstance(d, Mapping):
            raise CheckpointError("config must be a JSON object")
        dc = d.get("dflash_config")
        if not isinstance(dc, Mapping):
            raise CheckpointError("not a DFlash draft: config.json has no 'dflash_config' object")
        arch = d.get("architectures") or ["DFlashDraftModel"]
        if not isinstance(arch, list) or len(arch) != 1 or arch[0] not in VARIANTS:
            raise CheckpointError(f"unknown DFlash variant: architectures {arch!r}; this reader knows "
                                  f"{sorted(VARIANTS)}")
        variant = VARIANTS[arch[0]]
        known = _DFLASH_KEYS | (_DFLASH2_KEYS if variant == "dflash2" else frozenset())
        unknown = sorted(set(dc) - known)
        if unknown:
            raise CheckpointError(f"unknown DFlash variant: dflash_config has {unknown}, which a {arch[0]} "
                                  f"does not define (known: {sorted(known)})")
        if d.get("model_type", "qwen3") != "qwen3":
            raise CheckpointError(f"model_type {d.get('model_type')!r}: a DFlash draft here is a stack of "
                                  f"Qwen3 layers (model_type 'qwen3')")

        def get(key, default=None):      # dflash_config first, then the top level, as the dflash package reads
            return dc.get(key, d.get(key, default))

        def integer(key, default=None, minimum=1):
            v = get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise CheckpointError(f"config field {key!r} must be an integer >= {minimum}, got {v!r}")
            return v

        def number(key, default=None):
            v = get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise CheckpointError(f"config field {key!r} must be a number, got {v!r}")
            return float(v)

        for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads", "vocab_size"):
            if key not in d:
                raise CheckpointError(f"config lacks required field {key!r}")
        if "mask_token_id" not in dc and "mask_token_id" not in d:
            raise CheckpointError("config lacks 'dflash_config.mask_token_id' (the token the block is padded with)")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"hidden_act {act!r} is not supported (Qwen3 layers use 'silu')")
        if d.get("is_causal"):
            raise CheckpointError("is_causal true (causal full-attention draft layers) is not supported")
        rope_block = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or {}
        rope_type = (rope_block if isinstance(rope_block, Mapping) else {}).get("rope_type") or \
            (scaling if isinstance(scaling, Mapping) else {}).get("rope_type") or "default"
        if rope_type != "default":
            raise CheckpointError(f"RoPE scaling {rope_type!r} is not supported (only the default RoPE)")
        theta = rope_block.get("rope_theta", d.get("rope_theta", 10000.0)) if isinstance(rope_block, Mapping) \
            else d.get("rope_theta", 10000.0)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise CheckpointError(f"config field 'rope_theta' must be a positive number, got {theta!r}")

        H = integer("hidden_size")
        L = integer("num_hidden_layers")
        nh, nkv = integer("num_attention_heads"), integer("num_key_value_heads")
        if nh % nkv:
            raise CheckpointError(f"num_attention_heads {nh} is not a multiple of num_key_value_heads {nkv}")
        hd = integer("head_dim", H // nh)
        layer_types = d.get("layer_types") or ["full_attention"] * L
        if not isinstance(layer_types, list) or len(layer_types) != L or \
                any(t not in _LAYER_TYPES for t in layer_types):
            raise CheckpointError(f"config field 'layer_types' must list {L} of {_LAYER_TYPES}, got {layer_types!r}")
        window = None
        if "sliding_attention" in layer_types:
            window = integer("sliding_window")
        ntl = get("num_target_layers")
        if ntl is not None:
            ntl = integer("num_target_layers")
        ids = get("target_layer_ids")
        if ids is None:
            if ntl is None:
                raise CheckpointError("config gives neither 'dflash_config.target_layer_ids' nor 'num_target_layers'")
            ids = list(build_target_layer_ids(ntl, L))
        if not isinstance(ids, list) or not ids or \
                any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise CheckpointError(f"config field 'target_layer_ids' must be a non-empty list of layer indices, "
                                  f"got {ids!r}")
        softcap = get("final_logit_softcapping")
        softcap = number("final_logit_softcapping") if softcap is not None else None
        extra = {}
        if variant == "dflash2":
            for key in sorted(_DFLASH2_KEYS):
                extra[key] = integer(key)
            if H % extra["conv_group_size"]:
                raise CheckpointError(f"conv_group_size {extra['conv_group_size']} does not divide hidden_size {H}")
        qblock = d.get("quantization") or d.get("quantization_config")
        bias = d.get("attention_bias", False)
        if not isinstance(bias, bool):
            raise CheckpointError(f"config field 'attention_bias' must be true or false, got {bias!r}")
        return cls(
            variant=variant, hidden_size=H, num_hidden_layers=L, intermediate_size=integer("intermediate_size"),
            num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd, vocab_size=integer("vocab_size"),
            rms_norm_eps=number("rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position_embeddings=integer("max_position_embeddings", 32768), attention_bias=bias,
            layer_types=tuple(layer_types), sliding_window=window, target_layer_ids=tuple(ids),
            block_size=integer("block_size", 16), mask_token_id=integer("mask_token_id", minimum=0),
            num_target_layers=ntl, input_embedding_scale=number("input_embedding_scale", 1.0),
            output_multiplier=number("output_multiplier", 1.0), final_logit_softcapping=softcap,
            quantization=QuantizationConfig.from_dict(qblock) if qblock else None, raw=dict(d), **extra)


def check_target(config: DFlashConfig, target: ModelConfig, where: str = "the DFlash draft") -> None:
    """Raise CheckpointError unless the draft of `config` fits the target model of `target`: the same hidden
    size (the block is the target's embedding, and the features are the target's hidden states), the same
    vocabulary (its rows go through the target's lm_head), target layers and mask token that exist."""
    if config.hidden_size != target.hidden_size:
        raise CheckpointError(f"{where}: hidden_size {config.hidden_size} does not match the target's "
                              f"{target.hidden_size}: it was made for another model")
    if config.vocab_size != target.vocab_size:
        raise CheckpointError(f"{where}: vocab_size {config.vocab_size} does not match the target's "
                              f"{target.vocab_size}: it was made for another model")
    bad = [i for i in config.target_layer_ids if i >= target.num_hidden_layers]
    if bad:
        raise CheckpointError(f"{where}: target_layer_ids {list(config.target_layer_ids)} name layers {bad}, but "
                              f"the target has {target.num_hidden_layers} layers")
    if config.num_target_layers is not None and config.num_target_layers != target.num_hidden_layers:
        raise CheckpointError(f"{where}: num_target_layers {config.num_target_layers} does not match the "
                              f"target's {target.num_hidden_layers} layers: it was made for another model")
    if config.mask_token_id >= target.vocab_size:
        raise CheckpointError(f"{where}: mask_token_id {config.mask_token_id} is outside the target's "
                              f"vocabulary ({target.vocab_size})")


# ---------------------------------------------------------------------------------------------------------
# the checkpoint
# ---------------------------------------------------------------------------------------------------------
def _draft_key(key: str):
    """(stem, part) of a draft file key: an optional ``model.`` prefix removed."""
    return split_part(key[len("model."):] if key.startswith("model.") else key)


@dataclass
class DFlashDraft:
    """A loaded DFlash draft: its config and its tensors by canonical name (dense arrays viewing the mapped
    file, or `QuantizedTensor` for an MLX copy). ``float32()`` gives the dense float32 parameters the
    reference computes with."""

    config: DFlashConfig
    tensors: dict
    path: str
    source: TensorSource = field(repr=False)

    @property
    def quantized(self) -> bool:
        return any(isinstance(t, QuantizedTensor) for t in self.tensors.values())

    def float32(self) -> dict:
        return {k: np.ascontiguousarray(to_float32(t), dtype=F32) for k, t in self.tensors.items()}


def load_dflash_draft(path: str | os.PathLike, target: ModelConfig | None = None) -> DFlashDraft:
    """Load and check every tensor of the DFlash draft folder `path` (bf16/float safetensors or an MLX-quantized
    copy). With `target`, also check that the draft fits that model (`check_target`). Raises CheckpointError
    naming the file and tensor for a missing, misshapen or unexpected tensor, and for an unknown variant."""
    path = os.fspath(path)
    c = DFlashConfig.from_file(path)
    if target is not None:
        check_target(c, target, path)
    src = TensorSource(path)
    r = TensorReader(src, c, canonical=_draft_key)
    owned = sorted(s for s in r.stems if s.split(".")[0] in ("lm_head", "embed_tokens"))
    if owned:
        raise CheckpointError(f"{path}: the draft carries its own {owned}; a DFlash draft here shares the "
                              f"target's embedding and lm_head (a draft-owned one is not supported)")
    H, I = ConfigDim(c, "hidden_size"), ConfigDim(c, "intermediate_size")
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, ConfigDim(c, "head_dim")
    out: dict = {"fc": r.linear("fc", (H, len(c.target_layer_ids) * H)),
                 "hidden_norm": r.plain("hidden_norm", (H,)), "norm": r.plain("norm", (H,))}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        out[p + "input_layernorm"] = r.plain(p + "input_layernorm", (H,))
        out[p + "post_attention_layernorm"] = r.plain(p + "post_attention_layernorm", (H,))
        for name, shape in (("q_proj", (nh * hd, H)), ("k_proj", (nkv * hd, H)), ("v_proj", (nkv * hd, H)),
                            ("o_proj", (H, nh * hd))):
            out[p + "self_attn." + name] = r.linear(p + "self_attn." + name, shape)
            if c.attention_bias:
                out[p + f"self_attn.{name}.bias"] = r.plain(p + f"self_attn.{name}.bias", (shape[0],))
        out[p + "self_attn.q_norm"] = r.plain(p + "self_attn.q_norm", (hd,))
        out[p + "self_attn.k_norm"] = r.plain(p + "self_attn.k_norm", (hd,))
        for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            out[p + "mlp." + name] = r.linear(p + "mlp." + name, shape)
        if c.variant == "dflash2":
            K, groups = c.conv_kernel_size, c.hidden_size // c.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                out[f"{p}{conv}.base_kernel"] = r.plain(f"{p}{conv}.base_kernel", (2, K, H))
                out[f"{p}{conv}.kernel_projection"] = r.linear(f"{p}{conv}.kernel_projection", (2 * K * groups, H))
    if c.variant == "dflash2":
        V, R = ConfigDim(c, "vocab_size"), ConfigDim(c, "selector_rank")
        for name in ("predecessor_codebook", "successor_codebook"):
            out["candidate_selector." + name] = r.linear("candidate_selector." + name, (V, R))
        out["candidate_selector.hidden_projection"] = r.linear("candidate_selector.hidden_projection", (R, H))
    r.refuse_leftovers(f"a {c.variant} draft with this config.json (another DFlash variant?)")
    return DFlashDraft(c, out, path, src)


# ---------------------------------------------------------------------------------------------------------
# the reference forward
# ---------------------------------------------------------------------------------------------------------
class DFlashCache:
    """The draft's KV cache: per layer the post-RoPE keys and the values [nkv, T, hd] of the context rows
    seen so far, at RoPE positions 0..T-1 (``position`` = T)."""

    def __init__(self, keys: list, values: list, position: int = 0):
        self.keys, self.values, self.position = keys, values, int(position)

    def copy(self) -> "DFlashCache":
        return DFlashCache([k.copy() for k in self.keys], [v.copy() for v in self.values], self.position)


def _lin(x, w, b=None):
    y = x @ w.T
    return y + b if b is not None else y


def _grouped_causal_conv(x: np.ndarray, dynamic: np.ndarray, base: np.ndarray, group: int) -> np.ndarray:
    """DFlash2's grouped dynamic causal convolution over the block's rows: x [L, H], dynamic [L, K, H/group]
    (a per-row, per-group factor), base [K, H]: ``out[t] = sum_j (base[j] + dynamic[t, j]) * x[t - j]``."""
    L, H = x.shape
    K = base.shape[0]
    out = np.zeros_like(x)
    for j in range(K):
        shifted = np.zeros_like(x)
        shifted[j:] = x[:L - j]
        out += base[j] * shifted + np.repeat(dynamic[:, j, :], group, axis=-1) * shifted
    return out


class DFlashReference:
    """The draft's forward pass in float32 numpy, over dense float32 parameters named as `DFlashDraft` names
    them, with the target's embedding and lm_head ([V, H] each, float32)."""

    def __init__(self, config: DFlashConfig, params: dict, embed_tokens: np.ndarray, lm_head: np.ndarray):
        self.config = c = config
        self.params = {k: np.ascontiguousarray(v, dtype=F32) for k, v in params.items()}
        self.embed_tokens = np.asarray(embed_tokens, dtype=F32)
        self.lm_head = np.asarray(lm_head, dtype=F32)
        for name, a in (("embed_tokens", self.embed_tokens), ("lm_head", self.lm_head)):
            if a.shape != (c.vocab_size, c.hidden_size):
                raise CheckpointError(f"the target's {name} is {list(a.shape)}, the draft needs "
                                      f"[{c.vocab_size}, {c.hidden_size}]: it was made for another model")

    @classmethod
    def over_weights(cls, draft: DFlashDraft, weights) -> "DFlashReference":
        """The reference of `draft` over the embedding and lm_head of a target's `Weights` (any format, dequantized
        to float32: 2 x 2 GB at the real vocabulary)."""
        embed = np.ascontiguousarray(to_float32(weights.tensors["embed_tokens"]), dtype=F32)
        head = embed if weights.config.tie_word_embeddings else \
            np.ascontiguousarray(to_float32(weights.tensors["lm_head"]), dtype=F32)
        return cls(draft.config, draft.float32(), embed, head)

    @classmethod
    def from_draft(cls, draft: DFlashDraft, target: ReferenceModel) -> "DFlashReference":
        """The reference of `draft` over the target reference model's embedding and lm_head."""
        check_target(draft.config, target.config, draft.path)
        return cls(draft.config, draft.float32(), target.embed_tokens, target.lm_head)

    def new_cache(self) -> DFlashCache:
        c = self.config
        empty = [np.zeros((c.num_key_value_heads, 0, c.head_dim), dtype=F32) for _ in range(c.num_hidden_layers)]
        return DFlashCache(empty, [e.copy() for e in empty], 0)

    def project(self, features: np.ndarray) -> np.ndarray:
        """Context features [n, len(ids)*H] -> the rows the draft's layers read [n, H]."""
        c, p = self.config, self.params
        f = np.asarray(features, dtype=F32)
        if f.ndim != 2 or f.shape[1] != c.feature_size:
            raise ValueError(f"context features must be [n, {c.feature_size}], got {list(f.shape)}")
        return rms_norm(f @ p["fc"].T, p["hidden_norm"], c.rms_norm_eps)

    def embed(self, token_ids) -> np.ndarray:
        """The block's input: the target's embedding rows times ``input_embedding_scale``."""
        e = self.embed_tokens[np.asarray(token_ids)]
        s = self.config.input_embedding_scale
        return e * F32(s) if s != 1.0 else e.copy()

    def _attention(self, i: int, x: np.ndarray, ctx: np.ndarray, cache: DFlashCache) -> tuple:
        c, p = self.config, self.params
        pre = f"layers.{i}.self_attn."
        nh, nkv, hd, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        L, n, T0 = x.shape[0], ctx.shape[0], cache.position
        b = (lambda name: p.get(pre + name + ".bias"))
        q = rms_norm(_lin(x, p[pre + "q_proj"], b("q_proj")).reshape(L, nh, hd), p[pre + "q_norm"], eps)
        kv_in = np.concatenate([ctx, x], axis=0)                        # context rows first, then the block
        k = rms_norm(_lin(kv_in, p[pre + "k_proj"], b("k_proj")).reshape(n + L, nkv, hd), p[pre + "k_norm"], eps)
        v = _lin(kv_in, p[pre + "v_proj"], b("v_proj")).reshape(n + L, nkv, hd)
        pos = T0 + np.arange(n + L)
        q = rope(q, pos[n:], hd, c.rope_theta)
        k = rope(k, pos, hd, c.rope_theta)
        K = np.concatenate([cache.keys[i], k.transpose(1, 0, 2)], axis=1)   # [nkv, T0 + n + L, hd]
        V = np.concatenate([cache.values[i], v.transpose(1, 0, 2)], axis=1)
        group = nh // nkv
        qh = q.transpose(1, 0, 2).reshape(nkv, group, L, hd)
        scores = np.matmul(qh, np.swapaxes(K, -1, -2)[:, None]) * F32(hd ** -0.5)   # [nkv, group, L, T]
        if c.layer_types[i] == "sliding_attention":
            qpos, kpos = pos[n:][:, None], np.arange(K.shape[1])[None, :]
            scores = np.where((kpos <= qpos) & (qpos - kpos < c.sliding_window), scores, -np.inf)
        o = np.matmul(softmax(scores, axis=-1), V[:, None]).reshape(nh, L, hd).transpose(1, 0, 2)
        out = _lin(o.reshape(L, nh * hd), p[pre + "o_proj"], b("o_proj"))
        return out, K[:, :T0 + n], V[:, :T0 + n]

    def _conv(self, name: str, x: np.ndarray, which: int, dynamic=None):
        """DFlash2: the first (``which`` 0, returns the output and the second half's dynamic factors) or the
        second (1) half of a layer's grouped dynamic convolution."""
        c, p = self.config, self.params
        K, G = c.conv_kernel_size, c.conv_group_size
        if which == 0:
            d = (x @ p[name + ".kernel_projection"].T).reshape(x.shape[0], 2, K, c.hidden_size // G)
            return _grouped_causal_conv(x, d[:, 0], p[name + ".base_kernel"][0], G), d[:, 1]
        return _grouped_causal_conv(x, dynamic, p[name + ".base_kernel"][1], G)

    def forward(self, cache: DFlashCache, features: np.ndarray, block: np.ndarray, *, commit: bool = True,
                hidden_in: bool = False) -> np.ndarray:
        """One draft call: the context features [n, len(ids)*H] of the n tokens the target accepted since the
        last call (n may be 0), and the block (token ids [L], or with ``hidden_in`` its input rows [L, H]).
        Returns the final norm's rows [L, H]. With ``commit`` the context rows' keys and values are appended to
        `cache` (the block's never are)."""
        c, p, eps = self.config, self.params, self.config.rms_norm_eps
        x = np.asarray(block, dtype=F32) if hidden_in else self.embed(block)
        ctx = self.project(features) if len(features) else np.zeros((0, c.hidden_size), dtype=F32)
        new_k, new_v = [], []
        for i in range(c.num_hidden_layers):
            pre = f"layers.{i}."
            h = rms_norm(x, p[pre + "input_layernorm"], eps)
            if c.variant == "dflash2":
                h, dyn = self._conv(pre + "attention_conv", h, 0)
            a, K, V = self._attention(i, h, ctx, cache)
            if c.variant == "dflash2":
                a = self._conv(pre + "attention_conv", a, 1, dyn)
            x = x + a
            h = rms_norm(x, p[pre + "post_attention_layernorm"], eps)
            if c.variant == "dflash2":
                h, dyn = self._conv(pre + "mlp_conv", h, 0)
            m = (silu(h @ p[pre + "mlp.gate_proj"].T) * (h @ p[pre + "mlp.up_proj"].T)) @ p[pre + "mlp.down_proj"].T
            if c.variant == "dflash2":
                m = self._conv(pre + "mlp_conv", m, 1, dyn)
            x = x + m
            new_k.append(K)
            new_v.append(V)
        if commit:
            cache.keys, cache.values = new_k, new_v
            cache.position += ctx.shape[0]
        return rms_norm(x, p["norm"], eps)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Draft rows [L, H] -> logits [L, V] through the target's lm_head (times ``output_multiplier``, then
        the soft cap when the config has one)."""
        c = self.config
        out = hidden @ self.lm_head.T
        if c.output_multiplier != 1.0:
            out = out * F32(c.output_multiplier)
        if c.final_logit_softcapping:
            cap = F32(c.final_logit_softcapping)
            out = np.tanh(out / cap) * cap
        return out

    def select(self, hidden: np.ndarray, logits: np.ndarray, first: int) -> np.ndarray:
        """DFlash2's greedy candidate walk: at each position, among the top ``selector_top_k`` logits, the
        candidate with the highest ``logit + <pred[prev] * proj(h), succ[cand]>``, prev the token chosen
        before it (``first`` for the block's first draft)."""
        c, p = self.config, self.params
        kk = c.selector_top_k
        cand = np.argpartition(-logits, kk - 1, axis=-1)[:, :kk]
        unary = np.take_along_axis(logits, cand, axis=-1)
        proj = hidden @ p["candidate_selector.hidden_projection"].T
        pred, succ = p["candidate_selector.predecessor_codebook"], p["candidate_selector.successor_codebook"]
        prev, path = int(first), []
        for t in range(hidden.shape[0]):
            scores = unary[t] + succ[cand[t]] @ (pred[prev] * proj[t])
            prev = int(cand[t][int(np.argmax(scores))])
            path.append(prev)
        return np.asarray(path, dtype=np.int64)

    def propose(self, cache: DFlashCache, features: np.ndarray, first_token: int, block_len: int | None = None):
        """One drafting round, greedy: the block ``[first_token, mask * (block_len - 1)]`` with the new context
        features -> (drafts [block_len - 1], their logits [block_len - 1, V]). Commits the features to
        `cache`."""
        c = self.config
        block = drafting_block(c, first_token, block_len)
        hidden = self.forward(cache, features, block)[1:]
        logits = self.logits(hidden)
        if c.variant == "dflash2":
            return self.select(hidden, logits, first_token), logits
        return np.argmax(logits, axis=-1), logits


def drafting_block(config: DFlashConfig, first_token: int, block_len: int | None = None) -> np.ndarray:
    """The token ids of a drafting round's block: ``[first_token, mask * (block_len - 1)]`` (block_len defaults
    to the config's ``block_size``; at least 2)."""
    B = config.block_size if block_len is None else int(block_len)
    if B < 2:
        raise ValueError(f"a drafting block needs at least 2 tokens, got {B}")
    return np.array([int(first_token)] + [config.mask_token_id] * (B - 1), dtype=np.int64)


class NativeDFlash:
    """A backend's native DFlash forward (`ModelBase.dflash_draft`: `CpuBackend.dflash_draft`,
    `_GpuBackend.dflash_draft`; ``new_cache()`` and ``forward(cache, features, block, commit) -> logits of rows
    1..``; for a DFlash2 draft also ``propose(cache, features, block, commit) -> (drafts, logits)``, the drafts
    its candidate selector's, which needs the draft's hidden rows the backend keeps) behind the reference's
    drafting interface (`new_cache`, `propose`), so a `DFlashRound` runs either."""

    def __init__(self, config: DFlashConfig, impl):
        self.config = config
        self.impl = impl

    def new_cache(self):
        return self.impl.new_cache()

    def propose(self, cache, features: np.ndarray, first_token: int, block_len: int | None = None):
        """`DFlashReference.propose` on the backend: (greedy drafts [block_len - 1], their logits)."""
        block = drafting_block(self.config, first_token, block_len)
        if self.config.variant == "dflash2":
            return self.impl.propose(cache, features, block)
        logits = self.impl.forward(cache, features, block)
        return np.argmax(logits, axis=-1), logits


class DFlashRound:
    """The drafting side of DFlash decoding for one sequence: the draft's cache and the target's context
    features not yet handed to it. `observe` takes the features of the tokens the target accepted (in order),
    `propose` drafts a block after a token and hands the pending features over."""

    def __init__(self, draft: "DFlashReference | NativeDFlash"):
        self.draft = draft
        self.cache = draft.new_cache()
        self.pending = np.zeros((0, draft.config.feature_size), dtype=F32)

    @property
    def position(self) -> int:
        """Tokens whose features the draft has (cached or pending)."""
        return self.cache.position + self.pending.shape[0]

    def observe(self, features: np.ndarray) -> None:
        self.pending = np.concatenate([self.pending, np.asarray(features, dtype=F32)], axis=0)

    def propose(self, first_token: int, block_len: int | None = None):
        drafts, logits = self.draft.propose(self.cache, self.pending, first_token, block_len)
        self.pending = self.pending[:0]
        return drafts, logits


def dflash_generate_greedy(target: ReferenceModel, draft: DFlashReference, prompt: Sequence[int],
                           max_new_tokens: int, stop_token_ids: Sequence[int] | None = None,
                           block_size: int | None = None) -> dict:
    """Greedy speculative decoding with a DFlash draft on the numpy reference, round for round what the
    ``dflash`` package's ``dflash_generate`` does: the prompt's prefill captures the features, each round drafts
    ``min(block_size, room)`` - 1 tokens after the last token, the target verifies the block in one call, the
    longest agreeing prefix and the target's next token are kept, and the kept tokens' features go to the
    draft. The target state is rewound by recomputing the kept tokens from a copy (a reference, not an engine).
    Returns ``{"tokens": prompt + output, "acceptance_lengths": per round, "drafts": per round}``."""
    c = draft.config
    check_target(c, target.config)
    B = c.block_size if block_size is None else int(block_size)
    ids = [int(t) for t in prompt]
    N = len(ids)
    max_length = N + int(max_new_tokens)
    stops = set(int(t) for t in stop_token_ids) if stop_token_ids else set()
    layers = c.target_layer_ids
    state = target.new_state()
    feats: list = []
    logits = target.forward(state, np.asarray(ids), logits="last", feature_layers=layers, features=feats)
    out = ids + [int(np.argmax(logits))]
    rnd = DFlashRound(draft)
    if B > 1:
        rnd.observe(feats[0])
    start, accepted, drafted = N, [], []
    stopped = out[start] in stops
    while start + 1 < max_length and not stopped:
        size = min(B, max_length - start)
        block = [out[start]]
        if size > 1:
            d, _ = rnd.propose(out[start], size)
            block += [int(t) for t in d]
            drafted.append(block[1:])
        before = state.copy()
        feats = []
        rows = target.forward(state, np.asarray(block), logits="all", feature_layers=layers if size > 1 else (),
                              features=feats)
        post = np.argmax(rows, axis=-1)
        acc = 0
        while acc < size - 1 and block[acc + 1] == post[acc]:
            acc += 1
        del out[start + 1:]
        out += block[1:acc + 1] + [int(post[acc])]
        produced = min(acc + 1, max_length - start - 1)
        hit = [j for j in range(produced) if out[start + 1 + j] in stops]
        if hit:
            produced, stopped = hit[0] + 1, True
        start += produced
        accepted.append(produced)
        state = before
        target.forward(state, np.asarray(block[:produced]), logits="none")
        if size > 1:
            rnd.observe(feats[0][:produced])
    return {"tokens": out[:min(start + 1, max_length)], "acceptance_lengths": accepted, "drafts": drafted}


# ---- the drafter: speculative="dflash:DIR" ------------------------------------------------------------------------
class DFlashDrafter(Drafter):
    """A DFlash draft as a speculative drafter (``speculative="dflash:DIR"``, ``--speculative dflash:DIR``).

    Each round it drafts a block after the last sampled token t: ``[t, mask, ...]`` of ``k + 1`` tokens (k at most
    ``block_size - 1``) over the context features it was given, and returns the block's k drafts. The model
    verifies t and the drafts in one call that also returns the outputs of the draft's ``target_layer_ids``
    (`qwenmetal.speculative.Speculation`), and the kept rows' features go to the draft's cache
    (`observe_features`) for the next round, as in the ``dflash`` package's loop. The prompt's features come from
    its prefill in the same pass. Greedy drafts (and DFlash2's candidate walk) are point proposals; with a
    sampling temperature a DFlash draft draws its tokens from ``softmax(logits / temperature)`` and hands those
    distributions to the verification (the rejection rule for a drafted distribution: exact either way).

    The draft runs natively where the model's backend has a DFlash forward for its variant
    (`ModelBase.dflash_draft`: the cpu engine for DFlash and DFlash2, the Metal graph of ``metal`` /
    ``metal-sim`` for DFlash, over the target's own embedding and lm_head in place; ``native`` is then set),
    else in this module's numpy reference (`DFlashReference`) over the target's embedding and lm_head
    dequantized to float32 once per loaded model; the target runs on its backend, which must return layer
    features (`ModelBase.returns_features`). A session's tokens from before this generation (an earlier turn, a
    restored prefix) give the draft no features: it drafts from what this generation fed.
    """

    name = "dflash"

    def __init__(self, draft: DFlashDraft, seed: int = 0):
        self.checkpoint = draft
        self.feature_layers = tuple(int(i) for i in draft.config.target_layer_ids)
        self.seed = int(seed)
        self.reference: DFlashReference | None = None
        self._target = None                   # the weights the reference's embedding and lm_head come from
        self.native: NativeDFlash | None = None
        self._native_model = None             # the model whose backend runs `native`
        self.round: DFlashRound | None = None

    @classmethod
    def for_model(cls, model, path: str | os.PathLike, **options) -> "DFlashDrafter":
        """The drafter of the draft at `path` (a folder with config.json and safetensors) for `model`;
        CheckpointError if it was made for another model."""
        draft = load_dflash_draft(path, model.config)
        return cls(draft, **options)

    @property
    def block_size(self) -> int:
        return self.checkpoint.config.block_size

    def start(self, model) -> None:
        c = self.checkpoint.config
        check_target(c, model.config, self.checkpoint.path)
        if self._native_model is not model:
            impl = model.dflash_draft(self.checkpoint)
            self.native = NativeDFlash(c, impl) if impl is not None else None
            self._native_model = model
        if self.native is not None:
            self.round = DFlashRound(self.native)
        else:
            w = model.weights
            if self.reference is None or self._target is not w:
                self.reference = DFlashReference.over_weights(self.checkpoint, w)
                self._target = w
            self.round = DFlashRound(self.reference)
        self.rng = np.random.default_rng(self.seed)

    def observe_features(self, position: int, features: np.ndarray) -> None:
        self.round.observe(features)

    def propose(self, context: Sequence[int], k: int, temperature: float = 0.0) -> tuple[list, list | None]:
        n = min(int(k), self.block_size - 1)
        if n < 1 or not len(context):
            return [], None
        drafts, logits = self.round.propose(int(context[-1]), n + 1)
        if temperature == 0.0 or self.checkpoint.config.variant == "dflash2":
            return [int(d) for d in drafts], None
        q = softmax(np.asarray(logits, dtype=np.float64) / float(temperature), axis=-1)
        q = q / q.sum(axis=-1, keepdims=True)
        out = [int(self.rng.choice(q.shape[1], p=row)) for row in q]
        return out, list(q)

    def draft(self, context: Sequence[int], k: int) -> list:
        return self.propose(context, k)[0]

    def close(self) -> None:
        self.round = None

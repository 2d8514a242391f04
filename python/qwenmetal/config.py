"""Model configuration: parse a checkpoint's config.json into one `ModelConfig`.

Supported `model_type`s:

* ``qwen3_5_moe``       — Qwen3.5/3.6-MoE (multimodal wrapper); the text part is in ``text_config``.
* ``qwen3_5_moe_text``  — the text model alone (what ``Qwen3_5MoeForCausalLM`` saves).
* ``qwen3_next``        — Qwen3-Next (fused GDN input projections, optional dense-MLP layers).

A ``qwen3_5_moe`` config.json's ``vision_config`` (the image tower, docs/vision.md) is parsed into
`VisionConfig` (``ModelConfig.vision``; None when the file has none) with the image / video token ids.

Every dimension comes from the file; nothing about the 35B model is a constant here.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from html import escape
from typing import Any, Mapping

from .errors import CheckpointError
from .fileio import parse_json
from .quant import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
LINEAR, FULL = "linear_attention", "full_attention"
MAX_LAYERS = 1 << 16          # a sanity bound (real models have < 200), so a bad count cannot hang the parser
MAX_CONFIG_BYTES = 16 << 20


def read_config_json(path: str | os.PathLike, expected: str = "") -> tuple[str, Any]:
    """(the file's path, its parsed JSON) of a config.json, or of the one in the folder `path`; CheckpointError
    for a missing, unreadable, oversized (MAX_CONFIG_BYTES) or malformed file (`expected` says whose config a
    missing file should have been)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json" + (f" (expected {expected})" if expected else "")) from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes; not a config.json")
    return path, parse_json(data, path, CheckpointError)


def _positive_int(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise CheckpointError(f"{what} must be a positive integer, got {v!r}")
    return v


@dataclass(frozen=True)
class QuantSpec:
    """Bits and group size of one affine-quantized tensor."""

    bits: int
    group_size: int
    mode: str = "affine"


@dataclass(frozen=True)
class QuantizationConfig:
    """The ``quantization`` (or ``quantization_config``) block of an MLX config.json.

    ``default`` applies to every quantized tensor without a per-path override; ``overrides``
    maps module paths as written in the file (e.g. ``language_model.model.layers.0.mlp.gate``)
    to their own spec.
    """

    default: QuantSpec
    overrides: Mapping[str, QuantSpec] = field(default_factory=dict)

    def spec_for(self, path: str) -> QuantSpec:
        return self.overrides.get(path, self.default)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QuantizationConfig":
        if not isinstance(d, Mapping):
            raise CheckpointError(f"quantization block must be an object, got {d!r}")
        mode = d.get("mode", "affine")
        if mode != "affine":
            raise CheckpointError(f"quantization mode {mode!r} is not supported (only 'affine')")
        for key in ("bits", "group_size"):
            if key not in d:
                raise CheckpointError(f"quantization block lacks {key!r}")
        default = _spec(d["bits"], d["group_size"], "quantization field", mode)
        overrides = {}
        for k, v in d.items():
            if isinstance(v, Mapping):
                if v.get("mode", mode) != "affine":
                    raise CheckpointError(f"quantization mode {v.get('mode')!r} for {k!r} is not supported")
                overrides[k] = _spec(v.get("bits", default.bits), v.get("group_size", default.group_size),
                                     f"quantization {k!r}", mode)
        return cls(default, overrides)


def _spec(bits, group_size, what: str, mode: str) -> QuantSpec:
    """A QuantSpec of MLX's affine widths and group sizes (`what` names the entry in errors)."""
    bits = _positive_int(bits, f"{what} 'bits'")
    group_size = _positive_int(group_size, f"{what} 'group_size'")
    if bits not in SUPPORTED_BITS:
        raise CheckpointError(f"{what} 'bits' is {bits}: MLX affine quantization has bits {SUPPORTED_BITS}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise CheckpointError(f"{what} 'group_size' is {group_size}: supported group sizes are "
                              f"{SUPPORTED_GROUP_SIZES}")
    return QuantSpec(bits, group_size, mode)


VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")      # the block MLP's; the merger's GELU is always exact
VISION_TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


@dataclass(frozen=True)
class VisionConfig:
    """The ``vision_config`` block of a ``qwen3_5_moe`` config.json: the ViT that turns an image's patches into
    LM-width rows (transformers' ``Qwen3_5MoeVisionConfig``). Every dimension is required (the released
    configs list them all); ``in_channels`` defaults to 3 (RGB), ``hidden_act`` to ``gelu_pytorch_tanh`` and the
    rotary base to 10000, as transformers does."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str
    in_channels: int
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one row of ``pixel_values``: C * T * P * P (channel-major, as the processor flattens)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        """Patches per merged token (spatial_merge_size squared)."""
        return self.spatial_merge_size * self.spatial_merge_size

    @property
    def merged_dim(self) -> int:
        """Width of the merger's input: hidden_size x merge_unit."""
        return self.hidden_size * self.merge_unit

    @property
    def grid_side(self) -> int:
        """Side of the learned square position-embedding grid (sqrt of num_position_embeddings)."""
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "VisionConfig":
        if not isinstance(d, Mapping):
            raise CheckpointError(f"config field 'vision_config' must be an object, got {d!r:.200}")

        def get(key):
            if key not in d:
                raise CheckpointError(f"vision_config lacks required field {key!r}")
            return d[key]

        ints = {k: _positive_int(get(k), f"vision_config field {k!r}") for k in (
            "depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "spatial_merge_size",
            "temporal_patch_size", "out_hidden_size", "num_position_embeddings")}
        ints["in_channels"] = _positive_int(d.get("in_channels", 3), "vision_config field 'in_channels'")
        if ints["depth"] > MAX_LAYERS:
            raise CheckpointError(f"vision_config field 'depth' is {ints['depth']}, more than {MAX_LAYERS}")
        act = d.get("hidden_act", VISION_ACTIVATIONS[0])
        if act not in VISION_ACTIVATIONS:
            raise CheckpointError(f"vision_config field 'hidden_act' is {act!r}; supported: {VISION_ACTIVATIONS}")
        rope = d.get("rope_parameters") or {}
        if not isinstance(rope, Mapping):
            raise CheckpointError(f"vision_config field 'rope_parameters' must be an object, got {rope!r:.200}")
        if rope.get("rope_type", "axial") != "axial":
            raise CheckpointError(f"vision_config rope_type {rope.get('rope_type')!r} is not supported (only "
                                  f"'axial', the 2-D rotary embedding)")
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            raise CheckpointError(f"vision_config rope_theta must be a positive number, got {theta!r}")
        deepstack = d.get("deepstack_visual_indexes") or []
        if deepstack:
            raise CheckpointError(f"vision_config field 'deepstack_visual_indexes' is {deepstack!r}: deepstack "
                                  f"mergers (Qwen3-VL) are not supported; Qwen3.5/3.6 have none")
        vc = cls(hidden_act=act, rope_theta=float(theta), **ints)
        if vc.hidden_size % vc.num_heads:
            raise CheckpointError(f"vision_config hidden_size ({vc.hidden_size}) must be a multiple of "
                                  f"num_heads ({vc.num_heads})")
        if vc.head_dim % 4:
            raise CheckpointError(f"vision_config head dim {vc.head_dim} (hidden_size / num_heads) must be a "
                                  f"multiple of 4 (the 2-D rotary embedding gives each axis half of it, in pairs)")
        if vc.grid_side * vc.grid_side != vc.num_position_embeddings:
            raise CheckpointError(f"vision_config field 'num_position_embeddings' is {vc.num_position_embeddings}; "
                                  f"it must be a square (the learned position grid is side x side)")
        return vc


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions and options of one hybrid GDN/attention MoE model."""

    model_type: str                 # the file's top-level model_type
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple              # "linear_attention" | "full_attention", one per layer
    # full (gated) attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attn_output_gate: bool
    rope_theta: float
    partial_rotary_factor: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MoE / MLP
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    intermediate_size: int          # dense-MLP layers (qwen3_next mlp_only_layers); 0 if none
    mlp_only_layers: tuple
    decoder_sparse_step: int
    # misc
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple
    quantization: QuantizationConfig | None = None
    vision: VisionConfig | None = None         # the image tower (qwen3_5_moe's vision_config), if any
    image_token_id: int | None = None          # <|image_pad|>: one per merged image token in the prompt
    video_token_id: int | None = None
    vision_start_token_id: int | None = None   # <|vision_start|> / <|vision_end|> around an image's pads
    vision_end_token_id: int | None = None
    raw: Mapping[str, Any] = field(default=None, repr=False, compare=False)

    # ---- derived -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def is_full_attention(self, i: int) -> bool:
        return self.layer_types[i] == FULL

    def is_moe_layer(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def full_attention_layers(self) -> tuple:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_attention_layers(self) -> tuple:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def is_multimodal_wrapper(self) -> bool:
        return self.model_type == "qwen3_5_moe"

    def __repr__(self) -> str:  # readable in a notebook
        nl = self.num_hidden_layers
        nf = len(self.full_attention_layers)
        q = "dense"
        if self.quantization is not None:
            q = f"affine {self.quantization.default.bits}-bit g{self.quantization.default.group_size}"
            if self.quantization.overrides:
                q += f" (+{len(self.quantization.overrides)} per-path overrides)"
        return (
            f"ModelConfig({self.model_type}: {nl} layers [{nl - nf} GDN + {nf} attention], "
            f"hidden {self.hidden_size}, vocab {self.vocab_size}, "
            f"attention {self.num_attention_heads}q/{self.num_key_value_heads}kv x {self.head_dim} "
            f"(rotary {self.rotary_dim}, theta {self.rope_theta:g}), "
            f"GDN {self.linear_num_key_heads}k/{self.linear_num_value_heads}v x "
            f"{self.linear_key_head_dim}/{self.linear_value_head_dim} conv {self.linear_conv_kernel_dim}, "
            f"MoE {self.num_experts} experts top-{self.num_experts_per_tok} x {self.moe_intermediate_size} "
            f"+ shared {self.shared_expert_intermediate_size}, weights {q})"
        )

    def _repr_html_(self) -> str:  # Jupyter: the same facts as a table
        nl, nf = self.num_hidden_layers, len(self.full_attention_layers)
        q = "dense" if self.quantization is None else \
            f"affine {self.quantization.default.bits}-bit g{self.quantization.default.group_size}"
        rows = [
            ("model_type", self.model_type), ("layers", f"{nl} ({nl - nf} Gated DeltaNet + {nf} attention)"),
            ("hidden", self.hidden_size), ("vocab", self.vocab_size),
            ("attention", f"{self.num_attention_heads} q / {self.num_key_value_heads} kv heads x {self.head_dim}, "
                          f"rotary {self.rotary_dim}, theta {self.rope_theta:g}"),
            ("Gated DeltaNet", f"{self.linear_num_key_heads} k / {self.linear_num_value_heads} v heads x "
                               f"{self.linear_key_head_dim}/{self.linear_value_head_dim}, conv {self.linear_conv_kernel_dim}"),
            ("MoE", f"{self.num_experts} experts, top-{self.num_experts_per_tok} x {self.moe_intermediate_size} "
                    f"+ shared {self.shared_expert_intermediate_size}"),
            ("context", self.max_position_embeddings), ("weights", q)]
        body = "".join(f"<tr><td>{escape(str(k))}</td><td>{escape(str(v))}</td></tr>" for k, v in rows)
        return f"<b>qwenmetal.ModelConfig</b><table>{body}</table>"

    # ---- parsing -------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelConfig":
        path, d = read_config_json(path)
        try:
            return cls.from_dict(d)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        if not isinstance(d, Mapping):
            raise CheckpointError("config must be a JSON object")
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        if model_type == "qwen3_5_moe":
            t = d.get("text_config")
            if not isinstance(t, Mapping) or not t:
                raise CheckpointError("model_type 'qwen3_5_moe' needs a 'text_config' block (an object)")
            t = dict(t)
        else:
            t = dict(d)

        def req(key):
            if key not in t:
                raise CheckpointError(f"config lacks required field {key!r}")
            return t[key]

        def integer(key, default=None):
            v = t.get(key, default) if default is not None else req(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise CheckpointError(f"config field {key!r} must be a non-negative integer, got {v!r}")
            return v

        def number(key, value):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise CheckpointError(f"config field {key!r} must be a number, got {value!r}")
            return float(value)

        def flag(key, v):
            if not isinstance(v, bool):
                raise CheckpointError(f"config field {key!r} must be true or false, got {v!r}")
            return v

        def int_list(key):
            v = t.get(key) or []
            if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise CheckpointError(f"config field {key!r} must be a list of integers, got {v!r}")
            return tuple(v)

        n_layers = integer("num_hidden_layers")
        if n_layers > MAX_LAYERS:
            raise CheckpointError(f"config field 'num_hidden_layers' is {n_layers}, more than {MAX_LAYERS}")
        layer_types = t.get("layer_types")
        if layer_types is None:
            interval = integer("full_attention_interval", 4)
            if interval == 0:
                raise CheckpointError("full_attention_interval must be positive")
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
        if (not isinstance(layer_types, list) or len(layer_types) != n_layers
                or any(x not in (LINEAR, FULL) for x in layer_types)):
            raise CheckpointError(
                f"layer_types must list {n_layers} entries of {LINEAR!r}/{FULL!r}, got {layer_types!r:.200}")
        layer_types = tuple(layer_types)

        rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
        if not isinstance(rope, Mapping):
            raise CheckpointError(f"config field 'rope_parameters' must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise CheckpointError(f"rope_type {rope_type!r} is not supported (only 'default')")
        rope_theta = number("rope_theta", rope.get("rope_theta", t.get("rope_theta", 10000.0)))
        prf = number("partial_rotary_factor", rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 1.0)))
        if not 0 < prf <= 1:
            raise CheckpointError(f"config field 'partial_rotary_factor' must be in (0, 1], got {prf}")

        hd = integer("head_dim") if t.get("head_dim") is not None else \
            integer("hidden_size") // max(integer("num_attention_heads"), 1)
        # eos: text_config's, the top level's, both.
        eos = []
        for src in (t, d):
            v = src.get("eos_token_id")
            for x in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(x, int) and x not in eos:
                    eos.append(x)

        qblock = d.get("quantization") or d.get("quantization_config")
        if qblock is not None and not isinstance(qblock, Mapping):
            raise CheckpointError(f"config field 'quantization' must be an object, got {qblock!r}")
        if qblock is not None and model_type != "qwen3_5_moe" and "quantization" not in d:
            # HF-style quantization_config of another method (e.g. bitsandbytes) is not ours
            if "bits" not in qblock:
                raise CheckpointError(f"unsupported quantization_config {dict(qblock)!r}")
        quant = QuantizationConfig.from_dict(qblock) if qblock is not None else None

        vision, tokens = None, {}
        if model_type == "qwen3_5_moe":
            if d.get("vision_config"):
                vision = VisionConfig.from_dict(d["vision_config"])
            for key in VISION_TOKEN_FIELDS:
                v = d.get(key)
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                    raise CheckpointError(f"config field {key!r} must be a non-negative integer, got {v!r}")
                tokens[key] = v

        is_next = model_type == "qwen3_next"
        cfg = cls(
            model_type=model_type,
            vocab_size=integer("vocab_size"),
            hidden_size=integer("hidden_size"),
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            num_attention_heads=integer("num_attention_heads"),
            num_key_value_heads=integer("num_key_value_heads"),
            head_dim=int(hd),
            attn_output_gate=flag("attn_output_gate", t.get("attn_output_gate", True)),
            rope_theta=rope_theta,
            partial_rotary_factor=prf,
            linear_num_key_heads=integer("linear_num_key_heads"),
            linear_num_value_heads=integer("linear_num_value_heads"),
            linear_key_head_dim=integer("linear_key_head_dim"),
            linear_value_head_dim=integer("linear_value_head_dim"),
            linear_conv_kernel_dim=integer("linear_conv_kernel_dim", 4),
            num_experts=integer("num_experts"),
            num_experts_per_tok=integer("num_experts_per_tok"),
            moe_intermediate_size=integer("moe_intermediate_size"),
            shared_expert_intermediate_size=integer("shared_expert_intermediate_size"),
            norm_topk_prob=flag("norm_topk_prob", t.get("norm_topk_prob", True)),
            intermediate_size=integer("intermediate_size", 0) if is_next else 0,
            mlp_only_layers=int_list("mlp_only_layers") if is_next else (),
            decoder_sparse_step=integer("decoder_sparse_step", 1) if is_next else 1,
            rms_norm_eps=number("rms_norm_eps", t.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=flag("tie_word_embeddings", t.get("tie_word_embeddings", d.get("tie_word_embeddings", False))),
            max_position_embeddings=integer("max_position_embeddings", 262144),
            eos_token_ids=tuple(eos),
            quantization=quant,
            vision=vision,
            **tokens,
            raw=d,
        )
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        def check(cond, msg):
            if not cond:
                raise CheckpointError(msg)

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                     "num_experts_per_tok", "decoder_sparse_step"):
            check(getattr(self, name) > 0, f"config field {name!r} must be positive")
        check(self.num_attention_heads % self.num_key_value_heads == 0,
              f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
              f"num_key_value_heads ({self.num_key_value_heads})")
        check(self.linear_num_value_heads % self.linear_num_key_heads == 0,
              f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
              f"linear_num_key_heads ({self.linear_num_key_heads})")
        check(self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim,
              f"rotary dims {self.rotary_dim} (head_dim x partial_rotary_factor) must be even and <= head_dim")
        check(self.num_experts == 0 or self.num_experts_per_tok <= self.num_experts,
              "num_experts_per_tok exceeds num_experts")
        for i in range(self.num_hidden_layers):
            if not self.is_moe_layer(i):
                check(self.intermediate_size > 0, f"layer {i} is a dense-MLP layer but intermediate_size is 0")


# bytes per stored element of the KV cache, by the engines' kv_dtype option
KV_ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
STATE_ELEMENT_BYTES = 4          # GDN recurrent and conv state: float32 (mamba_ssm_dtype)


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


# How a session's KV cache grows (it is allocated by need, not for max_context): the cpu State
# (src/cpu/engine.cpp, State::reserve) grows to max(needed, 1.5 x its capacity) rounded up to KV_BLOCK tokens;
# the Metal GpuState (src/gpu/model.cpp) to the needed tokens rounded up to its kv_block (default KV_BLOCK).
KV_BLOCK = 256
KV_GROWTH = {"cpu": 1.5, "metal": 1.0}


def kv_capacity(context: int, backend: str = "cpu", block: int = KV_BLOCK) -> int:
    """Tokens of KV cache a session of `context` tokens may have allocated. Metal: `context` rounded up to
    `block`. cpu: the most that growth by need can leave -- the last growth happened at a capacity c <= context
    - 1 and gave max(c + 1, c + c // 2) rounded up to `block`, so round_up(max(context, (context - 1) * 3 // 2))
    (a prefill straight to `context`, or a fork, holds less: round_up(context), or exactly `context`)."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be an integer >= 0, got {context!r}")
    if context == 0:
        return 0
    grow = KV_GROWTH["metal" if backend.startswith("metal") else "cpu"]
    need = context if grow == 1.0 else max(context, (context - 1) + (context - 1) // 2)
    return -(-need // block) * block


def session_alloc_bytes(config, context: int, kv_element_bytes: int = 2, backend: str = "cpu",
                        state_element_bytes: int = STATE_ELEMENT_BYTES, block: int = KV_BLOCK) -> dict:
    """Bytes one session holds allocated at `context` tokens on `backend`: its KV cache at `kv_capacity`
    tokens and its GDN state (fixed per session; the Metal graph keeps two copies, its ping-pong halves).
    Keys: kv_tokens, kv_cache, gdn_state, total."""
    cap = kv_capacity(context, backend, block)
    held = session_bytes(config, cap, kv_element_bytes, state_element_bytes)
    state = held["gdn_state"] * (2 if backend.startswith("metal") else 1)
    return {"kv_tokens": cap, "kv_cache": held["kv_cache"], "gdn_state": state, "total": held["kv_cache"] + state}


def mtp_layer_config(config: ModelConfig) -> ModelConfig:
    """`config` with one full-attention MoE layer (index 0): the MTP decoder layer's config, so that
    `decoder_layer` runs it (mlx-vlm builds its MTP layer the same way, from the text config with
    ``num_hidden_layers = mtp layers`` and ``full_attention_interval = 1``)."""
    return replace(config, num_hidden_layers=1, layer_types=("full_attention",), mlp_only_layers=(),
                   decoder_sparse_step=1)

"""Checkpoint weights: find, sanitize and check every tensor of a model against its config.

Output is a `Weights` object: canonical tensor names (no prefix, no ``.weight``) mapped to either a
dense array (viewing the memory-mapped file where no transform is needed) or a `QuantizedTensor`
(MLX affine: uint32 packed values + per-group scales and biases).

Canonical names and layouts (the contract every backend reads)::

    embed_tokens [V, H]        lm_head [V, H] (absent when tied)        norm [H]
    layers.{i}.input_layernorm [H]          layers.{i}.post_attention_layernorm [H]
    # Gated DeltaNet layer
    layers.{i}.linear_attn.in_proj_qkv [2*key_dim + value_dim, H]   rows [q | k | v], head-major
    layers.{i}.linear_attn.in_proj_z [value_dim, H]   .in_proj_b [nv, H]   .in_proj_a [nv, H]
    layers.{i}.linear_attn.conv1d [conv_dim, K]       .dt_bias [nv]   .A_log [nv] (float32)
    layers.{i}.linear_attn.norm [dv] (plain weight)   .out_proj [H, value_dim]
    # full attention layer
    layers.{i}.self_attn.q_proj [nh*hd*(2 if output gate), H]  per head [query(hd) | gate(hd)]
    layers.{i}.self_attn.k_proj / v_proj [nkv*hd, H]   .o_proj [H, nh*hd]   .q_norm / .k_norm [hd]
    # MoE layer
    layers.{i}.mlp.gate [E, H]   layers.{i}.mlp.switch_mlp.{gate_proj,up_proj} [E, I, H]   .down_proj [E, H, I]
    layers.{i}.mlp.shared_expert.{gate_proj,up_proj} [Is, H]   .down_proj [H, Is]   layers.{i}.mlp.shared_expert_gate [1, H]
    # dense-MLP layer (qwen3_next mlp_only_layers)
    layers.{i}.mlp.{gate_proj,up_proj} [I, H]   .down_proj [H, I]

Every RMSNorm weight except ``linear_attn.norm`` is stored *shifted* (the factor the normalised
vector is multiplied by): MLX files already hold ``1 + w``; for HF files the loader adds 1 in float32
(docs/model.md §2.3). Qwen3-Next's fused ``in_proj_qkvz``/``in_proj_ba`` are split into the four
projections above (per-k-head grouped order), which is an exact row permutation for quantized
tensors too.

The multi-token-prediction head (``mtp.*`` keys, docs/model.md §2.5), when a checkpoint carries a complete
one, is loaded into ``Weights.mtp`` -- a separate dict that no backend reads -- under the same names
without the ``mtp.`` prefix::

    fc [H, 2H]   pre_fc_norm_embedding [H]   pre_fc_norm_hidden [H]   norm [H]     (norms shifted)
    layers.{j}.*  one full-attention decoder layer with the MoE block, named as a body layer

A partial or malformed head is dropped as before (ordinary inference ignores it); why is kept in
``Weights.mtp_error``. `load_mtp_head` reads a separate MTP head folder (mlx-vlm's ``qwen3_5_mtp``).

The vision tower (docs/vision.md), when the files carry one -- Hugging Face's ``model.visual.*`` (what
``save_pretrained`` of ``Qwen3_5MoeForConditionalGeneration`` writes) or mlx-vlm's ``vision_tower.*`` (its
conversion: bf16, the patch-embed conv channels-last) -- is loaded strictly (every tensor with the shape
config.json's ``vision_config`` gives it, nothing else) into ``Weights.vision``, a separate dict under these
names (``.bias`` the linear / LayerNorm biases; linear weights dense or MLX-quantized, the rest plain)::

    patch_embed.proj [hidden, C*T*P*P]  (the Conv3d as a GEMM: the weight flattened channel-major, the order
                                         of a pixel_values row)   patch_embed.proj.bias [hidden]
    pos_embed [num_position_embeddings, hidden]
    blocks.{i}.norm1 / norm2 [hidden] (+ .bias)      blocks.{i}.attn.qkv [3*hidden, hidden] (+ .bias)
    blocks.{i}.attn.proj [hidden, hidden] (+ .bias)  blocks.{i}.mlp.linear_fc1 [I, hidden] / linear_fc2 [hidden, I]
    merger.norm [hidden] (+ .bias)   merger.linear_fc1 [hidden*m^2, hidden*m^2]   merger.linear_fc2 [out, hidden*m^2]

A checkpoint without tower tensors (mlx-lm's text-only conversions) loads with ``Weights.vision`` empty.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

import numpy as np

from .config import ModelConfig, QuantizationConfig
from .errors import CheckpointError
from .native import core
from .quant import dequantize, infer_bits_and_group_size
from .safetensors_io import TensorSource

FLOAT_DTYPES = ("F32", "F16", "BF16")
SHIFTED_NORMS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")
# the routed-expert matrices of one MoE layer, in the order of its parts
EXPERT_MATRICES = ("gate_proj", "up_proj", "down_proj")


def expert_names(layer: int) -> list[str]:
    """Canonical names of one MoE layer's routed-expert stacks, in part order."""
    return [f"layers.{layer}.mlp.switch_mlp.{m}" for m in EXPERT_MATRICES]


def moe_layers(config) -> list[int]:
    """The indices of the layers with a mixture-of-experts MLP."""
    return [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]


def is_routed_expert(name: str) -> bool:
    """Whether canonical tensor `name` is a routed expert stack (the part expert streaming reads from disk)."""
    return ".mlp.switch_mlp." in name


@dataclass
class QuantizedTensor:
    """An MLX affine-quantized matrix (or stack of matrices along leading axes).

    ``weight``: uint32 [..., out, in*bits/32], elements packed LSB-first;
    ``scales``/``biases``: [..., out, in/group_size]; value = scale*q + bias.
    """

    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple:
        return self.weight.shape[:-1] + (self.weight.shape[-1] * 32 // self.bits,)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes + self.biases.nbytes

    def take_rows(self, rows: np.ndarray) -> "QuantizedTensor":
        """Rows (axis -2) in the given order; exact, as scales and biases are per row."""
        return QuantizedTensor(np.take(self.weight, rows, axis=-2), np.take(self.scales, rows, axis=-2),
                               np.take(self.biases, rows, axis=-2), self.bits, self.group_size)

    def dequantize(self) -> np.ndarray:
        """float32 values, by the compiled dequantizer (same result as `quant.dequantize`)."""
        try:
            _core = core()
        except ImportError:   # running from a source tree without the built extension
            return dequantize(self.weight, self.scales, self.biases, self.bits, self.group_size)
        rows = int(np.prod(self.weight.shape[:-1]))
        out = _core.dequantize_affine(
            np.ascontiguousarray(self.weight.reshape(rows, -1)),
            np.ascontiguousarray(self.scales.reshape(rows, -1), dtype=np.float32),
            np.ascontiguousarray(self.biases.reshape(rows, -1), dtype=np.float32),
            self.bits, self.group_size)
        return out.reshape(self.shape)

    def __repr__(self) -> str:
        return f"QuantizedTensor({list(self.shape)}, {self.bits}-bit g{self.group_size})"


Tensor = "np.ndarray | QuantizedTensor"


def to_float32(t) -> np.ndarray:
    if isinstance(t, QuantizedTensor):
        return t.dequantize()
    return np.asarray(t, dtype=np.float32)


@dataclass
class Weights:
    config: ModelConfig
    tensors: dict
    layout: str                  # "mlx" or "hf": how the files were laid out
    path: str
    source: TensorSource | None = None      # the mapped files (None for weights built in memory)
    mtp: dict = field(default_factory=dict)  # the MTP head's tensors (canonical names, see above), if any
    mtp_error: str | None = None             # why the checkpoint's mtp.* tensors were not loaded
    vision: dict = field(default_factory=dict)  # the vision tower's tensors (canonical names, see above), if any
    vision_layout: str | None = None         # "hf" (model.visual.*) or "mlx-vlm" (vision_tower.*); None: no tower

    def check_unchanged(self) -> None:
        """Raise CheckpointError if a weight file changed on disk since loading (see
        `SafetensorsFile.check_unchanged`)."""
        if self.source is not None:
            self.source.check_unchanged()

    def __getitem__(self, name):
        return self.tensors[name]

    def __contains__(self, name):
        return name in self.tensors

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def dense_float32(self) -> dict:
        """Every tensor dequantized/cast to float32 (what the numpy reference computes on)."""
        return {k: to_float32(v) for k, v in self.tensors.items()}

    def dense_float32_nbytes(self) -> int:
        return sum(4 * int(np.prod(t.shape)) for t in self.tensors.values())


# ---------------------------------------------------------------------------------------------
def split_part(rest: str):
    """A tensor key's stem and part: ("x.weight" -> ("x", "weight"); a key without a quantization part -> (key, ""))."""
    for part in ("weight", "scales", "biases"):
        if rest.endswith("." + part):
            return rest[: -len(part) - 1], part
    return rest, ""


def _is_mtp_key(key: str) -> bool:
    return key.startswith("mtp.") or ".mtp." in key


def _mtp_canonical_key(key: str):
    """(stem, part) of an ``mtp.*`` file key (``mtp.``, ``model.mtp.`` or ``language_model.mtp.``), the
    stem without the ``mtp.`` prefix; None for any other key."""
    if not _is_mtp_key(key):
        return None
    at = 0 if key.startswith("mtp.") else key.index(".mtp.") + 1
    return split_part(key[at + len("mtp."):])


# file-key prefixes of the vision tower: Hugging Face (save_pretrained; the second is an old nesting mlx-vlm
# also renames) and mlx-vlm's conversion
VISION_PREFIXES = {"model.visual.": "hf", "model.language_model.visual.": "hf", "vision_tower.": "mlx-vlm"}


def _vision_prefix(key: str) -> str | None:
    return next((p for p in VISION_PREFIXES if key.startswith(p)), None)


def _vision_canonical_key(key: str):
    """(stem, part) of a vision tower file key, its prefix removed; None for any other key."""
    p = _vision_prefix(key)
    return None if p is None else split_part(key[len(p):])


def _canonical_key(key: str):
    """Map a file key to (canonical stem, part) with part in weight/scales/biases/'' — or None to drop."""
    if _is_mtp_key(key):
        return None          # the MTP head: read by its own reader (`_load_mtp`), never by the body's
    rest = key
    for prefix in ("language_model.model.", "model.language_model.", "model."):
        if rest.startswith(prefix):
            rest = rest[len(prefix):]
            break
    else:
        if rest.startswith("language_model.lm_head."):
            rest = rest[len("language_model."):]
    head = rest.split(".", 1)[0]
    if head in ("visual", "vision_tower", "vision_model", "multi_modal_projector") or key.startswith(
            ("vision_tower.", "visual.", "language_model.vision_tower.")):
        return None
    return split_part(rest)


def detect_layout(src: TensorSource, stems: dict) -> str:
    """'hf' or 'mlx' (docs/model.md §2.3: the conv1d shape decides; other signs as fallback)."""
    for stem, parts in stems.items():
        if stem.endswith("linear_attn.conv1d") and "weight" in parts:
            shape = src.shape(parts["weight"])
            if len(shape) == 3 and shape[1] != shape[2]:
                return "hf" if shape[1] == 1 else "mlx"
    if any(".mlp.experts." in s for s in stems):
        return "hf"
    if any("scales" in p for p in stems.values()):
        return "mlx"
    return "mlx" if src.metadata.get("format") == "mlx" else "hf"


class ConfigDim(int):
    """A dimension of the model as config.json gives it, carrying the field's name for error messages
    (arithmetic on it gives a plain int: a product of dimensions names no one field)."""

    field: str

    def __new__(cls, config: ModelConfig, name: str) -> "ConfigDim":
        d = super().__new__(cls, getattr(config, name))
        d.field = name
        return d


class TensorReader:
    """Fetches tensors by canonical stem with strict checks; remembers what was used. Shared by the checkpoint
    readers of the model, its MTP head and DFlash drafts (`canonical` maps a file's key to (stem, part))."""

    def __init__(self, src: TensorSource, config: ModelConfig, canonical=_canonical_key):
        self.src, self.config = src, config
        self.stems: dict = {}
        for key in src.keys():
            c = canonical(key)
            if c is None:
                continue
            stem, part = c
            self.stems.setdefault(stem, {})[part] = key
        self.used: set = set()

    def where(self, key: str) -> str:
        return f"{self.src.file_of(key)}: tensor {key!r}"

    def has(self, stem: str) -> bool:
        return stem in self.stems

    def _missing(self, stem: str):
        raise CheckpointError(f"{self.src.directory}: missing tensor {stem!r} (expected for {self.config.model_type}; "
                              f"looked for it with and without the 'model.'/'language_model.model.' prefixes)")

    def plain(self, stem: str, shape: tuple) -> np.ndarray:
        """A non-quantized float tensor of exactly `shape` (bare name or `.weight`)."""
        parts = self.stems.get(stem)
        if not parts:
            self._missing(stem)
        if "scales" in parts or "biases" in parts:
            raise CheckpointError(f"{self.where(parts.get('weight', parts['scales']))}: "
                                  f"is quantized but {stem} must be a plain float tensor")
        key = parts.get("weight", parts.get(""))
        if key is None:
            self._missing(stem)
        return self._dense(key, shape)

    def _shape_error(self, key: str, got: tuple, shape: tuple, how: str = "") -> CheckpointError:
        """The tensor `key` holds `got` where config.json's dimensions give `shape`: an edited or foreign
        config.json, so the message names the config fields (`ConfigDim`) of the dimensions that differ.
        `how`: how `got` was read (a quantized tensor's widths)."""
        fields = [f"{want.field} is {int(want)} but the tensor has {g}" for g, want in zip(got, shape)
                  if g != want and isinstance(want, ConfigDim)] if len(got) == len(shape) else []
        return CheckpointError(
            f"{self.where(key)}: shape {list(got)}{how} does not match {list(map(int, shape))}, the shape "
            f"config.json's dimensions give it" + (f" (config.json's {'; '.join(fields)})" if fields else "")
            + ": does config.json belong to these weights?")

    def _dense(self, key: str, shape: tuple) -> np.ndarray:
        self._check_float(key)
        arr = self.src.get(key)
        if tuple(arr.shape) != tuple(shape):
            raise self._shape_error(key, tuple(arr.shape), tuple(shape))
        self.used.add(key)
        return arr

    def _check_float(self, key):
        dt = self.src.dtype_name(key)
        if dt not in FLOAT_DTYPES:
            raise CheckpointError(f"{self.where(key)}: dtype {dt}, expected one of {FLOAT_DTYPES}")

    def linear(self, stem: str, shape: tuple):
        """A matrix (or stack) of logical `shape`: dense float or MLX affine-quantized."""
        parts = self.stems.get(stem)
        if not parts or ("weight" not in parts and "" not in parts):
            self._missing(stem)
        key = parts.get("weight", parts.get(""))
        if "scales" not in parts and "biases" not in parts:
            return self._dense(key, shape)
        if "scales" not in parts or "biases" not in parts:
            missing = "scales" if "scales" not in parts else "biases"
            raise CheckpointError(f"{self.where(key)}: quantized tensor lacks '{stem}.{missing}' "
                                  f"(only affine quantization with biases is supported)")
        w, s, b = (self.src.get(parts[p]) for p in ("weight", "scales", "biases"))
        if self.src.dtype_name(parts["weight"]) != "U32":
            raise CheckpointError(f"{self.where(parts['weight'])}: quantized weight must be U32, "
                                  f"got {self.src.dtype_name(parts['weight'])}")
        for p in ("scales", "biases"):
            self._check_float(parts[p])
        if s.shape != b.shape or s.dtype != b.dtype:
            raise CheckpointError(f"{self.where(parts['biases'])}: shape/dtype {list(b.shape)} {b.dtype} "
                                  f"differs from its scales {list(s.shape)} {s.dtype}")
        lead, in_features = tuple(shape[:-1]), shape[-1]
        q = self.config.quantization
        file_path = key[: -len(".weight")] if key.endswith(".weight") else key
        spec = q.spec_for(file_path) if q is not None else None
        if spec is not None and tuple(w.shape[:-1]) == tuple(s.shape[:-1]) and (32 * w.shape[-1]) % spec.bits == 0:
            # read at config.json's widths the tensor is whole: a different shape is the dimensions' doing
            stored = tuple(w.shape[:-1]) + (32 * w.shape[-1] // spec.bits,)
            if stored[-1] == s.shape[-1] * spec.group_size and stored != tuple(shape):
                raise self._shape_error(parts["weight"], stored, tuple(shape),
                                        f" (read at config.json's {spec.bits}-bit group {spec.group_size})")
        if tuple(w.shape[:-1]) != lead or tuple(s.shape[:-1]) != lead:
            raise CheckpointError(f"{self.where(parts['weight'])}: shape {list(w.shape)} (scales {list(s.shape)}) "
                                  f"does not fit logical shape {list(shape)}")
        try:
            bits, gs = infer_bits_and_group_size(w.shape[-1], s.shape[-1], in_features)
        except ValueError as e:
            raise CheckpointError(f"{self.where(parts['weight'])}: packed width {w.shape[-1]} / {s.shape[-1]} "
                                  f"groups for {in_features} inputs: {e}") from None
        if spec is not None:
            if (spec.bits, spec.group_size) != (bits, gs):
                raise CheckpointError(
                    f"{self.where(parts['weight'])}: shapes say {bits}-bit group {gs}, but config.json's "
                    f"quantization block says {spec.bits}-bit group {spec.group_size} for {file_path!r}")
        self.used.update(parts.values())
        return QuantizedTensor(w, s, b, bits, gs)

    def leftovers(self) -> list:
        left = []
        for parts in self.stems.values():
            left.extend(k for k in parts.values() if k not in self.used)
        return left

    def refuse_leftovers(self, what: str) -> None:
        """CheckpointError naming the first tensor nothing read (and how many more), "not part of `what`"."""
        left = self.leftovers()
        if left:
            k = left[0]
            more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
            raise CheckpointError(f"{self.src.file_of(k)}: unexpected tensor {k!r}{more} — not part of {what}")


def _shift_norm(arr: np.ndarray) -> np.ndarray:
    return np.asarray(arr, dtype=np.float32) + np.float32(1.0)


def checkpoint_layout(path: str | os.PathLike, config: ModelConfig) -> str:
    """'hf' or 'mlx': the layout of the checkpoint directory `path` (from its tensor headers only)."""
    src = TensorSource(os.fspath(path))
    return detect_layout(src, TensorReader(src, config).stems)


def load_weights(path: str | os.PathLike, config: ModelConfig) -> Weights:
    """Load and check every tensor of the checkpoint directory `path` for `config`."""
    path = os.fspath(path)
    src = TensorSource(path)
    r = TensorReader(src, config)
    layout = detect_layout(src, r.stems)
    hf = layout == "hf"
    c = config
    H, V = ConfigDim(c, "hidden_size"), ConfigDim(c, "vocab_size")
    out: dict = {}

    def norm(stem, dim):
        a = r.plain(stem, (dim,))
        return _shift_norm(a) if hf else a

    out["embed_tokens"] = r.linear("embed_tokens", (V, H))
    if c.tie_word_embeddings:
        if r.has("lm_head"):
            r.linear("lm_head", (V, H))   # tolerated (some exports keep it); the embedding is used
    else:
        out["lm_head"] = r.linear("lm_head", (V, H))
    out["norm"] = norm("norm", H)

    for i in range(c.num_hidden_layers):
        _load_layer(r, c, f"layers.{i}.", out, norm, hf, full_attention=c.is_full_attention(i), moe=c.is_moe_layer(i))

    mtp, mtp_error = {}, None
    if any(_is_mtp_key(k) for k in src.keys()):
        mtp, mtp_error = _try_load_mtp(src, c, hf)
    vision, vision_layout = load_vision(src, c)

    r.refuse_leftovers(f"a {c.model_type} model with this config.json")
    return Weights(config, out, layout, path, src, mtp=mtp, mtp_error=mtp_error, vision=vision,
                   vision_layout=vision_layout)


def _load_layer(r: "TensorReader", c: ModelConfig, p: str, out: dict, norm, hf: bool, *, full_attention: bool,
                moe: bool) -> None:
    """Read decoder layer ``p`` (e.g. ``"layers.3."``) into `out` under the same canonical names."""
    H = ConfigDim(c, "hidden_size")
    nh, nkv, hd = (ConfigDim(c, n) for n in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    nk, nv, dk, dv, K = (ConfigDim(c, n) for n in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                              "linear_value_head_dim", "linear_conv_kernel_dim"))
    out[p + "input_layernorm"] = norm(p + "input_layernorm", H)
    out[p + "post_attention_layernorm"] = norm(p + "post_attention_layernorm", H)
    if full_attention:
        a = p + "self_attn."
        out[a + "q_proj"] = r.linear(a + "q_proj", (nh * hd * (2 if c.attn_output_gate else 1), H))
        out[a + "k_proj"] = r.linear(a + "k_proj", (nkv * hd, H))
        out[a + "v_proj"] = r.linear(a + "v_proj", (nkv * hd, H))
        out[a + "o_proj"] = r.linear(a + "o_proj", (H, nh * hd))
        out[a + "q_norm"] = norm(a + "q_norm", hd)
        out[a + "k_norm"] = norm(a + "k_norm", hd)
    else:
        g = p + "linear_attn."
        if r.has(g + "in_proj_qkvz"):           # qwen3_next fused layout, grouped per k-head
            rr = nv // nk
            qkvz = r.linear(g + "in_proj_qkvz", (2 * c.key_dim + 2 * c.value_dim, H))
            ba = r.linear(g + "in_proj_ba", (2 * nv, H))
            per = 2 * dk + 2 * rr * dv
            base = np.arange(nk)[:, None] * per

            def rows(start, n):
                return (base + start + np.arange(n)[None, :]).reshape(-1)

            qkv_rows = np.concatenate([rows(0, dk), rows(dk, dk), rows(2 * dk, rr * dv)])
            out[g + "in_proj_qkv"] = _take_rows(qkvz, qkv_rows)
            out[g + "in_proj_z"] = _take_rows(qkvz, rows(2 * dk + rr * dv, rr * dv))
            bbase = np.arange(nk)[:, None] * 2 * rr
            out[g + "in_proj_b"] = _take_rows(ba, (bbase + np.arange(rr)[None, :]).reshape(-1))
            out[g + "in_proj_a"] = _take_rows(ba, (bbase + rr + np.arange(rr)[None, :]).reshape(-1))
        else:
            out[g + "in_proj_qkv"] = r.linear(g + "in_proj_qkv", (c.conv_dim, H))
            out[g + "in_proj_z"] = r.linear(g + "in_proj_z", (c.value_dim, H))
            out[g + "in_proj_b"] = r.linear(g + "in_proj_b", (nv, H))
            out[g + "in_proj_a"] = r.linear(g + "in_proj_a", (nv, H))
        conv = r.plain(g + "conv1d", (c.conv_dim, 1, K) if hf else (c.conv_dim, K, 1))
        out[g + "conv1d"] = conv.reshape(c.conv_dim, K)   # same flat memory in both layouts
        out[g + "dt_bias"] = r.plain(g + "dt_bias", (nv,))
        out[g + "A_log"] = np.asarray(r.plain(g + "A_log", (nv,)), dtype=np.float32)
        out[g + "norm"] = r.plain(g + "norm", (dv,))
        out[g + "out_proj"] = r.linear(g + "out_proj", (H, c.value_dim))
    m = p + "mlp."
    if moe:
        E, I, Is = (ConfigDim(c, n) for n in ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size"))
        out[m + "gate"] = r.linear(m + "gate", (E, H))
        if r.has(m + "experts.gate_up_proj"):          # HF fused experts
            gu = r.plain(m + "experts.gate_up_proj", (E, 2 * I, H))
            out[m + "switch_mlp.gate_proj"] = gu[:, :I, :]
            out[m + "switch_mlp.up_proj"] = gu[:, I:, :]
            out[m + "switch_mlp.down_proj"] = r.plain(m + "experts.down_proj", (E, H, I))
        elif r.has(m + "experts.0.gate_proj"):         # HF per-expert keys: stack in expert order
            for name, shp in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                out[m + "switch_mlp." + name] = np.stack(
                    [r.plain(f"{m}experts.{e}.{name}", shp) for e in range(E)])
        else:
            out[m + "switch_mlp.gate_proj"] = r.linear(m + "switch_mlp.gate_proj", (E, I, H))
            out[m + "switch_mlp.up_proj"] = r.linear(m + "switch_mlp.up_proj", (E, I, H))
            out[m + "switch_mlp.down_proj"] = r.linear(m + "switch_mlp.down_proj", (E, H, I))
        if Is > 0:
            s = m + "shared_expert."
            out[s + "gate_proj"] = r.linear(s + "gate_proj", (Is, H))
            out[s + "up_proj"] = r.linear(s + "up_proj", (Is, H))
            out[s + "down_proj"] = r.linear(s + "down_proj", (H, Is))
            out[m + "shared_expert_gate"] = r.linear(m + "shared_expert_gate", (1, H))
    else:
        I = ConfigDim(c, "intermediate_size")
        out[m + "gate_proj"] = r.linear(m + "gate_proj", (I, H))
        out[m + "up_proj"] = r.linear(m + "up_proj", (I, H))
        out[m + "down_proj"] = r.linear(m + "down_proj", (H, I))


# ---- the MTP head ------------------------------------------------------------------------------
MTP_NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


def _load_mtp(src: TensorSource, c: ModelConfig, hf: bool, canonical=_mtp_canonical_key) -> dict:
    """The MTP head's tensors (canonical names without ``mtp.``, see the module docstring), strictly:
    every tensor present with its shape, nothing else. `hf`: the norms are zero-centred (add 1)."""
    r = TensorReader(src, c, canonical)
    if not r.stems:
        raise CheckpointError(f"{src.directory}: no MTP tensors")
    H = ConfigDim(c, "hidden_size")
    out: dict = {}

    def norm(stem, dim):
        a = r.plain(stem, (dim,))
        return _shift_norm(a) if hf else a

    out["fc"] = r.linear("fc", (H, 2 * H))
    for n in MTP_NORMS:
        out[n] = norm(n, H)
    layers = sorted({int(s.split(".")[1]) for s in r.stems if s.startswith("layers.") and s.split(".")[1].isdigit()})
    if not layers:
        raise CheckpointError(f"{src.directory}: MTP head has no decoder layer (mtp.layers.0.*)")
    if layers != list(range(len(layers))):
        raise CheckpointError(f"{src.directory}: MTP layers {layers} are not numbered 0..{len(layers) - 1}")
    raw = c.raw or {}
    want = (raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw).get("mtp_num_hidden_layers")
    if isinstance(want, int) and want > 0 and want != len(layers):
        raise CheckpointError(f"{src.directory}: {len(layers)} MTP layers, config.json says "
                              f"mtp_num_hidden_layers={want}")
    for j in layers:
        p = f"layers.{j}."
        # one full-attention layer with the MoE block (a dense MLP only if the file has one)
        moe = c.num_experts > 0 and not r.has(p + "mlp.gate_proj")
        _load_layer(r, c, p, out, norm, hf, full_attention=True, moe=moe)
    left = r.leftovers()
    if left:
        k = left[0]
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        raise CheckpointError(f"{src.file_of(k)}: unexpected MTP tensor {k!r}{more}")
    return out


def _try_load_mtp(src: TensorSource, c: ModelConfig, hf: bool) -> tuple[dict, str | None]:
    """The checkpoint's MTP head, or ({}, why) when its mtp.* tensors do not form a complete one (then
    they are ignored, as ordinary inference always did)."""
    try:
        return _load_mtp(src, c, hf), None
    except CheckpointError as e:
        return {}, str(e)


MTP_HEAD_MODEL_TYPE = "qwen3_5_mtp"


def _folder_key(key: str):
    if key.startswith("mtp."):
        key = key[len("mtp."):]
    if key.startswith(("embed_tokens.", "lm_head.")):
        return None            # a copy of the shared embedding / head: the main model's is used
    return split_part(key)


def load_mtp_head(path: str | os.PathLike, config: ModelConfig) -> tuple[dict, TensorSource]:
    """A separate MTP head folder (config.json ``model_type`` ``"qwen3_5_mtp"``, as mlx-vlm's splitter
    writes it: the ``mtp.*`` tensors with the prefix removed, norms already shifted, optionally
    quantized with a ``quantization`` block) for the model of `config`. Keys still carrying ``mtp.``
    are taken as HF tensors (zero-centred norms). Returns (tensors by canonical name, the mapped files)."""
    path = os.fspath(path)
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json (expected an MTP head folder)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: cannot read ({e})") from None
    if not isinstance(d, dict) or d.get("model_type") != MTP_HEAD_MODEL_TYPE:
        mt = d.get("model_type") if isinstance(d, dict) else None
        raise CheckpointError(f"{cfg_path}: model_type {mt!r}, expected {MTP_HEAD_MODEL_TYPE!r} (an MTP head folder)")
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
    if text.get("hidden_size") not in (None, config.hidden_size):
        raise CheckpointError(f"{cfg_path}: hidden_size {text.get('hidden_size')} does not match the model's "
                              f"{config.hidden_size}")
    qblock = d.get("quantization") or d.get("quantization_config")
    quant = QuantizationConfig.from_dict(qblock) if qblock else None
    src = TensorSource(path)
    hf = any(k.startswith("mtp.") for k in src.keys())
    head_cfg = replace(config, quantization=quant, raw={"text_config": text})
    return _load_mtp(src, head_cfg, hf, _folder_key), src


# ---- the vision tower ----------------------------------------------------------------------------------------
class _VisionReader(TensorReader):
    def _missing(self, stem: str):
        raise CheckpointError(f"{self.src.directory}: missing vision tensor {stem!r} (config.json's vision_config "
                              f"asks for it; looked for model.visual.{stem} / vision_tower.{stem} and "
                              f"their .weight)")


def _vision_dim(vc, name: str) -> ConfigDim:
    d = ConfigDim(vc, name)
    d.field = "vision_config." + name
    return d


def load_vision(src: TensorSource, c: ModelConfig) -> tuple[dict, str | None]:
    """The vision tower of the files in `src` for config `c` (canonical names, see the module docstring) and its
    layout ("hf" / "mlx-vlm"), or ({}, None) when the files hold no tower tensors. Strict: CheckpointError for
    tower tensors without a vision_config, both layouts mixed, a missing or misshapen tensor, or a leftover one."""
    keys = [k for k in src.keys() if _vision_prefix(k) is not None]
    if not keys:
        return {}, None
    if c.vision is None:
        raise CheckpointError(f"{src.file_of(keys[0])}: vision tower tensor {keys[0]!r} (and {len(keys) - 1} more), "
                              f"but config.json has no vision_config (not part of a {c.model_type} model "
                              f"with this config.json)")
    layouts = {VISION_PREFIXES[_vision_prefix(k)] for k in keys}
    if len(layouts) > 1:
        k = next(k for k in keys if VISION_PREFIXES[_vision_prefix(k)] == "mlx-vlm")
        raise CheckpointError(f"{src.file_of(k)}: vision tensors in both layouts (model.visual.* and "
                              f"vision_tower.*, e.g. {k!r}): one tower per checkpoint")
    layout = layouts.pop()
    r = _VisionReader(src, c, _vision_canonical_key)
    vc = c.vision
    if vc.out_hidden_size != c.hidden_size:
        raise CheckpointError(f"{src.directory}: config.json's vision_config out_hidden_size ({vc.out_hidden_size}) "
                              f"must equal the text model's hidden_size ({c.hidden_size}): the tower's rows "
                              f"stand in for image-token embeddings")
    h, inter = _vision_dim(vc, "hidden_size"), _vision_dim(vc, "intermediate_size")
    C, T, P = (_vision_dim(vc, n) for n in ("in_channels", "temporal_patch_size", "patch_size"))
    npos, out_h = _vision_dim(vc, "num_position_embeddings"), _vision_dim(vc, "out_hidden_size")
    merged = vc.merged_dim
    out: dict = {}

    def plain(stem, *shape):
        out[stem] = r.plain(stem, shape)

    def affine(stem, n_out, n_in):                 # a Linear: weight (dense or quantized) and bias
        out[stem] = r.linear(stem, (n_out, n_in))
        plain(stem + ".bias", n_out)

    def norm(stem):                                # a LayerNorm: weight and bias
        plain(stem, h)
        plain(stem + ".bias", h)

    # the patch embedding: HF Conv3d [h, C, T, P, P]; mlx-vlm channels-last [h, T, P, P, C] (its sanitize
    # transposes a channels-first one on load, so that is accepted under vision_tower.* too)
    stem = "patch_embed.proj"
    parts = r.stems.get(stem) or {}
    key = parts.get("weight", parts.get(""))
    last = (h, T, P, P, C)
    if layout == "mlx-vlm" and key is not None and tuple(src.shape(key)) == tuple(map(int, last)):
        w = np.moveaxis(r.plain(stem, last), 4, 1)
    else:
        w = r.plain(stem, (h, C, T, P, P))
    out[stem] = np.ascontiguousarray(w).reshape(int(h), vc.patch_dim)
    plain(stem + ".bias", h)
    plain("pos_embed", npos, h)
    for i in range(vc.depth):
        b = f"blocks.{i}."
        norm(b + "norm1")
        norm(b + "norm2")
        affine(b + "attn.qkv", 3 * h, h)
        affine(b + "attn.proj", h, h)
        affine(b + "mlp.linear_fc1", inter, h)
        affine(b + "mlp.linear_fc2", h, inter)
    norm("merger.norm")
    affine("merger.linear_fc1", merged, merged)
    affine("merger.linear_fc2", out_h, merged)
    left = r.leftovers()
    if left:
        k = left[0]
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        raise CheckpointError(f"{src.file_of(k)}: unexpected vision tensor {k!r}{more} -- not part of a tower "
                              f"of depth {vc.depth} (config.json's vision_config)")
    return out, layout


def _take_rows(t, rows):
    if isinstance(t, QuantizedTensor):
        return t.take_rows(rows)
    return np.take(t, rows, axis=-2)

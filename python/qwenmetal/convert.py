"""HF bf16 checkpoint -> MLX layout (4/8-bit affine or unquantized), exactly as ``mlx_lm.convert`` does it.

``convert(src, dst, q_bits=4, q_group_size=64)`` reproduces, for the model types this package supports
(``qwen3_5_moe``, ``qwen3_5_moe_text``, ``qwen3_next``), what ``mlx_lm.convert --quantize`` writes:

* the vision tower kept as mlx-vlm's conversion writes it (``vision_tower.*``: the patch-embed Conv3d weight
  channels-last ``[out, T, P, P, C]``, cast to the config's dtype, never quantized; config.json keeps its
  ``vision_config``); ``drop_vision=True`` / ``--drop-vision`` drops it as mlx-lm does (text-only output);
* mlx-lm's ``sanitize``: ``mtp.*`` dropped (``keep_mtp=True`` / ``--keep-mtp``: the MTP
  head kept under its ``mtp.*`` names, treated like a body layer -- experts split/stacked, zero-centred
  norms shifted (also ``pre_fc_norm_*`` and ``mtp.norm``, as mlx-vlm's MTP drafter sanitize does), its
  linears quantized by the same predicate), keys renamed (``language_model.model.*`` for
  qwen3_5_moe), fused ``experts.gate_up_proj`` split into ``switch_mlp.gate_proj``/``up_proj`` (qwen3_5) or
  per-expert tensors stacked (qwen3_next), conv1d weights moved to ``[C, K, 1]``, zero-centred RMSNorm
  weights shifted by +1 in the file's dtype;
* the cast to the config's dtype (``A_log`` stays float32 for qwen3_5, as mlx-lm's ``cast_predicate``);
* mlx-lm's ``quant_predicate``: every Linear / Embedding / SwitchLinear whose input dim is divisible by
  the group size is affine-quantized (uint32 weights, scales and biases in the weight dtype), the router
  ``mlp.gate`` and ``mlp.shared_expert_gate`` at 8 bits g64; the ``quantization`` block with per-path
  overrides in config.json (duplicated as ``quantization_config``);
* the index (``total_size``, ``total_parameters``), README, generation config and tokenizer files.

The conversion streams: the source is memory-mapped, each output tensor is computed from it when it is
written (a quantized weight once for its three outputs) and written at its place in the output file, so
memory stays around the size of the largest tensor, not the model. Outputs over ``max_shard_bytes``
(mlx-lm: 5 GiB) are split into ``model-0000i-of-0000n.safetensors`` shards in key order (mlx-lm
splits in module order; the tensors and their bytes are the same).

``tests/test_convert.py`` checks that converting the ``hf-bf16`` fixture gives byte-identical files to
the ``mlx-q4`` / ``mlx-q8`` / ``mlx-bf16`` fixtures, which ``tests/test_fixtures.py`` checks against
``mlx_lm.convert`` itself.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np

from .config import ModelConfig
from .errors import InputError
from .fileio import atomic_dir, check_free_dir
from .paths import resolve_checkpoint
from .quant import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, quantize
from .safetensors_io import DTYPES, SafetensorsWriter, TensorSource
from .weights import is_routed_expert

BF16 = np.dtype(ml_dtypes.bfloat16)
MAX_SHARD_BYTES = 5 << 30                    # mlx-lm's MAX_FILE_SIZE_GB = 5
NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")
# the MTP head's own zero-centred norms (mlx-vlm qwen3_5_mtp ``sanitize``)
MTP_NORM_SUFFIXES = ("mtp.norm.weight", ".pre_fc_norm_embedding.weight", ".pre_fc_norm_hidden.weight")
MLX_README = "---\nlanguage: en\nlibrary_name: mlx\npipeline_tag: text-generation\ntags:\n- mlx\n---\n"
# files copied from the source checkpoint as they are (tokenizer, chat template, generation config)
COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json")


# ---- lazy tensors ---------------------------------------------------------------------------------------
class Lazy:
    """A tensor known by shape and dtype, computed on demand by ``load()``."""

    __slots__ = ("shape", "dtype", "_fn")

    def __init__(self, shape, dtype, fn: Callable[[], np.ndarray]):
        self.shape, self.dtype, self._fn = tuple(int(d) for d in shape), np.dtype(dtype), fn

    def load(self) -> np.ndarray:
        a = self._fn()
        if a.shape != self.shape or a.dtype != self.dtype:
            raise AssertionError(f"lazy tensor: computed {a.dtype}{a.shape}, announced {self.dtype}{self.shape}")
        return a

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def lazy(a: np.ndarray) -> Lazy:
    return Lazy(a.shape, a.dtype, lambda: a)


def materialize(w: Mapping[str, Lazy]) -> dict[str, np.ndarray]:
    return {k: v.load() for k, v in w.items()}


class _Shared:
    """One computation feeding several lazy outputs; dropped once each has been loaded."""

    def __init__(self, fn, n):
        self.fn, self.n, self.val, self.left = fn, n, None, n

    def part(self, i):
        if self.val is None:
            self.val = self.fn()
            self.left = self.n
        v = self.val[i]
        self.left -= 1
        if self.left == 0:
            self.val = None
        return v


# ---- the mlx-lm transformation -----------------------------------------------------------------------
def family(cfg: Mapping[str, Any]) -> str:
    mt = cfg.get("model_type")
    if mt == "qwen3_next":
        return "qwen3_next"
    if mt in ("qwen3_5_moe", "qwen3_5_moe_text"):
        return "qwen3_5"
    raise ValueError(f"model_type {mt!r} is not supported (qwen3_5_moe, qwen3_5_moe_text, qwen3_next)")


def _is_mtp(k: str) -> bool:
    return "mtp." in k


def _split_fused_experts(w: dict, p: str) -> None:
    """``{p}.experts.gate_up_proj`` [E, 2I, H] -> ``{p}.switch_mlp.{gate,up}_proj.weight``, and
    ``experts.down_proj`` -> ``switch_mlp.down_proj.weight`` (lazily)."""
    if f"{p}.experts.gate_up_proj" not in w:
        return
    gu = w.pop(f"{p}.experts.gate_up_proj")
    mid = gu.shape[-2] // 2
    half = gu.shape[:-2] + (mid, gu.shape[-1])
    w[f"{p}.switch_mlp.gate_proj.weight"] = Lazy(
        half, gu.dtype, lambda gu=gu, mid=mid: np.ascontiguousarray(gu.load()[..., :mid, :]))
    w[f"{p}.switch_mlp.up_proj.weight"] = Lazy(
        half, gu.dtype, lambda gu=gu, mid=mid: np.ascontiguousarray(gu.load()[..., mid:, :]))
    w[f"{p}.switch_mlp.down_proj.weight"] = w.pop(f"{p}.experts.down_proj")


def _stack_experts(w: dict, p: str, n_experts: int) -> None:
    """Per-expert ``{p}.experts.{e}.{up,down,gate}_proj.weight`` -> ``{p}.switch_mlp.*.weight`` [E, ...]."""
    for n in ("up_proj", "down_proj", "gate_proj"):
        parts = [w.pop(f"{p}.experts.{e}.{n}.weight") for e in range(n_experts)]
        w[f"{p}.switch_mlp.{n}.weight"] = Lazy(
            (len(parts),) + parts[0].shape, parts[0].dtype,
            lambda parts=parts: np.stack([x.load() for x in parts]))


def _mtp_moe_blocks(w: Mapping[str, Lazy]) -> list:
    """The ``mtp.layers.{j}.mlp`` prefixes of the MTP head's MoE blocks."""
    out = set()
    for k in w:
        if k.startswith("mtp.layers.") and ".mlp.experts." in k:
            out.add(k[:k.index(".mlp.experts.") + len(".mlp")])
    return sorted(out)


def _vision_key(k: str) -> str | None:
    """mlx-vlm's name (``vision_tower.*``) of an HF vision tower key, None for any other key."""
    for p in ("model.visual.", "model.language_model.visual."):
        if k.startswith(p):
            return "vision_tower." + k[len(p):]
    return k if k.startswith("vision_tower.") else None


def _channels_last(v: Lazy) -> Lazy:
    """An HF Conv3d weight [out, C, T, P, P] as mlx-vlm stores it, [out, T, P, P, C]."""
    s = v.shape
    return Lazy((s[0],) + s[2:] + (s[1],), v.dtype,
                lambda v=v: np.ascontiguousarray(np.moveaxis(v.load(), 1, -1)))


def mlx_sanitize(hf: Mapping[str, Lazy], cfg: dict, c: ModelConfig, keep_mtp: bool = False,
                 keep_vision: bool = False) -> dict[str, Lazy]:
    """mlx-lm's ``Model.sanitize`` (qwen3_5_moe / qwen3_next) on HF file tensors (lazily). `keep_mtp`: keep
    the ``mtp.*`` head (top-level ``mtp.`` names) instead of dropping it, sanitized like a body layer.
    `keep_vision`: keep the vision tower as mlx-vlm's sanitize does (``vision_tower.*``, patch embed
    channels-last) instead of dropping it."""
    fam = family(cfg)
    w: dict[str, Lazy] = {}
    if fam == "qwen3_5":
        for k, v in hf.items():
            vk = _vision_key(k)
            if vk is not None:
                if keep_vision:
                    in_ch = (cfg.get("vision_config") or {}).get("in_channels", 3)
                    hf_conv = vk.endswith("patch_embed.proj.weight") and v.ndim == 5 and v.shape[1] == in_ch \
                        and v.shape[-1] != in_ch
                    w[vk] = _channels_last(v) if hf_conv else v
                continue
            if keep_mtp and k.startswith("mtp."):
                pass
            elif k.startswith("model.language_model"):
                k = k.replace("model.language_model", "language_model.model")
            elif not k.startswith("language_model."):
                k = "language_model." + k
            w[k] = v
        for i in range(c.num_hidden_layers):
            _split_fused_experts(w, f"language_model.model.layers.{i}.mlp")
        shift = any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in w.items())
    else:
        moe_layers = sorted(int(k.split(".")[2]) for k in hf
                            if k.startswith("model.layers.") and k.endswith(".mlp.experts.0.up_proj.weight"))
        if not moe_layers:
            raise ValueError("mlx-lm's qwen3_next sanitize needs at least one MoE layer")
        w = dict(hf)
        for i in moe_layers:
            _stack_experts(w, f"model.layers.{i}.mlp", c.num_experts)
        shift = True
    if keep_mtp:
        for p in _mtp_moe_blocks(w):
            if f"{p}.experts.gate_up_proj" in w:
                _split_fused_experts(w, p)
            else:
                _stack_experts(w, p, c.num_experts)
    else:
        w = {k: v for k, v in w.items() if not _is_mtp(k)}
    for k, v in list(w.items()):
        if "conv1d.weight" in k and v.shape[-1] != 1:
            s = v.shape
            w[k] = Lazy(s[:1] + (s[2], s[1]) + s[3:], v.dtype,
                        lambda v=v: np.ascontiguousarray(np.moveaxis(v.load(), 2, 1)))
        norm = k.endswith(NORM_SUFFIXES) or (_is_mtp(k) and k.endswith(MTP_NORM_SUFFIXES))
        if shift and norm and v.ndim == 1:
            w[k] = Lazy(v.shape, v.dtype,           # bf16 + 1.0 in MLX
                        lambda v=v: (v.load().astype(np.float32) + np.float32(1.0)).astype(v.dtype))
    return w


def convert_dtype(cfg: dict):
    """The dtype ``mlx_lm.convert`` casts to (``torch_dtype``, else text_config's ``dtype``), if any."""
    dt = cfg.get("torch_dtype")
    if dt is None and cfg.get("text_config"):
        dt = cfg["text_config"].get("dtype")
    return {"float16": np.dtype(np.float16), "bfloat16": BF16, "float32": np.dtype(np.float32)}.get(dt)


def mlx_cast(w: dict[str, Lazy], cfg: dict) -> dict[str, Lazy]:
    dt = convert_dtype(cfg)
    if dt is None:
        return w
    keep_a_log = family(cfg) == "qwen3_5"            # qwen3_5's cast_predicate skips A_log
    return {k: (v if (keep_a_log and k.endswith("A_log")) else
                Lazy(v.shape, dt, lambda v=v: v.load().astype(dt))) for k, v in w.items()}


_MODULE_RANK = ("mlp.gate", "switch_mlp.gate_proj", "switch_mlp.up_proj", "switch_mlp.down_proj", "shared_expert_gate")


def mlx_quantize(w: dict[str, Lazy], cfg: dict, c: ModelConfig, bits: int, group_size: int,
                 expert_bits: int | None = None):
    """``mlx_lm.utils.quantize_model`` with the model's ``quant_predicate`` (router ``mlp.gate`` and
    ``shared_expert_gate`` at 8 bits g64) extended, when ``expert_bits`` differs from ``bits``, by routed
    experts (``switch_mlp.*``) at ``expert_bits``: the predicate a caller passes to ``mlx_lm.convert(...,
    quant_predicate=...)`` for an expert-only low-bit checkpoint, written (as mlx-lm's own mixed recipes
    do) as ``{"group_size", "bits", "mode"}`` per path. Returns (tensors, overrides in module order)."""
    fam = family(cfg)
    use_predicate = fam == "qwen3_next" or c.num_experts > 0
    experts_differ = expert_bits is not None and expert_bits != bits
    out: dict[str, Lazy] = {}
    overrides = {}
    for k, v in w.items():
        path = k[:-len(".weight")] if k.endswith(".weight") else None
        quantizable = (path is not None and v.ndim >= 2 and "conv1d" not in k and not k.startswith("vision"))
        if not quantizable or v.shape[-1] % group_size:
            out[k] = v
            continue
        b, g = bits, group_size
        if use_predicate and (path.endswith("mlp.gate") or path.endswith("shared_expert_gate")):
            b, g = 8, 64
            overrides[path] = {"group_size": 64, "bits": 8}
        elif experts_differ and is_routed_expert(path):
            b = expert_bits
            overrides[path] = {"group_size": g, "bits": b, "mode": "affine"}
        lead, n_in = v.shape[:-1], v.shape[-1]
        sh = _Shared(lambda v=v, b=b, g=g: quantize(v.load(), b, g, scale_dtype=v.dtype), 3)
        out[k] = Lazy(lead + (n_in * b // 32,), np.uint32, lambda sh=sh: sh.part(0))
        out[path + ".scales"] = Lazy(lead + (n_in // g,), v.dtype, lambda sh=sh: sh.part(1))
        out[path + ".biases"] = Lazy(lead + (n_in // g,), v.dtype, lambda sh=sh: sh.part(2))

    def order(path):        # mlx's module traversal: by layer, then the MoE block's attribute order
        parts = path.split(".")
        i = parts.index("layers")
        return int(parts[i + 1]), next(r for r, m in enumerate(_MODULE_RANK) if path.endswith(m))

    return out, {p: overrides[p] for p in sorted(overrides, key=order)}


def mlx_build(hf: Mapping[str, Lazy], cfg: dict, bits: int | None, group_size: int = 64,
              expert_bits: int | None = None, keep_mtp: bool = False, keep_vision: bool = False):
    """HF file tensors -> (MLX tensors, quantization block or None), all lazy. ``expert_bits``: the
    routed experts' width (default ``bits``), recorded as per-path overrides. ``keep_mtp``: keep the MTP
    head (see `mlx_sanitize`), quantized like the body. ``keep_vision``: keep the vision tower (mlx-vlm's
    layout, cast but never quantized)."""
    c = ModelConfig.from_dict(cfg)
    w = mlx_cast(mlx_sanitize(hf, cfg, c, keep_mtp, keep_vision), cfg)
    if bits is None:
        if expert_bits is not None:
            raise InputError("expert_bits needs a quantized conversion (q_bits)", param="expert_bits")
        return w, None
    for name, b in (("q_bits", bits), ("expert_bits", expert_bits)):
        if b is not None and b not in SUPPORTED_BITS:
            raise InputError(f"{name} must be one of {', '.join(map(str, SUPPORTED_BITS))}, got {b}", param=name)
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise InputError(f"q_group_size must be 32, 64 or 128, got {group_size}", param="q_group_size")
    w, overrides = mlx_quantize(w, cfg, c, bits, group_size, expert_bits)
    return w, {"group_size": group_size, "bits": bits, "mode": "affine", **overrides}


def total_parameters(w: Mapping[str, Any], quant: dict | None) -> int:
    # mlx_lm.utils.get_total_parameters: logical sizes of the *leaf* modules' parameters. A_log and
    # dt_bias belong to the (non-leaf) GatedDeltaNet module, so they are not counted.
    n = 0
    for k, v in w.items():
        if k.endswith((".A_log", ".dt_bias")):
            continue
        if k.endswith((".scales", ".biases")) and k[:-7] + ".weight" in w and w[k[:-7] + ".weight"].dtype == np.uint32:
            continue
        if k.endswith(".weight") and v.dtype == np.uint32:
            path = k[:-len(".weight")]
            bits = (quant.get(path) or quant)["bits"]
            n += v.size * 32 // bits
        else:
            n += v.size
    return n


def wrap_text_config(text_cfg: Mapping[str, Any]) -> dict:
    """A ``qwen3_5_moe_text`` config.json dict wrapped the way the released multimodal checkpoint nests it
    (``{"model_type": "qwen3_5_moe", "text_config": {...}}``) -- the only form mlx-lm loads."""
    text = {k: v for k, v in text_cfg.items() if k not in ("architectures", "dtype")}
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "dtype": text_cfg.get("dtype", "bfloat16"),
            "model_type": "qwen3_5_moe", "text_config": text,
            "tie_word_embeddings": text_cfg.get("tie_word_embeddings", False)}


def mlx_config_text(hf_config_text: str, gen: dict, quant: dict | None, keep_vision: bool = False) -> str:
    """The config.json ``mlx_lm.convert`` writes, from the HF config.json text (same steps, same order);
    ``keep_vision``: with the ``vision_config`` (a checkpoint that keeps the tower, as mlx-vlm's does)."""
    cfg = json.loads(hf_config_text)
    if cfg["model_type"] == "qwen3_5_moe_text":                   # mlx-lm has no such model: wrap it
        cfg = wrap_text_config(cfg)
    if gen.get("eos_token_id"):                                   # utils.load_config
        cfg["eos_token_id"] = gen["eos_token_id"]
    text = cfg.get("text_config") if cfg["model_type"] == "qwen3_5_moe" else None
    if text is not None:                                          # qwen3_5 TextModelArgs.__post_init__
        rp = text.get("rope_parameters")
        if rp and "type" not in rp and "rope_type" in rp:
            rp["type"] = rp.pop("rope_type")
    if quant is not None:                                         # quantize_model + save_config
        cfg["quantization"] = quant
        cfg["quantization_config"] = quant
    cfg.pop("_name_or_path", None)
    if not keep_vision:
        cfg.pop("vision_config", None)
    return json.dumps(dict(sorted(cfg.items())), indent=4)


def _shard(w: Mapping[str, Lazy], max_bytes: int) -> list:
    def key(k):           # layer index as a number, so shards follow the model's order
        parts = k.split(".")
        return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts]

    shards, cur, size = [], [], 0
    for k in sorted(w, key=key):
        if cur and size + w[k].nbytes > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += w[k].nbytes
    shards.append(cur)
    return shards


def write_mlx_checkpoint(dst, w: Mapping[str, Lazy], quant: dict | None, hf_config_text: str, gen: dict,
                         max_shard_bytes: int = MAX_SHARD_BYTES, progress: bool = False) -> None:
    """Write the weights (streamed), index, config.json and README of an MLX checkpoint into ``dst``."""
    dst = Path(dst)
    shards = _shard(w, max_shard_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=sum(v.nbytes for v in w.values()), unit="B", unit_scale=True, desc="convert")
    try:
        for fn, keys in zip(names, shards):
            specs = {k: (w[k].dtype, w[k].shape) for k in keys}
            with SafetensorsWriter(dst / fn, specs, metadata={"format": "mlx"}) as out:
                for k in sorted(keys):
                    out.write(k, w[k].load())
                    if bar is not None:
                        bar.update(w[k].nbytes)
            os.chmod(dst / fn, 0o644)
    finally:
        if bar is not None:
            bar.close()
    weight_map = {k: fn for fn, keys in zip(names, shards) for k in keys}
    index = {"metadata": {"total_size": int(sum(v.nbytes for v in w.values())),
                          "total_parameters": int(total_parameters(w, quant))},
             "weight_map": {k: weight_map[k] for k in sorted(weight_map)}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=4), encoding="utf-8")
    keep_vision = any(k.startswith("vision_tower.") for k in w)
    (dst / "config.json").write_text(mlx_config_text(hf_config_text, gen, quant, keep_vision), encoding="utf-8")
    (dst / "README.md").write_text(MLX_README, encoding="utf-8")


def convert(src, dst, *, revision: str | None = None, q_bits: int | None = 4, q_group_size: int = 64,
            expert_bits: int | None = None, max_shard_bytes: int = MAX_SHARD_BYTES, progress: bool = False,
            keep_mtp: bool = False, drop_vision: bool = False) -> Path:
    """Convert the HF checkpoint at ``src`` (directory or hub id) to MLX layout in ``dst``.

    ``q_bits`` None -> unquantized (``mlx_lm.convert`` without ``-q``). ``expert_bits``: the routed
    experts' width (default ``q_bits``); when it differs, config.json records each expert stack's width as
    a per-path override (what ``mlx_lm.convert`` writes given the same ``quant_predicate``). ``dst`` must
    not exist (or be empty); the result appears atomically (built in a temporary sibling, then renamed).
    ``keep_mtp``: keep the multi-token-prediction head (``mtp.*``, which mlx-lm drops), quantized like the
    body, so ``speculative="mtp"`` can use it; raises ValueError if the source has no ``mtp.*`` tensors.
    The vision tower (``model.visual.*``), when the source has one, is kept unquantized in mlx-vlm's layout
    (``vision_tower.*``) with config.json's ``vision_config``; ``drop_vision``: drop it as ``mlx_lm.convert``
    does (a text-only checkpoint, byte-identical to mlx-lm's).
    """

    src = Path(resolve_checkpoint(src, revision))
    dst = Path(dst)
    check_free_dir(dst)                     # before any work
    cfg_text = (src / "config.json").read_text(encoding="utf-8")
    cfg = json.loads(cfg_text)
    if "quantization" in cfg or "quantization_config" in cfg:
        raise ValueError(f"{src}: already quantized; convert takes a Hugging Face bf16/fp16/fp32 checkpoint")
    ts = TensorSource(src)
    if any(k.startswith("language_model.model.") for k in ts.keys()):
        raise ValueError(f"{src}: this is already in the MLX layout")
    hf = {k: Lazy(ts.shape(k), DTYPES[ts.dtype_name(k)], lambda k=k: ts.get(k)) for k in ts.keys()}
    if keep_mtp and not any(k.startswith("mtp.") for k in hf):
        raise ValueError(f"{src}: keep_mtp: the checkpoint has no MTP head (no mtp.* tensors)")
    w, quant = mlx_build(hf, cfg, q_bits, q_group_size, expert_bits, keep_mtp, keep_vision=not drop_vision)
    gen_path = src / "generation_config.json"
    gen = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.exists() else {}
    with atomic_dir(dst) as tmp:            # only writes inside: an OSError here is about dst
        write_mlx_checkpoint(tmp, w, quant, cfg_text, gen, max_shard_bytes, progress)
        for fn in COPIED_FILES:
            if (src / fn).exists():
                shutil.copyfile(src / fn, tmp / fn)
    return dst

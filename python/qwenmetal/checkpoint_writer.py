"""The one random-checkpoint writer: deterministic random weights for a config, in a real on-disk layout.

Used by the test fixtures (:func:`qwenmetal.testing.make_checkpoint`), by the benchmark's real-width
checkpoint (:func:`qwenmetal.bench.ensure_checkpoint`) and, through :func:`canonical_params`, by the
numpy reference's :func:`qwenmetal.backends.testing.random_params` -- so there is one source of random weights.

* **Weights.** :func:`text_specs` lists every text-model tensor by logical name (Qwen3.5 naming, no
  prefix), shape and distribution; each is drawn from its own generator, seeded by ``sha256(seed, name)``,
  in float32 (row chunks of the same stream, so a real-width tensor never needs a float32 copy), then
  rounded to bf16 (``A_log`` stays float32, as in Qwen's releases). Scales (:data:`INITS`): checkpoints
  use ``"fixture"`` (projections ~ N(0, 0.04), embeddings and lm_head ~ N(0, 0.05), router ~ N(0, 0.1),
  ``dt_bias`` ~ U(0, 1), ``A_log = log(U(1, 16))``); the reference tests ``"reference"``, a
  residual-dominated model (see :data:`INITS`). Both: zero-centred norms ~ N(0, 0.1) (the model applies
  ``1 + w``), ``linear_attn.norm`` ~ N(1, 0.1), conv taps ~ N(0, 0.3).
* **Layouts.** ``hf-bf16`` (what transformers' ``save_pretrained`` writes, see :func:`hf_tensors`),
  ``mlx-bf16`` / ``mlx-q{2,3,4,5,6,8}`` (what ``mlx_lm.convert -q --q-bits B --q-group-size 64`` makes of
  it) and ``mlx-q4-e2`` / ``mlx-q4-e3`` (routed experts at 2/3 bits, the rest at 4: ``mlx_lm.convert``
  with a ``quant_predicate`` giving ``switch_mlp.*`` that width, which config.json records per path), all
  by the product code :mod:`qwenmetal.convert`.
* **Writing.** :func:`write_checkpoint` streams: every tensor is computed when it is written (lazily,
  through :class:`qwenmetal.convert.Lazy`), into safetensors shards of at most ``max_shard_bytes``
  (mlx-lm's 5 GiB by default), so memory stays near the largest tensor, not the model. The directory
  appears atomically (:func:`qwenmetal.fileio.atomic_dir`): on any error nothing is left behind.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

import ml_dtypes
import numpy as np

from . import convert as _convert
from .config import ModelConfig
from .fileio import atomic_dir

__all__ = ["LAYOUTS", "INITS", "Init", "Spec", "text_specs", "draw", "hf_tensors", "mlx_tensors", "canonical_params",
           "check_supported", "write_checkpoint", "with_mtp"]

BF16 = np.dtype(ml_dtypes.bfloat16)
#: layout -> (bits, routed-expert bits) of its MLX quantization (None: unquantized); all at group size 64
_BITS = {"mlx-bf16": (None, None), **{f"mlx-q{b}": (b, b) for b in (2, 3, 4, 5, 6, 8)},
         "mlx-q4-e2": (4, 2), "mlx-q4-e3": (4, 3)}
LAYOUTS = ("hf-bf16", *_BITS)
_CHUNK_ELEMENTS = 1 << 24            # rows drawn at a time: ~64 MB of float32


class Spec(NamedTuple):
    """One random tensor: ``dist`` "normal" (a = std, b = mean), "uniform" (U(a, b)) or "log_uniform"
    (log U(a, b)); stored as bf16 unless ``float32``; ``zero_centred`` norms are applied as ``1 + w``."""
    name: str
    shape: tuple
    dist: str
    a: float
    b: float
    float32: bool = False
    zero_centred: bool = False


def _rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"qwenmetal-fixture/{int(seed)}/{name}".encode()).digest()
    return np.random.default_rng(np.frombuffer(digest[:16], dtype="<u4").astype(np.uint64))


def draw(spec: Spec, seed: int, dtype=np.float32) -> np.ndarray:
    """The values of `spec` for `seed`, drawn in float32 and stored as `dtype` (row chunks of one stream:
    the result does not depend on the chunking)."""
    rng = _rng(seed, spec.name)
    if spec.dist == "normal":
        out = np.empty(spec.shape, dtype)
        flat = out.reshape(-1, spec.shape[-1]) if len(spec.shape) > 1 else out.reshape(1, -1)
        step = max(1, _CHUNK_ELEMENTS // flat.shape[1])
        std, mean = np.float32(spec.a), np.float32(spec.b)
        for r0 in range(0, flat.shape[0], step):
            x = rng.standard_normal((min(step, flat.shape[0] - r0), flat.shape[1]), dtype=np.float32)
            flat[r0:r0 + len(x)] = x * std + mean
        return out
    x = rng.uniform(spec.a, spec.b, size=spec.shape).astype(np.float32)
    if spec.dist == "log_uniform":
        x = np.log(x).astype(np.float32)
    elif spec.dist != "uniform":
        raise ValueError(f"{spec.name}: unknown distribution {spec.dist!r}")
    return x.astype(dtype)


def _stored(spec: Spec, seed: int) -> np.ndarray:
    return draw(spec, seed, np.float32 if spec.float32 else BF16)


class Init(NamedTuple):
    """The scales of one weight initialisation (std of N(0, std) unless said otherwise)."""
    proj: Callable[[int], float]          # input-side projections, by fan-in
    residual: Callable[[int], float]      # projections that write into the residual stream, by fan-in
    embed: float
    lm_head: float | None                 # None: as an input-side projection
    router: float
    shared_gate: float
    a_log: tuple                          # A_log = log U(lo, hi)
    dt_bias: tuple                        # U(lo, hi)


def _clipped_fan_in(n: int) -> float:
    return min(0.1, max(0.02, 1.0 / n ** 0.5))


#: ``"fixture"``: every projection ~ N(0, 0.04), embeddings and lm_head ~ N(0, 0.05) -- the fixtures'
#: (and the benchmark's) weights, kept byte-stable. ``"reference"``: input-side projections and lm_head ~
#: N(0, clip(1/sqrt(fan_in), 0.02, 0.1)), residual-writing ones (``o_proj``, ``out_proj``, every
#: ``down_proj``) ~ N(0, 0.02), embeddings ~ N(0, 0.5), router ~ N(0, 0.3): each layer adds a modest update
#: to a residual stream that dominates, as in a trained pre-norm model. A random 4-layer model with larger
#: output projections is chaotic (a 0.4 % input perturbation grows to ~10 % in the logits), which would
#: make the reference's bf16-vs-fp32 comparisons meaningless.
INITS = {
    "fixture": Init(proj=lambda n: 0.04, residual=lambda n: 0.04, embed=0.05, lm_head=0.05, router=0.1, shared_gate=0.05,
                    a_log=(1.0, 16.0), dt_bias=(0.0, 1.0)),
    "reference": Init(proj=_clipped_fan_in, residual=lambda n: 0.02, embed=0.5, lm_head=None, router=0.3, shared_gate=0.1,
                      a_log=(1.0, 8.0), dt_bias=(-1.0, 1.0)),
}


def text_specs(c: ModelConfig, init: str = "fixture", mtp: bool = False) -> list[Spec]:
    """Every text-model tensor of `c` by logical name (Qwen3.5 naming, no prefix), with the scales of
    :data:`INITS` ``[init]``: fused ``experts.gate_up_proj`` ``[E, 2I, H]`` (rows ``[:I]`` gate), conv1d
    ``[C, 1, K]``, unshifted norms. ``mtp``: also the multi-token-prediction head (docs/model.md §2.5) under
    its HF names: ``mtp.fc.weight`` ``[H, 2H]`` (an input-side projection), the zero-centred
    ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden`` and ``mtp.norm``, and ``mtp.layers.0.*``, a
    full-attention layer with the MoE block drawn like a body layer."""
    H, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    nv, dv, K = c.linear_num_value_heads, c.linear_value_head_dim, c.linear_conv_kernel_dim
    E, I, S = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    try:
        sc = INITS[init]
    except KeyError:
        raise ValueError(f"unknown init {init!r}; inits: {sorted(INITS)}") from None
    out: list[Spec] = []

    def proj(name, shape, std=None):
        out.append(Spec(name, tuple(shape), "normal", sc.proj(shape[-1]) if std is None else std, 0.0))

    def resid(name, shape):
        proj(name, shape, sc.residual(shape[-1]))

    def zc_norm(name, n):
        out.append(Spec(name, (n,), "normal", 0.1, 0.0, zero_centred=True))

    def layer(p, full_attention, moe):
        zc_norm(p + "input_layernorm.weight", H)
        zc_norm(p + "post_attention_layernorm.weight", H)
        if full_attention:
            a = p + "self_attn."
            proj(a + "q_proj.weight", (nh * hd * (2 if c.attn_output_gate else 1), H))   # per head [query | gate]
            proj(a + "k_proj.weight", (nkv * hd, H))
            proj(a + "v_proj.weight", (nkv * hd, H))
            resid(a + "o_proj.weight", (H, nh * hd))
            zc_norm(a + "q_norm.weight", hd)
            zc_norm(a + "k_norm.weight", hd)
        else:
            g = p + "linear_attn."
            proj(g + "in_proj_qkv.weight", (c.conv_dim, H))
            proj(g + "in_proj_z.weight", (c.value_dim, H))
            proj(g + "in_proj_b.weight", (nv, H))
            proj(g + "in_proj_a.weight", (nv, H))
            out.append(Spec(g + "conv1d.weight", (c.conv_dim, 1, K), "normal", 0.3, 0.0))
            out.append(Spec(g + "dt_bias", (nv,), "uniform", *sc.dt_bias))
            out.append(Spec(g + "A_log", (nv,), "log_uniform", *sc.a_log, float32=True))
            out.append(Spec(g + "norm.weight", (dv,), "normal", 0.1, 1.0))
            resid(g + "out_proj.weight", (H, c.value_dim))
        m = p + "mlp."
        if moe:
            proj(m + "gate.weight", (E, H), sc.router)
            proj(m + "experts.gate_up_proj", (E, 2 * I, H))
            resid(m + "experts.down_proj", (E, H, I))
            if S > 0:
                proj(m + "shared_expert.gate_proj.weight", (S, H))
                proj(m + "shared_expert.up_proj.weight", (S, H))
                resid(m + "shared_expert.down_proj.weight", (H, S))
                proj(m + "shared_expert_gate.weight", (1, H), sc.shared_gate)
        else:
            proj(m + "gate_proj.weight", (c.intermediate_size, H))
            proj(m + "up_proj.weight", (c.intermediate_size, H))
            resid(m + "down_proj.weight", (H, c.intermediate_size))

    proj("embed_tokens.weight", (c.vocab_size, H), sc.embed)
    zc_norm("norm.weight", H)
    if not c.tie_word_embeddings:
        proj("lm_head.weight", (c.vocab_size, H), sc.lm_head)
    for i in range(c.num_hidden_layers):
        layer(f"layers.{i}.", c.is_full_attention(i), c.is_moe_layer(i))
    if mtp:
        proj("mtp.fc.weight", (H, 2 * H))
        zc_norm("mtp.pre_fc_norm_embedding.weight", H)
        zc_norm("mtp.pre_fc_norm_hidden.weight", H)
        zc_norm("mtp.norm.weight", H)
        layer("mtp.layers.0.", True, c.num_experts > 0)
    return out


def with_mtp(cfg: Mapping[str, Any]) -> dict:
    """`cfg` (a config.json dict) declaring one MTP layer: ``mtp_num_hidden_layers: 1`` in the text config
    (``text_config`` for ``qwen3_5_moe``), as the released configs have it."""
    cfg = json.loads(json.dumps(dict(cfg)))
    text = cfg["text_config"] if cfg.get("model_type") == "qwen3_5_moe" else cfg
    text.setdefault("mtp_num_hidden_layers", 1)
    if cfg.get("model_type") == "qwen3_5_moe":
        cfg["text_config"] = dict(sorted(text.items()))
        return cfg
    return dict(sorted(cfg.items()))


def _vision_specs(vc: Mapping[str, Any]) -> list[Spec]:
    """``model.visual.*`` of Qwen3_5MoeVisionModel (the engine ignores them; real checkpoints have them),
    named ``visual.*`` (the file key is ``model.`` + name)."""
    h, inter, m = vc["hidden_size"], vc["intermediate_size"], vc.get("spatial_merge_size", 2)
    ps, tps, ch = vc.get("patch_size", 16), vc.get("temporal_patch_size", 2), vc.get("in_channels", 3)
    out: list[Spec] = []

    def t(name, shape, std=0.02, mean=0.0):
        out.append(Spec("visual." + name, tuple(shape), "normal", std, mean))

    t("patch_embed.proj.weight", (h, ch, tps, ps, ps))
    t("patch_embed.proj.bias", (h,))
    t("pos_embed.weight", (vc["num_position_embeddings"], h))
    for i in range(vc["depth"]):
        b = f"blocks.{i}."
        for n in ("norm1", "norm2"):
            t(b + n + ".weight", (h,), 0.1, 1.0)
            t(b + n + ".bias", (h,))
        t(b + "attn.qkv.weight", (3 * h, h))
        t(b + "attn.qkv.bias", (3 * h,))
        t(b + "attn.proj.weight", (h, h))
        t(b + "attn.proj.bias", (h,))
        t(b + "mlp.linear_fc1.weight", (inter, h))
        t(b + "mlp.linear_fc1.bias", (inter,))
        t(b + "mlp.linear_fc2.weight", (h, inter))
        t(b + "mlp.linear_fc2.bias", (h,))
    merged = h * m * m
    t("merger.norm.weight", (h,), 0.1, 1.0)
    t("merger.norm.bias", (h,))
    t("merger.linear_fc1.weight", (merged, merged))
    t("merger.linear_fc1.bias", (merged,))
    t("merger.linear_fc2.weight", (vc["out_hidden_size"], merged))
    t("merger.linear_fc2.bias", (vc["out_hidden_size"],))
    return out


class _LastDrawn:
    """Remembers the last tensor drawn: mlx-lm's sanitize reads the fused ``gate_up_proj`` twice (gate
    half, then up half), and the writer asks for them one after the other."""

    def __init__(self, seed: int):
        self.seed, self.key, self.val = seed, None, None

    def __call__(self, spec: Spec) -> np.ndarray:
        if self.key != spec.name:
            self.key, self.val = None, None          # drop the previous one before drawing the next
            self.val, self.key = _stored(spec, self.seed), spec.name
        return self.val


def _lazy(spec: Spec, get: Callable[[Spec], np.ndarray]) -> _convert.Lazy:
    return _convert.Lazy(spec.shape, np.float32 if spec.float32 else BF16, lambda: get(spec))


def _fuse_qwen3_next_gdn(W: dict, prefix: str, c: ModelConfig) -> None:
    """Replace in_proj_{qkv,z,b,a} by Qwen3-Next's fused in_proj_qkvz / in_proj_ba, grouped per k-head:
    k-head g holds [q_g | k_g | v_{g*r..g*r+r-1} | z_{same}] and [b_{same} | a_{same}], r = nv / nk."""
    nk, dk, nv, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_num_value_heads, c.linear_value_head_dim
    r, H = nv // nk, c.hidden_size
    qkv, z = W.pop(prefix + "in_proj_qkv.weight"), W.pop(prefix + "in_proj_z.weight")
    b, a = W.pop(prefix + "in_proj_b.weight"), W.pop(prefix + "in_proj_a.weight")

    def qkvz():
        x = qkv.load()
        q = x[:nk * dk].reshape(nk, dk, H)
        k = x[nk * dk:2 * nk * dk].reshape(nk, dk, H)
        v = x[2 * nk * dk:].reshape(nk, r * dv, H)
        return np.concatenate([q, k, v, z.load().reshape(nk, r * dv, H)], axis=1).reshape(-1, H)

    def ba():
        return np.concatenate([b.load().reshape(nk, r, H), a.load().reshape(nk, r, H)], axis=1).reshape(-1, H)

    W[prefix + "in_proj_qkvz.weight"] = _convert.Lazy((qkv.shape[0] + z.shape[0], H), qkv.dtype, qkvz)
    W[prefix + "in_proj_ba.weight"] = _convert.Lazy((2 * nv, H), b.dtype, ba)


def _split_experts(W: dict, m: str, c: ModelConfig) -> None:
    """Qwen3-Next keeps one tensor per expert: ``experts.{e}.{gate,up,down}_proj.weight``."""
    I = c.moe_intermediate_size
    gate_up, down = W.pop(m + "experts.gate_up_proj"), W.pop(m + "experts.down_proj")
    for e in range(c.num_experts):
        for n, src, rows in (("gate_proj", gate_up, slice(0, I)), ("up_proj", gate_up, slice(I, 2 * I)),
                             ("down_proj", down, slice(None))):
            shape = (I if n != "down_proj" else src.shape[1], src.shape[-1])
            W[f"{m}experts.{e}.{n}.weight"] = _convert.Lazy(
                shape, src.dtype, lambda src=src, e=e, rows=rows: np.ascontiguousarray(src.load()[e, rows]))


def check_supported(cfg: Mapping[str, Any], c: ModelConfig) -> None:
    """ValueError unless the real layouts (transformers / mlx-lm) can hold this config's model."""
    text = cfg.get("text_config", cfg) if cfg["model_type"] == "qwen3_5_moe" else cfg
    if text.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported by the checkpoint writer")
    if not c.attn_output_gate:
        raise ValueError("attn_output_gate=false is not supported (these models always gate attention)")
    if c.num_experts and c.shared_expert_intermediate_size <= 0:
        raise ValueError("MoE layers need shared_expert_intermediate_size > 0")


def _hf_lazy(cfg: dict, seed: int, mtp: bool = False) -> dict[str, _convert.Lazy]:
    c = ModelConfig.from_dict(cfg)
    check_supported(cfg, c)
    fam = _convert.family(cfg)
    get = _LastDrawn(int(seed))
    W = {s.name: _lazy(s, get) for s in text_specs(c, mtp=mtp)}
    if fam == "qwen3_next":
        for i in c.linear_attention_layers:
            _fuse_qwen3_next_gdn(W, f"layers.{i}.linear_attn.", c)
        for i in range(c.num_hidden_layers):
            if c.is_moe_layer(i):
                _split_experts(W, f"layers.{i}.mlp.", c)
        if mtp and c.num_experts > 0:
            _split_experts(W, "mtp.layers.0.mlp.", c)
    prefix = "model.language_model." if cfg["model_type"] == "qwen3_5_moe" else "model."
    # lm_head and the MTP head are top-level keys in both families' HF checkpoints
    out = {(k if k == "lm_head.weight" or k.startswith("mtp.") else prefix + k): v for k, v in W.items()}
    if cfg["model_type"] == "qwen3_5_moe" and cfg.get("vision_config"):
        out.update({"model." + s.name: _lazy(s, get) for s in _vision_specs(cfg["vision_config"])})
    return out


def hf_tensors(cfg: Mapping[str, Any], seed: int = 0, mtp: bool = False) -> dict[str, np.ndarray]:
    """The tensors of the ``hf-bf16`` layout by file key: for ``qwen3_5_moe`` (nested ``text_config``)
    ``Qwen3_5MoeForConditionalGeneration``'s (``model.language_model.*``, ``lm_head.weight``,
    ``model.visual.*`` with a ``vision_config``), for ``qwen3_5_moe_text`` ``Qwen3_5MoeForCausalLM``'s,
    both with fused experts; for ``qwen3_next`` ``Qwen3NextForCausalLM``'s (fused ``in_proj_qkvz`` /
    ``in_proj_ba``, per-expert keys). ``mtp``: with the ``mtp.*`` head (see :func:`text_specs`)."""
    return _convert.materialize(_hf_lazy(dict(cfg), seed, mtp))


def _mlx_lazy(cfg: dict, layout: str, seed: int, mtp: bool = False, vision: bool = False):
    if layout not in _BITS:
        raise ValueError(f"unknown format {layout!r}; formats: {LAYOUTS}")
    bits, expert_bits = _BITS[layout]
    if vision and not cfg.get("vision_config"):
        raise ValueError("vision=True needs a config with a vision_config (e.g. the 'tiny-vl' preset)")
    return _convert.mlx_build(_hf_lazy(cfg, seed, mtp), cfg, bits, 64, expert_bits, keep_mtp=mtp, keep_vision=vision)


def mlx_tensors(cfg: Mapping[str, Any], layout: str = "mlx-q4", seed: int = 0, mtp: bool = False,
                vision: bool = False) -> dict[str, np.ndarray]:
    """The tensors of an MLX layout (``mlx-bf16``, ``mlx-q{2,3,4,5,6,8}``, ``mlx-q4-e{2,3}``:
    ``mlx_lm.convert`` of the ``hf-bf16`` tensors, g64) by file key. ``mtp``: with the MTP head kept
    (``convert(..., keep_mtp=True)``). ``vision``: with the vision tower kept in mlx-vlm's layout
    (``vision_tower.*``, unquantized; what ``convert`` writes by default)."""
    return _convert.materialize(_mlx_lazy(dict(cfg), layout, seed, mtp, vision)[0])


def canonical_params(c: ModelConfig, seed: int = 0, init: str = "fixture", mtp: bool = False) -> dict[str, np.ndarray]:
    """The float32 draws of :func:`text_specs` ``(c, init)`` (a checkpoint's values before their bf16
    rounding) under the engine's canonical
    names (:mod:`qwenmetal.weights`): norms shifted to ``1 + w``, conv1d ``[C, K]``, experts as
    ``switch_mlp.{gate,up,down}_proj``. Any config the engine accepts (no output gate, no shared expert,
    tied embeddings too). ``mtp``: also the MTP head's, as ``mtp.`` + the names of ``Weights.mtp``."""
    P: dict[str, np.ndarray] = {}
    for s in text_specs(c, init, mtp):
        x = draw(s, seed)
        name = s.name[:-len(".weight")] if s.name.endswith(".weight") else s.name
        if s.zero_centred:
            x += np.float32(1.0)
        if name.endswith(".conv1d"):
            x = x[:, 0, :]
        if name.endswith(".experts.gate_up_proj"):
            I = x.shape[1] // 2
            base = name[:-len("experts.gate_up_proj")] + "switch_mlp."
            P[base + "gate_proj"], P[base + "up_proj"] = x[:, :I], x[:, I:]
            continue
        if name.endswith(".experts.down_proj"):
            name = name[:-len("experts.down_proj")] + "switch_mlp.down_proj"
        P[name] = x
    return {k: np.ascontiguousarray(v) for k, v in P.items()}


def write_checkpoint(dest: str | os.PathLike, cfg: Mapping[str, Any], layout: str = "mlx-q4", seed: int = 0,
                     files: Mapping[str, str] | None = None, max_shard_bytes: int = _convert.MAX_SHARD_BYTES,
                     progress: bool = False, mtp: bool = False, vision: bool = False) -> Path:
    """Write the random checkpoint of config.json dict `cfg` in `layout` (one of :data:`LAYOUTS`) at
    `dest` (absent or an empty directory), plus `files` (name -> text: tokenizer, generation config,
    ...; as in ``mlx_lm.convert``, a ``generation_config.json`` among them sets an MLX config.json's
    ``eos_token_id``). Weights are streamed into shards of at most `max_shard_bytes` (more than one:
    ``model-0000i-of-0000n.safetensors`` and an index, in save_pretrained's / mlx-lm's naming); the
    directory appears atomically. Returns `dest`. Same arguments -> byte-identical files. ``mtp``: with
    random ``mtp.*`` weights (kept in the MLX layouts too) and ``mtp_num_hidden_layers: 1`` in config.json
    (:func:`with_mtp`). ``vision``: the MLX layouts keep the vision tower as mlx-vlm's conversion does
    (``vision_tower.*``, bf16, patch embed channels-last, ``vision_config`` in config.json); without it they
    drop it as mlx-lm does. The ``hf-bf16`` layout has the tower whenever the config has a vision_config."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown format {layout!r}; formats: {LAYOUTS}")
    cfg = with_mtp(cfg) if mtp else json.loads(json.dumps(dict(cfg)))
    files = dict(files or {})
    hf_cfg_text = json.dumps(cfg, indent=2, sort_keys=True) + "\n"
    gen = json.loads(files.get("generation_config.json", "{}"))
    if layout == "hf-bf16":
        w, quant = _hf_lazy(cfg, seed, mtp), None
    else:
        w, quant = _mlx_lazy(cfg, layout, seed, mtp, vision)
    with atomic_dir(dest) as tmp:
        if layout == "hf-bf16":
            _write_hf_weights(tmp, w, max_shard_bytes)
            (tmp / "config.json").write_text(hf_cfg_text, encoding="utf-8")
        else:
            _convert.write_mlx_checkpoint(tmp, w, quant, hf_cfg_text, gen, max_shard_bytes, progress)
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
    return Path(dest)


def _write_hf_weights(d: Path, w: Mapping[str, _convert.Lazy], max_shard_bytes: int) -> None:
    """``save_pretrained``'s files: ``model.safetensors`` (format "pt"), or shards and an index."""
    shards = _convert._shard(w, max_shard_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fn, keys in zip(names, shards):
        with _convert.SafetensorsWriter(d / fn, {k: (w[k].dtype, w[k].shape) for k in keys},
                                        metadata={"format": "pt"}) as out:
            for k in sorted(keys):
                out.write(k, w[k].load())
        os.chmod(d / fn, 0o644)
    if len(shards) > 1:
        index = {"metadata": {"total_size": int(sum(v.nbytes for v in w.values()))},
                 "weight_map": {k: fn for fn, keys in zip(names, shards) for k in sorted(keys)}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n",
                                                        encoding="utf-8")

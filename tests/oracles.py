"""External oracles for qwenmetal's reference forward pass: HF transformers and mlx-lm.

Helper module (not a test file). It builds tiny random ``qwen3_5_moe`` / ``qwen3_next`` models with
transformers, saves them the way real checkpoints are saved, converts them with ``mlx_lm.convert``, and
runs prefill + greedy decode in both peers, returning float32 numpy logits.

Everything that works around a peer's limitation lives here (or in the tests' hypothesis filters), not in
the package:

* transformers 5 saves ``Qwen3_5MoeForCausalLM`` with ``model_type: qwen3_5_moe_text``; mlx-lm has no module of
  that name.  :func:`mlx_convert` wraps such a config the way the published multimodal checkpoint is laid out
  (``{"model_type": "qwen3_5_moe", "text_config": {...}}``). The main fixtures instead save a real
  ``Qwen3_5MoeForConditionalGeneration`` (:func:`save_hf_conditional`) and convert that, as mlx-community does.
* mlx-lm's ``qwen3_5_moe`` sanitize only knows the fused expert keys -> save with ``save_original_format=False``.
  mlx-lm's ``qwen3_next`` sanitize only knows per-expert keys -> save in the original (default) format; it
  also returns early (skipping the conv1d transpose and norm shift) when no layer is MoE.
* mlx-lm's ``qwen3_next`` ModelArgs needs top-level ``rope_theta`` / ``partial_rotary_factor`` (transformers 5
  nests them in ``rope_parameters``); both mlx-lm models read ``full_attention_interval`` and ignore
  ``layer_types``, so the interval is written too (a ``layer_types`` list that is not periodic is refused).
  mlx-lm also takes its GDN mask from layer 0's cache, so layer 0 must be a GDN layer (interval >= 2).
* mlx-lm's quant_predicate forces the router / shared_expert_gate to 8-bit g64 whatever the group size, so
  hidden_size must be a multiple of 64 for a quantized conversion.
* transformers' hybrid cache cannot run a model without any full-attention layer.
* mlx-lm's ``load`` needs a tokenizer; a 256-token byte-level one is written next to every model.
* mlx-lm CPU cannot run unquantized bf16 MoE (GatherMM is float32 only): :func:`mlx_load_f32` casts every
  floating parameter (incl. quantization scales/biases, exact from bf16) to float32.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import numpy as np

KINDS = ("qwen3_5_moe", "qwen3_next")
LINEAR, FULL = "linear_attention", "full_attention"

# Tiny dims; every linear's input dim (hidden 128, q-heads*head_dim 128, value_dim 128, moe/shared
# intermediate 64, dense intermediate 128) is a multiple of 64 so that 4-bit g64 quantization covers
# every linear, as in the real checkpoint.
BASE_TEXT = dict(
    vocab_size=256,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    layer_types=[LINEAR, LINEAR, LINEAR, FULL],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    eos_token_id=0,
)
NEXT_EXTRA = dict(intermediate_size=128, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])

# Zero-centred RMSNorm weights (applied as 1 + w). Everything else named "*norm*" is a plain weight.
_ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                 "k_norm.weight")


# ------------------------------------------------------------------------------------------------
# torch side
# ------------------------------------------------------------------------------------------------
def _torch():
    import torch
    torch.set_num_threads(2)
    return torch


def make_config(kind: str, cfg_overrides: dict | None = None):
    """transformers config object of ``kind`` with the tiny base dims and overrides applied."""
    d = copy.deepcopy(BASE_TEXT)
    if kind == "qwen3_next":
        d.update(copy.deepcopy(NEXT_EXTRA))
    elif kind != "qwen3_5_moe":
        raise ValueError(kind)
    ov = copy.deepcopy(cfg_overrides or {})
    if "rope_parameters" in ov:
        d["rope_parameters"] = {**d["rope_parameters"], **ov.pop("rope_parameters")}
    if "full_attention_interval" in ov:
        d.pop("layer_types", None)
    d.update(ov)
    if "layer_types" in d and d["layer_types"] is not None and len(d["layer_types"]) != d["num_hidden_layers"]:
        d.pop("layer_types")  # num_hidden_layers overridden alone: fall back to the interval rule
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig
        return Qwen3NextConfig(**d)
    from transformers import Qwen3_5MoeTextConfig
    return Qwen3_5MoeTextConfig(**d)


def _bf16_round_(t):
    t.copy_(t.to(_torch().bfloat16).to(t.dtype))


def randomize_(model, seed: int = 0):
    """Re-randomise every parameter so the comparison is strong, then round it to bf16-representable values.

    * linears / experts ~ N(0, 1/sqrt(fan_in)) (router x2 so top-k choices have clear margins),
      embedding ~ N(0, 1) (N(0, 1/sqrt(hidden)) when tied to the lm_head);
    * zero-centred norms: w = bf16(1 + N(0, 0.1)) - 1, so that both w (HF) and 1 + w (MLX stores the shifted
      weight, computed in the file's dtype) are exactly representable in bf16;
    * gated GDN norm 1 + N(0, 0.1); conv1d ~ N(0, 0.5); dt_bias ~ N(0, 0.5); A = exp(A_log) ~ U(0.05, 2).
    """
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            shape = tuple(p.shape)
            if name.endswith(_ZERO_CENTRED) or name.endswith("model.norm.weight"):
                v = normal(shape, 0.1, 1.0).to(torch.bfloat16).to(torch.float32) - 1.0
            elif name.endswith("linear_attn.norm.weight"):
                v = normal(shape, 0.1, 1.0)
            elif name.endswith("A_log"):
                v = torch.empty(shape).uniform_(0.05, 2.0, generator=g).log()
            elif name.endswith("dt_bias"):
                v = normal(shape, 0.5)
            elif "conv1d" in name:
                v = normal(shape, 0.5)
            elif "embed_tokens" in name:  # tied: it is the lm_head too, keep logits O(1)
                v = normal(shape, shape[-1] ** -0.5 if tied else 1.0)
            elif name.endswith("mlp.gate.weight"):
                v = normal(shape, 2.0 / shape[-1] ** 0.5)
            else:
                assert len(shape) >= 2, name
                v = normal(shape, 1.0 / shape[-1] ** 0.5)
            p.copy_(v)
            _bf16_round_(p)
    return model


def hf_model(kind: str, cfg_overrides: dict | None = None, seed: int = 0):
    """A random float32 ``Qwen3_5MoeForCausalLM`` (kind ``qwen3_5_moe``) or ``Qwen3NextForCausalLM``."""
    torch = _torch()
    torch.manual_seed(seed)
    cfg = make_config(kind, cfg_overrides)
    if kind == "qwen3_next":
        from transformers import Qwen3NextForCausalLM as cls
    else:
        from transformers import Qwen3_5MoeForCausalLM as cls
    cfg._attn_implementation = "eager"
    model = cls(cfg).to(torch.float32).eval()
    randomize_(model, seed)
    return model


def write_tokenizer(out_dir) -> None:
    """A byte-level tokenizer of exactly 256 tokens (ids 0..255 = bytes; eos = byte 0) for loaders that need one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # GPT-2 byte order: id == byte value
    from qwenmetal.tokenizer import bytes_to_unicode
    byte_to_char = bytes_to_unicode()
    assert set(byte_to_char.values()) == set(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=byte_to_char[0], pad_token=byte_to_char[0])
    fast.save_pretrained(str(out_dir))


def _interval_of(layer_types) -> int | None:
    """The full_attention_interval that produces ``layer_types`` (mlx-lm's only schedule), or None."""
    n = len(layer_types)
    for k in range(1, n + 2):
        if list(layer_types) == [FULL if (i + 1) % k == 0 else LINEAR for i in range(n)]:
            return k
    return None


def save_hf(model, out_dir, dtype: str = "bfloat16", fused_experts: bool | None = None) -> Path:
    """``save_pretrained`` into ``out_dir`` (+ tokenizer) as a real checkpoint would be saved.

    ``dtype`` "bfloat16" is lossless for models from :func:`hf_model` (all weights bf16-representable).
    ``fused_experts``: qwen3_5_moe defaults to the fused expert tensors (``save_original_format=False``:
    the layout of the published checkpoint and the one mlx-lm's sanitize accepts); qwen3_next to per-expert
    keys (its published layout, and the only one mlx-lm's qwen3_next sanitize accepts).
    For qwen3_next, top-level ``rope_theta`` / ``partial_rotary_factor`` are added for mlx-lm.
    """
    torch = _torch()
    out_dir = Path(out_dir)
    kind = model.config.model_type
    if fused_experts is None:
        fused_experts = kind != "qwen3_next"
    tdtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    orig = next(model.parameters()).dtype
    model.to(tdtype)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):  # real checkpoints keep A_log in float32 (mlx-lm's cast_predicate too)
            p.data = p.data.to(torch.float32)
    try:
        model.save_pretrained(str(out_dir), save_original_format=not fused_experts)
    finally:
        model.to(orig)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rp = cfg.get("rope_parameters") or {}
    if kind == "qwen3_next":
        cfg.setdefault("rope_theta", rp.get("rope_theta", 10000.0))
        cfg.setdefault("partial_rotary_factor", rp.get("partial_rotary_factor", 1.0))
    k = _interval_of(cfg["layer_types"])
    if k is not None:
        cfg.setdefault("full_attention_interval", k)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    write_tokenizer(out_dir)
    return out_dir


def save_hf_conditional(model, out_dir, dtype: str = "bfloat16", fused_experts: bool = True) -> Path:
    """Save a ``Qwen3_5MoeForCausalLM`` from :func:`hf_model` as the published multimodal checkpoint would be:
    a ``Qwen3_5MoeForConditionalGeneration`` (``model_type: qwen3_5_moe`` + ``text_config``, keys
    ``model.language_model.*``, a tiny random vision tower under ``model.visual.*``) holding the same text
    weights, fused experts by default (docs/model.md §2.1). Its text logits equal the causal model's."""
    torch = _torch()
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    assert model.config.model_type == "qwen3_5_moe_text", model.config.model_type
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2,
                  out_hidden_size=model.config.hidden_size, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, num_position_embeddings=16)
    text = model.config.to_dict()
    cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision,
                           tie_word_embeddings=model.config.tie_word_embeddings)
    cg = Qwen3_5MoeForConditionalGeneration(cfg).to(torch.float32).eval()
    cg.model.language_model.load_state_dict(model.model.state_dict())
    cg.lm_head.load_state_dict(model.lm_head.state_dict())
    with torch.no_grad():
        for p in cg.model.visual.parameters():
            _bf16_round_(p)
    out_dir = Path(out_dir)
    tdtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    cg.to(tdtype)
    for name, p in cg.named_parameters():
        if name.endswith("A_log"):
            p.data = p.data.to(torch.float32)
    cg.save_pretrained(str(out_dir), save_original_format=not fused_experts)
    write_tokenizer(out_dir)
    return out_dir


def hf_logits(model, ids, n_decode: int):
    """Prefill ``ids`` (one forward with a cache) then ``n_decode`` greedy steps with the cache.

    Returns (prefill_logits [L, V], decode_logits [n_decode, V], greedy tokens [n_decode]) as float32 numpy.
    ``decode_logits[j]`` are the logits after feeding ``tokens[j]`` (``tokens[0]`` = argmax of the last prefill
    row), so ``tokens[j+1] = argmax(decode_logits[j])``.
    """
    torch = _torch()
    ids = [int(t) for t in ids]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        cache = out.cache
        pre = out.logits[0].float().numpy().copy()
        nxt = int(pre[-1].argmax())
        toks, dec = [], []
        for _ in range(n_decode):
            toks.append(nxt)
            out = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True)
            cache = out.cache
            row = out.logits[0, -1].float().numpy().copy()
            dec.append(row)
            nxt = int(row.argmax())
    dec = np.stack(dec) if dec else np.zeros((0, pre.shape[-1]), np.float32)
    return pre.astype(np.float32), dec.astype(np.float32), np.array(toks, dtype=np.int64)


def hf_full_logits(model, ids):
    """Logits of one cache-free forward over ``ids`` ([L, V] float32)."""
    torch = _torch()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[int(t) for t in ids]]), use_cache=False)
    return out.logits[0].float().numpy().astype(np.float32)


# ------------------------------------------------------------------------------------------------
# mlx side
# ------------------------------------------------------------------------------------------------
def _mlx_ready_hf_copy(hf_dir: Path, work: Path) -> Path:
    """A copy of ``hf_dir`` whose config.json mlx-lm can read (see the module docstring)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    mt = cfg.get("model_type")
    if _interval_of(cfg.get("layer_types") or []) is None and "layer_types" in cfg:
        raise ValueError(f"mlx-lm only supports periodic layer schedules, got {cfg['layer_types']}")
    if mt == "qwen3_5_moe_text":
        text = dict(cfg)
        cfg = {
            "model_type": "qwen3_5_moe",
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "text_config": text,
            "tie_word_embeddings": text.get("tie_word_embeddings", False),
            "dtype": text.get("dtype"),
        }
        if text.get("eos_token_id") is not None:
            cfg["eos_token_id"] = text["eos_token_id"]
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(hf_dir, work)
    (work / "config.json").write_text(json.dumps(cfg, indent=2))
    return work


def mlx_convert(hf_dir, out_dir, q_bits: int | None = 4, group_size: int = 64, dtype: str | None = None) -> Path:
    """``mlx_lm.convert`` of an HF directory from :func:`save_hf`.

    ``q_bits`` None -> unquantized conversion (``dtype`` defaults to float32); otherwise quantized with mlx-lm's
    own predicate (router / shared_expert_gate 8-bit) and ``dtype`` default bfloat16, i.e. bf16 scales/biases as
    a real ``mlx_lm.convert -q`` of a bf16 checkpoint writes them.
    """
    import contextlib
    import io

    from mlx_lm import convert

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if dtype is None:
        dtype = "float32" if q_bits is None else "bfloat16"
    src = _mlx_ready_hf_copy(hf_dir, out_dir.parent / (out_dir.name + ".hf-src"))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    kw = dict(quantize=q_bits is not None, dtype=dtype)
    if q_bits is not None:
        kw.update(q_bits=q_bits, q_group_size=group_size)
    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(src), str(out_dir), **kw)
    shutil.rmtree(src)
    return out_dir


def mlx_load_f32(mlx_dir):
    """``mlx_lm.load`` and cast every floating parameter (incl. quantization scales/biases) to float32."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm import load

    model, _tok = load(str(mlx_dir))
    model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    mx.eval(model.parameters())
    return model


def mlx_logits(mlx_dir_or_model, ids, n_decode: int):
    """mlx-lm float32 prefill over ``ids`` with a prompt cache (logits at all positions), then ``n_decode``
    greedy decode steps. Same return convention as :func:`hf_logits`."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model = mlx_dir_or_model if not isinstance(mlx_dir_or_model, (str, os.PathLike)) \
        else mlx_load_f32(mlx_dir_or_model)
    cache = make_prompt_cache(model)
    out = model(mx.array([[int(t) for t in ids]]), cache=cache)
    pre = np.array(out[0].astype(mx.float32))
    nxt = int(pre[-1].argmax())
    toks, dec = [], []
    for _ in range(n_decode):
        toks.append(nxt)
        out = model(mx.array([[nxt]]), cache=cache)
        row = np.array(out[0, -1].astype(mx.float32))
        dec.append(row)
        nxt = int(row.argmax())
    dec = np.stack(dec) if dec else np.zeros((0, pre.shape[-1]), np.float32)
    return pre.astype(np.float32), dec.astype(np.float32), np.array(toks, dtype=np.int64)


# ------------------------------------------------------------------------------------------------
# qwenmetal side
# ------------------------------------------------------------------------------------------------
def qm_logits(model, ids, n_decode: int, forced_tokens=None):
    """qwenmetal prefill (all positions) + decode. ``forced_tokens`` (e.g. the oracle's greedy tokens) are fed
    instead of qwenmetal's own argmax so that one early flip does not cascade; the own greedy tokens are
    still returned for the identity check."""
    s = model.new_session()
    pre = np.asarray(model.prefill(s, [int(t) for t in ids], return_logits="all"), dtype=np.float32)
    nxt = int(pre[-1].argmax())
    toks, dec = [], []
    for j in range(n_decode):
        toks.append(nxt)
        feed = nxt if forced_tokens is None else int(forced_tokens[j])
        row = np.asarray(model.decode_step(s, feed), dtype=np.float32)
        dec.append(row)
        nxt = int(row.argmax())
    dec = np.stack(dec) if dec else np.zeros((0, pre.shape[-1]), np.float32)
    return pre, dec, np.array(toks, dtype=np.int64)


def prompt(n: int, vocab: int, seed: int = 1234):
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


def describe_diff(name, got, want) -> str:
    """A precise description of where ``got`` and ``want`` diverge (for assertion messages)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return f"{name}: shape {got.shape} != {want.shape}"
    d = np.abs(got - want)
    if d.size == 0:
        return f"{name}: empty"
    flat = int(d.argmax())
    idx = np.unravel_index(flat, d.shape)
    msg = f"{name}: max|diff| {d.max():.3e} at {tuple(int(i) for i in idx)} (got {got[idx]:.6f}, want {want[idx]:.6f})"
    if d.ndim == 2:
        per_row = d.max(axis=1)
        first = int(np.argmax(per_row > 1e-4)) if (per_row > 1e-4).any() else None
        msg += f"; per-position max {np.array2string(per_row, precision=1, max_line_width=10**6)}"
        if first is not None:
            msg += f"; first position over 1e-4: {first}"
    return msg


# ------------------------------------------------------------------------------------------------
# test plumbing
# ------------------------------------------------------------------------------------------------
def require(module_name: str):
    """Import an optional test dependency: in CI (``CI=true``) a missing one is an error (the test fails
    with the ImportError); elsewhere the calling test module / test is skipped."""
    import importlib

    if os.environ.get("CI") == "true":
        return importlib.import_module(module_name)
    import pytest
    return pytest.importorskip(module_name)


def unavailable(reason: str):
    """An external tool or oracle is missing, or too old for the test (a class, function or option it
    lacks): in CI (``CI=true``) the test fails with ``reason``, so a version drift cannot silently drop an
    oracle; elsewhere it is skipped."""
    import pytest

    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


PROMPT_LEN, N_DECODE = 32, 16

# HF on-disk layouts exercised per kind. "causal": what *ForCausalLM.save_pretrained writes;
# "conditional": the published Qwen3.5/3.6 multimodal checkpoint layout.
HF_LAYOUTS = {
    "qwen3_5_moe": ("causal-fused", "causal-per-expert", "causal-f32", "conditional"),
    "qwen3_next": ("causal", "causal-f32"),
}


class OracleCache:
    """Lazily builds and caches (per test session) the random models, their checkpoints and the peers'
    outputs. All directories live under ``root``."""

    def __init__(self, root):
        self.root = Path(root)
        self._hf, self._dirs, self._mlx = {}, {}, {}

    def hf(self, kind: str):
        """namespace(kind, model, ids, pre [L,V], dec [N,V], toks [N]) of the random HF model of ``kind``."""
        if kind not in self._hf:
            from types import SimpleNamespace

            model = hf_model(kind, seed=0)
            ids = prompt(PROMPT_LEN, model.config.vocab_size, seed=1234)
            pre, dec, toks = hf_logits(model, ids, N_DECODE)
            self._hf[kind] = SimpleNamespace(kind=kind, model=model, ids=ids, pre=pre, dec=dec, toks=toks)
        return self._hf[kind]

    def hf_dir(self, kind: str, layout: str) -> Path:
        key = ("hf", kind, layout)
        if key not in self._dirs:
            assert layout in HF_LAYOUTS[kind], (kind, layout)
            model = self.hf(kind).model
            d = self.root / f"hf-{kind}-{layout}"
            if layout == "conditional":
                save_hf_conditional(model, d)
            else:
                save_hf(model, d, dtype="float32" if layout.endswith("f32") else "bfloat16",
                        fused_experts=(layout == "causal-fused") if kind == "qwen3_5_moe" else False)
            self._dirs[key] = d
        return self._dirs[key]

    def mlx_dir(self, kind: str, q_bits: int | None, group_size: int = 64) -> Path:
        """mlx_lm.convert output of the random model of ``kind`` (qwen3_5_moe converted from the published
        multimodal layout, as mlx-community does)."""
        key = ("mlx", kind, q_bits, group_size)
        if key not in self._dirs:
            src = self.hf_dir(kind, "conditional" if kind == "qwen3_5_moe" else "causal")
            d = self.root / f"mlx-{kind}-{'q%d-g%d' % (q_bits, group_size) if q_bits else 'f32'}"
            mlx_convert(src, d, q_bits=q_bits, group_size=group_size)
            self._dirs[key] = d
        return self._dirs[key]

    def mlx(self, kind: str, q_bits: int | None, group_size: int = 64):
        """namespace(dir, pre, dec, toks): mlx-lm float32 outputs on the converted checkpoint."""
        key = (kind, q_bits, group_size)
        if key not in self._mlx:
            from types import SimpleNamespace

            d = self.mlx_dir(kind, q_bits, group_size)
            ids = self.hf(kind).ids
            pre, dec, toks = mlx_logits(d, ids, N_DECODE)
            self._mlx[key] = SimpleNamespace(dir=d, ids=ids, pre=pre, dec=dec, toks=toks)
        return self._mlx[key]


def random_config_strategy(kinds=KINDS, periodic_only: bool = False):
    """Hypothesis strategy of (kind, cfg_overrides, prompt_len, seed) over small configs of ``kinds``. ``periodic_only``:
    layer schedules given by ``full_attention_interval`` only (all mlx-lm supports)."""
    from hypothesis import strategies as st

    @st.composite
    def configs(draw):
        kind = draw(st.sampled_from(list(kinds)))
        n_layers = draw(st.integers(2, 5))
        # at least one full-attention layer: HF's hybrid cache cannot run an all-GDN model
        if periodic_only or draw(st.booleans()):
            sched = {"full_attention_interval": draw(st.integers(1, n_layers))}
        else:
            types = draw(st.lists(st.sampled_from(["linear_attention", "full_attention"]),
                                  min_size=n_layers, max_size=n_layers))
            if "full_attention" not in types:
                types[draw(st.integers(0, n_layers - 1))] = "full_attention"
            sched = {"layer_types": types}
        kv = draw(st.sampled_from([1, 2, 4]))
        head_dim = draw(st.sampled_from([16, 32, 64]))
        nk = draw(st.sampled_from([1, 2, 4]))
        n_exp = draw(st.sampled_from([4, 8, 16]))
        ov = dict(
            hidden_size=draw(st.sampled_from([64, 96, 128])),
            num_hidden_layers=n_layers,
            num_key_value_heads=kv,
            num_attention_heads=kv * draw(st.sampled_from([1, 2, 4])),
            head_dim=head_dim,
            rope_parameters={"rope_theta": draw(st.sampled_from([1e4, 1e6])),
                             "partial_rotary_factor": draw(st.sampled_from([0.25, 0.5, 1.0]))},
            linear_num_key_heads=nk,
            linear_num_value_heads=nk * draw(st.sampled_from([1, 2, 4])),
            linear_key_head_dim=draw(st.sampled_from([16, 32])),
            linear_value_head_dim=draw(st.sampled_from([16, 32])),
            linear_conv_kernel_dim=draw(st.sampled_from([2, 3, 4])),
            num_experts=n_exp,
            num_experts_per_tok=draw(st.integers(1, min(n_exp, 6))),
            moe_intermediate_size=draw(st.sampled_from([32, 64])),
            shared_expert_intermediate_size=draw(st.sampled_from([32, 64])),
            vocab_size=draw(st.sampled_from([128, 200])),
            tie_word_embeddings=draw(st.sampled_from([False, False, False, True])),
            **sched,
        )
        if kind == "qwen3_next":
            ov["norm_topk_prob"] = draw(st.booleans())
            ov["mlp_only_layers"] = sorted(draw(st.sets(st.integers(0, n_layers - 1), max_size=2)))
            ov["intermediate_size"] = draw(st.sampled_from([64, 96]))
            ov["decoder_sparse_step"] = draw(st.sampled_from([1, 1, 2]))
        n_prompt = draw(st.integers(1, 12))
        seed = draw(st.integers(0, 2**16))
        return kind, ov, n_prompt, seed

    return configs()


def assert_close(name, got, want, atol):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{name}: non-finite values at {np.argwhere(~np.isfinite(got))[:5].tolist()}"
    err = float(np.abs(got.astype(np.float64) - want).max()) if got.size else 0.0
    assert err <= atol, describe_diff(name, got, want)
    return err


def assert_same_greedy(name, got_toks, want_toks, want_rows, margin: float = 0.0):
    """Greedy tokens identical. With ``margin`` > 0 a differing step is tolerated only when the oracle's own
    top-2 logits at that step are closer than ``margin`` (a genuine near-tie)."""
    got_toks, want_toks = np.asarray(got_toks), np.asarray(want_toks)
    for j, (g, w) in enumerate(zip(got_toks.tolist(), want_toks.tolist())):
        if g == w:
            continue
        row = np.sort(np.asarray(want_rows[j], np.float64))
        gap = row[-1] - row[-2]
        assert gap < margin, (f"{name}: greedy token {j} is {g}, oracle chose {w} "
                              f"(oracle top-2 gap {gap:.2e}); got {got_toks.tolist()} want {want_toks.tolist()}")


def greedy_rows(pre, dec):
    """The logit rows the greedy tokens were taken from: last prefill row, then each decode row but the last."""
    return np.concatenate([pre[-1:], dec[:-1]], axis=0)

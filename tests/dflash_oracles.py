"""Random DFlash drafts in the published layout, and the two published runtimes run on them as oracles.

Helper module (not a test file), used by tests/test_dflash.py:

* :func:`draft_config` / :func:`write_draft`: a config.json and a bf16 ``model.safetensors`` laid out as the
  published drafts are (``DFlashDraftModel.save_pretrained``: keys without a prefix, ``dflash_config``);
  :func:`write_mlx_quantized`: an MLX-quantized copy of such a folder, quantized by ``mlx.core.quantize``
  (uint32 ``weight`` + bf16 ``scales``/``biases`` for every matrix, norms as they are, a ``quantization`` block).
* :data:`REAL`: the dimensions of ``z-lab/Qwen3.6-35B-A3B-DFlash`` (the draft of Qwen3.6-35B-A3B): 8 layers,
  hidden 2048, intermediate 6144, 32 heads of 128 with 4 KV heads, vocab 248320, block 16, mask token 248070,
  target layers [1, 10, 19, 28, 37] of 40. ``rope_theta`` 1e7 and ``rms_norm_eps`` 1e-6 are assumed from the
  published sibling drafts of the Qwen3.5/3.6 family (the dflash/dflash-mlx packages do not carry the config).
  The tests use its widths with fewer layers and a smaller vocabulary (the target's embedding and lm_head at
  248320 rows would cost 2 GB of float32 for nothing the draft computes differently).
* :func:`torch_rounds` runs ``dflash.model.DFlashDraftModel`` (torch CPU, float32) and :func:`mlx_rounds`
  runs ``dflash_mlx.model.DFlashDraftModel`` (MLX CPU, float32) over several drafting rounds with their own
  caches, exactly as their ``dflash_generate`` / draft backend call them, and return the draft logits.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import ml_dtypes
import numpy as np
from qwenmetal.safetensors_io import SafetensorsWriter

BF16 = ml_dtypes.bfloat16

#: z-lab/Qwen3.6-35B-A3B-DFlash's config.json fields (see the module docstring for what is assumed)
REAL = dict(
    architectures=["DFlashDraftModel"], model_type="qwen3", hidden_act="silu", attention_bias=False,
    attention_dropout=0.0, hidden_size=2048, intermediate_size=6144, num_hidden_layers=8,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=248320, rms_norm_eps=1e-6,
    rope_theta=10000000, rope_scaling=None, max_position_embeddings=262144, tie_word_embeddings=False,
    num_target_layers=40, block_size=16, sliding_window=None, use_sliding_window=False,
    layer_types=["full_attention"] * 8, dtype="bfloat16",
    dflash_config={"mask_token_id": 248070, "target_layer_ids": [1, 10, 19, 28, 37]},
)

#: a tiny draft of the same form (every matrix's input width a multiple of 64, for 4-bit g64 copies)
TINY = dict(REAL, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=256, num_target_layers=6, block_size=8,
            layer_types=["full_attention"] * 2, max_position_embeddings=4096, rope_theta=10000,
            dflash_config={"mask_token_id": 255, "target_layer_ids": [1, 3]})

#: DFlash2 (``DFlash2DraftModel``) at tiny width: the dflash_config keys its class reads
TINY2 = dict(TINY, architectures=["DFlash2DraftModel"],
             dflash_config={"mask_token_id": 255, "target_layer_ids": [1, 3], "block_size": 8,
                            "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 32,
                            "selector_top_k": 8})


def draft_config(base: dict, **overrides) -> dict:
    """A config.json dict: `base` with `overrides` (``num_hidden_layers`` also resizes ``layer_types``)."""
    d = copy.deepcopy(base)
    d.update(copy.deepcopy(overrides))
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        d["layer_types"] = ["full_attention"] * d["num_hidden_layers"]
    return d


def tensor_shapes(cfg: dict) -> dict:
    """File key -> shape of every tensor of a draft of `cfg`, as the published files name them."""
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    dc = cfg["dflash_config"]
    out = {"fc.weight": (H, len(dc["target_layer_ids"]) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                    p + "self_attn.q_proj.weight": (nh * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
                    p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                    p + "mlp.down_proj.weight": (H, I)})
        if cfg["architectures"] == ["DFlash2DraftModel"]:
            K, G = dc["conv_kernel_size"], dc["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                out[f"{p}{conv}.base_kernel"] = (2, K, H)
                out[f"{p}{conv}.kernel_projection.weight"] = (2 * K * (H // G), H)
    if cfg["architectures"] == ["DFlash2DraftModel"]:
        R = dc["selector_rank"]
        # the published DFlash2 files name the codebooks without ".weight" (DFlash2DraftModel's key_mapping)
        out.update({"candidate_selector.predecessor_codebook": (V, R),
                    "candidate_selector.successor_codebook": (V, R),
                    "candidate_selector.hidden_projection.weight": (R, H)})
    return out


def random_tensors(cfg: dict, seed: int = 0) -> dict:
    """Random weights for every tensor of `cfg` (bf16-representable float32): norms 1 + N(0, 0.1), matrices
    N(0, 1/sqrt(fan_in)), DFlash2's base kernels N(0, 0.5) and codebooks N(0, 0.5)."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, shape in tensor_shapes(cfg).items():
        if "norm" in k and len(shape) == 1:
            a = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        elif "base_kernel" in k or "codebook" in k:
            a = 0.5 * rng.standard_normal(shape, dtype=np.float32)
        else:
            a = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1]))
        out[k] = a.astype(BF16).astype(np.float32)
    return out


def _write_safetensors(path: Path, arrays: dict) -> None:
    with SafetensorsWriter(path, {k: (a.dtype, a.shape) for k, a in arrays.items()}, {"format": "pt"}) as w:
        for k, a in arrays.items():
            w.write(k, a)


def write_draft(out_dir, cfg: dict, tensors: dict, dtype=BF16) -> Path:
    """A draft folder in the published layout: config.json and one ``model.safetensors`` in `dtype`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _write_safetensors(out / "model.safetensors", {k: np.asarray(a).astype(dtype) for k, a in tensors.items()})
    return out


def write_mlx_quantized(src_dir, out_dir, bits: int = 4, group_size: int = 64) -> Path:
    """An MLX-quantized copy of the draft folder `src_dir`, quantized by MLX itself (``mx.quantize``, affine,
    bf16 scales and biases): every 2-D ``*.weight`` matrix whose input width the group size divides; norms and
    DFlash2's base kernels and codebooks stay as they are."""
    import mlx.core as mx
    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization"] = {"group_size": group_size, "bits": bits}
    weights = mx.load(str(src / "model.safetensors"))
    arrays = {}
    for k, a in weights.items():
        if k.endswith(".weight") and a.ndim == 2 and a.shape[-1] % group_size == 0:
            wq, s, b = mx.quantize(a, group_size=group_size, bits=bits)
            stem = k[:-len(".weight")]
            arrays[k] = np.array(wq)
            arrays[stem + ".scales"] = np.array(s.astype(mx.float32)).astype(BF16)
            arrays[stem + ".biases"] = np.array(b.astype(mx.float32)).astype(BF16)
        else:
            arrays[k] = np.array(a.astype(mx.float32)).astype(BF16)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _write_safetensors(out / "model.safetensors", arrays)
    return out


def random_target_head(cfg: dict, seed: int = 1) -> tuple:
    """A target's embedding and lm_head for a draft of `cfg` ([V, H] float32 each, bf16-representable)."""
    rng = np.random.default_rng(seed)
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    embed = rng.standard_normal((V, H), dtype=np.float32).astype(BF16).astype(np.float32)
    head = (rng.standard_normal((V, H), dtype=np.float32) / np.float32(np.sqrt(H))).astype(BF16).astype(np.float32)
    return embed, head


def random_rounds(cfg: dict, lengths=(5, 3, 1, 4), seed: int = 2) -> list:
    """Drafting rounds: (context features [n, len(ids)*H], block token ids [B]) for each n in `lengths` --
    the first the prompt, the others the tokens each round accepted; the block is a token then mask tokens."""
    rng = np.random.default_rng(seed)
    dc = cfg["dflash_config"]
    F = len(dc["target_layer_ids"]) * cfg["hidden_size"]
    B = dc.get("block_size", cfg["block_size"])
    out = []
    for n in lengths:
        feats = rng.standard_normal((n, F), dtype=np.float32)
        block = np.array([int(rng.integers(0, cfg["vocab_size"]))] + [dc["mask_token_id"]] * (B - 1))
        out.append((feats, block))
    return out


# ------------------------------------------------------------------------------------------------
# the oracles
# ------------------------------------------------------------------------------------------------
def random_round(rng, config, n: int, L: int) -> tuple:
    """One drafting round's inputs for a draft of `config` (a DFlashConfig): random context features [n, F] and a
    block of L token ids (a random first token below the mask id, then mask tokens)."""
    f = rng.standard_normal((n, config.feature_size)).astype(np.float32)
    mask = config.mask_token_id
    return f, np.array([int(rng.integers(0, mask))] + [mask] * (L - 1), dtype=np.int64)


def bad_draft_inputs(rng, config) -> list:
    """(features, block, message) for each bad input a native draft call must refuse, leaving its cache as it
    was (tests/test_dflash_cpu.py, tests/metal/test_dflash_metal.py)."""
    F, mask, V = config.feature_size, config.mask_token_id, config.vocab_size
    good = rng.standard_normal((2, F)).astype(np.float32)
    block = np.array([3] + [mask] * 7)
    return [(np.zeros((2, F + 1), np.float32), block, f"context features must be float32 [n, {F}], got [2, {F + 1}]"),
            (np.zeros(F, np.float32), block, f"context features must be [n, {F}], got [{F}]"),
            (good, np.zeros(0, np.int64), "the block is empty"),
            (good, np.array([3, V]), f"token id {V} outside the vocabulary"),
            (good, np.array([-1, mask]), "token id -1 outside the vocabulary"),
            (good, np.zeros((2, 2), np.int64), "1-D sequence of token ids")]


def torch_rounds(draft_dir, embed: np.ndarray, head: np.ndarray, rounds: list, variant: str = "dflash") -> list:
    """``dflash``'s DFlashDraftModel (torch CPU, float32) over `rounds` as ``dflash_generate`` calls it: the
    block's embedding, the new context rows at positions ``start - n .. start + B - 1`` of one growing
    ``DynamicCache`` cropped back to ``start`` after each call; the logits of rows 1.. by ``compute_logits``
    (DFlash) or the candidate selector's greedy tokens (DFlash2). Returns a list of [B - 1, V] logits, or
    of (logits, tokens) for DFlash2."""
    import torch
    from dflash.model import DFlash2DraftModel, DFlashDraftModel, _crop_to, _make_cache

    torch.set_num_threads(2)
    cls = DFlash2DraftModel if variant == "dflash2" else DFlashDraftModel
    model = cls.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)
    lm_head.weight.data = torch.from_numpy(head.copy())
    embed_t = torch.from_numpy(embed.copy())
    cache = _make_cache(model.config)
    out, start = [], 0
    with torch.inference_mode():
        for feats, block in rounds:
            n, B = feats.shape[0], block.shape[0]
            start += n
            noise = torch.nn.functional.embedding(torch.from_numpy(block)[None], embed_t)
            pos = torch.arange(start - n, start + B)[None]
            hidden = model(target_hidden=torch.from_numpy(feats)[None], noise_embedding=noise, position_ids=pos,
                           past_key_values=cache, use_cache=True)[:, 1:, :]
            _crop_to(cache, start)
            if variant == "dflash2":
                tokens, _, _ = model.propose(hidden, torch.from_numpy(block[:1]), lm_head, 0.0)
                out.append((model.compute_logits(hidden, lm_head)[0].numpy(), tokens[0].numpy()))
            else:
                out.append(model.compute_logits(hidden, lm_head)[0].numpy())
    return out


def mlx_rounds(draft_dir, embed: np.ndarray, head: np.ndarray, rounds: list, cache_kind: str = "full") -> list:
    """``dflash-mlx``'s DFlashDraftModel (MLX CPU) over `rounds`, loaded by its own loader
    (``load_draft_bundle``: mlx-lm's ``load_model``, which reads an MLX-quantized copy as such) with every
    floating parameter cast to float32, as its draft backend calls it: the block's embedding, the new context
    rows, its per-layer context cache (``cache_kind`` "full": ``FullContextDraftKVCache``; "window": the
    default ``ContextOnlyDraftKVCache`` with a window larger than the test's context); rows 1.. through the
    lm_head. Returns a list of [B - 1, V] logits."""
    import mlx.core as mx
    from dflash_mlx.model import ContextOnlyDraftKVCache, FullContextDraftKVCache
    from dflash_mlx.runtime.loading import load_draft_bundle

    mx.set_default_device(mx.cpu)
    model, _ = load_draft_bundle(str(draft_dir), lazy=False)

    def f32(x):
        return x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x

    model.apply(f32)
    if cache_kind == "full":
        cache = [FullContextDraftKVCache() for _ in model.layers]
    else:
        cache = [ContextOnlyDraftKVCache(sink_size=64, window_size=1024) for _ in model.layers]
    embed_m, head_m = mx.array(embed), mx.array(head)
    out = []
    for feats, block in rounds:
        noise = embed_m[mx.array(block)][None]
        hidden = model(noise_embedding=noise, target_hidden=mx.array(feats)[None], cache=cache)
        logits = hidden[:, 1:, :] @ head_m.T
        mx.eval(logits)
        out.append(np.array(logits[0]))
    return out

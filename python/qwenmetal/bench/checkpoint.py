"""The benchmark's checkpoint: configs at Qwen3.6-35B-A3B's real per-layer widths, and the random-weight
MLX 4-bit checkpoint of one, written once by the one random-checkpoint writer
(:mod:`qwenmetal.checkpoint_writer`, through :func:`qwenmetal.testing.make_checkpoint`) and cached under
``paths.cache_dir("bench")``."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

from ..testing import PRESETS, cached_checkpoint, wrap_text_config

CHECKPOINT_FORMAT = "mlx-q4"


def layer_types(n: int, interval: int = 4) -> list:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def _family_config(layers: int, **dims) -> dict:
    """A config.json dict (nested ``qwen3_5_moe`` form, as released) of a Qwen3.5/3.6-MoE family member:
    the fields every released size shares (the values of Qwen3.6-35B-A3B's config.json, docs/model.md §1.1), with
    ``dims`` (text_config fields: widths, head and expert counts) replacing them, and ``layers`` layers
    (every fourth full attention)."""
    if layers < 1:
        raise ValueError("layers must be at least 1")
    text = {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "bos_token_id": None, "dtype": "bfloat16", "eos_token_id": 248044,
        "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "layer_types": layer_types(layers),
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144, "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 512,
        "num_attention_heads": 16, "num_experts": 256, "num_experts_per_tok": 8,
        "num_hidden_layers": layers, "num_key_value_heads": 2, "output_router_logits": False,
        "pad_token_id": None, "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000.0, "rope_type": "default"},
        "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
        "use_cache": True, "vocab_size": 248320,
    }
    unknown = set(dims) - set(text)
    if unknown:
        raise ValueError(f"unknown text_config fields {sorted(unknown)}")
    text.update(dims)
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "dtype": "bfloat16",
            "model_type": "qwen3_5_moe", "text_config": dict(sorted(text.items())),
            "tie_word_embeddings": text["tie_word_embeddings"]}


def real_config(layers: int = 8, vocab_size: int = 248320, num_experts: int = 256) -> dict:
    """A config.json dict (nested ``qwen3_5_moe`` form, as released) with Qwen3.6-35B-A3B's per-layer
    dimensions and ``layers`` layers."""
    return _family_config(layers, vocab_size=vocab_size, num_experts=num_experts)


def qwen35_397b_config(layers: int = 60) -> dict:
    """The config.json dict of Qwen3.5-397B-A17B (``layers`` layers; 60 as released: 45 GDN + 15 full
    attention), parsed by ModelConfig like any other size.

    Where the values come from:

    * Flash-MoE's engine (github.com/danveloper/flash-moe, which runs this model; docs/model.md §1.3):
      60 layers (45 GDN + 15 attention), hidden 4096, 512 experts, moe_intermediate 1024, GDN 64 value /
      16 key heads, 10 experts per token (Flash-MoE's 7,077,888-byte 4-bit expert blob = 3 x 1024 x 4096
      weights at 4 bits + bf16 scales and biases at group 64 confirms hidden x moe_intermediate);
    * mlx-community/Qwen3.5-397B-A17B-4bit's model card (a conversion of the released config.json):
      attention 32 query / 2 KV heads of head_dim 256, GDN head dim 128, one shared expert, context
      262,144, vocabulary 248,320;
    * assumptions (the family's values, not checked against the 397B's own config.json here):
      shared_expert_intermediate_size 1024 (= moe_intermediate, as in the 35B where both are 512),
      conv kernel 4, rope (theta 1e7, partial 0.25, mrope [11, 11, 10]), rms_norm_eps 1e-6, untied
      embeddings, eos 248044 -- the 35B's values.
    """
    return _family_config(layers, hidden_size=4096, num_attention_heads=32, num_key_value_heads=2, head_dim=256,
                         linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
                         linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10,
                         moe_intermediate_size=1024, shared_expert_intermediate_size=1024)


def resolve_config(spec: str | Mapping[str, Any] = "real", layers: int | None = None) -> dict:
    """``"real"`` (real widths), a :data:`qwenmetal.testing.PRESETS` name, a path to a config.json, or a
    config dict. ``layers`` (if given) sets num_hidden_layers (and layer_types)."""
    if isinstance(spec, Mapping):
        cfg = json.loads(json.dumps(spec))
    elif spec == "real":
        return real_config(8 if layers is None else layers)
    elif os.path.exists(spec):
        p = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
        with open(p, encoding="utf-8") as f:
            cfg = json.load(f)
    else:
        if spec not in PRESETS:
            raise ValueError(f"unknown config {spec!r}: 'real', a path to a config.json, or one of {sorted(PRESETS)}")
        cfg = copy.deepcopy(PRESETS[spec])
    if cfg.get("model_type") == "qwen3_5_moe_text":
        cfg = wrap_text_config(cfg)
    if cfg.get("model_type") != "qwen3_5_moe":
        raise ValueError(f"the benchmark generator writes qwen3_5_moe checkpoints, got {cfg.get('model_type')!r}")
    cfg.pop("vision_config", None)
    if layers is not None:
        t = cfg["text_config"]
        interval = t.get("full_attention_interval", 4)
        t["num_hidden_layers"] = int(layers)
        t["layer_types"] = layer_types(int(layers), interval)
    return cfg



# the checkpoint is generated in a child process, so that the generator's memory (a real-width expert
# tensor at a time) does not count in the benchmark process's peak RSS
_BUILD_CHILD = ("import json, sys; from qwenmetal.testing import make_checkpoint; "
                "make_checkpoint(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4]), progress=True)")


def _build_in_child(dest: Path, cfg: dict, format: str, seed: int) -> Path:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])      # the directory holding the package
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    r = subprocess.run([sys.executable, "-c", _BUILD_CHILD, str(dest), json.dumps(cfg), format, str(seed)], env=env)
    if r.returncode and not (dest / "config.json").is_file():     # else: finished concurrently by another
        raise RuntimeError(f"generating the benchmark checkpoint {dest} failed (exit status {r.returncode}; "
                           "the error is printed above); nothing was left behind")
    return dest


def ensure_checkpoint(cfg: Mapping[str, Any], seed: int = 0, name: str = "bench",
                      log: Callable[[str], None] | None = None, format: str = CHECKPOINT_FORMAT) -> Path:
    """The cached random-weight checkpoint of `cfg` (see :func:`resolve_config`) and `seed` in `format`
    (default MLX 4-bit; ``"hf-bf16"`` is the unquantized original that llama.cpp's own converter reads,
    benchmarks/llama_cpp_gguf.py), generated on first use:
    ``paths.cache_dir("bench")/<name>-L<layers>-<format>-seed<seed>-<key>``
    (:func:`qwenmetal.testing.cached_checkpoint`; the key changes with the config, the seed and the
    generator). Written atomically, in a child process."""

    cfg = resolve_config(cfg)
    log = log or (lambda s: None)

    def build(dest: Path, cfg: dict, format: str, seed: int) -> Path:
        log(f"generating the random-weight checkpoint {dest} (one-time) ...")
        return _build_in_child(dest, cfg, format, seed)

    return cached_checkpoint(cfg, format, seed, cache="bench",
                             name=f"{name}-L{cfg['text_config']['num_hidden_layers']}", build=build)

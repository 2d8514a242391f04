"""`qwenmetal bench`: prefill and decode speed at the real Qwen3.6-35B-A3B widths, against the box's own
memory bandwidth.

    qwenmetal bench                          # 8 real-width layers, cpu backend, 2 threads
    qwenmetal bench --layers 4 --json out.json
    qwenmetal bench --quick --config tiny --backend reference     # smoke run, seconds

What it does:

1. **Checkpoint.** A random-weight MLX 4-bit checkpoint with the real per-layer dimensions (hidden 2048,
   256 experts top-8 x 512 + shared 512, GDN 16k/32v heads x 128, attention 16q/2kv x 256, vocab 248,320)
   and ``--layers`` layers (default 8 = two ``[GDN GDN GDN attention]`` blocks), generated once and cached
   under ``$QWENMETAL_CACHE/bench`` (else ``~/.cache/qwenmetal/bench``). It is written shard by shard
   (one safetensors file per layer), quantized with :func:`qwenmetal.quant.quantize` (4-bit g64, bf16
   scales/biases; router and shared-expert gate 8-bit), in exactly the layout ``mlx_lm.convert -q`` writes.
   About 0.46 GB per layer plus 0.57 GB for the embedding and lm_head.
2. **Read bandwidth.** Every thread (as many as the engine uses) streams its part of a buffer far larger
   than the last-level cache; best of N passes. The measurement runs in a child process so that its
   buffer does not count in the benchmark's peak RSS.
3. **Prefill.** Tokens/s for each ``--prefill`` length: one exact-shape warm-up, then ``--repeats``
   timed runs in fresh sessions (prefill + last-token logits + argmax); the median is reported.
4. **Decode.** For each ``--contexts`` length C: prefill C tokens (untimed), a few warm-up steps on a
   fork, then ``--repeats`` times ``--decode-steps`` greedy steps, each repeat on a fresh fork of the
   same context; the median ms/token is reported. The greedy tokens' FNV-1a digest must repeat across
   repeats (reported as ``digest_stable``).
5. **Bytes per decoded token**, from the checkpoint's actual tensor sizes: every non-expert weight
   (attention / GDN projections, norms, conv, router, shared expert), top-k of each layer's routed
   experts, one embedding row, the final norm and lm_head, plus the KV cache read at that context
   (and the new token's K/V written) and the GDN recurrent + conv state read and written. Effective
   GB/s = bytes/token x tokens/s; ``bandwidth_ratio`` = effective / measured read bandwidth.
6. **Peak RSS** of the benchmark process (``getrusage``); memory-mapped weight pages count once touched.

The synthetic prompt follows the benchmark method of prior art: token i = ((i * 2654435761) mod 2^32)
mod vocab. Output: a table, and JSON with ``--json PATH`` (schema ``qwenmetal-bench/1``).
"""
from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

SCHEMA = "qwenmetal-bench/1"
GENERATOR_VERSION = 1            # bump when generated checkpoint content changes (invalidates the cache)
DEFAULT_PREFILL = (128, 512, 2048)
DEFAULT_CONTEXTS = (128, 1024, 4096)
QUICK_PREFILL = (16, 64)
QUICK_CONTEXTS = (16, 64)
PROMPT_MULTIPLIER = 2654435761

# bytes per stored element of the KV cache, by the engine's kv_dtype option
KV_ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# the numpy reference keeps its caches in float32
BACKEND_KV_DEFAULT = {"reference": "float32", "cpu": "bfloat16"}
STATE_ELEMENT_BYTES = 4          # GDN recurrent and conv state: float32 (mamba_ssm_dtype)


# ---------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------
def layer_types(n: int, interval: int = 4) -> list:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def real_config(layers: int = 8, vocab_size: int = 248320, num_experts: int = 256) -> dict:
    """A config.json dict (nested ``qwen3_5_moe`` form, as released) with Qwen3.6-35B-A3B's per-layer
    dimensions and ``layers`` layers."""
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
        "num_attention_heads": 16, "num_experts": num_experts, "num_experts_per_tok": 8,
        "num_hidden_layers": layers, "num_key_value_heads": 2, "output_router_logits": False,
        "pad_token_id": None, "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000.0, "rope_type": "default"},
        "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
        "use_cache": True, "vocab_size": vocab_size,
    }
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "dtype": "bfloat16",
            "model_type": "qwen3_5_moe", "text_config": dict(sorted(text.items())), "tie_word_embeddings": False}


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
        from .testing import PRESETS
        if spec not in PRESETS:
            raise ValueError(f"unknown config {spec!r}: 'real', a path to a config.json, or one of {sorted(PRESETS)}")
        cfg = copy.deepcopy(PRESETS[spec])
    if cfg.get("model_type") == "qwen3_5_moe_text":
        from .testing import wrap_text_config
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


# ---------------------------------------------------------------------------------------------
# streaming checkpoint generator
# ---------------------------------------------------------------------------------------------
def cache_root() -> Path:
    env = os.environ.get("QWENMETAL_CACHE")
    return (Path(env) if env else Path.home() / ".cache" / "qwenmetal") / "bench"


def _rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"qwenmetal-bench/{int(seed)}/{name}".encode()).digest()
    return np.random.default_rng(np.frombuffer(digest[:16], dtype="<u4").astype(np.uint64))


def _uniform(rng: np.random.Generator, shape, std: float, mean: float = 0.0) -> np.ndarray:
    """float32 uniform noise with the given mean and standard deviation (cheaper to draw than normal)."""
    a = np.float32(std * 3.0 ** 0.5)
    x = rng.random(shape, dtype=np.float32)
    x *= np.float32(2.0) * a
    x += np.float32(mean) - a
    return x


class _ShardWriter:
    """Collects tensors of one shard, quantizing linear weights on the way, and writes the shard."""

    def __init__(self, seed: int, prefix: str, bits: int = 4, group_size: int = 64):
        self.seed, self.prefix, self.bits, self.group_size = seed, prefix, bits, group_size
        self.tensors: dict[str, np.ndarray] = {}
        self.overrides: dict[str, dict] = {}
        self.n_params = 0

    def linear(self, name: str, shape: tuple, gain: float, bits: int | None = None, chunk_rows: int = 1 << 24):
        """A random [..., out, in] matrix with std gain/sqrt(in), quantized (MLX affine, bf16 scales)."""
        from .quant import quantize
        bits = bits or self.bits
        rng = _rng(self.seed, name)
        n_in = shape[-1]
        std = gain / n_in ** 0.5
        lead = int(np.prod(shape[:-1]))
        step = max(1, chunk_rows // n_in)              # ~16M elements (64 MB of float32) at a time
        wq = np.empty((lead, n_in * bits // 32), np.uint32)
        import ml_dtypes
        sc = np.empty((lead, n_in // self.group_size), ml_dtypes.bfloat16)
        bi = np.empty_like(sc)
        for r0 in range(0, lead, step):
            r1 = min(lead, r0 + step)
            q, s, b = quantize(_uniform(rng, (r1 - r0, n_in), std), bits, self.group_size)
            wq[r0:r1], sc[r0:r1], bi[r0:r1] = q, s, b
        key = self.prefix + name
        self.tensors[key + ".weight"] = wq.reshape(*shape[:-1], -1)
        self.tensors[key + ".scales"] = sc.reshape(*shape[:-1], -1)
        self.tensors[key + ".biases"] = bi.reshape(*shape[:-1], -1)
        if bits != self.bits:
            self.overrides[key] = {"group_size": self.group_size, "bits": bits}
        self.n_params += int(np.prod(shape))

    def plain(self, name: str, arr: np.ndarray):
        self.tensors[self.prefix + name] = arr
        self.n_params += arr.size

    def vector(self, name: str, n, std: float, mean: float = 0.0, dtype: str = "bfloat16"):
        import ml_dtypes
        a = _uniform(_rng(self.seed, name), n, std, mean)
        self.plain(name, a.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else a)

    def save(self, path: Path) -> dict:
        from safetensors.numpy import save_file
        save_file({k: np.ascontiguousarray(v) for k, v in self.tensors.items()}, str(path),
                  metadata={"format": "mlx"})
        os.chmod(path, 0o644)
        return {k: v.nbytes for k, v in self.tensors.items()}


def _layer_shard(cfg: dict, c, i: int, seed: int) -> _ShardWriter:
    H, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    nv, dv, K = c.linear_num_value_heads, c.linear_value_head_dim, c.linear_conv_kernel_dim
    E, I, S = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    w = _ShardWriter(seed, "language_model.model.")
    p = f"layers.{i}."
    G = 0.45                                        # projection gain: output std ~0.45 x input RMS
    w.vector(p + "input_layernorm.weight", H, 0.1, 1.0)            # MLX stores the shifted 1 + w
    w.vector(p + "post_attention_layernorm.weight", H, 0.1, 1.0)
    if c.is_full_attention(i):
        a = p + "self_attn."
        w.linear(a + "q_proj", (nh * hd * 2, H), G)                # per head [query | output gate]
        w.linear(a + "k_proj", (nkv * hd, H), G)
        w.linear(a + "v_proj", (nkv * hd, H), G)
        w.linear(a + "o_proj", (H, nh * hd), G)
        w.vector(a + "q_norm.weight", hd, 0.1, 1.0)
        w.vector(a + "k_norm.weight", hd, 0.1, 1.0)
    else:
        g = p + "linear_attn."
        w.linear(g + "in_proj_qkv", (c.conv_dim, H), G)
        w.linear(g + "in_proj_z", (c.value_dim, H), G)
        w.linear(g + "in_proj_b", (nv, H), G)
        w.linear(g + "in_proj_a", (nv, H), G)
        import ml_dtypes
        conv = _uniform(_rng(seed, g + "conv1d"), (c.conv_dim, K, 1), 0.3)
        w.plain(g + "conv1d.weight", conv.astype(ml_dtypes.bfloat16))
        w.vector(g + "dt_bias", nv, 0.29, 0.5)
        a_log = np.log(_rng(seed, g + "A_log").uniform(1.0, 16.0, nv)).astype(np.float32)
        w.plain(g + "A_log", a_log)
        w.vector(g + "norm.weight", dv, 0.1, 1.0)
        w.linear(g + "out_proj", (H, c.value_dim), G)
    m = p + "mlp."
    w.linear(m + "gate", (E, H), 1.1, bits=8)                     # router: 8-bit, as mlx-lm quantizes it
    w.linear(m + "switch_mlp.gate_proj", (E, I, H), G)
    w.linear(m + "switch_mlp.up_proj", (E, I, H), G)
    w.linear(m + "switch_mlp.down_proj", (E, H, I), G)
    w.linear(m + "shared_expert.gate_proj", (S, H), G)
    w.linear(m + "shared_expert.up_proj", (S, H), G)
    w.linear(m + "shared_expert.down_proj", (H, S), G)
    w.linear(m + "shared_expert_gate", (1, H), 1.1, bits=8)
    return w


def write_checkpoint(dest: str | os.PathLike, cfg: Mapping[str, Any], seed: int = 0,
                     log: Callable[[str], None] | None = None) -> Path:
    """Write a random-weight MLX 4-bit checkpoint for `cfg` (nested ``qwen3_5_moe``) at `dest`, one
    safetensors shard per layer (plus one for the embedding + final norm and one for lm_head), so memory
    stays near one layer's worth. The directory appears atomically."""
    from .config import ModelConfig
    cfg = resolve_config(cfg)
    c = ModelConfig.from_dict(cfg)
    if c.tie_word_embeddings:
        raise ValueError("tied embeddings are not supported by the benchmark generator")
    if any(not c.is_moe_layer(i) for i in range(c.num_hidden_layers)):
        raise ValueError("the benchmark generator writes MoE layers only")
    if c.hidden_size % 64 or c.moe_intermediate_size % 64 or c.shared_expert_intermediate_size % 64:
        raise ValueError("hidden, moe and shared-expert sizes must be multiples of 64 (4-bit g64)")
    log = log or (lambda s: None)
    from .testing import building_directory
    with building_directory(dest) as tmp:
        n_shards = c.num_hidden_layers + 2
        weight_map, overrides, total_size, total_params = {}, {}, 0, 0
        t0 = time.perf_counter()
        for j in range(n_shards):
            if j == 0:
                w = _ShardWriter(seed, "language_model.model.")
                w.linear("embed_tokens", (c.vocab_size, c.hidden_size), 0.05 * c.hidden_size ** 0.5)
                w.vector("norm.weight", c.hidden_size, 0.1, 1.0)
            elif j == n_shards - 1:
                w = _ShardWriter(seed, "language_model.")
                w.linear("lm_head", (c.vocab_size, c.hidden_size), 0.45)
            else:
                w = _layer_shard(cfg, c, j - 1, seed)
            fn = f"model-{j + 1:05d}-of-{n_shards:05d}.safetensors"
            sizes = w.save(tmp / fn)
            for k, n in sizes.items():
                weight_map[k] = fn
                total_size += n
            overrides.update(w.overrides)
            total_params += w.n_params
            log(f"  shard {j + 1}/{n_shards} written ({sum(sizes.values()) / 2**20:.0f} MiB, "
                f"{time.perf_counter() - t0:.0f} s)")
            del w
            gc.collect()
        index = {"metadata": {"total_size": int(total_size), "total_parameters": int(total_params)},
                 "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=4), encoding="utf-8")
        _write_side_files(tmp, cfg, overrides)
    return Path(dest)


def _write_side_files(d: Path, cfg: dict, overrides: dict) -> None:
    """config.json (with the quantization block mlx_lm.convert writes), generation_config.json and the
    fixture tokenizer (byte-level BPE; the model's vocab is larger, as in the real checkpoint)."""
    quant = {"group_size": 64, "bits": 4, "mode": "affine", **overrides}
    from . import testing
    gen = testing._generation_config()
    try:
        text = testing._mlx_config_text(json.dumps(cfg, indent=2, sort_keys=True), gen, quant)
    except Exception:                                   # pragma: no cover - private helper changed
        out = dict(cfg, quantization=quant, quantization_config=quant, eos_token_id=gen["eos_token_id"])
        text = json.dumps(dict(sorted(out.items())), indent=4)
    (d / "config.json").write_text(text, encoding="utf-8")
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    try:
        (d / "tokenizer.json").write_text(testing._tokenizer_json("qwen3_5"), encoding="utf-8")
        (d / "tokenizer_config.json").write_text(
            json.dumps(testing._tokenizer_config("qwen3_5"), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        (d / "chat_template.jinja").write_text(testing.CHAT_TEMPLATE, encoding="utf-8")
    except Exception:                                   # pragma: no cover - the benchmark needs no tokenizer
        pass


def checkpoint_name(cfg: Mapping[str, Any], seed: int, name: str = "bench") -> str:
    key = json.dumps({"config": cfg, "seed": int(seed), "version": GENERATOR_VERSION}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    layers = cfg["text_config"]["num_hidden_layers"]
    return f"{name}-L{layers}-seed{int(seed)}-{digest}"


def ensure_checkpoint(cfg: Mapping[str, Any], seed: int = 0, name: str = "bench",
                      root: str | os.PathLike | None = None, log: Callable[[str], None] | None = None) -> Path:
    """The cached checkpoint for (cfg, seed), generated on first use."""
    cfg = resolve_config(cfg)
    dest = Path(root or cache_root()) / checkpoint_name(cfg, seed, name)
    if (dest / "config.json").is_file():
        return dest
    log = log or (lambda s: None)
    log(f"generating the random-weight checkpoint {dest} (one-time) ...")
    try:
        return write_checkpoint(dest, cfg, seed, log)
    except (FileExistsError, OSError):
        if (dest / "config.json").is_file():        # written concurrently by someone else
            return dest
        raise


# ---------------------------------------------------------------------------------------------
# memory read bandwidth
# ---------------------------------------------------------------------------------------------
_BW_CHILD = r"""
import json, sys, threading, time
import numpy as np
nbytes, threads, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
buf = np.empty(nbytes // 64 * 64, np.uint8)
buf[::4096] = 1                                  # fault every page in before timing
buf[:] = 7
parts = [p.view(np.uint64) for p in np.array_split(buf.view(np.uint64), threads)]
try:
    from qwenmetal import _core
    reader = _core.bench_read_bytes if hasattr(_core, "bench_read_bytes") else None
except Exception:
    reader = None
method = "qwenmetal._core.bench_read_bytes" if reader is not None else "numpy.bitwise_or.reduce"
isa = _core.bench_read_isa() if reader is not None else None
def read(p):
    if reader is not None:
        reader(p)
    else:
        np.bitwise_or.reduce(p)
samples = []
for r in range(repeats + 1):
    ths = [threading.Thread(target=read, args=(p,)) for p in parts]
    t = time.perf_counter()
    for th in ths: th.start()
    for th in ths: th.join()
    dt = time.perf_counter() - t
    if r:                                        # the first pass is a warm-up
        samples.append(buf.nbytes / dt / 1e9)
print(json.dumps({"read_gbps": max(samples), "samples_gbps": samples, "buffer_bytes": int(buf.nbytes),
                  "threads": threads, "method": method, "isa": isa}))
"""


def measure_read_bandwidth(threads: int = 2, nbytes: int = 2 << 30, repeats: int = 5) -> dict:
    """Best-of-`repeats` read bandwidth (GB/s, 1e9 bytes) of `threads` threads each streaming its share
    of an `nbytes` buffer, measured in a child process (so its buffer stays out of this process's RSS)."""
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", _BW_CHILD, str(int(nbytes)), str(int(threads)), str(int(repeats))],
                         check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# bytes read per decoded token
# ---------------------------------------------------------------------------------------------
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
    n_attn = len(c.full_attention_layers)
    n_gdn = len(c.linear_attention_layers)
    kv_token = 2 * c.num_key_value_heads * c.head_dim * kv_element_bytes       # K and V, one layer, one token
    kv = n_attn * kv_token * (int(context) + 1)
    state = n_gdn * 2 * state_element_bytes * (
        c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
        + c.conv_dim * (c.linear_conv_kernel_dim - 1))
    return {"total": weights + kv + state, "weights": weights, "kv_cache": kv, "gdn_state": state,
            "weight_parts": parts}


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def synthetic_prompt(n: int, vocab: int, offset: int = 0) -> np.ndarray:
    """Token i = ((i * 2654435761) mod 2^32) mod vocab (prior art's synthetic prompt)."""
    i = np.arange(offset, offset + n, dtype=np.uint64)
    return ((i * np.uint64(PROMPT_MULTIPLIER)) % np.uint64(1 << 32) % np.uint64(vocab)).astype(np.int64)


def fnv1a(tokens) -> str:
    h = 0xcbf29ce484222325
    for t in tokens:
        for b in int(t).to_bytes(4, "little"):
            h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def _median(xs):
    return float(statistics.median(xs))


def time_prefill(model, n: int, repeats: int, warmup: int = 1, max_context: int | None = None) -> dict:
    V = model.config.vocab_size
    ids = synthetic_prompt(n, V)
    samples = []
    for r in range(warmup + repeats):
        s = model.new_session(max_context=max_context)
        gc.collect()
        t = time.perf_counter()
        logits = model.prefill(s, ids, return_logits="last")
        int(np.argmax(logits))
        dt = time.perf_counter() - t
        if r >= warmup:
            samples.append(dt)
        del s
    med = _median(samples)
    return {"tokens": n, "seconds": med, "tokens_per_second": n / med, "samples_seconds": samples}


def time_decode(model, context: int, steps: int, repeats: int, warmup_steps: int = 4,
                max_context: int | None = None) -> dict:
    V = model.config.vocab_size
    s = model.new_session(max_context=max_context)
    t = time.perf_counter()
    logits = model.prefill(s, synthetic_prompt(context, V), return_logits="last")
    prefill_s = time.perf_counter() - t
    first = int(np.argmax(logits))
    if warmup_steps:
        w = s.fork()
        tok = first
        for _ in range(warmup_steps):
            tok = int(np.argmax(model.decode_step(w, tok)))
        del w
    samples, digests = [], []
    for _ in range(repeats):
        f = s.fork()
        gc.collect()
        tok, toks = first, []
        t = time.perf_counter()
        for _ in range(steps):
            tok = int(np.argmax(model.decode_step(f, tok)))
            toks.append(tok)
        samples.append((time.perf_counter() - t) / steps)
        digests.append(fnv1a(toks))
        del f
    med = _median(samples)
    return {"context": context, "steps": steps, "seconds_per_token": med, "ms_per_token": 1e3 * med,
            "tokens_per_second": 1.0 / med, "samples_ms": [1e3 * x for x in samples],
            "digest": digests[0], "digest_stable": len(set(digests)) == 1,
            "context_prefill_seconds": prefill_s}


def _cpu_times():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v), idle


def busy_fraction(seconds: float = 2.0) -> float | None:
    """Fraction of the machine's CPU time spent busy over the next `seconds` (None where /proc/stat is
    missing). Call it while nothing of ours runs to see other work on the box."""
    try:
        t0, i0 = _cpu_times()
        time.sleep(seconds)
        t1, i1 = _cpu_times()
    except OSError:
        return None
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


class ForeignLoad:
    """CPU time other processes used while a block ran: the machine's busy time from /proc/stat minus ours
    (this process and its finished children). ``fraction`` is that over the machine's capacity
    (wall time x CPUs); 0 means nothing else ran."""

    def __enter__(self):
        self._start = self._sample()
        return self

    def __exit__(self, *exc):
        end = self._sample()
        self.fraction = None
        if self._start is None or end is None:
            return False
        (b0, w0, o0), (b1, w1, o1) = self._start, end
        cpus = _usable_cpus_total()
        self.fraction = max(0.0, ((b1 - b0) - (o1 - o0)) / max(1e-9, (w1 - w0) * cpus))
        return False

    @staticmethod
    def _sample():
        try:
            total, idle = _cpu_times()
        except OSError:
            return None
        ru_s, ru_c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        ours = ru_s.ru_utime + ru_s.ru_stime + ru_c.ru_utime + ru_c.ru_stime
        return (total - idle) / os.sysconf("SC_CLK_TCK"), time.monotonic(), ours


def _usable_cpus_total() -> int:
    return os.cpu_count() or 1


def wait_quiet(max_wait: float, threshold: float = 0.10, log: Callable[[str], None] | None = None) -> float | None:
    """Wait (at most `max_wait` seconds) until other processes use less than `threshold` of the CPUs over a
    3-second window; returns the last busy fraction seen. Timings taken under foreign load are unreliable
    (2 cores, threads that wait for each other)."""
    deadline = time.monotonic() + max_wait
    busy = busy_fraction(3.0)
    said = False
    while busy is not None and busy > threshold and time.monotonic() < deadline:
        if log and not said:
            log(f"  waiting for the machine to be quiet (other processes use {100 * busy:.0f}% of the CPUs) ...")
            said = True
        busy = busy_fraction(3.0)
    return busy


def peak_rss_bytes() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kb) * (1 if sys.platform == "darwin" else 1024)


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "numpy": np.__version__,
            "cpus": os.cpu_count()}
    try:
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:                      # pragma: no cover - not Linux
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_total_bytes"] = int(f.readline().split()[1]) * 1024
    except OSError:                             # pragma: no cover
        pass
    try:
        from . import _core
        info["build_info"] = _core.build_info()
    except Exception:
        pass
    try:
        info["loadavg_at_start"] = list(os.getloadavg())    # other work on the box skews the numbers
    except OSError:                             # pragma: no cover
        pass
    for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS"):
        if k in os.environ:
            info.setdefault("env", {})[k] = os.environ[k]
    return info


# ---------------------------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------------------------
def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict:
    import qwenmetal as qm

    prefill_lens = _ints(args.prefill) if args.prefill else (QUICK_PREFILL if args.quick else DEFAULT_PREFILL)
    contexts = _ints(args.contexts) if args.contexts else (QUICK_CONTEXTS if args.quick else DEFAULT_CONTEXTS)
    repeats = args.repeats or (1 if args.quick else 3)
    steps = args.decode_steps or (4 if args.quick else 64)
    threads = args.threads or _usable_cpus()

    t_start = time.perf_counter()
    busy = wait_quiet(args.wait_quiet, log=log) if args.wait_quiet else busy_fraction(1.0)
    # read bandwidth: measured before and after the timings (it moves with the VM host's memory traffic,
    # which /proc/stat does not show); the higher figure is the box's capability
    bw_bytes = args.bandwidth_bytes if args.bandwidth_bytes is not None else ((512 << 20) if args.quick else (2 << 30))
    bw_repeats = 2 if args.quick else 5
    bw_runs = [measure_read_bandwidth(threads, bw_bytes, bw_repeats)] if bw_bytes else []
    if args.model:
        path = Path(args.model)
        cfg_name = str(path)
    else:
        cfg = resolve_config(args.config, args.layers)
        path = ensure_checkpoint(cfg, args.seed, log=log)
        cfg_name = args.config
    log(f"checkpoint: {path}")

    backend = args.backend
    options: dict = {}
    if backend == "cpu":
        options["threads"] = threads
        if args.kv_dtype:
            options["kv_dtype"] = args.kv_dtype
        if args.prefill_chunk:
            options["prefill_chunk"] = args.prefill_chunk
    elif args.kv_dtype or args.prefill_chunk:
        raise ValueError("--kv-dtype and --prefill-chunk apply to the cpu backend")
    for kv in args.option or ():
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise ValueError(f"--option takes KEY=VALUE, got {kv!r}")
        options[k] = int(v) if v.lstrip("-").isdigit() else v
    t = time.perf_counter()
    model = qm.Model.load(str(path), backend=backend, **options)
    load_s = time.perf_counter() - t
    c = model.config
    backend = model.backend
    kv_dtype = args.kv_dtype or getattr(model._backend, "kv_dtype", None) or BACKEND_KV_DEFAULT.get(backend, "bfloat16")
    kv_el = KV_ELEMENT_BYTES.get(kv_dtype, 2)
    sizes = tensor_sizes(model.weights)
    log(f"loaded on {backend!r} in {load_s:.2f} s: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
        f"{c.num_experts} experts top-{c.num_experts_per_tok}, vocab {c.vocab_size}, "
        f"weights {sum(sizes.values()) / 1e9:.2f} GB")

    max_context = max(list(prefill_lens) + list(contexts)) + steps + 16
    max_context = min(max_context, c.max_position_embeddings)
    result: dict = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "qwenmetal_version": getattr(qm, "__version__", None),
        "machine": machine_info(),
        "model": {"config": cfg_name, "checkpoint": str(path), "layers": c.num_hidden_layers,
                  "full_attention_layers": len(c.full_attention_layers),
                  "linear_attention_layers": len(c.linear_attention_layers),
                  "hidden_size": c.hidden_size, "num_experts": c.num_experts,
                  "num_experts_per_tok": c.num_experts_per_tok, "vocab_size": c.vocab_size,
                  "weights_bytes": int(sum(sizes.values()))},
        "backend": backend, "options": options, "threads": threads, "kv_dtype": kv_dtype,
        "engine": model._backend.info() if hasattr(model._backend, "info") else {},
        "method": {"repeats": repeats, "decode_steps": steps, "warmup": "1 exact-shape prefill; 4 decode steps",
                   "statistic": "median", "prompt": "token i = ((i*2654435761) mod 2^32) mod vocab"},
        "load_seconds": load_s, "busy_before": busy,
        "prefill": [], "decode": [],
    }

    fl = ForeignLoad().__enter__()
    for n in prefill_lens:
        r = time_prefill(model, n, repeats, max_context=max_context)
        result["prefill"].append(r)
        log(f"  prefill {n:6d} tokens: {r['tokens_per_second']:9.1f} tok/s ({r['seconds']:.3f} s)")
    for ctx in contexts:
        r = time_decode(model, ctx, steps, repeats, max_context=max_context)
        b = decode_bytes(c, sizes, ctx, kv_el)
        r["bytes_per_token"] = b["total"]
        r["bytes"] = b
        r["effective_gbps"] = b["total"] * r["tokens_per_second"] / 1e9
        result["decode"].append(r)
        log(f"  decode @ {ctx:6d}: {r['ms_per_token']:8.2f} ms/token, {r['tokens_per_second']:7.2f} tok/s, "
            f"{b['total'] / 1e6:.1f} MB/token, {r['effective_gbps']:.2f} GB/s")
    fl.__exit__(None, None, None)
    result["foreign_load"] = fl.fraction
    result["peak_rss_bytes"] = peak_rss_bytes()
    del model
    gc.collect()

    if bw_bytes:
        bw_runs.append(measure_read_bandwidth(threads, bw_bytes, bw_repeats))
        bw = dict(max(bw_runs, key=lambda r: r["read_gbps"]))
        bw["runs_gbps"] = [r["read_gbps"] for r in bw_runs]
    else:
        bw = {"read_gbps": None, "method": "skipped"}
    result["bandwidth"] = bw
    for r in result["decode"]:
        r["bandwidth_ratio"] = (r["effective_gbps"] / bw["read_gbps"]) if bw.get("read_gbps") else None
    result["total_seconds"] = time.perf_counter() - t_start
    try:
        result["machine"]["loadavg_at_end"] = list(os.getloadavg())
    except OSError:                             # pragma: no cover
        pass
    return result


def format_table(res: Mapping[str, Any]) -> str:
    m = res["model"]
    bw = res.get("bandwidth") or {}
    lines = [
        f"qwenmetal bench: backend {res['backend']}, {res['threads']} threads, kv {res['kv_dtype']}"
        + "".join(f", {k}={v}" for k, v in res.get("options", {}).items() if k not in ("threads", "kv_dtype"))
        + "".join(f", {k} {v}" for k, v in (res.get("engine") or {}).items() if k in ("isa", "activations", "amx"))
        + "; "
        f"{m['layers']} layers ({m['linear_attention_layers']} GDN + {m['full_attention_layers']} attention), "
        f"hidden {m['hidden_size']}, {m['num_experts']} experts top-{m['num_experts_per_tok']}, "
        f"vocab {m['vocab_size']}; weights {m['weights_bytes'] / 1e9:.3f} GB",
        f"machine: {res['machine'].get('cpu', '?')}, {res['machine'].get('cpus_usable', res['machine'].get('cpus'))} CPUs; "
        + (f"measured read bandwidth {bw['read_gbps']:.2f} GB/s ({bw.get('threads')} threads, "
           f"{bw.get('buffer_bytes', 0) / 2**30:.2f} GiB buffer, best of {len(bw.get('samples_gbps', []))} passes; "
           f"before/after the timings: {', '.join(f'{x:.2f}' for x in bw.get('runs_gbps', []))})"
           if bw.get("read_gbps") else "read bandwidth not measured"),
        "",
        f"{'prefill':>10} {'tok/s':>10} {'seconds':>9}",
    ]
    for r in res["prefill"]:
        lines.append(f"{r['tokens']:>10d} {r['tokens_per_second']:>10.1f} {r['seconds']:>9.3f}")
    lines += ["", f"{'context':>10} {'ms/token':>9} {'tok/s':>8} {'MB/token':>9} {'GB/s':>7} {'of bw':>6}  "
                  f"{'weights':>8} {'kv':>7} {'state':>6}  digest"]
    for r in res["decode"]:
        b = r["bytes"]
        ratio = f"{100 * r['bandwidth_ratio']:5.1f}%" if r.get("bandwidth_ratio") is not None else "    -"
        lines.append(f"{r['context']:>10d} {r['ms_per_token']:>9.2f} {r['tokens_per_second']:>8.2f} "
                     f"{r['bytes_per_token'] / 1e6:>9.2f} {r['effective_gbps']:>7.2f} {ratio:>6}  "
                     f"{b['weights'] / 1e6:>8.2f} {b['kv_cache'] / 1e6:>7.2f} {b['gdn_state'] / 1e6:>6.2f}  "
                     f"{r['digest']}{'' if r['digest_stable'] else ' (UNSTABLE)'}")
    if res["decode"]:
        wp = res["decode"][0]["bytes"]["weight_parts"]
        lines.append("weights per token (MB): " + ", ".join(f"{k} {v / 1e6:.2f}" for k, v in wp.items()))
    la = res["machine"].get("loadavg_at_start")
    lines.append(f"peak RSS {res['peak_rss_bytes'] / 2**30:.2f} GiB; load {res['load_seconds']:.2f} s; "
                 f"total {res.get('total_seconds', 0):.0f} s"
                 + (f"; load average at start {la[0]:.2f}" if la else "")
                 + (f"; other processes used {100 * res['foreign_load']:.0f}% of the CPUs meanwhile"
                    if res.get("foreign_load") is not None else ""))
    return "\n".join(lines)


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                      # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _ints(s) -> tuple:
    if isinstance(s, (list, tuple)):
        return tuple(int(x) for x in s)
    try:
        out = tuple(int(x) for x in str(s).split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {s!r}") from None
    if not out or any(x < 1 for x in out):
        raise ValueError(f"expected positive integers, got {s!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=None,
                   help="layers of the generated model (default 8 for --config real; a preset keeps its own)")
    p.add_argument("--config", default="real",
                   help="'real' (Qwen3.6-35B-A3B widths, default), a fixture preset (e.g. tiny) or a config.json path")
    p.add_argument("--model", default=None, help="benchmark an existing checkpoint directory instead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="cpu", help="cpu (default) | reference | any registered backend")
    p.add_argument("--threads", type=int, default=None, help="engine and bandwidth threads (default: usable CPUs)")
    p.add_argument("--kv-dtype", default=None, help="cpu backend KV cache dtype (bfloat16 | float32)")
    p.add_argument("--prefill-chunk", type=int, default=None, help="cpu backend prefill chunk")
    p.add_argument("--option", "-o", action="append", metavar="KEY=VALUE",
                   help="another backend option, e.g. -o activations=int8 (repeatable)")
    p.add_argument("--prefill", default=None, help="prefill lengths, comma-separated (default 128,512,2048)")
    p.add_argument("--contexts", default=None, help="decode contexts, comma-separated (default 128,1024,4096)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per point, median reported (default 3)")
    p.add_argument("--decode-steps", type=int, default=None, help="decode steps per repeat (default 64)")
    p.add_argument("--bandwidth-bytes", type=int, default=None,
                   help="bandwidth buffer size (default 2 GiB; 0 skips the measurement)")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                   help="first wait up to this long for other processes to leave the CPUs idle")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: prefill 16,64, contexts 16,64, 1 repeat, 4 decode steps, 512 MiB buffer")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--encode-only", action="store_true",
                   help="metal-sim: encode a decode step of the config (default: the full real model, 40 layers) with "
                        "virtual weights and report its cost (dispatches, levels, bytes vs floor, modelled tok/s)")


def run_encode_only(args: argparse.Namespace) -> dict:
    """`qwenmetal bench --backend metal-sim --encode-only`: the decode step of the real config, costed."""
    from .config import ModelConfig
    from .metal_backend import encode_only_cost

    if args.backend != "metal-sim":
        raise ValueError("--encode-only needs --backend metal-sim")
    if args.model:
        c = ModelConfig.from_file(args.model)
    else:
        c = ModelConfig.from_dict(resolve_config(args.config, 40 if args.layers is None and args.config == "real"
                                                 else args.layers))
    contexts = _ints(args.contexts) if args.contexts else (4096,)
    kv = args.kv_dtype or "bfloat16"
    by_ctx = {str(n): encode_only_cost(c, context=n, kv_dtype=kv) for n in contexts}
    first = by_ctx[str(contexts[0])]
    decode = {k: first[k] for k in ("dispatches", "levels", "command_buffers", "host_waits", "bytes_per_token",
                                    "floor_bytes", "bytes_vs_floor", "modelled_tok_s")}
    decode.update(context=contexts[0], level_latency_us=first["level_latency_us"])
    return {"backend": "metal-sim", "mode": "encode-only", "status": "simulator-verified, hardware-unverified",
            "config": {"layers": c.num_hidden_layers, "experts": c.num_experts, "vocab": c.vocab_size,
                       "hidden": c.hidden_size},
            "decode": decode, "decode_by_context": by_ctx}


def format_encode_only(res: Mapping[str, Any]) -> str:
    c = res["config"]
    lines = [f"metal-sim encode-only decode step ({res['status']}): {c['layers']} layers, {c['experts']} experts, "
             f"vocab {c['vocab']}",
             f"{'context':>8} {'dispatches':>10} {'levels':>7} {'cmdbuf/tok':>10} {'waits/tok':>9} "
             f"{'MB/token':>9} {'floor MB':>9} {'vs floor':>8}  modelled tok/s"]
    for ctx, r in res["decode_by_context"].items():
        tps = ", ".join(f"{chip} {v:.0f}" for chip, v in r["modelled_tok_s"].items())
        lines.append(f"{ctx:>8} {r['dispatches']:>10} {r['levels']:>7} {r['command_buffers']:>10.2f} "
                     f"{r['host_waits']:>9.2f} {r['bytes_per_token'] / 1e6:>9.1f} {r['floor_bytes'] / 1e6:>9.1f} "
                     f"{r['bytes_vs_floor']:>8.3f}  {tps}")
    lines.append(f"modelled: bytes / bandwidth + levels x {res['decode']['level_latency_us']:.1f} us "
                 "(per-level latency calibrated from Lily's published M5 Max decode; docs/metal.md)")
    return "\n".join(lines)


def main_args(args: argparse.Namespace) -> int:
    def log(msg):
        print(msg, file=sys.stderr, flush=True)
    if getattr(args, "encode_only", False):
        res = run_encode_only(args)
        print(format_encode_only(res))
    else:
        res = run(args, log=log)
        print(format_table(res))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
            f.write("\n")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="qwenmetal bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return main_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

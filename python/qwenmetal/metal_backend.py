"""The Metal backends: the C++ decode graph (``src/gpu/``) on a GPU device.

* ``backend="metal"`` (macOS, Apple Silicon): the graph on the real GPU through ``MetalDevice``.
* ``backend="metal-sim"`` (every platform): the same graph and the same kernels executed by the
  Metal-on-CPU simulator (``SimDevice``), with its checks on (barriers, divergence, uninitialised
  threadgroup memory, bounds, missing memory barriers between dispatches). It is slow — a tiny model
  runs a few tokens per second — and exists to verify the graph in CI.

Everything Metal is **simulator-verified, hardware-unverified** until a Mac has run it
(docs/mac-first-run.md).

Options (``Model.load(path, backend="metal-sim", **options)``):

* ``dtype``: activation type of every kernel, ``"bfloat16"`` (production; the default of ``metal``) or
  ``"float32"`` (exact against the float32 reference; the default of ``metal-sim``, a verification backend:
  its tokens are the CPU backend's). The bfloat build rounds where MLX's bf16 graph rounds.
* ``kv_dtype``: KV cache element type, ``"bfloat16"`` (default) or ``"float32"``; ``dtype="float32"``
  defaults it to ``"float32"``.
* ``attention``: overrides of the decode-attention policy, e.g. ``{"single_pass_max": 8}`` (tests use
  it to reach every route on short contexts).
* metal-sim only: ``schedule`` (``"forward"``, ``"reverse"``, ``"random"``: the order the simulator
  runs the threads of a threadgroup in) and ``seed``.

Prefill runs token by token through the decode graph (one command buffer per token). Weights are used
in place: each safetensors file is one device buffer wrapping its memory map, tensors are bound by
offset (``weight_table``); the stacked projections are built at load (their bytes are reported as
``copied_bytes``).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .cpu_backend import config_dict
from .session_io import gdn_state_arrays, gdn_state_vectors
from .weights import Weights
from .weights_table import virtual_weight_table, weight_table

DTYPES = ("bfloat16", "float32")


def _core():
    from . import _core
    return _core


# ------------------------------------------------------------------------------------------ backends
class _GpuBackend:
    """What metal and metal-sim share: the engine on a device, the state, Session.save/load."""

    name = ""

    def __init__(self, weights: Weights, device, dtype: str = "bfloat16", kv_dtype: str | None = None,
                 attention: dict | None = None):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if kv_dtype is None:
            kv_dtype = dtype
        if kv_dtype not in DTYPES:
            raise ValueError(f"kv_dtype must be one of {DTYPES}, got {kv_dtype!r}")
        self.weights = weights
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.attention = dict(attention or {})
        mappings, tensors, keep = weight_table(weights)
        self.device = device
        self.engine = _core().gpu.GpuEngine(device, config_dict(weights.config), mappings, tensors,
                                            "f32" if dtype == "float32" else "bf16", kv_dtype == "float32",
                                            self.attention, keep)

    def new_state(self):
        return self.engine.new_state()

    def forward(self, state, ids: np.ndarray, logits: str, consumed: list | None = None):
        """Run `ids` on `state` in place (all-or-nothing; a Ctrl-C between tokens restores it) and return
        (state, logits); `ids` are appended to `consumed` (a session's token list) inside the call."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        return state, self.engine.forward(state, ids, logits, consumed)

    def decode(self, state, first: int, n: int, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               min_p: float = 0.0, seed: int = 0, stop_ids=(), pipelined: bool = True, vocab: int = 0,
               consumed: list | None = None) -> list:
        """Generate up to `n` tokens after input token `first`, sampled on the GPU (argmax when
        temperature is 0) among logits [0, vocab) (0: all), one command buffer per token with two in
        flight; stops after a stop id. The state advances by the inputs consumed: `first` and every
        generated token but the last -- appended to `consumed` (a session's token list) inside the call.
        All-or-nothing: an error, or a Ctrl-C (checked between steps), restores the state of the start."""
        return self.engine.decode(state, int(first), int(n), greedy=temperature == 0, temperature=float(temperature),
                                  top_k=int(top_k), top_p=float(top_p), min_p=float(min_p), seed=int(seed),
                                  stop_ids=[int(t) for t in stop_ids], pipelined=pipelined, vocab=int(vocab),
                                  consumed=consumed)

    # ---- Session.save / Session.load (backend-independent layout, see session_io.py) -------------
    def state_to_arrays(self, state) -> dict:
        c = self.weights.config
        position, kv, conv, ssm = state._export()
        nkv, hd = c.num_key_value_heads, c.head_dim
        kv_t = np.float32 if self.kv_dtype == "float32" else ml_dtypes.bfloat16
        out = {"position": np.array([position], dtype=np.int64)}
        for j, i in enumerate(c.full_attention_layers):
            for n, a in (("key", kv[2 * j]), ("value", kv[2 * j + 1])):
                out[f"layers.{i}.{n}"] = a.view(kv_t).reshape(nkv, position, hd).copy()
        out.update(gdn_state_arrays(c, conv, ssm))
        return out

    def state_from_arrays(self, arrays: dict):
        c = self.weights.config
        position = int(np.asarray(arrays["position"]).reshape(-1)[0])
        kv_t = np.float32 if self.kv_dtype == "float32" else ml_dtypes.bfloat16
        kv = []
        for i in c.full_attention_layers:
            for n in ("key", "value"):
                a = np.ascontiguousarray(np.asarray(arrays[f"layers.{i}.{n}"]).astype(kv_t))   # [nkv, P, hd]
                kv.append(a.reshape(-1).view(np.uint8))
        conv, ssm = gdn_state_vectors(c, arrays)
        st = self.new_state()
        st._import(position, kv, conv, ssm)
        return st

    def info(self) -> dict:
        return {"device": dict(self.device.info), "dtype": self.dtype, "kv_dtype": self.kv_dtype,
                "weight_bytes": self.engine.weight_bytes, "copied_bytes": self.engine.copied_bytes,
                "status": "simulator-verified, hardware-unverified"}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dtype={self.dtype!r}, kv_dtype={self.kv_dtype!r}, device={self.device.info['name']!r})"


class MetalSimBackend(_GpuBackend):
    """The Metal graph and kernels executed by the Metal-on-CPU simulator (every platform)."""

    name = "metal-sim"

    def __init__(self, weights: Weights, dtype: str = "float32", kv_dtype: str | None = None,
                 attention: dict | None = None, schedule: str = "forward", seed: int = 0):
        dev = _core().gpu.SimDevice(schedule=schedule, seed=int(seed))
        self.schedule = schedule
        super().__init__(weights, dev, dtype, kv_dtype, attention)


class MetalBackend(_GpuBackend):
    """The Metal graph on this Mac's GPU (macOS builds only)."""

    name = "metal"

    def __init__(self, weights: Weights, dtype: str = "bfloat16", kv_dtype: str | None = None,
                 attention: dict | None = None):
        super().__init__(weights, _core().gpu.MetalDevice(), dtype, kv_dtype, attention)


def sim_available() -> bool:
    try:
        return hasattr(_core(), "gpu")
    except ImportError:
        return False


def metal_available() -> bool:
    """True on a macOS build with a Metal device."""
    try:
        g = _core().gpu
    except (ImportError, AttributeError):
        return False
    if not hasattr(g, "MetalDevice"):
        return False
    try:
        return bool(g.metal_device_available())
    except Exception:
        return False


# ------------------------------------------------------------------------------------------ costing
def encode_only_cost(config, *, context: int = 4096, dtype: str = "bfloat16", kv_dtype: str = "bfloat16",
                     tokens: int = 4, attention: dict | None = None) -> dict:
    """Encode decode steps of ``config`` (a ModelConfig) on an encode-only simulator device with virtual
    weights (the MLX 4-bit layout) at ``context`` cached tokens, and report what one step costs:
    dispatches, dependency levels, command buffers and host waits per token of the pipelined decode loop,
    bytes per token as declared by the host functions against the floor (weights touched + GDN state + KV)."""
    from .bench import decode_bytes
    core = _core()
    mappings, tensors, sizes = virtual_weight_table(config)
    dev = core.gpu.SimDevice(execute=False)
    eng = core.gpu.GpuEngine(dev, config_dict(config), mappings, tensors, "f32" if dtype == "float32" else "bf16",
                             kv_dtype == "float32", dict(attention or {}), [])
    st = eng.new_state()
    st._set_position(int(context))          # an encode-only state: the KV cache reserved, nothing computed
    step = eng.encode_cost(st)
    dev.reset_counters()
    eng.decode(st, 0, int(tokens), greedy=True)
    k = dev.counters()
    floor = decode_bytes(config, sizes, context, kv_element_bytes=4 if kv_dtype == "float32" else 2)
    moved = int(step["bytes_read"] + step["bytes_written"])
    return {"dispatches": int(step["dispatches"]), "levels": int(step["levels"]),
            "command_buffers": k["command_buffers"] / tokens, "host_waits": k["host_waits"] / tokens,
            "bytes_per_token": moved, "floor_bytes": int(floor["total"]), "bytes_vs_floor": moved / floor["total"],
            "modelled_tok_s": modelled_tok_s(moved, int(step["levels"])), "level_latency_us": LEVEL_LATENCY_S * 1e6,
            "floor": floor, "context": int(context)}


# Memory bandwidth of the Max chips (Apple's figures) and the per-level latency of the model below.
CHIP_BANDWIDTH_GBS = {"M1 Max": 400.0, "M2 Max": 400.0, "M3 Max": 400.0, "M4 Max": 546.0, "M5 Max": 614.0}
# Calibrated from Lily's published decode on an M5 Max (prior-art A.14 / D.2): 194 tok/s at 256 tokens of
# context = 5.15 ms per token for about 1.80 GB moved (1.67 GB weights + 126 MB GDN state + KV), which is
# 2.93 ms at the full 614 GB/s; the other 2.22 ms over Lily's ~555 dependency levels is ~4 us per level.
# (Assumes Lily's bandwidth-bound kernels stream at the chip's full rate: the latency is an upper estimate.)
LEVEL_LATENCY_S = 4.0e-6


def modelled_tok_s(bytes_per_token: float, levels: int, latency_s: float = LEVEL_LATENCY_S) -> dict:
    """tokens/s = 1 / (bytes / bandwidth + levels * latency) for each chip of CHIP_BANDWIDTH_GBS."""
    return {chip: 1.0 / (bytes_per_token / (bw * 1e9) + levels * latency_s) for chip, bw in CHIP_BANDWIDTH_GBS.items()}

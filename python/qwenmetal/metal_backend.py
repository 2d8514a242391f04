"""The Metal backends: the C++ decode and prefill graphs (``src/gpu/``) on a GPU device.

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
* ``prefill_chunk``: tokens per prefill chunk (default 4096, the modelled-cost optimum on the real config:
  docs/metal.md, "The prefill graph"); each chunk runs as command buffers committed back to back, and the
  prefill scratch is sized for it. The prefix cache snapshots at these chunk boundaries (``Model.load`` sets its ``chunk_tokens``).
* ``gemm_route``: the prefill GEMMs' route, ``"auto"`` (the device's: Metal 4 tensor ops on M5, else
  ``simdgroup_matrix``), ``"simdgroup"`` or ``"tensor"``.
* ``gdn_route``: the Gated DeltaNet prefill, ``"auto"`` (by chunk length from the cost model), ``"scan"``
  or ``"chunked"`` (the WY/UT form).
* ``memory_budget`` (``"auto"``, the default: the memory available here; bytes; or ``None``: never stream),
  ``expert_slots``, ``expert_policy`` (``"lfu"`` | ``"lru"`` | ``"os"``), ``expert_direct_io``: expert streaming
  (``qwenmetal.streaming``). When the checkpoint does not fit the budget, the routed experts are read from
  the files into ``expert_slots`` slot stacks per MoE layer (device buffers) as the routing asks for them,
  and a token runs as per-layer command buffers (docs/metal.md, "Streaming mode"); everything else stays
  as below. ``expert_slots`` / ``expert_policy`` force streaming on any checkpoint (tests).
* metal-sim only: ``schedule`` (``"forward"``, ``"reverse"``, ``"random"``: the order the simulator
  runs the threads of a threadgroup in) and ``seed``.

Prefill runs the prompt in chunks of ``prefill_chunk`` tokens, each cut into command buffers committed back to
back (under a modelled time budget: docs/metal.md, "Runtime limits") with no host read-back inside it (docs/metal.md, "The prefill graph"). Weights are used
in place: each safetensors file is one device buffer wrapping its memory map, tensors are bound by
offset (``weight_table``); the stacked projections are built at load (their bytes are reported as
``copied_bytes``).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .cpu_backend import config_dict, stream_spec
from .generation import expert_stats
from .session_io import gdn_state_arrays, gdn_state_vectors
from .weights import Weights
from .weights_table import virtual_weight_table, weight_table
from .working_set import DEFAULT_CONTEXT
from .working_set import plan as memory_plan

DTYPES = ("bfloat16", "float32")
# SimDevice's modelled Mac limits a metal-sim model can be given (device_options; docs/metal.md, "Runtime limits")
SIM_DEVICE_OPTIONS = {"pipeline_max_threads", "working_set", "watchdog_seconds"}
GEMM_ROUTES = ("auto", "simdgroup", "tensor")
GDN_ROUTES = ("auto", "scan", "chunked")
DEFAULT_PREFILL_CHUNK = 4096


def prefill_options(prefill_chunk, gemm_route: str, gdn_route: str, command_buffer_seconds=None) -> dict:
    """The engine's prefill options, validated (ValueError naming the option)."""
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, (int, np.integer)) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
    if gemm_route not in GEMM_ROUTES:
        raise ValueError(f"gemm_route must be one of {GEMM_ROUTES}, got {gemm_route!r}")
    if gdn_route not in GDN_ROUTES:
        raise ValueError(f"gdn_route must be one of {GDN_ROUTES}, got {gdn_route!r}")
    out = {"chunk": int(prefill_chunk), "gemm_route": gemm_route, "gdn_route": gdn_route}
    if command_buffer_seconds is not None:
        if isinstance(command_buffer_seconds, bool) or not isinstance(command_buffer_seconds, (int, float)) \
                or not command_buffer_seconds >= 0:
            raise ValueError(f"command_buffer_seconds must be a number >= 0, got {command_buffer_seconds!r}")
        out["command_buffer_seconds"] = float(command_buffer_seconds)
    return out


def _core():
    from . import _core
    return _core


# ------------------------------------------------------------------------------------------ backends
class _GpuBackend:
    """What metal and metal-sim share: the engine on a device, the state, Session.save/load."""

    name = ""

    def __init__(self, weights: Weights, device, dtype: str = "bfloat16", kv_dtype: str | None = None,
                 attention: dict | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 gemm_route: str = "auto", gdn_route: str = "auto", memory_budget="auto", expert_slots=None,
                 expert_policy=None, expert_direct_io=False, max_context: int = DEFAULT_CONTEXT,
                 command_buffer_seconds: float | None = None):
        prefill = prefill_options(prefill_chunk, gemm_route, gdn_route, command_buffer_seconds)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if kv_dtype is None:
            kv_dtype = dtype
        if kv_dtype not in DTYPES:
            raise ValueError(f"kv_dtype must be one of {DTYPES}, got {kv_dtype!r}")
        # against the GPU's working set (recommendedMaxWorkingSetSize): resident, a smaller chunk, or streaming
        self.memory = memory_plan(weights.config, weights, int(device.info["working_set"]), context=max_context,
                                  chunk=prefill["chunk"], dtype=dtype, kv_dtype=kv_dtype, memory_budget=memory_budget,
                                  expert_slots=expert_slots, expert_policy=expert_policy,
                                  expert_direct_io=expert_direct_io)
        prefill["chunk"] = self.memory.chunk
        self.plan = self.memory.stream
        streaming = stream_spec(weights, self.plan) if self.plan.stream else None
        self.weights = weights
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.attention = dict(attention or {})
        mappings, tensors, keep = weight_table(weights)
        self.device = device
        self.engine = _core().gpu.GpuEngine(device, config_dict(weights.config), mappings, tensors,
                                            "f32" if dtype == "float32" else "bf16", kv_dtype == "float32",
                                            self.attention, keep, prefill, streaming)
        self.prefill_chunk = int(self.engine.prefill_chunk)
        self.gemm_route = str(self.engine.gemm_route)
        self.gdn_route = gdn_route

    @property
    def snapshot_chunk(self) -> int:
        """The prefix cache's snapshot interval (``PrefixCache.chunk_tokens``): the prefill chunk, so every
        snapshot is the state at a chunk boundary of the GPU prefill."""
        return self.prefill_chunk

    def new_state(self):
        return self.engine.new_state()

    def forward(self, state, ids: np.ndarray, logits: str, consumed: list | None = None):
        """Run `ids` on `state` in place (all-or-nothing; a Ctrl-C between chunks restores it) and return
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

    # ---- speculative decoding (qwenmetal.speculative) ---------------------------------------------
    @property
    def native_verify(self) -> bool:
        """The graph verifies drafted tokens itself with resident experts; a streaming backend is verified
        row by row by qwenmetal.speculative."""
        return not self.plan.stream

    def verify(self, state, ids: np.ndarray, consumed: list | None = None, return_hidden: bool = False):
        """Run `ids` (at most 16, and 16 in a chain) with the logits of each ([n, vocab]), every row bit for
        bit a decode step's, keeping the GDN state after each row for `rewind` (consecutive calls chain).
        `return_hidden`: (logits, the final-normed hidden rows [n, hidden])."""
        return self.engine.verify(state, np.ascontiguousarray(ids, dtype=np.int64), consumed,
                                  return_hidden=bool(return_hidden))

    def rewind(self, state, keep: int, consumed: list | None = None) -> None:
        """End the verify chain keeping its first `keep` tokens (the rest leave `consumed` too)."""
        self.engine.rewind(state, int(keep), consumed)

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

    # ---- expert streaming statistics (generation.expert_stats summarises them) -------------------
    def expert_counters(self) -> dict:
        """Raw ExpertCache counters since the last `reset_expert_stats`: streaming, slots_per_layer,
        policy, lookups, hits, misses, bytes_read, io_seconds, tokens (run through the engine)."""
        return self.engine.expert_stats()

    def reset_expert_stats(self) -> None:
        self.engine.reset_expert_stats()

    def info(self) -> dict:
        return {"device": dict(self.device.info), "dtype": self.dtype, "kv_dtype": self.kv_dtype,
                "prefill_chunk": self.prefill_chunk, "gemm_route": self.gemm_route, "gdn_route": self.gdn_route,
                "weight_bytes": self.engine.weight_bytes, "copied_bytes": self.engine.copied_bytes,
                "slot_bytes": self.engine.slot_bytes, "experts": expert_stats(self.expert_counters()),
                "memory_plan": self.memory.describe(), "status": "simulator-verified, hardware-unverified"}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dtype={self.dtype!r}, kv_dtype={self.kv_dtype!r}, device={self.device.info['name']!r})"


class MetalSimBackend(_GpuBackend):
    """The Metal graph and kernels executed by the Metal-on-CPU simulator (every platform)."""

    name = "metal-sim"

    def __init__(self, weights: Weights, dtype: str = "float32", kv_dtype: str | None = None,
                 attention: dict | None = None, schedule: str = "forward", seed: int = 0,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, gemm_route: str = "auto", gdn_route: str = "auto",
                 memory_budget="auto", expert_slots=None, expert_policy=None, expert_direct_io=False,
                 max_context: int = DEFAULT_CONTEXT, command_buffer_seconds: float | None = None,
                 device_options: dict | None = None):
        opts = dict(device_options or {})
        unknown = set(opts) - SIM_DEVICE_OPTIONS
        if unknown:
            raise ValueError(f"device_options: unknown {sorted(unknown)}; known: {sorted(SIM_DEVICE_OPTIONS)}")
        dev = _core().gpu.SimDevice(schedule=schedule, seed=int(seed), **opts)
        self.schedule = schedule
        super().__init__(weights, dev, dtype, kv_dtype, attention, prefill_chunk, gemm_route, gdn_route,
                         memory_budget, expert_slots, expert_policy, expert_direct_io, max_context,
                         command_buffer_seconds)


class MetalBackend(_GpuBackend):
    """The Metal graph on this Mac's GPU (macOS builds only)."""

    name = "metal"

    def __init__(self, weights: Weights, dtype: str = "bfloat16", kv_dtype: str | None = None,
                 attention: dict | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 gemm_route: str = "auto", gdn_route: str = "auto", memory_budget="auto", expert_slots=None,
                 expert_policy=None, expert_direct_io=False, max_context: int = DEFAULT_CONTEXT,
                 command_buffer_seconds: float | None = None):
        g = _core().gpu
        dev = g.MetalDevice()
        # every family this GPU runs and every pipeline, now and in parallel: no dispatch waits for Apple's
        # compiler, and a kernel the compiler rejects fails the load, naming it, instead of a later call
        self.compile_report = dev.compile_all()
        bad = [r for r in self.compile_report if not r["ok"]]
        if bad:
            raise g.DeviceError("the Metal compiler rejected " + "; ".join(f"{r['origin']}:\n{r['log']}" for r in bad))
        super().__init__(weights, dev, dtype, kv_dtype, attention, prefill_chunk, gemm_route, gdn_route,
                         memory_budget, expert_slots, expert_policy, expert_direct_io, max_context,
                         command_buffer_seconds)


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
                     tokens: int = 4, attention: dict | None = None, bits: int = 4,
                     expert_bits: int | None = None) -> dict:
    """Encode decode steps of ``config`` (a ModelConfig) on an encode-only simulator device with virtual
    weights (the MLX layout at ``bits``, the routed experts at ``expert_bits``, default ``bits``) at
    ``context`` cached tokens, and report what one step costs: dispatches, dependency levels, command buffers
    and host waits per token of the pipelined decode loop, bytes per token as declared by the host functions
    (a matrix's rows * cols * bits / 8 + scales and biases, so they follow the width) against the floor
    (weights touched + GDN state + KV)."""
    from .bench import decode_bytes
    core = _core()
    mappings, tensors, sizes = virtual_weight_table(config, bits=bits, expert_bits=expert_bits)
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
# Calibrated from Lily's published decode on an M5 Max (docs/benchmarks.md, "Published figures"): 194 tok/s
# at 256 tokens of context = 5.15 ms per token for about 1.80 GB moved (1.67 GB weights + 126 MB GDN state
# + KV), which is 2.93 ms at the full 614 GB/s; the other 2.22 ms over Lily's ~555 dependency levels is
# ~4 us per level.
# (Assumes Lily's bandwidth-bound kernels stream at the chip's full rate: the latency is an upper estimate.)
LEVEL_LATENCY_S = 4.0e-6


def modelled_tok_s(bytes_per_token: float, levels: int, latency_s: float = LEVEL_LATENCY_S,
                   bandwidth_gbs: dict | None = None) -> dict:
    """tokens/s = 1 / (bytes / bandwidth + levels * latency) for each chip of ``bandwidth_gbs`` (name -> GB/s;
    default CHIP_BANDWIDTH_GBS)."""
    chips = CHIP_BANDWIDTH_GBS if bandwidth_gbs is None else bandwidth_gbs
    return {chip: 1.0 / (bytes_per_token / (bw * 1e9) + levels * latency_s) for chip, bw in chips.items()}


# ------------------------------------------------------------------------------------------ prefill costing
# Peak arithmetic of each chip on the route its prefill GEMMs take (TFLOP/s; a multiply-add is 2):
#   simdgroup_matrix (M1-M4): bf16/f16 simdgroup matrices run at the FP32 ALU rate on these GPUs, so the
#   FP32 peak: Apple's figures for M1 Max (32-core GPU, 10.4) and M2 Max (38-core, 13.6); M3 Max and M4 Max
#   (40-core; Apple publishes none) derived as cores x 128 FP32 lanes x 2 x clock (~1.6 GHz, ~1.8 GHz).
#   Metal 4 tensor ops (M5 Max, 40-core): Apple's claim of over 4x the M4's peak GPU compute for AI, applied
#   to the M4 Max figure (4 x 18.4). Lily's published M5 Max prefill (docs/benchmarks.md, "Published
#   figures"), which uses these tensor ops, implies an achieved rate that `encode_only_prefill_cost`
#   reports beside it as a check.
CHIP_PEAK_TFLOPS = {"M1 Max": 10.4, "M2 Max": 13.6, "M3 Max": 16.4, "M4 Max": 18.4, "M5 Max": 73.6}
# The rate Lily's published M5 Max 4K prefill (5724 tok/s) implies on this graph's declared FLOPs at 4K
# (5.4 GFLOP/token: `lily_implied_tflops`), 42 % of the peak above: the M5 Max is also modelled at this
# rate ("M5 Max (Lily's rate)"), i.e. as if our kernels reached only what Lily's reach.
M5_LILY_RATE_TFLOPS = 30.9
CHIP_ROUTE = {"M1 Max": "simdgroup", "M2 Max": "simdgroup", "M3 Max": "simdgroup", "M4 Max": "simdgroup",
              "M5 Max": "tensor"}
# Published M5 Max prefill tokens/s (Lily's 0.32.2-run column and MLX 0.32.2; docs/benchmarks.md, "Published
# figures").
PUBLISHED_PREFILL = {"Lily": {4096: 5724.4, 32768: 3927.5, 131072: 1792.7},
                     "MLX 0.32.2": {4096: 5165.7, 32768: 3963.7, 131072: 2237.5}}


def modelled_level_time(level_bytes, level_flops, bandwidth_gbs: float, peak_tflops: float,
                        latency_s: float = LEVEL_LATENCY_S) -> float:
    """Seconds for a command buffer's dependency levels: each level costs max(bytes / bandwidth,
    flops / peak) + the per-level latency (the levels run one after another; a level's dispatches overlap)."""
    b = np.asarray(level_bytes, dtype=np.float64)
    f = np.asarray(level_flops, dtype=np.float64)
    return float(np.maximum(b / (bandwidth_gbs * 1e9), f / (peak_tflops * 1e12)).sum() + len(b) * latency_s)


def slowest_chip() -> dict:
    """The slowest supported Apple GPU as the graph and SimDevice model it (src/gpu/cost.h): name,
    bandwidth_gbs, peak_tflops, and the watchdog budget / per-command-buffer target in seconds."""
    return dict(_core().gpu.slowest_chip())


def max_command_buffer_seconds(cost: dict, bandwidth_gbs: float, peak_tflops: float) -> float:
    """The modelled GPU time of the longest command buffer of a costed call (a StepCost dict: level_bytes,
    level_flops and command_buffer_levels, the first level of each command buffer)."""
    b, f = cost["level_bytes"], cost["level_flops"]
    starts = [int(x) for x in cost["command_buffer_levels"]] + [len(b)]
    return max((modelled_level_time(b[lo:hi], f[lo:hi], bandwidth_gbs, peak_tflops)
                for lo, hi in zip(starts, starts[1:]) if hi > lo), default=0.0)


def encode_only_prefill_cost(config, lengths=(4096,), *, chunk: int = DEFAULT_PREFILL_CHUNK,
                             dtype: str = "bfloat16", kv_dtype: str = "bfloat16", gdn_route: str = "auto",
                             chips: dict | None = None) -> dict:
    """Encode the prefill of ``config`` (a ModelConfig) for each prompt length, chunk by chunk (each cut into
    command buffers of at most the graph's target time on the slowest GPU), on an encode-only simulator device over virtual weights (the MLX 4-bit layout), once per
    GEMM route of CHIP_ROUTE, and report per chunk and per prompt: dispatches, dependency levels, command
    buffers, host waits, FLOPs and bytes as the host functions declare them, and a modelled tokens/s per
    chip (`modelled_level_time` with CHIP_BANDWIDTH_GBS / CHIP_PEAK_TFLOPS). ``chips``: more chips to model
    beside the Max chips, name -> (bandwidth_gbs, peak_tflops, route) (`qwenmetal selftest`'s GPU). A model,
    not a measurement."""
    core = _core()
    mappings, tensors, _ = virtual_weight_table(config)
    slow = slowest_chip()
    # the longest command buffer per chip: the slowest supported GPU on the simdgroup route, and each Max chip
    cb_chips = {slow["name"]: (slow["bandwidth_gbs"], slow["peak_tflops"], "simdgroup")}
    cb_chips.update({c: (CHIP_BANDWIDTH_GBS[c], CHIP_PEAK_TFLOPS[c], CHIP_ROUTE[c]) for c in CHIP_ROUTE})
    extra = {c: v for c, v in (chips or {}).items() if c not in CHIP_ROUTE}
    cb_chips.update(extra)
    out = {"chunk": int(chunk), "level_latency_us": LEVEL_LATENCY_S * 1e6, "peak_tflops": dict(CHIP_PEAK_TFLOPS),
           "bandwidth_gbs": dict(CHIP_BANDWIDTH_GBS), "chip_route": dict(CHIP_ROUTE),
           "m5_lily_rate_tflops": M5_LILY_RATE_TFLOPS, "watchdog_budget_ms": slow["watchdog_seconds"] * 1e3,
           "prompts": {}}
    for route in sorted(set(CHIP_ROUTE.values())):
        dev = core.gpu.SimDevice(execute=False, tensor_ops=route == "tensor")     # an M5-like device for "tensor"
        eng = core.gpu.GpuEngine(dev, config_dict(config), mappings, tensors, "f32" if dtype == "float32" else "bf16",
                                 kv_dtype == "float32", {}, [], prefill_options(chunk, route, gdn_route))
        for n in lengths:
            st = eng.new_state()
            chunks = []
            for p0 in range(0, int(n), int(chunk)):
                c = eng.prefill_cost(st, min(int(chunk), int(n) - p0))
                chunks.append({"position": p0, "rows": min(int(chunk), int(n) - p0), **c})
            p = out["prompts"].setdefault(str(n), {"tokens": int(n), "routes": {}, "modelled_tok_s": {}})
            keys = ("dispatches", "levels", "command_buffers", "host_waits", "flops", "bytes_read", "bytes_written")
            p["routes"][route] = {
                "chunks": [{k: int(c[k]) for k in ("position", "rows") + keys} for c in chunks],
                **{k: int(sum(int(c[k]) for c in chunks)) for k in keys}}
            for chip, (bw, peak, r) in cb_chips.items():
                if r == route:
                    p.setdefault("max_command_buffer_ms", {})[chip] = 1e3 * max(
                        max_command_buffer_seconds(c, bw, peak) for c in chunks)
            for chip, r in CHIP_ROUTE.items():
                if r != route:
                    continue
                t = sum(modelled_level_time(c["level_bytes"], c["level_flops"], CHIP_BANDWIDTH_GBS[chip],
                                            CHIP_PEAK_TFLOPS[chip]) for c in chunks)
                p["modelled_tok_s"][chip] = n / t
                if chip == "M5 Max":
                    t = sum(modelled_level_time(c["level_bytes"], c["level_flops"], CHIP_BANDWIDTH_GBS[chip],
                                                M5_LILY_RATE_TFLOPS) for c in chunks)
                    p["m5_max_at_lily_rate_tok_s"] = n / t
            for chip, (bw, peak, r) in extra.items():
                if r == route:
                    p["modelled_tok_s"][chip] = n / sum(modelled_level_time(c["level_bytes"], c["level_flops"],
                                                                            bw, peak) for c in chunks)
    for n, p in out["prompts"].items():
        tps = p["modelled_tok_s"]["M5 Max"]
        p["published_m5_max"] = {k: v.get(int(n)) for k, v in PUBLISHED_PREFILL.items()}
        p["m5_max_vs"] = {k: (tps / v if v else None) for k, v in p["published_m5_max"].items()}
        p["m5_max_at_lily_rate_vs"] = {k: (p["m5_max_at_lily_rate_tok_s"] / v if v else None)
                                       for k, v in p["published_m5_max"].items()}
        lily = p["published_m5_max"]["Lily"]
        m5 = p["routes"][CHIP_ROUTE["M5 Max"]]
        # the arithmetic rate Lily's published time implies if it did this graph's FLOPs (a check of the peak)
        p["lily_implied_tflops"] = (m5["flops"] / int(n) * lily / 1e12) if lily else None
    return out


def encode_only_verify_cost(config, rows=(2, 3, 5, 9), *, context: int = 4096, dtype: str = "bfloat16",
                            kv_dtype: str = "bfloat16") -> dict:
    """What verifying k = rows - 1 drafted tokens costs in the Metal graph against one decode step, at
    ``context`` cached tokens, per chip and GEMM route: the verification graph the backend runs
    (`GpuEngine.verify`: every row a decode step's arithmetic, the GEMVs over all rows) and, for comparison,
    a small-m prefill chunk with every row's logits (shares every weight read, but not the decode arithmetic:
    ``chunk_vs_step``). Encoded on an encode-only simulator device over virtual weights (the MLX 4-bit
    layout) and timed with `modelled_level_time` (CHIP_BANDWIDTH_GBS, CHIP_PEAK_TFLOPS). A model, not a
    measurement (docs/speculative.md)."""
    core = _core()
    mappings, tensors, _ = virtual_weight_table(config)
    out = {"context": int(context), "rows": {}, "step_seconds": {}, "level_latency_us": LEVEL_LATENCY_S * 1e6}
    for route in sorted(set(CHIP_ROUTE.values())):
        dev = core.gpu.SimDevice(execute=False, tensor_ops=route == "tensor")
        eng = core.gpu.GpuEngine(dev, config_dict(config), mappings, tensors, "f32" if dtype == "float32" else "bf16",
                                 kv_dtype == "float32", {}, [], prefill_options(DEFAULT_PREFILL_CHUNK, route, "auto"))
        st = eng.new_state()
        st._set_position(int(context))
        step = eng.encode_cost(st)
        graphs, chunks = {}, {}
        for n in rows:
            s = eng.new_state()
            s._set_position(int(context))
            graphs[int(n)] = eng.verify_cost(s, int(n))
            chunks[int(n)] = eng.prefill_cost(s, int(n), all_logits=True)
        for chip, r in CHIP_ROUTE.items():
            if r != route:
                continue
            bw, peak = CHIP_BANDWIDTH_GBS[chip], CHIP_PEAK_TFLOPS[chip]
            t1 = modelled_level_time(step["level_bytes"], step["level_flops"], bw, peak)
            out["step_seconds"][chip] = t1
            for n, c in graphs.items():
                t = modelled_level_time(c["level_bytes"], c["level_flops"], bw, peak)
                k = chunks[n]
                tc = modelled_level_time(k["level_bytes"], k["level_flops"], bw, peak)
                out["rows"].setdefault(n, {})[chip] = {"seconds": t, "vs_step": t / t1, "chunk_vs_step": tc / t1,
                                                       "levels": int(c["levels"]), "step_levels": int(step["levels"])}
    return out

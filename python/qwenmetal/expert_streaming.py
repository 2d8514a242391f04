"""Expert streaming: where each routed expert lives in the checkpoint's files, and the plan that decides
whether a model streams its experts under a memory budget and how many cache slots each MoE layer gets.

A model whose weights do not fit keeps every non-routed-expert weight resident (attention, GDN, shared
experts, router, embedding, lm_head, norms) and reads the routed experts a token needs from the files
into a bounded cache of fixed slots per MoE layer (``qwenmetal._core.ExpertCache``,
src/core/expert_cache.h). This module is the Python half: `expert_layout` finds each expert's bytes in
the files (the cache preads them; the mapping is never touched), `plan` sizes the cache from the budget,
`available_memory` resolves ``memory_budget="auto"``. The design is in docs/streaming.md.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from .config import KV_ELEMENT_BYTES, session_alloc_bytes, session_bytes
from .errors import CheckpointError, InputError
from .memory import available_memory, parse_budget
from .weights import EXPERT_MATRICES, QuantizedTensor, Weights, expert_names, moe_layers
from .weights_table import ptr, root_buffer, tensor_format

POLICIES = ("lru", "lfu", "os")
# measured (docs/streaming.md, "Measurements"): lfu has the best hit rate where the policy matters (50 % of the
# 8-layer real-width checkpoint: +10 points over lru), and "os" was slowest under a Linux memory limit
DEFAULT_POLICY = "lfu"
# What the planner keeps free of expert slots for one session: its KV cache at RESERVE_CONTEXT tokens and
# its GDN state (from the config), plus SCRATCH_BYTES for activations, the interpreter and its libraries.
RESERVE_CONTEXT = 8192
SCRATCH_BYTES = 256 << 20
# the routed-expert stacks of a MoE layer (streamed when the plan says so)
EXPERT_STACKS = tuple(f"switch_mlp.{m}" for m in EXPERT_MATRICES)


@dataclass(frozen=True)
class ExpertPart:
    """One matrix of an expert stack in a file: expert e's bytes are [offset + e*stride, + nbytes) of `path`."""

    path: str
    offset: int
    stride: int
    nbytes: int


def _expert_part(label: str, a: np.ndarray, num_experts: int, files: dict, where: str) -> ExpertPart:
    root = root_buffer(a)
    sf = files.get(id(root))
    if sf is None:
        raise CheckpointError(
            f"{where}: routed-expert tensor {label!r} is not a view of a safetensors file (the loader built it, "
            f"e.g. from per-expert keys), so its experts cannot be read from disk; `qwenmetal convert` writes "
            f"a checkpoint whose expert stacks can stream")
    if a.ndim < 2 or a.shape[0] != num_experts:
        raise CheckpointError(f"{sf.path}: routed-expert tensor {label!r} has shape {a.shape}, "
                              f"expected {num_experts} experts first")
    inner = a[0]
    if not inner.flags.c_contiguous or a.strides[0] < inner.nbytes:
        raise CheckpointError(f"{sf.path}: routed-expert tensor {label!r}: one expert's matrix is not one "
                              f"contiguous byte range (strides {a.strides}), so it cannot be read with one pread")
    offset = ptr(a) - ptr(np.frombuffer(root, np.uint8))
    part = ExpertPart(sf.path, int(offset), int(a.strides[0]), int(inner.nbytes))
    if offset < 0 or offset + (num_experts - 1) * part.stride + part.nbytes > sf.size:
        raise CheckpointError(f"{sf.path}: routed-expert tensor {label!r} lies outside the file")
    return part


def expert_layout(weights) -> dict[int, list[ExpertPart]]:
    """MoE layer index -> its routed experts' parts, in the fixed order: for gate_proj, up_proj, down_proj,
    the matrix's weight, scales and biases when quantized, or the matrix alone when dense.

    Raises CheckpointError when a routed-expert tensor is not a view of a safetensors file's map (an HF
    checkpoint with per-expert keys, stacked at load), naming it."""
    c = weights.config
    src = getattr(weights, "source", None)
    files = {id(sf._mmap): sf for sf in src.files.values()} if src is not None else {}
    out: dict[int, list[ExpertPart]] = {}
    for i in moe_layers(c):
        parts = []
        for name in expert_names(i):
            t = weights.tensors[name]
            arrays = ([(name + ".weight", t.weight), (name + ".scales", t.scales), (name + ".biases", t.biases)]
                      if isinstance(t, QuantizedTensor) else [(name, t)])
            for label, a in arrays:
                parts.append(_expert_part(label, a, c.num_experts, files, weights.path))
        out[i] = parts
    return out


def keep_unmapped(weights, layout: Mapping[int, list[ExpertPart]]) -> int:
    """Advise MADV_NOHUGEPAGE on the streamed expert stacks' pages of the files' maps; returns the bytes advised.

    The maps ask for 2 MiB folios (safetensors_io); with them a fault on a resident tensor beside an expert
    stack would PMD-map (and read ahead) the stack's first or last 2 MiB of expert bytes the cache already
    preads. Splitting the stacks off into their own no-huge mappings keeps every fault of the resident
    weights out of them (tests/test_streaming_cpu.py, test_streamed_experts_never_mapped). A hint only:
    systems without the advice keep their maps as they are."""
    src = getattr(weights, "source", None)
    if src is None or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return 0
    by_path = {sf.path: sf for sf in src.files.values()}
    page = mmap.PAGESIZE
    advised = 0
    for parts in layout.values():
        for p in parts:
            lo = -(-p.offset // page) * page
            hi = (p.offset + (weights.config.num_experts - 1) * p.stride + p.nbytes) // page * page
            if hi > lo:
                try:
                    by_path[p.path]._mmap.madvise(mmap.MADV_NOHUGEPAGE, lo, hi - lo)
                    advised += hi - lo
                except (OSError, ValueError):
                    pass
    return advised


def cache_tables(layout: Mapping[int, list[ExpertPart]]) -> tuple[list[str], dict[int, list[tuple]]]:
    """The layout as the C++ cache takes it: (files, {layer: [(file index, offset, stride, nbytes)]})."""
    files: list[str] = []
    index: dict[str, int] = {}
    layers = {}
    for layer, parts in layout.items():
        row = []
        for p in parts:
            if p.path not in index:
                index[p.path] = len(files)
                files.append(p.path)
            row.append((index[p.path], p.offset, p.stride, p.nbytes))
        layers[layer] = row
    return files, layers


@dataclass(frozen=True)
class StreamPlan:
    """Whether a model streams its routed experts, and the cache it gets (`plan`)."""

    stream: bool               # False: everything resident, nothing changes
    budget: int                # bytes the plan had to fit (resolved from "auto"; the checkpoint's size for None)
    checkpoint_bytes: int      # every tensor as stored
    resident_bytes: int        # every tensor but the routed experts
    expert_bytes: int          # one expert of one MoE layer, all parts (the mean over MoE layers)
    moe_layers: int
    num_experts: int
    top_k: int
    slots_per_layer: int       # 1..num_experts (num_experts when not streaming)
    policy: str                # "lru" | "lfu" | "os"
    reserve_bytes: int = 0     # kept free for one session's KV/state and scratch when sizing the slots
    direct_io: bool = False    # read experts past the page cache (Linux O_DIRECT, macOS F_NOCACHE)

    @property
    def slot_bytes(self) -> int:
        """Memory of the expert slots of every MoE layer."""
        return self.moe_layers * self.slots_per_layer * self.expert_bytes

    @property
    def naive_hit_rate(self) -> float:
        """The hit rate if every expert were equally likely and routing had no memory: slots / experts."""
        return self.slots_per_layer / self.num_experts if self.num_experts else 1.0

    def bytes_per_token(self, hit_rate: float) -> float:
        """Expected bytes read from the files per decoded token at a cache hit rate (0 when not streaming)."""
        if isinstance(hit_rate, bool) or not isinstance(hit_rate, (int, float)) or not 0.0 <= hit_rate <= 1.0:
            raise InputError(f"hit_rate must be a number in [0, 1], got {hit_rate!r}", "hit_rate")
        if not self.stream:
            return 0.0
        return self.moe_layers * self.top_k * self.expert_bytes * (1.0 - float(hit_rate))


def plan(config, weights_or_sizes, memory_budget="auto", *, slots_per_layer: int | None = None,
         policy: str | None = None, direct_io: bool = False, parallel: int = 1,
         context: int = RESERVE_CONTEXT) -> StreamPlan:
    """Plan expert streaming for `config` with the tensors of `weights_or_sizes` (a Weights, or a mapping
    canonical name -> bytes as stored) under `memory_budget` (None: never stream; "auto": available_memory();
    bytes, or a size string as `parse_budget` reads).

    Streams iff the checkpoint does not fit the budget, or `slots_per_layer` is given (tests force streaming
    that way). Slots per layer: `slots_per_layer`, else what the budget leaves after the resident weights and
    the reserve (one session's KV cache at RESERVE_CONTEXT tokens + its GDN state twice, live and the
    copy a streaming call restores on failure, + SCRATCH_BYTES), clamped to
    [1, num_experts]. Raises InputError naming memory_budget when the budget cannot hold the resident weights
    and the slots (at least one per layer). `direct_io`: the cache reads past the page cache (so a streamed
    expert's bytes are held once, in its slot); not with policy "os", which relies on the page cache."""
    budget = parse_budget(memory_budget)
    if slots_per_layer is not None and (isinstance(slots_per_layer, bool) or not isinstance(slots_per_layer, int)):
        raise InputError(f"expert_slots must be an int, got {slots_per_layer!r}", "expert_slots")
    if policy is not None and policy not in POLICIES:
        raise InputError(f"expert_policy must be one of {', '.join(POLICIES)}, got {policy!r}", "expert_policy")
    policy = policy or DEFAULT_POLICY
    if not isinstance(direct_io, bool):
        raise InputError(f"expert_direct_io must be True or False, got {direct_io!r}", "expert_direct_io")
    if direct_io and policy == "os":
        raise InputError("expert_direct_io cannot be used with expert_policy 'os' (it relies on the page cache)",
                         "expert_direct_io")
    sizes = ({k: int(v.nbytes) for k, v in weights_or_sizes.tensors.items()}
             if hasattr(weights_or_sizes, "tensors") else {k: int(v) for k, v in weights_or_sizes.items()})
    layers = moe_layers(config)
    E = config.num_experts
    expert_total = 0
    for i in layers:
        for name in expert_names(i):
            if name not in sizes:
                raise CheckpointError(f"no tensor {name!r} among the weights of this MoE model")
            if sizes[name] % E:
                raise CheckpointError(f"tensor {name!r}: {sizes[name]} bytes do not split into {E} experts")
            expert_total += sizes[name]
    checkpoint = sum(sizes.values())
    resident = checkpoint - expert_total
    per_slot = expert_total // E if E else 0             # one expert of every MoE layer
    expert_bytes = per_slot // len(layers) if layers else 0
    if slots_per_layer is not None and not 1 <= slots_per_layer <= max(E, 1):
        raise InputError(f"expert_slots must be in [1, {E}] (the experts per layer), got {slots_per_layer}",
                         "expert_slots")
    parallel = _positive(parallel, "parallel")
    context = _positive(context, "context")
    if budget == "auto":
        budget = available_memory()
    held = session_bytes(config, context)
    # a streaming forward also holds a copy of the GDN state, to restore it if an expert read fails mid-call
    # (src/cpu/forward.cpp, src/gpu/forward.cpp: all-or-nothing calls; a batched step copies every row's)
    reserve = parallel * (held["kv_cache"] + 2 * held["gdn_state"]) + SCRATCH_BYTES
    common = dict(checkpoint_bytes=checkpoint, resident_bytes=resident, expert_bytes=expert_bytes,
                  moe_layers=len(layers), num_experts=E, top_k=config.num_experts_per_tok, policy=policy,
                  reserve_bytes=reserve, direct_io=direct_io)
    fits = budget is None or checkpoint <= budget
    if not layers or (fits and slots_per_layer is None):
        return StreamPlan(stream=False, budget=checkpoint if budget is None else budget, slots_per_layer=E, **common)
    if slots_per_layer is None:
        slots_per_layer = int(min(max((budget - resident - reserve) // per_slot, 1), E))
    if budget is not None and budget < resident + slots_per_layer * per_slot:
        raise InputError(
            f"memory_budget {budget} bytes cannot hold the resident weights ({resident} bytes) and "
            f"{slots_per_layer} expert slot(s) per MoE layer ({slots_per_layer * per_slot} bytes)", "memory_budget")
    return StreamPlan(stream=True, budget=checkpoint if budget is None else budget,
                      slots_per_layer=slots_per_layer, **common)


def _positive(v, param: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InputError(f"{param} must be a positive integer, got {v!r}", param)
    return v


# the most concurrent sessions `default_parallel` proposes (a server's default; the backend's batch limit,
# model.max_batch_rows, may be lower or higher)
MAX_DEFAULT_PARALLEL = 8


@dataclass(frozen=True)
class ParallelPlan:
    """Concurrent sessions against a memory budget (`parallel_plan`): what one session holds at `context`
    tokens, what `parallel` of them hold, and how many fit beside the weights."""

    context: int
    parallel: int
    budget: int | None         # bytes (None: no budget, nothing is limited)
    weights_bytes: int         # held weights: the checkpoint, or (streaming) the resident part + top-k slots
    scratch_bytes: int         # SCRATCH_BYTES
    session: dict              # config.session_alloc_bytes: kv_tokens, kv_cache, gdn_state, total
    max_sessions: int | None   # the most sessions that fit beside the weights and scratch (0: not even one;
                               # None: no budget)
    streaming: bool            # the weights do not fit the budget: the plan counts the streamed minimum

    @property
    def sessions_bytes(self) -> int:
        return self.parallel * self.session["total"]

    @property
    def fits(self) -> bool:
        return self.max_sessions is None or self.parallel <= self.max_sessions

    def describe(self) -> list[str]:
        """Lines for `qwenmetal info --parallel N`."""
        s = self.session
        total = self.weights_bytes + self.scratch_bytes + self.sessions_bytes
        if self.budget is None:
            where = "no memory budget (nothing limits the sessions)"
        else:
            where = (f"of the budget {size_text(self.budget)}: {'fits' if self.fits else 'does NOT fit'}; at most "
                     f"{self.max_sessions} session(s) of {self.context:,} tokens fit")
        return [f"concurrent sessions at {self.context:,} tokens of context: one session holds "
                f"{size_text(s['total'])} (KV allocated for {s['kv_tokens']:,} tokens {size_text(s['kv_cache'])} + "
                f"GDN state {size_text(s['gdn_state'])})",
                f"  {self.parallel} session(s): {size_text(self.sessions_bytes)}; with the weights "
                f"({'streamed: resident + top-k expert slots ' if self.streaming else ''}{size_text(self.weights_bytes)}) "
                f"and scratch ({size_text(self.scratch_bytes)}): {size_text(total)} {where}"]


def parallel_plan(config, weights_or_sizes, memory_budget="auto", *, context: int = RESERVE_CONTEXT,
                  parallel: int = 1, kv_dtype: str = "bfloat16", backend: str = "cpu") -> ParallelPlan:
    """How `parallel` sessions of `context` tokens fit in `memory_budget` (as `plan` reads it; None: the
    budget: nothing limits) beside the weights: each session's KV cache as the backend allocates
    it by need (config.session_alloc_bytes: cpu worst case of its 1.5x growth in 256-token blocks, Metal
    rounded up to its kv_block) and its GDN state. The held weights are the checkpoint when it fits the budget,
    else the resident weights and top-k expert slots per MoE layer (the least that streams)."""
    context = _positive(context, "context")
    parallel = _positive(parallel, "parallel")
    if kv_dtype not in KV_ELEMENT_BYTES:
        raise InputError(f"kv_dtype must be one of {', '.join(KV_ELEMENT_BYTES)}, got {kv_dtype!r}", "kv_dtype")
    p = plan(config, weights_or_sizes, None)
    one = session_alloc_bytes(config, context, KV_ELEMENT_BYTES[kv_dtype], backend)
    budget = parse_budget(memory_budget)
    if budget == "auto":
        budget = available_memory()
    streaming = budget is not None and p.checkpoint_bytes > budget
    weights = p.checkpoint_bytes if not streaming else \
        p.resident_bytes + p.moe_layers * min(p.top_k, p.num_experts) * p.expert_bytes
    if budget is None:
        most = None
    else:
        left = budget - weights - SCRATCH_BYTES
        most = int(max(left // one["total"], 0)) if one["total"] else MAX_DEFAULT_PARALLEL
    return ParallelPlan(context, parallel, budget, weights, SCRATCH_BYTES, one, most, streaming)


def default_parallel(config, weights_or_sizes, memory_budget="auto", context: int = RESERVE_CONTEXT, *,
                     limit: int | None = None, kv_dtype: str = "bfloat16", backend: str = "cpu") -> int:
    """A server's default number of concurrent sessions: the largest N <= min(MAX_DEFAULT_PARALLEL, `limit`)
    (`limit`: e.g. the backend's max_batch_rows) whose sessions of `context` tokens fit beside the held weights
    and scratch in `memory_budget` (`parallel_plan`), and at least 1."""
    cap = MAX_DEFAULT_PARALLEL if limit is None else min(MAX_DEFAULT_PARALLEL, _positive(limit, "limit"))
    p = parallel_plan(config, weights_or_sizes, memory_budget, context=context, kv_dtype=kv_dtype, backend=backend)
    return cap if p.max_sessions is None else max(1, min(cap, p.max_sessions))


def size_text(n: float) -> str:
    """`n` bytes for a reader: "1.25 GiB", "640.00 MiB", "512 bytes"."""
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:,.2f} {unit}"
    return f"{n:,.0f} bytes"


def describe(p: StreamPlan, hit_rate: float | None = None) -> list[str]:
    """Lines for `qwenmetal info`: whether the model streams under the plan's budget, what stays resident,
    the slots, and the expected bytes read per token (at the naive hit rate and at `hit_rate` if given)."""
    lines = [f"memory budget: {size_text(p.budget)}; checkpoint {size_text(p.checkpoint_bytes)}, resident (all but "
             f"routed experts) {size_text(p.resident_bytes)}, one expert {size_text(p.expert_bytes)} x {p.num_experts} "
             f"experts x {p.moe_layers} MoE layers"]
    if not p.stream:
        lines.append("expert streaming: no (the checkpoint fits the budget: every weight stays resident)")
        return lines
    lines.append(f"expert streaming: yes, {p.slots_per_layer} of {p.num_experts} expert slots per MoE layer "
                 f"({size_text(p.slot_bytes)}), policy {p.policy}")
    rates = [("naive: slots / experts", p.naive_hit_rate)] + ([("given", hit_rate)] if hit_rate is not None else [])
    for what, h in rates:
        lines.append(f"  expected SSD reads at hit rate {h:.1%} ({what}): {size_text(p.bytes_per_token(h))} per token")
    return lines


def stream_spec(weights: Weights, plan) -> dict:
    """The engine's streaming spec for a streaming `plan`: the checkpoint files, each MoE layer's expert
    parts (`expert_layout`) as (file, offset, stride, nbytes), the slots and policy,
    and the stacks' formats. Also advises the maps to keep the streamed stacks out of huge-page faults
    (`keep_unmapped`): both backends set up streaming through here."""
    layout = expert_layout(weights)
    keep_unmapped(weights, layout)
    files, layers = cache_tables(layout)
    stacks = {f"layers.{i}.mlp.{n}": tensor_format(weights.tensors[f"layers.{i}.mlp.{n}"])
              for i in layers for n in EXPERT_STACKS}
    return dict(files=files, layers=layers, slots_per_layer=int(plan.slots_per_layer), policy=plan.policy,
                direct_io=bool(plan.direct_io), stacks=stacks)


def expert_stats(c: dict, at_decode: dict | None = None) -> dict:
    """A generation's (or a backend's, since its last generation started) expert streaming statistics from
    the backend's raw counters `c` (``expert_counters()``): streaming, slots_per_layer, policy, hit_rate
    (hits / lookups), bytes_read and io_seconds (SSD reads into the expert cache), bytes_per_token (bytes
    read per token run through the model, prompt and generated); with `at_decode` (the counters when
    decoding started) also decode_bytes_per_token, the decode phase's bytes per decoded token (what
    `StreamPlan.bytes_per_token` predicts)."""
    nan = float("nan")
    out = {"streaming": bool(c["streaming"]), "slots_per_layer": int(c["slots_per_layer"]), "policy": c["policy"],
           "hit_rate": c["hits"] / c["lookups"] if c["lookups"] else nan,
           "bytes_read": int(c["bytes_read"]), "io_seconds": float(c["io_seconds"]),
           "bytes_per_token": c["bytes_read"] / c["tokens"] if c["tokens"] else nan}
    if at_decode is not None:
        steps = c["tokens"] - at_decode["tokens"]
        out["decode_bytes_per_token"] = (c["bytes_read"] - at_decode["bytes_read"]) / steps if steps else nan
    return out

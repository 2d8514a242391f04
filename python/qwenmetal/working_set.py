"""The Metal backends' memory plan: what a model needs on the GPU against the device's working set.

Metal keeps a process's buffers resident only up to ``MTLDevice.recommendedMaxWorkingSetSize`` (about two
thirds of a Mac's memory up to 36 GB, three quarters above: ~21.3 GiB on a 32 GB Mac). Past it the GPU pages
and slows down by orders of magnitude, or the process is killed. So `plan` decides at load, from the figures:

1. **resident**: the weights + the KV cache at the requested context + the GDN state + the graph's scratch
   (decode buffers and one prefill chunk) fit the working set;
2. **smaller chunk**: they fit with a smaller prefill chunk (the chunk's scratch is most of the graph's);
3. **stream**: the routed experts are read from disk into a bounded cache (qwenmetal.expert_streaming) sized from
   what the working set leaves after everything else;
4. otherwise a clear error with the figures.

The graph's scratch is measured, not estimated: the engine is built on an encode-only device over virtual
weights of the config and asked to allocate one chunk (`graph_bytes`); the KV cache and the GDN state come
from the config (config.session_alloc_bytes: the KV rounded up to the graph's kv_block, the GDN state
twice), times the sessions planned for (`parallel`). Off a Mac the working set is a modelled figure
(`mac_working_set`), and SimDevice(working_set=...) reports it as a Mac would.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .config import KV_ELEMENT_BYTES, session_alloc_bytes
from .errors import InputError
from .expert_streaming import StreamPlan, size_text
from .expert_streaming import plan as stream_plan
from .native import core
from .weights_table import config_dict, virtual_weight_table

# What the planner tries when the default chunk does not fit, largest first (never below 256 rows: a
# smaller chunk costs prefill speed for little memory).
CHUNKS = (4096, 2048, 1024, 512, 256)
DEFAULT_CONTEXT = 32768
# Memory sizes of the Macs the plan is tested against (GiB), and the working set macOS gives each.
MAC_MEMORY_GIB = (16, 24, 32, 64)


def mac_working_set(memory_bytes: int) -> int:
    """recommendedMaxWorkingSetSize of an Apple-silicon Mac with `memory_bytes` of memory, as macOS sets it
    by default (modelled): 2/3 of memory up to 36 GiB, 3/4 above."""
    return int(memory_bytes * (2 / 3 if memory_bytes <= 36 * 2**30 else 3 / 4))




def graph_bytes(config, chunk: int, dtype: str = "bfloat16", kv_dtype: str = "bfloat16") -> int:
    """Bytes the Metal graph allocates for itself besides the weights and a session's state: the decode
    scratch and the scratch of one prefill chunk of `chunk` rows. Measured by building the engine on an
    encode-only device over virtual weights of `config` (nothing runs, nothing is read)."""
    ext = core()
    mappings, tensors, _ = virtual_weight_table(config)
    dev = ext.gpu.SimDevice(execute=False)
    eng = ext.gpu.GpuEngine(dev, config_dict(config), mappings, tensors, "f32" if dtype == "float32" else "bf16",
                             kv_dtype == "float32", {}, [], {"chunk": int(chunk)})
    eng.reserve_prefill(int(chunk))
    # less the virtual checkpoint's own buffers (an encode-only device allocates them) and the stacked
    # projections built at load: those are weights, not scratch
    return int(dev.allocated_bytes - sum(int(m[2]) for m in mappings) - eng.copied_bytes)


@dataclass(frozen=True)
class GpuMemoryPlan:
    """How a model is laid out against the GPU's working set (`plan`)."""

    mode: str                  # "resident" | "smaller chunk" | "stream" | "unlimited" (no working set known)
    working_set: int           # bytes (0: unknown)
    context: int               # tokens the KV cache is planned for
    chunk: int                 # prefill rows per chunk
    weight_bytes: int          # weights held on the GPU (all of them, or all but the routed experts)
    kv_bytes: int              # one session's KV cache at `context`
    state_bytes: int           # one session's GDN state, both halves of the graph's ping-pong
    scratch_bytes: int         # the graph's decode and prefill-chunk scratch
    stream: StreamPlan         # the expert plan (stream=False unless mode == "stream")
    parallel: int = 1          # sessions planned for, each with kv_bytes + state_bytes

    @property
    def sessions_bytes(self) -> int:
        """KV cache and GDN state of every planned session."""
        return self.parallel * (self.kv_bytes + self.state_bytes)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.stream.slot_bytes * self.stream.stream + self.sessions_bytes + \
            self.scratch_bytes

    def describe(self) -> list[str]:
        """Lines for `qwenmetal info`."""
        ws = "unknown (no limit assumed)" if not self.working_set else size_text(self.working_set)
        parts = (f"weights {size_text(self.weight_bytes)}"
                 + (f" + expert slots {size_text(self.stream.slot_bytes)}" if self.stream.stream else "")
                 + (f" + {self.parallel} sessions x (" if self.parallel > 1 else " + ")
                 + f"KV at {self.context:,} tokens {size_text(self.kv_bytes)} + GDN state {size_text(self.state_bytes)}"
                 + (")" if self.parallel > 1 else "")
                 + f" + scratch (chunk {self.chunk}) {size_text(self.scratch_bytes)} = {size_text(self.total_bytes)}")
        what = {"resident": "every weight resident",
                "smaller chunk": f"every weight resident with a prefill chunk of {self.chunk} rows",
                "stream": f"routed experts streamed from disk, {self.stream.slots_per_layer} of "
                          f"{self.stream.num_experts} slots per MoE layer",
                "unlimited": "every weight resident"}[self.mode]
        return [f"GPU working set: {ws}; plan: {what}", f"  {parts}"]


def plan(config, weights_or_sizes, working_set: int, *, context: int = DEFAULT_CONTEXT, chunk: int = CHUNKS[0],
         dtype: str = "bfloat16", kv_dtype: str = "bfloat16", memory_budget="auto", expert_slots=None,
         expert_policy=None, expert_direct_io: bool = False, parallel: int = 1) -> GpuMemoryPlan:
    """The plan for `config` with the tensors of `weights_or_sizes` (a Weights or name -> bytes) on a GPU
    whose working set is `working_set` bytes (0: unknown, nothing is limited by it), for sessions of up to
    `context` tokens and prefill chunks of up to `chunk` rows; memory_budget / expert_* as
    qwenmetal.expert_streaming.plan takes them (the expert plan is also bounded by the working set); `parallel`
    sessions of `context` tokens each (their KV caches and GDN states; one graph's scratch). Raises
    InputError naming the figures when even streaming cannot fit."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise InputError(f"context must be a positive integer, got {context!r}", "context")
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise InputError(f"parallel must be a positive integer, got {parallel!r}", "parallel")
    held = session_alloc_bytes(config, context, KV_ELEMENT_BYTES[kv_dtype], "metal")
    kv, state = held["kv_cache"], held["gdn_state"]
    sessions = parallel * (kv + state)
    base = stream_plan(config, weights_or_sizes, memory_budget, slots_per_layer=expert_slots, policy=expert_policy,
                       direct_io=expert_direct_io)
    weights = base.resident_bytes if base.stream else base.checkpoint_bytes
    if not working_set:                   # nothing to fit: the scratch is not measured (0)
        return GpuMemoryPlan("unlimited", 0, context, chunk, weights, kv, state, 0, base, parallel)
    if base.stream:                       # the memory budget (or forced slots) already streams
        scratch = graph_bytes(config, chunk, dtype, kv_dtype)
        p = GpuMemoryPlan("stream", working_set, context, chunk, weights, kv, state, scratch, base, parallel)
        if p.total_bytes <= working_set:
            return p
    candidates = [c for c in CHUNKS if c <= chunk] or [chunk]
    scratch = {}
    for c in candidates:                  # everything resident, the largest chunk that fits
        scratch[c] = graph_bytes(config, c, dtype, kv_dtype)
        if not base.stream and base.checkpoint_bytes + sessions + scratch[c] <= working_set:
            return GpuMemoryPlan("resident" if c == chunk else "smaller chunk", working_set, context, c,
                                 base.checkpoint_bytes, kv, state, scratch[c], base, parallel)
    # stream the routed experts: the slots get what the rest leaves of the working set, at the largest chunk
    # that leaves a token's experts (top-k) a slot each, else at the chunk that leaves the most slots
    budget = working_set if not base.stream else min(working_set, base.budget)
    per_slot = base.expert_bytes * base.moe_layers

    def slots_at(c: int) -> int:
        left = budget - base.resident_bytes - sessions - scratch[c]
        return int(min(base.num_experts, left // per_slot)) if per_slot else 0
    c = next((c for c in candidates if slots_at(c) >= min(base.top_k, base.num_experts)),
             max(candidates, key=lambda c: (slots_at(c), c)))
    if expert_slots is None:
        if slots_at(c) < 1:
            raise InputError(
                f"this GPU's working set is {size_text(working_set)}: the model's resident weights "
                f"({size_text(base.resident_bytes)}, everything but the routed experts) + "
                + (f"{parallel} sessions x (" if parallel > 1 else "")
                + f"KV at {context:,} tokens ({size_text(kv)}) + GDN state ({size_text(state)})"
                + (")" if parallel > 1 else "") + " + scratch "
                f"({size_text(scratch[c])}, chunk {c}) + one expert slot per MoE layer ({size_text(per_slot)}) need "
                f"{size_text(base.resident_bytes + sessions + scratch[c] + per_slot)}; lower the context"
                + (" or the sessions" if parallel > 1 else ""), "context")
        expert_slots = slots_at(c)
    streamed = replace(stream_plan(config, weights_or_sizes, None, slots_per_layer=expert_slots,
                                   policy=expert_policy, direct_io=expert_direct_io), budget=working_set)
    p = GpuMemoryPlan("stream", working_set, context, c, streamed.resident_bytes, kv, state, scratch[c], streamed,
                      parallel)
    if p.total_bytes > working_set:       # expert_slots given: more slots than the working set holds
        raise InputError(f"this GPU's working set is {size_text(working_set)}: {expert_slots} expert slots per MoE layer "
                         f"need {size_text(p.total_bytes)} in all ({'; '.join(p.describe()[1:]).strip()})", "expert_slots")
    return p

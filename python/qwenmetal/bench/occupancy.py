"""What the cost model cannot see from bytes and FLOPs alone: how many threadgroups of a kernel a GPU core
holds at once (occupancy), how many cores its grid keeps busy, and its threadgroup-memory bank conflicts
(counted by the simulator: ``SimDevice(count_banks=True).kernel_stats()``). Every figure here is modelled,
not measured; Metal is simulator-verified, hardware-unverified (docs/metal.md, "What the simulator counts").

The efficiency model of one dispatch (`dispatch_efficiency`), against the roofline's "at the bound":

    fill      = threadgroups / (cores * ceil(threadgroups / cores))
                (a grid of fewer threadgroups than cores keeps only that many cores busy; a larger one ends
                with a partly filled round: the busiest core runs ceil(threadgroups / cores) of them)
    conflicts = 1 / (1 + replays per SIMD-group access)
                (every threadgroup-memory access replayed that many extra cycles; an upper estimate of the
                slowdown, exact only for a kernel bound by its threadgroup-memory accesses)
    efficiency = fill * conflicts

and of a dependency level (`level_seconds`): its dispatches run concurrently, so the level takes at least its
slowest dispatch alone (bound / efficiency) and at least the whole GPU's work at the conflicts-slowed rate:

    level = max(max_d bound_d / eff_d, max(sum_d bytes_d / conflicts_d / bandwidth,
                                           sum_d flops_d / conflicts_d / peak)) + latency

which is the old level time max(sum bytes / bandwidth, sum flops / peak) + latency when every dispatch is
efficient. Threadgroups resident per core (`resident_per_core`) come from the per-core limits below; the time
model does not use them (how many resident threads a core needs to reach its share of the bandwidth is not
published), the per-kernel table reports them.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping

SIMD_WIDTH = 32

# Per-core limits of each Apple GPU family, ONE table. Sources and what is assumed:
#   * threads per core: philipturner/metal-benchmarks (README, "Layout of an M1 GPU Core": max threads per
#     core 768-3072 on Apple7 and Apple8, by the registers each thread takes). Registers are Apple's compiler's
#     and not modelled, so the upper figure is used: residency by threads is an upper bound.
#   * threadgroup memory per core: 64 KB on Apple7 and Apple8 (the same table, "Shared Memory");
#     32 KB per threadgroup on every family (Apple's Metal feature set tables, maxTotalThreadgroupMemory).
#   * Apple9 (M3, M4) and Apple10 (M5): no per-core figures are published (Apple9's Dynamic Caching
#     allocates registers and threadgroup memory from one on-chip pool at run time); ASSUMED equal to Apple8.
#   * threadgroups per core: no published cap (None): residency is limited by threads and memory only.
GPU_FAMILIES = {
    "Apple7": {"chips": "M1", "threads_per_core": 3072, "threads_per_core_min": 768,
               "tg_memory_per_core": 65536, "tg_memory_per_threadgroup": 32768, "threadgroups_per_core": None,
               "published": True},
    "Apple8": {"chips": "M2", "threads_per_core": 3072, "threads_per_core_min": 768,
               "tg_memory_per_core": 65536, "tg_memory_per_threadgroup": 32768, "threadgroups_per_core": None,
               "published": True},
}
# not published: assumed equal to Apple8 (above)
GPU_FAMILIES["Apple9"] = dict(GPU_FAMILIES["Apple8"], chips="M3, M4", published=False)
GPU_FAMILIES["Apple10"] = dict(GPU_FAMILIES["Apple8"], chips="M5", published=False)
# The column of each family in the per-kernel table.
FAMILY_LABEL = {"Apple7": "M1", "Apple8": "M2", "Apple9": "M3/M4", "Apple10": "M5"}

# The chips of the cost model (bench.cost): family and GPU cores (Apple's figures for the Max chips; the 7-core
# M1 is the slowest supported GPU of gpu/cost.h).
CHIP_FAMILY = {"M1 (7-core GPU)": "Apple7", "M1 Max": "Apple7", "M2 Max": "Apple8", "M3 Max": "Apple9",
               "M4 Max": "Apple9", "M5 Max": "Apple10"}
CHIP_CORES = {"M1 (7-core GPU)": 7, "M1 Max": 32, "M2 Max": 38, "M3 Max": 40, "M4 Max": 40, "M5 Max": 40}


def resident_per_core(threads_per_threadgroup: int, threadgroup_memory: int | None, family: str) -> dict:
    """Threadgroups of one kernel a core of `family` holds at once: the least of the limit by threads (a
    threadgroup takes whole SIMD-groups), by threadgroup memory (unknown: None, not limiting) and by a cap of
    threadgroups per core (none published). Returns {"resident", "by_threads", "by_memory", "limit"}."""
    f = GPU_FAMILIES[family]
    t = max(1, int(threads_per_threadgroup))
    t = -(-t // SIMD_WIDTH) * SIMD_WIDTH
    by_threads = f["threads_per_core"] // t
    by_memory = None
    if threadgroup_memory:
        by_memory = f["tg_memory_per_core"] // int(threadgroup_memory)
    cands = {"threads": by_threads}
    if by_memory is not None:
        cands["threadgroup memory"] = by_memory
    if f["threadgroups_per_core"]:
        cands["threadgroups per core"] = f["threadgroups_per_core"]
    limit = min(cands, key=lambda k: cands[k])
    return {"resident": cands[limit], "by_threads": by_threads, "by_memory": by_memory, "limit": limit}


def fill(threadgroups: int, cores: int) -> float:
    """The fraction of the GPU's cores a grid keeps busy, counting the last partly filled round."""
    g = max(1, int(threadgroups))
    return g / (cores * math.ceil(g / cores))


def conflict_factor(replays_per_access: float) -> float:
    return 1.0 / (1.0 + max(0.0, float(replays_per_access)))


def dispatch_efficiency(threadgroups: int, cores: int, replays_per_access: float = 0.0) -> float:
    """The modelled fraction of its bound one dispatch reaches (module docstring)."""
    return fill(threadgroups, cores) * conflict_factor(replays_per_access)


def _groups(r: Mapping) -> int:
    g = r["threadgroups"]
    return int(g[0]) * int(g[1]) * int(g[2])


def replays_of(kernel_stats: Mapping | None) -> dict:
    """kernel -> replays per SIMD-group access, from SimDevice.kernel_stats() (kernels never counted: absent)."""
    out = {}
    for k, s in (kernel_stats or {}).items():
        b = s.get("banks") if isinstance(s, Mapping) else None
        if b and b.get("accesses"):
            out[k] = b["replays"] / b["accesses"]
    return out


def levels_of(records: Iterable[Mapping]) -> list[list[Mapping]]:
    """Dispatch records (SimDevice.records(): kernel, level, command_buffer, threadgroups, bytes, flops)
    grouped by dependency level, in order (levels of later command buffers after earlier ones)."""
    out: dict = {}
    for r in records:
        out.setdefault((int(r.get("command_buffer", 0)), int(r["level"])), []).append(r)
    return [out[k] for k in sorted(out)]


def level_seconds(level: list[Mapping], bandwidth_gbs: float, peak_tflops: float, cores: int, latency_s: float,
                  replays: Mapping | None = None) -> tuple[float, float]:
    """(at the bound, with occupancy and conflicts) seconds of one dependency level (module docstring)."""
    bw, pk = bandwidth_gbs * 1e9, peak_tflops * 1e12
    replays = replays or {}
    b_sum = f_sum = b_slow = f_slow = worst = 0.0
    for r in level:
        b = float(r["bytes_read"] + r["bytes_written"])
        f = float(r.get("flops", 0))
        c = conflict_factor(replays.get(r["kernel"], 0.0))
        eff = fill(_groups(r), cores) * c
        b_sum += b
        f_sum += f
        b_slow += b / c
        f_slow += f / c
        worst = max(worst, max(b / bw, f / pk) / eff)
    bound = max(b_sum / bw, f_sum / pk)
    return bound + latency_s, max(worst, b_slow / bw, f_slow / pk) + latency_s


def records_seconds(records: Iterable[Mapping], bandwidth_gbs: float, peak_tflops: float, cores: int,
                    latency_s: float, replays: Mapping | None = None) -> tuple[float, float]:
    """(at the bound, with occupancy and conflicts) seconds of a costed call's dispatch records."""
    a = b = 0.0
    for lv in levels_of(records):
        x, y = level_seconds(lv, bandwidth_gbs, peak_tflops, cores, latency_s, replays)
        a += x
        b += y
    return a, b


def kernel_fractions(records: Iterable[Mapping], bandwidth_gbs: float, peak_tflops: float, cores: int,
                     replays: Mapping | None = None) -> dict:
    """kernel -> {"bound_s", "modelled_s", "fraction"}: each dispatch alone at its bound and at its efficiency
    (fraction = bound / modelled, the share of its bound the kernel reaches in this model)."""
    bw, pk = bandwidth_gbs * 1e9, peak_tflops * 1e12
    replays = replays or {}
    out: dict = {}
    for r in records:
        t = max(float(r["bytes_read"] + r["bytes_written"]) / bw, float(r.get("flops", 0)) / pk)
        eff = dispatch_efficiency(_groups(r), cores, replays.get(r["kernel"], 0.0))
        e = out.setdefault(r["kernel"], {"bound_s": 0.0, "modelled_s": 0.0})
        e["bound_s"] += t
        e["modelled_s"] += t / eff
    for e in out.values():
        e["fraction"] = e["bound_s"] / e["modelled_s"] if e["modelled_s"] else 1.0
    return out

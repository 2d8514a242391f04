"""Timed prefill and decode on a loaded model, the synthetic prompt, the greedy-token digest, peak RSS and
the machine description."""
from __future__ import annotations

import gc
import os
import platform
import resource
import statistics
import sys
import time
from typing import Any, Mapping

import numpy as np

from ..native import core

PROMPT_MULTIPLIER = 2654435761

def synthetic_prompt(n: int, vocab: int, offset: int = 0) -> np.ndarray:
    """Token i = ((i * 2654435761) mod 2^32) mod vocab (Lily's synthetic prompt, docs/benchmarks.md)."""
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
                max_context: int | None = None, counters=None) -> dict:
    """`counters`: an optional callable read just before the first and after the last timed step (the
    expert-cache counters of a streaming backend); its two readings are returned as ``counters``."""
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
    before = counters() if counters else None
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
    after = counters() if counters else None
    med = _median(samples)
    return {"context": context, "steps": steps, "counters": [before, after], "seconds_per_token": med, "ms_per_token": 1e3 * med,
            "tokens_per_second": 1.0 / med, "samples_ms": [1e3 * x for x in samples],
            "digest": digests[0], "digest_stable": len(set(digests)) == 1,
            "context_prefill_seconds": prefill_s}


def peak_rss_bytes() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kb) * (1 if sys.platform == "darwin" else 1024)


def machine_info() -> dict:
    """The machine a figure comes from: OS, Python, CPUs, memory, and the CPU as the engine sees it
    (``_core.cpu_info()``, the one place the CPU is detected: model name, vendor, family / model,
    micro-architecture, ISA, features, AMX usable now, the kernel variant each kernel family chose)."""
    info = {"platform": platform.platform(), "python": platform.python_version(), "numpy": np.__version__,
            "cpus": os.cpu_count()}
    try:
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:                      # pragma: no cover - not Linux
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_bytes"] = int(f.readline().split()[1]) * 1024
    except OSError:                             # pragma: no cover
        pass
    try:
        _core = core()
    except ImportError:                         # pragma: no cover - a build without the extension
        _core = None
    if _core is not None:
        info["cpu_info"] = _core.cpu_info()
        info["cpu"] = info["cpu_info"]["model_name"]
        info["build_info"] = _core.build_info()
    try:
        info["loadavg_at_start"] = list(os.getloadavg())    # other work on the box skews the numbers
    except OSError:                             # pragma: no cover
        pass
    for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS", "QWENMETAL_ISA", "QWENMETAL_AMX"):
        if k in os.environ:
            info.setdefault("env", {})[k] = os.environ[k]
    return info


def describe_machine(machine: Mapping[str, Any], read_gbps: float | None = None, threads: int | None = None) -> str:
    """One line naming the machine of a figure (docs and tables state every figure with it): CPU model,
    vendor, family / model, micro-architecture, ISA, AMX, the kernels chosen, CPUs, measured read
    bandwidth."""
    ci = machine.get("cpu_info") or {}
    parts = [f"{ci.get('model_name') or machine.get('cpu', '?')} ({ci.get('vendor', '?')}, "
             f"family {ci.get('family', '?')} model {ci.get('model', '?')}, uarch {ci.get('uarch', '?')})",
             f"isa {ci.get('isa', '?')}", f"AMX {'on' if ci.get('amx') else 'off'}"]
    if ci.get("kernels"):
        parts.append("kernels " + " ".join(f"{k}={v}" for k, v in sorted(ci["kernels"].items())))
    parts.append(f"{machine.get('cpus_usable', machine.get('cpus', '?'))} CPUs")
    if read_gbps:
        parts.append(f"read bandwidth {read_gbps:.1f} GB/s" + (f" ({threads} threads)" if threads else ""))
    return ", ".join(parts)

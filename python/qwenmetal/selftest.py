"""`qwenmetal selftest`: the Metal backend on this machine's device, and the report a Mac owner sends back.

One run gives:

1. versions and the device: name, GPU family, limits (max buffer length, working set, threads per
   threadgroup, threadgroup memory, and every kernel's maxTotalThreadsPerThreadgroup), SIMD-group reductions
   and matrices, Metal 4 tensor ops; the chip, looked up in APPLE_GPUS (Apple's memory bandwidth and FP32
   TFLOP/s) for the percentages of peak below;
2. the compile gate per kernel family: on a Mac, Apple's compiler (``MetalDevice.compile_all``: every
   library and every pipeline, with the compiler's log and times); on the simulator the kernels compiled
   into ``_core`` at build time (Apple's compiler did not run); then every kernel made into a pipeline;
3. every kernel family against numpy through its host function (one small shape each);
4. the whole decode graph on a generated tiny checkpoint: the float build against the CPU backend, the
   bfloat build against the numpy reference's bfloat16 mode (logit error, top-1 agreement, tokens/s);
5. one timed run per kernel family (FAMILY_RUNS) at the real model's widths: achieved GB/s and TFLOP/s
   from the bytes and FLOPs the host functions declare, against the chip's peak. On the simulator the
   runs use tiny shapes and are labelled as simulator times, with no percentage of any peak;
6. decode and prefill at 4K context on a random-weight checkpoint at the real widths with MEASURE_LAYERS
   layers, measured beside the cost model's prediction for the same config (``encode_only_cost`` /
   ``encode_only_prefill_cost``) for this chip and the Max chips. On the simulator only the prediction
   (a simulator's time is not a GPU's).

On a Mac it runs on the GPU (``backend="metal"``); elsewhere, or with ``--sim``, on the Metal-on-CPU
simulator. The text report is meant to be pasted into an issue; ``--json FILE`` writes all of it
(schema SCHEMA) to attach instead (docs/mac-first-run.md). A check the device cannot run (the paravirtual
GPU of CI runners has no SIMD-group reductions) is reported as skipped with the reason; the exit status
is 1 if anything failed.
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

import ml_dtypes
import numpy as np

from . import msl_sim, quant
from .backends.metal import DEFAULT_PREFILL_CHUNK, metal_available
from .bench.checkpoint import ensure_checkpoint, real_config
from .bench.cost import (
    CHIP_BANDWIDTH_GBS,
    CHIP_PEAK_TFLOPS,
    CHIP_ROUTE,
    LEVEL_LATENCY_S,
    encode_only_cost,
    encode_only_prefill_cost,
    modelled_tok_s,
)
from .bench.timing import time_decode, time_prefill
from .config import ModelConfig
from .fileio import atomic_file
from .model import Model
from .native import core
from .testing import cached_checkpoint
from .version import __version__

BF16 = ml_dtypes.bfloat16
SCHEMA = "qwenmetal-selftest/1"
SIM_LABEL = "simulator-verified, hardware-unverified"
CONTEXT = 4096                  # the context of the measured and modelled decode / prefill
MEASURE_LAYERS = 4              # layers of the real-width checkpoint timed on a Mac
FULL_LAYERS = 40                # Qwen3.6-35B-A3B as released (the full model's prediction)
DECODE_STEPS = 32
REPEATS = 2
ROTATE_BYTES = 256 << 20        # a timed run cycles through input copies this large: past any system-level cache


# ------------------------------------------------------------------------------------------ Apple GPUs
@dataclass(frozen=True)
class Chip:
    """An Apple GPU's published figures: memory bandwidth (GB/s) and FP32 TFLOP/s where Apple publishes one
    (None: achieved figures are reported without a percentage); ``tensor_tflops``: the Metal 4 tensor-op
    peak the prefill model uses (M5 Max); ``route``: the prefill GEMMs' route on it."""
    name: str
    bandwidth_gbs: float
    fp32_tflops: float | None = None
    tensor_tflops: float | None = None
    route: str = "simdgroup"
    note: str = ""

    @property
    def model_tflops(self) -> float | None:
        """The peak the cost model times the prefill GEMMs at on this chip's route."""
        return self.tensor_tflops if self.route == "tensor" else self.fp32_tflops


def _max_chip(name: str, note: str) -> Chip:
    """A Max chip from the cost model's figures (bench.cost.CHIP_BANDWIDTH_GBS / CHIP_PEAK_TFLOPS /
    CHIP_ROUTE), so the selftest and the model compare against the same numbers."""
    route, peak = CHIP_ROUTE[name], CHIP_PEAK_TFLOPS[name]
    return Chip(name, CHIP_BANDWIDTH_GBS[name], peak if route == "simdgroup" else None,
                peak if route == "tensor" else None, route, note)


# The full chip of each name (binned GPUs are below these figures; MTLDevice does not give the core count).
APPLE_GPUS = {c.name: c for c in [
    Chip("M1", 68.25, 2.6, note="8-core GPU (the 7-core: 2.29 TFLOP/s)"),
    Chip("M1 Pro", 200.0, 5.2, note="16-core GPU"),
    _max_chip("M1 Max", "32-core GPU"),
    Chip("M1 Ultra", 800.0, 21.0, note="64-core GPU"),
    Chip("M2", 100.0, 3.6, note="10-core GPU"),
    Chip("M2 Pro", 200.0, 6.8, note="19-core GPU"),
    _max_chip("M2 Max", "38-core GPU"),
    Chip("M2 Ultra", 800.0, 27.2, note="76-core GPU"),
    Chip("M3", 100.0, note="10-core GPU"),
    Chip("M3 Pro", 150.0, note="18-core GPU"),
    _max_chip("M3 Max", "40-core GPU (the 30-core: 300 GB/s); FP32 peak derived, Apple publishes none"),
    Chip("M3 Ultra", 819.0, note="80-core GPU"),
    Chip("M4", 120.0, note="10-core GPU"),
    Chip("M4 Pro", 273.0, note="20-core GPU"),
    _max_chip("M4 Max", "40-core GPU (the 32-core: 410 GB/s); FP32 peak derived, Apple publishes none"),
    Chip("M5", 153.0, route="tensor", note="10-core GPU; Metal 4 tensor ops, no published peak"),
    _max_chip("M5 Max", "40-core GPU; tensor-op peak: Apple's 4x-M4 claim on the M4 Max figure"),
]}


def chip_of(info: dict) -> Chip | None:
    """The APPLE_GPUS entry of a device (``dev.info``): "Apple M1 Max" -> M1 Max; None for the simulator,
    a paravirtual GPU or a chip not in the table."""
    if info.get("family") == "simulator":
        return None
    m = re.search(r"\bM(\d+)(?:\s+(Pro|Max|Ultra))?\b", str(info.get("name", "")))
    return APPLE_GPUS.get(f"M{m[1]}" + (f" {m[2]}" if m[2] else "")) if m else None


def rates(nbytes: float, flops: float, seconds: float | None, chip: Chip | None, peak: str = "fp32") -> dict:
    """Achieved GB/s and TFLOP/s of a timed run and their percentage of the chip's peak (bandwidth, and the
    FP32 or ``peak="tensor"`` tensor-op figure); None where there is no time or no published peak."""
    gbs = nbytes / seconds / 1e9 if seconds else None
    tflops = flops / seconds / 1e12 if seconds else None
    peak_gbs = chip.bandwidth_gbs if chip else None
    peak_tflops = (chip.tensor_tflops if peak == "tensor" else chip.fp32_tflops) if chip else None

    def pct(a, b):
        return 100.0 * a / b if a is not None and b else None
    return {"gbs": gbs, "tflops": tflops, "peak_gbs": peak_gbs, "peak_tflops": peak_tflops,
            "pct_of_peak_gbs": pct(gbs, peak_gbs), "pct_of_peak_tflops": pct(tflops, peak_tflops)}


# ------------------------------------------------------------------------------------------ the report
@dataclass
class Check:
    name: str
    status: str = "pass"          # pass | FAIL | skipped
    detail: str = ""
    max_error: float | None = None
    log: str = ""                 # the compile gate: Apple's compiler log (errors, or warnings)


@dataclass
class Report:
    device: dict = field(default_factory=dict)
    checks: list = field(default_factory=list)
    backend: str = "metal-sim"
    versions: dict = field(default_factory=dict)
    compile: list = field(default_factory=list)      # per family: compile_gate's dicts
    max_threads: dict = field(default_factory=dict)  # kernel -> the pipeline's maxTotalThreadsPerThreadgroup
    declared_threads: dict = field(default_factory=dict)  # kernel -> the simulator's (declared sizes, else 1024)
    timings: list = field(default_factory=list)      # per family: time_families' dicts
    four_k: dict = field(default_factory=dict)       # measure_4k's dict

    @property
    def simulated(self) -> bool:
        return self.device.get("family") == "simulator"

    @property
    def chip(self) -> Chip | None:
        return chip_of(self.device)

    @property
    def below_declared(self) -> dict:
        """Kernels whose pipeline allows fewer threads than the simulator's (the declared
        [[max_total_threads_per_threadgroup]], else 1024): Metal lowered them for their register use."""
        return {k: {"device": v, "declared": self.declared_threads[k]} for k, v in sorted(self.max_threads.items())
                if k in self.declared_threads and v < self.declared_threads[k]}

    @property
    def label(self) -> str:
        return SIM_LABEL if self.simulated else f"measured on {self.device.get('name')}"

    @property
    def failed(self) -> bool:
        return (any(c.status == "FAIL" for c in self.checks) or any(t.get("status") == "FAIL" for t in self.timings)
                or any(self.four_k.get(k, {}).get("status") == "FAIL" for k in ("prediction", "measured")))

    def text(self) -> str:
        d, chip = self.device, self.chip
        lines = [f"qwenmetal selftest report ({self.label})",
                 f"qwenmetal {__version__}, Python {platform.python_version()}, numpy {np.__version__}, "
                 f"{platform.platform()}",
                 f"device: {d.get('name')} (family {d.get('family')}); max buffer {_gib(d.get('max_buffer_length'))}, "
                 f"working set {_gib(d.get('working_set'))}, "
                 f"{d.get('max_threads_per_threadgroup')} threads/threadgroup, "
                 f"{d.get('max_threadgroup_memory')} B threadgroup memory; SIMD-group reductions: "
                 f"{d.get('simd_reductions')}, SIMD-group matrices: {d.get('simdgroup_matrix')}, "
                 f"Metal 4 tensor ops: {d.get('tensor_ops')}"]
        if chip:
            tf = f"{chip.fp32_tflops} FP32 TFLOP/s" if chip.fp32_tflops else "no published FP32 peak"
            if chip.tensor_tflops:
                tf += f", {chip.tensor_tflops} TFLOP/s tensor ops"
            lines.append(f"chip: {chip.name}: {chip.bandwidth_gbs:g} GB/s, {tf} ({chip.note})")
        elif not self.simulated:
            lines.append("chip: not in the selftest's table: achieved figures without % of peak")
        if self.max_threads:
            counts: dict = {}
            for v in self.max_threads.values():
                counts[v] = counts.get(v, 0) + 1
            low = self.below_declared
            lines.append(f"pipelines: {len(self.max_threads)} kernels; max threads per pipeline (kernels): "
                         + ", ".join(f"{v} ({n})" for v, n in sorted(counts.items(), reverse=True))
                         + "; below the declared / simulated limit: "
                         + (", ".join(f"{k} {v['device']} < {v['declared']}" for k, v in low.items())
                            if low else "none"))
        if self.simulated:
            lines.append("NOTE: no Metal device here: everything ran on the Metal-on-CPU simulator "
                         f"({SIM_LABEL}); Apple's compiler did not run")
        for c in self.checks:
            err = f"  max error {c.max_error:.2e}" if c.max_error is not None else ""
            lines.append(f"  [{c.status:>7}] {c.name}{err}{'  ' + c.detail if c.detail else ''}")
            lines += [f"            | {ln}" for ln in c.log.strip().splitlines()]
        lines += self._timing_lines() + self._four_k_lines()
        n = {s: sum(c.status == s for c in self.checks) for s in ("pass", "FAIL", "skipped")}
        nt = sum(t.get("status") == "FAIL" for t in self.timings)
        n4 = sum(self.four_k.get(k, {}).get("status") == "FAIL" for k in ("prediction", "measured"))
        lines.append(f"{n['pass']} passed, {n['FAIL'] + nt + n4} failed, {n['skipped']} skipped")
        return "\n".join(lines)

    def _timing_lines(self) -> list:
        if not self.timings:
            return []
        sim = self.simulated
        out = ["kernel timings, one run per family" + (
            " (SIMULATOR times at tiny shapes: not a GPU's, no % of peak)" if sim else
            " (GPU time of one command buffer / runs; bytes and FLOPs as the host functions declare them)")]
        for t in self.timings:
            if t.get("status") != "pass":
                out.append(f"  [{t.get('status'):>7}] {t['family']}: {t.get('reason') or t.get('error', '')}")
                continue
            head = f"  [{t['status']:>7}] {t['family']}: {t['op']} {t['shape']}"
            run = (f"{_bytes(t['bytes'] / t['runs'])}"
                   + (f", {t['flops'] / t['runs'] / 1e9:.3g} GFLOP" if t["flops"] else "")
                   + f" per run, {t['runs']} runs over {t['copies']} input copies")
            if t.get("seconds") is None:
                out.append(f"{head}: {run}; not timed (the device does not execute)")
                continue
            gbs = f"{t['gbs']:.3g} GB/s" + (f" ({_pct(t['pct_of_peak_gbs'])} of {t['peak_gbs']:g})"
                                            if t.get("pct_of_peak_gbs") is not None else "")
            tfl = f"{t['tflops']:.3g} TFLOP/s" + (f" ({_pct(t['pct_of_peak_tflops'])} of {t['peak_tflops']:g})"
                                                  if t.get("pct_of_peak_tflops") is not None else "")
            figures = [tfl, gbs] if t.get("bound") == "compute" else [gbs] + ([tfl] if t["flops"] else [])
            out.append(f"{head}: {1e3 * t['seconds_per_run']:.3g} ms/run, {', '.join(figures)}; {run}")
        return out

    def _four_k_lines(self) -> list:
        f = self.four_k
        if not f:
            return []
        out = [f"{_tokens(f['context'])} of context: real widths, {f['layers']} layers, random weights "
               "(measured beside the cost model's prediction for the same config)"]
        p = f.get("prediction", {})
        if p.get("status") == "FAIL":
            out.append(f"  prediction: FAIL {p.get('error')}")
        m = f.get("measured", {})
        if m.get("status") == "pass":
            for k in ("decode", "prefill"):
                c = f.get("comparison", {}).get(k, {})
                mod = (f"modelled for {c['chip']} {c['modelled_tok_s']:.1f} tok/s, measured/modelled {c['ratio']:.2f}"
                       if c.get("modelled_tok_s")
                       else "no prediction for this chip (no published peak, unknown chip or no prediction)")
                out.append(f"  {k:<8} measured {m[k]['tokens_per_second']:.1f} tok/s; {mod}")
        else:
            out.append(f"  measured: {m.get('status')} ({m.get('reason') or m.get('error')})")
        if p.get("status") == "pass":
            for k in ("decode", "prefill"):
                tps = p[k]["modelled_tok_s"]
                out.append(f"  modelled {k}, these {p['layers']} layers: "
                           + ", ".join(f"{c} {v:.0f}" for c, v in tps.items()) + " tok/s")
            full = f.get("full_model_prediction", {})
            if full.get("status") == "pass":
                for k in ("decode", "prefill"):
                    tps = full[k]["modelled_tok_s"]
                    out.append(f"  modelled {k}, the full model ({full['layers']} layers): "
                               + ", ".join(f"{c} {_num(v)}" for c, v in tps.items()) + " tok/s")
        return out

    def to_json(self) -> dict:
        d, chip = self.device, self.chip
        top = d.get("max_threads_per_threadgroup") or 1024
        n = {s: sum(c.status == s for c in self.checks) for s in ("pass", "FAIL", "skipped")}
        return {
            "schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "label": self.label,
            "simulated": self.simulated, "backend": self.backend, "failed": self.failed, "versions": self.versions,
            "device": {"info": d, "chip": asdict(chip) if chip else None,
                       "limits": {"family": d.get("family"), "max_buffer_length": d.get("max_buffer_length"),
                                  "working_set": d.get("working_set"),
                                  "max_threads_per_threadgroup": d.get("max_threads_per_threadgroup"),
                                  "max_threadgroup_memory": d.get("max_threadgroup_memory"),
                                  "max_threads_per_pipeline": dict(sorted(self.max_threads.items())),
                                  "pipelines_below_max_threads": {k: v for k, v in sorted(self.max_threads.items())
                                                                  if v < top},
                                  "pipelines_below_declared": self.below_declared}},
            "compile": self.compile,
            "checks": [asdict(c) for c in self.checks],
            "timings": self.timings,
            "four_k": self.four_k,
            "summary": {"passed": n["pass"], "failed": n["FAIL"], "skipped": n["skipped"],
                        "timings_failed": sum(t.get("status") == "FAIL" for t in self.timings)},
        }


def _gib(n) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "n/a"


def _bytes(n: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= k:
            return f"{n / k:.3g} {unit}"
    return f"{n:.0f} B"


def _pct(x: float) -> str:
    return f"{x:.0f} %" if x >= 1 else f"{x:.2g} %"


def _tokens(n: int) -> str:
    return f"{n // 1024}K tokens" if n % 1024 == 0 else f"{n} tokens"


def _num(x) -> str:
    return f"{x:.0f}" if x is not None else "n/a"


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def write_json(report: Report, path) -> None:
    """The report as JSON at `path`, written atomically (an interrupted run leaves no half file)."""
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(report.to_json(), indent=1, default=_jsonable) + "\n", encoding="utf-8")


def versions() -> dict:
    """The software and machine a report comes from."""
    v = {"qwenmetal": __version__, "python": platform.python_version(), "numpy": np.__version__,
         "platform": platform.platform(), "machine": platform.machine(), "macos": platform.mac_ver()[0] or None,
         "cpus": os.cpu_count()}
    try:
        v["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):   # pragma: no cover - a platform without these
        pass
    try:
        _core = core()
        v["build_info"] = dict(_core.build_info())
    except (ImportError, AttributeError):           # pragma: no cover - a build without the extension
        pass
    return v


def _device(sim: bool):
    _core = core()
    g = _core.gpu
    if not sim and metal_available():
        return g.MetalDevice(), "metal"
    return g.SimDevice(), "metal-sim"


def _log(msg: str) -> None:
    print(f"selftest: {msg}", file=sys.stderr, flush=True)


def _run(report: Report, name: str, fn, *args, needs_simd: bool = True):
    if needs_simd and not report.device.get("simd_reductions", True):
        report.checks.append(Check(name, "skipped", "the device has no SIMD-group reductions (paravirtual GPU)"))
        return None
    t = time.perf_counter()
    try:
        out = fn(*args)
    except Exception as e:          # a failing check is reported, the others still run
        report.checks.append(Check(name, "FAIL", f"{type(e).__name__}: {e}"))
        traceback.print_exc()
        return None
    err, detail, ok = out
    report.checks.append(Check(name, "pass" if ok else "FAIL", detail + f" ({time.perf_counter() - t:.2f} s)", err))
    return out


# ------------------------------------------------------------------------------------------ compile gate
SIM_COMPILER = "none: the simulator runs the kernels compiled into qwenmetal._core (Apple's compiler did not run)"
APPLE_COMPILER = "Apple's Metal compiler (newLibraryWithSource:, at run time)"


def compile_gate(dev) -> list:
    """One dict per kernel family: {family, origin, ok, status, log, seconds, pipeline_seconds, pipelines,
    language_version, kernels, compiler, max_threads, errors}. On a Mac every family this GPU runs is compiled by
    Apple's compiler with all its pipelines (``compile_all``: the log is the compiler's); elsewhere the
    simulator's kernels (compiled into _core). Then every kernel of a compiled family is made into a pipeline
    (``prepare``) and its maxTotalThreadsPerThreadgroup read. The tensor-op GEMM family runs on M5 (apple10)
    GPUs only; elsewhere it is reported as skipped."""
    tensor = bool(dev.info.get("tensor_ops"))
    skip_reason = "this GPU has no Metal 4 tensor ops (gemm_tensor runs on M5 / apple10 GPUs only)"
    if hasattr(dev, "compile_all"):
        out = [dict(r, compiler=APPLE_COMPILER, status="pass" if r["ok"] else "FAIL") for r in dev.compile_all()]
        embedded = type(dev).embedded_families() if hasattr(type(dev), "embedded_families") else []
        ran = {r["family"] for r in out}
        out += [{"family": f, "origin": f"metal/{f}.metal", "ok": None, "status": "skipped", "log": "",
                 "reason": skip_reason if f == "gemm_tensor" else "not compiled for this GPU", "kernels": [],
                 "compiler": APPLE_COMPILER} for f in embedded if f not in ran]
    else:
        lib, by_file = msl_sim.builtin_library(), {}
        for k in lib.kernels:
            by_file.setdefault(lib.kernel_info(k)["file"], []).append(k)
        out = []
        for origin, names in sorted(by_file.items()):
            fam = os.path.splitext(os.path.basename(origin))[0]
            r = {"family": fam, "origin": origin, "ok": True, "status": "pass", "log": "", "seconds": None,
                 "pipeline_seconds": None, "pipelines": len(names), "language_version": None, "kernels": names,
                 "compiler": SIM_COMPILER}
            if fam == "gemm_tensor" and not tensor:
                r.update(ok=None, status="skipped", reason=skip_reason, pipelines=0)
            out.append(r)
    for r in out:
        if r["status"] != "pass":
            continue
        t, errors, threads = time.perf_counter(), [], {}
        for k in r["kernels"]:
            try:
                dev.prepare(k)
                threads[k] = int(dev.max_threads(k))
            except Exception as e:
                errors.append(f"{k}: {type(e).__name__}: {e}")
        if r["pipeline_seconds"] is None:
            r["pipeline_seconds"] = time.perf_counter() - t
        r["max_threads"] = threads
        if errors:
            r.update(ok=False, status="FAIL", errors=errors)
    return out


def declared_threads(kernels) -> dict:
    """Each kernel's maxTotalThreadsPerThreadgroup on the simulator: its declared
    [[max_total_threads_per_threadgroup]], else 1024 -- what the host functions were verified with."""
    _core = core()
    ref = _core.gpu.SimDevice(execute=False)
    out = {}
    for k in kernels:
        try:
            out[k] = int(ref.max_threads(k))
        except Exception:       # a kernel the simulator does not have (add_source)
            pass
    return out


def _compile_checks(report: Report, dev) -> None:
    try:
        fams = compile_gate(dev)
    except Exception as e:
        report.checks.append(Check("compile gate", "FAIL", f"{type(e).__name__}: {e}"))
        traceback.print_exc()
        return
    report.compile = fams
    for r in fams:
        report.max_threads.update(r.pop("max_threads", {}))     # the JSON has them once, under the device limits
    report.declared_threads = declared_threads(report.max_threads)
    for r in fams:
        name = f"compile gate: {r['family']}"
        if r["status"] == "skipped":
            report.checks.append(Check(name, "skipped", r.get("reason", "")))
            continue
        if r["compiler"] == APPLE_COMPILER:
            detail = (f"{r['origin']}, MSL {r.get('language_version')}: library {r.get('seconds', 0):.2f} s, "
                      f"{r.get('pipelines')} pipelines {r.get('pipeline_seconds', 0):.2f} s")
        else:
            detail = f"{r['origin']}: {len(r['kernels'])} kernels (compiled into _core; Apple's compiler did not run)"
        errors = r.get("errors", [])
        if errors:
            detail += f"; {len(errors)} pipeline(s) failed: {errors[0]}"
        report.checks.append(Check(name, r["status"], detail, log=r.get("log") or "\n".join(errors[1:])))


# ------------------------------------------------------------------------------------------ checks
def _rel(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))


def _readback(buf, dtype, shape):
    return np.frombuffer(buf.to_bytes(), dtype=dtype).reshape(shape)


def _upload(dev, a: np.ndarray, label=""):
    """A device buffer holding a copy of `a` (works whether or not the device can wrap host memory)."""
    b = dev.alloc(a.nbytes, label)
    b.write(np.ascontiguousarray(a).tobytes())
    return b


def _encode(dev, fn):
    _core = core()
    cb = dev.command_buffer()
    enc = _core.gpu.Encoder(dev, cb)
    fn(enc)
    cb.commit()
    cb.wait()


def check_norm(dev) -> tuple:
    _core = core()
    ops = _core.gpu.ops
    rng = np.random.default_rng(0)
    R, H = 3, 2048
    x = rng.standard_normal((R, H)).astype(np.float32)
    w = rng.standard_normal(H).astype(np.float32)
    xb, wb, yb = _upload(dev, x), _upload(dev, w), dev.alloc(x.nbytes)
    _encode(dev, lambda e: ops.rmsnorm(e, "f32", xb, wb, yb, R, H, 1e-6))
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6) * w
    err = _rel(_readback(yb, np.float32, (R, H)), ref)
    return err, f"rmsnorm [{R}, {H}]", err < 1e-5


def check_qmv(dev) -> tuple:
    """4-bit group-64 GEMV at the real hidden size, bf16 scales, float activations."""
    _core = core()
    g = _core.gpu
    rng = np.random.default_rng(1)
    N, K = 64, 2048
    wq, sc, bi = quant.quantize(rng.standard_normal((N, K)).astype(np.float32), 4, 64, scale_dtype=BF16)
    W = g.Matrix("q4", N, K, _upload(dev, wq), _upload(dev, sc), _upload(dev, bi), group_size=64)
    x = rng.standard_normal(K).astype(np.float32)
    xb, yb = _upload(dev, x), dev.alloc(N * 4)
    _encode(dev, lambda e: g.ops.qmv(e, "f32", W, xb, yb))
    ref = quant.dequantize(wq, sc, bi, 4, 64).astype(np.float64) @ x
    err = _rel(_readback(yb, np.float32, (N,)), ref)
    return err, f"qmv q4 [{N}, {K}]", err < 1e-5


def check_topk(dev) -> tuple:
    """Router softmax + top-8 of 256 experts, renormalised."""
    _core = core()
    rng = np.random.default_rng(2)
    E, k = 256, 8
    logits = (3 * rng.standard_normal(E + 1)).astype(np.float32)
    lb, ib, wb = _upload(dev, logits), dev.alloc(k * 4), dev.alloc(k * 4)
    _encode(dev, lambda e: _core.gpu.ops.moe_topk(e, lb, E, k, True, ib, wb))
    p = np.exp(logits[:E].astype(np.float64) - logits[:E].max())
    p /= p.sum()
    want = np.argsort(-p, kind="stable")[:k]
    ids, w = _readback(ib, np.uint32, (k,)), _readback(wb, np.float32, (k,))
    err = _rel(w, p[want] / p[want].sum())
    return err, f"moe_topk {k} of {E}", bool((ids == want).all()) and err < 1e-5


def check_argmax(dev) -> tuple:
    """argmax over the real vocabulary (248,320 float logits), ties to the lowest index."""
    _core = core()
    ops = _core.gpu.ops
    rng = np.random.default_rng(3)
    V = 248320
    logits = rng.standard_normal(V).astype(np.float32)
    logits[[1000, 200000]] = 9.0
    lb, tb, sb = _upload(dev, logits), dev.alloc(4), dev.alloc(ops.sample_scratch_bytes(V))
    _encode(dev, lambda e: ops.argmax(e, lb, V, tb, sb))
    tok = int(_readback(tb, np.uint32, (1,))[0])
    return None, f"argmax over {V}: {tok}", tok == 1000


def check_token_mask(dev) -> tuple:
    """The token mask (structured output) over the real vocabulary, then argmax in the same command buffer: the
    masked logits equal numpy's bit for bit, the token is the best allowed one (the unmasked argmax is masked)."""
    _core = core()
    ops = _core.gpu.ops
    rng = np.random.default_rng(4)
    V = 248320
    logits = rng.standard_normal(V).astype(np.float32)
    logits[1000] = 9.0                                   # the unmasked argmax: masked out
    allowed = np.zeros(32 * ops.token_mask_words(V), np.uint8)
    allowed[rng.choice(V, 500, replace=False)] = 1
    allowed[[1000, V - 1]] = 0, 1
    words = np.packbits(allowed, bitorder="little").view("<u4")    # llguidance's layout
    want = np.where(allowed[:V] == 1, logits, np.float32(-np.inf))
    lb, mb = _upload(dev, logits), _upload(dev, words)
    tb, sb = dev.alloc(4), dev.alloc(ops.sample_scratch_bytes(V))

    def encode(e):
        ops.apply_token_mask(e, lb, V, mb)
        ops.argmax(e, lb, V, tb, sb)
    _encode(dev, encode)
    tok = int(_readback(tb, np.uint32, (1,))[0])
    same = np.array_equal(_readback(lb, np.float32, (V,)), want)
    return None, f"mask + argmax over {V}: {tok}", same and tok == int(np.argmax(want))


def check_graph(backend: str, dtype: str) -> tuple:
    """The decode graph on the tiny checkpoint, teacher-forced over 16 steps: the float build against the CPU
    backend's exact arithmetic (float KV and activations), the bfloat build against the numpy reference's
    bfloat16 mode (MLX's rounding points); max logit error relative to the range, top-1 agreement, tok/s."""
    path = cached_checkpoint("tiny", "mlx-q4", seed=0)
    prompt = [5, 17, 3, 99, 42, 7, 250, 1]
    if dtype == "float32":
        ref = Model.load(path, backend="cpu", kv_dtype="float32", activations="float")
    else:
        ref = Model.load(path, backend="reference", dtype="bfloat16")
    gpu = Model.load(path, backend=backend, dtype=dtype)
    sr, sg = ref.new_session(), gpu.new_session()
    want, got = ref.prefill(sr, prompt), gpu.prefill(sg, prompt)
    errs, agree, n = [], 0, 16
    t0 = time.perf_counter()
    for _ in range(n):
        errs.append(float(np.abs(got - want).max() / (want.max() - want.min())))
        t = int(np.argmax(want))
        agree += int(np.argmax(got)) == t
        want, got = ref.decode_step(sr, t), gpu.decode_step(sg, t)
    dt = time.perf_counter() - t0
    err = max(errs)
    ok = err < 1e-4 and agree == n if dtype == "float32" else err < 5e-2 and agree >= 0.9 * n
    against = "cpu backend" if dtype == "float32" else "reference bf16 mode"
    return err, f"vs {against}: top-1 {agree}/{n}, {n / dt:.1f} tok/s (ref + graph)", ok


# one small-shape check per kernel family, through its host function
FAMILY_CHECKS = [("norm: rmsnorm", check_norm), ("quant: qmv", check_qmv), ("moe: top-k", check_topk),
                 ("sample: argmax", check_argmax), ("sample: token mask", check_token_mask)]


# ------------------------------------------------------------------------------------------ timed runs
class _Inputs:
    """Device buffers for a timed run: random contents where the device executes, else (an encode-only
    device) buffers of the right sizes with nothing in them."""

    def __init__(self, dev, seed: int = 0):
        self.dev = dev
        self.rng = np.random.default_rng(seed)
        self.fill = bool(dev.info.get("executes", True))

    def _wrap(self, a: np.ndarray):
        return self.dev.wrap(a.view(np.uint16) if a.dtype == BF16 else a)

    def normal(self, n: int, dtype=BF16, scale: float = 1.0):
        if not self.fill:
            return self.dev.alloc(n * np.dtype(dtype).itemsize)
        return self._wrap((scale * self.rng.standard_normal(n, dtype=np.float32)).astype(dtype))

    def words(self, n: int):
        """n random uint32 words (packed quantized codes)"""
        if not self.fill:
            return self.dev.alloc(4 * n)
        return self._wrap(self.rng.integers(0, 2**32, size=n, dtype=np.uint32))

    def array(self, a: np.ndarray):
        if not self.fill:
            return self.dev.alloc(a.nbytes)
        return self._wrap(np.ascontiguousarray(a))

    def out(self, nbytes: int):
        return self.dev.alloc(nbytes)

    def q4(self, rows: int, cols: int, count: int = 1, gs: int = 64):
        """a gpu.Matrix of `count` stacked [rows, cols] 4-bit group-`gs` matrices, bf16 scales and biases"""
        _core = core()
        n = count * rows * cols
        return _core.gpu.Matrix("q4", rows, cols, self.words(n // 8), self.normal(n // gs, BF16, 0.02),
                                self.normal(n // gs, BF16, 0.01), group_size=gs, count=count)


@dataclass
class FamilyRun:
    op: str
    shape: str
    dtype: str
    copies: int              # input sets cycled through (past the system-level cache)
    encode: object           # encode(enc, i): one run on input set i
    bound: str = "bandwidth"  # which figure the family is judged by: bandwidth | compute
    peak: str = "fp32"       # compute peak: fp32 | tensor


def _copies(real: bool, per_copy: int, cap: int = 256) -> int:
    return max(1, min(cap, math.ceil(ROTATE_BYTES / max(per_copy, 1)))) if real else 1


def run_norm(dev, real: bool) -> FamilyRun:
    _core = core()
    R, H = (4096, 2048) if real else (8, 256)
    inp = _Inputs(dev, 10)
    w = inp.normal(H)
    n = _copies(real, 4 * R * H)
    xs, ys = [inp.normal(R * H) for _ in range(n)], [inp.out(2 * R * H) for _ in range(n)]
    return FamilyRun("rmsnorm", f"[{R}, {H}]", "bf16", n,
                     lambda e, i: _core.gpu.ops.rmsnorm(e, "bf16", xs[i], w, ys[i], R, H, 1e-6))


def run_quant(dev, real: bool) -> FamilyRun:
    """The LM head's GEMV (the largest matrix of a decode step)."""
    _core = core()
    N, K = (248320, 2048) if real else (64, 256)
    inp = _Inputs(dev, 11)
    W, x, y = inp.q4(N, K), inp.normal(K), inp.out(4 * N)
    return FamilyRun("qmv q4 (f32 out)", f"[{N}, {K}]", "bf16", 1,
                     lambda e, i: _core.gpu.ops.qmv(e, "bf16", W, x, y, f32_out=True))


def run_moe(dev, real: bool) -> FamilyRun:
    """The routed experts of one decode token: gate/up then down over k of E experts (each run picks k
    experts no earlier run picked, so the expert weights come from memory)."""
    _core = core()
    ops = _core.gpu.ops
    E, k, H, I = (256, 8, 2048, 512) if real else (8, 2, 128, 64)
    inp = _Inputs(dev, 12)
    gate, up, down = inp.q4(I, H, E), inp.q4(I, H, E), inp.q4(H, I, E)
    x, act = inp.normal(H), inp.out(2 * k * I)
    w = inp.array(np.full(k, 1.0 / k, np.float32))
    n = E // k if real else 1
    ids = [inp.array(np.arange(i * k, (i + 1) * k, dtype=np.uint32)) for i in range(n)]

    def encode(e, i):
        ops.moe_gate_up(e, "bf16", gate, up, None, x, ids[i], k, act)
        ops.moe_down(e, "bf16", down, None, act, ids[i], w, None, E, k, x)
    return FamilyRun("moe_gate_up + moe_down q4", f"{k} of {E} experts, [{I}, {H}]", "bf16", n, encode)


def run_sample(dev, real: bool) -> FamilyRun:
    _core = core()
    ops = _core.gpu.ops
    V = 248320 if real else 1000
    inp = _Inputs(dev, 13)
    n = _copies(real, 4 * V)
    logits = [inp.normal(V, np.float32) for _ in range(n)]
    tok, scratch = inp.out(4), inp.out(ops.sample_scratch_bytes(V))
    return FamilyRun("argmax", f"[{V}]", "f32", n, lambda e, i: ops.argmax(e, logits[i], V, tok, scratch))


def run_vision(dev, real: bool) -> FamilyRun:
    """The vision tower's MLP activation: GELU-tanh with its bias over a 1024 x 1024 image's patches (4096 rows
    of the tower's 4304-wide MLP), in place."""
    _core = core()
    R, N = (4096, 4304) if real else (8, 64)
    inp = _Inputs(dev, 14)
    b = inp.normal(N)
    n = _copies(real, 4 * R * N)
    ys = [inp.normal(R * N) for _ in range(n)]
    return FamilyRun("vision_bias_act gelu_tanh", f"[{R}, {N}]", "bf16", n,
                     lambda e, i: _core.gpu.ops.vision_bias_act(e, "bf16", ys[i], b, R, N, "gelu_tanh"))


def run_attention(dev, real: bool) -> FamilyRun:
    """Decode attention of one layer at CONTEXT cached keys (bf16 KV), each run another layer's cache."""
    _core = core()
    ops = _core.gpu.ops
    nh, nkv, hd, n_keys = (16, 2, 256, CONTEXT) if real else (4, 1, 32, 64)
    inp = _Inputs(dev, 14)
    q, proj = inp.normal(nh * hd), inp.normal(nh * 2 * hd + 2 * nkv * hd)
    kv = nkv * n_keys * hd
    n = _copies(real, 4 * kv)
    caches = [(inp.normal(kv), inp.normal(kv)) for _ in range(n)]
    scratch = inp.out(max(ops.attention_scratch_bytes(nh, nkv, hd, n_keys), 4))
    o = inp.out(2 * nh * hd)
    shape = dict(n_heads=nh, n_kv_heads=nkv, head_dim=hd, capacity=n_keys, output_gate=True, kv_dtype="bfloat16")
    return FamilyRun(f"attention_decode ({ops.attention_route(n_keys)})",
                     f"{n_keys} keys, {nh}/{nkv} heads of {hd}", "bf16", n,
                     lambda e, i: ops.attention_decode(e, "bfloat16", q, proj, caches[i][0], caches[i][1], n_keys,
                                                       scratch, o, **shape))


def run_gdn(dev, real: bool) -> FamilyRun:
    """One Gated DeltaNet decode step (the recurrent state read and written), each run another layer's state."""
    _core = core()
    ops = _core.gpu.ops
    s = ops.GdnShape(nk=16, nv=32, dk=128, dv=128, conv_kernel=4) if real else \
        ops.GdnShape(nk=2, nv=4, dk=16, dv=16, conv_kernel=4)
    inp = _Inputs(dev, 15)
    act, z = inp.normal(s.conv_dim), inp.normal(s.value_dim)
    b, a = inp.normal(s.nv), inp.normal(s.nv)
    A_log, dt_bias = inp.normal(s.nv, np.float32, 0.5), inp.normal(s.nv, np.float32, 0.5)
    norm_w, y = inp.normal(s.dv), inp.out(2 * s.value_dim)
    state_n = s.nv * s.dv * s.dk
    n = _copies(real, 8 * state_n)
    states = [inp.normal(state_n, np.float32, 0.1) for _ in range(n)]
    return FamilyRun("gdn_step", f"{s.nk}/{s.nv} heads, {s.dk} x {s.dv} state", "bf16", n,
                     lambda e, i: ops.gdn_step(e, "bf16", s, act, z, b, a, A_log, dt_bias, norm_w, 1e-6, states[i], y))


def _run_gemm(dev, real: bool, route: str) -> FamilyRun:
    """A prefill GEMM: M rows through a 4-bit [N, K] weight (the attention q projection of a chunk)."""
    _core = core()
    M, N, K = (512, 8192, 2048) if real else (32, 64, 128)
    inp = _Inputs(dev, 16)
    W, x, y = inp.q4(N, K), inp.normal(M * K), inp.out(2 * M * N)
    return FamilyRun(f"gemm q4 ({route})", f"M {M}, [{N}, {K}]", "bf16", 1,
                     lambda e, i: _core.gpu.ops.gemm(e, "bf16", W, x, y, M, route=route), bound="compute",
                     peak="tensor" if route == "tensor" else "fp32")


def run_gemm(dev, real: bool) -> FamilyRun:
    return _run_gemm(dev, real, "simdgroup")


def run_gemm_tensor(dev, real: bool) -> FamilyRun:
    return _run_gemm(dev, real, "tensor")


# one timed run per kernel family (family, function, needs Metal 4 tensor ops)
FAMILY_RUNS = [("attention", run_attention, False), ("gdn", run_gdn, False), ("gemm", run_gemm, False),
               ("gemm_tensor", run_gemm_tensor, True), ("moe", run_moe, False), ("norm", run_norm, False),
               ("quant", run_quant, False), ("sample", run_sample, False), ("vision", run_vision, False)]


def time_family(dev, run: FamilyRun, runs: int, chip: Chip | None) -> dict:
    """A warm-up (one run on every input copy), then `runs` runs in one command buffer (cycling through the
    input copies), timed from commit to completion; bytes and FLOPs as the host functions declare them."""
    _core = core()
    g = _core.gpu
    cb = dev.command_buffer()
    warm = g.Encoder(dev, cb)
    for i in range(run.copies):
        run.encode(warm, i)
    cb.commit()
    cb.wait()
    cb = dev.command_buffer()
    enc = g.Encoder(dev, cb)
    for i in range(runs):
        run.encode(enc, i % run.copies)
    t = time.perf_counter()
    cb.commit()
    cb.wait()
    dt = time.perf_counter() - t
    seconds = dt if dev.info.get("executes", True) else None
    nbytes = int(enc.bytes_read + enc.bytes_written)
    return {"op": run.op, "shape": run.shape, "dtype": run.dtype, "bound": run.bound, "runs": runs,
            "copies": run.copies, "dispatches": int(enc.dispatches), "levels": int(enc.levels),
            "bytes_read": int(enc.bytes_read), "bytes_written": int(enc.bytes_written), "bytes": nbytes,
            "flops": int(enc.flops), "seconds": seconds,
            "seconds_per_run": seconds / runs if seconds is not None else None,
            **rates(nbytes, int(enc.flops), seconds, chip, run.peak)}


def time_families(dev, *, real: bool, chip: Chip | None, runs: int | None = None) -> list:
    """FAMILY_RUNS on `dev`: at the real model's widths (`real`, a GPU) or at tiny shapes (the simulator),
    each family's result with its status (a failing run is reported, the others still run)."""
    out = []
    for fam, fn, needs_tensor in FAMILY_RUNS:
        r = {"family": fam, "simulated": dev.info.get("family") == "simulator", "real_shapes": real}
        if not dev.info.get("simd_reductions", True):
            out.append({**r, "status": "skipped", "reason": "the device has no SIMD-group reductions"})
            continue
        if needs_tensor and not dev.info.get("tensor_ops"):
            out.append({**r, "status": "skipped", "reason": "no Metal 4 tensor ops (M5 / apple10 GPUs only)"})
            continue
        fr = None
        try:
            fr = fn(dev, real)
            n = runs or (max(fr.copies, 8) if real else 2)
            out.append({**r, **time_family(dev, fr, n, chip), "status": "pass"})
        except Exception as e:
            traceback.print_exc()
            out.append({**r, "status": "FAIL", "error": f"{type(e).__name__}: {e}"})
        del fr                  # the inputs go before the next family's are made
    return out


# ------------------------------------------------------------------------------------------ 4K: measured and modelled
def predict(cfg: dict, chip: Chip | None, *, context: int = CONTEXT, chunk: int = DEFAULT_PREFILL_CHUNK) -> dict:
    """The cost model's decode and prefill tokens/s at `context` for a config.json dict, for the Max chips
    and `chip` (decode from its bandwidth; prefill also needs its peak: None without one)."""
    c = ModelConfig.from_dict(cfg)
    d = encode_only_cost(c, context=context)
    dec = dict(d["modelled_tok_s"])
    extra = {}
    if chip:
        dec.update(modelled_tok_s(d["bytes_per_token"], d["levels"], bandwidth_gbs={chip.name: chip.bandwidth_gbs}))
        if chip.model_tflops:
            extra[chip.name] = (chip.bandwidth_gbs, chip.model_tflops, chip.route)
    p = encode_only_prefill_cost(c, (context,), chunk=chunk, chips=extra)["prompts"][str(context)]
    route = chip.route if chip else "simdgroup"
    return {"status": "pass", "layers": c.num_hidden_layers, "context": context, "chip": chip.name if chip else None,
            "level_latency_us": LEVEL_LATENCY_S * 1e6,
            "decode": {"dispatches": d["dispatches"], "levels": d["levels"], "bytes_per_token": d["bytes_per_token"],
                       "floor_bytes": d["floor_bytes"], "modelled_tok_s": dec},
            "prefill": {"chunk": chunk, "route": route,
                        **{k: p["routes"][route][k] for k in ("dispatches", "levels", "command_buffers", "flops",
                                                               "bytes_read", "bytes_written")},
                        "modelled_tok_s": dict(p["modelled_tok_s"])}}


def measure(backend: str, path, context: int = CONTEXT, *, decode_steps: int = DECODE_STEPS,
            repeats: int = REPEATS, **options) -> dict:
    """Prefill of `context` tokens and decode at `context` cached tokens of the checkpoint at `path` on
    `backend` (qwenmetal.bench.timing: the synthetic prompt, median of `repeats`)."""
    max_context = context + decode_steps + 16
    t = time.perf_counter()
    model = Model.load(str(path), backend=backend, max_context=max_context, **options)
    load_s = time.perf_counter() - t
    pre = time_prefill(model, context, repeats, warmup=1, max_context=max_context)
    dec = time_decode(model, context, decode_steps, repeats, max_context=max_context)
    dec.pop("counters", None)
    b = model.backend_info()
    return {"status": "pass", "backend": backend, "load_seconds": load_s, "layers": model.config.num_hidden_layers,
            "prefill_chunk": int(b.get("prefill_chunk", DEFAULT_PREFILL_CHUNK)),
            "gemm_route": b.get("gemm_route"), "dtype": b.get("dtype"),
            "prefill": pre, "decode": dec}


def compare(measured: dict, prediction: dict, chip: Chip | None) -> dict:
    """Measured beside modelled tokens/s for the chip (ratio measured / modelled)."""
    out = {}
    for k in ("decode", "prefill"):
        got = measured[k]["tokens_per_second"]
        want = prediction[k]["modelled_tok_s"].get(chip.name) if chip else None
        out[k] = {"chip": chip.name if chip else None, "measured_tok_s": got, "modelled_tok_s": want,
                  "ratio": got / want if want else None}
    return out


def four_k(report: Report, *, layers: int = MEASURE_LAYERS, context: int = CONTEXT,
           decode_steps: int = DECODE_STEPS, repeats: int = REPEATS) -> dict:
    """The 4K section: the prediction (always) and, on a GPU, the measured runs on the real-width checkpoint."""
    chip = report.chip
    cfg = real_config(layers)
    out = {"context": context, "layers": layers, "config": f"Qwen3.6-35B-A3B widths, {layers} layers, random weights",
           "chip": chip.name if chip else None}
    for key, c in (("prediction", cfg), ("full_model_prediction", real_config(FULL_LAYERS))):
        try:
            out[key] = predict(c, chip, context=context)
        except Exception as e:
            traceback.print_exc()
            out[key] = {"status": "FAIL", "error": f"{type(e).__name__}: {e}"}
    if report.simulated:
        out["measured"] = {"status": "skipped", "reason": "simulator: a simulator's time is not a GPU's"}
    elif not report.device.get("simd_reductions", True):
        out["measured"] = {"status": "skipped", "reason": "the device has no SIMD-group reductions"}
    else:
        try:
            _log(f"{_tokens(context)}: the real-width checkpoint with {layers} layers (generated once, cached)")
            path = ensure_checkpoint(cfg, log=_log)
            out["checkpoint"] = str(path)
            out["measured"] = measure(report.backend, path, context, decode_steps=decode_steps, repeats=repeats)
            p = out.get("prediction", {})
            if p.get("status") == "pass" and out["measured"]["prefill_chunk"] != p["prefill"]["chunk"]:
                out["prediction"] = predict(cfg, chip, context=context, chunk=out["measured"]["prefill_chunk"])
        except Exception as e:
            traceback.print_exc()
            out["measured"] = {"status": "FAIL", "error": f"{type(e).__name__}: {e}"}
    if out["measured"].get("status") == "pass" and out["prediction"].get("status") == "pass":
        out["comparison"] = compare(out["measured"], out["prediction"], chip)
    return out


# ------------------------------------------------------------------------------------------ the run
def run(sim: bool = False) -> Report:
    dev, backend = _device(sim)
    report = Report(dict(dev.info), backend=backend, versions=versions())
    _log(f"device {dev.info.get('name')}: compile gate")
    _compile_checks(report, dev)
    for name, fn in FAMILY_CHECKS:
        _run(report, name, fn, dev)
    _log("decode graph checks")
    _run(report, "decode graph, float build", check_graph, backend, "float32")
    _run(report, "decode graph, bfloat build", check_graph, backend, "bfloat16")
    _log("timed kernel runs")
    report.timings = time_families(dev, real=not report.simulated, chip=report.chip)
    _log(f"decode and prefill at {_tokens(CONTEXT)}")
    report.four_k = four_k(report)
    return report


def main(args) -> int:
    report = run(sim=getattr(args, "sim", False))
    print(report.text())
    path = getattr(args, "json", None)
    if path:
        write_json(report, path)
        print(f"JSON report: {path}")
    return 1 if report.failed else 0

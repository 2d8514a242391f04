"""`qwenmetal selftest`: check the Metal backend on this machine's device, without downloading anything.

1. the device: name, GPU family, limits, SIMD-group reductions / matrices;
2. a compile gate: every kernel of metal/*.metal is compiled into a pipeline on the device;
3. every kernel family against numpy through its host function (one small shape each);
4. the whole decode graph against the CPU backend on a generated tiny checkpoint (float build: logits
   error and greedy tokens; bfloat build: tokens/s).

On a Mac it runs on the GPU (``backend="metal"``); elsewhere, or with ``--sim``, on the Metal-on-CPU
simulator. The report is plain text meant to be pasted into an issue (docs/mac-first-run.md). A check the
device cannot run (the paravirtual GPU of CI runners has no SIMD-group reductions) is reported as skipped
with the reason; the exit status is 1 if any check failed.
"""
from __future__ import annotations

import platform
import time
import traceback
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


@dataclass
class Check:
    name: str
    status: str = "pass"          # pass | FAIL | skipped
    detail: str = ""
    max_error: float | None = None


@dataclass
class Report:
    device: dict = field(default_factory=dict)
    checks: list = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(c.status == "FAIL" for c in self.checks)

    def text(self) -> str:
        from . import __version__
        d = self.device
        lines = ["qwenmetal selftest report", f"qwenmetal {__version__}, Python {platform.python_version()}, "
                 f"{platform.platform()}",
                 f"device: {d.get('name')} (family {d.get('family')}); max buffer {d.get('max_buffer_length', 0) / 2**30:.1f} GiB, "
                 f"{d.get('max_threads_per_threadgroup')} threads/threadgroup, "
                 f"{d.get('max_threadgroup_memory')} B threadgroup memory; SIMD-group reductions: "
                 f"{d.get('simd_reductions')}, SIMD-group matrices: {d.get('simdgroup_matrix')}"]
        if d.get("family") == "simulator":
            lines.append("NOTE: no Metal device here: everything ran on the Metal-on-CPU simulator "
                         "(simulator-verified, hardware-unverified)")
        for c in self.checks:
            err = f"  max error {c.max_error:.2e}" if c.max_error is not None else ""
            lines.append(f"  [{c.status:>7}] {c.name}{err}{'  ' + c.detail if c.detail else ''}")
        n = {s: sum(c.status == s for c in self.checks) for s in ("pass", "FAIL", "skipped")}
        lines.append(f"{n['pass']} passed, {n['FAIL']} failed, {n['skipped']} skipped")
        return "\n".join(lines)


def _device(sim: bool):
    from . import _core
    from .metal_backend import metal_available
    g = _core.gpu
    if not sim and metal_available():
        return g.MetalDevice(), "metal"
    return g.SimDevice(), "metal-sim"


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


# ------------------------------------------------------------------------------------------ checks
def compile_gate(dev) -> tuple:
    """Every kernel family compiled by the device's compiler (Apple's, from the embedded sources, on a Mac)
    and every kernel made into a pipeline."""
    from . import sim
    bad = []
    if hasattr(dev, "compile_all"):
        for r in dev.compile_all():
            if not r["ok"]:
                bad.append(f"{r['origin']}: {r['log']}")
        if bad:
            return None, "; ".join(bad), False
    names = sim.builtin_library().kernels()
    for n in names:
        try:
            dev.prepare(n)
        except Exception as e:
            bad.append(f"{n}: {e}")
    return None, f"{len(names) - len(bad)}/{len(names)} kernels compiled" + (f"; {bad[0]}" if bad else ""), not bad


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
    from . import _core
    cb = dev.command_buffer()
    enc = _core.gpu.Encoder(dev, cb)
    fn(enc)
    cb.commit()
    cb.wait()


def check_norm(dev) -> tuple:
    from . import _core
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


def check_graph(backend: str, dtype: str) -> tuple:
    """The decode graph on the tiny checkpoint against the CPU backend (float KV, exact arithmetic)."""
    import qwenmetal as qm
    from .testing import cached_checkpoint
    path = cached_checkpoint("tiny", "mlx-q4", seed=0)
    prompt = [5, 17, 3, 99, 42, 7, 250, 1]
    cpu = qm.Model.load(path, backend="cpu", kv_dtype="float32", activations="float")
    gpu = qm.Model.load(path, backend=backend, dtype=dtype)
    sc, sg = cpu.new_session(), gpu.new_session()
    want, got = cpu.prefill(sc, prompt), gpu.prefill(sg, prompt)
    errs, same = [], True
    t = int(np.argmax(want))
    t0 = time.perf_counter()
    n = 16
    for _ in range(n):
        errs.append(float(np.abs(got - want).max() / (want.max() - want.min())))
        same = same and int(np.argmax(got)) == t
        want, got = cpu.decode_step(sc, t), gpu.decode_step(sg, t)
        t = int(np.argmax(want))
    dt = time.perf_counter() - t0
    err = max(errs)
    tol = 1e-4 if dtype == "float32" else 5e-2
    return err, f"{dtype}: {n} steps, greedy tokens {'identical' if same else 'DIFFER'}, {n / dt:.1f} tok/s", \
        err < tol and (same or dtype != "float32")


def run(sim: bool = False) -> Report:
    dev, backend = _device(sim)
    report = Report(dict(dev.info))
    _run(report, "compile gate: every kernel", compile_gate, dev, needs_simd=False)
    for name, fn in FAMILY_CHECKS:
        _run(report, name, fn, dev)
    _run(report, "graph vs cpu backend (float32)", check_graph, backend, "float32")
    _run(report, "graph vs cpu backend (bfloat16)", check_graph, backend, "bfloat16")
    return report


# one small-shape check per kernel family, through its host function
FAMILY_CHECKS = [("norm: rmsnorm", check_norm)]


def main(args) -> int:
    report = run(sim=getattr(args, "sim", False))
    print(report.text())
    return 1 if report.failed else 0

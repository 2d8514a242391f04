"""`qwenmetal selftest`: check the Metal backend on this machine's device, without downloading anything.

1. the device: name, GPU family, limits, SIMD-group reductions / matrices;
2. a compile gate: every kernel of metal/*.metal is compiled into a pipeline on the device;
3. every kernel family against numpy through its host function (one small shape each);
4. the whole decode graph on a generated tiny checkpoint: the float build against the CPU backend, the
   bfloat build against the numpy reference's bfloat16 mode (logit error, top-1 agreement, tokens/s).

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
                 f"{d.get('simd_reductions')}, SIMD-group matrices: {d.get('simdgroup_matrix')}, "
                 f"Metal 4 tensor ops: {d.get('tensor_ops')}"]
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
    names = list(sim.builtin_library().kernels)
    if not dev.info.get("tensor_ops"):  # the Metal 4 tensor-op kernels exist only for M5 (apple10) GPUs
        names = [n for n in names if not n.startswith("gemm_tensor_")]
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


def check_qmv(dev) -> tuple:
    """4-bit group-64 GEMV at the real hidden size, bf16 scales, float activations."""
    from . import _core, quant
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
    from . import _core
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
    from . import _core
    ops = _core.gpu.ops
    rng = np.random.default_rng(3)
    V = 248320
    logits = rng.standard_normal(V).astype(np.float32)
    logits[[1000, 200000]] = 9.0
    lb, tb, sb = _upload(dev, logits), dev.alloc(4), dev.alloc(ops.sample_scratch_bytes(V))
    _encode(dev, lambda e: ops.argmax(e, lb, V, tb, sb))
    tok = int(_readback(tb, np.uint32, (1,))[0])
    return None, f"argmax over {V}: {tok}", tok == 1000


def check_graph(backend: str, dtype: str) -> tuple:
    """The decode graph on the tiny checkpoint, teacher-forced over 16 steps: the float build against the CPU
    backend's exact arithmetic (float KV and activations), the bfloat build against the numpy reference's
    bfloat16 mode (MLX's rounding points); max logit error relative to the range, top-1 agreement, tok/s."""
    import qwenmetal as qm
    from .testing import cached_checkpoint
    path = cached_checkpoint("tiny", "mlx-q4", seed=0)
    prompt = [5, 17, 3, 99, 42, 7, 250, 1]
    if dtype == "float32":
        ref = qm.Model.load(path, backend="cpu", kv_dtype="float32", activations="float")
    else:
        ref = qm.Model.load(path, backend="reference", dtype="bfloat16")
    gpu = qm.Model.load(path, backend=backend, dtype=dtype)
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


def run(sim: bool = False) -> Report:
    dev, backend = _device(sim)
    report = Report(dict(dev.info))
    _run(report, "compile gate: every kernel", compile_gate, dev, needs_simd=False)
    for name, fn in FAMILY_CHECKS:
        _run(report, name, fn, dev)
    _run(report, "decode graph, float build", check_graph, backend, "float32")
    _run(report, "decode graph, bfloat build", check_graph, backend, "bfloat16")
    return report


# one small-shape check per kernel family, through its host function
FAMILY_CHECKS = [("norm: rmsnorm", check_norm), ("quant: qmv", check_qmv), ("moe: top-k", check_topk),
                 ("sample: argmax", check_argmax)]


def main(args) -> int:
    report = run(sim=getattr(args, "sim", False))
    print(report.text())
    return 1 if report.failed else 0

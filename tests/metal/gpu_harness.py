"""Running one host op function (qwenmetal._core.gpu.ops) on the simulator device from a test.

    with run(schedule) as (dev, enc, buf):
        ops.rmsnorm(enc, "f32", buf(x), buf(w), buf(y), rows, H, 1e-6)
    # y (a numpy array) now holds the result

``buf(array)`` wraps a C-contiguous numpy array as a device buffer without a copy, so outputs are read
back from the arrays themselves.

The device is the simulator (``gpu.SimDevice``, under the given schedule) unless ``QWENMETAL_TEST_DEVICE=metal``
selects the Mac's GPU (``gpu.MetalDevice``; schedules do not apply, and the simulator-only checks -- dispatch
records -- are skipped where a test guards them with ``SIM``): the same kernel checks on real hardware
(docs/mac-first-run.md). The command buffer is committed and waited on when the block exits;
the simulator's checks (barriers, divergence, uninitialised threadgroup memory, bounds, missing memory
barriers) raise ``DeviceError`` there. Simulator-verified, hardware-unverified.
"""
from __future__ import annotations

import contextlib
import os

import ml_dtypes
import numpy as np

from qwenmetal import _core

gpu = _core.gpu
ops = gpu.ops
BF16 = ml_dtypes.bfloat16
SCHEDULES = ["forward", "reverse", "random"]
ACT = {"f32": np.float32, "bf16": BF16}
DEVICE = os.environ.get("QWENMETAL_TEST_DEVICE", "sim")
if DEVICE not in ("sim", "metal"):
    raise ValueError(f"QWENMETAL_TEST_DEVICE must be 'sim' or 'metal', got {DEVICE!r}")
SIM = DEVICE == "sim"
# the whole-graph tests' backend
BACKEND = "metal-sim" if SIM else "metal"
# the simulated pipelines' thread limit (maxTotalThreadsPerThreadgroup of kernels declaring none):
# tests/metal/test_runtime_limits.py reruns the kernel tests below 1024
PIPELINE_THREADS = int(os.environ.get("QWENMETAL_TEST_PIPELINE_THREADS", "1024"))


def make_device(schedule: str = "forward", seed: int = 0, keep_records: bool = False, tensor_ops: bool = False):
    """tensor_ops: the simulator claims Metal 4 tensor ops (the M5 routes run on its emulation); on a Mac the
    GPU decides (dev.info["tensor_ops"])."""
    if SIM:
        return gpu.SimDevice(schedule=schedule, seed=seed, keep_records=keep_records, tensor_ops=tensor_ops,
                             pipeline_max_threads=PIPELINE_THREADS)
    return gpu.MetalDevice()


@contextlib.contextmanager
def run(schedule: str = "forward", seed: int = 0, keep_records: bool = False, tensor_ops: bool = False):
    dev = make_device(schedule, seed, keep_records, tensor_ops)
    cb = dev.command_buffer()
    enc = gpu.Encoder(dev, cb)

    def buf(a: np.ndarray, label: str = ""):
        if not a.flags.c_contiguous:
            raise ValueError("buf(): arrays must be C-contiguous (outputs are written in place)")
        return dev.wrap(a.view(np.uint16) if a.dtype == BF16 else a, label)   # nanobind knows no ml_dtypes

    yield dev, enc, buf
    cb.commit()
    cb.wait()


def rel_err(y, ref) -> float:
    y = np.asarray(y, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))


def bf16_ulps(got, ref, floor=0.0) -> np.ndarray:
    """|got - ref| element-wise in bf16 ulps of the reference value (of max(|ref|, floor): a floor keeps a
    cancelling sum, whose float rounding is relative to its terms, from counting tiny differences as ulps)."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    mag = np.maximum(np.abs(ref), floor)
    ulp = np.exp2(np.floor(np.log2(np.maximum(mag, 2.0 ** -126))) - 7)     # 8 significant bits
    return np.abs(got - ref) / ulp


# Bars of assert_bf16, calibrated on the simulator under every schedule (QWENMETAL_BF16_STATS over the family
# tests; docs/verification.md, "bf16 kernel comparisons"). Each kernel against a reference rounding where it
# rounds: norm and gdn decode bit-exact; attention mean <= 0.001 ulp, 3 of ~390k elements 2 ulps away (a
# float32 reordering moves a value across a rounding boundary, then a second rounding); gdn prefill <= 0.002;
# quant, gemm, moe <= 0.008 on arrays of 64 or more (0.065 on a few tiny ones), one element 2 ulps away. One
# rounding point dropped (rmsnorm's T(x inv)): mean 0.13-0.33 ulp on arrays of 64 or more, none over 1 ulp --
# so the mean, not the count, is what catches it; the allowance of 2 ulps per array keeps a flip in a short
# vector from failing (a dropped rounding shows from about 10 elements on).
BF16_MEAN_ULPS = 0.05       # mean |got - ref| in ulps
BF16_OVER_FRAC = 0.002      # share of elements more than 1 ulp away (of at least 1 element)


def assert_bf16(got, ref, *, floor=0.0, mean_ulps: float = BF16_MEAN_ULPS, over_frac: float = BF16_OVER_FRAC,
                what: str = ""):
    """A bf16 kernel's output against a reference that rounds to bf16 at the kernel's rounding points (the
    reference backend's bfloat16 mode, or numpy with ml_dtypes): at most ``over_frac`` of the elements (at
    least one) more than 1 bf16 ulp away, and a mean distance below ``mean_ulps`` ulps plus 2 ulps over the whole
    array (so that a few flips in a short vector pass) -- 1-ulp flips from float32 re-association pass, one
    missing rounding point (a share of all elements an ulp away) fails.
    QWENMETAL_BF16_STATS=<file> appends each comparison's figures to the file (for calibrating the bars)."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert np.isfinite(got).all() == np.isfinite(ref).all(), f"{what}: non-finite values differ"
    d = bf16_ulps(got, ref, floor).ravel()
    n = d.size
    over = int(np.count_nonzero(d > 1.0))
    mean = float(d.mean()) if n else 0.0
    stats = os.environ.get("QWENMETAL_BF16_STATS")
    if stats:
        import inspect
        import json
        caller = next((f.function for f in inspect.stack()[1:] if f.function.startswith("test_")), "?")
        with open(stats, "a") as f:
            f.write(json.dumps({"test": caller, "what": what, "n": n, "mean": mean, "over": over,
                                "max": float(d.max()) if n else 0.0}) + "\n")
    j = int(np.argmax(d)) if n else 0
    assert over <= max(1, int(over_frac * n)), (
        f"{what}: {over} of {n} elements more than 1 bf16 ulp from the reference (worst: element {j}, got "
        f"{got.ravel()[j]!r}, expected {ref.ravel()[j]!r}, {d[j]:.1f} ulp)")
    assert mean * n <= mean_ulps * n + 2, (
        f"{what}: mean distance {mean:.3f} bf16 ulp over {n} elements > {mean_ulps} (a rounding point differs?)")


def token_bitmask(allowed, n_words: int) -> np.ndarray:
    """A token bitmask in llguidance's layout (fill_next_token_bitmask): bit i % 32 of uint32 word i / 32 allows
    token i; `allowed` token ids, the mask `n_words` words (the sample family's apply_token_mask, the decode
    loop's `mask`)."""
    words = np.zeros(n_words, np.uint32)
    for i in np.asarray(allowed, np.int64).ravel():
        words[int(i) // 32] |= np.uint32(1 << int(i % 32))
    return words

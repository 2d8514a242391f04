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

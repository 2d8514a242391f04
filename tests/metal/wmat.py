"""Weight matrices in every gpu.Matrix format for the quant and moe kernel tests.

``make(rng, fmt, shape, gs)`` returns a :class:`HostMatrix`: the arrays as the device reads them
(uint32 words + scales + biases, or a dense array) and ``ref``, the float64 value of every weight
computed from exactly those codes and scales (``scale * q + bias`` in float64; codes and layout from
``qwenmetal.quant``, byte-exact with MLX). ``hm.device(buf)`` is the gpu.Matrix over buffers made by
``buf`` (the harness's wrapper). ``random_words=True`` draws the codes and scales directly instead of
quantizing a float matrix (for the model-sized expert stacks, where quantizing would take seconds);
``ref`` is computed when first used, ``ref_of(i)`` gives matrix i of a stack alone (the chosen experts).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from qwenmetal import quant

BF16 = ml_dtypes.bfloat16
FORMATS = ["q4_sbf16", "q4_sf32", "q8_sbf16", "q8_sf32", "bf16", "f16", "f32"]
# the run-time-width kernels' widths (WFMT_QN, kernel variant qn_*), each width once, the scale types alternating
QN_FORMATS = ["q2_sbf16", "q3_sf32", "q5_sbf16", "q6_sf32"]
DENSE = {"bf16": BF16, "f16": np.float16, "f32": np.float32}


def raw(buf):
    """The harness's buf() for any dtype (nanobind takes no ml_dtypes arrays: bind their bytes)."""
    return lambda a: buf(a.view(np.uint8))


class HostMatrix:
    def __init__(self, fmt, shape, gs, w, scales=None, biases=None):
        self.fmt, self.shape, self.gs = fmt, tuple(shape), gs
        self.w, self.scales, self.biases = w, scales, biases
        self._ref = None

    @property
    def quantized(self):
        return self.fmt.startswith("q")

    @property
    def bits(self):
        return fmt_bits(self.fmt)

    @property
    def ref(self):
        """float64 value of every weight (scale * q + bias from the stored codes, or the dense values)"""
        if self._ref is None:
            self._ref = _ref(self.w, self.scales, self.biases, self.bits, self.gs) if self.quantized \
                else self.w.astype(np.float64)
        return self._ref

    def ref_of(self, i):
        """ref of matrix i of a stack, without dequantizing the whole stack"""
        if not self.quantized:
            return self.w[i].astype(np.float64)
        return _ref(self.w[i], self.scales[i], self.biases[i], self.bits, self.gs)

    def device(self, buf, gpu):
        count = self.shape[0] if len(self.shape) == 3 else 1
        rows, cols = self.shape[-2:]
        kind = self.fmt.split("_")[0]
        if not self.quantized:
            return gpu.Matrix(kind, rows, cols, buf(self.w), count=count)
        return gpu.Matrix(kind, rows, cols, buf(self.w), buf(self.scales), buf(self.biases), group_size=self.gs,
                          count=count, scales_f32=self.fmt.endswith("sf32"))


def fmt_bits(fmt: str) -> int:
    """the width of a quantized format name: "q3_sf32" -> 3"""
    return int(fmt.split("_")[0][1:])


def variant(fmt: str) -> str:
    """the kernel-name part gpu.Matrix.variant gives a format: the run-time-width kernels' qn_* at 2, 3, 5, 6 bits"""
    if fmt.startswith("q") and fmt_bits(fmt) in (2, 3, 5, 6):
        return "qn_" + fmt.split("_")[1]
    return fmt


def _ref(wq, s, b, bits, gs):
    q = quant.unpack(wq, bits).astype(np.float64)
    lead, K = q.shape[:-1], q.shape[-1]
    q = q.reshape(*lead, K // gs, gs)
    return (q * s.astype(np.float64)[..., None] + b.astype(np.float64)[..., None]).reshape(*lead, K)


def make(rng, fmt: str, shape, gs: int = 64, *, random_words: bool = False) -> HostMatrix:
    shape = tuple(shape)
    if fmt in DENSE:
        return HostMatrix(fmt, shape, 0, (rng.standard_normal(shape) * 0.5).astype(DENSE[fmt]))
    bits = fmt_bits(fmt)
    sdt = np.float32 if fmt.endswith("sf32") else BF16
    if random_words:
        lead, K = shape[:-1], shape[-1]
        wq = rng.integers(0, 2**32, size=(*lead, K * bits // 32), dtype=np.uint32)
        s = (rng.standard_normal((*lead, K // gs)) * 0.02).astype(sdt)
        b = (rng.standard_normal((*lead, K // gs)) * 0.1).astype(sdt)
        return HostMatrix(fmt, shape, gs, wq, s, b)
    w = rng.standard_normal(shape).astype(np.float32)
    wq, s, b = quant.quantize(w, bits, gs, scale_dtype=sdt)
    return HostMatrix(fmt, shape, gs, wq, s, b)


def cols_for(fmt: str, gs: int, n: int) -> int:
    """A column count valid for the format: n groups (quantized) or 8 n (dense)."""
    return gs * n if fmt.startswith("q") else 8 * n


# output rounding (relative to the value) and accumulation error (relative to the sum of |terms|) allowed
OUT_RTOL = {"f32": 1e-6, "bf16": 2.0 ** -8, "bf16x4": 2.0 ** -6}   # bf16x4: a chain of bf16 roundings
ACC_TOL = 1e-5


def assert_close(y, ref, bound, dtype: str, what: str = ""):
    """|y - ref| <= OUT_RTOL[dtype] |ref| + ACC_TOL bound, element-wise, where ``bound`` is the magnitude the
    float accumulation works at (e.g. |W| @ |x| for a GEMV): a cancelling dot product is judged by the size of
    its terms, not by its small result. bf16 outputs add one rounding of the result."""
    y = np.asarray(y, np.float64)
    ref = np.asarray(ref, np.float64)
    bound = np.broadcast_to(np.asarray(bound, np.float64), ref.shape)
    lim = OUT_RTOL[dtype] * np.abs(ref) + ACC_TOL * bound + 1e-30
    ratio = np.abs(y - ref) / lim
    j = int(np.argmax(ratio))
    assert ratio.flat[j] <= 1, (f"{what}: element {j}: got {y.flat[j]!r}, expected {ref.flat[j]!r} "
                                f"(bound {bound.flat[j]:.3g}, {ratio.flat[j]:.2f} x the tolerance)")
    from .gpu_harness import BF16, assert_bf16
    if dtype != "f32" and np.array_equal(y, y.astype(np.float32).astype(BF16).astype(np.float64)):
        # a bf16 output (a float one, e.g. T(product) + residual in float, keeps the bound above only);
        # and in bf16 ulps of the value, or of the float accumulation's scale (ACC_TOL bound is a fraction of
        # an ulp of 2^8 ACC_TOL bound): an ulp where float re-association flips a rounding, no rounding point
        # dropped (the relative bound above allows an ulp, bf16x4 four, everywhere); the output is stored as
        # bf16, so a float reference is rounded once (a reference rounded already stays as it is)
        assert_bf16(y, ref.astype(np.float32).astype(BF16), floor=2.0 ** 8 * ACC_TOL * bound, what=what)

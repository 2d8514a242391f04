"""The C++ CPU engine at MLX affine widths 2, 3, 5 and 6 (4 and 8: tests/test_cpu_engine.py).

* the engine's quantizer and dequantizer byte-exact / exact against quant.quantize / quant.dequantize;
* every GEMV / GEMM path (decode GEMV, register-tile GEMM, AVX2's dequantized-tile GEMM from 16 input
  rows) at each width and group size, for every SIMD table this CPU has, against numpy on the
  dequantized weights; integer activations fall back to that exact float path at these widths;
* the SIMD unpack reads nothing past a row's last byte (a matrix ending at an inaccessible page);
* widths the kernels cannot run are refused with an error naming the tensor and the width;
* end to end: the cpu backend on the fixtures of each width (mlx-q2/q3/q5/q6, mlx-q4-e2/e3) equals the
  reference backend as tests/test_cpu_engine.py checks it at 4 and 8 bits.
"""
from __future__ import annotations

import ctypes
import mmap

import ml_dtypes
import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal import _core
from qwenmetal.backends.cpu import describe
from qwenmetal.quant import dequantize, quantize
from qwenmetal.weights import QuantizedTensor

from model_runs import rel_range_err, run_greedy
from qwenmetal.testing import cached_checkpoint
from test_cpu_engine import FAMILY_ISAS, N_DECODE, PROMPT, need_isa, reference_runs  # noqa: F401 (fixture)

NEW_BITS = (2, 3, 5, 6)
BF16 = ml_dtypes.bfloat16


def _qweights(bits, rows, cols, gs, rng):
    w = rng.normal(0, 0.5, size=(rows, cols)).astype(BF16)
    wq, s, b = quantize(w, bits, gs)
    return QuantizedTensor(wq, s, b, bits, gs), dequantize(wq, s, b, bits, gs)


@pytest.mark.parametrize("bits", NEW_BITS)
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_quantizer_and_dequantizer_exact(bits, gs):
    rng = np.random.default_rng(bits * 1000 + gs)
    w = rng.normal(size=(7, 3 * 128)).astype(np.float32)
    w[1, :gs] = 0.0                                    # a group of zeros (bias 0 branch)
    w[2, gs:2 * gs] = -1.0                             # a constant group
    wq, s, b = _core.cpu_quantize(w, bits, gs)
    ewq, es, eb = quantize(w, bits, gs)
    np.testing.assert_array_equal(wq, ewq)
    np.testing.assert_array_equal(s, es.view(np.uint16))
    np.testing.assert_array_equal(b, eb.view(np.uint16))
    got = _core.dequantize_affine(ewq, es.astype(np.float32), eb.astype(np.float32), bits, gs)
    np.testing.assert_array_equal(got, dequantize(ewq, es, eb, bits, gs))


@pytest.mark.parametrize("isa", FAMILY_ISAS)
@pytest.mark.parametrize("bits", NEW_BITS)
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_linear_kernels(isa, bits, gs):
    """M = 1, 3: decode GEMV; 4, 9: the register-tile GEMM (and its row tails); 17: AVX2's dequantized
    16-row tiles + gemm_tile. 37 rows: tails of row blocks and 4-row passes; K = 3 groups."""
    need_isa(isa)
    rng = np.random.default_rng(hash((bits, gs)) % 2**32)
    cols = 3 * max(gs, 64)
    t, dense = _qweights(bits, 37, cols, gs, rng)
    keep = []
    d = describe(t, keep)
    for M in (1, 3, 4, 9, 17):
        x = rng.normal(size=(M, cols)).astype(np.float32)
        want = x.astype(np.float64) @ dense.T.astype(np.float64)
        for threads in (1, 3):
            y = _core.cpu_linear(d, x, threads, isa)
            np.testing.assert_allclose(y, want, rtol=0, atol=2e-5 * np.abs(want).max(), err_msg=f"M={M}")


@pytest.mark.parametrize("bits", NEW_BITS)
def test_integer_activations_fall_back_exact(bits):
    """activations int8 / int16 are 4-bit-g64-only: at these widths the exact float path runs."""
    rng = np.random.default_rng(bits)
    t, dense = _qweights(bits, 21, 256, 64, rng)
    keep = []
    for planes in (1, 2):
        for M in (1, 20):
            x = rng.normal(size=(M, 256)).astype(np.float32)
            y = _core.cpu_linear(describe(t, keep), x, 2, "", planes=planes)
            want = x.astype(np.float64) @ dense.T.astype(np.float64)
            np.testing.assert_allclose(y, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("isa", FAMILY_ISAS)
def test_unpack_reads_nothing_past_the_row(isa):
    """Each matrix's packed rows end exactly at a page followed by an inaccessible one: a SIMD load past
    the last chunk would crash the process."""
    need_isa(isa)
    page = mmap.PAGESIZE
    buf = mmap.mmap(-1, 2 * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(base + page), ctypes.c_size_t(page), 0) == 0, ctypes.get_errno()
    rng = np.random.default_rng(7)
    keep = []
    try:
        for bits in NEW_BITS:
            t, dense = _qweights(bits, 5, 128, 32, rng)
            n = t.weight.nbytes
            w = np.frombuffer(buf, np.uint8, count=n, offset=page - n).view(np.uint32).reshape(t.weight.shape)
            w[...] = t.weight
            tail = QuantizedTensor(w, t.scales, t.biases, bits, 32)
            for M in (1, 5):
                x = rng.normal(size=(M, 128)).astype(np.float32)
                y = _core.cpu_linear(describe(tail, keep), x, 1, isa)
                want = x.astype(np.float64) @ dense.T.astype(np.float64)
                np.testing.assert_allclose(y, want, rtol=0, atol=2e-5 * np.abs(want).max())
            del w, tail
        keep.clear()
    finally:
        libc.mprotect(ctypes.c_void_p(base + page), ctypes.c_size_t(page), 3)


def test_unsupported_width_is_refused():
    rng = np.random.default_rng(0)
    t, _ = _qweights(4, 8, 128, 64, rng)
    keep = []
    d = describe(t, keep)
    d["bits"] = 7
    with pytest.raises(ValueError, match="desc: unsupported quantization \\(7-bit, group 64"):
        _core.cpu_linear(d, np.zeros((1, 128), np.float32))
    with pytest.raises(ValueError, match="quantize: unsupported quantization \\(1-bit"):
        _core.cpu_quantize(np.zeros((2, 64), np.float32), 1, 64)
    with pytest.raises(ValueError, match="bits must be 2, 3, 4, 5, 6 or 8, got 9"):
        _core.dequantize_affine(t.weight, t.scales.astype(np.float32), t.biases.astype(np.float32), 9, 64)


@pytest.mark.parametrize("preset, fmt", [("tiny", f) for f in ("mlx-q2", "mlx-q3", "mlx-q5", "mlx-q6", "mlx-q4-e2",
                                                                 "mlx-q4-e3")] + [("tiny-qwen3-next", "mlx-q3")])
def test_matches_reference(preset, fmt, reference_runs):
    """Whole model at each width (the mixed formats: routed experts at 2/3 bits, the rest 4-bit on the int16
    kernels): within 2e-3 of the reference's logit range over the prompt and 64 greedy steps, same tokens.
    (int16 activations' rounding grows over the steps: 1.14e-3 at step 29 of mlx-q4-e3 on an AVX2 Zen 3,
    1.7e-5 there with float activations.)"""
    want_pre, want_dec, want_toks = reference_runs(preset, fmt, PROMPT)
    model = qm.Model.load(cached_checkpoint(preset, fmt, seed=0), backend="cpu", kv_dtype="float32", threads=2,
                          prefill_chunk=8)
    pre, dec, toks = run_greedy(model, PROMPT, N_DECODE)
    assert rel_range_err(pre, want_pre) < 2e-3
    for j in range(N_DECODE):
        assert rel_range_err(dec[j], want_dec[j]) < 2e-3, f"decode step {j}"
    assert toks == want_toks

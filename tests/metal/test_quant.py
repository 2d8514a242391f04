"""quant family (metal/quant.metal through gpu.ops.qmv / gpu.ops.embed) against numpy, on the simulator device
under the forward, reverse and random schedules. Simulator-verified, hardware-unverified.

Every weight format (4/8-bit with bf16 or float32 scales, dense bf16/f16/f32), activations float32 and
bfloat16, float output. References are float64 on exactly the values the kernel sees (weights from the
same codes and scales, activations as stored), compared element-wise within 1e-5 of the sum of |terms| plus one
rounding of the result for bfloat16 outputs (wmat.assert_close); the model shapes also by max|y - ref| / max|ref|.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwenmetal import quant

from .gpu_harness import ACT, BF16, SCHEDULES, SIM, gpu, ops, rel_err, run
from .wmat import FORMATS, assert_close, cols_for, make, raw

HYP = settings(max_examples=60, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------------------------------------ qmv
@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(fmt=st.sampled_from(FORMATS), dtype=st.sampled_from(["f32", "bf16"]), f32_out=st.booleans(),
       gs=st.sampled_from([32, 64, 128]), n=st.integers(1, 6), N=st.integers(1, 40), batch=st.integers(1, 3),
       pad=st.sampled_from([0, 4]), seed=st.integers(0, 2**31 - 1))
def test_qmv(schedule, fmt, dtype, f32_out, gs, n, N, batch, pad, seed):
    rng = np.random.default_rng(seed)
    K = cols_for(fmt, gs, n)
    hm = make(rng, fmt, (N, K), gs)
    xs, ys = K + pad, N + pad
    x = rng.standard_normal((batch, xs)).astype(ACT[dtype])
    out_dt = np.float32 if f32_out else ACT[dtype]
    y = np.full((batch, ys), 7, out_dt)
    with run(schedule, seed=seed, keep_records=True) as (dev, enc, b):
        buf = raw(b)
        ops.qmv(enc, dtype, hm.device(buf, gpu), buf(x), buf(y), batch, f32_out, xs, ys)
    xf = x[:, :K].astype(np.float64)
    ref = xf @ hm.ref.T
    assert_close(y[:, :N], ref, np.abs(xf) @ np.abs(hm.ref).T, "f32" if f32_out else dtype)
    assert (y[:, N:].astype(np.float32) == 7).all()  # the stride padding is not written
    suffix = "_f32out" if f32_out and dtype == "bf16" else ""
    assert not SIM or dev.records()[0]["kernel"] == f"qmv_{fmt}_{dtype}{suffix}"


@pytest.mark.parametrize("fmt,N,K", [("q4_sbf16", 2048, 2048), ("q8_sbf16", 257, 2048)])
def test_qmv_model_shape(fmt, N, K):
    """A 2048 x 2048 4-bit projection, and the 8-bit router + shared_expert_gate stack (256 + 1 rows),
    bf16 activations, with bf16 and with float output in one command buffer (one schedule)."""
    rng = np.random.default_rng(N + K)
    hm = make(rng, fmt, (N, K), 64)
    x = rng.standard_normal(K).astype(BF16)
    y = np.zeros(N, BF16)
    yf = np.zeros(N, np.float32)
    with run("random", seed=3) as (dev, enc, b):
        buf = raw(b)
        W = hm.device(buf, gpu)
        xb = buf(x)
        ops.qmv(enc, "bf16", W, xb, buf(y))
        ops.qmv(enc, "bf16", W, xb, buf(yf), f32_out=True)
        assert enc.levels == 1  # two readers of W and x, disjoint outputs: no barrier
    ref = hm.ref @ x.astype(np.float64)
    assert rel_err(yf, ref) <= 1e-5
    assert rel_err(y, ref) <= 1e-2
    np.testing.assert_array_equal(yf.astype(BF16), y)  # the bf16 kernel is the float one rounded once


def test_qmv_declared_bytes():
    """The costing sees the weight bytes (codes + scales + biases), x read and y written."""
    rng = np.random.default_rng(1)
    N, K = 24, 256
    hm = make(rng, "q4_sbf16", (N, K), 64)
    x = rng.standard_normal((2, K)).astype(np.float32)
    y = np.zeros((2, N), np.float32)
    with run() as (dev, enc, b):
        buf = raw(b)
        ops.qmv(enc, "f32", hm.device(buf, gpu), buf(x), buf(y), 2)
    assert enc.bytes_read == N * (K // 2 + 2 * (K // 64) * 2) + 2 * K * 4
    assert enc.bytes_written == 2 * N * 4
    assert rel_err(y, x.astype(np.float64) @ hm.ref.T) <= 1e-5


# ------------------------------------------------------------------------------------------ embed
@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(fmt=st.sampled_from(FORMATS), dtype=st.sampled_from(["f32", "bf16"]), gs=st.sampled_from([32, 64, 128]),
       n=st.integers(1, 40), rows=st.integers(1, 12), nid=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_embed(schedule, fmt, dtype, gs, n, rows, nid, seed):
    rng = np.random.default_rng(seed)
    K = cols_for(fmt, gs, n)
    hm = make(rng, fmt, (rows, K), gs)
    ids = rng.integers(0, rows, nid).astype(np.uint32)
    ids[-1] = rows + 3 if nid > 1 else ids[-1]  # an id past the table: a zero row
    y = np.full((nid, K), 7, ACT[dtype])
    with run(schedule, seed=seed) as (dev, enc, b):
        buf = raw(b)
        ops.embed(enc, dtype, hm.device(buf, gpu), buf(ids), nid, buf(y))
    ref = np.stack([hm.ref[i] if i < rows else np.zeros(K) for i in ids])
    yf = y.astype(np.float64)
    if dtype == "f32":  # float32(scale * q + bias): one or two roundings of the exact value
        np.testing.assert_allclose(yf, ref, rtol=2.5e-7, atol=1e-7 * np.abs(ref).max())
    else:  # rounded once more to bfloat16
        np.testing.assert_allclose(yf, ref, rtol=2 ** -8, atol=1e-6 * np.abs(ref).max())


def test_embed_model_shape():
    """A 4-bit embedding table of 4096 rows x hidden 2048 (the real one has 248320 rows; the kernel
    reads only the rows it is given), one bf16 token row, the declared bytes one row's."""
    rng = np.random.default_rng(9)
    V, H = 4096, 2048
    hm = make(rng, "q4_sbf16", (V, H), 64, random_words=True)
    ids = np.array([1234], np.uint32)
    y = np.zeros((1, H), BF16)
    with run("reverse") as (dev, enc, b):
        buf = raw(b)
        ops.embed(enc, "bf16", hm.device(buf, gpu), buf(ids), 1, buf(y))
    ref = hm.ref_of(1234)
    np.testing.assert_allclose(y[0].astype(np.float64), ref, rtol=2 ** -8, atol=1e-6 * np.abs(ref).max())
    assert enc.bytes_read == H // 2 + 2 * (H // 64) * 2 + 4


# ------------------------------------------------------------------------------------------ argument checks
def _q4(rows=16, K=128, count=1):
    rng = np.random.default_rng(0)
    return make(rng, "q4_sbf16", (count, rows, K) if count > 1 else (rows, K), 64)


def test_qmv_argument_checks():
    hm = _q4()
    x = np.zeros(128, np.float32)
    y = np.zeros(16, np.float32)
    with run() as (dev, enc, b):
        buf = raw(b)
        W = hm.device(buf, gpu)
        with pytest.raises(ValueError, match="x holds 508 bytes, needs 512"):
            ops.qmv(enc, "f32", W, buf(x[:127]), buf(y))
        with pytest.raises(ValueError, match="y holds"):
            ops.qmv(enc, "f32", W, buf(x), buf(y[:15]))
        with pytest.raises(ValueError, match="y holds"):  # f32_out with bf16 x: y must hold floats
            ops.qmv(enc, "bf16", W, buf(x.view(np.uint16)), buf(y[:8]), f32_out=True)
        with pytest.raises(ValueError, match="batch"):
            ops.qmv(enc, "f32", W, buf(x), buf(y), 0)
        with pytest.raises(ValueError, match="x_stride"):
            ops.qmv(enc, "f32", W, buf(x), buf(y), 1, False, 64)
        with pytest.raises(ValueError, match="activation type"):
            ops.qmv(enc, "f16", W, buf(x), buf(y))
        # the matrix itself
        small = gpu.Matrix("q4", 16, 128, buf(hm.w[:15]), buf(hm.scales), buf(hm.biases), group_size=64)
        with pytest.raises(ValueError, match="qmv: W: w holds"):
            ops.qmv(enc, "f32", small, buf(x), buf(y))
        noscale = gpu.Matrix("q4", 16, 128, buf(hm.w), None, buf(hm.biases), group_size=64)
        with pytest.raises(ValueError, match="scales is not set"):
            ops.qmv(enc, "f32", noscale, buf(x), buf(y))
        for gs in (16, 48):
            bad = gpu.Matrix("q4", 16, 128, buf(hm.w), buf(hm.scales), buf(hm.biases), group_size=gs)
            with pytest.raises(ValueError, match="group_size"):
                ops.qmv(enc, "f32", bad, buf(x), buf(y))
        ragged = gpu.Matrix("q4", 16, 96, buf(hm.w), buf(hm.scales), buf(hm.biases), group_size=64)
        with pytest.raises(ValueError, match="not a multiple of group_size"):
            ops.qmv(enc, "f32", ragged, buf(x), buf(y))
        dense = gpu.Matrix("f32", 2, 12, buf(np.zeros(24, np.float32)))
        with pytest.raises(ValueError, match="multiple of 8"):
            ops.qmv(enc, "f32", dense, buf(x), buf(y))
        stack = gpu.Matrix("q4", 8, 128, buf(hm.w), buf(hm.scales), buf(hm.biases), group_size=64, count=2)
        with pytest.raises(ValueError, match="count 1"):
            ops.qmv(enc, "f32", stack, buf(x), buf(y))
        with pytest.raises(ValueError, match="weight format"):
            gpu.Matrix("q3", 16, 128, buf(hm.w))
        assert enc.dispatches == 0


def test_embed_argument_checks():
    hm = _q4()
    ids = np.zeros(2, np.uint32)
    y = np.zeros((2, 128), np.float32)
    with run() as (dev, enc, b):
        buf = raw(b)
        E = hm.device(buf, gpu)
        with pytest.raises(ValueError, match="ids holds"):
            ops.embed(enc, "f32", E, buf(ids[:1]), 2, buf(y))
        with pytest.raises(ValueError, match="y holds"):
            ops.embed(enc, "f32", E, buf(ids), 2, buf(y[:1]))
        with pytest.raises(ValueError, match="n must be positive"):
            ops.embed(enc, "f32", E, buf(ids), 0, buf(y))
        assert enc.dispatches == 0


def test_matrix_descriptor():
    hm = _q4(count=3)
    with run() as (dev, enc, b):
        buf = raw(b)
        M = hm.device(buf, gpu)
        assert (M.fmt, M.rows, M.cols, M.count, M.group_size, M.variant) == ("q4", 16, 128, 3, 64, "q4_sbf16")
        assert M.row_bytes == 64 and M.matrix_bytes == 16 * (64 + 2 * 4)
        M.validate("m")
        M.scales_f32 = True
        assert M.variant == "q4_sf32"
        with pytest.raises(ValueError, match="m: scales holds"):
            M.validate("m")
        D = gpu.Matrix("bf16", 4, 8, buf(np.zeros(32, np.uint16)))
        assert D.variant == "bf16" and D.group_size == 0 and D.row_bytes == 16
        assert quant.SUPPORTED_GROUP_SIZES == (32, 64, 128)


# ------------------------------------------------------------------------------------------ qmv fusions
@pytest.mark.parametrize("schedule", SCHEDULES)
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(FORMATS), dtype=st.sampled_from(["f32", "bf16"]), f32_out=st.booleans(),
       n=st.integers(1, 4), N=st.integers(1, 40), batch=st.integers(1, 2), norm=st.booleans(), xn_out=st.booleans(),
       add=st.sampled_from([None, "separate", "in_place"]), seed=st.integers(0, 2**31 - 1))
def test_qmv_fusions(schedule, fmt, dtype, f32_out, n, N, batch, norm, xn_out, add, seed):
    """y = [r +] W (rmsnorm(x) * g | x), optionally storing rmsnorm(x) * g to xn: the input norm and the
    residual add fused into the GEMV, against the separate numpy steps."""
    rng = np.random.default_rng(seed)
    gs = 32
    K = cols_for(fmt, gs, n)
    hm = make(rng, fmt, (N, K), gs)
    x = (3 * rng.standard_normal((batch, K))).astype(ACT[dtype])
    g = rng.uniform(0.5, 1.5, K).astype(ACT[dtype])
    out_dt = np.float32 if f32_out else ACT[dtype]
    r = rng.standard_normal((batch, N)).astype(out_dt)
    y = r.copy() if add == "in_place" else np.full((batch, N), 7, out_dt)
    xn = np.full((batch, K), 7, ACT[dtype])
    xf = x.astype(np.float64)
    bf = dtype == "bf16"
    r16 = (lambda v: quant_bf16(v)) if bf else (lambda v: v)
    # the RMSNorm as the bf16 graph rounds it: g * T(x * inv), rounded (float: x * inv * g)
    xin = r16(r16(xf / np.sqrt((xf ** 2).mean(-1, keepdims=True) + 1e-6)) * g.astype(np.float64)) if norm else xf
    with run(schedule, seed=seed) as (dev, enc, b):
        buf = raw(b)
        yb = buf(y)
        kw = {}
        if norm:
            kw.update(norm_w=buf(g), eps=1e-6)
            if xn_out:
                kw["xn"] = buf(xn)
        if add:
            kw["residual"] = yb if add == "in_place" else buf(r)
        ops.qmv(enc, dtype, hm.device(buf, gpu), buf(x), yb, batch, f32_out, **kw)
    # the product is rounded to T before a residual add (a bf16 graph adds two bf16 values)
    ref = (r16(xin @ hm.ref.T) + r.astype(np.float64)) if add else xin @ hm.ref.T
    bound = np.abs(xin) @ np.abs(hm.ref).T + (np.abs(r.astype(np.float64)) if add else 0)
    assert_close(y, ref, bound, "bf16x4" if bf else "f32")
    if norm and xn_out:
        assert_close(xn, xin, np.abs(xin), "bf16x4" if bf else "f32")
    else:
        assert (xn.astype(np.float32) == 7).all()


def quant_bf16(v):
    return np.asarray(v, np.float64).astype(BF16).astype(np.float64)


def test_qmv_fusion_argument_checks():
    rng = np.random.default_rng(0)
    hm = make(rng, "q4_sbf16", (16, 64), 32)
    with run() as (dev, enc, b):
        buf = raw(b)
        W = hm.device(buf, gpu)
        x, y = np.zeros(64, np.float32), np.zeros(32, np.float32)
        with pytest.raises(ValueError, match="norm_w"):
            ops.qmv(enc, "f32", W, buf(x), buf(y), norm_w=buf(np.zeros(8, np.float32)))
        with pytest.raises(ValueError, match="xn needs norm_w"):
            ops.qmv(enc, "f32", W, buf(x), buf(y), xn=buf(np.zeros(64, np.float32)))
        yb = buf(y)
        with pytest.raises(ValueError, match="overlap"):
            ops.qmv(enc, "f32", W, buf(x), yb.view(0, 64), residual=yb.view(4, 64))

"""quant family (metal/quant.metal through gpu.ops.qmv / gpu.ops.embed) against numpy, on the simulator device
under the forward, reverse and random schedules. Simulator-verified, hardware-unverified.

Every weight format (4/8-bit with bf16 or float32 scales, dense bf16/f16/f32), activations float32 and
bfloat16, float output; batches of 1 (the decode kernel) to 17 vectors (the skinny variants b4/b8/b16, and b16
in chunks past 16), each vector's result bit-equal to the decode kernel's. References are float64 on exactly the values the kernel sees (weights from the
same codes and scales, activations as stored), compared element-wise within 1e-5 of the sum of |terms| plus one
rounding of the result for bfloat16 outputs (wmat.assert_close); the model shapes also by max|y - ref| / max|ref|.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwenmetal import quant

from .gpu_harness import ACT, BF16, SCHEDULES, SIM, gpu, ops, rel_err, run
from .wmat import FORMATS, QN_FORMATS, assert_close, cols_for, fmt_bits, make, raw, variant

HYP = settings(max_examples=60, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------------------------------------ qmv
@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(fmt=st.sampled_from(FORMATS), dtype=st.sampled_from(["f32", "bf16"]), f32_out=st.booleans(),
       gs=st.sampled_from([32, 64, 128]), n=st.integers(1, 6), N=st.integers(1, 40), batch=st.integers(1, 17),
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
    assert not SIM or dev.records()[0]["kernel"] == f"{qmv_prefix(batch)}{fmt}_{dtype}{suffix}"


def qmv_prefix(batch):
    """qmv's kernel variant for a batch: the decode kernel for 1 vector, else the smallest skinny variant of
    4, 8, 16 vectors that holds it (16 for larger batches, in chunks)"""
    return "qmv_" if batch == 1 else f"qmv_b{next(m for m in (4, 8, 16) if m >= min(batch, 16))}_"


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


def test_qmv_skinny_model_shape():
    """A 16-row prefill chunk through a 2048 x 2048 4-bit projection (the real hidden size) with the input
    RMSNorm fused, bf16 activations, float output: one b16 dispatch, one threadgroup row."""
    rng = np.random.default_rng(16)
    M, N, K = 16, 2048, 2048
    hm = make(rng, "q4_sbf16", (N, K), 64)
    x = rng.standard_normal((M, K)).astype(BF16)
    g = rng.uniform(0.5, 1.5, K).astype(BF16)
    y = np.zeros((M, N), np.float32)
    with run("random", seed=4, keep_records=True) as (dev, enc, b):
        buf = raw(b)
        ops.qmv(enc, "bf16", hm.device(buf, gpu), buf(x), buf(y), M, True, norm_w=buf(g), eps=1e-6)
    assert not SIM or dev.records()[0]["threadgroups"] == (N // 8, 1, 1)
    xf = x.astype(np.float64)
    xin = quant_bf16(quant_bf16(xf / np.sqrt((xf ** 2).mean(-1, keepdims=True) + 1e-6)) * g.astype(np.float64))
    assert rel_err(y, xin @ hm.ref.T) <= 1e-5


@pytest.mark.parametrize("batch", [1, 2, 3, 8, 16, 17, 33])
def test_qmv_declared_bytes(batch):
    """The costing sees the weight bytes (codes + scales + biases) once for up to 16 vectors (the skinny
    variants read each weight once for all of them; larger batches once per chunk of 16), x read, y written,
    and 2 N K flops per vector; the grid has one threadgroup row per chunk (each weight row is one SIMD-group's)."""
    rng = np.random.default_rng(1)
    N, K = 24, 256
    hm = make(rng, "q4_sbf16", (N, K), 64)
    x = rng.standard_normal((batch, K)).astype(np.float32)
    y = np.zeros((batch, N), np.float32)
    with run(keep_records=True) as (dev, enc, b):
        buf = raw(b)
        ops.qmv(enc, "f32", hm.device(buf, gpu), buf(x), buf(y), batch)
    chunks = -(-batch // 16)
    assert enc.bytes_read == chunks * N * (K // 2 + 2 * (K // 64) * 2) + batch * K * 4
    assert enc.bytes_written == batch * N * 4
    assert enc.flops == 2 * N * K * batch
    rec = dev.records()[0] if SIM else None
    assert not SIM or rec["threadgroups"] == (N // 8, chunks, 1)
    # one simd_sum per (vector, output row) in each of the N / 4 SIMD-groups: the vectors past the batch in a
    # variant's last chunk are skipped, not computed
    assert not SIM or rec["simd_ops"] == (N // 4) * 4 * batch
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
    reads only the rows it is given), one bf16 token row, the declared bytes one row's, the flops its dequantization."""
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
    assert enc.flops == 2 * H  # one multiply-add (scale * q + bias) per value


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
            gpu.Matrix("int3", 16, 128, buf(hm.w))
        with pytest.raises(ValueError, match="gpu.Matrix fmt: 7-bit weights are not supported"):
            gpu.Matrix("q7", 16, 128, buf(hm.w))
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
class QmvCase:
    """One qmv dispatch with its fusions and strides, and its float64 oracle: y = [r +] W (rmsnorm(x) * g | x)
    per vector, optionally storing rmsnorm(x) * g to xn, the product rounded to T before a residual add (the bf16
    graph adds two bf16 values) or for a float output with `round`."""

    def __init__(self, rng, fmt, dtype, N, K, gs, batch, *, f32_out=False, pad=0, norm=False, xn_out=False,
                 add=None, round_=False):
        self.hm = make(rng, fmt, (N, K), gs)
        self.dtype, self.batch, self.f32_out, self.N, self.K = dtype, batch, f32_out, N, K
        self.norm, self.xn_out, self.add, self.round = norm, xn_out and norm, add, round_
        self.xs, self.ys = K + pad, N + pad
        out_dt = np.float32 if f32_out else ACT[dtype]
        self.x = (3 * rng.standard_normal((batch, self.xs))).astype(ACT[dtype])
        self.g = rng.uniform(0.5, 1.5, K).astype(ACT[dtype])
        self.r = rng.standard_normal((batch, self.ys)).astype(out_dt)
        self.y = self.r.copy() if add == "in_place" else np.full((batch, self.ys), 7, out_dt)
        self.xn = np.full((batch, self.xs), 7, ACT[dtype])

    def rows(self, lo, hi):
        """vectors lo..hi-1 as a case of their own: the same weights, inputs and residual (row views), fresh outputs"""
        c = object.__new__(QmvCase)
        c.__dict__.update(self.__dict__)
        c.batch = hi - lo
        c.x, c.r, c.xn = self.x[lo:hi], self.r[lo:hi], self.xn[lo:hi].copy()
        c.y = self.y[lo:hi].copy()
        return c

    def dispatch(self, enc, buf):
        yb = buf(self.y)
        kw = {}
        if self.norm:
            kw.update(norm_w=buf(self.g), eps=1e-6)
            if self.xn_out:
                kw["xn"] = buf(self.xn)
        if self.add:
            kw["residual"] = yb if self.add == "in_place" else buf(self.r)
        ops.qmv(enc, self.dtype, self.hm.device(buf, gpu), buf(self.x), yb, self.batch, self.f32_out, self.xs,
                self.ys, round=self.round, **kw)

    def check(self):
        K, N = self.K, self.N
        xf = self.x[:, :K].astype(np.float64)
        bf = self.dtype == "bf16"
        r16 = quant_bf16 if bf else (lambda v: v)
        # the RMSNorm as the bf16 graph rounds it: g * T(x * inv), rounded (float: x * inv * g)
        xin = r16(r16(xf / np.sqrt((xf ** 2).mean(-1, keepdims=True) + 1e-6)) * self.g.astype(np.float64)) \
            if self.norm else xf
        prod = xin @ self.hm.ref.T
        rf = self.r[:, :N].astype(np.float64)
        ref = r16(prod) + rf if self.add else r16(prod) if self.round else prod
        bound = np.abs(xin) @ np.abs(self.hm.ref).T + (np.abs(rf) if self.add else 0)
        # bf16: a chain of roundings with the norm or the add, one rounding of the product otherwise
        mode = "f32" if not bf else "bf16x4" if self.norm or self.add else "bf16" if self.round or not self.f32_out \
            else "f32"
        assert_close(self.y[:, :N], ref, bound, mode)
        pad = self.r[:, N:].astype(np.float32) if self.add == "in_place" else 7
        assert (self.y[:, N:].astype(np.float32) == pad).all()  # the stride padding is not written
        if self.xn_out:
            assert_close(self.xn[:, :K], xin, np.abs(xin), "bf16x4" if bf else "f32")
            assert (self.xn[:, K:].astype(np.float32) == 7).all()  # the stride padding is not written
        else:
            assert (self.xn.astype(np.float32) == 7).all()


@pytest.mark.parametrize("schedule", SCHEDULES)
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(FORMATS), dtype=st.sampled_from(["f32", "bf16"]), f32_out=st.booleans(),
       n=st.integers(1, 4), N=st.integers(1, 40), batch=st.integers(1, 17), pad=st.sampled_from([0, 4]),
       norm=st.booleans(), xn_out=st.booleans(), add=st.sampled_from([None, "separate", "in_place"]),
       round_=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_qmv_fusions(schedule, fmt, dtype, f32_out, n, N, batch, pad, norm, xn_out, add, round_, seed):
    """The input norm (statistics per vector), the xn store, the residual add and the rounded float output fused
    into the GEMV, strided, against the separate numpy steps, for single vectors and skinny batches."""
    rng = np.random.default_rng(seed)
    c = QmvCase(rng, fmt, dtype, N, cols_for(fmt, 32, n), 32, batch, f32_out=f32_out, pad=pad, norm=norm,
                xn_out=xn_out, add=add, round_=round_ and f32_out)
    with run(schedule, seed=seed) as (dev, enc, b):
        c.dispatch(enc, raw(b))
    c.check()


# the fusion sets the batch test rotates through (by format; every one meets every skinny variant)
FUSIONS = [dict(pad=4), dict(pad=4, norm=True, xn_out=True, add="in_place"),
           dict(f32_out=True, norm=True, add="separate"), dict(f32_out=True, round_=True, pad=4)]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_qmv_batches(schedule, dtype):
    """Every batch 1..17 (the first b of 17 vectors) for every weight format with a fusion set (FUSIONS, rotated by
    format): against float64, and bit-equal to the same vectors run one at a time through the decode kernel (the
    skinny variants do exactly the decode kernel's arithmetic per vector, only the weight loads are shared)."""
    rng = np.random.default_rng(17)
    bases = [(fmt, QmvCase(rng, fmt, dtype, 13, cols_for(fmt, 32, 2), 32, 17,
                           **FUSIONS[(i + 2 * (dtype == "bf16")) % len(FUSIONS)])) for i, fmt in enumerate(FORMATS)]
    runs = [(fmt, [base.rows(0, b) for b in range(1, 18)], [base.rows(i, i + 1) for i in range(17)])
            for fmt, base in bases]
    with run(schedule, seed=5, keep_records=True) as (dev, enc, b):
        buf = raw(b)
        for _, batches, ones in runs:
            for c in batches + ones:
                c.dispatch(enc, buf)
    kernels = [r["kernel"] for r in dev.records()] if SIM else []
    for n, (fmt, batches, ones) in enumerate(runs):
        assert not SIM or all(k.startswith(f"qmv_{fmt}_{dtype}") for k in kernels[34 * n + 17:34 * n + 34])
        for c in batches:
            c.check()
            np.testing.assert_array_equal(c.y.view(np.uint8),
                                          np.concatenate([o.y for o in ones[:c.batch]]).view(np.uint8))
            np.testing.assert_array_equal(c.xn.view(np.uint8),
                                          np.concatenate([o.xn for o in ones[:c.batch]]).view(np.uint8))
            assert not SIM or kernels[34 * n + c.batch - 1].startswith(f"{qmv_prefix(c.batch)}{fmt}_{dtype}")


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


# ------------------------------------------------------------------------------------------ run-time widths (qn)
@pytest.mark.parametrize("fmt", QN_FORMATS)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_qmv_qn(fmt, dtype):
    """qmv at 2, 3, 5, 6 bits (the run-time-width kernels: qmv_qn_* for one vector, qmv_b16_qn_* for 2..16 and in
    chunks of 16 past that) with group sizes 32 and 128 and a fusion set each: batches 1, 5 and 17 against float64
    on the same codes, each bit-equal to its vectors run one at a time through the decode kernel."""
    rng = np.random.default_rng(fmt_bits(fmt) * 2 + (dtype == "bf16"))
    with run("random", seed=fmt_bits(fmt), keep_records=True) as (dev, enc, b):
        buf = raw(b)
        cases = []
        for gs, fuse in ((32, FUSIONS[1]), (128, FUSIONS[2 + (dtype == "bf16")])):
            base = QmvCase(rng, fmt, dtype, 13, cols_for(fmt, gs, 3 if gs == 32 else 2), gs, 17, **fuse)
            batches, ones = [base.rows(0, n) for n in (1, 5, 17)], [base.rows(i, i + 1) for i in range(17)]
            for c in batches + ones:
                c.dispatch(enc, buf)
            cases.append((batches, ones))
    for batches, ones in cases:
        for c in batches:
            c.check()
            np.testing.assert_array_equal(c.y.view(np.uint8),
                                          np.concatenate([o.y for o in ones[:c.batch]]).view(np.uint8))
    kernels = {r["kernel"] for r in dev.records()} if SIM else set()
    v = variant(fmt)
    assert not SIM or {k.split(f"_{v}_")[0] for k in kernels} == {"qmv", "qmv_b16"}
    assert not SIM or all(f"_{v}_{dtype}" in k for k in kernels)


@pytest.mark.parametrize("fmt", QN_FORMATS)
def test_qmv_qn_model_shape(fmt):
    """An expert-sized projection (512 x 2048: every lane takes two 32-value units of a row) at each low width,
    bf16 activations with float and bf16 output in one command buffer, the declared weight bytes
    rows * cols * bits / 8 + scales and biases."""
    rng = np.random.default_rng(fmt_bits(fmt))
    N, K = 512, 2048
    hm = make(rng, fmt, (N, K), 64, random_words=True)
    x = rng.standard_normal(K).astype(BF16)
    y, yf = np.zeros(N, BF16), np.zeros(N, np.float32)
    with run("reverse") as (dev, enc, b):
        buf = raw(b)
        W = hm.device(buf, gpu)
        ops.qmv(enc, "bf16", W, buf(x), buf(yf), f32_out=True)
        ops.qmv(enc, "bf16", W, buf(x), buf(y))
    ssize = 4 if fmt.endswith("sf32") else 2
    assert enc.bytes_read == 2 * (N * (K * fmt_bits(fmt) // 8 + 2 * (K // 64) * ssize) + K * 2)
    ref = hm.ref @ x.astype(np.float64)
    assert rel_err(yf, ref) <= 1e-5
    np.testing.assert_array_equal(yf.astype(BF16), y)


@pytest.mark.parametrize("fmt", QN_FORMATS)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_embed_qn(fmt, dtype):
    """embed at each low width: rows of 3 groups of 32 (a thread per 32-value unit) and of 8 groups of 128, an id
    past the table (a zero row); the flops one multiply-add per value."""
    rng = np.random.default_rng(10 * fmt_bits(fmt) + (dtype == "bf16"))
    for gs, n in ((32, 3), (128, 8)):
        K = cols_for(fmt, gs, n)
        hm = make(rng, fmt, (5, K), gs)
        ids = np.array([4, 0, 9, 2], np.uint32)
        y = np.full((4, K), 7, ACT[dtype])
        with run("random", seed=n, keep_records=True) as (dev, enc, b):
            buf = raw(b)
            ops.embed(enc, dtype, hm.device(buf, gpu), buf(ids), 4, buf(y))
        ref = np.stack([hm.ref[i] if i < 5 else np.zeros(K) for i in ids])
        np.testing.assert_allclose(y.astype(np.float64), ref, rtol=2.5e-7 if dtype == "f32" else 2 ** -8,
                                   atol=1e-6 * np.abs(ref).max())
        assert enc.flops == 2 * 4 * K
        assert not SIM or dev.records()[0]["kernel"] == f"embed_{variant(fmt)}_{dtype}"


# ------------------------------------------------------------------------------------------ qmv + conv epilogue
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("schedule,in_place", [("forward", False), ("reverse", True), ("random", False)])
def test_qmv_conv_epilogue_is_gdn_conv(dtype, schedule, in_place):
    """The decode in-projection with the Gated DeltaNet's conv fused (QMV_CONV) gives bit for bit what the
    unfused pair gives -- qmv (with its input norm), then gdn_conv of one token over the stored rows -- for y,
    the conv output and the shifted state, with the state updated in place or into the other half. The shape is
    a GDN layer's stacked in-projection: its first 2 nk dk + nv dv rows are the conv's channels (not a multiple of the 8
    rows of a threadgroup), the rows after them (z, b, a) are only stored."""
    rng = np.random.default_rng(11)
    shape = gpu.ops.GdnShape(1, 2, 16, 12, 4)           # conv_dim 2*16 + 2*12 = 56 channels, 4 taps
    C, K, H = shape.conv_dim, 4, 128
    hm = make(rng, "q4_sbf16", (C + 9, H), 64)          # [qkv | z b a]-like: 9 rows past the channels
    x = rng.standard_normal(H).astype(ACT[dtype])
    g = (1 + 0.1 * rng.standard_normal(H)).astype(ACT[dtype])
    conv_w = rng.standard_normal((C, K)).astype(np.float32)
    state = rng.standard_normal((K - 1, C)).astype(np.float32)

    def unfused():
        y, act, out = np.zeros(C + 9, ACT[dtype]), np.zeros(C, ACT[dtype]), np.zeros_like(state)
        with run(schedule) as (dev, enc, b):
            buf = raw(b)
            ops.qmv(enc, dtype, hm.device(buf, gpu), buf(x), buf(y), norm_w=buf(g))
            ops.gdn_conv(enc, dtype, shape, buf(y[:C]), buf(conv_w), buf(state.copy()), buf(act), conv_out=buf(out))
        return y, act, out

    def fused():
        y, act = np.zeros(C + 9, ACT[dtype]), np.zeros(C, ACT[dtype])
        s = state.copy()
        out = s if in_place else np.zeros_like(state)
        with run(schedule) as (dev, enc, b):
            buf = raw(b)
            ops.qmv(enc, dtype, hm.device(buf, gpu), buf(x), buf(y), norm_w=buf(g), conv_w=buf(conv_w), conv_state=buf(s),
                    conv_out=buf(out) if not in_place else buf(s), act=buf(act), conv_taps=K, conv_channels=C)
        return y, act, out

    want, got = unfused(), fused()
    for w_, g_ in zip(want, got):
        np.testing.assert_array_equal(np.asarray(g_).view(np.uint8), np.asarray(w_).view(np.uint8))


def test_qmv_conv_epilogue_argument_checks():
    rng = np.random.default_rng(3)
    hm = make(rng, "q4_sbf16", (16, 128), 64)
    x = np.zeros(128, np.float32)
    with run() as (dev, enc, b):
        buf = raw(b)
        W, y = hm.device(buf, gpu), buf(np.zeros(16, np.float32))
        cw, cs, act = buf(np.zeros((16, 4), np.float32)), buf(np.zeros((3, 16), np.float32)), buf(np.zeros(16, np.float32))
        with pytest.raises(ValueError, match="needs all its buffers"):
            ops.qmv(enc, "f32", W, buf(x), y, conv_w=cw, conv_taps=4)
        with pytest.raises(ValueError, match="one vector"):
            ops.qmv(enc, "f32", W, buf(np.zeros(256, np.float32)), buf(np.zeros(32, np.float32)), batch=2,
                    conv_w=cw, conv_state=cs, conv_out=cs, act=act, conv_taps=4)
        with pytest.raises(ValueError, match="conv_state"):
            ops.qmv(enc, "f32", W, buf(x), y, conv_w=cw, conv_state=buf(np.zeros((2, 16), np.float32)), conv_out=cs,
                    act=act, conv_taps=4)
        with pytest.raises(ValueError, match="channels 17 > rows 16"):
            ops.qmv(enc, "f32", W, buf(x), y, conv_w=cw, conv_state=cs, conv_out=cs, act=act, conv_taps=4,
                    conv_channels=17)
        with pytest.raises(ValueError, match="residual"):
            ops.qmv(enc, "f32", W, buf(x), y, residual=y, conv_w=cw, conv_state=cs, conv_out=cs, act=act, conv_taps=4)

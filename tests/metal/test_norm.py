"""norm family (metal/norm.metal through gpu.ops.rmsnorm / gpu.ops.add_rmsnorm / gpu.ops.copy_f32) against numpy, on the simulator
device under the forward, reverse and random schedules. Simulator-verified, hardware-unverified.

Float within 1e-5 relative of float64 references from the values as stored; bfloat16 against the reference
backend's bfloat16 mode (reference.rms_norm: the same two rounding points as the kernel), within 1 bf16 ulp and
a mean distance a dropped rounding point exceeds (gpu_harness.assert_bf16). Inputs of magnitude 1e-4..1e-3,
where eps = 1e-6 is a large part of mean(x^2), check the eps. copy_f32 (the target features' copy) is exact. layer_norm (the vision tower's) within 1e-5 of float64 and of
reference_vision.layer_norm; bf16 within 1 ulp of the float64 value.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from qwenmetal.backends import reference as R
from qwenmetal.backends.reference_vision import layer_norm

from .gpu_harness import ACT, SCHEDULES, SIM, assert_bf16, ops, rel_err, run
from .wmat import raw

HYP = settings(max_examples=50, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
TOL = {"f32": 1e-5}


def rms_ref(h, w, eps):
    h = h.astype(np.float64)
    return h / np.sqrt((h * h).mean(axis=-1, keepdims=True) + eps) * w.astype(np.float64)


def check(y, x, w, eps, dtype, what=""):
    """float: within 1e-5 of float64; bf16: as the reference's bf16 mode rounds (w * T(x * inv), rounded)"""
    if dtype == "f32":
        assert rel_err(y, rms_ref(x, w, eps)) <= TOL[dtype], what
    else:
        assert_bf16(y, R.rms_norm(np.asarray(x, np.float32), np.asarray(w, np.float32), eps, bf16=True), what=what)


@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(H=st.integers(1, 600), rows=st.integers(1, 3), dtype=st.sampled_from(["f32", "bf16"]),
       seed=st.integers(0, 2**31 - 1))
def test_rmsnorm(schedule, H, rows, dtype, seed):
    rng = np.random.default_rng(seed)
    dt = ACT[dtype]
    x = (rng.standard_normal((rows, H)) * rng.uniform(0.1, 10)).astype(dt)
    w = (1 + 0.2 * rng.standard_normal(H)).astype(dt)
    y = np.zeros((rows, H), dt)
    with run(schedule, seed=seed, keep_records=True) as (dev, enc, b):
        buf = raw(b)
        ops.rmsnorm(enc, dtype, buf(x), buf(w), buf(y), rows, H, 1e-6)
    check(y, x, w, 1e-6, dtype)
    if SIM:
        rec = dev.records()[0]
        assert rec["kernel"] == f"rmsnorm_{dtype}" and rec["threadgroup_memory"] == 128 and rec["barriers"] == rows


@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(H=st.integers(1, 600), rows=st.integers(1, 3), dtype=st.sampled_from(["f32", "bf16"]),
       in_place=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_add_rmsnorm(schedule, H, rows, dtype, in_place, seed):
    rng = np.random.default_rng(seed)
    dt = ACT[dtype]
    x = rng.standard_normal((rows, H)).astype(dt)
    r = rng.standard_normal((rows, H)).astype(dt)
    w = (1 + 0.2 * rng.standard_normal(H)).astype(dt)
    h_ref = (x.astype(np.float32) + r.astype(np.float32)).astype(dt)  # the residual stream, rounded as stored
    x_in = x.copy()
    h = x if in_place else np.zeros_like(x)
    y = np.zeros((rows, H), dt)
    with run(schedule, seed=seed) as (dev, enc, b):
        buf = raw(b)
        ops.add_rmsnorm(enc, dtype, buf(x), buf(r), buf(w), buf(h), buf(y), rows, H, 1e-6)
    np.testing.assert_array_equal(h.view(np.uint8), h_ref.view(np.uint8))
    if not in_place:
        np.testing.assert_array_equal(x.view(np.uint8), x_in.view(np.uint8))
    check(y, h_ref, w, 1e-6, dtype)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_norms_model_shape(dtype):
    """hidden 2048 (512 threads, one 4-vector each), rmsnorm then add_rmsnorm in one command buffer."""
    rng = np.random.default_rng(7)
    dt = ACT[dtype]
    H = 2048
    x = rng.standard_normal((2, H)).astype(dt)
    r = rng.standard_normal((2, H)).astype(dt)
    w = (1 + 0.2 * rng.standard_normal(H)).astype(dt)
    y1, y2, h = np.zeros_like(x), np.zeros_like(x), np.zeros_like(x)
    with run("random", seed=1, keep_records=True) as (dev, enc, b):
        buf = raw(b)
        xb = buf(x)
        ops.rmsnorm(enc, dtype, xb, buf(w), buf(y1), 2, H, 1e-6)
        ops.add_rmsnorm(enc, dtype, xb, buf(r), buf(w), buf(h), buf(y2), 2, H, 1e-6)
    check(y1, x, w, 1e-6, dtype, "rmsnorm")
    h_ref = (x.astype(np.float32) + r.astype(np.float32)).astype(dt)
    check(y2, h_ref, w, 1e-6, dtype, "add_rmsnorm")
    assert not SIM or [rec["threads_per_threadgroup"] for rec in dev.records()] == [(512, 1, 1)] * 2


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("scale", [1e-4, 1e-3])
def test_norms_small_inputs_see_eps(dtype, scale):
    """Rows of rms 1e-4 and 1e-3, where eps = 1e-6 is 100 % and 1 % of mean(x^2): the result depends on eps
    (an eps off by 10x moves every element by 5-95 %), so a wrong eps, or one applied twice, fails."""
    rng = np.random.default_rng(int(scale * 1e4))
    dt = ACT[dtype]
    H = 256
    x = (scale * rng.standard_normal((2, H))).astype(dt)
    r = (scale * rng.standard_normal((2, H))).astype(dt)
    w = (1 + 0.2 * rng.standard_normal(H)).astype(dt)
    y1, y2, h = np.zeros_like(x), np.zeros_like(x), np.zeros_like(x)
    with run("random", seed=3) as (dev, enc, b):
        buf = raw(b)
        ops.rmsnorm(enc, dtype, buf(x), buf(w), buf(y1), 2, H, 1e-6)
        ops.add_rmsnorm(enc, dtype, buf(x), buf(r), buf(w), buf(h), buf(y2), 2, H, 1e-6)
    check(y1, x, w, 1e-6, dtype, "rmsnorm")
    h_ref = (x.astype(np.float32) + r.astype(np.float32)).astype(dt)
    check(y2, h_ref, w, 1e-6, dtype, "add_rmsnorm")
    # the test can tell eps from 10 eps
    assert rel_err(rms_ref(x, w, 1e-5), rms_ref(x, w, 1e-6)) > 0.04


@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(H=st.integers(1, 600), rows=st.integers(1, 4), dtype=st.sampled_from(["f32", "bf16"]),
       seed=st.integers(0, 2**31 - 1))
def test_copy_f32(schedule, H, rows, dtype, seed):
    """y = float(x): the rows bit for bit, widened (bf16 -> f32 is exact), nothing past them written, the bytes
    declared are the rows read and written."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, H)) * 10).astype(ACT[dtype])
    y = np.full((rows + 1, H), 7.0, np.float32)
    with run(schedule, seed=seed, keep_records=True) as (dev, enc, b):
        buf = raw(b)
        ops.copy_f32(enc, dtype, buf(x), buf(y), rows, H)
        assert enc.bytes_read == x.nbytes and enc.bytes_written == rows * H * 4
    np.testing.assert_array_equal(y[:rows], x.astype(np.float32))
    assert (y[rows] == 7.0).all()
    if SIM:
        rec = dev.records()[0]
        assert rec["kernel"] == f"copy_f32_{dtype}" and rec["threadgroup_memory"] == 0 and rec["barriers"] == 0


def test_norm_argument_checks():
    x = np.zeros((2, 64), np.float32)
    w = np.ones(64, np.float32)
    with run() as (dev, enc, b):
        buf = raw(b)
        with pytest.raises(ValueError, match="x holds"):
            ops.rmsnorm(enc, "f32", buf(x[:1]), buf(w), buf(x), 2, 64, 1e-6)
        with pytest.raises(ValueError, match="w holds"):
            ops.rmsnorm(enc, "f32", buf(x), buf(w[:32]), buf(x), 2, 64, 1e-6)
        with pytest.raises(ValueError, match="r holds"):
            ops.add_rmsnorm(enc, "f32", buf(x), buf(x[:1]), buf(w), buf(x), buf(x), 2, 64, 1e-6)
        with pytest.raises(ValueError, match="positive"):
            ops.rmsnorm(enc, "f32", buf(x), buf(w), buf(x), 0, 64, 1e-6)
        with pytest.raises(ValueError, match="activation type"):
            ops.rmsnorm(enc, "f16", buf(x), buf(w), buf(x), 2, 64, 1e-6)
        with pytest.raises(ValueError, match="copy_f32: y holds 256 bytes, needs 512"):
            ops.copy_f32(enc, "f32", buf(x), buf(x[:1]), 2, 64)
        with pytest.raises(ValueError, match="copy_f32: x holds 256 bytes, needs 512"):
            ops.copy_f32(enc, "f32", buf(x[:1]), buf(x), 2, 64)
        assert enc.dispatches == 0


def layer_norm_ref(x, w, b, eps):
    x = np.asarray(x, np.float64)
    d = x - x.mean(axis=-1, keepdims=True)
    return d / np.sqrt((d * d).mean(axis=-1, keepdims=True) + eps) * np.asarray(w, np.float64) + np.asarray(b, np.float64)


@pytest.mark.parametrize("schedule", SCHEDULES)
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(H=st.integers(1, 1200), rows=st.integers(1, 3), dtype=st.sampled_from(["f32", "bf16"]),
       offset=st.sampled_from([0.0, 30.0]), seed=st.integers(0, 2**31 - 1))
def test_layer_norm(schedule, H, rows, dtype, offset, seed):
    """The vision tower's LayerNorm (weight and bias, biased variance, eps 1e-6): float within 1e-5 of float64
    and of the reference's reference_vision.layer_norm; bf16 within 1 ulp of the float64 value rounded once. Rows
    with a large mean (offset 30) check that the variance is taken around the mean (E[x^2] - mean^2 would lose
    it in float)."""
    rng = np.random.default_rng(seed)
    dt = ACT[dtype]
    x = (offset + rng.standard_normal((rows, H)) * rng.uniform(0.1, 10)).astype(dt)
    w = (1 + 0.2 * rng.standard_normal(H)).astype(dt)
    b = (0.3 * rng.standard_normal(H)).astype(dt)
    y = np.zeros((rows, H), dt)
    with run(schedule, seed=seed, keep_records=True) as (dev, enc, buf_):
        buf = raw(buf_)
        ops.layer_norm(enc, dtype, buf(x), buf(w), buf(b), buf(y), rows, H, 1e-6)
    ref = layer_norm_ref(x, w, b, 1e-6)
    if dtype == "f32":
        assert rel_err(y, ref) <= 1e-5
        f = lambda a: np.asarray(a, np.float32)                                                    # noqa: E731
        assert rel_err(y, layer_norm(f(x), f(w), f(b))) <= 1e-5
    else:
        assert_bf16(y, ref.astype(np.float32).astype(dt))
    if SIM:
        rec = dev.records()[0]
        assert rec["kernel"] == f"layer_norm_{dtype}" and rec["barriers"] == 2 * rows


def test_layer_norm_errors():
    """Bad arguments are refused before anything is encoded."""
    x = np.zeros((2, 8), np.float32)
    y = np.zeros((2, 8), np.float32)
    w = np.ones(8, np.float32)
    with run() as (dev, enc, buf):
        with pytest.raises(ValueError, match="y must not overlap x"):
            ops.layer_norm(enc, "f32", buf(x), buf(w), buf(w), buf(x), 2, 8, 1e-6)
        with pytest.raises(ValueError, match="b holds 32 bytes, needs 64"):
            ops.layer_norm(enc, "f32", buf(x), buf(np.ones(16, np.float32)), buf(w), buf(y), 1, 16, 1e-6)
        with pytest.raises(ValueError, match="rows and H must be positive"):
            ops.layer_norm(enc, "f32", buf(x), buf(w), buf(w), buf(y), 0, 8, 1e-6)
        assert enc.dispatches == 0

"""The first production kernels (metal/quant.metal, metal/norm.metal) against numpy, in the Metal simulator:
random shapes (hypothesis) under the forward, reverse and random thread schedules; float within 1e-5 relative,
bfloat (and half) within 1e-2. Simulator-verified, hardware-unverified.

Relative error is max|y - ref| / max|ref| with ref computed in float64 from exactly the values the kernel sees
(weights dequantized from the same codes, scales and activations as stored).
"""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwenmetal import quant, sim

BF16 = ml_dtypes.bfloat16
DTYPES = {"f32": np.float32, "bf16": BF16, "f16": np.float16}
TOL = {"f32": 1e-5, "bf16": 1e-2, "f16": 1e-2}
SCHEDULES = ["forward", "reverse", "random"]
HYP = settings(max_examples=25, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def lib():
    return sim.builtin_library()


def rel_err(y, ref):
    y = np.asarray(y, np.float64)
    return float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))


def quantized(rng, shape, bits, gs, dt):
    w = rng.standard_normal(shape).astype(np.float32)
    wq, s, b = quant.quantize(w, bits, gs, scale_dtype=dt)
    wd = quant.dequantize(wq, s, b, bits, gs).astype(np.float64)  # float32 math on the stored scales/biases
    return wq, s, b, wd


def qmv_params(K, N, gs, x_stride, y_stride):
    return sim.pack("IIIII", K, N, gs, x_stride, y_stride)


# ------------------------------------------------------------------------------------------ qmv
@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(bits=st.sampled_from([4, 8]), gs=st.sampled_from([32, 64, 128]), n_groups=st.integers(1, 12),
       N=st.integers(1, 40), batch=st.integers(1, 3), dtype=st.sampled_from(list(DTYPES)),
       seed=st.integers(0, 2**31 - 1))
def test_qmv(lib, schedule, bits, gs, n_groups, N, batch, dtype, seed):
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    K = gs * n_groups
    wq, s, b, wd = quantized(rng, (N, K), bits, gs, dt)
    x = rng.standard_normal((batch, K)).astype(dt)
    y = np.zeros((batch, N), dt)
    c = lib.dispatch(f"qmv{bits}_{dtype}", ((N + 7) // 8, batch), (32, 2), [wq, s, b, x, y],
                     qmv_params(K, N, gs, K, N), schedule=schedule, seed=seed)
    ref = x.astype(np.float64) @ wd.T
    assert rel_err(y, ref) <= TOL[dtype]
    assert c["threadgroup_memory"] == 0 and c["barriers"] == 0


@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(bits=st.sampled_from([4, 8]), n_groups=st.integers(1, 8), N=st.integers(1, 40),
       dtype=st.sampled_from(["bf16", "f16"]), seed=st.integers(0, 2**31 - 1))
def test_qmv_float_output(lib, schedule, bits, n_groups, N, dtype, seed):
    """Logits: bf16/f16 activations and weights, float accumulation, float output -- exact to float rounding."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    gs = 64
    K = gs * n_groups
    wq, s, b, wd = quantized(rng, (N, K), bits, gs, dt)
    x = rng.standard_normal(K).astype(dt)
    y = np.zeros(N, np.float32)
    lib.dispatch(f"qmv{bits}_{dtype}_f32out", ((N + 7) // 8, 1), (32, 2), [wq, s, b, x, y],
                 qmv_params(K, N, gs, K, N), schedule=schedule, seed=seed)
    assert rel_err(y, wd @ x.astype(np.float64)) <= 1e-5


@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(bits=st.sampled_from([4, 8]), gs=st.sampled_from([32, 64]), n_groups=st.integers(1, 6), N=st.integers(1, 24),
       E=st.integers(1, 6), slots=st.integers(1, 4), shared_x=st.booleans(), dtype=st.sampled_from(list(DTYPES)),
       seed=st.integers(0, 2**31 - 1))
def test_gather_qmv(lib, schedule, bits, gs, n_groups, N, E, slots, shared_x, dtype, seed):
    """Stacked experts selected by an index buffer (the MoE gate/up with one shared x, down with one x per slot)."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    K = gs * n_groups
    wq, s, b, wd = quantized(rng, (E, N, K), bits, gs, dt)
    ids = rng.integers(0, E, slots).astype(np.uint32)
    x = rng.standard_normal((1 if shared_x else slots, K)).astype(dt)
    y = np.zeros((slots, N), dt)
    lib.dispatch(f"gather_qmv{bits}_{dtype}", ((N + 7) // 8, slots), (32, 2), [wq, s, b, x, y, ids],
                 qmv_params(K, N, gs, 0 if shared_x else K, N), schedule=schedule, seed=seed)
    xs = x.astype(np.float64)
    ref = np.stack([wd[ids[i]] @ xs[0 if shared_x else i] for i in range(slots)])
    assert rel_err(y, ref) <= TOL[dtype]


@pytest.mark.parametrize("N,K,bits", [(2048, 2048, 4), (512, 2048, 4), (2048, 512, 4), (256, 2048, 8)])
def test_qmv_model_shapes(lib, N, K, bits):
    """Real decode shapes of Qwen3.6-35B-A3B (hidden 2048, expert intermediate 512, router 8-bit), bf16."""
    rng = np.random.default_rng(N + K + bits)
    wq, s, b, wd = quantized(rng, (N, K), bits, 64, BF16)
    x = rng.standard_normal(K).astype(BF16)
    y = np.zeros(N, BF16)
    yf = np.zeros(N, np.float32)
    lib.dispatch(f"qmv{bits}_bf16", (N // 8, 1), (32, 2), [wq, s, b, x, y], qmv_params(K, N, 64, K, N),
                 schedule="random", seed=1)
    lib.dispatch(f"qmv{bits}_bf16_f32out", (N // 8, 1), (32, 2), [wq, s, b, x, yf], qmv_params(K, N, 64, K, N))
    ref = wd @ x.astype(np.float64)
    assert rel_err(y, ref) <= 1e-2
    assert rel_err(yf, ref) <= 1e-5
    np.testing.assert_array_equal(yf.astype(BF16), y)  # the bf16 kernel is the float one rounded once


def test_qmv_runtime_compiled_matches_builtin(lib):
    """The product path (kernels linked into _core) and sim.compile of the same source agree."""
    rt = sim.compile(sim.kernel_path("quant.metal"))
    rng = np.random.default_rng(5)
    N, K = 24, 320
    wq, s, b, wd = quantized(rng, (N, K), 4, 64, np.float32)
    x = rng.standard_normal(K).astype(np.float32)
    y1, y2 = np.zeros(N, np.float32), np.zeros(N, np.float32)
    lib.dispatch("qmv4_f32", (3, 1), (32, 2), [wq, s, b, x, y1], qmv_params(K, N, 64, K, N))
    rt.dispatch("qmv4_f32", (3, 1), (32, 2), [wq, s, b, x, y2], qmv_params(K, N, 64, K, N), schedule="reverse")
    np.testing.assert_allclose(y1, y2, rtol=1e-6, atol=1e-6)
    assert rel_err(y1, wd @ x) <= 1e-5


def test_qmv_schedule_independent(lib):
    rng = np.random.default_rng(6)
    N, K = 20, 256
    wq, s, b, _ = quantized(rng, (N, K), 4, 32, BF16)
    x = rng.standard_normal((2, K)).astype(BF16)
    y = np.zeros((2, N), BF16)
    lib.check_schedules("qmv4_bf16", (3, 2), (32, 2), [wq, s, b, x, y], qmv_params(K, N, 32, K, N), seeds=(1, 2, 3))


# ------------------------------------------------------------------------------------------ norms
def rms_ref(h, w, eps):
    h = h.astype(np.float64)
    return h / np.sqrt((h * h).mean(axis=-1, keepdims=True) + eps) * w.astype(np.float64)


@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(H=st.integers(1, 300), rows=st.integers(1, 3), threads=st.sampled_from([32, 64, 96, 256]),
       dtype=st.sampled_from(list(DTYPES)), seed=st.integers(0, 2**31 - 1))
def test_rmsnorm(lib, schedule, H, rows, threads, dtype, seed):
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    x = (rng.standard_normal((rows, H)) * rng.uniform(0.1, 10)).astype(dt)
    w = (1 + 0.2 * rng.standard_normal(H)).astype(dt)
    y = np.zeros((rows, H), dt)
    eps = 1e-6
    c = lib.dispatch(f"rmsnorm_{dtype}", rows, threads, [x, w, y], sim.pack("If", H, eps), schedule=schedule,
                     seed=seed)
    assert rel_err(y, rms_ref(x, w, eps)) <= TOL[dtype]
    assert c["barriers"] == rows and c["threadgroup_memory"] == 128


@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(H=st.integers(1, 300), rows=st.integers(1, 3), threads=st.sampled_from([32, 64, 128, 256]),
       dtype=st.sampled_from(list(DTYPES)), in_place=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_add_rmsnorm(lib, schedule, H, rows, threads, dtype, in_place, seed):
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    x = rng.standard_normal((rows, H)).astype(dt)
    r = rng.standard_normal((rows, H)).astype(dt)
    w = (1 + 0.2 * rng.standard_normal(H)).astype(dt)
    h_ref = (x.astype(np.float32) + r.astype(np.float32)).astype(dt)  # the residual stream, rounded as stored
    h = x if in_place else np.zeros_like(x)
    y = np.zeros((rows, H), dt)
    x_in = x.copy()
    lib.dispatch(f"add_rmsnorm_{dtype}", rows, threads, [x, r, w, h, y], sim.pack("If", H, 1e-6), schedule=schedule,
                 seed=seed)
    np.testing.assert_array_equal(h.view(np.uint8), h_ref.view(np.uint8))
    if not in_place:
        np.testing.assert_array_equal(x, x_in)
    assert rel_err(y, rms_ref(h_ref, w, 1e-6)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_norms_model_shape(lib, dtype):
    """hidden 2048 with 512 threads (4 per thread, one vector load each), as the decoder uses it."""
    rng = np.random.default_rng(7)
    dt = DTYPES[dtype]
    H = 2048
    x = rng.standard_normal((2, H)).astype(dt)
    r = rng.standard_normal((2, H)).astype(dt)
    w = (1 + 0.2 * rng.standard_normal(H)).astype(dt)
    y = np.zeros_like(x)
    h = np.zeros_like(x)
    lib.check_schedules(f"rmsnorm_{dtype}", 2, 512, [x, w, y], sim.pack("If", H, 1e-6), seeds=(1,))
    assert rel_err(y, rms_ref(x, w, 1e-6)) <= TOL[dtype]
    lib.check_schedules(f"add_rmsnorm_{dtype}", 2, 512, [x, r, w, h, y], sim.pack("If", H, 1e-6), seeds=(1,))
    h_ref = (x.astype(np.float32) + r.astype(np.float32)).astype(dt)
    assert rel_err(y, rms_ref(h_ref, w, 1e-6)) <= TOL[dtype]

"""vision family (metal/vision.metal through gpu.ops.vision_bias_act / vision_pos_embed / vision_rope) against the
numpy reference of the vision tower (qwenmetal.backends.reference_vision), on the simulator device under the
forward, reverse and random schedules. Simulator-verified, hardware-unverified.

Float within 1e-6 relative of the reference's float32 (GELU-tanh and the bias within rounding; the exact GELU's
erf within the 1.5e-7 of its approximation); bfloat16 within 1 bf16 ulp of the float64 value rounded where the
kernel rounds. The tower's end-to-end checks are tests/metal/test_vision_metal.py.
"""
import numpy as np
import pytest
from qwenmetal.backends.reference_vision import (gelu_erf, gelu_tanh, interpolation_taps, rotary_cos_sin,
                                                 rotary_positions)

from .gpu_harness import ACT, BF16, SCHEDULES, SIM, assert_bf16, ops, rel_err, run
from .wmat import raw

ACTS = {"none": lambda v: v, "gelu_tanh": gelu_tanh, "gelu_erf": gelu_erf}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("act", sorted(ACTS))
def test_vision_bias_act(schedule, dtype, act):
    """y = act(y + b) in place on the first N columns of rows of `stride` elements; the columns past N untouched."""
    rng = np.random.default_rng(hash((schedule, dtype, act)) % 2**32)
    rows, N, stride = 3, 300, 310
    dt = ACT[dtype]
    y = (rng.standard_normal((rows, stride)) * 3).astype(dt)
    b = rng.standard_normal(N).astype(dt)
    y0 = y.copy()
    with run(schedule, seed=1, keep_records=True) as (dev, enc, buf_):
        buf = raw(buf_)
        ops.vision_bias_act(enc, dtype, buf(y), buf(b), rows, N, act, stride)
    pre = (y0[:, :N].astype(np.float32) + b.astype(np.float32)).astype(dt).astype(np.float32)
    ref = ACTS[act](pre)
    if dtype == "f32":
        assert rel_err(y[:, :N], ref) <= 1e-6
    else:
        # GELU's negative tail, 0.5 x (1 + erf or tanh) -> 0, is exact to an absolute error, not in ulps
        assert_bf16(y[:, :N], np.asarray(ref, np.float32).astype(BF16), floor=1e-2)
    np.testing.assert_array_equal(y[:, N:].view(np.uint8), y0[:, N:].view(np.uint8))
    if SIM:
        assert dev.records()[0]["kernel"] == f"vision_bias_act_{dtype}"


def test_vision_gelu_erf_wide_range():
    """The exact GELU's erf approximation over [-8, 8]: within 2e-7 absolute of the float64 erf GELU."""
    x = np.linspace(-8, 8, 4001, dtype=np.float32).reshape(1, -1).copy()
    b = np.zeros(x.shape[1], np.float32)
    with run() as (dev, enc, buf):
        ops.vision_bias_act(enc, "f32", buf(x), buf(b), 1, x.shape[1], "gelu_erf")
    ref = gelu_erf(np.linspace(-8, 8, 4001, dtype=np.float32))
    assert np.abs(x[0] - ref).max() <= 2e-7 * 8


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_vision_pos_embed(schedule, dtype):
    """x = (x + b) + the 4 bilinear taps of the position table, with the reference's taps for two grids."""
    rng = np.random.default_rng(5)
    side, H = 6, 40
    grid = np.array([[1, 4, 6], [2, 2, 2]])
    idx, w = interpolation_taps(grid, side, 2)
    rows = len(idx)
    dt = ACT[dtype]
    x = rng.standard_normal((rows, H)).astype(dt)
    b = rng.standard_normal(H).astype(dt)
    table = rng.standard_normal((side * side, H)).astype(dt)
    x0 = x.astype(np.float32)
    idx32 = np.ascontiguousarray(idx, np.uint32)
    w32 = np.ascontiguousarray(w, np.float32)
    with run(schedule, seed=2) as (dev, enc, buf_):
        buf = raw(buf_)
        ops.vision_pos_embed(enc, dtype, buf(x), buf(b), buf(table), side * side, buf(idx32), buf(w32), rows, H)
    xb = (x0 + b.astype(np.float32)).astype(dt).astype(np.float32)
    pos = (table.astype(np.float32)[idx] * w32[:, :, None]).sum(axis=1, dtype=np.float32)
    ref = xb + pos
    if dtype == "f32":
        assert rel_err(x, ref) <= 1e-6
    else:
        assert_bf16(x, ref.astype(BF16))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [16, 72])
def test_vision_rope(schedule, dtype, head_dim):
    """q and k rotated (rotate-half over the whole head by the reference's 2-D cos/sin), v copied, the bias added
    to all three; k and v land at rows 0.. of each head of [heads, capacity, head_dim]."""
    rng = np.random.default_rng(head_dim)
    heads, cap = 3, 20
    grid = np.array([[1, 2, 4], [1, 2, 2]])
    pos = rotary_positions(grid, 2)
    rows = len(pos)
    cos, sin = rotary_cos_sin(pos, head_dim, 10000.0)
    H = heads * head_dim
    dt = ACT[dtype]
    qkv = rng.standard_normal((rows, 3 * H)).astype(dt)
    bias = rng.standard_normal(3 * H).astype(dt)
    q = np.zeros((rows, H), dt)
    k = np.zeros((heads, cap, head_dim), dt)
    v = np.zeros((heads, cap, head_dim), dt)
    with run(schedule, seed=3, keep_records=True) as (dev, enc, buf_):
        buf = raw(buf_)
        ops.vision_rope(enc, dtype, heads, head_dim, buf(qkv), buf(bias), buf(cos), buf(sin), buf(q), buf(k), buf(v),
                        cap, rows)
    full = (qkv.astype(np.float32) + bias.astype(np.float32)).astype(dt).astype(np.float32).reshape(rows, 3, heads,
                                                                                                   head_dim)
    half = head_dim // 2

    def rot(x):
        r = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos[:, None, :] + r * sin[:, None, :]

    q_ref, k_ref, v_ref = rot(full[:, 0]), rot(full[:, 1]), full[:, 2]
    got = [q.reshape(rows, heads, head_dim), k[:, :rows].transpose(1, 0, 2), v[:, :rows].transpose(1, 0, 2)]
    for g, r, name in zip(got, (q_ref, k_ref, v_ref), "qkv"):
        if dtype == "f32":
            assert rel_err(g, r) <= 1e-6, name
        else:
            assert_bf16(g, r.astype(BF16), what=name)
    assert not k[:, rows:].view(np.uint16).any() and not v[:, rows:].view(np.uint16).any()
    if SIM:
        assert dev.records()[0]["kernel"] == f"vision_rope_{dtype}"


def test_vision_errors():
    """Bad arguments are refused before anything is encoded, naming the argument."""
    y = np.zeros((2, 8), np.float32)
    b = np.zeros(8, np.float32)
    with run() as (dev, enc, buf):
        with pytest.raises(ValueError, match="act must be 'none', 'gelu_tanh' or 'gelu_erf'"):
            ops.vision_bias_act(enc, "f32", buf(y), buf(b), 2, 8, "relu")
        with pytest.raises(ValueError, match="stride 4 below N 8"):
            ops.vision_bias_act(enc, "f32", buf(y), buf(b), 2, 8, "none", 4)
        with pytest.raises(ValueError, match="y holds 64 bytes, needs 96"):
            ops.vision_bias_act(enc, "f32", buf(y), buf(b), 3, 8)
        idx = np.zeros((2, 4), np.uint32)
        with pytest.raises(ValueError, match="table holds 32 bytes, needs 64"):
            ops.vision_pos_embed(enc, "f32", buf(y), buf(b), buf(b), 2, buf(idx), buf(idx.view(np.float32)), 2, 8)
        qkv = np.zeros((2, 24), np.float32)
        kv = np.zeros(64, np.float32)
        cs = np.zeros((2, 4), np.float32)
        with pytest.raises(ValueError, match="head_dim must be even"):
            ops.vision_rope(enc, "f32", 2, 3, buf(qkv), buf(qkv), buf(cs), buf(cs), buf(y), buf(kv), buf(kv), 4, 2)
        with pytest.raises(ValueError, match="3 rows outside K/V buffers of 2 rows"):
            ops.vision_rope(enc, "f32", 2, 4, buf(qkv), buf(qkv), buf(cs), buf(cs), buf(y), buf(kv), buf(kv), 2, 3)
        assert enc.dispatches == 0

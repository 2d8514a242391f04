"""Gated DeltaNet decode kernels (metal/gdn.metal) through their host functions (gpu.ops.gdn_conv, gdn_step)
on the simulator device, against the numpy reference (python/qwenmetal/reference.py: causal_conv1d, silu,
l2norm, sigmoid, softplus, gdn_recurrent, gated_rms_norm), evaluated on exactly the values the kernels see
(bf16 inputs converted to float32; in bf16 the conv output is rounded to bf16 before the step reads it, as the
kernel stores it). Simulator-verified, hardware-unverified.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwenmetal.backends import reference as R
from qwenmetal.testing import random_params

from .gpu_harness import ACT, BF16, SCHEDULES, assert_bf16, gpu, ops, rel_err, run

F32 = np.float32
EPS = 1e-6
PAD = 5          # sentinel elements after every output buffer: the kernels must not write past their range


def padded(a: np.ndarray, dtype) -> np.ndarray:
    """a flattened into a C-contiguous array of `dtype` with PAD NaN sentinels after it."""
    out = np.full(a.size + PAD, np.nan, dtype=dtype)
    out[:a.size] = np.asarray(a, F32).ravel().astype(dtype)
    return out


def untouched_tail(a: np.ndarray) -> bool:
    return bool(np.isnan(np.asarray(a[-PAD:], F32)).all())


def f32(a) -> np.ndarray:
    return np.asarray(a, F32)


# ---------------------------------------------------------------------------------------------------------
# oracle
# ---------------------------------------------------------------------------------------------------------
def ref_conv(qkv, conv_w, conv_state, bf16: bool):
    """(act [C], new conv_state [K-1, C]) from the reference causal_conv1d + silu; in bf16 as the reference's
    bfloat16 mode rounds (the conv output, then MLX's silu)."""
    out, new_state = R.causal_conv1d(f32(qkv)[None], f32(conv_state), f32(conv_w))
    act = R.silu(R.to_bf16(out[0]), bf16=True) if bf16 else R.silu(out[0])
    return act, new_state


def ref_rows(shape, act, z, b, a, A_log, dt_bias, norm_w, eps, state, bf16: bool):
    """(y [M, nv*dv], new state [nv, dv, dk]) for M consecutive rows from the reference's q/k normalisation,
    gates, gdn_recurrent and gated_rms_norm (bf16: the reference's bfloat16-mode rounding points, as
    gated_deltanet applies them). act [M, conv_dim], z [M, nv*dv], b, a [M, nv]."""
    nk, nv, dk, dv = shape.nk, shape.nv, shape.dk, shape.dv
    kd = nk * dk
    act = f32(act)
    M = act.shape[0]
    q, k = R._normalize_qk(act[:, :kd].reshape(M, nk, dk), act[:, kd:2 * kd].reshape(M, nk, dk), bf16)
    v = act[:, 2 * kd:2 * kd + nv * dv].reshape(M, nv, dv)
    beta = R.sigmoid(f32(b))
    if bf16:
        beta = R.to_bf16(beta)
    g_log = -np.exp(f32(A_log)) * R.softplus(f32(a) + f32(dt_bias))
    o, new_state = R.gdn_recurrent(q, k, v, beta, g_log, f32(state))
    if bf16:
        o = R.to_bf16(o)
    y = R.gated_rms_norm(o, f32(z).reshape(M, nv, dv), f32(norm_w), eps, bf16=bf16).reshape(M, nv * dv)
    return y, new_state


def ref_step(shape, act, z, b, a, A_log, dt_bias, norm_w, eps, state, bf16: bool):
    """One token of ref_rows: (y [nv*dv], new state)."""
    y, new_state = ref_rows(shape, f32(act)[None], f32(z)[None], f32(b)[None], f32(a)[None], A_log, dt_bias,
                            norm_w, eps, state, bf16)
    return y[0], new_state


# ---------------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------------
class Layer:
    """Random per-layer weights and states of one GDN shape, as the host contract lays them out."""

    def __init__(self, shape, dtype: str, seed: int, a_scale: float = 1.0):
        rng = np.random.default_rng(seed)
        T = ACT[dtype]
        self.shape, self.dtype, self.T, self.rng = shape, dtype, T, rng
        C, K, nv, dv, dk = shape.conv_dim, shape.conv_kernel, shape.nv, shape.dv, shape.dk
        self.conv_w = rng.normal(0.0, 0.5, size=(C, K)).astype(F32)            # canonical [conv_dim, K]
        self.conv_state = padded(rng.normal(size=(K - 1, C)), F32)              # [K-1, C] oldest first
        self.A_log = rng.normal(0.0, 1.0, size=nv).astype(F32)
        self.dt_bias = rng.normal(0.0, 1.0, size=nv).astype(F32)
        self.norm_w = rng.normal(1.0, 0.3, size=dv).astype(F32).astype(T)
        self.state = padded(rng.normal(0.0, 0.5, size=(nv, dv, dk)), F32)       # [nv, dv, dk]
        self.a_scale = a_scale

    def token(self):
        """One token's projection outputs: qkv [C], z [nv*dv], b [nv], a [nv] (dtype T)."""
        s, rng, T = self.shape, self.rng, self.T
        return (rng.normal(size=s.conv_dim).astype(F32).astype(T),
                rng.normal(size=s.value_dim).astype(F32).astype(T),
                rng.normal(0.0, 2.0, size=s.nv).astype(F32).astype(T),
                (self.a_scale * rng.normal(size=s.nv)).astype(F32).astype(T))


def conv_state_view(L: Layer) -> np.ndarray:
    s = L.shape
    return L.conv_state[:(s.conv_kernel - 1) * s.conv_dim].reshape(s.conv_kernel - 1, s.conv_dim)


def state_view(L: Layer) -> np.ndarray:
    s = L.shape
    return L.state[:s.nv * s.dv * s.dk].reshape(s.nv, s.dv, s.dk)


def run_tokens(L: Layer, tokens, schedule: str, seed: int = 0, pingpong: bool = False):
    """Encode conv + step for every token into ONE command buffer (state carried through the device buffers,
    barriers from the declared access) and return the per-token act and y arrays. With `pingpong`, token i
    reads one half of a pair of state buffers and writes the other (the graph's layout); the final state is
    copied back into L's arrays."""
    s, T = L.shape, L.T
    n = len(tokens)
    acts = [padded(np.zeros(s.conv_dim), T) for _ in range(n)]
    ys = [padded(np.zeros(s.value_dim), T) for _ in range(n)]
    halves = [(L.conv_state, L.state)] + ([(L.conv_state.copy(), L.state.copy())] if pingpong else [])
    with run(schedule, seed) as (dev, enc, buf):
        cw, A, dtb, nw = buf(L.conv_w), buf(L.A_log), buf(L.dt_bias), buf(L.norm_w)
        hb = [(buf(c), buf(st_)) for c, st_ in halves]
        for i, ((qkv, z, b, a), act, y) in enumerate(zip(tokens, acts, ys)):
            (cs, st_), (cs_out, st_out) = hb[i % len(hb)], hb[(i + 1) % len(hb)]
            ops.gdn_conv(enc, L.dtype, s, buf(qkv), cw, cs, buf(act), conv_out=cs_out)
            ops.gdn_step(enc, L.dtype, s, buf(act), buf(z), buf(b), buf(a), A, dtb, nw, EPS, st_, buf(y),
                         state_out=st_out)
    final = halves[n % len(halves)]
    if final[0] is not L.conv_state:
        L.conv_state[:] = final[0]
        L.state[:] = final[1]
    return acts, ys


def close(got, ref, tol, what):
    """within `tol` relative, or for tol == "bf16" in bf16 ulps of a reference rounded where the kernels round
    (gpu_harness.assert_bf16; ulps of at least 1e-3 of the largest value: the recurrence output is a cancelling
    float sum)"""
    if tol == "bf16":
        ref = np.asarray(ref, np.float64)
        assert_bf16(got, ref, floor=1e-3 * np.abs(ref).max(), what=what)
    else:
        e = rel_err(got, ref)
        assert e < tol, f"{what} rel err {e:.3g}"


def check_tokens(L: Layer, tokens, schedule: str, tol_y: float, tol_state: float, pingpong: bool = False):
    s = L.shape
    bf16 = L.dtype == "bf16"
    conv_state0, state0 = conv_state_view(L).copy(), state_view(L).copy()
    acts, ys = run_tokens(L, tokens, schedule, pingpong=pingpong)
    cs, S = conv_state0, state0
    for t, ((qkv, z, b, a), act, y) in enumerate(zip(tokens, acts, ys)):
        act_ref, cs = ref_conv(qkv, L.conv_w, cs, bf16)
        # the step oracle reads the kernel's act: the two kernels are checked separately per token
        y_ref, S = ref_step(s, act[:s.conv_dim], z, b, a, L.A_log, L.dt_bias, L.norm_w, EPS, S, bf16)
        assert untouched_tail(act) and untouched_tail(y), f"token {t}: write past the end of act / y"
        close(f32(act[:s.conv_dim]), act_ref, tol_y, f"token {t}: act")
        close(f32(y[:s.value_dim]), y_ref, tol_y, f"token {t}: y")
    assert untouched_tail(L.conv_state) and untouched_tail(L.state), "write past the end of a state"
    assert np.array_equal(conv_state_view(L), cs), "conv state: not the last K-1 rows of [state; qkv]"
    e_s = rel_err(state_view(L), S)
    assert e_s < tol_state, f"recurrent state rel err {e_s:.3g}"


# ---------------------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------------------
DIMS = st.sampled_from([8, 16, 24, 32, 40, 64, 72])


@st.composite
def shapes(draw):
    nk = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 3]))
    return ops.GdnShape(nk=nk, nv=nk * group, dk=draw(DIMS), dv=draw(DIMS),
                        conv_kernel=draw(st.sampled_from([2, 3, 4])))


@pytest.mark.parametrize("schedule", SCHEDULES)
@settings(max_examples=20, deadline=None, derandomize=True)
@given(shape=shapes(), n_tokens=st.integers(1, 3), seed=st.integers(0, 2**31 - 1), pingpong=st.booleans())
def test_conv_step_f32(schedule, shape, n_tokens, seed, pingpong):
    """f32: several consecutive tokens, conv + step chained in one command buffer, both states carried
    (in place, or ping-pong between two halves as the decode graph keeps them)."""
    L = Layer(shape, "f32", seed)
    check_tokens(L, [L.token() for _ in range(n_tokens)], schedule, tol_y=1e-5, tol_state=1e-5, pingpong=pingpong)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(shape=shapes(), n_tokens=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_conv_step_bf16(shape, n_tokens, seed):
    """bf16 activations, rounded where the reference's bfloat16 mode rounds (in ulps: an ulp where float
    summation order flips a rounding); the float states stay float-exact (1e-5) because the oracle reads the
    same bf16 values."""
    L = Layer(shape, "bf16", seed)
    check_tokens(L, [L.token() for _ in range(n_tokens)], "random", tol_y="bf16", tol_state=1e-5)


def test_gate_extremes():
    """softplus far in both tails (a + dt_bias ~ +-40 and beyond): decay ~ 1 and decay ~ 0, beta ~ 0 and 1."""
    shape = ops.GdnShape(nk=2, nv=4, dk=32, dv=16, conv_kernel=4)
    L = Layer(shape, "f32", 7)
    L.dt_bias[:] = np.array([-60.0, -25.0, 25.0, 60.0], F32)
    L.A_log[:] = np.array([2.0, 0.5, -1.0, -4.0], F32)
    tokens = []
    for _ in range(2):
        qkv, z, b, a = L.token()
        b[:] = np.array([-30.0, 30.0, -5.0, 5.0], F32)
        tokens.append((qkv, z, b, a))
    check_tokens(L, tokens, "forward", tol_y=1e-5, tol_state=1e-5)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_realistic_shape(dtype):
    """The real model's GDN layer (16 k-heads, 32 v-heads, 128 x 128, K 4, conv_dim 8192), two tokens."""
    shape = ops.GdnShape(nk=16, nv=32, dk=128, dv=128, conv_kernel=4)
    assert shape.conv_dim == 8192 and shape.value_dim == 4096
    L = Layer(shape, dtype, 2026)
    tol = 1e-5 if dtype == "f32" else "bf16"
    check_tokens(L, [L.token() for _ in range(2)], "random", tol_y=tol, tol_state=1e-5)


@pytest.mark.parametrize("dk", [32, 33, 64, 65, 128, 129, 256])
def test_step_per_lane_instantiations(dk):
    """gdn_step's instantiations (1, 2, 4, 8 state elements per lane: dk <= 32, 64, 128, 256), each at both
    ends of its range, two tokens against the reference."""
    shape = ops.GdnShape(nk=1, nv=2, dk=dk, dv=8, conv_kernel=2)
    L = Layer(shape, "f32", dk)
    check_tokens(L, [L.token() for _ in range(2)], "random", tol_y=1e-5, tol_state=1e-5)


def test_dispatch_geometry_and_bytes():
    """One dispatch each; the step's declared traffic is dominated by the state, read and written once."""
    shape = ops.GdnShape(nk=16, nv=32, dk=128, dv=128, conv_kernel=4)
    dev = gpu.SimDevice(execute=False)
    cb = dev.command_buffer()
    enc = gpu.Encoder(dev, cb)
    C, V, nv = shape.conv_dim, shape.value_dim, shape.nv
    al = dev.alloc
    ops.gdn_conv(enc, "bf16", shape, al(2 * C), al(4 * C * 4), al(4 * 3 * C), al(2 * C))
    assert (enc.dispatches, enc.bytes_read, enc.bytes_written) == (1, 2 * C + 16 * C + 12 * C, 12 * C + 2 * C)
    r0, w0 = enc.bytes_read, enc.bytes_written
    state_bytes = nv * 128 * 128 * 4
    ops.gdn_step(enc, "bf16", shape, al(2 * C), al(2 * V), al(2 * nv), al(2 * nv), al(4 * nv), al(4 * nv),
                 al(2 * 128), EPS, al(state_bytes), al(2 * V))
    assert enc.dispatches == 2
    assert enc.bytes_read - r0 == 2 * C + 2 * V + 4 * nv + 8 * nv + 2 * 128 + state_bytes
    assert enc.bytes_written - w0 == state_bytes + 2 * V
    cb.commit()
    cb.wait()


def test_argument_checks():
    shape = ops.GdnShape(nk=2, nv=4, dk=16, dv=8, conv_kernel=4)
    C, V, nv, dk, dv = shape.conv_dim, shape.value_dim, shape.nv, shape.dk, shape.dv
    with run("forward") as (dev, enc, buf):
        def arrays(T):
            return dict(qkv=np.zeros(C, T), conv_w=np.zeros((C, 4), F32), conv_state=np.zeros((3, C), F32),
                        act=np.zeros(C, T), z=np.zeros(V, T), b=np.zeros(nv, T), a=np.zeros(nv, T),
                        A_log=np.zeros(nv, F32), dt_bias=np.zeros(nv, F32), norm_w=np.zeros(dv, T),
                        state=np.zeros((nv, dv, dk), F32), y=np.zeros(V, T))

        def conv(s=shape, dtype="f32", **over):
            x = {k: buf(v) for k, v in arrays(ACT[dtype]).items()}
            x.update({k: buf(v) for k, v in over.items()})
            ops.gdn_conv(enc, dtype, s, x["qkv"], x["conv_w"], x["conv_state"], x["act"])

        def step(s=shape, dtype="f32", **over):
            x = {k: buf(v) for k, v in arrays(ACT[dtype]).items()}
            x.update({k: buf(v) for k, v in over.items()})
            ops.gdn_step(enc, dtype, s, x["act"], x["z"], x["b"], x["a"], x["A_log"], x["dt_bias"], x["norm_w"],
                         EPS, x["state"], x["y"])

        conv()
        step()
        conv(dtype="bf16")
        step(dtype="bf16")
        for name, n in [("qkv", C - 1), ("conv_w", C * 4 - 1), ("conv_state", 3 * C - 1), ("act", C - 1)]:
            with pytest.raises(ValueError, match=f"gdn_conv: {name} holds"):
                conv(**{name: np.zeros(n, F32)})
        # an f32 conv given a bf16-sized input: too small
        with pytest.raises(ValueError, match="gdn_conv: qkv holds"):
            conv(qkv=np.zeros(C, BF16))
        for name, n in [("act", C - 1), ("z", V - 1), ("b", nv - 1), ("a", nv - 1), ("A_log", nv - 1),
                        ("dt_bias", nv - 1), ("norm_w", dv - 1), ("state", nv * dv * dk - 1), ("y", V - 1)]:
            with pytest.raises(ValueError, match=f"gdn_step: {name} holds"):
                step(**{name: np.zeros(n, F32)})
        bad = [(dict(nk=2, nv=3, dk=16, dv=8, conv_kernel=4), "multiple of nk"),
               (dict(nk=0, nv=4, dk=16, dv=8, conv_kernel=4), "positive"),
               (dict(nk=2, nv=4, dk=16, dv=8, conv_kernel=1), "conv_kernel"),
               (dict(nk=1, nv=1, dk=257, dv=8, conv_kernel=4), "GDN_STEP_MAX_DK"),
               (dict(nk=1, nv=1, dk=8, dv=1025, conv_kernel=4), "GDN_STEP_MAX_DV")]
        for kw, msg in bad:
            s = ops.GdnShape(**kw)
            big = dict(qkv=np.zeros(max(s.conv_dim, 1), F32), conv_w=np.zeros(max(s.conv_dim, 1) * 4, F32),
                       conv_state=np.zeros(max(s.conv_dim, 1) * 3, F32), act=np.zeros(max(s.conv_dim, 1), F32))
            if "conv_kernel" in msg or "multiple" in msg or "positive" in msg:
                with pytest.raises(ValueError, match=msg):
                    conv(s, **big)
            bigs = dict(act=np.zeros(max(s.conv_dim, 1), F32), z=np.zeros(max(s.value_dim, 1), F32),
                        state=np.zeros(max(s.nv * s.dv * s.dk, 1), F32), y=np.zeros(max(s.value_dim, 1), F32),
                        norm_w=np.zeros(max(s.dv, 1), F32))
            with pytest.raises(ValueError, match=msg):
                step(s, **bigs)
        x = buf(np.zeros(C, F32))
        with pytest.raises(ValueError, match="float32"):
            ops.gdn_conv(enc, "f16", shape, x, buf(np.zeros(4 * C, F32)), buf(np.zeros(3 * C, F32)), x)


# ---------------------------------------------------------------------------------------------------------
# prefill: gdn_conv over rows, gdn_prefill (scan and chunked routes)
# ---------------------------------------------------------------------------------------------------------
BLOCKS = [1, 2, 3, 7, 8, 16, 31, 32, 64]


class Chunk:
    """M rows of a prefill chunk for L's shape: act [M, conv_dim] (the conv output: silu of normal values),
    proj [M, proj_stride] the stacked projection rows [qkv | z | b | a | pad] (dtype T)."""

    def __init__(self, L: Layer, M: int, extra: int = 3):
        s, rng, T = L.shape, L.rng, L.T
        C, V, nv = s.conv_dim, s.value_dim, s.nv
        self.M, self.stride = M, C + V + 2 * nv + extra
        self.act = R.silu(rng.normal(size=(M, C)).astype(F32)).astype(T)
        proj = rng.normal(size=(M, self.stride)).astype(F32)
        proj[:, C + V:C + V + nv] *= 2.0                                         # b: beta over its range
        proj[:, C + V + nv:C + V + 2 * nv] *= L.a_scale
        self.proj = proj.astype(T)

    def rows(self, lo, hi, L: Layer):
        s = L.shape
        C, V, nv = s.conv_dim, s.value_dim, s.nv
        p = self.proj[lo:hi]
        return (self.act[lo:hi], p[:, C:C + V], p[:, C + V:C + V + nv], p[:, C + V + nv:C + V + 2 * nv])


def run_prefill(L: Layer, ch: Chunk, route: str, block: int = 0, schedule: str = "forward", splits=None,
                pingpong: bool = False):
    """gdn_prefill over ch's rows (in one call, or one call per [lo, hi) of `splits`, in one command buffer);
    returns (y [M, value_dim] as float, the state after the last row). L's state is not modified."""
    s, T = L.shape, L.T
    M = ch.M
    splits = splits or [(0, M)]
    y = padded(np.zeros(M * s.value_dim), T)
    st = L.state.copy()
    st2 = L.state.copy()
    scratch = np.zeros(ops.gdn_prefill_scratch_bytes(s, M) // 4 + PAD, F32)
    scratch[-PAD:] = np.nan
    es = np.dtype(T).itemsize
    with run(schedule) as (dev, enc, buf):
        A, dtb, nw, act_b, proj_b, yb, sb = (buf(L.A_log), buf(L.dt_bias), buf(L.norm_w), buf(ch.act),
                                             buf(ch.proj), buf(y), buf(scratch))
        cur, nxt = buf(st), buf(st2)
        for lo, hi in splits:
            ops.gdn_prefill(enc, L.dtype, s, act_b.view(lo * s.conv_dim * es, (hi - lo) * s.conv_dim * es),
                            proj_b.view(lo * ch.stride * es, (hi - lo) * ch.stride * es), ch.stride, A, dtb, nw,
                            EPS, cur, yb.view(lo * s.value_dim * es, (hi - lo) * s.value_dim * es), hi - lo, sb,
                            route=route, block=block, state_out=nxt if pingpong else None)
            if pingpong:
                cur, nxt = nxt, cur
                st, st2 = st2, st
    assert untouched_tail(y), "write past the end of y"
    assert untouched_tail(st) and untouched_tail(scratch), "write past the end of the state / scratch"
    n = s.nv * s.dv * s.dk
    return f32(y[:M * s.value_dim]).reshape(M, s.value_dim), st[:n].reshape(s.nv, s.dv, s.dk).copy()


def ref_prefill(L: Layer, ch: Chunk):
    return ref_rows(L.shape, *ch.rows(0, ch.M, L), L.A_log, L.dt_bias, L.norm_w, EPS, state_view(L),
                    L.dtype == "bf16")


def check_close(y, S, y_ref, S_ref, tol_y, tol_s, what):
    close(y, y_ref, tol_y, f"{what}: y")
    close(S, S_ref, tol_s, f"{what}: state")


DIMS8 = st.sampled_from([8, 16, 24, 32, 40, 64])


@st.composite
def shapes8(draw):
    """shapes the chunked kernel supports (dk, dv multiples of 8), non-powers of two included"""
    nk = draw(st.sampled_from([1, 2]))
    return ops.GdnShape(nk=nk, nv=nk * draw(st.sampled_from([1, 2, 3])), dk=draw(DIMS8), dv=draw(DIMS8),
                        conv_kernel=4)


@pytest.mark.parametrize("schedule", SCHEDULES)
@settings(max_examples=6, deadline=None, derandomize=True)
@given(shape=shapes8(), M=st.integers(1, 40), block=st.sampled_from(BLOCKS), seed=st.integers(0, 2**31 - 1),
       pingpong=st.booleans())
def test_prefill_routes_f32(schedule, shape, M, block, seed, pingpong):
    """f32: both routes against the reference recurrence (1e-5), and the chunked form against the scan (1e-5),
    any block size and M (not divisible by the block), in place or ping-pong."""
    L = Layer(shape, "f32", seed)
    ch = Chunk(L, M)
    y_ref, S_ref = ref_prefill(L, ch)
    y_s, S_s = run_prefill(L, ch, "scan", schedule=schedule, pingpong=pingpong)
    y_c, S_c = run_prefill(L, ch, "chunked", block, schedule=schedule, pingpong=pingpong)
    check_close(y_s, S_s, y_ref, S_ref, 1e-5, 1e-5, "scan vs reference")
    check_close(y_c, S_c, y_ref, S_ref, 1e-5, 1e-5, f"chunked (block {block}) vs reference")
    check_close(y_c, S_c, y_s, S_s, 1e-5, 1e-5, f"chunked (block {block}) vs scan")


@pytest.mark.parametrize("block", range(1, 65))
def test_chunked_block_sweep(block):
    """Every block size 1..64 over 67 rows (no block but 1 divides it) with strong and weak decay heads and
    beta near 0 and 1 (the log-space mask: Gamma underflows to 0 inside long blocks): chunked == scan to 1e-5."""
    shape = ops.GdnShape(nk=2, nv=4, dk=16, dv=32, conv_kernel=4)
    L = Layer(shape, "f32", 100 + block)
    L.A_log[:] = np.array([2.0, 0.5, -1.0, -4.0], F32)
    L.dt_bias[:] = np.array([3.0, 0.0, -2.0, -30.0], F32)
    ch = Chunk(L, 67)
    y_s, S_s = run_prefill(L, ch, "scan")
    y_c, S_c = run_prefill(L, ch, "chunked", block, schedule="random")
    check_close(y_c, S_c, y_s, S_s, 1e-5, 1e-5, f"block {block}")


@settings(max_examples=6, deadline=None, derandomize=True)
@given(shape=shapes8(), M=st.integers(2, 24), block=st.sampled_from(BLOCKS), seed=st.integers(0, 2**31 - 1))
def test_prefill_routes_bf16(shape, M, block, seed):
    """bf16: both routes against the reference's bfloat16 mode (in ulps: an ulp where the summation order flips
    a rounding); the float state to 1e-5, because q, k, beta are the same rounded values in kernel and oracle."""
    L = Layer(shape, "bf16", seed)
    ch = Chunk(L, M)
    y_ref, S_ref = ref_prefill(L, ch)
    for route in ("scan", "chunked"):
        y, S = run_prefill(L, ch, route, block, schedule="random")
        check_close(y, S, y_ref, S_ref, "bf16", 1e-5, f"{route} (bf16)")


@pytest.mark.parametrize("route", ["scan", "chunked"])
def test_split_prefill(route):
    """Two calls (a + b rows, the state carried in the buffer) equal one call of a + b rows, and equal the
    other route (chunked: a block that divides neither part)."""
    shape = ops.GdnShape(nk=2, nv=4, dk=24, dv=16, conv_kernel=4)
    L = Layer(shape, "f32", 11)
    ch = Chunk(L, 37)
    y1, S1 = run_prefill(L, ch, route, 7)
    for splits, pp in [([(0, 13), (13, 37)], False), ([(0, 1), (1, 30), (30, 37)], True)]:
        y2, S2 = run_prefill(L, ch, route, 7, schedule="reverse", splits=splits, pingpong=pp)
        check_close(y2, S2, y1, S1, 1e-6, 1e-6, f"{route} split {splits}")


@pytest.mark.parametrize("dtype,K,Ms,schedule", [("f32", 2, (1, 2, 5), "random"), ("f32", 4, (1, 2, 5, 70), "random"),
                                                  ("bf16", 2, (1, 2, 5), "random"), ("bf16", 4, (1, 2, 5, 70), "random"),
                                                  ("f32", 34, (2, 70), "forward"), ("f32", 34, (70,), "reverse")])
def test_conv_rows(dtype, K, Ms, schedule):
    """gdn_conv over M rows of a strided projection equals M single-row calls (bit-exact: the same sums), and
    the reference causal_conv1d; conv_out in place and ping-pong; M < K-1 shifts part of the old window. 70 rows
    span three row blocks (32, 32, 6: the state is read and rewritten by block 0 only); K = 34 raises the row
    block to K - 1 = 33, so that block 0 still holds every row whose window reaches into the state (with
    blocks of 32, block 1 would read state row 32 in place after block 0 rewrote it: the forward schedule runs
    block 0 first)."""
    shape = ops.GdnShape(nk=1, nv=2, dk=16, dv=8, conv_kernel=K)
    C = shape.conv_dim
    for M in Ms:
        L = Layer(shape, dtype, 30 + M)
        stride = C + 7
        qkv = L.rng.normal(size=(M, stride)).astype(F32).astype(L.T)
        cs0 = conv_state_view(L).copy()
        act_rows = padded(np.zeros(M * C), L.T)
        act_one = [padded(np.zeros(C), L.T) for _ in range(M)]
        cs_rows = L.conv_state.copy()
        cs_out = np.full_like(L.conv_state, np.nan)
        cs_one = L.conv_state.copy()
        with run(schedule) as (dev, enc, buf):
            cw = buf(L.conv_w)
            ops.gdn_conv(enc, dtype, shape, buf(qkv), cw, buf(cs_rows), buf(act_rows), conv_out=buf(cs_out), rows=M,
                         qkv_stride=stride)
            ops.gdn_conv(enc, dtype, shape, buf(qkv), cw, buf(cs_rows), buf(act_rows), rows=M, qkv_stride=stride)
            ob = buf(cs_one)
            for m in range(M):
                ops.gdn_conv(enc, dtype, shape, buf(np.ascontiguousarray(qkv[m, :C])), cw, ob, buf(act_one[m]))
        assert untouched_tail(act_rows) and untouched_tail(cs_out) and untouched_tail(cs_rows)
        got = f32(act_rows[:M * C]).reshape(M, C)
        assert np.array_equal(got, np.stack([f32(x[:C]) for x in act_one])), f"M={M}: rows != token by token"
        assert np.array_equal(cs_rows, cs_one, equal_nan=True), f"M={M}: in-place window != token by token"
        assert np.array_equal(cs_out, cs_one, equal_nan=True), f"M={M}: ping-pong window != token by token"
        out, new_state = R.causal_conv1d(f32(qkv[:, :C]), cs0, L.conv_w)
        ref = R.silu(R.to_bf16(out), bf16=True) if dtype == "bf16" else R.silu(out)
        close(got, ref, "bf16" if dtype == "bf16" else 1e-6, f"M={M}: conv vs reference")
        assert np.array_equal(cs_one[:-PAD].reshape(K - 1, C), new_state), f"M={M}: conv state vs reference"


def test_prefill_realistic_shape():
    """The real GDN layer (16 k-heads, 32 v-heads, 128 x 128): 24 rows, both routes (chunked: block 16, so
    two blocks, the last one short) against the reference and each other."""
    shape = ops.GdnShape(nk=16, nv=32, dk=128, dv=128, conv_kernel=4)
    L = Layer(shape, "f32", 2027)
    ch = Chunk(L, 24)
    y_ref, S_ref = ref_prefill(L, ch)
    y_s, S_s = run_prefill(L, ch, "scan", schedule="random")
    y_c, S_c = run_prefill(L, ch, "chunked", 16, schedule="random")
    check_close(y_s, S_s, y_ref, S_ref, 1e-5, 1e-5, "scan vs reference")
    check_close(y_c, S_c, y_ref, S_ref, 1e-5, 1e-5, "chunked vs reference")
    check_close(y_c, S_c, y_s, S_s, 1e-5, 1e-5, "chunked vs scan")


def test_route_cost_model():
    """gdn_route: the scan for short chunks, the chunked form from the crossover on (real shape: between 8 and
    64 rows); Scan for shapes the chunked kernel does not fit; the declared flops and bytes of each route's
    dispatches equal gdn_prefill_cost's (bf16 build)."""
    real = ops.GdnShape(nk=16, nv=32, dk=128, dv=128, conv_kernel=4)
    routes = {M: ops.gdn_route(real, M) for M in (1, 2, 8, 64, 512, 4096)}
    assert routes[1] == routes[2] == routes[8] == "scan" and routes[64] == routes[512] == routes[4096] == "chunked"
    cross = next(M for M in range(1, 65) if ops.gdn_route(real, M) == "chunked")
    assert all(ops.gdn_route(real, M) == "chunked" for M in range(cross, 200))
    assert ops.gdn_route(ops.GdnShape(nk=1, nv=1, dk=12, dv=16, conv_kernel=4), 4096) == "scan"
    for M, route, block in [(64, "scan", 0), (64, "chunked", 0), (37, "chunked", 7)]:
        dev = gpu.SimDevice(execute=False)
        cb = dev.command_buffer()
        enc = gpu.Encoder(dev, cb)
        s = real
        al = dev.alloc
        ps = s.conv_dim + s.value_dim + 2 * s.nv
        st_ = al(s.nv * s.dv * s.dk * 4)
        ops.gdn_prefill(enc, "bf16", s, al(2 * M * s.conv_dim), al(2 * M * ps), ps, al(4 * s.nv), al(4 * s.nv),
                        al(2 * s.dv), EPS, st_, al(2 * M * s.value_dim), M,
                        al(ops.gdn_prefill_scratch_bytes(s, M)), route=route, block=block)
        cost = ops.gdn_prefill_cost(s, M, route, block)
        assert enc.dispatches == cost["dispatches"] == (1 if route == "scan" else 3)
        assert enc.flops == cost["flops"] and enc.bytes_read + enc.bytes_written == cost["bytes"], (M, route)
        cb.commit()
        cb.wait()
    c64 = ops.gdn_prefill_cost(real, 4096, "chunked")
    s64 = ops.gdn_prefill_cost(real, 4096, "scan")
    # more arithmetic, less time: the chunked route's critical path is ~M/64 blocks, not M tokens (~1.3x at 4K)
    assert c64["flops"] > s64["flops"] and c64["seconds"] < 0.8 * s64["seconds"]


def test_prefill_argument_checks():
    shape = ops.GdnShape(nk=2, nv=4, dk=16, dv=8, conv_kernel=4)
    C, V, nv, dk, dv = shape.conv_dim, shape.value_dim, shape.nv, shape.dk, shape.dv
    M, ps = 5, C + V + 2 * nv
    with run("forward") as (dev, enc, buf):
        def pre(s=shape, route="chunked", M=M, ps=ps, block=0, **over):
            x = dict(act=np.zeros(M * C, F32), proj=np.zeros(M * ps, F32), A_log=np.zeros(nv, F32),
                     dt_bias=np.zeros(nv, F32), norm_w=np.zeros(dv, F32), state=np.zeros(nv * dv * dk, F32),
                     y=np.zeros(M * V, F32), scratch=np.zeros(ops.gdn_prefill_scratch_bytes(shape, M) // 4, F32))
            x.update(over)
            b = {k: buf(v) for k, v in x.items()}
            ops.gdn_prefill(enc, "f32", s, b["act"], b["proj"], ps, b["A_log"], b["dt_bias"], b["norm_w"], EPS,
                            b["state"], b["y"], M, b["scratch"], route=route, block=block)

        pre()
        pre(route="scan")
        for name, n in [("act", M * C - 1), ("proj", M * ps - 1), ("A_log", nv - 1), ("dt_bias", nv - 1),
                        ("norm_w", dv - 1), ("state", nv * dv * dk - 1), ("y", M * V - 1)]:
            for route in ("scan", "chunked"):
                with pytest.raises(ValueError, match=f"gdn_prefill: {name} holds"):
                    pre(route=route, **{name: np.zeros(n, F32)})
        with pytest.raises(ValueError, match="gdn_prefill: scratch holds"):
            pre(scratch=np.zeros(100, F32))
        with pytest.raises(ValueError, match="proj_stride"):
            pre(ps=ps - 1)
        with pytest.raises(ValueError, match="M must be at least 1"):
            pre(M=0)
        with pytest.raises(ValueError, match="exceeds GDN_CHUNK_MAX"):
            pre(block=65)
        odd = ops.GdnShape(nk=1, nv=1, dk=12, dv=8, conv_kernel=4)
        with pytest.raises(ValueError, match="multiples of 8"):
            pre(s=odd)
        with pytest.raises(ValueError, match="GDN_STEP_MAX_DV"):
            pre(s=ops.GdnShape(nk=1, nv=1, dk=8, dv=136, conv_kernel=4), route="scan",
                state=np.zeros(136 * 8, F32), y=np.zeros(M * 136, F32), norm_w=np.zeros(136, F32),
                act=np.zeros(M * 152, F32), proj=np.zeros(M * 290, F32), ps=290)
        with pytest.raises(ValueError, match="route must be"):
            pre(route="fast")
        x = np.zeros(3 * C, F32)
        with pytest.raises(ValueError, match="gdn_conv: qkv holds"):
            ops.gdn_conv(enc, "f32", shape, buf(x), buf(np.zeros(4 * C, F32)), buf(np.zeros(3 * C, F32)),
                         buf(np.zeros(3 * C, F32)), rows=3, qkv_stride=C + 1)
        with pytest.raises(ValueError, match="qkv_stride"):
            ops.gdn_conv(enc, "f32", shape, buf(x), buf(np.zeros(4 * C, F32)), buf(np.zeros(3 * C, F32)),
                         buf(np.zeros(3 * C, F32)), rows=3, qkv_stride=C - 1)
        with pytest.raises(ValueError, match="rows must be at least 1"):
            ops.gdn_conv(enc, "f32", shape, buf(x), buf(np.zeros(4 * C, F32)), buf(np.zeros(3 * C, F32)),
                         buf(np.zeros(3 * C, F32)), rows=0)


def test_checks_catch_planted_errors():
    """The 1e-5 comparisons above are tight enough to see the bugs a prefill kernel is likely to have: the oracle
    fed a plausible mistake (HF state layout, gates one row late, the other key head, the state not carried
    across a split, one token dropped) no longer matches the chunked kernel."""
    shape = ops.GdnShape(nk=2, nv=4, dk=16, dv=16, conv_kernel=4)
    L = Layer(shape, "f32", 77)
    ch = Chunk(L, 20)
    y, S = run_prefill(L, ch, "chunked", 8)
    act, z, b, a = ch.rows(0, 20, L)
    args = (L.A_log, L.dt_bias, L.norm_w, EPS)
    S0 = state_view(L)
    check_close(y, S, *ref_rows(shape, act, z, b, a, *args, S0, False), 1e-5, 1e-5, "unmutated")
    kd = shape.nk * shape.dk
    qk_swapped = f32(act).copy()
    for off in (0, kd):   # q and k of the two key heads swapped: every value head reads the wrong one
        qk_swapped[:, off:off + kd] = np.roll(qk_swapped[:, off:off + kd].reshape(20, 2, 16), 1, axis=1).reshape(20, kd)
    y_split, S_split = run_prefill(L, ch, "chunked", 8, splits=[(0, 10), (10, 20)])
    y_half, S_half = ref_rows(shape, act[10:], z[10:], b[10:], a[10:], *args, S0, False)
    mutants = {
        "HF state layout": ref_rows(shape, act, z, b, a, *args, np.ascontiguousarray(S0.transpose(0, 2, 1)), False),
        "gates one row late": ref_rows(shape, act, z, np.roll(b, 1, 0), np.roll(a, 1, 0), *args, S0, False),
        "wrong key head": ref_rows(shape, qk_swapped, z, b, a, *args, S0, False),
        "a token dropped": ref_rows(shape, np.delete(act, 5, 0), np.delete(z, 5, 0), np.delete(b, 5, 0),
                                    np.delete(a, 5, 0), *args, S0, False),
    }
    for name, (y_m, S_m) in mutants.items():
        if y_m.shape != y.shape:
            y_m = np.concatenate([y_m[:5], y_m[4:5], y_m[5:]])   # align the rows (row 5's output is wrong anyway)
        with pytest.raises(AssertionError, match="rel err"):
            check_close(y, S, y_m, S_m, 1e-5, 1e-5, name)
    with pytest.raises(AssertionError, match="rel err"):   # the second half alone: the carried state matters
        check_close(y_split[10:], S_split, y_half, S_half, 1e-5, 1e-5, "state not carried")

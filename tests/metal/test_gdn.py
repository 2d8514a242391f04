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

from qwenmetal import reference as R

from .gpu_harness import ACT, BF16, SCHEDULES, gpu, ops, rel_err, run

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


def ref_step(shape, act, z, b, a, A_log, dt_bias, norm_w, eps, state, bf16: bool):
    """(y [nv*dv], new state [nv, dv, dk]) from the reference's q/k normalisation, gates, gdn_recurrent and
    gated_rms_norm (bf16: the reference's bfloat16-mode rounding points, as gated_deltanet applies them)."""
    nk, nv, dk, dv = shape.nk, shape.nv, shape.dk, shape.dv
    kd = nk * dk
    act = f32(act)
    q, k = R._normalize_qk(act[:kd].reshape(1, nk, dk), act[kd:2 * kd].reshape(1, nk, dk), bf16)
    v = act[2 * kd:2 * kd + nv * dv].reshape(1, nv, dv)
    beta = R.sigmoid(f32(b))[None]
    if bf16:
        beta = R.to_bf16(beta)
    g_log = (-np.exp(f32(A_log)) * R.softplus(f32(a) + f32(dt_bias)))[None]
    o, new_state = R.gdn_recurrent(q, k, v, beta, g_log, f32(state))
    if bf16:
        o = R.to_bf16(o)
    y = R.gated_rms_norm(o[0], f32(z).reshape(nv, dv), f32(norm_w), eps, bf16=bf16).ravel()
    return y, new_state


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
        e_act = rel_err(f32(act[:s.conv_dim]), act_ref)
        e_y = rel_err(f32(y[:s.value_dim]), y_ref)
        assert e_act < tol_y, f"token {t}: act rel err {e_act:.3g}"
        assert e_y < tol_y, f"token {t}: y rel err {e_y:.3g}"
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
    """bf16 activations, rounded where the reference's bfloat16 mode rounds (1e-2: a bf16 ulp where float
    summation order flips a rounding); the float states stay float-exact (1e-5) because the oracle reads the
    same bf16 values."""
    L = Layer(shape, "bf16", seed)
    check_tokens(L, [L.token() for _ in range(n_tokens)], "random", tol_y=1e-2, tol_state=1e-5)


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
    tol = 1e-5 if dtype == "f32" else 1e-2
    check_tokens(L, [L.token() for _ in range(2)], "random", tol_y=tol, tol_state=1e-5)


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

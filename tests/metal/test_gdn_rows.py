"""A verification's Gated DeltaNet rows in two dispatches (metal/gdn.metal gdn_conv_rows / gdn_step_rows, through
gpu.ops.gdn_conv_rows / gdn_step_rows) against the per-row path (one gdn_conv and one gdn_step per row, each on
the state the row before left), bit for bit: every row's conv output and y, and every row's conv window and
recurrent state in its slot of the ring. The slots outside the rows and the slot read stay untouched. float and
bf16 builds, the simulator's schedules. Simulator-verified, hardware-unverified.
"""
from __future__ import annotations

import numpy as np
import pytest

from .gpu_harness import ACT, SCHEDULES, ops, run
from .test_gdn import EPS, F32, PAD, Layer, f32, padded, untouched_tail


def per_row(L: Layer, proj, rows: int, proj_stride: int, schedule: str):
    """The per-row path (the graph's old one): conv r, step r on the state row r - 1 left, each into buffers of
    its own. Returns (acts [rows, C], ys [rows, V], convs [rows, K-1, C], ssms [rows, nv, dv, dk])."""
    s, T = L.shape, L.T
    C, V, nv, S = s.conv_dim, s.value_dim, s.nv, s.conv_kernel - 1
    nst = s.nv * s.dv * s.dk
    acts = [padded(np.zeros(C), T) for _ in range(rows)]
    ys = [padded(np.zeros(V), T) for _ in range(rows)]
    convs = [padded(np.zeros(S * C), F32) for _ in range(rows)]
    ssms = [padded(np.zeros(nst), F32) for _ in range(rows)]
    cs0 = np.ascontiguousarray(L.conv_state[:S * C])
    st0 = np.ascontiguousarray(L.state[:nst])
    with run(schedule) as (dev, enc, buf):
        cw, A, dtb, nw = buf(L.conv_w), buf(L.A_log), buf(L.dt_bias), buf(L.norm_w)
        cin, sin = buf(cs0), buf(st0)
        for r in range(rows):
            p = proj[r]
            qkv, z = np.ascontiguousarray(p[:C]), np.ascontiguousarray(p[C:C + V])
            b, a = np.ascontiguousarray(p[C + V:C + V + nv]), np.ascontiguousarray(p[C + V + nv:C + V + 2 * nv])
            cout, sout = buf(convs[r]), buf(ssms[r])
            ops.gdn_conv(enc, L.dtype, s, buf(qkv), cw, cin, buf(acts[r]), conv_out=cout)
            ops.gdn_step(enc, L.dtype, s, buf(acts[r]), buf(z), buf(b), buf(a), A, dtb, nw, EPS, sin, buf(ys[r]),
                         state_out=sout)
            cin, sin = cout, sout
    return (np.stack([f32(x[:C]) for x in acts]), np.stack([f32(x[:V]) for x in ys]),
            np.stack([x[:S * C] for x in convs]), np.stack([x[:nst] for x in ssms]))


def two_dispatches(L: Layer, proj, rows: int, proj_stride: int, slots: int, in_slot: int, first: int,
                   schedule: str, y_stride: int = 0):
    """gdn_conv_rows + gdn_step_rows on rings of `slots` states (NaN but slot in_slot, which holds L's state)."""
    s, T = L.shape, L.T
    C, V, S = s.conv_dim, s.value_dim, s.conv_kernel - 1
    nst = s.nv * s.dv * s.dk
    ys_w = y_stride or V
    conv_slab = np.full(slots * S * C + PAD, np.nan, F32)
    ssm_slab = np.full(slots * nst + PAD, np.nan, F32)
    conv_slab[in_slot * S * C:(in_slot + 1) * S * C] = L.conv_state[:S * C]
    ssm_slab[in_slot * nst:(in_slot + 1) * nst] = L.state[:nst]
    act = padded(np.zeros(rows * C), T)
    y = padded(np.full(rows * ys_w, np.nan), T)
    with run(schedule) as (dev, enc, buf):
        pb = buf(proj)
        ops.gdn_conv_rows(enc, L.dtype, s, pb, buf(L.conv_w), buf(conv_slab), slots, in_slot, first, buf(act), rows,
                          qkv_stride=proj_stride)
        ops.gdn_step_rows(enc, L.dtype, s, buf(act), pb, proj_stride, buf(L.A_log), buf(L.dt_bias), buf(L.norm_w),
                          EPS, buf(ssm_slab), slots, in_slot, first, buf(y), rows, y_stride=y_stride)
    assert untouched_tail(act) and untouched_tail(y) and untouched_tail(conv_slab) and untouched_tail(ssm_slab)
    ys = f32(y[:rows * ys_w]).reshape(rows, ys_w)
    assert np.isnan(ys[:, V:]).all(), "y written past value_dim within its stride"
    return (f32(act[:rows * C]).reshape(rows, C), ys[:, :V], conv_slab[:-PAD].reshape(slots, S * C),
            ssm_slab[:-PAD].reshape(slots, nst))


def check(shape, dtype, rows, slots, in_slot, first, schedule, seed=0, y_stride=0):
    L = Layer(shape, dtype, seed)
    s = shape
    C, V, nv = s.conv_dim, s.value_dim, s.nv
    proj_stride = C + V + 2 * nv + 3
    proj = L.rng.normal(size=(rows, proj_stride)).astype(F32)
    proj[:, C + V:C + V + nv] *= 2.0
    proj = proj.astype(L.T)
    acts, ys, convs, ssms = per_row(L, proj, rows, proj_stride, schedule)
    act2, y2, conv_slab, ssm_slab = two_dispatches(L, proj, rows, proj_stride, slots, in_slot, first, schedule,
                                                   y_stride)
    assert np.array_equal(act2, acts), "conv outputs differ from the per-row path"
    assert np.array_equal(y2, ys), "y differs from the per-row path"
    written = set()
    for r in range(rows):
        k = (first + r) % slots
        written.add(k)
        assert np.array_equal(conv_slab[k], convs[r]), f"row {r}: conv window (slot {k}) differs"
        assert np.array_equal(ssm_slab[k], ssms[r]), f"row {r}: recurrent state (slot {k}) differs"
    S = s.conv_kernel - 1
    assert np.array_equal(conv_slab[in_slot], L.conv_state[:S * C]), "the slot read was written"
    assert np.array_equal(ssm_slab[in_slot], L.state[:s.nv * s.dv * s.dk]), "the slot read was written"
    for k in set(range(slots)) - written - {in_slot}:
        assert np.isnan(conv_slab[k]).all() and np.isnan(ssm_slab[k]).all(), f"slot {k} (no row's) written"


SMALL = dict(nk=1, nv=2, dk=16, dv=8, conv_kernel=4)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("rows,slots,in_slot,first", [(1, 2, 0, 1), (1, 2, 1, 0), (2, 3, 0, 1), (5, 17, 3, 4),
                                                      (16, 17, 0, 1), (16, 17, 9, 10), (4, 17, 16, 0)])
def test_rows_equal_the_per_row_path(schedule, dtype, rows, slots, in_slot, first):
    """every row, every slot: bit for bit the per-row path, with the ring wrapping (in 9: rows in 10..16, 0..8)"""
    check(ops.GdnShape(**SMALL), dtype, rows, slots, in_slot, first, schedule, seed=rows + slots)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("kw", [dict(nk=2, nv=4, dk=32, dv=16, conv_kernel=2),     # group 2, K = 2
                                dict(nk=1, nv=1, dk=40, dv=40, conv_kernel=5),     # dk past a lane's 32, dv > 32 sg
                                dict(nk=2, nv=2, dk=128, dv=24, conv_kernel=4)])   # DPL 4, as the real model
def test_shapes(dtype, kw):
    check(ops.GdnShape(**kw), dtype, 6, 8, 5, 6, "random", seed=7)


def test_y_stride():
    """y rows y_stride apart (the verification graph's mix rows are max(value_dim, attention width) wide)"""
    check(ops.GdnShape(**SMALL), "bf16", 3, 5, 1, 2, "forward", y_stride=ops.GdnShape(**SMALL).value_dim + 9)


def test_bytes_declared():
    """the dispatches declare what they read and write: one state read, a state per row written"""
    s = ops.GdnShape(**SMALL)
    C, V, nv, S, rows, slots = s.conv_dim, s.value_dim, s.nv, s.conv_kernel - 1, 3, 5
    nst = s.nv * s.dv * s.dk
    ps = C + V + 2 * nv
    with run("forward") as (dev, enc, buf):
        proj = buf(np.zeros((rows, ps), F32))
        act = buf(np.zeros(rows * C, F32))
        ops.gdn_conv_rows(enc, "f32", s, proj, buf(np.zeros((C, 4), F32)), buf(np.zeros(slots * S * C, F32)), slots,
                          0, 1, act, rows, qkv_stride=ps)
        st0 = dict(bytes_read=enc.bytes_read, bytes_written=enc.bytes_written)
        ops.gdn_step_rows(enc, "f32", s, act, proj, ps, buf(np.zeros(nv, F32)), buf(np.zeros(nv, F32)),
                          buf(np.ones(s.dv, F32)), EPS, buf(np.zeros(slots * nst, F32)), slots, 0, 1,
                          buf(np.zeros(rows * V, F32)), rows)
        st1 = dict(bytes_read=enc.bytes_read, bytes_written=enc.bytes_written, levels=enc.levels)
    assert st0["bytes_read"] == 4 * (rows * C + C * 4 + S * C)
    assert st0["bytes_written"] == 4 * (rows * S * C + rows * C)
    assert st1["bytes_read"] - st0["bytes_read"] == 4 * (rows * C + rows * V + 2 * rows * nv + 2 * nv + s.dv + nst)
    assert st1["bytes_written"] - st0["bytes_written"] == 4 * (rows * nst + rows * V)
    assert st1["levels"] == 2


def test_argument_checks():
    s = ops.GdnShape(**SMALL)
    C, V, nv, S = s.conv_dim, s.value_dim, s.nv, s.conv_kernel - 1
    nst = s.nv * s.dv * s.dk
    ps = C + V + 2 * nv
    with run("forward") as (dev, enc, buf):
        def conv(rows=2, slots=4, in_slot=0, first=1, slab=None, act=None, qkv=None):
            ops.gdn_conv_rows(enc, "f32", s, buf(qkv if qkv is not None else np.zeros((max(rows, 1), ps), F32)),
                              buf(np.zeros((C, 4), F32)),
                              buf(slab if slab is not None else np.zeros(slots * S * C, F32)), slots, in_slot, first,
                              buf(act if act is not None else np.zeros(max(rows, 1) * C, F32)), rows, qkv_stride=ps)

        def step(rows=2, slots=4, in_slot=0, first=1, slab=None, y=None, y_stride=0):
            ops.gdn_step_rows(enc, "f32", s, buf(np.zeros(max(rows, 1) * C, F32)), buf(np.zeros((max(rows, 1), ps), F32)), ps,
                              buf(np.zeros(nv, F32)), buf(np.zeros(nv, F32)), buf(np.ones(s.dv, F32)), EPS,
                              buf(slab if slab is not None else np.zeros(slots * nst, F32)), slots, in_slot, first,
                              buf(y if y is not None else np.zeros(max(rows, 1) * V, F32)), rows, y_stride=y_stride)

        conv()
        step()
        for f, name in [(conv, "gdn_conv_rows"), (step, "gdn_step_rows")]:
            with pytest.raises(ValueError, match=f"{name}: rows must be at least 1"):
                f(rows=0)
            with pytest.raises(ValueError, match="below the ring's slots"):
                f(rows=4, slots=4)
            with pytest.raises(ValueError, match="include the slot they read"):
                f(rows=2, slots=4, in_slot=2, first=1)
            with pytest.raises(ValueError, match="include the slot they read"):
                f(rows=3, slots=4, in_slot=0, first=2)   # 2, 3, 0: wraps onto the slot read
            with pytest.raises(ValueError, match="outside"):
                f(slots=4, in_slot=4)
            with pytest.raises(ValueError, match=f"{name}: slab holds"):
                f(slots=4, slab=np.zeros(3 * (S * C if f is conv else nst), F32))
        with pytest.raises(ValueError, match="gdn_conv_rows: act holds"):
            conv(act=np.zeros(2 * C - 1, F32))
        with pytest.raises(ValueError, match="gdn_step_rows: y holds"):
            step(y=np.zeros(2 * V - 1, F32))
        with pytest.raises(ValueError, match="y_stride"):
            step(y_stride=V - 1)

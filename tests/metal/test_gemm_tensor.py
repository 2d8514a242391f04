"""The M5 GEMM route (metal/gemm_tensor.metal, Metal 4 tensor ops) through gpu.ops.gemm / gemm_grouped_swiglu /
gemm_grouped with route="tensor", on a simulator device that claims tensor ops (gpu.SimDevice(tensor_ops=True)),
against the simdgroup_matrix route and against float64 numpy, under the forward, reverse and random schedules.

Every weight format, float and bfloat activations, float output, each fusion (residual, in place, round,
SwiGLU), strides, the grouped GEMMs over tile maps (empty entries, partial tiles, both tile heights, an entry
past the stack), the route choice and its errors. The tensor route runs on the simulator's emulation of
matmul2d (msl_sim/tensor.h), checked only against our reading of Apple's documentation
(tests/test_sim_tensor.py): simulator-verified, hardware-unverified. Both routes multiply the same float tiles
in float, so they agree to float rounding (products summed in another order), bf16 outputs to one rounding.

A case is what one call needs: its inputs, the call (the same on both routes), the output array, the
expected values with their error bound, and the kernel names the two routes dispatch.
"""
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .gpu_harness import ACT, BF16, SCHEDULES, SIM, gpu, ops, run
from .test_gemm import product_ref, tile_map
from .test_moe import gate_up_ref, rnd, tol
from .wmat import FORMATS, QN_FORMATS, assert_close, cols_for, make, raw, variant

ROUTES = ("simdgroup", "tensor")
HYP = settings(max_examples=10, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True, scope="module")
def _needs_tensor_ops():
    if not SIM:
        with run() as (dev, _, _):
            if not dev.info["tensor_ops"]:
                pytest.skip(f"{dev.info['name']}: no Metal 4 tensor ops (M5 / apple10 only)")


@dataclass
class Case:
    call: Callable          # call(enc, buf, y_buffer, route): encodes the op
    y0: np.ndarray          # the output's initial contents (sentinels, or the residual for in place)
    expect: Callable        # expect(y): asserts y against float64 numpy
    kernel: str | None      # the simdgroup route's kernel; the tensor route's is gemm_tensor_... (None: one qmv
                            # kernel on both routes, the skinny batches)
    out: Callable = field(default=lambda y: y)   # the part of y the routes compare
    agree: float = 0.0      # max |difference| / max |value| between the routes (0: from the output type)


def execute(case, schedule, seed=0):
    """The case on both routes; checks each against numpy, the two against each other and the kernels."""
    ys, kernels = [], []
    for route in ROUTES:
        y = case.y0.copy()
        with run(schedule, seed=seed, keep_records=True, tensor_ops=route == "tensor") as (dev, enc, b):
            buf = raw(b)
            case.call(enc, buf, buf(y), route)
        case.expect(y)
        ys.append(np.asarray(case.out(y), np.float64))
        kernels.append(dev.records()[0]["kernel"] if SIM else None)
    if SIM and case.kernel is None:
        assert kernels[0] == kernels[1] and kernels[0].startswith("qmv_"), kernels
    elif SIM:
        assert kernels == [case.kernel, case.kernel.replace("gemm_", "gemm_tensor_", 1)]
    scale = max(np.abs(ys[0]).max(), 1e-30)
    agree = case.agree or (1e-6 if case.out(case.y0).dtype == np.float32 else 8e-3)
    assert np.abs(ys[0] - ys[1]).max() / scale <= agree, "the routes disagree"


def dense_case(rng, fmt, dtype, M, N, gs=32, groups=2, *, f32_out=False, fusion="none", pads=(0, 0),
               random_words=False):
    """gemm over an [N, K] matrix (K from the format: `groups` quantization groups, or 8 * (4 groups + 1)
    dense), x [M, K + pads[0]] (padding NaN: never read), y [M, N + pads[1]] (padding never written).
    fusion: none | residual | in_place | swiglu (W is [2N, K], y = silu(gate x) * (up x)) | round (float y
    holding T(X W^T), with f32_out)."""
    K = cols_for(fmt, gs, groups) if fmt.startswith("q") else 8 * (4 * groups + 1)
    hm = make(rng, fmt, (2 * N if fusion == "swiglu" else N, K), gs, random_words=random_words)
    x = rng.standard_normal((M, K + pads[0])).astype(ACT[dtype])
    x[:, K:] = np.nan
    out_dt = np.float32 if f32_out else ACT[dtype]
    res = rng.standard_normal((M, N + pads[1])).astype(out_dt)
    y0 = res.copy() if fusion == "in_place" else np.full((M, N + pads[1]), 7, out_dt)
    xs, ys = K + pads[0], N + pads[1]

    def call(enc, buf, yb, route):
        r = {"residual": buf(res), "in_place": yb}.get(fusion)
        ops.gemm(enc, dtype, hm.device(buf, gpu), buf(x), yb, M, f32_out, xs, ys, residual=r,
                 swiglu=fusion == "swiglu", round=fusion == "round", route=route)

    def expect(y):
        if fusion == "swiglu":
            ref, bound = gate_up_ref(hm.ref[:N], hm.ref[N:], x[:, :K].astype(np.float64).T, dtype)
            assert_close(y[:, :N], ref.T, bound.T, tol(dtype))
        else:
            ref, bound = product_ref(hm, x, K)
            if fusion in ("residual", "in_place"):
                assert_close(y[:, :N], rnd(ref, dtype) + res[:, :N].astype(np.float64), bound, tol(dtype))
            elif fusion == "round":   # the float output rounded once to T
                assert (y.astype(BF16).astype(np.float32) == y).all()
                assert_close(y[:, :N], ref, bound, tol(dtype), fmt)
            else:
                assert_close(y[:, :N], ref, bound, "f32" if f32_out else dtype, fmt)
        assert (y[:, N:] == y0[:, N:]).all()

    suffix = "_f32out" if f32_out and dtype == "bf16" else ""
    return Case(call, y0, expect, f"gemm_{variant(fmt)}_{dtype}{suffix}", lambda y: y[:, :N],
                8e-3 if fusion == "round" else 0.0)


@pytest.mark.parametrize("fmt", FORMATS + QN_FORMATS)
@pytest.mark.parametrize("dtype,f32_out", [("f32", False), ("bf16", False), ("bf16", True)])
def test_formats(fmt, dtype, f32_out):
    """Each format (the run-time widths 2, 3, 5, 6 too) x activation x output at M = 37 (a full and a partial row
    block), N = 70 (a partial column tile), 3 quantization groups or a partial K step of dense weights, padded
    strides."""
    rng = np.random.default_rng((FORMATS + QN_FORMATS).index(fmt) * 10 + 2 * (dtype == "bf16") + f32_out)
    execute(dense_case(rng, fmt, dtype, 37, 70, groups=3, f32_out=f32_out, pads=(4, 3)), "forward")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("fusion,fmt,dtype,M,N", [("residual", "q4_sbf16", "f32", 45, 40),
                                                  ("residual", "q8_sf32", "bf16", 33, 64),
                                                  ("in_place", "q4_sf32", "bf16", 40, 70),
                                                  ("round", "q8_sbf16", "bf16", 33, 65),
                                                  ("swiglu", "q4_sbf16", "bf16", 21, 40),
                                                  ("swiglu", "q8_sbf16", "f32", 9, 33),
                                                  ("swiglu", "bf16", "bf16", 40, 7)])
def test_fusions(schedule, fusion, fmt, dtype, M, N):
    """The residual add (also in place), the rounded float output (router logits), SwiGLU over a stacked
    [gate | up] (the tiled kernel at every M)."""
    rng = np.random.default_rng(M * N)
    execute(dense_case(rng, fmt, dtype, M, N, f32_out=fusion == "round", fusion=fusion, pads=(0, 2)), schedule,
            seed=M)


@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(fmt=st.sampled_from(FORMATS), dtype=st.sampled_from(["f32", "bf16"]), f32_out=st.booleans(),
       gs=st.sampled_from([32, 64, 128]), groups=st.integers(1, 3), N=st.integers(1, 80), M=st.integers(17, 80),
       seed=st.integers(0, 2**31 - 1))
def test_random_shapes(schedule, fmt, dtype, f32_out, gs, groups, N, M, seed):
    rng = np.random.default_rng(seed)
    execute(dense_case(rng, fmt, dtype, M, N, gs, groups, f32_out=f32_out and dtype == "bf16"), schedule, seed)


def grouped_case(rng, fmt, dtype, tile_rows, swiglu):
    """A tile map over E experts: one without slots, one with two tiles (a partial last one), empty entries
    between and after; swiglu: gate/up stacks over gathered token rows and an entry past the stack
    (skipped); else a W stack over the slots' rows, one tile dropped (its slot keeps the sentinel)."""
    if swiglu:
        E, K, N, M = 4, cols_for(fmt, 32, 2), 40, 30
        counts = [5, 0, tile_rows + 3, 1]
        tiles, S = tile_map(counts, tile_rows, empty_at=(1, 3), extra_empty=2, bogus_expert=E)
        gate, up = make(rng, fmt, (E, N, K), 32), make(rng, fmt, (E, N, K), 32)
        x = rng.standard_normal((M, K)).astype(ACT[dtype])
        slot_rows = rng.integers(0, M, S).astype(np.uint32)
        dropped = None
    else:
        E, K, N = 3, cols_for(fmt, 64, 2), 70
        counts = [tile_rows + 1, 2, 0]
        tiles, S = tile_map(counts, tile_rows, empty_at=(0,), extra_empty=1)
        tiles = tiles[[i for i in range(len(tiles)) if not (tiles[i, 0] == 0 and tiles[i, 2] == 1)]].copy()
        W = make(rng, fmt, (E, N, K), 64)
        x = rng.standard_normal((S, K)).astype(ACT[dtype])
        dropped = tile_rows
    expert = np.repeat(np.arange(E), counts)
    y0 = np.full((S, N), 7, ACT[dtype] if swiglu else np.float32)

    def call(enc, buf, yb, route):
        tm = gpu.TileMap(buf(tiles), len(tiles), tile_rows)
        if swiglu:
            ops.gemm_grouped_swiglu(enc, dtype, gate.device(buf, gpu), up.device(buf, gpu), buf(x), buf(slot_rows),
                                    tm, S, yb, route=route)
        else:
            ops.gemm_grouped(enc, dtype, W.device(buf, gpu), buf(x), tm, S, yb, route=route)

    def expect(y):
        xf = x.astype(np.float64)
        for s in range(S):
            e = expert[s]
            if swiglu:
                ref, bound = gate_up_ref(gate.ref[e], up.ref[e], xf[slot_rows[s]], dtype)
                assert_close(y[s], ref, bound, tol(dtype), f"slot {s}")
            elif s == dropped:
                assert (y[s] == 7).all()
            else:
                assert_close(y[s], rnd(W.ref[e] @ xf[s], dtype), np.abs(W.ref[e]) @ np.abs(xf[s]), dtype, f"slot {s}")

    suffix = "_f32out" if dtype == "bf16" and not swiglu else ""
    # the bf16 build's float output holds T-rounded values: the routes agree to one bf16 rounding (their
    # float sums differ in order: the simdgroup route adds two K halves), as the dense round case
    return Case(call, y0, expect, f"gemm_{variant(fmt)}_{dtype}{suffix}",
                agree=8e-3 if dtype == "bf16" and not swiglu else 0.0)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("tile_rows", [16, 32])
@pytest.mark.parametrize("swiglu,fmt,dtype", [(True, "q4_sbf16", "bf16"), (True, "q8_sf32", "f32"),
                                              (True, "f16", "f32"), (False, "q4_sf32", "bf16"),
                                              (False, "q8_sbf16", "f32"), (False, "bf16", "bf16"),
                                              (True, "q3_sbf16", "bf16"), (False, "q5_sf32", "f32")])
def test_grouped(schedule, tile_rows, swiglu, fmt, dtype):
    rng = np.random.default_rng(tile_rows + 7 * swiglu)
    execute(grouped_case(rng, fmt, dtype, tile_rows, swiglu), schedule, seed=tile_rows)


def test_model_shape():
    """A 2048 x 2048 4-bit projection (group 64) over a chunk of 64 bf16 rows, float output, on both routes."""
    rng = np.random.default_rng(64)
    case = dense_case(rng, "q4_sbf16", "bf16", 64, 2048, 64, 32, f32_out=True, random_words=True)
    # the routes sum the 2048 products in different orders (the simdgroup route in two K halves per step);
    # each is held to 1e-5 of |x| . |w| against float64 by the case itself, so they agree to about that
    case.agree = 1e-5
    execute(case, "random", 2)


def test_route_choice():
    """gemm_route picks Tensor exactly on tensor-op devices; batches of <= 16 rows stay on qmv on either route."""
    if SIM:
        assert ops.gemm_route(gpu.SimDevice(tensor_ops=True)) == "tensor"
        assert ops.gemm_route(gpu.SimDevice()) == "simdgroup"
    rng = np.random.default_rng(1)
    case = dense_case(rng, "q8_sf32", "f32", 16, 24)
    case.kernel = None   # the skinny kernel on both routes
    execute(case, "reverse")


@pytest.mark.skipif(not SIM, reason="needs a device without tensor ops")
def test_tensor_route_needs_tensor_ops():
    """Tensor on a device without tensor ops: every GEMM refuses it, naming the op and the device."""
    rng = np.random.default_rng(2)
    experts = make(rng, "q4_sf32", (3, 32, 64), 32)
    a = np.ones((24, 64), np.float32)
    with run() as (dev, enc, b):
        buf = raw(b)
        st, ab, out = experts.device(buf, gpu), buf(a), buf(np.zeros((24, 32), np.float32))
        tm = gpu.TileMap(buf(np.zeros((5, 4), np.uint32)), 5, 32)
        with pytest.raises(ValueError, match=r"gemm: route Tensor \(Metal 4 tensor ops\) is not available on this "
                                             r"device \(msl_sim \(forward schedule\)\)"):
            ops.gemm(enc, "f32", make(rng, "f32", (32, 64)).device(buf, gpu), ab, out, 24, route="tensor")
        with pytest.raises(ValueError, match="gemm_grouped: route Tensor .* is not available on this device"):
            ops.gemm_grouped(enc, "f32", st, ab, tm, 24, out, route="tensor")
        with pytest.raises(ValueError, match="gemm_grouped_swiglu: route Tensor .* is not available on this device"):
            ops.gemm_grouped_swiglu(enc, "f32", st, st, ab, buf(np.zeros(24, np.uint32)), tm, 24, out, route="tensor")

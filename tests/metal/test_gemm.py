"""gemm family (metal/gemm.metal through gpu.ops.gemm / gemm_grouped_swiglu / gemm_grouped) against numpy, on the
simulator device under the forward, reverse and random schedules. Simulator-verified, hardware-unverified.

Every weight format (4/8-bit with bf16 or float32 scales, group 32/64/128; dense bf16/f16/f32), float32 and
bfloat16 activations, float output, M past the skinny bound (17..~100) with M, N, K not multiples of the tile
(32 x 64 x 32), the fusions (residual, in place too; round; SwiGLU over a stacked [gate | up]), strides (the
padding is neither read nor written), the skinny forward to qmv, and the grouped GEMMs over hand-built tile maps
(empty entries, partial tiles, both tile heights, entries naming no expert). References are float64 on the values
the kernel sees (weights from the same codes, activations as stored), element-wise within 1e-5 of the sum of
|terms| plus one rounding for bf16 outputs (wmat.assert_close), which is stricter than 1e-5 / 1e-2 relative.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .gpu_harness import ACT, BF16, SCHEDULES, SIM, gpu, ops, rel_err, run
from .test_moe import gate_up_ref, rnd, tol
from .wmat import FORMATS, QN_FORMATS, assert_close, cols_for, make, raw, variant

HYP = settings(max_examples=30, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def kernel_of(dev, i=0):
    return dev.records()[i]["kernel"] if SIM else None


def product_ref(hm, x, K):
    xf = x[:, :K].astype(np.float64)
    return xf @ hm.ref.T, np.abs(xf) @ np.abs(hm.ref).T


# ------------------------------------------------------------------------------------------ dense gemm
@pytest.mark.parametrize("fmt", FORMATS + QN_FORMATS)
@pytest.mark.parametrize("dtype,f32_out", [("f32", False), ("bf16", False), ("bf16", True)])
def test_gemm_formats(fmt, dtype, f32_out):
    """Each format (the run-time widths 2, 3, 5, 6 too) x activation type x output type at one edge shape:
    M = 37 (a full and a partial row block), N = 70 (a partial column tile), K with a partial K step for dense
    weights."""
    rng = np.random.default_rng(abs(hash((fmt, dtype, f32_out))) % 2**31)
    M, N = 37, 70
    K = cols_for(fmt, 32, 3) if fmt.startswith("q") else 8 * 13   # 96 / 104: 104 = 3 K steps + 8
    hm = make(rng, fmt, (N, K), 32)
    x = rng.standard_normal((M, K)).astype(ACT[dtype])
    y = np.full((M, N), 7, np.float32 if f32_out else ACT[dtype])
    with run("forward", keep_records=True) as (dev, enc, b):
        buf = raw(b)
        ops.gemm(enc, dtype, hm.device(buf, gpu), buf(x), buf(y), M, f32_out)
    ref, bound = product_ref(hm, x, K)
    assert_close(y, ref, bound, "f32" if f32_out else dtype, fmt)
    assert rel_err(y, ref) <= (1e-5 if dtype == "f32" or f32_out else 1e-2)
    suffix = "_f32out" if f32_out and dtype == "bf16" else ""
    assert not SIM or kernel_of(dev) == f"gemm_{variant(fmt)}_{dtype}{suffix}"


@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(fmt=st.sampled_from(FORMATS), dtype=st.sampled_from(["f32", "bf16"]), f32_out=st.booleans(),
       gs=st.sampled_from([32, 64, 128]), n=st.integers(1, 3), N=st.integers(1, 80), M=st.integers(17, 100),
       xpad=st.sampled_from([0, 4]), ypad=st.sampled_from([0, 3]), seed=st.integers(0, 2**31 - 1))
def test_gemm(schedule, fmt, dtype, f32_out, gs, n, N, M, xpad, ypad, seed):
    rng = np.random.default_rng(seed)
    K = cols_for(fmt, gs, n)
    hm = make(rng, fmt, (N, K), gs)
    xs, ys = K + xpad, N + ypad
    x = rng.standard_normal((M, xs)).astype(ACT[dtype])
    x[:, K:] = np.nan                    # the stride padding is never read
    y = np.full((M, ys), 7, np.float32 if f32_out else ACT[dtype])
    with run(schedule, seed=seed) as (dev, enc, b):
        buf = raw(b)
        ops.gemm(enc, dtype, hm.device(buf, gpu), buf(x), buf(y), M, f32_out, xs, ys)
    ref, bound = product_ref(hm, x, K)
    assert_close(y[:, :N], ref, bound, "f32" if f32_out else dtype)
    assert (y[:, N:].astype(np.float32) == 7).all()   # ... nor written


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("in_place", [False, True])
def test_gemm_residual(schedule, dtype, in_place):
    """y = residual + T(X W^T), the out-projection's residual add (in place: residual is y)."""
    rng = np.random.default_rng(5)
    M, N, K = 45, 40, 128
    hm = make(rng, "q4_sbf16", (N, K), 64)
    x = rng.standard_normal((M, K)).astype(ACT[dtype])
    res = rng.standard_normal((M, N)).astype(ACT[dtype])
    y = res.copy() if in_place else np.zeros((M, N), ACT[dtype])
    with run(schedule) as (dev, enc, b):
        buf = raw(b)
        yb = buf(y)
        ops.gemm(enc, dtype, hm.device(buf, gpu), buf(x), yb, M, residual=yb if in_place else buf(res))
    ref, bound = product_ref(hm, x, K)
    want = rnd(ref, dtype) + res.astype(np.float64)
    assert_close(y, want, bound, tol(dtype))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gemm_round(schedule):
    """f32 output holding T(X W^T) (the router logits of the bf16 build): the float output rounded once."""
    rng = np.random.default_rng(6)
    M, N, K = 33, 65, 256
    hm = make(rng, "q8_sbf16", (N, K), 64)
    x = rng.standard_normal((M, K)).astype(BF16)
    yf = np.zeros((M, N), np.float32)
    yr = np.zeros((M, N), np.float32)
    with run(schedule) as (dev, enc, b):
        buf = raw(b)
        W, xb = hm.device(buf, gpu), buf(x)
        ops.gemm(enc, "bf16", W, xb, buf(yf), M, True)
        ops.gemm(enc, "bf16", W, xb, buf(yr), M, True, round=True)
    np.testing.assert_array_equal(yr, yf.astype(BF16).astype(np.float32))
    ref, bound = product_ref(hm, x, K)
    assert_close(yf, ref, bound, "f32")


@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(fmt=st.sampled_from(FORMATS), dtype=st.sampled_from(["f32", "bf16"]), gs=st.sampled_from([32, 64]),
       n=st.integers(1, 3), inter=st.integers(1, 70), M=st.integers(1, 70), seed=st.integers(0, 2**31 - 1))
def test_gemm_swiglu(schedule, fmt, dtype, gs, n, inter, M, seed):
    """The shared expert's gate/up: W a stacked [gate | up] (2 inter rows), y = silu(gate x) * (up x) with the
    bf16 graph's roundings; the tiled kernel at every M (also M <= 16, where plain products go to qmv)."""
    rng = np.random.default_rng(seed)
    K = cols_for(fmt, gs, n)
    gu = make(rng, fmt, (2 * inter, K), gs)
    x = rng.standard_normal((M, K)).astype(ACT[dtype])
    y = np.full((M, inter + 2), 7, ACT[dtype])
    with run(schedule, seed=seed, keep_records=True) as (dev, enc, b):
        buf = raw(b)
        ops.gemm(enc, dtype, gu.device(buf, gpu), buf(x), buf(y), M, y_stride=inter + 2, swiglu=True)
    ref, bound = gate_up_ref(gu.ref[:inter], gu.ref[inter:], x.astype(np.float64).T, dtype)
    assert_close(y[:, :inter], ref.T, bound.T, tol(dtype))
    assert (y[:, inter:].astype(np.float32) == 7).all()
    assert not SIM or kernel_of(dev) == f"gemm_{fmt}_{dtype}"
    bm = 16 if M <= 16 else 32
    assert not SIM or dev.records()[0]["threadgroups"] == (-(-inter // 32), -(-M // bm), 1)


@pytest.mark.parametrize("M", [1, 16, 17])
def test_gemm_skinny_forwards_to_qmv(M):
    """M <= 16 runs qmv with batch M (the skinny route), with the same fusions; 17 the tiled kernel."""
    rng = np.random.default_rng(M)
    N, K = 24, 128
    hm = make(rng, "q4_sf32", (N, K), 32)
    x = rng.standard_normal((M, K)).astype(BF16)
    res = rng.standard_normal((M, N)).astype(BF16)
    y = np.zeros((M, N), BF16)
    with run("reverse", keep_records=True) as (dev, enc, b):
        buf = raw(b)
        ops.gemm(enc, "bf16", hm.device(buf, gpu), buf(x), buf(y), M, residual=buf(res))
    ref, bound = product_ref(hm, x, K)
    assert_close(y, rnd(ref, "bf16") + res.astype(np.float64), bound, tol("bf16"))
    qmv = "qmv_q4_sf32_bf16" if M == 1 else "qmv_b16_q4_sf32_bf16"     # decode kernel / skinny b16
    assert not SIM or kernel_of(dev) == (qmv if M <= 16 else "gemm_q4_sf32_bf16")


def test_gemm_declared_bytes_and_flops():
    """Weights once per dispatch (the ideal: codes + scales + biases), x read once, y written once;
    flops 2 M N K, and 2 M (2N) K for SwiGLU."""
    rng = np.random.default_rng(1)
    M, N, K = 40, 24, 256
    hm = make(rng, "q4_sbf16", (N, K), 64)
    x = rng.standard_normal((M, K)).astype(np.float32)
    y = np.zeros((M, N), np.float32)
    with run() as (dev, enc, b):
        buf = raw(b)
        ops.gemm(enc, "f32", hm.device(buf, gpu), buf(x), buf(y), M)
    assert enc.bytes_read == N * (K // 2 + 2 * (K // 64) * 2) + M * K * 4
    assert enc.bytes_written == M * N * 4
    assert enc.flops == 2 * M * N * K
    ys = np.zeros((M, N // 2), np.float32)
    with run() as (dev, enc, b):
        buf = raw(b)
        ops.gemm(enc, "f32", hm.device(buf, gpu), buf(x), buf(ys), M, swiglu=True)
    assert enc.flops == 2 * M * N * K and enc.bytes_written == M * (N // 2) * 4


def test_gemm_model_shape():
    """A 2048 x 2048 4-bit projection over a chunk of 64 bf16 rows (2 row blocks x 32 column tiles x 64 K steps)."""
    rng = np.random.default_rng(64)
    M, N, K = 64, 2048, 2048
    hm = make(rng, "q4_sbf16", (N, K), 64, random_words=True)
    x = rng.standard_normal((M, K)).astype(BF16)
    y = np.zeros((M, N), np.float32)
    with run("random", seed=2) as (dev, enc, b):
        buf = raw(b)
        ops.gemm(enc, "bf16", hm.device(buf, gpu), buf(x), buf(y), M, True)
    ref = x.astype(np.float64) @ hm.ref.T
    assert rel_err(y, ref) <= 1e-5


# ------------------------------------------------------------------------------------------ grouped
def tile_map(counts, tile_rows, empty_at=(), extra_empty=0, bogus_expert=None):
    """The tile map moe_sort builds for slots sorted by expert (`counts[e]` slots of expert e, consecutive):
    each expert's slots cut into tiles of at most tile_rows, plus empty entries (n_rows 0) inserted at the
    positions `empty_at` and `extra_empty` at the end (the capacity's slack). bogus_expert: one more entry
    naming that expert (past the stack: must be skipped)."""
    entries, first = [], 0
    for e, c in enumerate(counts):
        for t0 in range(0, c, tile_rows):
            entries.append((e, first + t0, min(tile_rows, c - t0), 0))
        first += c
    for i in sorted(empty_at):
        entries.insert(min(i, len(entries)), (0, 0, 0, 0))
    entries += [(0, 0, 0, 0)] * extra_empty
    if bogus_expert is not None:
        entries.append((bogus_expert, 0, tile_rows, 0))
    return np.array(entries, np.uint32).reshape(-1, 4), first


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("tile_rows", [16, 32])
@pytest.mark.parametrize("fmt,dtype", [("q4_sbf16", "bf16"), ("q8_sf32", "f32"), ("bf16", "bf16"), ("f32", "f32"),
                                       ("q2_sbf16", "bf16"), ("q6_sf32", "f32")])
def test_gemm_grouped_swiglu(schedule, tile_rows, fmt, dtype):
    """act[s] = silu(gate_e x[slot_rows[s]]) * (up_e x[slot_rows[s]]) over a tile map: an expert with no slots,
    one with several tiles (a partial last one), empty entries between and after, an entry past the stack."""
    rng = np.random.default_rng(tile_rows)
    E, H, I, M = 4, cols_for(fmt, 32, 2), 40, 30
    counts = [5, 0, 2 * tile_rows + 3, 1]
    tiles, S = tile_map(counts, tile_rows, empty_at=(1, 3), extra_empty=2, bogus_expert=E)
    gate, up = make(rng, fmt, (E, I, H), 32), make(rng, fmt, (E, I, H), 32)
    x = rng.standard_normal((M, H)).astype(ACT[dtype])
    slot_rows = rng.integers(0, M, S).astype(np.uint32)
    act = np.full((S, I), 7, ACT[dtype])
    with run(schedule, keep_records=True) as (dev, enc, b):
        buf = raw(b)
        tm = gpu.TileMap(buf(tiles), len(tiles), tile_rows)
        ops.gemm_grouped_swiglu(enc, dtype, gate.device(buf, gpu), up.device(buf, gpu), buf(x), buf(slot_rows),
                                tm, S, buf(act))
    expert = np.repeat(np.arange(E), counts)
    xf = x.astype(np.float64)
    for s in range(S):
        e = expert[s]
        ref, bound = gate_up_ref(gate.ref[e], up.ref[e], xf[slot_rows[s]], dtype)
        assert_close(act[s], ref, bound, tol(dtype), f"slot {s} (expert {e})")
    assert not SIM or kernel_of(dev) == f"gemm_{variant(fmt)}_{dtype}"
    assert not SIM or dev.records()[0]["threadgroups"] == (2, len(tiles), 1)   # ceil(40 / 32) column tiles


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("tile_rows", [16, 32])
@pytest.mark.parametrize("fmt,dtype", [("q4_sf32", "bf16"), ("q8_sbf16", "f32"), ("f16", "bf16"), ("q3_sf32", "bf16"),
                                       ("q5_sbf16", "f32")])
def test_gemm_grouped(schedule, tile_rows, fmt, dtype):
    """y[s] = T(W_e act[s]) in float over a tile map; slots no entry covers are not written."""
    rng = np.random.default_rng(100 + tile_rows)
    E, K, N = 3, cols_for(fmt, 64, 2), 70
    counts = [tile_rows + 1, 2, 0]
    tiles, S = tile_map(counts, tile_rows, empty_at=(0,), extra_empty=1)
    drop = 1                               # the last tile of expert 0 is dropped: its slot keeps the sentinel
    keep = [i for i in range(len(tiles)) if not (tiles[i, 0] == 0 and tiles[i, 2] == 1)]
    assert len(keep) == len(tiles) - drop
    tiles = tiles[keep].copy()
    W = make(rng, fmt, (E, N, K), 64)
    a = rng.standard_normal((S, K)).astype(ACT[dtype])
    y = np.full((S, N), 7, np.float32)
    with run(schedule, keep_records=True) as (dev, enc, b):
        buf = raw(b)
        ops.gemm_grouped(enc, dtype, W.device(buf, gpu), buf(a), gpu.TileMap(buf(tiles), len(tiles), tile_rows), S,
                         buf(y))
    expert = np.repeat(np.arange(E), counts)
    af = a.astype(np.float64)
    for s in range(S):
        if s == tile_rows:                 # the dropped tile's slot
            assert (y[s] == 7).all()
            continue
        Wr = W.ref[expert[s]]
        assert_close(y[s], rnd(Wr @ af[s], dtype), np.abs(Wr) @ np.abs(af[s]), tol(dtype), f"slot {s}")
    if dtype == "bf16":   # the float output holds bf16 values (the bf16 graph's rounded expert outputs)
        np.testing.assert_array_equal(y, y.astype(BF16).astype(np.float32))
    suffix = "_f32out" if dtype == "bf16" else ""
    assert not SIM or kernel_of(dev) == f"gemm_{variant(fmt)}_{dtype}{suffix}"


@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(fmt=st.sampled_from(FORMATS), dtype=st.sampled_from(["f32", "bf16"]), tile_rows=st.sampled_from([16, 32]),
       counts=st.lists(st.integers(0, 40), min_size=1, max_size=5), n_empty=st.integers(0, 3),
       I=st.integers(1, 40), ng=st.integers(1, 2), seed=st.integers(0, 2**31 - 1))
def test_gemm_grouped_random(schedule, fmt, dtype, tile_rows, counts, n_empty, I, ng, seed):
    """Both grouped GEMMs chained as the MoE block runs them (gate/up + SwiGLU, then down) over random
    expert counts (zeros included) and a tile map with empty entries shuffled in."""
    if sum(counts) == 0:
        counts = counts + [1]
    rng = np.random.default_rng(seed)
    E, H, M = len(counts), cols_for(fmt, 32, ng), 23
    tiles, S = tile_map(counts, tile_rows, extra_empty=n_empty)
    tiles = tiles[rng.permutation(len(tiles))].copy()      # entry order is free
    gate, up = make(rng, fmt, (E, I, H), 32), make(rng, fmt, (E, I, H), 32)
    Ip = I if not fmt.startswith("q") else -(-I // 32) * 32   # the down projection's K: a valid column count
    Ip = -(-Ip // 8) * 8
    down = make(rng, fmt, (E, 24, Ip), 32)
    x = rng.standard_normal((M, H)).astype(ACT[dtype])
    slot_rows = rng.integers(0, M, S).astype(np.uint32)
    # the down GEMM's inputs: the SwiGLU output in columns [0, I), random ones after it (Ip is a valid K; not
    # zeros: a lone tiny input would make |W| @ |a| a bound below the float dequantization's own rounding)
    act = rng.standard_normal((S, Ip)).astype(ACT[dtype])
    act_v = np.full((S, I), 7, ACT[dtype])
    y = np.full((S, 24), 7, np.float32)
    with run(schedule, seed=seed) as (dev, enc, b):
        buf = raw(b)
        tm = gpu.TileMap(buf(tiles), len(tiles), tile_rows)
        ops.gemm_grouped_swiglu(enc, dtype, gate.device(buf, gpu), up.device(buf, gpu), buf(x), buf(slot_rows),
                                tm, S, buf(act_v))
    act[:, :I] = act_v
    with run(schedule, seed=seed) as (dev, enc, b):
        buf = raw(b)
        ops.gemm_grouped(enc, dtype, down.device(buf, gpu), buf(act), gpu.TileMap(buf(tiles), len(tiles), tile_rows),
                         S, buf(y))
    expert = np.repeat(np.arange(E), counts)
    xf, af = x.astype(np.float64), act.astype(np.float64)
    for s in range(S):
        e = expert[s]
        ref, bound = gate_up_ref(gate.ref[e], up.ref[e], xf[slot_rows[s]], dtype)
        assert_close(act_v[s], ref, bound, tol(dtype), f"act slot {s}")
        Wd = down.ref[e]
        assert_close(y[s], rnd(Wd @ af[s], dtype), np.abs(Wd) @ np.abs(af[s]), tol(dtype), f"y slot {s}")


def test_gemm_grouped_declared():
    """At most min(E, S) experts are touched: with S = 3 slots over 8 experts, three matrices are declared."""
    rng = np.random.default_rng(8)
    E, K, N = 8, 64, 16
    W = make(rng, "q4_sbf16", (E, N, K), 64)
    tiles, S = tile_map([1, 0, 0, 2, 0, 0, 0, 0], 16)
    a = rng.standard_normal((S, K)).astype(np.float32)
    y = np.zeros((S, N), np.float32)
    with run() as (dev, enc, b):
        buf = raw(b)
        ops.gemm_grouped(enc, "f32", W.device(buf, gpu), buf(a), gpu.TileMap(buf(tiles), len(tiles)), S, buf(y))
    row = K // 2 + 2 * (K // 64) * 2
    assert enc.bytes_read == 3 * N * row + S * K * 4 + len(tiles) * 16
    assert enc.flops == 2 * S * N * K
    assert rel_err(y[0], W.ref[0] @ a[0]) <= 1e-5


@pytest.mark.skipif(not SIM, reason="bank counting is the simulator's")
@pytest.mark.parametrize("fmt,dtype", [("q4_sbf16", "bf16"), ("q8_sf32", "f32"), ("bf16", "bf16"), ("q3_sf32", "bf16")])
def test_gemm_no_bank_conflicts(fmt, dtype):
    """The staging stores whole vectors in a lane order that spreads every SIMD-group access over the banks
    (metal/gemm_tile.h; docs/metal.md, gemm section): no threadgroup access of the GEMM replays, over a full
    32-row tile and a partial one (one store per 4 values with each unit size: 16, 8, 8 and 32 values)."""
    rng = np.random.default_rng(3)
    M, N = 48, 70
    K = cols_for(fmt, 32, 2) if fmt.startswith("q") else 64
    hm = make(rng, fmt, (N, K), 32)
    x = rng.standard_normal((M, K)).astype(ACT[dtype])
    y = np.zeros((M, N), ACT[dtype])
    dev = gpu.SimDevice(count_banks=True)
    cb = dev.command_buffer()
    enc = gpu.Encoder(dev, cb)
    buf = raw(lambda a, label="": dev.wrap(a.view(np.uint16) if a.dtype == BF16 else a, label))
    ops.gemm(enc, dtype, hm.device(buf, gpu), buf(x), buf(y), M, False)
    cb.commit()
    cb.wait()
    (b,) = [v["banks"] for k, v in dev.kernel_stats().items() if k.startswith("gemm_")]
    assert b["accesses"] > 0 and b["dropped"] == 0
    assert (b["conflicted"], b["replays"]) == (0, 0)
    ref, bound = product_ref(hm, x, K)
    assert_close(y, ref, bound, dtype, fmt)


# ------------------------------------------------------------------------------------------ errors
def test_gemm_argument_checks():
    rng = np.random.default_rng(0)
    hm = make(rng, "q4_sbf16", (16, 64), 64)
    stack = make(rng, "q4_sbf16", (2, 16, 64), 64)
    x = np.zeros((40, 64), np.float32)
    y = np.zeros((40, 16), np.float32)
    tiles = np.zeros((4, 4), np.uint32)
    with run() as (dev, enc, b):
        buf = raw(b)
        W, S = hm.device(buf, gpu), stack.device(buf, gpu)
        xb, yb = buf(x), buf(y)
        with pytest.raises(ValueError, match="gemm: M must be positive"):
            ops.gemm(enc, "f32", W, xb, yb, 0)
        with pytest.raises(ValueError, match="gemm: W must be one matrix"):
            ops.gemm(enc, "f32", S, xb, yb, 20)
        with pytest.raises(ValueError, match="gemm: y holds"):
            ops.gemm(enc, "f32", W, xb, buf(np.zeros((20, 16), np.float32)), 40)
        with pytest.raises(ValueError, match="gemm: x_stride 60 < cols 64"):
            ops.gemm(enc, "f32", W, xb, yb, 20, x_stride=60)
        with pytest.raises(ValueError, match="gemm: x_stride must be a multiple of 4"):
            ops.gemm(enc, "f32", W, buf(np.zeros((40, 66), np.float32)), yb, 20, x_stride=66)
        with pytest.raises(ValueError, match="gemm: swiglu takes no residual"):
            ops.gemm(enc, "f32", W, xb, yb, 20, swiglu=True, residual=yb)
        with pytest.raises(ValueError, match="gemm: round needs f32_out"):
            ops.gemm(enc, "bf16", W, buf(x.astype(BF16)), yb, 20, round=True)
        with pytest.raises(ValueError, match="gemm: route Tensor .* is not available"):
            ops.gemm(enc, "f32", W, xb, yb, 20, route="tensor")
        with pytest.raises(ValueError, match="gemm route must be 'simdgroup' or 'tensor'"):
            ops.gemm(enc, "f32", W, xb, yb, 20, route="mps")
        tm = gpu.TileMap(buf(tiles), 4, 16)
        with pytest.raises(ValueError, match="gemm_grouped: tile_rows must be 16 or 32, got 8"):
            ops.gemm_grouped(enc, "f32", S, xb, gpu.TileMap(buf(tiles), 4, 8), 8, yb)
        with pytest.raises(ValueError, match="gemm_grouped: tm.tiles holds 64 bytes, needs 80"):
            ops.gemm_grouped(enc, "f32", S, xb, gpu.TileMap(buf(tiles), 5, 16), 8, yb)
        with pytest.raises(ValueError, match="gemm_grouped: S .* must be positive"):
            ops.gemm_grouped(enc, "f32", S, xb, tm, 0, yb)
        with pytest.raises(ValueError, match="gemm_grouped: route Tensor"):
            ops.gemm_grouped(enc, "f32", S, xb, tm, 8, yb, route="tensor")
        other = make(rng, "q4_sbf16", (2, 8, 64), 64).device(buf, gpu)
        with pytest.raises(ValueError, match="gemm_grouped_swiglu: gate and up must be stacks of the same shape"):
            ops.gemm_grouped_swiglu(enc, "f32", S, other, xb, buf(np.zeros(8, np.uint32)), tm, 8, yb)
        with pytest.raises(ValueError, match="gemm_grouped_swiglu: slot_rows holds 16 bytes, needs 32"):
            ops.gemm_grouped_swiglu(enc, "f32", S, S, xb, buf(np.zeros(4, np.uint32)), tm, 8, yb)
        with pytest.raises(ValueError, match="gemm_grouped_swiglu: act holds"):
            ops.gemm_grouped_swiglu(enc, "f32", S, S, xb, buf(np.zeros(80, np.uint32)), tm, 80, yb)

"""moe family (metal/moe.metal through gpu.ops.moe_topk / moe_gate_up / moe_down / mlp_gate_up) against numpy,
on the simulator device under the forward, reverse and random schedules. Simulator-verified,
hardware-unverified.

Router math as python/qwenmetal/reference.py sparse_moe: float32 softmax over all experts, top-k on the
probabilities (ties to the lower expert index), renormalised when asked. The projections are checked against
float64 on exactly the weights (codes and scales) and activations the kernels see, element-wise: within 1e-5
of the magnitude the float accumulation works at (the sum of |terms|: a cancelling dot product is judged by
its terms), plus one rounding of the result for bfloat16 outputs (wmat.assert_close); in bfloat16 the oracles round
where the reference's bfloat16 mode rounds (gate/up, SwiGLU, expert outputs, weighted sums), within 4 ulps.
"""
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwenmetal.backends import reference

from .gpu_harness import ACT, BF16, SCHEDULES, SIM, assert_bf16, gpu, ops, rel_err, run
from .wmat import FORMATS, QN_FORMATS, assert_close, cols_for, fmt_bits, make, raw, variant

HYP = settings(max_examples=60, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def topk_ref(logits, k, norm):
    probs = reference.softmax(logits.astype(np.float32)[None])[0]
    idx = np.argsort(-probs, kind="stable")[:k]
    w = probs[idx]
    if norm:
        w = w / np.sum(w)
    return idx.astype(np.uint32), w.astype(np.float32)


def silu(g):
    return g / (1.0 + np.exp(-g))


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-np.float64(v)))


# ------------------------------------------------------------------------------------------ moe_topk
@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(n=st.integers(1, 300), k=st.integers(1, 32), norm=st.booleans(), ties=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_moe_topk(schedule, n, k, norm, ties, seed):
    rng = np.random.default_rng(seed)
    k = min(k, n)
    if ties:  # few distinct values: many exactly equal probabilities, ranked by expert index
        logits = (rng.integers(0, 4, n + 1) * 0.5).astype(np.float32)
    else:
        logits = (rng.standard_normal(n + 1) * 3).astype(np.float32)
    ids = np.full(k, 0xDEAD, np.uint32)
    w = np.full(k, -1, np.float32)
    with run(schedule, seed=seed) as (dev, enc, b):
        buf = raw(b)
        ops.moe_topk(enc, buf(logits), n, k, norm, buf(ids), buf(w))  # logits[n]: the shared gate, not read
    ref_ids, ref_w = topk_ref(logits[:n], k, norm)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(w, ref_w, rtol=1e-6, atol=1e-7)


def test_moe_topk_ties_go_to_the_lower_index():
    logits = np.zeros(256, np.float32)
    logits[[7, 3, 200, 100]] = 1.0  # four equal maxima, then 252 equal others
    ids, w = np.zeros(8, np.uint32), np.zeros(8, np.float32)
    with run("reverse") as (dev, enc, b):
        buf = raw(b)
        ops.moe_topk(enc, buf(logits), 256, 8, False, buf(ids), buf(w))
    assert ids.tolist() == [3, 7, 100, 200, 0, 1, 2, 4]
    assert w[0] == w[3] and w[4] == w[7] and w[0] > w[4]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_moe_topk_model_shape(schedule):
    """256 experts, top 8, renormalised (the real router)."""
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal(257) * 2).astype(np.float32)
    ids, w = np.zeros(8, np.uint32), np.zeros(8, np.float32)
    with run(schedule, seed=4) as (dev, enc, b):
        buf = raw(b)
        ops.moe_topk(enc, buf(logits), 256, 8, True, buf(ids), buf(w))
    ref_ids, ref_w = topk_ref(logits[:256], 8, True)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(w, ref_w, rtol=1e-6)
    assert abs(float(w.astype(np.float64).sum()) - 1) < 1e-6


# ------------------------------------------------------------------------------------------ gate/up
def rnd(v, dtype):
    """v rounded where the bfloat build rounds (the reference's bfloat16 mode); unchanged for float."""
    return reference.to_bf16(v).astype(np.float64) if dtype == "bf16" else v


def gate_up_ref(Wg, Wu, x, dtype="f32"):
    """silu(g) * u -- in bf16 with the bf16 graph's roundings: g and u rounded, silu = T(g T(sigmoid(g))) --
    and the magnitude its float accumulation works at (d act / dg <= 1.1)"""
    g, u = Wg @ x, Wu @ x
    G, U = np.abs(Wg) @ np.abs(x), np.abs(Wu) @ np.abs(x)
    if dtype == "bf16":
        g, u = rnd(g, dtype), rnd(u, dtype)
        val = rnd(g * rnd(sigmoid(g), dtype), dtype) * u
    else:
        val = silu(g) * u
    return val, np.abs(silu(g)) * U + 1.1 * np.abs(u) * G


def down_ref(Wd, acts, w, dtype, shared=None):
    """x's increment sum_s T(w_s T(Wd_s a_s)) rounded, + T(T(sigmoid) T(Wsh a_sh)) rounded (bf16 roundings;
    plain sums for float), and its accumulation bound. Wd, acts, w: per slot; shared: (W, a, logit)."""
    y = sum(rnd(float(ws) * rnd(W @ a, dtype), dtype) for W, a, ws in zip(Wd, acts, w))
    bound = sum(float(ws) * (np.abs(W) @ np.abs(a)) for W, a, ws in zip(Wd, acts, w))
    y = rnd(y, dtype)
    if shared is not None:
        W, a, logit = shared
        g = rnd(sigmoid(logit), dtype)
        y = rnd(y + rnd(g * rnd(W @ a, dtype), dtype), dtype)
        bound = bound + g * (np.abs(W) @ np.abs(a))
    return y, bound


# a chain of bf16 roundings: a float-order difference at one of them moves the result by an ulp or two
def tol(dtype):
    return "bf16x4" if dtype == "bf16" else dtype


@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(fmt=st.sampled_from(FORMATS), dtype=st.sampled_from(["f32", "bf16"]), gs=st.sampled_from([32, 64]),
       ng=st.integers(1, 4), E=st.integers(1, 6), k=st.integers(1, 4), inter=st.integers(1, 24),
       shared=st.integers(0, 24), shared_gs=st.sampled_from([32, 64, 128]), seed=st.integers(0, 2**31 - 1))
def test_moe_gate_up(schedule, fmt, dtype, gs, ng, E, k, inter, shared, shared_gs, seed):
    rng = np.random.default_rng(seed)
    k = min(k, E)
    H = cols_for(fmt, gs, ng)
    if fmt.startswith("q") and H % shared_gs:
        shared_gs = gs
    gate = make(rng, fmt, (E, inter, H), gs)
    up = make(rng, fmt, (E, inter, H), gs)
    sh = make(rng, fmt, (2 * shared, H), shared_gs) if shared else None
    ids = rng.choice(E, k, replace=False).astype(np.uint32)
    x = rng.standard_normal(H).astype(ACT[dtype])
    stride = max(inter, shared)
    slots = k + (1 if shared else 0)
    act = np.full((slots, stride), 7, ACT[dtype])
    with run(schedule, seed=seed, keep_records=True) as (dev, enc, b):
        buf = raw(b)
        ops.moe_gate_up(enc, dtype, gate.device(buf, gpu), up.device(buf, gpu), sh.device(buf, gpu) if sh else None,
                        buf(x), buf(ids), k, buf(act))
    xf = x.astype(np.float64)
    for s in range(k):
        ref, bound = gate_up_ref(gate.ref[ids[s]], up.ref[ids[s]], xf, dtype)
        assert_close(act[s, :inter], ref, bound, tol(dtype), f"slot {s}")
        assert (act[s, inter:].astype(np.float32) == 7).all()
    if shared:
        ref, bound = gate_up_ref(sh.ref[:shared], sh.ref[shared:], xf, dtype)
        assert_close(act[k, :shared], ref, bound, tol(dtype), "shared")
        assert (act[k, shared:].astype(np.float32) == 7).all()
    assert not SIM or dev.records()[0]["kernel"] == f"moe_gate_up_{fmt}_{dtype}"


@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(fmt=st.sampled_from(FORMATS), dtype=st.sampled_from(["f32", "bf16"]), gs=st.sampled_from([32, 64]),
       ng=st.integers(1, 4), inter=st.integers(1, 24), seed=st.integers(0, 2**31 - 1))
def test_mlp_gate_up(schedule, fmt, dtype, gs, ng, inter, seed):
    rng = np.random.default_rng(seed)
    K = cols_for(fmt, gs, ng)
    gu = make(rng, fmt, (2 * inter, K), gs)
    x = rng.standard_normal(K).astype(ACT[dtype])
    act = np.full(inter + 3, 7, ACT[dtype])
    with run(schedule, seed=seed) as (dev, enc, b):
        buf = raw(b)
        ops.mlp_gate_up(enc, dtype, gu.device(buf, gpu), buf(x), buf(act))
    ref, bound = gate_up_ref(gu.ref[:inter], gu.ref[inter:], x.astype(np.float64), dtype)
    assert_close(act[:inter], ref, bound, tol(dtype))
    assert (act[inter:].astype(np.float32) == 7).all()


# ------------------------------------------------------------------------------------------ down
@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(fmt=st.sampled_from(FORMATS), dtype=st.sampled_from(["f32", "bf16"]), gs=st.sampled_from([32, 64]),
       ng=st.integers(1, 3), sng=st.integers(0, 3), E=st.integers(1, 6), k=st.integers(1, 4),
       H=st.integers(1, 40), n_experts=st.integers(1, 10), seed=st.integers(0, 2**31 - 1))
def test_moe_down(schedule, fmt, dtype, gs, ng, sng, E, k, H, n_experts, seed):
    rng = np.random.default_rng(seed)
    k = min(k, E)
    inter = cols_for(fmt, gs, ng)
    shared = cols_for(fmt, gs, sng)
    down = make(rng, fmt, (E, H, inter), gs)
    sh = make(rng, fmt, (H, shared), gs) if shared else None
    stride = max(inter, shared)
    slots = k + (1 if shared else 0)
    act = rng.standard_normal((slots, stride)).astype(ACT[dtype])
    ids = rng.choice(E, k, replace=False).astype(np.uint32)
    w = rng.dirichlet(np.ones(k)).astype(np.float32)
    logits = (rng.standard_normal(n_experts + 1) * 2).astype(np.float32)
    x = rng.standard_normal(H).astype(ACT[dtype])
    x0 = x.astype(np.float64)
    with run(schedule, seed=seed, keep_records=True) as (dev, enc, b):
        buf = raw(b)
        ops.moe_down(enc, dtype, down.device(buf, gpu), sh.device(buf, gpu) if sh else None, buf(act), buf(ids),
                     buf(w), buf(logits) if shared else None, n_experts, k, buf(x))
    a = act.astype(np.float64)
    y, bound = down_ref([down.ref[ids[s]] for s in range(k)], [a[s, :inter] for s in range(k)], w, dtype,
                        (sh.ref, a[k, :shared], logits[n_experts]) if shared else None)
    assert_close(x, x0 + y, np.abs(x0) + bound, tol(dtype))
    assert not SIM or dev.records()[0]["kernel"] == f"moe_down_{fmt}_{dtype}"


# pairs the decode kernels cannot read in one dispatch (one dense side, or two dense types, or two scale types)
APART = [("bf16", "q4_sbf16"), ("q8_sf32", "f32"), ("f16", "bf16"), ("q4_sbf16", "q8_sf32")]


@pytest.mark.parametrize("routed,shared_fmt", APART)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_shared_expert_apart(routed, shared_fmt, dtype):
    """A shared expert whose format cannot share the routed experts' kernel: moe_gate_up writes its slot with
    mlp_gate_up, moe_down combines its down projection (qmv into shared_out) as it combines its own."""
    rng = np.random.default_rng(5)
    E, k, gs = 5, 2, 64
    H, inter, shared = 128, 64, 128
    gate, up = make(rng, routed, (E, inter, H), gs), make(rng, routed, (E, inter, H), gs)
    sgu = make(rng, shared_fmt, (2 * shared, H), gs)
    down, sdown = make(rng, routed, (E, H, inter), gs), make(rng, shared_fmt, (H, shared), gs)
    ids = np.array([3, 1], np.uint32)
    w = np.array([0.7, 0.3], np.float32)
    logits = rng.standard_normal(E + 1).astype(np.float32)
    x = rng.standard_normal(H).astype(ACT[dtype])
    act = np.full((k + 1, shared), 7, ACT[dtype])
    out = np.zeros(H, np.float32)
    with run(keep_records=True) as (dev, enc, b):
        buf = raw(b)
        ops.moe_gate_up(enc, dtype, gate.device(buf, gpu), up.device(buf, gpu), sgu.device(buf, gpu), buf(x),
                        buf(ids), k, buf(act))
    xf = x.astype(np.float64)
    ref, bound = gate_up_ref(sgu.ref[:shared], sgu.ref[shared:], xf, dtype)
    assert_close(act[k, :shared], ref, bound, tol(dtype), "shared slot")
    for s in range(k):
        ref, bound = gate_up_ref(gate.ref[ids[s]], up.ref[ids[s]], xf, dtype)
        assert_close(act[s, :inter], ref, bound, tol(dtype), f"slot {s}")
    assert not SIM or [r["kernel"] for r in dev.records()] == [f"moe_gate_up_{routed}_{dtype}",
                                                               f"mlp_gate_up_{shared_fmt}_{dtype}"]
    y0 = x.astype(np.float64)
    with run(keep_records=True) as (dev, enc, b):
        buf = raw(b)
        ops.moe_down(enc, dtype, down.device(buf, gpu), sdown.device(buf, gpu), buf(act), buf(ids), buf(w),
                     buf(logits), E, k, buf(x), shared_out=buf(out))
    a = act.astype(np.float64)
    y, bound = down_ref([down.ref[ids[s]] for s in range(k)], [a[s, :inter] for s in range(k)], w, dtype,
                        (sdown.ref, a[k, :shared], logits[E]))
    assert_close(x, y0 + y, np.abs(y0) + bound, tol(dtype))
    assert not SIM or [r["kernel"] for r in dev.records()][-1] == f"moe_down_{routed}_{dtype}"
    with run() as (dev, enc, b):
        buf = raw(b)
        with pytest.raises(ValueError, match=r"moe_down: shared_down .* cannot run in one dispatch .* give shared_out"):
            ops.moe_down(enc, dtype, down.device(buf, gpu), sdown.device(buf, gpu), buf(act), buf(ids), buf(w),
                         buf(logits), E, k, buf(x))


# ------------------------------------------------------------------------------------------ model shape
def test_moe_block_model_shape():
    """The MoE block of one decode token at the real shapes, in one command buffer as the graph encodes
    it: the 8-bit router GEMV over [256 router rows | shared_expert_gate] with float output, top-8 of 256
    (renormalised), routed gate/up + SwiGLU for 8 experts of 512 x 2048 plus the shared expert (its
    stacked [gate | up] 1024 x 2048), and the down projections (2048 x 512 each) added into x.
    4-bit gs 64 bf16 scales, bf16 activations; the expert stacks have 256 experts (random codes)."""
    rng = np.random.default_rng(2026)
    H, E, I, k = 2048, 256, 512, 8
    router = make(rng, "q8_sbf16", (E + 1, H), 64)
    gate = make(rng, "q4_sbf16", (E, I, H), 64, random_words=True)
    up = make(rng, "q4_sbf16", (E, I, H), 64, random_words=True)
    down = make(rng, "q4_sbf16", (E, H, I), 64, random_words=True)
    sgu = make(rng, "q4_sbf16", (2 * I, H), 64, random_words=True)
    sdown = make(rng, "q4_sbf16", (H, I), 64, random_words=True)
    x = rng.standard_normal(H).astype(BF16)
    xn = (rng.standard_normal(H) * 0.5).astype(BF16)  # the normed input of the block
    logits = np.zeros(E + 1, np.float32)
    ids, w = np.zeros(k, np.uint32), np.zeros(k, np.float32)
    act = np.zeros((k + 1, I), BF16)
    x0 = x.astype(np.float64)
    with run("random", seed=5, keep_records=True) as (dev, enc, b):
        buf = raw(b)
        xnb, lb, ib, wb, ab = buf(xn), buf(logits), buf(ids), buf(w), buf(act)
        ops.qmv(enc, "bf16", router.device(buf, gpu), xnb, lb, f32_out=True)
        ops.moe_topk(enc, lb, E, k, True, ib, wb)
        ops.moe_gate_up(enc, "bf16", gate.device(buf, gpu), up.device(buf, gpu), sgu.device(buf, gpu), xnb, ib, k, ab)
        read_gate_up = enc.bytes_read
        ops.moe_down(enc, "bf16", down.device(buf, gpu), sdown.device(buf, gpu), ab, ib, wb, lb, E, k, buf(x))
        assert enc.levels == 4  # each step reads what the previous one wrote: one barrier between each
    recs = dev.records() if SIM else None
    assert not SIM or [r["kernel"] for r in recs] == ["qmv_q8_sbf16_bf16_f32out", "moe_topk_f32",
                                                      "moe_gate_up_q4_sbf16_bf16", "moe_down_q4_sbf16_bf16"]
    # router: float logits of exactly these weights; top-k from those logits
    xf = xn.astype(np.float64)
    assert rel_err(logits, router.ref @ xf) <= 1e-5
    ref_ids, ref_w = topk_ref(logits[:E], k, True)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(w, ref_w, rtol=1e-6)
    # gate/up of the chosen experts and the shared one
    row_bytes = H // 2 + 2 * (H // 64) * 2
    assert not SIM or recs[2]["bytes_read"] == 2 * k * I * row_bytes + 2 * I * row_bytes + H * 2 + k * 4
    Wg = {int(e): gate.ref_of(e) for e in ids}  # the chosen experts' weights only
    Wu = {int(e): up.ref_of(e) for e in ids}
    Wd = {int(e): down.ref_of(e) for e in ids}
    for s, e in enumerate(ids):
        assert_close(act[s], *gate_up_ref(Wg[int(e)], Wu[int(e)], xf, "bf16"), "bf16x4", f"slot {s}")
    assert_close(act[k], *gate_up_ref(sgu.ref[:I], sgu.ref[I:], xf, "bf16"), "bf16x4", "shared")
    # down + shared + residual, from the act the kernel stored
    a = act.astype(np.float64)
    y, bound = down_ref([Wd[int(e)] for e in ids], list(a[:k]), w, "bf16", (sdown.ref, a[k], logits[E]))
    assert_close(x, x0 + y, np.abs(x0) + bound, "bf16x4")
    assert not SIM or recs[3]["bytes_read"] == k * H * (I // 2 + 2 * (I // 64) * 2) + H * (I // 2 + 2 * (I // 64) * 2) + \
        (k + 1) * I * 2 + k * 8 + 4 + H * 2
    assert read_gate_up < gate.w.nbytes  # 8 of 256 experts: far less than the stack


def test_mlp_gate_up_model_shape():
    """A dense SwiGLU MLP gate/up at the shared-expert shape (2 x 512 rows x 2048), 4-bit, bf16."""
    rng = np.random.default_rng(12)
    gu = make(rng, "q4_sbf16", (1024, 2048), 64, random_words=True)
    x = rng.standard_normal(2048).astype(BF16)
    act = np.zeros(512, BF16)
    with run("forward") as (dev, enc, b):
        buf = raw(b)
        ops.mlp_gate_up(enc, "bf16", gu.device(buf, gpu), buf(x), buf(act))
    assert_close(act, *gate_up_ref(gu.ref[:512], gu.ref[512:], x.astype(np.float64), "bf16"), "bf16x4")


# ------------------------------------------------------------------------------------------ argument checks
def test_moe_argument_checks():
    rng = np.random.default_rng(0)
    gate = make(rng, "q4_sbf16", (4, 16, 128), 64)
    up = make(rng, "q4_sbf16", (4, 16, 128), 64)
    up8 = make(rng, "q8_sbf16", (4, 16, 128), 64)
    up_short = make(rng, "q4_sbf16", (4, 8, 128), 64)
    sh = make(rng, "q4_sbf16", (32, 128), 64)
    down = make(rng, "q4_sbf16", (4, 128, 16 * 4), 32)
    x = np.zeros(128, np.float32)
    ids = np.zeros(2, np.uint32)
    w = np.zeros(2, np.float32)
    logits = np.zeros(5, np.float32)
    act = np.zeros((3, 64), np.float32)
    with run() as (dev, enc, b):
        buf = raw(b)
        G, U, S = gate.device(buf, gpu), up.device(buf, gpu), sh.device(buf, gpu)
        D = down.device(buf, gpu)
        # topk
        with pytest.raises(ValueError, match="logits holds"):
            ops.moe_topk(enc, buf(logits[:3]), 4, 2, True, buf(ids), buf(w))
        with pytest.raises(ValueError, match="k must be"):
            ops.moe_topk(enc, buf(logits), 4, 5, True, buf(np.zeros(5, np.uint32)), buf(np.zeros(5, np.float32)))
        with pytest.raises(ValueError, match="k must be"):
            big = np.zeros(64, np.float32)
            ops.moe_topk(enc, buf(big), 64, 33, True, buf(np.zeros(33, np.uint32)), buf(np.zeros(33, np.float32)))
        with pytest.raises(ValueError, match="n_experts"):
            ops.moe_topk(enc, buf(np.zeros(1025, np.float32)), 1025, 8, True, buf(ids), buf(w))
        with pytest.raises(ValueError, match="weights holds"):
            ops.moe_topk(enc, buf(logits), 4, 2, True, buf(ids), buf(w[:1]))
        # gate/up
        with pytest.raises(ValueError, match="act holds 128 bytes, needs 192"):  # (2 + shared) x 16 floats
            ops.moe_gate_up(enc, "f32", G, U, S, buf(x), buf(ids), 2, buf(act.reshape(-1)[:32]))
        with pytest.raises(ValueError, match="x holds"):
            ops.moe_gate_up(enc, "f32", G, U, S, buf(x[:64]), buf(ids), 2, buf(act))
        with pytest.raises(ValueError, match="ids holds"):
            ops.moe_gate_up(enc, "f32", G, U, S, buf(x), buf(ids[:1]), 2, buf(act))
        with pytest.raises(ValueError, match="same shape"):
            ops.moe_gate_up(enc, "f32", G, up_short.device(buf, gpu), S, buf(x), buf(ids), 2, buf(act))
        with pytest.raises(ValueError, match="format"):
            ops.moe_gate_up(enc, "f32", G, up8.device(buf, gpu), S, buf(x), buf(ids), 2, buf(act))
        with pytest.raises(ValueError, match="k must be"):
            ops.moe_gate_up(enc, "f32", G, U, S, buf(x), buf(np.zeros(5, np.uint32)), 5, buf(np.zeros((6, 16))))
        with pytest.raises(ValueError, match="shared_gate_up must be"):
            odd = gpu.Matrix("q4", 31, 128, buf(sh.w), buf(sh.scales), buf(sh.biases), group_size=64)
            ops.moe_gate_up(enc, "f32", G, U, odd, buf(x), buf(ids), 2, buf(act))
        with pytest.raises(ValueError, match="moe_gate_up: gate: w holds"):
            small = gpu.Matrix("q4", 16, 128, buf(gate.w[:3]), buf(gate.scales), buf(gate.biases), count=4)
            ops.moe_gate_up(enc, "f32", small, U, S, buf(x), buf(ids), 2, buf(act))
        # down
        xd = np.zeros(128, np.float32)
        with pytest.raises(ValueError, match="logits"):  # a shared expert needs logits[n_experts]
            ops.moe_down(enc, "f32", D, gpu.Matrix("q4", 128, 64, buf(down.w[0]), buf(down.scales[0]),
                                                   buf(down.biases[0]), group_size=32),
                         buf(act), buf(ids), buf(w), buf(logits), 5, 2, buf(xd))
        with pytest.raises(ValueError, match="shared_down must be"):
            ops.moe_down(enc, "f32", D, S, buf(act), buf(ids), buf(w), buf(logits), 4, 2, buf(xd))
        with pytest.raises(ValueError, match="x holds"):
            ops.moe_down(enc, "f32", D, None, buf(act), buf(ids), buf(w), None, 4, 2, buf(xd[:64]))
        with pytest.raises(ValueError, match="act holds"):
            ops.moe_down(enc, "f32", D, None, buf(act[:1]), buf(ids), buf(w), None, 4, 2, buf(xd))
        with pytest.raises(ValueError, match="weights holds"):
            ops.moe_down(enc, "f32", D, None, buf(act), buf(ids), buf(w[:1]), None, 4, 2, buf(xd))
        # dense mlp
        with pytest.raises(ValueError, match="gate_up must be"):
            ops.mlp_gate_up(enc, "f32", G, buf(x), buf(act))
        with pytest.raises(ValueError, match="act holds"):
            ops.mlp_gate_up(enc, "f32", S, buf(x), buf(act[0, :8]))
        assert enc.dispatches == 0


@pytest.mark.parametrize("schedule", SCHEDULES)
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(E=st.integers(1, 70), k=st.integers(1, 8), norm=st.booleans(), ties=st.booleans(), inter=st.integers(1, 20),
       shared=st.integers(0, 12), dtype=st.sampled_from(["f32", "bf16"]), seed=st.integers(0, 2**31 - 1))
def test_moe_gate_up_fused_topk(schedule, E, k, norm, ties, inter, shared, dtype, seed):
    """The router top-k fused into gate/up: the same ids and weights as moe_topk (written for moe_down) and
    every slot's SwiGLU computed with its expert."""
    rng = np.random.default_rng(seed)
    k = min(k, E)
    H = 64
    logits = (rng.integers(-3, 3, E + 1) if ties else rng.standard_normal(E + 1)).astype(np.float32)
    gate = make(rng, "q4_sbf16", (E, inter, H), 32)
    up = make(rng, "q4_sbf16", (E, inter, H), 32)
    sh = make(rng, "q4_sbf16", (2 * shared, H), 32) if shared else None
    x = rng.standard_normal(H).astype(ACT[dtype])
    act = np.full((k + (1 if shared else 0), max(inter, shared)), 7, ACT[dtype])
    ids, w = np.full(k, 99, np.uint32), np.full(k, 7, np.float32)
    want_ids, want_w = np.full(k, 99, np.uint32), np.full(k, 7, np.float32)
    with run(schedule, seed=seed) as (dev, enc, b):
        buf = raw(b)
        lb = buf(logits)
        ops.moe_topk(enc, lb, E, k, norm, buf(want_ids), buf(want_w))
        ops.moe_gate_up(enc, dtype, gate.device(buf, gpu), up.device(buf, gpu), sh.device(buf, gpu) if sh else None,
                        buf(x), buf(ids), k, buf(act), logits=lb, n_experts=E, norm=norm, weights=buf(w))
    np.testing.assert_array_equal(ids, want_ids)
    if dtype == "f32":
        np.testing.assert_array_equal(w, want_w)
    else:   # the bf16 graph rounds the selected probabilities, their sum and the quotient
        p_sel = topk_ref(logits[:E], k, False)[1].astype(np.float64)
        sc = rnd(p_sel, dtype)
        want = rnd(sc / rnd(np.sum(sc), dtype), dtype) if norm else sc
        np.testing.assert_allclose(w, want, rtol=2.0 ** -7)
    xf = x.astype(np.float64)
    for s in range(k):
        ref, bound = gate_up_ref(gate.ref[ids[s]], up.ref[ids[s]], xf, dtype)
        assert_close(act[s, :inter], ref, bound, tol(dtype), f"slot {s}")
    if shared:
        ref, bound = gate_up_ref(sh.ref[:shared], sh.ref[shared:], xf, dtype)
        assert_close(act[k, :shared], ref, bound, tol(dtype), "shared")


# ================================================================================== prefill: M rows at once
def topk_rows_ref(logits, E, k, norm, dtype):
    """ids and weights of every row; in bf16 the weights rounded as the bf16 graph rounds them (the selected
    probabilities, their sum, the quotient), as reference.sparse_moe(bf16=True)"""
    ids, ws = [], []
    for row in logits:
        i, w = topk_ref(row[:E], k, False)
        w = rnd(w.astype(np.float64), dtype)
        if norm:
            w = rnd(w / rnd(np.sum(w), dtype), dtype)
        ids.append(i)
        ws.append(w)
    return np.array(ids, np.uint32), np.array(ws)


@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(M=st.integers(1, 11), E=st.integers(1, 80), pad=st.integers(0, 3), k=st.integers(1, 9), norm=st.booleans(),
       ties=st.booleans(), dtype=st.sampled_from(["f32", "bf16"]), seed=st.integers(0, 2**31 - 1))
def test_moe_topk_rows(schedule, M, E, pad, k, norm, ties, dtype, seed):
    """Every row's top-k as the single-row moe_topk computes it (ties: lower index), rows at a padded stride
    (the router GEMM's [E router | shared gate] row); bf16 rounds the weights as the bf16 graph."""
    rng = np.random.default_rng(seed)
    k = min(k, E)
    stride = E + pad
    logits = ((rng.integers(0, 4, (M, stride)) * 0.5) if ties else rng.standard_normal((M, stride)) * 3)
    logits = logits.astype(np.float32)
    ids = np.full((M, k), 0xDEAD, np.uint32)
    w = np.full((M, k), -1, np.float32)
    with run(schedule, seed=seed, keep_records=True) as (dev, enc, b):
        buf = raw(b)
        ops.moe_topk_rows(enc, dtype, buf(logits), M, stride, E, k, norm, buf(ids), buf(w))
    ref_ids, ref_w = topk_rows_ref(logits, E, k, norm, dtype)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(w, ref_w, rtol=1e-6 if dtype == "f32" else 2.0 ** -8, atol=1e-7)
    assert not SIM or dev.records()[0]["kernel"] == f"moe_topk_{dtype}"


def sort_ref(ids, E, t, capacity):
    """slot_rows, slot_of and the tile map of a stable counting sort of the (token, j) pairs by expert"""
    M, k = ids.shape
    flat = np.minimum(ids.ravel(), E - 1)
    order = np.argsort(flat, kind="stable")                   # slot -> pair
    slot_of = np.empty(M * k, np.uint32)
    slot_of[order] = np.arange(M * k)
    tiles, base = [], 0
    for e, c in enumerate(np.bincount(flat, minlength=E)):
        tiles += [(e, base + f, min(t, c - f), 0) for f in range(0, c, t)]
        base += c
    assert len(tiles) <= capacity
    tiles += [(0, 0, 0, 0)] * (capacity - len(tiles))
    return (order // k).astype(np.uint32), slot_of, np.array(tiles, np.uint32).reshape(capacity, 4)


def run_sort(ids, E, t, schedule="forward", seed=0, keep_records=False):
    M, k = ids.shape
    S = M * k
    cap = ops.moe_tile_capacity(S, E, t)
    scratch = np.full(ops.moe_sort_scratch_bytes(E) // 4, 0xABCD, np.uint32)
    slot_rows, slot_of = np.full(S, 0xDEAD, np.uint32), np.full(S, 0xDEAD, np.uint32)
    tiles = np.full((cap, 4), 0xBEEF, np.uint32)
    with run(schedule, seed=seed, keep_records=keep_records) as (dev, enc, b):
        buf = raw(b)
        ops.moe_sort(enc, buf(np.ascontiguousarray(ids, np.uint32)), M, k, E, buf(scratch), buf(slot_rows),
                     buf(slot_of), gpu.TileMap(buf(tiles), cap, t))
        levels = enc.levels
    return slot_rows, slot_of, tiles, levels, dev


def check_sort(ids, E, t, schedule="forward", seed=0):
    slot_rows, slot_of, tiles, levels, _ = run_sort(ids, E, t, schedule, seed)
    want = sort_ref(ids, E, t, len(tiles))
    np.testing.assert_array_equal(slot_rows, want[0])
    np.testing.assert_array_equal(slot_of, want[1])
    np.testing.assert_array_equal(tiles, want[2])
    assert levels == 3   # count -> scan -> scatter
    return tiles


def routing(rng, M, k, E, skew):
    """M rows of k distinct experts, uniformly or concentrated on a few experts"""
    p = None
    if skew:
        p = 1.0 / np.arange(1, E + 1) ** 3
        p = rng.permutation(p / p.sum())
    return np.array([rng.choice(E, k, replace=False, p=p) for _ in range(M)], np.uint32)


@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(M=st.integers(1, 70), k=st.integers(1, 8), E=st.integers(1, 300), t=st.sampled_from([16, 32]),
       skew=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_moe_sort(schedule, M, k, E, t, skew, seed):
    """The stable sort and the tile map, exactly, for 1..70 rows (several token blocks above 32 rows), up to
    300 experts (two threadgroups of experts above 256), both tile heights, uniform and skewed routing."""
    rng = np.random.default_rng(seed)
    k = min(k, E)
    check_sort(routing(rng, M, k, E, skew), E, t, schedule, seed)


@pytest.mark.parametrize("t", [16, 32])
def test_moe_sort_routing_extremes(t):
    rng = np.random.default_rng(3)
    # all tokens to one expert (k = 1), the other 15 empty; 100 rows: not a multiple of either height
    tiles = check_sort(np.full((100, 1), 9, np.uint32), 16, t, "reverse")
    assert (tiles[:, 2] > 0).sum() == -(-100 // t) and (tiles[tiles[:, 2] > 0, 0] == 9).all()
    # every token to the same k experts (each gets all M rows), the rest empty
    check_sort(np.tile(np.array([5, 0, 63, 17], np.uint32), (45, 1)), 64, t, "random", 1)
    # one row (M = 1): k tiles of one row each
    tiles = check_sort(np.array([[7, 2, 30, 1, 0, 29, 3, 4]], np.uint32), 32, t)
    assert tiles[:8, 2].tolist() == [1] * 8 and tiles[:8, 0].tolist() == [0, 1, 2, 3, 4, 7, 29, 30]
    # one expert, one row
    check_sort(np.zeros((1, 1), np.uint32), 1, t)
    # S exactly a multiple of the height, and one more
    check_sort(routing(rng, 2 * t, 1, 1, False), 1, t)
    check_sort(routing(rng, 2 * t + 1, 1, 1, False), 1, t)
    # repeated ids in a row and ids >= E (not what top-k produces): still (token, j) order, clamped to E - 1
    check_sort(np.array([[3, 3, 9], [1, 3, 3], [99, 0, 3]], np.uint32), 4, t, "reverse")


def counts_at_capacity(M, k, E, t):
    """Routing of M rows x k distinct experts whose tiles fill every entry of moe_tile_capacity: every
    non-empty expert gets 1 + (a multiple of t) rows, except that the leftover (< t) goes where it adds no
    tile; the rows are handed out column-major so that each expert's run covers distinct tokens."""
    S = M * k
    n = min(E, S)
    c = [1] * n
    rest = S - n
    for e in range(n):
        while rest >= t and c[e] + t <= M:
            c[e] += t
            rest -= t
    for e in range(n):
        add = min(rest, M - c[e])
        c[e] += add
        rest -= add
    assert rest == 0 and max(c) <= M
    flat = np.repeat(np.arange(n), c)
    ids = np.empty((M, k), np.uint32)
    for i, e in enumerate(flat):
        ids[i % M, i // M] = e
    assert all(len(set(r)) == k for r in ids)
    return ids


@pytest.mark.parametrize("M,k,E", [(40, 1, 8), (100, 1, 5), (3, 1, 10), (1, 1, 1), (33, 2, 4), (50, 4, 6),
                                   (48, 8, 16), (70, 3, 300)])
@pytest.mark.parametrize("t", [16, 32])
def test_moe_tile_map_at_capacity(M, k, E, t):
    """A routing that needs exactly moe_tile_capacity tiles: every entry of the map is a real tile (the bound
    is tight, so the grouped GEMM's fixed grid is never larger than some routing needs)."""
    ids = counts_at_capacity(M, k, E, t)
    tiles = check_sort(ids, E, t, "random", M)
    assert len(tiles) == ops.moe_tile_capacity(M * k, E, t)
    assert (tiles[:, 2] > 0).all()


def test_moe_sort_deterministic_across_schedules():
    """The same slots and tile map whatever order the threads run in (integer counting, fixed order)."""
    rng = np.random.default_rng(8)
    ids = routing(rng, 67, 8, 40, True)
    outs = [run_sort(ids, 40, 16, s, seed)[:3] for s, seed in [("forward", 0), ("reverse", 0), ("random", 1),
                                                               ("random", 2)]]
    for o in outs[1:]:
        for a, b in zip(outs[0], o):
            np.testing.assert_array_equal(a, b)


def test_moe_tile_capacity_and_rows():
    cap = ops.moe_tile_capacity
    assert cap(100, 1, 16) == 1 + 99 // 16 and cap(3, 10, 16) == 3 and cap(1, 256, 32) == 1
    assert cap(4096 * 8, 256, 32) == 256 + (4096 * 8 - 256) // 32
    # the height rule: 32 from an average of 32 rows per expert
    assert ops.moe_tile_rows(32 * 256, 256) == 32 and ops.moe_tile_rows(32 * 256 - 1, 256) == 16
    assert ops.moe_sort_scratch_bytes(256) == 32 * 256 * 4


def combine_ref(x, y, slot_of, w, shared, logits, E, dtype):
    """x + the combine with the bf16 graph's roundings (moe_down's), and the magnitude of the float sum"""
    M, k = slot_of.shape
    ys = y.astype(np.float64)[slot_of]                             # [M, k, H]
    terms = rnd(w.astype(np.float64)[:, :, None] * rnd(ys, dtype), dtype)
    out = rnd(terms.sum(axis=1), dtype)
    bound = np.abs(terms).sum(axis=1)
    if shared is not None:
        g = rnd(sigmoid(logits[:, E].astype(np.float64)), dtype)[:, None]
        gs = rnd(g * rnd(shared.astype(np.float64), dtype), dtype)
        out = rnd(out + gs, dtype)
        bound = bound + np.abs(gs)
    x0 = x.astype(np.float64)
    return x0 + out, bound + np.abs(x0)


@pytest.mark.parametrize("schedule", SCHEDULES)
@HYP
@given(M=st.integers(1, 9), k=st.integers(1, 8), H=st.integers(1, 300), has_shared=st.booleans(), pad=st.integers(0, 2),
       dtype=st.sampled_from(["f32", "bf16"]), seed=st.integers(0, 2**31 - 1))
def test_moe_combine(schedule, M, k, H, has_shared, pad, dtype, seed):
    rng = np.random.default_rng(seed)
    S, E = M * k, 5
    y = rng.standard_normal((S, H)).astype(np.float32)
    slot_of = rng.permutation(S).astype(np.uint32).reshape(M, k)
    w = rng.dirichlet(np.ones(k), M).astype(np.float32)
    stride = E + 1 + pad
    logits = (rng.standard_normal((M, stride)) * 2).astype(np.float32)
    shared = rng.standard_normal((M, H)).astype(ACT[dtype]) if has_shared else None
    x = rng.standard_normal((M, H)).astype(ACT[dtype])
    want, bound = combine_ref(x, y, slot_of, w, shared, logits, E, dtype)
    with run(schedule, seed=seed, keep_records=True) as (dev, enc, b):
        buf = raw(b)
        ops.moe_combine(enc, dtype, buf(y), buf(slot_of), buf(w), M, k, H, buf(shared) if has_shared else None,
                        buf(logits) if has_shared else None, stride, E, buf(x))
    assert_close(x, want, bound, tol(dtype))
    assert not SIM or dev.records()[0]["kernel"] == f"moe_combine_{dtype}"


def test_moe_combine_matches_moe_down_rounding():
    """One row: the combine of k down outputs (as moe_down computes them, float) gives moe_down's x bit for
    bit in bf16 -- the same roundings in the same order (shared helpers in moe.metal)."""
    rng = np.random.default_rng(21)
    E, k, H, I = 6, 3, 40, 64
    down = make(rng, "f32", (E, H, I), 32)
    sh = make(rng, "f32", (H, I), 32)
    act = rng.standard_normal((k + 1, I)).astype(BF16)
    ids = np.array([4, 0, 2], np.uint32)
    w = rng.dirichlet(np.ones(k)).astype(np.float32)
    logits = rng.standard_normal(E + 1).astype(np.float32)
    x = rng.standard_normal(H).astype(BF16)
    x_down, x_comb = x.copy(), x.copy().reshape(1, H)
    a = act.astype(np.float32)
    y = np.stack([down.ref[ids[s]].astype(np.float32) @ a[s] for s in range(k)]).astype(np.float32)
    shared = (sh.ref.astype(np.float32) @ a[k]).astype(BF16).reshape(1, H)
    with run("forward") as (dev, enc, b):
        buf = raw(b)
        ops.moe_down(enc, "bf16", down.device(buf, gpu), sh.device(buf, gpu), buf(act), buf(ids), buf(w),
                     buf(logits), E, k, buf(x_down))
        ops.moe_combine(enc, "bf16", buf(y), buf(np.arange(k, dtype=np.uint32).reshape(1, k)), buf(w.reshape(1, k)),
                        1, k, H, buf(shared), buf(logits.reshape(1, -1)), E + 1, E, buf(x_comb))
    # the products differ by float summation order only; with these sizes no rounding boundary is crossed
    np.testing.assert_array_equal(x_comb[0].view(np.uint16), x_down.view(np.uint16))


def test_moe_prefill_argument_checks():
    z = lambda n, dt=np.uint32: np.zeros(n, dt)  # noqa: E731
    with run() as (dev, enc, b):
        buf = raw(b)
        # topk rows
        with pytest.raises(ValueError, match="moe_topk_rows: stride must be at least n_experts"):
            ops.moe_topk_rows(enc, "f32", buf(z(40, np.float32)), 4, 7, 8, 2, True, buf(z(8)), buf(z(8, np.float32)))
        with pytest.raises(ValueError, match="moe_topk_rows: logits holds 124 bytes, needs 128"):
            ops.moe_topk_rows(enc, "f32", buf(z(31, np.float32)), 4, 8, 8, 2, True, buf(z(8)), buf(z(8, np.float32)))
        with pytest.raises(ValueError, match="moe_topk_rows: ids holds"):
            ops.moe_topk_rows(enc, "bf16", buf(z(32, np.float32)), 4, 8, 8, 2, True, buf(z(7)), buf(z(8, np.float32)))
        with pytest.raises(ValueError, match="M must be at least 1"):
            ops.moe_topk_rows(enc, "f32", buf(z(32, np.float32)), 0, 8, 8, 2, True, buf(z(8)), buf(z(8, np.float32)))
        # sort
        ids, sc = z(12), z(ops.moe_sort_scratch_bytes(8) // 4)
        cap = ops.moe_tile_capacity(12, 8, 16)
        tiles = z(4 * cap)
        tm = lambda c=cap, t=16, a=tiles: gpu.TileMap(buf(a), c, t)  # noqa: E731
        with pytest.raises(ValueError, match="moe_sort: tile_rows must be 16 or 32, got 8"):
            ops.moe_sort(enc, buf(ids), 4, 3, 8, buf(sc), buf(z(12)), buf(z(12)), tm(t=8))
        with pytest.raises(ValueError, match=f"capacity must be at least moe_tile_capacity = {cap}, got {cap - 1}"):
            ops.moe_sort(enc, buf(ids), 4, 3, 8, buf(sc), buf(z(12)), buf(z(12)), tm(c=cap - 1))
        with pytest.raises(ValueError, match="moe_sort: tiles holds"):
            ops.moe_sort(enc, buf(ids), 4, 3, 8, buf(sc), buf(z(12)), buf(z(12)), tm(a=tiles[:-1]))
        with pytest.raises(ValueError, match="moe_sort: scratch holds"):
            ops.moe_sort(enc, buf(ids), 4, 3, 8, buf(sc[:-1]), buf(z(12)), buf(z(12)), tm())
        with pytest.raises(ValueError, match="moe_sort: slot_of holds"):
            ops.moe_sort(enc, buf(ids), 4, 3, 8, buf(sc), buf(z(12)), buf(z(11)), tm())
        with pytest.raises(ValueError, match="moe_sort: n_experts must be"):
            ops.moe_sort(enc, buf(ids), 4, 3, 0, buf(sc), buf(z(12)), buf(z(12)), tm())
        # combine
        y, so, w, x = z(6 * 16, np.float32), z(6), z(6, np.float32), z(3 * 16, np.float32)
        with pytest.raises(ValueError, match="moe_combine: y holds"):
            ops.moe_combine(enc, "f32", buf(y[:-1]), buf(so), buf(w), 3, 2, 16, None, None, 0, 4, buf(x))
        with pytest.raises(ValueError, match="moe_combine: x holds"):
            ops.moe_combine(enc, "bf16", buf(y), buf(so), buf(w), 3, 2, 16, None, None, 0, 4,
                            buf(z(3 * 16 - 1, np.uint16)))
        with pytest.raises(ValueError, match="logits_stride must be at least n_experts \\+ 1 = 5"):
            ops.moe_combine(enc, "f32", buf(y), buf(so), buf(w), 3, 2, 16, buf(x), buf(z(15, np.float32)), 4, 4, buf(x))
        with pytest.raises(ValueError, match="moe_combine: logits holds"):
            ops.moe_combine(enc, "f32", buf(y), buf(so), buf(w), 3, 2, 16, buf(x), buf(z(14, np.float32)), 5, 4, buf(x))
        with pytest.raises(ValueError, match="moe_combine: shared holds"):
            ops.moe_combine(enc, "f32", buf(y), buf(so), buf(w), 3, 2, 16, buf(x[:-1]), buf(z(15, np.float32)), 5, 4,
                            buf(x))
        assert enc.dispatches == 0


# ------------------------------------------------------------------------------------------ prefill block
def prefill_scratch(dtype, M, E, k, H, I, Is):
    """moe_prefill's named scratch (ops::MoeScratch) as host arrays, filled with garbage"""
    S = M * k
    T = ACT[dtype]
    return dict(logits=np.full((M, E + 1), 7, np.float32), ids=np.full((M, k), 0xDEAD, np.uint32),
                weights=np.full((M, k), 7, np.float32),
                sort=np.full(ops.moe_sort_scratch_bytes(E) // 4, 0xABCD, np.uint32),
                slot_rows=np.full(S, 0xDEAD, np.uint32), slot_of=np.full(S, 0xDEAD, np.uint32),
                tiles=np.full((ops.moe_tile_capacity(S, E, 16), 4), 0xBEEF, np.uint32),
                act=np.full((S, I), 7, T), y=np.full((S, H), 7, np.float32), shared_act=np.full((M, Is), 7, T),
                shared_out=np.full((M, H), 7, T))


class Block:
    """One MoE layer for moe_prefill: gs-64 expert stacks of format `fmt` (4-bit by default; down: gs down_gs),
    an 8-bit router over [E rows | shared gate] in one part or, with split_router, the shared-gate row as a dense
    bf16 part of its own; a shared expert of Is (0: none) of format `shared_fmt`; inputs xn (the normed rows,
    small) and x (the residual)."""

    def __init__(self, rng, dtype, M, E, k, H, I, Is, split_router=False, down_gs=64, fmt="q4_sbf16",
                 shared_fmt="q4_sbf16"):
        self.dtype, self.M, self.E, self.k, self.Is = dtype, M, E, k, Is
        n = E + (1 if Is else 0)
        self.router = ([make(rng, "q8_sbf16", (E, H), 64), make(rng, "bf16", (1, H))] if split_router
                       else [make(rng, "q8_sbf16", (n, H), 64)])
        self.gate, self.up = make(rng, fmt, (E, I, H), 64), make(rng, fmt, (E, I, H), 64)
        self.down = make(rng, fmt, (E, H, I), down_gs)
        self.sgu = make(rng, shared_fmt, (2 * Is, H), 64) if Is else None
        self.sdown = make(rng, shared_fmt, (H, Is), 64) if Is else None
        self.xn = (rng.standard_normal((M, H)) * 0.1).astype(ACT[dtype])
        self.x = rng.standard_normal((M, H)).astype(ACT[dtype])
        self.x0 = self.x.copy()

    def mats(self, buf):
        """moe_prefill's matrix arguments, router .. k"""
        dv = lambda m: m.device(buf, gpu) if m is not None else None  # noqa: E731
        return ([dv(r) for r in self.router], dv(self.gate), dv(self.up), dv(self.down), dv(self.sgu),
                dv(self.sdown), self.k)

    def encode(self, enc, buf, scratch):
        ops.moe_prefill(enc, self.dtype, *self.mats(buf), True, buf(self.xn), buf(self.x), self.M, **scratch)

    def reference(self):
        """the routed ids and x0 + reference.sparse_moe(xn) (rounded in bf16) as float32"""
        f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
        rows = np.concatenate([r.ref for r in self.router])
        p = {"gate": f32(rows[:self.E]), "switch_mlp.gate_proj": f32(self.gate.ref),
             "switch_mlp.up_proj": f32(self.up.ref), "switch_mlp.down_proj": f32(self.down.ref)}
        if self.Is:
            p.update({"shared_expert_gate": f32(rows[self.E:]),
                      "shared_expert.gate_proj": f32(self.sgu.ref[:self.Is]),
                      "shared_expert.up_proj": f32(self.sgu.ref[self.Is:]),
                      "shared_expert.down_proj": f32(self.sdown.ref)})
        cfg = SimpleNamespace(num_experts_per_tok=self.k, norm_topk_prob=True, shared_expert_intermediate_size=self.Is)
        bf = self.dtype == "bf16"
        xr = f32(self.xn)
        logits = xr @ p["gate"].T
        logits = reference.to_bf16(logits) if bf else logits
        ids = np.argsort(-reference.softmax(logits), axis=-1, kind="stable")[:, :self.k]
        want = f32(self.x0) + reference.sparse_moe(xr, p, cfg, bf16=bf)
        return ids, reference.to_bf16(want) if bf else want

    def check_rows(self, want):
        """float: 1e-5 relative per row; bf16: in ulps of the reference's bfloat16 mode (assert_bf16; ulps of at
        least 1e-3 of the row's largest value: the block's output is a cancelling sum)"""
        for m in range(self.M):
            if self.dtype == "bf16":
                assert_bf16(self.x[m], want[m], floor=1e-3 * np.abs(want[m]).max(), what=f"row {m}")
            else:
                assert rel_err(self.x[m], want[m]) <= 1e-5, f"row {m}"


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("E,tile_rows", [(32, 16), (12, 32)])   # S / E = 12 -> 16-row tiles; 32 -> 32-row
def test_moe_prefill_block(dtype, E, tile_rows):
    """The MoE block of a chunk of M = 48 rows as ops::moe_prefill encodes it, in one command buffer: the 8-bit
    router GEMM over [E router rows | shared gate] (float logits, rounded in bf16), top-8 for every row, the
    counting sort and tile map, the grouped gate/up + SwiGLU and down GEMMs over the sorted slots (4-bit, gs
    64), the shared expert (its own GEMMs) and the combine + residual, in place on x. Every row equals
    reference.sparse_moe + the residual (float <= 1e-5 relative, bfloat <= 1e-2); the routing and slots are
    the reference's."""
    M, k, H, I, Is = 48, 8, 256, 64, 128
    blk = Block(np.random.default_rng(48 + E), dtype, M, E, k, H, I, Is)
    sc = prefill_scratch(dtype, M, E, k, H, I, Is)
    with run("random", seed=E, keep_records=True) as (dev, enc, b):
        blk.encode(enc, raw(b), {n: raw(b)(a) for n, a in sc.items()})
        # router + shared gate/up, top-k + shared down, count, scan, scatter, the 2 grouped GEMMs, combine
        assert enc.levels == 8
        # declared arithmetic (the costing's): the GEMMs at 2 per multiply-add over the M rows / S slots, the
        # top-k's 4 per logit, the combine's 2k + 3 per output; the sort declares none
        S = M * k
        assert enc.flops == (2 * M * (E + 1) * H + 2 * M * 2 * Is * H + 2 * M * H * Is + 4 * M * E
                             + 2 * S * 2 * I * H + 2 * S * H * I + M * H * (2 * k + 3))
    if SIM:
        names = [r["kernel"] for r in dev.records()]
        assert names[-6:] == ["moe_sort_count", "moe_sort_scan", "moe_sort_scatter", names[-3], names[-2],
                              f"moe_combine_{dtype}"] and f"moe_topk_{dtype}" in names
    want_ids, want = blk.reference()
    # routing: the reference's experts for every row, and their stable sort
    np.testing.assert_array_equal(sc["ids"], want_ids)
    assert ops.moe_tile_rows(M * k, E) == tile_rows
    cap = ops.moe_tile_capacity(M * k, E, tile_rows)
    want_rows, want_of, want_tiles = sort_ref(sc["ids"], E, tile_rows, cap)
    np.testing.assert_array_equal(sc["slot_rows"], want_rows)
    np.testing.assert_array_equal(sc["slot_of"].reshape(-1), want_of)
    np.testing.assert_array_equal(sc["tiles"][:cap], want_tiles)
    blk.check_rows(want)


def test_moe_prefill_block_checks():
    rng = np.random.default_rng(1)
    E, H, I, Is, M, k = 4, 64, 32, 32, 3, 2
    mats = dict(router=make(rng, "q8_sbf16", (E + 1, H), 64), router_short=make(rng, "q8_sbf16", (E, H), 64),
                gate=make(rng, "q4_sbf16", (E, I, H), 32), up=make(rng, "q4_sbf16", (E, I, H), 32),
                down=make(rng, "q4_sbf16", (E, H, I), 32), down_bad=make(rng, "q4_sbf16", (E, H, 2 * I), 32),
                sgu=make(rng, "q4_sbf16", (2 * Is, H), 32), sdown=make(rng, "q4_sbf16", (H, Is), 32))
    sc = prefill_scratch("f32", M, E, k, H, I, Is)
    xn, x = np.zeros((M, H), np.float32), np.zeros((M, H), np.float32)
    with run() as (dev, enc, b):
        buf = raw(b)
        d = {n: m.device(buf, gpu) for n, m in mats.items()}
        scb = {n: buf(a) for n, a in sc.items()}

        def call(router="router", down="down", sgu="sgu", sdown="sdown", k=k):
            ops.moe_prefill(enc, "f32", [d[router]], d["gate"], d["up"], d[down], d[sgu] if sgu else None,
                            d[sdown] if sdown else None, k, True, buf(xn), buf(x), M, **scb)

        with pytest.raises(ValueError, match=r"router rows must be n_experts \+ 1 \(shared gate\) = 5, got 4"):
            call(router="router_short")
        with pytest.raises(ValueError, match="moe_prefill: router rows must be n_experts = 4, got 5"):
            call(sgu=None, sdown=None)
        with pytest.raises(ValueError, match="shared_gate_up and shared_down go together"):
            call(sdown=None)
        with pytest.raises(ValueError, match="down \\[E, H, I\\] must have matching shapes"):
            call(down="down_bad")
        with pytest.raises(ValueError, match="moe_prefill: k must be in \\[1, n_experts = 4\\], got 5"):
            call(k=5)
        with pytest.raises(ValueError, match="the shared expert must be"):
            call(sgu="sdown", sdown="sgu")
        assert enc.dispatches == 0


def test_moe_prefill_scratch_and_partial_chunk():
    """moe_prefill_scratch allocates the documented sizes for chunks of up to 48 rows; a chunk of 37 rows
    (no shared expert: router rows = E) through it equals reference.sparse_moe + the residual (float)."""
    max_rows, M, E, k, H, I = 48, 37, 20, 8, 128, 64
    blk = Block(np.random.default_rng(37), "f32", M, E, k, H, I, 0)
    with run("reverse") as (dev, enc, b):
        sc = ops.moe_prefill_scratch(dev, "f32", *blk.mats(raw(b)), max_rows)
        want_sizes = {n: a.nbytes for n, a in prefill_scratch("f32", max_rows, E, k, H, I, 0).items()
                      if not n.startswith("shared")}
        want_sizes["logits"] = max_rows * E * 4   # no shared-gate column
        assert {n: s.nbytes for n, s in sc.items()} == want_sizes
        blk.encode(enc, raw(b), sc)
    want_ids, want = blk.reference()
    blk.check_rows(want)
    np.testing.assert_array_equal(np.frombuffer(sc["ids"].to_bytes(), np.uint32)[:M * k].reshape(M, k), want_ids)


def test_moe_prefill_real_shape_encode_only():
    """The real config's MoE block for a 4096-token chunk (E = 256, top-8, H = 2048, I = Is = 512, q8 router,
    q4 gs 64 experts, bf16), encoded on an encode-only simulator device (virtual buffers, nothing runs): 8
    levels, 32-row tiles (S / E = 128), the grouped GEMMs' grid sized by the capacity bound, and the exact
    declared traffic of the top-k, sort and combine."""
    dev = gpu.SimDevice(execute=False, keep_records=True)
    cb = dev.command_buffer()
    enc = gpu.Encoder(dev, cb)
    M, E, k, H, I = 4096, 256, 8, 2048, 512
    S = M * k

    def mat(fmt, rows, cols, count=1):
        bits = 4 if fmt == "q4" else 8
        n = count * rows * (cols // 64) * 2
        return gpu.Matrix(fmt, rows, cols, dev.alloc(count * rows * cols * bits // 8), dev.alloc(n), dev.alloc(n),
                          group_size=64, count=count)

    mats = ([mat("q8", E + 1, H)], mat("q4", I, H, E), mat("q4", I, H, E), mat("q4", H, I, E), mat("q4", 2 * I, H),
            mat("q4", H, I), k)
    sc = ops.moe_prefill_scratch(dev, "bf16", *mats, M)
    ops.moe_prefill(enc, "bf16", *mats, True, dev.alloc(M * H * 2), dev.alloc(M * H * 2), M, **sc)
    assert enc.levels == 8 and dev.counters()["host_waits"] == 0
    cb.commit()
    cb.wait()
    recs = {r["kernel"]: r for r in dev.records()}
    t = ops.moe_tile_rows(S, E)
    cap = ops.moe_tile_capacity(S, E, t)
    assert (t, cap) == (32, 256 + (S - 256) // 32)
    grouped = [r for r in dev.records() if r["threadgroups"][1] == cap]
    assert len(grouped) == 2   # gate/up + SwiGLU and down: one row of threadgroups per tile-map entry
    assert recs["moe_topk_bf16"]["bytes_read"] == M * E * 4 and recs["moe_topk_bf16"]["bytes_written"] == S * 8
    assert recs["moe_sort_count"]["threadgroups"] == (32, 1, 1)   # 32 token blocks of 128 tokens, 256 experts
    assert recs["moe_sort_scan"]["bytes_written"] == 32 * E * 4 + cap * 16
    assert recs["moe_sort_scatter"]["bytes_written"] == 2 * S * 4
    assert recs["moe_combine_bf16"]["bytes_read"] == S * H * 4 + 2 * S * 4 + M * H * 2 * 2 + M * 4
    assert recs["moe_combine_bf16"]["bytes_written"] == M * H * 2


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("M", [1, 5, 17])
def test_moe_prefill_small_chunks_and_router_parts(dtype, M):
    """Chunks of 1, 5 (the skinny GEMMs: qmv with batch M) and 17 rows; the router as two parts of different
    formats (8-bit router rows, the shared-gate row dense bf16), written into consecutive logit columns."""
    E, k, H, I, Is = 10, 4, 128, 32, 64
    blk = Block(np.random.default_rng(M), dtype, M, E, k, H, I, Is, split_router=True, down_gs=32)
    sc = prefill_scratch(dtype, M, E, k, H, I, Is)
    with run("reverse", seed=M) as (dev, enc, b):
        blk.encode(enc, raw(b), {n: raw(b)(a) for n, a in sc.items()})
    want_ids, want = blk.reference()
    np.testing.assert_array_equal(sc["ids"], want_ids)
    blk.check_rows(want)


# ------------------------------------------------------------------------------------------ run-time widths (qn)
@pytest.mark.parametrize("fmt", QN_FORMATS)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_moe_decode_qn(fmt, dtype):
    """The decode MoE kernels at 2, 3, 5, 6 bits (moe_gate_up_qn_*, moe_down_qn_*, mlp_gate_up_qn_*): routed experts at
    the low width beside a 4-bit shared expert of the same scale type (an mlx-q4-e2/e3 layer: one qn dispatch,
    a width per matrix), and beside a shared expert at the routed width; the dense MLP at the low width."""
    rng = np.random.default_rng(fmt_bits(fmt) * 2 + (dtype == "bf16"))
    E, k, H, inter, Is, n_experts = 5, 3, cols_for(fmt, 64, 2), 64, 96, 5
    q4 = "q4_" + fmt.split("_")[1]
    gate, up = make(rng, fmt, (E, inter, H), 64), make(rng, fmt, (E, inter, H), 64)
    down = make(rng, fmt, (E, H, inter), 32)
    gu = make(rng, fmt, (2 * inter, H), 32)
    ids = rng.choice(E, k, replace=False).astype(np.uint32)
    w = rng.dirichlet(np.ones(k)).astype(np.float32)
    logits = (rng.standard_normal(n_experts + 1) * 2).astype(np.float32)
    x = rng.standard_normal(H).astype(ACT[dtype])
    xf = x.astype(np.float64)
    for shared_fmt in (q4, fmt):
        sgu, sdown = make(rng, shared_fmt, (2 * Is, H), 64), make(rng, shared_fmt, (H, Is), 32)
        act = np.full((k + 1, Is), 7, ACT[dtype])
        xd = rng.standard_normal(H).astype(ACT[dtype])
        x0 = xd.astype(np.float64)
        mlp = np.full(inter, 7, ACT[dtype])
        with run("random", seed=fmt_bits(fmt), keep_records=True) as (dev, enc, b):
            buf = raw(b)
            ab = buf(act)
            ops.moe_gate_up(enc, dtype, gate.device(buf, gpu), up.device(buf, gpu), sgu.device(buf, gpu), buf(x),
                            buf(ids), k, ab)
            ops.moe_down(enc, dtype, down.device(buf, gpu), sdown.device(buf, gpu), ab, buf(ids), buf(w),
                         buf(logits), n_experts, k, buf(xd))
            ops.mlp_gate_up(enc, dtype, gu.device(buf, gpu), buf(x), buf(mlp))
        for s in range(k):
            ref, bound = gate_up_ref(gate.ref[ids[s]], up.ref[ids[s]], xf, dtype)
            assert_close(act[s, :inter], ref, bound, tol(dtype), f"slot {s}")
        assert_close(act[k], *gate_up_ref(sgu.ref[:Is], sgu.ref[Is:], xf, dtype), tol(dtype), "shared")
        a = act.astype(np.float64)
        y, bound = down_ref([down.ref[ids[s]] for s in range(k)], [a[s, :inter] for s in range(k)], w, dtype,
                            (sdown.ref, a[k], logits[n_experts]))
        assert_close(xd, x0 + y, np.abs(x0) + bound, tol(dtype))
        assert_close(mlp, *gate_up_ref(gu.ref[:inter], gu.ref[inter:], xf, dtype), tol(dtype), "mlp")
        v = variant(fmt)
        assert not SIM or [r["kernel"] for r in dev.records()] == [f"moe_gate_up_{v}_{dtype}", f"moe_down_{v}_{dtype}",
                                                                   f"mlp_gate_up_{v}_{dtype}"]


def test_moe_qn_pairing_checks():
    """Routed experts and the shared expert run in one dispatch at two quantized widths only with one scale
    type (the qn kernel takes a width each), never quantized beside dense: then the shared expert runs apart
    (test_shared_expert_apart), and moe_down needs a buffer for it; gate and up of one format."""
    rng = np.random.default_rng(1)
    gate, up = make(rng, "q2_sbf16", (4, 16, 128), 64), make(rng, "q2_sbf16", (4, 16, 128), 64)
    up3 = make(rng, "q3_sbf16", (4, 16, 128), 64)
    down = make(rng, "q3_sbf16", (4, 128, 64), 32)
    sh_f32, sh_dense = make(rng, "q4_sf32", (32, 128), 64), make(rng, "bf16", (32, 128))
    sd_dense = make(rng, "bf16", (128, 64))
    act, ids, w = np.zeros((3, 16), np.float32), np.zeros(2, np.uint32), np.zeros(2, np.float32)
    x, logits = np.zeros(128, np.float32), np.zeros(5, np.float32)
    with run() as (dev, enc, b):
        buf = raw(b)
        G, U = gate.device(buf, gpu), up.device(buf, gpu)
        assert not ops.can_pair(G, sh_f32.device(buf, gpu)) and not ops.can_pair(G, sh_dense.device(buf, gpu))
        with pytest.raises(ValueError, match=r"moe_gate_up: up \(qn_sbf16, q3\) must have the format of gate "
                                             r"\(qn_sbf16, q2\)"):
            ops.moe_gate_up(enc, "f32", G, up3.device(buf, gpu), None, buf(x), buf(ids), 2, buf(act))
        with pytest.raises(ValueError, match=r"moe_down: shared_down \(bf16\) cannot run in one dispatch with the "
                                             r"routed experts \(qn_sbf16\): give shared_out"):
            ops.moe_down(enc, "f32", down.device(buf, gpu), sd_dense.device(buf, gpu),
                         buf(np.zeros((3, 64), np.float32)), buf(ids), buf(w), buf(logits), 4, 2, buf(x))
        assert enc.dispatches == 0


@pytest.mark.parametrize("fmt,dtype", [("q2_sbf16", "bf16"), ("q3_sf32", "f32")])
def test_moe_prefill_block_qn(fmt, dtype):
    """The prefill MoE block (ops::moe_prefill) of an mlx-q4-e2/e3 layer: routed experts at 2 or 3 bits through the
    grouped qn GEMMs, the 4-bit shared expert through its own GEMMs, against reference.sparse_moe + the residual."""
    M, E, k, H, I, Is = 20, 6, 2, 128, 64, 64
    blk = Block(np.random.default_rng(fmt_bits(fmt)), dtype, M, E, k, H, I, Is, fmt=fmt,
                shared_fmt="q4_" + fmt.split("_")[1])
    sc = prefill_scratch(dtype, M, E, k, H, I, Is)
    with run("random", seed=M, keep_records=True) as (dev, enc, b):
        blk.encode(enc, raw(b), {n: raw(b)(a) for n, a in sc.items()})
    names = [r["kernel"] for r in dev.records()] if SIM else []
    assert not SIM or names[-3:-1] == [f"gemm_{variant(fmt)}_{dtype}", f"gemm_{variant(fmt)}_{dtype}" +
                                       ("_f32out" if dtype == "bf16" else "")]
    want_ids, want = blk.reference()
    np.testing.assert_array_equal(sc["ids"], want_ids)
    blk.check_rows(want)


# ================================================================================== union-read: R rows at once
def _rows_case(rng, fmt, dtype, R, E, k, inter, shared, H, gs, shared_fmt=None, pad=0):
    """Weights, R rows' routing (few experts: the rows share many) and inputs of the union-read MoE."""
    shared_fmt = shared_fmt or fmt
    c = SimpleNamespace(R=R, k=k, inter=inter, shared=shared, H=H, E=E)
    c.gate, c.up = make(rng, fmt, (E, inter, H), gs), make(rng, fmt, (E, inter, H), gs)
    c.sgu = make(rng, shared_fmt, (2 * shared, H), gs) if shared else None
    c.down = make(rng, fmt, (E, H, inter), gs)
    c.sdown = make(rng, shared_fmt, (H, shared), gs) if shared else None
    c.ids = np.stack([rng.choice(E, k, replace=False) for _ in range(R)]).astype(np.uint32)
    c.w = np.stack([rng.dirichlet(np.ones(k)) for _ in range(R)]).astype(np.float32)
    c.logits = (rng.standard_normal((R, E + 1)) * 2).astype(np.float32)
    c.stride = max(inter, shared)
    c.slots = k + (1 if shared else 0)
    c.xs = H + pad                       # x rows and act rows padded apart (the graph's scratch rows)
    c.ar = (k + 1) * c.stride + pad
    c.x = rng.standard_normal((R, c.xs)).astype(ACT[dtype])
    return c


def _rows_vs_single(c, dtype, schedule="forward", seed=0):
    """The union-read kernels on all rows, and the single-row kernels row by row on the same inputs:
    (act, x) of both."""
    R, k = c.R, c.k
    act_rows = np.full((R, c.ar), 7, ACT[dtype])
    act_one = np.full((R, c.ar), 7, ACT[dtype])
    with run(schedule, seed=seed, keep_records=True) as (dev, enc, b):
        buf = raw(b)
        g, u, d = c.gate.device(buf, gpu), c.up.device(buf, gpu), c.down.device(buf, gpu)
        sgu = c.sgu.device(buf, gpu) if c.sgu else None
        ops.moe_gate_up_rows(enc, dtype, g, u, sgu, buf(c.x), buf(c.ids), k, buf(act_rows), R, c.xs, c.ar)
    with run(schedule, seed=seed) as (dev, enc, b):
        buf = raw(b)
        g, u = c.gate.device(buf, gpu), c.up.device(buf, gpu)
        sgu = c.sgu.device(buf, gpu) if c.sgu else None
        for r in range(R):
            ops.moe_gate_up(enc, dtype, g, u, sgu, buf(c.x[r, :c.H].copy()), buf(c.ids[r].copy()), k,
                            buf(act_one[r]))
    # the down projection from the same activations (the single-row ones)
    act = act_one.copy()
    x_rows, x_one = c.x.copy(), c.x.copy()
    with run(schedule, seed=seed, keep_records=True) as (dev, enc, b):
        buf = raw(b)
        d = c.down.device(buf, gpu)
        sd = c.sdown.device(buf, gpu) if c.sdown else None
        out = np.zeros((R, c.H), np.float32)
        ops.moe_down_rows(enc, dtype, d, sd, buf(act), buf(c.ids), buf(c.w), buf(c.logits) if c.shared else None,
                          c.E + 1, c.E, k, buf(x_rows), R, c.xs, c.ar, shared_out=buf(out))
    with run(schedule, seed=seed) as (dev, enc, b):
        buf = raw(b)
        d = c.down.device(buf, gpu)
        sd = c.sdown.device(buf, gpu) if c.sdown else None
        for r in range(R):
            xr = np.ascontiguousarray(x_one[r, :c.H])
            out = np.zeros(c.H, np.float32)
            ops.moe_down(enc, dtype, d, sd, buf(act[r].copy()), buf(c.ids[r].copy()), buf(c.w[r].copy()),
                         buf(c.logits[r].copy()) if c.shared else None, c.E, k, buf(xr), shared_out=buf(out))
            x_one[r, :c.H] = xr
    return act_rows, act_one, x_rows, x_one


def _same_bits(a, b, what):
    assert a.tobytes() == b.tobytes(), f"{what}: not bit for bit the single-row kernels' " \
        f"(max diff {np.abs(a.astype(np.float64) - b.astype(np.float64)).max()})"


@pytest.mark.parametrize("schedule", SCHEDULES)
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(FORMATS + QN_FORMATS[:1]), dtype=st.sampled_from(["f32", "bf16"]), R=st.integers(1, 7),
       E=st.integers(1, 9), k=st.integers(1, 4), m=st.integers(1, 3), sm=st.integers(0, 3), pad=st.sampled_from([0, 4]),
       seed=st.integers(0, 2**31 - 1))
def test_moe_rows_union_read_is_the_single_row_kernels(schedule, fmt, dtype, R, E, k, m, sm, pad, seed):
    """moe_gate_up_rows / moe_down_rows over R rows whose routings overlap (E small): every row's activations
    and residual bit for bit moe_gate_up's / moe_down's on that row alone (ids given, not fused)."""
    rng = np.random.default_rng(seed)
    k = min(k, E)
    gs = 32
    H = cols_for(fmt, gs, 2)
    c = _rows_case(rng, fmt, dtype, R, E, k, cols_for(fmt, gs, m), cols_for(fmt, gs, sm), H, gs, pad=pad)
    act_rows, act_one, x_rows, x_one = _rows_vs_single(c, dtype, schedule, seed)
    _same_bits(act_rows, act_one, "act")
    _same_bits(x_rows, x_one, "x")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_moe_rows_sixteen_rows_real_routing_width(dtype):
    """16 rows, top-8 of 12 experts (every expert shared by many rows; more than MOE_ROWS_MB rows per
    expert), with a shared expert: bit for bit the single-row kernels."""
    rng = np.random.default_rng(3)
    c = _rows_case(rng, "q4_sbf16", dtype, 16, 12, 8, 64, 64, 128, 64)
    act_rows, act_one, x_rows, x_one = _rows_vs_single(c, dtype, "random", 7)
    _same_bits(act_rows, act_one, "act")
    _same_bits(x_rows, x_one, "x")


@pytest.mark.parametrize("routed,shared_fmt", APART[:2])
def test_moe_rows_shared_expert_apart(routed, shared_fmt):
    """A shared expert the routed kernel cannot read: mlp_gate_up per row and qmv over the rows, combined as
    the single-row kernels combine it."""
    rng = np.random.default_rng(9)
    c = _rows_case(rng, routed, "f32", 3, 4, 2, 64, 128, 128, 64, shared_fmt=shared_fmt)
    act_rows, act_one, x_rows, x_one = _rows_vs_single(c, "f32")
    _same_bits(act_rows, act_one, "act")
    _same_bits(x_rows, x_one, "x")


def test_moe_rows_declared_bytes_and_checks():
    """The union kernels declare the modelled union's expert rows (moe_expected_union), and reject row counts
    and strides they cannot run."""
    assert ops.moe_expected_union(256, 8, 1) == pytest.approx(8)
    assert ops.moe_expected_union(256, 8, 4) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 4))
    rng = np.random.default_rng(1)
    c = _rows_case(rng, "q4_sbf16", "f32", 2, 6, 2, 32, 0, 64, 32)
    act = np.zeros((2, c.ar), np.float32)
    with run() as (dev, enc, b):
        buf = raw(b)
        g, u = c.gate.device(buf, gpu), c.up.device(buf, gpu)
        with pytest.raises(ValueError, match="rows must be in"):
            ops.moe_gate_up_rows(enc, "f32", g, u, None, buf(c.x), buf(c.ids), 2, buf(act), 17)
        with pytest.raises(ValueError, match="multiples of 4"):
            ops.moe_gate_up_rows(enc, "f32", g, u, None, buf(c.x), buf(c.ids), 2, buf(act), 2, 66)
        assert enc.dispatches == 0


@pytest.mark.parametrize("schedule", SCHEDULES)
@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(R=st.integers(1, 4), E=st.integers(1, 40), k=st.integers(1, 8), norm=st.booleans(), ties=st.booleans(),
       shared=st.booleans(), dtype=st.sampled_from(["f32", "bf16"]), seed=st.integers(0, 2**31 - 1))
def test_moe_gate_up_rows_fused_topk(schedule, R, E, k, norm, ties, shared, dtype, seed):
    """The router top-k fused into moe_gate_up_rows (up to 4 rows): the ids and weights moe_topk_rows writes,
    and every row's activations bit for bit moe_gate_up's with its own fused top-k."""
    rng = np.random.default_rng(seed)
    k = min(k, E)
    H, inter, Is = 64, 32, 32 if shared else 0
    c = _rows_case(rng, "q4_sbf16", dtype, R, E, k, inter, Is, H, 32)
    stride = E + 1 + 2                                       # padded logit rows
    logits = np.zeros((R, stride), np.float32)
    logits[:, :E + 1] = rng.integers(-3, 3, (R, E + 1)) if ties else rng.standard_normal((R, E + 1))
    ids, w = np.full((R, k), 99, np.uint32), np.full((R, k), 7, np.float32)
    want_ids, want_w = np.full((R, k), 99, np.uint32), np.full((R, k), 7, np.float32)
    act_rows = np.full((R, c.ar), 7, ACT[dtype])
    act_one = np.full((R, c.ar), 7, ACT[dtype])
    with run(schedule, seed=seed, keep_records=True) as (dev, enc, b):
        buf = raw(b)
        g, u = c.gate.device(buf, gpu), c.up.device(buf, gpu)
        sgu = c.sgu.device(buf, gpu) if c.sgu else None
        lb = buf(logits)
        ops.moe_topk_rows(enc, dtype, lb, R, stride, E, k, norm, buf(want_ids), buf(want_w))
        ops.moe_gate_up_rows(enc, dtype, g, u, sgu, buf(c.x), buf(ids), k, buf(act_rows), R, c.xs, c.ar,
                             logits=lb, logits_stride=stride, n_experts=E, norm=norm, weights=buf(w))
    assert not SIM or [r["kernel"] for r in dev.records()][-1] == f"moe_gate_up_rows_q4_sbf16_{dtype}"
    with run(schedule, seed=seed) as (dev, enc, b):
        buf = raw(b)
        g, u = c.gate.device(buf, gpu), c.up.device(buf, gpu)
        sgu = c.sgu.device(buf, gpu) if c.sgu else None
        for r in range(R):
            one_ids, one_w = np.zeros(k, np.uint32), np.zeros(k, np.float32)
            ops.moe_gate_up(enc, dtype, g, u, sgu, buf(c.x[r, :H].copy()), buf(one_ids), k, buf(act_one[r]),
                            logits=buf(logits[r].copy()), n_experts=E, norm=norm, weights=buf(one_w))
    np.testing.assert_array_equal(ids, want_ids)
    _same_bits(w, want_w, "weights")
    _same_bits(act_rows, act_one, "act")


def test_moe_gate_up_rows_fused_topk_checks():
    rng = np.random.default_rng(2)
    c = _rows_case(rng, "q4_sbf16", "f32", 5, 6, 2, 32, 0, 64, 32)
    logits = np.zeros((5, 7), np.float32)
    w = np.zeros((5, 2), np.float32)
    act = np.zeros((5, c.ar), np.float32)
    with run() as (dev, enc, b):
        buf = raw(b)
        g, u = c.gate.device(buf, gpu), c.up.device(buf, gpu)
        with pytest.raises(ValueError, match="fused top-k takes at most 4 rows"):
            ops.moe_gate_up_rows(enc, "f32", g, u, None, buf(c.x), buf(c.ids), 2, buf(act), 5, logits=buf(logits),
                                 logits_stride=7, n_experts=6, weights=buf(w))
        with pytest.raises(ValueError, match="needs both logits and weights"):
            ops.moe_gate_up_rows(enc, "f32", g, u, None, buf(c.x), buf(c.ids), 2, buf(act), 2, logits=buf(logits))
        assert enc.dispatches == 0

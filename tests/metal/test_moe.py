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
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwenmetal import reference

from .gpu_harness import ACT, BF16, SCHEDULES, SIM, gpu, ops, rel_err, run
from .wmat import FORMATS, assert_close, cols_for, make, raw

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

"""Attention family (metal/attention.metal) through its host functions on the simulator device.

attn_prepare (q/k norm + RoPE + KV write) against the reference's rms_norm / rope; attention_decode on
every route (single pass, split-K + combine, bounded two-pass; with and without GQA packing) against
float64 softmax attention on exactly the q, K, V and gate the kernels see; prepare + decode over many
steps against reference.full_attention; the real model's attention shape once. Prefill: attn_prepare over
M rows against M decode prepares (bit for bit); attention_prefill against float64 causal attention (GQA
1/2/3/8, p0 > 0, M not a multiple of the query block, head_dim 8..256), without the causal mask and with a
sliding window (a DFlash draft's block), and, after prepare, a prompt as one
chunk and as several against reference.full_attention (the chunked run bit-equal to the single one).
Simulator-verified, hardware-unverified.
"""
from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwenmetal.backends import reference as R
from qwenmetal.testing import random_params

from .gpu_harness import ACT, BF16, SCHEDULES, assert_bf16, ops, rel_err, run

DT = {"f32": "float32", "bf16": "bfloat16"}
TOL = {"f32": 1e-5, "bf16": 1e-2}
LONG_MAX_PARTIALS = 32          # metal/attention.h ATTN_LONG_MAX_PARTIALS
# ops.attention_prefill_geometry's tuple
GEOMETRY = ("block_rows", "tile_keys", "threads", "blocks", "heads_per_tg", "chunks", "head_dim_max")


def shape_kw(nh, nkv, hd, cap, gate, kv):
    return dict(n_heads=nh, n_kv_heads=nkv, head_dim=hd, capacity=cap, output_gate=gate, kv_dtype=DT[kv])


def partials(route, n, pol):
    if route == "single":
        return 1
    if route == "split":
        return -(-n // pol.get("split_block", 32))
    return min(-(-n // pol.get("long_block", 32)), LONG_MAX_PARTIALS)


def gated_out(o, g, bf16):
    """o times sigmoid(g); bf16: rounded where the kernels round, T(T(o) T(sigmoid(g))) (T(o) without a gate)"""
    r = (lambda v: np.asarray(v, np.float64).astype(np.float32).astype(BF16).astype(np.float64)) if bf16 \
        else (lambda v: v)
    if g is None:
        return r(o)
    return r(r(o) * r(1.0 / (1.0 + np.exp(-np.asarray(g, np.float64)))))


def check_out(o, ref, tol, what=""):
    """bf16 outputs against a reference rounded where the kernel rounds (gpu_harness.assert_bf16, ulps of
    max(|ref|, 1e-3 max|ref|): an output is a float sum of terms as large as the largest values), float
    ones within `tol` relative"""
    if np.asarray(o).dtype == BF16:   # a float reference (a float value stored as bf16) rounded once
        ref = np.asarray(ref, np.float64).astype(np.float32).astype(BF16).astype(np.float64)
        assert_bf16(o, ref, floor=1e-3 * np.abs(ref).max(), what=what)
    else:
        assert rel_err(o, ref) < tol, what


def decode_ref(q, proj, K, V, n, nh, nkv, hd, gate, bf16=False):
    """float64 gated attention on the values the kernel reads: q [nh*hd], K/V [nkv, cap, hd]; bf16: the output
    rounded as the kernel's."""
    G = nh // nkv
    q64 = np.asarray(q, np.float64).reshape(nkv, G, hd)
    K64 = np.asarray(K[:, :n], np.float64)
    V64 = np.asarray(V[:, :n], np.float64)
    s = np.einsum("jgd,jtd->jgt", q64, K64) / np.sqrt(hd)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("jgt,jtd->jgd", p, V64).reshape(nh, hd)
    g = np.asarray(proj[:nh * 2 * hd], np.float64).reshape(nh, 2 * hd)[:, hd:] if gate else None
    return gated_out(o, g, bf16).reshape(-1)


def decode_case(rng, t, kv, nh, nkv, hd, n, cap, gate):
    """q, proj (gate rows), K, V (rows >= n are NaN: never read), scratch and o NaN-filled."""
    T, KV = ACT[t], ACT[kv]
    q = (2.0 * rng.standard_normal(nh * hd)).astype(T)
    proj = rng.standard_normal(nh * (2 if gate else 1) * hd + 2 * nkv * hd).astype(T)
    K = np.full((nkv, cap, hd), np.nan, KV)
    V = np.full((nkv, cap, hd), np.nan, KV)
    K[:, :n] = rng.standard_normal((nkv, n, hd))
    V[:, :n] = rng.standard_normal((nkv, n, hd))
    return q, proj, K, V


def run_decode(schedule, t, kv, nh, nkv, hd, n, gate, pol, rng, cap=None):
    cap = cap or n + 3
    q, proj, K, V = decode_case(rng, t, kv, nh, nkv, hd, n, cap, gate)
    nbytes = ops.attention_scratch_bytes(nh, nkv, hd, n, **pol)
    scratch = np.full(max(nbytes // 4, 1), np.nan, np.float32)
    o = np.full(nh * hd, np.nan, ACT[t])
    with run(schedule, seed=n) as (dev, enc, buf):
        ops.attention_decode(enc, DT[t], buf(q), buf(proj), buf(K), buf(V), n, buf(scratch), buf(o),
                             **shape_kw(nh, nkv, hd, cap, gate, kv), **pol)
        dispatches = enc.dispatches
    route = ops.attention_route(n, **pol)
    assert dispatches == (1 if route == "single" else 2)
    if route != "single":   # exactly the partials the route promises were written
        need = nh * partials(route, n, pol) * (hd + 2)
        assert need * 4 <= nbytes
        assert not np.isnan(scratch[:need]).any()
    ref = decode_ref(q, proj, K, V, n, nh, nkv, hd, gate, t == "bf16")
    assert not np.isnan(np.asarray(o, np.float64)).any()
    check_out(o, ref, TOL[t], route)
    return route


# ----------------------------------------------------------------------------------------------- routes
def test_route_and_scratch_bytes():
    """The default policy: one pass only up to 64 keys, blocks of 32 keys beyond (at most 32 partials per head)."""
    assert ops.attention_route(1) == "single"
    assert ops.attention_route(64) == "single"
    assert ops.attention_route(65) == "split"
    assert ops.attention_route(1024) == "split"
    assert ops.attention_route(1025) == "two_pass"
    pol = dict(single_pass_max=8, split_max=40, split_block=4, long_block=2)
    assert [ops.attention_route(n, **pol) for n in (8, 9, 40, 41)] == ["single", "split", "split", "two_pass"]
    per = 16 * (256 + 2) * 4    # bytes per partial of every head, real model
    assert ops.attention_scratch_bytes(16, 2, 256, 64) == 0
    assert ops.attention_scratch_bytes(16, 2, 256, 65) == 3 * per
    assert ops.attention_scratch_bytes(16, 2, 256, 1024) == 32 * per
    assert ops.attention_scratch_bytes(16, 2, 256, 1025) == 32 * per
    # two-pass: bounded whatever the context
    assert ops.attention_scratch_bytes(16, 2, 256, 262144) == LONG_MAX_PARTIALS * per
    assert ops.attention_scratch_bytes(4, 1, 16, 10**6, split_max=2048, long_block=1024) == \
        max(2048 // 32, LONG_MAX_PARTIALS) * 4 * 18 * 4


# thresholds lowered so that small contexts reach every route; n_keys around each switch
POL = dict(single_pass_max=12, split_max=40, split_block=8, long_block=2)
N_AROUND = [1, 11, 12, 13, 39, 40, 41, 2 * LONG_MAX_PARTIALS + 3]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("G", [1, 2, 8])
def test_decode_every_route_f32(schedule, G):
    rng = np.random.default_rng(G)
    seen = {run_decode(schedule, "f32", "f32", 2 * G, 2, 32, n, True, POL, rng) for n in N_AROUND}
    assert seen == {"single", "split", "two_pass"}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("t,kv", [("bf16", "bf16"), ("bf16", "f32"), ("f32", "bf16")])
def test_decode_every_route_dtypes(schedule, t, kv):
    rng = np.random.default_rng(7)
    for n in (12, 13, 41, 200):
        run_decode(schedule, t, kv, 8, 1, 64, n, True, POL, rng)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_decode_without_gqa_packing(schedule):
    rng = np.random.default_rng(3)
    pol = dict(POL, gqa_pack=False)
    for n in (12, 13, 41, 150):
        run_decode(schedule, "f32", "f32", 8, 2, 16, n, True, pol, rng)
        run_decode(schedule, "bf16", "bf16", 6, 3, 16, n, False, pol, rng)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(nkv=st.integers(1, 3), G=st.sampled_from([1, 2, 3, 5, 8, 9, 12]),
       hd=st.sampled_from([6, 8, 16, 18, 24, 32, 40, 64, 128]), n=st.integers(1, 90),
       gate=st.booleans(), t=st.sampled_from(["f32", "bf16"]), kv=st.sampled_from(["f32", "bf16"]),
       spm=st.integers(0, 40), sb=st.integers(1, 16), lb=st.integers(1, 8), extra=st.integers(0, 40),
       pack=st.booleans(), schedule=st.sampled_from(SCHEDULES), seed=st.integers(0, 2**16))
def test_decode_hypothesis(nkv, G, hd, n, gate, t, kv, spm, sb, lb, extra, pack, schedule, seed):
    pol = dict(single_pass_max=spm, split_max=spm + extra, split_block=sb, long_block=lb, gqa_pack=pack)
    run_decode(schedule, t, kv, G * nkv, nkv, hd, n, gate, pol, np.random.default_rng(seed), cap=n + seed % 5)


def test_decode_two_pass_scratch_bounded():
    """At a context 40x past the partial bound the scratch sized by attention_scratch_bytes still suffices."""
    pol = dict(single_pass_max=4, split_max=8, split_block=4, long_block=1)
    n = 40 * LONG_MAX_PARTIALS
    assert ops.attention_scratch_bytes(3, 1, 8, n, **pol) == LONG_MAX_PARTIALS * 3 * 10 * 4
    run_decode("random", "f32", "bf16", 3, 1, 8, n, True, pol, np.random.default_rng(1))


# ---------------------------------------------------------------------------------------------- prepare
def prepare_case(rng, t, kv, nh, nkv, hd, cap, gate):
    T, KV = ACT[t], ACT[kv]
    proj = (3.0 * rng.standard_normal(nh * (2 if gate else 1) * hd + 2 * nkv * hd)).astype(T)
    qw = (1.0 + 0.2 * rng.standard_normal(hd)).astype(T)
    kw = (1.0 + 0.2 * rng.standard_normal(hd)).astype(T)
    K = rng.standard_normal((nkv, cap, hd)).astype(KV)
    V = rng.standard_normal((nkv, cap, hd)).astype(KV)
    return proj, qw, kw, K, V


def prepare_ref(t, proj, qw, kw, nh, nkv, hd, rd, gate, pos, theta, eps):
    """reference.py's q/k norm + RoPE (float32, or its bf16 mode) of one token: q [nh, hd], k, v [nkv, hd]."""
    bf16 = t == "bf16"
    r = R.to_bf16 if bf16 else (lambda a: np.asarray(a, np.float32))
    f = np.asarray(proj, np.float32)
    qs = (2 if gate else 1) * hd
    q = f[:nh * qs].reshape(nh, qs)[:, :hd]
    k = f[nh * qs:nh * qs + nkv * hd].reshape(nkv, hd)
    v = f[nh * qs + nkv * hd:].reshape(nkv, hd)
    qn = R.rms_norm(q, np.asarray(qw, np.float32), eps, bf16=bf16)
    kn = R.rms_norm(k, np.asarray(kw, np.float32), eps, bf16=bf16)
    pos_a = np.array([pos])
    qn = r(R.rope(qn[None], pos_a, rd, theta)[0]) if rd else qn
    kn = r(R.rope(kn[None], pos_a, rd, theta)[0]) if rd else kn
    return qn, kn, v


def run_prepare(schedule, t, kv, nh, nkv, hd, rd, gate, pos, cap, rng, theta=1e7, eps=1e-6):
    proj, qw, kw, K, V = prepare_case(rng, t, kv, nh, nkv, hd, cap, gate)
    K0, V0 = K.copy(), V.copy()
    qo = np.full(nh * hd, np.nan, ACT[t])
    with run(schedule, seed=pos) as (dev, enc, buf):
        ops.attn_prepare(enc, DT[t], buf(proj), buf(qw), buf(kw), pos, buf(K), buf(V), buf(qo), n_heads=nh,
                         n_kv_heads=nkv, head_dim=hd, rotary_dim=rd, capacity=cap, output_gate=gate,
                         rope_theta=theta, eps=eps, kv_dtype=DT[kv])
    qn, kn, v = prepare_ref(t, proj, qw, kw, nh, nkv, hd, rd, gate, pos, theta, eps)
    tol = max(TOL[t], TOL[kv])
    check_out(qo.reshape(nh, hd), qn, TOL[t])
    check_out(K[:, pos], kn, tol)
    check_out(V[:, pos], v, tol)
    # no other cache row moved
    others = np.arange(cap) != pos
    assert np.array_equal(K[:, others], K0[:, others]) and np.array_equal(V[:, others], V0[:, others])


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("t,kv", [("f32", "f32"), ("f32", "bf16"), ("bf16", "f32"), ("bf16", "bf16")])
def test_prepare(schedule, t, kv):
    rng = np.random.default_rng(11)
    run_prepare(schedule, t, kv, 4, 2, 32, 16, True, 5, 9, rng)
    run_prepare(schedule, t, kv, 3, 1, 24, 24, False, 0, 3, rng)


def test_prepare_long_position():
    """At position 2e5 the angle is ~2e5 rad: the float32 product must match the reference's bit for bit."""
    run_prepare("forward", "f32", "f32", 2, 1, 16, 12, True, 200_000, 200_001, np.random.default_rng(5))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(nkv=st.integers(1, 3), G=st.sampled_from([1, 2, 3, 8]), hd=st.sampled_from([2, 6, 16, 24, 40, 64, 256, 320]),
       rot=st.floats(0.0, 1.0), gate=st.booleans(), t=st.sampled_from(["f32", "bf16"]),
       kv=st.sampled_from(["f32", "bf16"]), pos=st.integers(0, 2000), schedule=st.sampled_from(SCHEDULES),
       theta=st.sampled_from([1e4, 1e6, 1e7]))
def test_prepare_hypothesis(nkv, G, hd, rot, gate, t, kv, pos, schedule, theta):
    rd = 2 * int(rot * min(hd, 256) / 2)
    run_prepare(schedule, t, kv, G * nkv, nkv, hd, rd, gate, pos, pos + 2, np.random.default_rng(pos),
                theta=theta)


# -------------------------------------------------------------------------------------------- multi-step
def full_attention_case(t, nh, nkv, hd, rd, H, L, seed):
    """reference.full_attention over L tokens (identity o_proj) and the stacked projection rows it starts from."""
    cfg = types.SimpleNamespace(num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd, rotary_dim=rd,
                                rope_theta=1e6, rms_norm_eps=1e-6, attn_output_gate=True)
    rng = np.random.default_rng(seed)
    T = ACT[t]
    rnd = lambda *s: np.asarray(rng.standard_normal(s) / np.sqrt(H), np.float32).astype(T).astype(np.float32)
    p = {"q_proj": rnd(nh * 2 * hd, H) * 3, "k_proj": rnd(nkv * hd, H) * 3, "v_proj": rnd(nkv * hd, H),
         "o_proj": np.eye(nh * hd, dtype=np.float32),
         "q_norm": (1 + 0.1 * rng.standard_normal(hd)).astype(T).astype(np.float32),
         "k_norm": (1 + 0.1 * rng.standard_normal(hd)).astype(T).astype(np.float32)}
    x = rng.standard_normal((L, H)).astype(T).astype(np.float32)
    empty = np.zeros((nkv, 0, hd), np.float32)
    ref, Kref, Vref = R.full_attention(x, p, cfg, empty, empty, 0, bf16=t == "bf16")
    lin = (lambda w: R.to_bf16(x @ w.T)) if t == "bf16" else (lambda w: x @ w.T)
    proj = np.ascontiguousarray(np.concatenate([lin(p[k]) for k in ("q_proj", "k_proj", "v_proj")], axis=1).astype(T))
    return proj, p["q_norm"].astype(T), p["k_norm"].astype(T), ref, Kref, Vref


@pytest.mark.parametrize("t,kv,schedule,fused", [("f32", "f32", "forward", False), ("f32", "bf16", "reverse", True),
                                                 ("bf16", "bf16", "random", True)])
def test_multistep_against_full_attention(t, kv, schedule, fused):
    """L decode steps in one command buffer (prepare at position i, then attend over the i + 1 keys the
    earlier prepares wrote; the routes change on the way; fused: the decode graph's attention_decode_prepared)
    against reference.full_attention over all L."""
    nh, nkv, hd, rd, H, L = 6, 2, 16, 8, 24, 30
    proj, qw, kw, ref, Kref, _ = full_attention_case(t, nh, nkv, hd, rd, H, L, 2)
    T = ACT[t]
    cap = L + 2
    K = np.zeros((nkv, cap, hd), ACT[kv])
    V = np.zeros((nkv, cap, hd), ACT[kv])
    qo = np.zeros(nh * hd, T)
    o = np.full((L, nh * hd), np.nan, T)
    pol = dict(single_pass_max=7, split_max=18, split_block=3, long_block=2)
    nbytes = ops.attention_scratch_bytes(nh, nkv, hd, L, **pol)
    scratch = np.zeros(nbytes // 4, np.float32)
    kw_shape = dict(n_heads=nh, n_kv_heads=nkv, head_dim=hd, capacity=cap, output_gate=True, kv_dtype=DT[kv])
    with run(schedule) as (dev, enc, buf):
        bproj, bK, bV, bq, bo, bs = buf(proj), buf(K), buf(V), buf(qo), buf(o), buf(scratch)
        row_p, row_o = proj.shape[1] * proj.itemsize, nh * hd * o.itemsize
        for i in range(L):
            pi = bproj.view(i * row_p, row_p)
            if fused:
                ops.attention_decode_prepared(enc, DT[t], pi, buf(qw), buf(kw), i, bK, bV, bs, bo.view(i * row_o, row_o),
                                              rotary_dim=rd, rope_theta=1e6, eps=1e-6, **kw_shape, **pol)
                continue
            ops.attn_prepare(enc, DT[t], pi, buf(qw), buf(kw), i, bK, bV, bq, rotary_dim=rd, rope_theta=1e6,
                             eps=1e-6, **kw_shape)
            ops.attention_decode(enc, DT[t], bq, pi, bK, bV, i + 1, bs, bo.view(i * row_o, row_o), **kw_shape,
                                 **pol)
    assert {ops.attention_route(i + 1, **pol) for i in range(L)} == {"single", "split", "two_pass"}
    tol = max(TOL[t], TOL[kv])
    check_out(K[:, :L], Kref, tol)
    check_out(o, ref, (3e-5 if tol < 1e-3 else 2e-2))


# ------------------------------------------------------------------------------------------- real shape
@pytest.mark.parametrize("t,kv", [("f32", "f32"), ("bf16", "bf16")])
def test_real_model_shape(t, kv):
    """Qwen3.6 full attention: 16 q / 2 kv heads x 256, rotary 64, theta 1e7, output gate; token at
    position 599 (600 keys, default policy: split-K, 19 blocks of 32 keys), then the single pass and the two-pass
    routes at the same context (two-pass: 75 blocks of 8 keys into 32 partials)."""
    nh, nkv, hd, rd, pos = 16, 2, 256, 64, 599
    cap = 640
    rng = np.random.default_rng(600)
    proj, qw, kw, K, V = prepare_case(rng, t, kv, nh, nkv, hd, cap, True)
    qo = np.zeros(nh * hd, ACT[t])
    outs = []
    for pol in ({}, dict(single_pass_max=1024), dict(single_pass_max=64, split_max=128, long_block=8)):
        o = np.full(nh * hd, np.nan, ACT[t])
        nbytes = ops.attention_scratch_bytes(nh, nkv, hd, pos + 1, **pol)
        scratch = np.zeros(max(nbytes // 4, 1), np.float32)
        with run("random") as (dev, enc, buf):
            ops.attn_prepare(enc, DT[t], buf(proj), buf(qw), buf(kw), pos, buf(K), buf(V), buf(qo), n_heads=nh,
                             n_kv_heads=nkv, head_dim=hd, rotary_dim=rd, capacity=cap, rope_theta=1e7, eps=1e-6,
                             kv_dtype=DT[kv])
            ops.attention_decode(enc, DT[t], buf(qo), buf(proj), buf(K), buf(V), pos + 1, buf(scratch), buf(o),
                                 n_heads=nh, n_kv_heads=nkv, head_dim=hd, capacity=cap, kv_dtype=DT[kv], **pol)
        outs.append(o)
    qn, kn, v = prepare_ref(t, proj, qw, kw, nh, nkv, hd, rd, True, pos, 1e7, 1e-6)
    check_out(qo.reshape(nh, hd), qn, TOL[t])
    check_out(K[:, pos], kn, TOL[kv])
    ref = decode_ref(qo, proj, K, V, pos + 1, nh, nkv, hd, True, t == "bf16")
    for o in outs:
        check_out(o, ref, TOL[t])


@pytest.mark.parametrize("pol,chunks", [({}, 1), (dict(single_pass_max=8), 1), (dict(gqa_pack=False), 4)])
def test_declared_bytes(pol, chunks):
    """The encoder's costing: each kv head's first n_keys rows once per head chunk (once with GQA packing)."""
    nh, nkv, hd, cap, n = 8, 2, 16, 40, 30
    rng = np.random.default_rng(0)
    proj, qw, kw, K, V = prepare_case(rng, "bf16", "f32", nh, nkv, hd, cap, True)
    q, o = np.zeros(nh * hd, ACT["bf16"]), np.zeros(nh * hd, ACT["bf16"])
    scratch = np.zeros(max(ops.attention_scratch_bytes(nh, nkv, hd, n, **pol) // 4, 1), np.float32)
    with run() as (dev, enc, buf):
        ops.attn_prepare(enc, "bfloat16", buf(proj), buf(qw), buf(kw), n - 1, buf(K), buf(V), buf(q), n_heads=nh,
                         n_kv_heads=nkv, head_dim=hd, rotary_dim=hd, capacity=cap, kv_dtype="float32")
        assert (enc.bytes_read, enc.bytes_written) == ((nh * hd + 2 * nkv * hd) * 2 + 2 * hd * 2,
                                                       nh * hd * 2 + 2 * nkv * hd * 4)
    with run() as (dev, enc, buf):
        ops.attention_decode(enc, "bfloat16", buf(q), buf(proj), buf(K), buf(V), n, buf(scratch), buf(o),
                             n_heads=nh, n_kv_heads=nkv, head_dim=hd, capacity=cap, kv_dtype="float32", **pol)
        kv_read = 2 * nkv * n * hd * 4 * chunks
        io = 2 * nh * hd * 2                                      # q and the gate read (T)
        if ops.attention_route(n, **pol) == "single":
            assert (enc.bytes_read, enc.bytes_written) == (io + kv_read, nh * hd * 2)
        else:
            part = nh * partials("split", n, pol) * (hd + 2) * 4
            assert (enc.bytes_read, enc.bytes_written) == (io + kv_read + part, nh * hd * 2 + part)
            assert enc.levels == 2                                # the combine waits for pass 1


# ----------------------------------------------------------------------------------------- argument checks
def test_argument_checks():
    nh, nkv, hd, cap = 4, 2, 16, 8
    f = lambda *s: np.zeros(s, np.float32)
    proj, qw, q, o = f(nh * 2 * hd + 2 * nkv * hd), f(hd), f(nh * hd), f(nh * hd)
    K, V, scratch = f(nkv, cap, hd), f(nkv, cap, hd), f(4)
    kws = dict(n_heads=nh, n_kv_heads=nkv, head_dim=hd, capacity=cap, kv_dtype="float32")
    with run() as (dev, enc, buf):
        def prep(**over):
            a = dict(proj=buf(proj), position=3, k_cache=buf(K), q_out=buf(q), rotary_dim=8, **kws)
            a.update(over)
            ops.attn_prepare(enc, "float32", a.pop("proj"), buf(qw), buf(qw), a.pop("position"), a.pop("k_cache"),
                             buf(V), a.pop("q_out"), **a)

        def dec(**over):
            a = dict(proj=buf(proj), n_keys=5, scratch=buf(scratch), o=buf(o), **kws)
            a.update(over)
            ops.attention_decode(enc, "float32", buf(q), a.pop("proj"), buf(K), buf(V), a.pop("n_keys"),
                                 a.pop("scratch"), a.pop("o"), **a)

        for bad, match in ((dict(proj=buf(proj[:-1])), r"attn_prepare: proj holds \d+ bytes, needs"),
                           (dict(position=cap), r"attn_prepare: position 8 outside a cache of 8 rows"),
                           (dict(k_cache=buf(K[:1])), r"attn_prepare: k cache holds \d+ bytes, needs"),
                           (dict(q_out=buf(q[:-1])), r"attn_prepare: q_out holds \d+ bytes, needs"),
                           (dict(rotary_dim=7), r"rotary_dim \(7\) must be even"),
                           (dict(rotary_dim=18), r"rotary_dim \(18\) must be even, at most head_dim"),
                           (dict(n_heads=3), r"n_heads \(3\) must be a multiple of n_kv_heads \(2\)"),
                           (dict(capacity=cap + 1), r"attn_prepare: k cache holds \d+ bytes, needs")):
            with pytest.raises(ValueError, match=match):
                prep(**bad)
        for bad, match in ((dict(n_keys=0), r"n_keys 0 outside 1 \.\. capacity 8"),
                           (dict(n_keys=cap + 1), r"n_keys 9 outside 1 \.\. capacity 8"),
                           (dict(o=buf(o[:-1])), r"attention_decode: o holds \d+ bytes, needs"),
                           (dict(proj=buf(proj[:nh * hd])), r"attention_decode: proj holds \d+ bytes, needs"),
                           (dict(single_pass_max=2), r"scratch \(split route\) holds \d+ bytes, needs"),
                           (dict(single_pass_max=2, scratch=None), r"scratch \(split route\) is not set"),
                           (dict(n_heads=5), r"n_heads \(5\) must be a multiple of n_kv_heads \(2\)"),
                           (dict(head_dim=512, capacity=1), r"head_dim 512 above the kernels' 256"),
                           (dict(split_block=0), r"split_block and long_block must be positive")):
            with pytest.raises(ValueError, match=match):
                dec(**bad)
        dec(scratch=None)                         # the single-pass route needs no scratch
        dec(output_gate=False, proj=buf(proj[:1]))  # nor proj without the output gate
        with pytest.raises(ValueError, match=r"attention_scratch_bytes: split_block and long_block must be positive"):
            ops.attention_scratch_bytes(nh, nkv, hd, 10, long_block=0)


# ---------------------------------------------------------------------------------------- prepare, rows
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("t,kv", [("f32", "f32"), ("bf16", "bf16"), ("f32", "bf16")])
def test_prepare_rows_equals_decode_prepares(schedule, t, kv):
    """One attn_prepare over `rows` rows (proj rows `stride` apart) writes bit for bit what `rows` calls of the
    decode prepare write, and each row matches the reference at its position; other cache rows untouched."""
    nh, nkv, hd, rd, rows, pos, cap = 6, 2, 24, 16, 5, 3, 11
    rng = np.random.default_rng(21)
    T, KV = ACT[t], ACT[kv]
    row_len = nh * 2 * hd + 2 * nkv * hd
    stride = row_len + 7
    proj = (3.0 * rng.standard_normal((rows, stride))).astype(T)
    qw = (1.0 + 0.2 * rng.standard_normal(hd)).astype(T)
    kw = (1.0 + 0.2 * rng.standard_normal(hd)).astype(T)
    K0 = rng.standard_normal((nkv, cap, hd)).astype(KV)
    V0 = rng.standard_normal((nkv, cap, hd)).astype(KV)
    shape = dict(n_heads=nh, n_kv_heads=nkv, head_dim=hd, rotary_dim=rd, capacity=cap, rope_theta=1e6, eps=1e-6,
                 kv_dtype=DT[kv])
    K1, V1, q1 = K0.copy(), V0.copy(), np.full((rows, nh * hd), np.nan, T)
    with run(schedule, seed=rows) as (dev, enc, buf):
        ops.attn_prepare(enc, DT[t], buf(proj), buf(qw), buf(kw), pos, buf(K1), buf(V1), buf(q1), rows=rows,
                         proj_stride=stride, **shape)
        assert enc.dispatches == 1
    K2, V2, q2 = K0.copy(), V0.copy(), np.full((rows, nh * hd), np.nan, T)
    with run(schedule) as (dev, enc, buf):
        bp, bq = buf(proj), buf(q2)
        rp, rq = stride * proj.itemsize, nh * hd * q2.itemsize
        for r in range(rows):
            ops.attn_prepare(enc, DT[t], bp.view(r * rp, row_len * proj.itemsize), buf(qw), buf(kw), pos + r,
                             buf(K2), buf(V2), bq.view(r * rq, rq), **shape)
    assert np.array_equal(q1.view(np.uint8), q2.view(np.uint8))
    assert np.array_equal(K1.view(np.uint8), K2.view(np.uint8)) and np.array_equal(V1.view(np.uint8), V2.view(np.uint8))
    tol = max(TOL[t], TOL[kv])
    for r in range(rows):
        qn, kn, v = prepare_ref(t, proj[r, :row_len], qw, kw, nh, nkv, hd, rd, True, pos + r, 1e6, 1e-6)
        check_out(q1[r].reshape(nh, hd), qn, TOL[t])
        check_out(K1[:, pos + r], kn, tol, "k"), check_out(V1[:, pos + r], v, tol, "v")
    others = (np.arange(cap) < pos) | (np.arange(cap) >= pos + rows)
    assert np.array_equal(K1[:, others], K0[:, others]) and np.array_equal(V1[:, others], V0[:, others])


@pytest.mark.parametrize("t,kv", [("f32", "f32"), ("bf16", "bf16")])
def test_prepare_mrope_positions(t, kv):
    """M-RoPE (docs/vision.md, "Positions and caches"): rows with explicit per-pair positions (pair_pos) match the
    reference's rope at those positions, cache rows still by index; rope_offset d rotates row r at pos + r + d,
    bit for bit pair_pos filled with pos + r + d; the fused decode prepare with rope_offset writes the same K row."""
    nh, nkv, hd, rd, rows, pos, cap, d = 4, 2, 32, 16, 3, 2, 8, 5
    rng = np.random.default_rng(5)
    T, KV = ACT[t], ACT[kv]
    row_len = nh * 2 * hd + 2 * nkv * hd
    proj = (3.0 * rng.standard_normal((rows, row_len))).astype(T)
    qw = (1.0 + 0.2 * rng.standard_normal(hd)).astype(T)
    kw = (1.0 + 0.2 * rng.standard_normal(hd)).astype(T)
    K0 = rng.standard_normal((nkv, cap, hd)).astype(KV)
    shape = dict(n_heads=nh, n_kv_heads=nkv, head_dim=hd, rotary_dim=rd, capacity=cap, rope_theta=1e6, eps=1e-6,
                 kv_dtype=DT[kv])

    def prepare(**kw_):
        K, V, q = K0.copy(), K0.copy(), np.full((rows, nh * hd), np.nan, T)
        with run("forward") as (dev, enc, buf):
            extra = {k: (buf(v) if k == "pair_pos" else v) for k, v in kw_.items()}
            ops.attn_prepare(enc, DT[t], buf(proj), buf(qw), buf(kw), pos, buf(K), buf(V), buf(q), rows=rows,
                             **shape, **extra)
        return q, K

    pairs = rng.integers(0, 40, (rows, rd // 2)).astype(np.int32)
    q, K = prepare(pair_pos=pairs)
    bf16 = t == "bf16"
    r = R.to_bf16 if bf16 else (lambda a: np.asarray(a, np.float32))
    f = proj.astype(np.float32)
    qn = R.rms_norm(f[:, :nh * 2 * hd].reshape(rows, nh, 2 * hd)[..., :hd], qw.astype(np.float32), 1e-6, bf16=bf16)
    kn = R.rms_norm(f[:, nh * 2 * hd:nh * 2 * hd + nkv * hd].reshape(rows, nkv, hd), kw.astype(np.float32), 1e-6,
                    bf16=bf16)
    check_out(q.reshape(rows, nh, hd), r(R.rope(qn, pairs, rd, 1e6)), TOL[t], "q")
    check_out(K[:, pos:pos + rows].transpose(1, 0, 2), r(R.rope(kn, pairs, rd, 1e6)), max(TOL[t], TOL[kv]), "k")
    q1, K1 = prepare(rope_offset=d)
    q2, K2 = prepare(pair_pos=np.repeat((pos + d + np.arange(rows, dtype=np.int32))[:, None], rd // 2, axis=1))
    assert np.array_equal(q1.view(np.uint8), q2.view(np.uint8)) and np.array_equal(K1.view(np.uint8), K2.view(np.uint8))
    # the fused decode prepare of row 0 at the same offset writes the same K row
    K3, V3, o = K0.copy(), K0.copy(), np.zeros(nh * hd, T)
    with run("forward") as (dev, enc, buf):
        ops.attention_decode_prepared(enc, DT[t], buf(proj[0]), buf(qw), buf(kw), pos, buf(K3), buf(V3), None, buf(o),
                                      rope_offset=d, **shape)
    assert np.array_equal(K3[:, pos].view(np.uint8), K1[:, pos].view(np.uint8))


# ---------------------------------------------------------------------------------------------- prefill
def prefill_ref(q, proj, stride, K, V, p0, M, nh, nkv, hd, gate, bf16=False, causal=True, window=0):
    """float64 gated attention on the values the kernel reads: q [M, nh*hd], K/V [nkv, cap, hd]; causal (or every
    key), keys within `window` of the row's position (0: all); bf16: the output rounded as the kernel's."""
    G = nh // nkv
    n = p0 + M
    q64 = np.asarray(q, np.float64).reshape(M, nkv, G, hd)
    s = np.einsum("mjgd,jtd->jgmt", q64, np.asarray(K[:, :n], np.float64)) / np.sqrt(hd)
    kpos, qpos = np.arange(n)[None, :], (p0 + np.arange(M))[:, None]
    visible = kpos <= qpos if causal else np.ones((M, n), bool)
    if window:
        visible = visible & (qpos - kpos < window)
    s = np.where(visible, s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    o = np.einsum("jgmt,jtd->mjgd", pr, np.asarray(V[:, :n], np.float64)).reshape(M, nh, hd)
    g = np.asarray(proj, np.float64)[:, :nh * 2 * hd].reshape(M, nh, 2 * hd)[..., hd:] if gate else None
    return gated_out(o, g, bf16).reshape(M, nh * hd)


def run_prefill(schedule, t, kv, nh, nkv, hd, p0, M, gate, rng, cap=None, pad=0, causal=True, window=0):
    """attention_prefill on random q, proj (rows `pad` elements longer than the stacked row), K/V (rows past
    the context NaN: never read), o NaN-filled; checked against prefill_ref (with the mask `causal`, `window`)."""
    T, KV = ACT[t], ACT[kv]
    cap = cap or p0 + M + 2
    n = p0 + M
    stride = nh * (2 if gate else 1) * hd + 2 * nkv * hd + pad
    q = (2.0 * rng.standard_normal((M, nh * hd))).astype(T)
    proj = rng.standard_normal((M, stride)).astype(T)
    K = np.full((nkv, cap, hd), np.nan, KV)
    V = np.full((nkv, cap, hd), np.nan, KV)
    K[:, :n] = rng.standard_normal((nkv, n, hd))
    V[:, :n] = rng.standard_normal((nkv, n, hd))
    o = np.full((M, nh * hd), np.nan, T)
    with run(schedule, seed=M + p0) as (dev, enc, buf):
        ops.attention_prefill(enc, DT[t], buf(q), buf(proj), buf(K), buf(V), p0, M, buf(o), n_heads=nh,
                              n_kv_heads=nkv, head_dim=hd, capacity=cap, output_gate=gate, kv_dtype=DT[kv],
                              proj_stride=stride, causal=causal, window=window)
        assert enc.dispatches == 1
    ref = prefill_ref(q, proj, stride, K, V, p0, M, nh, nkv, hd, gate, t == "bf16", causal, window)
    assert not np.isnan(np.asarray(o, np.float64)).any()
    check_out(o, ref, TOL[t], f"{(nh, nkv, hd, p0, M)}")
    return o


def test_prefill_geometry():
    """At most 16 SIMD-groups (512 threads) of 8 rows x 1 head: the group's heads (in equal chunks above 16), then
    as many 8-row groups as fit; no more rows than the chunk has; the real model: 16 rows x 8 heads per
    threadgroup, tiles of 16 keys with the bf16 cache (8 with a float one at head_dim 256); the instantiation for
    head_dim up to 64, 128 or 256."""
    def geo(nh, nkv, hd, M, kv="bfloat16"):
        return dict(zip(GEOMETRY, ops.attention_prefill_geometry(nh, nkv, hd, M, kv_dtype=kv)))

    assert geo(16, 2, 256, 4096) == dict(block_rows=16, tile_keys=16, threads=512, blocks=256, heads_per_tg=8,
                                         chunks=1, head_dim_max=256)
    assert geo(16, 2, 256, 4096, "float32")["tile_keys"] == 8
    assert geo(16, 2, 128, 4096, "float32")["tile_keys"] == 16
    assert geo(16, 2, 256, 1)["blocks"] == 1 and geo(16, 2, 256, 1)["threads"] == 256
    assert geo(4, 4, 64, 1000) == dict(block_rows=128, tile_keys=16, threads=512, blocks=8, heads_per_tg=1,
                                       chunks=1, head_dim_max=64)
    assert geo(4, 4, 64, 9)["block_rows"] == 16 and geo(4, 4, 64, 9)["threads"] == 64
    assert geo(4, 2, 128, 100) == dict(block_rows=64, tile_keys=16, threads=512, blocks=2, heads_per_tg=2,
                                       chunks=1, head_dim_max=128)
    assert geo(6, 2, 32, 100) == dict(block_rows=40, tile_keys=16, threads=480, blocks=3, heads_per_tg=3,
                                      chunks=1, head_dim_max=64)
    assert geo(9, 1, 136, 3) == dict(block_rows=8, tile_keys=16, threads=288, blocks=1, heads_per_tg=9,
                                     chunks=1, head_dim_max=256)
    assert geo(17, 1, 8, 3) == dict(block_rows=8, tile_keys=16, threads=288, blocks=1, heads_per_tg=9,
                                    chunks=2, head_dim_max=64)
    assert geo(32, 1, 8, 3) == dict(block_rows=8, tile_keys=16, threads=512, blocks=1, heads_per_tg=16,
                                    chunks=2, head_dim_max=64)


# (p0, M): a single row, chunks shorter than / equal to / not a multiple of the query block, contexts from
# earlier chunks that end inside and at the edge of a tile
PM = [(0, 1), (0, 7), (0, 8), (0, 13), (3, 1), (5, 12), (16, 9), (29, 30)]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("G", [1, 2, 3, 8, 17])   # 17: two head chunks of 9, one SIMD-group idle
def test_prefill_gqa_f32(schedule, G):
    rng = np.random.default_rng(G)
    for p0, M in PM:
        run_prefill(schedule, "f32", "f32", 2 * G, 2, 16, p0, M, True, rng)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("t,kv", [("bf16", "bf16"), ("bf16", "f32"), ("f32", "bf16")])
def test_prefill_dtypes(schedule, t, kv):
    rng = np.random.default_rng(9)
    for p0, M in ((0, 5), (4, 11), (19, 20)):
        run_prefill(schedule, t, kv, 8, 2, 64, p0, M, True, rng, pad=5)
        run_prefill(schedule, t, kv, 3, 3, 32, p0, M, False, rng)


@pytest.mark.parametrize("hd", [8, 64, 72, 128, 136, 256])
def test_prefill_head_dims(hd):
    """The instantiations for head_dim up to 64, 128 and 256, at and below their width (72, 136: the chunks past
    head_dim skipped), with float and bf16 caches (tiles of 16 keys, 8 for a float cache at 256): contexts
    spanning several tiles, a chunk crossing tiles."""
    rng = np.random.default_rng(hd)
    for kv in ("f32", "bf16"):
        for p0, M in ((0, 3), (13, 10), (40, 25)):
            run_prefill("random", "f32", kv, 4, 2, hd, p0, M, True, rng, cap=p0 + M)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(nkv=st.integers(1, 2), G=st.sampled_from([1, 2, 3, 5, 8, 16]), hd=st.sampled_from([8, 16, 24, 40, 64, 128]),
       p0=st.integers(0, 40), M=st.integers(1, 40), gate=st.booleans(), t=st.sampled_from(["f32", "bf16"]),
       kv=st.sampled_from(["f32", "bf16"]), schedule=st.sampled_from(SCHEDULES), seed=st.integers(0, 2**16))
def test_prefill_hypothesis(nkv, G, hd, p0, M, gate, t, kv, schedule, seed):
    run_prefill(schedule, t, kv, G * nkv, nkv, hd, p0, M, gate, np.random.default_rng(seed),
                cap=p0 + M + seed % 3, pad=seed % 4)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_prefill_masks(schedule):
    """The DFlash draft's masks: every row over every key (its block after its context: p0 > 0, rows crossing
    query blocks and tiles, GQA, both dtypes, no gate) and a sliding window (causal, keys within `window` of the
    row: windows shorter than a tile, than the block, longer than the context; threadgroups starting past key 0)."""
    rng = np.random.default_rng(21)
    for t, kv in (("f32", "f32"), ("bf16", "bf16")):
        for p0, M in ((0, 1), (0, 16), (7, 9), (40, 16), (3, 70)):
            run_prefill(schedule, t, kv, 8, 2, 32, p0, M, False, rng, causal=False)
    for p0, M, w in ((0, 12, 5), (30, 16, 3), (30, 16, 20), (5, 40, 17), (2, 9, 100), (61, 3, 1)):
        run_prefill(schedule, "f32", "f32", 4, 2, 16, p0, M, w % 2 == 0, rng, window=w)


def test_prefill_mask_declared_bytes_and_flops():
    """Without the causal mask every block reads every key and every row scores every key; a window starts each
    block at the tile of its first row's first visible key and scores min(window, pos + 1) keys per row."""
    nh, nkv, hd, p0, M = 4, 2, 16, 40, 20
    cap = p0 + M
    f = lambda *s: np.zeros(s, np.float32)
    q, proj, o, K, V = f(M, nh * hd), f(M, nh * hd), f(M, nh * hd), f(nkv, cap, hd), f(nkv, cap, hd)
    g = dict(zip(GEOMETRY, ops.attention_prefill_geometry(nh, nkv, hd, M, kv_dtype="float32")))
    kw = dict(n_heads=nh, n_kv_heads=nkv, head_dim=hd, capacity=cap, kv_dtype="float32", output_gate=False)
    with run() as (dev, enc, buf):
        ops.attention_prefill(enc, "float32", buf(q), buf(proj), buf(K), buf(V), p0, M, buf(o), causal=False, **kw)
        assert enc.flops == 4 * nh * hd * M * cap
        assert enc.bytes_read == M * nh * hd * 4 + 2 * nkv * g["chunks"] * g["blocks"] * cap * hd * 4   # q, K, V
    w = 9
    with run() as (dev, enc, buf):
        ops.attention_prefill(enc, "float32", buf(q), buf(proj), buf(K), buf(V), p0, M, buf(o), window=w, **kw)
        assert enc.flops == 4 * nh * hd * M * w
        tk = g["tile_keys"]
        keys = sum(min(p0 + (b + 1) * g["block_rows"], cap) - max(0, p0 + b * g["block_rows"] + 1 - w) // tk * tk
                   for b in range(g["blocks"]))
        assert enc.bytes_read == M * nh * hd * 4 + 2 * nkv * g["chunks"] * keys * hd * 4
        with pytest.raises(ValueError, match="attention_prefill: a window needs the causal mask"):
            ops.attention_prefill(enc, "float32", buf(q), buf(proj), buf(K), buf(V), p0, M, buf(o), causal=False,
                                  window=4, **kw)


def test_prefill_one_row_is_decode():
    """M = 1 at position p0 is the decode attention over p0 + 1 keys (different summation order: 1e-5)."""
    nh, nkv, hd, p0 = 8, 2, 32, 37
    rng = np.random.default_rng(4)
    o = run_prefill("forward", "f32", "f32", nh, nkv, hd, p0, 1, True, rng)
    rng = np.random.default_rng(4)      # the same q, proj, K, V
    q = (2.0 * rng.standard_normal((1, nh * hd))).astype(np.float32)
    proj = rng.standard_normal((1, nh * 2 * hd + 2 * nkv * hd)).astype(np.float32)
    K = np.full((nkv, p0 + 3, hd), np.nan, np.float32)
    V = np.full((nkv, p0 + 3, hd), np.nan, np.float32)
    K[:, :p0 + 1] = rng.standard_normal((nkv, p0 + 1, hd))
    V[:, :p0 + 1] = rng.standard_normal((nkv, p0 + 1, hd))
    od = np.full(nh * hd, np.nan, np.float32)
    with run() as (dev, enc, buf):
        ops.attention_decode(enc, "float32", buf(q), buf(proj), buf(K), buf(V), p0 + 1, None, buf(od), n_heads=nh,
                             n_kv_heads=nkv, head_dim=hd, capacity=p0 + 3, kv_dtype="float32")
    check_out(o[0], od, 1e-5)


def run_chunks(schedule, t, kv, proj, qw, kw, nh, nkv, hd, rd, bounds, cap):
    """attn_prepare (rows) + attention_prefill per chunk [a, b) of `bounds`, all in one command buffer."""
    L = proj.shape[0]
    K = np.full((nkv, cap, hd), np.nan, ACT[kv])
    V = np.full((nkv, cap, hd), np.nan, ACT[kv])
    q = np.full((L, nh * hd), np.nan, ACT[t])
    o = np.full((L, nh * hd), np.nan, ACT[t])
    shape = dict(n_heads=nh, n_kv_heads=nkv, head_dim=hd, capacity=cap, kv_dtype=DT[kv])
    with run(schedule) as (dev, enc, buf):
        bp, bK, bV, bq, bo = buf(proj), buf(K), buf(V), buf(q), buf(o)
        rp, rq = proj.shape[1] * proj.itemsize, nh * hd * q.itemsize
        for a, b in zip(bounds[:-1], bounds[1:]):
            pv, qv = bp.view(a * rp, (b - a) * rp), bq.view(a * rq, (b - a) * rq)
            ops.attn_prepare(enc, DT[t], pv, buf(qw), buf(kw), a, bK, bV, qv, rows=b - a, rotary_dim=rd,
                             rope_theta=1e6, eps=1e-6, **shape)
            ops.attention_prefill(enc, DT[t], qv, pv, bK, bV, a, b - a, bo.view(a * rq, (b - a) * rq), **shape)
    return o, K, V


@pytest.mark.parametrize("t,kv,schedule", [("f32", "f32", "forward"), ("f32", "bf16", "reverse"),
                                           ("bf16", "bf16", "random"), ("bf16", "f32", "forward")])
def test_prefill_chunks_against_full_attention(t, kv, schedule):
    """prepare + prefill over a prompt as one chunk, and as chunks of 11, 1 and 17 rows (contexts spanning earlier
    chunks), against reference.full_attention; the chunked run equals the single one bit for bit."""
    nh, nkv, hd, rd, H, L = 8, 2, 32, 16, 24, 29
    proj, qw, kw, ref, Kref, Vref = full_attention_case(t, nh, nkv, hd, rd, H, L, 2)
    one, K1, V1 = run_chunks(schedule, t, kv, proj, qw, kw, nh, nkv, hd, rd, [0, L], L + 3)
    split, K2, V2 = run_chunks(schedule, t, kv, proj, qw, kw, nh, nkv, hd, rd, [0, 11, 12, L], L + 3)
    tol = max(TOL[t], TOL[kv])
    check_out(K1[:, :L], Kref, tol, "K"), check_out(V1[:, :L], Vref, tol, "V")
    check_out(one, ref, (3e-5 if tol < 1e-3 else 2e-2))
    assert np.array_equal(one.view(np.uint8), split.view(np.uint8))
    assert np.array_equal(K1.view(np.uint8), K2.view(np.uint8))


@pytest.mark.parametrize("t,kv", [("f32", "f32"), ("bf16", "bf16")])
def test_prefill_real_model_shape(t, kv):
    """Qwen3.6 full attention (16 q / 2 kv heads x 256, rotary 64, theta 1e6 here): a chunk of 7 rows after one of
    12, against reference.full_attention; G = 8 heads share each K/V tile."""
    nh, nkv, hd, rd, H, L = 16, 2, 256, 64, 32, 19
    proj, qw, kw, ref, Kref, _ = full_attention_case(t, nh, nkv, hd, rd, H, L, 7)
    o, K, _ = run_chunks("random", t, kv, proj, qw, kw, nh, nkv, hd, rd, [0, 12, L], L + 1)
    tol = max(TOL[t], TOL[kv])
    check_out(K[:, :L], Kref, tol)
    check_out(o, ref, (3e-5 if tol < 1e-3 else 2e-2))


@pytest.mark.parametrize("nh,nkv,hd,p0,M", [(16, 2, 256, 100, 20), (4, 4, 64, 0, 70), (6, 2, 16, 9, 1),
                                             (32, 1, 16, 3, 10)])
def test_prefill_declared_bytes_and_flops(nh, nkv, hd, p0, M):
    """K/V read once per (query block, kv head): block b reads keys 0 .. min(p0 + (b+1) rows, p0 + M) - 1; q, the
    gate and o once; flops 2 hd per visible (query head, key) for each of QK^T and PV."""
    cap = p0 + M
    f = lambda *s: np.zeros(s, ACT["bf16"])
    stride = nh * 2 * hd + 2 * nkv * hd
    q, proj, o = f(M, nh * hd), f(M, stride), f(M, nh * hd)
    K, V = np.zeros((nkv, cap, hd), np.float32), np.zeros((nkv, cap, hd), np.float32)
    g = dict(zip(GEOMETRY, ops.attention_prefill_geometry(nh, nkv, hd, M, kv_dtype="float32")))
    keys = g["chunks"] * sum(min(p0 + (b + 1) * g["block_rows"], p0 + M) for b in range(g["blocks"]))
    with run() as (dev, enc, buf):
        ops.attention_prefill(enc, "bfloat16", buf(q), buf(proj), buf(K), buf(V), p0, M, buf(o), n_heads=nh,
                              n_kv_heads=nkv, head_dim=hd, capacity=cap, kv_dtype="float32")
        assert enc.bytes_read == 2 * M * nh * hd * 2 + 2 * nkv * keys * hd * 4
        assert enc.bytes_written == M * nh * hd * 2
        assert enc.flops == 4 * nh * hd * (M * p0 + M * (M + 1) // 2)
    if nh // nkv == 8:   # the real model: per query head it would read 8x these K/V bytes
        assert keys < g["blocks"] * (p0 + M)


def test_prefill_argument_checks():
    nh, nkv, hd, cap, M = 4, 2, 16, 10, 3
    f = lambda *s: np.zeros(s, np.float32)
    stride = nh * 2 * hd + 2 * nkv * hd
    q, proj, o, K, V = f(M, nh * hd), f(M, stride), f(M, nh * hd), f(nkv, cap, hd), f(nkv, cap, hd)
    qw = f(hd)
    kws = dict(n_heads=nh, n_kv_heads=nkv, head_dim=hd, capacity=cap, kv_dtype="float32")
    with run() as (dev, enc, buf):
        def pre(**over):
            a = dict(q=buf(q), proj=buf(proj), p0=2, M=M, o=buf(o), **kws)
            a.update(over)
            ops.attention_prefill(enc, "float32", a.pop("q"), a.pop("proj"), buf(K), buf(V), a.pop("p0"), a.pop("M"),
                                  a.pop("o"), **a)

        for bad, match in ((dict(M=0), r"attention_prefill: M \(rows\) must be positive"),
                           (dict(p0=8), r"attention_prefill: keys 0\.\.10 outside a cache of 10 rows"),
                           (dict(q=buf(q[:-1])), r"attention_prefill: q holds \d+ bytes, needs"),
                           (dict(o=buf(o[:-1])), r"attention_prefill: o holds \d+ bytes, needs"),
                           (dict(proj=buf(proj[:-1])), r"attention_prefill: proj holds \d+ bytes, needs"),
                           (dict(proj_stride=nh * 2 * hd - 1), r"proj_stride 127 below the q rows of 128"),
                           (dict(head_dim=12, capacity=13), r"head_dim 12 must be a multiple of 8 and at most 256 \(the kernels"),
                           (dict(head_dim=264, capacity=1), r"head_dim 264 must be a multiple of 8 and at most 256"),
                           (dict(n_heads=66, n_kv_heads=2), r"n_heads / n_kv_heads = 33 above the kernel's 32"),
                           (dict(n_heads=5), r"n_heads \(5\) must be a multiple of n_kv_heads \(2\)"),
                           (dict(capacity=cap + 1), r"attention_prefill: k cache holds \d+ bytes, needs")):
            with pytest.raises(ValueError, match=match):
                pre(**bad)
        pre()
        pre(output_gate=False, proj=buf(proj[:1, :1]))          # without the gate proj is never read

        def prep(**over):
            a = dict(proj=buf(proj), position=2, rows=M, proj_stride=0, **kws)
            a.update(over)
            ops.attn_prepare(enc, "float32", a.pop("proj"), buf(qw), buf(qw), a.pop("position"), buf(K), buf(V),
                             buf(q), rotary_dim=8, **a)

        for bad, match in ((dict(rows=0), r"attn_prepare: rows must be positive"),
                           (dict(position=8), r"attn_prepare: positions 8\.\.10 outside a cache of 10 rows"),
                           (dict(proj_stride=stride - 1), r"attn_prepare: proj_stride 191 below the stacked row of 192"),
                           (dict(proj_stride=stride + 1), r"attn_prepare: proj holds \d+ bytes, needs"),
                           (dict(rows=M + 1, position=0), r"attn_prepare: proj holds \d+ bytes, needs")):
            with pytest.raises(ValueError, match=match):
                prep(**bad)
        prep()


# --------------------------------------------------------------------------------------- fused prepare
def prepared_vs_separate(schedule, t, kv, nh, nkv, hd, rd, gate, pos, cap, pol, seed):
    """attention_decode_prepared against attn_prepare + attention_decode on the same inputs: o, every K/V cache
    row and the dispatch count (one fewer), bit for bit."""
    rng = np.random.default_rng(seed)
    proj, qw, kw, K0, V0 = prepare_case(rng, t, kv, nh, nkv, hd, cap, gate)
    nbytes = ops.attention_scratch_bytes(nh, nkv, hd, pos + 1, **pol)
    shape = shape_kw(nh, nkv, hd, cap, gate, kv)
    outs = []
    for fused in (False, True):
        K, V = K0.copy(), V0.copy()
        o = np.full(nh * hd, np.nan, ACT[t])
        scratch = np.full(max(nbytes // 4, 1), np.nan, np.float32)
        with run(schedule, seed=seed) as (dev, enc, buf):
            if fused:
                ops.attention_decode_prepared(enc, DT[t], buf(proj), buf(qw), buf(kw), pos, buf(K), buf(V),
                                              buf(scratch), buf(o), rotary_dim=rd, rope_theta=1e6, eps=1e-6,
                                              **shape, **pol)
            else:
                qo = np.full(nh * hd, np.nan, ACT[t])
                ops.attn_prepare(enc, DT[t], buf(proj), buf(qw), buf(kw), pos, buf(K), buf(V), buf(qo),
                                 rotary_dim=rd, rope_theta=1e6, eps=1e-6, **shape)
                ops.attention_decode(enc, DT[t], buf(qo), buf(proj), buf(K), buf(V), pos + 1, buf(scratch), buf(o),
                                     **shape, **pol)
            dispatches = enc.dispatches
        outs.append((o, K, V, dispatches))
    (o1, K1, V1, d1), (o2, K2, V2, d2) = outs
    assert d2 == d1 - 1
    assert not np.isnan(np.asarray(o2, np.float64)).any()
    for a, b in ((o1, o2), (K1, K2), (V1, V2)):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    return ops.attention_route(pos + 1, **pol)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_decode_prepared_every_route(schedule):
    """The decode graph's fused route equals prepare + decode bit for bit on every route, head chunks (G 12 in
    2 chunks) and without GQA packing, float and bf16."""
    seen = set()
    for i, (t, kv, G, pack) in enumerate([("f32", "f32", 4, True), ("bf16", "bf16", 12, True),
                                          ("bf16", "f32", 3, False)]):
        for pos in (0, 11, 12, 39, 40, 2 * LONG_MAX_PARTIALS + 2):
            seen.add(prepared_vs_separate(schedule, t, kv, 2 * G, 2, 40, 16, True, pos, pos + 3,
                                          dict(POL, gqa_pack=pack), 17 * i + pos))
    assert seen == {"single", "split", "two_pass"}


@settings(max_examples=40, deadline=None, derandomize=True)
@given(nkv=st.integers(1, 3), G=st.sampled_from([1, 2, 8, 9]), hd=st.sampled_from([6, 16, 24, 40, 64, 256]),
       rot=st.floats(0.0, 1.0), gate=st.booleans(), t=st.sampled_from(["f32", "bf16"]),
       kv=st.sampled_from(["f32", "bf16"]), pos=st.integers(0, 80), spm=st.integers(0, 30),
       sb=st.integers(1, 16), lb=st.integers(1, 8), extra=st.integers(0, 30), pack=st.booleans(),
       schedule=st.sampled_from(SCHEDULES), seed=st.integers(0, 2**16))
def test_decode_prepared_hypothesis(nkv, G, hd, rot, gate, t, kv, pos, spm, sb, lb, extra, pack, schedule, seed):
    pol = dict(single_pass_max=spm, split_max=spm + extra, split_block=sb, long_block=lb, gqa_pack=pack)
    rd = 2 * int(rot * hd / 2)
    prepared_vs_separate(schedule, t, kv, G * nkv, nkv, hd, rd, gate, pos, pos + 1 + seed % 4, pol, seed)


def test_decode_prepared_real_shape_and_checks():
    """The real model's shape (16 q / 2 kv heads x 256, rotary 64) at 600 keys on the default policy (split-K), and
    the fused call's own argument checks."""
    assert prepared_vs_separate("random", "bf16", "bf16", 16, 2, 256, 64, True, 599, 640, {}, 5) == "split"
    nh, nkv, hd, cap = 4, 2, 16, 8
    proj, qw, kw, K, V = prepare_case(np.random.default_rng(0), "f32", "f32", nh, nkv, hd, cap, True)
    o = np.zeros(nh * hd, np.float32)
    with run() as (dev, enc, buf):
        call = lambda pos=3, **kw_: ops.attention_decode_prepared(
            enc, "float32", kw_.pop("proj", buf(proj)), buf(qw), buf(kw), pos, buf(K), buf(V), None, buf(o),
            **{**dict(n_heads=nh, n_kv_heads=nkv, head_dim=hd, rotary_dim=8, capacity=cap, kv_dtype="float32"), **kw_})
        with pytest.raises(ValueError, match=r"attention_decode_prepared: position 8 outside a cache of 8 rows"):
            call(pos=8)
        with pytest.raises(ValueError, match=r"attention_decode_prepared: rotary_dim \(7\) must be even"):
            call(rotary_dim=7)
        with pytest.raises(ValueError, match=r"attention_decode_prepared: proj"):
            call(proj=buf(proj[:nh * 2 * hd]))
        assert enc.dispatches == 0


@pytest.mark.parametrize("t,kv,shift", [("f32", "f32", 5), ("bf16", "bf16", 37)])
def test_decode_prepared_rope_offset(t, kv, shift):
    """rope_offset (a state's rope_delta; here an MTP head's layer caches, whose entries skip positions): the fused
    route writes K/V row `pos`
    rotated at pos + shift and attends keys 0..pos with q rotated there -- bit for bit attn_prepare at position
    pos + shift, its K/V row moved to row pos, then attention_decode over pos + 1 keys."""
    nh, nkv, hd, rd, pos, gate = 4, 2, 32, 16, 9, True
    cap = pos + shift + 1
    pol = dict(POL)
    rng = np.random.default_rng(shift)
    proj, qw, kw, K0, V0 = prepare_case(rng, t, kv, nh, nkv, hd, cap, gate)
    nbytes = ops.attention_scratch_bytes(nh, nkv, hd, pos + 1, **pol)
    shape = shape_kw(nh, nkv, hd, cap, gate, kv)
    rope = dict(rotary_dim=rd, rope_theta=1e6, eps=1e-6)
    K1, V1, o1 = K0.copy(), V0.copy(), np.full(nh * hd, np.nan, ACT[t])
    with run("forward") as (dev, enc, buf):
        ops.attention_decode_prepared(enc, DT[t], buf(proj), buf(qw), buf(kw), pos, buf(K1), buf(V1),
                                      buf(np.zeros(max(nbytes // 4, 1), np.float32)), buf(o1), **rope, **shape,
                                      **pol, rope_offset=shift)
    K2, V2, qo = K0.copy(), V0.copy(), np.full(nh * hd, np.nan, ACT[t])
    with run("forward") as (dev, enc, buf):
        ops.attn_prepare(enc, DT[t], buf(proj), buf(qw), buf(kw), pos + shift, buf(K2), buf(V2), buf(qo), **rope,
                         **shape)
    K2[:, pos], V2[:, pos] = K2[:, pos + shift], V2[:, pos + shift]
    o2 = np.full(nh * hd, np.nan, ACT[t])
    with run("forward") as (dev, enc, buf):
        ops.attention_decode(enc, DT[t], buf(qo), buf(proj), buf(K2), buf(V2), pos + 1,
                             buf(np.zeros(max(nbytes // 4, 1), np.float32)), buf(o2), **shape, **pol)
    for a, b in ((o1, o2), (K1[:, :pos + 1], K2[:, :pos + 1]), (V1[:, :pos + 1], V2[:, :pos + 1])):
        assert np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))

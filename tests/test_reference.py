"""Tests of the numpy reference forward pass (python/qwenmetal/reference.py).

Block tests compare each function against an independent, deliberately naive implementation (loops,
float64). Model tests check the invariances the engine relies on (split prefill, prefill + decode,
chunked == recurrent GDN, state copies). When torch + transformers are installed, the float32 model is
also compared with HF's Qwen3.5-MoE and Qwen3-Next implementations.
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from oracles import require, unavailable  # fail in CI, skip elsewhere
from qwenmetal.backends import reference as R
from qwenmetal.testing import random_params
from qwenmetal.config import ModelConfig


def rel_err(a, b) -> float:
    """max |a - b| relative to max |a|."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-30))


# ---------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------
BASE = dict(
    model_type="qwen3_5_moe_text", vocab_size=128, hidden_size=64, num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
)

# Qwen3-Next flavour: a dense-MLP layer, an attention layer in the middle, dk != dv, no output gate,
# no shared expert, no renormalisation, tied embeddings.
NEXT = dict(
    model_type="qwen3_next", vocab_size=96, hidden_size=48, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    num_attention_heads=4, num_key_value_heads=1, head_dim=16, attn_output_gate=False,
    rope_theta=10000.0, partial_rotary_factor=0.5,
    linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_conv_kernel_dim=3, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
    shared_expert_intermediate_size=0, norm_topk_prob=False, intermediate_size=40, mlp_only_layers=[2],
    decoder_sparse_step=1, rms_norm_eps=1e-6, tie_word_embeddings=True,
)


def make_model(d=BASE, seed=0, dtype="float32", **over):
    cfg = ModelConfig.from_dict({**d, **over})
    return R.ReferenceModel(cfg, random_params(cfg, seed=seed), dtype=dtype)


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def next_model():
    return make_model(NEXT, seed=1)


def tokens(n, vocab=128, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, n)


# ---------------------------------------------------------------------------------------------
# elementwise / norms / RoPE
# ---------------------------------------------------------------------------------------------
def test_to_bf16_round_to_nearest_even():
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0); 1 + 3*2^-8 rounds up to 1 + 2^-6
    x = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -3.0], np.float32)
    np.testing.assert_array_equal(R.to_bf16(x), [1.0, 1 + 2 ** -6, 1 + 2 ** -7, -3.0])


def test_sigmoid_silu_softplus_stable():
    x = np.array([-1000, -30, -1, 0, 1, 30, 1000], np.float32)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        s, sp, si = R.sigmoid(x), R.softplus(x), R.silu(x)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(s, 1 / (1 + np.exp(-np.clip(x64, -700, 700))), rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(sp, np.logaddexp(0, x64), rtol=1e-6)
    np.testing.assert_allclose(si, x64 * s, rtol=1e-6)
    assert s.dtype == sp.dtype == si.dtype == np.float32


def test_rms_norm_and_bf16_variant():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 64)).astype(np.float32) * 3
    w = (1 + 0.1 * rng.normal(size=64)).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(R.rms_norm(x, w, 1e-6), ref, rtol=2e-6, atol=1e-6)
    # bf16: w * bf16(x * inv), rounded: every output is a bf16 value and close to the fp32 result
    yb = R.rms_norm(x, w, 1e-6, bf16=True)
    np.testing.assert_array_equal(yb, R.to_bf16(yb))
    np.testing.assert_array_equal(yb, R.to_bf16(w * R.to_bf16(x * (1 / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)))))
    assert rel_err(ref, yb) < 1e-2


def test_gated_rms_norm_order_and_plain_weight():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 4, 16)).astype(np.float32)
    z = rng.normal(size=(3, 4, 16)).astype(np.float32)
    w = (1 + 0.2 * rng.normal(size=16)).astype(np.float32)
    x64, z64 = x.astype(np.float64), z.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w * (z64 / (1 + np.exp(-z64)))
    np.testing.assert_allclose(R.gated_rms_norm(x, z, w, 1e-6), ref, rtol=5e-6, atol=1e-6)
    assert rel_err(ref, R.gated_rms_norm(x, z, w, 1e-6, bf16=True)) < 2e-2


def test_l2norm_eps_on_sum_of_squares():
    x = np.array([[3.0, 4.0], [0.0, 1e-4]], np.float32)
    y = R.l2norm(x)
    np.testing.assert_allclose(y[0], [0.6, 0.8], rtol=1e-6)
    # eps added to sum(x^2) (HF/FLA), not to mean(x^2)
    np.testing.assert_allclose(y[1, 1], 1e-4 / np.sqrt(1e-8 + 1e-6), rtol=1e-5)


def test_rope_pairing_passthrough_and_angles():
    hd, rd, theta = 16, 8, 1e4
    x = np.zeros((1, 1, hd), np.float32)
    x[0, 0, 1] = 1.0                      # pair (1, 1 + rd/2 = 5)
    x[0, 0, 12] = 7.0                     # beyond rotary dims: untouched
    pos = np.array([3])
    y = R.rope(x, pos, rd, theta)[0, 0]
    ang = 3 * theta ** (-2 * 1 / rd)
    expect = np.zeros(hd)
    expect[1], expect[5], expect[12] = np.cos(ang), np.sin(ang), 7.0
    np.testing.assert_allclose(y, expect, atol=1e-6)


def test_rope_relative_positions():
    rng = np.random.default_rng(2)
    q = rng.normal(size=(1, 1, 32)).astype(np.float32)
    k = rng.normal(size=(1, 1, 32)).astype(np.float32)

    def dot(m, n):
        return float(np.sum(R.rope(q, np.array([m]), 8, 1e7) * R.rope(k, np.array([n]), 8, 1e7)))
    assert dot(10, 3) == pytest.approx(dot(107, 100), rel=1e-5)
    assert dot(10, 3) != pytest.approx(dot(10, 4), rel=1e-3)
    # norm preserved
    y = R.rope(q, np.array([12345]), 8, 1e7)
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(q), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# causal conv
# ---------------------------------------------------------------------------------------------
def test_causal_conv1d_matches_loop_and_splits():
    rng = np.random.default_rng(3)
    C, K, L = 6, 4, 9
    x = rng.normal(size=(L, C)).astype(np.float32)
    w = rng.normal(size=(C, K)).astype(np.float32)
    s0 = rng.normal(size=(K - 1, C)).astype(np.float32)
    out, s1 = R.causal_conv1d(x, s0, w)
    hist = np.concatenate([s0, x]).astype(np.float64)
    naive = np.array([[sum(w[c, j] * hist[t + j, c] for j in range(K)) for c in range(C)] for t in range(L)])
    np.testing.assert_allclose(out, naive, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(s1, x[-(K - 1):])
    # split 4 + 5 == 9, and 1-token steps
    o_a, s_a = R.causal_conv1d(x[:4], s0, w)
    o_b, s_b = R.causal_conv1d(x[4:], s_a, w)
    np.testing.assert_allclose(np.concatenate([o_a, o_b]), out, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(s_b, s1)
    s = s0
    for t in range(L):
        o_t, s = R.causal_conv1d(x[t:t + 1], s, w)
        np.testing.assert_allclose(o_t[0], out[t], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# GDN recurrence: naive float64 check, chunked == recurrent
# ---------------------------------------------------------------------------------------------
def gdn_inputs(L, nk=2, nv=4, dk=32, dv=16, seed=0, state_scale=0.5, decay=(0.001, 3.0)):
    rng = np.random.default_rng(seed)
    q = R.l2norm(rng.normal(size=(L, nk, dk)).astype(np.float32)) * np.float32(dk ** -0.5)
    # correlated keys (|k_i . k_j| close to 1 for some pairs), docs/model.md §6
    base = rng.normal(size=(1, nk, dk))
    k = R.l2norm((rng.normal(size=(L, nk, dk)) + 2.0 * base).astype(np.float32))
    v = rng.normal(size=(L, nv, dv)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, size=(L, nv)).astype(np.float32)
    g = -rng.uniform(*decay, size=(L, nv)).astype(np.float32)
    s0 = (state_scale * rng.normal(size=(nv, dv, dk))).astype(np.float32)
    return q, k, v, beta, g, s0


def gdn_naive64(q, k, v, beta, g, s0):
    """HF-style closed form in float64, HF state layout [dk, dv]: S = e^g (I - b k k^T) S + b k v^T."""
    L, nv, dv = v.shape
    r = nv // q.shape[1]
    S = np.swapaxes(s0.astype(np.float64), 1, 2).copy()
    out = np.zeros((L, nv, dv))
    for t in range(L):
        for h in range(nv):
            kk, qq = k[t, h // r].astype(np.float64), q[t, h // r].astype(np.float64)
            S[h] = np.exp(g[t, h]) * (S[h] - beta[t, h] * np.outer(kk, kk @ S[h])) + beta[t, h] * np.outer(kk, v[t, h])
            out[t, h] = S[h].T @ qq
    return out, np.swapaxes(S, 1, 2)


def test_gdn_recurrent_matches_naive_float64():
    inp = gdn_inputs(23, seed=4)
    o, s = R.gdn_recurrent(*inp)
    o64, s64 = gdn_naive64(*inp)
    assert rel_err(o64, o) < 1e-5 and rel_err(s64, s) < 1e-5
    assert o.dtype == s.dtype == np.float32 and s.shape == inp[-1].shape


def test_gdn_functions_do_not_modify_inputs():
    inp = gdn_inputs(10, seed=5)
    saved = [a.copy() for a in inp]
    R.gdn_recurrent(*inp)
    R.gdn_chunked(*inp, chunk_size=4)
    for a, b in zip(inp, saved):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 16, 63, 64])
@pytest.mark.parametrize("L", [1, 5, 64, 100])
def test_gdn_chunked_equals_recurrent(chunk, L):
    inp = gdn_inputs(L, seed=chunk * 1000 + L)
    o_r, s_r = R.gdn_recurrent(*inp)
    o_c, s_c = R.gdn_chunked(*inp, chunk_size=chunk)
    assert o_c.shape == o_r.shape and s_c.shape == s_r.shape
    assert rel_err(o_r, o_c) < 1e-5, rel_err(o_r, o_c)
    assert rel_err(s_r, s_c) < 1e-5, rel_err(s_r, s_c)


@settings(max_examples=40, deadline=None)
@given(chunk=st.integers(1, 64), L=st.integers(1, 140), seed=st.integers(0, 2 ** 31),
       weak_decay=st.booleans(), ratio=st.sampled_from([1, 2, 3]))
def test_gdn_chunked_equals_recurrent_hypothesis(chunk, L, seed, weak_decay, ratio):
    inp = gdn_inputs(L, nk=2, nv=2 * ratio, dk=24, dv=20, seed=seed,
                     decay=(1e-4, 0.05) if weak_decay else (0.01, 8.0))
    o_r, s_r = R.gdn_recurrent(*inp)
    o_c, s_c = R.gdn_chunked(*inp, chunk_size=chunk)
    assert rel_err(o_r, o_c) < 1e-5
    assert rel_err(s_r, s_c) < 1e-5


def test_gdn_chunked_strong_decay_no_nan():
    # cumulative log decay of -2000 inside a chunk: exp underflows to 0, must not produce inf/nan
    inp = list(gdn_inputs(64, seed=6, decay=(20.0, 40.0)))
    with np.errstate(over="raise", invalid="raise"):
        o_c, s_c = R.gdn_chunked(*inp, chunk_size=64)
    o_r, s_r = R.gdn_recurrent(*inp)
    assert np.all(np.isfinite(o_c)) and np.all(np.isfinite(s_c))
    assert rel_err(o_r, o_c) < 1e-5 and rel_err(s_r, s_c) < 1e-5


def test_gdn_gqa_mapping_is_h_div_ratio():
    # v-heads 0,1 must read k-head 0: make k-head 1 garbage and check heads 0,1 are unaffected
    q, k, v, beta, g, s0 = gdn_inputs(6, nk=2, nv=4, seed=7)
    o1, _ = R.gdn_recurrent(q, k, v, beta, g, s0)
    q2, k2 = q.copy(), k.copy()
    q2[:, 1] *= -3
    k2[:, 1] = R.l2norm(np.random.default_rng(0).normal(size=k2[:, 1].shape).astype(np.float32))
    o2, _ = R.gdn_recurrent(q2, k2, v, beta, g, s0)
    np.testing.assert_array_equal(o1[:, :2], o2[:, :2])
    assert not np.allclose(o1[:, 2:], o2[:, 2:])


def gdn_layer_naive64(x, p, cfg, conv_state, ssm_state):
    """The GDN layer of docs/model.md §4.4 written out with loops in float64."""
    x = x.astype(np.float64)
    L = x.shape[0]
    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                      cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    K = cfg.linear_conv_kernel_dim
    qkv = x @ p["in_proj_qkv"].T
    z = (x @ p["in_proj_z"].T).reshape(L, nv, dv)
    b, a = x @ p["in_proj_b"].T, x @ p["in_proj_a"].T
    hist = np.concatenate([conv_state, qkv])
    conv = np.array([[np.dot(p["conv1d"][c], hist[t:t + K, c]) for c in range(qkv.shape[1])] for t in range(L)])
    act = conv / (1 + np.exp(-conv))
    q = act[:, :nk * dk].reshape(L, nk, dk)
    k = act[:, nk * dk:2 * nk * dk].reshape(L, nk, dk)
    v = act[:, 2 * nk * dk:].reshape(L, nv, dv)
    q = q / np.sqrt((q ** 2).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
    k = k / np.sqrt((k ** 2).sum(-1, keepdims=True) + 1e-6)
    beta = 1 / (1 + np.exp(-b))
    g = -np.exp(p["A_log"].astype(np.float64)) * np.log1p(np.exp(a + p["dt_bias"]))
    o, S = gdn_naive64(q, k, v, beta, g, ssm_state)
    y = o / np.sqrt((o ** 2).mean(-1, keepdims=True) + cfg.rms_norm_eps) * p["norm"] * (z / (1 + np.exp(-z)))
    return y.reshape(L, nv * dv) @ p["out_proj"].T, hist[L:], S


@pytest.mark.parametrize("which", ["base", "next"])
@pytest.mark.parametrize("mode", ["chunked", "recurrent"])
def test_gated_deltanet_matches_naive(which, mode, model, next_model):
    m = model if which == "base" else next_model
    cfg = m.config
    p = R._sub(m.layers[0], "linear_attn.")
    rng = np.random.default_rng(12)
    x = rng.normal(size=(11, cfg.hidden_size)).astype(np.float32)
    conv0 = rng.normal(size=(cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)).astype(np.float32)
    ssm0 = (0.3 * rng.normal(size=(cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                                   cfg.linear_key_head_dim))).astype(np.float32)
    out, conv1, ssm1 = R.gated_deltanet(x, p, cfg, conv0, ssm0, gdn_mode=mode, chunk_size=4)
    out_n, conv_n, ssm_n = gdn_layer_naive64(x, p, cfg, conv0, ssm0)
    assert rel_err(out_n, out) < 1e-5
    assert rel_err(conv_n, conv1) < 1e-6 and conv1.shape == conv0.shape
    assert rel_err(ssm_n, ssm1) < 1e-5


def test_gated_deltanet_bf16_rounding_points(model):
    """bf16 mode of the GDN layer, written out from the module docstring's list."""
    cfg = model.config
    p = R._sub(model.layers[0], "linear_attn.")
    rng = np.random.default_rng(13)
    x = R.to_bf16(rng.normal(size=(9, cfg.hidden_size)))
    conv0 = R.to_bf16(rng.normal(size=(cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)))
    ssm0 = (0.3 * rng.normal(size=(4, 16, 16))).astype(np.float32)
    b16 = R.to_bf16
    L, nk, nv, dk, dv = 9, 2, 4, 16, 16
    qkv = b16(x @ p["in_proj_qkv"].T)
    z = b16(x @ p["in_proj_z"].T).reshape(L, nv, dv)
    b, a = b16(x @ p["in_proj_b"].T), b16(x @ p["in_proj_a"].T)
    conv, conv1 = R.causal_conv1d(qkv, conv0, p["conv1d"])
    conv = b16(conv)
    act = b16(conv * b16(R.sigmoid(conv)))
    q, k = act[:, :32].reshape(L, nk, dk), act[:, 32:64].reshape(L, nk, dk)
    v = act[:, 64:].reshape(L, nv, dv)
    nq = b16(q * (1 / np.sqrt((q * q).mean(-1, keepdims=True) + np.float32(1e-6 / dk))))
    nkk = b16(k * (1 / np.sqrt((k * k).mean(-1, keepdims=True) + np.float32(1e-6 / dk))))
    q, k = b16(nq * b16(1 / dk)), b16(nkk * b16(dk ** -0.5))
    beta = b16(R.sigmoid(b))
    g = -np.exp(p["A_log"]) * R.softplus(a + p["dt_bias"])
    o, ssm1 = R.gdn_recurrent(q, k, v, beta, g, ssm0)
    o = b16(o)
    n = b16(p["norm"] * b16(o * (1 / np.sqrt((o * o).mean(-1, keepdims=True) + np.float32(1e-6)))))
    y = b16(n * R.silu(z))
    ref = b16(y.reshape(L, nv * dv) @ p["out_proj"].T)
    out, c1, s1 = R.gated_deltanet(x, p, cfg, conv0, ssm0, gdn_mode="recurrent", bf16=True)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(c1, conv1)
    np.testing.assert_array_equal(s1, ssm1)
    assert s1.dtype == np.float32 and not np.array_equal(s1, b16(s1))


# ---------------------------------------------------------------------------------------------
# attention and MoE blocks against naive loops
# ---------------------------------------------------------------------------------------------
def attention_naive(x, p, cfg, kc, vc, position):
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = x.astype(np.float64)
    L = x.shape[0]
    qg = x @ p["q_proj"].T
    if cfg.attn_output_gate:
        q = np.stack([qg[:, 2 * hd * h: 2 * hd * h + hd] for h in range(nh)], 1)
        gate = np.stack([qg[:, 2 * hd * h + hd: 2 * hd * (h + 1)] for h in range(nh)], 1)
    else:
        q, gate = qg.reshape(L, nh, hd), None
    k = (x @ p["k_proj"].T).reshape(L, nkv, hd)
    v = (x @ p["v_proj"].T).reshape(L, nkv, hd)

    def norm(t, w):
        return t / np.sqrt((t ** 2).mean(-1, keepdims=True) + cfg.rms_norm_eps) * w

    def rot(t, pos):
        rd, out = cfg.rotary_dim, t.copy()
        for d in range(rd // 2):
            a = pos * cfg.rope_theta ** (-2 * d / rd)
            out[..., d] = t[..., d] * np.cos(a) - t[..., d + rd // 2] * np.sin(a)
            out[..., d + rd // 2] = t[..., d + rd // 2] * np.cos(a) + t[..., d] * np.sin(a)
        return out

    q, k = norm(q, p["q_norm"]), norm(k, p["k_norm"])
    q = np.stack([rot(q[i], position + i) for i in range(L)])
    k = np.stack([rot(k[i], position + i) for i in range(L)])
    K = np.concatenate([kc, k.transpose(1, 0, 2)], 1)
    V = np.concatenate([vc, v.transpose(1, 0, 2)], 1)
    o = np.zeros((L, nh, hd))
    for i in range(L):
        for h in range(nh):
            j = h // (nh // nkv)
            T = position + i + 1
            s = K[j, :T] @ q[i, h] / np.sqrt(hd)
            pr = np.exp(s - s.max())
            pr /= pr.sum()
            o[i, h] = pr @ V[j, :T]
            if gate is not None:
                o[i, h] *= 1 / (1 + np.exp(-gate[i, h]))
    return o.reshape(L, nh * hd) @ p["o_proj"].T, K, V


@pytest.mark.parametrize("which", ["base", "next"])
def test_full_attention_matches_naive(which, model, next_model):
    m = model if which == "base" else next_model
    cfg = m.config
    i = cfg.full_attention_layers[0]
    p = R._sub(m.layers[i], "self_attn.")
    rng = np.random.default_rng(8)
    x = rng.normal(size=(5, cfg.hidden_size)).astype(np.float32)
    pos = 7
    kc = rng.normal(size=(cfg.num_key_value_heads, pos, cfg.head_dim)).astype(np.float32)
    vc = rng.normal(size=(cfg.num_key_value_heads, pos, cfg.head_dim)).astype(np.float32)
    out, K, V = R.full_attention(x, p, cfg, kc, vc, pos)
    out_n, K_n, V_n = attention_naive(x, p, cfg, kc, vc, pos)
    assert rel_err(out_n, out) < 1e-5
    assert rel_err(K_n, K) < 1e-5 and rel_err(V_n, V) < 1e-5
    assert K.shape == (cfg.num_key_value_heads, pos + 5, cfg.head_dim)


def moe_naive(x, p, cfg):
    x = x.astype(np.float64)
    out = np.zeros_like(x)
    silu = lambda t: t / (1 + np.exp(-t))  # noqa: E731
    for t in range(x.shape[0]):
        logits = p["gate"] @ x[t]
        pr = np.exp(logits - logits.max())
        pr /= pr.sum()
        top = np.argsort(-pr, kind="stable")[:cfg.num_experts_per_tok]
        w = pr[top] / (pr[top].sum() if cfg.norm_topk_prob else 1.0)
        for e, we in zip(top, w):
            h = silu(p["switch_mlp.gate_proj"][e] @ x[t]) * (p["switch_mlp.up_proj"][e] @ x[t])
            out[t] += we * (p["switch_mlp.down_proj"][e] @ h)
        if cfg.shared_expert_intermediate_size:
            h = silu(p["shared_expert.gate_proj"] @ x[t]) * (p["shared_expert.up_proj"] @ x[t])
            sg = 1 / (1 + np.exp(-(p["shared_expert_gate"] @ x[t])[0]))
            out[t] += sg * (p["shared_expert.down_proj"] @ h)
    return out


@pytest.mark.parametrize("which", ["base", "next"])
def test_sparse_moe_matches_naive(which, model, next_model):
    m = model if which == "base" else next_model
    cfg = m.config
    p = R._sub(m.layers[0], "mlp.")
    x = np.random.default_rng(9).normal(size=(40, cfg.hidden_size)).astype(np.float32)
    assert rel_err(moe_naive(x, p, cfg), R.sparse_moe(x, p, cfg)) < 1e-5


def test_sparse_moe_renormalisation_matters(model):
    cfg = model.config
    p = R._sub(model.layers[0], "mlp.")
    x = np.random.default_rng(10).normal(size=(8, cfg.hidden_size)).astype(np.float32)
    cfg_no = ModelConfig.from_dict({**BASE, "norm_topk_prob": False})
    a, b = R.sparse_moe(x, p, cfg), R.sparse_moe(x, p, cfg_no)
    assert rel_err(moe_naive(x, p, cfg_no), b) < 1e-5
    assert rel_err(a, b) > 1e-3


def test_dense_mlp(next_model):
    cfg = next_model.config
    assert not cfg.is_moe_layer(2)
    p = R._sub(next_model.layers[2], "mlp.")
    x = np.random.default_rng(11).normal(size=(3, cfg.hidden_size)).astype(np.float32)
    g, u = x @ p["gate_proj"].T, x @ p["up_proj"].T
    ref = (g / (1 + np.exp(-g)) * u) @ p["down_proj"].T
    assert rel_err(ref, R.dense_mlp(x, p)) < 1e-5


# ---------------------------------------------------------------------------------------------
# full model
# ---------------------------------------------------------------------------------------------
def states_close(a: R.ReferenceState, b: R.ReferenceState, tol=1e-5):
    assert a.position == b.position
    for da, db in ((a.keys, b.keys), (a.values, b.values), (a.conv, b.conv), (a.ssm, b.ssm)):
        assert da.keys() == db.keys()
        for i in da:
            assert da[i].shape == db[i].shape and da[i].dtype == db[i].dtype == np.float32
            assert rel_err(da[i], db[i]) < tol, (i, rel_err(da[i], db[i]))


def test_new_state_shapes(model):
    c = model.config
    s = model.new_state()
    assert s.position == 0
    assert set(s.keys) == set(s.values) == {3} and set(s.conv) == set(s.ssm) == {0, 1, 2}
    assert s.keys[3].shape == (2, 0, 32)
    assert s.conv[0].shape == (c.linear_conv_kernel_dim - 1, c.conv_dim)
    assert s.ssm[0].shape == (4, 16, 16)
    assert all(not a.any() for a in s.arrays())
    assert s.nbytes == 3 * (3 * 128 + 4 * 16 * 16) * 4


def test_logits_modes_and_state_growth(model):
    ids = tokens(7)
    s1, s2, s3 = model.new_state(), model.new_state(), model.new_state()
    last = model.forward(s1, ids)
    allv = model.forward(s2, ids, logits="all")
    assert model.forward(s3, ids, logits="none") is None
    assert last.shape == (128,) and allv.shape == (7, 128) and last.dtype == allv.dtype == np.float32
    np.testing.assert_allclose(last, allv[-1], rtol=1e-6, atol=1e-6)
    states_close(s1, s3, tol=1e-7)
    assert s1.position == 7 and s1.keys[3].shape == (2, 7, 32)
    assert s1.nbytes == model.new_state().nbytes + 2 * 2 * 7 * 32 * 4


@pytest.mark.parametrize("which", ["base", "next"])
@pytest.mark.parametrize("split", [1, 13, 31])
def test_split_prefill_equals_single(which, split, model, next_model):
    m = model if which == "base" else next_model
    ids = tokens(40, m.config.vocab_size, seed=split)
    s_full = m.new_state()
    full = m.forward(s_full, ids, logits="all")
    s = m.new_state()
    a = m.forward(s, ids[:split], logits="all")
    b = m.forward(s, ids[split:], logits="all", chunk_size=16)
    assert rel_err(full, np.concatenate([a, b])) < 1e-5
    states_close(s_full, s)


@pytest.mark.parametrize("which", ["base", "next"])
def test_prefill_then_decode_equals_all(which, model, next_model):
    m = model if which == "base" else next_model
    ids = tokens(24, m.config.vocab_size, seed=5)
    s_full = m.new_state()
    full = m.forward(s_full, ids, logits="all")
    s = m.new_state()
    m.forward(s, ids[:9], logits="none")
    steps = [m.forward(s, ids[t:t + 1]) for t in range(9, 24)]
    assert rel_err(full[9:], np.stack(steps)) < 1e-5
    states_close(s_full, s)


@pytest.mark.parametrize("which", ["base", "next"])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_model_chunked_equals_recurrent(which, chunk, model, next_model):
    m = model if which == "base" else next_model
    ids = tokens(70, m.config.vocab_size, seed=chunk)
    s_c, s_r = m.new_state(), m.new_state()
    lc = m.forward(s_c, ids, logits="all", gdn_mode="chunked", chunk_size=chunk)
    lr = m.forward(s_r, ids, logits="all", gdn_mode="recurrent")
    assert rel_err(lr, lc) < 1e-5
    states_close(s_r, s_c)


def test_state_copy_is_independent(model):
    s = model.new_state()
    model.forward(s, tokens(10), logits="none")
    snap = s.copy()
    ref = {k: {i: a.copy() for i, a in d.items()} for k, d in
           (("keys", snap.keys), ("values", snap.values), ("conv", snap.conv), ("ssm", snap.ssm))}
    after_a = model.forward(s, np.array([5, 6, 7]))
    assert s.position == 13 and snap.position == 10
    for k, d in ref.items():
        for i, a in d.items():
            np.testing.assert_array_equal(getattr(snap, k)[i], a)
    # in-place mutation of the copy does not reach the original either
    snap2 = s.copy()
    snap2.ssm[0][...] = 123.0
    snap2.keys[3][...] = 5.0
    assert not np.any(s.ssm[0] == 123.0) and not np.any(s.keys[3] == 5.0)
    # continuing from the snapshot reproduces the same logits
    np.testing.assert_array_equal(model.forward(snap, np.array([5, 6, 7])), after_a)
    assert snap.nbytes == s.nbytes


def test_forward_is_deterministic_and_history_sensitive(model):
    a = model.forward(model.new_state(), tokens(12, seed=3))
    b = model.forward(model.new_state(), tokens(12, seed=3))
    np.testing.assert_array_equal(a, b)
    ids = tokens(12, seed=3)
    ids2 = ids.copy()
    ids2[0] = (ids2[0] + 1) % 128          # first token changes -> last logits change (state carries)
    assert rel_err(a, model.forward(model.new_state(), ids2)) > 1e-4


def test_each_layer_type_contributes(model):
    """Zeroing one block's output projection must change the logits (guards against dead code paths)."""
    ids = tokens(16, seed=4)
    base = model.forward(model.new_state(), ids, logits="all")
    for name in ("layers.0.linear_attn.out_proj", "layers.3.self_attn.o_proj",
                 "layers.1.mlp.switch_mlp.down_proj", "layers.2.mlp.shared_expert.down_proj"):
        params = dict(model.params)
        params[name] = np.zeros_like(params[name])
        m2 = R.ReferenceModel(model.config, params)
        assert rel_err(base, m2.forward(m2.new_state(), ids, logits="all")) > 1e-3, name


def test_bf16_mode_close_to_float32():
    ids = tokens(32, seed=6)
    for seed in (0, 1):
        m32, mbf = make_model(seed=seed), make_model(seed=seed, dtype="bfloat16")
        s32, sbf = m32.new_state(), mbf.new_state()
        a = m32.forward(s32, ids, logits="all")
        b = mbf.forward(sbf, ids, logits="all")
        assert np.all(np.isfinite(b))
        assert np.linalg.norm(a - b) / np.linalg.norm(a) < 5e-2
        assert rel_err(a, b) < 1e-1
        assert not np.array_equal(a, b)
        np.testing.assert_array_equal(b, R.to_bf16(b))                # logits are bf16 values
        np.testing.assert_array_equal(sbf.keys[3], R.to_bf16(sbf.keys[3]))   # KV cache holds bf16 values
        np.testing.assert_array_equal(sbf.values[3], R.to_bf16(sbf.values[3]))
        np.testing.assert_array_equal(sbf.conv[0], R.to_bf16(sbf.conv[0]))
        assert not np.array_equal(sbf.ssm[0], R.to_bf16(sbf.ssm[0]))       # GDN state stays fp32
        # decode in bf16 mode follows the same path
        c = mbf.forward(sbf, ids[:1])
        assert c.shape == (128,) and np.all(np.isfinite(c))


def test_bf16_prefill_decode_consistency():
    m = make_model(dtype="bfloat16")
    ids = tokens(12, seed=8)
    full = m.forward(m.new_state(), ids, logits="all", gdn_mode="recurrent")
    s = m.new_state()
    m.forward(s, ids[:6], logits="none", gdn_mode="recurrent")
    steps = np.stack([m.forward(s, ids[t:t + 1]) for t in range(6, 12)])
    np.testing.assert_array_equal(full[6:], steps)


def test_prefill_speed(model):
    import time
    ids = tokens(32, seed=9)
    best = float("inf")
    for _ in range(3):       # best of 3: a loaded machine can stall numpy's BLAS threads
        t = time.perf_counter()
        model.forward(model.new_state(), ids)
        best = min(best, time.perf_counter() - t)
    assert best < 0.5


def test_random_params_shapes_and_dtype():
    cfg = ModelConfig.from_dict(BASE)
    p = random_params(cfg, seed=3)
    assert p["layers.0.linear_attn.in_proj_qkv"].shape == (2 * 32 + 64, 64)
    assert p["layers.0.linear_attn.conv1d"].shape == (128, 4)
    assert p["layers.3.self_attn.q_proj"].shape == (4 * 32 * 2, 64)
    assert p["layers.3.mlp.switch_mlp.down_proj"].shape == (8, 64, 32)
    assert p["layers.3.mlp.shared_expert_gate"].shape == (1, 64)
    assert all(a.dtype == np.float32 for a in p.values())
    assert np.array_equal(p["embed_tokens"], random_params(cfg, seed=3)["embed_tokens"])
    pb = random_params(cfg, seed=3, dtype=R.BF16)
    assert pb["norm"].dtype == R.BF16
    nxt = random_params(ModelConfig.from_dict(NEXT))
    assert "lm_head" not in nxt and "layers.2.mlp.gate_proj" in nxt and "layers.0.mlp.shared_expert_gate" not in nxt
    assert nxt["layers.1.self_attn.q_proj"].shape == (4 * 16, 48)


# ---------------------------------------------------------------------------------------------
# optional: compare with HF transformers (float32)
# ---------------------------------------------------------------------------------------------
def _hf_state_dict(cfg: ModelConfig, P: dict, fused_next: bool):
    torch = require("torch")
    sd = {}
    shifted = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")
    t = lambda a: torch.from_numpy(np.array(a, dtype=np.float32))  # noqa: E731
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
    for k, v in P.items():
        if k == "embed_tokens":
            sd["model.embed_tokens.weight"] = t(v)
            if cfg.tie_word_embeddings:
                sd["lm_head.weight"] = t(v)
        elif k == "lm_head":
            sd["lm_head.weight"] = t(v)
        elif k == "norm":
            sd["model.norm.weight"] = t(v - 1)
        elif k.endswith(shifted):
            sd[f"model.{k}.weight"] = t(v - 1)
        elif k.endswith("conv1d"):
            sd[f"model.{k}.weight"] = t(v[:, None, :])
        elif k.endswith(("dt_bias", "A_log")):
            sd[f"model.{k}"] = t(v)
        elif k.endswith("switch_mlp.gate_proj"):
            up = P[k.replace("gate_proj", "up_proj")]
            sd["model." + k.replace("switch_mlp.gate_proj", "experts.gate_up_proj")] = t(np.concatenate([v, up], 1))
        elif k.endswith("switch_mlp.down_proj"):
            sd["model." + k.replace("switch_mlp.", "experts.")] = t(v)
        elif k.endswith("switch_mlp.up_proj"):
            pass
        elif fused_next and k.endswith(("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")):
            if not k.endswith("in_proj_qkv"):
                continue
            pre = k[:-len("in_proj_qkv")]
            q, kk, vv = np.split(v, [nk * dk, 2 * nk * dk])
            z, b, a = P[pre + "in_proj_z"], P[pre + "in_proj_b"], P[pre + "in_proj_a"]
            rows, ba = [], []
            for g in range(nk):      # grouped per k-head: [q_g | k_g | v_{g*r..} | z_{g*r..}], [b_g.. | a_g..]
                rows += [q[g * dk:(g + 1) * dk], kk[g * dk:(g + 1) * dk],
                         vv[g * r * dv:(g + 1) * r * dv], z[g * r * dv:(g + 1) * r * dv]]
                ba += [b[g * r:(g + 1) * r], a[g * r:(g + 1) * r]]
            sd[f"model.{pre}in_proj_qkvz.weight"] = t(np.concatenate(rows))
            sd[f"model.{pre}in_proj_ba.weight"] = t(np.concatenate(ba))
        else:
            sd[f"model.{k}.weight"] = t(v)
    return sd


@pytest.mark.parametrize("which", ["base", "next"])
def test_matches_hf_transformers(which):
    torch = require("torch")
    tr = require("transformers")
    if which == "base":
        d = BASE
        hcls, hcfg_cls = tr.Qwen3_5MoeForCausalLM, tr.Qwen3_5MoeTextConfig
    else:
        if not hasattr(tr, "Qwen3NextForCausalLM"):
            unavailable("transformers without Qwen3-Next (Qwen3NextForCausalLM)")
        # HF Qwen3-Next always has the attention output gate and a shared expert
        d = {**NEXT, "attn_output_gate": True, "shared_expert_intermediate_size": 16}
        hcls, hcfg_cls = tr.Qwen3NextForCausalLM, tr.Qwen3NextConfig
    m = make_model(d, seed=2)
    cfg = m.config
    hd = {k: v for k, v in d.items() if k not in ("model_type", "rope_theta", "partial_rotary_factor",
                                                  "attn_output_gate")}
    hd["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta,
                             "partial_rotary_factor": cfg.partial_rotary_factor}
    hf = hcls(hcfg_cls(**hd)).float().eval()
    hf.load_state_dict(_hf_state_dict(cfg, m.params, fused_next=which == "next"), strict=True)
    # transformers 5.x renamed past_key_values -> cache (argument and output field)
    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"

    def get_cache(out):
        return out.cache if "cache" in out else out.past_key_values

    ids = tokens(40, cfg.vocab_size, seed=11)
    with torch.no_grad():
        out = hf(torch.tensor(ids)[None], use_cache=True)
    s = m.new_state()
    mine = m.forward(s, ids, logits="all")
    assert rel_err(out.logits[0].numpy(), mine) < 1e-4
    cache = get_cache(out)
    for tok in (3, 77, 12):
        with torch.no_grad():
            o2 = hf(torch.tensor([[tok]]), use_cache=True, **{cache_kw: cache})
        cache = get_cache(o2)
        assert rel_err(o2.logits[0, -1].numpy(), m.forward(s, np.array([tok]))) < 1e-4


# ---------------------------------------------------------------------------------------------
# optional: bf16 rounding points against MLX (bit-exact pieces)
# ---------------------------------------------------------------------------------------------
def test_bf16_blocks_bit_exact_vs_mlx():
    mx = require("mlx.core")
    gd = require("mlx_lm.models.gated_delta")
    qn = require("mlx_lm.models.qwen3_next")
    if not hasattr(gd, "normalize_qk"):
        unavailable("mlx-lm without gated_delta.normalize_qk")
    normalize_qk, Qwen3NextRMSNormGated = gd.normalize_qk, qn.Qwen3NextRMSNormGated

    rng = np.random.default_rng(14)
    b16 = R.to_bf16

    def to_mx(a):
        return mx.array(np.asarray(a, np.float32)).astype(mx.bfloat16)

    def back(a):
        return np.array(a.astype(mx.float32))

    x = b16(rng.normal(size=(16, 64)) * 2)
    w = b16(1 + 0.1 * rng.normal(size=64))
    np.testing.assert_array_equal(R.rms_norm(x, w, 1e-6, bf16=True),
                                  back(mx.fast.rms_norm(to_mx(x), to_mx(w), 1e-6)))

    o = b16(rng.normal(size=(16, 4, 32)) * 0.1)
    z = b16(rng.normal(size=(16, 4, 32)))
    gw = b16(1 + 0.1 * rng.normal(size=32))
    gn = Qwen3NextRMSNormGated(32, eps=1e-6)
    gn.weight = to_mx(gw)
    # the normalise-and-weight part is bit-exact; MLX's compiled silu(z) differs from float32 silu by a few
    # float32 ulps, which moves ~3 % of the final bf16 roundings by one bf16 ulp
    mine = R.gated_rms_norm(o, z, gw, 1e-6, bf16=True)
    theirs = back(gn(to_mx(o), to_mx(z)))
    inv = 1.0 / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + np.float32(1e-6))
    np.testing.assert_array_equal(b16(gw * b16(o * inv)), back(mx.fast.rms_norm(to_mx(o), to_mx(gw), 1e-6)))
    assert np.all(np.abs(mine - theirs) <= np.abs(theirs) * 2.0 ** -7)
    assert np.mean(mine == theirs) > 0.9

    q = b16(rng.normal(size=(16, 2, 32)))
    k = b16(rng.normal(size=(16, 2, 32)))
    mq, mk = normalize_qk(to_mx(q), to_mx(k), inv_scale=32 ** -0.5, eps=1e-6)
    rq, rk = R._normalize_qk(q, k, bf16=True)
    np.testing.assert_array_equal(rq, back(mq))
    np.testing.assert_array_equal(rk, back(mk))

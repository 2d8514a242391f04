"""The MTP (multi-token prediction) head: its numpy reference forward against a plain re-implementation of the
published formula (vLLM ``qwen3_next_mtp.py`` / mlx-vlm ``qwen3_5_mtp.py``), the drafter's incremental
chaining against drafting from scratch, ``convert(keep_mtp=True)``, a separate head folder, the error for a
checkpoint without a head, and ``speculative="mtp"`` giving the plain greedy output."""
import hashlib
import json

import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal.checkpoint_writer import canonical_params
from qwenmetal.config import ModelConfig
from qwenmetal.convert import convert
from qwenmetal.mtp import MtpDrafter
from qwenmetal.backends.reference import ReferenceModel, ReferenceMtp
from qwenmetal.safetensors_io import TensorSource
from qwenmetal.testing import PRESETS, cached_checkpoint, make_checkpoint
from qwenmetal.weights import QuantizedTensor, to_float32


# ---- a plain numpy MTP head, written from the formula (nothing from qwenmetal.backends.reference) -------------
def _norm(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _silu(x):
    return x * _sigmoid(x)


def naive_mtp(c: ModelConfig, P: dict, embed, lm_head, hidden, tokens):
    """Logits [L, V] and output hidden [L, H] of the MTP head over the pairs (hidden[p], tokens[p]) at RoPE
    positions p = 0..L-1, recomputed from scratch: concat(norm_e(embed(t)), norm_h(h)) -> fc -> one
    full-attention MoE decoder layer -> norm -> lm_head. `P`: the head's shifted float32 weights."""
    eps, L = c.rms_norm_eps, len(tokens)
    nh, nkv, hd, rd = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim
    x = np.concatenate([_norm(embed[tokens], P["pre_fc_norm_embedding"], eps),
                        _norm(hidden, P["pre_fc_norm_hidden"], eps)], axis=1) @ P["fc"].T.astype(np.float64)
    a = "layers.0.self_attn."
    h = _norm(x, P["layers.0.input_layernorm"], eps)
    qg = (h @ P[a + "q_proj"].T).reshape(L, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(L, nh * hd)
    k = (h @ P[a + "k_proj"].T).reshape(L, nkv, hd)
    v = (h @ P[a + "v_proj"].T).reshape(L, nkv, hd)
    q, k = _norm(q, P[a + "q_norm"], eps), _norm(k, P[a + "k_norm"], eps)
    inv = c.rope_theta ** (-np.arange(0, rd, 2) / rd)
    ang = np.arange(L)[:, None] * inv[None]                # position of pair p = p
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rope(t):
        t1, t2 = t[..., :rd // 2], t[..., rd // 2:rd]
        return np.concatenate([t1 * cos - t2 * sin, t2 * cos + t1 * sin, t[..., rd:]], -1)

    q, k = rope(q), rope(k)
    o = np.zeros((L, nh, hd))
    for i in range(nh):
        kv = i // (nh // nkv)
        s = q[:, i] @ k[:, kv].T / np.sqrt(hd)
        s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        o[:, i] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kv]
    x = x + (o.reshape(L, -1) * _sigmoid(gate)) @ P[a + "o_proj"].T
    m = "layers.0.mlp."
    h = _norm(x, P["layers.0.post_attention_layernorm"], eps)
    y = np.zeros_like(h)
    for t in range(L):
        z = h[t] @ P[m + "gate"].T
        pr = np.exp(z - z.max())
        pr /= pr.sum()
        top = np.argsort(-pr, kind="stable")[:c.num_experts_per_tok]
        wts = pr[top] / (pr[top].sum() if c.norm_topk_prob else 1.0)
        for e, wt in zip(top, wts):
            g, u = P[m + "switch_mlp.gate_proj"][e] @ h[t], P[m + "switch_mlp.up_proj"][e] @ h[t]
            y[t] += wt * (P[m + "switch_mlp.down_proj"][e] @ (_silu(g) * u))
        sh = P[m + "shared_expert.down_proj"] @ (_silu(P[m + "shared_expert.gate_proj"] @ h[t])
                                                 * (P[m + "shared_expert.up_proj"] @ h[t]))
        y[t] += _sigmoid(P[m + "shared_expert_gate"] @ h[t])[0] * sh
    out = _norm(x + y, P["norm"], eps)
    return out @ lm_head.T.astype(np.float64), out


def _split_mtp(P):
    return {k[4:]: v for k, v in P.items() if k.startswith("mtp.")}, \
        {k: v for k, v in P.items() if not k.startswith("mtp.")}


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3-next"])
def test_reference_mtp_matches_plain_formula(preset):
    c = ModelConfig.from_dict(PRESETS[preset])
    mtp, body = _split_mtp(canonical_params(c, 3, "reference", mtp=True))
    ref = ReferenceModel(c, body)
    head = ReferenceMtp.from_model(ref, mtp)
    rng = np.random.default_rng(0)
    L = 9
    hidden = rng.standard_normal((L, c.hidden_size)).astype(np.float32) * 3
    tokens = rng.integers(0, c.vocab_size, L)
    want, want_h = naive_mtp(c, mtp, ref.embed_tokens, ref.lm_head, hidden, tokens)
    st = head.new_state()
    got, got_h = [], []
    for a, b in ((0, 4), (4, 5), (5, L)):                      # cached calls = one call
        got.append(head.forward(st, hidden[a:b], tokens[a:b], logits="all", out_hidden=got_h))
    assert st.position == L and st.keys[0].shape[1] == L
    np.testing.assert_allclose(np.concatenate(got), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.concatenate(got_h), want_h, rtol=1e-4, atol=1e-4)
    # logits="last" is the last row; the main forward's final_hidden is what its lm_head multiplies
    st2 = head.new_state()
    np.testing.assert_allclose(head.forward(st2, hidden, tokens, logits="last"), want[-1], rtol=1e-4, atol=1e-4)
    fh, hid = [], []
    logits = ref.forward(ref.new_state(), tokens, logits="all", final_hidden=fh, hidden=hid)
    np.testing.assert_allclose(fh[0], _norm(hid[-1], ref.norm, c.rms_norm_eps), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits, fh[0] @ ref.lm_head.T, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def mtp_ckpt():
    return cached_checkpoint("tiny", "mlx-q4", 0, mtp=True)


def _drafts_from_scratch(m, ctx, k):
    """Draft k tokens after `ctx` with the plain formula: main final-normed hidden at 0..n-2, pairs
    (h_p, ctx[p+1]), then chained on the head's own output."""
    ref = ReferenceModel(m.config, m.weights.dense_float32())
    P = {k_: to_float32(v).astype(np.float64) for k_, v in m.weights.mtp.items()}
    fh = []
    ref.forward(ref.new_state(), np.asarray(ctx[:-1]), logits="none", final_hidden=fh)
    hs, toks = list(fh[0]), list(ctx[1:])
    out = []
    V = min(m.tokenizer.vocab_size, m.config.vocab_size)      # ids a sampler can return
    for _ in range(k):
        logits, oh = naive_mtp(m.config, P, ref.embed_tokens, ref.lm_head, np.array(hs), np.array(toks))
        out.append(int(np.argmax(logits[-1][:V])))
        hs.append(oh[-1])
        toks.append(out[-1])
    return out


def test_drafter_incremental_equals_from_scratch(mtp_ckpt):
    """The numpy drafter (any backend but cpu), fed growing contexts, drafts what the formula gives."""
    m = qm.Model.load(mtp_ckpt, backend="reference")
    d = MtpDrafter.for_model(m)
    d.start(m)
    rng = np.random.default_rng(1)
    ctx = rng.integers(0, 400, 14).tolist()
    for n in (5, 6, 11, 14):                                   # a growing context, as a generation feeds it
        assert d.draft(ctx[:n], 3) == _drafts_from_scratch(m, ctx[:n], 3)
    other = rng.integers(0, 400, 7).tolist()                   # another context: starts over
    assert d.draft(other, 2) == _drafts_from_scratch(m, other, 2)
    assert d.draft(ctx[:1], 3) == [] and d.draft(ctx, 0) == []
    d.close()


def _digests(d):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def test_convert_keep_mtp_round_trip(tmp_path, mtp_ckpt):
    hf = make_checkpoint(tmp_path / "hf", "tiny", "hf-bf16", seed=0, mtp=True)
    assert json.loads((hf / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    out = convert(hf, tmp_path / "q4", keep_mtp=True, drop_vision=True)
    assert _digests(out) == _digests(mtp_ckpt)                 # the mtp fixture is this conversion
    keys = TensorSource(out).keys()
    assert "mtp.fc.weight" in keys and "mtp.fc.scales" in keys
    assert "mtp.layers.0.mlp.switch_mlp.gate_proj.scales" in keys and "mtp.norm.weight" in keys
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["mtp.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}
    w = qm.Model.load(out, backend="reference").weights
    w_hf = qm.Model.load(hf, backend="reference").weights
    assert w.mtp_error is None and sorted(w.mtp) == sorted(w_hf.mtp)
    assert isinstance(w.mtp["fc"], QuantizedTensor) and w.mtp["fc"].bits == 4
    assert w.mtp["layers.0.mlp.gate"].bits == 8
    for name in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "layers.0.self_attn.q_norm"):
        assert not isinstance(w.mtp[name], QuantizedTensor)     # norms kept, shifted like the body's (1 + w)
        np.testing.assert_allclose(to_float32(w.mtp[name]), to_float32(w_hf.mtp[name]), atol=4e-3)
        assert abs(float(np.mean(to_float32(w.mtp[name]))) - 1) < 0.1
    np.testing.assert_allclose(to_float32(w.mtp["fc"]), to_float32(w_hf.mtp["fc"]), atol=0.03)
    # without keep_mtp the head is dropped, as mlx_lm.convert does
    plain = convert(hf, tmp_path / "plain")
    assert not any("mtp." in k for k in TensorSource(plain).keys())
    assert qm.Model.load(plain, backend="reference").weights.mtp == {}
    no_head = make_checkpoint(tmp_path / "hf0", "tiny", "hf-bf16", seed=0)
    with pytest.raises(ValueError, match=r"keep_mtp: the checkpoint has no MTP head"):
        convert(no_head, tmp_path / "bad", keep_mtp=True)


def test_mtp_without_head_raises_clearly():
    m = qm.Model.load(cached_checkpoint("tiny", "mlx-q4", 0), backend="reference")
    assert m.weights.mtp == {}
    with pytest.raises(ValueError, match=r"has no MTP head \(mtp\.\* weights\).*convert with --keep-mtp "
                                         r"or pass a separate MTP head folder"):
        list(m.generate("Hello", max_tokens=4, temperature=0, speculative="mtp"))


def test_separate_head_folder(tmp_path, mtp_ckpt):
    """mlx-vlm's split layout: the mtp.* tensors without the prefix, config model_type qwen3_5_mtp."""
    from safetensors.numpy import save_file
    src = TensorSource(mtp_ckpt)
    folder = tmp_path / "head"
    folder.mkdir()
    save_file({k[4:]: np.asarray(src.get(k)) for k in src.keys() if k.startswith("mtp.")},
              str(folder / "model.safetensors"), metadata={"format": "mlx"})
    cfg = json.loads((mtp_ckpt / "config.json").read_text())
    q = {k[4:] if k.startswith("mtp.") else k: v for k, v in cfg["quantization"].items()}
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5_mtp", "text_config": cfg["text_config"],
                                                    "quantization": q}))
    with_head = qm.Model.load(mtp_ckpt, backend="reference")
    bare = qm.Model.load(cached_checkpoint("tiny", "mlx-q4", 0), backend="reference")
    d = MtpDrafter.for_model(bare, path=folder)
    assert sorted(d.params) == sorted(with_head.weights.mtp)
    for k, v in d.params.items():
        np.testing.assert_array_equal(to_float32(v), to_float32(with_head.weights.mtp[k]))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe"}))
    with pytest.raises(ValueError, match=r"model_type 'qwen3_5_moe', expected 'qwen3_5_mtp'"):
        MtpDrafter.for_model(bare, path=folder)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3-next"])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_speculative_mtp_is_plain_greedy(preset, backend):
    d = cached_checkpoint(preset, "mlx-q4", 0, mtp=True)
    m = qm.Model.load(d, backend=backend, **({"threads": 2} if backend == "cpu" else {}))
    kw = dict(max_tokens=40, temperature=0, ignore_eos=True, cache=False)
    plain = list(m.generate("The quick brown fox", **kw))
    spec = list(m.generate("The quick brown fox", speculative="mtp", speculative_k=3, **kw))
    assert [o.token for o in spec] == [o.token for o in plain]
    st = spec[-1].stats["speculative"]
    assert st["drafter"] == "mtp" and st["drafted_tokens"] > 0


def test_native_head_matches_the_reference(mtp_ckpt):
    """The cpu backend's MTP head engine (CpuBackend.mtp_head: fc over [embedding; hidden] in C++, then the
    one-layer engine) against ReferenceMtp on the same weights, float activations and cache: logits and
    the head's normed output within 1e-4 of their range; the main model's verification hidden rows
    against the reference's final-normed hidden states likewise."""
    m = qm.Model.load(mtp_ckpt, backend="cpu", threads=2, activations="float", kv_dtype="float32")
    head = m._backend.mtp_head(m.weights.mtp).engine
    assert head.is_mtp_head and not m._backend.engine.is_mtp_head
    ref = ReferenceModel(m.config, m.weights.dense_float32())
    rh = ReferenceMtp.from_model(ref, {k: to_float32(v) for k, v in m.weights.mtp.items()})
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 400, 9)
    fh = []
    ref.forward(ref.new_state(), ids, logits="none", final_hidden=fh)
    s = m.new_session()
    _, hid = m._backend.verify(s._state, ids, None, return_hidden=True)
    assert np.abs(hid - fh[0]).max() < 1e-4 * np.ptp(fh[0])
    hid = np.ascontiguousarray(fh[0][:-1], dtype=np.float32)
    nxt = ids[1:]
    lg, h = head.forward(head.new_state(), nxt, "all", None, hidden=hid, return_hidden=1)
    out = []
    want = rh.forward(rh.new_state(), hid, nxt, "all", out_hidden=out)
    assert np.abs(lg - want).max() < 1e-4 * np.ptp(want)
    assert np.abs(h - out[0]).max() < 1e-4 * np.ptp(out[0])
    with pytest.raises(ValueError, match="needs the main model's hidden states"):
        head.forward(head.new_state(), nxt, "all", None)
    with pytest.raises(ValueError, match="hidden states are an MTP head's input"):
        m._backend.engine.forward(m.new_session()._state, nxt, "all", None, hidden=hid)


def test_native_drafts_follow_the_formula(mtp_ckpt):
    """The native drafter, given the verification calls' hidden rows (Drafter.observe), drafts what the
    formula gives from scratch (float activations)."""
    m = qm.Model.load(mtp_ckpt, backend="cpu", threads=2, activations="float", kv_dtype="float32")
    d = MtpDrafter.for_model(m)
    d.start(m)
    assert d.wants_hidden
    rng = np.random.default_rng(1)
    ctx = rng.integers(0, 400, 14).tolist()
    s = m.new_session()
    fed = 0
    for n in (5, 6, 11, 14):                                   # a growing context, as a generation feeds it
        _, hid = m._backend.verify(s._state, np.asarray(ctx[fed:n - 1]), s._tokens, return_hidden=True)
        m._backend.rewind(s._state, n - 1 - fed, s._tokens)
        d.observe(fed, hid)
        fed = n - 1
        assert d.draft(ctx[:n], 3) == _drafts_from_scratch(m, ctx[:n], 3)


def test_cli_convert_keep_mtp(tmp_path):
    """`qwenmetal convert --keep-mtp` keeps the head (loads into Weights.mtp); without it the head goes."""
    from qwenmetal.cli import main
    src = str(cached_checkpoint("tiny", "hf-bf16", 0, mtp=True))
    assert main(["convert", src, str(tmp_path / "keep"), "--keep-mtp", "--quiet"]) == 0
    assert main(["convert", src, str(tmp_path / "drop"), "--quiet"]) == 0
    keep = qm.Model.load(tmp_path / "keep", backend="reference").weights
    drop = qm.Model.load(tmp_path / "drop", backend="reference").weights
    assert "fc" in keep.mtp and isinstance(keep.mtp["fc"], QuantizedTensor) and not drop.mtp


def test_native_head_caches_the_prompt(mtp_ckpt):
    """A generation's prompt prefill hands every row's hidden state to the native drafter
    (Speculation.prefill -> CpuBackend.forward_hidden), so the head's cache holds the prompt's pairs and the
    first drafts are the formula's over the whole context; forward_hidden's rows are the reference's."""
    from qwenmetal.speculative import Speculation
    m = qm.Model.load(mtp_ckpt, backend="cpu", threads=2, activations="float", kv_dtype="float32")
    ctx = np.random.default_rng(4).integers(0, 400, 40).tolist()
    s = m.new_session()
    d = MtpDrafter.for_model(m)
    sp = Speculation(m, s, d, None)
    logits = sp.prefill(ctx[:-1], "last")
    assert logits.shape == (m.config.vocab_size,) and s.tokens == tuple(ctx[:-1])
    assert d.draft(ctx, 3) == _drafts_from_scratch(m, ctx, 3)
    ref = ReferenceModel(m.config, m.weights.dense_float32())
    fh = []
    ref.forward(ref.new_state(), np.asarray(ctx[:8]), logits="none", final_hidden=fh)
    out, hid = m._backend.forward_hidden(m.new_session()._state, np.asarray(ctx[:8]), "none")
    assert out is None and np.abs(hid - fh[0]).max() < 1e-4 * np.ptp(fh[0])
    sp.close()


def test_cli_speculative_mtp(mtp_ckpt, tmp_path, capsys):
    """`generate --speculative mtp` and `--speculative mtp:DIR` (a separate head folder written from the
    checkpoint's own head) print the plain greedy text and the drafting statistics."""
    from qwenmetal.cli import main
    args = ["generate", "--model", str(mtp_ckpt), "--backend", "cpu", "--prompt", "ab cd ab cd", "--temperature",
            "0", "--max-tokens", "16", "--ignore-eos"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--speculative", "mtp", "--speculative-k", "2"]) == 0
    out = capsys.readouterr()
    assert out.out == plain and "speculative (mtp): " in out.err
    assert main(["generate", "--model", str(cached_checkpoint("tiny", "mlx-q4", 0)), "--backend", "cpu", "--prompt",
                 "x", "--max-tokens", "2", "--speculative", "mtp"]) == 2
    err = capsys.readouterr().err
    assert "has no MTP head" in err and "--speculative mtp:DIR" in err

"""Speculative decoding (qwenmetal.speculative, docs/speculative.md): the output is plain decoding's -- greedy
token for token, sampling in distribution -- for every drafter, and the session ends holding exactly what
plain decoding leaves; the cpu engine's verification rows and its rewind are bit for bit one-token calls."""
import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal import session as ses
from qwenmetal.cli import _stats_line
from qwenmetal import speculative as sp
from qwenmetal.sampling import Sampler
from qwenmetal.speculative import AdaptiveK, PromptLookup, ScriptedDrafter
from qwenmetal.testing import cached_checkpoint

PROMPT = [5, 9, 17, 33, 65, 129, 200, 7, 5, 9, 17, 33, 3, 4]


def _load(preset="tiny", fmt="mlx-q4", backend="cpu", seed=0, **kw):
    if backend == "cpu":
        kw.setdefault("threads", 2)
    return qm.Model.load(cached_checkpoint(preset, fmt, seed=seed), backend=backend, **kw)


def _greedy(model, prompt, n, **kw):
    outs = list(model.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True, **kw))
    return [o.token for o in outs], outs[-1].stats


def _state_arrays(model, s):
    return model._backend.state_to_arrays(s._state)


def _same_state(model, a, b):
    x, y = _state_arrays(model, a), _state_arrays(model, b)
    return x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


# ---- the engine's verification and rewind --------------------------------------------------------
def _check_verify_and_rewind(m):
    """verify(n ids) returns bit for bit the logits of n decode steps, and rewind(keep) leaves bit for bit
    the state of a session that decoded only the first `keep` ids (every keep, 0..n), also after a chain
    of verify calls; the session's tokens follow."""
    drafts = [11, 300, 42, 7, 256, 99]
    base = m.new_session()
    m.prefill(base, PROMPT)
    seq = base.fork()
    want = np.stack([m.decode_step(seq, t) for t in drafts])
    for keep in range(len(drafts) + 1):
        s = base.fork()
        got = ses.verify(m, s, drafts)
        np.testing.assert_array_equal(got, want)
        assert s.position == len(PROMPT) + len(drafts) and ses.rewindable(m, s) == len(drafts)
        ses.rewind(m, s, keep)
        ref = base.fork()
        for t in drafts[:keep]:
            m.decode_step(ref, t)
        assert s.tokens == ref.tokens and s.position == ref.position and ses.rewindable(m, s) == 0
        assert _same_state(m, s, ref)
        np.testing.assert_array_equal(m.decode_step(s, 1), m.decode_step(ref, 1))
    chain = base.fork()                               # a chain of one-token calls, as a draft model drafts
    for t in drafts:
        ses.verify(m, chain, [t])
    ses.rewind(m, chain, 2)
    ref = base.fork()
    for t in drafts[:2]:
        m.decode_step(ref, t)
    assert _same_state(m, chain, ref) and chain.tokens == ref.tokens


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3-next"])
@pytest.mark.parametrize("activations", ["int16", "float"])
def test_verify_rows_are_one_token_calls_and_rewind_is_exact(preset, activations):
    _check_verify_and_rewind(_load(preset, activations=activations, kv_dtype="float32"))


@pytest.mark.parametrize("preset,attention", [("tiny", None), ("tiny-qwen3-next", None),
                                               # rows across the single / split / two-pass routes
                                               ("tiny", {"single_pass_max": 16, "split_max": 18})])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_metal_graph_verify_rows_are_decode_steps_and_rewind_is_exact(preset, attention, dtype):
    """The Metal graph's verification (simulator-verified): rows bit for bit decode steps, an exact rewind,
    and the hidden rows it returns are the final-normed rows (the lm_head's logits from them)."""
    m = _load(preset, backend="metal-sim", dtype=dtype, **({"attention": attention} if attention else {}))
    assert m._backend.native_verify
    _check_verify_and_rewind(m)
    s = m.new_session()
    m.prefill(s, PROMPT)
    logits, hidden = ses.verify(m, s, [3, 4], return_hidden=True)
    assert hidden.shape == (2, m.config.hidden_size) and np.isfinite(hidden).all() and hidden.std() > 0
    assert s._state.verify_bytes > 0


def test_metal_graph_verify_errors_leave_the_state_alone():
    m = _load(backend="metal-sim")
    s = m.new_session()
    m.prefill(s, PROMPT)
    ref = s.fork()
    with pytest.raises(ValueError, match="nothing to rewind"):
        ses.rewind(m, s, 0)
    with pytest.raises(ValueError, match="at most 16 tokens per verification"):
        ses.verify(m, s, [1] * 17)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m._backend.verify(s._state, np.array([1, m.config.vocab_size]), s._tokens)
    assert s.tokens == ref.tokens and _same_state(m, s, ref) and ses.rewindable(m, s) == 0
    ses.verify(m, s, [1] * 10)
    with pytest.raises(ValueError, match="a verification chain holds at most 16 tokens"):
        ses.verify(m, s, [1] * 7)
    with pytest.raises(ValueError, match="keeps 0..10"):
        ses.rewind(m, s, 11)
    assert s.position == len(PROMPT) + 10 and len(s.tokens) == s.position
    m.decode_step(s, 4)                               # any other call ends the chain
    assert ses.rewindable(m, s) == 0


def test_rewind_errors_leave_the_session_alone():
    m = _load()
    s = m.new_session()
    m.prefill(s, PROMPT)
    with pytest.raises(ValueError, match="nothing to rewind"):
        ses.rewind(m, s, 0)
    ses.verify(m, s, [1, 2, 3])
    with pytest.raises(ValueError, match="keeps 0..3"):
        ses.rewind(m, s, 4)
    assert s.position == len(PROMPT) + 3 and ses.rewindable(m, s) == 3
    m.decode_step(s, 4)                               # any other call ends the chain
    assert ses.rewindable(m, s) == 0
    small = _load(prefill_chunk=4)
    with pytest.raises(ValueError, match="at most 4 tokens"):
        ses.verify(small, small.new_session(), [1] * 5)


# ---- greedy identity ----------------------------------------------------------------------------------
def _drafters(prompt, plain, vocab):
    script = list(prompt) + plain
    n0 = len(prompt)
    return {
        "lookup": "lookup",
        "all-accept": ScriptedDrafter(script, vocab=vocab),
        "rejections": ScriptedDrafter(script, wrong_at=[n0 + 1, n0 + 5, n0 + 6, n0 + 20, n0 + 33], vocab=vocab),
        "half-wrong": ScriptedDrafter(script, corrupt=0.5, vocab=vocab, seed=3),
    }


@pytest.mark.parametrize("preset,fmt", [("tiny", "mlx-q4"), ("tiny-qwen3-next", "mlx-q4"), ("tiny", "hf-bf16"),
                                        ("tiny", "mlx-q8")])
def test_greedy_speculation_gives_the_plain_tokens(preset, fmt):
    """Every drafter, forced rejections and all-accept, fixed and adaptive k, over a generation that crosses
    the 16-token prefill chunk many times: the tokens of plain greedy decoding, and the session afterwards
    holds what plain decoding left, bit for bit."""
    m = _load(preset, fmt, prefill_chunk=16, kv_dtype="float32")
    n = 72
    plain_s = m.new_session()
    plain, _ = _greedy(m, PROMPT, n, session=plain_s)
    for name, d in _drafters(PROMPT, plain, m.config.vocab_size).items():
        for k in (None, 1, 4, 8):
            s = m.new_session()
            toks, st = _greedy(m, PROMPT, n, session=s, speculative=d, speculative_k=k)
            assert toks == plain, (name, k)
            assert st["speculative"]["drafter"] in ("lookup", "scripted")
            assert s.tokens == plain_s.tokens and _same_state(m, s, plain_s), (name, k)
            if name == "all-accept" and k:
                assert st["speculative"]["acceptance_rate"] == 1.0
                assert st["speculative"]["rounds"] <= n // k + 2


def test_a_draft_model_gives_the_plain_tokens():
    """A draft model (another checkpoint of the same vocabulary; and the target itself, which must be
    accepted every time) drafts through verify chains on its own session."""
    m = _load(kv_dtype="float32")
    plain, _ = _greedy(m, PROMPT, 60, cache=False)
    other = _load(seed=1)
    toks, st = _greedy(m, PROMPT, 60, cache=False, speculative=other, speculative_k=3)
    assert toks == plain and st["speculative"]["drafted_tokens"] > 0
    toks, st = _greedy(m, PROMPT, 60, cache=False, speculative=_load(kv_dtype="float32"), speculative_k=3)
    assert toks == plain and st["speculative"]["acceptance_rate"] == 1.0


@pytest.mark.parametrize("backend,kw", [("reference", {}), ("metal-sim", {}), ("metal-sim", {"expert_slots": 4}),
                                        ("metal-sim", {"dtype": "bfloat16"})])
def test_greedy_speculation_on_the_other_backends(backend, kw):
    """The Metal graph's native verification (resident experts) and the row-by-row fallback (the reference,
    Metal expert streaming): the plain tokens, which metal-sim samples in its GPU decode loop."""
    if backend not in qm.backends.BACKENDS:
        pytest.fail(f"backend {backend} is not built here")
    m = _load(backend=backend, **kw)
    assert m.native_verify == (backend == "metal-sim" and "expert_slots" not in kw)
    n = 24 if backend == "metal-sim" else 40
    plain, _ = _greedy(m, PROMPT, n, cache=False)
    d = ScriptedDrafter(PROMPT + plain, wrong_at=[len(PROMPT) + 3, len(PROMPT) + 9], vocab=m.config.vocab_size)
    toks, st = _greedy(m, PROMPT, n, cache=False, speculative=d, speculative_k=3)
    assert toks == plain and st["speculative"]["accepted_tokens"] > 0


def test_speculation_with_the_prefix_cache_and_stops():
    """A second generation of a cached prompt, a stop id inside an accepted run of drafts and a stop string:
    the plain outputs, and the cache keeps the plain turn."""
    m = _load(kv_dtype="float32")
    plain, _ = _greedy(m, PROMPT, 50)
    d = ScriptedDrafter(PROMPT + plain, vocab=m.config.vocab_size)
    again, st = _greedy(m, PROMPT, 50, speculative=d, speculative_k=4)
    assert again == plain and st["cached_tokens"] == len(PROMPT)
    stop_at = plain[17]
    want = [o.token for o in m.generate(PROMPT, max_tokens=50, temperature=0, stop_token_ids=[stop_at])]
    got = [o.token for o in m.generate(PROMPT, max_tokens=50, temperature=0, stop_token_ids=[stop_at],
                                       speculative=d, speculative_k=6)]
    assert got == want and got[-1] == stop_at
    text = m.tokenizer.decode(plain[:30])
    stop = text[len(text) // 2:len(text) // 2 + 3]
    want = [(o.token, o.text) for o in m.generate(PROMPT, max_tokens=50, temperature=0, stop=[stop])]
    got = [(o.token, o.text) for o in m.generate(PROMPT, max_tokens=50, temperature=0, stop=[stop],
                                                 speculative=d, speculative_k=5)]
    assert got == want


def test_closing_the_stream_leaves_the_plain_session():
    """A consumer that stops reading after 10 tokens (an interrupt, a disconnect) leaves the session where
    plain decoding leaves it: the drafts verified past the 10th token are dropped."""
    m = _load(kv_dtype="float32")
    plain_s, spec_s = m.new_session(), m.new_session()
    g = m.generate(PROMPT, max_tokens=40, temperature=0, ignore_eos=True, session=plain_s)
    plain = [next(g).token for _ in range(10)]
    g.close()
    script = PROMPT + [o.token for o in m.generate(PROMPT, max_tokens=40, temperature=0, ignore_eos=True)]
    g = m.generate(PROMPT, max_tokens=40, temperature=0, ignore_eos=True, session=spec_s,
                   speculative=ScriptedDrafter(script, vocab=m.config.vocab_size), speculative_k=6)
    got = [next(g).token for _ in range(10)]
    g.close()
    assert got == plain and spec_s.tokens == plain_s.tokens and _same_state(m, spec_s, plain_s)


# ---- sampling: the target distribution -------------------------------------------------------------
from test_sampling import CHI2_DF8_P001  # noqa: E402  (the chi-square bound, defined with the Sampler's test)


def test_speculative_sampling_matches_plain_sampling():
    """End to end on the cpu backend: the joint law of the first two generated tokens (the second decided
    at a drafted position) over 1500 seeded runs equals the model's exact joint p(a) p(b | a), computed from
    its logits; top_k=3 keeps it to 9 cells. The drafter proposes a fixed token for the second position."""
    m = _load(kv_dtype="float32")
    opts = dict(temperature=1.0, top_k=3, ignore_eos=True, cache=False)
    samp = Sampler(temperature=1.0, top_k=3)
    vocab = min(m.tokenizer.vocab_size, m.config.vocab_size)
    s = m.new_session()
    first = m.prefill(s, PROMPT)
    ca, pa = samp._distribution(first[:vocab].astype(np.float64))
    joint = {}
    for a, pa_ in zip(ca.tolist(), pa):
        cb, pb = samp._distribution(m.decode_step(s.fork(), a)[:vocab].astype(np.float64))
        for b, pb_ in zip(cb.tolist(), pb):
            joint[(a, b)] = pa_ * pb_
    draft_b = int(cb[1])
    script = {len(PROMPT) + 1: draft_b}

    class Fixed(sp.Drafter):
        name = "fixed"

        def draft(self, context, k):
            return [script[len(context)]] if len(context) in script else []

    N = 1500
    counts = dict.fromkeys(joint, 0)
    for seed in range(N):
        outs = list(m.generate(PROMPT, max_tokens=3, seed=seed, speculative=Fixed(), speculative_k=1, **opts))
        counts[(outs[0].token, outs[1].token)] += 1
    obs = np.array([counts[c] for c in joint], float)
    exp = N * np.array(list(joint.values()))
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 < CHI2_DF8_P001, chi2


# ---- drafters, the draft length, errors -----------------------------------------------------------
def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    d = PromptLookup(max_ngram=3)
    assert d.draft([1, 2, 3, 4, 5, 9, 2, 3], 2) == [4, 5]           # "2 3" seen before: 4 5 followed
    assert d.draft([1, 2, 3, 4, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]   # the most recent occurrence
    assert d.draft([1, 2, 3], 4) == []
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(max_ngram=1, min_ngram=2)


def test_adaptive_k_turns_speculation_off_when_it_does_not_pay():
    """Nothing accepted: k = 0 (plain decoding) but for a probe round now and then; everything accepted
    at a small verification cost: a long draft."""
    bad = AdaptiveK(probe_every=8)
    bad.observe(0, 1.0)
    for _ in range(50):
        bad.observe(3, 1.4, drafted=3, accepted=0)
    picks = [bad.choose() for _ in range(64)]
    assert picks.count(0) >= 56 and set(picks) <= {0, 1}
    good = AdaptiveK()
    good.observe(0, 1.0)
    for k in (1, 4):
        for _ in range(10):
            good.observe(k, 1.0 + 0.05 * k, drafted=k, accepted=k)
    assert good.choose() >= 6
    assert AdaptiveK(fixed=3).choose() == 3
    with pytest.raises(ValueError, match="speculative_k must be in 0..15"):
        AdaptiveK(fixed=16)


@pytest.mark.parametrize("length", [2, 5])
def test_adaptive_k_finds_the_best_length_when_costs_are_not_a_line(length):
    """Verification costs that grow faster than linearly past a few rows (a verification's rows read the union of
    their experts; the shape measured on a 2-core cpu) and a drafter whose L-th draft is always wrong: within a
    few rounds the choice settles on the k that maximises tokens per second, which a straight line through
    the first costs measured would rule out. A second generation sharing the cost table skips the first
    plain-step measurement."""
    cost = {0: 1.0, 1: 1.34, 2: 1.8, 3: 2.25, 4: 2.9, 5: 3.6, 6: 4.3, 7: 5.2, 8: 6.2}
    cost.update({k: 6.2 + 0.71 * (k - 8) for k in range(9, 16)})
    best = max(range(16), key=lambda k: (min(k, length - 1) + 1) / cost[k])
    shared: dict = {}
    a = AdaptiveK(cost=shared)
    picks = []
    for _ in range(30):
        k = a.choose()
        picks.append(k)
        a.observe(k, cost[k], k, min(k, length - 1))
    assert picks[-10:] == [best] * 10, picks
    assert picks.index(best) <= 10, picks
    assert 0 in shared and AdaptiveK(cost=shared).choose() != 0


def test_speculative_argument_errors():
    m = _load()
    with pytest.raises(ValueError, match="speculative must be 'lookup', 'mtp'"):
        m.generate(PROMPT, speculative="ngram")
    with pytest.raises(ValueError, match="speculative_k needs speculative"):
        m.generate(PROMPT, speculative_k=2)
    with pytest.raises(ValueError, match="speculative_k must be in 0..15"):
        m.generate(PROMPT, speculative="lookup", speculative_k=-1)

    class Wild(sp.Drafter):
        def draft(self, context, k):
            return [10**6]

    with pytest.raises(ValueError, match="outside the vocabulary"):
        list(m.generate(PROMPT, max_tokens=4, temperature=0, speculative=Wild(), speculative_k=1))


def test_cli_speculative(tmp_path, capsys):
    from qwenmetal.cli import main
    path = str(cached_checkpoint("tiny", "mlx-q4", seed=0))
    args = ["generate", "--model", path, "--backend", "cpu", "--prompt", "ab ab ab ab ab", "--temperature", "0",
            "--max-tokens", "12", "--ignore-eos"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--speculative", path, "--speculative-k", "2"]) == 0
    out = capsys.readouterr()
    assert out.out == plain and "speculative (model): " in out.err
    assert main(args + ["--speculative-k", "2"]) == 2
    assert "--speculative-k needs --speculative" in capsys.readouterr().err


def test_bench_speculative_quick(tmp_path, capsys):
    """`qwenmetal bench --speculative` prints the verification cost per row count and the oracle table, and
    checks that speculation kept the greedy tokens (it raises otherwise)."""
    import json
    from qwenmetal.cli import main
    out = tmp_path / "spec.json"
    path = str(cached_checkpoint("tiny", "mlx-q4", seed=0))
    assert main(["bench", "--model", path, "--speculative", "--quick", "--threads", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "verification cost at context 64" in text and "oracle block drafter" in text
    res = json.loads(out.read_text())
    assert set(res["verify"]["rows"]) == {"2", "4", "8", "16"}
    lengths = res["throughput"]["lengths"]
    assert set(lengths) == {"2", "4", "5", "6"}
    for n, row in lengths.items():    # the oracle yields exactly L tokens a round with whole blocks
        assert row["block"]["mean_accepted_length"] == pytest.approx(int(n), abs=0.5)
    assert res["machine"]["cpu"]
    if "metal-sim" in qm.backends.BACKENDS:                    # the Metal graph's chunk, modelled
        mm = res["metal_modelled"]
        assert set(mm["rows"]) == {"2", "4", "8", "16"} and "Metal graph, MODELLED" in text
        for r in mm["rows"].values():
            assert all(v["vs_step"] > 0 for v in r.values())
        assert "DFlash decoding, MODELLED" in text
        for chip in mm["lengths"].values():   # more tokens a round never model slower
            ls = chip["lengths"]
            assert ls["6"]["adaptive_vs_plain"] > ls["2"]["adaptive_vs_plain"] > 0
            # the draft call costed by the draft graph (one command buffer), beside the analytic figure
            assert chip["draft_graph_seconds"]["bf16"]["2"] > 0 and chip["draft_seconds"] > 0
        assert all(c["command_buffers"] == 1 for r in mm["draft_modelled"]["rows"].values()
                   for w in r.values() for c in w.values())
        assert "the draft graph's modelled cost" in text


def test_row_by_row_fallback_chain_ends_like_the_engines():
    """The reference backend's row-by-row verification: another call on the session ends the chain (as
    the engine's does), and a rewind then has nothing to go back to; within a chain, rewind is exact."""
    m = _load(backend="reference")
    s = m.new_session()
    m.prefill(s, PROMPT)
    ref = s.fork()
    ses.verify(m, s, [1, 2])
    ses.verify(m, s, [3])
    assert ses.rewindable(m, s) == 3
    ses.rewind(m, s, 1)
    m.decode_step(ref, 1)
    assert s.tokens == ref.tokens and _same_state(m, s, ref)
    ses.verify(m, s, [4, 5])
    m.decode_step(s, 6)                               # any other call ends the chain
    assert ses.rewindable(m, s) == 0
    with pytest.raises(ValueError, match="nothing to rewind"):
        ses.rewind(m, s, 0)


def test_no_round_reports_no_acceptance_rate():
    """With nothing drafted (k = 0) the acceptance rate is None, not NaN, and the CLI's stats line leaves
    it out."""
    m = _load()
    _, st = _greedy(m, PROMPT, 4, cache=False, speculative="lookup", speculative_k=0)
    sp = st["speculative"]
    assert sp["drafted_tokens"] == 0 and sp["acceptance_rate"] is None
    line = _stats_line(st)
    assert "0/0 drafts accepted" in line and "nan" not in line

"""qm.Sampler: greedy, seeded draws, the filters and penalties (each checked on a distribution whose answer is
known), log-probabilities, defaults from generation_config.json and parameter validation.

The distribution tests compare many seeded draws with the exact distribution the documented pipeline
gives (``spec_distribution``: softmax of the penalised, tempered logits, truncated by top-k, top-p and
min-p in that order and renormalised) with a chi-square test at significance 1e-4, and require that no
id outside the kept set is ever drawn. tools/mutation.py runs mutmut over sampling.py with this file."""
import math
import re

import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal.sampling import Sampler


def logits_of(p):
    return np.log(np.asarray(p, dtype=np.float64)).astype(np.float32)


def support(sampler, logits, n=400, **kw):
    return {sampler(logits, **kw) for _ in range(n)}


def spec_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The exact sampling distribution of the documented pipeline (no penalties), written from the spec:
    ids ordered by probability (ties: lower id first); keep the top_k most likely; then the smallest
    prefix whose (renormalised) probability reaches top_p; then those with probability >= min_p times the
    most likely; renormalise."""
    x = np.asarray(logits, np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = sorted(range(p.size), key=lambda i: (-p[i], i))
    if top_k:
        order = order[:top_k]
    q = p[order] / p[order].sum()
    if top_p < 1.0:
        acc, n = 0.0, 0
        while n < len(order) and acc < top_p:
            acc += q[n]
            n += 1
        order, q = order[:n], q[:n] / q[:n].sum()
    if min_p > 0.0:
        keep = [j for j in range(len(order)) if q[j] >= min_p * q[0]]
        order, q = [order[j] for j in keep], q[keep] / q[keep].sum()
    out = np.zeros(p.size)
    out[order] = q
    return out


def chi2_quantile(df, z=3.719):
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.719: upper tail 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_draws_follow(sampler, logits, want, n=4000, **kw):
    """``n`` draws of ``sampler`` never leave the support of ``want`` and pass a chi-square test against it
    (ids expected fewer than 5 times are pooled into one cell)."""
    want = np.asarray(want, np.float64)
    counts = np.bincount([sampler(logits, **kw) for _ in range(n)], minlength=want.size)
    assert counts.size == want.size
    outside = np.flatnonzero((want == 0) & (counts > 0))
    assert outside.size == 0, f"drew ids {outside.tolist()} that the filters remove"
    kept = want > 0
    big = kept & (n * want >= 5)
    small = kept & ~big
    expected = np.append(n * want[big], n * want[small].sum())
    observed = np.append(counts[big], counts[small].sum())
    if not small.any():
        expected, observed = expected[:-1], observed[:-1]
    chi2 = float(np.sum((observed - expected) ** 2 / expected))
    df = expected.size - 1
    if df:
        assert chi2 < chi2_quantile(df), f"chi2 {chi2:.1f} (df {df}): counts {counts.tolist()} vs {expected.round(1).tolist()}"
    else:
        assert observed.sum() == n


def test_spec_distribution_examples():
    """The test's reference itself, on hand-computed cases."""
    x = logits_of([0.4, 0.3, 0.2, 0.1])
    np.testing.assert_allclose(spec_distribution(x, top_p=0.65), [4 / 7, 3 / 7, 0, 0])
    np.testing.assert_allclose(spec_distribution(x, min_p=0.4), [4 / 9, 3 / 9, 2 / 9, 0])
    np.testing.assert_allclose(spec_distribution(x, top_k=3), [4 / 9, 3 / 9, 2 / 9, 0])
    np.testing.assert_allclose(spec_distribution(x, top_k=3, top_p=0.5), [4 / 7, 3 / 7, 0, 0])


def test_greedy_and_padding_rows():
    s = Sampler(temperature=0.0)
    x = np.array([0.1, 3.0, 3.0, -1.0, 9.0], np.float32)
    assert s(x) == 4
    assert s(x, vocab_used=4) == 1                 # padded rows are never chosen; ties go to the lower id
    hot = Sampler(temperature=5.0, seed=0)
    assert support(hot, x, vocab_used=4) <= {0, 1, 2, 3}


def test_seeded_runs_repeat():
    x = np.random.default_rng(0).normal(size=64).astype(np.float32)
    a = [Sampler(temperature=1.0, seed=5)(x)]
    s1, s2, s3 = Sampler(temperature=1.0, seed=5), Sampler(temperature=1.0, seed=5), Sampler(temperature=1.0, seed=6)
    r1, r2, r3 = [s1(x) for _ in range(50)], [s2(x) for _ in range(50)], [s3(x) for _ in range(50)]
    assert r1 == r2 and r1 != r3 and a[0] == r1[0]


def test_filters_keep_the_right_support():
    p = [0.5, 0.3, 0.15, 0.05]
    x = logits_of(p)
    assert support(Sampler(temperature=1.0, top_k=2, seed=0), x) == {0, 1}
    assert support(Sampler(temperature=1.0, top_p=0.7, seed=0), x) == {0, 1}
    assert support(Sampler(temperature=1.0, top_p=0.85, seed=0), x) == {0, 1, 2}
    assert support(Sampler(temperature=1.0, min_p=0.4, seed=0), x) == {0, 1}       # p >= 0.2
    assert support(Sampler(temperature=1.0, min_p=0.2, seed=0), x) == {0, 1, 2}    # p >= 0.1
    assert support(Sampler(temperature=3.0, top_k=1, seed=0), x) == {0}
    assert support(Sampler(temperature=1.0, seed=0), x, n=2000) == {0, 1, 2, 3}


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draws_follow_the_tempered_distribution(temperature):
    p = np.array([0.5, 0.3, 0.15, 0.05])
    s = Sampler(temperature=temperature, seed=1)
    n = 6000
    counts = np.bincount([s(logits_of(p)) for _ in range(n)], minlength=4) / n
    q = p ** (1 / temperature)
    q /= q.sum()
    np.testing.assert_allclose(counts, q, atol=0.025)


P4 = [0.4, 0.3, 0.2, 0.1]


@pytest.mark.parametrize("kw", [dict(top_p=0.65), dict(top_p=0.75), dict(top_p=0.95), dict(min_p=0.4),
                                dict(min_p=0.3), dict(top_k=3), dict(top_k=2), dict(top_k=3, top_p=0.5),
                                dict(top_p=0.8, min_p=0.6), dict(temperature=0.6, top_p=0.7),
                                dict(temperature=2.0, top_k=3, min_p=0.75), dict(temperature=0.5)],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_filtered_draws_follow_the_renormalised_distribution(kw):
    """top-k, top-p and min-p truncate and *renormalise*: the kept ids keep their relative odds (and the
    filters apply in the documented order: top-p on the top-k distribution, min-p after top-p)."""
    x = logits_of(P4)
    assert_draws_follow(Sampler(seed=7, **{"temperature": 1.0, **kw}), x, spec_distribution(x, **kw))


def test_filters_on_a_large_vocabulary():
    """top-k selects exactly the k most likely of many ids (for k = 1, a few and all but one), and
    top-p / min-p on 500 random logits renormalise what they keep."""
    rng = np.random.default_rng(11)
    x = rng.normal(0, 2, size=500).astype(np.float32)
    ranked = np.argsort(-x.astype(np.float64), kind="stable")
    for k in (1, 2, 5, 40, 499):
        s = Sampler(temperature=50.0, top_k=k, seed=k)       # hot: every kept id is likely to be drawn
        drawn = {s(x) for _ in range(300)}
        assert drawn <= set(ranked[:k].tolist()), k
        if k <= 5:
            assert len(drawn) == k
        else:
            assert len(drawn) > k // 3
    assert_draws_follow(Sampler(temperature=1.0, top_p=0.5, seed=3), x, spec_distribution(x, top_p=0.5))
    assert_draws_follow(Sampler(temperature=1.0, min_p=0.2, seed=4), x, spec_distribution(x, min_p=0.2))
    assert_draws_follow(Sampler(temperature=0.7, top_k=6, seed=5), x, spec_distribution(x, 0.7, top_k=6))


def test_filter_boundaries():
    """Exact boundaries, on equal logits (exact probabilities): top-p keeps the smallest set that
    *reaches* p, min-p keeps ids *at* the threshold, ties go to the lower id, top_k >= the vocabulary
    is no filter, and min-p always keeps the most likely id."""
    eq = np.zeros(4, np.float32)                          # p = 1/4 each
    assert support(Sampler(temperature=1.0, top_p=0.5, seed=0), eq) == {0, 1}
    assert support(Sampler(temperature=1.0, top_p=0.25, seed=0), eq) == {0}
    assert support(Sampler(temperature=1.0, top_p=0.5000001, seed=0), eq) == {0, 1, 2}
    two = np.array([1.0, 1.0, 0.0], np.float32)
    assert support(Sampler(temperature=1.0, min_p=1.0, seed=0), two) == {0, 1}
    for k in (3, 4, 100):
        assert support(Sampler(temperature=1.0, top_k=k, seed=0), two) == {0, 1, 2}
    x = logits_of([0.9, 0.1])
    assert support(Sampler(temperature=1.0, min_p=0.5, seed=0), x) == {0}
    assert support(Sampler(temperature=1.0, min_p=0.1, seed=0), x) == {0, 1}


def test_draw_at_the_top_of_the_unit_interval():
    """A uniform variate just below 1 picks the last *kept* id, even when the kept probabilities sum to
    slightly less than 1 in floating point (never a filtered id, never an index error)."""
    class Top:
        def random(self):
            return 1.0 - 2.0 ** -53

    rng = np.random.default_rng(0)
    for trial in range(200):
        x = rng.normal(size=7).astype(np.float32)
        for kw in (dict(), dict(top_k=3), dict(top_p=0.6), dict(min_p=0.3)):
            s = Sampler(temperature=1.0, **kw)
            s.rng = Top()
            want = spec_distribution(x, **kw)
            kept = [i for i in sorted(range(7), key=lambda i: (-want[i], i)) if want[i] > 0]
            assert s(x) == kept[-1], (trial, kw)


def test_shift_invariance_and_large_logits():
    """Softmax ignores a common offset: logits shifted by +-1024 (exact in float32 here) give the same
    seeded draws, without overflow."""
    x = np.array([0.0, -0.25, -0.5, -1.5], np.float32)
    for shift in (1024.0, -1024.0):
        s, r = Sampler(temperature=0.8, top_p=0.9, seed=2), Sampler(temperature=0.8, top_p=0.9, seed=2)
        shifted = [s(x + np.float32(shift)) for _ in range(300)]
        assert shifted == [r(x) for _ in range(300)] and set(shifted) == {0, 1, 2}


def test_penalised_draws_follow_the_penalised_distribution():
    """Penalties change the distribution that is sampled, not only the argmax: the draws follow the
    softmax of the penalised logits."""
    x = np.array([1.0, 0.5, -0.5, 0.2], np.float32)
    ctx, gen = [0, 2], [3, 3]
    pen = x.astype(np.float64).copy()
    pen[0] /= 1.5
    pen[2] *= 1.5
    pen[3] = pen[3] / 1.5 - (0.4 + 0.3 * 2)          # in the context too (generated), then presence/frequency
    s = Sampler(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3, seed=9)
    assert_draws_follow(s, x, spec_distribution(pen), context=ctx, generated=gen)


def test_penalties():
    # repetition penalty (context = prompt + generated): positive logits divided, negative multiplied
    assert Sampler(repetition_penalty=2.0)(np.array([2.0, 1.5], np.float32), context=[0]) == 1
    assert Sampler(repetition_penalty=2.0)(np.array([-1.0, -1.5], np.float32), context=[0]) == 1
    assert Sampler(repetition_penalty=2.0)(np.array([2.0, 1.5], np.float32), context=[1]) == 0
    # presence / frequency (generated tokens only)
    x = np.array([1.0, 0.5], np.float32)
    assert Sampler(presence_penalty=0.3)(x, generated=[0, 0]) == 0               # 0.7 > 0.5
    assert Sampler(presence_penalty=0.6)(x, generated=[0, 0]) == 1               # 0.4 < 0.5
    assert Sampler(frequency_penalty=0.2)(x, generated=[0]) == 0                 # 0.8
    assert Sampler(frequency_penalty=0.2)(x, generated=[0, 0, 0]) == 1           # 0.4
    assert Sampler(presence_penalty=1.0)(x, context=[0, 0]) == 0                 # the prompt does not count
    # a positive logit below 1 is divided too (0.5 / 4 < 0.3); zero is unchanged either way
    assert Sampler(repetition_penalty=4.0)(np.array([0.5, 0.3], np.float32), context=[0]) == 1
    # presence and frequency add up: 1.0 - (0.1 + 0.2 * 2) = 0.5 < 0.55; 1.0 - (0.3 + 0.3) = 0.4 < 0.5
    assert Sampler(presence_penalty=0.1, frequency_penalty=0.2)(np.array([1.0, 0.55], np.float32),
                                                                 generated=[0, 0]) == 1
    assert Sampler(presence_penalty=0.3, frequency_penalty=0.3)(x, generated=[0]) == 1
    # a penalty with nothing to penalise changes nothing; ids outside the vocabulary in use (padded rows,
    # negative) are ignored, not wrapped around or an error
    y = np.array([0.2, 1.0, 0.9, 5.0], np.float32)
    for kw in (dict(repetition_penalty=3.0), dict(presence_penalty=2.0), dict(frequency_penalty=2.0)):
        s = Sampler(**kw)
        assert s(y, vocab_used=3) == 1
        assert s(y, vocab_used=3, context=[3, 7, -1, -3], generated=[3, 3, -1, -3]) == 1
        r = s.sample(y, vocab_used=3, context=[-2, 3], generated=[-2, 3], logprobs=True)
        assert r.token == 1 and r.logprob == pytest.approx(float(np.log(np.exp(1.0) / np.exp(y[:3]).sum())), abs=1e-6)
    assert Sampler(repetition_penalty=3.0)(y, vocab_used=3, context=[1]) == 2
    assert Sampler(repetition_penalty=3.0)(y, vocab_used=3, context=np.array([1], np.int32)) == 2
    assert Sampler(presence_penalty=0.2)(y, vocab_used=3, generated=np.array([1], np.uint32)) == 2


def test_logprobs_are_of_the_raw_distribution():
    rng = np.random.default_rng(3)
    x = rng.normal(size=50).astype(np.float32)
    ref = x.astype(np.float64) - np.log(np.sum(np.exp(x.astype(np.float64))))
    r = Sampler(temperature=0.7, top_k=5, seed=2, repetition_penalty=1.3).sample(
        x, context=[1, 2], logprobs=True, top_logprobs=4)
    assert r.logprob == pytest.approx(ref[r.token], abs=1e-9)
    order = np.argsort(-ref)[:4]
    assert [i for i, _ in r.top_logprobs] == list(order)
    np.testing.assert_allclose([v for _, v in r.top_logprobs], ref[order], atol=1e-9)
    assert Sampler().sample(x).logprob is None and Sampler().sample(x).top_logprobs is None


def test_logprobs_options_and_ties():
    """``logprobs`` alone gives the token's log-probability; ``top_logprobs`` alone gives both; the
    alternatives are the most likely ids (ties by lower id), at most the vocabulary in use."""
    x = np.array([0.5, 2.0, 2.0, -1.0, 2.0, 1.0, 9.0], np.float32)
    lse = float(np.log(np.sum(np.exp(x[:6].astype(np.float64)))))
    r = Sampler().sample(x, vocab_used=6, logprobs=True)
    assert r.token == 1 and r.logprob == pytest.approx(2.0 - lse, abs=1e-12) and r.top_logprobs is None
    r = Sampler().sample(x, vocab_used=6, top_logprobs=3)
    assert r.logprob == pytest.approx(2.0 - lse, abs=1e-12)
    assert [i for i, _ in r.top_logprobs] == [1, 2, 4]
    assert [i for i, _ in Sampler().sample(x, vocab_used=6, top_logprobs=1).top_logprobs] == [1]
    every = Sampler().sample(x, vocab_used=6, top_logprobs=6).top_logprobs
    assert [i for i, _ in every] == [1, 2, 4, 5, 0, 3]
    assert Sampler().sample(x, vocab_used=6, top_logprobs=50).top_logprobs == every
    np.testing.assert_allclose([v for _, v in every], x[[1, 2, 4, 5, 0, 3]] - lse, atol=1e-12)
    rng = np.random.default_rng(8)
    big = rng.normal(size=300).astype(np.float32)
    top = Sampler().sample(big, top_logprobs=1).top_logprobs
    assert top[0][0] == int(np.argmax(big))


def test_logits_must_be_one_dimensional():
    with pytest.raises(ValueError, match=r"logits must be 1-D, got shape \(2, 3\)"):
        Sampler()(np.zeros((2, 3), np.float32))
    assert Sampler()([0.0, 3.0, 1.0]) == 1                   # any 1-D sequence of numbers


def test_logits_are_taken_as_float32():
    """Logits are float32 (what every backend returns): float64 input gives the token of its float32
    rounding, so a difference below float32 precision is a tie (the lower id wins)."""
    x = np.array([0.0, 1.0, 1.0 + 1e-12], np.float64)
    assert Sampler()(x) == 1 and Sampler()(x.astype(np.float32)) == 1
    assert Sampler(temperature=1.0, top_k=1, seed=0)(x) == 1
    assert Sampler()([0, 5, 2]) == 1                         # integers too


def test_generation_config_defaults_and_overrides():
    g = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [1]}
    s = Sampler.from_generation_config(g)
    assert (s.temperature, s.top_k, s.top_p, s.min_p) == (0.6, 20, 0.95, 0.0)
    s = Sampler.from_generation_config(g, temperature=0.0, top_k=None, seed=3)
    assert s.temperature == 0.0 and s.top_k == 20 and s.seed == 3
    assert Sampler.from_generation_config({"do_sample": False, "temperature": 0.9}).greedy
    assert Sampler.from_generation_config(None).greedy
    assert "temperature=0.6" in repr(Sampler.from_generation_config(g))
    assert qm.Sampler is Sampler
    # non-numeric and boolean values are ignored (not passed on), do_sample true keeps the temperature
    s = Sampler.from_generation_config({"top_k": True, "top_p": "0.5", "temperature": 0.7, "min_p": 0.05,
                                        "repetition_penalty": 1.1, "presence_penalty": 1.5,
                                        "frequency_penalty": 0.2, "do_sample": True})
    assert (s.temperature, s.top_k, s.top_p, s.min_p) == (0.7, 0, 1.0, 0.05)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.1, 1.5, 0.2)
    assert Sampler.from_generation_config({"temperature": 0.7}).temperature == 0.7
    assert Sampler.from_generation_config({}, top_p=0.5, temperature=None).top_p == 0.5


def test_defaults():
    """The default sampler is greedy with every filter and penalty off (repr lists every value)."""
    assert repr(Sampler()) == ("Sampler(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, "
                               "presence_penalty=0.0, frequency_penalty=0.0, seed=None)")
    assert Sampler().greedy and not Sampler(temperature=0.1).greedy
    s = Sampler(0.5, 3, 0.9, 0.1, 1.2, 0.3, 0.4, 5)
    assert repr(s) == ("Sampler(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, repetition_penalty=1.2, "
                       "presence_penalty=0.3, frequency_penalty=0.4, seed=5)")
    # unseeded samplers are not all the same stream
    x = np.random.default_rng(1).normal(size=100).astype(np.float32)
    draws = {tuple(Sampler(temperature=1.0)(x) for _ in range(8)) for _ in range(4)}
    assert len(draws) > 1


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(top_k=0), dict(top_p=1.0), dict(top_p=1e-9),
                                dict(min_p=0.0), dict(min_p=1.0), dict(repetition_penalty=0.5),
                                dict(repetition_penalty=1e-3), dict(top_k=3.0), dict(top_k=np.int64(2)),
                                dict(temperature=np.float32(0.5)), dict(temperature=1), dict(seed=np.int64(4)),
                                dict(seed=0), dict(presence_penalty=-2.0), dict(frequency_penalty=-1)])
def test_valid_boundaries(kw):
    s = Sampler(**kw)
    for k, v in kw.items():
        assert getattr(s, k) == v
        if k != "seed":
            assert type(getattr(s, k)) is (int if k == "top_k" else float)


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-0.1), r"temperature must be >= 0, got -0.1"),
    (dict(top_k=-1), r"top_k must be >= 0 \(0 = off\), got -1"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"), (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(min_p=-0.1), r"min_p must be in \[0, 1\], got -0.1"), (dict(min_p=1.1), r"min_p must be in \[0, 1\]"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be > 0 \(1 = off\), got 0.0"),
    (dict(repetition_penalty=-1.0), r"repetition_penalty must be > 0"),
    (dict(temperature=float("nan")), r"temperature must be a finite number, got nan"),
    (dict(top_p=float("inf")), r"top_p must be a finite number"), (dict(min_p=None), r"min_p must be a finite number"),
    (dict(repetition_penalty="2"), r"repetition_penalty must be a finite number, got '2'"),
    (dict(presence_penalty=float("inf")), r"presence_penalty must be a finite number, got inf"),
    (dict(frequency_penalty=float("-inf")), r"frequency_penalty must be a finite number, got -inf"),
    (dict(temperature="hot"), r"temperature must be a finite number, got 'hot'"),
    (dict(temperature=True), r"temperature must be a finite number, got True"),
    (dict(top_k=1.5), r"top_k must be an integer, got 1.5"), (dict(top_k=True), r"top_k must be an integer"),
    (dict(top_k="3"), r"top_k must be an integer, got '3'"),
    (dict(seed="x"), r"seed must be an integer or None, got 'x'"), (dict(seed=True), r"seed must be an integer"),
    (dict(seed=1.0), r"seed must be an integer or None, got 1.0")])
def test_invalid_parameters(kw, match):
    with pytest.raises(ValueError, match=match):
        Sampler(**kw)


# ---- speculative decoding's acceptance rule (qwenmetal.speculative) ------------------------------------
CHI2_DF8_P001 = 26.12     # chi-square critical value, 8 degrees of freedom, p = 0.001


def test_rejection_sampling_keeps_the_distribution():
    """Sampler.verify_draft over many seeded draws: the law of its token is the sampler's distribution
    whatever the draft (likely, unlikely, filtered out) -- chi-square on the 9 candidates of top_k=9; the
    draft is reported accepted exactly when it is the token."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, 40).astype(np.float32)
    ref = Sampler(temperature=0.8, top_k=9, seed=0)
    cand, p = ref._distribution(logits.astype(np.float64) / 0.8)
    N = 6000
    for draft in (int(cand[0]), int(cand[5]), int(np.argmin(logits))):
        s = Sampler(temperature=0.8, top_k=9, seed=1)
        counts = dict.fromkeys(cand.tolist(), 0)
        for _ in range(N):
            r, ok = s.verify_draft(logits, draft)
            counts[r.token] += 1
            assert ok == (r.token == draft)
        obs = np.array([counts[c] for c in cand.tolist()], float)
        chi2 = float(((obs - N * p) ** 2 / (N * p)).sum())
        assert chi2 < CHI2_DF8_P001, (draft, chi2)


def test_rejection_sampling_of_drafted_distributions_keeps_the_distribution():
    """Drafts drawn from a drafted distribution q (`draft_probs`: mass inside and outside the sampler's top 9,
    unlike p): the token's law is still p (chi-square on the 9 candidates), a draft is kept with probability
    min(1, p/q) per draft (so sum(min(p, q)) overall: a binomial bound at 4.4 sigma), and reported accepted
    exactly when it is the token."""
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 1.5, 40).astype(np.float32)
    ref = Sampler(temperature=0.8, top_k=9, seed=0)
    cand, p = ref._distribution(logits.astype(np.float64) / 0.8)
    pfull = np.zeros(40)
    pfull[cand] = p
    q = rng.dirichlet(np.full(40, 0.5))
    q[cand[:3]] += 0.5                     # q likes some of p's candidates more than p does, misses others
    q /= q.sum()
    s = Sampler(temperature=0.8, top_k=9, seed=1)
    N = 6000
    counts = dict.fromkeys(cand.tolist(), 0)
    kept = 0
    for _ in range(N):
        d = int(rng.choice(40, p=q))
        r, ok = s.verify_draft(logits, d, draft_probs=q)
        counts[r.token] += 1
        assert ok == (r.token == d)
        kept += ok
    obs = np.array([counts[c] for c in cand.tolist()], float)
    chi2 = float(((obs - N * p) ** 2 / (N * p)).sum())
    assert chi2 < CHI2_DF8_P001, chi2
    want = float(np.minimum(pfull, q).sum())
    assert abs(kept - N * want) < 4.4 * math.sqrt(N * want * (1 - want)), (kept / N, want)


@pytest.mark.parametrize("probs, draft, match", [
    (np.full((2, 4), 0.125), 0, "probability vector over the 4 logits, got shape (2, 4)"),
    (np.full(3, 1 / 3), 0, "probability vector over the 4 logits, got shape (3,)"),
    (np.array([0.5, 0.5, 0.5, 0.0]), 0, "sum to 1 (sum 1.5"),
    (np.array([1.5, -0.5, 0.0, 0.0]), 0, "non-negative"),
    (np.array([0.5, 0.5, 0.0, 0.0]), 2, "draft 2 has no probability under draft_probs"),
    (np.array([0.5, 0.5, 0.0, 0.0]), 7, "draft 7 has no probability under draft_probs"),
])
def test_drafted_distribution_errors(probs, draft, match):
    s = Sampler(temperature=1.0, seed=0)
    with pytest.raises(ValueError, match=re.escape(match)):
        s.verify_draft(np.zeros(4, np.float32), draft, draft_probs=probs)
    # a valid one over more entries than the logits (a padded vocabulary) is accepted
    s.verify_draft(np.zeros(4, np.float32), 1, draft_probs=np.array([0.0, 0.5, 0.5, 0.0, 0.0]))


def test_verify_draft_greedy_and_filters():
    """Greedy: the argmax whatever the draft, accepted iff equal; penalties and the vocabulary cut apply
    as in sample(); a draft the filters remove is never the token; logprobs are sample()'s."""
    x = np.array([0.1, 2.0, 1.9, -1.0, 5.0], dtype=np.float32)
    g = Sampler()
    assert g.verify_draft(x, 1, 4)[0].token == 1 and g.verify_draft(x, 1, 4)[1] is True
    r, ok = g.verify_draft(x, 2, 4)
    assert (r.token, ok) == (1, False)
    pen = Sampler(repetition_penalty=10.0)
    assert pen.verify_draft(x, 2, 4, context=[1])[0].token == 2          # 2.0 / 10 < 1.9
    s = Sampler(temperature=1.0, top_k=2, seed=0)
    for _ in range(200):
        r, ok = s.verify_draft(x, 0, 4)                                  # id 0 is outside the top 2
        assert r.token in (1, 2) and not ok
    a = Sampler(seed=0).sample(x, 4, logprobs=True, top_logprobs=2)
    b, _ = Sampler(seed=0).verify_draft(x, 1, 4, logprobs=True, top_logprobs=2)
    assert (a.token, a.logprob, a.top_logprobs) == (b.token, b.logprob, b.top_logprobs)
    r = g.verify_draft(x, 1, 4)[0]
    assert r.logprob is None and r.top_logprobs is None                 # nothing asked, nothing computed
    assert g.verify_draft(x, 1, 4, logprobs=True)[0].logprob == pytest.approx(a.logprob)
    with pytest.raises(ValueError, match="logits must be 1-D"):
        g.verify_draft(x[None], 1)


def test_verify_draft_draws_once_when_it_accepts():
    """Seeded reproducibility: an accepted draft costs one uniform draw, a rejected one two (the
    acceptance test, then the draw from the rest) -- the generator's stream continues from there."""
    x = np.array([0.0, 3.0, 1.0], dtype=np.float32)
    one = Sampler(temperature=1.0, top_k=1, seed=5)                       # p(1) = 1: always accepted
    assert one.verify_draft(x, 1)[1] is True
    ref = np.random.default_rng(5)
    ref.random()
    assert one.rng.random() == ref.random()
    two = Sampler(temperature=1.0, top_k=2, seed=5)
    r, ok = two.verify_draft(x, 0)                                        # filtered out: rejected
    ref = np.random.default_rng(5)
    ref.random(), ref.random()
    assert not ok and two.rng.random() == ref.random()


def test_the_sampler_never_draws_a_masked_token():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=64).astype(np.float32)
    allowed = np.zeros(64, dtype=bool)
    allowed[[3, 17, 40]] = True
    best = max((3, 17, 40), key=lambda i: logits[i])
    assert Sampler().sample(logits, allowed=allowed).token == best
    for kw in ({"temperature": 1.0}, {"temperature": 0.7, "top_k": 2}, {"temperature": 1.5, "top_p": 0.5},
               {"temperature": 1.0, "min_p": 0.2}):
        s = Sampler(seed=1, **kw)
        assert {s.sample(logits, allowed=allowed).token for _ in range(200)} <= {3, 17, 40}
    r = Sampler().sample(logits, allowed=allowed, logprobs=True)     # log-probabilities stay the model's
    lse = np.log(np.exp(logits.astype(np.float64) - logits.max()).sum()) + logits.max()
    assert r.logprob == pytest.approx(float(logits[best]) - lse)
    top = int(np.argmax(logits))                                      # the unmasked favourite, masked out
    assert top not in (3, 17, 40) and Sampler().verify_draft(logits, top)[1]
    assert Sampler().verify_draft(logits, top, allowed=allowed) == (Sampler().sample(logits, allowed=allowed), False)
    s = Sampler(temperature=0.3, seed=0)                              # sampled: a masked draft is never kept
    u = Sampler(temperature=0.3, seed=0)
    assert sum(u.verify_draft(logits, top)[1] for _ in range(50)) > 5           # p(top) = 0.29 unmasked
    assert all(not s.verify_draft(logits, top, allowed=allowed)[1] for _ in range(50))
    with pytest.raises(ValueError, match="allows no token"):
        Sampler().sample(logits, allowed=np.zeros(64, dtype=bool))
    short = Sampler().sample(logits, allowed=allowed[:41])            # a mask shorter than the logits: the rest out
    assert short.token == best
    for kw in ({}, {"top_k": 50}, {"top_p": 0.999}, {"min_p": 1e-9}):  # masked ids are never candidates
        cand, p = Sampler(temperature=1.0, **kw)._distribution(np.where(allowed, logits, -np.inf).astype(np.float64))
        assert sorted(cand.tolist()) == [3, 17, 40] and np.all(p > 0) and abs(p.sum() - 1) < 1e-12

"""qm.Sampler: greedy, seeded draws, the filters and penalties (each checked on a distribution whose answer is
known), log-probabilities, defaults from generation_config.json and parameter validation."""
import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal.sampling import Sampler


def logits_of(p):
    return np.log(np.asarray(p, dtype=np.float64)).astype(np.float32)


def support(sampler, logits, n=400, **kw):
    return {sampler(logits, **kw) for _ in range(n)}


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
    assert Sampler().sample(x).logprob is None


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


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
                                dict(min_p=-0.1), dict(min_p=1.1), dict(repetition_penalty=0.0),
                                dict(temperature=float("nan")), dict(top_k=1.5), dict(seed="x"),
                                dict(temperature="hot"), dict(presence_penalty=float("inf"))])
def test_invalid_parameters(kw):
    with pytest.raises(ValueError):
        Sampler(**kw)

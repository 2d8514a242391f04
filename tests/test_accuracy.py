"""The accuracy contract (docs/cpu.md, "Accuracy contract"; `qwenmetal.accuracy`).

* the measures themselves on hand-made logits (KL, top-1, max |Δlogit| / range, rms) and their errors;
* every mode of `accuracy.MODES` on the fixtures (tiny, tiny-qwen3-next; mlx-q4, mlx-q8), teacher-forced
  on a prompt and the float reference's own greedy continuation: the CPU default meets the contract (at
  least as accurate as the reference's bfloat16 mode on KL, top-1 agreement and max logit error), on
  every SIMD kernel set this CPU can run, and each mode stays within its own stated bound.
"""
from __future__ import annotations

import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal import _core
from qwenmetal import accuracy as A
from qwenmetal.testing import cached_checkpoint

PROMPT_LEN, STEPS = 20, 32
CASES = [(p, f) for p in ("tiny", "tiny-qwen3-next") for f in ("mlx-q4", "mlx-q8")]

# each mode's own bound on the fixtures (observed figures in docs/cpu.md): the exact modes keep tight
# tolerances and every greedy argmax; int8 is approximate and only bounded loosely.
BOUNDS = {
    "cpu float, f32 KV": dict(max_abs_err_rel=1e-4, top1_agree=1.0),      # observed <= 7e-6
    "cpu int16, f32 KV": dict(max_abs_err_rel=1e-3, top1_agree=1.0),      # observed <= 2.3e-4
    # with the bf16 KV cache (observed <= 8.6e-4) one flip is allowed: the closest top-2 pair of the
    # reference's logits is 1.3e-4 of the range apart (mlx-q8), below the cache's rounding error
    "cpu float": dict(max_abs_err_rel=3e-3, top1_agree_min=0.98),
    "cpu int16": dict(max_abs_err_rel=3e-3, top1_agree_min=0.98),
    "cpu default": dict(max_abs_err_rel=3e-3, top1_agree_min=0.98),
    "cpu int8, f32 KV": dict(max_abs_err_rel=0.3, kl_mean=5e-3),          # observed 0.145, 1.4e-3
    "cpu int8": dict(max_abs_err_rel=0.3, kl_mean=5e-3),
    # the bar itself: MLX's bf16 rounding points cost accuracy, but a bar this loose or looser would mean
    # the bf16 mode is broken (observed 0.11-0.13, 0.87-0.90 top-1)
    "reference bfloat16": dict(max_abs_err_rel=0.3, kl_mean=5e-3, top1_agree_min=0.7),
}


# ------------------------------------------------------------------------------------------------
# the measures
# ------------------------------------------------------------------------------------------------
def test_measures_on_known_logits():
    want = np.array([[0.0, 1.0, 3.0, 2.0], [1.0, 0.0, 0.0, 0.0]])
    same = A.measures(want, want)
    assert same["kl_mean"] == same["kl_max"] == same["max_abs_err_rel"] == same["rms_rel"] == 0.0
    assert same["top1_agree"] == 1.0 and same["positions"] == 2
    # a constant shift leaves the distribution (KL 0, argmax) unchanged but is a logit error
    shifted = A.measures(want, want + 0.5)
    assert shifted["kl_max"] < 1e-12 and shifted["top1_agree"] == 1.0
    assert shifted["max_abs_err_rel"] == pytest.approx(0.5 / 1.0)        # row 1's range is 1
    # swapping the top two logits of row 0: one of two argmaxes differs; KL as computed by hand
    got = want.copy()
    got[0, [2, 3]] = got[0, [3, 2]]
    m = A.measures(want, got)
    p = np.exp(want[0] - want[0].max()); p /= p.sum()
    q = np.exp(got[0] - got[0].max()); q /= q.sum()
    assert m["kl_max"] == pytest.approx(float(np.sum(p * np.log(p / q))), rel=1e-9)
    assert m["kl_mean"] == pytest.approx(m["kl_max"] / 2, rel=1e-9)
    assert m["top1_agree"] == 0.5
    assert m["max_abs_err_rel"] == pytest.approx(1.0 / 3.0)
    spread = np.sqrt(np.mean((want - want.mean(-1, keepdims=True)) ** 2))
    assert m["rms_rel"] == pytest.approx(np.sqrt(2 / 8) / spread)


def test_meets_names_each_worse_measure():
    bar = dict(kl_mean=1e-3, kl_max=1e-2, top1_agree=0.9, max_abs_err_rel=0.1, rms_rel=0.05)
    assert A.meets(dict(bar), bar) == []
    worse = A.meets(dict(bar, kl_mean=2e-3, top1_agree=0.8, rms_rel=1.0), bar)
    assert [w.split()[0] for w in worse] == ["kl_mean", "top1_agree"]          # rms_rel is not in the contract
    assert A.meets(dict(bar, max_abs_err_rel=0.2), bar) == ["max_abs_err_rel 0.2 vs 0.1"]


def test_measure_errors():
    with pytest.raises(ValueError, match=r"logits must both be \[positions, vocab\], got \(2, 3\) and \(2, 4\)"):
        A.measures(np.zeros((2, 3)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="contain NaN or inf"):
        A.measures(np.zeros((1, 3)), np.array([[0.0, np.nan, 1.0]]))
    m = qm.Model.load(cached_checkpoint("tiny", "mlx-q4", seed=0), backend="cpu", threads=1)
    with pytest.raises(ValueError, match=r"prompt_len must be in 1\.\.3 \(the number of tokens\), got 0"):
        A.teacher_forced(m, [1, 2, 3], 0)
    with pytest.raises(ValueError, match="need a non-empty prompt and n >= 0"):
        A.greedy_sequence(m, [], 4)


def test_teacher_forced_is_prefill_plus_decode():
    """The reference's greedy run gives the same logits as its teacher-forced run on the same tokens."""
    ref = qm.Model.load(cached_checkpoint("tiny", "mlx-q4", seed=0), backend="reference")
    tokens, want = A.greedy_sequence(ref, A.prompt(ref.config.vocab_size, 6, seed=3), 5)
    assert len(tokens) == want.shape[0] == 11
    np.testing.assert_array_equal(A.teacher_forced(ref, tokens, 6), want)


# ------------------------------------------------------------------------------------------------
# the figures of every mode on the fixtures
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def figures():
    """{(preset, format): {mode: measures}} for every mode of accuracy.MODES, plus "cpu default" run on
    each SIMD kernel set this CPU has ("cpu default @isa")."""
    out = {}
    for preset, fmt in CASES:
        path = cached_checkpoint(preset, fmt, seed=0)
        ref = qm.Model.load(path, backend="reference")
        tokens, want = A.greedy_sequence(ref, A.prompt(ref.config.vocab_size, PROMPT_LEN), STEPS)
        res = {name: A.compare(A.load_mode(name, path, ref), want, tokens, PROMPT_LEN) for name in A.MODES}
        saved = _core.cpu_isa()
        try:
            for isa in _core.cpu_isas():
                _core.cpu_set_isa(isa)        # "auto" resolves per the kernels in use at load
                m = qm.Model.load(path, backend="cpu")
                res[f"cpu default @{isa}"] = A.compare(m, want, tokens, PROMPT_LEN)
        finally:
            _core.cpu_set_isa(saved)
        out[(preset, fmt)] = res
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{p}-{f}" for p, f in CASES])
def test_default_meets_the_contract(case, figures):
    """The default path (and the default on every kernel set this CPU can run) is at least as accurate as
    the reference's bfloat16 mode on KL, top-1 agreement and max logit error."""
    res = figures[case]
    bar = res["reference bfloat16"]
    for name in ["cpu default"] + [n for n in res if n.startswith("cpu default @")]:
        assert A.meets(res[name], bar) == [], f"{name} on {case}: less accurate than bf16 in {A.meets(res[name], bar)}"


@pytest.mark.parametrize("case", CASES, ids=[f"{p}-{f}" for p, f in CASES])
def test_each_mode_within_its_bound(case, figures):
    res = figures[case]
    for name, bound in BOUNDS.items():
        m = res[name]
        for k, v in bound.items():
            if k == "top1_agree":
                assert m[k] == v, f"{name}: {k} {m[k]}"
            elif k == "top1_agree_min":
                assert m["top1_agree"] >= v, f"{name}: top1_agree {m['top1_agree']}"
            else:
                assert m[k] < v, f"{name}: {k} {m[k]:.3g} >= {v}"
    # the exact modes are far inside the bar, not just at it
    bar = res["reference bfloat16"]
    assert res["cpu int16, f32 KV"]["kl_mean"] < 1e-3 * bar["kl_mean"]
    assert res["cpu float, f32 KV"]["kl_mean"] < 1e-3 * bar["kl_mean"]


def test_bf16_mode_is_a_twin_of_the_float_reference():
    """load_mode's bf16 reference shares the float reference's weights, rounds where MLX rounds (its logits
    differ), and leaves the float reference as it was."""
    path = cached_checkpoint("tiny", "mlx-q4", seed=0)
    ref = qm.Model.load(path, backend="reference")
    ids = A.prompt(ref.config.vocab_size, 5, seed=1)
    before = A.teacher_forced(ref, ids, 5)
    twin = A.load_mode("reference bfloat16", path, ref)
    assert twin._backend.impl.bf16 and twin._backend.dtype == "bfloat16"
    assert twin._backend.impl.params["lm_head"] is ref._backend.impl.params["lm_head"]
    fresh = qm.Model.load(path, backend="reference", dtype="bfloat16")
    np.testing.assert_array_equal(A.teacher_forced(twin, ids, 5), A.teacher_forced(fresh, ids, 5))
    assert not np.array_equal(A.teacher_forced(twin, ids, 5), before)
    np.testing.assert_array_equal(A.teacher_forced(ref, ids, 5), before)

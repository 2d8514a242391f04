"""DFlash drafting in the generation loop (``speculative="dflash:DIR"``): the target's layer features through
`prefill_features` and ``verify(features=)``, greedy output identical to plain decoding with the real (random)
draft and with a scripted wrapper that forces long accepted runs, the features reaching the draft's cache in
order, the rejection rule for a drafted distribution (a chi-square test over a two-token block), and the
argument errors."""
import re

import numpy as np
import pytest
import qwenmetal as qm
from dflash_oracles import TINY, TINY2, draft_config, random_tensors, write_draft
from qwenmetal.backends.reference import ReferenceModel
from qwenmetal.dflash import DFlashDrafter, DFlashReference, load_dflash_draft
from qwenmetal.errors import CheckpointError
from qwenmetal.sampling import Sampler
from qwenmetal.session import verify
from qwenmetal.testing import cached_checkpoint
from test_sampling import CHI2_DF8_P001

PROMPT = "The quick brown fox"
LAYERS = (1, 2)


@pytest.fixture(scope="module")
def target_dir():
    return cached_checkpoint("tiny", "mlx-q4", 0)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    cfg = draft_config(TINY, vocab_size=512, num_target_layers=4, block_size=8,
                       dflash_config={"mask_token_id": 511, "target_layer_ids": list(LAYERS)})
    return write_draft(tmp_path_factory.mktemp("dflash") / "draft", cfg, random_tensors(cfg, seed=5))


def _load(target_dir, backend):
    return qm.Model.load(target_dir, backend=backend, **({"threads": 2} if backend == "cpu" else {}))


# ---- the target's layer features ------------------------------------------------------------------------
def test_reference_features_and_their_errors(target_dir):
    """The reference backend's features are the listed layers' outputs from the pass that gives the logits; a
    verification's rows (one decode step each) give the same rows; bad layer lists are refused before any work."""
    m = _load(target_dir, "reference")
    ids = m.tokenizer.encode(PROMPT)
    s = m.new_session()
    logits, feats = m.prefill_features(s, ids, "last", (2, 1))
    ref = ReferenceModel(m.config, m.weights.dense_float32())
    want = []
    want_logits = ref.forward(ref.new_state(), np.asarray(ids), logits="last", feature_layers=(2, 1), features=want)
    np.testing.assert_allclose(feats, want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert s.position == len(ids) and list(s.tokens) == list(ids)
    s2 = m.new_session()
    rows, vf = verify(m, s2, ids, features=(2, 1))
    assert vf.shape == feats.shape
    np.testing.assert_allclose(vf, feats, rtol=1e-4, atol=1e-4 * np.abs(feats).max())
    np.testing.assert_allclose(rows[-1], logits, rtol=1e-4, atol=1e-4 * np.abs(logits).max())
    s3 = m.new_session()
    for layers, msg in (((), "1..8 of them, got 0"), ((0, 4), "distinct indices 0..3"), ((1, 1), "distinct"),
                        (tuple(range(9)), "1..8 of them, got 9"), ("ab", "layer indices")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            m.prefill_features(s3, ids, "last", layers)
    with pytest.raises(ValueError, match="hidden states or layer features, not both"):
        verify(m, s3, ids, return_hidden=True, features=(1,))
    assert s3.position == 0 and not s3.tokens


# ---- DFlash drafting: exact -----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "cpu", "metal-sim"])
def test_dflash_greedy_is_plain_greedy(target_dir, draft_dir, backend):
    m = _load(target_dir, backend)
    sim = backend == "metal-sim"          # the simulator runs every verification row: fewer, shorter rounds
    kw = dict(max_tokens=12 if sim else 24, temperature=0, ignore_eos=True, cache=False)
    plain = [o.token for o in m.generate(PROMPT, **kw)]
    outs = list(m.generate(PROMPT, speculative=f"dflash:{draft_dir}", speculative_k=3 if sim else 7, **kw))
    assert [o.token for o in outs] == plain
    st = outs[-1].stats["speculative"]
    assert st["drafter"] == "dflash" and st["drafted_tokens"] > 0 and st["mean_accepted_length"] >= 1.0
    # the cpu engine and the Metal graph draft natively; the reference backend drafts with the numpy reference
    d = DFlashDrafter.for_model(m, draft_dir)
    outs = list(m.generate(PROMPT, speculative=d, speculative_k=3 if sim else 7, **kw))
    assert [o.token for o in outs] == plain
    assert (d.native is not None) == (backend != "reference")
    assert (d.reference is None) == (backend != "reference")


def test_dflash2_greedy_on_cpu_drafts_natively_and_is_plain_greedy(target_dir, tmp_path, monkeypatch):
    """A DFlash2 draft (convolutions and candidate selector) drafts on the cpu engine, not in the reference."""
    cfg = draft_config(TINY2, vocab_size=512, num_target_layers=4,
                       dflash_config=dict(TINY2["dflash_config"], mask_token_id=511, target_layer_ids=list(LAYERS)))
    path = write_draft(tmp_path / "d2", cfg, random_tensors(cfg, seed=5))

    def no_reference(*a, **k):
        raise AssertionError("the numpy reference drafted on the cpu backend")

    monkeypatch.setattr(DFlashReference, "forward", no_reference)
    m = _load(target_dir, "cpu")
    kw = dict(max_tokens=24, temperature=0, ignore_eos=True, cache=False)
    plain = [o.token for o in m.generate(PROMPT, **kw)]
    d = DFlashDrafter.for_model(m, path)
    assert d.checkpoint.config.variant == "dflash2"
    outs = list(m.generate(PROMPT, speculative=d, speculative_k=7, **kw))
    assert [o.token for o in outs] == plain
    assert d.native is not None and d.reference is None
    st = outs[-1].stats["speculative"]
    assert st["drafter"] == "dflash" and st["drafted_tokens"] > 0


class ScriptedDFlash(DFlashDrafter):
    """The real draft runs every round (so its features and cache advance as in a real run), but the proposal
    is the target's own greedy continuation, wrong at every fourth round's third draft: long accepted runs."""

    def __init__(self, draft, script):
        super().__init__(draft)
        self.script, self.calls, self.positions = script, 0, []

    def propose(self, context, k, temperature=0.0):
        real, _ = super().propose(context, k, temperature)
        self.calls += 1
        self.positions.append((self.round.cache.position, len(context)))
        want = list(self.script[len(context):len(context) + len(real)])
        if self.calls % 4 == 0 and len(want) > 2:
            want[2] = (want[2] + 1) % 400
        return want, None


@pytest.mark.parametrize("backend", ["reference", "cpu", "metal-sim"])
def test_forced_acceptance_keeps_the_output_and_feeds_the_draft_in_order(target_dir, draft_dir, backend):
    m = _load(target_dir, backend)
    kw = dict(max_tokens=30, temperature=0, ignore_eos=True, cache=False)
    prompt = m.tokenizer.encode(PROMPT)
    plain = [o.token for o in m.generate(prompt, **kw)]
    d = ScriptedDFlash(load_dflash_draft(draft_dir, m.config), prompt + plain)
    outs = list(m.generate(prompt, speculative=d, speculative_k=7, **kw))
    assert [o.token for o in outs] == plain
    st = outs[-1].stats["speculative"]
    assert st["mean_accepted_length"] > 3.0, st
    # every round the draft holds the features of exactly the tokens before the sampled one: its cache position
    # is the context's length less one, round after round
    assert d.positions[0] == (len(prompt), len(prompt) + 1)
    assert all(pos == n - 1 for pos, n in d.positions), d.positions


def test_dflash_drafter_errors(target_dir, draft_dir, tmp_path):
    m = _load(target_dir, "reference")
    with pytest.raises(ValueError, match=re.escape("'dflash:DIR'")):
        list(m.generate(PROMPT, max_tokens=2, speculative="dflash:"))
    other = draft_config(TINY, vocab_size=512, num_target_layers=4,
                         dflash_config={"mask_token_id": 511, "target_layer_ids": [1, 7]})
    bad = write_draft(tmp_path / "bad", other, random_tensors(other))
    with pytest.raises(CheckpointError, match=re.escape("name layers [7]")):
        list(m.generate(PROMPT, max_tokens=2, speculative=f"dflash:{bad}"))
    with pytest.raises(CheckpointError, match="config.json"):
        list(m.generate(PROMPT, max_tokens=2, speculative=f"dflash:{tmp_path / 'missing'}"))


# ---- sampling: the rejection rule for a drafted distribution ---------------------------------------------
def test_block_rejection_sampling_is_exact():
    """A two-token block: drafts d1 ~ q1, d2 ~ q2(. | d1); the verification keeps d1 with min(1, p1/q1), else
    draws from max(p1 - q1, 0); on keeping d1 it decides position 2 the same way against p2(. | d1), else the
    next token is drawn from p2 plainly (the next round). The joint law of the two tokens is p1(a) p2(b | a):
    chi-square over 9 cells at 1e-3 (df 8) with 6000 blocks."""
    rng = np.random.default_rng(0)
    p1 = np.array([0.5, 0.3, 0.2])
    p2 = np.array([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.1, 0.8, 0.1]])
    q1 = np.array([0.2, 0.3, 0.5])
    q2 = np.array([[0.3, 0.3, 0.4], [0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    logit = np.log
    s = Sampler(temperature=1.0, seed=1)
    N, counts = 6000, np.zeros((3, 3))
    for _ in range(N):
        d1 = int(rng.choice(3, p=q1))
        d2 = int(rng.choice(3, p=q2[d1]))
        r1, ok1 = s.verify_draft(logit(p1), d1, draft_probs=q1)
        a = r1.token
        if ok1:
            r2, _ = s.verify_draft(logit(p2[a]), d2, draft_probs=q2[a])
            b = r2.token
        else:
            b = s.sample(logit(p2[a])).token
        counts[a, b] += 1
    exp = N * p1[:, None] * p2
    chi2 = float(((counts - exp) ** 2 / exp).sum())
    assert chi2 < CHI2_DF8_P001, chi2
    with pytest.raises(ValueError, match="draft_probs must be a probability vector over the 3 logits"):
        s.verify_draft(logit(p1), 0, draft_probs=q1[:2])


# ---- architectures, fixture formats, prefill chunks and the prefix cache ------------------------------------
@pytest.mark.parametrize("preset, fmt", [("tiny-qwen3-next", "mlx-q4"), ("tiny", "hf-bf16")])
def test_dflash_on_the_other_architecture_and_format(draft_dir, preset, fmt):
    """Qwen3-Next and an unquantized checkpoint: greedy DFlash decoding on cpu is plain greedy decoding."""
    m = qm.Model.load(cached_checkpoint(preset, fmt, 0), backend="cpu", threads=2)
    kw = dict(max_tokens=16, temperature=0, ignore_eos=True, cache=False)
    plain = [o.token for o in m.generate(PROMPT, **kw)]
    outs = list(m.generate(PROMPT, speculative=f"dflash:{draft_dir}", speculative_k=5, **kw))
    assert [o.token for o in outs] == plain and outs[-1].stats["speculative"]["drafted_tokens"] > 0


def test_dflash_across_prefill_chunks_and_the_prefix_cache(target_dir, draft_dir):
    """A prompt prefilled in 3-token chunks gives the draft every row's features in order (the scripted wrapper
    sees its cache at the context less one), and a second generation whose prompt comes back from the prefix
    cache (its features do not: the draft starts from the new rows) is still plain greedy decoding."""
    m = qm.Model.load(target_dir, backend="cpu", threads=2, prefill_chunk=3)
    prompt = m.tokenizer.encode(PROMPT + " jumps over the lazy dog")
    kw = dict(max_tokens=16, temperature=0, ignore_eos=True)
    plain = [o.token for o in m.generate(prompt, cache=False, **kw)]
    d = ScriptedDFlash(load_dflash_draft(draft_dir, m.config), prompt + plain)
    outs = list(m.generate(prompt, speculative=d, speculative_k=5, cache=True, **kw))
    assert [o.token for o in outs] == plain
    assert all(pos == n - 1 for pos, n in d.positions), d.positions
    again = list(m.generate(prompt, speculative=f"dflash:{draft_dir}", speculative_k=5, cache=True, **kw))
    assert again[-1].stats["cached_tokens"] > 0
    assert [o.token for o in again] == plain

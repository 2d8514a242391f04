"""The DFlash draft's forward on the cpu engine (`CpuBackend.dflash_draft`, src/cpu/dflash.*) against the numpy
reference `DFlashReference` (the ground truth) over several rounds with a growing cache, for the bf16 draft and an
MLX 4-bit copy, DFlash and DFlash2 (its convolutions, and its candidate selector's drafts against
``DFlashReference.propose``); ``commit=False`` leaves the cache; argument errors leave it untouched; and the
drafter in the generation loop uses the native path with output identical to plain greedy decoding."""
import re

import numpy as np
import pytest
import qwenmetal as qm
from dflash_oracles import (
    TINY,
    TINY2,
    bad_draft_inputs,
    draft_config,
    random_round,
    random_tensors,
    write_draft,
    write_mlx_quantized,
)
from qwenmetal.backends.cpu import CpuDFlash
from qwenmetal.dflash import DFlashDrafter, DFlashReference, NativeDFlash, drafting_block, load_dflash_draft
from qwenmetal.testing import cached_checkpoint

PROMPT = "The quick brown fox"
LAYERS = (1, 2)
MASK = 511
# (context rows, block length) per round: a prompt, accepted runs, a round with no new context, short blocks
ROUNDS = ((6, 8), (3, 8), (0, 5), (1, 2), (4, 8), (2, 1))


@pytest.fixture(scope="module")
def model():
    return qm.Model.load(cached_checkpoint("tiny", "mlx-q4", 0), backend="cpu", threads=2)


def _config(**over):
    base = dict(vocab_size=512, num_target_layers=4, block_size=8,
                dflash_config={"mask_token_id": MASK, "target_layer_ids": list(LAYERS)})
    base.update(over)
    return draft_config(TINY, **base)


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash_cpu")
    cfg = _config()
    bf16 = write_draft(root / "bf16", cfg, random_tensors(cfg, seed=5))
    return {"bf16": bf16, "mlx-q4": write_mlx_quantized(bf16, root / "q4", bits=4, group_size=64)}


def _close(got, want, tol=1e-4):
    assert got.shape == want.shape and got.dtype == np.float32
    if want.size:
        err = float(np.abs(got - want).max()) / float(want.max() - want.min())
        assert err < tol, err


def _check(native, nc, ref, rc, f, block, commit=True):
    want = ref.logits(ref.forward(rc, f, block, commit=commit)[1:])
    got = native.forward(nc, f, block, commit=commit)
    _close(got, want)
    assert nc.position == rc.position
    return got


@pytest.mark.parametrize("fmt", ["bf16", "mlx-q4"])
def test_native_logits_match_the_reference_round_after_round(model, draft_dirs, fmt):
    draft = load_dflash_draft(draft_dirs[fmt], model.config)
    assert draft.quantized == (fmt == "mlx-q4")
    native, ref = model.dflash_draft(draft), DFlashReference.over_weights(draft, model.weights)
    assert isinstance(native, CpuDFlash)
    nc, rc = native.new_cache(), ref.new_cache()
    rng = np.random.default_rng(3)
    for n, L in ROUNDS:
        _check(native, nc, ref, rc, *random_round(rng, draft.config, n, L))
    assert nc.position == sum(n for n, _ in ROUNDS)
    # a copy of the cache carries on as the original does
    f, block = random_round(rng, draft.config, 2, 8)
    twin = nc.copy()
    a = native.forward(nc, f, block)
    np.testing.assert_array_equal(native.forward(twin, f, block), a)


def test_context_rows_in_pieces_of_prefill_chunk(draft_dirs):
    """Context projections over more rows than the target's prefill_chunk run in pieces: the same logits."""
    small = qm.Model.load(cached_checkpoint("tiny", "mlx-q4", 0), backend="cpu", threads=2, prefill_chunk=4)
    draft = load_dflash_draft(draft_dirs["bf16"], small.config)
    native, ref = small.dflash_draft(draft), DFlashReference.over_weights(draft, small.weights)
    nc, rc = native.new_cache(), ref.new_cache()
    rng = np.random.default_rng(8)
    for n, L in ((11, 8), (5, 8), (4, 8)):
        _check(native, nc, ref, rc, *random_round(rng, draft.config, n, L))


def test_sliding_window_layer_and_scalings(model, tmp_path):
    """A sliding-attention layer (causal within its window), input_embedding_scale, output_multiplier and a
    logit soft cap, against the reference, with the window smaller than the context."""
    cfg = _config(layer_types=["sliding_attention", "full_attention"], sliding_window=5,
                  dflash_config={"mask_token_id": MASK, "target_layer_ids": list(LAYERS),
                                 "input_embedding_scale": 0.5, "output_multiplier": 1.5,
                                 "final_logit_softcapping": 3.0})
    draft = load_dflash_draft(write_draft(tmp_path / "d", cfg, random_tensors(cfg, seed=7)), model.config)
    native, ref = model.dflash_draft(draft), DFlashReference.over_weights(draft, model.weights)
    nc, rc = native.new_cache(), ref.new_cache()
    rng = np.random.default_rng(4)
    for n, L in ROUNDS:
        _check(native, nc, ref, rc, *random_round(rng, draft.config, n, L))


# ---- DFlash2: the convolutions and the candidate selector ---------------------------------------------------------
def _config2(**over):
    base = dict(vocab_size=512, num_target_layers=4, block_size=8,
                dflash_config=dict(TINY2["dflash_config"], mask_token_id=MASK, target_layer_ids=list(LAYERS)))
    base.update(over)
    return draft_config(TINY2, **base)


@pytest.fixture(scope="module")
def draft2_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2_cpu")
    cfg = _config2()
    bf16 = write_draft(root / "bf16", cfg, random_tensors(cfg, seed=5))
    return {"bf16": bf16, "mlx-q4": write_mlx_quantized(bf16, root / "q4", bits=4, group_size=64)}


# The DFlash cases' 1e-4 holds for the bf16 draft and, in the reference arithmetic (activations "float"), for the
# 4-bit copy. With integer activations (int16, "auto" on AVX2/AVX-512) every 4-bit GEMM of the draft rounds its
# input to 16 bits per group, and DFlash2's convolutions multiply those rows by dynamic factors that carry the
# same rounding: ~2e-4 of the logit range on this fixture (DFlash: ~7e-5), checked at 4e-4 -- and there the
# drafts, a walk over near-equal scores, are not compared.
@pytest.mark.parametrize("fmt, activations, tol", [("bf16", "auto", 1e-4), ("mlx-q4", "float", 1e-4),
                                                   ("mlx-q4", "auto", 4e-4)])
def test_dflash2_logits_and_selected_drafts_match_the_reference(model, draft2_dirs, fmt, activations, tol):
    m = model if activations == "auto" else \
        qm.Model.load(cached_checkpoint("tiny", "mlx-q4", 0), backend="cpu", threads=2, activations=activations)
    draft = load_dflash_draft(draft2_dirs[fmt], m.config)
    assert draft.config.variant == "dflash2" and draft.quantized == (fmt == "mlx-q4")
    native, ref = m.dflash_draft(draft), DFlashReference.over_weights(draft, m.weights)
    nc, rc = native.new_cache(), ref.new_cache()
    rng = np.random.default_rng(3)
    for i, (n, L) in enumerate(((6, 8), (3, 8), (0, 5), (1, 2), (4, 8), (2, 8))):
        f = rng.standard_normal((n, draft.config.feature_size)).astype(np.float32)
        first = int(rng.integers(0, MASK))
        block = drafting_block(draft.config, first, L)
        if i == 1:                         # without commit: the cache stays, the same logits come again
            _close(native.forward(nc, f, block, commit=False), ref.logits(ref.forward(rc, f, block, commit=False)[1:]),
                   tol)
            assert nc.position == rc.position == 6
        want_drafts, want = ref.propose(rc, f, first, L)
        drafts, got = NativeDFlash(draft.config, native).propose(nc, f, first, L)
        _close(got, want, tol)
        assert drafts.dtype == np.int64 and drafts.shape == (L - 1,)
        if tol == 1e-4:
            assert drafts.tolist() == want_drafts.tolist(), i
        assert nc.position == rc.position
    # forward's logits are propose's
    f, block = random_round(rng, draft.config, 2, 8)
    np.testing.assert_array_equal(native.forward(nc, f, block, commit=False), native.propose(nc, f, block, False)[1])


def test_commit_false_leaves_the_cache(model, draft_dirs):
    draft = load_dflash_draft(draft_dirs["bf16"], model.config)
    native, ref = model.dflash_draft(draft), DFlashReference.over_weights(draft, model.weights)
    nc, rc = native.new_cache(), ref.new_cache()
    rng = np.random.default_rng(5)
    _check(native, nc, ref, rc, *random_round(rng, draft.config, 5, 8))
    f, block = random_round(rng, draft.config, 3, 8)
    first = _check(native, nc, ref, rc, f, block, commit=False)
    assert nc.position == 5
    np.testing.assert_array_equal(native.forward(nc, f, block, commit=False), first)
    # the cache is as it was: the next committed rounds still follow the reference
    for n, L in ((3, 8), (2, 4)):
        _check(native, nc, ref, rc, *random_round(rng, draft.config, n, L))
    assert nc.position == 10


def test_argument_errors_leave_the_cache_untouched(model, draft_dirs, tmp_path):
    draft = load_dflash_draft(draft_dirs["bf16"], model.config)
    native, ref = model.dflash_draft(draft), DFlashReference.over_weights(draft, model.weights)
    nc, rc = native.new_cache(), ref.new_cache()
    rng = np.random.default_rng(6)
    _check(native, nc, ref, rc, *random_round(rng, draft.config, 4, 8))
    for features, ids, msg in bad_draft_inputs(rng, draft.config):
        with pytest.raises(ValueError, match=re.escape(msg)):
            native.forward(nc, features, ids)
        assert nc.position == 4
    other = model.dflash_draft(load_dflash_draft(write_draft(tmp_path / "wide", _config(num_hidden_layers=3),
                                                             random_tensors(_config(num_hidden_layers=3))),
                                                 model.config))
    with pytest.raises(ValueError, match="this cache was made for another draft"):
        other.forward(nc, *random_round(rng, draft.config, 2, 8))
    assert nc.position == 4
    cfg2 = _config2(dflash_config=dict(TINY2["dflash_config"], mask_token_id=MASK, target_layer_ids=list(LAYERS),
                                       selector_top_k=513))
    d2 = load_dflash_draft(write_draft(tmp_path / "d2", cfg2, random_tensors(cfg2)), model.config)
    with pytest.raises(ValueError, match=re.escape("selector_top_k 513 exceeds vocab_size 512")):
        model.dflash_draft(d2)
    # nothing above touched the cache: the next rounds still follow the reference
    for n, L in ((2, 8), (1, 3)):
        _check(native, nc, ref, rc, *random_round(rng, draft.config, n, L))


def test_generation_drafts_natively_and_equals_plain_greedy(model, draft_dirs, monkeypatch):
    calls = []
    forward = CpuDFlash.forward

    def spy(self, cache, features, block, commit=True):
        calls.append(len(block))
        return forward(self, cache, features, block, commit)

    def no_reference(*a, **k):
        raise AssertionError("the numpy reference drafted on the cpu backend")

    monkeypatch.setattr(CpuDFlash, "forward", spy)
    monkeypatch.setattr(DFlashReference, "forward", no_reference)
    kw = dict(max_tokens=24, temperature=0, ignore_eos=True, cache=False)
    plain = [o.token for o in model.generate(PROMPT, **kw)]
    outs = list(model.generate(PROMPT, speculative=f"dflash:{draft_dirs['bf16']}", speculative_k=7, **kw))
    assert [o.token for o in outs] == plain
    st = outs[-1].stats["speculative"]
    assert st["drafter"] == "dflash" and st["drafted_tokens"] > 0
    assert calls and all(2 <= n <= 8 for n in calls)
    d = DFlashDrafter.for_model(model, draft_dirs["mlx-q4"])
    outs = list(model.generate(PROMPT, speculative=d, speculative_k=7, **kw))
    assert [o.token for o in outs] == plain
    assert d.native is not None and d.reference is None

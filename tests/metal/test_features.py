"""Target features in the Metal graph (a DFlash draft's context, docs/speculative.md "DFlash drafts"): the
residual stream after chosen decoder layers, copied out by `copy_f32` in the prefill chunks
(`forward_features`), the decode step (one token), the verification graph (``verify(features=)``) and the
streaming step. Simulator-verified, hardware-unverified.

* float build: the features of a prompt against the reference's ``feature_layers`` (both architectures),
  tight; a prompt across several internal prefill chunks bit for bit one chunk (every logits mode);
* verification rows bit for bit the one-token calls (float and bfloat builds), through a chain, a rewind
  and another chain;
* bfloat build: the rows are the bf16 residual stream widened (every value a bf16), near the reference's
  bfloat16 mode;
* argument errors refused by the engine itself (the session checks first; these bypass it) with the state,
  the tokens and an open chain untouched;
* expert streaming: the same features as resident experts;
* the copies add no dependency level to the real config's graphs (encode-only), only their bytes.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import qwenmetal as qm
from qwenmetal import bench
from qwenmetal import session as ses
from qwenmetal.backends.metal import DEFAULT_PREFILL_CHUNK, prefill_options
from qwenmetal.backends.reference import ReferenceModel
from qwenmetal.bench.cost import virtual_weight_table
from qwenmetal.config import ModelConfig
from qwenmetal.native import core
from qwenmetal.testing import cached_checkpoint
from qwenmetal.weights_table import config_dict

from .gpu_harness import BACKEND, SIM

PROMPT = [5, 17, 3, 99, 42, 7, 250, 1, 9, 11, 13]
DRAFTS = [11, 300, 42, 7, 256, 99]
LAYERS = (3, 0, 2)          # any order: the output's column blocks follow it; the last layer included


def _load(preset="tiny", dtype="float32", **kw):
    return qm.Model.load(cached_checkpoint(preset, "mlx-q4", seed=0), backend=BACKEND, dtype=dtype, **kw)


def _arrays(m, s):
    return m._backend.state_to_arrays(s._state)


def _same_state(m, a, b):
    x, y = _arrays(m, a), _arrays(m, b)
    return x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


def _one_token_rows(m, s, ids, layers):
    """(logits, features) of `ids` fed one token per call (the decode step's graph)."""
    rows = [m.prefill_features(s, [t], "last", layers) for t in ids]
    return np.stack([r[0] for r in rows]), np.concatenate([r[1] for r in rows])


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3-next"])
def test_float_build_features_match_the_reference(preset):
    m = _load(preset)
    ref = ReferenceModel(m.config, m.weights.dense_float32())
    want = []
    want_logits = ref.forward(ref.new_state(), np.asarray(PROMPT), logits="last", feature_layers=LAYERS,
                              features=want)
    s = m.new_session()
    logits, feats = m.prefill_features(s, PROMPT, "last", LAYERS)
    H = m.config.hidden_size
    assert feats.dtype == np.float32 and feats.shape == (len(PROMPT), len(LAYERS) * H)
    scale = np.abs(want[0]).max()
    np.testing.assert_allclose(feats, want[0], rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(logits, want_logits, rtol=0, atol=1e-5 * np.abs(want_logits).max())
    assert s.position == len(PROMPT) and list(s.tokens) == PROMPT
    # one token more: the decode step's graph, against the reference's next row
    _, f1 = m.prefill_features(s, [DRAFTS[0]], "none", LAYERS)
    want1 = []
    st = ref.new_state()
    ref.forward(st, np.asarray(PROMPT + DRAFTS[:1]), logits="none", feature_layers=LAYERS, features=want1)
    np.testing.assert_allclose(f1[0], want1[0][-1], rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("dtype,modes", [("float32", ("last", "all", "none")), ("bfloat16", ("all",))])
def test_prefill_across_chunks_is_one_chunk(dtype, modes):
    """Chunks of 4 rows (the features of each chunk gathered into its rows) give the one-chunk prefill's
    features and logits bit for bit, in every logits mode."""
    one, cut = _load(dtype=dtype), _load(dtype=dtype, prefill_chunk=4)
    for mode in modes:
        la, fa = one.prefill_features(one.new_session(), PROMPT, mode, LAYERS)
        lb, fb = cut.prefill_features(cut.new_session(), PROMPT, mode, LAYERS)
        np.testing.assert_array_equal(fa, fb)
        assert (la is None and lb is None and mode == "none") or np.array_equal(la, lb)
    # the columns follow the order asked for
    _, f2 = cut.prefill_features(cut.new_session(), PROMPT, "none", LAYERS[::-1])
    H = one.config.hidden_size
    np.testing.assert_array_equal(f2, np.concatenate([fa[:, j * H:(j + 1) * H] for j in (2, 1, 0)], axis=1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_rows_are_one_token_calls_through_a_chain_and_rewind(dtype):
    m = _load(dtype=dtype)
    base = m.new_session()
    m.prefill(base, PROMPT)
    want_logits, want = _one_token_rows(m, base.fork(), DRAFTS, LAYERS)
    s = base.fork()
    logits, feats = ses.verify(m, s, DRAFTS[:4], features=LAYERS)             # a chain of two calls
    l2, f2 = ses.verify(m, s, DRAFTS[4:], features=LAYERS)
    np.testing.assert_array_equal(np.concatenate([feats, f2]), want)
    np.testing.assert_array_equal(np.concatenate([logits, l2]), want_logits)
    ses.rewind(m, s, 2)                                                       # keep 2, verify again after them
    l3, f3 = ses.verify(m, s, DRAFTS[2:], features=LAYERS)
    np.testing.assert_array_equal(f3, want[2:])
    np.testing.assert_array_equal(l3, want_logits[2:])
    ses.rewind(m, s, 1)
    ref = base.fork()
    for t in DRAFTS[:3]:
        m.decode_step(ref, t)
    assert _same_state(m, s, ref) and s.tokens == ref.tokens
    if dtype == "bfloat16":                                                   # the bf16 stream, widened
        np.testing.assert_array_equal(want.astype(ml_dtypes.bfloat16).astype(np.float32), want)


def test_bfloat_build_features_are_near_the_reference_bf16_mode():
    m = _load(dtype="bfloat16")
    ref = ReferenceModel(m.config, m.weights.dense_float32(), dtype="bfloat16")
    want = []
    ref.forward(ref.new_state(), np.asarray(PROMPT), logits="none", feature_layers=LAYERS, features=want)
    _, feats = m.prefill_features(m.new_session(), PROMPT, "none", LAYERS)
    assert np.isfinite(feats).all()
    np.testing.assert_array_equal(feats.astype(ml_dtypes.bfloat16).astype(np.float32), feats)
    err = np.abs(feats - want[0]).mean() / np.abs(want[0]).max()
    assert err < 2e-3, err


def test_argument_errors_leave_the_state_alone():
    """The engine refuses bad layer lists itself (the session's checks bypassed) before any work: the state,
    the tokens and an open verify chain are as they were, and the next call computes the right rows."""
    m = _load()
    be = m._backend
    n = m.config.num_hidden_layers
    s = m.new_session()
    m.prefill(s, PROMPT)
    ses.verify(m, s, DRAFTS[:2])                                              # an open chain
    before, toks = _arrays(m, s), list(s.tokens)
    ids = np.asarray(DRAFTS[2:4], dtype=np.int64)
    bad = [((), "feature layers: 1..8 of them, got 0"), (tuple(range(9)), "1..8 of them, got 9"),
           ((0, n), f"feature layer {n} outside the model's layers 0..{n - 1}"), ((-1,), "feature layer -1 outside"),
           ((1, 2, 1), "feature layer 1 given twice"), ("ab", "sequence of layer indices"),
           ((True,), "sequence of layer indices")]
    for layers, msg in bad:
        with pytest.raises(ValueError, match=msg):
            be.forward_features(s._state, ids, "last", s._tokens, layers)
        with pytest.raises(ValueError, match=msg):
            be.verify(s._state, ids, s._tokens, features=layers)
    with pytest.raises(ValueError, match="hidden states or layer features, not both"):
        be.verify(s._state, ids, s._tokens, return_hidden=True, features=(1,))
    with pytest.raises(ValueError, match="hidden states or layer features, not both"):
        be.engine.verify(s._state, ids, s._tokens, return_hidden=True, features=[1])
    with pytest.raises(ValueError, match="at most 16 tokens per verification"):
        be.verify(s._state, np.ones(17, dtype=np.int64), s._tokens, features=(1,))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        be.forward_features(s._state, np.asarray([1, m.config.vocab_size]), "all", s._tokens, (1,))
    with pytest.raises(ValueError, match="logits must be 'last', 'all' or 'none'"):
        be.forward_features(s._state, ids, "some", s._tokens, (1,))
    after = _arrays(m, s)
    assert list(s.tokens) == toks and all(np.array_equal(before[k], after[k]) for k in before)
    assert ses.rewindable(m, s) == 2
    ses.rewind(m, s, 1)                                                       # the chain still rewinds
    ref = m.new_session()
    m.prefill(ref, PROMPT)
    _, want = _one_token_rows(m, ref, DRAFTS[:3], (1,))
    _, got = ses.verify(m, s, DRAFTS[1:3], features=(1,))
    np.testing.assert_array_equal(got, want[1:])


@pytest.mark.skipif(not SIM, reason="streaming runs on the simulator here (tests/metal/test_streaming_metal.py)")
def test_expert_streaming_returns_the_resident_features():
    """Streaming mode (each token its own stream_step): the prompt's features and the row-by-row verification's
    (the session's fallback, one forward_features per row) equal the resident graph's within the backend's
    tolerance (a slot batch adds its experts' sum to x on its own)."""
    res, stream = _load(), _load(expert_slots=4)
    assert not stream.native_verify and stream.returns_features
    _, want = res.prefill_features(res.new_session(), PROMPT, "none", LAYERS)
    s = stream.new_session()
    _, got = stream.prefill_features(s, PROMPT[:-2], "none", LAYERS)
    _, tail = ses.verify(stream, s, PROMPT[-2:], features=LAYERS)
    np.testing.assert_allclose(np.concatenate([got, tail]), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_the_copies_add_no_dependency_level_on_the_real_config():
    """Encode-only, the real config (40 layers) with DFlash's five layers: the decode step, a 16-row verification
    and a 4096-row prefill chunk have the levels they have without features; the bytes grow by exactly the rows
    read (bf16) and written (f32); five dispatches more."""
    cfg = ModelConfig.from_dict(bench.real_config(40))
    mappings, tensors, _ = virtual_weight_table(cfg)
    eng = core().gpu.GpuEngine(core().gpu.SimDevice(execute=False), config_dict(cfg), mappings, tensors, "bf16",
                               False, {}, [], prefill_options(DEFAULT_PREFILL_CHUNK, "auto", "auto"))
    layers = [1, 10, 19, 28, 37]
    H = cfg.hidden_size

    def state(p):
        st = eng.new_state()
        st._set_position(p)
        return st

    for rows, cost in ((1, lambda st, f: eng.encode_cost(st, f)), (16, lambda st, f: eng.verify_cost(st, 16, f)),
                       (4096, lambda st, f: eng.prefill_cost(st, 4096, False, f))):
        p = 0 if rows == 4096 else 4096
        a, b = cost(state(p), []), cost(state(p), layers)
        assert b["levels"] == a["levels"], rows
        assert b["dispatches"] == a["dispatches"] + len(layers)
        assert b["bytes_read"] - a["bytes_read"] == len(layers) * rows * H * 2
        assert b["bytes_written"] - a["bytes_written"] == len(layers) * rows * H * 4
    with pytest.raises(ValueError, match="feature layer 40 outside the model's layers 0..39"):
        eng.verify_cost(state(0), 2, [40])

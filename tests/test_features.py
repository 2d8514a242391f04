"""The target's layer features on the cpu engine (`prefill_features`, ``verify(features=)``; a DFlash draft's
context): the listed layers' outputs against the numpy reference's ``feature_layers``, a prefill across several
internal chunks against one chunk, verification rows bit for bit one-token calls (through a chain, a rewind and
a verification after it), and bad layer lists refused by the engine itself with the state untouched."""
import re

import numpy as np
import pytest
import qwenmetal as qm
from qwenmetal import session as ses
from qwenmetal.backends.reference import ReferenceModel
from qwenmetal.testing import cached_checkpoint

PROMPT = [5, 17, 3, 99, 42, 7, 250, 1, 0, 64, 300, 12, 401, 88, 9, 2, 77]
LAYERS = (3, 0, 2)            # any order: the columns follow it; GDN and attention layers of the tiny models


def _load(preset="tiny", **kw):
    return qm.Model.load(cached_checkpoint(preset, "mlx-q4", seed=0), backend="cpu", threads=2,
                         kv_dtype="float32", activations="float", **kw)


def _close(got, want, rel=1e-4):
    np.testing.assert_allclose(got, want, rtol=rel, atol=rel * np.abs(want).max())


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3-next"])
def test_features_match_the_reference_in_one_chunk_or_several(preset):
    m = _load(preset)
    H = m.config.hidden_size
    ref = ReferenceModel(m.config, m.weights.dense_float32())
    want = []
    want_logits = ref.forward(ref.new_state(), np.asarray(PROMPT), logits="all", feature_layers=LAYERS,
                              features=want)
    s = m.new_session()
    logits, feats = m.prefill_features(s, PROMPT, "all", LAYERS)
    assert feats.dtype == np.float32 and feats.shape == (len(PROMPT), len(LAYERS) * H)
    _close(feats, want[0])
    _close(logits, want_logits)
    assert s.position == len(PROMPT) and list(s.tokens) == PROMPT
    # the same prompt through 5-token chunks: the rows of every chunk land in place
    small = _load(preset, prefill_chunk=5)
    s5 = small.new_session()
    none, f5 = small.prefill_features(s5, PROMPT, "none", LAYERS)
    assert none is None
    _close(f5, feats, 1e-5)
    # a single layer's columns are that layer's block of the concatenation
    _, f2 = small.prefill_features(small.new_session(), PROMPT, "last", (2,))
    _close(f2, feats[:, 2 * H:], 1e-5)


def test_verify_rows_are_one_token_calls_through_a_chain_and_a_rewind():
    """verify(features=) rows, logits and features, are bit for bit those of one-token calls; after a chain of
    verifications and a rewind, the next verification's rows are those of one-token calls from the kept state."""
    m = _load()
    base = m.new_session()
    m.prefill_features(base, PROMPT, "last", LAYERS)

    def one_token_rows(s, ids):
        rows = [m.prefill_features(s, [t], "last", LAYERS) for t in ids]
        return np.stack([r[0] for r in rows]), np.concatenate([r[1] for r in rows])

    s = base.fork()
    lg1, f1 = ses.verify(m, s, [11, 300, 42], features=LAYERS)
    lg2, f2 = ses.verify(m, s, [7, 256], features=LAYERS)
    want_lg, want_f = one_token_rows(base.fork(), [11, 300, 42, 7, 256])
    np.testing.assert_array_equal(np.concatenate([lg1, lg2]), want_lg)
    np.testing.assert_array_equal(np.concatenate([f1, f2]), want_f)
    # plain verification rows are the same logits: the features take no other path
    np.testing.assert_array_equal(ses.verify(m, base.fork(), [11, 300, 42]), lg1)
    ses.rewind(m, s, 2)
    lg3, f3 = ses.verify(m, s, [99, 5, 6], features=LAYERS)
    want_lg, want_f = one_token_rows(base.fork(), [11, 300, 99, 5, 6])
    np.testing.assert_array_equal(lg3, want_lg[2:])
    np.testing.assert_array_equal(f3, want_f[2:])


def test_bad_layer_lists_are_refused_by_the_engine_with_the_state_untouched():
    """The backend (below the session's own check) refuses each bad list naming the problem, before the
    state, its tokens or its open verification chain are touched."""
    m = _load()
    be = m._backend
    s = m.new_session()
    m.prefill(s, PROMPT)
    ses.verify(m, s, [1, 2, 3])
    ref = s.fork()
    ids = np.array([4, 5])
    for layers, msg in (([], "1..8 of them, got 0"), ((0, 4), "feature layer 4 outside the layers 0..3"),
                        ((-1,), "feature layer -1 outside"), ((1, 1), "feature layer 1 listed twice"),
                        (tuple(range(9)), "1..8 of them, got 9"), ("ab", "a sequence of decoder-layer indices"),
                        ((True,), "a sequence of decoder-layer indices"), (3, "a sequence of decoder-layer indices")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            be.verify(s._state, ids, s._tokens, features=layers)
        with pytest.raises(ValueError, match=re.escape(msg)):
            be.forward_features(s._state, ids, "last", s._tokens, layers)
    with pytest.raises(ValueError, match="hidden states or layer features, not both"):
        be.verify(s._state, ids, s._tokens, return_hidden=True, features=(1,))
    with pytest.raises(ValueError, match="hidden states or layer features, not both"):
        be.engine.forward(s._state, ids, "last", s._tokens, return_hidden=2, features=(1,))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        be.verify(s._state, np.array([1, m.config.vocab_size]), s._tokens, features=(1,))
    with pytest.raises(ValueError, match="logits must be 'last', 'all' or 'none'"):
        be.forward_features(s._state, ids, "some", s._tokens, (1,))
    assert s.tokens == ref.tokens and s.position == ref.position and ses.rewindable(m, s) == 3
    a, b = be.state_to_arrays(s._state), be.state_to_arrays(ref._state)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    ses.rewind(m, s, 1)                                # the chain is still open
    assert s.position == len(PROMPT) + 1

"""The Metal graph's batched decode step (GpuEngine::decode_batch, docs/metal.md "The batched decode step"):
B independent sessions at their own positions in one command buffer, every row bit for bit that session's own
one-token decode step; rows join and leave between steps; errors leave every state alone. Simulator-verified,
hardware-unverified."""
import numpy as np
import pytest
from test_batching import _check_rows_are_decode_steps   # sessions stepped by changing subsets vs alone

import qwenmetal as qm
from qwenmetal.testing import cached_checkpoint

pytestmark = pytest.mark.skipif("metal-sim" not in qm.backends.BACKENDS, reason="needs the metal-sim backend")

PROMPTS = [[5, 9, 17, 33, 65, 129, 200], [7, 3], [11, 300, 42, 7, 256, 99, 3, 4, 5, 6, 1], [2]]


def _load(preset, dtype="float32"):
    return qm.Model.load(cached_checkpoint(preset, "mlx-q4", seed=0), backend="metal-sim", dtype=dtype)


def _state(m, s):
    a = m._backend.state_to_arrays(s._state)
    return {k: np.array(v, copy=True) for k, v in a.items()}


def _same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3-next"])
def test_decode_batch_rows_are_decode_steps(preset):
    _check_rows_are_decode_steps(_load(preset), steps=6)


def test_decode_batch_bfloat16():
    """The bfloat16 build: the same bit-for-bit equality (every kernel of a row is the decode step's)."""
    _check_rows_are_decode_steps(_load("tiny", "bfloat16"), steps=6)


def test_decode_batch_errors_leave_every_state_alone():
    m = _load("tiny")
    be = m._backend
    ss = [m.new_session() for _ in range(3)]
    for s, p in zip(ss, PROMPTS):
        m.prefill(s, p)
    before = [(s.tokens, _state(m, s)) for s in ss]
    V = m.config.vocab_size
    st = [s._state for s in ss]
    toks = [s._tokens for s in ss]
    with pytest.raises(ValueError, match="the same state twice"):
        be.decode_batch([st[0], st[1], st[0]], np.array([1, 2, 3]), [toks[0], toks[1], toks[0]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        be.decode_batch(st, np.array([1, V, 3]), toks)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        be.decode_batch(st, np.array([1, -1, 3]), toks)
    with pytest.raises(ValueError, match="takes 1..16"):
        be.decode_batch([], np.array([], np.int64), [])
    with pytest.raises(ValueError, match="states for"):
        be.decode_batch(st[:2], np.array([1, 2, 3]), toks)
    with pytest.raises(TypeError, match="consumed"):
        be.decode_batch(st, np.array([1, 2, 3]), toks[:2])
    many = [m.new_session() for _ in range(17)]
    with pytest.raises(ValueError, match="takes 1..16"):
        be.decode_batch([x._state for x in many], np.ones(17, np.int64), None)
    for s, (t, a) in zip(ss, before):
        assert s.tokens == t and _same(_state(m, s), a)
    # a state with an open verify chain: the batched step ends it, after the chain's last row
    from qwenmetal import session as ses
    ref = ss[0].fork()
    ses.verify(m, ss[0], [4, 8])
    for t in (4, 8):
        m.decode_step(ref, t)
    got = be.decode_batch([ss[0]._state], np.array([5]), [ss[0]._tokens])
    np.testing.assert_array_equal(got[0], m.decode_step(ref, 5))
    assert ses.rewindable(m, ss[0]) == 0 and ss[0].tokens == ref.tokens



def test_decode_batch_needs_resident_experts_and_an_executing_device():
    m = qm.Model.load(cached_checkpoint("tiny", "mlx-q4", seed=0), backend="metal-sim", expert_slots=4)
    s = m.new_session()
    m.prefill(s, PROMPTS[1])
    with pytest.raises(ValueError, match="resident experts"):
        m._backend.decode_batch([s._state], np.array([1]), [s._tokens])
    assert s.tokens == tuple(PROMPTS[1])
    from qwenmetal.native import core
    from qwenmetal.weights_table import config_dict, virtual_weight_table
    ext = core()
    mappings, tensors, _ = virtual_weight_table(m.config)
    eng = ext.gpu.GpuEngine(ext.gpu.SimDevice(execute=False), config_dict(m.config), mappings, tensors, "f32",
                            False, {}, [])
    st = eng.new_state()
    with pytest.raises(ValueError, match="encode-only device cannot decode"):
        eng.decode_batch([st], np.array([1]), None)
    assert st.position == 0


def test_batch_cost_encode_only_tiny():
    """batch_cost encodes the batched step without advancing a state; the modelled bench runs at tiny scale."""
    from qwenmetal.bench.batch import batch_modelled
    m = _load("tiny")
    res = batch_modelled(m.config, batches=(1, 2), context=64)
    assert set(res["batches"]) == {1, 2}
    b1, b2 = res["batches"][1], res["batches"][2]
    assert b2["bytes"] > b1["bytes"] and b2["bytes"] < 2 * b1["bytes"]
    for chip, r in b2["chips"].items():
        assert r["aggregate_tok_s"] > b1["chips"][chip]["aggregate_tok_s"]
    assert res["verify2"]["chips"]

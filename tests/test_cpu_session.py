"""The Model/Session contract (tests/test_session.py) on the C++ CPU backend, plus the state's C++ side:
deep copies, KV capacity reserved ahead, all-or-nothing calls."""
import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal.testing import make_checkpoint

import test_session
from test_session import *  # noqa: F401,F403  (the same contract tests, run with the fixture below)


# (preset, kv_dtype, prefill_chunk): a small chunk so that split prefills also cross chunk boundaries.
# float32 KV and float activations: the contract tests compare split vs joint prefills at 2e-5, and
# both a bf16 cache and integer activations round values that differ in the last fp32 bit (recurrent
# vs chunked GDN upstream) to neighbouring bf16 / integer values (test_cpu_engine.py covers the
# default bf16 cache and int16 activations at their own tolerances).
@pytest.fixture(scope="module", params=[("tiny", "float32", 5), ("tiny-qwen3-next", "float32", 512)],
                ids=lambda p: f"{p[0]}-{p[1]}-chunk{p[2]}")
def model(request, tmp_path_factory):
    preset, kv, chunk = request.param
    d = make_checkpoint(tmp_path_factory.mktemp("m") / "ck", config=preset, format="mlx-q4", seed=1)
    return qm.Model.load(d, backend="cpu", threads=2, kv_dtype=kv, prefill_chunk=chunk, activations="float")


def test_backend_is_cpu(model):
    assert model.backend == "cpu"
    assert type(model.new_session()._state).__name__ == "CpuState"
    assert model.new_session()._state.kv_dtype == model._backend.kv_dtype


def test_copy_is_deep_and_trimmed(model):
    s = model.new_session()
    model.prefill(s, list(range(1, 40)))
    st = s._state
    assert st.capacity >= 39 and st.allocated_nbytes >= st.nbytes
    expect = model.decode_step(s.fork(), 5)
    cp = st.copy()
    assert cp.position == st.position == 39 and cp.nbytes == st.nbytes
    assert cp.capacity == 39                       # a copy holds exactly its tokens
    f = s.fork()
    model.prefill(f, list(range(300)))             # grows the fork's KV cache (reallocation) ...
    assert s.position == 39 and cp.position == 39  # ... never the parent's or the copy's
    np.testing.assert_array_equal(model.decode_step(s.fork(), 5), expect)


def test_reset_zeroes_state(model):
    fresh = model.decode_step(model.new_session(), 7)
    s = model.new_session()
    model.prefill(s, [3, 4, 5, 6])
    s.reset()
    assert s.position == 0
    np.testing.assert_array_equal(model.decode_step(s, 7), fresh)
    st = s._state
    st.reset()                                     # the C++ reset itself
    assert st.position == 0
    np.testing.assert_array_equal(model.decode_step(s, 7), fresh)


def test_engine_errors_leave_state_unchanged(model):
    """Errors raised inside the C++ call (bypassing the Python checks) leave the state as it was."""
    s = model.new_session()
    model.prefill(s, [1, 2, 3])
    ref = s.fork()
    eng = model._backend.engine
    with pytest.raises(ValueError, match="vocabulary"):
        eng.forward(s._state, np.array([1, model.config.vocab_size], np.int64), "last")
    with pytest.raises(ValueError, match="logits"):
        eng.forward(s._state, np.array([1], np.int64), "some")
    with pytest.raises(ValueError, match="no tokens"):
        eng.forward(s._state, np.zeros(0, np.int64), "last")
    test_session.state_equal(s, ref)


def test_state_of_another_shape_is_refused(model, tmp_path):
    cfg = dict(qm.testing.PRESETS["tiny-text"])
    cfg["linear_num_value_heads"] = 2 * cfg["linear_num_value_heads"]
    other = qm.Model.load(make_checkpoint(tmp_path / "o", config=cfg, format="mlx-q4", seed=2), backend="cpu",
                          threads=1, kv_dtype=model._backend.kv_dtype)
    with pytest.raises(ValueError, match="another model"):
        model._backend.engine.forward(other.new_session()._state, np.array([1], np.int64), "last")


def test_options_are_checked(model, tmp_path):
    d = model.path
    for bad in (dict(threads=0), dict(kv_dtype="float16"), dict(prefill_chunk=0), dict(quantize=3),
                dict(threads=True)):
        (name,) = bad
        with pytest.raises(ValueError, match=f"^{name} must be"):
            qm.Model.load(d, backend="cpu", **bad)
    with pytest.raises(TypeError, match="dtype"):
        qm.Model.load(d, backend="cpu", dtype="float32")


def test_save_load_roundtrip_and_across_backends(model, tmp_path):
    """Session.save/load through the backend-independent layout: exact on the same backend, and a
    session saved by the reference backend continues on this one (and back)."""
    s = model.new_session()
    model.prefill(s, [4, 8, 15, 16, 23, 42])
    expect = model.decode_step(s.fork(), 7)
    s.save(tmp_path / "s.qms")
    t = qm.Session.load(tmp_path / "s.qms", model)
    assert t.position == 6 and t.tokens == s.tokens and t.nbytes == s.nbytes
    np.testing.assert_array_equal(model.decode_step(t, 7), expect)
    ref = qm.Model.load(model.path, backend="reference")
    r = ref.new_session()
    ref.prefill(r, [4, 8, 15, 16, 23, 42])
    r.save(tmp_path / "r.qms")
    u = qm.Session.load(tmp_path / "r.qms", model)
    got, want = model.decode_step(u, 7), ref.decode_step(r, 7)
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())
    t.save(tmp_path / "t.qms")
    v = qm.Session.load(tmp_path / "t.qms", ref)
    assert np.abs(ref.decode_step(v, 9) - model.decode_step(t, 9)).max() < 1e-3 * (want.max() - want.min())
    # an empty session (position 0: no KV rows) round-trips and continues like a new one
    model.new_session().save(tmp_path / "e.qms")
    e = qm.Session.load(tmp_path / "e.qms", model)
    assert e.position == 0 and e.tokens == ()
    np.testing.assert_array_equal(model.decode_step(e, 7), model.decode_step(model.new_session(), 7))


def test_save_load_bf16_kv_is_exact(tmp_path):
    m = qm.Model.load(make_checkpoint(tmp_path / "ck", config="tiny", format="mlx-q4", seed=4), backend="cpu",
                      threads=2)
    assert m._backend.kv_dtype == "bfloat16"
    s = m.new_session()
    m.prefill(s, list(range(3, 20)))
    expect = m.decode_step(s.fork(), 5)
    s.save(tmp_path / "s.qms")
    t = qm.Session.load(tmp_path / "s.qms", m)
    np.testing.assert_array_equal(m.decode_step(t, 5), expect)

"""The Model/Session contract: split prefills, fork, snapshot/restore, bad input leaves state untouched."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import qwenmetal as qm
from qwenmetal.testing import make_checkpoint


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen3-next"])
def model(request, tmp_path_factory):
    d = make_checkpoint(tmp_path_factory.mktemp("m") / "ck", config=request.param, format="mlx-q4", seed=1)
    return qm.Model.load(d, backend="reference")


def state_equal(a, b):
    """Two sessions hold identical state: same next-token logits after the same probe token."""
    assert a.position == b.position and a.tokens == b.tokens and a.nbytes == b.nbytes
    m = a._model
    la, lb = m.decode_step(a.fork(), 3), m.decode_step(b.fork(), 3)
    np.testing.assert_array_equal(la, lb)


ids_st = st.lists(st.integers(0, 200), min_size=1, max_size=24)


@settings(max_examples=12, deadline=None)
@given(a=ids_st, b=ids_st)
def test_split_prefill_equals_one_prefill(model, a, b):
    s1 = model.new_session()
    la = model.prefill(s1, a, return_logits="all")
    lb = model.prefill(s1, b, return_logits="all")
    s2 = model.new_session()
    lab = model.prefill(s2, a + b, return_logits="all")
    np.testing.assert_allclose(np.concatenate([la, lb]), lab, rtol=0, atol=2e-5 * np.abs(lab).max())
    assert s1.position == s2.position == len(a) + len(b) and s1.tokens == tuple(a + b)


def test_decode_equals_prefill_logits(model):
    ids = [5, 17, 3, 99, 42, 7, 250, 1, 0, 64]
    full = model.prefill(model.new_session(), ids, return_logits="all")
    s = model.new_session()
    model.prefill(s, ids[:3], return_logits="none")
    for j in range(3, len(ids)):
        np.testing.assert_allclose(model.decode_step(s, ids[j]), full[j], atol=2e-5 * np.abs(full).max())
    assert model.prefill(model.new_session(), ids, return_logits="none") is None
    np.testing.assert_allclose(model.prefill(model.new_session(), ids), full[-1], atol=1e-5)  # 1-row vs L-row GEMM


def test_fork_is_independent(model):
    s = model.new_session()
    model.prefill(s, [1, 2, 3])
    f = s.fork()
    before = model.decode_step(s.fork(), 9)
    model.prefill(f, [4, 5, 6, 7])             # advancing the fork ...
    assert s.position == 3 and f.position == 7
    np.testing.assert_array_equal(model.decode_step(s.fork(), 9), before)   # ... leaves the parent alone
    model.prefill(s, [8])
    assert f.tokens == (1, 2, 3, 4, 5, 6, 7)


def test_snapshot_restore_is_exact(model):
    s = model.new_session()
    model.prefill(s, [10, 20, 30])
    snap = s.snapshot()
    expect = model.decode_step(s.fork(), 11)
    model.prefill(s, [40, 50])
    s.restore(snap)
    assert s.position == 3 and s.tokens == (10, 20, 30)
    np.testing.assert_array_equal(model.decode_step(s, 11), expect)
    s.restore(snap)                             # a snapshot can be restored more than once
    np.testing.assert_array_equal(model.decode_step(s, 11), expect)
    s.reset()
    assert s.position == 0 and s.tokens == ()


@pytest.mark.parametrize("bad, msg", [
    ([], "empty"),
    ([1, -1], "outside the vocabulary"),
    ([1, 10 ** 6], "outside the vocabulary"),
    ([[1, 2]], "1-D"),
    ([1.5, 2.0], "integers"),
    ("hello", "integers"),
])
def test_bad_input_raises_and_leaves_session_unchanged(model, bad, msg):
    s = model.new_session()
    model.prefill(s, [1, 2, 3])
    ref = s.fork()
    with pytest.raises(ValueError, match=msg):
        model.prefill(s, bad)
    state_equal(s, ref)


def test_decode_step_bad_token(model):
    s = model.new_session()
    model.prefill(s, [1])
    ref = s.fork()
    for bad in (model.config.vocab_size, -3, 2.0, True, [1]):
        with pytest.raises(ValueError, match="outside the vocabulary|one integer token id"):
            model.decode_step(s, bad)
    state_equal(s, ref)


def test_context_overflow(model):
    s = model.new_session(max_context=8)
    model.prefill(s, [1, 2, 3, 4, 5])
    ref = s.fork()
    with pytest.raises(ValueError, match="context overflow"):
        model.prefill(s, [1, 2, 3, 4])
    state_equal(s, ref)
    model.prefill(s, [6, 7, 8])
    with pytest.raises(ValueError, match="context overflow"):
        model.decode_step(s, 1)
    with pytest.raises(ValueError, match="max_context"):
        model.new_session(max_context=model.config.max_position_embeddings + 1)


def test_interrupted_compute_leaves_session_unchanged(model, monkeypatch):
    s = model.new_session()
    model.prefill(s, [1, 2, 3])
    ref = s.fork()
    impl = model._backend.impl

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(impl, "forward", boom)
    with pytest.raises(KeyboardInterrupt, match="^$"):
        model.prefill(s, [4, 5])
    monkeypatch.undo()
    state_equal(s, ref)


def test_session_of_another_model_is_refused(model, tmp_path):
    other = qm.Model.load(make_checkpoint(tmp_path / "o", config="tiny", format="mlx-q4", seed=2),
                          backend="reference")
    s = other.new_session()
    with pytest.raises(ValueError, match="another model"):
        model.prefill(s, [1])
    with pytest.raises(ValueError, match="another model"):
        model.new_session().restore(s.snapshot())


def test_nbytes_grows_with_kv_cache(model):
    s = model.new_session()
    n0 = s.nbytes
    assert n0 > 0                                     # conv + recurrent state exist from the start
    model.prefill(s, [1, 2, 3, 4])
    c = model.config
    per_token = 2 * len(c.full_attention_layers) * c.num_key_value_heads * c.head_dim
    assert s.nbytes - n0 in (4 * per_token * 2, 4 * per_token * 4)   # bf16 or float32 K and V rows
    assert "Session(position=4" in repr(s)


def test_snapshot_repr_says_what_it_holds(model, tmp_path):
    """A snapshot shows its position and size (not the id of the model object), and round-trips through the
    session file format."""
    s = model.new_session()
    model.prefill(s, [1, 2, 3])
    snap = s.snapshot()
    assert repr(snap) == f"SessionSnapshot(position=3, state={snap.nbytes / 2**20:.2f} MiB)"
    snap.save(tmp_path / "snap.safetensors")
    back = qm.SessionSnapshot.load(tmp_path / "snap.safetensors", model)
    assert back.tokens == (1, 2, 3) and back.belongs_to(model)
    t = model.new_session()
    t.restore(back)
    state_equal(s, t)


def test_generate_streams_and_is_reproducible(model):
    outs = list(model.generate("hello world", max_tokens=12, temperature=0.0))
    assert 1 <= len(outs) <= 12 and outs[-1].finish_reason in ("stop", "length")
    assert all(o.finish_reason is None for o in outs[:-1])
    st_ = outs[-1].stats
    assert st_["generated_tokens"] == len(outs) and st_["prompt_tokens"] > 0
    # greedy generate == argmax over prefill/decode_step
    s = model.new_session()
    logits = model.prefill(s, model.tokenizer.encode("hello world"))
    V = model.tokenizer.vocab_size
    for o in outs:
        assert o.token == int(np.argmax(logits[:V]))
        if o.finish_reason is None:
            logits = model.decode_step(s, o.token)
    a = [o.token for o in model.generate("abc", max_tokens=10, temperature=0.9, top_k=20, top_p=0.9, seed=7)]
    b = [o.token for o in model.generate("abc", max_tokens=10, temperature=0.9, top_k=20, top_p=0.9, seed=7)]
    assert a == b
    with pytest.raises(ValueError, match="max_tokens"):
        list(model.generate("abc", max_tokens=0))
    with pytest.raises(ValueError, match="temperature"):
        list(model.generate("abc", temperature=-1))


@settings(max_examples=10, deadline=None)
@given(prefix=ids_st, branch=ids_st, probe=st.integers(0, 200))
def test_fork_and_snapshot_properties(model, prefix, branch, probe):
    """For any history: a fork advanced on its own never changes its parent, and restoring a
    snapshot gives back exactly the logits the session had when it was taken."""
    s = model.new_session()
    model.prefill(s, prefix)
    snap = s.snapshot()
    expect = model.decode_step(s.fork(), probe)
    f = s.fork()
    model.prefill(f, branch)
    np.testing.assert_array_equal(model.decode_step(s.fork(), probe), expect)
    model.prefill(s, branch)
    np.testing.assert_array_equal(model.decode_step(s.fork(), probe), model.decode_step(f.fork(), probe))
    s.restore(snap)
    assert s.tokens == tuple(prefix)
    np.testing.assert_array_equal(model.decode_step(s, probe), expect)

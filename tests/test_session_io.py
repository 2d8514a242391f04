"""Session.save / qm.Session.load: an exact round trip in the documented backend-independent layout, and a
header that names the model so that another checkpoint's session is refused."""
import json
import re

import ml_dtypes
import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal.session_io import HEADER_KEY, read_header
from qwenmetal.testing import make_checkpoint


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen3-next"])
def model(request, tmp_path_factory):
    d = make_checkpoint(tmp_path_factory.mktemp("io") / "ck", request.param, "mlx-q4", seed=6)
    return qm.Model.load(d, backend="reference")


def raw(path):
    b = open(path, "rb").read()
    n = int.from_bytes(b[:8], "little")
    return json.loads(b[8:8 + n])


def test_round_trip_is_exact(model, tmp_path):
    s = model.new_session(max_context=1000)
    model.prefill(s, [5, 9, 2, 77, 31, 8, 100])
    model.decode_step(s, 12)
    p = tmp_path / "s.safetensors"
    s.save(p, metadata={"note": "hello", "n": [1, 2]})
    t = qm.Session.load(p, model)
    assert t.position == s.position == 8 and t.tokens == s.tokens and t.max_context == 1000
    assert t.metadata == {"note": "hello", "n": [1, 2]} and t.nbytes == s.nbytes
    np.testing.assert_array_equal(model.decode_step(t, 40), model.decode_step(s, 40))
    # a fresh Model object for the same checkpoint accepts it too
    other = qm.Model.load(model.path, backend="reference")
    u = qm.Session.load(p, other)
    assert u.tokens == s.tokens[:8]
    # an empty session
    e = model.new_session()
    e.save(tmp_path / "e.safetensors")
    assert qm.Session.load(tmp_path / "e.safetensors", model).position == 0


def test_file_layout(model, tmp_path):
    c = model.config
    s = model.new_session()
    model.prefill(s, [1, 2, 3, 4, 5])
    p = tmp_path / "s.safetensors"
    s.save(p)
    h = raw(p)
    header = json.loads(h["__metadata__"][HEADER_KEY])
    assert header["format"] == "qwenmetal-session" and header["version"] == 1 and header["position"] == 5
    assert header["model"]["identity"] == model.identity["identity"]
    assert header["layers"]["attention"] == list(c.full_attention_layers)
    assert read_header(p) == header
    assert h["tokens"]["dtype"] == "I64" and h["tokens"]["shape"] == [5]
    for i in c.full_attention_layers:
        for n in ("key", "value"):
            assert h[f"state.layers.{i}.{n}"]["shape"] == [c.num_key_value_heads, 5, c.head_dim]
    for i in c.linear_attention_layers:
        assert h[f"state.layers.{i}.conv"]["shape"] == [c.linear_conv_kernel_dim - 1, c.conv_dim]
        assert h[f"state.layers.{i}.ssm"] == {**h[f"state.layers.{i}.ssm"], "dtype": "F32",
                                              "shape": [c.linear_num_value_heads, c.linear_value_head_dim,
                                                        c.linear_key_head_dim]}


def test_bf16_kv_is_accepted(model, tmp_path):
    """Another backend may store K/V and conv rows as bf16: the layout allows it."""
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open

    s = model.new_session()
    model.prefill(s, [3, 1, 4, 1, 5, 9])
    p = tmp_path / "s.safetensors"
    s.save(p)
    with safe_open(str(p), "np") as f:
        md = f.metadata()
    t = load_file(str(p))
    t = {k: (v.astype(ml_dtypes.bfloat16) if k.endswith((".key", ".value", ".conv")) else v) for k, v in t.items()}
    q = tmp_path / "bf16.safetensors"
    save_file(t, str(q), metadata=md)
    u = qm.Session.load(q, model)
    a, b = model.decode_step(u, 2), model.decode_step(s, 2)
    assert u.position == 7 and np.abs(a - b).max() < 0.05 * np.abs(b).max()


def test_mismatched_model_is_refused(model, tmp_path):
    s = model.new_session()
    model.prefill(s, [1, 2, 3])
    p = tmp_path / "s.safetensors"
    s.save(p)
    preset = "tiny-qwen3-next" if model.config.model_type == "qwen3_next" else "tiny"
    same_arch = make_checkpoint(tmp_path / "other-seed", preset, "mlx-q4", seed=99)
    m2 = qm.Model.load(same_arch, backend="reference")
    with pytest.raises(ValueError, match="another model.*weight files differ"):
        qm.Session.load(p, m2)
    other_arch = make_checkpoint(tmp_path / "other-arch", "tiny" if preset != "tiny" else "tiny-qwen3-next",
                                 "mlx-q4", seed=6)
    with pytest.raises(ValueError, match="another model.*config.json differs"):
        qm.Session.load(p, qm.Model.load(other_arch, backend="reference"))


def test_malformed_files(model, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a qwenmetal session"):
        qm.Session.load(bad, model)
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open
    save_file({"x": np.zeros(3, np.float32)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="not a qwenmetal session"):
        qm.Session.load(tmp_path / "plain.safetensors", model)
    s = model.new_session()
    model.prefill(s, [1, 2, 3])
    p = tmp_path / "s.safetensors"
    s.save(p)
    with safe_open(str(p), "np") as f:
        md = f.metadata()
    t = load_file(str(p))
    k = next(k for k in t if k.endswith(".ssm"))
    t[k] = t[k][:1]
    save_file(t, str(tmp_path / "cut.safetensors"), metadata=md)
    with pytest.raises(ValueError, match="ssm"):
        qm.Session.load(tmp_path / "cut.safetensors", model)
    h = json.loads(md[HEADER_KEY])
    h["version"] = 99
    save_file(load_file(str(p)), str(tmp_path / "v99.safetensors"), metadata={HEADER_KEY: json.dumps(h)})
    with pytest.raises(ValueError, match="version 99"):
        qm.Session.load(tmp_path / "v99.safetensors", model)
    with pytest.raises(ValueError, match="JSON"):
        s.save(tmp_path / "x.safetensors", metadata={"f": object()})


@pytest.mark.parametrize("edit, msg", [
    ({"position": None}, "'position' must be an integer >= 0"),
    ({"position": "3"}, "'position' must be an integer >= 0"),
    ({"position": True}, "'position' must be an integer >= 0"),
    ({"max_context": 0}, "'max_context' must be an integer >= 1"),
    ({"model": ["x"]}, "'model' must name the model's identity"),
    ({"model": {"identity": 5}}, "'model' must name"),
    ({"metadata": [1]}, "'metadata' must be an object"),
    ({"format": None}, "not a qwenmetal session file"),
    ({"position": 4}, r"tensor 'tokens' must be int64 \[4\]"),
])
def test_malformed_header_fields(model, tmp_path, edit, msg):
    """Found by tests/test_fuzz.py on the earlier loader: these raised KeyError/TypeError/AttributeError."""
    from qwenmetal.safetensors_io import SafetensorsFile, SafetensorsWriter
    s = model.new_session()
    model.prefill(s, [1, 2, 3])
    p = tmp_path / "s.safetensors"
    s.save(p)
    sf = SafetensorsFile(p)
    h = json.loads(sf.metadata[HEADER_KEY])
    h.update(edit)
    arrays = {k: np.array(sf.get(k)) for k in sf.keys()}
    q = tmp_path / "bad.safetensors"
    with SafetensorsWriter(q, {k: (v.dtype, v.shape) for k, v in arrays.items()},
                           metadata={HEADER_KEY: json.dumps(h)}) as out:
        for k, v in arrays.items():
            out.write(k, v)
    with pytest.raises(ValueError, match=rf"{q}.*{msg}"):
        qm.Session.load(q, model)


def test_old_identity_scheme_is_refused(model, tmp_path):
    s = model.new_session()
    p = tmp_path / "s.safetensors"
    s.save(p)
    from safetensors.numpy import load_file, save_file
    h = read_header(p)
    del h["model"]["scheme"]
    save_file(load_file(str(p)), str(tmp_path / "old.safetensors"), metadata={HEADER_KEY: json.dumps(h)})
    with pytest.raises(ValueError, match="older qwenmetal whose model identity sampled the weight files"):
        qm.Session.load(tmp_path / "old.safetensors", model)


def _saved(model, tmp_path, tokens=(1, 2, 3)):
    s = model.new_session()
    model.prefill(s, list(tokens))
    p = tmp_path / "s.safetensors"
    s.save(p)
    return s, p


def _rewrite(p, q, header=None, edit_tensors=None):
    """A copy of session file ``p`` at ``q`` with another header and/or tensors."""
    from qwenmetal.safetensors_io import SafetensorsFile, SafetensorsWriter
    sf = SafetensorsFile(p)
    h = json.loads(sf.metadata[HEADER_KEY]) if header is None else header
    arrays = {k: np.array(sf.get(k)) for k in sf.keys()}
    if edit_tensors:
        edit_tensors(arrays)
    with SafetensorsWriter(q, {k: (v.dtype, v.shape) for k, v in arrays.items()},
                           metadata={HEADER_KEY: json.dumps(h)}) as out:
        for k, v in arrays.items():
            out.write(k, v)
    return q


def test_identity_is_the_documented_hash(model):
    """The identity hashes config.json and each weight file's [name, size, sha256] (module docstring): a
    session file saved by any qwenmetal with this scheme keeps loading."""
    import hashlib
    import os
    from qwenmetal.session_io import model_identity
    d = model.path
    cfg = open(os.path.join(d, "config.json"), "rb").read()
    weights = sorted([fn, os.path.getsize(os.path.join(d, fn)),
                      hashlib.sha256(open(os.path.join(d, fn), "rb").read()).hexdigest()]
                     for fn in os.listdir(d) if fn.endswith(".safetensors"))
    cfg_sha = hashlib.sha256(cfg).hexdigest()
    assert model_identity(str(d)) == model.identity == {
        "identity": hashlib.sha256(json.dumps({"config": cfg_sha, "weights": weights}).encode()).hexdigest(),
        "scheme": "sha256-full", "model_type": json.loads(cfg)["model_type"], "config_sha256": cfg_sha,
        "weights": weights}


def test_identity_of_a_config_that_is_not_json(tmp_path):
    from qwenmetal.session_io import model_identity
    (tmp_path / "config.json").write_text("not json")
    assert model_identity(str(tmp_path))["model_type"] is None


def test_header_names_layers_and_backend(model, tmp_path):
    c = model.config
    _, p = _saved(model, tmp_path)
    h = read_header(p)
    assert h["layers"] == {"attention": list(c.full_attention_layers),
                           "linear_attention": list(c.linear_attention_layers)}
    assert h["saved_by_backend"] == "reference" and h["metadata"] == {}
    with pytest.raises(ValueError, match="^metadata must be JSON-serialisable"):
        model.new_session().save(tmp_path / "nan.safetensors", metadata={"x": float("nan")})


def test_state_array_errors_say_what_differs(model):
    from qwenmetal.session_io import check_state_arrays, expected_shapes
    exp = sorted(expected_shapes(model.config))
    assert len(exp) >= 6
    pos = np.array([0], np.int64)
    with pytest.raises(ValueError, match=rf"^here: state arrays do not match this model \(missing "
                                         rf"{re.escape(str([k for k in exp if k != 'position'][:4]))}, extra \[\]\)$"):
        check_state_arrays({"position": pos}, model.config, 0, "here")
    extra = {f"z{i}": pos for i in range(6)}
    full = {k: np.zeros([0 if d is None else d for d in shape], dtypes[0]) for k, (shape, dtypes)
            in expected_shapes(model.config).items()}
    full["position"] = pos
    check_state_arrays(full, model.config, 0, "here")
    with pytest.raises(ValueError, match=r"^here: .*\(missing \[\], extra \['z0', 'z1', 'z2', 'z3'\]\)$"):
        check_state_arrays({**full, **extra}, model.config, 0, "here")
    k = next(k for k in exp if k.endswith((".key", ".conv")))
    with pytest.raises(ValueError, match=rf"^here: state array '{re.escape(k)}' is float16\[.*expected "
                                         rf"float32/bfloat16\["):
        check_state_arrays({**full, k: full[k].astype(np.float16)}, model.config, 0, "here")
    with pytest.raises(ValueError, match=r"^here: state position 2 != header position 0$"):
        check_state_arrays({**full, "position": np.array([2], np.int64)}, model.config, 0, "here")


def test_load_checks_name_the_file(model, tmp_path):
    from qwenmetal.session_io import load_session
    s, p = _saved(model, tmp_path, [0, 1, 2])              # token id 0 is a valid id
    V = model.config.vocab_size
    got = load_session(p, model)
    assert got.tokens == [0, 1, 2] and got.max_context == s.max_context and got.metadata == {}
    assert load_session(p, model, max_context=3).max_context == 3          # exactly full
    with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}: 3 tokens do not fit max_context 2$"):
        load_session(p, model, max_context=2)
    for bad in (-1, V):
        q = _rewrite(p, tmp_path / f"t{bad}.safetensors",
                     edit_tensors=lambda a: a.__setitem__("tokens", np.array([1, bad, 2], np.int64)))
        with pytest.raises(ValueError, match=rf"^{re.escape(str(q))}: token ids outside the vocabulary$"):
            load_session(q, model)
    last = _rewrite(p, tmp_path / "last.safetensors",
                    edit_tensors=lambda a: a.__setitem__("tokens", np.array([1, V - 1, 2], np.int64)))
    assert load_session(last, model).tokens == [1, V - 1, 2]
    h = read_header(p)
    del h["metadata"]
    assert load_session(_rewrite(p, tmp_path / "nomd.safetensors", header=h), model).metadata == {}
    cut = _rewrite(p, tmp_path / "cut.safetensors", edit_tensors=lambda a: a.pop(next(k for k in a if k.endswith(".key"))))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(cut))}: state arrays do not match"):
        load_session(cut, model)
    h = read_header(p)
    h["model"] = dict(h["model"], identity="f" * 64, model_type="other_type")
    q = _rewrite(p, tmp_path / "other.safetensors", header=h)
    with pytest.raises(ValueError, match=rf"\(other_type, identity ffffffffffff…; weight files differ\) than "
                                         rf"{re.escape(str(model.path))} \(identity {model.identity['identity'][:12]}…\)$"):
        load_session(q, model)
    h["model"]["config_sha256"] = "0"
    with pytest.raises(ValueError, match=r"identity ffffffffffff…; config.json differs\)"):
        load_session(_rewrite(p, tmp_path / "other2.safetensors", header=h), model)


def test_backends_without_state_arrays_and_wrong_restores(model, tmp_path, monkeypatch):
    from types import SimpleNamespace
    from qwenmetal.session_io import load_session
    s, p = _saved(model, tmp_path)
    real = model._backend
    monkeypatch.setattr(model, "_backend", SimpleNamespace(name="bare"))
    with pytest.raises(NotImplementedError, match="^backend 'bare' does not implement state_from_arrays$"):
        load_session(p, model)
    with pytest.raises(NotImplementedError, match="^backend 'bare' does not implement state_to_arrays$"):
        s.save(tmp_path / "x.safetensors")
    monkeypatch.setattr(model, "_backend", SimpleNamespace(
        name="odd", state_to_arrays=lambda st: {"position": np.array([3], np.int64)},
        state_from_arrays=lambda arrays: SimpleNamespace(position=99)))
    with pytest.raises(ValueError, match=r"^backend 'odd': state arrays do not match"):
        s.save(tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}: backend restored position 99, expected 3$"):
        load_session(p, model)
    monkeypatch.setattr(model, "_backend", real)


def test_unparsable_header_names_the_file(model, tmp_path):
    from qwenmetal.safetensors_io import SafetensorsWriter
    q = tmp_path / "j.safetensors"
    with SafetensorsWriter(q, {"tokens": (np.dtype(np.int64), (0,))}, metadata={HEADER_KEY: "{not json"}) as out:
        out.write("tokens", np.zeros(0, np.int64))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(q))}: session header"):
        qm.Session.load(q, model)

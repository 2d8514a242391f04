"""Session.save / qm.Session.load: an exact round trip in the documented backend-independent layout, and a
header that names the model so that another checkpoint's session is refused."""
import json

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

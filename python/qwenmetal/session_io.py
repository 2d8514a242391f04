"""``Session.save`` / ``Session.load``: a session's state on disk.

The file is a safetensors file (``safetensors.numpy.save_file``) whose ``__metadata__`` holds one JSON
header under the key ``"qwenmetal.session"``::

    {"format": "qwenmetal-session", "version": 1,
     "model": {"identity": sha256, "model_type": ..., "config_sha256": ..., "weights": [[file, bytes], ...]},
     "position": P, "max_context": N, "layers": {"attention": [...], "linear_attention": [...]},
     "metadata": {...user data...}}

and these tensors, in a backend-independent layout (what the backend contract's ``state_to_arrays``
returns):

* ``tokens`` int64 [P]
* ``state.position`` int64 [1]
* ``state.layers.{i}.key`` / ``state.layers.{i}.value``: float32 or bfloat16 [num_key_value_heads, P, head_dim]
  for each full-attention layer (keys after RoPE)
* ``state.layers.{i}.conv``: float32 or bfloat16 [linear_conv_kernel_dim - 1, conv_dim] for each GDN layer
  (the last K-1 pre-conv rows, oldest first)
* ``state.layers.{i}.ssm``: float32 [linear_num_value_heads, linear_value_head_dim, linear_key_head_dim]

The model identity is the SHA-256 of config.json's bytes and of the names, sizes and a digest of the first
and last 64 KiB of each of the checkpoint's ``*.safetensors`` files -- independent of the backend, so a
session saved on one backend loads on another for the same checkpoint, and a session of another
checkpoint (another config, or other weights) is refused.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

import numpy as np

FORMAT, VERSION, HEADER_KEY = "qwenmetal-session", 1, "qwenmetal.session"


SAMPLE_BYTES = 1 << 16


def _file_sample_digest(fn: str) -> str:
    """SHA-256 of a file's first and last 64 KiB: cheap (two reads), and it tells apart checkpoints of the
    same architecture whose weights differ."""
    h = hashlib.sha256()
    size = os.path.getsize(fn)
    with open(fn, "rb") as f:
        h.update(f.read(SAMPLE_BYTES))
        if size > SAMPLE_BYTES:
            f.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def model_identity(path: str) -> dict:
    """What names a checkpoint: config.json's hash and its weight files' names, sizes and a digest of their
    first and last 64 KiB."""
    with open(os.path.join(path, "config.json"), "rb") as f:
        cfg = f.read()
    weights = sorted([fn, os.path.getsize(os.path.join(path, fn)), _file_sample_digest(os.path.join(path, fn))]
                     for fn in os.listdir(path) if fn.endswith(".safetensors"))
    config_sha = hashlib.sha256(cfg).hexdigest()
    ident = hashlib.sha256(json.dumps({"config": config_sha, "weights": weights}).encode()).hexdigest()
    try:
        mt = json.loads(cfg).get("model_type")
    except (json.JSONDecodeError, AttributeError):
        mt = None
    return {"identity": ident, "model_type": mt, "config_sha256": config_sha, "weights": weights}


def expected_shapes(config) -> dict:
    """name -> (shape with None for the position axis, allowed dtypes) of the state arrays."""
    c = config
    f32, bf16 = "float32", "bfloat16"
    out = {"position": ((1,), ("int64",))}
    for i in c.full_attention_layers:
        for n in ("key", "value"):
            out[f"layers.{i}.{n}"] = ((c.num_key_value_heads, None, c.head_dim), (f32, bf16))
    for i in c.linear_attention_layers:
        out[f"layers.{i}.conv"] = ((c.linear_conv_kernel_dim - 1, c.conv_dim), (f32, bf16))
        out[f"layers.{i}.ssm"] = ((c.linear_num_value_heads, c.linear_value_head_dim, c.linear_key_head_dim), (f32,))
    return out


def gdn_state_arrays(config, conv, ssm) -> dict:
    """The GDN layers' `layers.{i}.conv` / `.ssm` arrays of the layout from flat float32 vectors (one per GDN
    layer, in layer order), as the C++ backends export them."""
    c = config
    shape = (c.linear_num_value_heads, c.linear_value_head_dim, c.linear_key_head_dim)
    out = {}
    for j, i in enumerate(c.linear_attention_layers):
        out[f"layers.{i}.conv"] = conv[j].reshape(c.linear_conv_kernel_dim - 1, c.conv_dim)
        out[f"layers.{i}.ssm"] = ssm[j].reshape(shape)
    return out


def gdn_state_vectors(config, arrays: dict) -> tuple[list, list]:
    """The inverse of gdn_state_arrays: contiguous flat float32 (conv, ssm) vectors per GDN layer."""
    layers = config.linear_attention_layers
    conv = [np.ascontiguousarray(np.asarray(arrays[f"layers.{i}.conv"], np.float32).reshape(-1)) for i in layers]
    ssm = [np.ascontiguousarray(np.asarray(arrays[f"layers.{i}.ssm"], np.float32).reshape(-1)) for i in layers]
    return conv, ssm


def _dtype_name(a: np.ndarray) -> str:
    return "bfloat16" if a.dtype.name == "bfloat16" else a.dtype.name


def check_state_arrays(arrays: dict, config, position: int, where: str) -> None:
    exp = expected_shapes(config)
    if set(arrays) != set(exp):
        missing, extra = sorted(set(exp) - set(arrays)), sorted(set(arrays) - set(exp))
        raise ValueError(f"{where}: state arrays do not match this model (missing {missing[:4]}, extra {extra[:4]})")
    for k, (shape, dtypes) in exp.items():
        a = arrays[k]
        want = tuple(position if d is None else d for d in shape)
        if tuple(a.shape) != want or _dtype_name(a) not in dtypes:
            raise ValueError(f"{where}: state array {k!r} is {_dtype_name(a)}{list(a.shape)}, "
                             f"expected {'/'.join(dtypes)}{list(want)}")
    if int(arrays["position"][0]) != position:
        raise ValueError(f"{where}: state position {int(arrays['position'][0])} != header position {position}")


def save_session(session, path, metadata: dict | None = None) -> None:
    from safetensors.numpy import save_file

    model = session._model
    backend = model._backend
    if not hasattr(backend, "state_to_arrays"):
        raise NotImplementedError(f"backend {backend.name!r} does not implement state_to_arrays")
    arrays = backend.state_to_arrays(session._state)
    check_state_arrays(arrays, model.config, session.position, f"backend {backend.name!r}")
    c = model.config
    header = {"format": FORMAT, "version": VERSION, "model": model.identity,
              "position": session.position, "max_context": session.max_context,
              "layers": {"attention": list(c.full_attention_layers), "linear_attention": list(c.linear_attention_layers)},
              "saved_by_backend": backend.name, "metadata": metadata or {}}
    try:
        json.dumps(header)
    except TypeError as e:
        raise ValueError(f"metadata must be JSON-serialisable: {e}") from None
    tensors = {"tokens": np.asarray(session.tokens, dtype=np.int64).reshape(-1)}
    tensors.update({f"state.{k}": np.ascontiguousarray(v) for k, v in arrays.items()})
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".session.", suffix=".partial", dir=d)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={HEADER_KEY: json.dumps(header)})
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_header(path) -> dict:
    """The JSON header of a saved session (without loading the state)."""
    from safetensors import safe_open

    path = os.fspath(path)
    try:
        with safe_open(path, framework="np") as f:
            md = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"{path}: not a qwenmetal session file ({e})") from None
    try:
        header = json.loads(md[HEADER_KEY])
    except (KeyError, json.JSONDecodeError):
        raise ValueError(f"{path}: not a qwenmetal session file (no {HEADER_KEY!r} header)") from None
    if header.get("format") != FORMAT:
        raise ValueError(f"{path}: not a qwenmetal session file")
    if header.get("version") != VERSION:
        raise ValueError(f"{path}: session format version {header.get('version')} is not supported (this is {VERSION})")
    return header


def load_session(path, model, max_context: int | None = None):
    from safetensors.numpy import load_file

    from .model import Session

    path = os.fspath(path)
    header = read_header(path)
    mine, theirs = model.identity, header.get("model") or {}
    if theirs.get("identity") != mine["identity"]:
        why = "config.json differs" if theirs.get("config_sha256") != mine["config_sha256"] else "weight files differ"
        raise ValueError(f"{path}: this session was saved from another model ({theirs.get('model_type')}, "
                         f"identity {str(theirs.get('identity'))[:12]}…; {why}) than {model.path} "
                         f"(identity {mine['identity'][:12]}…)")
    backend = model._backend
    if not hasattr(backend, "state_from_arrays"):
        raise NotImplementedError(f"backend {backend.name!r} does not implement state_from_arrays")
    t = load_file(path)
    position = int(header["position"])
    tokens = t.pop("tokens", None)
    if tokens is None or tokens.shape != (position,):
        raise ValueError(f"{path}: tokens do not match the header position {position}")
    arrays = {k[len("state."):]: v for k, v in t.items() if k.startswith("state.")}
    check_state_arrays(arrays, model.config, position, path)
    V = model.config.vocab_size
    if position and (tokens.min() < 0 or tokens.max() >= V):
        raise ValueError(f"{path}: token ids outside the vocabulary")
    mc = max_context if max_context is not None else header.get("max_context")
    mc = min(int(mc or model.config.max_position_embeddings), model.config.max_position_embeddings)
    if position > mc:
        raise ValueError(f"{path}: {position} tokens do not fit max_context {mc}")
    state = backend.state_from_arrays(arrays)
    if state.position != position:
        raise ValueError(f"{path}: backend restored position {state.position}, expected {position}")
    s = Session(model, state, [int(x) for x in tokens], max_context=mc)
    s.metadata = header.get("metadata") or {}
    return s

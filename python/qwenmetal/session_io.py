"""``Session.save`` / ``Session.load``: a session's state on disk.

The file is a safetensors file (``safetensors.numpy.save_file``) whose ``__metadata__`` holds one JSON
header under the key ``"qwenmetal.session"``::

    {"format": "qwenmetal-session", "version": 1,
     "model": {"identity": sha256, "scheme": "sha256-full", "model_type": ..., "config_sha256": ...,
               "weights": [[file, bytes, sha256], ...]},
     "position": P, "max_context": N, "layers": {"attention": [...], "linear_attention": [...]},
     "metadata": {...user data...}}

Version 2 (written only for a session that holds an image or a nonzero RoPE delta; a text-only session is
still written as version 1, which older readers load) adds ``"rope_delta": D`` (the M-RoPE delta of the next
token, `qwenmetal.mrope`) and ``"images": [[start, end, sha256-hex], ...]`` (the session's image spans, the
prefix cache's keys). A version-1 file loads with delta 0 and no images.

and these tensors, in a backend-independent layout (what the backend contract's ``state_to_arrays``
returns):

* ``tokens`` int64 [P]
* ``state.position`` int64 [1]
* ``state.layers.{i}.key`` / ``state.layers.{i}.value``: float32 or bfloat16 [num_key_value_heads, P, head_dim]
  for each full-attention layer (keys after RoPE)
* ``state.layers.{i}.conv``: float32 or bfloat16 [linear_conv_kernel_dim - 1, conv_dim] for each GDN layer
  (the last K-1 pre-conv rows, oldest first)
* ``state.layers.{i}.ssm``: float32 [linear_num_value_heads, linear_value_head_dim, linear_key_head_dim]

The model identity is the SHA-256 of config.json's bytes and of the name, size and full SHA-256 of each of
the checkpoint's ``*.safetensors`` files -- independent of the backend, so a session saved on one backend
loads on another for the same checkpoint, and a session of another checkpoint (another config, or weights
that differ in any byte) is refused. Hashing a file streams it once (``hashlib.file_digest``); the digest
is cached under ``qwenmetal.paths.cache_dir("hashes")``, keyed by the file's real path, device, inode,
size, mtime and ctime (ctime changes on every write and cannot be set back by ``os.utime``), so later
saves and loads cost a ``stat`` per file. A digest is not cached while the file's ctime is within
`RACY_SECONDS` of the hash (timestamps are coarse: a write in the same tick would keep the key), nor if
the file changed while it was hashed. A corrupt or mismatching cache entry is ignored and rewritten.

`save_session` writes atomically (`qwenmetal.fileio.atomic_file`): the file appears complete or not at
all, an existing file is replaced only on success, and errors name the user's path. `load_session` reads
the file with the strict parser of `qwenmetal.safetensors_io` and checks every header field and array
against the model before the backend sees them; any malformed file gives ValueError.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import NamedTuple

import numpy as np

from .errors import CheckpointError
from .fileio import atomic_file, parse_json
from .mrope import check_spans
from .paths import cache_dir
from .safetensors_io import SafetensorsFile, SafetensorsWriter, file_stamp

FORMAT, VERSION, HEADER_KEY = "qwenmetal-session", 2, "qwenmetal.session"
VERSIONS = (1, 2)                     # read; a text-only session is written as version 1
IDENTITY_SCHEME = "sha256-full"       # how model.identity is computed; files of older schemes are refused
RACY_SECONDS = 2.0


def _hash_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_sha256(path: str) -> str:
    """The SHA-256 of a file's bytes, from the hash cache when the file is unchanged since it was hashed
    (same real path, device, inode, size, mtime and ctime)."""
    real = os.path.realpath(path)
    before = file_stamp(os.stat(real))
    key = json.dumps([real, *before])
    entry = cache_dir("hashes") / (hashlib.sha256(key.encode()).hexdigest() + ".json")
    try:
        cached = parse_json(entry.read_bytes(), str(entry))
        if isinstance(cached, dict) and cached.get("key") == key and isinstance(cached.get("sha256"), str):
            return cached["sha256"]
    except (OSError, ValueError):
        pass                      # absent, unreadable or corrupt: hash again and rewrite it
    digest = _hash_file(real)
    settled = time.time_ns() - before.ctime_ns > RACY_SECONDS * 1e9
    if settled and file_stamp(os.stat(real)) == before:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(entry) as tmp:
                tmp.write_text(json.dumps({"key": key, "sha256": digest}), encoding="utf-8")
        except OSError:
            pass                  # a read-only cache only costs the next hash
    return digest


def model_identity(path: str) -> dict:
    """What names a checkpoint: config.json's hash and its weight files' names, sizes and full SHA-256."""
    with open(os.path.join(path, "config.json"), "rb") as f:
        cfg = f.read()
    weights = sorted([fn, os.path.getsize(os.path.join(path, fn)), file_sha256(os.path.join(path, fn))]
                     for fn in os.listdir(path) if fn.endswith(".safetensors"))
    config_sha = hashlib.sha256(cfg).hexdigest()
    ident = hashlib.sha256(json.dumps({"config": config_sha, "weights": weights}).encode()).hexdigest()
    try:
        mt = json.loads(cfg).get("model_type")
    except (ValueError, AttributeError):
        mt = None
    return {"identity": ident, "scheme": IDENTITY_SCHEME, "model_type": mt, "config_sha256": config_sha,
            "weights": weights}


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


def check_state_arrays(arrays: dict, config, position: int, where: str) -> None:
    exp = expected_shapes(config)
    if set(arrays) != set(exp):
        missing, extra = sorted(set(exp) - set(arrays)), sorted(set(arrays) - set(exp))
        raise ValueError(f"{where}: state arrays do not match this model (missing {missing[:4]}, extra {extra[:4]})")
    for k, (shape, dtypes) in exp.items():
        a = arrays[k]
        want = tuple(position if d is None else d for d in shape)
        if tuple(a.shape) != want or a.dtype.name not in dtypes:
            raise ValueError(f"{where}: state array {k!r} is {a.dtype.name}{list(a.shape)}, "
                             f"expected {'/'.join(dtypes)}{list(want)}")
    if int(arrays["position"][0]) != position:
        raise ValueError(f"{where}: state position {int(arrays['position'][0])} != header position {position}")


class LoadedSession(NamedTuple):
    """What `load_session` read: `Session.load` builds the session from it."""

    state: object
    tokens: list
    max_context: int
    metadata: dict
    images: tuple = ()                # ImageSpans (version 2)


def save_session(session, path, metadata: dict | None = None) -> None:
    """Write `session` to `path` atomically (format in the module docstring)."""
    model = session.model
    arrays = session.state_arrays()
    check_state_arrays(arrays, model.config, session.position, f"backend {model.backend!r}")
    c = model.config
    header = {"format": FORMAT, "version": 1, "model": model.identity,
              "position": session.position, "max_context": session.max_context,
              "layers": {"attention": list(c.full_attention_layers), "linear_attention": list(c.linear_attention_layers)},
              "saved_by_backend": model.backend, "metadata": metadata or {}}
    delta, images = session.rope_delta, session.images
    if delta or images:
        header.update(version=2, rope_delta=int(delta), images=[[int(a), int(b), str(d)] for a, b, d in images])
    try:
        text = json.dumps(header, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"metadata must be JSON-serialisable: {e}") from None
    tensors = {"tokens": np.asarray(session.tokens, dtype=np.int64)}
    tensors.update({f"state.{k}": np.ascontiguousarray(v) for k, v in arrays.items()})
    with atomic_file(path) as tmp:
        with SafetensorsWriter(tmp, {k: (v.dtype, v.shape) for k, v in tensors.items()},
                               metadata={HEADER_KEY: text}) as out:
            for k, v in tensors.items():
                out.write(k, v)


def _open(path: str) -> tuple[SafetensorsFile, dict]:
    try:
        sf = SafetensorsFile(path)
    except CheckpointError as e:
        raise ValueError(f"not a qwenmetal session file: {e}") from None
    if HEADER_KEY not in sf.metadata:
        raise ValueError(f"{path}: not a qwenmetal session file (no {HEADER_KEY!r} header)")
    header = parse_json(sf.metadata[HEADER_KEY], f"{path}: session header")
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"{path}: not a qwenmetal session file")
    if header.get("version") not in VERSIONS:
        raise ValueError(f"{path}: session format version {header.get('version')!r} is not supported "
                         f"(this reads {', '.join(map(str, VERSIONS))})")
    model = header.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("identity"), str):
        raise ValueError(f"{path}: session header field 'model' must name the model's identity")
    for key, lo in (("position", 0), ("max_context", 1)):
        v = header.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{path}: session header field {key!r} must be an integer >= {lo}, got {v!r}")
    if not isinstance(header.get("metadata", {}), dict):
        raise ValueError(f"{path}: session header field 'metadata' must be an object")
    rope_fields(header, path)
    return sf, header


def rope_fields(header: dict, path: str) -> tuple[int, tuple]:
    """A header's (rope_delta, image spans), checked; (0, ()) for a version-1 file."""
    d = header.get("rope_delta", 0)
    if isinstance(d, bool) or not isinstance(d, int) or abs(d) >= 2**24:
        raise ValueError(f"{path}: session header field 'rope_delta' must be an integer, got {d!r}")
    try:
        images = check_spans(header.get("images", []), header["position"])
    except ValueError as e:
        raise ValueError(f"{path}: session header field 'images': {e}") from None
    return d, images


def read_header(path) -> dict:
    """The JSON header of a saved session (without loading the state)."""
    return _open(os.fspath(path))[1]


def _tokens(sf: SafetensorsFile, header: dict, path: str) -> np.ndarray:
    position = header["position"]
    if "tokens" not in sf or sf.shape("tokens") != (position,) or sf.dtype_name("tokens") != "I64":
        raise ValueError(f"{path}: tensor 'tokens' must be int64 [{position}] (the header position)")
    return np.array(sf.get("tokens"))


def read_tokens(path) -> tuple[list, dict]:
    """The tokens and the JSON header of a saved session, without its state (the prefix cache's disk tier
    indexes its files with it)."""
    path = os.fspath(path)
    sf, header = _open(path)
    return [int(x) for x in _tokens(sf, header, path)], header


def load_session(path, model, max_context: int | None = None) -> LoadedSession:
    """Read and check a session file for `model`; the backend restores the state only from checked arrays."""
    path = os.fspath(path)
    sf, header = _open(path)
    mine, theirs = model.identity, header["model"]
    if theirs.get("scheme") != mine["scheme"]:
        raise ValueError(f"{path}: this session was saved by an older qwenmetal whose model identity "
                         f"sampled the weight files instead of hashing them; it cannot be verified "
                         f"against {model.path}")
    if theirs["identity"] != mine["identity"]:
        why = "config.json differs" if theirs.get("config_sha256") != mine["config_sha256"] else "weight files differ"
        raise ValueError(f"{path}: this session was saved from another model ({theirs.get('model_type')}, "
                         f"identity {theirs['identity'][:12]}…; {why}) than {model.path} "
                         f"(identity {mine['identity'][:12]}…)")
    position = header["position"]
    tokens = _tokens(sf, header, path)
    arrays = {k[len("state."):]: np.array(sf.get(k)) for k in sf.keys() if k.startswith("state.")}
    check_state_arrays(arrays, model.config, position, path)
    V = model.config.vocab_size
    if position and (tokens.min() < 0 or tokens.max() >= V):
        raise ValueError(f"{path}: token ids outside the vocabulary")
    mc = max_context if max_context is not None else header["max_context"]
    mc = min(int(mc), model.config.max_position_embeddings)
    if position > mc:
        raise ValueError(f"{path}: {position} tokens do not fit max_context {mc}")
    state = model.state_from_arrays(arrays)
    if state.position != position:
        raise ValueError(f"{path}: backend restored position {state.position}, expected {position}")
    delta, images = rope_fields(header, path)
    if delta:
        if not hasattr(state, "rope_delta"):
            raise ValueError(f"{path}: the {model.backend} backend keeps no M-RoPE delta")
        state.rope_delta = delta
    return LoadedSession(state, [int(x) for x in tokens], mc, header.get("metadata", {}), images)

"""Sessions and the primitive model: the calls every backend implements, and nothing above them.

    s = model.new_session()
    logits = model.prefill(s, ids, return_logits="last")     # float32 [vocab]
    logits = model.decode_step(s, token_id)
    rows = verify(model, s, [t, *drafts])                     # logits of every row; rewind() drops a tail
    rewind(model, s, keep)

A `Session` holds one sequence's state (KV cache of the attention layers, conv and recurrent state of the
Gated DeltaNet layers, the position and the tokens). Calls are all-or-nothing: an invalid token, empty input
or context overflow raises ValueError before anything changes, and an exception during compute (including
KeyboardInterrupt, which the C++ engines check for between chunks and tokens) leaves the session as it was:
state and tokens always advance together (docs/api.md, "Interrupts").

`ModelBase` is a loaded checkpoint on one backend with these primitive calls; `qwenmetal.Model` builds
generation, chat and the caches on it. The runtime modules (generation, speculative decoding, the prefix
cache) use only what this module makes public, so they sit below `Model` and never import it.
"""
from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass
from html import escape
from typing import Sequence

import numpy as np

from .config import ModelConfig
from .errors import CheckpointError
from .interrupts import sigint_deferred
from .mrope import ImageSpan, RowInputs, check_spans, pair_positions
from .options import GenerationOptions
from .session_io import load_session, model_identity, save_session

RETURN_LOGITS = ("last", "all", "none")
#: the most decoder layers one call returns the outputs of (`prefill_features`, ``verify(features=)``): a DFlash
#: draft reads 5 on the published 40-layer drafts
MAX_FEATURE_LAYERS = 8


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, repr=False)
class SessionSnapshot:
    """An immutable copy of a session's state, for `Session.restore` (the prefix cache holds these)."""

    model_ref: weakref.ref
    state: object
    tokens: tuple
    images: tuple = ()            # the session's ImageSpans (`Session.images`)

    @property
    def position(self) -> int:
        """The session position the snapshot was taken at."""
        return self.state.position

    @property
    def nbytes(self) -> int:
        """Bytes held by the snapshot's state."""
        return self.state.nbytes

    def belongs_to(self, model: "ModelBase") -> bool:
        """Whether the snapshot was taken from a session of `model`."""
        return self.model_ref() is model

    def save(self, path: str | os.PathLike, metadata: dict | None = None) -> None:
        """Write the snapshot as a session file (`Session.save`'s format; `Session.load` reads it)."""
        model = self.model_ref()
        if model is None:
            raise ValueError("the model this snapshot was taken from is gone")
        s = Session(model, self.state, self.tokens)
        s._images = list(self.images)
        save_session(s, path, metadata)

    @classmethod
    def load(cls, path: str | os.PathLike, model: "ModelBase") -> "SessionSnapshot":
        """The state of a session file (`Session.save`) as a snapshot of `model`; ValueError as `Session.load`."""
        loaded = load_session(path, model)
        return cls(weakref.ref(model), loaded.state, tuple(loaded.tokens), tuple(loaded.images))

    def __repr__(self) -> str:
        return f"SessionSnapshot(position={self.position}, state={self.nbytes / 2**20:.2f} MiB)"


class Session:
    """One sequence's decode state. Create with `Model.new_session()`."""

    def __init__(self, model: "ModelBase", state, tokens=(), max_context: int | None = None):
        self._model = model
        self._state = state
        self._tokens = list(tokens)
        self._images: list = []           # ImageSpans: which token spans hold which image's features
        self._chain: list = []            # the row-by-row verification's state copies (see `verify`)
        self._chain_at = -1               # len(tokens) when the chain was last extended
        self.max_context = max_context or model.config.max_position_embeddings
        self.metadata: dict = {}          # user data kept by save()/load()

    @property
    def model(self) -> "ModelBase":
        """The model this session belongs to."""
        return self._model

    @property
    def position(self) -> int:
        """Tokens processed so far (the absolute position of the next token)."""
        return self._state.position

    @property
    def tokens(self) -> tuple:
        """Every token the session has processed, in order."""
        return tuple(self._tokens)

    @property
    def rope_delta(self) -> int:
        """The next token's RoPE position minus its index: 0 for text, changed by an image (M-RoPE,
        `qwenmetal.mrope`)."""
        return int(getattr(self._state, "rope_delta", 0))

    @property
    def images(self) -> tuple:
        """The image spans of the session (`qwenmetal.mrope.ImageSpan`: start, end, content digest), in order:
        what the prefix cache keys the image tokens on."""
        return tuple(self._images)

    @property
    def nbytes(self) -> int:
        """Bytes held by the state (KV cache as stored, conv and recurrent states)."""
        return self._state.nbytes

    def fork(self) -> "Session":
        """An independent copy that continues from the same point."""
        s = Session(self._model, self._state.copy(), self._tokens, self.max_context)
        s._images = list(self._images)
        return s

    def snapshot(self) -> SessionSnapshot:
        """An immutable copy of the state, for `restore` (cheap to keep: the prefix cache holds these)."""
        return SessionSnapshot(weakref.ref(self._model), self._state.copy(), tuple(self._tokens),
                               tuple(self._images))

    def restore(self, snap: SessionSnapshot) -> None:
        """Go back to `snap` (taken from a session of the same model)."""
        if not isinstance(snap, SessionSnapshot):
            raise TypeError(f"restore() takes a SessionSnapshot, got {type(snap).__name__}")
        if not snap.belongs_to(self._model):
            raise ValueError("this snapshot was taken from a session of another model")
        state, tokens, images = snap.state.copy(), list(snap.tokens), list(snap.images)
        with sigint_deferred():
            self._state = state
            self._tokens = tokens
            self._images = images

    def reset(self) -> None:
        """Back to position 0 (an empty state)."""
        state = self._model._backend.new_state()
        with sigint_deferred():
            self._state = state
            self._tokens = []
            self._images = []

    def state_arrays(self) -> dict:
        """The state in the backend-independent layout of `Session.save` (docs/architecture.md)."""
        backend = self._model._backend
        if not hasattr(backend, "state_to_arrays"):
            raise NotImplementedError(f"backend {backend.name!r} does not implement state_to_arrays")
        return backend.state_to_arrays(self._state)

    def save(self, path: str | os.PathLike, metadata: dict | None = None) -> None:
        """Write the state, tokens and position to `path` (a safetensors file with a JSON header naming
        the model; format in `qwenmetal.session_io`). `metadata`: JSON-serialisable user data."""
        save_session(self, path, metadata if metadata is not None else self.metadata)

    @classmethod
    def load(cls, path: str | os.PathLike, model: "ModelBase", max_context: int | None = None) -> "Session":
        """A session from `Session.save`'s file. Raises ValueError if it was saved from another model
        (config.json or weight files differ) or the file is malformed. A session holding a conversation
        (`Model.chat_session`, the chat command's /save) also goes into the model's prefix cache with its
        transcript, so `model.chat` on its ``metadata["messages"]`` plus a new message prefills only that."""
        loaded = load_session(path, model, max_context)
        s = cls(model, loaded.state, loaded.tokens, max_context=loaded.max_context)
        s._images = list(loaded.images)
        s.metadata = loaded.metadata
        model.session_loaded(s)
        return s

    def __repr__(self) -> str:
        return (f"Session(position={self.position}, max_context={self.max_context}, "
                f"state={self.nbytes / 2**20:.2f} MiB)")

    def _repr_html_(self) -> str:
        tail = ""
        tok = self._model.tokenizer
        if tok is not None and self._tokens:
            text = tok.decode(self._tokens[-64:])
            tail = f"<tr><td>last tokens</td><td><code>{escape(text[-300:])}</code></td></tr>"
        return (f"<b>qwenmetal.Session</b><table><tr><td>position</td><td>{self.position} / {self.max_context}</td></tr>"
                f"<tr><td>state</td><td>{self.nbytes / 2**20:.2f} MiB</td></tr>{tail}</table>")


# ---------------------------------------------------------------------------------------------
class ModelBase:
    """A loaded checkpoint on one backend, with the primitive calls. `qwenmetal.Model` is the one to use."""

    def __init__(self, config: ModelConfig, weights, tokenizer, backend, path: str):
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self._backend = backend
        self.path = path
        gc_path = os.path.join(path, "generation_config.json")
        self.generation_config = _read_json(gc_path)
        try:                                    # its sampling values are what unset options become
            GenerationOptions().with_defaults(self.generation_config)
        except ValueError as e:
            raise CheckpointError(f"{gc_path}: {e}") from None
        self._identity = None
        self._vision = None                     # vision_encoder()'s, built on first use
        self.prefix_cache = None                # Model sets these (qwenmetal.prefix_cache, .transcripts)
        self.transcripts = None

    @property
    def backend(self) -> str:
        """The backend's name ("reference", "cpu", "metal", "metal-sim"; see `qwenmetal.backends`)."""
        return self._backend.name

    def backend_info(self) -> dict:
        """What the backend reports of itself (threads and kernels on cpu; the device, its memory plan and
        the expert cache on metal / metal-sim); {} for the reference."""
        info = getattr(self._backend, "info", None)
        return dict(info()) if info else {}

    @property
    def snapshot_chunk(self) -> int | None:
        """The prefill chunk a backend with fixed GPU chunks (metal, metal-sim) snapshots at, else None."""
        return getattr(self._backend, "snapshot_chunk", None)

    @property
    def eos_token_ids(self) -> tuple:
        """Stop ids: generation_config.json's, config.json's (top level and text_config) and the
        tokenizer's eos, all of them (docs/model.md §7)."""
        ids = list(self.config.eos_token_ids)
        g = self.generation_config.get("eos_token_id")
        for x in (g if isinstance(g, list) else [g]):
            if isinstance(x, int) and x not in ids:
                ids.append(x)
        if self.tokenizer is not None:
            for t in (self.tokenizer.eos_token_id, self.tokenizer.token_to_id("<|im_end|>")):
                if t is not None and t not in ids:
                    ids.append(t)
        return tuple(ids)

    @property
    def sampleable_vocab(self) -> int:
        """The ids a sampler may return: the tokenizer's vocabulary, not the padded rows of lm_head."""
        tok = self.tokenizer
        v = tok.vocab_size if tok is not None else self.config.vocab_size
        return min(v, self.config.vocab_size)

    @property
    def identity(self) -> dict:
        """What names this checkpoint (hash of config.json + the weight files' names, sizes and full
        SHA-256, cached by `qwenmetal.session_io`); sessions saved with `Session.save` carry it and refuse
        to load into another model. Raises CheckpointError if a weight file changed since loading."""
        self.weights.check_unchanged()
        if self._identity is None:
            self._identity = model_identity(self.path)
        return self._identity

    def new_session(self, max_context: int | None = None) -> Session:
        """An empty session; `max_context` (1..max_position_embeddings, default: all of it) caps its length."""
        if max_context is not None and not (0 < max_context <= self.config.max_position_embeddings):
            raise ValueError(f"max_context must be in 1..{self.config.max_position_embeddings}")
        return Session(self, self._backend.new_state(), max_context=max_context)

    def session_loaded(self, session: Session) -> None:
        """Called by `Session.load` with the session it read (`Model` puts a saved conversation in its caches)."""

    def state_from_arrays(self, arrays: dict):
        """A backend state from `Session.state_arrays`'s layout (what `qwenmetal.session_io` reads back)."""
        if not hasattr(self._backend, "state_from_arrays"):
            raise NotImplementedError(f"backend {self.backend!r} does not implement state_from_arrays")
        return self._backend.state_from_arrays(arrays)

    # ---- the two primitive calls ---------------------------------------------------------
    def prefill(self, session: Session, token_ids: Sequence[int] | np.ndarray,
                return_logits: str = "last", *, positions=None, embeds=None, embed_rows=None,
                images=()) -> np.ndarray | None:
        """Append `token_ids` to the session. Returns float32 logits of the last token ([vocab]),
        of every token ([L, vocab]) or None, per `return_logits` ("last" | "all" | "none").

        Images (docs/vision.md, "Positions and caches"): `positions` int [3, L] the tokens' absolute M-RoPE
        positions (t, h, w; `qwenmetal.mrope.rope_index`), after which the session's `rope_delta` is
        ``max(positions) + 1 - (position + L)``; without them token i is at ``position + i + rope_delta``.
        `embeds` float [m, hidden] replace the embedding lookup of the rows `embed_rows` (m distinct indices
        into `token_ids`; default: every row when m == L): the image features at the image pads. `images`:
        (start, end, digest) spans of this call's rows holding an image (`qwenmetal.mrope.ImageSpan`), kept
        by the session for the prefix cache's keys."""
        self.check_session(session)
        if return_logits not in RETURN_LOGITS:
            raise ValueError(f"return_logits must be one of {RETURN_LOGITS}, got {return_logits!r}")
        ids = self.check_ids(token_ids, session)
        rows = self.check_rows(session, ids, positions, embeds, embed_rows)
        spans = check_spans(images, ids.size)
        spans = [ImageSpan(session.position + a, session.position + b, d) for a, b, d in spans]
        if not spans and rows is None:
            # the backend commits the state and the session's tokens together (an interrupt lands before or after)
            _, out = self._backend.forward(session._state, ids, return_logits, session._tokens)
            return out
        if rows is not None and not getattr(self._backend, "row_inputs", False):
            raise ValueError(f"the {self.backend} backend takes no explicit positions or embedding rows")
        n0 = len(session._tokens)
        try:
            _, out = self._backend.forward(session._state, ids, return_logits, session._tokens,
                                           **({} if rows is None else {"rows": rows}))
        finally:                        # the spans follow the tokens (the backend commits them or not)
            if len(session._tokens) > n0:
                _add_spans(session._images, spans)
        return out

    def check_rows(self, session: Session, ids: np.ndarray, positions, embeds, embed_rows) -> RowInputs | None:
        """`prefill`'s positions / embeds / embed_rows as the backends take them (`qwenmetal.mrope.RowInputs`),
        or None when there are none; ValueError naming the problem otherwise."""
        n, H = ids.size, self.config.hidden_size
        if positions is None and embeds is None:
            if embed_rows is not None:
                raise ValueError("embed_rows without embeds")
            return None
        pair, delta = None, session.rope_delta
        if positions is not None:
            p = np.asarray(positions)
            if p.shape != (3, n):
                raise ValueError(f"positions must be [3, {n}] (t, h, w per token), got {list(p.shape)}")
            pair = pair_positions(p, self.config)
            delta = int(p.max()) + 1 - (session.position + n)
        rows = np.zeros(0, np.int64)
        e = np.zeros((0, H), np.float32)
        if embeds is not None:
            e = np.asarray(embeds)
            if e.ndim != 2 or e.shape[1] != H or not np.issubdtype(e.dtype, np.floating):
                raise ValueError(f"embeds must be float [m, {H}], got {e.dtype}{list(e.shape)}")
            e = np.ascontiguousarray(e, dtype=np.float32)
            if not np.isfinite(e).all():
                raise ValueError("embeds must be finite")
            if embed_rows is None:
                if e.shape[0] != n:
                    raise ValueError(f"embeds has {e.shape[0]} rows for {n} tokens: name them with embed_rows")
                rows = np.arange(n, dtype=np.int64)
            else:
                rows = np.asarray(embed_rows)
                if rows.shape != (e.shape[0],) or (rows.size and not np.issubdtype(rows.dtype, np.integer)):
                    raise ValueError(f"embed_rows must be {e.shape[0]} integer row indices, got {rows!r:.80}")
                rows = rows.astype(np.int64)
                if rows.size and (rows.min() < 0 or rows.max() >= n or (np.diff(rows) <= 0).any()):
                    raise ValueError(f"embed_rows must be increasing indices in 0..{n - 1}")
        elif embed_rows is not None:
            raise ValueError("embed_rows without embeds")
        return RowInputs(pair, rows, e, delta)

    def decode_step(self, session: Session, token_id: int) -> np.ndarray:
        """Append one token; returns the float32 logits [vocab] for the next one."""
        if isinstance(token_id, (bool, np.bool_)) or not isinstance(token_id, (int, np.integer)):
            raise ValueError(f"decode_step takes one integer token id, got {token_id!r}")
        return self.prefill(session, [int(token_id)], return_logits="last")

    @property
    def returns_hidden(self) -> bool:
        """Whether `prefill_hidden` and ``verify(..., return_hidden=True)`` work on this backend (cpu, metal,
        metal-sim)."""
        return hasattr(self._backend, "forward_hidden")

    def prefill_hidden(self, session: Session, token_ids, return_logits: str = "last") -> tuple:
        """`prefill`, also returning the final-normed hidden rows [n, hidden] of the tokens (the MTP head's
        input), on a backend that has them (`returns_hidden`)."""
        if not self.returns_hidden:
            raise ValueError(f"the {self.backend} backend does not return hidden states")
        self.check_session(session)
        ids = self.check_ids(token_ids, session)
        return self._backend.forward_hidden(session._state, ids, return_logits, session._tokens)

    @property
    def returns_features(self) -> bool:
        """Whether `prefill_features` and ``verify(..., features=layers)`` work on this backend: the outputs of
        chosen decoder layers (a DFlash draft's context features)."""
        return hasattr(self._backend, "forward_features")

    def check_feature_layers(self, layers) -> tuple:
        """`layers` as a tuple of distinct decoder-layer indices of this model (1..8 of them); ValueError
        otherwise."""
        n = self.config.num_hidden_layers
        try:
            out = tuple(int(i) for i in layers)
        except (TypeError, ValueError):
            raise ValueError(f"feature layers must be a sequence of layer indices, got {layers!r}") from None
        if not 1 <= len(out) <= MAX_FEATURE_LAYERS:
            raise ValueError(f"feature layers: 1..{MAX_FEATURE_LAYERS} of them, got {len(out)}")
        if any(isinstance(i, bool) for i in layers) or any(not 0 <= i < n for i in out) or len(set(out)) != len(out):
            raise ValueError(f"feature layers must be distinct indices 0..{n - 1}, got {list(layers)}")
        return out

    def prefill_features(self, session: Session, token_ids, return_logits: str = "last", layers=()) -> tuple:
        """`prefill`, also returning the outputs of the decoder layers `layers` for every token, concatenated
        ([n, len(layers) * hidden], float32; the layer outputs before the final norm): (logits, features), on a
        backend that has them (`returns_features`)."""
        if not self.returns_features:
            raise ValueError(f"the {self.backend} backend does not return layer features")
        self.check_session(session)
        layers = self.check_feature_layers(layers)
        ids = self.check_ids(token_ids, session)
        if return_logits not in RETURN_LOGITS:
            raise ValueError(f"return_logits must be 'last', 'all' or 'none', got {return_logits!r}")
        return self._backend.forward_features(session._state, ids, return_logits, session._tokens, layers)

    def check_session(self, session) -> None:
        """TypeError / ValueError unless `session` is a Session of this model."""
        if not isinstance(session, Session):
            raise TypeError(f"expected a Session, got {type(session).__name__}")
        if session._model is not self:
            raise ValueError("this session belongs to another model")

    def check_ids(self, token_ids, session: Session) -> np.ndarray:
        """`token_ids` as int64, checked: integers, 1-D, not empty, in the vocabulary, fitting the session's
        context. ValueError naming the problem otherwise."""
        if isinstance(token_ids, (str, bytes)):
            raise ValueError("token_ids must be integers; encode text with model.tokenizer.encode() first")
        try:
            arr = np.asarray(token_ids)
        except Exception:
            raise ValueError(f"token_ids must be a sequence of integers, got {type(token_ids).__name__}") from None
        if arr.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
        if arr.size == 0:
            raise ValueError("token_ids is empty")
        if not np.issubdtype(arr.dtype, np.integer):
            if arr.dtype == object and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in arr):
                arr = arr.astype(np.int64)
            else:
                raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
        V = self.config.vocab_size
        bad = (arr < 0) | (arr >= V)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(f"token id {int(arr[j])} at index {j} is outside the vocabulary [0, {V})")
        if session.position + arr.size > session.max_context:
            raise ValueError(f"context overflow: {session.position} tokens in the session + {arr.size} new "
                             f"> max_context {session.max_context}")
        return arr.astype(np.int64)

    # ---- what the runtime asks of the backend ---------------------------------------------
    @property
    def native_verify(self) -> bool:
        """Whether the backend verifies and rewinds natively (cpu; metal and metal-sim with resident experts)."""
        return bool(getattr(self._backend, "native_verify", False))

    @property
    def gpu_decode(self) -> bool:
        """Whether the backend has a pipelined GPU decode loop (`decode_loop`: metal, metal-sim)."""
        return hasattr(self._backend, "decode")

    def decode_loop(self, session: Session, first: int, n: int, *, mask=None, **sampling) -> list:
        """Up to `n` tokens from the backend's pipelined GPU decode loop, feeding `first` then each sampled
        token (GPU sampling: temperature, top_k, top_p, min_p, seed, stop_ids, vocab). The session's tokens
        follow the state inside the call (an interrupt cannot separate them). `mask` (structured output, with
        n = 1): a token bitmask, uint32 or int32 [ceil(vocab_size / 32)] in llguidance's layout (bit i % 32 of
        word i / 32 allows token i), applied on the GPU before the token is chosen; a bad mask raises ValueError
        and leaves the session untouched."""
        self.check_session(session)
        return self._backend.decode(session._state, first, n, consumed=session._tokens, mask=mask, **sampling)

    @property
    def prefill_granule(self) -> int | None:
        """The chunk the backend computes a prompt in (cpu and metal: their ``prefill_chunk``): a prompt
        prefilled in pieces that end at multiples of it is bit for bit the prompt prefilled at once. None for
        the reference, whose prompt is prefilled at once to stay exact."""
        if self._backend.name == "reference":
            return None
        return getattr(self._backend, "prefill_chunk", None)

    @property
    def max_verify_rows(self) -> int | None:
        """The most rows one `verify` call (and one open chain of them) takes on this backend (cpu: 32 and at most
        its prefill chunk; metal with resident experts: 16), None where it verifies row by row (no limit)."""
        return getattr(self._backend, "max_verify_rows", None) if self.native_verify else None

    @property
    def max_batch_rows(self) -> int | None:
        """The most sessions one `decode_batch` call runs at once in a shared forward (cpu: 32; metal with
        resident experts: its verification rows), None where the backend runs rows one by one."""
        return getattr(self._backend, "max_batch_rows", None)

    def expert_counters(self) -> dict | None:
        """The expert cache's raw counters since `reset_expert_stats` (backends that can stream experts),
        else None; `qwenmetal.expert_streaming.expert_stats` summarises them."""
        read = getattr(self._backend, "expert_counters", None)
        return read() if read is not None else None

    def reset_expert_stats(self) -> None:
        """Start the expert cache's counters afresh (a no-op where there is no expert cache)."""
        reset = getattr(self._backend, "reset_expert_stats", None)
        if reset is not None:
            reset()

    def mtp_head(self, params: dict):
        """The backend's native MTP head over `params` (cpu: `CpuMtpHead`, one one-layer engine per decoder layer;
        metal / metal-sim with resident experts: `GpuMtpHead`, the head in the Metal graph; each holds the arrays
        its engines read, so keep it), or None where the backend has none."""
        make = getattr(self._backend, "mtp_head", None)
        return make(params) if make is not None else None

    def dflash_draft(self, draft):
        """The backend's native forward of the DFlash draft `draft` (a `qwenmetal.dflash.DFlashDraft`; cpu: over
        this model's embedding, lm_head and threads; metal / metal-sim: on the Metal graph over its embedding and
        lm_head; with ``new_cache()`` and ``forward(cache, features, block, commit)``, and for a DFlash2 draft
        ``propose(cache, features, block, commit) -> (drafts, logits)``), or None where the backend has none for
        the draft's variant (or does not run this draft)."""
        make = getattr(self._backend, "dflash_draft", None)
        return make(draft) if make is not None else None

    def vision_encoder(self):
        """The backend's vision tower over this checkpoint's (`Weights.vision`), built on first use and kept:
        an object with ``encode(pixel_values, grid_thw) -> [n_merged, out_hidden_size]`` float32 (the
        rows that replace an image's ``<|image_pad|>`` tokens; inputs as `qwenmetal.images.preprocess` gives
        them). reference: the numpy `VisionTower`; cpu: `CpuVisionEncoder` on the engine's threads. None for
        a checkpoint without a tower, or a backend that has none."""
        if not getattr(self.weights, "vision", None):
            return None
        enc = getattr(self, "_vision", None)
        if enc is None:
            make = getattr(self._backend, "vision_encoder", None)
            if make is None:
                return None
            enc = self._vision = make(self.weights)
        return enc

    @property
    def reference_model(self):
        """The numpy `ReferenceModel` of the reference backend, None on the others."""
        return getattr(self._backend, "impl", None) if self.backend == "reference" else None

    def with_backend(self, backend) -> "ModelBase":
        """A twin of this model (same config, weights and tokenizer) on another backend object, with no
        prefix cache or transcripts (their states were computed by this model's backend)."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin._backend = backend
        twin._identity = self._identity
        twin._vision = None
        twin.prefix_cache = twin.transcripts = None
        return twin


def _add_spans(have: list, spans) -> None:
    """Append `spans` to a session's image spans; a span that continues the last one (the same image, from
    where it ended: an image prefilled in two calls) extends it, so the prefix cache's keys of its rows
    (`qwenmetal.mrope.cache_key`) do not depend on where the calls were cut."""
    for sp in spans:
        if have and have[-1].end == sp.start and have[-1].digest == sp.digest:
            have[-1] = ImageSpan(have[-1].start, sp.end, sp.digest)
        else:
            have.append(sp)


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON: {e}") from None
    return d if isinstance(d, dict) else {}


# ---- many sessions at once: one decode step each ---------------------------------------------------
def decode_batch(model: ModelBase, sessions: Sequence[Session], token_ids: Sequence[int]) -> np.ndarray:
    """Append token_ids[i] to sessions[i] (distinct sessions of `model`), returning the float32 logits of the
    next token for each ([n, vocab]). Row i is bit for bit what ``model.decode_step(sessions[i], token_ids[i])``
    gives. All-or-nothing: a bad argument raises ValueError before anything changes, and a failure or an
    interrupt during the step leaves every session as it was.

    On the cpu backend, and in the Metal graph with resident experts, the rows run as one forward that reads
    every weight once for all of them (the MoE reads the rows' union of experts once), each row keeping a
    one-token step's arithmetic. Other backends (the reference, the oracle; Metal expert streaming) run the
    rows one after another."""
    sessions = list(sessions)
    if isinstance(token_ids, (str, bytes)):
        raise ValueError("token_ids must be integers, one per session")
    ids = list(token_ids)
    if not sessions:
        raise ValueError("decode_batch needs at least one session")
    if len(ids) != len(sessions):
        raise ValueError(f"decode_batch: {len(sessions)} sessions but {len(ids)} token ids")
    seen = set()
    arr = np.empty(len(ids), np.int64)
    for i, (s, t) in enumerate(zip(sessions, ids)):
        model.check_session(s)
        if id(s) in seen:
            raise ValueError(f"decode_batch: sessions[{i}] appears twice")
        seen.add(id(s))
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"decode_batch: token_ids[{i}] must be one integer token id, got {t!r}")
        arr[i] = model.check_ids([int(t)], s)[0]
    be = model._backend
    limit = model.max_batch_rows
    if limit is not None:
        if len(sessions) > limit:
            raise ValueError(f"decode_batch runs at most {limit} sessions at once on the {be.name} backend, "
                             f"got {len(sessions)}")
        return be.decode_batch([s._state for s in sessions], arr, [s._tokens for s in sessions])
    # one session after another, each state kept until the later ones are done (the last one's own step is
    # all-or-nothing: a single session needs no copy)
    before = [(s._state.copy(), len(s._tokens)) for s in sessions[:-1]]
    rows = []
    try:
        for s, t in zip(sessions, arr):
            _, out = be.forward(s._state, np.array([t]), "last", s._tokens)
            rows.append(out)
    except BaseException:
        with sigint_deferred():
            for s, (state, n) in zip(sessions, before[:len(rows)]):
                s._state = state
                del s._tokens[n:]
        raise
    return np.stack(rows)


# ---- verification: several rows at once, and dropping a tail of them again --------------------------
def verify(model: ModelBase, s: Session, ids: Sequence[int], return_hidden: bool = False, features=None):
    """Append `ids` to the session, returning the float32 logits of every one ([n, vocab]), and keep what
    `rewind` needs to drop any tail of them again. Consecutive calls form one chain; `rewind` ends it.
    Nothing else may run on the session in between. `return_hidden`: (logits, the final-normed hidden
    rows [n, hidden]), on a backend with a native verification only. `features` (decoder-layer indices):
    (logits, the outputs of those layers for every row [n, len(features) * hidden]), on a backend that
    `returns_features`; not together with `return_hidden`.

    On the cpu backend, and in the Metal graph with resident experts, a verification computes every row
    exactly as a one-token decode step does, reading the shared weights once for all rows. Other backends
    (the reference, Metal expert streaming) verify row by row (one decode step per row, the state copied
    after each), which is exact too but shares no weight reads."""
    model.check_session(s)
    arr = model.check_ids(ids, s)
    be = model._backend
    if features is not None:
        if return_hidden:
            raise ValueError("verify returns hidden states or layer features, not both")
        if not model.returns_features:
            raise ValueError(f"the {be.name} backend does not return layer features")
        features = model.check_feature_layers(features)
    if model.native_verify:
        if features is not None:
            return be.verify(s._state, arr, s._tokens, features=features)
        return be.verify(s._state, arr, s._tokens, return_hidden=return_hidden) if return_hidden else \
            be.verify(s._state, arr, s._tokens)
    if return_hidden:
        raise ValueError(f"the {be.name} backend does not return hidden states")
    chain = _open_chain(s)
    if not chain:
        chain.append(s._state.copy())
    start, n0 = len(chain), len(s._tokens)
    rows, feats = [], []
    try:
        for t in arr:                 # one decode step per row, the state after each kept
            if features is None:
                rows.append(model.prefill(s, [int(t)], "last"))
            else:
                lg, f = be.forward_features(s._state, np.asarray([int(t)], dtype=np.int64), "last", s._tokens,
                                            features)
                rows.append(lg)
                feats.append(f)
            chain.append(s._state.copy())
    except BaseException:             # all or nothing, as the engine's verification
        with sigint_deferred():
            s._state = chain[start - 1].copy()
            del s._tokens[n0:]
            del chain[start:]
        raise
    s._chain_at = len(s._tokens)
    if features is not None:
        return np.stack(rows), np.concatenate(feats, axis=0)
    return np.stack(rows)


def _open_chain(s: Session) -> list:
    """The row-by-row fallback's chain of state copies on `s` (a new one if anything else ran on the
    session since the last `verify`, as the engine's chain ends on any other call)."""
    if s._chain and s._chain_at != len(s._tokens):
        s._chain.clear()
    return s._chain


def rewind(model: ModelBase, s: Session, keep: int) -> None:
    """End the chain of `verify` calls, keeping its first `keep` tokens: the session is bit for bit what
    decoding just those would have left (state, position, tokens)."""
    model.check_session(s)
    if model.native_verify:
        model._backend.rewind(s._state, int(keep), s._tokens)
        return
    chain = _open_chain(s)
    if not chain:
        raise ValueError("nothing to rewind (no open verify chain on this session)")
    if not 0 <= keep < len(chain):
        raise ValueError(f"rewind keeps 0..{len(chain) - 1} tokens, got {keep}")
    drop = len(chain) - 1 - keep
    with sigint_deferred():
        s._state = chain[keep]
        s._chain = []
        if drop:
            del s._tokens[-drop:]


def rewindable(model: ModelBase, s: Session) -> int:
    """Tokens of the session's open `verify` chain (0: none)."""
    if model.native_verify:
        return int(s._state.rewindable)
    return max(len(_open_chain(s)) - 1, 0)

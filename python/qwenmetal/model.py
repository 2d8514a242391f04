"""`Model` and `Session`: the API every backend implements.

    model = Model.load(path_or_hub_id, backend="reference")
    s = model.new_session()
    logits = model.prefill(s, ids, return_logits="last")     # float32 [vocab]
    logits = model.decode_step(s, token_id)
    for out in model.generate("Hello", max_tokens=32): print(out.text, end="")

A `Session` holds one sequence's state (KV cache of the attention layers, conv and recurrent
state of the Gated DeltaNet layers, the position and the tokens). Calls are all-or-nothing: an
invalid token, empty input or context overflow raises ValueError before anything changes, and an
exception during compute (including KeyboardInterrupt) leaves the session as it was.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .config import ModelConfig
from .errors import CheckpointError
from .tokenizer import load_tokenizer
from .weights import load_weights

PLANNED_BACKENDS = ("cpu", "metal", "metal-sim")
RETURN_LOGITS = ("last", "all", "none")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def resolve_checkpoint(path_or_id: str | os.PathLike, revision: str | None = None) -> str:
    """A local directory as is; otherwise a Hugging Face hub id downloaded (or taken from the
    local hub cache) with huggingface_hub, which shows its own progress bars."""
    p = os.fspath(path_or_id)
    if os.path.isdir(p):
        return p
    if os.path.exists(p):
        raise CheckpointError(f"{p}: expected a checkpoint directory, got a file")
    if not _HUB_ID.match(p):
        raise CheckpointError(f"{p}: no such directory, and not a hub id of the form 'org/name'")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(p, revision=revision,
                                 allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"])
    except Exception as e:  # network, auth, missing repo: say which and how to work offline
        raise CheckpointError(
            f"could not get {p!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
            f"Download it once with network access (or pass a local directory).") from e


# ---------------------------------------------------------------------------------------------
class ReferenceBackend:
    """numpy reference (`qwenmetal.reference`): float32 on dequantized weights."""

    name = "reference"

    def __init__(self, weights, dtype="float32", gdn_mode="chunked", chunk_size=64):
        from .reference import ReferenceModel

        need = weights.dense_float32_nbytes()
        total = _total_memory()
        if total and need > 0.75 * total:
            raise MemoryError(
                f"the reference backend dequantizes every weight to float32: {need / 2**30:.1f} GiB, more than "
                f"this machine can hold ({total / 2**30:.1f} GiB). It is meant for small checkpoints.")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        if gdn_mode not in ("chunked", "recurrent"):
            raise ValueError(f"gdn_mode must be 'chunked' or 'recurrent', got {gdn_mode!r}")
        self.impl = ReferenceModel(weights.config, weights.dense_float32(), dtype=dtype)
        self.dtype, self.gdn_mode, self.chunk_size = dtype, gdn_mode, int(chunk_size)

    def new_state(self):
        return self.impl.new_state()

    def forward(self, state, ids: np.ndarray, logits: str):
        """Run `ids` on a copy of `state`; returns (new_state, logits)."""
        new = state.copy()
        out = self.impl.forward(new, ids, logits=logits, gdn_mode=self.gdn_mode, chunk_size=self.chunk_size)
        return new, out


# name -> factory(weights, **options) returning a backend (see docs/architecture.md)
BACKENDS = {"reference": ReferenceBackend}
# what backend="auto" picks: the first of these that is available
AUTO_ORDER = ("reference",)


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SessionSnapshot:
    """An immutable copy of a session's state, for `Session.restore`."""

    model_id: int
    state: object = field(repr=False)
    tokens: tuple = field(repr=False)

    @property
    def position(self) -> int:
        return self.state.position


class Session:
    """One sequence's decode state. Create with `Model.new_session()`."""

    def __init__(self, model: "Model", state, tokens=(), max_context: int | None = None):
        self._model = model
        self._state = state
        self._tokens = list(tokens)
        self.max_context = max_context or model.config.max_position_embeddings

    @property
    def position(self) -> int:
        """Tokens processed so far (the absolute position of the next token)."""
        return self._state.position

    @property
    def tokens(self) -> tuple:
        return tuple(self._tokens)

    @property
    def nbytes(self) -> int:
        """Bytes held by the state (KV cache as stored, conv and recurrent states)."""
        return self._state.nbytes

    def fork(self) -> "Session":
        """An independent copy that continues from the same point."""
        return Session(self._model, self._state.copy(), self._tokens, self.max_context)

    def snapshot(self) -> SessionSnapshot:
        return SessionSnapshot(id(self._model), self._state.copy(), tuple(self._tokens))

    def restore(self, snap: SessionSnapshot) -> None:
        if not isinstance(snap, SessionSnapshot):
            raise TypeError(f"restore() takes a SessionSnapshot, got {type(snap).__name__}")
        if snap.model_id != id(self._model):
            raise ValueError("this snapshot was taken from a session of another model")
        self._state = snap.state.copy()
        self._tokens = list(snap.tokens)

    def reset(self) -> None:
        self._state = self._model._backend.new_state()
        self._tokens = []

    def __repr__(self) -> str:
        return (f"Session(position={self.position}, max_context={self.max_context}, "
                f"state={self.nbytes / 2**20:.2f} MiB)")


@dataclass
class GenerationOutput:
    """One generated token. The last output of a generation has `finish_reason` and `stats`."""

    token: int
    text: str                     # the new text this token completes (may be "" mid-character)
    index: int
    finish_reason: str | None = None      # "stop" (eos), "length" (max_tokens) or "context"
    stats: dict | None = None


# ---------------------------------------------------------------------------------------------
class Model:
    """A loaded checkpoint on one backend."""

    def __init__(self, config: ModelConfig, weights, tokenizer, backend, path: str):
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self._backend = backend
        self.path = path
        self.generation_config = _read_json(os.path.join(path, "generation_config.json"))

    @classmethod
    def load(cls, path_or_id, backend: str = "auto", *, revision: str | None = None, **options) -> "Model":
        """Load a checkpoint (local directory or hub id) onto a backend.

        backend: "reference" (numpy, float32 on dequantized weights) or "auto" (the fastest
        available here). Other keyword options go to the backend — reference: dtype
        ("float32" | "bfloat16", rounding where MLX rounds), gdn_mode ("chunked" | "recurrent"),
        chunk_size (GDN prefill chunk, default 64).
        """
        if backend == "auto":
            backend = next(b for b in AUTO_ORDER if b in BACKENDS)
        if backend not in BACKENDS:
            if backend in PLANNED_BACKENDS:
                raise ValueError(f"backend {backend!r} is not available in this build; available: {tuple(BACKENDS)}")
            raise ValueError(f"unknown backend {backend!r}; available: {tuple(BACKENDS)}")
        path = resolve_checkpoint(path_or_id, revision)
        config = ModelConfig.from_file(path)
        weights = load_weights(path, config)
        tokenizer = load_tokenizer(path)
        impl = BACKENDS[backend](weights, **options)
        return cls(config, weights, tokenizer, impl, path)

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def eos_token_ids(self) -> tuple:
        """Stop ids: generation_config.json's, config.json's (top level and text_config) and the
        tokenizer's eos, all of them (model-spec §7)."""
        ids = list(self.config.eos_token_ids)
        g = self.generation_config.get("eos_token_id")
        for x in (g if isinstance(g, list) else [g]):
            if isinstance(x, int) and x not in ids:
                ids.append(x)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            if self.tokenizer.eos_token_id not in ids:
                ids.append(self.tokenizer.eos_token_id)
        return tuple(ids)

    def new_session(self, max_context: int | None = None) -> Session:
        if max_context is not None and not (0 < max_context <= self.config.max_position_embeddings):
            raise ValueError(f"max_context must be in 1..{self.config.max_position_embeddings}")
        return Session(self, self._backend.new_state(), max_context=max_context)

    # ---- the two primitive calls ---------------------------------------------------------
    def prefill(self, session: Session, token_ids, return_logits: str = "last"):
        """Append `token_ids` to the session. Returns float32 logits of the last token ([vocab]),
        of every token ([L, vocab]) or None, per `return_logits` ("last" | "all" | "none")."""
        self._check_session(session)
        if return_logits not in RETURN_LOGITS:
            raise ValueError(f"return_logits must be one of {RETURN_LOGITS}, got {return_logits!r}")
        ids = self._check_ids(token_ids, session)
        state, out = self._backend.forward(session._state, ids, return_logits)
        session._state = state
        session._tokens.extend(int(i) for i in ids)
        return out

    def decode_step(self, session: Session, token_id) -> np.ndarray:
        """Append one token; returns the float32 logits [vocab] for the next one."""
        if isinstance(token_id, (bool, np.bool_)) or not isinstance(token_id, (int, np.integer)):
            raise ValueError(f"decode_step takes one integer token id, got {token_id!r}")
        return self.prefill(session, [int(token_id)], return_logits="last")

    def _check_session(self, session):
        if not isinstance(session, Session):
            raise TypeError(f"expected a Session, got {type(session).__name__}")
        if session._model is not self:
            raise ValueError("this session belongs to another model")

    def _check_ids(self, token_ids, session) -> np.ndarray:
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

    # ---- generation ----------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_tokens: int = 32, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 session: Session | None = None) -> Iterator[GenerationOutput]:
        """Stream tokens for `prompt` (text, encoded without a chat template, or token ids).

        Greedy when temperature == 0. Stops at an eos id, after `max_tokens`, or at the context
        limit. With `session`, continues it (the prompt is appended); otherwise uses a new one.
        """
        from .sampling import Sampler

        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.path}: no tokenizer.json, so prompts must be token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        s = session if session is not None else self.new_session()
        vocab_used = self.tokenizer.vocab_size if self.tokenizer is not None else self.config.vocab_size
        stops = set(self.eos_token_ids)
        t0 = time.perf_counter()
        logits = self.prefill(s, ids)
        t1 = time.perf_counter()
        generated: list = []
        text_so_far = ""
        for n in range(max_tokens):
            tok = sampler(logits, vocab_used)
            generated.append(tok)
            text = ""
            if self.tokenizer is not None:
                full = self.tokenizer.decode(generated, skip_special_tokens=True)
                if not full.endswith("\ufffd"):
                    text, text_so_far = full[len(text_so_far):], full
            reason = None
            if tok in stops:
                reason = "stop"
            elif n + 1 == max_tokens:
                reason = "length"
            elif s.position + 1 > s.max_context:
                reason = "context"
            if reason is None:
                logits = self.decode_step(s, tok)
                yield GenerationOutput(tok, text, n)
                continue
            t2 = time.perf_counter()
            decode_steps = len(generated) - 1
            stats = {"prompt_tokens": len(ids), "generated_tokens": len(generated),
                     "prefill_seconds": t1 - t0, "decode_seconds": t2 - t1,
                     "prefill_tokens_per_second": len(ids) / max(t1 - t0, 1e-9),
                     "decode_tokens_per_second": decode_steps / (t2 - t1) if decode_steps else float("nan")}
            yield GenerationOutput(tok, text, n, reason, stats)
            return

    def __repr__(self) -> str:
        return (f"Model(backend={self.backend!r}, path={self.path!r}, layout={self.weights.layout!r}, "
                f"weights={self.weights.nbytes / 2**20:.1f} MiB,\n      {self.config!r})")


def _read_json(path: str) -> dict:
    import json
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON: {e}") from None
    return d if isinstance(d, dict) else {}

"""`Model` and `Session`: the API every backend implements.

    model = Model.load(path_or_hub_id, backend="reference")
    s = model.new_session()
    logits = model.prefill(s, ids, return_logits="last")     # float32 [vocab]
    logits = model.decode_step(s, token_id)
    for out in model.generate("Hello", max_tokens=32): print(out.text, end="")

A `Session` holds one sequence's state (KV cache of the attention layers, conv and recurrent
state of the Gated DeltaNet layers, the position and the tokens). Calls are all-or-nothing: an
invalid token, empty input or context overflow raises ValueError before anything changes, and an
exception during compute (including KeyboardInterrupt, which the C++ engines check for between chunks
and tokens) leaves the session as it was: state and tokens always advance together (docs/api.md,
"Interrupts").
"""
from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from .config import ModelConfig
from .errors import CheckpointError
from .generation import GenerationOutput
from .interrupts import sigint_deferred
from .options import GenerationOptions
from .prefix_cache import PrefixCache
from .tokenizer import load_tokenizer
from .transcripts import TranscriptStore
from .weights import load_weights
from .backends import backend_factory

if TYPE_CHECKING:
    from .chat import ChatResponse
    from .sampling import Sampler

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
@dataclass(frozen=True)
class SessionSnapshot:
    """An immutable copy of a session's state, for `Session.restore`."""

    model_id: int
    state: object = field(repr=False)
    tokens: tuple = field(repr=False)

    @property
    def position(self) -> int:
        """The session position the snapshot was taken at."""
        return self.state.position


class Session:
    """One sequence's decode state. Create with `Model.new_session()`."""

    def __init__(self, model: "Model", state, tokens=(), max_context: int | None = None):
        self._model = model
        self._state = state
        self._tokens = list(tokens)
        self.max_context = max_context or model.config.max_position_embeddings
        self.metadata: dict = {}          # user data kept by save()/load()

    @property
    def position(self) -> int:
        """Tokens processed so far (the absolute position of the next token)."""
        return self._state.position

    @property
    def tokens(self) -> tuple:
        """Every token the session has processed, in order."""
        return tuple(self._tokens)

    @property
    def nbytes(self) -> int:
        """Bytes held by the state (KV cache as stored, conv and recurrent states)."""
        return self._state.nbytes

    def fork(self) -> "Session":
        """An independent copy that continues from the same point."""
        return Session(self._model, self._state.copy(), self._tokens, self.max_context)

    def snapshot(self) -> SessionSnapshot:
        """An immutable copy of the state, for `restore` (cheap to keep: the prefix cache holds these)."""
        return SessionSnapshot(id(self._model), self._state.copy(), tuple(self._tokens))

    def restore(self, snap: SessionSnapshot) -> None:
        """Go back to `snap` (taken from a session of the same model)."""
        if not isinstance(snap, SessionSnapshot):
            raise TypeError(f"restore() takes a SessionSnapshot, got {type(snap).__name__}")
        if snap.model_id != id(self._model):
            raise ValueError("this snapshot was taken from a session of another model")
        state, tokens = snap.state.copy(), list(snap.tokens)
        with sigint_deferred():
            self._state = state
            self._tokens = tokens

    def reset(self) -> None:
        """Back to position 0 (an empty state)."""
        state = self._model._backend.new_state()
        with sigint_deferred():
            self._state = state
            self._tokens = []

    def save(self, path: str | os.PathLike, metadata: dict | None = None) -> None:
        """Write the state, tokens and position to `path` (a safetensors file with a JSON header naming
        the model; format in `qwenmetal.session_io`). `metadata`: JSON-serialisable user data."""
        from .session_io import save_session
        save_session(self, path, metadata if metadata is not None else self.metadata)

    @classmethod
    def load(cls, path: str | os.PathLike, model: "Model", max_context: int | None = None) -> "Session":
        """A session from `Session.save`'s file. Raises ValueError if it was saved from another model
        (config.json or weight files differ) or the file is malformed. A session holding a conversation
        (`Model.chat_session`, the chat command's /save) also goes into the model's prefix cache with its
        transcript, so `model.chat` on its ``metadata["messages"]`` plus a new message prefills only that."""
        from .session_io import load_session
        from .transcripts import resume_conversation
        state, tokens, max_context, metadata = load_session(path, model, max_context)
        s = cls(model, state, tokens, max_context=max_context)
        s.metadata = metadata
        resume_conversation(model, s)
        return s

    def __repr__(self) -> str:
        return (f"Session(position={self.position}, max_context={self.max_context}, "
                f"state={self.nbytes / 2**20:.2f} MiB)")

    def _repr_html_(self) -> str:
        from html import escape
        tail = ""
        tok = self._model.tokenizer
        if tok is not None and self._tokens:
            text = tok.decode(self._tokens[-64:])
            tail = f"<tr><td>last tokens</td><td><code>{escape(text[-300:])}</code></td></tr>"
        return (f"<b>qwenmetal.Session</b><table><tr><td>position</td><td>{self.position} / {self.max_context}</td></tr>"
                f"<tr><td>state</td><td>{self.nbytes / 2**20:.2f} MiB</td></tr>{tail}</table>")


# ---------------------------------------------------------------------------------------------
class Model:
    """A loaded checkpoint on one backend."""

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
        # a backend whose prefill runs in fixed chunks (metal, metal-sim) snapshots at its chunk boundaries:
        # the state there is what one of its command buffers left, so a resume re-runs whole chunks
        chunk = getattr(backend, "snapshot_chunk", None)
        self.prefix_cache: PrefixCache | None = PrefixCache() if chunk is None else PrefixCache(chunk_tokens=chunk)
        self.transcripts: TranscriptStore | None = TranscriptStore()
        self._identity = None

    @classmethod
    def load(cls, path_or_id: str | os.PathLike, backend: str = "auto", *, revision: str | None = None,
             **options) -> "Model":
        """Load a checkpoint (local directory or hub id) onto a backend.

        backend: "cpu" (C++ engine on the mmap'd weights, threads + SIMD), "reference" (numpy,
        float32 on dequantized weights) or "auto" (the fastest available here: cpu, then reference).
        Other keyword options go to the backend — cpu: threads (default: physical cores), kv_dtype
        ("bfloat16" | "float32"), prefill_chunk (tokens per chunk, default 512), quantize (None | 4 | 8:
        quantize a dense checkpoint at load, group 64), memory_budget ("auto" (default: the memory
        available here) | bytes | a size like "8GiB" | None: never stream; a checkpoint larger than the
        budget keeps its non-expert weights mapped and streams the routed experts from the files into a
        bounded expert cache, output unchanged), expert_slots (cache slots per MoE layer, 1..num_experts;
        giving it forces streaming), expert_policy ("lfu", the default | "lru" | "os") and expert_direct_io
        (read the experts past the page cache, default False); reference: dtype
        ("float32" | "bfloat16", rounding where MLX rounds), gdn_mode ("chunked" | "recurrent"), chunk_size
        (GDN prefill chunk, default 64); metal / metal-sim: dtype, kv_dtype, attention, prefill_chunk (tokens per GPU chunk,
        default 4096; the prefix cache snapshots at its boundaries), gemm_route ("auto" | "simdgroup" |
        "tensor"), gdn_route ("auto" | "scan" | "chunked"), max_context (the context the GPU memory plan
        reserves KV for, default 32768: resident, a smaller chunk or expert streaming within the GPU's working
        set), command_buffer_seconds (modelled GPU time each prefill command buffer is cut to), and
        memory_budget / expert_slots / expert_policy as on cpu (slots in device buffers, per-layer command
        buffers); metal-sim also schedule, seed and device_options (SimDevice's modelled Mac limits:
        pipeline_max_threads, working_set, watchdog_seconds); see `qwenmetal.metal_backend`.
        """
        factory = backend_factory(backend)
        path = resolve_checkpoint(path_or_id, revision)
        config = ModelConfig.from_file(path)
        weights = load_weights(path, config)
        tokenizer = load_tokenizer(path)
        impl = factory(weights, **options)
        return cls(config, weights, tokenizer, impl, path)

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
    def identity(self) -> dict:
        """What names this checkpoint (hash of config.json + the weight files' names, sizes and full
        SHA-256, cached by `qwenmetal.session_io`); sessions saved with `Session.save` carry it and refuse
        to load into another model. Raises CheckpointError if a weight file changed since loading."""
        self.weights.check_unchanged()
        if self._identity is None:
            from .session_io import model_identity
            self._identity = model_identity(self.path)
        return self._identity

    def new_session(self, max_context: int | None = None) -> Session:
        """An empty session; `max_context` (1..max_position_embeddings, default: all of it) caps its length."""
        if max_context is not None and not (0 < max_context <= self.config.max_position_embeddings):
            raise ValueError(f"max_context must be in 1..{self.config.max_position_embeddings}")
        return Session(self, self._backend.new_state(), max_context=max_context)

    # ---- the two primitive calls ---------------------------------------------------------
    def prefill(self, session: Session, token_ids: Sequence[int] | np.ndarray,
                return_logits: str = "last") -> np.ndarray | None:
        """Append `token_ids` to the session. Returns float32 logits of the last token ([vocab]),
        of every token ([L, vocab]) or None, per `return_logits` ("last" | "all" | "none")."""
        self._check_session(session)
        if return_logits not in RETURN_LOGITS:
            raise ValueError(f"return_logits must be one of {RETURN_LOGITS}, got {return_logits!r}")
        ids = self._check_ids(token_ids, session)
        # the backend commits the state and the session's tokens together (an interrupt lands before or after)
        _, out = self._backend.forward(session._state, ids, return_logits, session._tokens)
        return out

    def decode_step(self, session: Session, token_id: int) -> np.ndarray:
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
    def generate(self, prompt: str | Sequence[int], max_tokens: int | None = None, *,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 min_p: float | None = None, repetition_penalty: float | None = None,
                 presence_penalty: float | None = None, frequency_penalty: float | None = None,
                 seed: int | None = None, stop: str | Sequence[str] | None = None,
                 stop_token_ids: Sequence[int] | None = None, ignore_eos: bool | None = None,
                 logprobs: bool | None = None, top_logprobs: int | None = None,
                 skip_special_tokens: bool | None = None, options: GenerationOptions | None = None,
                 sampler: Sampler | None = None, session: Session | None = None, cache: bool = True,
                 cache_points: Sequence[int] = (), progress: bool | None = None,
                 cancel: threading.Event | None = None, speculative=None,
                 speculative_k: int | None = None) -> Iterator[GenerationOutput]:
        """Stream `GenerationOutput`s for `prompt` (text, encoded without a chat template, or token ids).

        The sampling and stopping options (max_tokens, default 256, temperature ... skip_special_tokens) are
        the fields of `qm.GenerationOptions`: pass them as keywords, or `options=` one (keywords given too
        replace its fields). Sampling parameters left unset come from generation_config.json (greedy when
        temperature is 0); or `sampler=` a `qm.Sampler` instead of them (passing both is an error). Stops
        at an eos id (config.json, generation_config.json, the tokenizer's eos, `<|im_end|>`; `ignore_eos`
        disables them), an id in `stop_token_ids`, a `stop` string (matched across tokens, not emitted),
        after `max_tokens`, or when the session is full. With `session`, continues it (the prompt is
        appended; the last sampled token is not fed back); otherwise uses a new session and the prefix
        cache (`cache=False` to bypass; `cache_points`: prompt lengths to keep a snapshot at). `cancel`: an
        Event that ends the generation (no final output). The last output has `finish_reason` and `stats`.
        `speculative`: decode speculatively with a drafter -- "lookup" (n-grams of the session's own tokens),
        "mtp" (the checkpoint's multi-token-prediction head), a draft `Model` of the same vocabulary, or a
        `qwenmetal.speculative.Drafter`; the output is exactly what decoding without it gives (greedy: the
        same tokens; sampling: the same distribution), and `stats["speculative"]` reports drafted and
        accepted tokens. `speculative_k`: drafts per round (default: chosen from the measured acceptance
        and cost, 0 when speculation does not pay). See docs/speculative.md.
        Arguments are checked before the first output: invalid ones raise ValueError naming them.
        See docs/usage.md.
        """
        from .generation import generate
        opts = GenerationOptions.build(
            options, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, seed=seed, stop=stop, stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos, logprobs=logprobs, top_logprobs=top_logprobs,
            skip_special_tokens=skip_special_tokens)
        return generate(self, prompt, opts, sampler=sampler, session=session, cache=cache,
                        cache_points=cache_points, progress=progress, cancel=cancel, speculative=speculative,
                        speculative_k=speculative_k)

    def chat_prompt(self, messages: Sequence[dict], *, tools: list | None = None,
                    enable_thinking: bool | None = None, **template_kwargs) -> tuple[list, int, str]:
        """(prompt ids, number of ids before the generation prompt, prompt text) for `messages` as given
        (`Model.chat` checks them first; see `qwenmetal.chat.chat_turn`): the transcript of the longest
        answered prefix of the conversation plus the rendering of the rest, or the template's rendering
        (see `qwenmetal.transcripts`)."""
        from .transcripts import chat_prompt
        p = chat_prompt(self, messages, tools=tools, enable_thinking=enable_thinking, **template_kwargs)
        return p.ids, p.head, p.text

    def use_disk_cache(self, directory: str | os.PathLike, max_bytes: int | None = None) -> None:
        """Keep the state at the end of every chat turn that has a transcript in `directory` as well (a
        session file per turn, at most `max_bytes`, default 4 GiB, least recently used removed), and read
        the ones already there, so a new process -- a restarted server -- continues those conversations
        without prefilling them. See `qwenmetal.prefix_cache.DiskTier`."""
        from .transcripts import restore_from_disk
        if self.prefix_cache is None:
            raise ValueError("the prefix cache is off (model.prefix_cache is None): nothing to keep on disk")
        self.prefix_cache.attach_disk(self, directory, max_bytes)
        restore_from_disk(self)

    def chat_session(self, messages: Sequence[dict], *, tools: list | None = None,
                     enable_thinking: bool | None = None, chat_template_kwargs: dict | None = None) -> Session:
        """A new session holding the conversation `messages` as the model read and wrote it (the transcript
        of its last reply, else its rendering), with the messages in ``metadata``: `Session.save` it, and
        `Session.load` continues it. Uses the prefix cache, so after `chat` it prefills at most one token."""
        from .transcripts import conversation_session
        return conversation_session(self, messages, tools=tools, enable_thinking=enable_thinking,
                                    **(chat_template_kwargs or {}))

    def chat(self, messages: Sequence[dict], *, tools: list | None = None, enable_thinking: bool | None = None,
             stream: bool = False, chat_template_kwargs: dict | None = None,
             options: GenerationOptions | None = None, **generate_kwargs) -> ChatResponse | Iterator[GenerationOutput]:
        """Answer a conversation (OpenAI-style message dicts) with the checkpoint's chat template.

        The messages are checked as the server checks them (`qwenmetal.chat.validate_messages`: ValueError
        naming ``messages[i]``). Returns a `ChatResponse` (content, reasoning, tool_calls -- parsed when
        `tools` are offered --, finish_reason, stats, `.message` to append to the history), or with
        `stream=True` the `GenerationOutput` iterator. Uses the prefix cache, and keeps the reply's tokens
        (a transcript, `qwenmetal.transcripts`) so that the next turn's prompt continues them and prefills
        only the new messages. `options` and the other keyword arguments are `generate`'s (max_tokens,
        temperature, stop, seed, sampler, ...).
        """
        from .chat import chat_turn

        turn = chat_turn(self, messages, tools=tools, enable_thinking=enable_thinking,
                         template_kwargs=chat_template_kwargs)
        gen = turn.generate(self, options, **generate_kwargs)
        if stream:
            return turn.remembering(self, gen)
        r = turn.response(gen)
        turn.remember(self, r.message, r.tokens)
        return r

    def __repr__(self) -> str:
        return (f"Model(backend={self.backend!r}, path={self.path!r}, layout={self.weights.layout!r}, "
                f"weights={self.weights.nbytes / 2**20:.1f} MiB,\n      {self.config!r})")

    def _repr_html_(self) -> str:
        from html import escape
        c = self.config
        rows = [("backend", self.backend), ("path", self.path), ("layout", self.weights.layout),
                ("weights", f"{self.weights.nbytes / 2**20:.1f} MiB"),
                ("layers", f"{c.num_hidden_layers} ({len(c.linear_attention_layers)} Gated DeltaNet, "
                           f"{len(c.full_attention_layers)} attention)"),
                ("tokenizer", repr(self.tokenizer)), ("prefix cache", repr(self.prefix_cache))]
        body = "".join(f"<tr><td>{escape(k)}</td><td>{escape(str(v))}</td></tr>" for k, v in rows)
        return f"<b>qwenmetal.Model</b><table>{body}</table>" + c._repr_html_()


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

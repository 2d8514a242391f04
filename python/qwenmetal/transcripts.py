"""Chat transcripts: the next turn's prompt continues what the model read and generated, token for token.

Re-rendering a conversation with the chat template does not give back the tokens of the previous turn: with
thinking on, Qwen's templates drop the reasoning of replies before the last user message; content is
trimmed; and encoding text can give other tokens than the ones the model sampled. So the prefix cache's
snapshot at the end of a turn (prompt + reply) is not a prefix of the next prompt, and every turn would
prefill the previous reply again. Instead, every reply that ended on an end-of-turn token is kept as a
*transcript*: the exact token ids of its prompt and of the reply, including the end token, keyed by the
conversation up to and including that reply. The next prompt is

    transcript of the longest such prefix of the messages + the template's rendering of what follows it

so the previous turn's snapshot is a prefix of it and only the new messages are prefilled. The rendering of
what follows is found generically: the history before the last reused reply must render identically on its
own and inside the whole conversation, and the text after that reply's end token (``<|im_end|>``) is what
is encoded. A transcript that does not line up (its reply ended on another end id than the template
writes, say) gives way to the transcript of an earlier reply (the four longest are tried); when none does
(no transcript, a template that renders the history differently), the prompt is the plain rendering.

The key is the conversation *normalised*: assistant ``reasoning_content`` is dropped (OpenAI clients
usually drop it; the transcript holds the reasoning as generated), ``None`` and empty fields are dropped,
content is stripped (text parts joined; an image part counts by its content hash) and tool-call arguments given as JSON strings are parsed -- together with
the tools and the template options (``enable_thinking`` left out counts as the template's own default, so a
client that sends it and one that does not name the same conversation). Transcripts are bounded (entries and tokens, least recently used out).

Behaviour: with thinking on, the reasoning of earlier replies stays in the context, as Qwen3.6's
``preserve_thinking`` does (for the plain rendering ``preserve_thinking=True`` is passed to templates that
know it, so the reasoning sent back in the history renders as generated). Pass
``chat_template_kwargs={"preserve_thinking": False}`` for the template's own rendering of the history
(earlier reasoning dropped, each turn re-reads the previous reply), or set ``model.transcripts = None`` to
keep no transcripts.
"""
from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .errors import InputError
from .prompt_images import place_images

DEFAULT_MAX_ENTRIES = 4096
DEFAULT_MAX_TOKENS = 1 << 23                 # 32 MiB of int32 ids
PRESERVE_THINKING = "preserve_thinking"
_DROPPED = ("reasoning_content", "reasoning")


def check_chat_support(model) -> None:
    """Raise ValueError saying why `model` cannot chat (no tokenizer.json; no chat template), if it cannot."""
    if model.tokenizer is None:
        raise InputError(f"{model.path}: no tokenizer.json, so chat is not available")
    model.tokenizer.require_chat_template()


def _part_text(p) -> str:
    if not isinstance(p, dict):
        return str(p)
    if p.get("type") == "image":                  # an image (`chat.read_images`): named by its content hash
        return f"\x00image:{p.get('digest', '')}\x00"
    return p.get("text", "")


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(_part_text(p) for p in content)
    return content if isinstance(content, str) else str(content)


def normalize_message(m: dict) -> dict:
    """The part of a message that names it in a transcript key (see the module docstring)."""
    out = {}
    for k, v in m.items():
        if k in _DROPPED or v is None or v == [] or v == {}:
            continue
        if k == "content":
            v = _text(v).strip()                  # templates trim it; streamed content may keep a newline
        elif k == "tool_calls":
            calls = []
            for c in v:
                c = dict(c)
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
                    except json.JSONDecodeError:
                        args = fn["arguments"]
                    fn["arguments"] = args
                c["function"] = fn
                c.pop("type", None)
                calls.append(c)
            v = calls
        out[k] = v
    out.setdefault("content", "")
    return out


def _digest(obj) -> bytes:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode()).digest()


def conversation_keys(messages: Sequence[dict], tools=None, template_kwargs: dict | None = None) -> list:
    """Hex keys of every prefix of `messages`: ``keys[i]`` names ``messages[:i + 1]`` with `tools` and
    `template_kwargs` (a chained hash, so all prefixes cost one pass)."""
    kw = {k: v for k, v in (template_kwargs or {}).items() if k != PRESERVE_THINKING and v is not None}
    h = _digest({"tools": tools, "template_kwargs": kw}).hex()
    keys = []
    for m in messages:
        h = next_key(h, m)
        keys.append(h)
    return keys


def next_key(key: str, message: dict) -> str:
    """The key of a conversation (named `key`) followed by `message`."""
    return hashlib.sha256(bytes.fromhex(key) + _digest(normalize_message(message))).hexdigest()


class TranscriptStore:
    """Transcripts (token ids of prompt + reply, ending on the reply's end token) by conversation key.

    Bounded by ``max_entries`` and ``max_tokens`` (least recently used evicted); thread-safe.
    ``model.transcripts`` is one of these (``None``: keep none)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_tokens: int = DEFAULT_MAX_TOKENS):
        if max_entries < 1 or max_tokens < 1:
            raise ValueError(f"max_entries and max_tokens must be >= 1, got {max_entries} and {max_tokens}")
        self.max_entries, self.max_tokens = int(max_entries), int(max_tokens)
        self._entries: "OrderedDict[str, np.ndarray]" = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def total_tokens(self) -> int:
        return self._tokens

    def put(self, key: str, tokens: Sequence[int]) -> None:
        """Keep `tokens` under `key` (replacing an older transcript of it)."""
        arr = np.asarray(tokens, dtype=np.int32).copy()
        if arr.ndim != 1 or arr.size == 0 or arr.size > self.max_tokens:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= old.size
            self._entries[key] = arr
            self._tokens += arr.size
            while len(self._entries) > self.max_entries or self._tokens > self.max_tokens:
                _, e = self._entries.popitem(last=False)
                self._tokens -= e.size

    def get(self, key: str) -> list | None:
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return None
            self._entries.move_to_end(key)
            return e.tolist()

    def candidates(self, keys: Sequence[str], messages: Sequence[dict], limit: int = 4) -> Iterator[tuple]:
        """``(k, tokens)`` for the prefixes ``messages[:k]`` ending in an assistant reply that have a
        transcript (`keys` from :func:`conversation_keys`), longest first, at most `limit` of them."""
        n = 0
        for k in range(len(messages), 0, -1):
            if n == limit:
                return
            if messages[k - 1].get("role") == "assistant":
                t = self.get(keys[k - 1])
                if t is not None:
                    n += 1
                    yield k, t

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._tokens = 0

    def __repr__(self) -> str:
        return f"TranscriptStore({len(self)} transcripts, {self._tokens} tokens)"


# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: ``ids`` (with the generation prompt), ``head`` (how many of them hold the
    conversation itself; 0 if unknown), ``text`` (the template's rendering) and ``keys`` (the conversation
    keys of the messages, for :func:`remember_reply`; empty when transcripts are off)."""

    ids: list = field(repr=False)
    head: int
    text: str = field(repr=False)
    keys: list = field(default_factory=list, repr=False)


def _render(tk, messages, tools, kwargs, generation_prompt: bool) -> str:
    return tk.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, **kwargs)


_THINKING_DEFAULTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def thinking_default(tk) -> bool | None:
    """What ``enable_thinking`` the chat template of `tk` assumes when it is not given: True or False when
    leaving it out renders a probe conversation as that value does, else None (cached per tokenizer)."""
    if tk not in _THINKING_DEFAULTS:
        probe = [{"role": "user", "content": "?"}]
        try:
            unset = tk.apply_chat_template(probe, add_generation_prompt=True)
            found = [v for v in (True, False)
                     if tk.apply_chat_template(probe, add_generation_prompt=True, enable_thinking=v) == unset]
        except ValueError:
            found = []
        _THINKING_DEFAULTS[tk] = found[0] if len(found) == 1 else None
    return _THINKING_DEFAULTS[tk]


def _template_kwargs(tk, template_kwargs: dict, enable_thinking) -> dict:
    """What the template is rendered with: `template_kwargs`, ``enable_thinking`` (when not given, the
    template's own default, so that a conversation keys the same whether a client leaves it out or sends
    that value) and, for a template that knows it and unless the caller set it, ``preserve_thinking=True``
    (history renders as generated)."""
    if enable_thinking is None:
        enable_thinking = thinking_default(tk)
    kwargs = dict(template_kwargs, enable_thinking=enable_thinking)
    if kwargs.get(PRESERVE_THINKING) is None and PRESERVE_THINKING in (tk.chat_template or ""):
        kwargs[PRESERVE_THINKING] = True
    return kwargs


def _stripped(m: dict) -> dict:
    return {k: v for k, v in m.items() if k not in _DROPPED} if m.get("role") == "assistant" else m


def chat_prompt(model, messages: Sequence[dict], *, tools=None, enable_thinking: bool | None = None,
                **template_kwargs) -> ChatPrompt:
    """The prompt for answering `messages`: the transcript of the longest answered prefix that lines up with
    the rendering of the rest, plus that rendering; else the plain rendering (module docstring)."""
    check_chat_support(model)
    tk = model.tokenizer
    messages = list(messages)
    kwargs = _template_kwargs(tk, template_kwargs, enable_thinking)
    store = getattr(model, "transcripts", None)
    on = store is not None and template_kwargs.get(PRESERVE_THINKING) is not False
    keys = conversation_keys(messages, tools, kwargs) if on else []
    for k, tokens in (store.candidates(keys, messages) if keys else ()):
        p = _continue(model, messages, k, tokens, tools, kwargs, keys)
        if p is not None:                         # else an earlier reply's transcript may still line up
            return p
    return _plain(tk, messages, tools, kwargs, keys)


def _plain(tk, messages, tools, kwargs, keys) -> ChatPrompt:
    text = _render(tk, messages, tools, kwargs, True)
    ids = tk.encode(text)
    head = 0
    try:
        base = _render(tk, messages, tools, kwargs, False)
        if text.startswith(base):
            b = tk.encode(base)
            if ids[:len(b)] == b:
                head = len(b)
    except Exception:  # a template may refuse to render without the generation prompt
        head = 0
    return ChatPrompt(ids, head, text, keys)


def _continue(model, messages, k, transcript, tools, kwargs, keys) -> ChatPrompt | None:
    """transcript + the rendering of what follows ``messages[:k]``, or None when they do not line up."""
    tk = model.tokenizer
    end_text = tk.decode([transcript[-1]])
    if not end_text or end_text in repr(normalize_message(messages[k - 1])):
        return None                               # (a reply that spells its end token would be cut short)
    msgs = [_stripped(m) for m in messages[:k]] + list(messages[k:])
    try:
        text = _render(tk, msgs, tools, kwargs, True)
        before = _render(tk, msgs[:k - 1], tools, kwargs, False)     # the history before the reused reply
    except Exception:  # the template refuses a part of the conversation: render it plainly
        return None
    if not text.startswith(before):
        return None
    pos = text.find(end_text, len(before))
    if pos < 0:
        return None
    cut = pos + len(end_text)                     # the reused reply ends here, with its end token
    rest = tk.encode(text[cut:])
    ids = list(transcript) + rest
    head = 0
    try:
        base = _render(tk, msgs, tools, kwargs, False)
        if text.startswith(base) and len(base) >= cut:
            b = tk.encode(base[cut:])
            if rest[:len(b)] == b:
                head = len(transcript) + len(b)
    except Exception:
        head = 0
    return ChatPrompt(ids, head, text, keys)


def remember_reply(model, prompt_ids: Sequence[int], keys: Sequence[str], reply: dict,
                   tokens: Sequence[int], images=()) -> str | None:
    """Keep the transcript of a reply: the prompt `prompt_ids` (of the conversation named by `keys`, a
    `ChatPrompt`'s) was answered with the generated `tokens`, appended to the conversation as `reply` (the
    assistant message). Kept only when the reply ended on one of the model's end ids (its last token) and
    transcripts are on for the prompt (`keys` not empty). `images`: the prompt's image spans
    (`qwenmetal.mrope.ImageSpan`), which the disk tier's entry is keyed on. Returns the transcript's key, or
    None."""
    store = getattr(model, "transcripts", None)
    if store is None or not keys or not tokens or int(tokens[-1]) not in model.eos_token_ids:
        return None
    key = next_key(keys[-1], reply)
    transcript = [int(t) for t in prompt_ids] + [int(t) for t in tokens]
    store.put(key, transcript)
    pc = model.prefix_cache
    if pc is not None and pc.disk is not None:    # the turn's snapshot (its end token not fed) with its transcript
        pc.persist(transcript[:-1], images=tuple(images), transcript={"key": key, "end": transcript[-1]})
    return key


def restore_from_disk(model) -> int:
    """Put the transcripts written beside the prefix cache's disk tier into ``model.transcripts`` (a new
    process continues the conversations of an earlier one). Returns how many."""
    pc, store = model.prefix_cache, getattr(model, "transcripts", None)
    if pc is None or pc.disk is None or store is None:
        return 0
    n = 0
    for tokens, md in pc.disk.entries():
        t = md.get("transcript") if isinstance(md, dict) else None
        if isinstance(t, dict) and isinstance(t.get("key"), str) and isinstance(t.get("end"), int):
            store.put(t["key"], list(tokens) + [t["end"]])
            n += 1
    return n


# ---------------------------------------------------------------------------------------------------
# saved conversations
# ---------------------------------------------------------------------------------------------------
def conversation_session(model, messages: Sequence[dict], *, tools=None, enable_thinking: bool | None = None,
                         images=None, **template_kwargs):
    """A `Session` holding the conversation `messages` (ending with a reply): its transcript when it has one,
    else its rendering without a generation prompt. Resumes from the prefix cache and prefills the rest.
    ``session.metadata`` holds the messages and how they were rendered, which `resume_conversation` reads
    back (`Session.save` writes it). `images`: the `ImageBatch` of the messages' image parts, which are
    ``{"type": "image", "digest": ...}`` (`qwenmetal.chat.read_images`)."""
    check_chat_support(model)
    tk = model.tokenizer
    messages = list(messages)
    if not messages:
        raise ValueError("messages is empty: there is no conversation to hold")
    kwargs = _template_kwargs(tk, template_kwargs, enable_thinking)
    store = getattr(model, "transcripts", None)
    ids = None
    if store is not None and template_kwargs.get(PRESERVE_THINKING) is not False \
            and messages[-1].get("role") == "assistant":
        ids = store.get(conversation_keys(messages, tools, kwargs)[-1])
    transcript = ids is not None
    if ids is None:
        ids = tk.encode(_render(tk, messages, tools, kwargs, False))
    placed = place_images(model, ids, images) if images is not None else None
    if placed is not None:
        ids = placed.ids
    s = model.new_session()
    pc = model.prefix_cache
    e = pc.lookup(ids, need_logits=False, images=placed.spans if placed else ()) if pc is not None else None
    if e is not None:
        s.restore(e.snapshot)
    if s.position < len(ids):
        rows = placed.prefill_inputs(model, s.position, len(ids), 0) if placed is not None else {}
        model.prefill(s, ids[s.position:], return_logits="none", **rows)
    user_kwargs = {k: v for k, v in dict(template_kwargs, enable_thinking=enable_thinking).items() if v is not None}
    s.metadata = {"messages": messages,
                  "chat": {"tools": tools, "template_kwargs": user_kwargs, "transcript": transcript}}
    return s


def resume_conversation(model, session) -> None:
    """For a session holding a conversation (`conversation_session`'s metadata): put its state in the
    model's prefix cache and, if it holds a transcript, the transcript in ``model.transcripts``, so a chat
    that continues the conversation prefills only the new messages. Other sessions are left alone."""
    md = session.metadata or {}
    messages = md.get("messages")
    if not isinstance(messages, list) or not messages or not session.tokens:
        return
    chat = md.get("chat") if isinstance(md.get("chat"), dict) else {}
    if model.prefix_cache is not None:
        model.prefix_cache.put(session.tokens, session.snapshot(), kind="loaded")
    store = getattr(model, "transcripts", None)
    if store is not None and chat.get("transcript") is True and messages[-1].get("role") == "assistant":
        kw = dict(chat.get("template_kwargs")) if isinstance(chat.get("template_kwargs"), dict) else {}
        kw = _template_kwargs(model.tokenizer, kw, kw.pop("enable_thinking", None))   # as chat_prompt keys it
        store.put(conversation_keys(messages, chat.get("tools"), kw)[-1], session.tokens)

"""Tokenizer and chat template from a checkpoint's own files.

Encoding/decoding uses HF ``tokenizers`` on ``tokenizer.json``; added tokens listed only in
``tokenizer_config.json``'s ``added_tokens_decoder`` are added too (docs/model.md §8.1). The chat
template (``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``) is rendered
with jinja2's sandbox, so a template from a downloaded checkpoint cannot run arbitrary code.
"""
from __future__ import annotations

import codecs
import copy
import datetime
import json
import os
from typing import Sequence

from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders
from tokenizers import Tokenizer as HFTokenizer

from .errors import CheckpointError


def bytes_to_unicode() -> dict:
    """The GPT-2 byte-level alphabet: byte value -> the unicode character byte-level BPE uses for it."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _byte_decoder() -> dict:
    """The GPT-2 byte-level alphabet, inverted: unicode character -> byte value."""
    return {c: b for b, c in bytes_to_unicode().items()}


_BYTE_DECODER = _byte_decoder()


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _normalize_messages(messages) -> list:
    """A copy of `messages` with OpenAI-style tool calls made renderable: ``function.arguments`` given as a
    JSON string (what OpenAI clients send) is parsed into a mapping, as the Qwen templates expect."""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            m = dict(m)
            new_calls = []
            for c in calls:
                c = copy.deepcopy(dict(c))
                fn = c.get("function") if isinstance(c.get("function"), dict) else None
                if fn is not None and isinstance(fn.get("arguments"), str):
                    try:
                        args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
                    except json.JSONDecodeError:
                        args = None
                    if isinstance(args, dict):
                        fn["arguments"] = args
                new_calls.append(c)
            m["tool_calls"] = new_calls
        out.append(m)
    return out


def _raise_exception(msg):
    raise TemplateError(msg)


class Tokenizer:
    """A checkpoint's tokenizer (tokenizer.json through HF ``tokenizers``) and chat template."""

    def __init__(self, directory: str | os.PathLike):

        self.directory = os.fspath(directory)
        tj = os.path.join(self.directory, "tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(tj)
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"{tj}: cannot load tokenizer: {e}") from None
        cfg_path = os.path.join(self.directory, "tokenizer_config.json")
        self.config = {}
        if os.path.exists(cfg_path):
            try:
                with open(cfg_path, encoding="utf-8") as f:
                    self.config = json.load(f)
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{cfg_path}: invalid JSON: {e}") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        for sid, spec in sorted((self.config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])):
            content = spec.get("content")
            if content is None or content in vocab:
                continue
            special = bool(spec.get("special", False))
            tok = AddedToken(content, special=special, normalized=bool(spec.get("normalized", not special)),
                             lstrip=bool(spec.get("lstrip", False)), rstrip=bool(spec.get("rstrip", False)),
                             single_word=bool(spec.get("single_word", False)))
            (self._tok.add_special_tokens if special else self._tok.add_tokens)([tok])
        self._added = {int(i): t for i, t in self._tok.get_added_tokens_decoder().items()}
        self.special_ids = frozenset(i for i, t in self._added.items() if t.special)
        try:
            self.byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        except Exception:  # pragma: no cover - very old tokenizers
            self.byte_level = False
        self._bytes_cache: dict = {}
        self.chat_template = None
        jinja_path = os.path.join(self.directory, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                self.chat_template = f.read()
        elif isinstance(self.config.get("chat_template"), str):
            self.chat_template = self.config["chat_template"]
        self._template = None

    # ---- vocabulary -----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer defines (≤ the model's padded vocab)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (with the added tokens), for engines that read it (llguidance)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        """The id of `token` (a vocabulary string, e.g. ``"<|im_end|>"``), or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary string of id `i`, or None."""
        return self._tok.id_to_token(int(i))

    def _token_setting(self, name):
        v = self.config.get(name)
        if isinstance(v, dict):
            v = v.get("content")
        return v

    @property
    def eos_token(self) -> str | None:
        """tokenizer_config.json's ``eos_token``."""
        return self._token_setting("eos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The id of `eos_token`."""
        t = self.eos_token
        return None if t is None else self.token_to_id(t)

    # ---- text ---------------------------------------------------------------------------
    def encode(self, text: str) -> list:
        """Token ids for `text`. No BOS is added; special-token strings map to their ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids` (invalid UTF-8 becomes U+FFFD)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token `token_id` stands for (byte-level BPE: the token's bytes; added tokens: their
        text as UTF-8). A token need not be valid UTF-8 on its own."""
        i = int(token_id)
        b = self._bytes_cache.get(i)
        if b is None:
            if i in self._added:
                b = self._added[i].content.encode("utf-8")
            else:
                t = self._tok.id_to_token(i)
                if t is None:
                    raise ValueError(f"token id {i} is not in the tokenizer's vocabulary")
                if self.byte_level:
                    try:
                        b = bytes(_BYTE_DECODER[ch] for ch in t)
                    except KeyError:          # not a byte-level symbol string
                        b = t.encode("utf-8")
                else:
                    b = t.encode("utf-8")
            self._bytes_cache[i] = b
        return b

    def stream_decoder(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        """An incremental detokenizer: feed ids one at a time, get text that never splits a character."""
        return StreamDecoder(self, skip_special_tokens)

    # ---- chat ---------------------------------------------------------------------------
    def require_chat_template(self) -> None:
        """Raise ValueError if the checkpoint ships no chat template."""
        if self.chat_template is None:
            raise ValueError(f"{self.directory}: the checkpoint has no chat template (no chat_template.jinja, and "
                             f"no chat_template in tokenizer_config.json)")

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                            tools: list | None = None, tokenize: bool = False, **kwargs) -> str | list:
        """Render `messages` with the checkpoint's template (extra kwargs such as
        ``enable_thinking`` are passed to it). Returns the text, or ids if ``tokenize``. A conversation the
        template refuses (its ``raise_exception``) raises ValueError; a malformed or unsafe template CheckpointError."""
        self.require_chat_template()
        if kwargs.get("enable_thinking", 0) is None:
            kwargs.pop("enable_thinking")          # None: the template's default
        messages = _normalize_messages(messages)
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
                json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                self._template = env.from_string(self.chat_template)
            except TemplateSyntaxError as e:
                raise CheckpointError(f"{self.directory}: the chat template is malformed: {e}") from None
        try:
            text = self._template.render(messages=list(messages), tools=tools,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self._token_setting("bos_token") or "",
                                         eos_token=self.eos_token or "", **kwargs)
        except SecurityError as e:    # the template reached for what the sandbox forbids: not the user's input
            raise CheckpointError(f"{self.directory}: the chat template does something the sandbox forbids: {e}") from None
        except TemplateError as e:    # raise_exception() in the template, or an undefined it cannot use
            raise ValueError(f"the chat template cannot render this conversation: {e}") from None
        return self.encode(text) if tokenize else text

    def __repr__(self) -> str:
        return f"Tokenizer({self.vocab_size} ids, chat template: {'yes' if self.chat_template else 'no'})"


class StreamDecoder:
    """Incremental detokenization that never emits broken UTF-8.

    ``add(id)`` returns the text that token completes. For byte-level BPE the token bytes are accumulated and
    decoded with an incremental UTF-8 decoder, so a character split over several tokens (CJK, emoji, ...) is
    emitted whole by the token that completes it, and the concatenation of all pieces plus ``flush()`` equals
    ``tokenizer.decode(ids)`` (invalid byte sequences become U+FFFD there too). Other tokenizers fall back to
    decoding the whole sequence and emitting the new suffix once it no longer ends in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list = []
        self._emitted = ""

    def add(self, token_id: int) -> str:
        """The text `token_id` completes ("" while a character is incomplete)."""
        t = self.tokenizer
        i = int(token_id)
        if self.skip_special_tokens and i in t.special_ids:
            return ""
        if t.byte_level:
            return self._utf8.decode(t.token_bytes(i), final=False)
        self._ids.append(i)
        full = t.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
        if full.endswith("\ufffd") or not full.startswith(self._emitted):
            return ""
        new, self._emitted = full[len(self._emitted):], full
        return new

    def flush(self) -> str:
        """Whatever is still held (an incomplete character at the very end becomes U+FFFD)."""
        if self.tokenizer.byte_level:
            return self._utf8.decode(b"", final=True)
        full = self.tokenizer.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
        new = full[len(self._emitted):] if full.startswith(self._emitted) else ""
        self._emitted = full
        return new


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None if it ships no tokenizer.json."""
    if not os.path.exists(os.path.join(os.fspath(directory), "tokenizer.json")):
        return None
    return Tokenizer(directory)

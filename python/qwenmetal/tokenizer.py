"""Tokenizer and chat template from a checkpoint's own files.

Encoding/decoding uses HF ``tokenizers`` on ``tokenizer.json``; added tokens listed only in
``tokenizer_config.json``'s ``added_tokens_decoder`` are added too (model-spec §8.1). The chat
template (``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``) is rendered
with jinja2's sandbox, so a template from a downloaded checkpoint cannot run arbitrary code.
"""
from __future__ import annotations

import json
import os

from .errors import CheckpointError


def _raise_exception(msg):
    from jinja2.exceptions import TemplateError
    raise TemplateError(msg)


class Tokenizer:
    def __init__(self, directory: str | os.PathLike):
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFTokenizer

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

    def token_to_id(self, token: str):
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int):
        return self._tok.id_to_token(int(i))

    def _token_setting(self, name):
        v = self.config.get(name)
        if isinstance(v, dict):
            v = v.get("content")
        return v

    @property
    def eos_token(self):
        return self._token_setting("eos_token")

    @property
    def eos_token_id(self):
        t = self.eos_token
        return None if t is None else self.token_to_id(t)

    # ---- text ---------------------------------------------------------------------------
    def encode(self, text: str) -> list:
        """Token ids for `text`. No BOS is added; special-token strings map to their ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ---- chat ---------------------------------------------------------------------------
    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, tools=None,
                            tokenize: bool = False, **kwargs):
        """Render `messages` with the checkpoint's template (extra kwargs such as
        ``enable_thinking`` are passed to it). Returns the text, or ids if ``tokenize``."""
        if self.chat_template is None:
            raise ValueError(f"{self.directory}: the checkpoint has no chat template")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
                json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(self.chat_template)
        text = self._template.render(messages=list(messages), tools=tools,
                                     add_generation_prompt=add_generation_prompt,
                                     bos_token=self._token_setting("bos_token") or "",
                                     eos_token=self.eos_token or "", **kwargs)
        return self.encode(text) if tokenize else text

    def __repr__(self) -> str:
        return f"Tokenizer({self.vocab_size} ids, chat template: {'yes' if self.chat_template else 'no'})"


def load_tokenizer(directory):
    """The checkpoint's tokenizer, or None if it ships no tokenizer.json."""
    if not os.path.exists(os.path.join(os.fspath(directory), "tokenizer.json")):
        return None
    return Tokenizer(directory)

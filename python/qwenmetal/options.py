"""`GenerationOptions`: the one description of how to sample and when to stop.

``Model.generate`` / ``Model.chat`` (from their keyword arguments), the CLI (`from_cli_args`) and the server
(from the request body) all build one, and its constructor is the one place these options are checked: an
invalid value raises `qwenmetal.errors.InputError` (a ValueError) naming the option, before any work.

    opts = GenerationOptions(max_tokens=64, temperature=0.7, stop=["\\n\\n"])
    model.generate("Hello", options=opts)
    model.generate("Hello", options=opts, seed=3)          # keyword arguments override fields of `options`
"""
from __future__ import annotations

import argparse
import dataclasses
import numbers
import re
from dataclasses import dataclass

from .errors import InputError
from .grammar import Grammar
from .sampling import SAMPLING_KEYS, Sampler, check_sampling, config_defaults


@dataclass(frozen=True)
class GenerationOptions:
    """Sampling and stopping options (immutable; checked when made; ``dataclasses.replace`` re-checks).

    Sampling parameters left as None take the checkpoint's generation_config.json value (see
    `with_defaults`), else the `Sampler` default (greedy). ``stop``: strings that end the generation
    (matched across tokens, not emitted; non-empty); ``stop_token_ids``: extra stop ids; ``ignore_eos``:
    do not stop at the model's eos ids; ``logprobs`` / ``top_logprobs``: report the chosen token's
    log-probability / that many alternatives; ``skip_special_tokens``: leave special tokens out of the text;
    ``grammar``: a `qwenmetal.grammar.Grammar` every generated token must keep the text within (structured
    output: JSON Schema, regular expressions, Lark grammars, chat replies with tool calls);
    ``thinking_budget``: at most this many tokens of thinking when the prompt leaves the model inside
    ``<think>`` (a chat turn with thinking on), then a short note and ``</think>`` are forced and the answer
    follows (`qwenmetal.grammar.ThinkingBudget`); a prompt that does not open a think block ignores it.
    """

    max_tokens: int = 256
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    grammar: Grammar | None = None
    thinking_budget: int | None = None

    def __post_init__(self) -> None:
        def put(name, value):
            object.__setattr__(self, name, value)

        put("max_tokens", _count("max_tokens", self.max_tokens, 1))
        for k in SAMPLING_KEYS:
            v = getattr(self, k)
            if v is not None:
                put(k, check_sampling(k, v))
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise InputError(f"stop must be a string or a list of strings, got {self.stop!r}", "stop")
        if any(s == "" for s in stop):
            raise InputError("stop strings must be non-empty (an empty one would stop before any text)", "stop")
        put("stop", tuple(stop))
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise InputError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}",
                             "stop_token_ids")
        put("stop_token_ids", tuple(_count("stop_token_ids", i, 0) for i in ids))
        for k in ("ignore_eos", "logprobs", "skip_special_tokens"):
            if not isinstance(getattr(self, k), bool):
                raise InputError(f"{k} must be a boolean, got {getattr(self, k)!r}", k)
        put("top_logprobs", _count("top_logprobs", self.top_logprobs, 0))
        if self.thinking_budget is not None:
            put("thinking_budget", _count("thinking_budget", self.thinking_budget, 0))
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise InputError(f"grammar must be a qwenmetal.Grammar (Grammar.json_schema(...), Grammar.regex(...), "
                             f"Grammar.lark(...)), got {type(self.grammar).__name__}", "grammar")

    @classmethod
    def build(cls, options: "GenerationOptions | None" = None, **overrides) -> "GenerationOptions":
        """`options` (default: all defaults) with the ``overrides`` that are not None replacing its fields."""
        if options is None:
            options = cls()
        elif not isinstance(options, cls):
            raise InputError(f"options must be a GenerationOptions, got {type(options).__name__}", "options")
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unknown generation option(s): {', '.join(unknown)}")
        given = {k: v for k, v in overrides.items() if v is not None}
        return dataclasses.replace(options, **given) if given else options

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "GenerationOptions":
        """The options of a parsed ``qwenmetal generate`` / ``chat`` command line (see `cli`)."""
        return cls.build(max_tokens=args.max_tokens, **{k: getattr(args, k) for k in SAMPLING_KEYS},
                         stop=[unescape_stop(x) for x in args.stop] if args.stop else None,
                         ignore_eos=getattr(args, "ignore_eos", None),
                         thinking_budget=getattr(args, "thinking_budget", None))

    @property
    def sampling(self) -> dict:
        """The sampling parameters that are set (not None)."""
        return {k: getattr(self, k) for k in SAMPLING_KEYS if getattr(self, k) is not None}

    def with_defaults(self, generation_config: dict | None) -> "GenerationOptions":
        """These options with unset sampling parameters taken from a checkpoint's generation_config.json
        (``do_sample: false`` there means greedy: temperature 0). Values it holds that are not valid for
        qwenmetal raise InputError naming the option."""
        kw = {k: v for k, v in config_defaults(generation_config).items() if getattr(self, k) is None}
        return dataclasses.replace(self, **kw) if kw else self

    def sampler(self, generation_config: dict | None = None) -> Sampler:
        """A new `Sampler` for these options (unset parameters from `generation_config`, see `with_defaults`)."""
        return Sampler(**self.with_defaults(generation_config).sampling)


def _count(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise InputError(f"{name} must be an integer >= {lo}, got {v!r}", name)
    if v < lo:
        raise InputError(f"{name} must be an integer >= {lo}, got {v}", name)
    return int(v)


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape_stop(text: str) -> str:
    """`--stop` values as a shell passes them: \\n, \\t, \\r and \\\\ become newline, tab, return and a
    backslash (so `--stop "\\n\\n"` stops at a blank line); any other backslash stays as it is."""
    return re.sub(r"\\([ntr\\])", lambda m: _ESCAPES[m.group(1)], text)

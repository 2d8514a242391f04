"""Constrained generation: a `Grammar` is a token mask applied at every sampled token (structured output).

    g = Grammar.json_schema({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    model.generate(prompt, grammar=g)        # every token keeps the text a prefix of a valid instance

The engine is llguidance (PyPI ``llguidance``, MIT): it compiles JSON Schema, regular expressions and
Lark-like context-free grammars (with JSON Schema inlined as ``%json {...}``) against the tokenizer's
vocabulary, and computes the set of allowed next tokens in tens of microseconds, lazily, with no
per-grammar precomputation over the vocabulary -- so a request's own schema costs nothing up front. It
also rolls back consumed tokens, which speculative decoding needs (drafts are checked against the mask,
then rejected tokens are undone). xgrammar needs torch-shaped tensors or a per-grammar compile step, and
outlines-core builds an index over the whole vocabulary per schema (seconds for a 248k vocabulary); both
lack Lark grammars with inline JSON Schema, which the tool-call format below needs.

`Grammar` is immutable and shareable (it holds the grammar's text); `Grammar.matcher(model)` makes the
per-generation state (`GrammarMatcher`): ``allowed()`` / ``bitmask()`` for the next token, ``advance(t)``
after it is sampled, ``rollback(n)``. Where each backend applies the mask: docs/structured-output.md.

`reply_grammar` builds the grammar of a whole chat reply in Qwen3.5/3.6's format: an optional think block,
then free text, a JSON answer (``response_format``) and/or tool calls (``<tool_call><function=NAME>
<parameter=KEY>VALUE</parameter>...``) whose parameters follow each tool's JSON Schema.
"""
from __future__ import annotations

import functools
import json
import re
import sys
import threading
import weakref
from collections import OrderedDict
from typing import Sequence

import llguidance
import numpy as np

from .errors import InputError, brief

#: JSON written as ``json.dumps`` writes it (", " and ": "), with no free whitespace: a model cannot
#: loop on whitespace, and the text is what the model was trained to write
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(InputError):
    """A grammar or schema that does not compile, or a token the grammar does not allow."""


class Grammar:
    """A constraint on generated text, as llguidance grammar text (`Grammar.json_schema`, `json_object`,
    `regex`, `lark`, or `reply_grammar` for chat replies). ``description`` says what it is (for errors)."""

    def __init__(self, source: str, description: str):
        self.source = source
        self.description = description

    def __repr__(self) -> str:
        return f"Grammar({self.description})"

    @classmethod
    def json_schema(cls, schema: dict, param: str = "schema") -> "Grammar":
        """Text that is one JSON instance of `schema` (a JSON Schema object), written compactly."""
        if not isinstance(schema, dict):
            raise GrammarError(f"{param} must be a JSON Schema object, got {brief(schema)}", param, "invalid_schema")
        try:
            source = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{param}: {_error_text(str(e))}", param, "invalid_schema") from None
        return cls(source, "a JSON schema").checked(param)

    @classmethod
    def json_object(cls) -> "Grammar":
        """Any JSON object."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str, param: str = "regex") -> "Grammar":
        """Text matching the regular expression `pattern` (Rust regex syntax) in full."""
        if not isinstance(pattern, str):
            raise GrammarError(f"{param} must be a string, got {brief(pattern)}", param)
        return cls(llguidance.LLMatcher.grammar_from_regex(pattern), "a regular expression").checked(param)

    @classmethod
    def lark(cls, text: str, param: str = "grammar") -> "Grammar":
        """A Lark-like grammar (llguidance's syntax: ``start: ...``, ``%json {...}`` inline schemas)."""
        if not isinstance(text, str):
            raise GrammarError(f"{param} must be a string, got {brief(text)}", param)
        return cls(llguidance.LLMatcher.grammar_from_lark(text), "a Lark grammar").checked(param)

    def checked(self, param: str) -> "Grammar":
        """This grammar, after llguidance compiled it (without a tokenizer); GrammarError naming `param`."""
        is_error, messages = _validated(self.source)
        if is_error:
            raise GrammarError(f"{param}: {_error_text(messages)}", param, "invalid_schema")
        return self

    def matcher(self, model) -> "GrammarMatcher":
        """The per-generation state of this grammar for `model` (its tokenizer, logits width and eos ids)."""
        tok = model.tokenizer
        if tok is None:
            raise InputError(f"{model.path}: no tokenizer.json, so output cannot be constrained by a grammar",
                             "grammar")
        return GrammarMatcher(self, *_compiled(tok, model.config.vocab_size, tuple(model.eos_token_ids),
                                               self.source))


@functools.lru_cache(maxsize=256)
def _validated(source: str) -> tuple:
    """llguidance's (is_error, messages) for a grammar's text, kept: an agent sends the same tools every turn
    (20 tools' reply grammar: about 20 ms to compile)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source)
    return is_error, tuple(messages)


def warm_up(model) -> None:
    """Build llguidance's view of `model`'s tokenizer now (seconds for the real vocabulary), so the first
    constrained generation does not wait for it (the server does this on a thread when it starts)."""
    if model.tokenizer is not None:
        _ll_tokenizer(model.tokenizer, model.config.vocab_size, tuple(model.eos_token_ids))


#: per tokenizer: {(logits width, eos ids): (llguidance tokenizer, {grammar text: a matcher never advanced})}
_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()
MAX_COMPILED = 64                  # compiled grammars kept per tokenizer (least recently used out)


def _ll_tokenizer(tok, n_vocab: int, eos: tuple) -> tuple:
    """(llguidance's view of `tok`, its compiled grammars), built once per tokenizer, vocabulary width and eos
    ids: a few seconds for the 248k vocabulary; a second caller waits for the first."""
    with _TOKENIZERS_LOCK:
        per = _TOKENIZERS.setdefault(tok, {})
        key = (n_vocab, eos)
        if key not in per:
            per[key] = (llguidance.LLTokenizer(tok.to_json(), n_vocab=n_vocab, eos_token=list(eos)), OrderedDict())
        return per[key]


def _compiled(tok, n_vocab: int, eos: tuple, source: str) -> tuple:
    """(a fresh matcher of the grammar `source` for `tok`, the logits width): a copy of the kept compiled one
    (compiling against the vocabulary takes about 40 ms for an agent's 20 tools; a copy, microseconds)."""
    llt, kept = _ll_tokenizer(tok, n_vocab, eos)
    with _TOKENIZERS_LOCK:
        proto = kept.get(source)
        if proto is not None:
            kept.move_to_end(source)
            return proto.deep_copy(), llt.vocab_size
    proto = llguidance.LLMatcher(llt, source)
    if proto.is_error():
        raise GrammarError(f"grammar: {_error_text(proto.get_error())}", "grammar", "invalid_schema")
    with _TOKENIZERS_LOCK:
        kept[source] = proto
        while len(kept) > MAX_COMPILED:
            kept.popitem(last=False)
        return proto.deep_copy(), llt.vocab_size


class GrammarMatcher:
    """One generation's position in a `Grammar`: the tokens it allows next, advanced token by token."""

    def __init__(self, grammar: Grammar, matcher, n_vocab: int):
        self.grammar = grammar
        self.n_vocab = n_vocab
        self._m = matcher                  # an llguidance.LLMatcher of this generation alone
        self.consumed = 0

    def bitmask(self) -> np.ndarray:
        """The allowed next tokens as uint32 words, bit i % 32 of word i // 32 (ceil(vocab / 32) words)."""
        words = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint32)
        return words[:(self.n_vocab + 31) // 32]              # (llguidance pads a word)

    def allowed(self, n: int | None = None) -> np.ndarray:
        """The allowed next tokens as a bool array over the first `n` ids (default: the whole vocabulary)."""
        bits = np.unpackbits(self.bitmask().view(np.uint8), bitorder="little")
        return bits[:self.n_vocab if n is None else n].astype(bool)

    def advance(self, token: int) -> None:
        """`token` was generated: move past it (GrammarError if the grammar does not allow it)."""
        if not self._m.consume_token(int(token)):
            raise GrammarError(f"token {int(token)} is not allowed by {self.grammar.description} here: "
                               f"{_error_text(self._m.get_error())}", "grammar")
        self.consumed += 1

    def rollback(self, n: int) -> None:
        """Undo the last `n` tokens."""
        if n:
            if n > self.consumed or not self._m.rollback(int(n)):
                raise GrammarError(f"cannot roll the grammar back by {n} tokens", "grammar")
            self.consumed -= n

    def free_steps(self) -> int:
        """How many next tokens may be sampled without this mask: none (every token needs it)."""
        return 0

    @property
    def done(self) -> bool:
        """The grammar allows nothing more but the end of the text."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is complete (the end is allowed)."""
        return self._m.is_accepting()


#: what a thinking model is given when its thinking budget runs out, before the think block is closed: the
#: stop-thinking instruction the Qwen3 technical report inserts when it halts thinking at a budget
BUDGET_NOTE = ("\n\nConsidering the limited time by the user, I have to give the solution based on the "
               "thinking directly now.\n")


class ThinkingBudget:
    """A generation that starts inside a think block, with at most `budget` tokens of thinking: once the
    thinking has used ``budget - len(note)`` tokens without closing the block, `BUDGET_NOTE` and then
    ``</think>`` are forced (a mask allowing one token), so the block closes after at most `budget` tokens
    (``</think>`` not counted) and the answer follows. A budget shorter than the note forces ``</think>``
    alone. Until the forcing starts the tokens are free (`free_steps`), so the GPU decode loop keeps running
    ahead; `inner`, the generation's grammar if it has one, applies throughout.

    The same interface as `GrammarMatcher` (``allowed`` / ``bitmask`` / ``advance`` / ``rollback`` /
    ``free_steps``); ``allowed`` is None where nothing is constrained."""

    def __init__(self, inner: GrammarMatcher | None, note: Sequence[int], close_id: int, budget: int,
                 n_vocab: int):
        self.inner, self.close_id, self.n_vocab, self.budget = inner, int(close_id), int(n_vocab), int(budget)
        note = [int(t) for t in note] if len(note) <= budget else []
        self.forced = note + [self.close_id]
        self.start = self.budget - len(note)      # thinking tokens before the forcing starts
        self.thought = 0                          # thinking tokens so far (``</think>`` not counted)
        self.closed = False
        self._trace: list = []                    # (thought, closed) before each advance, for rollback

    def _forced(self) -> int | None:
        """The token the budget forces next (None: none)."""
        return None if self.closed or self.thought < self.start else self.forced[self.thought - self.start]

    def free_steps(self) -> int:
        """How many next tokens may be sampled with no mask at all (before the forcing starts)."""
        if self.inner is not None:
            return 0
        return sys.maxsize if self.closed else self.start - self.thought

    def allowed(self, n: int | None = None) -> np.ndarray | None:
        """The allowed next tokens as a bool array over the first `n` ids; None when any token is."""
        f = self._forced()
        if f is not None:
            out = np.zeros(self.n_vocab if n is None else n, dtype=bool)
            out[f] = True
            return out
        return self.inner.allowed(n) if self.inner is not None else None

    def bitmask(self) -> np.ndarray:
        """The allowed next tokens as uint32 words (as `GrammarMatcher.bitmask`)."""
        f = self._forced()
        if f is None and self.inner is not None:
            return self.inner.bitmask()
        words = np.zeros((self.n_vocab + 31) // 32, dtype=np.uint32)
        if f is not None:
            words[f // 32] = np.uint32(1 << (f % 32))
        else:
            words[:] = 0xFFFFFFFF
            if self.n_vocab % 32:
                words[-1] = np.uint32((1 << (self.n_vocab % 32)) - 1)
        return words

    def advance(self, token: int) -> None:
        """`token` was generated (GrammarError if the budget forced another one, or the grammar refuses it)."""
        t = int(token)
        f = self._forced()
        if f is not None and t != f:
            raise GrammarError(f"token {t} generated where the thinking budget ({self.budget} tokens) forces "
                               f"token {f}", "thinking_budget")
        if self.inner is not None:
            self.inner.advance(t)
        self._trace.append((self.thought, self.closed))
        if not self.closed:
            if t == self.close_id:
                self.closed = True
            else:
                self.thought += 1

    def rollback(self, n: int) -> None:
        """Undo the last `n` tokens."""
        if n:
            if n > len(self._trace):
                raise GrammarError(f"cannot roll the thinking budget back by {n} tokens", "thinking_budget")
            if self.inner is not None:
                self.inner.rollback(n)
            self.thought, self.closed = self._trace[-n]
            del self._trace[-n:]


def thinking_budget(model, context: Sequence[int], budget: int, inner: GrammarMatcher | None = None):
    """`inner` with at most `budget` tokens of thinking (a `ThinkingBudget`) when `context` -- the session's
    tokens and the prompt -- leaves the model inside ``<think>`` (its last ``<think>`` comes after its last
    ``</think>``); `inner` as it is otherwise (a reply that does not think has nothing to bound)."""
    tok = model.tokenizer
    if tok is None:
        raise InputError(f"{model.path}: no tokenizer.json, so thinking cannot be bounded", "thinking_budget")
    open_id, close_id = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    if open_id is None or close_id is None:
        raise InputError(f"{model.path}: its tokenizer has no <think> and </think> tokens, so thinking_budget "
                         f"has nothing to bound", "thinking_budget")
    for t in reversed(context):
        if t == close_id:
            return inner
        if t == open_id:
            return ThinkingBudget(inner, tok.encode(BUDGET_NOTE), close_id, budget, model.config.vocab_size)
    return inner


def _error_text(messages) -> str:
    if isinstance(messages, (list, tuple)):
        messages = "; ".join(str(m) for m in messages if m)
    return str(messages).strip() or "invalid grammar"


# ---------------------------------------------------------------------------------------------------
# chat replies in Qwen3.5/3.6's format
# ---------------------------------------------------------------------------------------------------
def _lit(s: str) -> str:
    """`s` as a Lark string literal."""
    return json.dumps(s, ensure_ascii=False)


def _json_rule(schema: dict, lenient: bool = False) -> str:
    """`schema` inlined in a Lark grammar; `lenient`: keywords llguidance does not implement (formats, say)
    are ignored rather than refused (tool schemas from agents carry many)."""
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_STYLE, "lenient": lenient}}, ensure_ascii=False)


def tool_spec(tool: dict) -> tuple[str, dict]:
    """(name, parameters schema) of an OpenAI-style tool ``{"type": "function", "function": {...}}`` (or the
    bare function object)."""
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise GrammarError(f"each tool must have a function with a non-empty string name, got {brief(tool)}",
                           "tools")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise GrammarError(f"tool {fn['name']!r}: parameters must be a JSON Schema object, got {brief(params)}",
                           "tools")
    return fn["name"], params


def string_parameter(schema) -> bool:
    """Whether a tool parameter is written raw (not as JSON) in a tool call: its schema's type is "string"
    (Qwen's chat template writes string values as they are, everything else as JSON)."""
    return isinstance(schema, dict) and schema.get("type") == "string"


def _length(v, default):
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default


def _function_rules(i: int, name: str, params: dict) -> list[str]:
    """Rules ``f{i}`` (what follows ``<function=``: the name, the parameters, ``</function>``)."""
    if name != name.strip() or re.search(r"[>\n]", name):
        raise GrammarError(f"tool name {name!r} cannot be written in a tool call (no '>', newlines or edge spaces)",
                           "tools")
    props = params.get("properties") or {}
    if not isinstance(props, dict):
        raise GrammarError(f"tool {name!r}: parameters.properties must be an object", "tools")
    required = set(params.get("required") or ())
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    rules, seq = [], []
    for j, (key, schema) in enumerate(props.items()):
        if re.search(r"[>\n]", key):
            raise GrammarError(f"tool {name!r}: parameter name {key!r} cannot be written in a tool call", "tools")
        if not isinstance(schema, dict):
            schema = {}
        p, v = f"p{i}_{j}", f"v{i}_{j}"
        enum = schema.get("enum") if isinstance(schema.get("enum"), list) else (
            [schema["const"]] if "const" in schema else None)
        if string_parameter(schema) and enum and all(isinstance(e, str) for e in enum):
            rules.append(f"{v}: ({' | '.join(_lit(e) for e in enum)}) {_lit(chr(10) + '</parameter>' + chr(10))}")
        elif string_parameter(schema):            # raw text up to the close tag, within min/maxLength
            lo, hi = _length(schema.get("minLength"), 0), _length(schema.get("maxLength"), None)
            span = "*" if lo == 0 and hi is None else f"{{{lo},{'' if hi is None else hi}}}"
            rules.append(f"{v}[lazy]: /(?s:.{span})\\n<\\/parameter>\\n/")
        else:
            rules.append(f"{v}: {_json_rule({**schema, **defs}, lenient=True)} "
                         f"{_lit(chr(10) + '</parameter>' + chr(10))}")
        rules.append(f"{p}: {_lit('<parameter=' + key + '>' + chr(10))} {v}")
        seq.append(p if key in required else p + "?")
    rules.append(f"f{i}: {_lit(name + '>' + chr(10))} {' '.join(seq)} {_lit('</function>')}")
    return rules


#: the tags of Qwen's reply format that its tokenizers hold as single (added) tokens; a reply ends with the
#: end-of-turn token the chat template writes (not another end id, so the next turn continues its transcript)
REPLY_TAGS = ("<tool_call>", "</tool_call>", "</think>", "<|im_end|>")


def reply_grammar(*, thinking: bool, tools: Sequence[dict] | None = None, tool_choice="auto",
                  parallel_tool_calls: bool = True, answer_schema: dict | None = None,
                  token_tags: Sequence[str] = REPLY_TAGS) -> Grammar | None:
    """The grammar of a chat reply, or None when nothing is constrained.

    `thinking`: the prompt leaves the model inside ``<think>`` (the reply closes it first, freely).
    `tools` (OpenAI form) with `tool_choice` "auto" (free text, or text then tool calls), "required" (tool
    calls only), "none" (no calls) or a function name (one call of that function): every call's
    parameters follow its tool's schema. `answer_schema`: the answer (when it is not tool calls) is one
    JSON instance of this schema (``response_format``). `parallel_tool_calls` False: at most one call.
    `token_tags`: the tags of `REPLY_TAGS` that the tokenizer holds as tokens (llguidance matches those as
    tokens, never as text; the others are matched as text)."""

    def tag(t):
        return t if t in token_tags else _lit(t)
    specs = [tool_spec(t) for t in tools or ()] if tool_choice != "none" else []
    names = [n for n, _ in specs]
    if isinstance(tool_choice, str) and tool_choice not in ("auto", "required", "none"):
        if tool_choice not in names:
            raise GrammarError(f"tool_choice names the function {tool_choice!r}, which is not among the tools "
                               f"({', '.join(names) or 'none given'})", "tool_choice", "invalid_value")
        specs = [s for s in specs if s[0] == tool_choice]
    if tool_choice in ("required",) and not specs:
        raise GrammarError("tool_choice 'required' needs tools", "tool_choice", "invalid_value")
    if not specs and answer_schema is None:
        return None
    rules = []
    if answer_schema is not None:
        Grammar.json_schema(answer_schema, "response_format")      # its own error first
        rules.append(f"answer: /\\n{{0,2}}/ {_json_rule(answer_schema)}")
    else:
        rules.append("answer: TEXT")
        rules.append("TEXT: /(?s:.*)/" + ("" if "<tool_call>" in token_tags else " & ~/(?s:.*)<tool_call>(?s:.*)/"))
    body = "answer"
    if specs:
        seen = set()
        for i, (name, params) in enumerate(specs):
            if name in seen:
                raise GrammarError(f"two tools are named {name!r}", "tools")
            seen.add(name)
            rules += _function_rules(i, name, params)
        rules.append(f"call_body: {_lit(chr(10) + '<function=')} "
                     f"({' | '.join(f'f{i}' for i in range(len(specs)))}) {_lit(chr(10))} {tag('</tool_call>')}")
        rules.append(f"call: {tag('<tool_call>')} call_body")
        more = f" ({_lit(chr(10))} call)*" if parallel_tool_calls else ""
        if tool_choice != "auto":                  # calls only
            rules.append(f"calls: call{more}")
        elif "<tool_call>" in token_tags:          # free text, then calls (the text cannot hold the token)
            rules.append(f"calls: TEXT call{more}")
        else:                                      # free text up to the first "<tool_call>", then calls
            rules.append("lead[lazy]: /(?s:.*)<tool_call>/")
            rules.append(f"calls: lead call_body{more}")
        body = "calls" if tool_choice != "auto" else "answer | calls"
    end = " <|im_end|>" if "<|im_end|>" in token_tags else ""
    if thinking:
        if "</think>" in token_tags:
            rules.append(f"think: THINK {tag('</think>')}")
            rules.append("THINK: /(?s:.*)/")
        else:
            rules.append("think[lazy]: /(?s:.*)<\\/think>/")
        rules.append("WS: /\\n{0,2}/")
        start = f"start: think WS ({body}){end}"
    else:
        start = f"start: ({body}){end}"
    what = "the reply format" + (" with tool calls" if specs else "") + (
        " with a JSON answer" if answer_schema is not None else "")
    g = Grammar("\n".join([start] + rules), what)
    return Grammar(llguidance.LLMatcher.grammar_from_lark(g.source), what).checked(
        "tools" if specs else "response_format")

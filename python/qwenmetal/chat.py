"""Chat: the one validation of OpenAI-style messages, the one chat turn, and the parsing of a reply.

    turn = chat_turn(model, messages, tools=tools)          # validate, render, cache point of the history
    for out in turn.generate(model, options): ...           # stream GenerationOutputs
    reply = turn.response(outputs)                           # ChatResponse: reasoning, content, tool calls

`Model.chat`, the CLI's ``generate --chat`` and ``chat`` commands and the server's ``/v1/chat/completions``
all go through :func:`chat_turn`, so they render, cache and parse a conversation the same way (the server
keeps its own streaming format). Replies are split as Qwen3.5/3.6 writes them: a ``<think>`` block
(reasoning), the answer (content), and, when the request offers ``tools``, ``<tool_call>`` blocks.
"""
from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from .errors import InputError, brief
from .generation import GenerationOutput
from .grammar import REPLY_TAGS, Grammar, reply_grammar, string_parameter
from .options import GenerationOptions
from .prompt_images import (
    PromptImages,
    check_image_part,
    expanded_index,
    is_image_part,
    part_source,
    place_images,
    preprocess_for,
)
from .session import ModelBase
from .transcripts import chat_prompt, remember_reply

#: roles a message may have ("developer" is OpenAI's newer name for "system" and is rendered as one)
ROLES = ("system", "developer", "user", "assistant", "tool")


def validate_messages(messages: object) -> list[dict]:
    """`messages` checked and normalised for the chat template: a non-empty list of objects, each with a
    ``role`` in `ROLES`; ``content`` a string, None (made "") or a list of ``{"type": "text", "text": str}``
    parts and, in user messages, image parts (``{"type": "image_url", "image_url": {"url": ...}}`` or
    ``{"type": "image", "image": ...}``; read by :func:`chat_turn`); ``tool_calls`` (if present) a list of ``{"function": {"name": str, "arguments": str | object}}``;
    ``reasoning_content``, ``name`` and ``tool_call_id`` strings. "developer" becomes "system". Raises
    `InputError` (a ValueError) naming the first offending ``messages[i]...``; the input is not modified."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError(f"messages must be a non-empty list of message objects, got {brief(messages)}",
                         "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InputError(f"{where} must be an object with a role in {list(ROLES)}, got {brief(m)}", where)
        m = dict(m)
        c = m.get("content")
        if c is None:
            m["content"] = ""
        elif isinstance(c, list):
            for j, p in enumerate(c):
                if is_image_part(p):
                    if m["role"] != "user":
                        raise InputError(f"{where}.content[{j}]: images go in user messages, not in "
                                         f"{m['role']} messages", f"{where}.content", "unsupported_value")
                    check_image_part(p, f"{where}.content[{j}]", f"{where}.content")
                    continue
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise InputError(f"{where}.content[{j}]: only text parts ({{'type': 'text', 'text': str}}) and "
                                     f"image parts ({{'type': 'image_url', 'image_url': {{'url': 'data:...'}}}}) are "
                                     f"supported, got {brief(p)}", f"{where}.content", "unsupported_value")
        elif not isinstance(c, str):
            raise InputError(f"{where}.content must be a string or a list of text parts, got {brief(c)}",
                             f"{where}.content")
        for k in ("reasoning_content", "name", "tool_call_id"):
            if m.get(k) is not None and not isinstance(m[k], str):
                raise InputError(f"{where}.{k} must be a string, got {brief(m[k])}", f"{where}.{k}")
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise InputError(f"{where}.tool_calls must be a list, got {brief(calls)}", f"{where}.tool_calls")
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                        and isinstance(fn.get("arguments", {}), (str, dict))):
                    raise InputError(f"{where}.tool_calls[{j}] must be an object with a 'function' holding a "
                                     f"string 'name' and 'arguments' (a JSON string or an object), got {brief(call)}",
                                     f"{where}.tool_calls")
        if m["role"] == "developer":
            m["role"] = "system"
        out.append(m)
    return out


def validate_tools(tools: object) -> list | None:
    """`tools` as the chat template takes them: None, or a list of objects (OpenAI function specs)."""
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise InputError(f"tools must be a list of objects, got {brief(tools)}", "tools")
    return tools


@dataclass(frozen=True)
class ChatTurn:
    """One rendered conversation, ready to answer (made by :func:`chat_turn`).

    ``prompt_ids``: the rendered prompt with the generation prompt; ``cache_point``: how many of them hold
    the conversation itself (the prefix cache keeps the state there, so the next turn, which extends the
    conversation, prefills only what is new; 0 if the template does not allow it); ``prompt_text``: the
    rendered text; ``thinking``: the prompt leaves the model inside a ``<think>`` block; ``tools``: the tools
    offered (tool calls are parsed only when there are some); ``keys``: the conversation's transcript keys
    (`qwenmetal.transcripts`; empty when transcripts are off), for `remember`; ``images``: the conversation's
    images placed at their pads in ``prompt_ids`` (`qwenmetal.prompt_images.PromptImages`), or None;
    ``grammar``: the constraint the reply follows (`qwenmetal.grammar.reply_grammar`: tool calls that match
    the tools' schemas, a JSON answer), or None."""

    messages: list = field(repr=False)
    prompt_ids: list = field(repr=False)
    cache_point: int
    prompt_text: str = field(repr=False)
    thinking: bool
    tools: list | None = field(default=None, repr=False)
    keys: list = field(default_factory=list, repr=False)
    images: PromptImages | None = field(default=None, repr=False)
    grammar: Grammar | None = field(default=None, repr=False)

    @property
    def cache_points(self) -> tuple:
        """``cache_points`` for `Model.generate`."""
        return (self.cache_point,) if self.cache_point else ()

    def generate(self, model: ModelBase, options: GenerationOptions | None = None,
                 **generate_kwargs) -> Iterator[GenerationOutput]:
        """`Model.generate` on the prompt, with the history's cache point (and the turn's grammar)."""
        if self.images is not None:
            generate_kwargs["images"] = self.images
        if self.grammar is not None and generate_kwargs.get("grammar") is None and (
                options is None or options.grammar is None):
            generate_kwargs["grammar"] = self.grammar
        return model.generate(self.prompt_ids, cache_points=self.cache_points, options=options, **generate_kwargs)

    def stream_parser(self) -> "ChatStreamParser":
        """A parser for this turn's streamed reply."""
        return ChatStreamParser(self.thinking, self.tools, parse_tools=bool(self.tools))

    def parse(self, text: str) -> tuple:
        """``(reasoning, content, tool_calls)`` of the reply `text`."""
        return parse_assistant(text, thinking=self.thinking, tools=self.tools, parse_tools=bool(self.tools))

    def response(self, outputs: Iterable[GenerationOutput]) -> "ChatResponse":
        """The `ChatResponse` of a complete generation (consumes `outputs`)."""
        outs = list(outputs)
        if not outs or outs[-1].finish_reason is None:
            raise ValueError("the generation ended without a result (cancelled?)")
        full = "".join(o.text for o in outs)
        reasoning, content, calls = self.parse(full)
        lps = [o.logprob for o in outs if o.logprob is not None]
        return ChatResponse(full, content, reasoning, calls, outs[-1].finish_reason, outs[-1].stats,
                            [o.token for o in outs], lps or None)

    def remember(self, model: ModelBase, message: dict, tokens: Sequence[int]) -> None:
        """Keep the transcript of this turn's reply: the generated `tokens`, appended to the conversation as
        `message` (as the caller sends it back next turn), so the next prompt continues them
        (`qwenmetal.transcripts.remember_reply`: only a reply that ended on an end id)."""
        remember_reply(model, self.prompt_ids, self.keys, message, tokens,
                       images=self.images.spans if self.images is not None else ())

    def remembering(self, model: ModelBase, outputs: Iterable[GenerationOutput]) -> Iterator[GenerationOutput]:
        """`outputs` passed through; when they are complete, the reply (`response`) is remembered."""
        outs = []
        for o in outputs:
            outs.append(o)
            yield o
        if outs and outs[-1].finish_reason is not None:
            r = self.response(outs)
            self.remember(model, r.message, r.tokens)


def chat_turn(model: ModelBase, messages: Sequence[dict], *, tools: list | None = None,
              enable_thinking: bool | None = None, template_kwargs: dict | None = None,
              allow_local_images: bool = True, tool_choice=None, response_format: dict | None = None,
              parallel_tool_calls: bool = True) -> ChatTurn:
    """Validate `messages` (:func:`validate_messages`) and `tools`, read their images (:func:`read_images`),
    render them with the checkpoint's chat template (``enable_thinking`` and `template_kwargs` go to the
    template; the prompt continues the transcript of the longest answered prefix, `Model.chat_prompt`),
    expand each image's placeholder to its pads and find the cache point of the history. Raises ValueError
    for invalid messages or a checkpoint without tokenizer.json or chat template (`check_chat_support`),
    for a conversation the template refuses, for images sent to a checkpoint without a vision tower, and
    `qwenmetal.errors.ImageError` for a bad image -- all before any work on the model.

    Structured replies (`qwenmetal.grammar`): with `tools`, every tool call the reply makes follows its
    tool's parameter schema; `tool_choice` (OpenAI's: None or "auto", "none", "required", or
    ``{"type": "function", "function": {"name": N}}``) decides whether the reply may, must or must not call
    them (and which); `parallel_tool_calls` False allows one call; `response_format` (OpenAI's:
    ``{"type": "text" | "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": {...}}}``)
    makes the answer one JSON instance. An invalid schema or choice raises `qwenmetal.grammar.GrammarError`
    (an InputError naming ``tools``, ``tool_choice`` or ``response_format``)."""
    msgs = validate_messages(messages)
    tools = validate_tools(tools)
    choice = normalize_tool_choice(tool_choice)
    answer_schema = response_schema(response_format)
    if not isinstance(parallel_tool_calls, bool):
        raise InputError(f"parallel_tool_calls must be a boolean, got {brief(parallel_tool_calls)}",
                         "parallel_tool_calls")
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise InputError(f"chat_template_kwargs must be a dict, got {brief(template_kwargs)}", "chat_template_kwargs")
    msgs, batch = read_images(model, msgs, allow_local=allow_local_images)
    p = chat_prompt(model, msgs, tools=tools, enable_thinking=enable_thinking, **(template_kwargs or {}))
    thinking = prompt_opens_thinking(p.text)
    tags = [t for t in REPLY_TAGS if model.tokenizer.token_to_id(t) is not None]
    grammar = reply_grammar(thinking=thinking, tools=tools, tool_choice=choice,
                            parallel_tool_calls=parallel_tool_calls, answer_schema=answer_schema, token_tags=tags)
    if batch is None:
        return ChatTurn(msgs, p.ids, p.head, p.text, thinking, tools, p.keys, grammar=grammar)
    placed = place_images(model, p.ids, batch)
    head = expanded_index(p.ids, model.config.image_token_id, p.head, placed)
    return ChatTurn(msgs, placed.ids, head, p.text, thinking, tools, p.keys, placed, grammar)


def normalize_tool_choice(tool_choice) -> str:
    """OpenAI's ``tool_choice`` as `qwenmetal.grammar.reply_grammar` takes it: "auto" (also for None),
    "none", "required", or the name of the one function to call (``{"type": "function", "function":
    {"name": N}}``; the Responses API's ``{"type": "function", "name": N}`` too)."""
    if tool_choice is None:
        return "auto"
    if tool_choice in ("auto", "none", "required"):
        return tool_choice
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else tool_choice.get("name")
        if isinstance(name, str) and name:
            return name
    raise InputError(f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'function': "
                     f"{{'name': ...}}}}, got {brief(tool_choice)}", "tool_choice", "invalid_value")


def response_schema(response_format) -> dict | None:
    """The JSON Schema an OpenAI ``response_format`` asks the answer to follow (None: free text)."""
    if response_format is None:
        return None
    rf = response_format
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise InputError(f"response_format must be {{'type': 'text' | 'json_object' | 'json_schema', ...}}, got "
                         f"{brief(rf)}", "response_format", "invalid_value")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return {"type": "object"}
    js = rf.get("json_schema")
    schema = js.get("schema") if isinstance(js, dict) else None
    if not isinstance(schema, dict):
        raise InputError("response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}} with the "
                         "schema an object", "response_format", "invalid_value")
    return schema


def read_images(model: ModelBase, messages: list, *, allow_local: bool = True) -> tuple:
    """The image parts of validated `messages`, decoded and preprocessed (`qwenmetal.images`), in order:
    ``(messages with each image part replaced by {"type": "image", "digest": <its content hash>}, the
    `ImageBatch` or None without images)``. The replaced parts are what the chat template renders (Qwen's
    templates write ``<|vision_start|><|image_pad|><|vision_end|>`` for a part of type "image") and what names
    the image in transcript keys. `allow_local`: take file paths and ``file://`` URLs (the server only with
    ``--allow-local-images``). InputError for a checkpoint without a tower, ImageError for a bad image."""
    sources, where = [], []
    for i, m in enumerate(messages):
        c = m.get("content")
        if isinstance(c, list):
            for j, part in enumerate(c):
                if is_image_part(part):
                    w = f"messages[{i}].content[{j}]"
                    sources.append(part_source(part, w, allow_local))
                    where.append(w)
    if not sources:
        return messages, None
    try:
        batch = preprocess_for(model, sources)
    except InputError as e:                    # name the message part (ImageError keeps its class)
        if e.param is not None and e.param.startswith("images[") and len(where) > 1:
            k = int(e.param[len("images["):-1])
            msg = str(e).split(": ", 1)[1] if str(e).startswith(f"image {k}: ") else str(e)
            raise type(e)(f"{where[k]}: {msg}", where[k], e.code) from None
        if len(where) == 1 and e.param in ("image", "images[0]"):
            raise type(e)(f"{where[0]}: {e}", where[0], e.code) from None
        raise
    out, k = [], 0
    for m in messages:
        c = m.get("content")
        if isinstance(c, list) and any(is_image_part(p) for p in c):
            parts = []
            for p in c:
                if is_image_part(p):
                    parts.append({"type": "image", "digest": batch.hashes[k]})
                    k += 1
                else:
                    parts.append(p)
            m = dict(m, content=parts)
        out.append(m)
    return out, batch


# ---------------------------------------------------------------------------------------------------
# replies
# ---------------------------------------------------------------------------------------------------
def _param_schemas(tools, name) -> dict:
    """The parameter schemas of the tool called `name` (empty if there is none)."""
    for t in tools or ():
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return props if isinstance(props, dict) else {}
    return {}


def parse_tool_calls(text: str, tools: list | None = None) -> list:
    """Tool calls in Qwen3.5/3.6's XML format (``<tool_call><function=NAME><parameter=ARG>VALUE``...) as
    ``[{"name": ..., "arguments": {...}}]`` (`ChatStreamParser`'s reading of `text` as a reply). Values are
    JSON-decoded unless the tool's schema says ``string`` (or they are not valid JSON)."""
    p = ChatStreamParser(False, tools)
    return reply_events_merged(p.feed(text) + p.finish())[2]


def parse_assistant(text: str, *, thinking: bool = False, tools: list | None = None,
                    parse_tools: bool = True) -> tuple:
    """Split a generated reply into ``(reasoning, content, tool_calls)``, as `ChatStreamParser` splits it
    streamed (so a reply reads the same streamed or not). ``thinking``: the prompt ended inside a
    ``<think>`` block (Qwen3.5/3.6 with thinking on), so the reply is reasoning up to the first ``</think>``;
    without it the template has closed the think block in the prompt and the reply is content -- a stray
    ``</think>`` in it is text -- unless the reply opens a block of its own (``<think>`` at its start).
    ``reasoning`` is None when there was no think block. ``tools``: their schemas type the arguments;
    ``parse_tools=False`` leaves ``<tool_call>`` text in the content."""
    p = ChatStreamParser(thinking, tools, parse_tools=parse_tools)
    reasoning, content, calls = reply_events_merged(p.feed(text) + p.finish())
    return (reasoning.strip() if p.opened_thinking else None), content.strip(), calls


def prompt_opens_thinking(prompt_text: str) -> bool:
    """The rendered prompt leaves the model inside a think block (it ends with an unclosed ``<think>``)."""
    i = prompt_text.rfind("<think>")
    return i >= 0 and "</think>" not in prompt_text[i:]


@dataclass
class ChatResponse:
    """The reply of :meth:`Model.chat`: ``content`` (the answer), ``reasoning`` (the think block, if any),
    ``tool_calls`` (``[{"name", "arguments"}]``), ``text`` (everything generated), ``finish_reason``,
    ``stats``, ``tokens`` and ``message`` (an assistant message to append to the conversation)."""

    text: str
    content: str
    reasoning: str | None
    tool_calls: list
    finish_reason: str
    stats: dict
    tokens: list = field(repr=False)
    logprobs: list | None = field(default=None, repr=False)

    @property
    def message(self) -> dict:
        """The reply as an assistant message, to append to the conversation for the next turn."""
        m = {"role": "assistant", "content": self.content}
        if self.reasoning:
            m["reasoning_content"] = self.reasoning
        if self.tool_calls:
            m["tool_calls"] = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                               for c in self.tool_calls]
        return m

    def __str__(self) -> str:
        return self.content

    def _repr_markdown_(self) -> str:
        """Jupyter's view: model text is escaped (`markdown_escape`), so it shows as written, never as markup."""
        parts = []
        if self.reasoning:
            parts.append("> " + markdown_escape(self.reasoning).replace("\n", "\n> "))
        parts.append(markdown_escape(self.content))
        for c in self.tool_calls:
            parts.append("tool call: " + markdown_escape(f"{c['name']}({json.dumps(c['arguments'], ensure_ascii=False)})"))
        s = self.stats
        parts.append(f"<small>{s['prompt_tokens']} prompt tokens ({s['cached_tokens']} cached), "
                     f"{s['generated_tokens']} generated, finish: {self.finish_reason}</small>")
        return "\n\n".join(parts)


_MD_PUNCT = re.compile(r"([!-%'-/:;=?-@\[-`{-~])")        # ASCII punctuation but & < >


def markdown_escape(text: str) -> str:
    """`text` as literal Markdown: ASCII punctuation backslash-escaped (CommonMark), ``& < >`` as HTML
    entities, so neither Markdown nor HTML in it takes effect; line breaks kept."""
    return html.escape(_MD_PUNCT.sub(r"\\\1", text), quote=False)


class ChatStreamParser:
    """Splits a streamed reply into events, as it arrives.

    ``feed(text)`` returns the events that `text` (the next piece of the reply) decides, ``finish()`` the
    rest at the end of the reply:

    - ``("reasoning", text)``: thinking; ``("content", text)``: the answer;
    - ``("tool_call", index, name)``: a tool call starts (index 0, 1, ... in the reply);
    - ``("tool_args", index, fragment)``: the next piece of its arguments as JSON text, one parameter at a
      time (the pieces of a call concatenate to a JSON object);
    - ``("tool_done", index, call)``: the call is complete, ``call = {"name": str, "arguments": dict}``.

    Text that may be the start of ``</think>`` or ``<tool_call>`` is held until decided. From the first
    ``<tool_call>`` on (with tool parsing on), the calls are parsed as they complete: a call starts when its
    ``<function=NAME>`` line is whole, each parameter goes out when its ``</parameter>`` arrives. Text that
    does not follow the format (a block without a function, a stray line inside a call) ends the call so far
    and comes out as content; so does a call cut off by the end of the reply (its complete parameters are
    kept). Any cut of a reply into pieces gives the same events, merged (`parse_assistant` feeds it whole).
    """

    def __init__(self, thinking: bool = False, tools: list | None = None, parse_tools: bool = True):
        self.mode = "reasoning" if thinking else "content"
        self.opened_thinking = thinking           # the reply had a think block (the prompt's or its own)
        self.tools = tools
        self.parse_tools = parse_tools
        self._buf = ""
        self._tool_text = None                    # from the first <tool_call> on: not yet parsed
        self._content_started = False
        self._block_start = thinking              # at the start of a think block: a '<think>' here is its tag
        self.calls: list = []                     # the complete calls so far
        self._call = None                         # the call being parsed: {"name", "arguments"}
        self._schemas: dict = {}                  # the called tool's parameter schemas
        self._junk = False                        # text that is not the format was seen: the rest is content

    def _emit(self, field_, text, out):
        if not text:
            return
        if field_ == "content" and not self._content_started:
            text = text.lstrip("\n")              # the "\n\n" after </think>
            if not text:
                return
            self._content_started = True
        elif field_ == "reasoning":
            self._block_start = False
        out.append((field_, text))

    def feed(self, text: str) -> list:
        """The events that `text` (the next piece of the reply) decides."""
        out: list = []
        if self._tool_text is not None:
            self._tool_text += text
            self._parse_calls(out, final=False)
            return out
        self._buf += text
        while True:
            if self.mode == "reasoning":
                if self._buf.startswith("<think>") and self._block_start:
                    self._buf = self._buf[len("<think>"):]
                    self._block_start = False
                i = self._buf.find("</think>")
                if i >= 0:
                    self._emit("reasoning", self._buf[:i], out)
                    self._buf = self._buf[i + len("</think>"):]
                    self.mode = "content"
                    continue
                keep = _partial_suffix(self._buf, ("</think>", "<think>"))
                self._emit("reasoning", self._buf[:len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            tags = ("<tool_call>", "<think>") if self.parse_tools else ("<think>",)
            if not self._content_started:         # leading newlines are dropped (_emit), whatever the chunks
                self._buf = self._buf.lstrip("\n")
            if self._buf.startswith("<think>") and not self._content_started:
                self.mode = "reasoning"
                self.opened_thinking = True
                self._block_start = True
                continue
            i = self._buf.find("<tool_call>") if self.parse_tools else -1
            if i >= 0:
                self._emit("content", self._buf[:i], out)   # (not stripped: the pieces may have sent it)
                self._tool_text = self._buf[i:]
                self._buf = ""
                self._parse_calls(out, final=False)
                return out
            keep = _partial_suffix(self._buf, tags)
            self._emit("content", self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def finish(self) -> list:
        """The remaining events, at the end of the reply."""
        out: list = []
        if self._buf:
            self._emit("reasoning" if self.mode == "reasoning" else "content", self._buf, out)
            self._buf = ""
        if self._tool_text is not None:
            self._parse_calls(out, final=True)
        return out

    # ---- tool calls ------------------------------------------------------------------------------
    def _parse_calls(self, out: list, final: bool) -> None:
        """Parse `_tool_text` as far as it is decided (all of it when `final`)."""
        while True:
            t = self._tool_text
            if self._junk:                        # after text that is not the format: all of it is text
                self._text(t, out)
                return
            if self._call is None:                # between calls: whitespace, then <tool_call> / the end
                s = t.lstrip()
                head = _CALL_HEAD.match(s)
                if head is None:
                    if not s or (not final and _head_pending(s)):
                        return                    # nothing yet, or maybe a call's head, not whole yet
                    self._junk = True
                    self._tool_text = s
                    continue
                name = head.group(1).strip()
                self._call = {"name": name, "arguments": {}}
                self._schemas = _param_schemas(self.tools, name)
                out.append(("tool_call", len(self.calls), name))
                self._tool_text = s[head.end():]
                continue
            s = t.lstrip("\n")
            m = _PARAM_WHOLE.match(s)
            if m is not None:
                key = m.group(1).strip()
                v = self._value(key, m.group(2))
                args = self._call["arguments"]
                frag = ("{" if not args else ", ") + json.dumps(key, ensure_ascii=False) + ": " + json.dumps(
                    v, ensure_ascii=False)
                args[key] = v
                out.append(("tool_args", len(self.calls), frag))
                self._tool_text = s[m.end():]
                continue
            end = _CALL_END.match(s)
            if end is not None:
                rest = s[end.end():]
                if not final and (not rest or _is_prefix(rest, "</tool_call>")):
                    return                        # the close tag may still come
                self._close(out)
                self._tool_text = rest[len("</tool_call>"):] if rest.startswith("</tool_call>") else rest
                continue
            if not final and (not s or _is_prefix(s, "</function>") or _is_prefix(s, "<parameter=")
                              or s.startswith("<parameter=")):
                return                            # a parameter or the call's end, not whole yet
            self._close(out)                      # not the format (or cut off): the call ends here
            self._junk = True
            self._tool_text = s

    def _value(self, key: str, value: str):
        if string_parameter(self._schemas.get(key)):     # written raw, as the grammar and the template do
            return value
        try:
            return json.loads(value)
        except (json.JSONDecodeError, ValueError):
            return value

    def _close(self, out: list) -> None:
        call, self._call = self._call, None
        k = len(self.calls)
        out.append(("tool_args", k, "}" if call["arguments"] else "{}"))
        out.append(("tool_done", k, call))
        self.calls.append(call)

    def _text(self, s: str, out: list) -> None:
        """Text that is not a call: content, as the model wrote it."""
        if s:
            self._content_started = True
            out.append(("content", s))
        self._tool_text = ""


_CALL_HEAD = re.compile(r"<tool_call>\s*<function=([^>\n]+)>\n?")
_PARAM_WHOLE = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\n?", re.S)
_CALL_END = re.compile(r"</function>\s*")


def _head_pending(s: str) -> bool:
    """`s` may still become the head of a call (``<tool_call>`` then ``<function=NAME>``)."""
    if _is_prefix(s, "<tool_call>"):
        return True
    if not s.startswith("<tool_call>"):
        return False
    rest = s[len("<tool_call>"):].lstrip()
    return _is_prefix(rest, "<function=") or re.fullmatch(r"<function=[^>\n]*", rest) is not None


def _is_prefix(s: str, tag: str) -> bool:
    """`s` is a proper prefix of `tag` (it may still become it)."""
    return len(s) < len(tag) and tag.startswith(s)


def reply_events_merged(events) -> tuple:
    """``(reasoning text, content text, tool calls)`` of a list of parser events."""
    parts = {"reasoning": "", "content": ""}
    calls = []
    for e in events:
        if e[0] in parts:
            parts[e[0]] += e[1]
        elif e[0] == "tool_done":
            calls.append(e[2])
    return parts["reasoning"], parts["content"], calls


def _partial_suffix(s: str, tags) -> int:
    """Length of the longest suffix of `s` that is a proper prefix of one of `tags`."""
    best = 0
    for t in tags:
        for k in range(min(len(t) - 1, len(s)), best, -1):
            if s.endswith(t[:k]):
                best = k
                break
    return best

"""The Anthropic Messages API of ``qwenmetal serve``: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request is converted into the internal chat form (OpenAI chat-completions messages, `qwenmetal.chat`) and
answered by the one chat turn every API uses (`Service.turn`); the reply is written back as Anthropic content
blocks (``thinking``, ``text``, ``tool_use``), streamed as Anthropic's events (``message_start``,
``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``, ``message_stop``, ``ping``) or whole.
Errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (`error_response`; `create_app`
uses it for every path under ``/v1/messages``). The conversions are plain functions (`convert_messages`,
`convert_tools`, `convert_tool_choice`, `convert_thinking`, `convert_output_format`, `chat_request`), so
they are testable without a model. Documented in docs/server.md, "POST /v1/messages".
"""
from __future__ import annotations

import hashlib
import uuid
from typing import NamedTuple

from .errors import brief
from .serving import APIError, Render, Service, boolean, num, options_of, sse

__all__ = ["Thinking", "chat_request", "convert_messages", "convert_output_format", "convert_system",
           "convert_thinking", "convert_tool_choice", "convert_tools", "error_body", "error_response", "routes"]

#: Anthropic's error type for each HTTP status (others: api_error from 500 on, invalid_request_error below)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}
#: a system text block Claude Code puts first: a per-request hash that carries nothing for the model and,
#: left in, would make every prompt differ from its first tokens on (no prefix cache hit, ever)
BILLING_HEADER = "x-anthropic-billing-header:"
#: thinking config types that turn thinking on
_THINKING_ON = ("enabled", "adaptive", "between_tools")


# ---------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------
def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def error_body(e: APIError) -> dict:
    """`e` in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": error_type(e.status), "message": e.message}}


def error_response(e: APIError):
    from starlette.responses import JSONResponse
    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


# ---------------------------------------------------------------------------------------------------
# request -> internal chat form
# ---------------------------------------------------------------------------------------------------
def _text_blocks(blocks, where: str) -> list:
    """The texts of a list of text blocks (``cache_control``, ``citations`` ignored)."""
    if not isinstance(blocks, list):
        raise _bad(f"{where}: must be a string or a list of text blocks, got {brief(blocks)}", where)
    out = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise _bad(f"{where}.{j}: must be a text block ({{'type': 'text', 'text': str}}), got {brief(b)}",
                       where)
        out.append(b["text"])
    return out


def convert_system(system) -> str | None:
    """The ``system`` field (a string or text blocks) as one system message text, or None. Blocks are joined
    with blank lines; Claude Code's ``x-anthropic-billing-header`` block is dropped (`BILLING_HEADER`)."""
    if system is None:
        return None
    if isinstance(system, str):
        return system or None
    texts = [t for t in _text_blocks(system, "system") if not t.startswith(BILLING_HEADER)]
    return "\n\n".join(texts) or None


def _image_part(b: dict, where: str) -> dict:
    """An image block as the internal ``image_url`` part: a base64 source becomes a ``data:`` URL, a url
    source is passed on (the chat layer takes ``data:`` URLs, local files only with --allow-local-images, and
    never fetches an http(s) URL)."""
    src = b.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "base64":
        mt, data = src.get("media_type"), src.get("data")
        if not isinstance(mt, str) or not isinstance(data, str):
            raise _bad(f"{where}.source: a base64 source needs string 'media_type' and 'data'", where)
        return {"type": "image_url", "image_url": {"url": f"data:{mt};base64,{data}"}}
    if kind == "url":
        if not isinstance(src.get("url"), str):
            raise _bad(f"{where}.source: a url source needs a string 'url'", where)
        return {"type": "image_url", "image_url": {"url": src["url"]}}
    raise _bad(f"{where}.source: only 'base64' and 'url' image sources are supported, got {brief(src)}", where,
               "unsupported_value")


def _document_text(b: dict, where: str) -> str:
    """A document block with a plain-text source (``text``, or ``content`` holding text blocks) as its text,
    after its ``title`` and ``context`` lines; PDFs and files get 400."""
    src = b.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "text" and isinstance(src.get("data"), str):
        text = src["data"]
    elif kind == "content" and isinstance(src.get("content"), str):
        text = src["content"]
    elif kind == "content":
        text = "\n".join(_text_blocks(src.get("content"), f"{where}.source.content"))
    else:
        raise _bad(f"{where}.source: only plain-text documents (a 'text' or 'content' source) are supported, got "
                   f"{brief(src)}", where, "unsupported_value")
    head = [b[k] for k in ("title", "context") if isinstance(b.get(k), str) and b[k]]
    return "\n\n".join(head + [text])


def _tool_result(b: dict, where: str) -> tuple:
    """A tool_result block: ``(the tool message, its image parts)`` (images go to a user message after the
    tool messages: the chat form takes images in user messages only)."""
    tid = b.get("tool_use_id")
    if not isinstance(tid, str):
        raise _bad(f"{where}.tool_use_id: must be a string, got {brief(tid)}", where)
    c = b.get("content")
    texts, images = [], []
    if c is None:
        pass
    elif isinstance(c, str):
        texts.append(c)
    elif isinstance(c, list):
        for j, p in enumerate(c):
            t = p.get("type") if isinstance(p, dict) else None
            if t == "text" and isinstance(p.get("text"), str):
                texts.append(p["text"])
            elif t == "image":
                images.append(_image_part(p, f"{where}.content.{j}"))
            elif t == "document":
                texts.append(_document_text(p, f"{where}.content.{j}"))
            else:
                raise _bad(f"{where}.content.{j}: a tool result holds text, image and document blocks, got "
                           f"{brief(p)}", where, "unsupported_value")
    else:
        raise _bad(f"{where}.content: must be a string or a list of blocks, got {brief(c)}", where)
    text = "\n".join(texts)
    if b.get("is_error") is not None and not isinstance(b.get("is_error"), bool):
        raise _bad(f"{where}.is_error: must be a boolean, got {brief(b.get('is_error'))}", where)
    if b.get("is_error"):
        text = "Error: " + text if text else "Error"
    return {"role": "tool", "tool_call_id": tid, "content": text}, images


def _user(content, where: str) -> list:
    """A user message: its tool results as tool messages (in order), then its text and images as one user
    message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}: must be a string or a list of content blocks, got {brief(content)}", where)
    tools, parts = [], []
    for j, b in enumerate(content):
        w = f"{where}.{j}"
        t = b.get("type") if isinstance(b, dict) else None
        if t == "text":
            if not isinstance(b.get("text"), str):
                raise _bad(f"{w}.text: must be a string, got {brief(b.get('text'))}", w)
            parts.append({"type": "text", "text": b["text"]})
        elif t == "image":
            parts.append(_image_part(b, w))
        elif t == "document":
            parts.append({"type": "text", "text": _document_text(b, w)})
        elif t == "tool_result":
            msg, images = _tool_result(b, w)
            tools.append(msg)
            parts += images
        else:
            raise _bad(f"{w}: user messages take text, image, document and tool_result blocks, got {brief(b)}",
                       w, "unsupported_value")
    if not parts:
        return tools
    if all(p["type"] == "text" for p in parts):
        parts = "".join(p["text"] for p in parts) if len(parts) == 1 else parts
    return tools + [{"role": "user", "content": parts}]


def _assistant(content, where: str) -> dict:
    """An assistant message: thinking -> ``reasoning_content``, text blocks joined -> ``content``, tool_use ->
    ``tool_calls`` (redacted_thinking is dropped; any signature is accepted)."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _bad(f"{where}: must be a string or a list of content blocks, got {brief(content)}", where)
    thinking, texts, calls = [], [], []
    for j, b in enumerate(content):
        w = f"{where}.{j}"
        t = b.get("type") if isinstance(b, dict) else None
        if t == "text":
            if not isinstance(b.get("text"), str):
                raise _bad(f"{w}.text: must be a string, got {brief(b.get('text'))}", w)
            texts.append(b["text"])
        elif t == "thinking":
            if not isinstance(b.get("thinking"), str):
                raise _bad(f"{w}.thinking: must be a string, got {brief(b.get('thinking'))}", w)
            thinking.append(b["thinking"])
        elif t == "redacted_thinking":
            pass
        elif t == "tool_use":
            tid, name, args = b.get("id"), b.get("name"), b.get("input", {})
            if not isinstance(tid, str) or not isinstance(name, str) or not isinstance(args, dict):
                raise _bad(f"{w}: a tool_use block needs a string 'id' and 'name' and an object 'input', got "
                           f"{brief(b)}", w)
            calls.append({"id": tid, "type": "function", "function": {"name": name, "arguments": args}})
        else:
            raise _bad(f"{w}: assistant messages take text, thinking, redacted_thinking and tool_use blocks, got "
                       f"{brief(b)}", w, "unsupported_value")
    msg = {"role": "assistant", "content": "\n\n".join(texts)}
    if thinking:
        msg["reasoning_content"] = "\n\n".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def convert_messages(messages, system=None) -> list:
    """Anthropic ``messages`` (and ``system``) in the internal chat form (module docstring; docs/server.md
    has the table). A final assistant message (prefill) is refused, as Anthropic's newer models do."""
    if not isinstance(messages, list) or not messages:
        raise _bad(f"messages: must be a non-empty list of messages, got {brief(messages)}", "messages")
    out = []
    sys_text = convert_system(system)
    if sys_text is not None:
        out.append({"role": "system", "content": sys_text})
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"{where}: must be an object with role 'user' or 'assistant', got {brief(m)}", where)
        if "content" not in m:
            raise _bad(f"{where}.content: Field required", where)
        if m["role"] == "user":
            out += _user(m["content"], f"{where}.content")
        else:
            out.append(_assistant(m["content"], f"{where}.content"))
    if messages[-1]["role"] == "assistant":
        raise _bad("prefilling the assistant message is not supported: the conversation must end with a user "
                   "message", f"messages.{len(messages) - 1}", "unsupported_value")
    return out


def convert_tools(tools) -> list | None:
    """Anthropic tools (``{name, description, input_schema, strict}``) as OpenAI function tools. Server tools
    and Anthropic-defined client tools (a ``type`` other than "custom": web search, bash, text editor, ...)
    get 400: the server runs nothing, and their schemas are Anthropic's."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad(f"tools: must be a list of tools, got {brief(tools)}", "tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(t, dict):
            raise _bad(f"{where}: must be an object, got {brief(t)}", where)
        if t.get("type") not in (None, "custom"):
            raise _bad(f"{where}: the tool type {t['type']!r} is not supported: only client tools with an "
                       "input_schema are (the server runs no tools itself)", where, "unsupported_value")
        name, schema = t.get("name"), t.get("input_schema")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}.name: must be a non-empty string, got {brief(name)}", where)
        if not isinstance(schema, dict):
            raise _bad(f"{where}.input_schema: must be a JSON schema object, got {brief(schema)}", where)
        fn = {"name": name, "parameters": schema}
        if t.get("description") is not None:
            if not isinstance(t["description"], str):
                raise _bad(f"{where}.description: must be a string", where)
            fn["description"] = t["description"]
        if t.get("strict") is not None:
            if not isinstance(t["strict"], bool):
                raise _bad(f"{where}.strict: must be a boolean", where)
            fn["strict"] = t["strict"]
        out.append({"type": "function", "function": fn})
    return out or None


def convert_tool_choice(tc) -> tuple:
    """``tool_choice`` as ``(the chat layer's tool_choice, parallel_tool_calls)``: auto -> "auto", any ->
    "required", tool -> that function, none -> "none"; ``disable_parallel_tool_use`` -> at most one call."""
    if tc is None:
        return None, True
    if not isinstance(tc, dict):
        raise _bad(f"tool_choice: must be an object with a 'type', got {brief(tc)}", "tool_choice")
    kind = tc.get("type")
    dp = tc.get("disable_parallel_tool_use")
    if dp is not None and not isinstance(dp, bool):
        raise _bad("tool_choice.disable_parallel_tool_use: must be a boolean", "tool_choice")
    if kind == "auto":
        choice = "auto"
    elif kind == "any":
        choice = "required"
    elif kind == "none":
        choice = "none"
    elif kind == "tool":
        if not isinstance(tc.get("name"), str):
            raise _bad("tool_choice.name: a tool_choice of type 'tool' needs the tool's name", "tool_choice")
        choice = {"type": "function", "function": {"name": tc["name"]}}
    else:
        raise _bad(f"tool_choice.type: must be 'auto', 'any', 'tool' or 'none', got {brief(kind)}", "tool_choice")
    return choice, not dp


class Thinking(NamedTuple):
    """A request's ``thinking``: Qwen's thinking on, its text shown, and the token budget (None: unbounded)."""

    enabled: bool
    show: bool = True
    budget: int | None = None


def convert_thinking(thinking) -> Thinking:
    """``thinking`` as a `Thinking`: enabled / adaptive -> on, disabled or absent -> off (as Anthropic's API
    defaults); ``budget_tokens`` bounds the thinking (``GenerationOptions.thinking_budget``: the think block
    is closed when it runs out, and the answer follows, all within ``max_tokens``); ``display: "omitted"``
    returns thinking blocks without their text."""
    if thinking is None:
        return Thinking(False)
    if not isinstance(thinking, dict):
        raise _bad(f"thinking: must be an object with a 'type', got {brief(thinking)}", "thinking")
    kind = thinking.get("type")
    if kind == "disabled":
        return Thinking(False)
    if kind not in _THINKING_ON:
        raise _bad(f"thinking.type: must be 'enabled', 'adaptive' or 'disabled', got {brief(kind)}", "thinking")
    bt = thinking.get("budget_tokens")
    if kind == "enabled" and bt is not None and (isinstance(bt, bool) or not isinstance(bt, int) or bt < 1):
        raise _bad(f"thinking.budget_tokens: must be a positive integer, got {brief(bt)}", "thinking")
    display = thinking.get("display")
    if display not in (None, "summarized", "omitted"):
        raise _bad(f"thinking.display: must be 'summarized' or 'omitted', got {brief(display)}", "thinking")
    return Thinking(True, display != "omitted", bt if kind == "enabled" else None)


def convert_output_format(body: dict) -> dict | None:
    """Structured output: ``output_config.format`` (or the older top-level ``output_format``),
    ``{"type": "json_schema", "schema": {...}}``, as the chat layer's ``response_format``."""
    oc = body.get("output_config")
    if oc is not None and not isinstance(oc, dict):
        raise _bad(f"output_config: must be an object, got {brief(oc)}", "output_config")
    fmt, where = (oc or {}).get("format"), "output_config.format"
    if fmt is None:
        fmt, where = body.get("output_format"), "output_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise _bad(f"{where}: only {{'type': 'json_schema', 'schema': {{...}}}} is supported, got {brief(fmt)}",
                   where, "unsupported_value")
    if not isinstance(fmt.get("schema"), dict):
        raise _bad(f"{where}.schema: must be a JSON schema object, got {brief(fmt.get('schema'))}", where)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def chat_request(body: dict) -> tuple:
    """A Messages request as ``(internal messages, keyword arguments of Service.turn, its Thinking)``."""
    messages = convert_messages(body.get("messages"), body.get("system"))
    tools = convert_tools(body.get("tools"))
    choice, parallel = convert_tool_choice(body.get("tool_choice"))
    thinking = convert_thinking(body.get("thinking"))
    kw = {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel,
          "response_format": convert_output_format(body), "enable_thinking": thinking.enabled}
    return messages, kw, thinking


# ---------------------------------------------------------------------------------------------------
# reply -> Anthropic message
# ---------------------------------------------------------------------------------------------------
def signature(thinking: str) -> str:
    """The opaque signature of a thinking block: a hash of its text without the surrounding whitespace (so a
    streamed block and the collected one agree); any signature is taken back."""
    return hashlib.sha256(thinking.strip().encode("utf-8")).hexdigest()[:32]


def tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def stop_reason(reason: str, stop, tool_calls: bool) -> tuple:
    """``(stop_reason, stop_sequence)`` of a generation that ended with `reason` (`stop`: the last output's
    stop string or id)."""
    if reason == "stop":
        if isinstance(stop, str):
            return "stop_sequence", stop
        return ("tool_use" if tool_calls else "end_turn"), None
    if reason == "context":
        return "model_context_window_exceeded", None
    return "max_tokens", None                 # "length", "time_limit"


def usage(stats: dict | None, output_tokens: int | None = None) -> dict:
    """Anthropic's usage: ``input_tokens`` is the part of the prompt the prefix cache did not supply,
    ``cache_read_input_tokens`` the part it did (unknown after a time limit: 0)."""
    stats = stats or {}
    prompt, cached = stats.get("prompt_tokens", 0), stats.get("cached_tokens") or 0
    out = stats.get("generated_tokens", 0) if output_tokens is None else output_tokens
    return {"input_tokens": prompt - cached, "output_tokens": out, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}


class _MessagesRender(Render):
    """A Messages reply: the whole message (``body``) or its events. Streamed, blocks open and close as the
    chat layer's stream parser decides the text (thinking, then text, then each tool call with its input as
    ``input_json_delta`` pieces); a thinking block gets its ``signature_delta`` before it stops. Either way
    the reply is remembered (`ChatTurn.remember`) as the client will send it back, converted, with the same
    tool_use ids. `warm`: ``max_tokens: 0`` (Anthropic's cache warm-up): the prompt is prefilled into the
    prefix cache, one token generated and dropped; the reply is empty."""

    def __init__(self, svc: Service, turn, show_thinking: bool, warm: bool = False):
        self.svc, self.turn, self.show, self.warm = svc, turn, show_thinking, warm
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.parser = turn.stream_parser()
        self.tokens: list = []
        self.stop = None                      # the last output's stop string / id
        # streamed: the open block (kind, index), the blocks so far, and the reply as the client rebuilds it
        self.open: tuple | None = None
        self.n_blocks = 0
        self.reasoning, self.text = [], []
        self.calls: dict = {}                 # the parser's call index -> the call's tool_use id
        self.done: list = []                  # the complete calls, as tool_calls entries

    def envelope(self, content: list, stop_reason=None, stop_sequence=None, usage_=None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.svc.name, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage_}

    # ---- the whole message ----------------------------------------------------------------------
    def body(self, outs, reason, stats) -> dict:
        stop = outs[-1].stop if outs else None
        if self.warm:
            return self.envelope([], "max_tokens", None, usage(stats, 0))
        reasoning, content, calls = self.turn.parse("".join(o.text for o in outs))
        blocks, msg = [], {"role": "assistant", "content": content}
        if reasoning:
            blocks.append({"type": "thinking", "thinking": reasoning if self.show else "",
                           "signature": signature(reasoning)})
            msg["reasoning_content"] = reasoning
        if content:
            blocks.append({"type": "text", "text": content})
        if calls:
            msg["tool_calls"] = []
            for c in calls:
                tid = tool_use_id()
                blocks.append({"type": "tool_use", "id": tid, "name": c["name"], "input": c["arguments"]})
                msg["tool_calls"].append({"id": tid, "type": "function",
                                          "function": {"name": c["name"], "arguments": c["arguments"]}})
        self.turn.remember(self.svc.model, msg, [o.token for o in outs])
        sr, seq = stop_reason(reason, stop, bool(calls))
        return self.envelope(blocks, sr, seq, usage(stats))

    # ---- events ---------------------------------------------------------------------------------
    def start(self) -> list:
        n = len(self.turn.prompt_ids)
        first = self.envelope([], usage_={"input_tokens": n, "output_tokens": 0, "cache_creation_input_tokens": 0,
                                          "cache_read_input_tokens": 0})
        return [sse({"type": "message_start", "message": first}, "message_start"), *self.keepalive()]

    def keepalive(self) -> list:
        """Anthropic's own keep-alive: a ``ping`` event (after ``message_start``, and whenever the stream has
        been silent for the service's keep-alive interval)."""
        return [sse({"type": "ping"}, "ping")]

    def _delta(self, delta: dict) -> str:
        return sse({"type": "content_block_delta", "index": self.open[1], "delta": delta}, "content_block_delta")

    def _open(self, kind, block: dict) -> list:
        out = self._close()
        self.open = (kind, self.n_blocks)
        self.n_blocks += 1
        return out + [sse({"type": "content_block_start", "index": self.open[1], "content_block": block},
                          "content_block_start")]

    def _close(self) -> list:
        if self.open is None:
            return []
        out = []
        if self.open[0] == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": signature("".join(self.reasoning))}))
        out.append(sse({"type": "content_block_stop", "index": self.open[1]}, "content_block_stop"))
        self.open = None
        return out

    def _events(self, events) -> list:
        out = []
        for ev in events:
            kind = ev[0]
            if kind == "reasoning":
                if self.open is None or self.open[0] != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self.reasoning.append(ev[1])
                if self.show:
                    out.append(self._delta({"type": "thinking_delta", "thinking": ev[1]}))
            elif kind == "content":
                if self.open is None or self.open[0] != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                self.text.append(ev[1])
                out.append(self._delta({"type": "text_delta", "text": ev[1]}))
            elif kind == "tool_call":
                tid = self.calls[ev[1]] = tool_use_id()
                out += self._open(("tool", ev[1]), {"type": "tool_use", "id": tid, "name": ev[2], "input": {}})
            elif kind == "tool_args":
                if self.open is not None and self.open[0] == ("tool", ev[1]):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": ev[2]}))
            elif kind == "tool_done":
                call = ev[2]
                self.done.append({"id": self.calls.get(ev[1]) or tool_use_id(), "type": "function",
                                  "function": {"name": call["name"], "arguments": call["arguments"]}})
                if self.open is not None and self.open[0] == ("tool", ev[1]):
                    out += self._close()
        return out

    def step(self, out) -> list:
        self.tokens.append(out.token)
        if out.finish_reason is not None:
            self.stop = out.stop
        if self.warm:
            return []
        return self._events(self.parser.feed(out.text))

    def finish(self, reason, stats) -> list:
        out = [] if self.warm else self._events(self.parser.finish())
        out += self._close()
        done = self.done
        if not self.warm:
            msg = {"role": "assistant", "content": "".join(self.text)}
            if self.reasoning:
                msg["reasoning_content"] = "".join(self.reasoning)
            if done:
                msg["tool_calls"] = done
            self.turn.remember(self.svc.model, msg, self.tokens)
        sr, seq = stop_reason(reason, self.stop, bool(done))
        if self.warm:
            sr, seq = "max_tokens", None
        u = usage(stats, 0 if self.warm else None)
        return out + [sse({"type": "message_delta", "delta": {"stop_reason": sr, "stop_sequence": seq}, "usage": u},
                          "message_delta"),
                      sse({"type": "message_stop"}, "message_stop")]

    def error(self, e: APIError) -> list:
        return [sse(error_body(e), "error")]


# ---------------------------------------------------------------------------------------------------
# the routes
# ---------------------------------------------------------------------------------------------------
def routes(svc: Service) -> list:
    """``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` over `svc`."""
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def turn_of(body):
        if svc.tok is None:
            raise APIError(400, "this checkpoint has no tokenizer, so it cannot chat")
        messages, kw, thinking = chat_request(body)
        try:
            return await svc.turn(messages, param="messages", **kw), thinking
        except APIError as e:                 # the chat layer names the schema by its OpenAI field
            if e.param == "response_format" and e.message.startswith("response_format"):
                raise APIError(e.status, "output_config.format" + e.message[len("response_format"):],
                               "output_config.format", e.code) from None
            raise

    async def messages(request):
        body = await svc.read_json(request)
        if body.get("max_tokens") is None:
            raise _bad("max_tokens: Field required", "max_tokens")
        requested = num(body, "max_tokens", 0, None, integer=True)
        stop = body.get("stop_sequences")
        if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
            raise _bad(f"stop_sequences: must be a list of strings, got {brief(stop)}", "stop_sequences")
        stream = boolean(body, "stream")
        turn, thinking = await turn_of(body)
        warm = requested == 0
        mt = svc.max_tokens(max(requested, 1), len(turn.prompt_ids), None, "messages")
        opts = options_of(body, mt, {"stop_sequences": "stop"}, grammar=turn.grammar,
                          thinking_budget=thinking.budget)
        render = _MessagesRender(svc, turn, thinking.show, warm)
        return await svc.respond(request, svc.job(opts, turn.prompt_ids, turn.cache_points, turn.images), render,
                                 stream)

    async def count_tokens(request):
        body = await svc.read_json(request)
        turn, _ = await turn_of(body)
        return JSONResponse({"input_tokens": len(turn.prompt_ids)})

    return [Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]


def is_anthropic_path(path: str) -> bool:
    """The paths whose errors are written in Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


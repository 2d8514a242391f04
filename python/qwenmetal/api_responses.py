"""The OpenAI Responses API of ``qwenmetal serve``: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items`` (`routes`). Documented in docs/server.md,
"POST /v1/responses".

A request's ``input`` items (messages, function calls and their outputs, reasoning) become the internal chat
form (`input_messages`: OpenAI chat-completions messages), its ``tools``, ``tool_choice`` and ``text.format``
the chat layer's (`tools_of`, `tool_choice_of`, `response_format_of`), and the reply goes through one chat
turn (`qwenmetal.serving.Service.turn`) like every other API's. The reply's stream-parser events
(`qwenmetal.chat.ChatStreamParser`) become output items -- a ``reasoning`` item, a ``message`` item, one
``function_call`` item per tool call -- and, streamed, the Responses API's typed events (`_Reply`).

Responses are kept (``store``, the default) in a bounded in-memory `ResponseStore`: the conversation so far,
in internal form with the reply appended as the assistant message a client would send back. A request with
``previous_response_id`` continues that conversation; the reply's transcript (`ChatTurn.remember`) makes the
next prompt continue the generated tokens, so only the new input is prefilled.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict

from .errors import brief
from .serving import THINKING_BUDGET, APIError, Render, Service, boolean, num, options_of, sse

#: responses kept for ``previous_response_id`` / GET (least recently used out)
DEFAULT_STORE_ENTRIES = 1024
DEFAULT_STORE_BYTES = 64 << 20          # their conversations' JSON size, summed
#: ``reasoning.effort`` values; "none" and "minimal" turn thinking off, the others on
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_THINKING_OFF = ("none", "minimal")
_ROLES = ("user", "system", "developer", "assistant")


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def _bad(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


# ---------------------------------------------------------------------------------------------------
# requests -> the internal chat form
# ---------------------------------------------------------------------------------------------------
def _content_of(content, where: str):
    """A message item's content in internal form: a string (text parts joined), or a list of text and
    image parts, one per input part (so ``content[j]`` names the same part in both)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts, got {brief(content, as_json=True)}",
                   f"{where}.content")
    parts, images = [], False
    for j, p in enumerate(content):
        t = p.get("type") if isinstance(p, dict) else None
        if t in ("input_text", "output_text", "text") and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": p["text"]})
        elif t == "refusal" and isinstance(p.get("refusal"), str):
            parts.append({"type": "text", "text": p["refusal"]})
        elif t == "input_image":
            url = p.get("image_url")
            if not isinstance(url, str) or not url:
                raise _bad(f"{where}.content[{j}]: only images given by 'image_url' (a data: URL) are supported, "
                           f"not by file_id", f"{where}.content[{j}]", "unsupported_value")
            parts.append({"type": "image_url", "image_url": {"url": url}})
            images = True
        else:
            raise _bad(f"{where}.content[{j}]: only input_text, output_text and input_image parts are supported, "
                       f"got {brief(p, as_json=True)}", f"{where}.content[{j}]", "unsupported_value")
    return parts if images else "".join(p["text"] for p in parts)


def _text_of(value, where: str) -> str:
    """A function call's output: a string, or text parts joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise _bad(f"{where} must be a string or a list of input_text parts, got {brief(value, as_json=True)}", where,
               "unsupported_value")


#: the id prefix of each input item type, for the items a request gives without one
_ITEM_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}


def listed_items(items) -> list:
    """A request's (already checked) ``input`` as ``GET /v1/responses/{id}/input_items`` lists it: every item
    an object with its ``type`` and an ``id`` (given ones kept), message content as a list of parts (a
    string input is one user message of one ``input_text`` part)."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    out = []
    for it in items:
        it = dict(it)
        t = it.setdefault("type", "message")
        if t == "message":
            if isinstance(it.get("content"), str):
                kind = "output_text" if it.get("role") == "assistant" else "input_text"
                it["content"] = [{"type": kind, "text": it["content"]}]
            it.setdefault("status", "completed")
        if not isinstance(it.get("id"), str):
            it["id"] = _id(_ITEM_PREFIX.get(t, "item_"))
        out.append(it)
    return out


def input_messages(items, param: str = "input") -> tuple:
    """Responses ``input`` (a string, or a list of items) as internal chat messages: ``(messages, origins)``,
    with ``origins[k]`` the request field message k came from (``"input[i]"``), for errors.

    Message items (``{"role", "content"}``, with or without ``"type": "message"``) keep their role and
    content (text parts joined into a string; input_image parts as image_url parts). A ``reasoning`` item's
    text (its reasoning_text content, else its summary) becomes the ``reasoning_content`` of the next
    assistant message (dropped when none follows). ``function_call`` items become ``tool_calls`` (id =
    call_id) of the assistant message right before them, or of a new one; ``function_call_output`` items
    become tool messages. Anything else is a 400 naming the item."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], [param]
    if not isinstance(items, list) or not items:
        raise _bad(f"'{param}' must be a string or a non-empty list of items, got {brief(items, as_json=True)}", param)
    msgs, origins, reasoning = [], [], []

    def add(m, where):
        if m["role"] == "assistant" and reasoning:
            m["reasoning_content"] = "\n\n".join(reasoning)
            reasoning.clear()
        elif m["role"] != "assistant":
            reasoning.clear()                 # reasoning not followed by a reply of its own
        msgs.append(m)
        origins.append(where)

    for i, it in enumerate(items):
        where = f"{param}[{i}]"
        if not isinstance(it, dict):
            raise _bad(f"{where} must be an object, got {brief(it, as_json=True)}", where)
        t = it.get("type", "message" if "role" in it else None)
        if t == "message":
            role = it.get("role")
            if role not in _ROLES:
                raise _bad(f"{where}.role must be one of {list(_ROLES)}, got {brief(role, as_json=True)}", f"{where}.role")
            add({"role": role, "content": _content_of(it.get("content"), where)}, where)
        elif t == "function_call":
            name, args, cid = it.get("name"), it.get("arguments", ""), it.get("call_id")
            if not isinstance(name, str) or not name or not isinstance(cid, str) or not cid \
                    or not isinstance(args, str):
                raise _bad(f"{where}: a function_call needs a string 'call_id', 'name' and 'arguments' (a JSON "
                           f"string), got {brief(it, as_json=True)}", where)
            call = {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)     # the same reply's calls
            else:
                add({"role": "assistant", "content": "", "tool_calls": [call]}, where)
        elif t == "function_call_output":
            cid = it.get("call_id")
            if not isinstance(cid, str) or not cid:
                raise _bad(f"{where}: a function_call_output needs a string 'call_id'", f"{where}.call_id")
            add({"role": "tool", "tool_call_id": cid, "content": _text_of(it.get("output"), f"{where}.output")},
                where)
        elif t == "reasoning":
            parts = it.get("content") or it.get("summary") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise _bad(f"{where}: a reasoning item's content must be a list of {{'type': 'reasoning_text', "
                           f"'text': str}}, got {brief(parts, as_json=True)}", where)
            text = "".join(p["text"] for p in parts)
            if text:
                reasoning.append(text)
        else:
            raise _bad(f"{where}: items of type {t!r} are not supported (message, function_call, "
                       f"function_call_output and reasoning are)", f"{where}.type", "unsupported_value")
    return msgs, origins


def leading_system_merged(messages: list, origins: list) -> tuple:
    """`messages` with the system and developer messages they start with (``instructions``, then those of the
    input) joined into one system message, blank-line separated: Qwen's chat templates take one system
    message, first, and Codex sends ``instructions`` and developer messages both. ``(messages, origins)``."""
    k = 0
    while k < len(messages) and messages[k]["role"] in ("system", "developer"):
        k += 1
    if k < 2 or not all(isinstance(m["content"], str) for m in messages[:k]):
        return messages, origins              # (image parts in a system message: refused further on)
    text = "\n\n".join(m["content"] for m in messages[:k] if m["content"])
    return [{"role": "system", "content": text}] + messages[k:], [origins[0]] + origins[k:]


def tools_of(tools) -> list | None:
    """Responses function tools (``{"type": "function", "name", "description", "parameters", "strict"}``) in
    chat form; any other tool type is a 400."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad(f"'tools' must be a list, got {brief(tools, as_json=True)}", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"tools[{i}]: only function tools are supported, got type {kind!r}", f"tools[{i}].type",
                       "unsupported_value")
        fn = t.get("function") if isinstance(t.get("function"), dict) else t     # the chat form, leniently
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{i}] needs a string 'name'", f"tools[{i}].name")
        out.append({"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters",
                                                                         "strict") if fn.get(k) is not None}})
    return out or None


def tool_choice_of(tc):
    """Responses ``tool_choice`` in chat form: "auto" | "none" | "required" | a named function."""
    if tc is None or tc in ("auto", "none", "required"):
        return tc
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}
    raise _bad(f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'name': ...}}, got "
               f"{brief(tc, as_json=True)}", "tool_choice", "unsupported_value")


def response_format_of(text) -> dict | None:
    """``text.format`` as the chat layer's ``response_format``."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad(f"'text' must be an object, got {brief(text, as_json=True)}", "text")
    f = text.get("format")
    if f is None:
        return None
    if not isinstance(f, dict) or f.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad(f"text.format must be {{'type': 'text' | 'json_object' | 'json_schema', ...}}, got {brief(f, as_json=True)}",
                   "text.format")
    if f["type"] != "json_schema":
        return {"type": f["type"]}
    return {"type": "json_schema", "json_schema": {"name": f.get("name"), "schema": f.get("schema"),
                                                   "strict": f.get("strict")}}


def thinking_of(reasoning) -> bool | None:
    """``reasoning.effort``: "none" / "minimal" turn thinking off, "low" ... "xhigh" on; absent: the
    chat template's default."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise _bad(f"'reasoning' must be an object, got {brief(reasoning, as_json=True)}", "reasoning")
    effort = reasoning.get("effort")
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise _bad(f"reasoning.effort must be one of {list(EFFORTS)}, got {brief(effort, as_json=True)}", "reasoning.effort")
    return effort not in _THINKING_OFF


# ---------------------------------------------------------------------------------------------------
# the response store
# ---------------------------------------------------------------------------------------------------
class ResponseStore:
    """Responses kept for ``previous_response_id``, ``GET /v1/responses/{id}`` and its ``input_items``: each
    is the response object, its conversation (internal messages, the reply included) and the request's own
    input items (`listed_items`). Bounded by `max_entries` and
    `max_bytes` (the JSON size of what is kept; least recently used out; one larger than `max_bytes` is not
    kept). Thread-safe. Stored objects are never modified (a continued conversation is a new list)."""

    def __init__(self, max_entries: int = DEFAULT_STORE_ENTRIES, max_bytes: int = DEFAULT_STORE_BYTES):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"max_entries and max_bytes must be >= 1, got {max_entries} and {max_bytes}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict = OrderedDict()      # id -> (response, messages, input items, size)
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, response: dict, messages: list, items: list = ()) -> bool:
        """Keep `response` (under its id) with its conversation `messages` and its request's input `items`;
        whether it was kept."""
        items = list(items)
        size = len(json.dumps([response, messages, items], ensure_ascii=False, default=str).encode())
        if size > self.max_bytes:
            return False
        with self._lock:
            self._drop(response["id"])
            self._entries[response["id"]] = (response, messages, items, size)
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, e = self._entries.popitem(last=False)
                self._bytes -= e[-1]
        return True

    def get(self, rid: str) -> tuple | None:
        """``(response, messages)`` of `rid`, or None."""
        with self._lock:
            e = self._entries.get(rid)
            if e is None:
                return None
            self._entries.move_to_end(rid)
            return e[0], e[1]

    def input_items(self, rid: str) -> list | None:
        """The input items of `rid`'s request, or None."""
        with self._lock:
            e = self._entries.get(rid)
            return None if e is None else e[2]

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._drop(rid)

    def _drop(self, rid: str) -> bool:
        e = self._entries.pop(rid, None)
        if e is not None:
            self._bytes -= e[-1]
        return e is not None


# ---------------------------------------------------------------------------------------------------
# replies -> output items and events
# ---------------------------------------------------------------------------------------------------
def _usage(stats: dict, reasoning_tokens: int) -> dict:
    n_in, n_out = stats["prompt_tokens"], stats["generated_tokens"]
    return {"input_tokens": n_in,
            "input_tokens_details": {"cached_tokens": stats.get("cached_tokens") or 0, "cache_write_tokens": 0},
            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": n_in + n_out}


class _Reply:
    """One reply as output items, built from the stream parser's events token by token. With `streaming`,
    each change is also an event (a dict without its sequence number) in `events`, taken by the caller.

    Items open and close as the kind of text changes: reasoning (a reasoning item with one reasoning_text
    part), content (a message item with one output_text part), each tool call (a function_call item whose
    arguments grow with the parser's pieces). The texts are the deltas concatenated, streamed or not."""

    def __init__(self, turn, streaming: bool):
        self.parser = turn.stream_parser()
        self.streaming = streaming
        self.items: list = []
        self.open = None                      # the item being written
        self.calls: dict = {}                 # parser call index -> its item
        self.events: list = []
        self.tokens: list = []
        self.reasoning_tokens = 0
        self.answered = False                 # text other than reasoning has come

    def emit(self, type_: str, **fields) -> None:
        if self.streaming:
            self.events.append({"type": type_, **fields})

    def _snapshot(self, item) -> dict | None:
        """`item` as it is now, for an event (it changes before the event is written)."""
        return json.loads(json.dumps(item)) if self.streaming else None

    def _start(self, item: dict, part: dict | None = None) -> None:
        self.close()
        self.items.append(item)
        self.open = item
        self.emit("response.output_item.added", output_index=len(self.items) - 1, item=self._snapshot(item))
        if part is not None:
            item["content"].append(part)
            self.emit("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                      content_index=0, part=dict(part))

    def close(self, status: str = "completed") -> None:
        item, self.open = self.open, None
        if item is None:
            return
        k = self.items.index(item)
        if item["type"] == "reasoning":
            part = item["content"][0]
            self.emit("response.reasoning_text.done", item_id=item["id"], output_index=k, content_index=0,
                      text=part["text"])
            self.emit("response.content_part.done", item_id=item["id"], output_index=k, content_index=0,
                      part=dict(part))
        elif item["type"] == "message":
            part = item["content"][0]
            self.emit("response.output_text.done", item_id=item["id"], output_index=k, content_index=0,
                      text=part["text"], logprobs=[])
            self.emit("response.content_part.done", item_id=item["id"], output_index=k, content_index=0,
                      part=self._snapshot(part))
        else:
            self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                      arguments=item["arguments"])
        item["status"] = status
        self.emit("response.output_item.done", output_index=k, item=self._snapshot(item))

    def _text(self, kind: str, text: str) -> None:
        item = self.open
        if kind == "reasoning":
            if item is None or item["type"] != "reasoning":
                self._start({"id": _id("rs_"), "type": "reasoning", "summary": [], "content": [],
                             "status": "in_progress"}, {"type": "reasoning_text", "text": ""})
            self.open["content"][0]["text"] += text
            self.emit("response.reasoning_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1,
                      content_index=0, delta=text)
        else:
            if item is None or item["type"] != "message":
                self._message()
            self.open["content"][0]["text"] += text
            self.emit("response.output_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1,
                      content_index=0, delta=text, logprobs=[])

    def _message(self) -> None:
        self._start({"id": _id("msg_"), "type": "message", "role": "assistant", "status": "in_progress",
                     "content": []}, {"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def on(self, events) -> None:
        for e in events:
            if e[0] in ("reasoning", "content"):
                self._text(e[0], e[1])
            elif e[0] == "tool_call":
                item = {"id": _id("fc_"), "type": "function_call", "call_id": _id("call_")[:29], "name": e[2],
                        "arguments": "", "status": "in_progress"}
                self.calls[e[1]] = item
                self._start(item)
            elif e[0] == "tool_args":
                item = self.calls[e[1]]
                item["arguments"] += e[2]
                self.emit("response.function_call_arguments.delta", item_id=item["id"],
                          output_index=self.items.index(item), delta=e[2])
            elif e[0] == "tool_done":
                item = self.calls[e[1]]
                try:
                    ok = json.loads(item["arguments"]) == e[2]["arguments"]
                except json.JSONDecodeError:
                    ok = False
                if not ok:                    # (the pieces make the arguments; should they not, the call's win)
                    item["arguments"] = json.dumps(e[2]["arguments"], ensure_ascii=False)
                if self.open is item:
                    self.close()
            if e[0] != "reasoning":
                self.answered = True

    def feed(self, out) -> None:
        self.tokens.append(out.token)
        self.on(self.parser.feed(out.text))
        if not self.answered and self.parser.opened_thinking:
            self.reasoning_tokens += 1        # (the token that closes the think block counts as reasoning)

    def finish(self, reason: str) -> None:
        self.on(self.parser.finish())
        status = "completed" if reason == "stop" else "incomplete"
        if not any(it["type"] in ("message", "function_call") for it in self.items):
            self._message()                   # a reply always has a message or calls
        self.close(status)
        for it in self.items:                 # a call the parser never finished (not expected)
            if it.get("status") == "in_progress":
                it["status"] = status


class _Request:
    """What a request decided, for its reply: the response's fields, the conversation, the turn, and its
    input items as they are listed."""

    def __init__(self, base: dict, conversation: list, turn, store_it: bool, items: list = ()):
        self.base, self.conversation, self.turn, self.store_it = base, conversation, turn, store_it
        self.items = items


class _ResponsesRender(Render):
    """A reply as a Responses object (collected) or as its typed events (streamed): ``response.created``,
    ``response.in_progress``, the items' events (`_Reply`), then ``response.completed`` or
    ``response.incomplete``; after an error, ``error`` and ``response.failed``."""

    def __init__(self, req: _Request, model, store: ResponseStore, streaming: bool):
        self.req, self.model, self.store = req, model, store
        self.reply = _Reply(req.turn, streaming)
        self.seq = 0

    def _sse(self, events) -> list:
        out = []
        for e in events:
            e["sequence_number"] = self.seq
            self.seq += 1
            out.append(sse(e, event=e["type"]))
        return out

    def _taken(self) -> list:
        ev, self.reply.events = self.reply.events, []
        return self._sse(ev)

    def response(self, status: str, **fields) -> dict:
        return {**self.req.base, "status": status, **fields}

    def start(self) -> list:
        r = self.response("in_progress", output=[])
        return self._sse([{"type": "response.created", "response": r},
                          {"type": "response.in_progress", "response": r}])

    def step(self, out) -> list:
        self.reply.feed(out)
        return self._taken()

    def final(self, reason: str, stats: dict) -> dict:
        """The finished response: stored (with ``store``) and its reply remembered for the next turn."""
        rep = self.reply
        rep.finish(reason)
        done = reason == "stop"
        r = self.response("completed" if done else "incomplete", output=rep.items,
                          incomplete_details=None if done else {"reason": "max_output_tokens"},
                          completed_at=int(time.time()) if done else None,
                          usage=_usage(stats, rep.reasoning_tokens))
        msgs, _ = input_messages(rep.items, "output")
        if len(msgs) == 1:                    # the reply as the client sends it back: its transcript
            self.req.turn.remember(self.model, msgs[0], rep.tokens)
        if self.req.store_it:
            self.store.put(r, self.req.conversation + msgs, self.req.items)
        return r

    def finish(self, reason: str, stats: dict) -> list:
        r = self.final(reason, stats)
        return self._taken() + self._sse([{"type": f"response.{r['status']}", "response": r}])

    def error(self, e: APIError) -> list:
        r = self.response("failed", output=self.reply.items,
                          error={"code": e.code or ("server_error" if e.status >= 500 else "invalid_request"),
                                 "message": e.message})
        return self._sse([{"type": "error", "code": e.code, "message": e.message, "param": e.param},
                          {"type": "response.failed", "response": r}])

    def body(self, outs: list, reason: str, stats: dict) -> dict:
        for o in outs:
            self.reply.feed(o)
        return self.final(reason, stats)


# ---------------------------------------------------------------------------------------------------
# the routes
# ---------------------------------------------------------------------------------------------------
def _renamed(e: APIError, origins: list) -> APIError:
    """An error of the chat layer, its ``param`` named as this API names the field."""
    p = e.param
    if p == "response_format":
        e.param = "text.format"
    elif p == "messages":
        e.param = "input"
    elif isinstance(p, str) and p.startswith("messages["):
        k, rest = p[len("messages["):].split("]", 1)
        if k.isdigit() and int(k) < len(origins):
            e.param = origins[int(k)] + rest if origins[int(k)].startswith("input[") else origins[int(k)]
    return e


def routes(svc: Service, store: ResponseStore | None = None) -> list:
    """The Responses API's routes on `svc` (``POST /v1/responses``, ``GET`` / ``DELETE
    /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``), with `store` (default: a new
    `ResponseStore`) keeping the responses."""
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    store = store if store is not None else ResponseStore()

    def not_found(rid: str) -> APIError:
        return APIError(404, f"Response with id '{rid}' not found.", "response_id", "not_found")

    async def create(request):
        body = await svc.read_json(request)
        if svc.tok is None:
            raise APIError(400, "this checkpoint has no tokenizer, so it cannot chat")
        for k in ("background", "conversation"):
            if body.get(k):
                raise _bad(f"'{k}' is not supported", k, "unsupported_value")
        new, origins = input_messages(body.get("input"))
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise _bad(f"'instructions' must be a string, got {brief(instructions, as_json=True)}", "instructions")
        prev_id = body.get("previous_response_id")
        history = []
        if prev_id is not None:
            prev = store.get(prev_id) if isinstance(prev_id, str) else None
            if prev is None:
                raise APIError(400, f"Previous response with id '{prev_id}' not found.", "previous_response_id",
                               "previous_response_not_found")
            history = prev[1]
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise _bad(f"'metadata' must be an object, got {brief(metadata, as_json=True)}", "metadata")
        stream = boolean(body, "stream")
        store_it = boolean(body, "store", True)
        parallel = boolean(body, "parallel_tool_calls", True)
        requested = num(body, "max_output_tokens", 1, None, integer=True)
        conversation = history + new           # what is kept: without the instructions (not carried over)
        head = [{"role": "system", "content": instructions}] if instructions else []
        origins = ["instructions"] * len(head) + ["previous_response_id"] * len(history) + origins
        msgs, origins = leading_system_merged(head + conversation, origins)
        tools, choice = tools_of(body.get("tools")), tool_choice_of(body.get("tool_choice"))
        if choice == "none":                   # as the chat endpoint: no tools in the prompt
            tools, choice = None, None
        try:
            turn = await svc.turn(msgs, param="input", tools=tools, tool_choice=choice,
                                  response_format=response_format_of(body.get("text")),
                                  parallel_tool_calls=parallel, enable_thinking=thinking_of(body.get("reasoning")))
        except APIError as e:
            raise _renamed(e, origins) from None
        opts = options_of(body, svc.max_tokens(requested, len(turn.prompt_ids), svc.default_max_tokens, "input"),
                          THINKING_BUDGET, grammar=turn.grammar)
        base = {"id": _id("resp_"), "object": "response", "created_at": int(time.time()), "model": svc.name,
                "status": "in_progress", "error": None, "incomplete_details": None, "instructions": instructions,
                "max_output_tokens": requested, "output": [], "parallel_tool_calls": parallel,
                "previous_response_id": prev_id, "reasoning": body.get("reasoning") or {"effort": None,
                                                                                        "summary": None},
                "store": store_it, "temperature": opts.temperature, "top_p": opts.top_p,
                "text": body.get("text") or {"format": {"type": "text"}},
                "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
                "truncation": "disabled", "metadata": metadata or {}, "user": body.get("user"), "usage": None}
        req = _Request(base, conversation, turn, store_it, listed_items(body.get("input")) if store_it else ())
        render = _ResponsesRender(req, svc.model, store, stream)
        return await svc.respond(request, svc.job(opts, turn.prompt_ids, turn.cache_points, turn.images), render,
                                 stream)

    async def retrieve(request):
        svc.check_key(request)
        rid = request.path_params["response_id"]
        got = store.get(rid)
        if got is None:
            raise not_found(rid)
        return JSONResponse(got[0])

    async def input_items(request):
        """The input items of a stored response's request, a page at a time (OpenAI's list: ``limit`` 1-100,
        default 20; ``order`` "desc" (default) or "asc"; ``after`` an item id)."""
        svc.check_key(request)
        rid = request.path_params["response_id"]
        items = store.input_items(rid)
        if items is None:
            raise not_found(rid)
        q = request.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise _bad(f"'order' must be 'asc' or 'desc', got {order!r}", "order")
        try:
            limit = int(q.get("limit", 20))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise _bad(f"'limit' must be an integer from 1 to 100, got {q.get('limit')!r}", "limit")
        seq = items if order == "asc" else items[::-1]
        after = q.get("after")
        if after is not None:
            ids = [it["id"] for it in seq]
            if after not in ids:
                raise _bad(f"'after' names no input item of response '{rid}': {after!r}", "after")
            seq = seq[ids.index(after) + 1:]
        page = seq[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(seq) > limit})

    async def delete(request):
        svc.check_key(request)
        rid = request.path_params["response_id"]
        if not store.delete(rid):
            raise not_found(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    return [Route("/v1/responses", create, methods=["POST"]),
            Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"]),
            Route("/v1/responses/{response_id}", delete, methods=["DELETE"])]

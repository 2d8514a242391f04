"""The Anthropic Messages API (`qwenmetal.api_anthropic`, ``POST /v1/messages``).

First the conversions and the event writer without a model: Anthropic requests -> the internal chat form,
errors in Anthropic's shape, stop reasons and usage, and a scripted reply (thinking, text, a tool call)
streamed and collected, read back as a client rebuilds it and converted again: exactly the message that was
remembered for the next turn.

Then the official `anthropic` client against the spawned loopback server (tests/live_server.py, shared with
tests/test_server.py): messages streamed and not (the same text, and the library's), the event sequence,
system prompts, thinking on and off, a forced tool call and its result on the next turn (resumed from the
cache: ``cache_read_input_tokens``), stop sequences, max_tokens, count_tokens and the error responses.
"""
import json

import pytest

from live_server import API_KEY, MAX_BODY, NAME
from oracles import require

from qwenmetal import api_anthropic as aa
from qwenmetal.chat import ChatStreamParser, parse_assistant
from qwenmetal.generation import GenerationOutput
from qwenmetal.grammar import BUDGET_NOTE
from qwenmetal.serving import APIError
from qwenmetal.transcripts import normalize_message

TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin"]}},
                           "required": ["city"]}}]
PNG = "iVBORw0KGgo="                              # (never decoded here)


# ---------------------------------------------------------------------------------------------------
# conversions
# ---------------------------------------------------------------------------------------------------
def test_messages_convert_to_the_internal_chat_form():
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=fa690;"},
              {"type": "text", "text": "You are terse."},
              {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}}]
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": PNG}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": "anything"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Berlin"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "timeout"},
                         {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]},
            {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}}]},
    ]
    got = aa.convert_messages(msgs, system)
    assert got == [
        {"role": "system", "content": "You are terse.\n\nUse tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG}}]},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.", "tool_calls": [
            {"id": f"toolu_{i}", "type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}}
            for i, c in ((1, "Paris"), (2, "Berlin"))]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                                     {"type": "text", "text": "And tomorrow?"}]},
    ]
    assert aa.convert_messages([{"role": "user", "content": "hi"}], "Be brief.") == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert aa.convert_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]) == [
        {"role": "user", "content": "hi"}]
    docs = [{"type": "document", "title": "notes.txt", "source": {"type": "text", "media_type": "text/plain",
                                                                  "data": "line 1"}},
            {"type": "tool_result", "tool_use_id": "t", "content": [
                {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "a"},
                                                                                 {"type": "text", "text": "b"}]}}]}]
    assert aa.convert_messages([{"role": "user", "content": docs}]) == [
        {"role": "tool", "tool_call_id": "t", "content": "a\nb"}, {"role": "user", "content": "notes.txt\n\nline 1"}]


def test_tools_tool_choice_thinking_and_output_format_convert():
    assert aa.convert_tools(TOOLS + [{"name": "f", "input_schema": {"type": "object"}, "strict": True,
                                      "type": "custom", "cache_control": {"type": "ephemeral"}}]) == [
        {"type": "function", "function": {"name": "get_weather", "parameters": TOOLS[0]["input_schema"],
                                          "description": "Weather of a city"}},
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}]
    assert aa.convert_tools(None) is None and aa.convert_tools([]) is None
    for tc, want in [(None, (None, True)), ({"type": "auto"}, ("auto", True)), ({"type": "any"}, ("required", True)),
                     ({"type": "none"}, ("none", True)),
                     ({"type": "tool", "name": "f", "disable_parallel_tool_use": True},
                      ({"type": "function", "function": {"name": "f"}}, False))]:
        assert aa.convert_tool_choice(tc) == want, tc
    for th, want in [(None, (False, True, None)), ({"type": "disabled"}, (False, True, None)),
                     ({"type": "enabled", "budget_tokens": 2048}, (True, True, 2048)),
                     ({"type": "adaptive"}, (True, True, None)),
                     ({"type": "adaptive", "display": "omitted"}, (True, False, None))]:
        assert aa.convert_thinking(th) == want, th
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    want = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": True}}
    assert aa.convert_output_format({"output_config": {"format": {"type": "json_schema", "schema": schema},
                                                       "effort": "high"}}) == want
    assert aa.convert_output_format({"output_format": {"type": "json_schema", "schema": schema}}) == want
    assert aa.convert_output_format({"output_config": {"effort": "low"}}) is None
    msgs, kw, thinking = aa.chat_request({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                          "tool_choice": {"type": "any"}, "thinking": {"type": "enabled"}})
    assert kw == {"tools": aa.convert_tools(TOOLS), "tool_choice": "required", "parallel_tool_calls": True,
                  "response_format": None, "enable_thinking": True} and thinking == aa.Thinking(True)


@pytest.mark.parametrize("body, message", [
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role 'user' or 'assistant'"),
    ({"messages": [{"role": "user"}]}, "messages.0.content: Field required"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "prefilling"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "base64",
                                                                                "media_type": "application/pdf",
                                                                                "data": "JVBER"}}]}]},
     "messages.0.content.0.source: only plain-text documents"),
    ({"messages": [{"role": "user", "content": [{"type": "search_result"}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "image sources"),
    ({"messages": [{"role": "assistant", "content": [{"type": "server_tool_use"}]}, {"role": "user", "content": "x"}]},
     "assistant messages take"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]},
                   {"role": "user", "content": "x"}]}, "object 'input'"),
    ({"system": [{"type": "image"}]}, "system.0"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "'web_search_20250305' is not supported"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"thinking": {"type": "maybe"}}, "thinking.type"),
    ({"thinking": {"type": "enabled", "budget_tokens": "lots"}}, "budget_tokens"),
    ({"output_config": {"format": {"type": "text"}}}, "output_config.format"),
    ({"output_format": {"type": "json_schema", "schema": "x"}}, "output_format.schema"),
])
def test_bad_requests_get_400_naming_the_field(body, message):
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(APIError, match=message.replace("(", r"\(")) as e:
        aa.chat_request(body)
    assert e.value.status == 400


def test_errors_are_in_anthropic_shape():
    for status, kind in [(400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
                         (404, "not_found_error"), (405, "invalid_request_error"), (413, "request_too_large"),
                         (429, "rate_limit_error"), (500, "api_error"), (503, "overloaded_error"),
                         (529, "overloaded_error")]:
        assert aa.error_body(APIError(status, "nope")) == {"type": "error", "error": {"type": kind, "message": "nope"}}
    r = aa.error_response(APIError(503, "busy", headers={"Retry-After": "1"}))
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert json.loads(r.body)["error"]["type"] == "overloaded_error"


def test_stop_reasons_and_usage():
    assert aa.stop_reason("stop", 7, False) == ("end_turn", None)
    assert aa.stop_reason("stop", 7, True) == ("tool_use", None)
    assert aa.stop_reason("stop", "END", False) == ("stop_sequence", "END")
    assert aa.stop_reason("length", None, True) == ("max_tokens", None)
    assert aa.stop_reason("time_limit", None, False) == ("max_tokens", None)
    assert aa.stop_reason("context", None, False) == ("model_context_window_exceeded", None)
    u = aa.usage({"prompt_tokens": 100, "cached_tokens": 60, "generated_tokens": 5})
    assert u == {"input_tokens": 40, "output_tokens": 5, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": 60}
    assert aa.usage({"prompt_tokens": 100, "cached_tokens": None, "generated_tokens": 5})["input_tokens"] == 100


# ---------------------------------------------------------------------------------------------------
# the event writer, on a scripted reply
# ---------------------------------------------------------------------------------------------------
class _Turn:
    """The parts of a `ChatTurn` the writer uses, for a scripted reply (thinking on, the weather tool)."""

    prompt_ids = [1, 2, 3]

    def __init__(self):
        self.tools = aa.convert_tools(TOOLS)
        self.remembered = []

    def stream_parser(self):
        return ChatStreamParser(True, self.tools)

    def parse(self, text):
        return parse_assistant(text, thinking=True, tools=self.tools)

    def remember(self, model, message, tokens):
        self.remembered.append((message, list(tokens)))


class _Svc:
    name, model = NAME, None


REPLY = ("Berlin, so the tool.\n</think>\n\nLet me check.\n<tool_call>\n<function=get_weather>\n"
         "<parameter=city>\nBerlin\n</parameter>\n</function>\n</tool_call>")


def _outputs(text, size=3, stop=99):
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    stats = {"prompt_tokens": 3, "cached_tokens": 0, "generated_tokens": len(pieces)}
    return [GenerationOutput(10 + i, p, i, "stop" if i == len(pieces) - 1 else None,
                             stats if i == len(pieces) - 1 else None, stop=stop if i == len(pieces) - 1 else None)
            for i, p in enumerate(pieces)], stats


def _events(chunks):
    out = []
    for c in chunks:
        head, data = c.strip("\n").split("\n")
        ev = json.loads(data[len("data: "):])
        assert head == "event: " + ev["type"]
        out.append(ev)
    return out


def _rebuild(events) -> dict:
    """The message a client accumulates from the events (as the anthropic library does)."""
    msg, parts = None, {}
    for ev in events:
        if ev["type"] == "message_start":
            msg = ev["message"]
        elif ev["type"] == "content_block_start":
            msg["content"].append(dict(ev["content_block"]))
        elif ev["type"] == "content_block_delta":
            b, d = msg["content"][ev["index"]], ev["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature"}.get(d["type"])
            if key == "signature":
                b[key] = d[key]
            elif key is not None:
                b[key] += d[key]
            else:
                parts[ev["index"]] = parts.get(ev["index"], "") + d["partial_json"]
        elif ev["type"] == "content_block_stop" and ev["index"] in parts:
            msg["content"][ev["index"]]["input"] = json.loads(parts[ev["index"]])
        elif ev["type"] == "message_delta":
            msg.update(ev["delta"])
            msg["usage"].update(ev["usage"])
    return msg


def test_a_streamed_reply_is_the_collected_one_and_is_remembered_as_the_client_sends_it_back():
    turn = _Turn()
    outs, stats = _outputs(REPLY)
    r = aa._MessagesRender(_Svc(), turn, show_thinking=True)
    chunks = r.start()
    for o in outs:
        chunks += r.step(o)
    chunks += r.finish("stop", stats)
    events = _events(chunks)
    kinds = [e["type"] if e["type"] != "content_block_delta" else e["delta"]["type"] for e in events]
    # message_start, ping; thinking (its signature before it stops), text, the tool call; the end
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    blocks = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert blocks == ["thinking", "text", "tool_use"]
    i = kinds.index("signature_delta")
    assert kinds[i + 1] == "content_block_stop" and set(kinds[3:i]) == {"thinking_delta"}
    assert "input_json_delta" in kinds
    streamed = _rebuild(events)
    assert streamed["stop_reason"] == "tool_use" and streamed["stop_sequence"] is None
    assert streamed["usage"]["output_tokens"] == len(outs)

    turn2 = _Turn()
    body = aa._MessagesRender(_Svc(), turn2, show_thinking=True).body(outs, "stop", stats)
    assert body["stop_reason"] == "tool_use" and body["id"].startswith("msg_")
    strip = {"thinking": "thinking", "text": "text"}
    for a, b in zip(streamed["content"], body["content"], strict=True):
        assert a["type"] == b["type"]
        if a["type"] in strip:
            assert a[strip[a["type"]]].strip() == b[strip[a["type"]]]
        else:
            assert a["input"] == b["input"] == {"city": "Berlin"} and a["id"].startswith("toolu_")
    assert body["content"][0]["signature"] == streamed["content"][0]["signature"]

    # what each remembered is what the client sends back, converted (the transcript key matches)
    for t, msg in ((turn, streamed), (turn2, body)):
        (remembered, tokens), = t.remembered
        assert tokens == [o.token for o in outs]
        back = aa.convert_messages([{"role": "user", "content": "Weather?"},
                                    {"role": "assistant", "content": msg["content"]},
                                    {"role": "user", "content": "thanks"}])[1]
        assert normalize_message(back) == normalize_message(remembered)


def test_hidden_thinking_stop_sequences_and_stream_errors():
    turn = _Turn()
    outs, stats = _outputs("secret plan</think>\n\nDone", stop="END")
    r = aa._MessagesRender(_Svc(), turn, show_thinking=False)
    events = _events(r.start() + [c for o in outs for c in r.step(o)] + r.finish("stop", stats))
    msg = _rebuild(events)
    assert msg["content"][0] == {"type": "thinking", "thinking": "", "signature": aa.signature("secret plan")}
    assert msg["content"][1] == {"type": "text", "text": "Done"}
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "END")
    body = aa._MessagesRender(_Svc(), _Turn(), show_thinking=False).body(outs, "stop", stats)
    assert body["content"][0]["thinking"] == "" and body["stop_sequence"] == "END"
    ev, = _events(r.error(APIError(503, "the server is shutting down")))
    assert ev == {"type": "error", "error": {"type": "overloaded_error", "message": "the server is shutting down"}}


# ---------------------------------------------------------------------------------------------------
# the official client against the live server
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(spawned_url):
    anthropic = require("anthropic")
    return anthropic.Anthropic(base_url=spawned_url, api_key=API_KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def local(spawned_local):
    return spawned_local


USER = [{"role": "user", "content": "What is the capital of Italy?"}]
GREEDY = {"temperature": 0}                       # (this version of the client has no sampling arguments)


def _text(msg) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


def test_messages_streamed_and_not_match_the_library(client, local):
    r = client.messages.create(model=NAME, max_tokens=10, system="You are terse.", messages=USER, extra_body=GREEDY)
    want = local.chat([{"role": "system", "content": "You are terse."}] + USER, max_tokens=10, temperature=0,
                      enable_thinking=False)
    assert r.type == "message" and r.role == "assistant" and r.model == NAME and r.id.startswith("msg_")
    assert _text(r) == want.content and not [b for b in r.content if b.type == "thinking"]
    assert r.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[want.finish_reason]
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == want.stats["prompt_tokens"]
    assert r.usage.output_tokens == want.stats["generated_tokens"]
    n = client.messages.count_tokens(model=NAME, system="You are terse.", messages=USER).input_tokens
    assert n == want.stats["prompt_tokens"]

    seen = []
    with client.messages.stream(model=NAME, max_tokens=10, system="You are terse.", messages=USER,
                                extra_body=GREEDY) as s:
        for ev in s:
            seen.append(ev.type)
        m = s.get_final_message()
    assert seen[0] == "message_start" and seen[-2:] == ["message_delta", "message_stop"]
    assert _text(m).strip() == _text(r) and m.stop_reason == r.stop_reason
    assert m.usage.output_tokens == r.usage.output_tokens
    assert m.usage.cache_read_input_tokens == n             # the same prompt again: from the prefix cache


def test_models_list_reads_as_anthropic_models(client):
    (m,) = client.models.list().data
    assert (m.id, m.type, m.display_name) == (NAME, "model", NAME) and m.created_at.year >= 2024


def test_raw_event_stream_has_a_ping_and_names_every_event(spawned_url):
    import httpx

    body = {"model": NAME, "max_tokens": 3, "stream": True, "messages": USER}
    with httpx.stream("POST", spawned_url + "/v1/messages", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}", "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    names = [ln[len("event: "):] for ln in lines if ln.startswith("event: ")]
    data = [json.loads(ln[len("data: "):]) for ln in lines if ln.startswith("data: ")]
    assert len(names) == len(data) and names == [d["type"] for d in data]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"


def test_system_blocks_with_cache_control_are_the_system_string(client):
    blocks = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.37; cch=fa690;"},
              {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Answer in French."}]
    a = client.messages.count_tokens(model=NAME, system=blocks, messages=USER).input_tokens
    b = client.messages.count_tokens(model=NAME, system="You are terse.\n\nAnswer in French.", messages=USER)
    c = client.messages.count_tokens(model=NAME, messages=USER).input_tokens
    assert a == b.input_tokens > c


def test_thinking_on_and_off(client):
    on = client.messages.create(model=NAME, max_tokens=6, messages=USER, thinking={"type": "enabled",
                                                                                 "budget_tokens": 1024},
                                extra_body=GREEDY)
    assert on.content[0].type == "thinking" and on.content[0].signature
    with client.messages.stream(model=NAME, max_tokens=6, messages=USER, thinking={"type": "adaptive"},
                                extra_body=GREEDY) as s:
        deltas = [ev.delta.type for ev in s if ev.type == "content_block_delta"]
        m = s.get_final_message()
    assert "thinking_delta" in deltas and "signature_delta" in deltas
    assert m.content[0].thinking.strip() == on.content[0].thinking
    off = client.messages.count_tokens(model=NAME, messages=USER, thinking={"type": "disabled"})
    assert client.messages.count_tokens(model=NAME, messages=USER).input_tokens == off.input_tokens
    assert on.usage.input_tokens + on.usage.cache_read_input_tokens != off.input_tokens


def test_budget_tokens_close_the_thinking_and_the_answer_follows(client):
    """The tiny model never closes its think block by itself: with ``budget_tokens`` the block ends after that
    many tokens with Qwen's note, and the answer follows within ``max_tokens``."""
    budget = 70                                   # the tiny tokenizer writes the note in 66 tokens
    r = client.messages.create(model=NAME, max_tokens=budget + 6, messages=USER, extra_body=GREEDY,
                               thinking={"type": "enabled", "budget_tokens": budget})
    assert r.content[0].type == "thinking" and r.content[0].thinking.endswith(BUDGET_NOTE.strip())
    assert r.usage.output_tokens > budget + 1 and r.content[1].type == "text"


def test_a_forced_tool_call_and_its_result_resume_from_the_cache(client):
    r1 = client.messages.create(model=NAME, max_tokens=80, messages=[{"role": "user", "content": "Weather in Berlin?"}],
                                tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert r1.stop_reason == "tool_use", r1
    call = r1.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.input["city"] in ("Paris", "Berlin")
    assert call.id.startswith("toolu_")
    msgs = [{"role": "user", "content": "Weather in Berlin?"}, r1.to_param(),
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C"}]}]
    r2 = client.messages.create(model=NAME, max_tokens=4, messages=msgs, tools=TOOLS, extra_body=GREEDY)
    # turn 2 continues turn 1's prompt and reply (all but its end token) from the prefix cache
    prompt1 = r1.usage.input_tokens + r1.usage.cache_read_input_tokens
    assert r2.usage.cache_read_input_tokens == prompt1 + r1.usage.output_tokens - 1

    with client.messages.stream(model=NAME, max_tokens=80, messages=[{"role": "user", "content": "Weather?"}],
                                tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                extra_body=GREEDY) as s:
        deltas = [ev.delta.type for ev in s if ev.type == "content_block_delta"]
        m = s.get_final_message()
    assert m.stop_reason == "tool_use" and "input_json_delta" in deltas
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert call.input["city"] in ("Paris", "Berlin")
    msgs = [{"role": "user", "content": "Weather?"}, m.to_param(),
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "cold"},
                                         {"type": "text", "text": "Thanks."}]}]
    r3 = client.messages.create(model=NAME, max_tokens=4, messages=msgs, tools=TOOLS, stream=False, extra_body=GREEDY)
    assert r3.usage.cache_read_input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens \
        + m.usage.output_tokens - 1


def test_stop_sequences_and_max_tokens(client):
    free = client.messages.create(model=NAME, max_tokens=24, messages=USER,
                                  extra_body={**GREEDY, "ignore_eos": True})
    assert free.stop_reason == "max_tokens" and free.usage.output_tokens == 24
    text = _text(free)
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if text[i:i + 3].strip() == text[i:i + 3]
                and text.index(text[i:i + 3]) == i)
    r = client.messages.create(model=NAME, max_tokens=24, messages=USER, stop_sequences=[stop, "\x00never"],
                               extra_body={**GREEDY, "ignore_eos": True})
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert _text(r) == text[:text.index(stop)].strip()
    with client.messages.stream(model=NAME, max_tokens=24, messages=USER, stop_sequences=[stop],
                                extra_body={**GREEDY, "ignore_eos": True}) as s:
        m = s.get_final_message()
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop) and _text(m).strip() == _text(r)
    # max_tokens 0 fills the cache and answers nothing
    new = [{"role": "user", "content": "Warm this prompt up."}]
    w = client.messages.create(model=NAME, max_tokens=0, messages=new)
    assert (w.content, w.stop_reason, w.usage.output_tokens) == ([], "max_tokens", 0)
    again = client.messages.create(model=NAME, max_tokens=1, messages=new)
    assert again.usage.cache_read_input_tokens == w.usage.input_tokens > 0


def test_structured_output_follows_the_schema(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    r = client.messages.create(model=NAME, max_tokens=40, messages=USER, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    got = json.loads(_text(r))
    assert r.stop_reason == "end_turn" and set(got) == {"n", "ok"} and isinstance(got["ok"], bool)
    r2 = client.messages.create(model=NAME, max_tokens=40, messages=USER,
                                extra_body={**GREEDY, "output_format": {"type": "json_schema", "schema": schema}})
    assert json.loads(_text(r2)) == got


def test_errors_have_anthropic_types(client, spawned_url):
    import anthropic
    import httpx

    def bad(call, cls, kind, match):
        with pytest.raises(cls, match=match) as e:
            call()
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == kind, e.value.body
        return e.value

    bad(lambda: client.messages.create(model=NAME, max_tokens=5, messages=USER + [{"role": "assistant",
                                                                                 "content": "Rome"}]),
        anthropic.BadRequestError, "invalid_request_error", "prefilling")
    bad(lambda: client.messages.create(model=NAME, max_tokens=5, messages=USER,
                                       tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        anthropic.BadRequestError, "invalid_request_error", "not supported")
    bad(lambda: client.messages.create(model=NAME, max_tokens=5, messages=USER, tools=TOOLS,
                                       tool_choice={"type": "tool", "name": "nope"}),
        anthropic.BadRequestError, "invalid_request_error", "nope")
    bad(lambda: client.messages.create(model=NAME, max_tokens=5, messages=USER, output_config={
        "format": {"type": "json_schema", "schema": {"type": "nonsense"}}}),
        anthropic.BadRequestError, "invalid_request_error", "output_config.format")
    bad(lambda: client.messages.create(model="claude-opus-4", max_tokens=5, messages=USER),
        anthropic.NotFoundError, "not_found_error", "claude-opus-4")
    wrong = anthropic.Anthropic(base_url=spawned_url, api_key="wrong", max_retries=0, timeout=10)
    bad(lambda: wrong.messages.create(model=NAME, max_tokens=5, messages=USER), anthropic.AuthenticationError,
        "authentication_error", "API key")
    e = bad(lambda: client.messages.create(model=NAME, max_tokens=5, messages=[
        {"role": "user", "content": "x" * (MAX_BODY + 10)}]), anthropic.APIStatusError, "request_too_large", "limit")
    assert e.status_code == 413
    h = {"x-api-key": API_KEY}
    for method, path, body, status, kind in [
            ("POST", "/v1/messages", {"model": NAME, "messages": USER}, 400, "invalid_request_error"),
            ("POST", "/v1/messages", {"max_tokens": 5, "messages": USER, "temperature": 9}, 400,
             "invalid_request_error"),
            ("GET", "/v1/messages", None, 405, "invalid_request_error"),
            ("POST", "/v1/messages/batches", {}, 404, "not_found_error"),
            ("POST", "/v1/messages/count_tokens", {"messages": "hi"}, 400, "invalid_request_error")]:
        r = httpx.request(method, spawned_url + path, json=body, headers=h, timeout=10)
        assert r.status_code == status and r.json()["type"] == "error", (path, r.text)
        assert r.json()["error"]["type"] == kind, (path, r.text)
    assert "max_tokens" in httpx.post(spawned_url + "/v1/messages", json={"messages": USER}, headers=h,
                                      timeout=10).json()["error"]["message"]
    # the OpenAI routes keep OpenAI's shape
    r = httpx.get(spawned_url + "/v1/chat/completions", headers=h, timeout=10)
    assert r.status_code == 405 and "type" in r.json()["error"] and "param" in r.json()["error"]

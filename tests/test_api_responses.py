"""The OpenAI Responses API (`qwenmetal.api_responses`), driven by the official openai client.

The conversions (input items -> chat messages, tools, tool_choice, text.format, reasoning effort) and the
response store are tested directly. Against `qwenmetal serve` in a subprocess (``spawned_url``, shared with the other
API tests: tests/conftest.py): a string input streamed and not and through the ``responses.stream`` helper
(the same reply as the library's), instructions and function-call items (the prompt the library renders for
the same conversation), a forced tool call and a JSON answer (the grammar holds the random model to the
tool's and the answer's schema), ``previous_response_id`` (cached tokens on the second turn), GET / DELETE,
``store: false`` and the errors. Against an in-process app whose sampler follows a script: a reply with
reasoning, text and a tool call as output items and as streamed events, continued by its call's output
(through ``previous_response_id`` and as the full input a stateless client such as Codex sends), and a
generation that fails mid-stream.
"""
import json

import pytest

from live_server import API_KEY, NAME
from oracles import require

import qwenmetal as qm
from qwenmetal.api_responses import (
    ResponseStore,
    input_messages,
    leading_system_merged,
    listed_items,
    response_format_of,
    thinking_of,
    tool_choice_of,
    tools_of,
)
from qwenmetal.grammar import BUDGET_NOTE
from qwenmetal.serving import APIError

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}


# ---------------------------------------------------------------------------------------------------
# conversions
# ---------------------------------------------------------------------------------------------------
def test_input_items_become_chat_messages():
    assert input_messages("Hi") == ([{"role": "user", "content": "Hi"}], ["input"])
    img = "data:image/png;base64,iVBORw0KGgo="
    items = [
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Look: "},
                                                        {"type": "input_image", "image_url": img, "detail": "auto"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me ", "annotations": []},
                     {"type": "output_text", "text": "check.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "A"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "B"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Dropped: no reply follows."}]},
        {"role": "user", "content": "Thanks"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Again."}]},
        {"type": "function_call", "call_id": "c3", "name": "get_weather", "arguments": "{}"},
    ]
    msgs, origins = input_messages(items)
    call = lambda cid, args: {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": args}}  # noqa: E731
    assert msgs == [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                     {"type": "image_url", "image_url": {"url": img}}]},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Hm.",
         "tool_calls": [call("c1", '{"city": "A"}'), call("c2", '{"city": "B"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "", "reasoning_content": "Again.", "tool_calls": [call("c3", "{}")]},
    ]
    assert origins == ["input[0]", "input[1]", "input[3]", "input[6]", "input[7]", "input[9]", "input[11]"]


def test_leading_system_messages_become_one():
    msgs = [{"role": "system", "content": "A"}, {"role": "developer", "content": ""},
            {"role": "developer", "content": "B"}, {"role": "user", "content": "hi"},
            {"role": "developer", "content": "C"}]
    assert leading_system_merged(msgs, ["instructions", "input[0]", "input[1]", "input[2]", "input[3]"]) == (
        [{"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "hi"},
         {"role": "developer", "content": "C"}], ["instructions", "input[2]", "input[3]"])
    assert leading_system_merged(msgs[1:], ["x"] * 4) == ([{"role": "system", "content": "B"}] + msgs[3:], ["x"] * 3)
    assert leading_system_merged(msgs[2:], ["x"] * 3) == (msgs[2:], ["x"] * 3)


@pytest.mark.parametrize("items, param", [
    ([], "input"),
    (None, "input"),
    ([{"type": "item_reference", "id": "x"}], "input[0].type"),
    (["text"], "input[0]"),
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input[0].content[0]"),
    ([{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}], "input[0].content[0]"),
    ([{"role": "user", "content": 3}], "input[0].content"),
    ([{"role": "user", "content": "x"}, {"type": "function_call", "name": "f", "arguments": "{}"}], "input[1]"),
    ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
    ([{"type": "function_call_output", "call_id": "c", "output": {"a": 1}}], "input[0].output"),
])
def test_bad_input_items_name_the_item(items, param):
    with pytest.raises(APIError, match=r"^'?input") as e:
        input_messages(items)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_tools_tool_choice_text_format_and_reasoning_effort():
    assert tools_of(None) is None
    assert tools_of([dict(WEATHER, strict=True)]) == [
        {"type": "function", "function": {**CHAT_WEATHER["function"], "strict": True}}]
    assert tools_of([CHAT_WEATHER]) == [CHAT_WEATHER]                 # the chat form is taken too
    for bad, param in (([{"type": "web_search"}], "tools[0].type"), ([{"type": "function"}], "tools[0].name"),
                       ({"type": "function"}, "tools")):
        with pytest.raises(APIError, match=r"^'?tools") as e:
            tools_of(bad)
        assert e.value.param == param
    assert [tool_choice_of(c) for c in (None, "auto", "none", "required")] == [None, "auto", "none", "required"]
    assert tool_choice_of({"type": "function", "name": "f"}) == {"type": "function", "function": {"name": "f"}}
    with pytest.raises(APIError, match="tool_choice"):
        tool_choice_of({"type": "file_search"})
    assert response_format_of(None) is None and response_format_of({"format": {"type": "text"}}) == {"type": "text"}
    assert response_format_of({"format": {"type": "json_object"}}) == {"type": "json_object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert response_format_of({"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}}) == {
        "type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}}
    with pytest.raises(APIError, match="text.format must be") as e:
        response_format_of({"format": {"type": "grammar"}})
    assert e.value.param == "text.format"
    assert [thinking_of(r) for r in (None, {}, {"effort": None}, {"effort": "none"}, {"effort": "minimal"},
                                     {"effort": "low"}, {"effort": "xhigh"})] == [None, None, None, False, False,
                                                                                   True, True]
    with pytest.raises(APIError, match="reasoning.effort must be one of") as e:
        thinking_of({"effort": "extreme"})
    assert e.value.param == "reasoning.effort"


def test_the_response_store_is_bounded():
    def resp(i, pad=0):
        return {"id": f"resp_{i}", "output": ["x" * pad]}
    s = ResponseStore(max_entries=3, max_bytes=10_000)
    for i in range(4):
        assert s.put(resp(i), [{"role": "user", "content": str(i)}], listed_items(str(i)))
    assert len(s) == 3 and s.get("resp_0") is None and s.input_items("resp_0") is None   # least recently used out
    assert s.get("resp_1")[1] == [{"role": "user", "content": "1"}]
    assert s.input_items("resp_1")[0]["content"] == [{"type": "input_text", "text": "1"}]
    s.put(resp(4), [])                                            # resp_2 is now the oldest
    assert s.get("resp_2") is None and s.get("resp_1") is not None
    assert not s.put(resp(5, pad=20_000), [])                    # larger than the whole budget: not kept
    s.put(resp(6, pad=9_950), [])                                 # the budget: older ones go
    assert len(s) == 1 and s.get("resp_6") is not None and s.bytes <= 10_000
    assert s.delete("resp_6") and not s.delete("resp_6") and len(s) == 0 and s.bytes == 0
    with pytest.raises(ValueError, match="must be >= 1"):
        ResponseStore(max_entries=0)


# ---------------------------------------------------------------------------------------------------
# against `qwenmetal serve`
# ---------------------------------------------------------------------------------------------------


Q = "What is the capital of France?"          # this checkpoint answers it with a short reply and its end token


def _texts(r):
    """(reasoning text, output text) of a Response."""
    reasoning = "".join(c.text for it in r.output if it.type == "reasoning" for c in it.content or ())
    return reasoning, r.output_text


def test_a_string_input_streamed_and_not_and_through_the_stream_helper(openai_client, spawned_local):
    want = spawned_local.chat([{"role": "user", "content": Q}], max_tokens=16, temperature=0)
    r = openai_client.responses.create(model=NAME, input=Q, max_output_tokens=16, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    assert tuple(t.strip() for t in _texts(r)) == (want.reasoning or "", want.content)
    assert r.usage.input_tokens == want.stats["prompt_tokens"]
    assert r.usage.output_tokens == want.stats["generated_tokens"]
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    assert [it.type for it in r.output] == ["reasoning", "message"]
    assert all(it.status == "completed" for it in r.output)

    events = list(openai_client.responses.create(model=NAME, input=Q, max_output_tokens=16, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = {k: "".join(e.delta for e in events if e.type == f"response.{k}.delta")
              for k in ("reasoning_text", "output_text")}
    final = events[-1].response
    assert (deltas["reasoning_text"], deltas["output_text"]) == _texts(final) == _texts(r)
    assert final.usage.output_tokens == r.usage.output_tokens
    # the identical prompt came from the prefix cache
    assert final.usage.input_tokens_details.cached_tokens == r.usage.input_tokens

    with openai_client.responses.stream(model=NAME, input=Q, max_output_tokens=16, temperature=0) as s:
        seen = [e.type for e in s]
        helper = s.get_final_response()
    assert seen == types and _texts(helper) == _texts(r) and helper.status == "completed"

    # a reply cut by max_output_tokens is incomplete
    cut = openai_client.responses.create(model=NAME, input="Name three birds.", max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3
    last = list(openai_client.responses.create(model=NAME, input="Name three birds.", max_output_tokens=3,
                                        temperature=0, stream=True))[-1]
    assert last.type == "response.incomplete" and _texts(last.response) == _texts(cut)


def test_thinking_token_budget_closes_the_reasoning(openai_client, spawned_local):
    budget = len(spawned_local.tokenizer.encode(BUDGET_NOTE)) + 1
    r = openai_client.responses.create(model=NAME, input=Q, max_output_tokens=budget + 8, temperature=0,
                                       reasoning={"effort": "high"}, extra_body={"thinking_token_budget": budget})
    assert _texts(r)[0].strip().endswith(BUDGET_NOTE.strip())


def test_instructions_and_function_call_items_render_as_the_chat_conversation(openai_client, spawned_local):
    r = openai_client.responses.create(model=NAME, input=Q, instructions="You are terse.", max_output_tokens=1)
    ids, _, _ = spawned_local.chat_prompt([{"role": "system", "content": "You are terse."}, {"role": "user", "content": Q}])
    assert r.usage.input_tokens == len(ids) and r.instructions == "You are terse."
    # instructions and leading developer messages are one system message (Qwen's templates take one)
    r = openai_client.responses.create(model=NAME, instructions="You are terse.", max_output_tokens=1,
                                input=[{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": Q}])
    ids, _, _ = spawned_local.chat_prompt([{"role": "system", "content": "You are terse.\n\nAnswer in French."},
                                   {"role": "user", "content": Q}])
    assert r.usage.input_tokens == len(ids)
    items = [{"role": "user", "content": "Weather in Berlin?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Berlin"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature": 21}'}]
    r = openai_client.responses.create(model=NAME, input=items, tools=[WEATHER], max_output_tokens=1)
    ids, _, _ = spawned_local.chat_prompt(
        [{"role": "user", "content": "Weather in Berlin?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Berlin"}'}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}], tools=[CHAT_WEATHER])
    assert r.usage.input_tokens == len(ids) and r.tools[0].name == "get_weather"


def test_a_forced_tool_call_and_a_json_answer_follow_their_schemas(openai_client):
    """The grammar holds the random model to the format: a named tool_choice gives one function_call item
    whose arguments follow the tool's schema (streamed: the argument deltas make them), and text.format
    json_schema an output_text that is an instance of the schema."""
    tool = {"type": "function", "name": "set_light", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}
    args = {"model": NAME, "input": "Light on?", "tools": [tool], "tool_choice": {"type": "function", "name": "set_light"},
            "reasoning": {"effort": "none"}, "max_output_tokens": 40, "temperature": 0}
    r = openai_client.responses.create(**args)
    calls = [it for it in r.output if it.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "set_light"
    assert isinstance(json.loads(calls[0].arguments)["on"], bool)
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    events = list(openai_client.responses.create(stream=True, **args))
    fargs = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(fargs) == json.loads(calls[0].arguments) and events[-1].type == "response.completed"

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = openai_client.responses.create(model=NAME, input="Is it ok?", reasoning={"effort": "none"}, max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text)["ok"], bool)
    assert r.text.format.type == "json_schema"


def test_previous_response_id_continues_the_conversation_from_the_cache(openai_client):
    import openai

    r1 = openai_client.responses.create(model=NAME, input=Q, max_output_tokens=16, temperature=0)
    r2 = openai_client.responses.create(model=NAME, input="And of Spain?", previous_response_id=r1.id,
                                 max_output_tokens=4, temperature=0)
    assert r2.previous_response_id == r1.id
    # the first turn's prompt and reply (ended on its end token: a transcript) are all reused
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens + r1.usage.output_tokens - 1
    assert r2.usage.input_tokens > r2.usage.input_tokens_details.cached_tokens

    got = openai_client.responses.retrieve(r1.id)
    assert got.id == r1.id and _texts(got) == _texts(r1) and got.usage.input_tokens == r1.usage.input_tokens
    openai_client.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError, match="resp_") as e:
        openai_client.responses.retrieve(r1.id)
    assert e.value.body["code"] == "not_found"
    with pytest.raises(openai.NotFoundError, match="resp_"):
        openai_client.responses.delete(r1.id)
    with pytest.raises(openai.BadRequestError, match="Previous response with id") as e:
        openai_client.responses.create(model=NAME, input="Hi", previous_response_id=r1.id, max_output_tokens=1)
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"
    # r2 stands on its own: its conversation was kept whole
    r3 = openai_client.responses.create(model=NAME, input="And Italy?", previous_response_id=r2.id, max_output_tokens=1)
    assert r3.usage.input_tokens > r2.usage.input_tokens

    nostore = openai_client.responses.create(model=NAME, input="Hi", store=False, max_output_tokens=1)
    assert nostore.store is False
    with pytest.raises(openai.NotFoundError, match="resp_"):
        openai_client.responses.retrieve(nostore.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        openai_client.responses.create(model=NAME, input="Hi", previous_response_id=nostore.id, max_output_tokens=1)


def test_input_items_are_listed_as_given_with_ids():
    items = listed_items([{"role": "user", "content": "Hi"},
                          {"type": "message", "role": "assistant", "content": "Hello", "id": "msg_given"},
                          {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                          {"type": "function_call_output", "call_id": "c1", "output": "ok"}])
    assert [it["type"] for it in items] == ["message", "message", "function_call", "function_call_output"]
    assert [it["id"].split("_")[0] for it in items] == ["msg", "msg", "fc", "fco"]
    assert items[1]["id"] == "msg_given" and items[1]["content"] == [{"type": "output_text", "text": "Hello"}]
    assert items[0]["content"] == [{"type": "input_text", "text": "Hi"}] and items[0]["status"] == "completed"
    assert items[3]["output"] == "ok" and "status" not in items[2]


def test_input_items_list_a_stored_responses_input_a_page_at_a_time(openai_client, spawned_url):
    import httpx
    import openai

    given = [{"role": "user", "content": "Hi"}, {"type": "message", "role": "assistant", "content": "Hello",
                                                 "id": "msg_given"},
             {"role": "user", "content": [{"type": "input_text", "text": "And?"}]}]
    r = openai_client.responses.create(model=NAME, input=given, max_output_tokens=2, temperature=0)
    page = openai_client.responses.input_items.list(r.id)
    assert [it.type for it in page.data] == ["message"] * 3 and page.data[1].id == "msg_given"
    assert [it.content[0].text for it in page.data] == ["And?", "Hello", "Hi"]          # newest first
    every = list(openai_client.responses.input_items.list(r.id, limit=1, order="asc"))  # the SDK pages by `after`
    assert [it.id for it in every] == [it.id for it in reversed(page.data)]
    head = {"Authorization": f"Bearer {API_KEY}"}
    for q, param in [("order=sideways", "order"), ("limit=0", "limit"), ("limit=x", "limit"), ("after=nope", "after")]:
        bad = httpx.get(f"{spawned_url}/v1/responses/{r.id}/input_items?{q}", headers=head, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, q
    with pytest.raises(openai.NotFoundError, match="resp_x"):
        openai_client.responses.input_items.list("resp_x")
    nostore = openai_client.responses.create(model=NAME, input="Hi", store=False, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError, match=nostore.id):
        openai_client.responses.input_items.list(nostore.id)


def test_bad_requests(spawned_url, openai_client):
    import httpx
    import openai

    for kw, param in [({"temperature": 5}, "temperature"), ({"max_output_tokens": 0}, "max_output_tokens"),
                      ({"input": []}, "input"), ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
                      ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                      ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
                      ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
                      ({"reasoning": {"effort": "max"}}, "reasoning.effort"),
                      ({"input": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]},
                       "input[1].role")]:
        args = {"model": NAME, "input": "Hi", "max_output_tokens": 2, **kw}
        with pytest.raises(openai.BadRequestError, match="Error code: 400") as e:
            openai_client.responses.create(**args)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (kw, e.value.body)
        assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError, match="does not exist") as e:
        openai_client.responses.create(model="gpt-5", input="Hi")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="context") as e:   # longer than the context
        openai_client.responses.create(model=NAME, input="x " * 5000, max_output_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "input"
    r = httpx.get(spawned_url + "/v1/responses/resp_x", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.put(spawned_url + "/v1/responses", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert r.status_code == 405
    assert openai_client.responses.create(model=NAME, input="ok", max_output_tokens=1).status   # still serving


# ---------------------------------------------------------------------------------------------------
# scripted replies: reasoning, text and tool calls
# ---------------------------------------------------------------------------------------------------
REPLY = ("Let me check.</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nBerlin\n"
         "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def scripted():
    """(openai client, script) on an in-process app whose sampler writes ``script["tokens"]`` (then repeats the
    last one), or raises ``script["fail"]`` at the second token."""
    require("starlette")
    require("httpx")
    openai = require("openai")
    from starlette.testclient import TestClient

    from qwenmetal.sampling import SampleResult
    from qwenmetal.server import create_app
    from qwenmetal.testing import cached_checkpoint

    model = qm.Model.load(cached_checkpoint("tiny"), backend="cpu")
    script = {"tokens": [], "fail": None}

    class Script:
        def __init__(self):
            self.i = 0

        def sample(self, logits, vocab_used=None, **kw):
            self.i += 1
            if script["fail"] is not None and self.i == 2:
                raise script["fail"]
            return SampleResult(script["tokens"][min(self.i - 1, len(script["tokens"]) - 1)])

    real = model.generate
    model.generate = lambda ids, **kw: real(ids, sampler=Script(), **kw)
    app = create_app(model, model_name=NAME)
    with TestClient(app) as tc:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0), script, \
            model


def _plain(r) -> list:
    """A Response's output without the generated ids."""
    out = []
    for it in r.output:
        d = it.model_dump(exclude_none=True)
        d.pop("id", None)
        d.pop("call_id", None)
        d.pop("parsed_arguments", None)
        for c in d.get("content", ()):
            c.pop("parsed", None)
        out.append(d)
    return out


def test_a_reply_with_reasoning_text_and_a_tool_call(scripted):
    from qwenmetal.testing import IM_END

    client, script, model = scripted
    script["tokens"] = model.tokenizer.encode(REPLY) + [IM_END]
    args = {"model": NAME, "input": "Weather in Berlin?", "tools": [WEATHER], "max_output_tokens": 200,
            "reasoning": {"effort": "high"}}
    r = client.responses.create(**args)
    assert r.status == "completed" and r.reasoning.effort == "high"
    assert [it.type for it in r.output] == ["reasoning", "message", "function_call"]
    rs, msg, fc = r.output
    assert rs.content[0].text == "Let me check." and rs.summary == []
    assert msg.content[0].text.strip() == "Checking." and r.output_text.strip() == "Checking."
    assert (fc.name, json.loads(fc.arguments), fc.status) == ("get_weather", {"city": "Berlin", "days": 3}, "completed")
    assert fc.call_id.startswith("call_") and fc.id.startswith("fc_")
    assert r.usage.output_tokens == len(script["tokens"])
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens

    with client.responses.stream(**args) as s:
        events = list(s)
        final = s.get_final_response()
    assert _plain(final) == _plain(r)
    assert [e.type for e in events if e.type.startswith("response.function_call")][-1] == \
        "response.function_call_arguments.done"
    fargs = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(fargs) == {"city": "Berlin", "days": 3}
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert added == [it.type for it in done] == ["reasoning", "message", "function_call"]
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1, 2]

    # the call's output continues the conversation: the reply's transcript makes the new prompt continue
    # the generated tokens, through previous_response_id and through the full input sent back
    script["tokens"] = model.tokenizer.encode("Done.</think>\n\nIt is sunny.") + [IM_END]
    result = {"type": "function_call_output", "call_id": fc.call_id, "output": '{"sky": "sunny"}'}
    more = {"model": NAME, "tools": [WEATHER], "reasoning": {"effort": "high"}}    # as before: the same prompt
    r2 = client.responses.create(previous_response_id=r.id, input=[result], **more)
    prior = r.usage.input_tokens + r.usage.output_tokens
    assert r2.usage.input_tokens_details.cached_tokens >= prior - 1 and r2.output_text == "It is sunny."
    sent_back = [{"role": "user", "content": "Weather in Berlin?"}] + \
                [it.model_dump(exclude_none=True) for it in r.output] + [result]
    r3 = client.responses.create(input=sent_back, store=False, **more)
    assert r3.usage.input_tokens == r2.usage.input_tokens
    assert r3.usage.input_tokens_details.cached_tokens >= prior - 1


def test_a_failed_generation_ends_the_stream_with_an_error(scripted):
    import openai

    client, script, model = scripted
    script["tokens"], script["fail"] = model.tokenizer.encode("Hello there"), RuntimeError("the GPU caught fire")
    try:
        events = list(client.responses.create(model=NAME, input="Hi", max_output_tokens=8, stream=True))
        assert [e.type for e in events[-2:]] == ["error", "response.failed"]
        assert "the GPU caught fire" in events[-2].message
        assert events[-1].response.status == "failed" and "the GPU caught fire" in events[-1].response.error.message
        with pytest.raises(openai.InternalServerError, match="the GPU caught fire"):
            client.responses.create(model=NAME, input="Hi", max_output_tokens=8)
    finally:
        script["fail"] = None

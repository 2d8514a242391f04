"""Structured output through the server with the official openai client on loopback: ``response_format``
json_schema output that validates (jsonschema) on every backend, with speculative decoding on and off;
forced tool calls streamed as deltas whose arguments follow the tool's schema; bad schemas get a 400."""
import json

import jsonschema
import pytest

import qwenmetal as qm
from live_server import live_server
from oracles import require
from qwenmetal.grammar import BUDGET_NOTE
from qwenmetal.testing import cached_checkpoint

NAME = "tiny"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "forecast", "parameters": SCHEMA}}
MSGS = [{"role": "user", "content": "Weather in Rome for two days, as JSON."}]


@pytest.fixture(scope="module", params=["reference", "cpu", "metal-sim"])
def model(request):
    require("uvicorn")
    return qm.Model.load(cached_checkpoint("tiny", "mlx-q4", seed=0), backend=request.param)


def _client(base):
    openai = require("openai")
    return openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=120, max_retries=0)


@pytest.mark.parametrize("speculative", [None, "lookup"])
def test_json_schema_output_validates(model, speculative):
    with live_server(model, model_name=NAME, speculative=speculative) as base:
        c = _client(base)
        rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
        r = c.chat.completions.create(model=NAME, messages=MSGS, response_format=rf, max_tokens=60, temperature=0,
                                      extra_body={"enable_thinking": False})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        if speculative is None:
            obj = c.chat.completions.create(model=NAME, messages=MSGS, response_format={"type": "json_object"},
                                            max_tokens=60, temperature=0, seed=1,
                                            extra_body={"enable_thinking": False, "top_k": 5})
            if obj.choices[0].finish_reason == "stop":
                assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.fixture(scope="module")
def reference():
    require("uvicorn")
    return qm.Model.load(cached_checkpoint("tiny", "mlx-q4", seed=0), backend="reference")


def test_thinking_token_budget_closes_the_reasoning(reference):
    """vLLM's ``thinking_token_budget``: the reasoning ends with Qwen's note after that many tokens (the tiny
    model never ends it by itself), and the answer follows."""
    budget = 70                                   # the tiny tokenizer writes the note in 66 tokens
    with live_server(reference, model_name=NAME) as base:
        r = _client(base).chat.completions.create(
            model=NAME, messages=MSGS, max_tokens=budget + 6, temperature=0,
            extra_body={"enable_thinking": True, "thinking_token_budget": budget})
    assert r.choices[0].message.model_extra["reasoning_content"].endswith(BUDGET_NOTE.strip())
    assert r.usage.completion_tokens == budget + 6 or r.choices[0].finish_reason == "stop"


def test_forced_tool_calls_stream_as_deltas(reference):
    with live_server(reference, model_name=NAME) as base:
        c = _client(base)
        calls: dict = {}
        finish = None
        for chunk in c.chat.completions.create(model=NAME, messages=MSGS, tools=[TOOL], tool_choice="required",
                                               max_tokens=80, temperature=0, stream=True,
                                               extra_body={"enable_thinking": False}):
            ch = chunk.choices[0]
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or ():
                e = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                e["id"] = d.id or e["id"]
                if d.function is not None:
                    e["name"] = d.function.name or e["name"]
                    e["arguments"] += d.function.arguments or ""
        assert finish == "tool_calls" and calls
        for e in calls.values():
            assert e["id"].startswith("call_") and e["name"] == "forecast"
            jsonschema.validate(json.loads(e["arguments"]), SCHEMA)
        whole = c.chat.completions.create(model=NAME, messages=MSGS, tools=[TOOL], tool_choice="required",
                                          max_tokens=80, temperature=0, extra_body={"enable_thinking": False})
        got = [(t.function.name, json.loads(t.function.arguments)) for t in whole.choices[0].message.tool_calls]
        assert got == [(e["name"], json.loads(e["arguments"])) for _, e in sorted(calls.items())]

        openai = require("openai")
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
        with pytest.raises(openai.BadRequestError, match="Invalid type") as e:
            c.chat.completions.create(model=NAME, messages=MSGS, response_format=bad, max_tokens=5)
        assert e.value.body["param"] == "response_format"
        with pytest.raises(openai.BadRequestError, match="not among the tools") as e:
            c.chat.completions.create(model=NAME, messages=MSGS, tools=[TOOL], max_tokens=5,
                                      tool_choice={"type": "function", "function": {"name": "nope"}})
        assert e.value.body["param"] == "tool_choice"


def test_an_agent_transcript_resumes_from_cache(reference):
    """An agent's loop replayed: each turn sends the whole conversation back (the model's forced tool call as
    the server returned it, then the tool's result); from the second turn on the prompt continues the
    previous turn's tokens, so only the new messages are prefilled and cached_tokens says so."""
    reference.prefix_cache.clear()
    with live_server(reference, model_name=NAME) as base:
        c = _client(base)
        msgs = [{"role": "system", "content": "You are a weather agent. Call tools."},
                {"role": "user", "content": "Plan a week in Rome."}]
        fractions = []
        for turn in range(4):
            r = c.chat.completions.create(model=NAME, messages=msgs, tools=[TOOL], tool_choice="required",
                                          max_tokens=80, temperature=0, stream=turn % 2 == 1,
                                          stream_options={"include_usage": True} if turn % 2 else None,
                                          extra_body={"enable_thinking": False})
            if turn % 2:                      # rebuild the streamed reply as a client does
                calls, usage = {}, None
                for ch in r:
                    usage = ch.usage or usage
                    for d in (ch.choices[0].delta.tool_calls or ()) if ch.choices else ():
                        e = calls.setdefault(d.index, {"id": d.id, "type": "function",
                                                       "function": {"name": d.function.name, "arguments": ""}})
                        e["function"]["arguments"] += d.function.arguments or ""
                tool_calls = [calls[k] for k in sorted(calls)]
            else:
                usage = r.usage
                tool_calls = [t.model_dump() for t in r.choices[0].message.tool_calls]
            assert tool_calls
            if turn:
                fractions.append(usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens)
            msgs.append({"role": "assistant", "content": "", "tool_calls": tool_calls})
            for t in tool_calls:
                msgs.append({"role": "tool", "tool_call_id": t["id"], "content": '{"temp": 21, "sky": "clear"}'})
        print("cached fraction per turn:", [round(f, 3) for f in fractions])
        assert min(fractions) > 0.75, fractions

"""Request validation of the server, in process and fast (the mutation-testing target of server.py).

The helpers `num`, `boolean`, `options_of` and `check_n` (qwenmetal.serving) are called directly; the body checks of `read_json`
(a closure of `create_app`) go through the app with starlette's TestClient, or a raw ASGI call for a client
that hangs up mid-body. Each case checks the status, ``param``, ``code`` and the whole message. No request
here generates a token: every one is rejected (or reaches the next check) before the model runs.
"""
import asyncio
import json
import re

import pytest

from oracles import require

from qwenmetal.server import create_app
from qwenmetal.serving import MAX_STOP_STRINGS, APIError
from qwenmetal.serving import boolean as _bool
from qwenmetal.serving import check_n as _check_n
from qwenmetal.serving import num as _num
from qwenmetal.serving import options_of as _options

NAME = "tiny"
LIMIT = 1000


def _raises(fn, status, param, code, message):
    with pytest.raises(APIError, match="^" + re.escape(message) + "$") as e:
        fn()
    assert (e.value.status, e.value.param, e.value.code, e.value.message) == (status, param, code, message)
    assert e.value.type == "invalid_request_error"


# --- _num / _bool ------------------------------------------------------------------------------------
def test_num_missing_or_null_gives_the_default():
    assert _num({}, "x") is None
    assert _num({}, "x", default=7) == 7
    assert _num({"x": None}, "x", 0, 1, default=0.5) == 0.5


def test_num_converts_and_keeps_bounds_inclusive():
    v = _num({"x": 2}, "x", 0, 2)
    assert v == 2.0 and type(v) is float
    v = _num({"x": 3.0}, "x", 1, None, integer=True)
    assert v == 3 and type(v) is int
    assert _num({"x": 0}, "x", 0, 1) == 0.0                  # lo inclusive
    assert _num({"x": 1}, "x", 0, 1) == 1.0                  # hi inclusive
    assert _num({"x": 0.5}, "x", 0, 1, lo_open=True) == 0.5
    assert _num({"x": -1e300}, "x") == -1e300                # no bounds
    assert _num({"x": 5}, "x", None, 9) == 5.0


@pytest.mark.parametrize("body,kw,message", [
    ({"x": True}, {}, "'x' must be a number, got True"),
    ({"x": False}, {"integer": True}, "'x' must be an integer, got False"),
    ({"x": "1"}, {}, "'x' must be a number, got '1'"),
    ({"x": 2.5}, {"integer": True}, "'x' must be an integer, got 2.5"),
    ({"x": float("nan")}, {"lo": 0, "hi": 1}, "'x' must be in [0, 1], got nan"),
    ({"x": -0.5}, {"lo": 0, "hi": 1}, "'x' must be in [0, 1], got -0.5"),
    ({"x": 1.5}, {"lo": 0, "hi": 1}, "'x' must be in [0, 1], got 1.5"),
    ({"x": 0}, {"lo": 0, "hi": 1, "lo_open": True}, "'x' must be in (0, 1], got 0.0"),
    ({"x": 0}, {"lo": 1, "integer": True}, "'x' must be in [1, inf], got 0"),
    ({"x": 3}, {"hi": 2}, "'x' must be in [-inf, 2], got 3.0"),
])
def test_num_rejects_with_the_field_named(body, kw, message):
    _raises(lambda: _num(body, "x", **kw), 400, "x", "invalid_value", message)


def test_bool():
    assert _bool({}, "s") is False
    assert _bool({}, "s", default=True) is True
    assert _bool({"s": None}, "s", default=True) is True
    assert _bool({"s": True}, "s") is True
    assert _bool({"s": False}, "s", default=True) is False
    _raises(lambda: _bool({"s": 1}, "s"), 400, "s", "invalid_value", "'s' must be a boolean, got 1")
    _raises(lambda: _bool({"s": "true"}, "s"), 400, "s", "invalid_value", "'s' must be a boolean, got 'true'")


# --- _check_n ----------------------------------------------------------------------------------------
def test_check_n_accepts_one():
    assert _check_n({}) is None
    assert _check_n({"n": 1, "best_of": 1}) is None
    assert _check_n({"n": None, "best_of": None}) is None


@pytest.mark.parametrize("body,param,code,message", [
    ({"n": 2}, "n", "unsupported_value", "only n=1 is supported"),
    ({"best_of": 3}, "best_of", "unsupported_value", "only best_of=1 is supported"),
    ({"n": 0}, "n", "invalid_value", "'n' must be in [1, inf], got 0"),
    ({"best_of": 0}, "best_of", "invalid_value", "'best_of' must be in [1, inf], got 0"),
    ({"n": 1.5}, "n", "invalid_value", "'n' must be an integer, got 1.5"),
    ({"best_of": 1.5}, "best_of", "invalid_value", "'best_of' must be an integer, got 1.5"),
    ({"n": 1, "best_of": 2}, "best_of", "unsupported_value", "only best_of=1 is supported"),
])
def test_check_n_rejects(body, param, code, message):
    _raises(lambda: _check_n(body), 400, param, code, message)


# --- _options ----------------------------------------------------------------------------------------
def test_options_maps_request_fields():
    o = _options({"top_k": -1, "seed": -1, "stop": ["a"] * MAX_STOP_STRINGS, "temperature": 0.5,
                  "top_p": 0.9, "min_p": 0.1, "repetition_penalty": 1.1, "presence_penalty": 0.5,
                  "frequency_penalty": 0.25, "stop_token_ids": [3], "ignore_eos": True}, 9)
    assert o.top_k == 0 and o.seed == 2 ** 64 - 1 and o.max_tokens == 9
    assert list(o.stop) == ["a"] * MAX_STOP_STRINGS and list(o.stop_token_ids) == [3] and o.ignore_eos is True
    assert (o.temperature, o.top_p, o.min_p, o.repetition_penalty, o.presence_penalty, o.frequency_penalty) == \
        (0.5, 0.9, 0.1, 1.1, 0.5, 0.25)
    assert _options({"seed": 2 ** 64 + 5, "top_k": 4}, 1).seed == 5
    assert _options({"top_k": 4}, 1).top_k == 4
    assert _options({"seed": 12}, 1).seed == 12
    for k, lo, hi in [("temperature", 0.0, 2.0), ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)]:
        assert getattr(_options({k: lo}, 1), k) == lo and getattr(_options({k: hi}, 1), k) == hi
    o = _options({}, 4)
    assert o.temperature is None and o.seed is None and o.stop == ()


@pytest.mark.parametrize("body,param,code,message", [
    ({"stop": ["a"] * (MAX_STOP_STRINGS + 1)}, "stop", "invalid_value",
     f"'stop' may hold at most {MAX_STOP_STRINGS} strings"),
    ({"temperature": 2.5}, "temperature", "invalid_value", "'temperature' must be in [0.0, 2.0], got 2.5"),
    ({"presence_penalty": -2.5}, "presence_penalty", "invalid_value",
     "'presence_penalty' must be in [-2.0, 2.0], got -2.5"),
    ({"frequency_penalty": 2.5}, "frequency_penalty", "invalid_value",
     "'frequency_penalty' must be in [-2.0, 2.0], got 2.5"),
])
def test_options_rejects(body, param, code, message):
    _raises(lambda: _options(body, 4), 400, param, code, message)


def test_options_passes_the_library_check_on_with_its_param():
    with pytest.raises(APIError, match="top_p") as e:
        _options({"top_p": 0}, 4)
    assert (e.value.status, e.value.param) == (400, "top_p") and e.value.code
    with pytest.raises(APIError, match="seed") as e:
        _options({"seed": True}, 4)
    assert (e.value.status, e.value.param) == (400, "seed")


# --- read_json: body limits, JSON, model name, API key ------------------------------------------------
@pytest.fixture(scope="module")
def model():
    import qwenmetal as qm
    from qwenmetal.testing import cached_checkpoint

    m = qm.Model.load(cached_checkpoint("tiny"), backend="reference")
    m.prefix_cache = None
    return m


@pytest.fixture
def app(model):
    """A fresh app per test (mutmut attributes create_app to the test that calls it)."""
    require("starlette")
    require("httpx")
    made = []

    def make(**kw):
        made.append(create_app(model, model_name=NAME, max_request_bytes=LIMIT, **kw))
        return made[-1]

    yield make
    for a in made:
        a.state.queue.close()
        assert a.state.queue.join(10)


def _post(app, content, headers=None):
    from starlette.testclient import TestClient
    return TestClient(app, raise_server_exceptions=False).post("/v1/chat/completions", content=content,
                                                                headers=headers or {})


def _err(r, status, param, code, message):
    assert r.status_code == status, r.text
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


NEXT = (400, "messages", "invalid_value")     # what a body that passes read_json gets: {"messages": []}


def _body(size: int) -> bytes:
    """A JSON object of exactly `size` bytes that read_json accepts (empty messages: rejected next)."""
    b = b'{"messages": [], "pad": ""}'
    return b[:-2] + b"x" * (size - len(b)) + b[-2:]


def _passes(r):
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_body_at_the_limit_passes_and_one_byte_more_is_413(app):
    a = app()
    _passes(_post(a, _body(LIMIT)))
    _err(_post(a, _body(LIMIT + 1)), 413, None, "request_too_large",
         f"request body of {LIMIT + 1} bytes exceeds the limit of {LIMIT}")


def test_streamed_body_without_length_is_counted(app):
    a = app()
    body = _body(LIMIT)
    _passes(_post(a, iter([body[:10], body[10:]])))               # chunked: no content-length
    big = _body(LIMIT + 1)
    _err(_post(a, iter([big[:600], big[600:]])), 413, None, "request_too_large",
         f"request body exceeds the limit of {LIMIT} bytes")


def _asgi(app, messages, headers):
    """One POST straight through ASGI with the given receive messages; -> (status, JSON body)."""
    sent = []
    it = iter(messages)

    async def receive():
        return next(it)

    async def send(m):
        sent.append(m)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "headers": headers, "client": ("t", 1), "server": ("t", 80)}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


def test_a_body_cut_short_is_400(app):
    status, body = _asgi(app(), [{"type": "http.request", "body": b'{"mess', "more_body": True},
                                 {"type": "http.disconnect"}], [(b"content-length", b"40")])
    assert status == 400
    assert body == {"error": {"message": "the request body was cut short", "type": "invalid_request_error",
                              "param": None, "code": "incomplete_body"}}


def test_bad_json_and_non_objects_are_400(app):
    a = app()
    r = _post(a, b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json" and r.json()["error"]["param"] is None
    assert r.json()["error"]["message"] == f"invalid JSON body: {_decode_error(b'{not json')}"
    for doc in (b"[1]", b'"x"', b"3"):
        _err(_post(a, doc), 400, None, "invalid_json", "the request body must be a JSON object")


def _decode_error(b):
    try:
        json.loads(b)
    except json.JSONDecodeError as e:
        return str(e)
    raise AssertionError("valid JSON")


def test_the_model_name_must_match_when_given(app):
    a = app()
    _err(_post(a, b'{"model": "gpt-4o", "messages": []}'), 404, "model", "model_not_found",
         f"the model 'gpt-4o' does not exist; this server serves '{NAME}'")
    _passes(_post(a, json.dumps({"model": NAME, "messages": []}).encode()))
    _passes(_post(a, b'{"model": null, "messages": []}'))


def test_the_api_key_is_checked_before_the_body(app):
    a = app(api_key="k")
    r = _post(a, _body(LIMIT + 1))
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    _passes(_post(a, _body(10), {"Authorization": "Bearer k"}))


def test_the_limit_counts_every_chunk_of_the_body(app):
    big = _body(LIMIT + 1)
    status, body = _asgi(app(), [{"type": "http.request", "body": big[:600], "more_body": True},
                                 {"type": "http.request", "body": big[600:], "more_body": False}], [])
    assert status == 413
    assert body["error"]["message"] == f"request body exceeds the limit of {LIMIT} bytes"


def test_a_prompt_over_the_context_names_its_own_field(model):
    """/v1/completions names 'prompt', /v1/chat/completions 'messages': the field the client has to shorten."""
    require("starlette")
    require("httpx")
    from starlette.testclient import TestClient
    a = create_app(model, model_name=NAME)
    try:
        n = model.config.max_position_embeddings + 1
        c = TestClient(a, raise_server_exceptions=False)
        msg = f"the prompt has {n} tokens; this model's context is {n - 1} tokens"
        r = c.post("/v1/completions", json={"prompt": [5] * n, "max_tokens": 2})
        _err(r, 400, "prompt", "context_length_exceeded", msg)
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi " * n}], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        a.state.queue.close()
        assert a.state.queue.join(10)

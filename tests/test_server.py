"""`qwenmetal serve`: the real server (subprocess, loopback, free port) driven by the official openai client.

Covers chat and text completions (streaming and not), stop strings, the error responses, a client that
disconnects mid-stream (its generation is cancelled, the server keeps serving), two concurrent clients
(queued one at a time, both answered correctly) and `cached_tokens` on a second chat turn.

Then load and abuse against an in-process server whose model sleeps per decode step and counts its steps:
a disconnect (streaming or not) stops the generation within one decode step, a queued request whose client
left never runs, a full queue answers 503 + Retry-After, the time limit, the default max_tokens, and
graceful shutdown (the running request finishes, the queued one gets 503; past the graceful timeout the
generation is cancelled). The soak test is tests/test_server_soak.py.
"""
import json
import re
import socket
import threading
import time

import pytest

from live_server import API_KEY, MAX_BODY, NAME
from live_server import free_port as _free_port
from oracles import require

import qwenmetal as qm


@pytest.fixture(scope="module")
def ckpt(spawned_ckpt):
    return spawned_ckpt


@pytest.fixture(scope="module")
def server(spawned_url):
    return spawned_url


@pytest.fixture(scope="module")
def client(openai_client):
    return openai_client


@pytest.fixture(scope="module")
def local(spawned_local):
    """The same checkpoint in this process, for expected outputs."""
    return spawned_local


MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]


def _extra(msg, key):
    return (getattr(msg, "model_extra", None) or {}).get(key)


def test_models_health_and_auth(server, client):
    import httpx
    import openai

    assert [m.id for m in client.models.list().data] == [NAME]
    h = httpx.get(server + "/health", timeout=5).json()
    assert h["status"] == "ok" and h["model"] == NAME
    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError, match="invalid or missing API key") as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"


def test_chat_non_stream_and_stream_match_the_library(client, local):
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=10, temperature=0)
    want = local.chat(MSGS, max_tokens=10, temperature=0)
    msg = r.choices[0].message
    assert msg.role == "assistant"
    assert msg.content == want.content and _extra(msg, "reasoning_content") == want.reasoning
    assert r.choices[0].finish_reason == {"length": "length", "context": "length"}.get(want.finish_reason, "stop")
    assert r.usage.prompt_tokens == want.stats["prompt_tokens"]
    assert r.usage.completion_tokens == want.stats["generated_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(_extra(c.choices[0].delta, "reasoning_content") or "" for c in chunks if c.choices)
    assert content.strip() == want.content and reasoning.strip() == (want.reasoning or "")
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [r.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # the identical prompt was cached by the first request (end-of-prompt snapshot + logits)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens


def test_streamed_and_collected_chat_split_a_stray_close_tag_alike(local, monkeypatch):
    """One scripted reply with a '</think>' in it, asked for streamed and not, with thinking on and off:
    both give the same reasoning and content. Thinking off (the template closed the think block in the
    prompt) the reply is content, '</think>' included; thinking on, the text before it is the reasoning."""
    require("starlette")
    require("httpx")
    from starlette.testclient import TestClient

    from qwenmetal.sampling import SampleResult
    from qwenmetal.server import create_app
    from qwenmetal.testing import IM_END

    reply = "The sum is 4.</think>\n\nFour."
    script = local.tokenizer.encode(reply) + [IM_END]
    real = local.generate

    class Script:
        def __init__(self):
            self.i = 0

        def sample(self, logits, vocab_used=None, **kw):
            self.i += 1
            return SampleResult(script[min(self.i - 1, len(script) - 1)])

    monkeypatch.setattr(local, "generate", lambda ids, **kw: real(ids, sampler=Script(), **kw))
    app = create_app(local, model_name=NAME)
    try:
        c = TestClient(app)
        for thinking, want in ((False, ("", reply)), (True, ("The sum is 4.", "Four."))):
            body = {"messages": MSGS, "max_tokens": 40, "chat_template_kwargs": {"enable_thinking": thinking}}
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            msg = r.json()["choices"][0]["message"]
            got = {"reasoning_content": "", "content": ""}
            with c.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as s:
                for line in s.iter_lines():
                    if line.startswith("data: {"):
                        for ch in json.loads(line[6:])["choices"]:
                            for k in got:
                                got[k] += ch["delta"].get(k) or ""
            assert (got["reasoning_content"].strip(), got["content"].strip()) == want, (thinking, got)
            assert (msg.get("reasoning_content") or "", msg["content"]) == want, (thinking, msg)
            assert ("reasoning_content" in msg) == thinking
    finally:
        app.state.queue.close()
        assert app.state.queue.join(10)


def test_completions_stop_strings_stream_and_not(client, local):
    prompt = "The quick brown fox"
    free = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    want = "".join(o.text for o in local.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True))
    assert text == want and free.choices[0].finish_reason == "length" and free.usage.completion_tokens == 24
    # a stop string from the middle of the unconstrained output, likely spanning a token boundary
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text[:text.index(stop)]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "\x00never"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    # logprobs on the legacy endpoint
    lp = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=3,
                                   extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) == 3 for t in lp.top_logprobs)
    # token-id prompts
    ids = local.tokenizer.encode(prompt)
    r2 = client.completions.create(model=NAME, prompt=ids, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    assert r2.choices[0].text == text


def test_chat_logprobs_and_seeded_sampling(client):
    a = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=6, temperature=0.8, seed=11,
                                       logprobs=True, top_logprobs=2)
    b = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=6, temperature=0.8, seed=11)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert _extra(a.choices[0].message, "reasoning_content") == _extra(b.choices[0].message, "reasoning_content")
    lps = a.choices[0].logprobs.content
    assert len(lps) == 6 and all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in lps)


def test_tool_messages_render(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "Weather in Berlin?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Berlin"})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model=NAME, messages=msgs, tools=tools, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 100                # the tool instructions are in the prompt


def test_bad_requests(server, client):
    import httpx
    import openai

    h = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(server + "/v1/chat/completions", content=b"{not json", headers=h, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError, match="the model 'gpt-4o' does not exist") as e:
        client.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    for kw, param in [({"temperature": 5}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
                      ({"n": 2}, "n"), ({"messages": []}, "messages"), ({"top_logprobs": 3}, "top_logprobs"),
                      ({"stop": [1, 2]}, "stop"), ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]")]:
        args = dict(model=NAME, messages=MSGS, max_tokens=2)
        args.update(kw)
        with pytest.raises(openai.BadRequestError, match=re.escape(param)) as e:
            client.chat.completions.create(**args)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (kw, e.value.body)
    big = {"model": NAME, "messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]}
    r = httpx.post(server + "/v1/chat/completions", json=big, headers=h, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    with pytest.raises(openai.BadRequestError, match="5000 tokens") as e:             # longer than the context
        client.completions.create(model=NAME, prompt=[5] * 5000, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"
    r = httpx.get(server + "/v1/chat/completions", headers=h, timeout=10)
    assert r.status_code == 405 and "error" in r.json()
    # still serving
    assert client.completions.create(model=NAME, prompt="ok", max_tokens=2).choices[0].finish_reason


def test_client_disconnect_cancels_generation(server, client):
    import httpx

    h = {"Authorization": f"Bearer {API_KEY}"}
    before = httpx.get(server + "/health", timeout=5).json()
    body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 3500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.monotonic()
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=h, timeout=30) as r:
        assert r.status_code == 200
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                n += 1
                if n == 3:
                    break                       # hang up mid-stream
    deadline = time.monotonic() + 30
    while True:
        st = httpx.get(server + "/health", timeout=5).json()
        if st["cancelled"] == before["cancelled"] + 1 and not st["running"]:
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.1)
    # 3500 tokens would take far longer than this: the generation was cut short
    assert time.monotonic() - t0 < 20
    r = client.completions.create(model=NAME, prompt="Still there?", max_tokens=3)
    assert r.usage.completion_tokens >= 1


def _completions_at_once(client, reqs: list) -> list:
    """The texts of completion requests `reqs` (keyword dicts) sent at once from one thread each, the odd
    ones streamed."""
    got, errors = [None] * len(reqs), []

    def run(i):
        try:
            args = dict(model=NAME, extra_body={"ignore_eos": True}, **reqs[i])
            if i % 2:
                got[i] = "".join(ch.choices[0].text for ch in client.completions.create(stream=True, **args))
            else:
                got[i] = client.completions.create(**args).choices[0].text
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return got


def test_two_concurrent_clients(client, local):
    prompts = ["Alpha beta gamma", "One two three four"]
    want = ["".join(o.text for o in local.generate(p, max_tokens=16, temperature=0, ignore_eos=True)) for p in prompts]
    assert _completions_at_once(client, [dict(prompt=p, max_tokens=16, temperature=0) for p in prompts]) == want


def test_second_chat_turn_reports_cached_tokens(client, local):
    msgs = [{"role": "user", "content": "Name three colours."}]
    r1 = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0)
    m = r1.choices[0].message
    msgs2 = msgs + [{"role": "assistant", "content": m.content or ""}, {"role": "user", "content": "And three fruits?"}]
    r2 = client.chat.completions.create(model=NAME, messages=msgs2, max_tokens=8, temperature=0)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # turn 1 left a snapshot at the end of its prompt ("...<|im_start|>assistant\n<think>\n"); the history
    # renders the reply after the same "<think>\n" (preserve_thinking), so turn 2's prompt starts with all of
    # turn 1's and reuses it (this reply ended by length, so it has no transcript: tests/test_chat_continuity.py)
    ids1, head1, _ = local.chat_prompt(msgs)
    assert len(ids1) == r1.usage.prompt_tokens and 0 < head1 < len(ids1)
    assert cached == len(ids1) and r2.usage.prompt_tokens > cached


# ---------------------------------------------------------------------------------------------------
# load and abuse: an in-process uvicorn server (a thread, loopback, free port) whose model is slowed down
# per decode step and counts its steps, so "stops within one decode step" can be counted
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_model():
    from qwenmetal.testing import cached_checkpoint

    m = qm.Model.load(cached_checkpoint("tiny"), backend="cpu")
    m.prefix_cache = None
    return m


class _Counted:
    """Wraps a model's decode_step and its backend's batched step (sleeping `delay` per step) and generate,
    counting calls; `rows` holds each batched step's row count."""

    def __init__(self, model, delay):
        self.model, self.delay, self.steps, self.generations = model, delay, 0, 0
        self._decode, self._generate = model.decode_step, model.generate
        self._batch = model._backend.decode_batch
        self.rows: list = []

    def decode_step(self, s, t):
        self.steps += 1
        time.sleep(self.delay)
        return self._decode(s, t)

    def decode_batch(self, states, ids, consumed=None):
        self.steps += 1
        self.rows.append(len(ids))
        time.sleep(self.delay)
        return self._batch(states, ids, consumed)

    def generate(self, *a, **kw):
        self.generations += 1
        return self._generate(*a, **kw)


@pytest.fixture
def live(cpu_model, monkeypatch):
    """live(delay=..., graceful_timeout=..., **create_app options) -> (base url, counter, uvicorn server)."""
    require("uvicorn")
    from qwenmetal.server import create_app, uvicorn_server

    started = []

    def start(delay=0.0, graceful_timeout=5.0, **opts):
        c = _Counted(cpu_model, delay)
        monkeypatch.setattr(cpu_model, "decode_step", c.decode_step)
        monkeypatch.setattr(cpu_model._backend, "decode_batch", c.decode_batch)
        monkeypatch.setattr(cpu_model, "generate", c.generate)
        port = _free_port()
        srv = uvicorn_server(create_app(cpu_model, model_name=NAME, **opts), "127.0.0.1", port,
                             log_level="warning", graceful_timeout=graceful_timeout)
        th = threading.Thread(target=srv.run, daemon=True)
        th.start()
        started.append((srv, th))
        deadline = time.monotonic() + 30
        while not srv.started:
            assert th.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        return f"http://127.0.0.1:{port}", c, srv

    yield start
    for srv, th in started:
        srv.should_exit = True
        th.join(30)
        assert not th.is_alive(), "the server did not shut down"


def _raw(base, path, body) -> socket.socket:
    """Send a POST with a raw socket and return the socket (the caller reads and hangs up)."""
    host, port = base.rsplit("//", 1)[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _health(base) -> dict:
    import httpx
    return httpx.get(base + "/health", timeout=10).json()


def _until(pred, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


LONG = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("stream,parallel", [(True, 1), (False, 1), (True, 3)])
def test_disconnect_stops_the_generation_within_one_decode_step(live, stream, parallel):
    base, c, _ = live(delay=0.1, parallel=parallel)
    s = _raw(base, "/v1/completions", dict(LONG, stream=stream))
    if stream:
        got = b""
        while got.count(b"data: ") < 4:         # the headers and a few tokens arrived
            got += s.recv(65536)
    else:
        _until(lambda: c.steps >= 4, "a few decode steps")
    at_close = c.steps
    s.close()
    _until(lambda: _health(base)["cancelled"] == 1 and not _health(base)["running"], "the cancellation")
    # the step running when the client left may finish; no further step starts
    assert c.steps - at_close <= 1, (at_close, c.steps)
    h = _health(base)
    assert h["completed"] == 0 and h["failed"] == 0 and c.steps < LONG["max_tokens"]


def test_a_stream_is_not_written_on_after_its_connection_is_lost(cpu_model, monkeypatch):
    """A client that hangs up while tokens pile up (here: the event loop is held up for half a second):
    asyncio's transport schedules the connection's loss after the first failed write and logs every
    write past the fifth before that runs ('socket.send() raised exception.', a line per token). Driven
    through ASGI as uvicorn does it (a send after the loss is dropped): once a write has found the
    connection gone, no further write happens before the server learns of it, and the generation is
    cancelled."""
    import asyncio
    require("starlette")
    from qwenmetal.server import create_app

    # 2 ms per decode step: the 3000 tokens outlast the half-second stall (a fast CPU ran them all within it)
    monkeypatch.setattr(cpu_model, "decode_step", _Counted(cpu_model, 0.002).decode_step)
    app = create_app(cpu_model, model_name=NAME)
    body = json.dumps(dict(LONG, max_tokens=3000, stream=True)).encode()
    st = {"chunks": 0, "failed": False, "lost": False, "written_after": 0}

    async def main():
        loop = asyncio.get_running_loop()
        gone = asyncio.Event()
        asked = []

        async def receive():
            if not asked:
                asked.append(1)
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        def connection_lost():                 # what the transport's call_soon runs
            st["lost"] = True
            gone.set()

        async def send(m):
            if m["type"] == "http.response.start":
                time.sleep(0.5)                # a slow loop turn: the generation's tokens pile up meanwhile
            elif st["lost"]:
                pass                           # uvicorn: disconnected, the send is dropped
            elif st["failed"]:
                st["written_after"] += 1       # asyncio: a write on a lost connection (logged past the fifth)
            else:
                st["chunks"] += 1
                if st["chunks"] == 3:          # this write finds the connection reset
                    st["failed"] = True
                    loop.call_soon(connection_lost)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "client": ("t", 1), "server": ("t", 80),
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
        await app(scope, receive, send)

    try:
        asyncio.run(main())
        assert st["failed"] and st["written_after"] == 0, st
        _until(lambda: not app.state.queue.status()["running"], "the generation's end")
        assert app.state.queue.status()["cancelled"] == 1
    finally:
        app.state.queue.close()
        assert app.state.queue.join(10)


def test_a_queued_request_whose_client_left_never_runs(live):
    import httpx

    base, c, _ = live(delay=0.05)
    a = _raw(base, "/v1/completions", dict(LONG, stream=True))
    _until(lambda: c.steps >= 2, "request A running")
    b = _raw(base, "/v1/completions", dict(LONG, max_tokens=5))
    _until(lambda: _health(base)["queued"] == 1, "request B queued")
    b.close()
    _until(lambda: _health(base)["queued"] == 0, "request B dropped")
    h = _health(base)
    assert h["running"] and h["cancelled"] == 1          # dropped while A still runs
    a.close()
    _until(lambda: _health(base)["cancelled"] == 2 and not _health(base)["running"], "request A cancelled")
    assert c.generations == 1                            # B's generation was never started
    r = httpx.post(base + "/v1/completions", json=dict(LONG, max_tokens=3), timeout=30).json()
    assert r["usage"]["completion_tokens"] == 3 and c.generations == 2


def test_a_full_queue_answers_503_with_retry_after(live):
    import httpx
    import openai

    base, c, _ = live(delay=0.05, max_queue=1)
    a = _raw(base, "/v1/completions", dict(LONG, stream=True))
    _until(lambda: c.steps >= 1, "request A running")
    b = _raw(base, "/v1/completions", dict(LONG, max_tokens=2))
    _until(lambda: _health(base)["queued"] == 1, "request B queued")
    r = httpx.post(base + "/v1/completions", json=dict(LONG, max_tokens=2), timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "server_busy" and r.json()["error"]["type"] == "server_error"
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.InternalServerError, match="busy") as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=2)
    assert e.value.status_code == 503
    assert _health(base)["rejected"] == 2 and _health(base)["max_queued"] == 1
    a.close()
    b.recv(65536)                                        # B runs once A is cancelled, and is answered
    b.close()


@pytest.mark.parametrize("stream,parallel", [(False, 1), (True, 1), (False, 3)])
def test_the_time_limit_ends_a_generation_with_what_it_made(live, stream, parallel):
    import openai

    base, c, _ = live(delay=0.1, request_timeout=1.0, parallel=parallel)
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)
    t0 = time.monotonic()
    args = dict(model=NAME, prompt="Once upon a time", max_tokens=400, temperature=0,
                extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        usage = chunks[-1].usage
        assert finish == ["length"]
    else:
        r = client.completions.create(**args)
        text, usage = r.choices[0].text, r.usage
        assert r.choices[0].finish_reason == "length"
    assert time.monotonic() - t0 < 10
    # at most the steps that fit in 1 s (each sleeps 0.1 s; fewer on a loaded machine), their text, and no
    # claim about cached tokens
    n = usage.completion_tokens
    assert n <= 11 and c.steps <= 11 and usage.prompt_tokens_details is None
    want = "".join(o.text for o in c._generate("Once upon a time", max_tokens=n, temperature=0,
                                                 ignore_eos=True)) if n else ""
    assert text == want
    h = _health(base)
    assert h["timed_out"] == 1 and h["cancelled"] == 0 and h["completed"] == 0


def test_batched_requests_get_the_answers_they_get_alone(live, cpu_model):
    """Four concurrent clients on a server batching 4 at once, streaming and not, greedy and seeded sampling
    with stop strings: each gets what the model generates for it alone, and they ran together."""
    import openai

    base, c, _ = live(delay=0.02, parallel=4)
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    reqs = [dict(prompt="Once upon a time", max_tokens=40, temperature=0),
            dict(prompt="The quick brown fox", max_tokens=30, temperature=0.9, seed=11),
            dict(prompt="1, 2, 3, 4,", max_tokens=35, temperature=0.7, seed=3, stop=["e"]),
            dict(prompt="Hello there, how are", max_tokens=25, temperature=0)]
    want = []
    for r in reqs:
        kw = {k: v for k, v in r.items() if k != "prompt"}
        want.append("".join(o.text for o in c._generate(r["prompt"], ignore_eos=True, cache=False, **kw)))
    assert _completions_at_once(client, reqs) == want
    assert max(c.rows) >= 2                              # rows shared decode steps
    h = _health(base)
    assert h["parallel"] == 4 and h["completed"] == 4 and h["active_rows"] == 0
    assert 0 < h["batch_occupancy"] <= 1


def test_a_disconnect_removes_only_its_row(live):
    """Two long generations batched together; one client leaves: its row is gone by the next step but one,
    and the other generation goes on to its end with the text it gets alone."""
    import openai

    base, c, _ = live(delay=0.05, parallel=3)
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    args = dict(model=NAME, prompt="The quick brown fox", max_tokens=60, temperature=0,
                extra_body={"ignore_eos": True})
    want = "".join(o.text for o in c._generate(args["prompt"], max_tokens=60, temperature=0, ignore_eos=True,
                                                 cache=False))
    result = {}
    th = threading.Thread(target=lambda: result.update(text=client.completions.create(**args).choices[0].text))
    th.start()
    s = _raw(base, "/v1/completions", dict(LONG, stream=True))
    _until(lambda: c.rows.count(2) >= 4, "both rows decoding together")
    s.close()
    _until(lambda: _health(base)["cancelled"] == 1, "the cancellation")
    at = len(c.rows)
    th.join(60)
    assert result["text"] == want
    assert all(r == 1 for r in c.rows[at + 1:])           # the step running at the hang-up may have had 2 rows
    h = _health(base)
    assert h["completed"] == 1 and h["failed"] == 0


def test_chat_without_max_tokens_gets_the_default_budget(live, capsys):
    import openai

    from qwenmetal.cli import main
    from qwenmetal.server import DEFAULT_CHAT_MAX_TOKENS

    base, _, _ = live()
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=NAME, messages=MSGS, temperature=0, extra_body={"ignore_eos": True})
    # not the whole context (4096 - prompt): the documented default
    assert r.usage.completion_tokens == DEFAULT_CHAT_MAX_TOKENS == 2048 and r.choices[0].finish_reason == "length"
    r = client.completions.create(model=NAME, prompt="x", temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16                # OpenAI's default for /v1/completions
    with pytest.raises(SystemExit, match="0"):
        main(["serve", "--help"])
    assert f"sets none (default {DEFAULT_CHAT_MAX_TOKENS}; 0: up to the context limit)" in " ".join(
        capsys.readouterr().out.split())                 # the CLI's default is the same


def test_default_max_tokens_option(live):
    import openai

    base, _, _ = live(default_max_tokens=3)
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=NAME, messages=MSGS, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5


def test_bad_server_options_raise(cpu_model):
    from qwenmetal.server import create_app

    with pytest.raises(ValueError, match="default_max_tokens"):
        create_app(cpu_model, default_max_tokens=0)
    with pytest.raises(ValueError, match="request_timeout"):
        create_app(cpu_model, request_timeout=-1)
    with pytest.raises(ValueError, match="max_queue"):
        create_app(cpu_model, max_queue=-1)
    with pytest.raises(ValueError, match="parallel must be a positive integer"):
        create_app(cpu_model, parallel=0)
    with pytest.raises(ValueError, match="at most 32 rows"):
        create_app(cpu_model, parallel=33)
    with pytest.raises(ValueError, match="single-stream"):
        create_app(cpu_model, parallel=2, speculative="lookup")
    with pytest.raises(ValueError, match="keepalive_seconds must be > 0 seconds"):
        create_app(cpu_model, keepalive_seconds=0)


def test_silent_streams_get_keepalive_events(live):
    """A stream silent for the keep-alive interval (here decode steps of 0.3 s, a keep-alive after 0.1 s of
    silence) gets SSE comments on the OpenAI routes and pings on Anthropic's; the text read is unchanged."""
    import httpx
    base, _, _ = live(delay=0.3, keepalive_seconds=0.1)
    body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines.count(": keepalive") >= 2 and lines[-1] == "data: [DONE]", lines
    text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines if ln.startswith("data: {"))
    alone = httpx.post(base + "/v1/completions", json={**body, "stream": False}, timeout=30).json()
    assert text == alone["choices"][0]["text"]
    msg = {"model": NAME, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
           "stream": True}
    with httpx.stream("POST", base + "/v1/messages", json=msg, timeout=30) as r:
        events = [ln[7:] for ln in r.iter_lines() if ln.startswith("event: ")]
    assert events[:2] == ["message_start", "ping"] and events.count("ping") >= 3 and events[-1] == "message_stop"


def test_shutdown_finishes_the_running_request_and_fails_the_queued_one(live):
    import httpx

    base, c, srv = live(delay=0.02, graceful_timeout=10)
    res = {}

    def run_a():
        res["a"] = httpx.post(base + "/v1/completions", json=dict(LONG, max_tokens=40), timeout=30).json()

    ta = threading.Thread(target=run_a)
    ta.start()
    _until(lambda: c.steps >= 2, "request A running")
    b = _raw(base, "/v1/completions", dict(LONG, max_tokens=5))
    _until(lambda: _health(base)["queued"] == 1, "request B queued")
    srv.should_exit = True
    reply = b""
    while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
        part = b.recv(65536)
        assert part, reply
        reply += part
    assert reply.startswith(b"HTTP/1.1 503") and b'"shutting_down"' in reply
    ta.join(30)
    assert res["a"]["choices"][0]["finish_reason"] == "length" and res["a"]["usage"]["completion_tokens"] == 40
    assert c.generations == 1


def test_shutdown_cancels_what_outlives_the_graceful_timeout(live):
    base, c, srv = live(delay=0.05, graceful_timeout=0.5)
    a = _raw(base, "/v1/completions", dict(LONG, stream=True))
    _until(lambda: c.steps >= 2, "request A running")
    t0 = time.monotonic()
    srv.should_exit = True
    assert srv.config.app.state.queue.join(15), "the generation worker did not stop"
    assert time.monotonic() - t0 < 5
    assert c.steps < LONG["max_tokens"]
    a.close()

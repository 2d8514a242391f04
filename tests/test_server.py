"""`qwenmetal serve`: the real server (subprocess, loopback, free port) driven by the official openai client.

Covers chat and text completions (streaming and not), stop strings, the error responses, a client that
disconnects mid-stream (its generation is cancelled, the server keeps serving), two concurrent clients
(queued one at a time, both answered correctly) and `cached_tokens` on a second chat turn.
"""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from oracles import require

import qwenmetal as qm
from qwenmetal.testing import make_checkpoint

API_KEY = "sk-test-key"
NAME = "tiny"
MAX_BODY = 64 * 1024


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("srv") / "ck", "tiny", "mlx-q4", seed=3)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    require("starlette")
    require("uvicorn")
    httpx = require("httpx")
    port = _free_port()
    log = tmp_path_factory.mktemp("srvlog") / "server.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "qwenmetal.cli", "serve", "--model", str(ckpt),
                                 "--port", str(port), "--api-key", API_KEY, "--served-model-name", NAME,
                                 "--max-request-bytes", str(MAX_BODY), "--log-level", "warning",
                                 "--backend", "reference"],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{log.read_text()}")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode is not None


@pytest.fixture(scope="module")
def client(server):
    openai = require("openai")
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def local(ckpt):
    """The same checkpoint in this process, for expected outputs."""
    m = qm.Model.load(ckpt, backend="reference")
    m.prefix_cache = None
    return m


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
    with pytest.raises(openai.AuthenticationError) as e:
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
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    for kw, param in [({"temperature": 5}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
                      ({"n": 2}, "n"), ({"messages": []}, "messages"), ({"top_logprobs": 3}, "top_logprobs"),
                      ({"stop": [1, 2]}, "stop"), ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]")]:
        args = dict(model=NAME, messages=MSGS, max_tokens=2)
        args.update(kw)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**args)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (kw, e.value.body)
    big = {"model": NAME, "messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]}
    r = httpx.post(server + "/v1/chat/completions", json=big, headers=h, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    with pytest.raises(openai.BadRequestError) as e:             # longer than the context (4096)
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


def test_two_concurrent_clients(client, local):
    prompts = ["Alpha beta gamma", "One two three four"]
    want = ["".join(o.text for o in local.generate(p, max_tokens=16, temperature=0, ignore_eos=True)) for p in prompts]
    got, errors = [None, None], []

    def run(i):
        try:
            if i == 0:
                got[i] = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=16, temperature=0,
                                                   extra_body={"ignore_eos": True}).choices[0].text
            else:
                chunks = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=16, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
                got[i] = "".join(c.choices[0].text for c in chunks)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and got == want


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

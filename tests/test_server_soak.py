"""Soak test of `qwenmetal serve`: a real server process on loopback, many concurrent clients, abuse mixed in.

The server (``qwenmetal serve``, backend "cpu", the tiny fixture checkpoint, PARALLEL requests batched at
once, a small queue so that 503s happen) runs in its own process, so its RSS can be read from ``/proc/PID/status`` and "it never restarts"
means the same process answers from start to end. CLIENTS threads loop until the deadline, each request
drawn at random from: the official ``openai`` client (chat and completions, streaming and not, greedy or
seeded sampling, answers compared with the same checkpoint run alone in this process), raw sockets sending malformed JSON,
truncated JSON, bodies cut short, bodies over ``--max-request-bytes``, prompts longer than the context, bad
values, and clients that hang up mid-stream or while waiting. Well-formed requests refused with the
documented 503 ``server_busy`` are retried after ``Retry-After``, as a client should.

Asserted: every well-formed request gets the right answer; every bad one its documented 4xx; no 5xx but
503 ``server_busy``; the server process is alive at the end (same PID) with consistent /health counters
and nothing failed; RSS after warm-up grows by less than RSS_GROWTH_BOUND; SIGTERM then stops it within
the graceful timeout. The figures (requests by kind, statuses, RSS, max queue, latency) are printed.

Bounded: ``QWENMETAL_SOAK_SECONDS`` (default 60) of load, loopback only. docs/server.md has the figures of
a longer run (``QWENMETAL_SOAK_SECONDS=300 pytest tests/test_server_soak.py -s``).
"""
import json
import os
import random
import signal
import socket
import threading
import time

import pytest

from oracles import require
from live_server import spawned_server

import qwenmetal as qm
from qwenmetal.testing import cached_checkpoint

SECONDS = float(os.environ.get("QWENMETAL_SOAK_SECONDS", "60"))
CLIENTS = 6
PARALLEL = 3                      # requests generated at once, batched
MAX_QUEUE = 1                     # PARALLEL + MAX_QUEUE below CLIENTS, so that a full queue (503) happens
MAX_BODY = 64 * 1024
CACHE_BYTES = 8 << 20             # a small prefix cache: filled during warm-up
RSS_GROWTH_BOUND = 24 << 20       # bytes of RSS growth allowed after warm-up
NAME = "tiny"

PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3, 4,", "Hello"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]]
BUDGETS = [4, 12]


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no VmRSS in /proc/{pid}/status")


def _raw(port, head: bytes, body: bytes, *, send_all=True, read=True, timeout=60.0):
    """One raw HTTP exchange (Connection: close); returns (status or None if closed without reply, body)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.sendall(head + (body if send_all else body[: len(body) // 2]))
        if not send_all:
            s.shutdown(socket.SHUT_WR)        # the rest never comes
        if not read:
            return None, b""
        data = b""
        while True:
            try:
                part = s.recv(65536)
            except ConnectionResetError:
                break
            if not part:
                break
            data += part
    finally:
        s.close()
    if not data:
        return None, b""
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in data else b""


def _head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n").encode()


@pytest.fixture(scope="module")
def expected():
    """Greedy answers of the same checkpoint and backend, in this process: {(kind, i, budget): text}."""
    m = qm.Model.load(cached_checkpoint("tiny"), backend="cpu")
    m.prefix_cache = None
    out = {}
    for i, p in enumerate(PROMPTS):
        for b in BUDGETS:
            out["cmpl", i, b] = "".join(o.text for o in m.generate(p, max_tokens=b, temperature=0, ignore_eos=True))
            out["seeded", i, b] = "".join(o.text for o in m.generate(p, max_tokens=b, temperature=0.9, seed=i + b,
                                                                     ignore_eos=True))
    for i, msgs in enumerate(CHATS):
        for b in BUDGETS:
            r = m.chat(msgs, max_tokens=b, temperature=0)
            out["chat", i, b] = (r.content, r.reasoning)
    return out


class Soak:
    """The shared tallies of all client threads."""

    def __init__(self, port):
        self.port = port
        self.lock = threading.Lock()
        self.kinds: dict = {}
        self.statuses: dict = {}
        self.latency: list = []
        self.failures: list = []
        self.attempts = 0                 # well-formed requests sent (each may be queued, or refused with 503)
        self.busy = 0

    def tally(self, kind, status):
        with self.lock:
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            self.statuses[status] = self.statuses.get(status, 0) + 1

    def fail(self, kind, what):
        with self.lock:
            self.failures.append(f"{kind}: {what}")


def _client(soak: Soak, expected, seed: int, deadline: float):
    import openai

    rng = random.Random(seed)
    port = soak.port
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)

    def wellformed(kind):
        chat = kind.startswith("chat")
        stream = kind.endswith("stream")
        i = rng.randrange(len(CHATS if chat else PROMPTS))
        b = rng.choice(BUDGETS)
        t0, retried = time.monotonic(), False
        while True:
            with soak.lock:
                soak.attempts += 1
            try:
                if chat:
                    args = dict(model=NAME, messages=CHATS[i], max_tokens=b, temperature=0)
                    if stream:
                        chunks = list(client.chat.completions.create(stream=True, **args))
                        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                        reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                                            for c in chunks if c.choices)
                        got = (content.strip(), reasoning.strip() or None)
                        want = expected["chat", i, b]
                        want = (want[0], (want[1] or "").strip() or None)
                    else:
                        msg = client.chat.completions.create(**args).choices[0].message
                        got = (msg.content, (msg.model_extra or {}).get("reasoning_content"))
                        want = expected["chat", i, b]
                else:
                    seeded = rng.random() < 0.5          # sampled with a seed: the answer it gets alone too
                    args = dict(model=NAME, prompt=PROMPTS[i], max_tokens=b, temperature=0.9 if seeded else 0,
                                seed=i + b if seeded else None, extra_body={"ignore_eos": True})
                    if stream:
                        got = "".join(c.choices[0].text for c in client.completions.create(stream=True, **args))
                    else:
                        got = client.completions.create(**args).choices[0].text
                    want = expected["seeded" if seeded else "cmpl", i, b]
            except openai.APIStatusError as e:
                if e.status_code == 503 and (e.body or {}).get("code") == "server_busy":
                    soak.tally(kind + " (503, retried)", 503)
                    with soak.lock:
                        soak.busy += 1
                    time.sleep(float(e.response.headers.get("retry-after", "1")))
                    retried = True
                    continue
                soak.tally(kind, e.status_code)
                soak.fail(kind, f"status {e.status_code}: {e.body}")
                return
            break
        soak.tally(kind, 200)
        with soak.lock:
            soak.latency.append((time.monotonic() - t0, retried))
        if got != want:
            soak.fail(kind, f"prompt {i}, max_tokens {b}: got {got!r}, want {want!r}")

    def expect(kind, status, body, want_status, want_code):
        soak.tally(kind, status)
        code = None
        if status is not None and body:
            try:
                code = json.loads(body)["error"]["code"]
            except (ValueError, KeyError, TypeError):
                pass
        if (status, code) != (want_status, want_code):
            soak.fail(kind, f"got {status} {code!r} ({body[:200]!r}), want {want_status} {want_code!r}")

    def abuse(kind):
        if kind == "bad json":
            body = b'{"model": "tiny", "prompt": "x", max_tokens: }'
            expect(kind, *_raw(port, _head("/v1/completions", len(body)), body), 400, "invalid_json")
        elif kind == "truncated json":
            body = json.dumps({"model": NAME, "messages": CHATS[0]}).encode()[:-7]
            expect(kind, *_raw(port, _head("/v1/chat/completions", len(body)), body), 400, "invalid_json")
        elif kind == "body cut short":       # Content-Length promises more than is sent, then EOF
            body = json.dumps({"model": NAME, "prompt": "x" * 2000}).encode()
            status, resp = _raw(port, _head("/v1/completions", len(body)), body, send_all=False)
            soak.tally(kind, status)
            if status not in (None, 400):
                soak.fail(kind, f"got {status} {resp[:200]!r}")
        elif kind == "oversized body":
            body = json.dumps({"model": NAME, "prompt": "y" * (MAX_BODY + 100)}).encode()
            expect(kind, *_raw(port, _head("/v1/completions", len(body)), body), 413, "request_too_large")
        elif kind == "oversized prompt":
            body = json.dumps({"model": NAME, "prompt": [5] * 4200, "max_tokens": 2}).encode()
            expect(kind, *_raw(port, _head("/v1/completions", len(body)), body), 400, "context_length_exceeded")
        elif kind == "bad value":
            body = json.dumps({"model": NAME, "messages": CHATS[0], "temperature": 5}).encode()
            expect(kind, *_raw(port, _head("/v1/chat/completions", len(body)), body), 400, "invalid_value")
        elif kind in ("hang up mid-stream", "hang up while waiting"):
            stream = kind == "hang up mid-stream"
            body = json.dumps({"model": NAME, "prompt": rng.choice(PROMPTS), "max_tokens": 200, "temperature": 0,
                               "ignore_eos": True, "stream": stream}).encode()
            with soak.lock:
                soak.attempts += 1
            s = socket.create_connection(("127.0.0.1", port), timeout=60)
            try:
                s.sendall(_head("/v1/completions", len(body)) + body)
                if stream:
                    want, got = rng.randint(1, 6), b""
                    while got.count(b"data: ") < want and b"server_busy" not in got:
                        part = s.recv(65536)
                        if not part:
                            break
                        got += part
                else:
                    time.sleep(rng.uniform(0.0, 0.3))
            finally:
                s.close()
            soak.tally(kind, "hung up")

    kinds = ["cmpl", "cmpl stream", "chat", "chat stream"] * 3 + [
        "bad json", "truncated json", "body cut short", "oversized body", "oversized prompt", "bad value",
        "hang up mid-stream", "hang up while waiting"]
    while time.monotonic() < deadline:
        kind = rng.choice(kinds)
        try:
            if kind in ("cmpl", "cmpl stream", "chat", "chat stream"):
                wellformed(kind)
            else:
                abuse(kind)
        except Exception as e:  # noqa: BLE001 - every surprise is a failure of the soak
            soak.fail(kind, f"{type(e).__name__}: {e}")


def test_soak(expected, tmp_path):
    require("openai")
    require("uvicorn")
    httpx = require("httpx")
    with spawned_server(["--model", str(cached_checkpoint("tiny")), "--backend", "cpu", "--served-model-name",
                         NAME, "--parallel", str(PARALLEL), "--max-request-bytes", str(MAX_BODY),
                         "--max-queue", str(MAX_QUEUE),
                         "--cache-bytes", str(CACHE_BYTES), "--log-level", "warning"],
                        tmp_path / "server.log") as (proc, base):
        port = int(base.rsplit(":", 1)[1])
        log = tmp_path / "server.log"
        pid = proc.pid
        rss_start = _rss(pid)
        soak = Soak(port)
        t0 = time.monotonic()
        end = t0 + SECONDS
        warm = t0 + max(10.0, SECONDS / 4)
        samples, health = [], []
        threads = [threading.Thread(target=_client, args=(soak, expected, k, end)) for k in range(CLIENTS)]
        for t in threads:
            t.start()
        rss_warm = None
        while any(t.is_alive() for t in threads):
            now = time.monotonic()
            samples.append((now - t0, _rss(pid)))
            if rss_warm is None and now >= warm:
                rss_warm = samples[-1][1]
            health.append(httpx.get(base + "/health", timeout=30).json())
            time.sleep(0.5)
        for t in threads:
            t.join()
        # idle: let the last cancelled generations end
        idle_by = time.monotonic() + 30
        while True:
            h = httpx.get(base + "/health", timeout=10).json()
            if not h["running"] and not h["queued"]:
                break
            assert time.monotonic() < idle_by, h
            time.sleep(0.1)
        rss_end = _rss(pid)
        def pct(xs):
            xs = sorted(xs)
            return [round(xs[len(xs) // 2], 3), round(xs[int(len(xs) * 0.95)], 3)] if xs else None
        figures = {
            "seconds": SECONDS, "clients": CLIENTS, "cpu": _cpu(),
            "requests by kind": dict(sorted(soak.kinds.items())),
            "statuses": {str(k): v for k, v in sorted(soak.statuses.items(), key=str)},
            "health": h, "max queued (sampled)": max(x["queued"] for x in health),
            "rss MiB start / after warm-up / end": [round(x / 2**20, 1) for x in (rss_start, rss_warm, rss_end)],
            "rss MiB max after warm-up": round(max(r for t, r in samples if t0 + t >= warm) / 2**20, 1),
            "latency s p50 / p95, well-formed": pct([t for t, _ in soak.latency]),
            "latency s p50 / p95, well-formed answered at the first try": pct([t for t, r in soak.latency if not r]),
        }
        print("\nsoak figures: " + json.dumps(figures, indent=1))
        assert not soak.failures, "\n".join(soak.failures[:20])
        assert proc.poll() is None and proc.pid == pid, "the server process died"
        assert len(soak.latency) >= CLIENTS, "too few well-formed requests were answered"
        # /health: counters only grow; nothing failed or timed out; every job accounted for
        for a, b in zip(health, health[1:]):
            assert all(b[k] >= a[k] for k in ("completed", "cancelled", "rejected")), (a, b)
        assert h["failed"] == 0 and h["timed_out"] == 0
        assert h["rejected"] >= soak.busy              # hang-ups may have been refused unseen too
        ran = h["completed"] + h["cancelled"]
        assert len(soak.latency) <= h["completed"] and ran <= soak.attempts - h["rejected"], (h, soak.attempts)
        assert h["max_queued"] <= MAX_QUEUE and h["parallel"] == PARALLEL
        assert max(x["active_rows"] for x in health) > 1, "no two requests ever ran together"
        assert rss_end - rss_warm < RSS_GROWTH_BOUND, figures
        # graceful stop
        t_stop = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert time.monotonic() - t_stop < 15
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"

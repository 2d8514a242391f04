"""OpenAI-compatible HTTP server: ``qwenmetal serve`` (needs the ``server`` extra: starlette + uvicorn).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or server-sent events with
``"stream": true``), ``GET /v1/models``, ``GET /health``. One model per server; generations run on a worker
thread, in arrival order (`GenerationQueue`: bounded, a full queue answers 503 with ``Retry-After``): with
``parallel`` > 1 up to that many at once, batched (`qwenmetal.batching.Batcher`: one decode step for all
of them per step, new prompts prefilled in pieces between steps), else one at a time. A client that
disconnects cancels its generation within one decode step (a queued one is dropped unrun; the other rows
go on) and the server goes on serving; a generation past the time limit ends with what it made;
shutdown fails queued requests and lets the running one finish for a grace period. Both endpoints share
one submit/stream/collect path (`respond`, with a `_Render` per endpoint). Errors are OpenAI-style:
``{"error": {"message", "type", "param", "code"}}``. The prefix cache makes follow-up turns cheap;
``usage.prompt_tokens_details.cached_tokens`` says how many prompt tokens came from it. Documented in
docs/server.md.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import os
import threading
import time
import uuid

from .batching import DEFAULT_STEP_TOKENS, Batcher
from .chat import chat_turn, validate_messages
from .errors import InputError
from .generation import prepare
from .options import GenerationOptions
from .sampling import SAMPLING_KEYS

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
DEFAULT_MAX_QUEUE = 64                  # requests that may wait for the one generation slot
DEFAULT_CHAT_MAX_TOKENS = 2048          # a chat request without max_tokens; /v1/completions defaults to 16
DEFAULT_REQUEST_TIMEOUT = 600.0         # seconds a generation may run
DEFAULT_GRACEFUL_TIMEOUT = 5.0          # seconds in-flight requests get to finish on shutdown
SHUTDOWN_JOIN_SECONDS = 10.0            # how long shutdown waits for the worker after cancelling
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


class APIError(Exception):
    """An OpenAI-style error response: ``{"error": {"message", "type", "param", "code"}}`` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def payload(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self):
        from starlette.responses import JSONResponse
        return JSONResponse(self.payload(), status_code=self.status, headers=self.headers)


# ---------------------------------------------------------------------------------------------------
# the request queue: one generation at a time
# ---------------------------------------------------------------------------------------------------
class _Job:
    """One request's generation: `make(cancel)` starts it on the worker (one at a time), `prepare(cancel)` makes
    it a `Generation` for the batched worker; its events go to `out` on the event loop: ``("out",
    GenerationOutput)`` per token, then ``("end", reason, stats)`` (reason None: cancelled) or ``("error",
    exception)``."""

    def __init__(self, make, n_prompt: int, prepare=None):
        self.make = make                      # (cancel: threading.Event) -> iterator of GenerationOutput
        self.prepare = prepare                # (cancel: threading.Event) -> generation.Generation
        self.n_prompt = n_prompt
        self.n_out = 0                        # outputs pushed so far
        self.loop = asyncio.get_running_loop()
        self.out: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()       # set: stop at the next decode step / prefill chunk
        self.timed_out = False

    def push(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, event)
        except RuntimeError:                  # the event loop is gone (server shutting down)
            self.cancel.set()

    def expire(self) -> None:
        self.timed_out = True
        self.cancel.set()


class GenerationQueue:
    """The server's request queue, first come first served, on one worker thread: generations run one at a
    time, or with a `batcher` (`qwenmetal.batching.Batcher`) up to its ``max_rows`` at once, one batched
    decode step for all of them per step. At most `max_waiting` requests wait; `submit` refuses more with 503
    and ``Retry-After``. A waiting request that is cancelled (its client left) is dropped at once; a running
    one stops at its next decode step (or prefill chunk), and its row leaves the batch. A running generation
    that outlives `time_limit` seconds is stopped and its request ends with what it generated (reason
    ``"time_limit"``). `close` refuses new requests and fails the waiting ones with 503 ``shutting_down``;
    the running ones go on until they end."""

    def __init__(self, max_waiting: int = DEFAULT_MAX_QUEUE, time_limit: float | None = None,
                 batcher: Batcher | None = None):
        if max_waiting < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_waiting}")
        if time_limit is not None and not time_limit > 0:
            raise ValueError(f"request_timeout must be > 0 seconds (or None for no limit), got {time_limit}")
        self.max_waiting = max_waiting
        self.time_limit = time_limit
        self.batcher = batcher
        self.parallel = batcher.max_rows if batcher is not None else 1
        self._cond = threading.Condition()
        self._waiting: collections.deque = collections.deque()
        self._running: set = set()
        self._closed = False
        self.counts = dict.fromkeys(("completed", "cancelled", "timed_out", "failed", "rejected"), 0)
        self.max_queued = 0
        self._occupancy = None                # the batch's mean rows per step / parallel, recently
        self._thread = threading.Thread(target=self._work if batcher is None else self._work_batched,
                                        name="qwenmetal-generate", daemon=True)
        self._thread.start()

    def submit(self, job: _Job) -> None:
        with self._cond:
            if self._closed:
                raise APIError(503, "the server is shutting down", code="shutting_down", type="server_error")
            if len(self._waiting) >= self.max_waiting:
                self.counts["rejected"] += 1
                raise APIError(503, f"the server is busy ({len(self._waiting)} requests queued); retry later",
                               code="server_busy", type="server_error", headers={"Retry-After": "1"})
            self._waiting.append(job)
            self.max_queued = max(self.max_queued, len(self._waiting))
            self._cond.notify()

    def cancel(self, job: _Job) -> None:
        """The client is gone: drop `job` if it waits, stop it at its next step if it runs (no-op once done)."""
        with self._cond:
            job.cancel.set()
            if job in self._waiting:
                self._waiting.remove(job)
                self.counts["cancelled"] += 1
                job.push("end", None, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            err = APIError(503, "the server is shutting down", code="shutting_down", type="server_error")
            while self._waiting:
                self._waiting.popleft().push("error", err)
            self._cond.notify()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the worker to finish (after `close`); whether it did within `timeout`."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return
                job = self._waiting.popleft()
                self._running.add(job)
            timer = self._timer(job)
            try:
                self._run(job)
            finally:
                if timer is not None:
                    timer.cancel()
                with self._cond:
                    self._running.discard(job)

    def _timer(self, job: _Job):
        if self.time_limit is None:
            return None
        timer = threading.Timer(self.time_limit, job.expire)
        timer.daemon = True
        timer.start()
        return timer

    def _run(self, job: _Job) -> None:
        last = None
        try:
            it = job.make(job.cancel)
            try:
                for last in it:
                    self._out(job, last)
                    if last.finish_reason is not None or job.cancel.is_set():
                        break
            finally:
                it.close()
        except Exception as e:  # noqa: BLE001 - reported to the client as a 500
            self._fail(job, e)
            return
        if last is None or last.finish_reason is None:
            self._stopped(job)

    def _work_batched(self) -> None:
        """The batched worker: admit waiting jobs while the batcher has free rows, then one step for all."""
        b, timers = self.batcher, {}
        while True:
            admit = []
            with self._cond:
                while not self._waiting and not b.active and not self._closed:
                    self._cond.wait()
                if not self._waiting and not b.active:
                    return
                while self._waiting and b.rows + b.waiting < b.max_rows:
                    job = self._waiting.popleft()
                    self._running.add(job)
                    admit.append(job)
            for job in admit:
                try:
                    gen = job.prepare(job.cancel)
                except Exception as e:  # noqa: BLE001 - reported to the client
                    self._fail(job, e)
                    continue
                b.add(gen, job)
                timers[job] = self._timer(job)
            events = b.step()
            with self._cond:
                self._occupancy = b.stats.occupancy(b.max_rows)
            for ev in events:
                job = ev.tag
                if ev.kind == "out":
                    self._out(job, ev.value)
                    if ev.value.finish_reason is None:
                        continue
                elif ev.kind == "error":
                    self._fail(job, ev.value)
                else:
                    self._stopped(job)
                timer = timers.pop(job, None)
                if timer is not None:
                    timer.cancel()

    # ---- how a job ends -------------------------------------------------------------------------
    def _out(self, job: _Job, out) -> None:
        job.n_out += 1
        job.push("out", out)
        if out.finish_reason is not None:
            self._count("completed", job)
            job.push("end", out.finish_reason, out.stats)

    def _fail(self, job: _Job, e: BaseException) -> None:
        self._count("failed", job)
        job.push("error", e)

    def _stopped(self, job: _Job) -> None:
        """`job` stopped before its end: its time ran out, or its client left."""
        if job.timed_out:
            self._count("timed_out", job)
            job.push("end", "time_limit", {"prompt_tokens": job.n_prompt, "generated_tokens": job.n_out,
                                           "cached_tokens": None})
        else:
            self._count("cancelled", job)
            job.push("end", None, None)

    def _count(self, key: str, job: _Job | None = None) -> None:
        with self._cond:
            self.counts[key] += 1
            self._running.discard(job)

    def status(self) -> dict:
        """What /health reports: queued requests, running ones (``active_rows``, of ``parallel``), the batch's
        mean occupancy over its recent decode steps, and the counters."""
        with self._cond:
            out = {"queued": len(self._waiting), "running": bool(self._running), "active_rows": len(self._running),
                   "parallel": self.parallel, **self.counts, "max_queued": self.max_queued}
            if self.batcher is not None:
                occ = self._occupancy
                out["batch_occupancy"] = None if occ is None else round(occ, 3)
        return out


# ---------------------------------------------------------------------------------------------------
# request validation
# ---------------------------------------------------------------------------------------------------
def _num(body, name, lo=None, hi=None, integer=False, default=None, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not float(v).is_integer()):
        raise APIError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {v!r}", name,
                       "invalid_value")
    v = int(v) if integer else float(v)
    if v != v or (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        rng = f"{'(' if lo_open else '['}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise APIError(400, f"'{name}' must be in {rng}, got {v!r}", name, "invalid_value")
    return v


def _bool(body, name, default=False):
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(400, f"'{name}' must be a boolean, got {v!r}", name, "invalid_value")
    return v


#: request fields that are `GenerationOptions` fields of the same name (max_tokens: see max_tokens_of)
_OPTION_FIELDS = SAMPLING_KEYS + ("stop", "stop_token_ids", "ignore_eos")
#: OpenAI's documented ranges where they are narrower than qwenmetal's own checks
_API_RANGES = {"temperature": (0.0, 2.0), "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}


def _bad_input(e: InputError) -> APIError:
    return APIError(400, str(e), e.param, e.code)


def _options(body, max_tokens: int) -> GenerationOptions:
    """The request's sampling and stopping options, checked by `GenerationOptions` (a 400 naming the field)."""
    kw = {k: body.get(k) for k in _OPTION_FIELDS}
    if kw["top_k"] == -1:                     # vLLM's "off"
        kw["top_k"] = 0
    if isinstance(kw["seed"], int) and not isinstance(kw["seed"], bool):
        kw["seed"] &= 0xFFFFFFFFFFFFFFFF      # any JSON integer seeds the generator
    if isinstance(kw["stop"], list) and len(kw["stop"]) > MAX_STOP_STRINGS:
        raise APIError(400, f"'stop' may hold at most {MAX_STOP_STRINGS} strings", "stop", "invalid_value")
    try:
        opts = GenerationOptions.build(max_tokens=max_tokens, **kw)
    except InputError as e:
        raise _bad_input(e) from None
    for k, (lo, hi) in _API_RANGES.items():
        v = getattr(opts, k)
        if v is not None and not lo <= v <= hi:
            raise APIError(400, f"'{k}' must be in [{lo}, {hi}], got {v!r}", k, "invalid_value")
    return opts


def _check_n(body):
    n = _num(body, "n", 1, None, integer=True, default=1)
    if n != 1:
        raise APIError(400, "only n=1 is supported", "n", "unsupported_value")
    bo = _num(body, "best_of", 1, None, integer=True, default=1)
    if bo != 1:
        raise APIError(400, "only best_of=1 is supported", "best_of", "unsupported_value")


def _messages(body) -> list:
    try:
        return validate_messages(body.get("messages"))
    except InputError as e:
        raise _bad_input(e) from None


def _usage(stats) -> dict:
    u = {"prompt_tokens": stats["prompt_tokens"], "completion_tokens": stats["generated_tokens"],
         "total_tokens": stats["prompt_tokens"] + stats["generated_tokens"]}
    if stats["cached_tokens"] is not None:            # unknown for a generation stopped by the time limit
        u["prompt_tokens_details"] = {"cached_tokens": stats["cached_tokens"]}
    return u


def _finish(reason, tool_calls=False):
    if reason == "stop" and tool_calls:
        return "tool_calls"
    return "stop" if reason == "stop" else "length"


def _sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def _token_str(tok, i: int) -> str:
    return tok.token_bytes(i).decode("utf-8", "replace") if tok is not None else str(i)


def _tool_calls(calls, indexed: bool) -> list:
    return [{**({"index": k} if indexed else {}), "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for k, c in enumerate(calls)]


class _Render:
    """How one endpoint writes a generation as OpenAI JSON. `respond` drives it the same way for both
    endpoints: ``start`` / ``step(out)`` per token / ``finish(reason)`` give the streamed chunks,
    ``body(outs, reason, usage)`` the collected response."""

    chunk_object = ""

    def __init__(self, id_prefix: str, model_name: str):
        self.id, self.created, self.model = id_prefix + uuid.uuid4().hex, int(time.time()), model_name

    def envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def usage_chunk(self, usage: dict) -> dict:
        return self.envelope(self.chunk_object, [], usage=usage)

    def start(self) -> list:
        return []


class _ChatRender(_Render):
    chunk_object = "chat.completion.chunk"

    def __init__(self, model_name, tok, turn, logprobs: bool, lm=None):
        super().__init__("chatcmpl-", model_name)
        self.tok, self.turn, self.logprobs = tok, turn, logprobs     # turn: chat.chat_turn's result
        self.parser = turn.stream_parser()
        self.lm = lm                          # the qm.Model, which keeps the reply's transcript
        self.msg, self.tokens = {"role": "assistant", "content": ""}, []   # the reply as the client rebuilds it

    def _add(self, deltas) -> None:
        for f, t in deltas:
            self.msg[f] = self.msg.get(f, "") + t

    def chunk(self, delta, finish=None, lp=None) -> dict:
        return self.envelope(self.chunk_object, [{"index": 0, "delta": delta, "logprobs": lp,
                                                  "finish_reason": finish}])

    def entry(self, out) -> dict:
        def one(i, v):
            b = self.tok.token_bytes(i) if self.tok is not None else b""
            return {"token": b.decode("utf-8", "replace"), "logprob": v, "bytes": list(b)}
        e = one(out.token, out.logprob)
        e["top_logprobs"] = [one(i, v) for i, v in (out.top_logprobs or [])]
        return e

    def start(self) -> list:
        return [self.chunk({"role": "assistant", "content": ""})]

    def step(self, out) -> list:
        lp = {"content": [self.entry(out)]} if self.logprobs and out.logprob is not None else None
        deltas = self.parser.feed(out.text)
        self.tokens.append(out.token)
        self._add(deltas)
        chunks = [self.chunk({f: t}, lp=lp if i == 0 else None) for i, (f, t) in enumerate(deltas)]
        if not deltas and lp is not None:
            chunks.append(self.chunk({}, lp=lp))
        return chunks

    def finish(self, reason) -> list:
        deltas, calls = self.parser.finish()
        self._add(deltas)
        chunks = [self.chunk({f: t}) for f, t in deltas]
        if calls:
            tc = _tool_calls(calls, indexed=True)
            self.msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in tc]
            chunks.append(self.chunk({"tool_calls": tc}))
        self.turn.remember(self.lm, self.msg, self.tokens)
        return chunks + [self.chunk({}, _finish(reason, bool(calls)))]

    def body(self, outs, reason, usage) -> dict:
        reasoning, content, calls = self.turn.parse("".join(o.text for o in outs))
        msg = {"role": "assistant", "content": content}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = _tool_calls(calls, indexed=False)
        self.turn.remember(self.lm, msg, [o.token for o in outs])
        lp = {"content": [self.entry(o) for o in outs]} if self.logprobs else None
        return self.envelope("chat.completion", [{"index": 0, "message": msg, "logprobs": lp,
                                                  "finish_reason": _finish(reason, bool(calls))}], usage=usage)


class _CompletionRender(_Render):
    chunk_object = "text_completion"

    def __init__(self, model_name, tok, prompt_text: str, n_logprobs: int | None):
        super().__init__("cmpl-", model_name)
        self.tok, self.prompt_text, self.n_lp = tok, prompt_text, n_logprobs
        self.offset = len(prompt_text)        # text_offset of the next streamed token

    def chunk(self, text, finish=None, lp=None) -> dict:
        return self.envelope(self.chunk_object, [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}])

    def logprobs_of(self, outs, off: int):
        if self.n_lp is None:
            return None
        toks, lps, tops, offs = [], [], [], []
        for o in outs:
            toks.append(_token_str(self.tok, o.token) if self.tok is not None else "")
            lps.append(o.logprob)
            tops.append({_token_str(self.tok, i): v for i, v in (o.top_logprobs or [])})
            offs.append(off)
            off += len(o.text)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    def start(self) -> list:
        return [self.chunk(self.prompt_text)] if self.prompt_text else []

    def step(self, out) -> list:
        if not out.text and self.n_lp is None:
            return []
        c = self.chunk(out.text, lp=self.logprobs_of([out], self.offset))
        self.offset += len(out.text)
        return [c]

    def finish(self, reason) -> list:
        return [self.chunk("", _finish(reason))]

    def body(self, outs, reason, usage) -> dict:
        return self.envelope("text_completion", [{
            "index": 0, "text": self.prompt_text + "".join(o.text for o in outs),
            "logprobs": self.logprobs_of(outs, len(self.prompt_text)), "finish_reason": _finish(reason)}],
            usage=usage)


# ---------------------------------------------------------------------------------------------------
# the app
# ---------------------------------------------------------------------------------------------------
def create_app(model, *, model_name: str | None = None, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               default_max_tokens: int | None = DEFAULT_CHAT_MAX_TOKENS, max_queue: int = DEFAULT_MAX_QUEUE,
               request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT, speculative=None,
               speculative_k: int | None = None, parallel: int = 1, step_tokens: int = DEFAULT_STEP_TOKENS,
               allow_local_images: bool = False):
    """The Starlette application serving `model` (a loaded `qm.Model`). `default_max_tokens`: the budget
    of a chat request that sets no ``max_tokens`` (None: up to the context limit); `max_queue`: how many
    requests may wait; `request_timeout`: seconds a generation may run (None: no limit); `speculative` /
    `speculative_k`: every generation decodes speculatively (`Model.generate`'s arguments; the output is
    unchanged; single-stream, so `parallel` must be 1); `parallel`: how many generations run at once,
    batched (`qwenmetal.batching`), with at most `step_tokens` prompt tokens prefilled per step;
    `allow_local_images`: chat messages may name image files on this machine (a ``file://`` URL or a path;
    otherwise only ``data:`` URLs are taken, and nothing is ever fetched). See docs/server.md."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    if default_max_tokens is not None and (isinstance(default_max_tokens, bool) or default_max_tokens < 1):
        raise ValueError(f"default_max_tokens must be >= 1 (or None for the context limit), got {default_max_tokens!r}")
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise ValueError(f"parallel must be a positive integer, got {parallel!r}")
    if speculative is not None and parallel > 1:
        raise ValueError("speculative decoding is single-stream: serve with parallel=1 (--parallel 1) to use it")
    name = model_name or os.path.basename(os.path.normpath(str(model.path))) or "qwenmetal"
    batcher = Batcher(model, parallel, step_tokens) if parallel > 1 else None
    queue = GenerationQueue(max_queue, request_timeout, batcher)
    created = int(time.time())
    tok = model.tokenizer

    def check_key(request):
        if api_key is None:
            return
        h = request.headers.get("authorization", "")
        given = h[7:] if h.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key", type="authentication_error")

    async def read_json(request) -> dict:
        check_key(request)
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > max_request_bytes:
            raise APIError(413, f"request body of {cl} bytes exceeds the limit of {max_request_bytes}",
                           code="request_too_large")
        chunks, n = [], 0
        try:
            async for c in request.stream():
                n += len(c)
                if n > max_request_bytes:
                    raise APIError(413, f"request body exceeds the limit of {max_request_bytes} bytes",
                                   code="request_too_large")
                chunks.append(c)
        except ClientDisconnect:              # the client left before sending the whole body
            raise APIError(400, "the request body was cut short", code="incomplete_body") from None
        try:
            body = json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"invalid JSON body: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        m = body.get("model")
        if m is not None and m != name:
            raise APIError(404, f"the model '{m}' does not exist; this server serves '{name}'", "model",
                           "model_not_found")
        return body

    def max_tokens_of(body, n_prompt, key_default, prompt_param):
        mt = _num(body, "max_completion_tokens", 1, None, integer=True)
        if mt is None:
            mt = _num(body, "max_tokens", 1, None, integer=True)
        limit = model.config.max_position_embeddings
        if n_prompt >= limit:
            raise APIError(400, f"the prompt has {n_prompt} tokens; this model's context is {limit} tokens",
                           prompt_param, "context_length_exceeded")
        if mt is None:
            mt = key_default if key_default is not None else limit - n_prompt
        return max(1, min(mt, limit - n_prompt))

    def make_job(gen_kwargs, ids, cache_points=(), images=None) -> _Job:
        kw = dict(gen_kwargs)
        opts = GenerationOptions.build(kw.pop("options", None), **kw)
        return _Job(lambda cancel: model.generate(ids, cache_points=cache_points, cancel=cancel, options=opts,
                                                  speculative=speculative, speculative_k=speculative_k,
                                                  images=images),
                    len(ids), lambda cancel: prepare(model, ids, opts, cache_points=cache_points, cancel=cancel,
                                                     images=images))

    async def events(request, job):
        """`job`'s events up to its end. The client is watched the whole time (queued or running): its
        disconnect cancels the job at once, as does leaving this generator early."""
        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            queue.cancel(job)

        watcher = asyncio.ensure_future(watch())
        try:
            while True:
                event = await job.out.get()
                if event[0] == "error":
                    e = event[1]
                    raise e if isinstance(e, APIError) else APIError(
                        500, f"generation failed: {type(e).__name__}: {e}", type="server_error")
                yield event
                if event[0] == "end":
                    return
        finally:
            watcher.cancel()
            queue.cancel(job)

    async def sse(request, job, render, include_usage):
        try:
            for c in render.start():
                yield _sse(c)
            async with contextlib.aclosing(events(request, job)) as evs:
                async for kind, *val in evs:
                    # one event-loop turn per event: tokens that arrived together would otherwise be written
                    # in one go, on past a write that found the connection gone (asyncio logs each such
                    # write); in the turn the server learns of the disconnect (later writes are dropped)
                    # and the watcher cancels the job
                    await asyncio.sleep(0)
                    if kind == "out":
                        for c in render.step(val[0]):
                            yield _sse(c)
                    elif val[0] is not None:
                        for c in render.finish(val[0]):
                            yield _sse(c)
                        if include_usage:
                            yield _sse(render.usage_chunk(_usage(val[1])))
                        yield "data: [DONE]\n\n"
        except APIError as e:                 # after the 200 header: an error event ends the stream
            yield _sse(e.payload())
        finally:
            queue.cancel(job)

    async def respond(request, job: _Job, render: _Render, stream: bool, include_usage: bool):
        """The one path of both endpoints: queue `job`, then stream its chunks or collect its body."""
        queue.submit(job)
        if stream:
            return StreamingResponse(sse(request, job, render, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        outs, end = [], None
        async with contextlib.aclosing(events(request, job)) as evs:
            async for event in evs:
                if event[0] == "out":
                    outs.append(event[1])
                else:
                    end = event
        _, reason, stats = end
        if reason is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(render.body(outs, reason, _usage(stats)))

    def gen_kwargs_of(body, n_prompt, default_max, prompt_param):
        """`prompt_param`: the field that holds the prompt ("messages" or "prompt"), named by a too-long one."""
        return {"options": _options(body, max_tokens_of(body, n_prompt, default_max, prompt_param))}

    # ---- endpoints ------------------------------------------------------------------------------
    async def health(request):
        return JSONResponse({"status": "ok", "model": name, **queue.status()})

    async def models(request):
        check_key(request)
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "qwenmetal",
             "max_model_len": model.config.max_position_embeddings}]})

    async def chat_completions(request):
        body = await read_json(request)
        if tok is None:
            raise APIError(400, "this checkpoint has no tokenizer; use /v1/completions with token ids")
        msgs = _messages(body)
        _check_n(body)
        stream = _bool(body, "stream")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) if stream else False
        want_lp = _bool(body, "logprobs")
        top_n = _num(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True, default=0)
        if top_n and not want_lp:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
        tools = body.get("tools")
        if body.get("tool_choice") == "none":
            tools = None
        rf = body.get("response_format")
        if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
            raise APIError(400, "only response_format {'type': 'text'} is supported", "response_format",
                           "unsupported_value")
        ctk = body.get("chat_template_kwargs") or {}
        if not isinstance(ctk, dict):
            raise APIError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs", "invalid_value")
        ctk = dict(ctk)
        enable_thinking = ctk.pop("enable_thinking", None)
        if "enable_thinking" in body:
            enable_thinking = _bool(body, "enable_thinking", None)
        try:
            turn = await run_in_threadpool(chat_turn, model, msgs, tools=tools, enable_thinking=enable_thinking,
                                           template_kwargs=ctk, allow_local_images=allow_local_images)
        except InputError as e:
            raise _bad_input(e) from None
        except ValueError as e:  # a conversation the chat template refuses
            raise APIError(400, str(e), "messages", "invalid_value") from None
        if turn.images is not None and speculative is not None:
            raise APIError(400, "this server decodes speculatively, which does not take images yet", "messages",
                           "unsupported_value")
        kw = gen_kwargs_of(body, len(turn.prompt_ids), default_max_tokens, "messages")
        kw.update(logprobs=want_lp, top_logprobs=top_n)
        render = _ChatRender(name, tok, turn, want_lp, model)
        return await respond(request, make_job(kw, turn.prompt_ids, turn.cache_points, turn.images), render,
                             stream, include_usage)

    async def completions(request):
        body = await read_json(request)
        _check_n(body)
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            if tok is None:
                raise APIError(400, "this checkpoint has no tokenizer; send the prompt as token ids", "prompt")
            ids = tok.encode(p)
        elif isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
            ids = list(p)
            if min(ids) < 0 or max(ids) >= model.config.vocab_size:
                raise APIError(400, f"prompt token ids must be in [0, {model.config.vocab_size})", "prompt",
                               "invalid_value")
        else:
            raise APIError(400, "'prompt' must be a string, a list of token ids, or a list holding one of them",
                           "prompt", "invalid_value")
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt", "invalid_value")
        if body.get("suffix"):
            raise APIError(400, "'suffix' is not supported", "suffix", "unsupported_value")
        stream = _bool(body, "stream")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) if stream else False
        echo = _bool(body, "echo")
        n_lp = body.get("logprobs")
        n_lp = None if n_lp is None else _num(body, "logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
        kw = gen_kwargs_of(body, len(ids), 16, "prompt")
        kw.update(logprobs=n_lp is not None, top_logprobs=n_lp or 0)
        prompt_text = (p if isinstance(p, str) else tok.decode(ids)) if echo and tok is not None else ""
        return await respond(request, make_job(kw, ids), _CompletionRender(name, tok, prompt_text, n_lp), stream,
                             include_usage)

    async def api_error(request, exc: APIError):
        return exc.response()

    async def http_error(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    async def server_error(request, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    routes = [Route("/health", health, methods=["GET"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"])]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        queue.close()                         # waiting requests get 503 shutting_down
        await run_in_threadpool(queue.join, SHUTDOWN_JOIN_SECONDS)

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error})
    app.state.queue = queue
    app.state.model_name = name
    return app


def uvicorn_server(app, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
                   graceful_timeout: float = DEFAULT_GRACEFUL_TIMEOUT):
    """A ``uvicorn.Server`` for `app` (from `create_app`). On shutdown (SIGINT/SIGTERM or
    ``should_exit``) it first closes the request queue, so waiting requests get 503 ``shutting_down`` at
    once; in-flight ones may finish for `graceful_timeout` seconds, after which uvicorn cancels them (and
    so their generations, at the next decode step)."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            app.state.queue.close()
            await super().shutdown(sockets)

    return _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                  timeout_graceful_shutdown=graceful_timeout))


def serve(model, host: str = "127.0.0.1", port: int = 8000, *, model_name: str | None = None,
          api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
          default_max_tokens: int | None = DEFAULT_CHAT_MAX_TOKENS, max_queue: int = DEFAULT_MAX_QUEUE,
          request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
          graceful_timeout: float = DEFAULT_GRACEFUL_TIMEOUT, log_level: str = "info", speculative=None,
          speculative_k: int | None = None, parallel: int = 1, step_tokens: int = DEFAULT_STEP_TOKENS,
          allow_local_images: bool = False) -> None:
    """Serve `model` with uvicorn until interrupted (options as for `create_app` and `uvicorn_server`)."""
    app = create_app(model, model_name=model_name, api_key=api_key, max_request_bytes=max_request_bytes,
                     default_max_tokens=default_max_tokens, max_queue=max_queue, request_timeout=request_timeout,
                     speculative=speculative, speculative_k=speculative_k, parallel=parallel,
                     step_tokens=step_tokens, allow_local_images=allow_local_images)
    uvicorn_server(app, host, port, log_level=log_level, graceful_timeout=graceful_timeout).run()

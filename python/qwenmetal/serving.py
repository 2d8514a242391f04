"""What every HTTP API of ``qwenmetal serve`` shares (needs the ``server`` extra: starlette + uvicorn).

`GenerationQueue` runs generations on one worker thread, in arrival order (bounded: a full queue answers 503
with ``Retry-After``): with ``parallel`` > 1 up to that many at once, batched (`qwenmetal.batching.Batcher`),
else one at a time. A client that disconnects cancels its generation within one decode step; a generation
past the time limit ends with what it made. `Service` is one served model with its queue: it reads and
checks requests (`read_json`, the key, the model name), renders chat turns (`turn`), and runs a `Job` to a
streamed response or a collected result through a per-API `Render`. The APIs on top of it: OpenAI chat
completions and completions (`qwenmetal.server`), Anthropic Messages (`qwenmetal.api_anthropic`) and
OpenAI Responses (`qwenmetal.api_responses`). `APIError` carries an error's status and fields; each API
writes it in its own shape.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import threading
import time

from .batching import Batcher
from .chat import ChatTurn, chat_turn, validate_messages
from .errors import InputError
from .generation import prepare
from .grammar import warm_up
from .options import GenerationOptions
from .sampling import SAMPLING_KEYS

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
DEFAULT_MAX_QUEUE = 64                  # requests that may wait for the one generation slot
DEFAULT_CHAT_MAX_TOKENS = 2048          # a chat request without max_tokens; /v1/completions defaults to 16
DEFAULT_REQUEST_TIMEOUT = 600.0         # seconds a generation may run
DEFAULT_GRACEFUL_TIMEOUT = 5.0          # seconds in-flight requests get to finish on shutdown
SHUTDOWN_JOIN_SECONDS = 10.0            # how long shutdown waits for the worker after cancelling
KEEPALIVE_SECONDS = 10.0                # a stream silent this long (a long prefill) gets a keep-alive event
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
class Job:
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

    def submit(self, job: Job) -> None:
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

    def cancel(self, job: Job) -> None:
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

    def _timer(self, job: Job):
        if self.time_limit is None:
            return None
        timer = threading.Timer(self.time_limit, job.expire)
        timer.daemon = True
        timer.start()
        return timer

    def _run(self, job: Job) -> None:
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
    def _out(self, job: Job, out) -> None:
        job.n_out += 1
        job.push("out", out)
        if out.finish_reason is not None:
            self._count("completed", job)
            job.push("end", out.finish_reason, out.stats)

    def _fail(self, job: Job, e: BaseException) -> None:
        self._count("failed", job)
        job.push("error", e)

    def _stopped(self, job: Job) -> None:
        """`job` stopped before its end: its time ran out, or its client left."""
        if job.timed_out:
            self._count("timed_out", job)
            job.push("end", "time_limit", {"prompt_tokens": job.n_prompt, "generated_tokens": job.n_out,
                                           "cached_tokens": None})
        else:
            self._count("cancelled", job)
            job.push("end", None, None)

    def _count(self, key: str, job: Job | None = None) -> None:
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
def num(body, name, lo=None, hi=None, integer=False, default=None, lo_open=False):
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


def boolean(body, name, default=False):
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(400, f"'{name}' must be a boolean, got {v!r}", name, "invalid_value")
    return v


#: request fields that are `GenerationOptions` fields of the same name (max_tokens: see max_tokens_of)
_OPTION_FIELDS = SAMPLING_KEYS + ("stop", "stop_token_ids", "ignore_eos")
#: vLLM's request field for a thinking budget (`GenerationOptions.thinking_budget`), which the OpenAI routes take
THINKING_BUDGET = {"thinking_token_budget": "thinking_budget"}
#: OpenAI's documented ranges where they are narrower than qwenmetal's own checks
_API_RANGES = {"temperature": (0.0, 2.0), "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}


def bad_input(e: InputError) -> APIError:
    return APIError(400, str(e), e.param, e.code)


def options_of(body, max_tokens: int, fields: dict | None = None, **extra) -> GenerationOptions:
    """The request's sampling and stopping options, checked by `GenerationOptions` (a 400 naming the field).
    `fields`: the option names an API spells differently (``{"stop_sequences": "stop"}``); `extra`: more
    `GenerationOptions` fields (logprobs, a grammar)."""
    kw = {k: body.get(k) for k in _OPTION_FIELDS}
    for api_name, field_name in (fields or {}).items():
        if body.get(api_name) is not None:
            kw[field_name] = body[api_name]
    if kw["top_k"] == -1:                     # vLLM's "off"
        kw["top_k"] = 0
    if isinstance(kw["seed"], int) and not isinstance(kw["seed"], bool):
        kw["seed"] &= 0xFFFFFFFFFFFFFFFF      # any JSON integer seeds the generator
    if isinstance(kw["stop"], list) and len(kw["stop"]) > MAX_STOP_STRINGS:
        raise APIError(400, f"'stop' may hold at most {MAX_STOP_STRINGS} strings", "stop", "invalid_value")
    try:
        opts = GenerationOptions.build(max_tokens=max_tokens, **kw, **extra)
    except InputError as e:
        raise bad_input(e) from None
    for k, (lo, hi) in _API_RANGES.items():
        v = getattr(opts, k)
        if v is not None and not lo <= v <= hi:
            raise APIError(400, f"'{k}' must be in [{lo}, {hi}], got {v!r}", k, "invalid_value")
    return opts


def check_n(body):
    n = num(body, "n", 1, None, integer=True, default=1)
    if n != 1:
        raise APIError(400, "only n=1 is supported", "n", "unsupported_value")
    bo = num(body, "best_of", 1, None, integer=True, default=1)
    if bo != 1:
        raise APIError(400, "only best_of=1 is supported", "best_of", "unsupported_value")


def messages_of(body) -> list:
    try:
        return validate_messages(body.get("messages"))
    except InputError as e:
        raise bad_input(e) from None



def sse(obj, event: str | None = None) -> str:
    """One server-sent event holding `obj` as JSON (with an ``event:`` line when `event` is given)."""
    head = f"event: {event}\n" if event is not None else ""
    return head + "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


class Render:
    """How one API writes a generation. `Service.respond` drives every API the same way: ``start()``,
    ``step(out)`` per token and ``finish(reason, stats)`` give the streamed text (server-sent events, ready
    to write), ``error(e)`` the event that ends a stream after an `APIError`, and ``body(outs, reason,
    stats)`` the collected response (a JSON-able dict)."""

    def start(self) -> list:
        return []

    def step(self, out) -> list:
        raise NotImplementedError

    def finish(self, reason: str, stats: dict) -> list:
        raise NotImplementedError

    def error(self, e: APIError) -> list:
        return [sse(e.payload())]

    def keepalive(self) -> list:
        """What a stream sends when it has been silent for the service's keep-alive interval (a long prefill
        before the first token), so that proxies and clients with read timeouts keep the connection: an SSE
        comment, which every client skips."""
        return [": keepalive\n\n"]

    def body(self, outs: list, reason: str, stats: dict) -> dict:
        raise NotImplementedError


class Service:
    """One served model and its request queue: what every endpoint uses (the settings are `create_app`'s,
    `qwenmetal.server`)."""

    def __init__(self, model, *, name: str, api_key: str | None, max_request_bytes: int,
                 default_max_tokens: int | None, max_queue: int, request_timeout: float | None, speculative,
                 speculative_k: int | None, parallel: int, step_tokens: int, allow_local_images: bool,
                 keepalive_seconds: float | None = KEEPALIVE_SECONDS):
        if default_max_tokens is not None and (isinstance(default_max_tokens, bool) or default_max_tokens < 1):
            raise ValueError(f"default_max_tokens must be >= 1 (or None for the context limit), got "
                             f"{default_max_tokens!r}")
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise ValueError(f"parallel must be a positive integer, got {parallel!r}")
        if keepalive_seconds is not None and not keepalive_seconds > 0:
            raise ValueError(f"keepalive_seconds must be > 0 seconds (or None: never), got {keepalive_seconds}")
        if speculative is not None and parallel > 1:
            raise ValueError("speculative decoding is single-stream: serve with parallel=1 (--parallel 1) to use it")
        self.model, self.name, self.tok = model, name, model.tokenizer
        self.api_key, self.max_request_bytes = api_key, max_request_bytes
        self.default_max_tokens = default_max_tokens
        self.speculative, self.speculative_k = speculative, speculative_k
        self.allow_local_images = allow_local_images
        self.keepalive_seconds = keepalive_seconds
        batcher = Batcher(model, parallel, step_tokens) if parallel > 1 else None
        self.queue = GenerationQueue(max_queue, request_timeout, batcher)
        self.created = int(time.time())
        # the grammar engine's view of the vocabulary, built now rather than in the first tool request
        threading.Thread(target=warm_up, args=(model,), name="qwenmetal-grammar-warm-up", daemon=True).start()

    # ---- requests -------------------------------------------------------------------------------
    def check_key(self, request) -> None:
        """With an API key set: ``Authorization: Bearer KEY`` (OpenAI clients) or ``x-api-key: KEY``
        (Anthropic clients) must carry it."""
        if self.api_key is None:
            return
        h = request.headers.get("authorization", "")
        given = h[7:] if h.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                           code="invalid_api_key", type="authentication_error")

    async def read_json(self, request) -> dict:
        """The request's JSON object body, after the key check, within the size limit, for this model."""
        from starlette.requests import ClientDisconnect
        self.check_key(request)
        limit = self.max_request_bytes
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > limit:
            raise APIError(413, f"request body of {cl} bytes exceeds the limit of {limit}", code="request_too_large")
        chunks, n = [], 0
        try:
            async for c in request.stream():
                n += len(c)
                if n > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
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
        if m is not None and m != self.name:
            raise APIError(404, f"the model '{m}' does not exist; this server serves '{self.name}'", "model",
                           "model_not_found")
        return body

    def max_tokens(self, requested: int | None, n_prompt: int, default: int | None, prompt_param: str) -> int:
        """The generation budget: `requested` (None: `default`, None: up to the context limit), capped at the
        context left after the prompt of `n_prompt` tokens (a 400 naming `prompt_param` if there is none)."""
        limit = self.model.config.max_position_embeddings
        if n_prompt >= limit:
            raise APIError(400, f"the prompt has {n_prompt} tokens; this model's context is {limit} tokens",
                           prompt_param, "context_length_exceeded")
        mt = requested if requested is not None else default if default is not None else limit - n_prompt
        return max(1, min(mt, limit - n_prompt))

    async def turn(self, messages, *, param: str = "messages", **kwargs) -> ChatTurn:
        """`qwenmetal.chat.chat_turn` on a worker thread (images are decoded there), its errors as 400s
        (`param` names the conversation's field when the template refuses it)."""
        from starlette.concurrency import run_in_threadpool
        try:
            turn = await run_in_threadpool(chat_turn, self.model, messages,
                                           allow_local_images=self.allow_local_images, **kwargs)
        except InputError as e:
            raise bad_input(e) from None
        except ValueError as e:  # a conversation the chat template refuses
            raise APIError(400, str(e), param, "invalid_value") from None
        if turn.images is not None and self.speculative is not None:
            raise APIError(400, "this server decodes speculatively, which does not take images yet", param,
                           "unsupported_value")
        return turn

    def job(self, options: GenerationOptions, ids, cache_points=(), images=None) -> Job:
        """A generation of `ids` with `options`, for `respond`."""
        model = self.model
        return Job(lambda cancel: model.generate(ids, cache_points=cache_points, cancel=cancel, options=options,
                                                 speculative=self.speculative, speculative_k=self.speculative_k,
                                                 images=images),
                   len(ids), lambda cancel: prepare(model, ids, options, cache_points=cache_points, cancel=cancel,
                                                    images=images))

    # ---- responses ------------------------------------------------------------------------------
    async def events(self, request, job: Job, keepalive: bool = False):
        """`job`'s events up to its end. The client is watched the whole time (queued or running): its
        disconnect cancels the job at once, as does leaving this generator early. With `keepalive`, a
        ``("keepalive",)`` event whenever none came for the service's keep-alive interval."""
        queue, wait = self.queue, self.keepalive_seconds if keepalive else None

        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            queue.cancel(job)

        watcher, getter = asyncio.ensure_future(watch()), None
        try:
            while True:
                if wait is None:
                    event = await job.out.get()
                else:                         # one pending get across the waits: no event is lost to a timeout
                    getter = getter or asyncio.ensure_future(job.out.get())
                    done, _ = await asyncio.wait({getter}, timeout=wait)
                    if not done:
                        yield ("keepalive",)
                        continue
                    event, getter = getter.result(), None
                if event[0] == "error":
                    e = event[1]
                    raise e if isinstance(e, APIError) else APIError(
                        500, f"generation failed: {type(e).__name__}: {e}", type="server_error")
                yield event
                if event[0] == "end":
                    return
        finally:
            watcher.cancel()
            if getter is not None:
                getter.cancel()
            queue.cancel(job)

    async def _sse(self, request, job: Job, render: Render):
        try:
            for c in render.start():
                yield c
            async with contextlib.aclosing(self.events(request, job, keepalive=True)) as evs:
                async for kind, *val in evs:
                    # one event-loop turn per event: tokens that arrived together would otherwise be written
                    # in one go, on past a write that found the connection gone (asyncio logs each such
                    # write); in the turn the server learns of the disconnect (later writes are dropped)
                    # and the watcher cancels the job
                    await asyncio.sleep(0)
                    if kind == "out":
                        for c in render.step(val[0]):
                            yield c
                    elif kind == "keepalive":
                        for c in render.keepalive():
                            yield c
                    elif val[0] is not None:
                        for c in render.finish(val[0], val[1]):
                            yield c
        except APIError as e:                 # after the 200 header: an error event ends the stream
            for c in render.error(e):
                yield c
        finally:
            self.queue.cancel(job)

    async def collect(self, request, job: Job):
        """Queue `job` and wait for its end: ``(outputs, finish reason, stats)``, or None if the client left."""
        self.queue.submit(job)
        outs, end = [], None
        async with contextlib.aclosing(self.events(request, job)) as evs:
            async for event in evs:
                if event[0] == "out":
                    outs.append(event[1])
                else:
                    end = event
        _, reason, stats = end
        return None if reason is None else (outs, reason, stats)

    async def respond(self, request, job: Job, render: Render, stream: bool):
        """The one path of every generating endpoint: queue `job`, then stream its events or collect its body."""
        from starlette.responses import JSONResponse, Response, StreamingResponse
        if stream:
            self.queue.submit(job)
            return StreamingResponse(self._sse(request, job, render), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        done = await self.collect(request, job)
        if done is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(render.body(*done))

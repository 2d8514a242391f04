"""OpenAI-compatible HTTP server: ``qwenmetal serve`` (needs the ``server`` extra: starlette + uvicorn).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or server-sent events with
``"stream": true``), ``GET /v1/models``, ``GET /health``. One model per server; generations run one at a
time on a worker thread, in arrival order (a bounded queue; a full queue answers 503). A client that
disconnects cancels its generation (queued or running) and the server goes on serving. Errors are
OpenAI-style: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status. The prefix cache
makes follow-up turns cheap; ``usage.prompt_tokens_details.cached_tokens`` says how many prompt tokens
came from it. Documented in docs/server.md.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import queue
import threading
import time
import uuid

from .chat import chat_turn, validate_messages
from .errors import InputError
from .options import GenerationOptions
from .sampling import SAMPLING_KEYS

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def response(self):
        from starlette.responses import JSONResponse
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


# ---------------------------------------------------------------------------------------------------
# the generation worker
# ---------------------------------------------------------------------------------------------------
class _Job:
    def __init__(self, make, loop):
        self.make = make                      # () -> iterator of GenerationOutput (runs on the worker)
        self.loop = loop
        self.out: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()

    def push(self, item):
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:                  # the event loop is gone (server shutting down)
            self.cancel.set()


class Engine:
    """Runs generations for one model, one at a time, in submission order."""

    def __init__(self, model, max_queue: int = 64):
        self.model = model
        self.max_queue = max_queue
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0
        self.running = False
        self.completed = self.cancelled = self.failed = 0
        self._thread = threading.Thread(target=self._work, name="qwenmetal-generate", daemon=True)
        self._thread.start()

    def submit(self, job: _Job) -> None:
        with self._lock:
            if self.waiting >= self.max_queue:
                raise APIError(503, f"the server is busy ({self.waiting} requests queued); retry later",
                               code="server_busy", type="server_error")
            self.waiting += 1
        self._q.put(job)

    def stop(self) -> None:
        self._q.put(None)

    def _work(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            with self._lock:
                self.waiting -= 1
                self.running = True
            try:
                if job.cancel.is_set():
                    self.cancelled += 1
                    continue
                it = job.make()
                finished = False
                try:
                    for out in it:
                        job.push(("out", out))
                        if out.finish_reason is not None:
                            finished = True
                        if job.cancel.is_set():
                            break
                finally:
                    close = getattr(it, "close", None)
                    if close is not None:
                        close()
                if finished:
                    self.completed += 1
                else:
                    self.cancelled += 1
                job.push(("end", None))
            except Exception as e:  # noqa: BLE001 - reported to the client as a 500
                self.failed += 1
                job.push(("error", e))
            finally:
                with self._lock:
                    self.running = False

    def status(self) -> dict:
        return {"queued": self.waiting, "running": self.running, "completed": self.completed,
                "cancelled": self.cancelled, "failed": self.failed}


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
    return {"prompt_tokens": stats["prompt_tokens"], "completion_tokens": stats["generated_tokens"],
            "total_tokens": stats["prompt_tokens"] + stats["generated_tokens"],
            "prompt_tokens_details": {"cached_tokens": stats["cached_tokens"]}}


def _finish(reason, tool_calls=False):
    if reason == "stop" and tool_calls:
        return "tool_calls"
    return "stop" if reason == "stop" else "length"


def _sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


# ---------------------------------------------------------------------------------------------------
# the app
# ---------------------------------------------------------------------------------------------------
def create_app(model, *, model_name: str | None = None, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, default_max_tokens: int | None = None,
               max_queue: int = 64):
    """The Starlette application serving `model` (a loaded `qm.Model`)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    name = model_name or os.path.basename(os.path.normpath(str(model.path))) or "qwenmetal"
    engine = Engine(model, max_queue=max_queue)
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
        async for c in request.stream():
            n += len(c)
            if n > max_request_bytes:
                raise APIError(413, f"request body exceeds the limit of {max_request_bytes} bytes",
                               code="request_too_large")
            chunks.append(c)
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

    def max_tokens_of(body, n_prompt, key_default):
        mt = _num(body, "max_completion_tokens", 1, None, integer=True)
        if mt is None:
            mt = _num(body, "max_tokens", 1, None, integer=True)
        limit = model.config.max_position_embeddings
        if n_prompt >= limit:
            raise APIError(400, f"the prompt has {n_prompt} tokens; this model's context is {limit} tokens",
                           "messages", "context_length_exceeded")
        if mt is None:
            mt = key_default if key_default is not None else limit - n_prompt
        return max(1, min(mt, limit - n_prompt))

    def logprob_entry(t, lp, top):
        def one(i, v):
            b = tok.token_bytes(i) if tok is not None else b""
            return {"token": b.decode("utf-8", "replace"), "logprob": v, "bytes": list(b)}
        e = one(t, lp)
        e["top_logprobs"] = [one(i, v) for i, v in (top or [])]
        return e

    async def run(request, job, stream_body, collect):
        """Submit `job`; stream with `stream_body(job)` or wait and `collect(outputs)`."""
        engine.submit(job)
        if stream_body is not None:
            return StreamingResponse(stream_body(job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        outs = []
        try:
            while True:
                try:
                    kind, val = await asyncio.wait_for(job.out.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return JSONResponse({}, status_code=499)
                    continue
                if kind == "out":
                    outs.append(val)
                elif kind == "error":
                    raise APIError(500, f"generation failed: {type(val).__name__}: {val}", type="server_error")
                else:
                    break
        finally:
            job.cancel.set()                  # no-op once finished; stops it if we leave early
        if not outs or outs[-1].finish_reason is None:
            raise APIError(500, "generation ended without a result", type="server_error")
        return JSONResponse(collect(outs))

    def make_job(gen_kwargs, ids, cache_points=()):
        loop = asyncio.get_running_loop()
        holder = {}

        def make():
            return model.generate(ids, cache_points=cache_points, cancel=holder["job"].cancel, **gen_kwargs)

        job = _Job(make, loop)
        holder["job"] = job
        return job

    def gen_kwargs_of(body, n_prompt, default_max):
        return {"options": _options(body, max_tokens_of(body, n_prompt, default_max))}

    # ---- endpoints ------------------------------------------------------------------------------
    async def health(request):
        return JSONResponse({"status": "ok", "model": name, **engine.status()})

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
                                           template_kwargs=ctk)
        except InputError as e:
            raise _bad_input(e) from None
        except Exception as e:  # template errors (jinja2 TemplateError and friends)
            raise APIError(400, f"cannot render the conversation with the chat template: {e}", "messages",
                           "invalid_value") from None
        kw = gen_kwargs_of(body, len(turn.prompt_ids), default_max_tokens)
        kw.update(logprobs=want_lp, top_logprobs=top_n)
        job = make_job(kw, turn.prompt_ids, turn.cache_points)
        cid, now = "chatcmpl-" + uuid.uuid4().hex, int(time.time())

        def chunk(delta, finish=None, lp=None):
            return {"id": cid, "object": "chat.completion.chunk", "created": now, "model": name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

        async def stream_body(job):
            parser = turn.stream_parser()
            msg, tokens = {"role": "assistant", "content": ""}, []     # the message as the client rebuilds it
            try:
                yield _sse(chunk({"role": "assistant", "content": ""}))
                while True:
                    kind, val = await job.out.get()
                    if kind == "error":
                        yield _sse({"error": {"message": f"generation failed: {val}", "type": "server_error",
                                              "param": None, "code": None}})
                        break
                    if kind == "end":
                        break
                    out = val
                    lp = {"content": [logprob_entry(out.token, out.logprob, out.top_logprobs)]} \
                        if want_lp and out.logprob is not None else None
                    deltas = parser.feed(out.text)
                    calls = []
                    if out.finish_reason is not None:
                        more, calls = parser.finish()
                        deltas += more
                    tokens.append(out.token)
                    for i, (f, t) in enumerate(deltas):
                        msg[f] = msg.get(f, "") + t
                        yield _sse(chunk({f: t}, lp=lp if i == 0 else None))
                    if not deltas and lp is not None:
                        yield _sse(chunk({}, lp=lp))
                    if out.finish_reason is not None:
                        if calls:
                            msg["tool_calls"] = [
                                {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                                for c in calls]
                            yield _sse(chunk({"tool_calls": [dict(c, index=k) for k, c in enumerate(msg["tool_calls"])]}))
                        turn.remember(model, msg, tokens)
                        yield _sse(chunk({}, _finish(out.finish_reason, bool(calls))))
                        if include_usage:
                            yield _sse({"id": cid, "object": "chat.completion.chunk", "created": now, "model": name,
                                        "choices": [], "usage": _usage(out.stats)})
                        yield "data: [DONE]\n\n"
            finally:
                job.cancel.set()

        def collect(outs):
            last = outs[-1]
            full = "".join(o.text for o in outs)
            reasoning, content, calls = turn.parse(full)
            msg = {"role": "assistant", "content": content}
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
            if calls:
                msg["tool_calls"] = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                                      "function": {"name": c["name"],
                                                   "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                                     for c in calls]
            turn.remember(model, msg, [o.token for o in outs])
            lp = {"content": [logprob_entry(o.token, o.logprob, o.top_logprobs) for o in outs]} if want_lp else None
            return {"id": cid, "object": "chat.completion", "created": now, "model": name,
                    "choices": [{"index": 0, "message": msg, "logprobs": lp,
                                 "finish_reason": _finish(last.finish_reason, bool(calls))}],
                    "usage": _usage(last.stats)}

        return await run(request, job, stream_body if stream else None, collect)

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
        kw = gen_kwargs_of(body, len(ids), 16)
        kw.update(logprobs=n_lp is not None, top_logprobs=n_lp or 0)
        job = make_job(kw, ids)
        cid, now = "cmpl-" + uuid.uuid4().hex, int(time.time())
        prompt_text = (p if isinstance(p, str) else tok.decode(ids)) if echo and tok is not None else ""

        def lp_of(outs):
            if n_lp is None:
                return None
            toks, lps, tops, offs = [], [], [], []
            off = len(prompt_text)
            for o in outs:
                b = tok.token_bytes(o.token) if tok is not None else b""
                toks.append(b.decode("utf-8", "replace"))
                lps.append(o.logprob)
                tops.append({(tok.token_bytes(i).decode("utf-8", "replace") if tok is not None else str(i)): v
                             for i, v in (o.top_logprobs or [])})
                offs.append(off)
                off += len(o.text)
            return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

        def chunk(text, finish=None, lp=None):
            return {"id": cid, "object": "text_completion", "created": now, "model": name,
                    "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]}

        async def stream_body(job):
            try:
                if prompt_text:
                    yield _sse(chunk(prompt_text))
                while True:
                    kind, val = await job.out.get()
                    if kind == "error":
                        yield _sse({"error": {"message": f"generation failed: {val}", "type": "server_error",
                                              "param": None, "code": None}})
                        break
                    if kind == "end":
                        break
                    out = val
                    fin = None if out.finish_reason is None else _finish(out.finish_reason)
                    if out.text or fin or n_lp is not None:
                        yield _sse(chunk(out.text, fin, lp_of([out])))
                    if fin is not None:
                        if include_usage:
                            yield _sse({"id": cid, "object": "text_completion", "created": now, "model": name,
                                        "choices": [], "usage": _usage(out.stats)})
                        yield "data: [DONE]\n\n"
            finally:
                job.cancel.set()

        def collect(outs):
            last = outs[-1]
            return {"id": cid, "object": "text_completion", "created": now, "model": name,
                    "choices": [{"index": 0, "text": prompt_text + "".join(o.text for o in outs),
                                 "logprobs": lp_of(outs), "finish_reason": _finish(last.finish_reason)}],
                    "usage": _usage(last.stats)}

        return await run(request, job, stream_body if stream else None, collect)

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
        engine.stop()

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error})
    app.state.engine = engine
    app.state.model_name = name
    return app


def serve(model, host: str = "127.0.0.1", port: int = 8000, *, model_name: str | None = None,
          api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
          default_max_tokens: int | None = None, max_queue: int = 64, log_level: str = "info") -> None:
    """Serve `model` with uvicorn until interrupted."""
    import uvicorn

    app = create_app(model, model_name=model_name, api_key=api_key, max_request_bytes=max_request_bytes,
                     default_max_tokens=default_max_tokens, max_queue=max_queue)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)

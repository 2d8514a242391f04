"""OpenAI-compatible HTTP server: ``qwenmetal serve`` (needs the ``server`` extra: starlette + uvicorn).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or server-sent events with
``"stream": true``), ``POST /v1/responses`` (OpenAI Responses, `qwenmetal.api_responses`), ``POST
/v1/messages`` (Anthropic Messages, `qwenmetal.api_anthropic`), ``GET /v1/models``, ``GET /health``. One
model per server, one `qwenmetal.serving.Service`: its queue runs generations on a worker thread, in arrival
order, batched with ``parallel`` > 1; a client that disconnects cancels its generation within one decode
step. Every generating endpoint goes through one submit/stream/collect path (`Service.respond`, with a
`Render` per endpoint). Errors are OpenAI-style, ``{"error": {"message", "type", "param", "code"}}``, except
on the Anthropic routes, which use Anthropic's shape. The prefix cache makes follow-up turns cheap;
``usage.prompt_tokens_details.cached_tokens`` says how many prompt tokens came from it. Documented in
docs/server.md.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
import uuid

from . import api_anthropic, api_responses
from .batching import DEFAULT_STEP_TOKENS
from .serving import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_GRACEFUL_TIMEOUT,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_REQUEST_TIMEOUT,
    KEEPALIVE_SECONDS,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    SHUTDOWN_JOIN_SECONDS,
    THINKING_BUDGET,
    APIError,
    GenerationQueue,
    Render,
    Service,
    boolean,
    check_n,
    messages_of,
    num,
    options_of,
    sse,
)

__all__ = ["APIError", "GenerationQueue", "MAX_STOP_STRINGS", "create_app", "serve", "uvicorn_server",
           "DEFAULT_CHAT_MAX_TOKENS", "DEFAULT_GRACEFUL_TIMEOUT", "DEFAULT_MAX_QUEUE", "DEFAULT_MAX_REQUEST_BYTES",
           "DEFAULT_REQUEST_TIMEOUT", "DEFAULT_STEP_TOKENS"]


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


def _token_str(tok, i: int) -> str:
    return tok.token_bytes(i).decode("utf-8", "replace") if tok is not None else str(i)


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _tool_calls(calls) -> list:
    return [{"id": _call_id(), "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in calls]


class _OpenAIRender(Render):
    """An OpenAI endpoint's chunks and body: ``finish`` adds the usage chunk (with ``include_usage``) and
    ``data: [DONE]``."""

    chunk_object = ""

    def __init__(self, id_prefix: str, model_name: str, include_usage: bool = False):
        self.id, self.created, self.model = id_prefix + uuid.uuid4().hex, int(time.time()), model_name
        self.include_usage = include_usage

    def envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def first_chunks(self) -> list:
        return []

    def start(self) -> list:
        return [sse(c) for c in self.first_chunks()]

    def step(self, out) -> list:
        return [sse(c) for c in self.step_chunks(out)]

    def finish(self, reason, stats) -> list:
        out = [sse(c) for c in self.last_chunks(reason)]
        if self.include_usage:
            out.append(sse(self.envelope(self.chunk_object, [], usage=_usage(stats))))
        return out + ["data: [DONE]\n\n"]


class _ChatRender(_OpenAIRender):
    chunk_object = "chat.completion.chunk"

    def __init__(self, model_name, tok, turn, logprobs: bool, lm=None, include_usage: bool = False):
        super().__init__("chatcmpl-", model_name, include_usage)
        self.tok, self.turn, self.logprobs = tok, turn, logprobs     # turn: chat.chat_turn's result
        self.parser = turn.stream_parser()
        self.lm = lm                          # the qm.Model, which keeps the reply's transcript
        self.msg, self.tokens = {"role": "assistant", "content": ""}, []   # the reply as the client rebuilds it

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

    def first_chunks(self) -> list:
        return [self.chunk({"role": "assistant", "content": ""})]

    def step_chunks(self, out) -> list:
        lp = {"content": [self.entry(out)]} if self.logprobs and out.logprob is not None else None
        self.tokens.append(out.token)
        chunks = self.event_chunks(self.parser.feed(out.text))
        if chunks and lp is not None:
            chunks[0]["choices"][0]["logprobs"] = lp
        elif lp is not None:
            chunks.append(self.chunk({}, lp=lp))
        return chunks

    def event_chunks(self, events) -> list:
        """The chunks of the stream parser's events (`qwenmetal.chat.ChatStreamParser`), the reply kept as
        the client rebuilds it: text deltas, and each tool call as a first delta with its id and name, then
        argument deltas."""
        chunks = []
        for e in events:
            if e[0] in ("reasoning", "content"):
                f = "reasoning_content" if e[0] == "reasoning" else "content"
                self.msg[f] = self.msg.get(f, "") + e[1]
                chunks.append(self.chunk({f: e[1]}))
            elif e[0] == "tool_call":
                cid = _call_id()
                self.msg.setdefault("tool_calls", []).append(
                    {"id": cid, "type": "function", "function": {"name": e[2], "arguments": ""}})
                chunks.append(self.chunk({"tool_calls": [{"index": e[1], "id": cid, "type": "function",
                                                          "function": {"name": e[2], "arguments": ""}}]}))
            elif e[0] == "tool_args":
                self.msg["tool_calls"][e[1]]["function"]["arguments"] += e[2]
                chunks.append(self.chunk({"tool_calls": [{"index": e[1], "function": {"arguments": e[2]}}]}))
        return chunks

    def last_chunks(self, reason) -> list:
        chunks = self.event_chunks(self.parser.finish())
        self.turn.remember(self.lm, self.msg, self.tokens)
        return chunks + [self.chunk({}, _finish(reason, bool(self.msg.get("tool_calls"))))]

    def body(self, outs, reason, stats) -> dict:
        reasoning, content, calls = self.turn.parse("".join(o.text for o in outs))
        msg = {"role": "assistant", "content": content}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = _tool_calls(calls)
        self.turn.remember(self.lm, msg, [o.token for o in outs])
        lp = {"content": [self.entry(o) for o in outs]} if self.logprobs else None
        return self.envelope("chat.completion", [{"index": 0, "message": msg, "logprobs": lp,
                                                  "finish_reason": _finish(reason, bool(calls))}], usage=_usage(stats))


class _CompletionRender(_OpenAIRender):
    chunk_object = "text_completion"

    def __init__(self, model_name, tok, prompt_text: str, n_logprobs: int | None, include_usage: bool = False):
        super().__init__("cmpl-", model_name, include_usage)
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

    def first_chunks(self) -> list:
        return [self.chunk(self.prompt_text)] if self.prompt_text else []

    def step_chunks(self, out) -> list:
        if not out.text and self.n_lp is None:
            return []
        c = self.chunk(out.text, lp=self.logprobs_of([out], self.offset))
        self.offset += len(out.text)
        return [c]

    def last_chunks(self, reason) -> list:
        return [self.chunk("", _finish(reason))]

    def body(self, outs, reason, stats) -> dict:
        return self.envelope("text_completion", [{
            "index": 0, "text": self.prompt_text + "".join(o.text for o in outs),
            "logprobs": self.logprobs_of(outs, len(self.prompt_text)), "finish_reason": _finish(reason)}],
            usage=_usage(stats))


# ---------------------------------------------------------------------------------------------------
# the app
# ---------------------------------------------------------------------------------------------------
def create_app(model, *, model_name: str | None = None, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               default_max_tokens: int | None = DEFAULT_CHAT_MAX_TOKENS, max_queue: int = DEFAULT_MAX_QUEUE,
               request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT, speculative=None,
               speculative_k: int | None = None, parallel: int = 1, step_tokens: int = DEFAULT_STEP_TOKENS,
               allow_local_images: bool = False, keepalive_seconds: float | None = KEEPALIVE_SECONDS):
    """The Starlette application serving `model` (a loaded `qm.Model`). `default_max_tokens`: the budget
    of a chat request that sets no ``max_tokens`` (None: up to the context limit); `max_queue`: how many
    requests may wait; `request_timeout`: seconds a generation may run (None: no limit); `speculative` /
    `speculative_k`: every generation decodes speculatively (`Model.generate`'s arguments; the output is
    unchanged; single-stream, so `parallel` must be 1); `parallel`: how many generations run at once,
    batched (`qwenmetal.batching`), with at most `step_tokens` prompt tokens prefilled per step;
    `allow_local_images`: chat messages may name image files on this machine (a ``file://`` URL or a path;
    otherwise only ``data:`` URLs are taken, and nothing is ever fetched); `keepalive_seconds`: a stream silent
    this long (a long prefill) gets a keep-alive event (Anthropic's ``ping``, an SSE comment elsewhere; None:
    never). See docs/server.md."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    name = model_name or os.path.basename(os.path.normpath(str(model.path))) or "qwenmetal"
    svc = Service(model, name=name, api_key=api_key, max_request_bytes=max_request_bytes,
                  default_max_tokens=default_max_tokens, max_queue=max_queue, request_timeout=request_timeout,
                  speculative=speculative, speculative_k=speculative_k, parallel=parallel,
                  step_tokens=step_tokens, allow_local_images=allow_local_images,
                  keepalive_seconds=keepalive_seconds)
    queue, tok = svc.queue, svc.tok

    def max_tokens_of(body, n_prompt, default, prompt_param):
        mt = num(body, "max_completion_tokens", 1, None, integer=True)
        if mt is None:
            mt = num(body, "max_tokens", 1, None, integer=True)
        return svc.max_tokens(mt, n_prompt, default, prompt_param)

    # ---- endpoints ------------------------------------------------------------------------------
    async def health(request):
        return JSONResponse({"status": "ok", "model": name, **queue.status()})

    async def models(request):
        """The one model, in a list both OpenAI's and Anthropic's clients read (Anthropic's fields: type,
        display_name, created_at, has_more, first_id, last_id)."""
        svc.check_key(request)
        created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(svc.created))
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": svc.created, "owned_by": "qwenmetal",
             "max_model_len": model.config.max_position_embeddings, "type": "model", "display_name": name,
             "created_at": created_at}], "has_more": False, "first_id": name, "last_id": name})

    async def chat_completions(request):
        body = await svc.read_json(request)
        if tok is None:
            raise APIError(400, "this checkpoint has no tokenizer; use /v1/completions with token ids")
        msgs = messages_of(body)
        check_n(body)
        stream = boolean(body, "stream")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) if stream else False
        want_lp = boolean(body, "logprobs")
        top_n = num(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True, default=0)
        if top_n and not want_lp:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
        tools = body.get("tools")
        tool_choice = body.get("tool_choice")
        if tool_choice == "none":
            tools = None
        ctk = body.get("chat_template_kwargs") or {}
        if not isinstance(ctk, dict):
            raise APIError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs", "invalid_value")
        ctk = dict(ctk)
        enable_thinking = ctk.pop("enable_thinking", None)
        if "enable_thinking" in body:
            enable_thinking = boolean(body, "enable_thinking", None)
        turn = await svc.turn(msgs, tools=tools, enable_thinking=enable_thinking, template_kwargs=ctk,
                              tool_choice=None if tool_choice == "none" else tool_choice,
                              response_format=body.get("response_format"),
                              parallel_tool_calls=boolean(body, "parallel_tool_calls", True))
        opts = options_of(body, max_tokens_of(body, len(turn.prompt_ids), svc.default_max_tokens, "messages"),
                          THINKING_BUDGET, logprobs=want_lp, top_logprobs=top_n, grammar=turn.grammar)
        render = _ChatRender(name, tok, turn, want_lp, model, include_usage)
        return await svc.respond(request, svc.job(opts, turn.prompt_ids, turn.cache_points, turn.images), render,
                                 stream)

    async def completions(request):
        body = await svc.read_json(request)
        check_n(body)
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
        stream = boolean(body, "stream")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) if stream else False
        echo = boolean(body, "echo")
        n_lp = body.get("logprobs")
        n_lp = None if n_lp is None else num(body, "logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
        opts = options_of(body, max_tokens_of(body, len(ids), 16, "prompt"), THINKING_BUDGET,
                          logprobs=n_lp is not None, top_logprobs=n_lp or 0)
        prompt_text = (p if isinstance(p, str) else tok.decode(ids)) if echo and tok is not None else ""
        return await svc.respond(request, svc.job(opts, ids), _CompletionRender(name, tok, prompt_text, n_lp,
                                                                                include_usage), stream)

    def error(request, e: APIError):
        """`e` in the shape of the API the request went to."""
        if api_anthropic.is_anthropic_path(request.url.path):
            return api_anthropic.error_response(e)
        return e.response()

    async def api_error(request, exc: APIError):
        return error(request, exc)

    async def http_error(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error(request, APIError(exc.status_code, str(exc.detail), code=code))

    async def server_error(request, exc: Exception):
        return error(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    routes = [Route("/health", health, methods=["GET"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"])]
    routes += api_anthropic.routes(svc)
    routes += api_responses.routes(svc)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        queue.close()                         # waiting requests get 503 shutting_down
        await run_in_threadpool(queue.join, SHUTDOWN_JOIN_SECONDS)

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error})
    app.state.queue = queue
    app.state.model_name = name
    app.state.service = svc
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

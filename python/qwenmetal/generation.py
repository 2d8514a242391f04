"""Text generation on top of the two primitive calls (``Model.prefill`` / ``Model.decode_step``).

``generate()`` here is what ``Model.generate`` runs: prefix-cache lookup, chunked prefill with snapshots,
sampling, streaming detokenization, stop conditions and statistics. ``ChatResponse`` and
:func:`parse_assistant` turn a chat reply into reasoning, content and tool calls (Qwen3.5/3.6 format).
"""
from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .sampling import SampleResult

FINISH_REASONS = ("stop", "length", "context")


@dataclass
class GenerationOutput:
    """One generated token. The last output of a generation has `finish_reason` and `stats`."""

    token: int
    text: str                     # the new text (may be "" mid-character, while a stop string may be starting,
    #                               or for a special/stop token)
    index: int
    finish_reason: str | None = None      # "stop" (eos / stop token / stop string), "length" (max_tokens),
    #                                       or "context" (the session is full)
    stats: dict | None = None
    logprob: float | None = None          # log-probability of `token` (with logprobs=True)
    top_logprobs: list | None = None      # [(id, logprob)] alternatives (with top_logprobs=N)
    stop: str | int | None = None         # the stop string or stop id that ended the generation

    def __repr__(self) -> str:
        extra = "" if self.finish_reason is None else f", finish_reason={self.finish_reason!r}"
        lp = "" if self.logprob is None else f", logprob={self.logprob:.3f}"
        return f"GenerationOutput(token={self.token}, text={self.text!r}, index={self.index}{lp}{extra})"


class StopStringMatcher:
    """Finds stop strings in streamed text, across token boundaries, without emitting them.

    The generation stops at the first point where a stop string is complete (the earliest end; of two
    ending there, the longer), so the result does not depend on how the text is split into tokens.

    ``push(delta)`` returns ``(text_to_emit, matched_stop_or_None)``. Text that could be the beginning of a
    stop string is held back until it is decided; ``flush()`` releases it at the end.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._pending = ""

    def push(self, delta: str):
        if not self.stops:
            return delta, None
        self._pending += delta
        best = None                      # the match that ends first (then: the one that starts first)
        for s in self.stops:
            i = self._pending.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
                best = (i, s)
        if best is not None:
            out = self._pending[:best[0]]
            self._pending = ""
            return out, best[1]
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self._pending)), hold, -1):
                if self._pending.endswith(s[:k]):
                    hold = k
                    break
        out = self._pending[:len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold:]
        return out, None

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


def _progress_bar(total: int, enabled: bool | None):
    if enabled is False or (enabled is None and total < 4096):
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, unit="tok", desc="prefill", leave=False)


def generate(model, prompt, *, max_tokens: int = 256, sampler=None, temperature=None, top_k=None, top_p=None,
             min_p=None, repetition_penalty=None, presence_penalty=None, frequency_penalty=None, seed=None,
             stop=None, stop_token_ids=None, ignore_eos: bool = False, logprobs: bool = False,
             top_logprobs: int = 0, session=None, cache: bool = True, cache_points: Sequence[int] = (),
             skip_special_tokens: bool = True, progress: bool | None = None,
             cancel: threading.Event | None = None) -> Iterator[GenerationOutput]:
    from .sampling import Sampler

    tok = model.tokenizer
    if isinstance(prompt, str):
        if tok is None:
            raise ValueError(f"{model.path}: no tokenizer.json, so prompts must be token ids")
        ids = tok.encode(prompt)
    else:
        ids = [int(i) for i in prompt] if not isinstance(prompt, np.ndarray) else prompt.tolist()
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if isinstance(stop, str):
        stop = [stop]
    stop = [s for s in (stop or [])]
    if not all(isinstance(s, str) for s in stop):
        raise ValueError("stop must be a string or a list of strings")
    if any(s == "" for s in stop):
        raise ValueError("stop strings must be non-empty (an empty one would stop before any text)")
    if stop and tok is None:
        raise ValueError("stop strings need a tokenizer")
    top_logprobs = int(top_logprobs or 0)
    if top_logprobs < 0:
        raise ValueError("top_logprobs must be >= 0")
    knobs = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                 repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                 frequency_penalty=frequency_penalty, seed=seed)
    if sampler is not None:
        given = sorted(k for k, v in knobs.items() if v is not None)
        if given:
            raise ValueError(f"pass either a sampler or sampling options, not both (got sampler and {', '.join(given)})")
    if sampler is None:
        sampler = Sampler.from_generation_config(
            model.generation_config, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, seed=seed)
    s = session if session is not None else model.new_session()
    model._check_session(s)
    model._check_ids(ids, s)                       # validates ids and the context limit, before any work
    vocab_used = tok.vocab_size if tok is not None else model.config.vocab_size
    vocab_used = min(vocab_used, model.config.vocab_size)
    stop_ids = set() if ignore_eos else set(model.eos_token_ids)
    stop_ids |= {int(t) for t in (stop_token_ids or ())}
    pc = model.prefix_cache if cache else None
    return _run(model, s, ids, max_tokens, sampler, stop, stop_ids, logprobs, top_logprobs, pc, cache_points,
                skip_special_tokens, progress, cancel, vocab_used)


def _run(model, s, ids, max_tokens, sampler, stop, stop_ids, want_logprobs, top_n, pc, cache_points,
         skip_special_tokens, progress, cancel, vocab_used):
    tok = model.tokenizer
    t0 = time.perf_counter()
    base = s.position
    n_prompt = len(ids)
    cached = 0
    logits = None
    if pc is not None and base == 0:
        e = pc.lookup(ids)
        if e is not None:
            s.restore(e.snapshot)
            cached = len(e.tokens)
            if cached == n_prompt:
                logits = e.logits
    # chunked prefill of the rest, snapshotting at chunk boundaries and at the requested points
    chunk = pc.chunk_tokens if pc is not None else 2048
    points = sorted({base + int(p) for p in cache_points if 0 < int(p) < n_prompt})
    bar = _progress_bar(n_prompt - cached, progress) if logits is None else None
    try:
        while logits is None:
            if cancel is not None and cancel.is_set():
                return
            pos = s.position
            end = base + n_prompt
            nxt = min(end, (pos // chunk + 1) * chunk)
            for p in points:
                if pos < p < nxt:
                    nxt = p
                    break
            last = nxt == end
            out = model.prefill(s, ids[pos - base:nxt - base], return_logits="last" if last else "none")
            if bar is not None:
                bar.update(nxt - pos)
            if last:
                logits = out
            elif pc is not None and s.nbytes <= pc.max_bytes:
                if nxt in points:
                    pc.put(s.tokens, s.snapshot(), kind="point")
                elif _keep_boundary(nxt // chunk, (end - 1) // chunk):
                    pc.put(s.tokens, s.snapshot(), kind="chunk")
    finally:
        if bar is not None:
            bar.close()
    if pc is not None and cached < n_prompt and s.nbytes <= pc.max_bytes:
        pc.put(s.tokens, s.snapshot(), logits=logits, kind="prompt")
    t1 = time.perf_counter()

    decoder = tok.stream_decoder(skip_special_tokens) if tok is not None else None
    matcher = StopStringMatcher(stop)
    generated: list = []
    context = list(s.tokens)
    gpu = _GpuDecode(model, s, sampler, stop_ids, vocab_used, max_tokens) \
        if _gpu_decodable(model, sampler, stop, want_logprobs, top_n) else None
    for n in range(max_tokens):
        if cancel is not None and cancel.is_set():
            return
        if gpu is not None and n > 0:     # sampled on the GPU by the pipelined decode loop
            r = SampleResult(gpu.next(n), None, None)
        else:
            r = sampler.sample(logits, vocab_used, context=context, generated=generated, logprobs=want_logprobs,
                               top_logprobs=top_n)
        t = r.token
        generated.append(t)
        context.append(t)
        reason = hit = None
        if t in stop_ids:
            reason, hit, text = "stop", t, ""
            if decoder is not None:
                text, _ = matcher.push(decoder.flush())
                text += matcher.flush()
        else:
            delta = decoder.add(t) if decoder is not None else ""
            text, hit = matcher.push(delta)
            if hit is not None:
                reason = "stop"
        if reason is None:
            if n + 1 == max_tokens:
                reason = "length"
            elif s.position + 1 > s.max_context:
                reason = "context"
            if reason is not None and decoder is not None:
                more, hit = matcher.push(decoder.flush())
                text += more + ("" if hit is not None else matcher.flush())
        lp, top = r.logprob, r.top_logprobs
        if reason is None:
            if gpu is not None:
                gpu.feed(t)               # the GPU loop consumes t as its next input
            else:
                logits = model.decode_step(s, t)
            yield GenerationOutput(t, text, n, logprob=lp, top_logprobs=top)
            continue
        t2 = time.perf_counter()
        if gpu is not None:
            logits = None                 # the GPU path reads no logits back: the turn is kept without them
        if pc is not None and len(generated) > 1 and s.nbytes <= pc.max_bytes:
            pc.put(s.tokens, s.snapshot(), logits=logits, kind="turn")
        yield GenerationOutput(t, text, n, reason, _stats(n_prompt, cached, len(generated), t0, t1, t2, reason),
                               lp, top, hit)
        return


def _gpu_decodable(model, sampler, stop, want_logprobs, top_n) -> bool:
    """Whether the backend's pipelined GPU decode loop can generate for these options: a Metal backend, and
    nothing the GPU does not do (penalties, logprobs) or that is decided on text (stop strings: the loop
    runs ahead of the text by up to a chunk)."""
    return (hasattr(model._backend, "decode") and not want_logprobs and not top_n and not stop
            and sampler.repetition_penalty == 1.0 and not sampler.presence_penalty
            and not sampler.frequency_penalty)


class _GpuDecode:
    """Tokens from the backend's pipelined decode loop (one command buffer per token, two in flight, GPU
    sampling), CHUNK at a time; the session's tokens follow the state after every call. Seeded sampling
    reproduces on the same backend (the GPU's RNG is Philox keyed by (seed, position), not the host
    Sampler's stream); greedy decoding is the host path's."""

    CHUNK = 32

    def __init__(self, model, s, sampler, stop_ids, vocab_used, max_tokens):
        self.be, self.s, self.sampler = model._backend, s, sampler
        self.stop_ids, self.vocab = [int(t) for t in stop_ids], int(vocab_used or 0)
        self.max_tokens = max_tokens
        seed = sampler.seed if sampler.seed is not None else int(sampler.rng.integers(0, 2**63 - 1))
        self.seed = int(seed)
        self.pending: list = []
        self.fed = None

    def feed(self, t: int) -> None:
        self.fed = int(t)

    def next(self, n: int) -> int:
        if not self.pending:
            s, sp = self.s, self.sampler
            budget = min(self.CHUNK, self.max_tokens - n, s.max_context - s.position)
            # the session's tokens follow the state inside the call (an interrupt cannot separate them)
            out = self.be.decode(s._state, self.fed, budget, temperature=sp.temperature, top_k=sp.top_k,
                                 top_p=sp.top_p, min_p=sp.min_p, seed=self.seed, stop_ids=self.stop_ids,
                                 vocab=self.vocab, consumed=s._tokens)
            self.pending = [int(t) for t in out]
        return self.pending.pop(0)


def _keep_boundary(k: int, last_k: int) -> bool:
    """Snapshot the k-th chunk boundary of a prompt whose last boundary is `last_k`? The boundaries at
    powers of two (chunk, 2 chunks, 4, 8, ...) and the last two: O(log n) snapshots per prompt, so the
    copying stays linear in the prompt length, yet a prompt that diverges from a cached one late
    resumes within two chunks of the divergence and one that diverges early from a power-of-two
    boundary."""
    return k >= last_k - 1 or (k & (k - 1)) == 0


def _stats(n_prompt, cached, n_gen, t0, t1, t2, reason) -> dict:
    computed = n_prompt - cached
    decode_steps = max(n_gen - 1, 0)
    return {"prompt_tokens": n_prompt, "cached_tokens": cached, "prefill_tokens": computed,
            "generated_tokens": n_gen, "finish_reason": reason,
            "prefill_seconds": t1 - t0, "decode_seconds": t2 - t1,
            "prefill_tokens_per_second": computed / max(t1 - t0, 1e-9) if computed else float("nan"),
            "decode_tokens_per_second": decode_steps / (t2 - t1) if decode_steps and t2 > t1 else float("nan"),
            "time_to_first_token": t1 - t0}


# ---------------------------------------------------------------------------------------------------
# chat replies
# ---------------------------------------------------------------------------------------------------
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|$)", re.S)


def _param_types(tools, name) -> dict:
    for t in tools or ():
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k: (v or {}).get("type") for k, v in props.items() if isinstance(v, dict)}
    return {}


def parse_tool_calls(text: str, tools=None) -> list:
    """Tool calls in Qwen3.5/3.6's XML format (``<tool_call><function=NAME><parameter=ARG>VALUE``...) as
    ``[{"name": ..., "arguments": {...}}]``. Values are JSON-decoded unless the tool's schema says
    ``string`` (or they are not valid JSON)."""
    calls = []
    for block in _TOOL_CALL.findall(text):
        for name, body in _FUNCTION.findall(block):
            types = _param_types(tools, name.strip())
            args = {}
            for key, value in _PARAM.findall(body):
                key = key.strip()
                if types.get(key) == "string":
                    args[key] = value
                    continue
                try:
                    args[key] = json.loads(value)
                except (json.JSONDecodeError, ValueError):
                    args[key] = value
            calls.append({"name": name.strip(), "arguments": args})
    return calls


def parse_assistant(text: str, *, thinking: bool = False, tools=None) -> tuple:
    """Split a generated reply into ``(reasoning, content, tool_calls)``. ``thinking``: the prompt ended
    inside a ``<think>`` block (Qwen3.5/3.6 with thinking on), so the reply starts with reasoning."""
    reasoning = None
    content = text
    if "</think>" in text:
        r, _, content = text.partition("</think>")
        reasoning = r.split("<think>", 1)[-1].strip()
    elif thinking:
        reasoning, content = text.strip(), ""
    calls = parse_tool_calls(content, tools) if "<tool_call>" in content else []
    if calls:
        content = content.split("<tool_call>", 1)[0]
    return reasoning, content.strip(), calls


def prompt_opens_thinking(prompt_text: str) -> bool:
    """The rendered prompt leaves the model inside a think block (it ends with an unclosed ``<think>``)."""
    i = prompt_text.rfind("<think>")
    return i >= 0 and "</think>" not in prompt_text[i:]


@dataclass
class ChatResponse:
    """The reply of :meth:`Model.chat`: ``content`` (the answer), ``reasoning`` (the think block, if any),
    ``tool_calls`` (``[{"name", "arguments"}]``), ``text`` (everything generated), ``finish_reason``,
    ``stats``, ``tokens`` and ``message`` (an assistant message to append to the conversation)."""

    text: str
    content: str
    reasoning: str | None
    tool_calls: list
    finish_reason: str
    stats: dict
    tokens: list = field(repr=False)
    logprobs: list | None = field(default=None, repr=False)

    @property
    def message(self) -> dict:
        m = {"role": "assistant", "content": self.content}
        if self.reasoning:
            m["reasoning_content"] = self.reasoning
        if self.tool_calls:
            m["tool_calls"] = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                               for c in self.tool_calls]
        return m

    def __str__(self) -> str:
        return self.content

    def _repr_markdown_(self) -> str:
        parts = []
        if self.reasoning:
            parts.append("> " + self.reasoning.replace("\n", "\n> "))
        parts.append(self.content)
        for c in self.tool_calls:
            parts.append(f"`{c['name']}({json.dumps(c['arguments'], ensure_ascii=False)})`")
        s = self.stats
        parts.append(f"<small>{s['prompt_tokens']} prompt tokens ({s['cached_tokens']} cached), "
                     f"{s['generated_tokens']} generated, finish: {self.finish_reason}</small>")
        return "\n\n".join(parts)


class ChatStreamParser:
    """Splits streamed reply text into reasoning and content deltas, and collects tool calls.

    ``feed(text)`` returns ``[(field, text), ...]`` with field ``"reasoning_content"`` or ``"content"``;
    text that may be the start of ``</think>`` or ``<tool_call>`` is held until decided. From the first
    ``<tool_call>`` on, text is kept back and parsed by ``finish()``, which returns
    ``(remaining deltas, tool_calls)``.
    """

    def __init__(self, thinking: bool = False, tools=None, parse_tools: bool = True):
        self.mode = "reasoning" if thinking else "content"
        self.tools = tools
        self.parse_tools = parse_tools
        self._buf = ""
        self._tool_text = None
        self._content_started = False

    def _emit(self, field_, text, out):
        if not text:
            return
        if field_ == "content" and not self._content_started:
            text = text.lstrip("\n")              # the "\n\n" after </think>
            if not text:
                return
            self._content_started = True
        out.append((field_, text))

    def feed(self, text: str) -> list:
        out: list = []
        if self._tool_text is not None:
            self._tool_text += text
            return out
        self._buf += text
        while True:
            if self.mode == "reasoning":
                if self._buf.startswith("<think>"):
                    self._buf = self._buf[len("<think>"):]
                i = self._buf.find("</think>")
                if i >= 0:
                    self._emit("reasoning_content", self._buf[:i], out)
                    self._buf = self._buf[i + len("</think>"):]
                    self.mode = "content"
                    continue
                keep = _partial_suffix(self._buf, ("</think>", "<think>"))
                self._emit("reasoning_content", self._buf[:len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            tags = ("<tool_call>", "<think>") if self.parse_tools else ("<think>",)
            if self._buf.startswith("<think>") and not self._content_started:
                self.mode = "reasoning"
                continue
            i = self._buf.find("<tool_call>") if self.parse_tools else -1
            if i >= 0:
                self._emit("content", self._buf[:i].rstrip(), out)
                self._tool_text = self._buf[i:]
                self._buf = ""
                return out
            keep = _partial_suffix(self._buf, tags)
            self._emit("content", self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def finish(self) -> tuple:
        out: list = []
        if self._buf:
            self._emit("reasoning_content" if self.mode == "reasoning" else "content", self._buf, out)
            self._buf = ""
        calls = []
        if self._tool_text is not None:
            calls = parse_tool_calls(self._tool_text, self.tools)
            if not calls:                         # not a well-formed call: give the text back as content
                self._emit("content", self._tool_text, out)
        return out, calls


def _partial_suffix(s: str, tags) -> int:
    """Length of the longest suffix of `s` that is a proper prefix of one of `tags`."""
    best = 0
    for t in tags:
        for k in range(min(len(t) - 1, len(s)), best, -1):
            if s.endswith(t[:k]):
                best = k
                break
    return best

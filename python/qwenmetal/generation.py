"""Text generation on top of the primitive calls (``prefill`` / ``decode_step``, `qwenmetal.session`).

``generate()`` here is what ``Model.generate`` runs, top to bottom: check everything (`generate`), look up
the prefix cache and prefill the rest in chunks with snapshots (`_prefill`), then sample, detokenize and
stop token by token (`_decode`) -- on the host, through the Metal backends' pipelined GPU loop, or from a
speculative round's verified rows. One `_Run` carries a generation's state through these steps. Its options come as one
`qwenmetal.options.GenerationOptions`; chat turns (rendering, parsing replies) are in `qwenmetal.chat`.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .dflash import DFlashDrafter
from .errors import InputError
from .expert_streaming import expert_stats
from .grammar import GrammarMatcher, ThinkingBudget, thinking_budget
from .mtp import MtpDrafter
from .options import GenerationOptions
from .prefix_cache import PrefixCache
from .prompt_images import PromptImages, place_images, preprocess_for
from .sampling import Sampler, SampleResult
from .session import ModelBase, Session
from .speculative import Drafter, DraftModel, PromptLookup, Speculation, check_k

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

    def push(self, delta: str) -> tuple[str, str | None]:
        """Add `delta`: ``(text now safe to emit, the stop string matched or None)``."""
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
        """The held-back text, at the end of the generation."""
        out, self._pending = self._pending, ""
        return out


def _progress_bar(total: int, enabled: bool | None):
    if enabled is False or (enabled is None and total < 4096):
        return None
    from tqdm.auto import tqdm  # imported when a long prompt shows a bar (tqdm loads slowly)
    return tqdm(total=total, unit="tok", desc="prefill", leave=False)


def make_drafter(spec, model: ModelBase) -> Drafter:
    """The drafter `speculative=` names: "lookup", "mtp" (the checkpoint's head), "mtp:DIR" (a separate MTP
    head folder), "dflash:DIR" (a DFlash draft folder), a draft `Model`, or a `Drafter`."""
    if isinstance(spec, Drafter):
        return spec
    if isinstance(spec, ModelBase):
        return DraftModel(spec)
    if spec == "lookup":
        return PromptLookup()
    if spec == "mtp":
        return MtpDrafter.for_model(model)
    if isinstance(spec, str) and spec.startswith("mtp:") and len(spec) > 4:
        return MtpDrafter.for_model(model, path=spec[4:])
    if isinstance(spec, str) and spec.startswith("dflash:") and len(spec) > 7:
        return DFlashDrafter.for_model(model, spec[7:])
    raise ValueError("speculative must be 'lookup', 'mtp', 'mtp:DIR', 'dflash:DIR', a draft Model or a Drafter, "
                     f"got {spec!r}")


def generate(model: ModelBase, prompt: str | Sequence[int], options: GenerationOptions | None = None, *,
             sampler: Sampler | None = None, session: Session | None = None, cache: bool = True,
             cache_points: Sequence[int] = (), progress: bool | None = None,
             cancel: threading.Event | None = None, speculative=None,
             speculative_k: int | None = None, images=None) -> Iterator[GenerationOutput]:
    """What `Model.generate` runs, with its options as one `GenerationOptions` (None: the defaults).
    Everything is checked before the first output (and before any work). `images`: the images of the
    prompt's ``<|image_pad|>`` placeholders, in order (anything `qwenmetal.images.load_image` takes, or a
    `PromptImages` placed on exactly these ids)."""
    run = _checked_run(model, prompt, options, sampler, session, cache, cache_points, progress, cancel, images)
    drafter = None
    if speculative is not None and run.images is not None:
        raise InputError("speculative decoding does not take images yet (the drafters have no M-RoPE "
                         "positions): generate without speculative=", "speculative", "unsupported_value")
    if speculative is not None:
        check_k(speculative_k)
        drafter = make_drafter(speculative, model)
    elif speculative_k is not None:
        raise ValueError("speculative_k needs speculative= (a drafter)")
    return _generate(run, drafter, speculative_k)


def prepare(model: ModelBase, prompt: str | Sequence[int], options: GenerationOptions | None = None, *,
            sampler: Sampler | None = None, session: Session | None = None, cache: bool = True,
            cache_points: Sequence[int] = (), cancel: threading.Event | None = None,
            images=None) -> "Generation":
    """One generation, checked as `generate` checks it, for a scheduler to step (`qwenmetal.batching`): its
    prompt in pieces (image rows with their features and positions), then one token per step from logits
    the scheduler computed for it."""
    return Generation(_checked_run(model, prompt, options, sampler, session, cache, cache_points, False, cancel,
                                   images))


def _checked_run(model: ModelBase, prompt, options, sampler, session, cache, cache_points, progress,
                 cancel, images=None) -> "_Run":
    o = GenerationOptions.build(options)
    tok = model.tokenizer
    if isinstance(prompt, str):
        if tok is None:
            raise InputError(f"{model.path}: no tokenizer.json, so prompts must be token ids", "prompt")
        ids = tok.encode(prompt)
    else:
        ids = [int(i) for i in prompt] if not isinstance(prompt, np.ndarray) else prompt.tolist()
    if o.stop and tok is None:
        raise InputError(f"{model.path}: no tokenizer.json, so stop strings cannot be matched", "stop")
    if sampler is not None and o.sampling:
        raise ValueError(f"pass either a sampler or sampling options, not both (got sampler and "
                         f"{', '.join(sorted(o.sampling))})")
    if sampler is None:
        sampler = o.sampler(model.generation_config)
    placed = None
    if isinstance(images, PromptImages):
        if list(images.ids) != list(ids):
            raise ValueError("images= is a PromptImages placed on other token ids than the prompt's")
        placed = images
    elif images is not None and not (isinstance(images, (list, tuple)) and not images):
        placed = place_images(model, ids, preprocess_for(model, images))   # ImageError before any work
        ids = placed.ids
    s = session if session is not None else model.new_session()
    model.check_session(s)
    model.check_ids(ids, s)                        # validates ids and the context limit, before any work
    stop_ids = set() if o.ignore_eos else set(model.eos_token_ids)
    matcher = o.grammar.matcher(model) if o.grammar is not None else None
    if o.thinking_budget is not None:
        matcher = thinking_budget(model, list(s.tokens) + list(ids), o.thinking_budget, matcher)
    return _Run(model, s, ids, o, sampler, stop_ids | set(o.stop_token_ids), model.sampleable_vocab,
                model.prefix_cache if cache else None, cache_points, progress, cancel, images=placed,
                grammar=matcher)


@dataclass
class _Run:
    """One generation: what it was asked (the model, session, prompt ids, options and sampler), and what it
    has measured so far (times, the prompt's cached part, the expert counters when decoding started)."""

    model: ModelBase
    s: Session
    ids: list
    o: GenerationOptions
    sampler: Sampler
    stop_ids: set
    vocab: int                       # the ids the sampler may return (`ModelBase.sampleable_vocab`)
    pc: PrefixCache | None
    cache_points: Sequence[int]
    progress: bool | None
    cancel: threading.Event | None
    images: PromptImages | None = None   # the prompt's images, placed (`qwenmetal.prompt_images`)
    grammar: GrammarMatcher | ThinkingBudget | None = None  # the options' grammar and thinking budget, at the
    #                                  generated text so far
    rope_start: int = 0              # the rope position of the prompt's first token (with images)
    spec: Speculation | None = None
    t0: float = 0.0                  # start
    t1: float = 0.0                  # the prompt prefilled
    cached: int = 0                  # prompt tokens taken from the prefix cache
    counters: dict | None = None     # the expert counters when decoding started (backends that stream experts)
    base: int = 0                    # the session's position before the prompt
    points: tuple = ()               # absolute positions to snapshot the prompt at (`cache_points`)

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def finish(self, n_gen: int, reason: str, logits: np.ndarray | None) -> dict:
        """The generation's statistics; the finished turn goes into the prefix cache (with the logits for the
        next token, when known)."""
        stats = self.stats(n_gen, reason)
        s, pc = self.s, self.pc
        if pc is not None and n_gen > 1 and s.nbytes <= pc.max_bytes:
            pc.put(s.tokens, s.snapshot(), logits=logits, kind="turn")
        return stats

    def stats(self, n_gen: int, reason: str) -> dict:
        t0, t1, t2 = self.t0, self.t1, time.perf_counter()
        n_prompt = len(self.ids)
        computed = n_prompt - self.cached
        decode_steps = max(n_gen - 1, 0)
        out = {"prompt_tokens": n_prompt, "cached_tokens": self.cached, "prefill_tokens": computed,
               **({"images": len(self.images)} if self.images is not None else {}),
               "generated_tokens": n_gen, "finish_reason": reason,
               "prefill_seconds": t1 - t0, "decode_seconds": t2 - t1,
               "prefill_tokens_per_second": computed / max(t1 - t0, 1e-9) if computed else float("nan"),
               "decode_tokens_per_second": decode_steps / (t2 - t1) if decode_steps and t2 > t1 else float("nan"),
               "time_to_first_token": t1 - t0}
        if self.spec is not None:
            out["speculative"] = self.spec.stats()
        if self.counters is not None:
            out["experts"] = expert_stats(self.model.expert_counters(), self.counters)
        return out


def _generate(run: _Run, drafter: Drafter | None, speculative_k: int | None) -> Iterator[GenerationOutput]:
    if drafter is not None:
        run.spec = Speculation(run.model, run.s, drafter, speculative_k, run.sampler.temperature)
    try:
        run.model.reset_expert_stats()             # the expert statistics are per generation
        run.t0 = time.perf_counter()
        logits = _prefill(run)
        if run.cancelled:
            return
        run.counters = run.model.expert_counters()
        yield from _decode(run, logits)
    finally:
        if run.spec is not None:
            run.spec.close()


def _prefill(run: _Run) -> np.ndarray | None:
    """The prompt after the prefix cache's longest match, in chunks, snapshotting at chunk boundaries and
    at the requested points: the last token's logits (None if cancelled)."""
    logits = _prefill_start(run)
    bar = _progress_bar(len(run.ids) - run.cached, run.progress) if logits is None else None
    try:
        while logits is None:
            if run.cancelled:
                return None
            n, logits = _prefill_piece(run)
            if bar is not None:
                bar.update(n)
    finally:
        if bar is not None:
            bar.close()
    return logits


def _prefill_start(run: _Run) -> np.ndarray | None:
    """Restore the prefix cache's longest match of the prompt; the last token's logits if it covers all."""
    s, ids, pc = run.s, run.ids, run.pc
    run.base = s.position
    run.points = tuple(sorted({run.base + int(p) for p in run.cache_points if 0 < int(p) < len(ids)}))
    run.rope_start = s.position + s.rope_delta
    if pc is not None and run.base == 0:
        e = pc.lookup(ids, images=run.images.spans if run.images is not None else ())
        if e is not None:
            s.restore(e.snapshot)
            run.cached = len(e.tokens)
            if run.cached == len(ids):
                _prefill_end(run, e.logits)
                return e.logits
    return None


def _prefill_piece(run: _Run, budget: int | None = None) -> tuple[int, np.ndarray | None]:
    """The next piece of the prompt: up to the next chunk boundary or snapshot point, and at most `budget`
    tokens, rounded to the backend's prefill chunks (at least one; `ModelBase.prefill_granule`). Returns (tokens prefilled, the last token's logits when the prompt is done, else None)."""
    model, s, ids, pc, spec = run.model, run.s, run.ids, run.pc, run.spec
    chunk = pc.chunk_tokens if pc is not None else 2048
    base, pos = run.base, s.position
    end = base + len(ids)
    nxt = min(end, (pos // chunk + 1) * chunk)
    for p in run.points:
        if pos < p < nxt:
            nxt = p
            break
    g = model.prefill_granule
    if budget is not None and g:              # pieces end where the backend's own chunks end: exact
        nxt = min(nxt, max((pos + int(budget)) // g * g, (pos // g + 1) * g))
    last = nxt == end
    chunk_ids, want = ids[pos - base:nxt - base], "last" if last else "none"
    rows = run.images.prefill_inputs(model, pos - base, nxt - base, run.rope_start) if run.images else {}
    # a drafter that takes hidden states (the MTP head) gets the prompt's too
    out = spec.prefill(chunk_ids, want) if spec is not None else model.prefill(s, chunk_ids, want, **rows)
    if last:
        _prefill_end(run, out)
        return nxt - pos, out
    if pc is not None and s.nbytes <= pc.max_bytes:
        if nxt in run.points:
            pc.put(s.tokens, s.snapshot(), kind="point")
        elif nxt % chunk == 0 and _keep_boundary(nxt // chunk, (end - 1) // chunk):
            pc.put(s.tokens, s.snapshot(), kind="chunk")
    return nxt - pos, None


def _prefill_end(run: _Run, logits: np.ndarray) -> None:
    pc, s = run.pc, run.s
    if pc is not None and run.cached < len(run.ids) and s.nbytes <= pc.max_bytes:
        pc.put(s.tokens, s.snapshot(), logits=logits, kind="prompt")
    run.t1 = time.perf_counter()


class _Tokens:
    """A generation's tokens becoming text: each sampled token is detokenized and checked against the stop
    ids, the stop strings (`StopStringMatcher`), max_tokens and the session's context."""

    def __init__(self, run: _Run):
        self.run = run
        tok = run.model.tokenizer
        self.decoder = tok.stream_decoder(run.o.skip_special_tokens) if tok is not None else None
        self.matcher = StopStringMatcher(list(run.o.stop))
        self.generated: list = []
        self.context = list(run.s.tokens)

    def allowed(self) -> np.ndarray | None:
        """The grammar's mask for the next token (None: any token)."""
        g = self.run.grammar
        return None if g is None else g.allowed(self.run.vocab or None)

    def sample(self, logits: np.ndarray) -> SampleResult:
        """The next token from `logits` on the host (penalties see the context and the generated tokens;
        the grammar's mask, if any, applies)."""
        run = self.run
        return run.sampler.sample(logits, run.vocab, context=self.context, generated=self.generated,
                                  logprobs=run.o.logprobs, top_logprobs=run.o.top_logprobs,
                                  allowed=self.allowed())

    def take(self, t: int, position: int) -> tuple[str, str | None, str | int | None]:
        """Token `t` was sampled with the session at `position`: (its text, the finish reason or None, the
        stop string or id that ended the generation)."""
        run, decoder, matcher = self.run, self.decoder, self.matcher
        if run.grammar is not None:
            run.grammar.advance(t)
        self.generated.append(t)
        self.context.append(t)
        reason = hit = None
        if t in run.stop_ids:
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
            if len(self.generated) == run.o.max_tokens:
                reason = "length"
            elif position + 1 > run.s.max_context:
                reason = "context"
            if reason is not None and decoder is not None:
                more, hit = matcher.push(decoder.flush())
                text += more + ("" if hit is not None else matcher.flush())
        return text, reason, hit


def _decode(run: _Run, logits: np.ndarray) -> Iterator[GenerationOutput]:
    """Sample, detokenize and stop, token by token: from the logits (host sampling), the pipelined GPU loop,
    or a speculative round's verified rows."""
    model, s, sampler, o, spec = run.model, run.s, run.sampler, run.o, run.spec
    want_logprobs, top_n = o.logprobs, o.top_logprobs
    gpu = _GpuDecode(run) if spec is None and _gpu_decodable(run) else None
    toks = _Tokens(run)
    pending: list = []                # (result, in the state, its logits): decided by the last verification
    accepted = 0                      # drafts the model agreed with in the open round
    for n in range(o.max_tokens):
        if run.cancelled:
            return
        in_state, row = False, logits     # row: the logits the token comes from
        if pending:                       # decided by the last verification
            r, in_state, row = pending.pop(0)
        elif gpu is not None and n > 0:   # sampled on the GPU by the pipelined decode loop
            r = SampleResult(gpu.next(n), None, None)
        else:
            r = toks.sample(logits)
        t = r.token
        text, reason, hit = toks.take(t, spec.position() if spec is not None else s.position)
        lp, top = r.logprob, r.top_logprobs
        if reason is None:
            if gpu is not None:
                gpu.feed(t)               # the GPU loop consumes t as its next input
            elif spec is not None and in_state:
                spec.fed()                # an accepted draft: already in the state
            elif spec is not None:
                spec.end_round(accepted)
                rows, drafts, probs = spec.step(t, toks.context, o.max_tokens - n - 1)
                accepted, advanced, logits = 0, 0, rows[0]
                ctx, gen = list(toks.context), list(toks.generated)
                for i, d in enumerate(drafts):     # the model's token at each drafted position
                    ri, ok = sampler.verify_draft(rows[i], d, run.vocab, context=ctx, generated=gen,
                                                  logprobs=want_logprobs, top_logprobs=top_n,
                                                  draft_probs=None if probs is None else probs[i],
                                                  allowed=toks.allowed())
                    pending.append((ri, ok, rows[i]))
                    ctx.append(ri.token)
                    gen.append(ri.token)
                    if not ok:
                        break
                    accepted += 1
                    if ri.token in run.stop_ids:   # the generation ends here: nothing after it is used
                        break
                    if run.grammar is not None:    # the next row's mask follows this token; `take` redoes it
                        run.grammar.advance(ri.token)
                        advanced += 1
                if advanced:
                    run.grammar.rollback(advanced)
                if drafts and accepted == len(drafts):
                    logits = rows[-1]             # every draft kept: the next token is sampled from the last row
            else:
                logits = model.decode_step(s, t)
            yield GenerationOutput(t, text, n, logprob=lp, top_logprobs=top)
            continue
        if spec is not None:
            spec.close()                  # the session keeps what plain decoding would have fed
            logits = row
        # the GPU path reads no logits back: the turn is kept without them
        stats = run.finish(len(toks.generated), reason, None if gpu is not None else logits)
        yield GenerationOutput(t, text, n, reason, stats, lp, top, hit)
        return


class Generation:
    """One generation stepped from outside (`prepare`; the scheduler in `qwenmetal.batching` runs many):
    `prefill(budget)` until `prefilled`, then `first()` and `feed(logits)` per decode step, each giving a
    `GenerationOutput` (the last one has `finish_reason` and `stats`); `next_token` is what the next decode
    step must run on the session. Host sampling with the generation's own sampler, so a seeded generation
    gives what `Model.generate` gives alone on the host path."""

    def __init__(self, run: _Run):
        self.run = run
        self.session = run.s
        self.next_token: int | None = None    # to be fed to the session next (None: prefilling or done)
        self._logits = None
        self._toks: _Tokens | None = None
        self._started = False

    @property
    def cancelled(self) -> bool:
        return self.run.cancelled

    def prefill(self, budget: int | None = None) -> int:
        """Prefill the next piece of the prompt (at most `budget` tokens, within the prefix cache's chunk
        boundaries): the tokens it ran (0 when the prefix cache held the whole prompt). `prefilled` says
        when the prompt is done."""
        run = self.run
        if not self._started:
            self._started = True
            run.model.reset_expert_stats()
            run.t0 = time.perf_counter()
            self._logits = _prefill_start(run)
        if self._logits is not None:
            return 0
        n, self._logits = _prefill_piece(run, budget)
        return n

    @property
    def prefilled(self) -> bool:
        return self._logits is not None

    def first(self) -> GenerationOutput:
        """The first generated token, from the prompt's last logits."""
        run = self.run
        run.counters = run.model.expert_counters()
        self._toks = _Tokens(run)
        return self.feed(self._logits)

    def feed(self, logits: np.ndarray) -> GenerationOutput:
        """The next token from the logits the session's last step gave."""
        toks, s = self._toks, self.run.s
        r = toks.sample(logits)
        t = r.token
        n = len(toks.generated)
        text, reason, hit = toks.take(t, s.position)
        if reason is None:
            self.next_token = t
            return GenerationOutput(t, text, n, logprob=r.logprob, top_logprobs=r.top_logprobs)
        self.next_token = None
        stats = self.run.finish(len(toks.generated), reason, logits)
        return GenerationOutput(t, text, n, reason, stats, r.logprob, r.top_logprobs, hit)


def _gpu_decodable(run: _Run) -> bool:
    """Whether the backend's pipelined GPU decode loop can generate for these options: a Metal backend, and
    nothing the GPU does not do (penalties, logprobs) or that is decided on text (stop strings: the loop
    runs ahead of the text by up to a chunk)."""
    sp, o = run.sampler, run.o
    return (run.model.gpu_decode and not o.logprobs and not o.top_logprobs and not o.stop
            and sp.repetition_penalty == 1.0 and not sp.presence_penalty and not sp.frequency_penalty)


class _GpuDecode:
    """Tokens from the backend's pipelined decode loop (one command buffer per token, two in flight, GPU
    sampling), CHUNK at a time; the session's tokens follow the state after every call. Seeded sampling
    reproduces on the same backend (the GPU's RNG is Philox keyed by (seed, position), not the host
    Sampler's stream); greedy decoding is the host path's."""

    CHUNK = 32

    def __init__(self, run: _Run):
        self.run = run
        sp = run.sampler
        seed = sp.seed if sp.seed is not None else int(sp.rng.integers(0, 2**63 - 1))
        self.seed = int(seed)
        self.pending: list = []
        self.fed = None

    def feed(self, t: int) -> None:
        self.fed = int(t)

    def next(self, n: int) -> int:
        if not self.pending:
            run = self.run
            s, sp = run.s, run.sampler
            budget = min(self.CHUNK, run.o.max_tokens - n, s.max_context - s.position)
            mask, g = {}, run.grammar
            free = g.free_steps() if g is not None else 0
            if free > 0:                          # unconstrained until a thinking budget's forcing starts
                budget = min(budget, free)
            elif g is not None:                   # one token per call: the grammar moves after each
                budget, mask = 1, {"mask": g.bitmask()}
            out = run.model.decode_loop(s, self.fed, budget, temperature=sp.temperature, top_k=sp.top_k,
                                        top_p=sp.top_p, min_p=sp.min_p, seed=self.seed,
                                        stop_ids=[int(t) for t in run.stop_ids], vocab=int(run.vocab or 0), **mask)
            self.pending = [int(t) for t in out]
        return self.pending.pop(0)


def _keep_boundary(k: int, last_k: int) -> bool:
    """Snapshot the k-th chunk boundary of a prompt whose last boundary is `last_k`? The boundaries at
    powers of two (chunk, 2 chunks, 4, 8, ...) and the last two: O(log n) snapshots per prompt, so the
    copying stays linear in the prompt length, yet a prompt that diverges from a cached one late
    resumes within two chunks of the divergence and one that diverges early from a power-of-two
    boundary."""
    return k >= last_k - 1 or (k & (k - 1)) == 0

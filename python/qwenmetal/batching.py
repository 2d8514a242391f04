"""Many generations at once: continuous batching over independent sessions.

    for i, out in model.generate_batch(["Hello", "Bonjour", [1, 2, 3]], max_tokens=32):
        print(i, out.text, end="")

A `Batcher` holds up to `max_rows` generations (`generation.prepare`: each with its own session, options,
sampler, seed and stop conditions) and advances all of them by one `step` at a time:

1. every generation that is decoding gives the token it sampled last, and one `session.decode_batch` call runs
   them all: one forward that reads every weight once for all rows (on cpu and the Metal graph), each row bit
   for bit its session's own decode step (a backend without a batched step -- the reference, Metal expert
   streaming -- runs a one-row step per row); each row then samples its next token on the host with its own
   sampler;
2. then the prompts of newly joined generations are prefilled in pieces, oldest first, with what is left of
   the step's token budget (`step_tokens`, at least one piece per step): a long prompt holds the decoding
   rows up by at most one piece per step (chunked prefill);
3. generations join (`add`) and leave (finished, cancelled or failed) between steps. Waiting generations
   are admitted in arrival order when a row is free.

Each generation's output is exactly what it gives alone on the host path: greedy, the same tokens; seeded
sampling, the same tokens; its prompt uses the prefix cache as `Model.generate` does (a prompt that shares a
prefix with an earlier or concurrent request restores the snapshot the other left at a chunk boundary).
Speculative decoding and the Metal backends' pipelined single-stream loop are single-stream only: a batched
generation samples every token on the host.

A failure is contained to its row: an error while prefilling a prompt or sampling a row fails that
generation only; an error in the batched step (which leaves every session unchanged) reruns the rows one
by one, so only a row that fails alone fails. A KeyboardInterrupt propagates, every session all-or-nothing.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from .generation import Generation, GenerationOutput, prepare
from .options import GenerationOptions
from .session import ModelBase, decode_batch

DEFAULT_STEP_TOKENS = 512           # tokens per step: the decoding rows plus prompt pieces
DEFAULT_MAX_ROWS = 8                # generations at once where the backend sets no limit (row by row)


@dataclass
class Event:
    """What a step produced for one generation: ``"out"`` (a `GenerationOutput`; the generation is done when
    it has a finish_reason), ``"cancelled"`` (its cancel event was set: it left without a final output) or
    ``"error"`` (an exception: it left)."""

    tag: Any
    kind: str
    value: Any = None


@dataclass
class _Row:
    gen: Generation
    tag: Any


@dataclass
class BatchStats:
    """What the scheduler has done: decode steps, and the rows of the recent ones."""

    steps: int = 0
    history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))

    def occupancy(self, max_rows: int) -> float | None:
        """Mean rows per batched decode step over the recent steps, as a fraction of `max_rows`."""
        if not self.history:
            return None
        return sum(self.history) / len(self.history) / max_rows


class Batcher:
    """Continuous batching over `model`'s sessions (see the module docstring). Not thread-safe: one thread
    calls `add` and `step` (the server's worker does)."""

    def __init__(self, model: ModelBase, max_rows: int | None = None, step_tokens: int = DEFAULT_STEP_TOKENS):
        limit = model.max_batch_rows
        if max_rows is None:
            max_rows = limit if limit is not None else DEFAULT_MAX_ROWS
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows must be a positive integer, got {max_rows!r}")
        if limit is not None and max_rows > limit:
            raise ValueError(f"the {model.backend} backend runs at most {limit} rows per batched step, "
                             f"got max_rows={max_rows}")
        if isinstance(step_tokens, bool) or not isinstance(step_tokens, int) or step_tokens < 1:
            raise ValueError(f"step_tokens must be a positive integer, got {step_tokens!r}")
        self.model = model
        self.max_rows = max_rows
        self.step_tokens = step_tokens
        self._waiting: collections.deque = collections.deque()
        self._rows: list[_Row] = []
        self.stats = BatchStats()

    # ---- what is in it --------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        """Generations holding a row (prefilling or decoding)."""
        return len(self._rows)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> bool:
        """Whether a step has anything to do."""
        return bool(self._rows or self._waiting)

    def add(self, gen: Generation, tag: Any = None) -> None:
        """Queue `gen` (from `generation.prepare`); it takes a row at the next step with one free. `tag` names
        it in the events."""
        if not isinstance(gen, Generation):
            raise TypeError(f"add() takes a Generation (generation.prepare), got {type(gen).__name__}")
        if gen.session.model is not self.model:
            raise ValueError("this generation belongs to another model")
        self._waiting.append(_Row(gen, tag))

    # ---- one step -----------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Admit waiting generations, run one batched decode step, then prefill with the rest of the budget."""
        events: list[Event] = []
        for r in list(self._rows) + list(self._waiting):   # cancelled ones leave first
            if r.gen.cancelled:
                self._leave(r)
                events.append(Event(r.tag, "cancelled"))
        while self._waiting and len(self._rows) < self.max_rows:
            self._rows.append(self._waiting.popleft())
        decoding = [r for r in self._rows if r.gen.next_token is not None]
        if decoding:
            self._decode(decoding, events)
        budget = self.step_tokens - len(decoding)
        first = True                                     # one piece per step at least, so prompts progress
        for r in [r for r in self._rows if not r.gen.prefilled]:
            if budget <= 0 and not first:
                break
            first = False
            try:
                budget -= r.gen.prefill(max(budget, 1))
                if r.gen.prefilled:
                    self._emit(r, r.gen.first(), events)
            except Exception as e:  # noqa: BLE001 - the generation fails, the others go on
                self._leave(r)
                events.append(Event(r.tag, "error", e))
        return events

    def _decode(self, rows: list[_Row], events: list[Event]) -> None:
        if self.model.max_batch_rows is None:            # no batched step: the rows one by one
            results = self._one_by_one(rows)
        else:
            try:
                logits = decode_batch(self.model, [r.gen.session for r in rows], [r.gen.next_token for r in rows])
                results = [(r, logits[i], None) for i, r in enumerate(rows)]
            except Exception:  # noqa: BLE001 - every session is unchanged: find the row that fails alone
                results = self._one_by_one(rows)
        self.stats.steps += 1
        self.stats.history.append(len(rows))
        for r, row, err in results:
            if err is not None:
                self._leave(r)
                events.append(Event(r.tag, "error", err))
                continue
            try:
                self._emit(r, r.gen.feed(row), events)
            except Exception as e:  # noqa: BLE001
                self._leave(r)
                events.append(Event(r.tag, "error", e))

    def _one_by_one(self, rows: list[_Row]) -> list[tuple]:
        """(row, its logits or None, its error or None) from a one-row step per row."""
        out = []
        for r in rows:
            try:
                out.append((r, decode_batch(self.model, [r.gen.session], [r.gen.next_token])[0], None))
            except Exception as e:  # noqa: BLE001
                out.append((r, None, e))
        return out

    def _emit(self, r: _Row, out: GenerationOutput, events: list[Event]) -> None:
        events.append(Event(r.tag, "out", out))
        if out.finish_reason is not None:
            self._leave(r)

    def _leave(self, r: _Row) -> None:
        if r in self._rows:
            self._rows.remove(r)
        elif r in self._waiting:
            self._waiting.remove(r)

    def __repr__(self) -> str:
        return f"Batcher(rows={self.rows}/{self.max_rows}, waiting={self.waiting}, step_tokens={self.step_tokens})"


def generate_batch(model: ModelBase, prompts: Sequence, options: GenerationOptions | Sequence | None = None, *,
                   max_rows: int | None = None, step_tokens: int = DEFAULT_STEP_TOKENS, cache: bool = True,
                   cancel: threading.Event | None = None) -> Iterator[tuple[int, GenerationOutput]]:
    """What `Model.generate_batch` runs: `(index, GenerationOutput)` for each prompt's outputs as they come.
    `options`: one `GenerationOptions` for every prompt, or one per prompt. Every prompt and option is checked
    before any work (ValueError naming the prompt). An error in one generation is raised after the step that
    met it (the other generations' sessions are left as they were at that point)."""
    prompts = list(prompts)
    if not prompts:
        raise ValueError("generate_batch needs at least one prompt")
    if options is None or isinstance(options, GenerationOptions):
        per = [options] * len(prompts)
    else:
        per = list(options)
        if len(per) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per)} options")
    gens = []
    for i, (p, o) in enumerate(zip(prompts, per)):
        try:
            gens.append(prepare(model, p, o, cache=cache, cancel=cancel))
        except ValueError as e:
            raise type(e)(f"prompts[{i}]: {e}") from None
    b = Batcher(model, max_rows, step_tokens)
    for i, g in enumerate(gens):
        b.add(g, i)
    return _drain(b)


def _drain(b: Batcher) -> Iterator[tuple[int, GenerationOutput]]:
    while b.active:
        for ev in b.step():
            if ev.kind == "error":
                raise ev.value
            if ev.kind == "out":
                yield ev.tag, ev.value

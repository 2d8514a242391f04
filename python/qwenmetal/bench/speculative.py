"""``qwenmetal bench --speculative``: what speculative decoding costs and gains on this machine.

1. The cost of one verification call of n = 2, 3, 5, 9 rows (k = n - 1 drafts) against one decode step, at a
   fixed context (the drafts are rewound after each timed call).
2. Greedy tokens per second against plain decoding at controlled acceptance rates: an oracle drafter proposes
   the model's own greedy continuation (measured first, by plain decoding), each proposal corrupted with
   probability 1 - rate (random weights make real acceptance meaningless). The adaptive draft length runs as
   it would for a user, and a fixed k is shown beside it; the tokens must equal the plain ones.

Timings alternate between the compared cases and report medians (docs/speculative.md explains the method).
"""
from __future__ import annotations

import gc
import time
from typing import Callable

import numpy as np

from ..speculative import ScriptedDrafter, rewind, verify
from .timing import _median, synthetic_prompt

ROWS = (2, 3, 5, 9)
RATES = (0.5, 0.7, 0.9)


def verify_cost(model, context: int, rows=ROWS, repeats: int = 5) -> dict:
    """Seconds of one decode step and of one verification of n rows at `context` (medians, alternating)."""

    V = model.config.vocab_size
    base = model.new_session()
    first = int(np.argmax(model.prefill(base, synthetic_prompt(context, V))))
    drafts = [int(t) for t in synthetic_prompt(max(rows), V, offset=context)]
    samples: dict = {1: [], **{n: [] for n in rows}}
    for r in range(repeats + 1):                  # the first round warms every shape up
        for n in (1, *rows):
            s = base.fork()
            gc.collect()
            t = time.perf_counter()
            if n == 1:
                model.decode_step(s, first)
            else:
                verify(model, s, [first, *drafts[:n - 1]])
            dt = time.perf_counter() - t
            if n > 1:
                rewind(model, s, 0)
            if r:
                samples[n].append(dt)
            del s
    step = _median(samples[1])
    return {"context": context, "step_ms": 1e3 * step,
            "rows": {n: {"ms": 1e3 * _median(samples[n]), "vs_step": _median(samples[n]) / step,
                         "samples_ms": [1e3 * x for x in samples[n]]} for n in rows}}


def _timed_generate(model, prompt, n, **kw):
    t = time.perf_counter()
    outs = list(model.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True, cache=False, **kw))
    return [o.token for o in outs], time.perf_counter() - t, outs[-1].stats


def throughput(model, context: int, tokens: int, rates=RATES, fixed_k: int = 3, repeats: int = 3) -> dict:
    """Decode tokens/s of plain greedy decoding and of speculation with the oracle drafter at each rate."""

    V = model.config.vocab_size
    prompt = [int(t) for t in synthetic_prompt(context, V)]
    plain, _, _ = _timed_generate(model, prompt, tokens)          # the oracle's script (and a warm-up)
    out = {"context": context, "tokens": tokens, "fixed_k": fixed_k, "rates": {}}
    plain_s = []
    runs: dict = {r: {"adaptive": [], "fixed": []} for r in rates}
    for _ in range(repeats):
        toks, dt, st = _timed_generate(model, prompt, tokens)
        plain_s.append(st["decode_seconds"])
        for rate in rates:
            for mode, k in (("adaptive", None), ("fixed", fixed_k)):
                d = ScriptedDrafter(prompt + plain, corrupt=1 - rate, vocab=V, seed=int(rate * 100))
                toks, dt, st = _timed_generate(model, prompt, tokens, speculative=d, speculative_k=k)
                if toks != plain:
                    raise AssertionError(f"speculation changed the greedy tokens (rate {rate}, k {k})")
                runs[rate][mode].append((st["decode_seconds"], st["speculative"]))
    steps = tokens - 1
    out["plain_tokens_per_second"] = steps / _median(plain_s)
    for rate in rates:
        row = {}
        for mode in ("adaptive", "fixed"):
            secs = [x[0] for x in runs[rate][mode]]
            sp = runs[rate][mode][len(secs) // 2][1]
            tps = steps / _median(secs)
            row[mode] = {"tokens_per_second": tps, "vs_plain": tps / out["plain_tokens_per_second"],
                         "acceptance_rate": sp["acceptance_rate"], "rounds": sp["rounds"],
                         "draft_length_at_end": sp["draft_length"]}
        out["rates"][rate] = row
    return out


def run_speculative(model, context: int, tokens: int, repeats: int, log: Callable[[str], None]) -> dict:
    cost = verify_cost(model, context, repeats=max(repeats, 3))
    for n, r in cost["rows"].items():
        log(f"  verify {n} rows @ {context}: {r['ms']:.2f} ms = {r['vs_step']:.2f}x a decode step "
            f"({cost['step_ms']:.2f} ms)")
    thr = throughput(model, context, tokens, repeats=repeats)
    for rate, row in thr["rates"].items():
        log(f"  acceptance {rate}: " + ", ".join(
            f"{m} {v['tokens_per_second']:.1f} tok/s ({v['vs_plain']:.2f}x)" for m, v in row.items()))
    return {"verify": cost, "throughput": thr}


def format_speculative(res: dict) -> str:
    c, t = res["verify"], res["throughput"]
    lines = [f"verification cost at context {c['context']} (one decode step {c['step_ms']:.2f} ms):",
             f"{'rows':>5} {'ms':>9} {'vs step':>8}"]
    lines += [f"{n:>5} {r['ms']:>9.2f} {r['vs_step']:>8.2f}" for n, r in c["rows"].items()]
    lines.append(f"greedy decode, {t['tokens']} tokens at context {t['context']}: plain "
                 f"{t['plain_tokens_per_second']:.2f} tok/s; oracle drafter corrupted at 1 - rate")
    lines.append(f"{'rate':>5} {'adaptive tok/s':>14} {'vs plain':>8} {'accepted':>8} {'k at end':>8} "
                 f"{'k=' + str(t['fixed_k']) + ' tok/s':>11} {'vs plain':>8}")
    for rate, row in t["rates"].items():
        a, f = row["adaptive"], row["fixed"]
        lines.append(f"{rate:>5} {a['tokens_per_second']:>14.2f} {a['vs_plain']:>8.2f} {_rate(a['acceptance_rate']):>8} "
                     f"{a['draft_length_at_end']:>8} {f['tokens_per_second']:>11.2f} {f['vs_plain']:>8.2f}")
    mm = res.get("metal_modelled")
    if mm:
        chips = list(mm["step_seconds"])
        lines.append(f"Metal graph, MODELLED (encode-only, {mm['layers']} layers, context {mm['context']}; "
                     "simulator-verified, hardware-unverified): the verification graph vs one decode step "
                     "(in brackets: a small-m prefill chunk with every row's logits)")
        lines.append(f"{'rows':>5} " + " ".join(f"{c:>16}" for c in chips))
        lines.append(f"{'step':>5} " + " ".join(f"{1e3 * mm['step_seconds'][c]:>14.2f}ms" for c in chips))
        for n, r in mm["rows"].items():
            lines.append(f"{n:>5} " + " ".join(f"{r[c]['vs_step']:>7.2f}x ({r[c]['chunk_vs_step']:.2f}x)"
                                               for c in chips))
    return "\n".join(lines)


def _rate(r) -> str:
    """An acceptance rate for the table ("-": nothing was drafted)."""
    return "-" if r is None else f"{r:.2f}"

"""``qwenmetal bench --speculative``: what speculative decoding costs and gains on this machine.

1. The cost of one verification call of n = 2, 4, 8, 16 rows (k = n - 1 drafts; 16: a DFlash block) against one
   decode step, at a fixed context (the drafts are rewound after each timed call).
2. Greedy tokens per second against plain decoding at controlled mean accepted lengths L = 2, 4, 5, 6 (tokens
   a round yields: its kept drafts and the model's own token): an oracle block drafter proposes the model's
   own greedy continuation (measured first, by plain decoding), wrong at the L-th draft of every round (random
   weights make real acceptance meaningless). Two draft lengths: the adaptive one, as a user runs it, and
   k = 15, a whole DFlash block verified every round. The tokens must equal the plain ones. The oracle drafts
   for free: a real draft's forward is not in these figures.
3. Beside them, where the simulator is built, the Metal graph MODELLED (encode-only, the real config): the
   verification graph of n rows against a decode step, and the tok/s at each mean accepted length with a
   DFlash draft's own forward costed by the draft graph (src/gpu/dflash.h, `bench.cost.encode_only_dflash_cost`:
   the published draft's dimensions over virtual weights, the round's context rows, a block of 16), beside the
   analytic figure from its size (`dflash_draft_seconds`).

Timings alternate between the compared cases and report medians (docs/speculative.md explains the method).
"""
from __future__ import annotations

import gc
import time
from typing import Callable

import numpy as np

from ..speculative import MAX_DRAFT, ScriptedDrafter, rewind, verify
from .cost import CHIP_BANDWIDTH_GBS, DRAFT_WIDTHS, LEVEL_LATENCY_S, PUBLISHED_DRAFT
from .timing import _median, synthetic_prompt

ROWS = (2, 4, 8, 16)
LENGTHS = (2, 4, 5, 6)
#: dependency levels of one draft layer in a graph shaped like the decode graph's (norm+qkv, attention over
#: context + block, o_proj + residual, norm+gate/up, down + residual, the context rows' k/v): an estimate
DRAFT_LEVELS_PER_LAYER = 6


class BlockOracle(ScriptedDrafter):
    """The script's continuation, wrong at the `length`-th draft of every round: each round yields exactly
    `length` tokens (length - 1 kept drafts and the model's own) whenever it drafts at least `length`."""

    name = "oracle"

    def __init__(self, script, length: int, vocab: int):
        super().__init__(script, vocab=vocab)
        self.length = int(length)

    def draft(self, context, k):
        p0 = len(context)
        out = self.script[p0:p0 + k]
        if len(out) >= self.length:
            out = list(out)
            out[self.length - 1] = (out[self.length - 1] + 1) % self.vocab
        return list(out)


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


def throughput(model, context: int, tokens: int, lengths=LENGTHS, block_k: int = MAX_DRAFT, repeats: int = 3) -> dict:
    """Decode tokens/s of plain greedy decoding and of speculation with the block oracle at each mean accepted
    length, with the adaptive draft length and with whole blocks (k = `block_k`)."""

    V = model.config.vocab_size
    prompt = [int(t) for t in synthetic_prompt(context, V)]
    plain, _, _ = _timed_generate(model, prompt, tokens)          # the oracle's script (and a warm-up)
    out = {"context": context, "tokens": tokens, "block_k": block_k, "lengths": {}}
    plain_s = []
    runs: dict = {n: {"adaptive": [], "block": []} for n in lengths}
    for _ in range(repeats):
        toks, dt, st = _timed_generate(model, prompt, tokens)
        plain_s.append(st["decode_seconds"])
        for n in lengths:
            for mode, k in (("adaptive", None), ("block", block_k)):
                d = BlockOracle(prompt + plain, n, V)
                toks, dt, st = _timed_generate(model, prompt, tokens, speculative=d, speculative_k=k)
                if toks != plain:
                    raise AssertionError(f"speculation changed the greedy tokens (length {n}, k {k})")
                runs[n][mode].append((st["decode_seconds"], st["speculative"]))
    steps = tokens - 1
    out["plain_tokens_per_second"] = steps / _median(plain_s)
    for n in lengths:
        row = {}
        for mode in ("adaptive", "block"):
            secs = [x[0] for x in runs[n][mode]]
            sp = runs[n][mode][len(secs) // 2][1]
            tps = steps / _median(secs)
            row[mode] = {"tokens_per_second": tps, "vs_plain": tps / out["plain_tokens_per_second"],
                         "mean_accepted_length": sp["mean_accepted_length"], "rounds": sp["rounds"],
                         "draft_length_at_end": sp["draft_length"]}
        out["lengths"][n] = row
    return out


def dflash_draft_seconds(lm_head_bytes: int, bandwidth_gbs: float, draft: dict = PUBLISHED_DRAFT,
                         bytes_per_weight: float = 2.0) -> dict:
    """A MODEL of one DFlash drafting call on a GPU (the draft graph is not built): its weights read once
    (`bytes_per_weight` 2: the published bf16; 0.5625: an MLX 4-bit copy), the target's lm_head for the block's
    rows, the fc over the context features, and DRAFT_LEVELS_PER_LAYER dependency levels per layer plus 3 (fc,
    final norm + lm_head, argmax) at the decode model's 4 us each."""
    H, I, L = draft["hidden_size"], draft["intermediate_size"], draft["num_hidden_layers"]
    q, kv = draft["num_attention_heads"] * draft["head_dim"], draft["num_key_value_heads"] * draft["head_dim"]
    per_layer = H * q * 2 + H * kv * 2 + 3 * H * I
    params = L * per_layer + draft["target_layers"] * H * H
    nbytes = params * bytes_per_weight + lm_head_bytes
    levels = DRAFT_LEVELS_PER_LAYER * L + 3
    return {"bytes": nbytes, "levels": levels,
            "seconds": nbytes / (bandwidth_gbs * 1e9) + levels * LEVEL_LATENCY_S}




def modelled_lengths(verify_modelled: dict, lm_head_bytes: int, lengths=LENGTHS, block: int = 16,
                     draft_modelled: dict | None = None) -> dict:
    """Modelled tok/s against plain decoding at each mean accepted length L, per chip and draft width
    (DRAFT_WIDTHS): a round of n rows yields L tokens in verify(n) + one draft call; n = L (the draft length the
    adaptive choice settles on when every round keeps L - 1 drafts) and n = `block` (whole blocks).
    `verify_modelled`: encode_only_verify_cost's result holding rows L and `block`. The draft call: the Metal
    draft graph's modelled cost with the L context rows a round feeds (`draft_modelled`: encode_only_dflash_cost's
    result holding rows L; ``draft_graph_seconds``) where given, else the analytic `dflash_draft_seconds`
    (``draft_seconds``, reported either way)."""
    out: dict = {}
    for chip, step in verify_modelled["step_seconds"].items():
        analytic = {w: dflash_draft_seconds(lm_head_bytes, CHIP_BANDWIDTH_GBS[chip], bytes_per_weight=b)["seconds"]
                    for w, b in DRAFT_WIDTHS.items()}
        graph = None
        if draft_modelled is not None:
            graph = {w: {n: draft_modelled["rows"][n][w][chip]["seconds"] for n in lengths} for w in DRAFT_WIDTHS}
        row = {}
        for n in lengths:
            fit = verify_modelled["rows"][n][chip]["seconds"] if n > 1 else step
            whole = verify_modelled["rows"][block][chip]["seconds"]
            row[n] = {}
            for w in DRAFT_WIDTHS:
                d = graph[w][n] if graph is not None else analytic[w]
                sfx = "" if w == "bf16" else "_" + w
                row[n]["adaptive_vs_plain" + sfx] = n * step / (fit + d)
                row[n]["block_vs_plain" + sfx] = n * step / (whole + d)
        out[chip] = {"step_seconds": step, "draft_seconds": analytic["bf16"], "draft_seconds_q4": analytic["q4"],
                     "lengths": row}
        if graph is not None:
            out[chip]["draft_graph_seconds"] = graph
    return out


def run_speculative(model, context: int, tokens: int, repeats: int, log: Callable[[str], None]) -> dict:
    cost = verify_cost(model, context, repeats=max(repeats, 3))
    for n, r in cost["rows"].items():
        log(f"  verify {n} rows @ {context}: {r['ms']:.2f} ms = {r['vs_step']:.2f}x a decode step "
            f"({cost['step_ms']:.2f} ms)")
    thr = throughput(model, context, tokens, repeats=repeats)
    for n, row in thr["lengths"].items():
        log(f"  mean accepted length {n}: " + ", ".join(
            f"{m} {v['tokens_per_second']:.1f} tok/s ({v['vs_plain']:.2f}x)" for m, v in row.items()))
    return {"verify": cost, "throughput": thr}


def format_speculative(res: dict) -> str:
    c, t = res["verify"], res["throughput"]
    lines = [f"verification cost at context {c['context']} (one decode step {c['step_ms']:.2f} ms):",
             f"{'rows':>5} {'ms':>9} {'vs step':>8}"]
    lines += [f"{n:>5} {r['ms']:>9.2f} {r['vs_step']:>8.2f}" for n, r in c["rows"].items()]
    lines.append(f"greedy decode, {t['tokens']} tokens at context {t['context']}: plain "
                 f"{t['plain_tokens_per_second']:.2f} tok/s; oracle block drafter (drafts for free), wrong at the "
                 "L-th draft of every round")
    lines.append(f"{'L':>3} {'adaptive tok/s':>14} {'vs plain':>8} {'mean len':>8} {'k at end':>8} "
                 f"{'k=' + str(t['block_k']) + ' tok/s':>12} {'vs plain':>8} {'mean len':>8}")
    for n, row in t["lengths"].items():
        a, b = row["adaptive"], row["block"]
        lines.append(f"{n:>3} {a['tokens_per_second']:>14.2f} {a['vs_plain']:>8.2f} {_len(a['mean_accepted_length']):>8} "
                     f"{a['draft_length_at_end']:>8} {b['tokens_per_second']:>12.2f} {b['vs_plain']:>8.2f} "
                     f"{_len(b['mean_accepted_length']):>8}")
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
        ml = mm.get("lengths")
        if ml:
            for w, sfx in (("bf16", ""), ("MLX 4-bit", "_q4")):
                key = "bf16" if not sfx else sfx[1:]
                if "draft_graph_seconds" in ml[chips[0]]:
                    draft_ms = ", ".join(
                        f"{c} {1e3 * min(ml[c]['draft_graph_seconds'][key].values()):.2f}-"
                        f"{1e3 * max(ml[c]['draft_graph_seconds'][key].values()):.2f} ms "
                        f"(analytic {1e3 * ml[c]['draft_seconds' + sfx]:.2f})" for c in chips)
                    how = "the draft graph's modelled cost"
                else:
                    draft_ms = ", ".join(f"{c} {1e3 * ml[c]['draft_seconds' + sfx]:.2f} ms" for c in chips)
                    how = "costed from its size"
                lines.append(f"DFlash decoding, MODELLED vs plain decoding at mean accepted length L (rows verified = "
                             f"L / whole blocks of 16), a {w} draft's forward per round, {how} ({draft_ms})")
                lines.append(f"{'L':>5} " + " ".join(f"{c:>16}" for c in chips))
                for n in next(iter(ml.values()))["lengths"]:
                    cells = []
                    for c in chips:
                        v = ml[c]["lengths"][n]
                        cells.append(f"{v['adaptive_vs_plain' + sfx]:>7.2f}x / {v['block_vs_plain' + sfx]:.2f}x")
                    lines.append(f"{n:>5} " + " ".join(cells))
    if res.get("metal_mtp_modelled"):
        lines += format_mtp_modelled(res["metal_mtp_modelled"])
    return "\n".join(lines)


def format_mtp_modelled(mm: dict) -> list[str]:
    """The lines of `encode_only_mtp_cost`'s result: per k drafts, the round's dispatches, levels, bytes and
    modelled time per chip against one decode step."""
    chips = list(mm["step_seconds"])
    lines = [f"MTP head in the Metal graph, MODELLED (encode-only, {mm['n_layers']}-layer head, {mm['pairs']} pairs, "
             f"context {mm['context']}; simulator-verified, hardware-unverified): a round of k drafts, one command "
             "buffer, vs one decode step",
             f"{'k':>3} {'disp':>5} {'levels':>6} {'GB':>6} " + " ".join(f"{c:>18}" for c in chips),
             f"{'step':>23} " + " ".join(f"{1e3 * mm['step_seconds'][c]:>16.2f}ms" for c in chips)]
    for k, r in mm["rounds"].items():
        cells = " ".join(f"{1e3 * r['seconds'][c]:>7.2f}ms ({r['seconds'][c] / mm['step_seconds'][c]:.2f}x)"
                         for c in chips)
        lines.append(f"{k:>3} {r['dispatches']:>5} {r['levels']:>6} {r['bytes'] / 1e9:>6.2f} {cells}")
    return lines


def _len(x) -> str:
    """A mean accepted length for the table ("-": nothing was drafted)."""
    return "-" if x is None else f"{x:.2f}"

"""``qwenmetal bench --batch 1,2,4,8``: what one batched decode step over B sessions costs (session.decode_batch).

For each batch size B: B sessions forked from one prefilled context (`--context` tokens), each given a
different first token, then greedy steps of ``decode_batch`` over all B of them. The batch sizes are timed in
turn within each round (the first round warms every shape up and is not counted), and the median over rounds
of the mean step time is reported: ms per step, aggregate tok/s (B / step), per-stream tok/s (1 / step) and the
aggregate against B = 1.

Beside the times, the **union floor**: the weight bytes a step over B rows must read, however the engine
schedules it -- every non-expert weight once (attention / GDN projections, norms, router, shared expert,
lm_head; B embedding rows), each MoE layer's *distinct* experts of the B rows once, plus the B rows' own KV
cache and GDN state. The distinct experts are measured where they can be: a twin of the model with an expert
cache of every expert (``expert_slots = num_experts``, the streaming path, which asks the cache for each
layer's union of the rows' experts once per step) runs the same steps on the same tokens, and its lookups per
step and MoE layer are the distinct count. Where the twin cannot load (a backend without expert streaming, or
``--batch-routing random``), the expected count under uniform independent routing E * (1 - (1 - k/E)^B) is used;
the result names which (``routing``).

The 2-row verification against one decode step (`bench --speculative`'s first table) is measured beside it, at
the same context: both amortise weight reads over rows, and the targets are stated together
(docs/benchmarks.md, "Batched decode").

With ``--backend metal-sim --encode-only`` the Metal graph's batched step (`GpuEngine.decode_batch`: B
independent sequences in one command buffer, every weight read once for all rows, the union-read MoE) is
costed instead (`batch_modelled`): encoded on an encode-only simulator device over virtual weights of the real
config and timed with the chip model of `bench.cost` (bytes / bandwidth per dependency level, plus a per-level
latency). Those figures are MODELLED, not measured: simulator-verified, hardware-unverified (docs/metal.md,
"The batched decode step").
"""
from __future__ import annotations

import gc
import time
from typing import Callable

import numpy as np

from ..native import core
from ..session import decode_batch
from ..weights_table import config_dict, virtual_weight_table
from .bytes_model import _category, decode_bytes, tensor_sizes
from .cost import (
    CHIP_BANDWIDTH_GBS,
    CHIP_PEAK_TFLOPS,
    LEVEL_LATENCY_S,
    modelled_level_time,
)
from .speculative import verify_cost
from .timing import _median, fnv1a, synthetic_prompt

# targets to print ratios against (docs/benchmarks.md, "Targets"; not tests)
TARGETS = {"aggregate_vs_batch1": {4: 2.0, 8: 3.0}, "verify_2_rows_vs_step": 1.3}
WARMUP_STEPS = 2
MODELLED_BATCHES = (1, 2, 4, 8)
MODELLED = "modelled; simulator-verified, hardware-unverified"


def expected_distinct(num_experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts of `rows` tokens in one MoE layer when each token's top-k is a uniform random
    k-subset, independent of the others: E * (1 - (1 - k/E)^rows) (what the Metal union-read kernels declare
    they read: gpu.ops.moe_expected_union)."""
    E, k = num_experts, top_k
    return E * (1.0 - (1.0 - k / E) ** rows) if E else 0.0


def union_floor(config, sizes, context: int, rows: int, distinct: float, kv_element_bytes: int) -> dict:
    """Bytes one decode_batch step of `rows` sessions at `context` must read: the non-expert weights once (one
    embedding row per row), `distinct` experts per MoE layer once, and every row's KV cache and GDN state
    (decode_bytes' per-token figures, times `rows`)."""
    one = decode_bytes(config, sizes, context, kv_element_bytes)
    parts = one["weight_parts"]
    routed_all = sum(n for name, n in sizes.items() if _category(name) == "routed_experts")
    moe = sum(1 for i in range(config.num_hidden_layers) if config.is_moe_layer(i))
    per_expert = routed_all / (config.num_experts * moe) if moe and config.num_experts else 0.0
    non_expert = one["weights"] - parts["routed_experts"] - parts["embedding"] + rows * parts["embedding"]
    experts = distinct * moe * per_expert
    kv, state = rows * one["kv_cache"], rows * one["gdn_state"]
    return {"total": int(non_expert + experts + kv + state), "non_expert_weights": int(non_expert),
            "experts": int(experts), "kv_cache": int(kv), "gdn_state": int(state),
            "bytes_per_expert": per_expert, "moe_layers": moe}


def _first_tokens(first: int, rows: int, vocab: int, context: int) -> list:
    """Row 0 continues with the context's greedy token, row i > 0 with a token of the synthetic prompt past
    the context (so the rows route differently)."""
    others = [int(t) for t in synthetic_prompt(rows - 1, vocab, offset=context)] if rows > 1 else []
    return [first, *others]


def _steps(model, sessions, tokens, steps: int):
    """`steps` greedy decode_batch steps; returns (seconds per step, the rows' last tokens, the greedy tokens
    of every step)."""
    out = []
    t = time.perf_counter()
    for _ in range(steps):
        logits = decode_batch(model, sessions, tokens)
        tokens = [int(x) for x in np.argmax(logits, axis=1)]
        out.append(tokens)
    return (time.perf_counter() - t) / steps, tokens, out


def _base(model, context: int, max_context: int):
    V = model.config.vocab_size
    base = model.new_session(max_context=max_context)
    first = int(np.argmax(model.prefill(base, synthetic_prompt(context, V), return_logits="last")))
    return base, first


def time_batches(model, batches, context: int, steps: int, repeats: int) -> dict:
    """Median seconds per decode_batch step for each batch size, the sizes alternating within each round."""
    V = model.config.vocab_size
    base, first = _base(model, context, context + (repeats + 1) * (steps + WARMUP_STEPS) + 16)
    samples: dict = {B: [] for B in batches}
    digests: dict = {B: [] for B in batches}
    for r in range(repeats + 1):                   # round 0 warms every shape up
        for B in batches:
            sessions = [base.fork() for _ in range(B)]
            toks = _first_tokens(first, B, V, context)
            _, toks, _ = _steps(model, sessions, toks, WARMUP_STEPS)
            gc.collect()
            dt, _, out = _steps(model, sessions, toks, steps)
            if r:
                samples[B].append(dt)
                digests[B].append(fnv1a(t for row in out for t in row))
            del sessions
    return {B: {"seconds": _median(samples[B]), "samples_ms": [1e3 * x for x in samples[B]],
                "digest": digests[B][0], "digest_stable": len(set(digests[B])) == 1} for B in batches}


def count_distinct(model, batches, context: int, steps: int) -> dict | None:
    """Distinct experts per MoE layer and step for each batch size, measured on `model` (a twin with an expert
    cache of every expert: its lookups are the union of each step's rows) over the same tokens as the timed
    steps; None when the model has no expert counters."""
    c0 = model.expert_counters()
    if not c0 or not c0.get("streaming"):
        return None
    V = model.config.vocab_size
    moe = sum(1 for i in range(model.config.num_hidden_layers) if model.config.is_moe_layer(i))
    base, first = _base(model, context, context + steps + WARMUP_STEPS + 16)
    out = {}
    for B in batches:
        sessions = [base.fork() for _ in range(B)]
        _, toks, _ = _steps(model, sessions, _first_tokens(first, B, V, context), WARMUP_STEPS)
        before = model.expert_counters()["lookups"]
        _steps(model, sessions, toks, steps)
        out[B] = (model.expert_counters()["lookups"] - before) / (steps * moe)
        del sessions
    return out


def run_batch(model, batches, context: int, steps: int, repeats: int, log: Callable[[str], None],
              kv_element_bytes: int, counter=None) -> dict:
    """The batched-decode benchmark on `model` (see the module's docstring). `counter`: a twin of the model
    with an expert cache of every expert (the measured distinct experts), or None (the random-routing
    estimate)."""
    c = model.config
    limit = model.max_batch_rows
    if limit is not None and max(batches) > limit:
        raise ValueError(f"--batch: the {model.backend} backend runs at most {limit} sessions per decode_batch, "
                         f"got {max(batches)}")
    batches = tuple(sorted(set(batches)))
    timed = time_batches(model, batches, context, steps, repeats)
    measured = count_distinct(counter, batches, context, steps) if counter is not None else None
    sizes = tensor_sizes(model.weights)
    rows = {}
    t1 = timed[1]["seconds"] if 1 in timed else None        # batch 1's step
    for B in batches:
        t = timed[B]["seconds"]
        distinct = measured[B] if measured else expected_distinct(c.num_experts, c.num_experts_per_tok, B)
        floor = union_floor(c, sizes, context, B, distinct, kv_element_bytes)
        r = {"rows": B, "ms_per_step": 1e3 * t, "aggregate_tokens_per_second": B / t,
             "per_stream_tokens_per_second": 1.0 / t,
             "aggregate_vs_batch1": B * t1 / t if t1 else None,
             "distinct_experts_per_layer": distinct,
             "floor_bytes_per_step": floor["total"], "floor": floor,
             "floor_gbps": floor["total"] / t / 1e9, **timed[B]}
        r.pop("seconds")
        rows[B] = r
        agg = f" = {r['aggregate_vs_batch1']:.2f}x batch 1" if t1 else ""
        log(f"  batch {B:2d} @ {context}: {r['ms_per_step']:8.2f} ms/step, {r['aggregate_tokens_per_second']:7.2f} "
            f"tok/s aggregate{agg}, {distinct:.1f} distinct experts/layer, floor {floor['total'] / 1e6:.1f} MB/step")
    if 1 in rows:
        f1 = rows[1]["floor_bytes_per_step"]
        for r in rows.values():
            r["floor_vs_batch1"] = r["floor_bytes_per_step"] / f1
            r["time_vs_batch1"] = r["ms_per_step"] / rows[1]["ms_per_step"]
    v = verify_cost(model, context, rows=(2,), repeats=max(repeats, 3))
    ver = {"context": context, "step_ms": v["step_ms"], "rows_2_ms": v["rows"][2]["ms"],
           "vs_step": v["rows"][2]["vs_step"]}
    log(f"  verify 2 rows @ {context}: {ver['rows_2_ms']:.2f} ms = {ver['vs_step']:.2f}x a decode step "
        f"({ver['step_ms']:.2f} ms)")
    return {"mode": "batch", "context": context, "steps": steps, "repeats": repeats, "warmup_steps": WARMUP_STEPS,
            "routing": ("measured (an expert-cache twin's lookups per step and MoE layer)" if measured else
                        "random (expected distinct experts E*(1-(1-k/E)^B))"),
            "routing_measured": bool(measured),
            "statistic": "median over rounds of the mean step time; batch sizes alternate within a round",
            "batches": {str(B): r for B, r in rows.items()}, "verify": ver, "targets": TARGETS}


def _mark(value, target, le=False) -> str:
    if value is None:
        return "-"
    ok = value <= target if le else value >= target
    return f"{value:.2f}x ({'meets' if ok else 'below'} {'<=' if le else '>='} {target}x)"


def format_batch(res: dict) -> str:
    lines = [f"batched decode (decode_batch) at context {res['context']}: {res['steps']} steps x {res['repeats']} "
             f"rounds after {res['warmup_steps']} warm-up steps; {res['statistic']}",
             f"distinct experts: {res['routing']}",
             f"{'rows':>5} {'ms/step':>9} {'agg tok/s':>10} {'per stream':>10} {'vs B=1':>7} {'experts':>8} "
             f"{'floor MB':>9} {'floor x':>8} {'time x':>7} {'floor GB/s':>10}  digest"]
    tgt = res["targets"]["aggregate_vs_batch1"]
    for B, r in res["batches"].items():
        vs = "-" if r.get("aggregate_vs_batch1") is None else f"{r['aggregate_vs_batch1']:.2f}x"
        fx = f"{r['floor_vs_batch1']:.2f}" if "floor_vs_batch1" in r else "-"
        tx = f"{r['time_vs_batch1']:.2f}" if "time_vs_batch1" in r else "-"
        lines.append(f"{B:>5} {r['ms_per_step']:>9.2f} {r['aggregate_tokens_per_second']:>10.2f} "
                     f"{r['per_stream_tokens_per_second']:>10.2f} {vs:>7} {r['distinct_experts_per_layer']:>8.1f} "
                     f"{r['floor_bytes_per_step'] / 1e6:>9.2f} {fx:>8} {tx:>7} {r['floor_gbps']:>10.2f}  "
                     f"{r['digest']}{'' if r['digest_stable'] else ' (UNSTABLE)'}")
    lines.append("floor: non-expert weights once + distinct experts per MoE layer once + every row's KV and GDN "
                 "state; floor x / time x: against batch 1 (time growing like the floor: bound by reads; faster "
                 "than it: bound by per-row work)")
    marks = [f"{B} rows: aggregate {_mark(res['batches'][str(B)].get('aggregate_vs_batch1'), t)} batch 1"
             for B, t in tgt.items() if str(B) in res["batches"]]
    v = res.get("verify")
    if v:
        marks.append(f"verify 2 rows {v['rows_2_ms']:.2f} ms / step {v['step_ms']:.2f} ms = "
                     f"{_mark(v['vs_step'], res['targets']['verify_2_rows_vs_step'], le=True)}")
    if marks:
        lines.append("targets: " + "; ".join(marks))
    if res.get("foreign_load") is not None:
        lines.append(f"other processes used {100 * res['foreign_load']:.0f}% of the CPUs during the run"
                     + (f" ({100 * res['busy_before']:.0f}% just before it)" if res.get("busy_before") is not None else ""))
    return "\n".join(lines)


# ---- the Metal graph's batched step, modelled (encode-only) ---------------------------------------
def batch_modelled(config, batches=MODELLED_BATCHES, *, context: int = 4096, dtype: str = "bfloat16",
                   kv_dtype: str = "bfloat16") -> dict:
    """Encode the batched decode step of ``config`` (a ModelConfig) at B = each of ``batches`` sequences of
    ``context`` cached tokens on an encode-only simulator device, and the 2-row verification and one decode
    step beside it; per chip (CHIP_BANDWIDTH_GBS): the modelled step time, aggregate and per-sequence tok/s
    and their ratio to batch 1, and the bytes against the union floor (`union_floor`). A model, not a
    measurement."""
    ext = core()
    mappings, tensors, sizes = virtual_weight_table(config)
    dev = ext.gpu.SimDevice(execute=False)
    eng = ext.gpu.GpuEngine(dev, config_dict(config), mappings, tensors, "f32" if dtype == "float32" else "bf16",
                             kv_dtype == "float32", {}, [])
    kvb = 4 if kv_dtype == "float32" else 2

    def state():
        s = eng.new_state()
        s._set_position(int(context))      # an encode-only state: the KV cache reserved, nothing computed
        return s

    def timed(cost) -> dict:
        return {chip: modelled_level_time(cost["level_bytes"], cost["level_flops"], bw, CHIP_PEAK_TFLOPS[chip])
                for chip, bw in CHIP_BANDWIDTH_GBS.items()}

    step = eng.encode_cost(state())
    t_step = timed(step)
    out = {"context": int(context), "status": MODELLED, "level_latency_us": LEVEL_LATENCY_S * 1e6,
           "layers": int(config.num_hidden_layers),
           "step": {"levels": int(step["levels"]), "bytes": int(step["bytes_read"] + step["bytes_written"]),
                    "seconds": t_step},
           "batches": {}}
    for b in batches:
        states = [state() for _ in range(int(b))]
        c = eng.batch_cost(states)
        moved = int(c["bytes_read"] + c["bytes_written"])
        experts = expected_distinct(config.num_experts, config.num_experts_per_tok, int(b))
        floor = union_floor(config, sizes, context, int(b), experts, kvb)
        t = timed(c)
        out["batches"][int(b)] = {
            "levels": int(c["levels"]), "dispatches": int(c["dispatches"]), "bytes": moved,
            "union_floor": int(floor["total"]), "bytes_vs_union_floor": moved / floor["total"],
            "expected_experts": experts,
            "chips": {chip: {"seconds": s, "aggregate_tok_s": b / s, "per_stream_tok_s": 1.0 / s}
                      for chip, s in t.items()}}
    one = out["batches"].get(1)
    for b, r in out["batches"].items():
        for chip, v in r["chips"].items():
            v["vs_step"] = v["seconds"] / t_step[chip]
            if one:
                base = one["chips"][chip]
                v["aggregate_vs_b1"] = v["aggregate_tok_s"] / base["aggregate_tok_s"]
                v["per_stream_vs_b1"] = v["per_stream_tok_s"] / base["per_stream_tok_s"]
    v2 = eng.verify_cost(state(), 2)
    tv = timed(v2)
    out["verify2"] = {"levels": int(v2["levels"]), "bytes": int(v2["bytes_read"] + v2["bytes_written"]),
                      "chips": {chip: {"seconds": s, "vs_step": s / t_step[chip]} for chip, s in tv.items()}}
    return out


def format_modelled(res: dict) -> str:
    """`batch_modelled`'s result as a table."""
    chips = list(CHIP_BANDWIDTH_GBS)
    lines = [f"Metal graph batched decode step, MODELLED (encode-only, {res['layers']} layers, context "
             f"{res['context']} per sequence; {res['status']}); one decode step: {res['step']['levels']} levels, "
             f"{res['step']['bytes'] / 1e6:.1f} MB",
             f"{'B':>3} {'levels':>6} {'MB':>8} {'union floor':>11} {'vs floor':>8} {'experts':>7}  "
             + "  ".join(f"{c + ' agg tok/s (x B=1) / per-seq':>34}" for c in chips)]
    for b, r in res["batches"].items():
        cells = "  ".join(f"{v['aggregate_tok_s']:>12.1f} ({v.get('aggregate_vs_b1', 1):.2f}x) / "
                          f"{v['per_stream_tok_s']:>6.1f} ({v.get('per_stream_vs_b1', 1):.2f}x)"
                          for v in r["chips"].values())
        lines.append(f"{b:>3} {r['levels']:>6} {r['bytes'] / 1e6:>8.1f} {r['union_floor'] / 1e6:>11.1f} "
                     f"{r['bytes_vs_union_floor']:>8.3f} {r['expected_experts']:>7.1f}  {cells}")
    v = res["verify2"]
    lines.append("2-row verification vs one decode step: " + ", ".join(
        f"{c} {x['vs_step']:.2f}x" for c, x in v["chips"].items()) + f" ({v['levels']} levels)")
    lines.append(f"modelled: bytes / bandwidth + levels x {res['level_latency_us']:.1f} us; the union floor assumes "
                 "uniform random routing (expected distinct experts of the B rows)")
    return "\n".join(lines)

"""The Metal graph's batched decode step (`GpuEngine.decode_batch`: B independent sequences in one command
buffer, every weight read once for all rows, the union-read MoE), costed encode-only on the real config over
virtual weights and timed with the chip model of `bench.cost` (bytes / bandwidth per dependency level, plus a
per-level latency). Every figure here is MODELLED, not measured: simulator-verified, hardware-unverified
(docs/metal.md, "The batched decode step")."""
from __future__ import annotations

from ..native import core
from ..weights_table import config_dict, virtual_weight_table
from .bytes_model import _category, session_bytes
from .cost import CHIP_BANDWIDTH_GBS, CHIP_PEAK_TFLOPS, LEVEL_LATENCY_S, modelled_level_time

BATCHES = (1, 2, 4, 8)
STATUS = "modelled; simulator-verified, hardware-unverified"


def expected_union(n_experts: int, k: int, rows: int) -> float:
    """Distinct experts `rows` rows choose in expectation when each picks k of n_experts uniformly at random
    (the routing the union-read kernels' declared bytes assume: gpu.ops.moe_expected_union)."""
    return n_experts * (1.0 - (1.0 - k / n_experts) ** rows)


def union_floor(config, sizes, context: int, rows: int, kv_element_bytes: int = 2) -> dict:
    """Bytes a batched step of `rows` sequences at `context` cached tokens each must move if every weight is
    read once: the non-expert weights (one embedding row per sequence), the expected union of the rows'
    routed experts (expected_union / E of each layer's experts), and each sequence's KV cache (read, plus the
    new row written) and GDN state (read and written)."""
    c = config
    u = expected_union(c.num_experts, c.num_experts_per_tok, rows)
    parts: dict = {}
    for name, n in sizes.items():
        cat = _category(name)
        if cat == "routed_experts":
            n = n * u / c.num_experts
        elif cat == "embedding":
            n = n * rows / c.vocab_size
        parts[cat] = parts.get(cat, 0) + n
    weights = sum(parts.values())
    held = session_bytes(c, int(context) + 1, kv_element_bytes)
    kv, state = rows * held["kv_cache"], rows * 2 * held["gdn_state"]
    return {"total": weights + kv + state, "weights": weights, "kv_cache": kv, "gdn_state": state,
            "expected_experts": u, "weight_parts": parts}


def batch_modelled(config, batches=BATCHES, *, context: int = 4096, dtype: str = "bfloat16",
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
    out = {"context": int(context), "status": STATUS, "level_latency_us": LEVEL_LATENCY_S * 1e6,
           "layers": int(config.num_hidden_layers),
           "step": {"levels": int(step["levels"]), "bytes": int(step["bytes_read"] + step["bytes_written"]),
                    "seconds": t_step},
           "batches": {}}
    for b in batches:
        states = [state() for _ in range(int(b))]
        c = eng.batch_cost(states)
        moved = int(c["bytes_read"] + c["bytes_written"])
        floor = union_floor(config, sizes, context, int(b), kvb)
        t = timed(c)
        out["batches"][int(b)] = {
            "levels": int(c["levels"]), "dispatches": int(c["dispatches"]), "bytes": moved,
            "union_floor": int(floor["total"]), "bytes_vs_union_floor": moved / floor["total"],
            "expected_experts": floor["expected_experts"],
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


def format_batch(res: dict) -> str:
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

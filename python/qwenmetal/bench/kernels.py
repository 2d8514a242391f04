"""`qwenmetal bench --backend metal-sim --kernels`: per kernel, what the cost model cannot see from bytes and
FLOPs -- threadgroups resident per GPU core on each Apple GPU family, the cores its grid fills, its
threadgroup-memory bank conflicts -- and the modelled fraction of its bound (bench.occupancy).

Two runs, because an encode-only device runs nothing:

1. **Counting run** (executes): a small fixture model (default: the tests' ``tiny`` preset at the real config's
   head sizes, :func:`count_config`) on a ``SimDevice(count_banks=True)`` runs a prefill of two chunks and a few decode steps, so every kernel of the
   decode step and of the prefill (the chunked GDN form, the simdgroup GEMM route) executes and its bank
   conflicts are counted, and its threadgroup memory is seen.
2. **Shapes of the real config** (encode-only): the decode step and one prefill chunk of the real config
   (bench.cost) give each kernel's dispatches, threads per threadgroup and grid at the real widths.
   Threadgroup memory and bank conflicts are per-pipeline facts (a pipeline's threadgroup arrays do not
   depend on the model's dimensions), so they are taken from the counting run.

Modelled, not measured; simulator-verified, hardware-unverified. The access pattern of the small model's
dispatches stands in for the real one's (same kernels, same tiles; their grids differ).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from ..backends.metal import DEFAULT_PREFILL_CHUNK
from ..model import Model
from .checkpoint import ensure_checkpoint, resolve_config
from .cost import (
    CHIP_BANDWIDTH_GBS,
    CHIP_PEAK_TFLOPS,
    encode_only_cost,
    encode_only_prefill_cost,
)
from .occupancy import (
    CHIP_CORES,
    FAMILY_LABEL,
    GPU_FAMILIES,
    kernel_fractions,
    replays_of,
    resident_per_core,
)

FRACTION_CHIPS = ("M1 Max", "M5 Max")


def count_config() -> dict:
    """The tiny preset with the real config's head sizes: attention 16 query / 2 KV heads of 256 (64 rotary
    dims), Gated DeltaNet key and value heads of 128. The kernels whose instantiation follows a head size
    (attn_prefill_d<N>, gdn_step_*_dk<N>) and whose tile strides do (the bank conflicts) are then the ones the
    real config runs; the tiny hidden size, layer and expert counts keep the run to seconds."""
    cfg = resolve_config("tiny", None)
    t = cfg["text_config"]
    t.update(head_dim=256, num_attention_heads=16, num_key_value_heads=2, linear_key_head_dim=128,
             linear_value_head_dim=128)
    t["rope_parameters"] = dict(t["rope_parameters"], mrope_section=[11, 11, 10])   # 64 rotary dims
    return cfg


def count_kernels(config: str | Mapping | None = None, *, dtype: str = "bfloat16", prompt: int = 24, chunk: int = 16,
                  decode: int = 2, seed: int = 0, log: Callable[[str], None] | None = None) -> dict:
    """Run a prefill of `prompt` tokens (chunks of `chunk`) and `decode` steps of the fixture model `config`
    (default count_config()) on a bank-counting simulator device; returns SimDevice.kernel_stats()."""
    path = ensure_checkpoint(count_config() if config is None else resolve_config(config, None), seed, log=log)
    # the long-context routes the real config takes at thousands of tokens: the chunked GDN prefill and the
    # split decode attention (partials + combine) already at this short context
    model = Model.load(str(path), backend="metal-sim", dtype=dtype, prefill_chunk=chunk, gdn_route="chunked",
                       attention={"single_pass_max": 8}, device_options={"count_banks": True})
    s = model.new_session()
    ids = [(i * 2654435761) % 2**32 % model.config.vocab_size for i in range(prompt)]
    model.prefill(s, ids, return_logits="last")
    model.decode_step(s, ids[0])
    model.decode_loop(s, ids[1], decode)                                      # greedy: GPU argmax
    model.decode_loop(s, ids[2], decode, temperature=0.8, top_k=20, top_p=0.9, seed=1)   # GPU sampling
    return model.backend_info()["kernel_stats"]


def kernel_table(real_config, counted: Mapping, *, context: int = 4096, chunk: int = DEFAULT_PREFILL_CHUNK,
                 kv_dtype: str = "bfloat16") -> dict:
    """The per-kernel table: the real config's decode step at `context` and one prefill chunk of `chunk` rows
    (encode-only), with `counted` (count_kernels) for threadgroup memory and bank conflicts. Also the decode
    step's and the chunk's modelled tok/s at the bound and with occupancy and conflicts."""
    replays = replays_of(counted)
    dec = encode_only_cost(real_config, context=context, kv_dtype=kv_dtype, tokens=1, kernel_stats=counted)
    pre = encode_only_prefill_cost(real_config, (chunk,), chunk=chunk, kv_dtype=kv_dtype, kernel_stats=counted)
    dec_bound = encode_only_cost(real_config, context=context, kv_dtype=kv_dtype, tokens=1)
    phases = {"decode": dec.pop("records"), "prefill": pre["records"].get("simdgroup", []),
              "prefill (tensor)": pre["records"].get("tensor", [])}
    rows: dict = {}
    for phase, recs in phases.items():
        fr = {chip: kernel_fractions(recs, CHIP_BANDWIDTH_GBS[chip], CHIP_PEAK_TFLOPS[chip], CHIP_CORES[chip],
                                     replays) for chip in FRACTION_CHIPS}
        for r in recs:
            k = r["kernel"]
            if phase == "prefill (tensor)" and (k, "prefill") in rows:
                continue
            e = rows.setdefault((k, phase), {"kernel": k, "phase": phase, "dispatches": 0, "threads_per_threadgroup": 0,
                                             "threadgroups": 0, "threadgroup_memory": None})
            e["dispatches"] += 1
            t = r["threads_per_threadgroup"]
            e["threads_per_threadgroup"] = max(e["threads_per_threadgroup"], int(t[0]) * int(t[1]) * int(t[2]))
            g = r["threadgroups"]
            e["threadgroups"] = max(e["threadgroups"], int(g[0]) * int(g[1]) * int(g[2]))
            tgm = r.get("threadgroup_memory")
            if tgm is not None and tgm >= 0:
                e["threadgroup_memory"] = max(e["threadgroup_memory"] or 0, int(tgm))
        for (k, ph), e in rows.items():
            if ph == phase:
                e["fraction_of_bound"] = {chip: fr[chip][k]["fraction"] for chip in FRACTION_CHIPS}
    for e in rows.values():
        c = counted.get(e["kernel"])
        if c and c.get("threadgroup_memory") is not None:
            e["threadgroup_memory"] = max(e["threadgroup_memory"] or 0, int(c["threadgroup_memory"]))
        b = c.get("banks") if c else None
        e["counted"] = bool(b)
        e["bank_accesses"] = b["accesses"] if b else None
        e["conflicted_share"] = (b["conflicted"] / b["accesses"] if b["accesses"] else 0.0) if b else None
        e["replays_per_access"] = b["replays_per_access"] if b else None
        e["resident_per_core"] = {fam: resident_per_core(e["threads_per_threadgroup"], e["threadgroup_memory"], fam)
                                  for fam in GPU_FAMILIES}
    return {"status": "simulator-verified, hardware-unverified; modelled, not measured",
            "context": int(context), "chunk": int(chunk),
            "decode": {"at_bound": dec["modelled_tok_s"], "occupancy_only": dec_bound["modelled_tok_s_occupancy"],
                       "occupancy_and_conflicts": dec["modelled_tok_s_occupancy"]},
            "prefill": {"at_bound": pre["prompts"][str(chunk)]["modelled_tok_s"],
                        "occupancy_and_conflicts": pre["prompts"][str(chunk)]["modelled_tok_s_occupancy"]},
            "kernels": sorted(rows.values(), key=lambda e: (e["phase"], e["kernel"]))}


def format_kernels(res: Mapping[str, Any]) -> str:
    fams = list(GPU_FAMILIES)
    lines = [f"metal-sim per-kernel table ({res['status']}): real config, decode at {res['context']} tokens of "
             f"context, one prefill chunk of {res['chunk']} rows",
             f"{'phase':<16} {'kernel':<40} {'disp':>4} {'thr/tg':>6} {'tgs':>7} {'tg mem':>7} "
             + " ".join(f"{FAMILY_LABEL[f]:>5}" for f in fams)
             + f" {'replay/acc':>10} {'confl %':>7} " + " ".join(f"{c:>8}" for c in FRACTION_CHIPS)]
    for e in res["kernels"]:
        tgm = "?" if e["threadgroup_memory"] is None else str(e["threadgroup_memory"])
        rp = "-" if e["replays_per_access"] is None else f"{e['replays_per_access']:.3f}"
        cs = "-" if e["conflicted_share"] is None else f"{100 * e['conflicted_share']:.1f}"
        lines.append(f"{e['phase']:<16} {e['kernel'][:40]:<40} {e['dispatches']:>4} {e['threads_per_threadgroup']:>6} "
                     f"{e['threadgroups']:>7} {tgm:>7} "
                     + " ".join(f"{e['resident_per_core'][f]['resident']:>5}" for f in fams)
                     + f" {rp:>10} {cs:>7} "
                     + " ".join(f"{e['fraction_of_bound'][c]:>8.3f}" for c in FRACTION_CHIPS))
    lines.append("columns: dispatches per decode step / prefill chunk; threads per threadgroup; threadgroups (largest "
                 "grid); threadgroup memory (bytes; ? = the kernel did not run in the counting model); threadgroups "
                 "resident per core by family (threads and threadgroup memory; registers not modelled; M3-M5 limits "
                 "assumed); bank-conflict replays per SIMD-group access and share of accesses conflicted (counting "
                 "model; - = not run there); modelled fraction of the kernel's bound (cores its grid fills x conflicts)")
    d, p = res["decode"], res["prefill"]
    lines.append("modelled decode tok/s (at the bound / occupancy / occupancy + conflicts): "
                 + ", ".join(f"{c} {d['at_bound'][c]:.0f}/{d['occupancy_only'][c]:.0f}/"
                             f"{d['occupancy_and_conflicts'][c]:.0f}" for c in d["at_bound"]))
    lines.append(f"modelled prefill tok/s, chunk of {res['chunk']} (at the bound / occupancy + conflicts): "
                 + ", ".join(f"{c} {p['at_bound'][c]:.0f}/{p['occupancy_and_conflicts'][c]:.0f}"
                             for c in p["at_bound"]))
    return "\n".join(lines)

"""The Metal graph's cost model: what a decode step, a prefill and a verification of the real model cost on
an encode-only simulator device over virtual weights (dispatches, dependency levels, command buffers, bytes
and FLOPs per level), and the modelled tokens per second on named Apple chips from those figures. Nothing
runs and no weights are read; every figure here is modelled (docs/metal.md, "Cost model")."""
from __future__ import annotations

import numpy as np

from ..backends.metal import DEFAULT_PREFILL_CHUNK, prefill_options, vision_dims
from ..config import VisionConfig, mtp_layer_config
from ..native import core
from ..weights_table import config_dict, virtual_mtp_weight_table, virtual_weight_table
from .bytes_model import decode_bytes
from .occupancy import CHIP_CORES, records_seconds, replays_of


def encode_only_cost(config, *, context: int = 4096, dtype: str = "bfloat16", kv_dtype: str = "bfloat16",
                     tokens: int = 4, attention: dict | None = None, bits: int = 4,
                     expert_bits: int | None = None, kernel_stats: dict | None = None) -> dict:
    """Encode decode steps of ``config`` (a ModelConfig) on an encode-only simulator device with virtual
    weights (the MLX layout at ``bits``, the routed experts at ``expert_bits``, default ``bits``) at
    ``context`` cached tokens, and report what one step costs: dispatches, dependency levels, command buffers
    and host waits per token of the pipelined decode loop, bytes per token as declared by the host functions
    (a matrix's rows * cols * bits / 8 + scales and biases, so they follow the width) against the floor
    (weights touched + GDN state + KV). ``modelled_tok_s`` is the roofline at the bound;
    ``modelled_tok_s_occupancy`` the same step with each dispatch at its modelled efficiency (bench.occupancy:
    the cores its grid fills, and the bank-conflict replays of ``kernel_stats``, a counting device's
    SimDevice.kernel_stats(), when given); ``records``: the step's dispatch records."""
    ext = core()
    mappings, tensors, sizes = virtual_weight_table(config, bits=bits, expert_bits=expert_bits)
    dev = ext.gpu.SimDevice(execute=False, keep_records=True)
    eng = ext.gpu.GpuEngine(dev, config_dict(config), mappings, tensors, "f32" if dtype == "float32" else "bf16",
                             kv_dtype == "float32", dict(attention or {}), [])
    st = eng.new_state()
    st._set_position(int(context))          # an encode-only state: the KV cache reserved, nothing computed
    step = eng.encode_cost(st)
    records = dev.records()
    dev.reset_counters()
    eng.decode(st, 0, int(tokens), greedy=True)
    k = dev.counters()
    floor = decode_bytes(config, sizes, context, kv_element_bytes=4 if kv_dtype == "float32" else 2)
    moved = int(step["bytes_read"] + step["bytes_written"])
    replays = replays_of(kernel_stats)
    occ = {chip: 1.0 / records_seconds(records, bw, CHIP_PEAK_TFLOPS[chip], CHIP_CORES[chip], LEVEL_LATENCY_S,
                                       replays)[1] for chip, bw in CHIP_BANDWIDTH_GBS.items()}
    return {"dispatches": int(step["dispatches"]), "levels": int(step["levels"]),
            "command_buffers": k["command_buffers"] / tokens, "host_waits": k["host_waits"] / tokens,
            "bytes_per_token": moved, "floor_bytes": int(floor["total"]), "bytes_vs_floor": moved / floor["total"],
            "modelled_tok_s": modelled_tok_s(moved, int(step["levels"])), "modelled_tok_s_occupancy": occ,
            "level_latency_us": LEVEL_LATENCY_S * 1e6, "floor": floor, "context": int(context),
            "records": records}


# Memory bandwidth of the Max chips (Apple's figures) and the per-level latency of the model below.
CHIP_BANDWIDTH_GBS = {"M1 Max": 400.0, "M2 Max": 400.0, "M3 Max": 400.0, "M4 Max": 546.0, "M5 Max": 614.0}
# Calibrated from Lily's published decode on an M5 Max (docs/benchmarks.md, "Published figures"): 194 tok/s
# at 256 tokens of context = 5.15 ms per token for about 1.80 GB moved (1.67 GB weights + 126 MB GDN state
# + KV), which is 2.93 ms at the full 614 GB/s; the other 2.22 ms over Lily's ~555 dependency levels is
# ~4 us per level.
# (Assumes Lily's bandwidth-bound kernels stream at the chip's full rate: the latency is an upper estimate.)
LEVEL_LATENCY_S = 4.0e-6


def modelled_tok_s(bytes_per_token: float, levels: int, latency_s: float = LEVEL_LATENCY_S,
                   bandwidth_gbs: dict | None = None) -> dict:
    """tokens/s = 1 / (bytes / bandwidth + levels * latency) for each chip of ``bandwidth_gbs`` (name -> GB/s;
    default CHIP_BANDWIDTH_GBS)."""
    chips = CHIP_BANDWIDTH_GBS if bandwidth_gbs is None else bandwidth_gbs
    return {chip: 1.0 / (bytes_per_token / (bw * 1e9) + levels * latency_s) for chip, bw in chips.items()}


# ------------------------------------------------------------------------------------------ prefill costing
# Peak arithmetic of each chip on the route its prefill GEMMs take (TFLOP/s; a multiply-add is 2):
#   simdgroup_matrix (M1-M4): bf16/f16 simdgroup matrices run at the FP32 ALU rate on these GPUs, so the
#   FP32 peak: Apple's figures for M1 Max (32-core GPU, 10.4) and M2 Max (38-core, 13.6); M3 Max and M4 Max
#   (40-core; Apple publishes none) derived as cores x 128 FP32 lanes x 2 x clock (~1.6 GHz, ~1.8 GHz).
#   Metal 4 tensor ops (M5 Max, 40-core): Apple's claim of over 4x the M4's peak GPU compute for AI, applied
#   to the M4 Max figure (4 x 18.4). Lily's published M5 Max prefill (docs/benchmarks.md, "Published
#   figures"), which uses these tensor ops, implies an achieved rate that `encode_only_prefill_cost`
#   reports beside it as a check.
CHIP_PEAK_TFLOPS = {"M1 Max": 10.4, "M2 Max": 13.6, "M3 Max": 16.4, "M4 Max": 18.4, "M5 Max": 73.6}
# The rate Lily's published M5 Max 4K prefill (5724 tok/s) implies on this graph's declared FLOPs at 4K
# (5.4 GFLOP/token: `lily_implied_tflops`), 42 % of the peak above: the M5 Max is also modelled at this
# rate ("M5 Max (Lily's rate)"), i.e. as if our kernels reached only what Lily's reach.
M5_LILY_RATE_TFLOPS = 30.9
CHIP_ROUTE = {"M1 Max": "simdgroup", "M2 Max": "simdgroup", "M3 Max": "simdgroup", "M4 Max": "simdgroup",
              "M5 Max": "tensor"}
# Published M5 Max prefill tokens/s (Lily's 0.32.2-run column and MLX 0.32.2; docs/benchmarks.md, "Published
# figures").
PUBLISHED_PREFILL = {"Lily": {4096: 5724.4, 32768: 3927.5, 131072: 1792.7},
                     "MLX 0.32.2": {4096: 5165.7, 32768: 3963.7, 131072: 2237.5}}


def modelled_level_time(level_bytes, level_flops, bandwidth_gbs: float, peak_tflops: float,
                        latency_s: float = LEVEL_LATENCY_S) -> float:
    """Seconds for a command buffer's dependency levels: each level costs max(bytes / bandwidth,
    flops / peak) + the per-level latency (the levels run one after another; a level's dispatches overlap)."""
    b = np.asarray(level_bytes, dtype=np.float64)
    f = np.asarray(level_flops, dtype=np.float64)
    return float(np.maximum(b / (bandwidth_gbs * 1e9), f / (peak_tflops * 1e12)).sum() + len(b) * latency_s)


def slowest_chip() -> dict:
    """The slowest supported Apple GPU as the graph and SimDevice model it (src/gpu/cost.h): name,
    bandwidth_gbs, peak_tflops, and the watchdog budget / per-command-buffer target in seconds."""
    return dict(core().gpu.slowest_chip())


def max_command_buffer_seconds(cost: dict, bandwidth_gbs: float, peak_tflops: float) -> float:
    """The modelled GPU time of the longest command buffer of a costed call (a StepCost dict: level_bytes,
    level_flops and command_buffer_levels, the first level of each command buffer)."""
    b, f = cost["level_bytes"], cost["level_flops"]
    starts = [int(x) for x in cost["command_buffer_levels"]] + [len(b)]
    return max((modelled_level_time(b[lo:hi], f[lo:hi], bandwidth_gbs, peak_tflops)
                for lo, hi in zip(starts, starts[1:]) if hi > lo), default=0.0)


def encode_only_prefill_cost(config, lengths=(4096,), *, chunk: int = DEFAULT_PREFILL_CHUNK,
                             dtype: str = "bfloat16", kv_dtype: str = "bfloat16", gdn_route: str = "auto",
                             chips: dict | None = None, kernel_stats: dict | None = None) -> dict:
    """Encode the prefill of ``config`` (a ModelConfig) for each prompt length, chunk by chunk (each cut into
    command buffers of at most the graph's target time on the slowest GPU), on an encode-only simulator device over virtual weights (the MLX 4-bit layout), once per
    GEMM route of CHIP_ROUTE, and report per chunk and per prompt: dispatches, dependency levels, command
    buffers, host waits, FLOPs and bytes as the host functions declare them, and a modelled tokens/s per
    chip (`modelled_level_time` with CHIP_BANDWIDTH_GBS / CHIP_PEAK_TFLOPS). ``chips``: more chips to model
    beside the Max chips, name -> (bandwidth_gbs, peak_tflops, route) (`qwenmetal selftest`'s GPU). A model,
    not a measurement. ``modelled_tok_s_occupancy``: the Max chips with each dispatch at its modelled
    efficiency (bench.occupancy; bank-conflict replays from ``kernel_stats`` when given); ``records``: the
    dispatch records of the first chunk of the longest prompt on each route."""
    ext = core()
    mappings, tensors, _ = virtual_weight_table(config)
    slow = slowest_chip()
    # the longest command buffer per chip: the slowest supported GPU on the simdgroup route, and each Max chip
    cb_chips = {slow["name"]: (slow["bandwidth_gbs"], slow["peak_tflops"], "simdgroup")}
    cb_chips.update({c: (CHIP_BANDWIDTH_GBS[c], CHIP_PEAK_TFLOPS[c], CHIP_ROUTE[c]) for c in CHIP_ROUTE})
    extra = {c: v for c, v in (chips or {}).items() if c not in CHIP_ROUTE}
    cb_chips.update(extra)
    out = {"chunk": int(chunk), "level_latency_us": LEVEL_LATENCY_S * 1e6, "peak_tflops": dict(CHIP_PEAK_TFLOPS),
           "bandwidth_gbs": dict(CHIP_BANDWIDTH_GBS), "chip_route": dict(CHIP_ROUTE),
           "m5_lily_rate_tflops": M5_LILY_RATE_TFLOPS, "watchdog_budget_ms": slow["watchdog_seconds"] * 1e3,
           "prompts": {}}
    replays = replays_of(kernel_stats)
    out["records"] = {}
    for route in sorted(set(CHIP_ROUTE.values())):
        # an M5-like device for "tensor"
        dev = ext.gpu.SimDevice(execute=False, tensor_ops=route == "tensor", keep_records=True)
        eng = ext.gpu.GpuEngine(dev, config_dict(config), mappings, tensors, "f32" if dtype == "float32" else "bf16",
                                 kv_dtype == "float32", {}, [], prefill_options(chunk, route, gdn_route))
        for n in lengths:
            st = eng.new_state()
            chunks = []
            occ = {chip: 0.0 for chip, r in CHIP_ROUTE.items() if r == route}
            for p0 in range(0, int(n), int(chunk)):
                c = eng.prefill_cost(st, min(int(chunk), int(n) - p0))
                recs = dev.records()
                if p0 == 0 and int(n) == max(int(x) for x in lengths):
                    out["records"][route] = recs
                for chip in occ:
                    occ[chip] += records_seconds(recs, CHIP_BANDWIDTH_GBS[chip], CHIP_PEAK_TFLOPS[chip],
                                                 CHIP_CORES[chip], LEVEL_LATENCY_S, replays)[1]
                chunks.append({"position": p0, "rows": min(int(chunk), int(n) - p0), **c})
            p = out["prompts"].setdefault(str(n), {"tokens": int(n), "routes": {}, "modelled_tok_s": {},
                                                   "modelled_tok_s_occupancy": {}})
            for chip, t in occ.items():
                p["modelled_tok_s_occupancy"][chip] = n / t
            keys = ("dispatches", "levels", "command_buffers", "host_waits", "flops", "bytes_read", "bytes_written")
            p["routes"][route] = {
                "chunks": [{k: int(c[k]) for k in ("position", "rows") + keys} for c in chunks],
                **{k: int(sum(int(c[k]) for c in chunks)) for k in keys}}
            for chip, (bw, peak, r) in cb_chips.items():
                if r == route:
                    p.setdefault("max_command_buffer_ms", {})[chip] = 1e3 * max(
                        max_command_buffer_seconds(c, bw, peak) for c in chunks)
            for chip, r in CHIP_ROUTE.items():
                if r != route:
                    continue
                t = sum(modelled_level_time(c["level_bytes"], c["level_flops"], CHIP_BANDWIDTH_GBS[chip],
                                            CHIP_PEAK_TFLOPS[chip]) for c in chunks)
                p["modelled_tok_s"][chip] = n / t
                if chip == "M5 Max":
                    t = sum(modelled_level_time(c["level_bytes"], c["level_flops"], CHIP_BANDWIDTH_GBS[chip],
                                                M5_LILY_RATE_TFLOPS) for c in chunks)
                    p["m5_max_at_lily_rate_tok_s"] = n / t
            for chip, (bw, peak, r) in extra.items():
                if r == route:
                    p["modelled_tok_s"][chip] = n / sum(modelled_level_time(c["level_bytes"], c["level_flops"],
                                                                            bw, peak) for c in chunks)
    for n, p in out["prompts"].items():
        tps = p["modelled_tok_s"]["M5 Max"]
        p["published_m5_max"] = {k: v.get(int(n)) for k, v in PUBLISHED_PREFILL.items()}
        p["m5_max_vs"] = {k: (tps / v if v else None) for k, v in p["published_m5_max"].items()}
        p["m5_max_at_lily_rate_vs"] = {k: (p["m5_max_at_lily_rate_tok_s"] / v if v else None)
                                       for k, v in p["published_m5_max"].items()}
        lily = p["published_m5_max"]["Lily"]
        m5 = p["routes"][CHIP_ROUTE["M5 Max"]]
        # the arithmetic rate Lily's published time implies if it did this graph's FLOPs (a check of the peak)
        p["lily_implied_tflops"] = (m5["flops"] / int(n) * lily / 1e12) if lily else None
    return out


def encode_only_verify_cost(config, rows=(2, 3, 5, 9), *, context: int = 4096, dtype: str = "bfloat16",
                            kv_dtype: str = "bfloat16") -> dict:
    """What verifying k = rows - 1 drafted tokens costs in the Metal graph against one decode step, at
    ``context`` cached tokens, per chip and GEMM route: the verification graph the backend runs
    (`GpuEngine.verify`: every row a decode step's arithmetic, the GEMVs over all rows) and, for comparison,
    a small-m prefill chunk with every row's logits (shares every weight read, but not the decode arithmetic:
    ``chunk_vs_step``). Encoded on an encode-only simulator device over virtual weights (the MLX 4-bit
    layout) and timed with `modelled_level_time` (CHIP_BANDWIDTH_GBS, CHIP_PEAK_TFLOPS). A model, not a
    measurement (docs/speculative.md)."""
    ext = core()
    mappings, tensors, _ = virtual_weight_table(config)
    out = {"context": int(context), "rows": {}, "step_seconds": {}, "level_latency_us": LEVEL_LATENCY_S * 1e6}
    for route in sorted(set(CHIP_ROUTE.values())):
        dev = ext.gpu.SimDevice(execute=False, tensor_ops=route == "tensor")
        eng = ext.gpu.GpuEngine(dev, config_dict(config), mappings, tensors, "f32" if dtype == "float32" else "bf16",
                                 kv_dtype == "float32", {}, [], prefill_options(DEFAULT_PREFILL_CHUNK, route, "auto"))
        st = eng.new_state()
        st._set_position(int(context))
        step = eng.encode_cost(st)
        graphs, chunks = {}, {}
        for n in rows:
            s = eng.new_state()
            s._set_position(int(context))
            graphs[int(n)] = eng.verify_cost(s, int(n))
            chunks[int(n)] = eng.prefill_cost(s, int(n), all_logits=True)
        for chip, r in CHIP_ROUTE.items():
            if r != route:
                continue
            bw, peak = CHIP_BANDWIDTH_GBS[chip], CHIP_PEAK_TFLOPS[chip]
            t1 = modelled_level_time(step["level_bytes"], step["level_flops"], bw, peak)
            out["step_seconds"][chip] = t1
            for n, c in graphs.items():
                t = modelled_level_time(c["level_bytes"], c["level_flops"], bw, peak)
                k = chunks[n]
                tc = modelled_level_time(k["level_bytes"], k["level_flops"], bw, peak)
                out["rows"].setdefault(n, {})[chip] = {"seconds": t, "vs_step": t / t1, "chunk_vs_step": tc / t1,
                                                       "levels": int(c["levels"]), "step_levels": int(step["levels"])}
    return out


# ------------------------------------------------------------------------------------------ DFlash draft costing
#: the DFlash draft published for Qwen3.6-35B-A3B (z-lab/Qwen3.6-35B-A3B-DFlash's config.json): 8 Qwen3
#: decoder layers of hidden 2048, MLP 6144, 32 query / 4 KV heads of 128, bf16, blocks of 16
PUBLISHED_DRAFT = dict(num_hidden_layers=8, hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
                       num_key_value_heads=4, head_dim=128, target_layers=5, block_size=16)
#: bytes per draft weight of each published form: bf16, and an MLX 4-bit copy (group 64, a bf16 scale and bias
#: per group)
DRAFT_WIDTHS = {"bf16": 2.0, "q4": 0.5 + 4 / 64}


def virtual_dflash_table(config, draft: dict = PUBLISHED_DRAFT, bits: int | None = None, group_size: int = 64):
    """(dims, mappings, tensors) of a DFlash draft of `draft`'s dimensions for the target `config` (its hidden and
    vocabulary sizes), over a virtual mapping: the dims as the native drafts take them (backends.engine.dflash_dims)
    and its weights table, bf16 (``bits`` None) or MLX affine at ``bits`` with bf16 scales; the norms bf16. For
    costing the draft graph without its weights."""
    H, I, L = config.hidden_size, draft["intermediate_size"], draft["num_hidden_layers"]
    nh, nkv, hd = draft["num_attention_heads"], draft["num_key_value_heads"], draft["head_dim"]
    tensors: dict = {}
    cursor = [0]

    def span(nbytes: int):
        off = cursor[0]
        cursor[0] += (nbytes + 63) // 64 * 64
        return (0, off, int(nbytes))

    def lin(name, rows, cols):
        if bits is None:
            tensors[name] = dict(bits=0, group_size=0, dtype="bfloat16", sdtype="bfloat16", shape=[rows, cols],
                                 data=span(rows * cols * 2), scales=None, biases=None)
            return
        sb = rows * (cols // group_size) * 2
        tensors[name] = dict(bits=bits, group_size=group_size, dtype="float32", sdtype="bfloat16", shape=[rows, cols],
                             data=span(rows * cols * bits // 8), scales=span(sb), biases=span(sb))

    def vec(name, n):
        tensors[name] = dict(bits=0, group_size=0, dtype="bfloat16", sdtype="bfloat16", shape=[n], data=span(2 * n),
                             scales=None, biases=None)

    lin("fc", H, draft["target_layers"] * H)
    vec("hidden_norm", H)
    vec("norm", H)
    for i in range(L):
        p = f"layers.{i}."
        vec(p + "input_layernorm", H)
        vec(p + "post_attention_layernorm", H)
        for name, rows, cols in (("q_proj", nh * hd, H), ("k_proj", nkv * hd, H), ("v_proj", nkv * hd, H),
                                 ("o_proj", H, nh * hd)):
            lin(p + "self_attn." + name, rows, cols)
        vec(p + "self_attn.q_norm", hd)
        vec(p + "self_attn.k_norm", hd)
        for name, rows, cols in (("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)):
            lin(p + "mlp." + name, rows, cols)
    dims = dict(variant="dflash", hidden_size=H, num_hidden_layers=L, intermediate_size=I, num_attention_heads=nh,
                num_key_value_heads=nkv, head_dim=hd, vocab_size=config.vocab_size,
                num_feature_layers=draft["target_layers"], rms_norm_eps=1e-6, rope_theta=1e7, windows=[0] * L,
                attention_bias=False, input_embedding_scale=1.0, output_multiplier=1.0, final_logit_softcapping=0.0)
    return dims, [("virtual draft", 0, cursor[0])], tensors


def encode_only_dflash_cost(config, *, draft: dict = PUBLISHED_DRAFT, context: int = 4096, rows=(1, 2, 4, 16),
                            widths=("bf16", "q4"), dtype: str = "bfloat16", kv_dtype: str = "bfloat16") -> dict:
    """What one DFlash draft call costs in the Metal graph (src/gpu/dflash.h: the fc over the round's new context
    rows, every layer, the final norm and the target's lm_head for the block's rows) on top of the target
    ``config`` (a ModelConfig: its MLX 4-bit embedding and lm_head), with a draft of `draft`'s dimensions (bf16, or
    the MLX 4-bit copy: ``widths``) holding ``context`` cached context rows, for each count of new context rows in
    ``rows`` (a round feeds the tokens the last verification kept) and a whole block (``draft["block_size"]``).
    Encoded on an encode-only simulator device, once per GEMM route of CHIP_ROUTE, timed with
    `modelled_level_time`: ``rows[n][width][chip]`` = {seconds, levels, dispatches, command_buffers, bytes}. A
    model, not a measurement."""
    ext = core()
    mappings, tensors, _ = virtual_weight_table(config)
    block = int(draft["block_size"])
    out = {"context": int(context), "block": block, "draft": dict(draft), "level_latency_us": LEVEL_LATENCY_S * 1e6,
           "rows": {}}
    for route in sorted(set(CHIP_ROUTE.values())):
        dev = ext.gpu.SimDevice(execute=False, tensor_ops=route == "tensor")
        eng = ext.gpu.GpuEngine(dev, config_dict(config), mappings, tensors, "f32" if dtype == "float32" else "bf16",
                                 kv_dtype == "float32", {}, [], prefill_options(DEFAULT_PREFILL_CHUNK, route, "auto"))
        for width in widths:
            dims, dmaps, dtensors = virtual_dflash_table(config, draft, None if width == "bf16" else 4)
            d = ext.gpu.GpuDFlashDraft(eng, dims, dmaps, dtensors, [])
            cache = d.new_cache()
            cache._set_position(int(context))
            for n in rows:
                c = d.cost(cache, int(n), block)
                for chip, r in CHIP_ROUTE.items():
                    if r != route:
                        continue
                    t = modelled_level_time(c["level_bytes"], c["level_flops"], CHIP_BANDWIDTH_GBS[chip],
                                            CHIP_PEAK_TFLOPS[chip])
                    out["rows"].setdefault(int(n), {}).setdefault(width, {})[chip] = {
                        "seconds": t, "levels": int(c["levels"]), "dispatches": int(c["dispatches"]),
                        "command_buffers": int(c["command_buffers"]),
                        "bytes": int(c["bytes_read"] + c["bytes_written"])}
    return out


def encode_only_mtp_cost(config, drafts=(1, 3, 7, 15), *, pairs: int = 4, n_layers: int = 1, context: int = 4096,
                         dtype: str = "bfloat16", kv_dtype: str = "bfloat16", bits: int = 4) -> dict:
    """What an MTP drafting round costs in the Metal graph (`GpuEngine.mtp_cost`: ``pairs`` verified pairs through
    layer 0, then k greedy drafts chained on the GPU, one command buffer) for each k of ``drafts``, against one
    decode step of the main model, with the head's cache at ``context`` pairs: dispatches, dependency levels,
    bytes, command buffers and the modelled seconds per chip (`modelled_level_time`, CHIP_BANDWIDTH_GBS;
    bandwidth-bound, so one route). Encoded on an encode-only simulator device over virtual weights (the MLX
    layout at ``bits``; the head's layers as the main model's MoE layers). A model, not a measurement
    (docs/metal.md, "The MTP head")."""
    ext = core()
    act = "f32" if dtype == "float32" else "bf16"
    dev = ext.gpu.SimDevice(execute=False)
    mappings, tensors, _ = virtual_weight_table(config, bits=bits)
    main = ext.gpu.GpuEngine(dev, config_dict(config), mappings, tensors, act, kv_dtype == "float32", {}, [])
    st = main.new_state()
    st._set_position(int(context))
    step = main.encode_cost(st)
    mappings, tensors, _ = virtual_mtp_weight_table(config, n_layers, bits=bits)
    head = ext.gpu.GpuEngine(dev, config_dict(mtp_layer_config(config, n_layers)), mappings, tensors, act,
                             kv_dtype == "float32", {}, [])
    out = {"context": int(context), "pairs": int(pairs), "n_layers": int(n_layers), "rounds": {},
           "step_seconds": {chip: modelled_level_time(step["level_bytes"], step["level_flops"], bw,
                                                      CHIP_PEAK_TFLOPS[chip])
                            for chip, bw in CHIP_BANDWIDTH_GBS.items()},
           "level_latency_us": LEVEL_LATENCY_S * 1e6}
    for k in drafts:
        hs = head.new_state()
        hs._set_position(int(context))
        c = head.mtp_cost(hs, int(pairs), int(k))
        out["rounds"][int(k)] = {
            "dispatches": int(c["dispatches"]), "levels": int(c["levels"]), "command_buffers": int(c["command_buffers"]),
            "bytes": int(c["bytes_read"] + c["bytes_written"]),
            "seconds": {chip: modelled_level_time(c["level_bytes"], c["level_flops"], bw, CHIP_PEAK_TFLOPS[chip])
                        for chip, bw in CHIP_BANDWIDTH_GBS.items()}}
    return out


# Qwen3.6-35B-A3B's vision_config as released (docs/vision.md, "Config")
RELEASED_VISION = {"depth": 27, "hidden_size": 1152, "num_heads": 16, "intermediate_size": 4304, "patch_size": 16,
                   "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3, "out_hidden_size": 2048,
                   "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh"}


def virtual_vision_table(vc: VisionConfig):
    """(mappings, tensors) of a vision tower of `vc`'s dimensions over a virtual mapping, every tensor bf16 (as
    Hugging Face and mlx-vlm store it: mlx-vlm never quantizes the tower). For costing the tower graph without its
    weights."""
    tensors: dict = {}
    cursor = [0]

    def t(name, *shape):
        n = int(np.prod(shape))
        off = cursor[0]
        cursor[0] += (2 * n + 63) // 64 * 64
        tensors[name] = dict(bits=0, group_size=0, dtype="bfloat16", sdtype="bfloat16", shape=list(shape),
                             data=(0, off, 2 * n), scales=None, biases=None)

    H, I, M = vc.hidden_size, vc.intermediate_size, vc.merged_dim
    t("patch_embed.proj", H, vc.patch_dim)
    t("patch_embed.proj.bias", H)
    t("pos_embed", vc.num_position_embeddings, H)
    for i in range(vc.depth):
        p = f"blocks.{i}."
        for n in ("norm1", "norm2"):
            t(p + n, H)
            t(p + n + ".bias", H)
        for n, rows, cols in (("attn.qkv", 3 * H, H), ("attn.proj", H, H), ("mlp.linear_fc1", I, H),
                              ("mlp.linear_fc2", H, I)):
            t(p + n, rows, cols)
            t(p + n + ".bias", rows)
    t("merger.norm", H)
    t("merger.norm.bias", H)
    t("merger.linear_fc1", M, M)
    t("merger.linear_fc1.bias", M)
    t("merger.linear_fc2", vc.out_hidden_size, M)
    t("merger.linear_fc2.bias", vc.out_hidden_size)
    return [("virtual vision tower", 0, cursor[0])], tensors


def encode_only_vision_cost(config, *, vision: dict = RELEASED_VISION, sizes=((448, 448), (1024, 1024)),
                            chips=("M5 Max", "M1 Max"), dtype: str = "bfloat16") -> dict:
    """What one image through the vision tower costs in the Metal graph (src/gpu/vision.h: the patch embedding,
    every block, the merger) for a tower of `vision`'s dimensions (a vision_config dict; bf16 weights) beside the
    text model `config` (a ModelConfig, whose engine supplies the device and options), for each image of
    ``sizes`` (height, width in pixels, multiples of patch x merge). Encoded on an encode-only simulator device
    per GEMM route of CHIP_ROUTE and timed with `modelled_level_time`: ``images["HxW"]`` = {patches, tokens,
    chips: {chip: {seconds, levels, dispatches, command_buffers, bytes, flops}}}. A model, not a measurement."""
    ext = core()
    vc = VisionConfig.from_dict(vision)
    unit = vc.patch_size * vc.spatial_merge_size
    for h, w in sizes:
        if h % unit or w % unit:
            raise ValueError(f"image size {h}x{w}: both sides must be multiples of {unit}")
    mappings, tensors, _ = virtual_weight_table(config)
    vmaps, vtensors = virtual_vision_table(vc)
    out = {"vision": dict(vision), "level_latency_us": LEVEL_LATENCY_S * 1e6, "images": {}}
    routes = {CHIP_ROUTE[c] for c in chips}
    for route in sorted(routes):
        dev = ext.gpu.SimDevice(execute=False, tensor_ops=route == "tensor")
        eng = ext.gpu.GpuEngine(dev, config_dict(config), mappings, tensors, "f32" if dtype == "float32" else "bf16",
                                 False, {}, [], prefill_options(DEFAULT_PREFILL_CHUNK, route, "auto"))
        tower = ext.gpu.GpuVisionTower(eng, vision_dims(vc), vmaps, vtensors, [])
        for h, w in sizes:
            grid = np.array([[1, h // vc.patch_size, w // vc.patch_size]], np.int64)
            c = tower.cost(grid)
            patches = int(grid[0, 1] * grid[0, 2])
            entry = out["images"].setdefault(f"{h}x{w}", {"patches": patches,
                                                           "tokens": patches // vc.merge_unit, "chips": {}})
            for chip in chips:
                if CHIP_ROUTE[chip] != route:
                    continue
                t = modelled_level_time(c["level_bytes"], c["level_flops"], CHIP_BANDWIDTH_GBS[chip],
                                        CHIP_PEAK_TFLOPS[chip])
                entry["chips"][chip] = {"seconds": t, "levels": int(c["levels"]), "dispatches": int(c["dispatches"]),
                                        "command_buffers": int(c["command_buffers"]),
                                        "bytes": int(c["bytes_read"] + c["bytes_written"]), "flops": int(c["flops"])}
    return out

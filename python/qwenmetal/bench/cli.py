"""`qwenmetal bench`: prefill and decode speed at the real Qwen3.6-35B-A3B widths, against the box's own
memory bandwidth.

    qwenmetal bench                          # 8 real-width layers, cpu backend, 2 threads
    qwenmetal bench --layers 4 --json out.json
    qwenmetal bench --quick                  # smoke run, seconds: the tiny fixture model, short lengths

What it does:

1. **Checkpoint.** A random-weight MLX 4-bit checkpoint with the real per-layer dimensions (hidden 2048,
   256 experts top-8 x 512 + shared 512, GDN 16k/32v heads x 128, attention 16q/2kv x 256, vocab 248,320)
   and ``--layers`` layers (default 8 = two ``[GDN GDN GDN attention]`` blocks), generated once (in a
   child process) and cached under ``paths.cache_dir("bench")`` (docs/usage.md, "Cache directory"). It is
   written by the one random-checkpoint writer, :mod:`qwenmetal.checkpoint_writer` (the test fixtures'
   ``mlx-q4`` format: 4-bit g64, bf16 scales/biases, router and shared-expert gate 8-bit -- exactly what
   ``mlx_lm.convert -q`` writes), streamed tensor by tensor and atomically. About 0.46 GB per layer plus
   0.57 GB for the embedding and lm_head. ``--quick`` without ``--config`` / ``--layers`` uses the tiny
   fixture preset instead (a smoke run of the whole benchmark, not a measurement of real widths).
2. **Read bandwidth.** Every thread (as many as the engine uses) streams its part of a buffer far larger
   than the last-level cache; best of N passes. The measurement runs in a child process so that its
   buffer does not count in the benchmark's peak RSS.
3. **Prefill.** Tokens/s for each ``--prefill`` length: one exact-shape warm-up, then ``--repeats``
   timed runs in fresh sessions (prefill + last-token logits + argmax); the median is reported.
4. **Decode.** For each ``--contexts`` length C: prefill C tokens (untimed), a few warm-up steps on a
   fork, then ``--repeats`` times ``--decode-steps`` greedy steps, each repeat on a fresh fork of the
   same context; the median ms/token is reported. The greedy tokens' FNV-1a digest must repeat across
   repeats (reported as ``digest_stable``).
5. **Bytes per decoded token**, from the checkpoint's actual tensor sizes: every non-expert weight
   (attention / GDN projections, norms, conv, router, shared expert), top-k of each layer's routed
   experts, one embedding row, the final norm and lm_head, plus the KV cache read at that context
   (and the new token's K/V written) and the GDN recurrent + conv state read and written. Effective
   GB/s = bytes/token x tokens/s; ``bandwidth_ratio`` = effective / measured read bandwidth.
6. **Peak RSS** of the benchmark process (``getrusage``); memory-mapped weight pages count once touched.

The synthetic prompt is Lily's (docs/benchmarks.md, "Method"): token i = ((i * 2654435761) mod 2^32)
mod vocab. Output: a table, and JSON with ``--json PATH`` (schema ``qwenmetal-bench/1``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from .. import memlimit
from ..backends.metal import DEFAULT_PREFILL_CHUNK, sim_available
from ..bench.cost import (
    encode_only_cost,
    encode_only_dflash_cost,
    encode_only_mtp_cost,
    encode_only_prefill_cost,
    encode_only_verify_cost,
)
from ..cli_args import add_expert_args, expert_options, seed_arg
from ..config import ModelConfig
from ..memory import parse_budget
from ..model import Model
from ..version import __version__
from ..weights_table import virtual_weight_table
from .bandwidth import measure_file_read, measure_read_bandwidth
from .batch import batch_modelled, format_batch, format_modelled, run_batch
from .bytes_model import (
    BACKEND_KV_DEFAULT,
    KV_ELEMENT_BYTES,
    decode_bytes,
    tensor_sizes,
)
from .checkpoint import ensure_checkpoint, resolve_config
from .experts import expert_counters, per_token
from .kernels import count_kernels, format_kernels, kernel_table
from .load import ForeignLoad, busy_fraction, wait_quiet
from .speculative import (
    LENGTHS,
    ROWS,
    format_speculative,
    modelled_lengths,
    run_speculative,
)
from .timing import (
    describe_machine,
    machine_info,
    peak_rss_bytes,
    time_decode,
    time_prefill,
)

SCHEMA = "qwenmetal-bench/1"
DEFAULT_PREFILL = (128, 512, 2048)
DEFAULT_CONTEXTS = (128, 1024, 4096)
QUICK_PREFILL = (16, 64)
QUICK_CONTEXTS = (16, 64)
QUICK_CONFIG = "tiny"           # --quick's model without --config / --layers: a fixture preset, written in seconds


def checkpoint_config(args: argparse.Namespace) -> str:
    """The config a run generates its checkpoint of: --config; else, with --quick and no --layers, the
    small `QUICK_CONFIG` (a smoke run must not first write gigabytes of real-width layers); else "real"."""
    if args.config is not None:
        return args.config
    return QUICK_CONFIG if getattr(args, "quick", False) and args.layers is None else "real"

# ---------------------------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------------------------
def load_model(args: argparse.Namespace, threads: int, log: Callable[[str], None]):
    """The model a benchmark runs: --model, or the generated checkpoint of --config/--layers, on --backend
    with its options. Returns (model, checkpoint path, config name, options, load seconds)."""

    if args.model:
        path = Path(args.model)
        cfg_name = str(path)
    else:
        cfg_name = checkpoint_config(args)
        cfg = resolve_config(cfg_name, args.layers)
        path = ensure_checkpoint(cfg, args.seed, log=log)
    log(f"checkpoint: {path}")

    backend = args.backend
    options: dict = {}
    if backend == "cpu":
        options["threads"] = threads
        if args.kv_dtype:
            options["kv_dtype"] = args.kv_dtype
        if args.prefill_chunk:
            options["prefill_chunk"] = args.prefill_chunk
    elif args.kv_dtype or args.prefill_chunk:
        raise ValueError("--kv-dtype and --prefill-chunk apply to the cpu backend")
    if args.memory_budget is not None:
        options["memory_budget"] = parse_size(args.memory_budget, "--memory-budget", checkpoint_bytes(path))
    options |= expert_options(args)
    for kv in args.option or ():
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise ValueError(f"--option takes KEY=VALUE, got {kv!r}")
        options[k] = int(v) if v.lstrip("-").isdigit() else v
    t = time.perf_counter()
    model = Model.load(str(path), backend=backend, **options)
    load_s = time.perf_counter() - t
    return model, path, cfg_name, options, load_s


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict:

    prefill_lens = _ints(args.prefill) if args.prefill else (QUICK_PREFILL if args.quick else DEFAULT_PREFILL)
    contexts = _ints(args.contexts) if args.contexts else (QUICK_CONTEXTS if args.quick else DEFAULT_CONTEXTS)
    repeats = args.repeats or (1 if args.quick else 3)
    steps = args.decode_steps or (4 if args.quick else 64)
    threads = args.threads or _usable_cpus()

    t_start = time.perf_counter()
    busy = wait_quiet(args.wait_quiet, log=log) if args.wait_quiet else busy_fraction(1.0)
    # read bandwidth: measured before and after the timings (it moves with the VM host's memory traffic,
    # which /proc/stat does not show); the higher figure is the box's capability
    bw_bytes = args.bandwidth_bytes if args.bandwidth_bytes is not None else ((512 << 20) if args.quick else (2 << 30))
    bw_repeats = 2 if args.quick else 5
    bw_runs = [measure_read_bandwidth(threads, bw_bytes, bw_repeats)] if bw_bytes else []
    model, path, cfg_name, options, load_s = load_model(args, threads, log)
    c = model.config
    backend = model.backend
    kv_dtype = args.kv_dtype or model.backend_info().get("kv_dtype") or BACKEND_KV_DEFAULT.get(backend, "bfloat16")
    kv_el = KV_ELEMENT_BYTES.get(kv_dtype, 2)
    sizes = tensor_sizes(model.weights)
    machine = machine_info()
    log(f"machine: {describe_machine(machine)}")
    log(f"loaded on {backend!r} in {load_s:.2f} s: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
        f"{c.num_experts} experts top-{c.num_experts_per_tok}, vocab {c.vocab_size}, "
        f"weights {sum(sizes.values()) / 1e9:.2f} GB")

    max_context = max(list(prefill_lens) + list(contexts)) + steps + 16
    max_context = min(max_context, c.max_position_embeddings)
    result: dict = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "qwenmetal_version": __version__,
        "machine": machine,
        "model": {"config": cfg_name, "checkpoint": str(path), "layers": c.num_hidden_layers,
                  "full_attention_layers": len(c.full_attention_layers),
                  "linear_attention_layers": len(c.linear_attention_layers),
                  "hidden_size": c.hidden_size, "num_experts": c.num_experts,
                  "num_experts_per_tok": c.num_experts_per_tok, "vocab_size": c.vocab_size,
                  "weights_bytes": int(sum(sizes.values()))},
        "backend": backend, "options": options, "threads": threads, "kv_dtype": kv_dtype,
        "engine": model.backend_info(),
        "method": {"repeats": repeats, "decode_steps": steps, "warmup": "1 exact-shape prefill; 4 decode steps",
                   "statistic": "median", "prompt": "token i = ((i*2654435761) mod 2^32) mod vocab"},
        "load_seconds": load_s, "busy_before": busy,
        "prefill": [], "decode": [],
    }

    # expert streaming (a backend with expert-cache counters): per-token figures of each timed block
    counters = (lambda: expert_counters(model)) if expert_counters(model) else None

    fl = ForeignLoad().__enter__()
    for n in prefill_lens:
        before = counters() if counters else None
        r = time_prefill(model, n, repeats, max_context=max_context)
        r["experts"] = per_token(before, counters() if counters else None, n * (1 + repeats))
        result["prefill"].append(r)
        log(f"  prefill {n:6d} tokens: {r['tokens_per_second']:9.1f} tok/s ({r['seconds']:.3f} s)"
            + _experts_note(r["experts"]))
    for ctx in contexts:
        r = time_decode(model, ctx, steps, repeats, max_context=max_context, counters=counters)
        r["experts"] = per_token(*r.pop("counters"), steps * repeats)
        b = decode_bytes(c, sizes, ctx, kv_el)
        r["bytes_per_token"] = b["total"]
        r["bytes"] = b
        r["effective_gbps"] = b["total"] * r["tokens_per_second"] / 1e9
        result["decode"].append(r)
        log(f"  decode @ {ctx:6d}: {r['ms_per_token']:8.2f} ms/token, {r['tokens_per_second']:7.2f} tok/s, "
            f"{b['total'] / 1e6:.1f} MB/token, {r['effective_gbps']:.2f} GB/s" + _experts_note(r["experts"]))
    fl.__exit__(None, None, None)
    result["foreign_load"] = fl.fraction
    result["peak_rss_bytes"] = peak_rss_bytes()
    del model
    gc.collect()

    if bw_bytes:
        bw_runs.append(measure_read_bandwidth(threads, bw_bytes, bw_repeats))
        bw = dict(max(bw_runs, key=lambda r: r["read_gbps"]))
        bw["runs_gbps"] = [r["read_gbps"] for r in bw_runs]
    else:
        bw = {"read_gbps": None, "method": "skipped"}
    result["bandwidth"] = bw
    for r in result["decode"]:
        r["bandwidth_ratio"] = (r["effective_gbps"] / bw["read_gbps"]) if bw.get("read_gbps") else None
    result["machine_label"] = describe_machine(result["machine"], bw.get("read_gbps"), bw.get("threads"))
    result["total_seconds"] = time.perf_counter() - t_start
    try:
        result["machine"]["loadavg_at_end"] = list(os.getloadavg())
    except OSError:                             # pragma: no cover
        pass
    return result


def format_table(res: Mapping[str, Any]) -> str:
    m = res["model"]
    bw = res.get("bandwidth") or {}
    lines = [
        f"qwenmetal bench: backend {res['backend']}, {res['threads']} threads, kv {res['kv_dtype']}"
        + "".join(f", {k}={v}" for k, v in res.get("options", {}).items() if k not in ("threads", "kv_dtype"))
        + "".join(f", {k} {v}" for k, v in (res.get("engine") or {}).items() if k in ("isa", "activations", "amx"))
        + "; "
        f"{m['layers']} layers ({m['linear_attention_layers']} GDN + {m['full_attention_layers']} attention), "
        f"hidden {m['hidden_size']}, {m['num_experts']} experts top-{m['num_experts_per_tok']}, "
        f"vocab {m['vocab_size']}; weights {m['weights_bytes'] / 1e9:.3f} GB",
        f"machine: {describe_machine(res['machine'])}; "
        + (f"measured read bandwidth {bw['read_gbps']:.2f} GB/s ({bw.get('threads')} threads, "
           f"{bw.get('buffer_bytes', 0) / 2**30:.2f} GiB buffer, best of {len(bw.get('samples_gbps', []))} passes; "
           f"before/after the timings: {', '.join(f'{x:.2f}' for x in bw.get('runs_gbps', []))})"
           if bw.get("read_gbps") else "read bandwidth not measured"),
        "",
        f"{'prefill':>10} {'tok/s':>10} {'seconds':>9}",
    ]
    for r in res["prefill"]:
        lines.append(f"{r['tokens']:>10d} {r['tokens_per_second']:>10.1f} {r['seconds']:>9.3f}")
    lines += ["", f"{'context':>10} {'ms/token':>9} {'tok/s':>8} {'MB/token':>9} {'GB/s':>7} {'of bw':>6}  "
                  f"{'weights':>8} {'kv':>7} {'state':>6}  digest"]
    for r in res["decode"]:
        b = r["bytes"]
        ratio = f"{100 * r['bandwidth_ratio']:5.1f}%" if r.get("bandwidth_ratio") is not None else "    -"
        lines.append(f"{r['context']:>10d} {r['ms_per_token']:>9.2f} {r['tokens_per_second']:>8.2f} "
                     f"{r['bytes_per_token'] / 1e6:>9.2f} {r['effective_gbps']:>7.2f} {ratio:>6}  "
                     f"{b['weights'] / 1e6:>8.2f} {b['kv_cache'] / 1e6:>7.2f} {b['gdn_state'] / 1e6:>6.2f}  "
                     f"{r['digest']}{'' if r['digest_stable'] else ' (UNSTABLE)'}")
    for kind, key in (("prefill", "tokens"), ("decode", "context")):
        for r in res[kind]:
            if r.get("experts"):
                lines.append(f"experts, {kind} {r[key]}:" + _experts_note(r["experts"]))
    ml = res.get("memory_limit")
    if ml:
        lines.append(f"memory limit {ml['limit_bytes'] / 2**30:.2f} GiB ({ml.get('fraction_of_checkpoint', 0):.0%} of the "
                     f"checkpoint; cgroup v{ml['cgroup_version']}): cgroup peak (RSS + page cache) "
                     f"{ml['peak_bytes'] / 2**30:.2f} GiB, VmHWM {ml['vmhwm_bytes'] / 2**30:.2f} GiB, "
                     f"{ml['limit_hits']} limit hits, {ml['oom_kills']} OOM kills")
    if res.get("disk"):
        lines.append(f"disk: cold read {res['disk']['read_gbps']:.2f} GB/s ({res['disk']['threads']} threads x "
                     f"{res['disk']['chunk_bytes'] >> 20} MiB preads of the checkpoint, {res['disk']['bytes'] / 1e9:.1f} GB)")
    if res["decode"]:
        wp = res["decode"][0]["bytes"]["weight_parts"]
        lines.append("weights per token (MB): " + ", ".join(f"{k} {v / 1e6:.2f}" for k, v in wp.items()))
    la = res["machine"].get("loadavg_at_start")
    lines.append(f"peak RSS {res['peak_rss_bytes'] / 2**30:.2f} GiB; load {res['load_seconds']:.2f} s; "
                 f"total {res.get('total_seconds', 0):.0f} s"
                 + (f"; load average at start {la[0]:.2f}" if la else "")
                 + (f"; other processes used {100 * res['foreign_load']:.0f}% of the CPUs meanwhile"
                    if res.get("foreign_load") is not None else ""))
    return "\n".join(lines)


def _experts_note(e) -> str:
    if not e:
        return ""
    hr = "-" if e["hit_rate"] is None else f"{100 * e['hit_rate']:.1f}%"
    return (f" [experts: {e['policy']}, {e['slots_per_layer']} slots/layer, hit rate {hr}, "
            f"{e['bytes_read_per_token'] / 1e6:.2f} MB read/token, {1e3 * e['io_seconds_per_token']:.2f} ms I/O/token]")


def checkpoint_bytes(path) -> int:
    """Bytes of the checkpoint's safetensors files."""
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def parse_size(value: str, what: str, whole: int):
    """A size argument: "auto", "none", bytes or a size like "8GiB" (streaming.parse_budget), or "N%" of
    `whole` (the checkpoint's bytes)."""
    v = str(value).strip()
    if v.lower() == "none":
        return None
    if v.endswith("%"):
        try:
            pct = float(v[:-1])
        except ValueError:
            raise ValueError(f"{what}: expected N% of the checkpoint, got {value!r}") from None
        if pct <= 0:
            raise ValueError(f"{what} must be positive, got {value!r}")
        return int(whole * pct / 100)
    return parse_budget(v, what)


_LIMITED_CHILD = ("import argparse, json, sys; from qwenmetal import memlimit; from qwenmetal.bench.cli import run; "
                  "memlimit.report(run(argparse.Namespace(**json.loads(sys.argv[1])), "
                  "log=lambda m: print(m, file=sys.stderr, flush=True)))")


def run_limited(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict:
    """`qwenmetal bench --memory-limit L`: the run in a child process inside a memory cgroup of L bytes
    (qwenmetal.memlimit: RSS + page cache, no swap), the checkpoint evicted from the page cache first.
    The checkpoint is generated and the memory and disk read bandwidths are measured here, outside the
    limit (their buffers would not fit it)."""

    if args.model:
        path = Path(args.model)
    else:
        path = ensure_checkpoint(resolve_config(checkpoint_config(args), args.layers), args.seed, log=log)
    size = checkpoint_bytes(path)
    limit = parse_size(args.memory_limit, "--memory-limit", size)
    if not isinstance(limit, int):
        raise ValueError(f"--memory-limit needs a size or a percentage, got {args.memory_limit!r}")
    threads = args.threads or _usable_cpus()
    bw_bytes = args.bandwidth_bytes if args.bandwidth_bytes is not None else ((512 << 20) if args.quick else (2 << 30))
    bw = measure_read_bandwidth(threads, bw_bytes, 2 if args.quick else 5) if bw_bytes else None
    shards = sorted(str(path / f) for f in os.listdir(path) if f.endswith(".safetensors"))
    disk = measure_file_read(shards, min(size, 1 << 30))
    log(f"memory limit {limit / 2**30:.2f} GiB ({limit / size:.0%} of the {size / 2**30:.2f} GiB checkpoint); "
        f"disk cold read {disk['read_gbps']:.2f} GB/s")
    child = dict(vars(args), model=str(path), memory_limit=None, bandwidth_bytes=0, json=None)
    child.pop("func", None)
    r = memlimit.run_python(_LIMITED_CHILD, limit, args=[json.dumps(child)], drop_cache=[path], stderr_to_ours=True)
    res = r.check().result
    res["memory_limit"] = dict(r.summary(), fraction_of_checkpoint=limit / size, checkpoint_bytes=size)
    res["disk"] = disk
    if bw:
        res["bandwidth"] = dict(bw, runs_gbps=[bw["read_gbps"]])
        for d in res["decode"]:
            d["bandwidth_ratio"] = d["effective_gbps"] / bw["read_gbps"]
        res["machine_label"] = describe_machine(res["machine"], bw["read_gbps"], bw["threads"])
    return res


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                      # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _ints(s) -> tuple:
    if isinstance(s, (list, tuple)):
        return tuple(int(x) for x in s)
    try:
        out = tuple(int(x) for x in str(s).split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {s!r}") from None
    if not out or any(x < 1 for x in out):
        raise ValueError(f"expected positive integers, got {s!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=None,
                   help="layers of the generated model (default 8 for --config real; a preset keeps its own)")
    p.add_argument("--config", default=None,
                   help="'real' (Qwen3.6-35B-A3B widths, the default but with --quick), a fixture preset (e.g. tiny) "
                        "or a config.json path")
    p.add_argument("--model", default=None, help="benchmark an existing checkpoint directory instead")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the random checkpoint")
    p.add_argument("--backend", default="cpu", help="cpu (default) | reference | any registered backend")
    p.add_argument("--threads", type=int, default=None, help="engine and bandwidth threads (default: usable CPUs)")
    p.add_argument("--kv-dtype", default=None, help="cpu backend KV cache dtype (bfloat16 | float32)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="cpu backend prefill chunk; with --encode-only the metal prefill chunk (default 4096)")
    p.add_argument("--option", "-o", action="append", metavar="KEY=VALUE",
                   help="another backend option, e.g. -o activations=int8 (repeatable)")
    p.add_argument("--prefill", default=None, help="prefill lengths, comma-separated (default 128,512,2048)")
    p.add_argument("--contexts", default=None, help="decode contexts, comma-separated (default 128,1024,4096)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per point, median reported (default 3)")
    p.add_argument("--decode-steps", type=int, default=None, help="decode steps per repeat (default 64)")
    p.add_argument("--bandwidth-bytes", type=int, default=None,
                   help="bandwidth buffer size (default 2 GiB; 0 skips the measurement)")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                   help="first wait up to this long for other processes to leave the CPUs idle")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run, seconds: the {QUICK_CONFIG!r} fixture model (a few MB, not real widths) unless "
                        "--config, --layers or --model says otherwise; prefill 16,64, contexts 16,64, 1 repeat, "
                        "4 decode steps, 512 MiB bandwidth buffer")
    p.add_argument("--memory-budget", default=None, metavar="B",
                   help="the backend's memory_budget: auto, none, bytes, a size (8GiB) or N%% of the checkpoint; "
                        "routed experts stream from disk when the checkpoint does not fit (docs/streaming.md)")
    add_expert_args(p)
    p.add_argument("--memory-limit", default=None, metavar="L",
                   help="run under a real memory limit: a memory cgroup of L bytes, a size or N%% of the checkpoint "
                        "(RSS + page cache, no swap; Linux, root or a delegated cgroup)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--speculative", action="store_true",
                   help="speculative decoding instead: the cost of verifying 2/4/8/16 rows against a decode step, "
                        "and greedy tok/s against plain decoding at mean accepted lengths 2/4/5/6 (an oracle block "
                        "drafter; context: the first --contexts value, default 512; tokens: --decode-steps, "
                        "default 64), with the Metal graph and a DFlash draft MODELLED beside them")
    p.add_argument("--batch", default=None, metavar="B,...",
                   help="batched decode instead: for each batch size, one decode_batch step over B sessions forked "
                        "from one context (ms/step, aggregate and per-stream tok/s, vs batch 1, the bytes floor of "
                        "the rows' union of experts) and the 2-row verification vs a step; e.g. --batch 1,2,4,8. "
                        "With --encode-only (metal-sim): the Metal graph's batched step of B sequences at the first "
                        "--contexts value, modelled against the union floor, and the 2-row verification")
    p.add_argument("--context", type=int, default=None,
                   help="--batch: tokens of context each session holds (default 512; --quick 32)")
    p.add_argument("--batch-routing", default="measured", choices=("measured", "random"),
                   help="--batch: distinct experts per step counted on an expert-cache twin of the model "
                        "(measured, the default, where the backend streams experts) or the random-routing estimate")
    p.add_argument("--encode-only", action="store_true",
                   help="metal-sim: encode a decode step of the config (default: the full real model, 40 layers) with "
                        "virtual weights and report its cost (dispatches, levels, bytes vs floor, modelled tok/s); "
                        "with --prefill, also the chunked prefill of those prompt lengths")
    p.add_argument("--kernels", action="store_true",
                   help="metal-sim: per kernel, dispatches, threads and threadgroup memory per threadgroup, "
                        "threadgroups resident per GPU core (M1..M5), bank-conflict replays (counted on the tiny "
                        "fixture model run in the simulator) and the modelled fraction of its bound, for the decode "
                        "step (first --contexts value, default 4096) and one prefill chunk (--prefill-chunk) of the "
                        "config (default the real model); alone or with --encode-only")


def _costed_config(args: argparse.Namespace) -> ModelConfig:
    """The config an encode-only costing runs: --model's, else --config's (default the real model, all 40
    layers unless --layers says otherwise)."""
    if args.model:
        return ModelConfig.from_file(args.model)
    config = args.config or "real"
    return ModelConfig.from_dict(resolve_config(config, 40 if args.layers is None and config == "real" else args.layers))


def run_encode_only(args: argparse.Namespace) -> dict:
    """`qwenmetal bench --backend metal-sim --encode-only`: the decode step of the real config, costed."""

    if args.backend != "metal-sim":
        raise ValueError("--encode-only needs --backend metal-sim")
    c = _costed_config(args)
    contexts = _ints(args.contexts) if args.contexts else (4096,)
    kv = args.kv_dtype or "bfloat16"
    by_ctx = {str(n): encode_only_cost(c, context=n, kv_dtype=kv) for n in contexts}
    for r in by_ctx.values():
        r.pop("records", None)
    first = by_ctx[str(contexts[0])]
    decode = {k: first[k] for k in ("dispatches", "levels", "command_buffers", "host_waits", "bytes_per_token",
                                    "floor_bytes", "bytes_vs_floor", "modelled_tok_s", "modelled_tok_s_occupancy")}
    decode.update(context=contexts[0], level_latency_us=first["level_latency_us"])
    res = {"backend": "metal-sim", "mode": "encode-only", "status": "simulator-verified, hardware-unverified",
           "config": {"layers": c.num_hidden_layers, "experts": c.num_experts, "vocab": c.vocab_size,
                      "hidden": c.hidden_size},
           "decode": decode, "decode_by_context": by_ctx}
    if getattr(args, "batch", None):
        res["batch"] = batch_modelled(c, _ints(args.batch), context=contexts[0], kv_dtype=kv)
    if args.prefill:
        res["prefill"] = encode_only_prefill_cost(c, _ints(args.prefill), kv_dtype=kv,
                                                  chunk=args.prefill_chunk or DEFAULT_PREFILL_CHUNK)
        res["prefill"].pop("records", None)
    return res


def format_encode_only(res: Mapping[str, Any]) -> str:
    c = res["config"]
    lines = [f"metal-sim encode-only decode step ({res['status']}): {c['layers']} layers, {c['experts']} experts, "
             f"vocab {c['vocab']}",
             f"{'context':>8} {'dispatches':>10} {'levels':>7} {'cmdbuf/tok':>10} {'waits/tok':>9} "
             f"{'MB/token':>9} {'floor MB':>9} {'vs floor':>8}  modelled tok/s"]
    for ctx, r in res["decode_by_context"].items():
        tps = ", ".join(f"{chip} {v:.0f}" for chip, v in r["modelled_tok_s"].items())
        lines.append(f"{ctx:>8} {r['dispatches']:>10} {r['levels']:>7} {r['command_buffers']:>10.2f} "
                     f"{r['host_waits']:>9.2f} {r['bytes_per_token'] / 1e6:>9.1f} {r['floor_bytes'] / 1e6:>9.1f} "
                     f"{r['bytes_vs_floor']:>8.3f}  {tps}")
    lines.append(f"modelled: bytes / bandwidth + levels x {res['decode']['level_latency_us']:.1f} us "
                 "(per-level latency calibrated from Lily's published M5 Max decode; docs/metal.md)")
    lines.append("modelled tok/s with occupancy (each dispatch at the share of the GPU's cores its grid fills; "
                 "bench.occupancy):")
    for ctx, r in res["decode_by_context"].items():
        lines.append(f"{ctx:>8}  " + ", ".join(f"{chip} {v:.0f}" for chip, v in r["modelled_tok_s_occupancy"].items()))
    if "batch" in res:
        lines.append(format_modelled(res["batch"]))
    if "prefill" in res:
        lines.append(format_prefill_cost(res["prefill"]))
    return "\n".join(lines)


def format_prefill_cost(pf: Mapping[str, Any]) -> str:
    """The encode-only prefill costing as a table (bench.cost.encode_only_prefill_cost)."""
    chips = list(pf["peak_tflops"])
    lines = [f"metal-sim encode-only prefill, chunks of {pf['chunk']} tokens (MODELLED, not measured; "
             "simulator-verified, hardware-unverified)",
             f"{'tokens':>7} {'route':>9} {'chunks':>6} {'cmdbufs':>7} {'waits':>5} {'disp/chunk':>10} "
             f"{'levels/chunk':>12} {'TFLOP':>8} {'GB':>8}"]
    for n, p in pf["prompts"].items():
        for route, r in p["routes"].items():
            k = len(r["chunks"])
            lines.append(f"{n:>7} {route:>9} {k:>6} {r['command_buffers']:>7} {r['host_waits']:>5} "
                         f"{max(c['dispatches'] for c in r['chunks']):>10} "
                         f"{max(c['levels'] for c in r['chunks']):>12} {r['flops'] / 1e12:>8.2f} "
                         f"{(r['bytes_read'] + r['bytes_written']) / 1e9:>8.1f}")
    lines.append(f"{'tokens':>7}  " + "  ".join(f"{c:>8}" for c in chips) + f"  {'M5@Lily':>8}"
                 + "   published M5 Max tok/s (modelled M5 Max / it; at Lily's rate / it)")
    for n, p in pf["prompts"].items():
        pub = p["published_m5_max"]
        ref = "  ".join(f"{k} {v:.0f} ({p['m5_max_vs'][k]:.2f}x; {p['m5_max_at_lily_rate_vs'][k]:.2f}x)"
                        for k, v in pub.items() if v)
        lines.append(f"{n:>7}  " + "  ".join(f"{p['modelled_tok_s'][c]:>8.0f}" for c in chips)
                     + f"  {p['m5_max_at_lily_rate_tok_s']:>8.0f}   {ref}")
        lines.append(f"{'occup.':>7}  " + "  ".join(f"{p['modelled_tok_s_occupancy'][c]:>8.0f}" for c in chips)
                     + "   the same with occupancy (the cores each dispatch's grid fills; bench.occupancy)")
    lines.append("modelled tok/s: per dependency level max(bytes / bandwidth, FLOPs / peak) + "
                 f"{pf['level_latency_us']:.1f} us; peaks (TFLOP/s) "
                 + ", ".join(f"{c} {v} ({pf['chip_route'][c]})" for c, v in pf["peak_tflops"].items())
                 + f"; M5@Lily: the M5 Max at the {pf['m5_lily_rate_tflops']} TFLOP/s Lily's 4K prefill implies "
                 "(assumptions: docs/metal.md)")
    return "\n".join(lines)


def run_kernels(args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    """`qwenmetal bench --backend metal-sim --kernels` (qwenmetal.bench.kernels)."""
    if args.backend != "metal-sim":
        raise ValueError("--kernels needs --backend metal-sim")
    c = _costed_config(args)
    log("counting bank conflicts on the tiny fixture model (simulator)")
    counted = count_kernels(log=log)
    contexts = _ints(args.contexts) if args.contexts else (4096,)
    return kernel_table(c, counted, context=contexts[0], chunk=args.prefill_chunk or DEFAULT_PREFILL_CHUNK,
                        kv_dtype=args.kv_dtype or "bfloat16")


def main_args(args: argparse.Namespace) -> int:
    def log(msg):
        print(msg, file=sys.stderr, flush=True)
    if getattr(args, "kernels", False):
        res = {"kernels": run_kernels(args, log)}
        if getattr(args, "encode_only", False):
            res["encode_only"] = run_encode_only(args)
            print(format_encode_only(res["encode_only"]))
        print(format_kernels(res["kernels"]))
    elif getattr(args, "encode_only", False):
        res = run_encode_only(args)
        print(format_encode_only(res))
    elif getattr(args, "speculative", False):
        res = run_speculative_args(args, log)
        print(format_speculative(res))
    elif getattr(args, "batch", None):
        res = run_batch_args(args, log)
        print(format_batch(res))
    else:
        res = run_limited(args, log=log) if args.memory_limit else run(args, log=log)
        print(format_table(res))
    write_json(args.json, res)
    return 0


def run_speculative_args(args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    """`bench --speculative` (qwenmetal.bench.speculative) on the benchmark's model, with the machine."""
    threads = args.threads or _usable_cpus()
    model, path, cfg_name, options, load_s = load_model(args, threads, log)
    machine = machine_info()
    log(f"machine: {describe_machine(machine)}")
    context = _ints(args.contexts)[0] if args.contexts else (64 if args.quick else 512)
    tokens = args.decode_steps or (12 if args.quick else 64)
    res = run_speculative(model, context, tokens, args.repeats or (1 if args.quick else 3), log)
    if sim_available():     # the Metal graph's verification, and DFlash decoding with it, modelled (encode-only)
        cfg = ModelConfig.from_dict(resolve_config(args.config or "real", 4 if args.quick else 40))
        mm = encode_only_verify_cost(cfg, rows=sorted(set(ROWS) | set(LENGTHS) - {1}),
                                     context=256 if args.quick else 4096)
        lm_head = decode_bytes(cfg, virtual_weight_table(cfg)[2], 0)["weight_parts"]["lm_head"]
        dm = encode_only_dflash_cost(cfg, context=256 if args.quick else 4096, rows=LENGTHS)
        mm["lengths"] = modelled_lengths(mm, lm_head, draft_modelled=dm)
        mm["draft_modelled"] = dm
        mm["rows"] = {n: r for n, r in mm["rows"].items() if n in ROWS}
        mm["layers"] = cfg.num_hidden_layers
        res["metal_modelled"] = mm
        # the MTP head's drafting round in the graph (a one-layer head, a round's 4 verified pairs)
        res["metal_mtp_modelled"] = encode_only_mtp_cost(cfg, context=256 if args.quick else 4096)
    res.update({"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine,
                "model": {"config": cfg_name, "checkpoint": str(path), "layers": model.config.num_hidden_layers},
                "backend": model.backend, "options": options, "threads": threads,
                "engine": model.backend_info()})
    res["machine_label"] = describe_machine(machine)
    return res


def run_batch_args(args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    """`bench --batch 1,2,4,8` (qwenmetal.bench.batch) on the benchmark's model, with the machine. The distinct
    experts per step are counted on a twin with an expert cache of every expert (--batch-routing measured,
    the default) where the backend streams experts; else the random-routing estimate."""
    batches = _ints(args.batch)
    threads = args.threads or _usable_cpus()
    model, path, cfg_name, options, load_s = load_model(args, threads, log)
    machine = machine_info()
    log(f"machine: {describe_machine(machine)}")
    context = args.context or (_ints(args.contexts)[0] if args.contexts else (32 if args.quick else 512))
    steps = args.decode_steps or (3 if args.quick else 16)
    repeats = args.repeats or (1 if args.quick else 3)
    kv_dtype = args.kv_dtype or model.backend_info().get("kv_dtype") or BACKEND_KV_DEFAULT.get(model.backend, "bfloat16")
    counter = None
    if args.batch_routing == "measured" and model.expert_counters() is not None:
        try:
            counter = Model.load(str(path), backend=model.backend,
                                 **dict(options, expert_slots=model.config.num_experts, memory_budget=None))
        except Exception as e:              # the estimate instead, said in the result
            log(f"no expert-cache twin ({e}); distinct experts from the random-routing estimate")
    busy = wait_quiet(args.wait_quiet, log=log) if args.wait_quiet else busy_fraction(1.0)
    with ForeignLoad() as fl:
        res = run_batch(model, batches, context, steps, repeats, log, KV_ELEMENT_BYTES.get(kv_dtype, 2), counter)
    del counter
    res["busy_before"], res["foreign_load"] = busy, fl.fraction
    log(f"other processes used {100 * (fl.fraction or 0):.0f}% of the CPUs during the run")
    res.update({"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine,
                "model": {"config": cfg_name, "checkpoint": str(path), "layers": model.config.num_hidden_layers,
                          "num_experts": model.config.num_experts, "num_experts_per_tok": model.config.num_experts_per_tok,
                          "weights_bytes": int(sum(tensor_sizes(model.weights).values()))},
                "backend": model.backend, "options": options, "threads": threads, "kv_dtype": kv_dtype,
                "engine": model.backend_info(), "load_seconds": load_s, "peak_rss_bytes": peak_rss_bytes()})
    res["machine_label"] = describe_machine(machine)
    return res


def write_json(path: str | None, obj) -> None:
    """Write a benchmark's results as indented JSON to `path` (nothing when it is None)."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="qwenmetal bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return main_args(p.parse_args(argv))

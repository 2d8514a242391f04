"""Expert streaming under real memory limits: the benchmark checkpoint run fully resident, then in memory
cgroups of --limits percent of its size (qwenmetal with each --policies expert-cache policy, the budget
"auto" reading the cgroup's limit), against llama.cpp's mmap'd run under the same limits.

    python benchmarks/streaming_matrix.py --json streaming.json          # 100/50/25 %, lru/lfu/os, + llama.cpp
    python benchmarks/streaming_matrix.py --markdown streaming.json      # the table of an earlier run
    python benchmarks/streaming_matrix.py --skip-llama --json a.json; ... --skip-qwenmetal --json b.json
    python benchmarks/streaming_matrix.py --markdown a.json b.json       # the two halves in one table

Every arm is a fresh process (`qwenmetal bench --memory-limit`, `llama_cpp_compare.py --worker` inside
`qwenmetal.memlimit.run`), the checkpoint (or GGUF) evicted from the page cache first, so each limited arm
starts cold and reads from the disk what does not fit. llama.cpp under a limit runs without repacked
weight copies (`--no-repack`): they are anonymous memory as large as the weights. Memory read bandwidth
and the disk's cold read bandwidth are measured before the first arm and after the last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from llama_cpp_compare import _csv, _run_json, convert_gguf, log  # noqa: E402


def run_matrix(a) -> dict:
    from qwenmetal.bench import ForeignLoad, ensure_checkpoint, measure_read_bandwidth, resolve_config
    from qwenmetal.bench.bandwidth import measure_file_read
    from qwenmetal.bench.cli import checkpoint_bytes

    ckpt = Path(a.model) if a.model else ensure_checkpoint(resolve_config("real", a.layers), 0, log=log)
    gguf = ckpt.parent / f"{ckpt.name}.q4_0.gguf"
    if not a.skip_llama and not gguf.exists():
        log(f"writing {gguf} (one-time) ...")
        convert_gguf(ckpt, gguf, "q4_0", log=log)
    size = checkpoint_bytes(ckpt)
    shards = sorted(str(ckpt / f) for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    common = ["--threads", str(a.threads), "--prefill", _csv(a.prefill), "--contexts", _csv(a.contexts),
              "--repeats", str(a.repeats), "--decode-steps", str(a.decode_steps)]
    qm = [sys.executable, "-m", "qwenmetal.bench", "--model", str(ckpt), "--bandwidth-bytes", "0"] + common
    llama = [sys.executable, str(HERE / "llama_cpp_compare.py"), "--worker", "--gguf", str(gguf)] + common
    arms = [] if a.skip_qwenmetal else [("qwenmetal", None, None, qm)]
    if not a.skip_llama:
        arms.append(("llama.cpp", None, None, llama))
    for pct in a.limits:
        limit = size * pct // 100
        for policy in ([] if a.skip_qwenmetal else a.policies if pct < 100 else a.policies[:1]):
            arms.append(("qwenmetal", pct, policy, qm + ["--memory-limit", str(limit), "--expert-policy", policy]))
        if not a.skip_llama:
            arms.append(("llama.cpp", pct, None, llama + ["--no-repack"]))
    result = {"schema": "qwenmetal-streaming-matrix/1", "checkpoint": str(ckpt), "checkpoint_bytes": size,
              "gguf": str(gguf), "threads": a.threads, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "bandwidth": [measure_read_bandwidth(a.threads)], "disk": [measure_file_read(shards)], "arms": []}
    for engine, pct, policy, cmd in arms:
        limit = size * pct // 100 if pct else None
        t = time.perf_counter()
        with ForeignLoad() as fl:       # the CPU time other processes took meanwhile (the box is shared)
            try:
                # qwenmetal bench puts itself in the cgroup (--memory-limit); llama.cpp's worker is put there here
                res = _run_json(cmd, f"{engine} {pct or 'resident'}% {policy or ''}",
                                limit if engine == "llama.cpp" else None, drop_cache=[gguf] if limit else ())
            except Exception as e:                      # an OOM-killed or failed arm is a result too
                res = {"error": str(e)[-2000:]}
        result["arms"].append({"engine": engine, "limit_percent": pct, "limit_bytes": limit, "policy": policy,
                               "wall_seconds": time.perf_counter() - t, "foreign_load": fl.fraction, "result": res})
        log(format_row(result["arms"][-1]))
    result["bandwidth"].append(measure_read_bandwidth(a.threads))
    result["disk"].append(measure_file_read(shards))
    return result


def _row_values(arm: dict) -> dict:
    res = arm["result"]
    if "error" in res:
        return {"error": res["error"].splitlines()[0][:120]}
    d, p = res["decode"][0], res["prefill"][0]
    e = d.get("experts") or {}
    ml = res.get("memory_limit") or {}
    return {"decode_tok_s": d["tokens_per_second"], "ms_per_token": d["ms_per_token"], "context": d["context"],
            "prefill_tok_s": p["tokens_per_second"], "prefill_tokens": p["tokens"],
            "hit_rate": e.get("hit_rate"), "mb_read_per_token": (e.get("bytes_read_per_token") or 0) / 1e6,
            "io_ms_per_token": 1e3 * (e.get("io_seconds_per_token") or 0), "slots": e.get("slots_per_layer"),
            "peak_gib": ml["peak_bytes"] / 2**30 if ml else res.get("peak_rss_bytes", 0) / 2**30,
            "peak_kind": "cgroup peak" if ml else "peak RSS", "digest": d["digest"],
            "foreign_load": arm.get("foreign_load", res.get("foreign_load"))}


def format_row(arm: dict) -> str:
    v = _row_values(arm)
    name = f"{arm['engine']} {str(arm['limit_percent']) + '%' if arm['limit_percent'] else 'no limit'}" \
           + (f" {arm['policy']}" if arm["policy"] else "")
    if "error" in v:
        return f"{name}: FAILED ({v['error']})"
    hr = "-" if v["hit_rate"] is None else f"{100 * v['hit_rate']:.1f}%"
    return (f"{name}: decode {v['decode_tok_s']:.2f} tok/s ({v['ms_per_token']:.1f} ms), prefill {v['prefill_tok_s']:.1f} "
            f"tok/s, slots {v['slots'] or '-'}, hit {hr}, {v['mb_read_per_token']:.1f} MB read/token, "
            f"I/O {v['io_ms_per_token']:.1f} ms/token, {v['peak_kind']} {v['peak_gib']:.2f} GiB")


def format_markdown(result: dict) -> str:
    bw = max(b["read_gbps"] for b in result["bandwidth"])
    disk = max(d["read_gbps"] for d in result["disk"])
    out = [f"Checkpoint {result['checkpoint_bytes'] / 1e9:.2f} GB; {result['threads']} threads; memory read bandwidth "
           f"{bw:.1f} GB/s, disk cold read {disk:.2f} GB/s (best of the runs before and after).", "",
           "| engine | memory limit | policy | slots / layer | decode tok/s | prefill tok/s | hit rate "
           "| MB read / token | I/O ms / token | peak (GiB) | other load |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm in result["arms"]:
        v = _row_values(arm)
        lim = f"{arm['limit_percent']} % ({arm['limit_bytes'] / 2**30:.2f} GiB)" if arm["limit_percent"] else "none"
        if "error" in v:
            out.append(f"| {arm['engine']} | {lim} | {arm['policy'] or '-'} | | failed: {v['error']} | | | | | | |")
            continue
        hr = "-" if v["hit_rate"] is None else f"{100 * v['hit_rate']:.1f} %"
        out.append(f"| {arm['engine']} | {lim} | {arm['policy'] or '-'} | {v['slots'] or '-'} | {v['decode_tok_s']:.2f} | "
                   f"{v['prefill_tok_s']:.1f} | {hr} | {v['mb_read_per_token']:.1f} | {v['io_ms_per_token']:.1f} | "
                   f"{v['peak_gib']:.2f} ({v['peak_kind']}) | "
                   + ("-" if v["foreign_load"] is None else f"{100 * v['foreign_load']:.0f} %") + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    def ints(s):
        return [int(x) for x in str(s).split(",") if x.strip()]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bench's cached one)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--limits", type=ints, default=[100, 50, 25], help="memory limits, percent of the checkpoint")
    p.add_argument("--policies", default="lru,lfu,os", help="expert-cache policies to measure under each limit < 100 %%")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill", type=ints, default=[128])
    p.add_argument("--contexts", type=ints, default=[128])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--skip-qwenmetal", action="store_true")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--markdown", default=None, nargs="+", metavar="JSON",
                   help="print the table of earlier runs (their arms in order; bandwidths: the best of all) and exit")
    a = p.parse_args(argv)
    from qwenmetal.bench.cli import write_json
    a.policies = [x for x in a.policies.split(",") if x]
    if a.markdown:
        runs = [json.loads(Path(f).read_text(encoding="utf-8")) for f in a.markdown]
        result = dict(runs[0], arms=[x for r in runs for x in r["arms"]],
                      bandwidth=[x for r in runs for x in r["bandwidth"]], disk=[x for r in runs for x in r["disk"]])
    else:
        result = run_matrix(a)
    print(format_markdown(result))
    if not a.markdown:
        write_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

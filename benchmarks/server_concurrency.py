"""Concurrent chat requests against the same requests served one after another, on loopback.

    python benchmarks/server_concurrency.py                          # 4 real-width layers, cpu, 4 x 128 tokens
    python benchmarks/server_concurrency.py --model DIR --requests 4 --max-tokens 128 --json out.json

One `qwenmetal serve --parallel N` process (the prefix cache off, so no round reuses another's prompt)
answers N chat requests of `--max-tokens` tokens each (greedy, `ignore_eos`, different messages) in two
arrangements, alternated over `--rounds` rounds (sequential, concurrent, concurrent, sequential, ...):

* sequential: one request after another, each sent when the previous one has been answered;
* concurrent: all N sent at once from N threads (the server batches them).

Printed: the wall time of each arrangement (median over rounds), their ratio (target: concurrent <= 0.6x
sequential), the aggregate tokens per second, each request's time to its last token, the server's /health
at the end (batched steps' occupancy), and the share of the CPUs other processes used during the rounds
(it first waits up to 2 minutes for a quiet machine). The CPU is named with the figures. A benchmark, not a test:
the box may be shared, so the two arrangements alternate in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_server import spawned_server  # noqa: E402  (starts `qwenmetal serve`, waits for /health)

MESSAGES = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.",
            "List ten facts about the moon.", "Describe a walk through a forest in autumn.",
            "What makes bread rise?", "Summarise the rules of chess.", "How do bees make honey?",
            "Why is the sky blue?"]


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = {k.strip(): v for k, v in (line.split(":", 1) for line in f if ":" in line)}
        name = info.get("model name", "?").strip()
        return f"{name} (family {info.get('cpu family', '?').strip()} model {info.get('model', '?').strip()})"
    except OSError:
        return "unknown CPU"


def _busy() -> float:
    """CPU seconds the whole machine has spent busy (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - (v[4] if len(v) > 4 else 0)) / os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> float:
    """CPU seconds process `pid` has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _request(base: str, i: int, max_tokens: int) -> dict:
    import httpx

    t0 = time.perf_counter()
    r = httpx.post(base + "/v1/chat/completions", timeout=3600, json={
        "messages": [{"role": "user", "content": MESSAGES[i % len(MESSAGES)]}], "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    r.raise_for_status()
    body = r.json()
    return {"seconds": time.perf_counter() - t0, "tokens": body["usage"]["completion_tokens"],
            "text": body["choices"][0]["message"]["content"]}


def _sequential(base, n, max_tokens):
    t0 = time.perf_counter()
    out = [_request(base, i, max_tokens) for i in range(n)]
    return time.perf_counter() - t0, out


def _concurrent(base, n, max_tokens):
    out = [None] * n
    errors = []

    def run(i):
        try:
            out[i] = _request(base, i, max_tokens)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the generated real-width checkpoint)")
    p.add_argument("--layers", type=int, default=4, help="layers of the generated checkpoint (default 4)")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="pairs of (sequential, concurrent) runs (default 2)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    import httpx
    from qwenmetal.bench import ensure_checkpoint, resolve_config
    from qwenmetal.bench.load import wait_quiet

    ckpt = Path(a.model) if a.model else ensure_checkpoint(resolve_config("real", a.layers), 0,
                                                            log=lambda s: print(s, file=sys.stderr))
    args = ["--model", str(ckpt), "--backend", a.backend, "--parallel", str(a.requests), "--cache-bytes", "0",
            "--log-level", "warning"]
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"server_concurrency.{os.getpid()}.log"
    seq, conc = [], []
    quiet = wait_quiet(120, log=lambda s: print(s, file=sys.stderr))
    with spawned_server(args, log) as (proc, base):
        _request(base, 0, 4)                                    # warm-up: page the weights in
        texts = None
        busy0, server0, self0, t0 = _busy(), _proc_cpu(proc.pid), time.process_time(), time.monotonic()
        for r in range(a.rounds):
            order = (_sequential, _concurrent) if r % 2 == 0 else (_concurrent, _sequential)
            for f in order:
                t, out = f(base, a.requests, a.max_tokens)
                (seq if f is _sequential else conc).append((t, out))
                got = [o["text"] for o in out]
                if texts is None:
                    texts = got
                elif got != texts:                              # batched answers are the lone answers
                    raise SystemExit("the concurrent answers differ from the sequential ones")
                print(f"round {r}: {f.__name__[1:]:10s} {t:7.2f} s", file=sys.stderr, flush=True)
        health = httpx.get(base + "/health", timeout=10).json()
        # other processes' share of the CPUs during the rounds: the machine's busy time less the server's and ours
        others = (_busy() - busy0) - (_proc_cpu(proc.pid) - server0) - (time.process_time() - self0)
        foreign = max(0.0, others / max(1e-9, (time.monotonic() - t0) * (os.cpu_count() or 1)))
    ts, tc = statistics.median(t for t, _ in seq), statistics.median(t for t, _ in conc)
    tokens = sum(o["tokens"] for o in seq[0][1])
    res = {"cpu": _cpu(), "checkpoint": str(ckpt), "backend": a.backend, "requests": a.requests,
           "max_tokens": a.max_tokens, "rounds": a.rounds, "sequential_seconds": [round(t, 3) for t, _ in seq],
           "concurrent_seconds": [round(t, 3) for t, _ in conc], "ratio": round(tc / ts, 3),
           "sequential_tok_s": round(tokens / ts, 2), "concurrent_tok_s": round(tokens / tc, 2),
           "concurrent_request_seconds": [round(o["seconds"], 2) for o in conc[-1][1]],
           "batch_occupancy": health.get("batch_occupancy"), "date": time.strftime("%Y-%m-%d"),
           "foreign_load_before": None if quiet is None else round(quiet, 3),
           "foreign_load_during": round(foreign, 3)}
    print(json.dumps(res, indent=1))
    verdict = "met" if res["ratio"] <= 0.6 else "MISSED"
    print(f"{a.requests} concurrent chats of {a.max_tokens} tokens: {tc:.2f} s vs {ts:.2f} s one after another "
          f"= {res['ratio']:.2f}x (target <= 0.6x: {verdict}); {res['concurrent_tok_s']} vs "
          f"{res['sequential_tok_s']} tok/s aggregate; {res['cpu']}; other processes used "
          f"{100 * foreign:.0f}% of the CPUs during the rounds")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

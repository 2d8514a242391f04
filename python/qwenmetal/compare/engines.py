"""One engine of ``qwenmetal compare``, in a process of its own:

    python -m qwenmetal.compare.engines SPEC.json RESULT.json

`SPEC.json` (written by :mod:`qwenmetal.compare.cli`): ``engine`` (``"qwenmetal"``, ``"mlx-lm"``,
``"llama.cpp"``), ``checkpoint``, ``gguf`` (llama.cpp), ``backend`` / ``options`` (qwenmetal), ``threads``,
``vocab``, ``lengths`` (each point: a prefill of that many synthetic prompt tokens, then ``steps`` greedy
decode steps at that context), ``repeats``, ``quality_tokens`` / ``quality_out`` (optional: the
teacher-forced logits of those tokens, saved as .npy). The result: every sample, the medians, the token
digests, the drift check, the other processes' share of the CPUs, the peak memory and the versions.

Every engine is timed the same way, as the published Lily benchmark times MLX (docs/benchmarks.md,
"qwenmetal compare"): a token stream of ``steps + 1`` greedy tokens after the prompt; the prefill is the
time to the first token, the decode rate the mean interval between the later ones. Each point first runs
once untimed at its exact shape. Each engine's stream is its own fastest batch-1 path:

* qwenmetal: ``Model.generate(ids, temperature=0, ignore_eos=True, cache=False)`` (the prefix cache off,
  so a repeat prefills again; on Metal the pipelined GPU decode loop);
* mlx-lm: ``mlx_lm.generate.generate_step`` (what ``stream_generate`` runs, without its EOS stop; 2048-token
  prefill chunks, one token of lookahead);
* llama.cpp: ``Llama.eval`` of the prompt, then one ``eval`` per token, argmax of the last logits
  (llama-cpp-python); without it, a ``llama-bench`` binary (``spec["llama_bench"]``): its prompt test
  ``-p L -n 0`` and its generation test at that depth ``-p 0 -n steps -d L``, ``-r repeats``, with its own
  warm-up. llama-bench streams no tokens and returns no logits: no digests, no quality figures.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Iterator

import numpy as np

from ..bench import ForeignLoad, fnv1a, peak_rss_bytes, synthetic_prompt
from ..fileio import atomic_file
from ..model import Model
from ..version import __version__
from . import llama

ENGINES = ("qwenmetal", "mlx-lm", "llama.cpp")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# the engines: open(spec) -> (stream(ids, n) -> n greedy tokens, teacher_forced(tokens) -> logits, versions)
# ---------------------------------------------------------------------------------------------
def _open_qwenmetal(spec: dict):

    opts = dict(spec.get("options") or {})
    if spec.get("backend") == "cpu":
        opts.setdefault("threads", spec["threads"])
    model = Model.load(spec["checkpoint"], backend=spec["backend"], **opts)
    longest = max(spec["lengths"], default=1) + spec["steps"] + 2

    def stream(ids, n) -> Iterator[int]:
        s = model.new_session(max_context=max(longest, len(ids) + n + 1))
        for o in model.generate(list(ids), max_tokens=n, temperature=0, ignore_eos=True, cache=False,
                                session=s):
            yield int(o.token)

    def teacher_forced(tokens):
        return model.prefill(model.new_session(max_context=len(tokens) + 1), list(tokens), return_logits="all")

    versions = {"qwenmetal": __version__, "backend": model.backend, "options": opts}
    return stream, teacher_forced, versions


def _open_mlx(spec: dict):
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    model, _ = mlx_lm.load(spec["checkpoint"])

    def stream(ids, n) -> Iterator[int]:
        for tok, _ in generate_step(mx.array(list(ids)), model, max_tokens=n):
            yield int(tok)

    def teacher_forced(tokens):
        out = model(mx.array(list(tokens))[None])
        return np.array(out[0].astype(mx.float32))

    versions = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "device": str(mx.default_device())}
    return stream, teacher_forced, versions


def _open_llama(spec: dict):

    llama_cpp = llama.import_llama()
    n_ctx = max(max(spec["lengths"], default=1) + spec["steps"] + 16, 64)
    n_batch = min(2048, max(max(spec["lengths"], default=1), 32))
    gpu_layers = -1 if sys.platform == "darwin" else 0          # the Metal build offloads every layer
    llm = llama.open_llama(spec["gguf"], spec["threads"], n_ctx, n_batch, flash_attn=True, gpu_layers=gpu_layers)

    def stream(ids, n) -> Iterator[int]:
        llm.reset()
        llm.eval([int(t) for t in ids])
        tok = int(np.argmax(llama.last_logits(llm)))
        yield tok
        for _ in range(n - 1):
            llm.eval([tok])
            tok = int(np.argmax(llama.last_logits(llm)))
            yield tok

    def teacher_forced(tokens):
        q = llama.open_llama(spec["gguf"], spec["threads"], len(tokens) + 8, len(tokens), flash_attn=True,
                             logits_all=True, gpu_layers=gpu_layers)
        try:
            return llama.teacher_forced(q, tokens)
        finally:
            del q

    versions = {"llama_cpp_python": llama_cpp.__version__, "gguf": spec["gguf"],
                "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
                "settings": {"n_ctx": n_ctx, "n_batch": n_batch, "n_ubatch": min(512, n_batch), "flash_attn": True,
                             "kv_dtype": "float16", "threads": spec["threads"], "n_gpu_layers": gpu_layers}}
    return stream, teacher_forced, versions


def llama_bench_point(binary: str, gguf: str, threads: int, length: int, steps: int, repeats: int,
                      gpu_layers: int, run=subprocess.run) -> dict:
    """A point from two llama-bench tests (JSON lines): prefill of `length` tokens, and `steps` generated
    tokens at depth `length`; per-repetition samples, medians."""
    common = [binary, "-m", gguf, "-o", "jsonl", "-r", str(repeats), "-t", str(threads), "-fa", "on",
              "-ngl", str(gpu_layers)]
    rows = []
    for args in (["-p", str(length), "-n", "0"], ["-p", "0", "-n", str(steps), "-d", str(length)]):
        out = run(common + args, capture_output=True, text=True, check=False)
        lines = [ln for ln in out.stdout.splitlines() if ln.strip().startswith("{")]
        if out.returncode != 0 or not lines:
            tail = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
            raise RuntimeError(f"llama-bench {' '.join(args)}: {tail}")
        rows.append(json.loads(lines[-1]))
    pre, dec = rows
    pre_s = [length / ts for ts in pre["samples_ts"]]
    dec_s = [1.0 / ts for ts in dec["samples_ts"]]
    med_pre, med_dec = statistics.median(pre_s), statistics.median(dec_s)
    return {"length": length, "steps": steps, "prefill_seconds": med_pre, "prefill_tok_s": length / med_pre,
            "decode_seconds_per_token": med_dec, "decode_tok_s": 1.0 / med_dec, "digest": None,
            "digest_stable": None, "samples": [{"prefill_seconds": a, "decode_seconds_per_token": b}
                                               for a, b in zip(pre_s, dec_s)],
            "llama_bench": {"build_commit": pre.get("build_commit"), "backends": pre.get("backends"),
                            "n_batch": pre.get("n_batch"), "n_ubatch": pre.get("n_ubatch"),
                            "type_k": pre.get("type_k"), "flash_attn": pre.get("flash_attn")}}


def _open_llama_bench(spec: dict):
    binary = spec["llama_bench"]
    gpu_layers = -1 if sys.platform == "darwin" else 0
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    versions = {"llama_bench": binary, "version": (version.stdout + version.stderr).strip().splitlines()[-1:] or None,
                "gguf": spec["gguf"], "settings": {"threads": spec["threads"], "n_gpu_layers": gpu_layers,
                                                   "flash_attn": "on"}}

    def measure(n):
        return llama_bench_point(binary, spec["gguf"], spec["threads"], n, spec["steps"], spec["repeats"], gpu_layers)
    return measure, None, versions


def _streamed(opener: Callable) -> Callable:
    """An engine that streams tokens: measure(length) is `measure_point` over its stream."""
    def open_(spec: dict):
        stream, teacher_forced, versions = opener(spec)
        return (lambda n: measure_point(stream, spec["vocab"], n, spec["steps"], spec["repeats"]),
                teacher_forced, versions)
    return open_


# engine -> open(spec) -> (measure(length) -> point, teacher_forced(tokens) -> logits or None, versions)
OPENERS: dict[str, Callable] = {"qwenmetal": _streamed(_open_qwenmetal), "mlx-lm": _streamed(_open_mlx),
                                "llama.cpp": _streamed(_open_llama), "llama-bench": _open_llama_bench}


# ---------------------------------------------------------------------------------------------
# the method
# ---------------------------------------------------------------------------------------------
def time_stream(stream: Callable, ids, steps: int) -> dict:
    """One sample: the seconds to the first of ``steps + 1`` streamed tokens (the prefill), the mean interval
    between the later ones (the decode), the tokens' FNV-1a digest."""
    toks, stamps = [], []
    t0 = time.perf_counter()
    for tok in stream(ids, steps + 1):
        stamps.append(time.perf_counter())
        toks.append(tok)
    if len(toks) != steps + 1:
        raise RuntimeError(f"the engine streamed {len(toks)} tokens, expected {steps + 1}")
    return {"prefill_seconds": stamps[0] - t0,
            "decode_seconds_per_token": (stamps[-1] - stamps[0]) / steps if steps else None,
            "digest": fnv1a(toks[1:]), "first_token": toks[0]}


def measure_point(stream: Callable, vocab: int, length: int, steps: int, repeats: int) -> dict:
    """A point: one untimed run at the exact shape, then `repeats` samples; medians and the digests."""
    ids = synthetic_prompt(length, vocab).tolist()
    time_stream(stream, ids, min(steps, 4))                     # exact-shape warm-up (prefill + a few steps)
    samples = [time_stream(stream, ids, steps) for _ in range(repeats)]
    pre = statistics.median(s["prefill_seconds"] for s in samples)
    out = {"length": length, "steps": steps, "samples": samples, "prefill_seconds": pre,
           "prefill_tok_s": length / pre, "digest": samples[0]["digest"],
           "digest_stable": len({s["digest"] for s in samples}) == 1}
    if steps:
        dec = statistics.median(s["decode_seconds_per_token"] for s in samples)
        out.update(decode_seconds_per_token=dec, decode_tok_s=1.0 / dec)
    return out


def run(spec: dict) -> dict:
    engine = spec["engine"]
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; the engines are {ENGINES}")
    route = "llama-bench" if engine == "llama.cpp" and spec.get("llama_bench") else engine
    t = time.perf_counter()
    measure, teacher_forced, versions = OPENERS[route](spec)
    res = {"engine": engine, "route": route, "versions": versions, "load_seconds": time.perf_counter() - t,
           "points": [], "pid": os.getpid()}
    with ForeignLoad() as fl:
        for n in spec["lengths"]:
            p = measure(n)
            res["points"].append(p)
            log(f"  {engine:<10} {n:>7} tokens: prefill {p['prefill_tok_s']:9.1f} tok/s"
                + (f", decode {p['decode_tok_s']:8.2f} tok/s" if "decode_tok_s" in p else ""))
        if spec["lengths"] and spec.get("drift", True):     # the first point again: did the machine drift?
            first = res["points"][0]
            again = measure(first["length"])
            res["drift"] = {"length": first["length"], "again": again,
                            "prefill": again["prefill_tok_s"] / first["prefill_tok_s"] - 1.0,
                            "decode": (again["decode_tok_s"] / first["decode_tok_s"] - 1.0)
                            if "decode_tok_s" in first else None}
    res["foreign_load"] = fl.fraction
    if spec.get("quality_tokens") and teacher_forced is None:
        res["quality_unavailable"] = f"{route} returns no logits"
    elif spec.get("quality_tokens"):
        logits = np.asarray(teacher_forced(spec["quality_tokens"]), np.float32)
        np.save(spec["quality_out"], logits)
        res["quality_logits"] = spec["quality_out"]
    res["peak_rss_bytes"] = peak_rss_bytes()
    if engine == "mlx-lm":
        import mlx.core as mx
        res["peak_device_bytes"] = int(mx.get_peak_memory())
    return res


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m qwenmetal.compare.engines SPEC.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    res = run(spec)
    with atomic_file(argv[1]) as tmp:
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

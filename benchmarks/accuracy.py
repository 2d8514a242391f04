"""The accuracy-contract figures (docs/cpu.md, "Accuracy contract") of every mode in
`qwenmetal.accuracy.MODES`, against the float32 reference, teacher-forced on a seeded random prompt and
the reference's own greedy continuation.

    python benchmarks/accuracy.py                        # the fixtures (tiny, tiny-qwen3-next; mlx-q4, mlx-q8)
    flock /tmp/qwenmetal-bench.lock python benchmarks/accuracy.py --real 4 --prompt 32 --steps 16

``--real N`` runs the `qwenmetal bench` checkpoint (Qwen3.6-35B-A3B widths, N layers, random weights,
MLX 4-bit) instead: the reference dequantizes every weight to float32 (about 16 GiB at 4 layers; the
float and bfloat16 reference share that copy, `accuracy.load_mode`), and the sequence is kept short. ``--json`` writes
the figures with the CPU they came from.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import qwenmetal as qm
from qwenmetal import _core
from qwenmetal import accuracy as A


def cpu_record() -> dict:
    """What this CPU is and what the engine chose on it (cpu_info() where the extension has it)."""
    info = _core.cpu_info() if hasattr(_core, "cpu_info") else {"isa": _core.cpu_isa(), "amx": _core.cpu_amx()}
    return {"machine": platform.machine(), **info}


def run(path, prompt_len: int, steps: int, seed: int, log) -> dict:
    """Every mode's measures on the checkpoint at `path`."""
    t0 = time.time()
    ref = qm.Model.load(path, backend="reference")
    ids = A.prompt(ref.config.vocab_size, prompt_len, seed)
    tokens, want = A.greedy_sequence(ref, ids, steps)
    log(f"  float32 reference: {len(tokens)} positions in {time.time() - t0:.0f} s")
    out = {}
    for name, (backend, _) in A.MODES.items():
        t0 = time.time()
        model = A.load_mode(name, path, ref)
        out[name] = A.compare(model, want, tokens, prompt_len)
        if backend == "cpu":
            out[name]["resolved"] = {"activations": model._backend.activations, "kv_dtype": model._backend.kv_dtype}
        log(f"  {name:20s} " + " ".join(f"{k}={out[name][k]:.3g}" for k in A.MEASURES) +
            f"  ({time.time() - t0:.0f} s)")
        del model
    bar = out["reference bfloat16"]
    for name, m in out.items():
        m["meets_contract"] = not A.meets(m, bar)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", type=int, metavar="LAYERS", help="the real-width bench checkpoint with LAYERS layers")
    ap.add_argument("--prompt", type=int, default=20, help="prompt tokens (one prefill)")
    ap.add_argument("--steps", type=int, default=32, help="greedy continuation tokens (decode steps)")
    ap.add_argument("--seed", type=int, default=0, help="the prompt's seed")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)

    def log(s):
        print(s, file=sys.stderr, flush=True)

    if a.real is not None:
        from qwenmetal.bench.checkpoint import ensure_checkpoint, resolve_config
        cases = {f"real-L{a.real} mlx-q4": ensure_checkpoint(resolve_config("real", a.real), log=log)}
    else:
        from qwenmetal.testing import cached_checkpoint
        cases = {f"{p} {f}": cached_checkpoint(p, f, seed=0)
                 for p in ("tiny", "tiny-qwen3-next") for f in ("mlx-q4", "mlx-q8")}
    result = {"cpu": cpu_record(), "prompt": a.prompt, "steps": a.steps, "seed": a.seed,
              "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "cases": {}}
    for case, path in cases.items():
        log(f"{case}: {path}")
        result["cases"][case] = run(path, a.prompt, a.steps, a.seed, log)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time the CPU engine's integer prefill GEMM (4-bit group-64 weights, int8/int16 inputs) per kernel.

    flock /tmp/qwenmetal-bench.lock python benchmarks/prefill_gemm.py            # 1 thread, real shapes
    flock /tmp/qwenmetal-bench.lock python benchmarks/prefill_gemm.py --threads 2 --rounds 9
    flock /tmp/qwenmetal-bench.lock python benchmarks/prefill_gemm.py --layers 4 --threads 2   # whole model

Kernels (forced through the _core switches, alternated round by round so that the box's drift hits
every one alike): `tile` the older 1-row x 16-input register tile, `vnni` the AVX-512 VNNI GEMM
(rows in lanes), `amx` the tile unit where this CPU and OS allow it. Shapes: an MoE expert's gate/up
(512 x 2048, 16 tokens: one call, as an expert task) and a dense 2048 x 2048 matrix over 512 tokens
(the engine's prefill split: 64-row tasks). GMAC/s = rows * cols * tokens / the median of the rounds'
fastest calls. With ``--layers N``: whole-model prefill tok/s instead (the ``qwenmetal bench``
checkpoint with N layers, activations int16 and int8, the synthetic prompt of ``qwenmetal bench``, prompts
``--prompts``), the kernels alternated the same way within one process. The CPU is printed with the figures.
"""
from __future__ import annotations

import argparse
import statistics
import time

import ml_dtypes
import numpy as np

from qwenmetal import _core
from qwenmetal.backends.cpu import describe
from qwenmetal.weights import QuantizedTensor

SHAPES = {"expert": (512, 2048, 16), "dense": (2048, 2048, 512)}


def matrix(rows: int, cols: int, rng) -> QuantizedTensor:
    wq = rng.integers(0, 2**32, size=(rows, cols // 8), dtype=np.uint32)
    s = rng.uniform(0.001, 0.01, size=(rows, cols // 64)).astype(ml_dtypes.bfloat16)
    b = rng.uniform(-0.05, 0.05, size=(rows, cols // 64)).astype(ml_dtypes.bfloat16)
    return QuantizedTensor(wq, s, b, 4, 64)


def force(kernel: str) -> None:
    _core.cpu_set_amx(kernel == "amx")
    _core.cpu_set_vnni_gemm(kernel != "tile")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f if ":" in line and line.split(":", 1)[0].strip()
                        in ("model name", "cpu family", "model"))
        info = {k.strip(): v.strip() for k, v in info.items()}
        return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')}, model {info.get('model', '?')})"
    except OSError:
        return "unknown CPU"


def model_prefill(args, kernels: list[str]) -> None:
    import qwenmetal as qm
    from qwenmetal.bench.checkpoint import ensure_checkpoint, resolve_config
    from qwenmetal.bench.timing import synthetic_prompt

    path = ensure_checkpoint(resolve_config("real", args.layers), 0)
    for act in ("int16", "int8"):
        model = qm.Model.load(path, backend="cpu", threads=args.threads, activations=act)
        vocab = model.config.vocab_size
        for n in (int(p) for p in args.prompts.split(",")):
            ids = synthetic_prompt(n, vocab)
            best: dict[str, list[float]] = {k: [] for k in kernels}
            for _ in range(args.rounds):
                for k in kernels:
                    force(k)
                    t0 = time.perf_counter()
                    model.prefill(model.new_session(), ids, "last")
                    best[k].append(time.perf_counter() - t0)
            cells = "  ".join(f"{k} {n / statistics.median(best[k]):6.1f}" for k in kernels)
            print(f"{args.layers} layers, {act:>5}, prompt {n:>4}: prefill tok/s  {cells}", flush=True)
        del model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=5, help="calls per round (the fastest counts)")
    ap.add_argument("--shapes", default="expert,dense")
    ap.add_argument("--layers", type=int, default=0, help="whole-model prefill of this many layers instead")
    ap.add_argument("--prompts", default="128,512,2048", help="prompt lengths with --layers")
    args = ap.parse_args()
    kernels = ["tile", "vnni"] + (["amx"] if _core.cpu_amx_available() else [])
    print(f"{cpu_name()}; isa {_core.cpu_isa()}; threads {args.threads}; kernels {', '.join(kernels)}")
    if args.layers:
        try:
            model_prefill(args, kernels)
        finally:
            force("amx")
        return
    rng = np.random.default_rng(0)
    keep: list = []
    try:
        for name in args.shapes.split(","):
            rows, cols, tokens = SHAPES[name]
            d = describe(matrix(rows, cols, rng), keep)
            x = rng.normal(size=(tokens, cols)).astype(np.float32)
            for planes in (1, 2):
                best: dict[str, list[float]] = {k: [] for k in kernels}
                for _ in range(args.rounds):
                    for k in kernels:
                        force(k)
                        best[k].append(_core.cpu_linear_timed(d, x, args.threads, "avx512", planes, args.repeats)[1])
                macs = rows * cols * tokens
                cells = "  ".join(f"{k} {macs / statistics.median(best[k]) / 1e9:6.1f}" for k in kernels)
                print(f"{name:>6} {rows}x{cols} x {tokens:>3} tokens, {('int8', 'int16')[planes - 1]:>5}: "
                      f"GMAC/s  {cells}", flush=True)
    finally:
        force("amx")


if __name__ == "__main__":
    main()

"""Time the CPU engine's decode GEMV (one input row) on expert matrices at every MLX affine width.

    python benchmarks/gemv_bits.py                         # 512 x 2048 (Qwen3.6-35B-A3B gate/up), 1 and 2 threads
    python benchmarks/gemv_bits.py --rows 1024 --cols 4096 --experts 64 --isa avx2

Two numbers per width: one expert matrix called `--repeats` times (it stays in L2 between calls: the
kernel's compute rate), and a stack of `--experts` expert matrices as one tall matrix (streams from
DRAM, as the experts of a decode step do). Group 64, bf16 scales; the packed words are random (the
speed does not depend on the values). GB/s counts the packed weights plus scales and biases.
"""
from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

from qwenmetal import _core
from qwenmetal.backends.cpu import describe
from qwenmetal.quant import SUPPORTED_BITS
from qwenmetal.weights import QuantizedTensor


def matrix(rows: int, cols: int, bits: int, gs: int, rng) -> QuantizedTensor:
    wq = rng.integers(0, 2**32, size=(rows, cols * bits // 32), dtype=np.uint32)
    s = rng.uniform(0.001, 0.01, size=(rows, cols // gs)).astype(ml_dtypes.bfloat16)
    b = rng.uniform(-0.05, 0.05, size=(rows, cols // gs)).astype(ml_dtypes.bfloat16)
    return QuantizedTensor(wq, s, b, bits, gs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128, help="matrices in the DRAM-streaming stack")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--isa", default="", help="portable | avx2 | avx512 (default: the best this CPU has)")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, args.cols)).astype(np.float32)
    print(f"isa {args.isa or _core.cpu_isa()}, expert {args.rows} x {args.cols}, group 64, "
          f"stack of {args.experts}")
    print("bits  activations  threads  one expert: us  GW/s  GB/s   stack: ms  GW/s  GB/s")
    for bits in SUPPORTED_BITS:
        one = matrix(args.rows, args.cols, bits, 64, rng)
        stack = matrix(args.rows * args.experts, args.cols, bits, 64, rng)
        keep: list = []
        d1, ds = describe(one, keep), describe(stack, keep)
        for planes in ((0, 2) if bits == 4 else (0,)):
            for th in (int(t) for t in args.threads.split(",")):
                _, t1 = _core.cpu_linear_timed(d1, x, th, args.isa, planes, args.repeats)
                _, ts = _core.cpu_linear_timed(ds, x, th, args.isa, planes, max(10, args.repeats // 10))
                w1, ws = args.rows * args.cols, args.rows * args.cols * args.experts
                print(f"{bits:>4}  {('float', 'int8', 'int16')[planes]:>11}  {th:>7}  {t1 * 1e6:>14.1f}  "
                      f"{w1 / t1 / 1e9:>4.1f}  {one.nbytes / t1 / 1e9:>4.1f}   {ts * 1e3:>8.2f}  {ws / ts / 1e9:>4.1f}  "
                      f"{stack.nbytes / ts / 1e9:>4.1f}")


if __name__ == "__main__":
    main()

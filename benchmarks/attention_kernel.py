"""Time the CPU engine's decode attention kernel alone, at the real Qwen3.6-35B-A3B head layout.

    python benchmarks/attention_kernel.py                      # contexts 1024, 4096, 16384; 2 threads
    python benchmarks/attention_kernel.py --contexts 4096 --threads 1 --isa avx2

One full-attention layer, one query token (decode), 16 query heads sharing 2 KV heads of dimension 256,
bf16 cache (the default). The cache is built once and the kernel run `--repeats` times; the best time is
printed with the cache bytes it reads per call. A cache this small stays in the L3 between repeats, so
this measures the kernel's compute, not DRAM: in a real decode the cache streams from memory between
the weight reads (docs/cpu.md, "Kernels: attention").
"""
from __future__ import annotations

import argparse

import numpy as np

from qwenmetal import _core


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,4096,16384", help="comma-separated cached-key counts")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", default="", help="portable | avx2 | avx512 (default: the best this CPU has)")
    ap.add_argument("--kv-f32", action="store_true", help="float32 cache instead of bf16")
    ap.add_argument("--repeats", type=int, default=50)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, a.heads, a.head_dim)).astype(np.float32)
    print(f"{'context':>8} {'ms/layer':>9} {'cache MB':>9} {'GB/s':>6}")
    for T in (int(c) for c in a.contexts.split(",")):
        K = rng.normal(size=(T, a.kv_heads, a.head_dim)).astype(np.float32)
        V = rng.normal(size=(T, a.kv_heads, a.head_dim)).astype(np.float32)
        _, best = _core.cpu_attention_timed(q, K, V, T - 1, a.kv_f32, a.threads, a.isa, a.repeats)
        nbytes = 2 * T * a.kv_heads * a.head_dim * (4 if a.kv_f32 else 2)
        print(f"{T:>8} {best * 1e3:>9.3f} {nbytes / 1e6:>9.2f} {nbytes / best / 1e9:>6.1f}")


if __name__ == "__main__":
    main()

"""Encoding time of one image through the vision tower: the cpu engine (`CpuVisionEncoder`, bf16 weights read
in place, float32 activations) against transformers' ``Qwen3_5MoeVisionModel`` (torch CPU) on the same CPU, in
the same run, with the same threads, on the same random weights at the released widths and full depth
(27 blocks, 1152 wide, 16 heads, MLP 4304, merger 4608 -> 2048). Not a test: it prints times and ratios.

    python benchmarks/vision.py                       # 448x448 and 1024x1024, 2 threads
    python benchmarks/vision.py --sizes 448 --threads 4 --depth 27 --repeats 3

torch runs twice: float32 (the weights' bf16 values widened: the same numbers as the engine's), and bfloat16
(its own fast path where the CPU has avx512_bf16 / AMX; activations rounded to bf16, less accurate). Timings
are the best of ``--repeats`` calls after one warm-up call, runs of the three alternating. The merged outputs
are compared too (max |diff| / max |output| of the engine against torch float32).
"""
from __future__ import annotations

import argparse
import subprocess
import time

import ml_dtypes
import numpy as np

from qwenmetal.backends.cpu import CpuVisionEncoder
from qwenmetal.config import VisionConfig

REAL = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, spatial_merge_size=2,
            temporal_patch_size=2, out_hidden_size=2048, num_position_embeddings=2304, in_channels=3,
            hidden_act="gelu_pytorch_tanh")


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    f = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = f.get("Model name", "?").strip()
    flags = f.get("Flags", "")
    simd = " ".join(x for x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if x in flags.split())
    return f"{name}, {f.get('CPU(s)', '?').strip()} CPUs ({simd})"


def torch_tower(d: dict, seed: int, dtype):
    import torch
    from transformers import Qwen3_5MoeVisionConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel
    cfg = Qwen3_5MoeVisionConfig(**d)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    # built in float32 and cast after: the rotary inv_freq buffer stays float32 in the float32 tower
    m = Qwen3_5MoeVisionModel(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                v = torch.randn(p.shape, generator=g) * 0.1
            elif "norm" in name:
                v = 1 + torch.randn(p.shape, generator=g) * 0.1
            elif "pos_embed" in name:
                v = torch.randn(p.shape, generator=g)
            else:
                v = torch.randn(p.shape, generator=g) / float(np.prod(p.shape[1:])) ** 0.5
            p.copy_(v.to(torch.bfloat16).float())     # bf16 values, as a checkpoint holds them
    return m.to(dtype)


def canonical(m) -> dict:
    """The torch tower's bf16 tensors under Weights.vision's names, as ml_dtypes.bfloat16 numpy arrays."""
    import torch
    out = {}
    for name, t in m.state_dict().items():
        k = name[:-len(".weight")] if name.endswith(".weight") else name
        a = t.detach().contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        out[k] = a.reshape(a.shape[0], -1) if k == "patch_embed.proj" else a
    return out


def best(fn, repeats: int) -> tuple[float, object]:
    out, ts = None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return min(ts), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[448, 1024], help="square image sides in pixels")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=27)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-bf16", action="store_true", help="skip torch bfloat16")
    a = ap.parse_args(argv)
    import torch
    torch.set_num_threads(a.threads)
    d = dict(REAL, depth=a.depth)
    print(f"CPU: {cpu_name()}; threads {a.threads}; torch {torch.__version__}; tower depth {a.depth}")
    m16 = torch_tower(d, seed=0, dtype=torch.bfloat16)
    params = canonical(m16)
    vc = VisionConfig.from_dict(d)
    enc = CpuVisionEncoder(params, vc, threads=a.threads)
    m32 = torch_tower(d, seed=0, dtype=torch.float32)       # the same values (bf16, widened)
    for side in a.sizes:
        g = side // (vc.patch_size * vc.spatial_merge_size) * vc.spatial_merge_size
        grid = np.array([[1, g, g]])
        n = g * g
        px = np.random.default_rng(0).standard_normal((n, vc.patch_dim), dtype=np.float32)
        tpx, tgrid = torch.from_numpy(px), torch.from_numpy(grid)

        def run_torch(m, dtype):
            with torch.no_grad():
                return m(tpx.to(dtype), tgrid).pooler_output.float().numpy()

        runs = {"cpu engine": lambda: enc.encode(px, grid),
                "torch float32": lambda: run_torch(m32, torch.float32)}
        if not a.no_bf16:
            runs["torch bfloat16"] = lambda: run_torch(m16, torch.bfloat16)
        for fn in runs.values():          # warm-up (first-touch of the weights, oneDNN primitive caches)
            fn()
        times = {k: [] for k in runs}
        outs = {}
        for _ in range(a.repeats):        # alternating, so a burst of load hits all of them
            for k, fn in runs.items():
                t, outs[k] = best(fn, 1)
                times[k].append(t)
        t = {k: min(v) for k, v in times.items()}
        ref = outs["torch float32"]
        err = float(np.abs(outs["cpu engine"] - ref).max()) / float(np.abs(ref).max())
        print(f"{side}x{side} ({n} patches -> {n // 4} tokens):")
        for k, v in t.items():
            print(f"  {k:15s} {v:8.2f} s   ({v / t['cpu engine']:.2f}x the cpu engine's time)")
        if "torch bfloat16" in outs:
            e16 = float(np.abs(outs["torch bfloat16"] - ref).max()) / float(np.abs(ref).max())
            print(f"  max |diff| / max |out| vs torch float32: cpu engine {err:.2g}, torch bfloat16 {e16:.2g}")
        else:
            print(f"  max |diff| / max |out| vs torch float32: cpu engine {err:.2g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

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

``--ttft``: the time to first token of a one-image chat turn instead (docs/vision.md, "Time to first token"):

    python benchmarks/vision.py --ttft                # 448x448 and 1024x1024, 2 threads, 30 text tokens

* cpu engine, measured: the tower above (the cpu engine alone, random bf16 weights at the released widths and
  depth), then the language model's prefill of the turn, on the 8-layer real-width bench checkpoint (``qwenmetal
  bench``'s random MLX 4-bit checkpoint, bench/checkpoint.py; built on first use): the image's tokens (the
  tower's output rows at the pads, M-RoPE positions from ``mrope.rope_index``) between ~30 text tokens, in one
  ``prefill`` call returning the last row's logits. The released model has 40 layers in the same 3:1 mix of
  linear- and full-attention layers as the 8 (30 + 10 against 6 + 2), so the 40-layer prefill is estimated as
  5 x the 8-layer time: an upper bound by the embedding lookup and the one-row output head, counted 5 times
  instead of once. Each figure is one timed call after a warm-up call on a small input (which pages in the
  weights): a first turn's cost, not a best-of.
* Metal, modelled: ``bench.cost.encode_only_vision_cost`` (the tower graph) plus ``encode_only_prefill_cost``
  (the 40-layer prefill graph) of the same token count, on M5 Max and M1 Max: models, not measurements.
"""
from __future__ import annotations

import argparse
import subprocess
import time
import types

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


def ttft(a) -> int:
    """The time to first token of a one-image chat turn: cpu engine measured, Metal modelled (module doc)."""
    import torch
    import qwenmetal as qm
    from qwenmetal.bench import ensure_checkpoint, resolve_config
    from qwenmetal.bench.cost import encode_only_prefill_cost, encode_only_vision_cost
    from qwenmetal.config import ModelConfig
    from qwenmetal.mrope import rope_index
    torch.set_num_threads(a.threads)
    layers, full = 8, 40
    print(f"CPU: {cpu_name()}; threads {a.threads}; tower depth {a.depth}; LM {layers} of {full} layers "
          f"(40-layer figure = {full // layers} x); {a.text_tokens} text tokens")
    d = dict(REAL, depth=a.depth)
    vc = VisionConfig.from_dict(d)
    enc = CpuVisionEncoder(canonical(torch_tower(d, seed=0, dtype=torch.bfloat16)), vc, threads=a.threads)
    path = ensure_checkpoint(resolve_config("real", layers), 0, log=print)
    lm = qm.Model.load(path, backend="cpu", threads=a.threads)
    image_id, start_id, end_id = 248056, 248053, 248054          # Qwen3.5/3.6's image pad, vision start / end
    rope_cfg = types.SimpleNamespace(raw={"image_token_id": image_id, "vision_config": d})
    unit = vc.patch_size * vc.spatial_merge_size
    rng = np.random.default_rng(0)

    def turn(side):
        g = side // unit * vc.spatial_merge_size
        grid = np.array([[1, g, g]])
        px = rng.standard_normal((g * g, vc.patch_dim), dtype=np.float32)
        n_img = g * g // vc.merge_unit
        head = [int(x) for x in rng.integers(1000, 200000, 8)]
        tail = [int(x) for x in rng.integers(1000, 200000, a.text_tokens - 8)]
        ids = head + [start_id] + [image_id] * n_img + [end_id] + tail
        return grid, px, ids, list(range(len(head) + 1, len(head) + 1 + n_img))

    def run(side):
        grid, px, ids, rows = turn(side)
        t0 = time.perf_counter()
        feats = enc.encode(px, grid)
        t1 = time.perf_counter()
        pos, _ = rope_index(ids, grid, rope_cfg)
        lm.prefill(lm.new_session(), ids, "last", positions=pos, embeds=feats, embed_rows=rows)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, len(ids), len(rows)

    run(64)                                # warm-up: pages in the tower's and the LM's weights
    cpu = {side: run(side) for side in a.sizes}
    sizes = [(s, s) for s in a.sizes]
    cfg40 = ModelConfig.from_dict(resolve_config("real", full))
    vis = encode_only_vision_cost(cfg40, vision=d, sizes=sizes)
    pre = encode_only_prefill_cost(cfg40, sorted({v[2] for v in cpu.values()}))
    chips = ("M5 Max", "M1 Max")
    print()
    print("| image | tokens (image + text) | cpu: tower | cpu: LM prefill, 8 layers | cpu: TTFT, 8 layers | "
          "cpu: TTFT, 40 layers (5x LM) | " + " | ".join(f"Metal {c}, modelled: tower + prefill = TTFT"
                                                    for c in chips) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(chips))
    for side, (tt, tp, n, n_img) in cpu.items():
        cells = []
        for c in chips:
            tv = vis["images"][f"{side}x{side}"]["chips"][c]["seconds"]
            tl = n / pre["prompts"][str(n)]["modelled_tok_s"][c]
            cells.append(f"{tv:.3f} + {tl:.3f} = {tv + tl:.3f} s")
        print(f"| {side} x {side} | {n} ({n_img} + {n - n_img}) | {tt:.2f} s | {tp:.2f} s | {tt + tp:.2f} s | "
              f"{tt + full // layers * tp:.2f} s | " + " | ".join(cells) + " |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[448, 1024], help="square image sides in pixels")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=27)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-bf16", action="store_true", help="skip torch bfloat16")
    ap.add_argument("--ttft", action="store_true", help="time to first token of a one-image chat turn (see above)")
    ap.add_argument("--text-tokens", type=int, default=30, help="--ttft: text tokens around the image")
    a = ap.parse_args(argv)
    if a.ttft:
        return ttft(a)
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

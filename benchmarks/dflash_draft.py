"""Time one DFlash draft call on the cpu engine (`CpuBackend.dflash_draft`) against one decode step of the target.

    python benchmarks/dflash_draft.py                          # the 8-layer real-width bench checkpoint, 2 threads
    python benchmarks/dflash_draft.py --model DIR --draft /tmp/dflash-real --context 512 --new 4

The draft is a random bf16 DFlash draft at Qwen3.6-35B-A3B-DFlash's published widths (tests/dflash_oracles.py,
REAL: 8 layers of hidden 2048, 32 query / 4 KV heads of 128, MLP 6144, fc over 5 target layers), written once
under --draft (~0.95 GB; keep it out of the repository), its target_layer_ids spread over the target's layers.
The target is the real-width random checkpoint `qwenmetal bench --layers 8` generates (default: generated here
the same way when missing). The draft's cache holds --context rows; each timed call adds --new context rows
(commit=False, so every call sees the same cache) and drafts a block of --block tokens: its logits through the
target's 4-bit lm_head (248,320 rows). Draft calls and decode steps at the same context alternate; medians.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import qwenmetal as qm
from qwenmetal.bench.checkpoint import ensure_checkpoint, resolve_config
from qwenmetal.dflash import build_target_layer_ids, load_dflash_draft
from qwenmetal.quant import quantize
from qwenmetal.safetensors_io import SafetensorsWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dflash_oracles import REAL, draft_config, tensor_shapes  # noqa: E402

BF16 = ml_dtypes.bfloat16


def write_real_draft(out: Path, target_layers: int, seed: int = 0, bits: int = 0) -> Path:
    """A random bf16 draft of REAL's widths for a target of `target_layers` layers, tensor by tensor; with
    `bits`, its MLX affine copy (group 64, bf16 scales; `qwenmetal.quant.quantize`, MLX's algorithm)."""
    if (out / "config.json").is_file():
        return out
    cfg = draft_config(REAL, num_target_layers=target_layers,
                       dflash_config=dict(REAL["dflash_config"],
                                          target_layer_ids=list(build_target_layer_ids(target_layers, 5))))
    cfg["dflash_config"]["target_layer_ids"] = sorted(set(cfg["dflash_config"]["target_layer_ids"]))
    out.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(cfg)
    files = {}
    for k, shape in shapes.items():
        if bits and len(shape) == 2:
            stem, n = k[:-len(".weight")], shape[-1] // 64
            files.update({k: (np.dtype(np.uint32), (shape[0], shape[1] * bits // 32)),
                          stem + ".scales": (np.dtype(BF16), (shape[0], n)),
                          stem + ".biases": (np.dtype(BF16), (shape[0], n))})
        else:
            files[k] = (np.dtype(BF16), shape)
    if bits:
        cfg["quantization"] = {"group_size": 64, "bits": bits}
    rng = np.random.default_rng(seed)
    tmp = out / "model.safetensors.tmp"
    with SafetensorsWriter(tmp, files, {"format": "pt"}) as w:
        for k, shape in shapes.items():
            if "norm" in k and len(shape) == 1:
                a = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
            else:
                a = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1]))
            a = a.astype(BF16)
            if bits and len(shape) == 2:
                wq, sc, bi = quantize(a, bits, 64)
                stem = k[:-len(".weight")]
                w.write(k, wq)
                w.write(stem + ".scales", sc)
                w.write(stem + ".biases", bi)
            else:
                w.write(k, a)
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target checkpoint (default: the generated real-width bench checkpoint)")
    ap.add_argument("--layers", type=int, default=8, help="layers of the generated target (without --model)")
    ap.add_argument("--draft", default=None,
                    help="where the random real draft lives (default /tmp/qwenmetal-dflash-real[-q<bits>])")
    ap.add_argument("--bits", type=int, default=0, help="an MLX-quantized draft of these bits (default: bf16)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=512, help="context rows in the draft's cache and the target's")
    ap.add_argument("--new", type=int, default=4, help="new context rows per draft call (the tokens accepted)")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    path = Path(a.model) if a.model else ensure_checkpoint(resolve_config("real", a.layers), 0, log=print)
    model = qm.Model.load(path, backend="cpu", threads=a.threads)
    c = model.config
    where = Path(a.draft or "/tmp/qwenmetal-dflash-real" + (f"-q{a.bits}" if a.bits else ""))
    draft = load_dflash_draft(write_real_draft(where, c.num_hidden_layers, bits=a.bits), c)
    native = model.dflash_draft(draft)
    dc = draft.config
    rng = np.random.default_rng(0)
    cache = native.new_cache()
    block = np.array([5] + [dc.mask_token_id] * (a.block - 1), dtype=np.int64)
    t0 = time.perf_counter()
    native.forward(cache, rng.standard_normal((a.context, dc.feature_size), dtype=np.float32), block[:1])
    fill = time.perf_counter() - t0
    feats = rng.standard_normal((a.new, dc.feature_size), dtype=np.float32)
    base = model.new_session()
    prompt = [int(t) for t in rng.integers(0, c.vocab_size, a.context)]
    first = int(np.argmax(model.prefill(base, prompt)))
    draft_s, step_s = [], []
    for r in range(a.repeats + 1):                 # the first round warms up
        gc.collect()
        t = time.perf_counter()
        native.forward(cache, feats, block, commit=False)
        dt = time.perf_counter() - t
        s = base.fork()
        t = time.perf_counter()
        model.decode_step(s, first)
        ds = time.perf_counter() - t
        del s
        if r:
            draft_s.append(dt)
            step_s.append(ds)
    d, s = statistics.median(draft_s), statistics.median(step_s)
    cpu = qm._core.cpu_info()
    print(f"cpu: {cpu['model_name']} ({cpu['uarch']}, {cpu['isa']}), {a.threads} threads, activations "
          f"{model.backend_info().get('activations')}")
    print(f"target: {path.name} ({c.num_hidden_layers} layers, vocab {c.vocab_size}); draft: {dc.num_hidden_layers} "
          f"layers, hidden {dc.hidden_size}, MLP {dc.intermediate_size}, "
          f"{f'{a.bits}-bit' if a.bits else 'bf16'} {native.weight_nbytes / 1e9:.2f} GB")
    print(f"draft cache filled with {a.context} context rows in one call: {fill * 1e3:.0f} ms")
    print(f"one draft call ({a.new} new context rows, block {a.block}, context {a.context}): {d * 1e3:.1f} ms "
          f"(samples {', '.join(f'{x * 1e3:.1f}' for x in draft_s)})")
    print(f"one decode step at context {a.context}: {s * 1e3:.1f} ms (samples "
          f"{', '.join(f'{x * 1e3:.1f}' for x in step_s)})")
    print(f"draft call / decode step: {d / s:.2f}x")


if __name__ == "__main__":
    main()

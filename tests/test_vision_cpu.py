"""The vision tower on the cpu engine (src/cpu/vision.h, backends/cpu.py `CpuVisionEncoder`; docs/vision.md,
"The vision tower on the cpu engine") against the numpy reference `VisionTower` (itself checked against
transformers and mlx-vlm in tests/test_vision_reference.py).

Tolerance: the largest absolute difference of the merged output within 1e-4 x the reference's largest output
magnitude (float32 activations both sides; the engine sums in other orders -- blocked GEMMs, an online softmax
over key blocks, float tanh / erf -- observed ~1e-6 of the range). Weights in bf16 or MLX 4-bit are the same
values on both sides (the reference casts / dequantizes them to float32), so the same tolerance holds."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import qwenmetal as qm
from vision_inputs import bad_inputs, pixels
from qwenmetal.backends.cpu import CpuVisionEncoder, available
from qwenmetal.native import core
from qwenmetal.backends.reference_vision import VisionTower
from qwenmetal.config import VisionConfig
from qwenmetal.errors import InputError
from qwenmetal.quant import quantize
from qwenmetal.testing import cached_checkpoint
from qwenmetal.weights import QuantizedTensor

pytestmark = pytest.mark.skipif(not available(), reason="the compiled extension is not built")
_core = core() if available() else None

TINY = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
            temporal_patch_size=2, out_hidden_size=48, num_position_embeddings=36)
# the released tower's widths (1152 wide, 16 heads of 72, MLP 4304, merger 4608 -> 2048), on 2 of its 27 blocks
REAL = dict(TINY, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, out_hidden_size=2048,
            num_position_embeddings=2304)
GRIDS = {"one image": [[1, 4, 6]], "two images": [[1, 4, 6], [1, 8, 2]], "clip of 2 frames": [[2, 4, 4]],
         # a frame longer than one key block (256) and query blocks that do not divide it: 18 x 20 = 360 patches
         "long frame": [[1, 18, 20]]}


def random_params(vc: VisionConfig, seed: int = 0, dtype=np.float32) -> dict:
    """Canonical tower tensors (`Weights.vision` names) scaled so every part matters: linears ~ N(0, 1/fan_in),
    biases ~ N(0, 0.1), LayerNorm weights ~ 1 + N(0, 0.1), the position table ~ N(0, 1); linears in `dtype`."""
    rng = np.random.default_rng(seed)
    h, i, m = vc.hidden_size, vc.intermediate_size, vc.merged_dim
    p: dict = {}

    def lin(name, n_out, n_in):
        p[name] = (rng.standard_normal((n_out, n_in), dtype=np.float32) / np.sqrt(n_in)).astype(dtype)
        p[name + ".bias"] = rng.standard_normal(n_out, dtype=np.float32) * 0.1

    def norm(name):
        p[name] = 1 + rng.standard_normal(h, dtype=np.float32) * 0.1
        p[name + ".bias"] = rng.standard_normal(h, dtype=np.float32) * 0.1

    lin("patch_embed.proj", h, vc.patch_dim)
    p["pos_embed"] = rng.standard_normal((vc.num_position_embeddings, h), dtype=np.float32)
    for b in range(vc.depth):
        norm(f"blocks.{b}.norm1")
        norm(f"blocks.{b}.norm2")
        lin(f"blocks.{b}.attn.qkv", 3 * h, h)
        lin(f"blocks.{b}.attn.proj", h, h)
        lin(f"blocks.{b}.mlp.linear_fc1", i, h)
        lin(f"blocks.{b}.mlp.linear_fc2", h, i)
    norm("merger.norm")
    lin("merger.linear_fc1", m, m)
    lin("merger.linear_fc2", vc.out_hidden_size, m)
    return p



def close(what, got, want, rtol=1e-4):
    err = float(np.abs(got - want).max())
    scale = float(np.abs(want).max())
    assert got.shape == want.shape and got.dtype == np.float32, (got.shape, want.shape, got.dtype)
    assert err <= rtol * scale, f"{what}: max |diff| {err:.3g}, |want| {scale:.3g}"


@pytest.fixture(scope="module")
def tiny():
    vc = VisionConfig.from_dict(TINY)
    p = random_params(vc)
    return vc, p, VisionTower(p, vc)


@pytest.mark.parametrize("grids", list(GRIDS), ids=list(GRIDS))
def test_tiny_tower_matches_reference(tiny, grids):
    vc, p, ref = tiny
    grid = np.array(GRIDS[grids])
    px = pixels(vc, grid)
    want = ref(px, grid)
    got = CpuVisionEncoder(p, vc, threads=2).encode(px, grid)
    close(grids, got, want)
    # the thread count does not change a bit
    assert np.array_equal(CpuVisionEncoder(p, vc, threads=1).encode(px, grid), got)


def test_every_isa(tiny):
    """Every SIMD kernel set this CPU runs (portable, avx2, avx512 / neon): the GEMMs, the vectorised exp of the
    attention's softmax and the GELU-tanh kernel, with a frame longer than a key block."""
    vc, p, ref = tiny
    grid = np.array([[1, 18, 20], [1, 2, 4]])
    px = pixels(vc, grid, seed=4)
    want = ref(px, grid)
    saved = _core.cpu_isa()
    try:
        for isa in _core.cpu_isas():
            _core.cpu_set_isa(isa)
            close(isa, CpuVisionEncoder(p, vc, threads=2).encode(px, grid), want)
    finally:
        _core.cpu_set_isa(saved)


@pytest.mark.parametrize("fmt", ["bfloat16", "float16", "mlx-q4"])
def test_weight_formats(tiny, fmt):
    """bf16 / f16 / 4-bit g32 linears read in place; the reference runs on the same values in float32."""
    vc, p, _ = tiny
    q = {}
    for k, v in p.items():
        if k.endswith(".bias") or "norm" in k or k == "pos_embed":
            q[k] = v
        elif fmt == "mlx-q4":
            q[k] = QuantizedTensor(*quantize(v, 4, 32), 4, 32)
        else:
            q[k] = v.astype(ml_dtypes.bfloat16 if fmt == "bfloat16" else np.float16)
    grid = np.array(GRIDS["two images"])
    px = pixels(vc, grid, seed=3)
    close(fmt, CpuVisionEncoder(q, vc, threads=2).encode(px, grid), VisionTower(q, vc)(px, grid))


def test_real_width_two_blocks():
    """The released widths on 2 blocks with bf16 linears (as checkpoints store them), two images."""
    vc = VisionConfig.from_dict(REAL)
    p = random_params(vc, seed=1, dtype=ml_dtypes.bfloat16)
    grid = np.array([[1, 6, 8], [1, 4, 10]])
    px = pixels(vc, grid, seed=1)
    got = CpuVisionEncoder(p, vc, threads=2).encode(px, grid)
    assert got.shape == (22, 2048)
    close("real width", got, VisionTower(p, vc)(px, grid))


@pytest.mark.parametrize("fmt", ["hf-bf16", "mlx-q4"])
def test_model_vision_encoder_on_fixture(fmt):
    """ModelBase.vision_encoder(): the cpu backend's tower equals the reference backend's on the tiny-vl
    fixture (HF layout, and mlx-vlm's kept beside a 4-bit text model); a text-only checkpoint has none."""
    path = cached_checkpoint("tiny-vl", fmt, vision=fmt != "hf-bf16")
    cpu = qm.Model.load(path, backend="cpu", threads=2)
    ref = qm.Model.load(path, backend="reference")
    enc = cpu.vision_encoder()
    assert isinstance(enc, CpuVisionEncoder) and cpu.vision_encoder() is enc
    assert isinstance(ref.vision_encoder(), VisionTower)
    vc = cpu.config.vision
    grid = np.array([[1, 4, 6], [1, 2, 2]])
    px = pixels(vc, grid, seed=2)
    close(fmt, enc.encode(px, grid), ref.vision_encoder().encode(px, grid))
    assert qm.Model.load(cached_checkpoint("tiny", "mlx-q4"), backend="cpu", threads=1).vision_encoder() is None


def test_bad_inputs_are_refused_and_change_nothing(tiny):
    vc, p, ref = tiny
    enc = CpuVisionEncoder(p, vc, threads=2)
    grid = np.array([[1, 4, 6]])
    px = pixels(vc, grid)
    before = enc.encode(px, grid)
    for bad_px, bad_grid, match in bad_inputs(px, grid):
        with pytest.raises(InputError, match=match):
            enc.encode(bad_px, bad_grid)
    # the C++ side checks the same on its own (a caller that skips the Python checks)
    with pytest.raises(ValueError, match=r"pixel_values has 24 patches, grid_thw describes 32"):
        enc.impl.encode(px, np.array([[1, 4, 8]]))
    with pytest.raises(ValueError, match=r"grid_thw\[1\] = \[1, 2, 3\]: height and width must be multiples"):
        enc.impl.encode(px, np.array([[1, 4, 4], [1, 2, 3]]))
    assert np.array_equal(enc.encode(px, grid), before)
    # weights that disagree with the config, and no tower at all
    bad = dict(p, **{"blocks.1.attn.proj": p["blocks.1.attn.proj"][:, :16]})
    with pytest.raises(InputError, match=r"'blocks.1.attn.proj' is \[32, 16\], expected \[32, 32\]"):
        CpuVisionEncoder(bad, vc, threads=1)
    with pytest.raises(InputError, match=r"missing 'merger.norm.bias'"):
        CpuVisionEncoder({k: v for k, v in p.items() if k != "merger.norm.bias"}, vc, threads=1)
    with pytest.raises(InputError, match=r"the checkpoint has no vision tower"):
        CpuVisionEncoder({}, vc, threads=1)
    with pytest.raises(ValueError, match=r"threads must be a positive integer"):
        CpuVisionEncoder(p, vc, threads=0)

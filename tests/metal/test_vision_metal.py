"""The vision tower on the Metal graph (`_GpuBackend.vision_encoder`, src/gpu/vision.*) against the numpy
reference `VisionTower` (the ground truth) on the tiny-vl fixture: float32 activations tight, bfloat16 loose; one
image, two images of different grids, a two-frame clip, a frame long enough for the attention to run in query
blocks; the released widths on one block; the Hugging Face layout as the mlx-vlm one; one command buffer per call at the default budget, more
under a small one with the same result; argument errors leave the tower usable; the modelled cost at the
released width (encode-only). Simulator-verified, hardware-unverified."""
from __future__ import annotations

import numpy as np
import pytest
from vision_inputs import pixels
from qwenmetal.backends.metal import MetalBackend, MetalSimBackend, vision_dims
from qwenmetal.backends.reference_vision import VisionTower
from qwenmetal.bench.cli import resolve_config
from qwenmetal.bench.cost import RELEASED_VISION, encode_only_vision_cost
from qwenmetal.config import ModelConfig, VisionConfig
from qwenmetal.errors import InputError
from qwenmetal.native import core
from qwenmetal.testing import cached_checkpoint
from qwenmetal.weights import load_weights
from qwenmetal.weights_table import weight_table

from .gpu_harness import SIM

# the error of the merged rows against the reference, relative to their largest magnitude
TOL = {"float32": 1e-5, "bfloat16": 3e-2}
GRIDS = {"one": [[1, 4, 6]], "two": [[1, 4, 6], [1, 2, 2]], "clip": [[2, 2, 4], [1, 2, 2]]}

# the simulator, or this Mac's GPU (QWENMETAL_TEST_DEVICE=metal)
GpuBackend = MetalSimBackend if SIM else MetalBackend


def _weights(fmt):
    path = cached_checkpoint("tiny-vl", fmt, vision=fmt != "hf-bf16")
    return load_weights(path, ModelConfig.from_file(path))


@pytest.fixture(scope="module")
def weights():
    return _weights("mlx-bf16")


@pytest.fixture(scope="module")
def encoders(weights):
    return {dt: GpuBackend(weights, dtype=dt).vision_encoder() for dt in ("float32", "bfloat16")}


@pytest.fixture(scope="module")
def tower(weights):
    return VisionTower(weights.vision, weights.config.vision)



def _err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(GRIDS))
def test_matches_reference(encoders, tower, case, dtype):
    grid = np.array(GRIDS[case])
    px = pixels(tower.config, grid)
    enc = encoders[dtype]
    out = enc.encode(px, grid)
    ref = tower(px, grid)
    assert out.dtype == np.float32 and out.shape == ref.shape == (int(grid.prod(axis=1).sum()) // 4, 128)
    assert _err(out, ref) <= TOL[dtype]
    assert enc.last_command_buffers == 1


def _random_tower(vc, seed=0) -> dict:
    """Float32 tensors of a tower of `vc`'s dimensions (canonical names), scaled so the activations stay O(1)."""
    rng = np.random.default_rng(seed)
    H, I, M = vc.hidden_size, vc.intermediate_size, vc.merged_dim
    shapes = {"patch_embed.proj": (H, vc.patch_dim), "pos_embed": (vc.num_position_embeddings, H),
              "merger.norm": (H,), "merger.linear_fc1": (M, M), "merger.linear_fc2": (vc.out_hidden_size, M)}
    for i in range(vc.depth):
        p = f"blocks.{i}."
        shapes.update({p + "norm1": (H,), p + "norm2": (H,), p + "attn.qkv": (3 * H, H), p + "attn.proj": (H, H),
                       p + "mlp.linear_fc1": (I, H), p + "mlp.linear_fc2": (H, I)})
    out = {}
    for k, shape in shapes.items():
        if len(shape) == 1:
            out[k] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[k] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
        if k != "pos_embed":
            out[k + ".bias"] = (0.1 * rng.standard_normal(shape[0])).astype(np.float32)
    return out


def test_released_width(weights):
    """The released widths (1152 in 16 heads of 72, MLP 4304, a 48 x 48 position table, out 2048) on one block,
    float32 weights, two images: within the float32 tolerance of the reference."""
    vc = VisionConfig.from_dict(dict(RELEASED_VISION, depth=1))
    params = _random_tower(vc)
    grid = np.array([[1, 4, 6], [1, 2, 2]])
    px = pixels(vc, grid, seed=4)
    be = GpuBackend(weights, dtype="float32")
    mappings, tensors, keep = weight_table(None, params)
    impl = core().gpu.GpuVisionTower(be.engine, vision_dims(vc), mappings, tensors, keep)
    ref = VisionTower(params, vc)(px, grid)
    assert _err(impl.encode(px, grid), ref) <= TOL["float32"]


def test_hf_layout(tower):
    """The Hugging Face layout (model.visual.*, Conv3d patch embedding) binds to the same tower."""
    enc = GpuBackend(_weights("hf-bf16"), dtype="float32").vision_encoder()
    grid = np.array(GRIDS["one"])
    px = pixels(tower.config, grid, seed=3)
    assert _err(enc(px, grid), tower(px, grid)) <= TOL["float32"]


def test_command_buffer_budget(weights, encoders, tower):
    """Under a tiny watchdog budget the call is cut into many command buffers (one per dispatch) and a 64-patch
    frame's attention runs in two query blocks of 32, each over all 64 keys: the same rows bit for bit."""
    grid = np.array([[1, 8, 8], [1, 2, 2]])
    px = pixels(tower.config, grid, seed=1)
    small = GpuBackend(weights, dtype="float32", command_buffer_seconds=1e-9).vision_encoder()
    out = small.encode(px, grid)
    base = encoders["float32"]
    np.testing.assert_array_equal(out, base.encode(px, grid))
    assert base.last_command_buffers == 1
    cut = small.cost(grid)
    assert small.last_command_buffers == cut["command_buffers"] == cut["dispatches"] > 1
    # two blocks instead of one for the 64-patch frame, in each of the tower's blocks
    assert cut["dispatches"] == base.cost(grid)["dispatches"] + tower.config.depth
    assert _err(out, tower(px, grid)) <= TOL["float32"]


def test_errors_leave_the_tower_usable(encoders, tower):
    enc = encoders["float32"]
    vc = tower.config
    grid = np.array(GRIDS["one"])
    px = pixels(vc, grid)
    with pytest.raises(InputError, match=r"pixel_values must be \[24, 1536\]"):
        enc.encode(px[:-1], grid)
    with pytest.raises(InputError, match="multiples of spatial_merge_size 2"):
        enc.encode(pixels(vc, [[1, 3, 2]]), [[1, 3, 2]])
    with pytest.raises(InputError, match="integer array"):
        enc.encode(px, grid.astype(np.float32))
    bad = px.copy()
    bad[3, 7] = np.nan
    with pytest.raises(InputError, match="NaN or infinity"):
        enc.encode(bad, grid)
    # the native checks, below the Python ones
    with pytest.raises(ValueError, match=r"pixel_values must be float32 \[24, 1536\]"):
        enc.impl.encode(px[:-1], grid.astype(np.int64))
    with pytest.raises(ValueError, match="every entry must be positive"):
        enc.impl.encode(px, np.array([[0, 4, 6]], np.int64))
    assert _err(enc.encode(px, grid), tower(px, grid)) <= TOL["float32"]


def test_no_tower():
    path = cached_checkpoint("tiny", "mlx-q4")
    be = GpuBackend(load_weights(path, ModelConfig.from_file(path)), dtype="float32")
    with pytest.raises(InputError, match="the checkpoint has no vision tower"):
        be.vision_encoder()


def test_modelled_cost_at_released_width():
    """The released tower (27 blocks of 1152, 16 heads, MLP 4304, out 2048) at 448 x 448 and 1024 x 1024, bf16,
    encode-only: 11 dispatches per block, every one its own dependency level; more command buffers for the larger
    image under the default budget; the M5 Max (tensor route, 614 GB/s) ahead of the M1 Max. Modelled figures."""
    r = encode_only_vision_cost(ModelConfig.from_dict(resolve_config("real", 4)))
    small, large = r["images"]["448x448"], r["images"]["1024x1024"]
    assert (small["patches"], small["tokens"], large["patches"], large["tokens"]) == (784, 196, 4096, 1024)
    for img in (small, large):
        m5, m1 = img["chips"]["M5 Max"], img["chips"]["M1 Max"]
        assert m5["dispatches"] == m1["dispatches"] == 27 * 11 + 7
        assert 0 < m5["seconds"] < m1["seconds"]
    assert large["chips"]["M1 Max"]["command_buffers"] > small["chips"]["M1 Max"]["command_buffers"] >= 1
    assert large["chips"]["M1 Max"]["flops"] > 5 * small["chips"]["M1 Max"]["flops"]

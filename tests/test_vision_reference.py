"""The vision tower (docs/vision.md, "The vision tower"): config, strict loading from both layouts, the numpy
reference against transformers' ``Qwen3_5MoeVisionModel`` and mlx-vlm's ``VisionModel``, and ``convert``
keeping the tower.

Oracles: transformers (torch CPU, float32) on random weights -- the tiny tower and the real width (1152 wide,
16 heads, MLP 4304, out 2048) on 2 blocks -- for one image, two images of different grids and a 2-frame clip;
transformers' ``Qwen3_5MoeForConditionalGeneration.from_pretrained`` of the ``tiny-vl`` hf-bf16 fixture (the
HF layout as transformers reads it); mlx-vlm 0.7.10's ``convert`` of that fixture (tensor for tensor our
``vision=True`` MLX fixtures) and its ``VisionModel`` (MLX CPU, float32) on it. In CI (``CI=true``) a missing
oracle fails the test (tests/oracles.py ``require``)."""
from __future__ import annotations

import contextlib
import io
import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import qwenmetal as qm
from oracles import require
from vision_inputs import bad_inputs, pixels
from qwenmetal.backends.reference_vision import (VisionTower, interpolation_taps, merged_token_counts,
                                                 rotary_positions)
from qwenmetal.config import ModelConfig, VisionConfig
from qwenmetal.convert import convert
from qwenmetal.errors import CheckpointError, InputError
from qwenmetal.testing import PRESETS, cached_checkpoint
from qwenmetal.weights import load_weights, to_float32

TINY = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
            temporal_patch_size=2, out_hidden_size=48, num_position_embeddings=36)
# the released tower's widths (Qwen3.5/3.6-35B-A3B), on 2 of its 27 blocks
REAL = dict(depth=2, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, spatial_merge_size=2,
            temporal_patch_size=2, out_hidden_size=2048, num_position_embeddings=2304)
GRIDS = {"one image": [[1, 4, 6]], "two images": [[1, 4, 6], [1, 8, 2]], "clip of 2 frames": [[2, 4, 4]],
         "one patch block": [[1, 2, 2]]}


def _torch_tower(d: dict, seed: int = 0):
    """transformers' Qwen3_5MoeVisionModel (float32, eager attention) with weights scaled so every part
    matters: linears ~ N(0, 1/fan_in), biases ~ N(0, 0.1), LayerNorm weights ~ 1 + N(0, 0.1), position
    table ~ N(0, 1)."""
    torch = require("torch")
    require("transformers")
    from transformers import Qwen3_5MoeVisionConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel
    torch.set_num_threads(2)
    cfg = Qwen3_5MoeVisionConfig(**d)
    cfg._attn_implementation = "eager"
    m = Qwen3_5MoeVisionModel(cfg).float().eval()
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
            p.copy_(v)
    return m


def _canonical(state_dict) -> dict:
    """A transformers tower's state dict under Weights.vision's names (patch embed as the GEMM matrix)."""
    out = {}
    for name, t in state_dict.items():
        k = name[:-len(".weight")] if name.endswith(".weight") else name
        a = t.numpy()
        out[k] = a.reshape(a.shape[0], -1) if k == "patch_embed.proj" else a
    return out



def _close(what, got, want, rtol=1e-5):
    """Max abs error within rtol x the output's max magnitude (float32 throughout: observed ~1e-6)."""
    err = float(np.abs(got - want).max())
    scale = float(np.abs(want).max())
    assert got.shape == want.shape and err <= rtol * scale + 1e-6, f"{what}: max |diff| {err:.3g}, |want| {scale:.3g}"


# ---- the reference against transformers --------------------------------------------------------------------
@pytest.mark.parametrize("grids", list(GRIDS), ids=list(GRIDS))
def test_tower_matches_transformers_tiny(grids):
    torch = require("torch")
    m = _torch_tower(TINY)
    vc = VisionConfig.from_dict(TINY)
    grid = np.array(GRIDS[grids])
    px = pixels(vc, grid)
    with torch.no_grad():
        want = m(torch.from_numpy(px), torch.from_numpy(grid)).pooler_output.numpy()
    got = VisionTower(_canonical(m.state_dict()), vc)(px, grid)
    assert got.shape == (sum(merged_token_counts(grid, 2)), 48)
    _close(grids, got, want)


def test_tower_matches_transformers_real_width():
    """The real tower's widths (1152 / 16 heads of 72 / MLP 4304 / merger 4608 -> 2048, a 48 x 48 position
    grid) on 2 blocks, two images of different grids (6 x 8 and 4 x 10 patches)."""
    torch = require("torch")
    m = _torch_tower(REAL, seed=1)
    vc = VisionConfig.from_dict(REAL)
    grid = np.array([[1, 6, 8], [1, 4, 10]])
    px = pixels(vc, grid, seed=1)
    with torch.no_grad():
        want = m(torch.from_numpy(px), torch.from_numpy(grid)).pooler_output.numpy()
    got = VisionTower(_canonical(m.state_dict()), vc)(px, grid)
    assert got.shape == (22, 2048)
    _close("real width", got, want)


def test_grid_helpers_equal_transformers():
    """The position-table taps and the rotary (row, column) of every patch equal transformers' helpers exactly
    (indices) and to float32 rounding (weights), grids larger and smaller than the table, square and not."""
    torch = require("torch")
    require("transformers")
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids
    grid = np.array([[1, 4, 6], [2, 2, 2], [1, 12, 8], [1, 6, 6]])
    idx, w = get_vision_interpolation_indices_and_weights(torch.from_numpy(grid), 6, mode="bilinear",
                                                          align_corners=True, spatial_merge_size=2)
    got_idx, got_w = interpolation_taps(grid, 6, 2)
    np.testing.assert_array_equal(got_idx, idx.numpy())
    np.testing.assert_allclose(got_w, w.numpy(), rtol=0, atol=1e-7)
    np.testing.assert_array_equal(rotary_positions(grid, 2), get_vision_position_ids(torch.from_numpy(grid), 2).numpy())


# ---- the fixtures: HF layout as transformers reads it, mlx-vlm's layout as mlx-vlm writes and runs it ---------
@pytest.fixture(scope="module")
def vl():
    """The tiny-vl fixtures: hf-bf16, and mlx-bf16 / mlx-q4 with the tower kept (mlx-vlm's layout)."""
    return {f: cached_checkpoint("tiny-vl", f, vision=f != "hf-bf16") for f in ("hf-bf16", "mlx-bf16", "mlx-q4")}


def _load(path):
    c = ModelConfig.from_file(path)
    return c, load_weights(path, c)


def test_both_layouts_load_the_same_tower(vl):
    """hf-bf16 (model.visual.*, Conv3d channels-first) and mlx-vlm's bf16 / 4-bit conversions (vision_tower.*,
    channels-last, never quantized) give the same tensors bit for bit; mlx-lm's text-only conversion (no tower,
    no vision_config) loads with none."""
    c, hf = _load(vl["hf-bf16"])
    assert hf.vision_layout == "hf" and c.vision == VisionConfig.from_dict(PRESETS["tiny-vl"]["vision_config"])
    assert (c.image_token_id, c.video_token_id) == (PRESETS["tiny-vl"]["image_token_id"], PRESETS["tiny-vl"]["video_token_id"])
    assert len(hf.vision) == 3 + 12 * c.vision.depth + 6       # patch embed + bias, pos_embed; blocks; merger
    assert hf.vision["patch_embed.proj"].shape == (64, 3 * 2 * 16 * 16)
    for f in ("mlx-bf16", "mlx-q4"):
        c2, w = _load(vl[f])
        assert w.vision_layout == "mlx-vlm" and c2.vision == c.vision and sorted(w.vision) == sorted(hf.vision)
        for k, v in hf.vision.items():
            assert isinstance(w.vision[k], np.ndarray) and w.vision[k].dtype == ml_dtypes.bfloat16, (f, k)
            np.testing.assert_array_equal(np.asarray(w.vision[k], np.float32), np.asarray(v, np.float32), err_msg=k)
    text_only = cached_checkpoint("tiny-vl", "mlx-q4")
    c3, w3 = _load(text_only)
    assert c3.vision is None and w3.vision == {} and w3.vision_layout is None
    assert not ModelConfig.from_dict(PRESETS["tiny-text"]).vision


def test_hf_fixture_matches_transformers_from_pretrained(vl):
    """transformers loads the hf-bf16 fixture as Qwen3_5MoeForConditionalGeneration; its tower (float32) on two
    images equals ours on the tensors our loader read."""
    torch = require("torch")
    require("transformers")
    from transformers import Qwen3_5MoeForConditionalGeneration
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(vl["hf-bf16"]), dtype=torch.float32).eval()
    c, w = _load(vl["hf-bf16"])
    grid = np.array([[1, 4, 6], [1, 2, 4]])
    px = pixels(c.vision, grid, seed=3)
    with torch.no_grad():
        want = model.model.visual(torch.from_numpy(px), torch.from_numpy(grid)).pooler_output.numpy()
    _close("from_pretrained", VisionTower(w.vision, c.vision)(px, grid), want)


@pytest.fixture(scope="module")
def mlx_vlm_converted(vl, tmp_path_factory):
    """mlx-vlm's own `convert` of the hf-bf16 fixture: unquantized, and 4-bit g64."""
    require("mlx_vlm")
    from mlx_vlm import convert as mv_convert
    out = {}
    root = tmp_path_factory.mktemp("mlx_vlm")
    for name, kw in (("mlx-bf16", {}), ("mlx-q4", dict(quantize=True, q_bits=4, q_group_size=64))):
        with contextlib.redirect_stdout(io.StringIO()):
            mv_convert(str(vl["hf-bf16"]), mlx_path=str(root / name), **kw)
        out[name] = root / name
    return out


@pytest.mark.parametrize("fmt", ["mlx-bf16", "mlx-q4"])
def test_mlx_layout_is_mlx_vlm_convert(vl, mlx_vlm_converted, fmt):
    """Our vision=True MLX fixtures hold exactly the tensors mlx-vlm's convert writes (names, dtypes, shapes,
    bytes: the tower bf16, channels-last, unquantized; the text as mlx-lm writes it) and the same vision_config."""
    ours = load_file(str(vl[fmt] / "model.safetensors"))
    theirs = {}
    for f in sorted(mlx_vlm_converted[fmt].glob("*.safetensors")):
        theirs.update(load_file(str(f)))
    assert sorted(ours) == sorted(theirs)
    for k, v in ours.items():
        assert v.dtype == theirs[k].dtype and v.shape == theirs[k].shape, k
        assert v.tobytes() == theirs[k].tobytes(), k
    cfg = json.loads((mlx_vlm_converted[fmt] / "config.json").read_text())
    assert cfg["vision_config"] == json.loads((vl[fmt] / "config.json").read_text())["vision_config"]


def test_tower_matches_mlx_vlm(vl):
    """mlx-vlm's VisionModel (MLX CPU, float32 weights) strictly loaded with the mlx-bf16 fixture's
    vision_tower.* equals our tower on two images."""
    mx = require("mlx.core")
    require("mlx_vlm")
    from mlx_vlm.models.qwen3_5_moe.config import VisionConfig as MlxVisionConfig
    from mlx_vlm.models.qwen3_5_moe.vision import VisionModel
    path = vl["mlx-bf16"]
    c, w = _load(path)
    tower = VisionModel(MlxVisionConfig.from_dict(json.loads((path / "config.json").read_text())["vision_config"]))
    files = load_file(str(path / "model.safetensors"))
    params = {k[len("vision_tower."):]: mx.array(v.astype(np.float32)) for k, v in files.items()
              if k.startswith("vision_tower.")}
    tower.load_weights(list(tower.sanitize(params).items()), strict=True)
    grid = np.array([[1, 4, 6], [1, 8, 2]])
    px = pixels(c.vision, grid, seed=4)
    out, _ = tower(mx.array(px), mx.array(grid))
    _close("mlx-vlm", VisionTower(w.vision, c.vision)(px, grid), np.array(out))


# ---- convert ---------------------------------------------------------------------------------------------------
def test_convert_keeps_the_tower(vl, tmp_path):
    """`qwenmetal convert` keeps the tower (== the vision=True fixture, byte for byte); --drop-vision writes
    mlx-lm's text-only checkpoint (== the plain fixture)."""
    from qwenmetal.cli import main

    def digests(d):
        return {f.name: f.read_bytes() for f in sorted(d.iterdir())}

    kept = convert(vl["hf-bf16"], tmp_path / "kept")
    assert digests(kept) == digests(vl["mlx-q4"])
    assert main(["convert", str(vl["hf-bf16"]), str(tmp_path / "text"), "--drop-vision", "--quiet"]) == 0
    assert digests(tmp_path / "text") == digests(cached_checkpoint("tiny-vl", "mlx-q4"))
    assert not any(k.startswith("vision") for k in load_file(str(tmp_path / "text" / "model.safetensors")))


# ---- errors ----------------------------------------------------------------------------------------------------
def _edited(src, dst, edit=None, cfg_edit=None):
    shutil.copytree(src, dst)
    if edit is not None:
        f = dst / "model.safetensors"
        t = load_file(str(f))
        edit(t)
        save_file({k: np.ascontiguousarray(v) for k, v in t.items()}, str(f), metadata={"format": "pt"})
        (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    if cfg_edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _refused(path, match):
    with pytest.raises(CheckpointError, match=match):
        qm.Model.load(path, backend="reference")


def test_missing_misshapen_and_extra_vision_tensors_are_refused(vl, tmp_path):
    hf = vl["hf-bf16"]
    _refused(_edited(hf, tmp_path / "a", lambda t: t.pop("model.visual.blocks.1.attn.qkv.bias")),
             r"missing vision tensor 'blocks\.1\.attn\.qkv\.bias'")
    _refused(_edited(hf, tmp_path / "b", lambda t: t.update({
        "model.visual.blocks.0.mlp.linear_fc1.weight": t["model.visual.blocks.0.mlp.linear_fc1.weight"][:100]})),
        r"blocks\.0\.mlp\.linear_fc1\.weight'.*shape \[100, 64\] does not match \[128, 64\].*"
        r"vision_config\.intermediate_size is 128 but the tensor has 100")
    _refused(_edited(hf, tmp_path / "c", lambda t: t.update({
        "model.visual.blocks.2.norm1.weight": t["model.visual.blocks.1.norm1.weight"]})),
        r"unexpected vision tensor 'model\.visual\.blocks\.2\.norm1\.weight'.*depth 2")
    _refused(_edited(hf, tmp_path / "o", cfg_edit=lambda c: c["vision_config"].update(out_hidden_size=64)),
             r"vision_config out_hidden_size \(64\) must equal the text model's hidden_size \(128\)")
    _refused(_edited(hf, tmp_path / "d", cfg_edit=lambda c: c.pop("vision_config")),
             r"vision tower tensor 'model\.visual\..*' \(and \d+ more\), but config\.json has no vision_config")
    _refused(_edited(hf, tmp_path / "e", lambda t: t.update({
        "vision_tower.pos_embed.weight": t["model.visual.pos_embed.weight"]})),
        r"vision tensors in both layouts .*'vision_tower\.pos_embed\.weight'")
    _refused(_edited(hf, tmp_path / "f", lambda t: t.update({
        "model.visual.patch_embed.proj.weight": t["model.visual.patch_embed.proj.weight"].transpose(0, 2, 3, 4, 1)})),
        r"patch_embed\.proj\.weight'.*shape \[64, 2, 16, 16, 3\] does not match \[64, 3, 2, 16, 16\]")
    # mlx-vlm's layout: its channels-last conv, and (as mlx-vlm's sanitize transposes one) channels-first too
    mlx = vl["mlx-bf16"]
    first = _edited(mlx, tmp_path / "g", lambda t: t.update({
        "vision_tower.patch_embed.proj.weight": t["vision_tower.patch_embed.proj.weight"].transpose(0, 4, 1, 2, 3)}))
    np.testing.assert_array_equal(to_float32(_load(first)[1].vision["patch_embed.proj"]),
                                  to_float32(_load(mlx)[1].vision["patch_embed.proj"]))
    _refused(_edited(mlx, tmp_path / "h", lambda t: t.pop("vision_tower.merger.linear_fc2.bias")),
             r"missing vision tensor 'merger\.linear_fc2\.bias'")


@pytest.mark.parametrize("edit, match", [
    (lambda v: v.update(num_position_embeddings=40), r"'num_position_embeddings' is 40; it must be a square"),
    (lambda v: v.update(num_heads=3), r"hidden_size \(64\) must be a multiple of num_heads \(3\)"),
    (lambda v: v.update(num_heads=32), r"head dim 2 .* must be a multiple of 4"),
    (lambda v: v.pop("depth"), r"vision_config lacks required field 'depth'"),
    (lambda v: v.update(depth=0), r"vision_config field 'depth' must be a positive integer, got 0"),
    (lambda v: v.update(hidden_act="relu"), r"'hidden_act' is 'relu'; supported"),
    (lambda v: v.update(deepstack_visual_indexes=[1]), r"deepstack mergers \(Qwen3-VL\) are not supported"),
    (lambda v: v.update(rope_parameters={"rope_type": "default"}), r"rope_type 'default' is not supported"),
])
def test_bad_vision_config(edit, match):
    cfg = json.loads(json.dumps(PRESETS["tiny-vl"]))
    edit(cfg["vision_config"])
    with pytest.raises(CheckpointError, match=match):
        ModelConfig.from_dict(cfg)


def test_bad_token_id():
    cfg = dict(PRESETS["tiny-vl"], image_token_id="x")
    with pytest.raises(CheckpointError, match=r"'image_token_id' must be a non-negative integer, got 'x'"):
        ModelConfig.from_dict(cfg)


def test_bad_inputs_are_refused(vl):
    c, w = _load(vl["hf-bf16"])
    tower = VisionTower(w.vision, c.vision)
    grid = np.array([[1, 4, 6]])
    px = pixels(c.vision, grid)
    for p, g, match in bad_inputs(px, grid):
        with pytest.raises(InputError, match=match):
            tower(p, g)
    with pytest.raises(InputError, match=r"the checkpoint has no vision tower"):
        VisionTower({}, c.vision)

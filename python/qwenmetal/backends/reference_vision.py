"""The vision tower in numpy: Qwen3.5/3.6's ViT, the ground truth the engines' towers are checked against.

`VisionTower(params, vision_config)(pixel_values, grid_thw)` -> ``[n_merged, out_hidden_size]`` float32, the
rows that stand in for an image's ``<|image_pad|>`` tokens (docs/vision.md, "The vision tower"). Inputs are
what transformers' image processor gives: ``pixel_values`` ``[n_patches, C*T*P*P]`` (one row per patch, the
patches of each image in spatial-merge-block order) and ``grid_thw`` ``[n_images, 3]`` (temporal, height, width
in patches). ``params`` are `Weights.vision`'s canonical tensors (qwenmetal.weights), dequantized or cast to
float32 here.

The computation, in order (transformers' ``Qwen3_5MoeVisionModel``):

1. patch embedding: the Conv3d whose kernel equals its stride is one GEMM, ``x = pixel_values @ W^T + b`` with
   ``W`` ``[hidden, C*T*P*P]`` (the conv weight flattened in the processor's channel-major patch order);
2. learned position embedding: the ``side x side`` table (``num_position_embeddings = side^2``) bilinearly
   resampled to each image's ``h x w`` grid with align_corners=True (``get_vision_interpolation_indices_and_
   weights``: 4 taps per patch, edge-clamped), in spatial-merge-block order, repeated over the t frames;
3. 2-D rotary embedding: head_dim/4 frequencies ``theta^(-4i/head_dim)``; the first half of a head's rotary
   angles are the patch's row times those frequencies, the second half its column, and the rotation is
   rotate-half over the whole head (the angle vector ``[row f, col f, row f, col f]``);
4. ``depth`` pre-LayerNorm blocks (eps 1e-6): full bidirectional attention within each frame of each image
   (``cu_seqlens``; no attention across images), ``qkv`` and ``proj`` with biases; an MLP
   ``fc2(act(fc1 x))`` with the config's activation (GELU-tanh for the released models);
5. the patch merger: LayerNorm over each patch, then every ``merge x merge`` block of consecutive rows
   concatenated (``hidden * merge^2`` wide), ``fc2(GELU(fc1 .))`` with the exact (erf) GELU ->
   ``out_hidden_size``.

Everything is float32 (products and reductions accumulate in float32; GELU's erf and the rotary angles'
cos/sin are evaluated in float64 and rounded).
"""
from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from ..config import VisionConfig
from ..errors import InputError
from ..weights import to_float32

F32 = np.float32
LAYER_NORM_EPS = 1e-6
MAX_VISION_PATCHES = 1 << 20          # a sanity bound on the patches of one call (a 2048^2 image has 16384)

_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """Exact GELU, x * Phi(x) (torch's nn.GELU()): erf evaluated in float64, rounded to float32."""
    x64 = x.astype(np.float64)
    return (0.5 * x64 * (1.0 + _erf(x64 / math.sqrt(2.0)))).astype(F32)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation (``gelu_pytorch_tanh``), evaluated in float64 and rounded to float32."""
    x64 = x.astype(np.float64)
    return (0.5 * x64 * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64 ** 3)))).astype(F32)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Softmax in float32 (as `reference.softmax`; kept here so that reference.py can import this module)."""
    x = x.astype(F32, copy=False)
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


ACTIVATIONS = {"gelu_pytorch_tanh": gelu_tanh, "gelu": gelu_erf}


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = LAYER_NORM_EPS) -> np.ndarray:
    """LayerNorm over the last axis (biased variance), statistics in float32."""
    mean = x.mean(axis=-1, keepdims=True, dtype=F32)
    d = x - mean
    var = (d * d).mean(axis=-1, keepdims=True, dtype=F32)
    return (d / np.sqrt(var + F32(eps)) * weight + bias).astype(F32)


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """x @ W^T + b with W [out, in], float32."""
    return (x @ w.T + b).astype(F32)


# ---- the grid helpers (pure functions of grid_thw and the config) ------------------------------------------
def check_inputs(vc: VisionConfig, pixel_values, grid_thw) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values as float32 [n, C*T*P*P], grid_thw as int64 [n_images, 3]) after checking them against `vc`
    and each other; InputError naming the argument otherwise."""
    g = np.asarray(grid_thw)
    if g.ndim != 2 or g.shape[1] != 3 or g.shape[0] == 0 or not np.issubdtype(g.dtype, np.integer):
        raise InputError(f"grid_thw must be an integer array [n_images, 3] with at least one image, got "
                         f"{g.dtype} {list(g.shape)}", param="grid_thw")
    g = g.astype(np.int64)
    m = vc.spatial_merge_size
    for i, (t, h, w) in enumerate(g.tolist()):
        if t <= 0 or h <= 0 or w <= 0:
            raise InputError(f"grid_thw[{i}] = {[t, h, w]}: every entry must be positive", param="grid_thw")
        if h % m or w % m:
            raise InputError(f"grid_thw[{i}] = {[t, h, w]}: height and width must be multiples of "
                             f"spatial_merge_size {m}", param="grid_thw")
    n = int((g[:, 0] * g[:, 1] * g[:, 2]).sum())
    if n > MAX_VISION_PATCHES:
        raise InputError(f"grid_thw asks for {n} patches, more than {MAX_VISION_PATCHES}", param="grid_thw")
    p = np.asarray(pixel_values)
    if p.ndim != 2 or p.shape != (n, vc.patch_dim):
        raise InputError(f"pixel_values must be [{n}, {vc.patch_dim}] (the patches grid_thw describes x "
                         f"in_channels*temporal_patch_size*patch_size^2), got {list(p.shape)}", param="pixel_values")
    if not np.issubdtype(p.dtype, np.floating):
        raise InputError(f"pixel_values must be floating point, got {p.dtype}", param="pixel_values")
    p = np.ascontiguousarray(p, dtype=F32)
    if not np.isfinite(p).all():
        raise InputError("pixel_values holds NaN or infinity", param="pixel_values")
    return p, g


def merged_token_counts(grid_thw, spatial_merge_size: int) -> list[int]:
    """Merged tokens (``<|image_pad|>`` slots) per image: t * h * w / merge^2."""
    return [int(t * h * w) // (spatial_merge_size * spatial_merge_size) for t, h, w in np.asarray(grid_thw).tolist()]


def block_order_rows_cols(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """The (row, column) of each patch of one h x w frame in the processor's spatial-merge-block order:
    blocks of merge x merge patches row-major, the patches of a block row-major."""
    rows = np.arange(h).reshape(h // merge, merge, 1, 1)
    cols = np.arange(w).reshape(1, 1, w // merge, merge)
    r = np.broadcast_to(rows, (h // merge, merge, w // merge, merge)).transpose(0, 2, 1, 3).reshape(-1)
    c = np.broadcast_to(cols, (h // merge, merge, w // merge, merge)).transpose(0, 2, 1, 3).reshape(-1)
    return r, c


def rotary_positions(grid_thw, merge: int) -> np.ndarray:
    """[n_patches, 2] (row, column) of every patch, block order, repeated over each image's frames."""
    out = []
    for t, h, w in np.asarray(grid_thw).tolist():
        r, c = block_order_rows_cols(h, w, merge)
        out.append(np.tile(np.stack([r, c], axis=-1), (t, 1)))
    return np.concatenate(out).astype(np.int64)


def interpolation_taps(grid_thw, side: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices [n, 4] into the flattened side x side position table, weights [n, 4] float32): the bilinear,
    align_corners=True resampling of the table to each image's grid, per patch in block order (taps in the
    order (r0, c0), (r0, c1), (r1, c0), (r1, c1); out-of-range taps clamp to the edge with weight 0 or exactly
    on it)."""
    idx, wts = [], []
    for t, h, w in np.asarray(grid_thw).tolist():
        r, c = block_order_rows_cols(h, w, merge)

        def axis(pos, size):
            src = pos.astype(F32) * F32(side - 1) / F32(max(size - 1, 1))
            lo = np.floor(src)
            frac = (src - lo).astype(F32)
            lo = lo.astype(np.int64)
            return np.minimum(lo, side - 1), np.minimum(lo + 1, side - 1), F32(1) - frac, frac

        r0, r1, wr0, wr1 = axis(r, h)
        c0, c1, wc0, wc1 = axis(c, w)
        i = np.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], axis=-1)
        ww = np.stack([wr0 * wc0, wr0 * wc1, wr1 * wc0, wr1 * wc1], axis=-1).astype(F32)
        idx.append(np.tile(i, (t, 1)))
        wts.append(np.tile(ww, (t, 1)))
    return np.concatenate(idx), np.concatenate(wts)


def rotary_cos_sin(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) [n, head_dim] float32 of the 2-D rotary embedding for (row, column) `positions` [n, 2]:
    inv_freq = theta^(-2i/(head_dim/2)) for i < head_dim/4 (float32), angles [row f | col f] repeated twice,
    each angle the float32 product and its cos/sin evaluated in float64 and rounded."""
    spatial = head_dim // 2
    inv_freq = (1.0 / (float(theta) ** (np.arange(0, spatial, 2, dtype=np.float64) / spatial))).astype(F32)
    ang = positions[:, :, None].astype(F32) * inv_freq[None, None, :]          # [n, 2, head_dim/4]
    ang = ang.reshape(len(positions), -1)                                       # [row f | col f]
    ang = np.concatenate([ang, ang], axis=-1).astype(np.float64)
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


def frame_bounds(grid_thw) -> np.ndarray:
    """cu_seqlens: the row where each attention segment (one frame of one image) starts, plus the end."""
    lens = [h * w for t, h, w in np.asarray(grid_thw).tolist() for _ in range(t)]
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE over the whole head: x [n, heads, d], cos/sin [n, d]."""
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos[:, None, :] + rot * sin[:, None, :]).astype(F32)


# ---- the tower ----------------------------------------------------------------------------------------------
class VisionTower:
    """The tower with its parameters cast to float32 once. ``params``: canonical names (`Weights.vision`)."""

    def __init__(self, params: Mapping[str, object], vision_config: VisionConfig):
        if not isinstance(vision_config, VisionConfig):
            raise TypeError(f"vision_config must be a VisionConfig, not {type(vision_config).__name__}")
        if not params:
            raise InputError("the checkpoint has no vision tower (no model.visual.* / vision_tower.* tensors)",
                             param="params")
        self.config = vision_config
        self.p = {k: to_float32(v) for k, v in params.items()}
        vc = vision_config
        if self.p["patch_embed.proj"].shape != (vc.hidden_size, vc.patch_dim):
            raise InputError(f"patch_embed.proj is {list(self.p['patch_embed.proj'].shape)}, expected "
                             f"[{vc.hidden_size}, {vc.patch_dim}]", param="params")
        self.act = ACTIVATIONS[vc.hidden_act]

    def __call__(self, pixel_values, grid_thw) -> np.ndarray:
        """[n_merged, out_hidden_size] float32: the merged rows of every image, images in order."""
        return self.merge(self.blocks(pixel_values, grid_thw))

    def encode(self, pixel_values, grid_thw) -> np.ndarray:
        """The same as calling the tower: the interface every backend's vision encoder has
        (`ModelBase.vision_encoder`)."""
        return self(pixel_values, grid_thw)

    def embed(self, pixel_values, grid_thw) -> np.ndarray:
        """Patch embedding plus the interpolated position embedding: [n_patches, hidden]."""
        vc, p = self.config, self.p
        pixels, g = check_inputs(vc, pixel_values, grid_thw)
        x = linear(pixels, p["patch_embed.proj"], p["patch_embed.proj.bias"])
        idx, wts = interpolation_taps(g, vc.grid_side, vc.spatial_merge_size)
        pos = (p["pos_embed"][idx] * wts[:, :, None]).sum(axis=1, dtype=F32)
        return (x + pos).astype(F32)

    def blocks(self, pixel_values, grid_thw) -> np.ndarray:
        """The hidden states after the last block, before the merger: [n_patches, hidden]."""
        vc = self.config
        x = self.embed(pixel_values, grid_thw)
        g = np.asarray(grid_thw, dtype=np.int64)
        cos, sin = rotary_cos_sin(rotary_positions(g, vc.spatial_merge_size), vc.head_dim, vc.rope_theta)
        bounds = frame_bounds(g)
        for i in range(vc.depth):
            x = self.block(i, x, cos, sin, bounds)
        return x

    def block(self, i: int, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, bounds: np.ndarray) -> np.ndarray:
        vc, p, b = self.config, self.p, f"blocks.{i}."
        n, nh, hd = x.shape[0], vc.num_heads, vc.head_dim
        h = layer_norm(x, p[b + "norm1"], p[b + "norm1.bias"])
        qkv = linear(h, p[b + "attn.qkv"], p[b + "attn.qkv.bias"]).reshape(n, 3, nh, hd)
        q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
        out = np.empty((n, nh, hd), F32)
        scale = F32(hd ** -0.5)
        for s, e in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (a[s:e].transpose(1, 0, 2) for a in (q, k, v))           # [heads, len, hd]
            probs = softmax((qs @ ks.transpose(0, 2, 1)) * scale, axis=-1)
            out[s:e] = (probs @ vs).transpose(1, 0, 2)
        x = (x + linear(out.reshape(n, nh * hd), p[b + "attn.proj"], p[b + "attn.proj.bias"])).astype(F32)
        h = layer_norm(x, p[b + "norm2"], p[b + "norm2.bias"])
        h = self.act(linear(h, p[b + "mlp.linear_fc1"], p[b + "mlp.linear_fc1.bias"]))
        return (x + linear(h, p[b + "mlp.linear_fc2"], p[b + "mlp.linear_fc2.bias"])).astype(F32)

    def merge(self, x: np.ndarray) -> np.ndarray:
        """The patch merger: [n_patches, hidden] -> [n_patches / merge^2, out_hidden_size]."""
        vc, p = self.config, self.p
        h = layer_norm(x, p["merger.norm"], p["merger.norm.bias"]).reshape(-1, vc.merged_dim)
        h = gelu_erf(linear(h, p["merger.linear_fc1"], p["merger.linear_fc1.bias"]))
        return linear(h, p["merger.linear_fc2"], p["merger.linear_fc2.bias"])


def vision_forward(params: Mapping[str, object], vision_config: VisionConfig, pixel_values, grid_thw) -> np.ndarray:
    """One call of the tower (see `VisionTower`): [n_merged, out_hidden_size] float32."""
    return VisionTower(params, vision_config)(pixel_values, grid_thw)

"""Interleaved M-RoPE positions of Qwen3.5/3.6 (docs/vision.md, "Positions and caches").

A Qwen3.5/3.6 text attention layer rotates its first ``rotary_dim`` dims (64 of 256: 32 frequency pairs) by
angles ``position * inv_freq[j]``. With M-RoPE every token has three position components (t, h, w); pair
``j`` takes its position from one of them, interleaved by ``rope_parameters.mrope_section`` = [s_t, s_h, s_w]
([11, 11, 10])::

    component(j) = 1 (h)  if j % 3 == 1 and j < 3 * s_h
                   2 (w)  if j % 3 == 2 and j < 3 * s_w
                   0 (t)  otherwise

(transformers' ``Qwen3_5MoeTextRotaryEmbedding.recomposition_frequencies``). A text token's three components
are equal, so M-RoPE on text is plain 1-D RoPE. An image of ``t x h x w`` merged patches starting at rope
position ``s`` gets ``(s + t_i, s + h_i, s + w_i)``; the text after it continues at
``s + max(h, w)`` (= the largest position so far + 1 for a single frame), so from then on a token's rope
position is its index plus a *delta* (``rope_deltas``), which a session keeps.

The engines take positions per frequency pair (`pair_positions`: [n, rotary_dim / 2] int32), so none of them
needs to know the sections; a call without positions rotates row i at ``index + delta`` in every pair.
"""
from __future__ import annotations

import hashlib
from typing import NamedTuple, Sequence

import numpy as np


def mrope_section(config) -> tuple | None:
    """The interleaved M-RoPE sections (t, h, w) in frequency pairs of `config` (a ModelConfig), or None for a
    model without M-RoPE (Qwen3-Next). Only the interleaved layout (mrope_interleaved) is supported; a Qwen3.5
    config without the field gets transformers' default [11, 11, 10]."""
    raw = getattr(config, "raw", None) or {}
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    sec = rope.get("mrope_section") if isinstance(rope, dict) else None
    if sec is None:       # transformers' Qwen3_5MoeTextRotaryEmbedding defaults to [11, 11, 10]
        return (11, 11, 10) if str(getattr(config, "model_type", "")).startswith("qwen3_5_moe") else None
    if (not isinstance(sec, (list, tuple)) or len(sec) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in sec)):
        raise ValueError(f"mrope_section must be three non-negative integers, got {sec!r}")
    if rope.get("mrope_interleaved") is False:
        raise ValueError("only interleaved M-RoPE (mrope_interleaved: true) is supported")
    return tuple(int(x) for x in sec)


def pair_components(section, half: int) -> np.ndarray:
    """[half] int: which position component (0 t, 1 h, 2 w) each frequency pair reads (module docstring)."""
    j = np.arange(half)
    comp = np.zeros(half, dtype=np.int64)
    if section is not None:
        comp[(j % 3 == 1) & (j < 3 * section[1])] = 1
        comp[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return comp


def pair_positions(positions: np.ndarray, config) -> np.ndarray:
    """Positions [3, n] (t, h, w) -> the position of every frequency pair [n, rotary_dim / 2] int32, what the
    engines take. A model without M-RoPE uses component t for every pair."""
    p = np.asarray(positions)
    if p.ndim != 2 or p.shape[0] != 3 or not np.issubdtype(p.dtype, np.integer):
        raise ValueError(f"positions must be integers [3, n], got {p.dtype}{list(p.shape)}")
    if p.size and (p.min() < 0 or p.max() >= 2**24):
        raise ValueError("positions must be in 0..2^24-1 (exact in float32)")
    comp = pair_components(mrope_section(config), config.rotary_dim // 2)
    return np.ascontiguousarray(p[comp, :].T, dtype=np.int32)


def _token_id(config, key: str):
    raw = getattr(config, "raw", None) or {}
    v = raw.get(key)
    if v is None and isinstance(raw.get("text_config"), dict):
        v = raw["text_config"].get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def spatial_merge_size(config) -> int:
    raw = getattr(config, "raw", None) or {}
    vc = raw.get("vision_config") if isinstance(raw.get("vision_config"), dict) else {}
    return int(vc.get("spatial_merge_size", 2))


def rope_index(input_ids, image_grid_thw, config, start: int = 0) -> tuple[np.ndarray, int]:
    """M-RoPE positions of one sequence: (positions int64 [3, n], delta), as transformers'
    ``Qwen3_5MoeModel.get_rope_index`` computes them for a batch of one without padding.

    `input_ids`: the tokens, with each image as a run of ``t*h*w / merge^2`` ``image_token_id`` tokens;
    `image_grid_thw`: the images' (t, h, w) patch grids in order ([m, 3], before the spatial merge);
    `config`: the ModelConfig (its raw config.json names ``image_token_id`` and ``vision_config``);
    `start`: the rope position of the first token (a continuation: the session's position + its delta).
    delta = ``max(positions) + 1 - (start + n)``: what these tokens add to the session's delta (transformers'
    ``rope_deltas`` when ``start == 0``); the token after them is at rope position ``start + n + delta``."""
    ids = np.asarray(input_ids).reshape(-1)
    grids = np.zeros((0, 3), dtype=np.int64) if image_grid_thw is None else np.asarray(image_grid_thw, dtype=np.int64)
    if grids.ndim != 2 or grids.shape[1] != 3 or (grids.size and grids.min() < 1):
        raise ValueError(f"image_grid_thw must be positive integers [m, 3], got {list(grids.shape)}")
    image_id = _token_id(config, "image_token_id")
    merge = spatial_merge_size(config)
    is_image = (ids == image_id) if image_id is not None else np.zeros(ids.shape, dtype=bool)
    n = ids.size
    out = np.zeros((3, n), dtype=np.int64)
    pos, i, g = int(start), 0, 0
    while i < n:
        if not is_image[i]:
            j = i
            while j < n and not is_image[j]:
                j += 1
            out[:, i:j] = pos + np.arange(j - i)
            pos += j - i
            i = j
            continue
        if g >= len(grids):
            raise ValueError(f"more image runs in input_ids than image_grid_thw's {len(grids)} grids")
        t, h, w = (int(x) for x in grids[g])
        if h % merge or w % merge:
            raise ValueError(f"image grid {t}x{h}x{w} is not a multiple of spatial_merge_size {merge}")
        gh, gw = h // merge, w // merge
        count = t * gh * gw
        if i + count > n or not is_image[i:i + count].all():
            raise ValueError(f"image {g} ({t}x{h}x{w}) needs {count} image tokens at index {i}")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[0, i:i + count] = pos + tt.reshape(-1)
        out[1, i:i + count] = pos + hh.reshape(-1)
        out[2, i:i + count] = pos + ww.reshape(-1)
        pos += max(gh, gw)
        i += count
        g += 1
    if g != len(grids):
        raise ValueError(f"image_grid_thw has {len(grids)} grids, input_ids {g} image runs")
    delta = int(out.max()) + 1 - (int(start) + n) if n else 0
    return out, delta


class ImageSpan(NamedTuple):
    """An image's tokens in a session: indices ``start..end-1`` hold its features; ``digest`` names its content
    (`image_digest`), so that two images of the same size (identical pad tokens) never share a cache key."""

    start: int
    end: int
    digest: str


def image_digest(data) -> str:
    """The SHA-256 (hex) of an image's content: raw bytes, or an array (its dtype, shape and bytes)."""
    h = hashlib.sha256()
    if isinstance(data, (bytes, bytearray, memoryview)):
        h.update(b"bytes:")
        h.update(bytes(data))
    else:
        a = np.ascontiguousarray(data)
        h.update(f"array:{a.dtype.str}:{a.shape}:".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def check_spans(spans, n_tokens: int) -> tuple:
    """`spans` as a tuple of ImageSpan: sorted, disjoint, inside 0..n_tokens; ValueError otherwise."""
    out = []
    last = 0
    for s in spans:
        try:
            start, end, digest = s
            start, end = int(start), int(end)
        except (TypeError, ValueError):
            raise ValueError(f"an image span is (start, end, digest), got {s!r}") from None
        if not isinstance(digest, str) or not digest:
            raise ValueError(f"an image span's digest must be a non-empty string, got {digest!r}")
        if not last <= start < end <= n_tokens:
            raise ValueError(f"image span {start}..{end} must be sorted, disjoint and inside 0..{n_tokens}")
        out.append(ImageSpan(start, end, digest))
        last = end
    return tuple(out)


def cache_key(tokens: Sequence[int], spans=()) -> tuple:
    """The prefix cache's key of a token sequence: the token ids, except that the token at index
    ``start + j`` of an image span is ``(digest, j)`` -- image pads are identical for different images, the
    image's content hash is not. Prefixes of keys are keys of prefixes."""
    key = [int(t) for t in tokens]
    for s in spans:
        for j in range(s[0], min(s[1], len(key))):
            key[j] = (s[2], j - s[0])
    return tuple(key)


class RowInputs(NamedTuple):
    """What a prefill call passes an engine beside the token ids (`ModelBase.prefill`'s positions / embeds,
    checked there): ``pair_pos`` int32 [n, rotary_dim / 2] the rows' rope position per frequency pair (None:
    row i at ``state.position + i + state.rope_delta``); ``embed_rows`` int64 [m] (sorted, distinct rows of the
    call) whose embedding lookups are replaced by ``embeds`` float32 [m, hidden]; ``rope_delta`` the state's
    delta after the call (committed with it)."""

    pair_pos: np.ndarray | None
    embed_rows: np.ndarray
    embeds: np.ndarray
    rope_delta: int

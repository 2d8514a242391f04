"""Images in a prompt: placeholders expanded, features encoded, rows and positions handed to `prefill`.

    batch = preprocess_for(model, ["photo.png"])       # ImageError for a bad image, InputError without a tower
    placed = place_images(model, ids, batch)           # each <|image_pad|> run -> that image's n_tokens pads
    placed.ids, placed.spans                           # the prompt the model reads; ImageSpan(start, end, digest)
    kwargs = placed.prefill_inputs(model, a, b)        # positions / embeds / embed_rows / images for rows a..b-1

Qwen's processor expands each ``<|image_pad|>`` of the rendered prompt to as many copies as the image has
merged patches; `place_images` does that on the token ids, so it also takes a prompt whose earlier images are
expanded already (a chat transcript). The vision tower (`ModelBase.vision_encoder`) runs once per image, when a piece of the prompt that holds the image's rows is
prefilled -- never for an image the prefix cache already holds. Positions are transformers' ``get_rope_index``
(`qwenmetal.mrope.rope_index`) from the session's rope position. docs/vision.md, "Images in chat, the CLI and
the server".
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .errors import InputError
from .images import ImageBatch, ImageProcessorConfig, from_preprocessor_config, preprocess
from .mrope import ImageSpan, rope_index
from .session import ModelBase

_lock = threading.Lock()
_configs: dict = {}                                  # checkpoint path -> its ImageProcessorConfig


def check_vision(model: ModelBase) -> None:
    """InputError unless `model` reads images: a checkpoint with a vision tower and the image token ids."""
    c = model.config
    if c.vision is None or not getattr(model.weights, "vision", None):
        what = ("Qwen3-Next has no vision tower" if c.model_type == "qwen3_next" else
                "this checkpoint has no vision tower (no model.visual.* / vision_tower.* tensors; a text-only "
                "conversion drops it: convert with the tower kept)")
        raise InputError(f"{model.path}: images were given, but {what}", "images", "unsupported_value")
    if c.image_token_id is None:
        raise InputError(f"{model.path}: config.json names no image_token_id, so images cannot be placed",
                         "images", "unsupported_value")


def image_config(model: ModelBase) -> ImageProcessorConfig:
    """The checkpoint's preprocessing parameters (its preprocessor_config.json, else the published defaults),
    read once per checkpoint path."""
    with _lock:
        cfg = _configs.get(model.path)
    if cfg is None:
        cfg = from_preprocessor_config(model.path)
        with _lock:
            _configs[model.path] = cfg
    return cfg


def preprocess_for(model: ModelBase, images: Sequence[Any]) -> ImageBatch:
    """`images` (paths, bytes, data: URLs, PIL images, uint8 arrays) decoded and preprocessed as `model`'s
    checkpoint says. InputError for a model without a tower (checked first), ImageError for a bad image;
    nothing is computed on the model."""
    check_vision(model)
    if isinstance(images, ImageBatch):
        return images
    if not isinstance(images, (list, tuple)) or not images:
        raise InputError(f"images must be a non-empty list of images, got {type(images).__name__}", "images")
    return preprocess(list(images), config=image_config(model))


def encoder(model: ModelBase):
    """The vision tower `model` runs images through: its backend's (`ModelBase.vision_encoder`: the numpy tower,
    the cpu engine's, the Metal graph's)."""
    enc = model.vision_encoder()
    if enc is None:
        raise InputError(f"the {model.backend} backend has no vision tower for this checkpoint", "images")
    return enc


@dataclass
class PromptImages:
    """A prompt's images placed at their pads: ``ids`` the prompt with every image's pads expanded, ``spans``
    one `ImageSpan` per image (indices into ``ids``), ``batch`` the preprocessed images (`ImageBatch`). The
    features of an image are computed on first use and kept for the life of this object."""

    ids: list = field(repr=False)
    spans: tuple
    batch: ImageBatch = field(repr=False)
    _features: dict = field(default_factory=dict, repr=False)
    _positions: tuple | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.spans)

    def shifted(self, offset: int) -> tuple:
        """The spans with `offset` added (a prompt that starts at session position `offset`)."""
        return tuple(ImageSpan(s.start + offset, s.end + offset, s.digest) for s in self.spans)

    def features(self, model: ModelBase, k: int) -> np.ndarray:
        """Image `k`'s rows [n_tokens, hidden] from the vision tower (computed once)."""
        f = self._features.get(k)
        if f is None:
            b = self.batch
            sizes = np.prod(b.grid_thw, axis=1)
            off = int(sizes[:k].sum())
            f = np.asarray(encoder(model).encode(b.pixel_values[off:off + int(sizes[k])], b.grid_thw[k:k + 1]),
                           dtype=np.float32)
            n = self.spans[k].end - self.spans[k].start
            if f.shape != (n, model.config.hidden_size):
                raise ValueError(f"the vision tower gave {list(f.shape)} rows for image {k}, expected "
                                 f"[{n}, {model.config.hidden_size}]")
            self._features[k] = f
        return f

    def positions(self, model: ModelBase, start: int) -> np.ndarray:
        """The prompt's M-RoPE positions [3, n] with its first token at rope position `start`."""
        if self._positions is None or self._positions[0] != start:
            pos, _ = rope_index(np.asarray(self.ids), self.batch.grid_thw, model.config, start=start)
            self._positions = (start, pos)
        return self._positions[1]

    def prefill_inputs(self, model: ModelBase, a: int, b: int, start: int) -> dict:
        """`ModelBase.prefill`'s keyword arguments for the prompt's rows ``a..b-1`` (`start`: the rope position
        of the prompt's first token): {} when those rows hold no image (their positions follow from the
        session's delta), else positions, the image rows' embeds and embed_rows, and the images' spans (an
        image cut by the piece gives the part inside it; the session joins the parts)."""
        parts = [(k, s) for k, s in enumerate(self.spans) if s.start < b and s.end > a]
        if not parts:
            return {}
        rows, feats, spans = [], [], []
        for k, s in parts:
            lo, hi = max(a, s.start), min(b, s.end)
            feats.append(self.features(model, k)[lo - s.start:hi - s.start])
            rows.extend(range(lo - a, hi - a))
            spans.append((lo - a, hi - a, s.digest))
        return {"positions": self.positions(model, start)[:, a:b], "embeds": np.concatenate(feats),
                "embed_rows": np.asarray(rows, dtype=np.int64), "images": spans}


def place_images(model: ModelBase, ids: Sequence[int], batch: ImageBatch) -> PromptImages:
    """Expand the image placeholders of the prompt `ids` for the images of `batch`, in order: each run of
    ``<|image_pad|>`` tokens is one image, and a run of one becomes that image's ``n_tokens`` pads (a run that
    already has them, from an earlier turn's transcript, is kept). InputError when the runs and the images do
    not match one to one."""
    pad = model.config.image_token_id
    need = batch.n_tokens
    out: list = []
    spans = []
    ids = [int(t) for t in ids]
    i, n = 0, len(ids)
    while i < n:
        if ids[i] != pad:
            out.append(ids[i])
            i += 1
            continue
        j = i
        while j < n and ids[j] == pad:
            j += 1
        k = len(spans)
        if k >= len(need):
            raise InputError(f"the prompt has more image placeholders (<|image_pad|> runs) than the {len(need)} "
                             "image(s) given", "images")
        if j - i not in (1, need[k]):
            raise InputError(f"image {k}: the prompt has a run of {j - i} <|image_pad|> tokens; the image takes "
                             f"{need[k]} (write one placeholder per image)", "images")
        spans.append(ImageSpan(len(out), len(out) + need[k], batch.hashes[k]))
        out.extend([pad] * need[k])
        i = j
    if len(spans) != len(need):
        raise InputError(f"{len(need)} image(s) given but the prompt has {len(spans)} placeholder(s): each image "
                         "needs <|vision_start|><|image_pad|><|vision_end|> where it goes (the chat template writes "
                         "them for image content parts)", "images")
    return PromptImages(out, tuple(spans), batch)


def expanded_index(ids: Sequence[int], pad: int | None, n: int, placed: PromptImages) -> int:
    """Where index `n` of the unexpanded prompt `ids` lands in ``placed.ids`` (a cache point before, between
    or after the images)."""
    if pad is None or not placed.spans:
        return n
    grow, k, i = 0, 0, 0
    ids = list(ids)
    while i < min(n, len(ids)):
        if ids[i] == pad:
            j = i
            while j < len(ids) and ids[j] == pad:
                j += 1
            if j > n:                          # the point is inside a run: not a useful cache point
                return 0
            grow += (placed.spans[k].end - placed.spans[k].start) - (j - i)
            k += 1
            i = j
            continue
        i += 1
    return n + grow


# ---- image content parts of chat messages -----------------------------------------------------------------
IMAGE_PART_TYPES = ("image_url", "image", "input_image")


def is_image_part(p: Any) -> bool:
    return isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES


def check_image_part(p: dict, where: str, param: str) -> None:
    """InputError (param `param`) unless the image part `p` names an image: ``image_url`` a non-empty string or
    ``{"url": non-empty string}``; ``image`` (or ``url``) present. What it names is read later
    (`part_source`)."""
    if p.get("type") in ("image_url", "input_image"):
        u = p.get("image_url")
        src = u.get("url") if isinstance(u, dict) else u
        if not isinstance(src, str) or not src:
            raise InputError(f"{where}: an image_url part needs {{'image_url': {{'url': 'data:image/...;base64,...'}}}}"
                             f", got {str(p)[:80]!r}", param, "invalid_value")
    elif p.get("image", p.get("url")) is None:
        raise InputError(f"{where}: an image part needs 'image' (a path, bytes, a data: URL or a PIL image), got "
                         f"{str(p)[:80]!r}", param, "invalid_value")


def part_source(p: dict, where: str, allow_local: bool) -> Any:
    """What an image content part points at, as `qwenmetal.images.load_image` takes it: OpenAI's
    ``{"type": "image_url", "image_url": {"url": "data:..."}}`` (or the URL as a string), or
    ``{"type": "image", "image": path | bytes | PIL image | array}``. A ``file://`` URL or a plain path is
    taken only with `allow_local`; an http(s) URL is refused by the decoder (qwenmetal never fetches)."""
    check_image_part(p, where, where)
    if p.get("type") in ("image_url", "input_image"):
        u = p.get("image_url")
        src = u.get("url") if isinstance(u, dict) else u
    else:
        src = p.get("image", p.get("url"))
    if isinstance(src, str):
        low = src[:8].lower()
        if low.startswith("file://"):
            if not allow_local:
                raise InputError(f"{where}: local image files are not allowed here (the server takes them with "
                                 "--allow-local-images); send the image as a data:image/...;base64 URL", where,
                                 "unsupported_value")
            return src[len("file://"):]
        if not (low.startswith("data:") or low.startswith("http:/") or low.startswith("https:/")
                or "://" in src[:16]) and not allow_local:
            raise InputError(f"{where}: {src[:60]!r} is a local path, not allowed here (the server takes local "
                             "files with --allow-local-images); send the image as a data:image/...;base64 URL",
                             where, "unsupported_value")
    elif isinstance(src, (os.PathLike,)) and not allow_local:
        raise InputError(f"{where}: local image files are not allowed here", where, "unsupported_value")
    return src

"""Images in: decode an image (`load_image`) and turn images into the vision tower's input (`preprocess`).

No model code. The preprocessing is the one of transformers' image processor for Qwen3.5/3.6
(``Qwen2VLImageProcessor``, the class ``AutoImageProcessor`` picks for ``qwen3_5_moe``), with the defaults those
checkpoints publish in their preprocessor_config.json (`ImageProcessorConfig`), and it gives the same
numbers as that processor's PIL backend (tests/test_images.py compares them):

1. decode to RGB (`load_image`): PNG, JPEG, WebP or GIF (the first frame), from a path, bytes or a
   ``data:image/...;base64,`` URL; the EXIF orientation is applied; transparency is composited over white;
2. `smart_resize` the size to multiples of ``patch_size * merge_size`` (32) with ``min_pixels <= h*w <=
   max_pixels``, keeping the aspect ratio as closely as that allows, and resize with Pillow (bicubic);
3. rescale (x / 255) and normalise ((x - mean) / std), in float32;
4. repeat the still image to ``temporal_patch_size`` frames and cut it into patches: ``pixel_values`` [n_patches,
   C * T * P * P], the patches of each ``merge_size`` x ``merge_size`` block of the grid consecutive (the order
   the patch merger reads), and ``grid_thw`` = (1, h / P, w / P) per image.

    from qwenmetal.images import preprocess, from_preprocessor_config
    batch = preprocess(["photo.jpg", png_bytes, "data:image/png;base64,..."],
                       config=from_preprocessor_config(checkpoint_dir))
    batch.pixel_values, batch.grid_thw, batch.n_tokens, batch.hashes

Limits (each a keyword of `load_image` / `preprocess`): an encoded image of at most `MAX_ENCODED_BYTES`, and
at most `MAX_IMAGE_PIXELS` pixels, read from the header before any pixel is decoded. Every bad input raises
`qwenmetal.errors.ImageError` (a ValueError) naming what was given. This module never fetches a URL, and
takes no video (docs/vision.md).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .config import read_config_json
from .errors import CheckpointError, ImageError

#: the largest encoded image (file, bytes, or the decoded payload of a data: URL) `load_image` reads
MAX_ENCODED_BYTES = 20 << 20
#: the most pixels (width * height, from the header) of an image `load_image` decodes: 64 Mpx, 192 MiB as RGB
MAX_IMAGE_PIXELS = 1 << 26
#: Pillow's format names of what `load_image` decodes (no other Pillow plugin is consulted)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
                "image/gif": "GIF"}
_VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".avi", ".mkv", ".webm", ".mpeg", ".mpg", ".flv", ".wmv", ".3gp")
#: leading bytes of formats that are not taken, to name them in the error
_MAGIC = ((b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"%PDF", "PDF"),
          (b"\x00\x00\x01\x00", "ICO"), (b"8BPS", "PSD"), (b"\xff\x0a", "JPEG XL"),
          (b"\x00\x00\x00\x0cJXL ", "JPEG XL"), (b"qoif", "QOI"))
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_BASE64ISH = re.compile(r"^[A-Za-z0-9+/=\s]+$")
#: what the content hash covers, so another layout of the same bytes can never collide with it
_HASH_TAG = b"qwenmetal.image.rgb8.v1"


def _error(message: str, unsupported: bool = False) -> ImageError:
    return ImageError(message, param="image", code="unsupported_value" if unsupported else "invalid_value")


def _describe(source: Any) -> str:
    """A short name of an input for an error message (never the whole payload)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"{len(source)} bytes"
    if isinstance(source, str):
        return repr(source if len(source) <= 80 else source[:60] + "...") + ("" if len(source) <= 80 else
                                                                             f" ({len(source)} characters)")
    if isinstance(source, os.PathLike):
        return repr(os.fspath(source))
    if isinstance(source, np.ndarray):
        return f"an array of shape {source.shape} and dtype {source.dtype}"
    return f"a {type(source).__name__}"


# ---------------------------------------------------------------------------------------------- decoding
def _read_file(path: str, max_bytes: int) -> bytes:
    name = _describe(path)
    if path.lower().endswith(_VIDEO_SUFFIXES):
        raise _error(f"{name} is a video; qwenmetal takes images only (video input is not supported yet)",
                     unsupported=True)
    try:
        size = os.stat(path).st_size
        if not os.path.isfile(path):
            raise _error(f"{name} is not a file")
        if size > max_bytes:
            raise _error(f"{name} is {size} bytes, over the {max_bytes}-byte limit of an encoded image")
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        hint = ("; base64 data needs the data:image/<type>;base64, prefix"
                if len(path) > 64 and _BASE64ISH.match(path) else "")
        if isinstance(e, (FileNotFoundError, NotADirectoryError)):
            raise _error(f"no image file {name} (a path, bytes or a data:image/...;base64 URL is taken)"
                         f"{hint}") from None
        raise _error(f"cannot read the image file {name} ({e.strerror}){hint}") from None
    if len(data) > max_bytes:
        raise _error(f"{name} is over the {max_bytes}-byte limit of an encoded image")
    return data


def _data_url(url: str, max_bytes: int) -> bytes:
    """The payload of ``data:image/<png|jpeg|webp|gif>;base64,<data>``."""
    head, comma, payload = url.partition(",")
    if not comma:
        raise _error(f"data: URL {_describe(url)} has no ',' before its data")
    params = [p.strip().lower() for p in head[len("data:"):].split(";")]
    media = params[0]
    if media == "image":                   # no subtype (qwen-vl-utils writes "data:image;base64,"): the bytes say
        media = "image/png"
    if media.startswith("video/"):
        raise _error(f"a {media} data: URL is a video; qwenmetal takes images only (video input is not "
                     "supported yet)", unsupported=True)
    if media not in _MEDIA_TYPES:
        raise _error(f"data: URL of media type {media or '(none)'!r}: only "
                     f"{', '.join(sorted(_MEDIA_TYPES))} are taken", unsupported=True)
    if "base64" not in params[1:]:
        raise _error(f"data: URL {_describe(url)} is not base64 (';base64,' is required)", unsupported=True)
    payload = re.sub(r"\s+", "", payload)
    if len(payload) // 4 * 3 > max_bytes + 3:
        raise _error(f"data: URL carries about {len(payload) // 4 * 3} bytes, over the {max_bytes}-byte limit of "
                     "an encoded image")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _error(f"data: URL {_describe(url)} is not valid base64 ({e})") from None
    if len(data) > max_bytes:
        raise _error(f"data: URL carries {len(data)} bytes, over the {max_bytes}-byte limit of an encoded image")
    return data


def _sniff(data: bytes) -> str | None:
    """The name of a format `load_image` does not take, from its leading bytes, or None."""
    if data[4:8] == b"ftyp":
        brand = data[8:12]
        if brand in (b"avif", b"avis"):
            return "AVIF"
        if brand in (b"heic", b"heix", b"mif1", b"msf1", b"heim", b"heis", b"hevc"):
            return "HEIF"
        return "video (MP4/QuickTime)"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "video (Matroska/WebM)"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "video (AVI)"
    head = data[:256].lstrip().lower()
    if head.startswith((b"<svg", b"<?xml")):
        return "SVG"
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    return None


def _decode(data: bytes, what: str, max_pixels: int) -> np.ndarray:
    """The first frame of an encoded PNG/JPEG/WebP/GIF as uint8 RGB, EXIF-oriented, size-checked from its header
    before decoding. Whatever Pillow raises on bad data becomes an ImageError."""
    if not data:
        raise _error(f"{what}: empty (no image data)")
    # Pillow's own bomb check (Image.MAX_IMAGE_PIXELS, left as it is) warns over 89 Mpx and raises over twice
    # that; ours, lower, follows. Its warnings (that one, a corrupt EXIF tag it skips) are left to the caller's
    # filters: catch_warnings would change the process's filters, from any thread
    try:
        im = Image.open(io.BytesIO(data), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _error(f"{what}: over the pixel limit of Pillow's decompression-bomb check ({e})") from None
    except UnidentifiedImageError:
        kind = _sniff(data)
        if kind and kind.startswith("video"):
            raise _error(f"{what} is a {kind}; qwenmetal takes images only (video input is not supported yet)",
                         unsupported=True) from None
        if kind:
            raise _error(f"{what} is a {kind} image; only PNG, JPEG, WebP and GIF are taken",
                         unsupported=True) from None
        raise _error(f"{what} is not a PNG, JPEG, WebP or GIF image that can be read (unrecognised format, or a "
                     "corrupt or zero-size header)") from None
    except Exception as e:                  # Pillow's plugins raise OSError, SyntaxError, struct.error, ...
        raise _error(f"{what}: corrupt image header ({_why(e)})") from None
    w, h = im.size
    if w <= 0 or h <= 0:
        raise _error(f"{what}: a {w}x{h} image has no pixels")
    if w * h > max_pixels:
        raise _error(f"{what}: {w}x{h} = {w * h} pixels, over the limit of {max_pixels} (checked before decoding)")
    try:
        im.seek(0)
        im.load()
        return to_rgb(ImageOps.exif_transpose(im))
    except Exception as e:                  # a warning the caller's filters turn into an error included
        raise _error(f"{what}: corrupt {im.format} data ({_why(e)})") from None


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def to_rgb(im: Image.Image) -> np.ndarray:
    """A Pillow image as uint8 RGB [H, W, 3]; an image with transparency (an alpha band, or a palette / RGB / L
    image with a transparent colour) is composited over white first: transformers' ``convert_to_rgb``."""
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        im = im.convert("RGBA")
        im = Image.alpha_composite(Image.new("RGBA", im.size, (255, 255, 255, 255)), im)
    return np.array(im.convert("RGB"), dtype=np.uint8)


def _check_array(a: np.ndarray, max_pixels: int) -> np.ndarray:
    if a.ndim == 4:
        raise _error(f"{_describe(a)} looks like a video (frames x H x W x C); video input is not supported yet",
                     unsupported=True)
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3:
        raise _error(f"{_describe(a)}: an image array must be uint8 RGB of shape [height, width, 3]")
    h, w = a.shape[:2]
    if h == 0 or w == 0:
        raise _error(f"{_describe(a)} has no pixels")
    if h * w > max_pixels:
        raise _error(f"{_describe(a)}: {h * w} pixels, over the limit of {max_pixels}")
    return np.array(a, dtype=np.uint8, order="C")


def load_image(source: Any, *, max_bytes: int = MAX_ENCODED_BYTES, max_pixels: int = MAX_IMAGE_PIXELS
               ) -> np.ndarray:
    """One image as uint8 RGB [height, width, 3].

    `source`: a path (str or os.PathLike) to a PNG, JPEG, WebP or GIF file; the encoded bytes (bytes, bytearray,
    memoryview); a ``data:image/<png|jpeg|webp|gif>;base64,...`` URL; or an already decoded image: a
    ``PIL.Image.Image`` or a uint8 [H, W, 3] array (taken as it is: no EXIF orientation applied).

    An encoded image is read only up to `max_bytes` (refused over it), its size is read from the header and
    refused over `max_pixels` before its pixels are decoded, its EXIF orientation is applied, and an animated
    GIF/WebP/PNG gives its first frame. Pillow's own limit (``PIL.Image.MAX_IMAGE_PIXELS``) applies too; this
    function does not change it. A URL with a scheme (http://, https://, file://, ...) is refused: qwenmetal
    never fetches. Every bad input raises `ImageError` naming it."""
    if isinstance(source, np.ndarray):
        return _check_array(source, max_pixels)
    if isinstance(source, Image.Image):
        w, h = source.size
        if w <= 0 or h <= 0:
            raise _error(f"a {w}x{h} PIL image has no pixels")
        if w * h > max_pixels:
            raise _error(f"a {w}x{h} PIL image: {w * h} pixels, over the limit of {max_pixels}")
        return to_rgb(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) > max_bytes:
            raise _error(f"{len(source)} bytes of image data, over the {max_bytes}-byte limit of an encoded image")
        data, what = bytes(source), f"image bytes ({len(source)} bytes)"
    elif isinstance(source, str) and source[:5].lower() == "data:":
        data, what = _data_url(source, max_bytes), "data: URL image"
    elif isinstance(source, str) and _URL.match(source):
        raise _error(f"{_describe(source)} is a URL; qwenmetal never fetches: download it and give the file path, "
                     "the bytes or a data:image/...;base64 URL", unsupported=True)
    elif isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not isinstance(path, str) or not path:
            raise _error(f"{_describe(source)} is not an image path")
        data, what = _read_file(path, max_bytes), repr(path)
    else:
        raise _error(f"{_describe(source)} is not an image (a path, bytes, a data:image/...;base64 URL, a PIL "
                     "image or a uint8 [H, W, 3] array is taken)")
    return _decode(data, what, max_pixels)


def image_hash(rgb: np.ndarray) -> str:
    """sha256 (hex) of a decoded image: its size and its RGB bytes, so the same pixels hash the same whatever
    encoding carried them (the key of a prefix-cache entry that holds the image)."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    h, w = rgb.shape[:2]
    return hashlib.sha256(_HASH_TAG + f":{h}x{w}:".encode() + rgb.tobytes()).hexdigest()


# ---------------------------------------------------------------------------------------------- preprocessing
#: Pillow resampling filters by the number a preprocessor_config.json writes ("resample": 3 is bicubic)
RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The preprocessing parameters; the defaults are the ones Qwen3.5/3.6 checkpoints publish
    (preprocessor_config.json: size {shortest_edge 65536, longest_edge 16777216}, patch_size 16,
    temporal_patch_size 2, merge_size 2, image_mean = image_std = [0.5, 0.5, 0.5]; resample and rescale_factor
    are the processor's class defaults, bicubic and 1/255). ``min_pixels`` / ``max_pixels`` bound the resized
    image's area (transformers: ``size["shortest_edge"]`` / ``size["longest_edge"]``)."""
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 256 * 256
    max_pixels: int = 4096 * 4096
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = 3

    def __post_init__(self):
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"image preprocessing: {name} must be a positive integer, got {v!r}")
            object.__setattr__(self, name, int(v))
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"image preprocessing: min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")
        if self.max_pixels < self.factor ** 2:
            raise ValueError(f"image preprocessing: max_pixels {self.max_pixels} is below one merged patch "
                             f"({self.factor}x{self.factor})")
        for name in ("mean", "std"):
            v = getattr(self, name)
            try:
                t = tuple(float(x) for x in v)
            except (TypeError, ValueError):
                raise ValueError(f"image preprocessing: {name} must be 3 numbers, got {v!r}") from None
            if len(t) != 3 or not all(math.isfinite(x) for x in t) or (name == "std" and 0.0 in t):
                raise ValueError(f"image preprocessing: {name} must be 3 finite numbers"
                                 f"{' (none zero)' if name == 'std' else ''}, got {v!r}")
            object.__setattr__(self, name, t)
        r = self.rescale_factor
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"image preprocessing: rescale_factor must be a positive number, got {r!r}")
        object.__setattr__(self, "rescale_factor", float(r))
        if isinstance(self.resample, bool) or self.resample not in RESAMPLE:
            raise ValueError(f"image preprocessing: resample must be one of {sorted(RESAMPLE)} (Pillow's filters: "
                             f"{RESAMPLE}), got {self.resample!r}")
        object.__setattr__(self, "resample", int(self.resample))

    @property
    def factor(self) -> int:
        """What both sides of a resized image are multiples of: patch_size * merge_size."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """The width of one row of pixel_values: 3 * temporal_patch_size * patch_size**2."""
        return 3 * self.temporal_patch_size * self.patch_size ** 2


def _config_from_dict(d: Any, where: str) -> ImageProcessorConfig:
    if not isinstance(d, dict):
        raise CheckpointError(f"{where}: must be a JSON object, got {type(d).__name__}")
    for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if d.get(flag, True) is not True:
            raise CheckpointError(f"{where}: {flag}={d[flag]!r} is not supported (qwenmetal always does it)")
    kw: dict[str, Any] = {}
    size = d.get("size")
    if size is not None:
        if not isinstance(size, dict):
            raise CheckpointError(f"{where}: size must be an object, got {size!r}")
        for ours, keys in (("min_pixels", ("shortest_edge", "min_pixels")),
                           ("max_pixels", ("longest_edge", "max_pixels"))):
            for k in keys:
                if size.get(k) is not None:
                    kw[ours] = size[k]
                    break
    for k in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "rescale_factor",
              "resample"):
        if d.get(k) is not None:           # top-level min_pixels / max_pixels win over size, as in transformers
            kw[k] = d[k]
    if d.get("image_mean") is not None:
        kw["mean"] = d["image_mean"]
    if d.get("image_std") is not None:
        kw["std"] = d["image_std"]
    try:
        return ImageProcessorConfig(**kw)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None


def from_preprocessor_config(path: str | os.PathLike) -> ImageProcessorConfig:
    """The preprocessing parameters of a checkpoint: `path` is its folder or a JSON file. A folder's
    preprocessor_config.json (the fields at its top level), else its processor_config.json (the fields under
    "image_processor"), else the published defaults (`ImageProcessorConfig()`) when it has neither. A field
    missing from the file takes its default. CheckpointError for a malformed file or value, or a do_* flag
    turned off."""
    path = os.fspath(path)
    if os.path.isdir(path):
        for name in ("preprocessor_config.json", "processor_config.json"):
            if os.path.isfile(os.path.join(path, name)):
                path = os.path.join(path, name)
                break
        else:
            return ImageProcessorConfig()
    elif not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such preprocessor config file")
    where, d = read_config_json(path)
    if isinstance(d, dict) and isinstance(d.get("image_processor"), dict):
        return _config_from_dict(d["image_processor"], f"{where} (image_processor)")
    return _config_from_dict(d, where)


def smart_resize(height: int, width: int, factor: int = 32, min_pixels: int = 256 * 256,
                 max_pixels: int = 4096 * 4096) -> tuple[int, int]:
    """The (height, width) an image is resized to: both multiples of `factor`, the area within [min_pixels,
    max_pixels] where the rounding allows (never below one factor x factor block), the aspect ratio kept as
    closely as that allows. Each side is first rounded to the nearest multiple (half to even, as Python's
    round); an area over max_pixels scales both sides down by sqrt(area / max_pixels) and floors them, one
    under min_pixels scales up by sqrt(min_pixels / area) and ceils them. An aspect ratio over 200 raises
    ImageError (as transformers' smart_resize raises ValueError)."""
    if height <= 0 or width <= 0:
        raise _error(f"a {width}x{height} image has no pixels")
    if max(height, width) / min(height, width) > 200:
        raise _error(f"a {width}x{height} image: aspect ratio {max(height, width) / min(height, width):.1f} is "
                     "over 200, which the vision preprocessing does not take")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def _patches(x: np.ndarray, cfg: ImageProcessorConfig) -> np.ndarray:
    """[H, W, C] float32 -> [gh * gw, C * T * P * P]: rows in merge-block order (block row, block column, then
    the merge_size x merge_size patches of the block row by row), each row channel, frame, patch row, column."""
    H, W, C = x.shape
    P, M, T = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = H // P, W // P
    blocks = x.reshape(gh // M, M, P, gw // M, M, P, C).transpose(0, 3, 1, 4, 6, 2, 5)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], blocks.shape[:5] + (T, P, P))
    return frames.reshape(gh * gw, C * T * P * P)


@dataclass(frozen=True)
class ImageBatch:
    """`preprocess`'s output. ``pixel_values`` float32 [sum of n_patches, 3 * T * P * P] (the images one after
    the other); ``grid_thw`` int64 [n_images, 3]: (temporal, height, width) patches of each image;
    ``n_tokens``: the image tokens each image becomes after the patch merger, t * h * w / merge_size**2;
    ``hashes``: `image_hash` of each decoded image; ``sizes``: each decoded image's (height, width)."""
    pixel_values: np.ndarray
    grid_thw: np.ndarray
    n_tokens: tuple[int, ...]
    hashes: tuple[str, ...]
    sizes: tuple[tuple[int, int], ...]
    config: ImageProcessorConfig = field(repr=False, default_factory=ImageProcessorConfig)

    def __len__(self) -> int:
        return len(self.n_tokens)


def preprocess_one(rgb: np.ndarray, cfg: ImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One decoded uint8 RGB [H, W, 3] image -> (its pixel_values rows, its (t, h, w) grid)."""
    H, W = rgb.shape[:2]
    h, w = smart_resize(H, W, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    resized = np.asarray(Image.fromarray(rgb).resize((w, h), resample=Image.Resampling(cfg.resample)))
    x = (resized.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    x = (x - np.asarray(cfg.mean, np.float32)) / np.asarray(cfg.std, np.float32)
    return _patches(x, cfg), (1, h // cfg.patch_size, w // cfg.patch_size)


def preprocess(images: Any, *, config: ImageProcessorConfig | None = None, patch_size: int | None = None,
               temporal_patch_size: int | None = None, merge_size: int | None = None,
               min_pixels: int | None = None, max_pixels: int | None = None,
               mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
               max_bytes: int = MAX_ENCODED_BYTES, max_image_pixels: int = MAX_IMAGE_PIXELS) -> ImageBatch:
    """`images` (one image, or a list or tuple of them; each anything `load_image` takes) -> `ImageBatch`.

    The parameters are `config`'s (default: `ImageProcessorConfig()`, the published Qwen3.5/3.6 values; a
    checkpoint's from `from_preprocessor_config`), each keyword given overriding its field. `max_bytes` and
    `max_image_pixels` are `load_image`'s limits on the input (not on the resized image, which `max_pixels`
    bounds). Every image is decoded and checked before any is resized: an ImageError (naming the image's index
    when there are several) leaves nothing half done. Videos are not taken."""
    cfg = config if config is not None else ImageProcessorConfig()
    if not isinstance(cfg, ImageProcessorConfig):
        raise TypeError(f"config must be an ImageProcessorConfig, got {type(cfg).__name__}")
    over = {k: v for k, v in (("patch_size", patch_size), ("temporal_patch_size", temporal_patch_size),
                              ("merge_size", merge_size), ("min_pixels", min_pixels), ("max_pixels", max_pixels),
                              ("mean", mean), ("std", std)) if v is not None}
    if over:
        try:
            cfg = ImageProcessorConfig(**{**cfg.__dict__, **over})
        except ValueError as e:
            raise ImageError(str(e), param="images") from None
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    if not items:
        raise _error("no images given")
    decoded = []
    for i, item in enumerate(items):
        if isinstance(item, (list, tuple)):
            raise _error(f"image {i} is a list (frames of a video?); video input is not supported yet",
                         unsupported=True)
        try:
            rgb = load_image(item, max_bytes=max_bytes, max_pixels=max_image_pixels)
            smart_resize(rgb.shape[0], rgb.shape[1], cfg.factor, cfg.min_pixels, cfg.max_pixels)
        except ImageError as e:
            if len(items) == 1:
                raise
            raise ImageError(f"image {i}: {e}", param=f"images[{i}]", code=e.code) from None
        decoded.append(rgb)
    rows, grids = [], []
    for rgb in decoded:
        p, g = preprocess_one(rgb, cfg)
        rows.append(p)
        grids.append(g)
    grid_thw = np.array(grids, dtype=np.int64).reshape(len(grids), 3)
    return ImageBatch(
        pixel_values=np.ascontiguousarray(np.concatenate(rows, axis=0), dtype=np.float32),
        grid_thw=grid_thw,
        n_tokens=tuple(int(t * h * w) // cfg.merge_size ** 2 for t, h, w in grids),
        hashes=tuple(image_hash(rgb) for rgb in decoded),
        sizes=tuple((int(rgb.shape[0]), int(rgb.shape[1])) for rgb in decoded),
        config=cfg)


def n_image_tokens(height: int, width: int, config: ImageProcessorConfig | None = None) -> int:
    """How many image tokens a decoded height x width image becomes (without decoding or resizing it)."""
    cfg = config if config is not None else ImageProcessorConfig()
    h, w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return (h // cfg.patch_size) * (w // cfg.patch_size) // cfg.merge_size ** 2


__all__ = ["MAX_ENCODED_BYTES", "MAX_IMAGE_PIXELS", "FORMATS", "ImageProcessorConfig", "ImageBatch",
           "load_image", "to_rgb", "image_hash", "smart_resize", "preprocess", "preprocess_one",
           "from_preprocessor_config", "n_image_tokens"]

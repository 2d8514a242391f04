"""qwenmetal.images against transformers' image processor for Qwen3.5/3.6 (what ``AutoImageProcessor`` builds
from the preprocessor_config.json those checkpoints publish; its PIL backend, the one that runs without
torchvision): pixel_values and image_grid_thw are compared exactly (tolerance 0: the same Pillow resize and
the same float32 arithmetic give the same bits). Then decoding (PNG, JPEG, WebP, GIF; paths, bytes, data: URLs;
RGBA / palette / grayscale conversion; EXIF orientation) and every refused input's error. Tiny images only."""
from __future__ import annotations

import base64
import io
import json
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps
from transformers import AutoImageProcessor
from transformers.image_transforms import convert_to_rgb as hf_convert_to_rgb
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from qwenmetal import images as qi
from qwenmetal.errors import CheckpointError, ImageError, InputError

# the image fields of Qwen3.5/3.6's published preprocessor_config.json
PUBLISHED = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
             "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
             "image_processor_type": "Qwen2VLImageProcessorFast"}


def _write_config(folder, d, name="preprocessor_config.json"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(d))
    return folder


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    folder = _write_config(tmp_path_factory.mktemp("qwen36"), PUBLISHED)
    proc = AutoImageProcessor.from_pretrained(folder, backend="pil")
    assert type(proc).__name__ == "Qwen2VLImageProcessorPil"
    return proc


def _hf_run(proc, imgs, **kw):
    out = proc(images=imgs, return_tensors="np", **kw)
    return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])


def _picture(h, w, seed=0, channels=3):
    """A smooth gradient plus noise (resampling differences show on both)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = (x * 255 / max(w - 1, 1) + y * 127 / max(h - 1, 1))[..., None] + rng.normal(0, 30, (h, w, channels))
    return np.clip(base, 0, 255).astype(np.uint8)


def _encode(a, fmt, **kw):
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format=fmt, **kw)
    return buf.getvalue()


def _assert_same(ours, hf_pv, hf_grid):
    assert ours.pixel_values.dtype == np.float32 and ours.grid_thw.dtype == np.int64
    np.testing.assert_array_equal(ours.grid_thw, hf_grid)
    np.testing.assert_array_equal(ours.pixel_values, hf_pv)          # exact: tolerance 0
    assert ours.n_tokens == tuple(int(t * h * w) // 4 for t, h, w in hf_grid)


# ---------------------------------------------------------------------------------------- vs transformers
@pytest.mark.parametrize("h,w", [(1, 1), (5, 3), (32, 32), (200, 300), (100, 700), (700, 100), (517, 333),
                                 (256, 256), (270, 480)],
                         ids=lambda v: str(v))
def test_pixel_values_and_grid_equal_transformers_with_the_published_defaults(hf, h, w):
    a = _picture(h, w, seed=h * 7 + w)
    pv, grid = _hf_run(hf, [Image.fromarray(a)])
    _assert_same(qi.preprocess(a), pv, grid)


@pytest.mark.parametrize("h,w,lo,hi", [(400, 300, 32 * 32, 128 * 128),      # over max_pixels: scaled down
                                       (1000, 90, 32 * 32, 96 * 96),        # tall, over max
                                       (20, 50, 160 * 160, 512 * 512),      # under min_pixels: scaled up
                                       (33, 999, 64 * 64, 64 * 64 * 4)],    # wide, rounding at both limits
                         ids=lambda v: str(v))
def test_over_max_and_under_min_pixels_equal_transformers(hf, h, w, lo, hi):
    a = _picture(h, w, seed=w)
    pv, grid = _hf_run(hf, [Image.fromarray(a)], size={"shortest_edge": lo, "longest_edge": hi})
    ours = qi.preprocess(a, min_pixels=lo, max_pixels=hi)
    _assert_same(ours, pv, grid)
    t, gh, gw = ours.grid_thw[0]
    # within max_pixels, unless a side is held at its one-block minimum (32) as transformers holds it
    assert t == 1 and gh % 2 == 0 and gw % 2 == 0 and ((gh * 16) * (gw * 16) <= hi or min(gh, gw) == 2)


def test_several_images_in_one_call_concatenate_in_order(hf):
    imgs = [_picture(64, 96, 1), _picture(300, 40, 2), _picture(64, 96, 3)]
    pv, grid = _hf_run(hf, [Image.fromarray(a) for a in imgs])
    ours = qi.preprocess(imgs)
    _assert_same(ours, pv, grid)
    assert len(ours) == 3 and ours.sizes == ((64, 96), (300, 40), (64, 96))
    assert sum(int(np.prod(g)) for g in ours.grid_thw) == ours.pixel_values.shape[0]


def test_a_checkpoints_own_parameters_equal_transformers(tmp_path):
    """Other values read from a preprocessor_config.json (Qwen2-VL's patch 14 and CLIP mean/std, bilinear,
    other limits) give transformers' numbers too."""
    d = {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64}, "patch_size": 14,
         "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
         "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 2,
         "image_processor_type": "Qwen2VLImageProcessor"}
    folder = _write_config(tmp_path, d)
    proc = AutoImageProcessor.from_pretrained(folder, backend="pil")
    cfg = qi.from_preprocessor_config(folder)
    assert (cfg.patch_size, cfg.min_pixels, cfg.max_pixels, cfg.resample) == (14, 3136, 50176, 2)
    for h, w in [(123, 321), (500, 20), (10, 10)]:
        a = _picture(h, w, seed=h)
        pv, grid = _hf_run(proc, [Image.fromarray(a)])
        ours = qi.preprocess(a, config=cfg)
        np.testing.assert_array_equal(ours.grid_thw, grid)
        np.testing.assert_array_equal(ours.pixel_values, pv)
        assert ours.pixel_values.shape[1] == cfg.patch_dim == 3 * 2 * 14 * 14


def test_smart_resize_equals_transformers_over_many_sizes():
    rng = np.random.default_rng(5)
    sizes = [(1, 1), (1, 200), (200, 1), (31, 33), (48, 80), (4096, 4096), (4097, 4095), (10000, 3000),
             (20000, 20000), (65536, 400)] + [tuple(int(v) for v in rng.integers(1, 6000, 2)) for _ in range(300)]
    for h, w in sizes:
        if max(h, w) / min(h, w) > 200:
            continue
        for factor, lo, hi in [(32, 65536, 16777216), (28, 3136, 12845056), (32, 1024, 4096)]:
            assert qi.smart_resize(h, w, factor, lo, hi) == hf_smart_resize(h, w, factor, lo, hi), (h, w, factor)
    assert qi.n_image_tokens(1080, 1920) == (1088 // 16) * (1920 // 16) // 4


def test_an_aspect_ratio_over_200_is_refused_as_transformers_does():
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        hf_smart_resize(1, 201)
    with pytest.raises(ImageError, match="aspect ratio 201.0 is over 200"):
        qi.smart_resize(1, 201)
    with pytest.raises(ImageError, match="aspect ratio 300.0 is over 200"):
        qi.preprocess(np.zeros((2, 600, 3), np.uint8))


# ---------------------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("fmt,lossless", [("PNG", True), ("JPEG", False), ("WEBP", False), ("GIF", False)])
def test_each_format_decodes_from_bytes_path_and_data_url(tmp_path, hf, fmt, lossless):
    a = _picture(40, 56, seed=3)
    data = _encode(a, fmt)
    expect = np.array(Image.open(io.BytesIO(data)).convert("RGB"))
    if lossless:
        np.testing.assert_array_equal(expect, a)
    path = tmp_path / f"img.{fmt.lower()}"
    path.write_bytes(data)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}[fmt]
    url = f"data:image/{mime};base64," + base64.b64encode(data).decode()
    for source in (data, bytearray(data), memoryview(data), str(path), path, url):
        got = qi.load_image(source)
        assert got.dtype == np.uint8 and got.shape == (40, 56, 3)
        np.testing.assert_array_equal(got, expect)
    # a path given to transformers' processor is decoded by its own loader: same numbers
    pv, grid = _hf_run(hf, [str(path)])
    _assert_same(qi.preprocess(str(path)), pv, grid)


def test_rgba_is_composited_over_white_as_transformers_does(hf):
    rgba = _picture(30, 50, seed=4, channels=4)
    rgba[:10, :, 3] = 0                                  # a fully transparent band: white after conversion
    data = _encode(rgba, "PNG")
    got = qi.load_image(data)
    np.testing.assert_array_equal(got, hf_convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True))
    assert (got[:10] == 255).all()
    pv, grid = _hf_run(hf, [Image.open(io.BytesIO(data))])
    _assert_same(qi.preprocess(data), pv, grid)


@pytest.mark.parametrize("mode", ["P", "P+transparency", "L", "LA", "1", "RGB+transparency", "CMYK"])
def test_palette_grayscale_and_other_modes_convert_as_transformers_does(hf, mode):
    rgb = Image.fromarray(_picture(24, 40, seed=5))
    if mode.startswith("P"):
        im = rgb.quantize(colors=16)
        if mode == "P+transparency":
            im.info["transparency"] = 3
    elif mode == "RGB+transparency":
        im = rgb.copy()
        im.info["transparency"] = tuple(int(v) for v in np.asarray(rgb)[0, 0])
    else:
        im = rgb.convert(mode)
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    buf = io.BytesIO()
    im.save(buf, format=fmt, **({"transparency": im.info["transparency"]} if "transparency" in mode else {}))
    data = buf.getvalue()
    decoded = Image.open(io.BytesIO(data))
    assert ("transparency" in decoded.info) == ("transparency" in mode)
    got = qi.load_image(data)
    np.testing.assert_array_equal(got, hf_convert_to_rgb(decoded, return_numpy=True))
    pv, grid = _hf_run(hf, [Image.open(io.BytesIO(data))])
    _assert_same(qi.preprocess(data), pv, grid)


def test_a_transparent_gif_and_an_animated_gif_give_their_first_frame():
    frames = [Image.fromarray(_picture(16, 16, seed=s)).quantize(colors=8) for s in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], transparency=0, disposal=2)
    data = buf.getvalue()
    first = Image.open(io.BytesIO(data))
    assert first.n_frames == 3 and first.info.get("transparency") is not None
    np.testing.assert_array_equal(qi.load_image(data), hf_convert_to_rgb(first, return_numpy=True))


def test_the_exif_orientation_is_applied():
    a = _picture(20, 36, seed=6)
    exif = Image.Exif()
    exif[0x0112] = 6                                    # rotate 90 degrees clockwise to display
    data = _encode(a, "JPEG", exif=exif.tobytes(), quality=95)
    got = qi.load_image(data)
    assert got.shape == (36, 20, 3)
    np.testing.assert_array_equal(got, np.array(ImageOps.exif_transpose(Image.open(io.BytesIO(data)))))


def test_decoded_images_and_arrays_are_taken_as_they_are():
    a = _picture(10, 12, seed=7)
    np.testing.assert_array_equal(qi.load_image(a), a)
    np.testing.assert_array_equal(qi.load_image(Image.fromarray(a)), a)
    rgba = _picture(10, 12, seed=7, channels=4)
    np.testing.assert_array_equal(qi.load_image(Image.fromarray(rgba)),
                                  hf_convert_to_rgb(Image.fromarray(rgba), return_numpy=True))


def test_the_content_hash_keys_the_pixels_not_the_encoding():
    a = _picture(16, 24, seed=8)
    batch = qi.preprocess([a, _encode(a, "PNG"), Image.fromarray(a), _encode(a, "JPEG")])
    assert batch.hashes[0] == batch.hashes[1] == batch.hashes[2] == qi.image_hash(a)
    assert batch.hashes[3] != batch.hashes[0]                  # JPEG is lossy: other pixels
    assert len(batch.hashes[0]) == 64
    b = a.copy()
    b[0, 0, 0] ^= 1
    assert qi.image_hash(b) != qi.image_hash(a)
    assert qi.image_hash(a.reshape(24, 16, 3)) != qi.image_hash(a)   # same bytes, another size


# ---------------------------------------------------------------------------------------- preprocessor_config
def test_from_preprocessor_config_reads_the_published_file_and_the_nested_one(tmp_path):
    assert qi.from_preprocessor_config(_write_config(tmp_path / "a", PUBLISHED)) == qi.ImageProcessorConfig()
    nested = {"image_processor": {**PUBLISHED, "size": {"shortest_edge": 1024, "longest_edge": 8192}},
              "video_processor": {"size": {"shortest_edge": 4096, "longest_edge": 25165824}}}
    folder = _write_config(tmp_path / "b", nested, name="processor_config.json")
    cfg = qi.from_preprocessor_config(folder)
    assert (cfg.min_pixels, cfg.max_pixels) == (1024, 8192)
    assert qi.from_preprocessor_config(folder / "processor_config.json") == cfg
    assert qi.from_preprocessor_config(tmp_path) == qi.ImageProcessorConfig()      # neither file: defaults
    legacy = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14}           # Qwen2-VL's top level
    cfg = qi.from_preprocessor_config(_write_config(tmp_path / "c", legacy))
    assert (cfg.min_pixels, cfg.max_pixels, cfg.patch_size, cfg.factor) == (3136, 12845056, 14, 28)


@pytest.mark.parametrize("d,msg", [({"patch_size": 0}, "patch_size must be a positive integer"),
                                   ({"size": {"shortest_edge": 9000, "longest_edge": 100}}, "min_pixels 9000 >"),
                                   ({"image_std": [0.5, 0, 0.5]}, "std must be 3 finite numbers"),
                                   ({"image_mean": [0.5, 0.5]}, "mean must be 3 finite numbers"),
                                   ({"resample": 9}, "resample must be one of"),
                                   ({"do_resize": False}, "do_resize=False is not supported"),
                                   ({"size": 448}, "size must be an object"),
                                   ([1, 2], "must be a JSON object")])
def test_a_bad_preprocessor_config_is_a_checkpoint_error(tmp_path, d, msg):
    with pytest.raises(CheckpointError, match=msg):
        qi.from_preprocessor_config(_write_config(tmp_path, d))


def test_a_missing_or_malformed_config_file_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="no such preprocessor config file"):
        qi.from_preprocessor_config(tmp_path / "nope.json")
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="preprocessor_config.json"):
        qi.from_preprocessor_config(tmp_path)


# ---------------------------------------------------------------------------------------- refused inputs
def _png_header_only(w, h):
    """A PNG whose IHDR declares w x h (no pixel data): what a decompression bomb looks like to the header."""
    def chunk(tag, body):
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def test_a_huge_declared_size_is_refused_before_decoding():
    pillow_limit = Image.MAX_IMAGE_PIXELS
    bomb = _png_header_only(9000, 9000)                       # 81 Mpx: over ours, under Pillow's own limit
    with pytest.raises(ImageError, match=r"9000x9000 = 81000000 pixels, over the limit of 67108864 \(checked "):
        qi.load_image(bomb)
    with pytest.raises(ImageError, match="over the limit of 1000"):
        qi.load_image(_encode(_picture(40, 40), "PNG"), max_pixels=1000)
    with pytest.raises(ImageError, match="decompression-bomb check"):
        qi.load_image(_png_header_only(100_000, 100_000))      # over Pillow's hard limit: its check says it
    assert Image.MAX_IMAGE_PIXELS == pillow_limit                # Pillow's global is left as it was


def test_corrupt_truncated_and_empty_data_are_refused():
    with pytest.raises(ImageError, match=r"image bytes \(64 bytes\) is not a PNG, JPEG, WebP or GIF image"):
        qi.load_image(bytes(range(64)))
    png = _encode(_picture(64, 64), "PNG")
    with pytest.raises(ImageError, match="corrupt PNG data"):
        qi.load_image(png[: len(png) // 2])
    with pytest.raises(ImageError, match="empty"):
        qi.load_image(b"")
    with pytest.raises(ImageError, match="zero-size header"):
        qi.load_image(_png_header_only(0, 5))
    with pytest.raises(ImageError, match="has no pixels"):
        qi.load_image(np.zeros((0, 4, 3), np.uint8))


def test_an_unsupported_format_is_named():
    bmp = _encode(_picture(8, 8), "BMP")
    with pytest.raises(ImageError, match="is a BMP image; only PNG, JPEG, WebP and GIF are taken") as e:
        qi.load_image(bmp)
    assert e.value.code == "unsupported_value" and isinstance(e.value, InputError)
    with pytest.raises(ImageError, match="is a TIFF image"):
        qi.load_image(_encode(_picture(8, 8), "TIFF"))
    with pytest.raises(ImageError, match="media type 'image/bmp'"):
        qi.load_image("data:image/bmp;base64," + base64.b64encode(bmp).decode())


def test_urls_are_never_fetched():
    for url in ("http://example.com/cat.png", "https://example.com/cat.png", "file:///tmp/cat.png"):
        with pytest.raises(ImageError, match="is a URL; qwenmetal never fetches") as e:
            qi.load_image(url)
        assert e.value.code == "unsupported_value"


def test_bad_data_urls_are_refused():
    with pytest.raises(ImageError, match="is not valid base64"):
        qi.load_image("data:image/png;base64,@@@@")
    with pytest.raises(ImageError, match="is not base64"):
        qi.load_image("data:image/png,rawdata")
    with pytest.raises(ImageError, match="has no ','"):
        qi.load_image("data:image/png;base64")
    big = "data:image/png;base64," + "A" * (4 * 1024)
    with pytest.raises(ImageError, match="over the 1000-byte limit"):
        qi.load_image(big, max_bytes=1000)


def test_an_oversize_file_or_bytes_are_refused_before_reading(tmp_path):
    path = tmp_path / "huge.png"
    with open(path, "wb") as f:                              # sparse: no 20 MiB written
        f.truncate(qi.MAX_ENCODED_BYTES + 1)
    with pytest.raises(ImageError, match=f"is {qi.MAX_ENCODED_BYTES + 1} bytes, over the "
                                         f"{qi.MAX_ENCODED_BYTES}-byte limit"):
        qi.load_image(path)
    with pytest.raises(ImageError, match="2000 bytes of image data, over the 1000-byte limit"):
        qi.load_image(bytes(2000), max_bytes=1000)
    with pytest.raises(ImageError, match="no image file"):
        qi.load_image(tmp_path / "missing.png")
    with pytest.raises(ImageError, match="is not a file"):
        qi.load_image(tmp_path)


def test_videos_are_refused_as_not_supported_yet(tmp_path):
    with pytest.raises(ImageError, match="video input is not supported yet"):
        qi.load_image(tmp_path / "clip.mp4")
    with pytest.raises(ImageError, match="video input is not supported yet"):
        qi.load_image("data:video/mp4;base64,AAAA")
    with pytest.raises(ImageError, match=r"video \(MP4/QuickTime\).*not supported yet"):
        qi.load_image(b"\x00\x00\x00\x18ftypmp42" + bytes(32))
    with pytest.raises(ImageError, match="looks like a video"):
        qi.preprocess(np.zeros((2, 8, 8, 3), np.uint8))
    with pytest.raises(ImageError, match="image 1 is a list"):
        qi.preprocess([np.zeros((8, 8, 3), np.uint8), [np.zeros((8, 8, 3), np.uint8)]])


def test_other_bad_inputs_name_what_was_given():
    with pytest.raises(ImageError, match="a int is not an image"):
        qi.load_image(3)
    with pytest.raises(ImageError, match="must be uint8 RGB"):
        qi.load_image(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(ImageError, match="no images given"):
        qi.preprocess([])
    with pytest.raises(ImageError, match=r"image 1: .*not a PNG") as e:
        qi.preprocess([np.zeros((8, 8, 3), np.uint8), b"junk"])
    assert e.value.param == "images[1]"
    with pytest.raises(ImageError, match="patch_size must be a positive integer"):
        qi.preprocess(np.zeros((8, 8, 3), np.uint8), patch_size=0)


def test_mutated_files_decode_or_raise_an_image_error_and_nothing_else():
    """Byte flips, truncations and insertions in each format (and a JPEG with EXIF tags): Pillow raises many
    exception types on bad data (OSError, SyntaxError, struct.error, ...); every outcome is a uint8 RGB image
    or an ImageError. Run with warnings as errors: a warning Pillow gives (corrupt EXIF) is then an
    ImageError too, never another exception."""
    rng = np.random.default_rng(11)
    a = _picture(24, 32, seed=12)
    exif = Image.Exif()
    exif[0x0112], exif[0x010F] = 6, "camera"
    seeds = [_encode(a, f) for f in ("PNG", "JPEG", "WEBP", "GIF")] + [_encode(a, "JPEG", exif=exif.tobytes())]
    outcomes = {"decoded": 0, "refused": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for data in seeds:
            for _ in range(150):
                d = bytearray(data)
                kind = rng.integers(0, 3)
                if kind == 0:
                    for _ in range(rng.integers(1, 6)):
                        d[rng.integers(0, len(d))] = rng.integers(0, 256)
                elif kind == 1:
                    d = d[: rng.integers(0, len(d))]
                else:
                    p = rng.integers(0, len(d))
                    d[p:p] = rng.integers(0, 256, rng.integers(1, 32)).astype(np.uint8).tobytes()
                try:
                    got = qi.load_image(bytes(d))
                    assert got.dtype == np.uint8 and got.ndim == 3 and got.shape[2] == 3
                    outcomes["decoded"] += 1
                except ImageError:
                    outcomes["refused"] += 1
    assert outcomes["decoded"] > 50 and outcomes["refused"] > 50, outcomes


def test_base64_without_its_prefix_gets_a_hint_and_a_bare_image_media_type_is_taken():
    data = _encode(_picture(8, 8, seed=13), "PNG")
    b64 = base64.b64encode(data).decode()
    with pytest.raises(ImageError, match="base64 data needs the data:image/<type>;base64, prefix"):
        qi.load_image(b64)
    with pytest.raises(ImageError, match=r"base64 data needs .* prefix") as e:
        qi.load_image(b64 * 100)                          # too long a name for the file system
    assert len(str(e.value)) < 400                        # the message quotes the start, not the whole string
    np.testing.assert_array_equal(qi.load_image("data:image;base64," + b64), qi.load_image(data))

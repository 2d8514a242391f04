"""MLX affine quantization in numpy, bit-exact with ``mx.quantize`` / ``mx.dequantize`` on the CPU.

Format (docs/model.md §3): a weight ``W[..., out, in]`` is cut along its last axis into groups of
``group_size`` consecutive elements. Each group has one ``scale`` and one ``bias``; element k holds an
unsigned ``q`` in ``[0, 2**bits - 1]`` and means ``scale * q + bias``. The q values of a row are one
LSB-first bit stream, ``bits`` bits each, stored as little-endian uint32 words (``in * bits / 32`` per row).
At bits 2, 4 and 8 that is ``32 // bits`` whole values per word; at bits 3, 5 and 6 MLX packs 8, 8 and 4
values into 3, 5 and 3 bytes, which is the same stream, so a value may straddle two words.

The quantizer follows MLX's CPU kernel (``mlx/backend/cpu/quantized.cpp``, ``quantize<T, U>``), all in
float32:

* ``mn, mx`` = group min and max (the input converted to float32);
* ``scale = max((mx - mn) / (2**bits - 1), 1e-7)``, negated unless ``|mn| > |mx|`` -- the scale is
  *negative* whenever the largest-magnitude element is positive;
* ``edge`` = ``mn`` if ``|mn| > |mx|`` else ``mx``; ``q0 = rint(edge / scale)``;
  if ``q0 != 0``: ``scale = edge / q0`` and ``bias = edge`` (so the edge element is exact); else ``bias = 0``;
* ``q = clip(rint((w - bias) / scale), 0, 2**bits - 1)`` with the *unrounded* float32 scale and bias
  (``rint`` = round half to even);
* only then are scale and bias rounded (to nearest even) to the output dtype, which in MLX is the
  input's dtype (bf16 in real checkpoints).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["quantize", "dequantize", "pack", "unpack", "infer_bits_and_group_size",
           "SUPPORTED_BITS", "SUPPORTED_GROUP_SIZES"]

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)   # MLX's affine widths (all one LSB-first bit stream per row)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
_EPS = np.float32(1e-7)
_CHUNK_ELEMENTS = 1 << 22           # quantize() works on ~4M weights (16 MB of float32) at a time


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or int(bits) != bits or int(bits) not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    return int(bits)


def _check_group_size(group_size: int) -> int:
    if isinstance(group_size, bool) or int(group_size) != group_size or int(group_size) not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size!r}")
    return int(group_size)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned values ``q[..., n]`` (each < 2**bits) into uint32 words ``[..., n * bits // 32]``.

    Element k occupies bits ``[bits * k, bits * (k + 1))`` of the row's little-endian bit stream (LSB
    first); at bits 2/4/8 that is word ``k // (32 // bits)`` at offset ``bits * (k % (32 // bits))``.
    """
    bits = _check_bits(bits)
    q = np.asarray(q)
    if q.ndim == 0 or (q.shape[-1] * bits) % 32:
        raise ValueError(f"last dim {q.shape[-1] if q.ndim else None} times {bits} bits is not a whole number "
                         "of uint32 words")
    if q.size and (q.min() < 0 or q.max() >= (1 << bits)):
        raise ValueError(f"values must lie in [0, {(1 << bits) - 1}] for bits={bits}")
    n = q.shape[-1]
    if 32 % bits == 0:
        per = 32 // bits
        q32 = q.astype(np.uint32).reshape(*q.shape[:-1], n // per, per)
        shifts = np.arange(0, 32, bits, dtype=np.uint32)
        return np.bitwise_or.reduce(q32 << shifts, axis=-1).astype(np.uint32)
    # 3/5/6 bits: the stream's bits, 8 per byte, LSB first
    stream = ((q.astype(np.uint8)[..., None] >> np.arange(bits, dtype=np.uint8)) & 1).reshape(*q.shape[:-1], n * bits)
    return np.packbits(stream, axis=-1, bitorder="little").view("<u4").astype(np.uint32)


def unpack(wq: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`pack`: uint32 ``[..., p]`` -> uint8 q values ``[..., p * 32 // bits]``."""
    bits = _check_bits(bits)
    wq = np.asarray(wq)
    if wq.dtype != np.uint32:
        raise ValueError(f"packed weights must be uint32, got {wq.dtype}")
    if wq.ndim == 0:
        raise ValueError("packed weights must have at least one dimension")
    if 32 % bits == 0:
        shifts = np.arange(0, 32, bits, dtype=np.uint32)
        q = (wq[..., None] >> shifts) & np.uint32((1 << bits) - 1)
        return q.reshape(*wq.shape[:-1], wq.shape[-1] * (32 // bits)).astype(np.uint8)
    n = wq.shape[-1] * 32 // bits
    stream = np.unpackbits(np.ascontiguousarray(wq, "<u4").view(np.uint8), axis=-1, bitorder="little")
    stream = stream.reshape(*wq.shape[:-1], n, bits)
    return (stream << np.arange(bits, dtype=np.uint8)).sum(axis=-1, dtype=np.uint8)


def quantize(w: np.ndarray, bits: int, group_size: int, scale_dtype=ml_dtypes.bfloat16):
    """Affine-quantize ``w[..., out, in]`` exactly like ``mx.quantize(w, group_size, bits)`` on the CPU.

    Returns ``(wq, scales, biases)``: ``wq`` uint32 ``[..., out, in * bits // 32]``, ``scales`` and
    ``biases`` ``[..., out, in // group_size]`` of ``scale_dtype``. MLX stores them in the input's dtype;
    pass ``scale_dtype=None`` for that (the result then equals ``mx.quantize`` byte for byte for float32,
    bfloat16 and float16 inputs). The default, bfloat16, is what real checkpoints hold: for a bf16 input
    it is again MLX's result; for a float32 input it is MLX's float32 result with scales and biases
    rounded to bf16 (q computed with the unrounded float32 values, as in MLX).

    Inputs: float32, bfloat16 or float16, at least 2-D (leading dims, e.g. stacked experts, are kept),
    finite, last dim a multiple of ``group_size``.
    """
    bits = _check_bits(bits)
    group_size = _check_group_size(group_size)
    w = np.asarray(w)
    if w.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"quantize needs a float32/bfloat16/float16 array, got {w.dtype}")
    if w.ndim < 2:
        raise ValueError(f"the matrix to quantize must have at least 2 dimensions, got shape {w.shape}")
    n_in = w.shape[-1]
    if n_in % group_size:
        raise ValueError(f"last dim {n_in} is not divisible by group_size {group_size}")
    out_dtype = w.dtype if scale_dtype is None else np.dtype(scale_dtype)
    if out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"scale_dtype must be float32/bfloat16/float16, got {out_dtype}")

    lead, n_groups = w.shape[:-1], n_in // group_size
    rows = w.reshape(-1, n_in)
    wq = np.empty((rows.shape[0], n_in * bits // 32), np.uint32)
    scales = np.empty((rows.shape[0], n_groups), out_dtype)
    biases = np.empty_like(scales)
    step = max(1, _CHUNK_ELEMENTS // n_in)         # rows at a time: bounded temporaries for any size
    for r0 in range(0, rows.shape[0], step):
        r1 = min(rows.shape[0], r0 + step)
        wq[r0:r1], scales[r0:r1], biases[r0:r1] = _quantize_rows(rows[r0:r1], bits, group_size, out_dtype)
    return wq.reshape(*lead, -1), scales.reshape(*lead, n_groups), biases.reshape(*lead, n_groups)


def _quantize_rows(w: np.ndarray, bits: int, group_size: int, out_dtype) -> tuple:
    """:func:`quantize` of the rows ``w[r, in]`` (groups never cross rows, so chunks of rows are exact)."""
    n_in = w.shape[-1]
    wf = w.astype(np.float32).reshape(-1, n_in // group_size, group_size)
    if not np.isfinite(wf).all():
        raise ValueError("quantize needs finite values")
    n_bins = np.float32((1 << bits) - 1)
    w_max = wf.max(axis=-1)
    w_min = wf.min(axis=-1)
    mask = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, _EPS)
    scale = np.where(mask, scale, -scale)
    edge = np.where(mask, w_min, w_max)
    q0 = np.rint(edge / scale)
    nz = q0 != 0
    scale = np.where(nz, edge / np.where(nz, q0, np.float32(1)), scale).astype(np.float32)
    bias = np.where(nz, edge, np.float32(0)).astype(np.float32)

    q = np.rint((wf - bias[..., None]) / scale[..., None])
    q = np.clip(q, np.float32(0), n_bins).astype(np.uint32)
    return pack(q.reshape(-1, n_in), bits), scale.astype(out_dtype), bias.astype(out_dtype)


def dequantize(wq: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int,
               dtype=np.float32) -> np.ndarray:
    """``float32(scale) * q + float32(bias)`` per group, evaluated in float32 (docs/model.md §3.2).

    With ``dtype=np.float32`` (the default) this is the exact float32 value of every weight; it equals
    ``mx.dequantize`` applied to float32 scales and biases. With another ``dtype`` (e.g. bfloat16) it
    reproduces ``mx.dequantize`` on the CPU for scales of that dtype: the product and the sum are each
    rounded to ``dtype``.
    """
    bits = _check_bits(bits)
    group_size = _check_group_size(group_size)
    q = unpack(wq, bits)
    scales = np.asarray(scales)
    biases = np.asarray(biases)
    n_in = q.shape[-1]
    if scales.shape != biases.shape or scales.shape[:-1] != q.shape[:-1] or n_in != scales.shape[-1] * group_size:
        raise ValueError(
            f"shapes do not match: weight {tuple(np.shape(wq))} ({bits}-bit -> {n_in} columns), "
            f"scales {scales.shape}, biases {biases.shape}, group_size {group_size}")
    qg = q.reshape(*q.shape[:-1], n_in // group_size, group_size).astype(np.float32)
    s = scales.astype(np.float32)[..., None]
    b = biases.astype(np.float32)[..., None]
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        out = qg * s + b
    else:
        out = ((qg * s).astype(dtype).astype(np.float32) + b).astype(dtype)
    return out.reshape(q.shape)


def infer_bits_and_group_size(packed_cols: int, scale_cols: int, in_features: int) -> tuple[int, int]:
    """(bits, group_size) of a quantized tensor from its shapes (docs/model.md §3.4).

    ``packed_cols``: uint32 columns of ``.weight``; ``scale_cols``: columns of ``.scales``;
    ``in_features``: the logical input dim. ``group_size = in / scale_cols``, ``bits = 32 * packed / in``.
    Raises ValueError when these are not integers or not a supported (bits, group_size).
    """
    for name, v in (("packed_cols", packed_cols), ("scale_cols", scale_cols), ("in_features", in_features)):
        if isinstance(v, bool) or int(v) != v or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    packed_cols, scale_cols, in_features = int(packed_cols), int(scale_cols), int(in_features)
    if in_features % scale_cols:
        raise ValueError(f"in_features {in_features} is not a multiple of the {scale_cols} scale columns")
    group_size = in_features // scale_cols
    if (32 * packed_cols) % in_features:
        raise ValueError(f"{packed_cols} packed uint32 columns do not hold {in_features} values "
                         "at a whole number of bits")
    bits = 32 * packed_cols // in_features
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"inferred bits {bits} (from {packed_cols} packed columns, in_features "
                         f"{in_features}) is not one of {SUPPORTED_BITS}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"inferred group_size {group_size} (in_features {in_features} / {scale_cols} "
                         f"scale columns) is not one of {SUPPORTED_GROUP_SIZES}")
    return bits, group_size

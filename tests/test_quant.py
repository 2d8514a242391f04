"""qwenmetal.quant against MLX itself: quantize == mx.quantize and dequantize == mx.dequantize, byte for byte."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from oracles import require  # fails in CI, skips elsewhere
from qwenmetal.quant import SUPPORTED_BITS, dequantize, infer_bits_and_group_size, pack, quantize, unpack

BF16 = np.dtype(ml_dtypes.bfloat16)


def _to_mx(mx, a):
    if a.dtype == BF16:
        return mx.array(a.astype(np.float32)).astype(mx.bfloat16)
    return mx.array(a)


def _from_mx(mx, a):
    """MLX array -> numpy with the same dtype (bf16 via float32, which is exact)."""
    if a.dtype == mx.bfloat16:
        return np.array(a.astype(mx.float32)).astype(BF16)
    return np.array(a)


def _mlx_quantize(w, bits, gs):
    mx = require("mlx.core")
    with mx.stream(mx.cpu):
        wq, s, b = mx.quantize(_to_mx(mx, w), group_size=gs, bits=bits)
        return _from_mx(mx, wq), _from_mx(mx, s), _from_mx(mx, b)


def _mlx_dequantize(wq, s, b, bits, gs):
    mx = require("mlx.core")
    with mx.stream(mx.cpu):
        return _from_mx(mx, mx.dequantize(mx.array(wq), _to_mx(mx, s), _to_mx(mx, b), group_size=gs, bits=bits))


def _assert_same_bytes(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert a.tobytes() == b.tobytes(), f"{what}: {int((a.view(np.uint8) != b.view(np.uint8)).sum())} bytes differ"


GROUP_KINDS = ("random", "constant", "zero", "positive", "negative", "one_outlier")


@st.composite
def weight_cases(draw):
    bits = draw(st.sampled_from(SUPPORTED_BITS))
    gs = draw(st.sampled_from([32, 64, 128]))
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))       # e.g. stacked experts
    out = draw(st.integers(1, 5))
    n_groups = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from([np.dtype(np.float32), BF16]))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    scale = draw(st.sampled_from([1e-6, 1e-3, 0.02, 1.0, 37.0, 1e4]))
    rng = np.random.default_rng(seed)
    shape = (*lead, out, n_groups * gs)
    w = rng.normal(size=shape).astype(np.float32) * np.float32(scale)
    g = w.reshape(-1, gs)                       # every group, to give some a special pattern
    for i in range(g.shape[0]):
        kind = GROUP_KINDS[rng.integers(len(GROUP_KINDS))]
        if kind == "constant":
            g[i] = np.float32(rng.normal() * scale)
        elif kind == "zero":
            g[i] = 0.0
        elif kind == "positive":
            g[i] = np.abs(g[i])
        elif kind == "negative":
            g[i] = -np.abs(g[i])
        elif kind == "one_outlier":
            g[i, rng.integers(gs)] *= 50
    return bits, gs, w.reshape(shape).astype(dtype)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(weight_cases())
def test_quantize_and_dequantize_match_mlx(case):
    bits, gs, w = case
    ref = _mlx_quantize(w, bits, gs)
    ours = quantize(w, bits, gs, scale_dtype=None)          # MLX keeps the input dtype
    for name, a, b in zip(("wq", "scales", "biases"), ours, ref):
        _assert_same_bytes(a, b, name)
    assert ours[0].shape == (*w.shape[:-1], w.shape[-1] * bits // 32)
    assert ours[1].shape == (*w.shape[:-1], w.shape[-1] // gs)
    # default scale dtype is bf16: for bf16 input it is exactly MLX's output
    if w.dtype == BF16:
        for a, b in zip(quantize(w, bits, gs), ref):
            _assert_same_bytes(a, b, "default scale dtype")
    # float32 dequantization == mx.dequantize on float32 scales/biases
    s32, b32 = ref[1].astype(np.float32), ref[2].astype(np.float32)
    _assert_same_bytes(dequantize(ref[0], s32, b32, bits, gs), _mlx_dequantize(ref[0], s32, b32, bits, gs),
                       "dequantize f32")
    # MLX's own-dtype dequantization (bf16 rounding after the multiply and after the add)
    _assert_same_bytes(dequantize(*ref, bits, gs, dtype=w.dtype), _mlx_dequantize(*ref, bits, gs),
                       "dequantize in input dtype")


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SUPPORTED_BITS), st.sampled_from([32, 64]),
       hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.just(64)),
                  elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=False)))
def test_quantize_matches_mlx_on_adversarial_values(bits, gs, w):
    """Hypothesis-chosen values: repeated values, exact ties at .5 after division, +-0."""
    for a, b, name in zip(quantize(w, bits, gs, scale_dtype=None), _mlx_quantize(w, bits, gs), ("wq", "s", "b")):
        _assert_same_bytes(a, b, name)


def test_scale_is_negative_when_max_dominates_and_edge_is_exact():
    w = np.linspace(-0.5, 1.0, 64, dtype=np.float32)[None]
    wq, s, b = quantize(w, 4, 64, scale_dtype=np.float32)
    assert s[0, 0] < 0 and b[0, 0] == np.float32(1.0)     # bias is the edge (the max here)
    d = dequantize(wq, s, b, 4, 64)
    assert d[0, -1] == np.float32(1.0)
    assert np.abs(d - w).max() <= abs(s[0, 0]) / 2 * 1.0001
    w2 = -w
    _, s2, b2 = quantize(w2, 4, 64, scale_dtype=np.float32)
    assert s2[0, 0] > 0 and b2[0, 0] == np.float32(-1.0)
    # constant and all-zero groups
    _, s3, b3 = quantize(np.zeros((1, 32), np.float32), 8, 32, scale_dtype=np.float32)
    assert b3[0, 0] == 0 and s3[0, 0] == np.float32(-1e-7)
    wq4, s4, b4 = quantize(np.full((1, 32), 0.25, np.float32), 8, 32, scale_dtype=np.float32)
    assert b4[0, 0] == np.float32(0.25) and not unpack(wq4, 8).any()


def test_default_scale_dtype_is_bf16_and_float32_input_rounds_only_scales():
    rng = np.random.default_rng(3)
    w = rng.normal(size=(4, 128)).astype(np.float32)
    wq, s, b = quantize(w, 4, 64)
    assert s.dtype == BF16 and b.dtype == BF16 and wq.dtype == np.uint32
    wq32, s32, b32 = quantize(w, 4, 64, scale_dtype=np.float32)
    np.testing.assert_array_equal(wq, wq32)
    np.testing.assert_array_equal(s, s32.astype(BF16))
    np.testing.assert_array_equal(b, b32.astype(BF16))


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_quantize_in_row_chunks_is_exact(monkeypatch, bits):
    """quantize works on bounded chunks of rows (a real-width expert tensor never needs a whole float32
    copy); chunk boundaries anywhere, also inside a stacked expert, give the same bytes."""
    from qwenmetal import quant
    w = (np.random.default_rng(3).standard_normal((3, 7, 256)) * 0.05).astype(ml_dtypes.bfloat16)
    whole = quantize(w, bits, 64)
    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 5 * 256)            # 5 rows at a time: chunks straddle experts
    chunked = quantize(w, bits, 64)
    for a, b in zip(whole, chunked):
        assert a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    w[1, 4, 3] = np.inf
    with pytest.raises(ValueError, match="finite"):
        quantize(w, bits, 64)


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(SUPPORTED_BITS), st.integers(0, 2 ** 32 - 1), st.integers(1, 4), st.integers(1, 3))
def test_pack_unpack_round_trip(bits, seed, rows, blocks):
    rng = np.random.default_rng(seed)
    words = blocks * bits                   # 32 values: a whole number of words at every width
    q = rng.integers(0, 1 << bits, size=(rows, blocks * 32), dtype=np.uint8)
    p = pack(q, bits)
    assert p.dtype == np.uint32 and p.shape == (rows, words)
    np.testing.assert_array_equal(unpack(p, bits), q)
    words_arr = rng.integers(0, 2 ** 32, size=(rows, words), dtype=np.uint64).astype(np.uint32)
    np.testing.assert_array_equal(pack(unpack(words_arr, bits), bits), words_arr)


def test_packing_is_lsb_first_little_endian():
    q = np.arange(8, dtype=np.uint8)[None]
    p = pack(q, 4)
    assert p[0, 0] == 0x76543210
    assert p.tobytes() == bytes([0x10, 0x32, 0x54, 0x76])     # element 0 in the low nibble of byte 0
    assert pack(np.array([[1, 2, 3, 4]], np.uint8), 8).tobytes() == bytes([1, 2, 3, 4])
    # 3 bits: one stream, so value 10 (bits 30..32) straddles words 0 and 1
    q3 = np.zeros((1, 32), np.uint8)
    q3[0, 10] = 0b111
    assert pack(q3, 3)[0].tolist() == [0xC0000000, 0x1, 0x0]
    q6 = np.arange(16, dtype=np.uint8)[None] * 4 + 3          # 6 bits: 4 values in 3 bytes
    b6 = pack(q6, 6).tobytes()
    assert int.from_bytes(b6[:3], "little") == sum(int(v) << (6 * i) for i, v in enumerate(q6[0, :4]))


def test_infer_bits_and_group_size():
    assert infer_bits_and_group_size(256, 32, 2048) == (4, 64)
    assert infer_bits_and_group_size(512, 32, 2048) == (8, 64)
    assert infer_bits_and_group_size(64, 8, 512) == (4, 64)
    assert infer_bits_and_group_size(16, 1, 128) == (4, 128)
    assert infer_bits_and_group_size(8, 4, 128) == (2, 32)
    assert infer_bits_and_group_size(12, 2, 128) == (3, 64)
    assert infer_bits_and_group_size(320, 32, 2048) == (5, 64)
    assert infer_bits_and_group_size(384, 16, 2048) == (6, 128)
    for args, msg in [((256, 33, 2048), "multiple"), ((100, 32, 2048), "whole number"),
                      ((448, 32, 2048), "bits"), ((256, 8, 2048), "group_size"), ((0, 32, 2048), "positive"),
                      ((256, 32, 2048.5), "integer")]:
        with pytest.raises(ValueError, match=msg):
            infer_bits_and_group_size(*args)


def test_errors():
    w = np.zeros((2, 64), np.float32)
    for kwargs, msg in [(dict(bits=7), "bits"), (dict(bits=4, group_size=48), "group_size"),
                        (dict(bits=4, group_size=128), "divisible")]:
        with pytest.raises(ValueError, match=msg):
            quantize(w, kwargs.get("bits", 4), kwargs.get("group_size", 64))
    with pytest.raises(ValueError, match="2 dimensions"):
        quantize(np.zeros(64, np.float32), 4, 64)
    with pytest.raises(ValueError, match="float"):
        quantize(np.zeros((2, 64), np.int32), 4, 64)
    with pytest.raises(ValueError, match="finite"):
        quantize(np.full((2, 64), np.inf, np.float32), 4, 64)
    wq, s, b = quantize(w, 4, 64)
    with pytest.raises(ValueError, match="shapes"):
        dequantize(wq, s, b, 8, 64)
    with pytest.raises(ValueError, match="uint32"):
        unpack(wq.astype(np.int64), 4)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack(np.full((1, 8), 16), 4)

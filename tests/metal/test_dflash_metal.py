"""The DFlash draft's forward on the Metal graph (`_GpuBackend.dflash_draft`, src/gpu/dflash.*) against the numpy
reference `DFlashReference` (the ground truth) over several rounds with a growing cache: float32 activations
tight, bfloat16 loose, for the bf16 draft and MLX 4-bit and 8-bit copies; a sliding-window layer, output multiplier and
soft cap; context rows past one pass; ``commit=False`` and argument errors leave the cache; one command buffer
(and one host wait) per draft call; the cost of a call at the published draft's real width (encode-only).
Simulator-verified, hardware-unverified."""
from __future__ import annotations

import re

import numpy as np
import pytest
import qwenmetal as qm
from dflash_oracles import (
    TINY,
    TINY2,
    bad_draft_inputs,
    draft_config,
    random_round,
    random_tensors,
    write_draft,
    write_mlx_quantized,
)
from qwenmetal.backends.metal import GpuDFlash
from qwenmetal.bench.cli import resolve_config
from qwenmetal.bench.cost import PUBLISHED_DRAFT, encode_only_dflash_cost
from qwenmetal.config import ModelConfig
from qwenmetal.dflash import DFlashReference, load_dflash_draft
from qwenmetal.testing import cached_checkpoint

from .gpu_harness import BACKEND, SIM

LAYERS = (1, 2)
MASK = 511
# (context rows, block length) per round: a prompt, accepted runs, a round with no new context, short blocks
ROUNDS = ((6, 8), (3, 8), (0, 5), (1, 2), (4, 8), (2, 1))
# the error of a draft's logits against the reference, relative to their range
TOL = {"float32": 1e-5, "bfloat16": 3e-2}


def _load(dtype="float32", **kw):
    return qm.Model.load(cached_checkpoint("tiny", "mlx-q4", 0), backend=BACKEND, dtype=dtype, **kw)


@pytest.fixture(scope="module")
def models():
    return {dt: _load(dt) for dt in ("float32", "bfloat16")}


def _config(**over):
    base = dict(vocab_size=512, num_target_layers=4, block_size=8,
                dflash_config={"mask_token_id": MASK, "target_layer_ids": list(LAYERS)})
    base.update(over)
    return draft_config(TINY, **base)


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash_metal")
    cfg = _config()
    bf16 = write_draft(root / "bf16", cfg, random_tensors(cfg, seed=5))
    return {"bf16": bf16, "mlx-q4": write_mlx_quantized(bf16, root / "q4", bits=4, group_size=64),
            "mlx-q8": write_mlx_quantized(bf16, root / "q8", bits=8, group_size=32)}


def _check(native, nc, ref, rc, f, block, tol=TOL["float32"], commit=True):
    want = ref.logits(ref.forward(rc, f, block, commit=commit)[1:])
    got = native.forward(nc, f, block, commit=commit)
    assert got.shape == want.shape and got.dtype == np.float32
    if want.size:
        err = float(np.abs(got - want).max()) / float(want.max() - want.min())
        assert err < tol, err
    assert nc.position == rc.position
    return got


@pytest.mark.parametrize("dtype,fmt", [("float32", "bf16"), ("float32", "mlx-q4"), ("float32", "mlx-q8"),
                                       ("bfloat16", "bf16"), ("bfloat16", "mlx-q4")])
def test_native_logits_match_the_reference_round_after_round(models, draft_dirs, dtype, fmt):
    model = models[dtype]
    draft = load_dflash_draft(draft_dirs[fmt], model.config)
    assert draft.quantized == fmt.startswith("mlx")
    native, ref = model.dflash_draft(draft), DFlashReference.over_weights(draft, model.weights)
    assert isinstance(native, GpuDFlash)
    nc, rc = native.new_cache(), ref.new_cache()
    rng = np.random.default_rng(3)
    for n, L in ROUNDS:
        _check(native, nc, ref, rc, *random_round(rng, draft.config, n, L), tol=TOL[dtype])
    assert nc.position == sum(n for n, _ in ROUNDS)
    # a copy of the cache carries on as the original does
    f, block = random_round(rng, draft.config, 2, 8)
    twin = nc.copy()
    np.testing.assert_array_equal(native.forward(twin, f, block), native.forward(nc, f, block))


def test_one_command_buffer_per_draft_call(models, draft_dirs):
    """fc, every layer, the final norm and the lm_head of a round: one command buffer, one host wait (the
    simulator's counters); context rows past one pass (the target's prefill_chunk) run as passes of their own
    first, each waited on, with the same logits."""
    model = models["float32"]
    draft = load_dflash_draft(draft_dirs["bf16"], model.config)
    native, ref = model.dflash_draft(draft), DFlashReference.over_weights(draft, model.weights)
    dev = model._backend.device
    nc, rc = native.new_cache(), ref.new_cache()
    rng = np.random.default_rng(7)
    for n, L in ((5, 8), (2, 8), (0, 3)):
        dev.reset_counters()
        _check(native, nc, ref, rc, *random_round(rng, draft.config, n, L))
        k = dev.counters()
        assert k["command_buffers"] == 1 and k["host_waits"] == 1, k
    small = _load(prefill_chunk=4)
    native, ref = small.dflash_draft(draft), DFlashReference.over_weights(draft, small.weights)
    assert native.impl.context_rows == 4
    nc, rc = native.new_cache(), ref.new_cache()
    d = small._backend.device
    for n, L in ((11, 8), (4, 8), (5, 2)):
        d.reset_counters()
        _check(native, nc, ref, rc, *random_round(rng, draft.config, n, L))
        assert d.counters()["command_buffers"] == -(-n // 4), n


def test_sliding_window_layer_and_scalings(models, tmp_path):
    """A sliding-attention layer (causal within its window, smaller than the context), output_multiplier and a
    logit soft cap against the reference. A draft with an input_embedding_scale or attention biases is left to
    the reference (dflash_draft gives None; the native constructor refuses it)."""
    model = models["float32"]
    cfg = _config(layer_types=["sliding_attention", "full_attention"], sliding_window=5,
                  dflash_config={"mask_token_id": MASK, "target_layer_ids": list(LAYERS),
                                 "output_multiplier": 1.5, "final_logit_softcapping": 3.0})
    draft = load_dflash_draft(write_draft(tmp_path / "d", cfg, random_tensors(cfg, seed=7)), model.config)
    native, ref = model.dflash_draft(draft), DFlashReference.over_weights(draft, model.weights)
    nc, rc = native.new_cache(), ref.new_cache()
    rng = np.random.default_rng(4)
    for n, L in ROUNDS:
        _check(native, nc, ref, rc, *random_round(rng, draft.config, n, L))
    scaled = _config(dflash_config={"mask_token_id": MASK, "target_layer_ids": list(LAYERS),
                                    "input_embedding_scale": 0.5})
    d = load_dflash_draft(write_draft(tmp_path / "s", scaled, random_tensors(scaled, seed=7)), model.config)
    assert model.dflash_draft(d) is None
    with pytest.raises(ValueError, match="input_embedding_scale of 1, not this dflash draft"):
        GpuDFlash(model._backend, d)


def test_commit_false_and_errors_leave_the_cache(models, draft_dirs, tmp_path):
    model = models["float32"]
    draft = load_dflash_draft(draft_dirs["bf16"], model.config)
    native, ref = model.dflash_draft(draft), DFlashReference.over_weights(draft, model.weights)
    nc, rc = native.new_cache(), ref.new_cache()
    rng = np.random.default_rng(5)
    _check(native, nc, ref, rc, *random_round(rng, draft.config, 4, 8))
    f, block = random_round(rng, draft.config, 3, 8)
    first = _check(native, nc, ref, rc, f, block, commit=False)
    assert nc.position == 4
    np.testing.assert_array_equal(native.forward(nc, f, block, commit=False), first)
    for features, ids, msg in bad_draft_inputs(rng, draft.config):
        with pytest.raises(ValueError, match=re.escape(msg)):
            native.forward(nc, features, ids)
        assert nc.position == 4
    other_cfg = _config(num_hidden_layers=3)
    other = model.dflash_draft(load_dflash_draft(write_draft(tmp_path / "wide", other_cfg, random_tensors(other_cfg)),
                                                 model.config))
    with pytest.raises(ValueError, match="this cache was made for another draft"):
        other.forward(nc, *random_round(rng, draft.config, 2, 8))
    with pytest.raises(ValueError, match="this cache was made for another draft"):   # another target's device
        models["bfloat16"].dflash_draft(draft).forward(nc, *random_round(rng, draft.config, 2, 8))
    cfg2 = draft_config(TINY2, vocab_size=512, num_target_layers=4,
                        dflash_config=dict(TINY2["dflash_config"], mask_token_id=MASK, target_layer_ids=list(LAYERS)))
    d2 = load_dflash_draft(write_draft(tmp_path / "d2", cfg2, random_tensors(cfg2)), model.config)
    assert model.dflash_draft(d2) is None          # DFlash2: the drafter falls back to the numpy reference
    with pytest.raises(ValueError, match="not this dflash2 draft"):
        GpuDFlash(model._backend, d2)
    # nothing above touched the cache: the next rounds still follow the reference
    for n, L in ((3, 8), (2, 4)):
        _check(native, nc, ref, rc, *random_round(rng, draft.config, n, L))


@pytest.mark.skipif(not SIM, reason="encode-only costing runs on the simulator device")
def test_real_width_draft_call_is_one_command_buffer():
    """The published draft (8 layers of 2048, bf16 and MLX 4-bit) over the real config at 4096 cached context rows,
    encode-only: one command buffer per call, its dependency levels per layer, the bytes of the draft's weights and
    the target's lm_head read once, modelled far under the watchdog budget."""
    cfg = ModelConfig.from_dict(resolve_config("real", 4))
    r = encode_only_dflash_cost(cfg, rows=(1, 16))
    L = PUBLISHED_DRAFT["num_hidden_layers"]
    for n, widths in r["rows"].items():
        for w, chips in widths.items():
            for chip, c in chips.items():
                assert c["command_buffers"] == 1
                # per layer: q (the input norm fused), [k | v], prepare, attention, o_proj, norm, gate/up, down;
                # plus fc, its norm (the block's embed beside them) and the lm_head (the final norm fused)
                assert L * 8 <= c["levels"] <= L * 8 + 3
                assert 0 < c["seconds"] < 0.05
    bf16, q4 = r["rows"][16]["bf16"]["M1 Max"], r["rows"][16]["q4"]["M1 Max"]
    assert q4["bytes"] < 0.6 * bf16["bytes"]


def test_published_attention_geometry_executed(models, tmp_path):
    """The published draft's attention at the tiny target's width, executed: 32 query / 4 KV heads of 128 (GQA 8),
    blocks of 16, a context of a few dozen rows, against the reference (float32)."""
    model = models["float32"]
    cfg = _config(num_attention_heads=PUBLISHED_DRAFT["num_attention_heads"],
                  num_key_value_heads=PUBLISHED_DRAFT["num_key_value_heads"], head_dim=PUBLISHED_DRAFT["head_dim"],
                  num_hidden_layers=1, block_size=16)
    draft = load_dflash_draft(write_draft(tmp_path / "g", cfg, random_tensors(cfg, seed=9)), model.config)
    native, ref = model.dflash_draft(draft), DFlashReference.over_weights(draft, model.weights)
    nc, rc = native.new_cache(), ref.new_cache()
    rng = np.random.default_rng(11)
    for n, L in ((37, 16), (16, 16), (5, 16)):
        _check(native, nc, ref, rc, *random_round(rng, draft.config, n, L))


def test_streaming_target(draft_dirs):
    """A target whose experts are streamed (its embedding and lm_head each wrapped on their own): the same draft."""
    model = _load(expert_slots=2)
    assert model._backend.plan.stream
    draft = load_dflash_draft(draft_dirs["mlx-q4"], model.config)
    native, ref = model.dflash_draft(draft), DFlashReference.over_weights(draft, model.weights)
    nc, rc = native.new_cache(), ref.new_cache()
    rng = np.random.default_rng(12)
    for n, L in ((6, 8), (2, 4)):
        _check(native, nc, ref, rc, *random_round(rng, draft.config, n, L))

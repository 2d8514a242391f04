"""Every format mix ``mlx_lm.convert`` writes and mlx-lm runs also runs on the Metal graph (metal-sim, the float
build), against mlx-lm itself (an oracle: with CI=true a missing mlx-lm fails these tests).

mlx_lm.convert's quant_predicate decides per module whether and how a linear is quantized, so one checkpoint
can hold dense routed experts beside a quantized shared expert (or the reverse), other widths or group sizes
per tensor, and bf16 / f16 / f32 scales. The decode MoE kernels read the routed experts and the shared expert
in one dispatch when their formats pair; otherwise the shared expert runs apart (mlp_gate_up into its slot,
qmv for its down projection, combined by moe_down as its own) — docs/metal.md, "The MoE block".
Simulator-verified, hardware-unverified.
"""
from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal.testing import cached_checkpoint

from oracles import mlx_load_f32, mlx_logits, prompt, qm_logits

from .gpu_harness import BACKEND

# name -> mlx_lm.convert options (q_bits 4, q_group_size 64 unless the predicate says otherwise)
MIXES = {
    "dense routed, q4 shared": dict(quant_predicate=lambda path, m: "switch_mlp" not in path),
    "q4 routed, dense shared": dict(quant_predicate=lambda path, m: "shared_expert." not in path),
    "q8 routed, q4 shared": dict(quant_predicate=lambda path, m: {"bits": 8, "group_size": 64} if "switch_mlp" in path
                                 else True),
    "g32 routed, g64 shared": dict(quant_predicate=lambda path, m: {"bits": 4, "group_size": 32}
                                   if "switch_mlp" in path else True),
    "q8 shared, f16 scales": dict(quant_predicate=lambda path, m: {"bits": 8, "group_size": 64}
                                  if "shared_expert." in path else True, dtype="float16"),
    "f32 scales": dict(dtype="float32"),
    "f16, dense routed": dict(quant_predicate=lambda path, m: "switch_mlp" not in path, dtype="float16"),
}
ATOL = 1e-4       # of the logit range, the float build against mlx-lm float32


@pytest.fixture(scope="module")
def converted(tmp_path_factory, require):
    mlx_lm = require("mlx_lm")
    src = cached_checkpoint("tiny", "hf-bf16")
    root = tmp_path_factory.mktemp("mixes")
    cache = {}

    def get(name):
        if name not in cache:
            out = root / name.replace(" ", "_").replace(",", "")
            with contextlib.redirect_stdout(io.StringIO()):
                mlx_lm.convert(str(src), str(out), quantize=True, q_bits=4, q_group_size=64, **MIXES[name])
            ids = prompt(12, 400, seed=7)
            cache[name] = (out, ids, mlx_logits(mlx_load_f32(out), ids, 3))
        return cache[name]
    return get


def _rel(got, want):
    return float(np.abs(got - want).max() / (want.max() - want.min()))


@pytest.mark.parametrize("name", MIXES)
def test_mix_matches_mlx(name, converted):
    """The prompt's logits (the chunked prefill graph) and three decode steps (the decode MoE kernels)."""
    path, ids, (pre, dec, toks) = converted(name)
    m = qm.Model.load(path, backend=BACKEND, dtype="float32")
    got_pre, got_dec, got_toks = qm_logits(m, ids, 3, forced_tokens=toks)
    assert _rel(got_pre, pre) < ATOL and _rel(got_dec, dec) < ATOL, (_rel(got_pre, pre), _rel(got_dec, dec))
    assert list(got_toks) == list(toks)


def test_unpaired_shared_expert_in_streaming_and_verification(converted):
    """The shared expert apart also where the other graphs run the decode MoE kernels: expert streaming
    (per-layer command buffers) and the verification of drafted tokens (every row a decode step)."""
    path, ids, (pre, dec, toks) = converted("dense routed, q4 shared")
    resident = qm.Model.load(path, backend=BACKEND, dtype="float32")
    streamed = qm.Model.load(path, backend=BACKEND, dtype="float32", expert_slots=2)
    for m in (resident, streamed):
        _, got_dec, _ = qm_logits(m, ids, 3, forced_tokens=toks)
        assert _rel(got_dec, dec) < ATOL
    s = resident.new_session()
    resident.prefill(s, list(ids))
    logits = resident._backend.verify(s._state, np.asarray(toks[:3], np.int64), s._tokens)
    assert _rel(np.asarray(logits), dec) < ATOL

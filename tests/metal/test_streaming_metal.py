"""Expert streaming on the Metal backend (docs/metal.md, "Streaming mode"), on the simulator: the routed
experts in slot stacks filled by the expert cache, a token as per-layer command buffers, prefill token by
token. Against the same checkpoint fully resident on the same backend:

* decode from the same state: the same greedy tokens, and with slots >= top_k the same state bit for bit
  (the same kernels on the same bytes), with fewer slots (batches, x rounded per batch) within tolerance;
* prefill (token by token through the decode kernels, vs the resident chunked GEMMs): logits within the
  float build's tolerance;
* command buffers and host waits per token: one per batch of each MoE layer's routing, plus one;
* the routed experts are never bound from the mapping (weight_bytes drops by exactly their bytes; the slots
  hold slots x expert bytes per MoE layer) nor touched through it (/proc/self/pagemap), the cache's
  counters are reported, bad options are rejected.
Simulator-verified, hardware-unverified.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal.errors import InputError
from qwenmetal.memlimit import drop_page_cache
from qwenmetal.testing import cached_checkpoint

from model_runs import rel_range_err
from test_streaming_cpu import CFG, mapped_expert_pages

from .gpu_harness import BACKEND

PROMPT = [5, 17, 3, 99, 42, 7]
N_DECODE = 4


def _decode(be, arrays, n=N_DECODE):
    """n greedy tokens on the GPU from the state `arrays`; (tokens, the state after them as arrays)."""
    st = be.state_from_arrays(arrays)
    toks = be.decode(st, PROMPT[-1], n)
    return toks, be.state_to_arrays(st)


@pytest.fixture(scope="module")
def resident():
    cache = {}

    def get(preset, fmt, dtype):
        key = (preset, fmt, dtype)
        if key not in cache:
            m = qm.Model.load(cached_checkpoint(preset, fmt, seed=0), backend=BACKEND, dtype=dtype)
            s = m.new_session()
            pre = m.prefill(s, PROMPT[:-1], return_logits="all")
            arrays = m._backend.state_to_arrays(s._state)
            cache[key] = (m, pre, arrays, _decode(m._backend, arrays))
        return cache[key]
    return get


@pytest.mark.parametrize("slots", ["one", "top_k", "all"])
def test_streaming_matches_resident(slots, resident):
    model, want_pre, arrays, (want_toks, want_state) = resident("tiny", "mlx-q4", "float32")
    c = model.config
    S = {"one": 1, "top_k": c.num_experts_per_tok, "all": c.num_experts}[slots]
    m = qm.Model.load(model.path, backend=BACKEND, dtype="float32", expert_slots=S, expert_policy="lru")
    be = m._backend
    plan = be.plan
    assert plan.stream and plan.slots_per_layer == S
    # the routed experts are not bound from the mapping: only the slot stacks hold them
    assert model._backend.engine.weight_bytes - be.engine.weight_bytes == plan.checkpoint_bytes - plan.resident_bytes
    assert be.engine.slot_bytes == plan.moe_layers * S * plan.expert_bytes

    be.device.reset_counters()
    toks, state = _decode(be, arrays)
    # per token: one wait after each MoE layer's top-k batch of the routing (ceil(k / S) each), one at the end
    k_ = be.device.counters()
    per_token = plan.moe_layers * -(-c.num_experts_per_tok // S) + 1
    assert k_["host_waits"] == k_["command_buffers"] == N_DECODE * per_token
    assert toks == want_toks
    for k, want in want_state.items():
        if S >= c.num_experts_per_tok:          # one batch per layer: the resident step's arithmetic exactly
            assert np.array_equal(state[k], want), k
        else:                                   # batches: x rounded once per batch
            assert rel_range_err(state[k], want) < 1e-4, k

    s = m.new_session()
    pre = m.prefill(s, PROMPT[:-1], return_logits="all")
    assert rel_range_err(pre, want_pre) < 1e-4

    raw = be.expert_counters()
    tokens = len(PROMPT) - 1 + N_DECODE
    lookups = tokens * plan.moe_layers * c.num_experts_per_tok
    assert raw["streaming"] and raw["slots_per_layer"] == S and raw["policy"] == "lru"
    assert raw["tokens"] == tokens and raw["lookups"] == lookups and raw["hits"] + raw["misses"] == lookups
    assert raw["bytes_read"] == raw["misses"] * plan.expert_bytes > 0
    if S == c.num_experts:                      # every expert read at most once
        assert raw["misses"] <= plan.moe_layers * c.num_experts
    st = be.info()["experts"]
    assert st["hit_rate"] == raw["hits"] / lookups and st["bytes_per_token"] == raw["bytes_read"] / tokens
    if slots == "top_k":                        # a generation reports its own expert stats
        out = list(m.generate(PROMPT, max_tokens=2, temperature=0))[-1]
        g = out.stats["experts"]
        assert g["streaming"] and g["slots_per_layer"] == S and 0.0 <= g["hit_rate"] <= 1.0
        assert g["bytes_read"] == be.expert_counters()["bytes_read"] and g["bytes_per_token"] >= 0


def test_streaming_bfloat_build_exact(resident):
    """The production activation type: with slots = top_k, decode is the resident step bit for bit."""
    model, _, arrays, (want_toks, want_state) = resident("tiny", "mlx-q4", "bfloat16")
    m = qm.Model.load(model.path, backend=BACKEND, dtype="bfloat16", expert_slots=model.config.num_experts_per_tok)
    toks, state = _decode(m._backend, arrays)
    assert toks == want_toks
    for k, want in want_state.items():
        assert np.array_equal(state[k], want), k


@pytest.mark.parametrize("preset,fmt", [("tiny", "hf-bf16"), ("tiny-qwen3-next", "mlx-q8")])
def test_streaming_other_formats(preset, fmt, resident):
    """Dense expert stacks (one part per matrix) that are strided views of HF's fused gate_up, 8-bit stacks,
    and Qwen3-Next, with one slot per layer."""
    model, _, arrays, (want_toks, want_state) = resident(preset, fmt, "float32")
    m = qm.Model.load(model.path, backend=BACKEND, dtype="float32", expert_slots=1, expert_policy="lfu")
    toks, state = _decode(m._backend, arrays)
    assert toks == want_toks
    for k, want in want_state.items():
        assert rel_range_err(state[k], want) < 1e-4, k
    assert m._backend.expert_counters()["policy"] == "lfu"


def test_resident_when_it_fits():
    m = qm.Model.load(cached_checkpoint("tiny", "mlx-q4", seed=0), backend=BACKEND)
    st = m._backend.info()["experts"]
    assert not st["streaming"] and st["bytes_read"] == 0 and np.isnan(st["hit_rate"])
    assert not m._backend.plan.stream and m._backend.engine.slot_bytes == 0


@pytest.mark.parametrize("options,match", [
    ({"expert_slots": 0}, r"expert_slots must be in \[1, 8\]"),
    ({"expert_slots": 9}, r"expert_slots must be in \[1, 8\]"),
    ({"expert_slots": "2"}, r"expert_slots must be an int"),
    ({"expert_policy": "mru"}, r"expert_policy must be one of lru, lfu, os"),
    ({"memory_budget": 4096}, r"memory_budget 4096 bytes cannot hold the resident weights"),
    ({"memory_budget": -1}, r"memory_budget must be positive"),
])
def test_streaming_options_rejected(options, match):
    with pytest.raises(InputError, match=match):
        qm.Model.load(cached_checkpoint("tiny", "mlx-q4", seed=0), backend=BACKEND, **options)


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux /proc/self/pagemap")
def test_streamed_experts_never_mapped():
    """No page of the streamed experts' bytes is ever in this process's page tables after a streaming run
    (the probe and its control, a resident run that maps most of them: tests/test_streaming_cpu.py)."""
    ckpt = cached_checkpoint(CFG, "mlx-q4", seed=2, name="stream-cpu")
    drop_page_cache([ckpt])
    m = qm.Model.load(ckpt, backend=BACKEND, expert_slots=1, expert_policy="os")
    s = m.new_session()
    m.prefill(s, PROMPT[:2], return_logits="last")
    assert m._backend.expert_counters()["bytes_read"] > 0
    present, checked = mapped_expert_pages(m)
    assert checked and present == 0, f"{present} of {checked} streamed expert pages mapped"


def test_streaming_low_bit_experts(resident):
    """Routed experts at 2 bits beside 4-bit shared experts (mlx-q4-e2) streamed into slot stacks: the qn expert
    kernels over slot ids, with slots = top_k, decode the resident step's tokens and state bit for bit."""
    model, _, arrays, (want_toks, want_state) = resident("tiny", "mlx-q4-e2", "float32")
    m = qm.Model.load(model.path, backend=BACKEND, dtype="float32", expert_slots=model.config.num_experts_per_tok)
    assert m._backend.plan.stream
    toks, state = _decode(m._backend, arrays)
    assert toks == want_toks
    for k, want in want_state.items():
        assert np.array_equal(state[k], want), k

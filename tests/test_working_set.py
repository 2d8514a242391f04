"""The Metal backends' memory plan against the GPU's working set (qwenmetal.working_set; docs/metal.md,
"Runtime limits"): on the real Qwen3.6-35B-A3B config (virtual weights, the MLX 4-bit layout) for a 16, 24,
32 and 64 GB Mac, the plan each gets; the figures it adds up; the error when nothing fits; `qwenmetal info`
showing it; and a metal-sim model whose SimDevice reports a small working set streaming its experts with the
resident model's tokens. The working sets of those Macs are modelled (2/3 of memory up to 36 GiB, 3/4 above).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal import bench, cli
from qwenmetal.config import ModelConfig, session_bytes
from qwenmetal.errors import InputError
from qwenmetal.testing import cached_checkpoint
from qwenmetal.weights_table import virtual_weight_table
from qwenmetal.working_set import CHUNKS, graph_bytes, mac_working_set, plan

GIB = 2**30


@pytest.fixture(scope="module")
def real():
    c = ModelConfig.from_dict(bench.real_config(40))
    return c, virtual_weight_table(c)[2]


def test_mac_working_sets():
    assert mac_working_set(32 * GIB) == pytest.approx(21.333 * GIB, rel=1e-3)    # about 21 GB on a 32 GB Mac
    assert mac_working_set(16 * GIB) == pytest.approx(10.667 * GIB, rel=1e-3)
    assert mac_working_set(64 * GIB) == 48 * GIB


@pytest.mark.parametrize("mac,context,mode,chunk", [
    (16, 32768, "stream", 4096), (24, 32768, "stream", 4096),
    (32, 32768, "resident", 4096), (32, 131072, "smaller chunk", 2048), (32, 262144, "stream", 4096),
    (64, 262144, "resident", 4096)])
def test_real_config_on_each_mac(real, mac, context, mode, chunk):
    c, sizes = real
    ws = mac_working_set(mac * GIB)
    p = plan(c, sizes, ws, context=context)
    assert (p.mode, p.chunk) == (mode, chunk)
    assert p.total_bytes <= ws
    held = session_bytes(c, context)
    assert p.kv_bytes == held["kv_cache"] and p.state_bytes == 2 * held["gdn_state"]
    assert p.scratch_bytes == graph_bytes(c, p.chunk)
    if mode == "stream":
        assert 1 <= p.stream.slots_per_layer < c.num_experts and p.weight_bytes == p.stream.resident_bytes
        # one slot more per layer would not fit
        assert p.total_bytes + p.stream.moe_layers * p.stream.expert_bytes > ws
    else:
        assert p.weight_bytes == sum(sizes.values()) and not p.stream.stream
        if mode == "smaller chunk":      # the default chunk would not have fitted
            assert p.weight_bytes + p.kv_bytes + p.state_bytes + graph_bytes(c, CHUNKS[0]) > ws


def test_scratch_follows_the_chunk(real):
    c, _ = real
    assert graph_bytes(c, 4096) > 1.8 * graph_bytes(c, 2048) > 0


def test_nothing_fits_is_a_clear_error(real):
    c, sizes = real
    with pytest.raises(InputError, match=r"working set is 10.67 GiB: .* KV at 4,194,304 tokens \(80.00 GiB\).*"
                                         r"lower the context"):
        plan(c, sizes, mac_working_set(16 * GIB), context=4 * 1024 * 1024)
    with pytest.raises(InputError, match="context must be a positive integer"):
        plan(c, sizes, mac_working_set(16 * GIB), context=0)


def test_given_slots_beyond_the_working_set_are_refused(real):
    c, sizes = real
    with pytest.raises(InputError, match=r"working set is 10.67 GiB: 200 expert slots per MoE layer need"):
        plan(c, sizes, mac_working_set(16 * GIB), expert_slots=200)


def test_unknown_working_set_limits_nothing(real):
    c, sizes = real
    p = plan(c, sizes, 0)
    assert p.mode == "unlimited" and not p.stream.stream and p.chunk == CHUNKS[0]


def test_info_shows_the_plan(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(bench.real_config(40)))
    assert cli.main(["info", "--model", str(tmp_path), "--mac-memory", "32GiB", "--context", "131072"]) == 0
    out = capsys.readouterr().out
    assert "GPU working set (a Mac with 32 GiB, modelled): 21.33 GiB; plan: every weight resident with a prefill " \
           "chunk of 2048 rows" in out
    assert "KV at 131,072 tokens 2.50 GiB" in out


def test_a_small_working_set_streams_on_metal_sim():
    """A metal-sim model whose device reports a working set below its checkpoint streams its routed experts,
    with the resident model's greedy tokens, and says so in its memory plan."""
    path = cached_checkpoint("tiny", "mlx-q4", seed=0)
    resident = qm.Model.load(path, backend="metal-sim", dtype="float32")
    c, sizes = resident.config, {k: int(v.nbytes) for k, v in resident.weights.tensors.items()}
    # half the routed experts short of everything resident at the smallest chunk
    routed = sum(v for k, v in sizes.items() if ".switch_mlp." in k)
    everything = plan(c, sizes, 2**40, context=256, chunk=CHUNKS[-1], dtype="float32", kv_dtype="float32")
    m = qm.Model.load(path, backend="metal-sim", dtype="float32", max_context=256,
                      device_options={"working_set": everything.total_bytes - routed // 2})
    info = m.backend_info()
    assert info["memory_plan"][0].endswith("slots per MoE layer") and "routed experts streamed" in info["memory_plan"][0]
    toks = [o.token for o in m.generate([5, 17, 3, 99], max_tokens=6, temperature=0.0)]
    want = [o.token for o in resident.generate([5, 17, 3, 99], max_tokens=6, temperature=0.0)]
    assert toks == want
    with pytest.raises(InputError, match="working set is"):
        qm.Model.load(path, backend="metal-sim", dtype="float32", device_options={"working_set": 4096})
    assert m.backend_info()["memory_plan"] != resident.backend_info()["memory_plan"]

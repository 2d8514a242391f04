"""qwenmetal.expert_streaming: the expert layout points at exactly each expert's bytes in the checkpoint files (and
the C++ cache reads them from there), the planner's arithmetic, "auto" from a fake /proc + cgroup tree,
budget parsing and its errors, and the streaming lines of `qwenmetal info`."""
import os

import numpy as np
import pytest

from qwenmetal import _core, cli, memory, weights
from qwenmetal import expert_streaming as streaming
from qwenmetal.config import ModelConfig
from qwenmetal.errors import CheckpointError, InputError
from qwenmetal.testing import PRESETS, cached_checkpoint
from qwenmetal.weights import QuantizedTensor, load_weights


def _load(fmt):
    d = cached_checkpoint("tiny", fmt)
    c = ModelConfig.from_file(d / "config.json")
    return c, load_weights(d, c)


def _arrays(t):
    return [t.weight, t.scales, t.biases] if isinstance(t, QuantizedTensor) else [t]


@pytest.mark.parametrize("fmt", ["mlx-q4", "mlx-bf16", "hf-bf16"])   # hf-bf16: fused gate_up, strided views
def test_layout_points_at_each_experts_bytes_and_the_cache_reads_them(fmt):
    c, w = _load(fmt)
    layout = streaming.expert_layout(w)
    assert sorted(layout) == weights.moe_layers(c) == list(range(c.num_hidden_layers))
    raw = {}
    for layer, parts in layout.items():
        arrays = [a for name in weights.expert_names(layer) for a in _arrays(w.tensors[name])]
        assert len(parts) == len(arrays) == (9 if fmt == "mlx-q4" else 3)
        for p, a in zip(parts, arrays):
            data = raw.setdefault(p.path, open(p.path, "rb").read())
            for e in range(c.num_experts):
                assert data[p.offset + e * p.stride:p.offset + e * p.stride + p.nbytes] == \
                    np.ascontiguousarray(a[e]).tobytes()
    # the same layout through the C++ cache: slot contents equal the loaded tensors
    files, layers = streaming.cache_tables(layout)
    S = 2
    slots = {l: [np.zeros(S * nb, np.uint8) for (_, _, _, nb) in ps] for l, ps in layers.items()}
    cache = _core.ExpertCache(files, layers, slots, num_experts=c.num_experts, slots_per_layer=S)
    layer = weights.moe_layers(c)[-1]
    experts = [c.num_experts - 1, 3]
    got = cache.acquire(layer, np.array(experts, np.int32))
    arrays = [a for name in weights.expert_names(layer) for a in _arrays(w.tensors[name])]
    for e, s in zip(experts, got):
        for buf, a in zip(slots[layer], arrays):
            nb = a[0].nbytes
            assert buf[s * nb:(s + 1) * nb].tobytes() == np.ascontiguousarray(a[e]).tobytes()


def test_layout_refuses_experts_the_loader_built():
    c, w = _load("mlx-q4")
    name = weights.expert_names(0)[1]
    t = w.tensors[name]
    w.tensors[name] = QuantizedTensor(t.weight.copy(), t.scales, t.biases, t.bits, t.group_size)
    with pytest.raises(CheckpointError, match=r"routed-expert tensor 'layers\.0\.mlp\.switch_mlp\.up_proj\.weight' "
                                              r"is not a view of a safetensors file.*qwenmetal convert"):
        streaming.expert_layout(w)


# ---- the planner -------------------------------------------------------------------------------------
CFG = ModelConfig.from_dict(PRESETS["tiny"])
E, L = CFG.num_experts, len(weights.moe_layers(CFG))
X = 10_000_000    # bytes of one expert of one matrix: the experts (960 MB) dwarf the reserve (~270 MB)
RESIDENT = 50_000_000
SIZES = {"embed_tokens": RESIDENT - 1000, "norm": 1000}
for _i in weights.moe_layers(CFG):
    for _n in weights.expert_names(_i):
        SIZES[_n] = X * E
PER_SLOT = 3 * X * L                       # one expert of every MoE layer
CHECKPOINT = RESIDENT + PER_SLOT * E


def test_reserve_is_one_sessions_kv_and_twice_its_state_plus_scratch():
    p = streaming.plan(CFG, SIZES, None)
    kv = len(CFG.full_attention_layers) * 2 * CFG.num_key_value_heads * CFG.head_dim * 2 * streaming.RESERVE_CONTEXT
    state = len(CFG.linear_attention_layers) * 4 * (
        CFG.linear_num_value_heads * CFG.linear_key_head_dim * CFG.linear_value_head_dim
        + CFG.conv_dim * (CFG.linear_conv_kernel_dim - 1))
    assert p.reserve_bytes == kv + 2 * state + streaming.SCRATCH_BYTES    # state: live + the rollback copy


def test_plan_arithmetic():
    reserve = streaming.plan(CFG, SIZES, None).reserve_bytes
    p = streaming.plan(CFG, SIZES, CHECKPOINT)
    assert not p.stream and p.slots_per_layer == E and p.budget == CHECKPOINT
    assert (p.checkpoint_bytes, p.resident_bytes, p.expert_bytes, p.moe_layers, p.top_k) == (
        CHECKPOINT, RESIDENT, 3 * X, L, CFG.num_experts_per_tok)
    assert p.bytes_per_token(0.0) == 0.0                  # resident: nothing read
    assert not streaming.plan(CFG, SIZES, None).stream
    # short of the checkpoint: streams, with the slots the budget leaves after resident + reserve
    budget = RESIDENT + reserve + 5 * PER_SLOT + PER_SLOT // 2
    p = streaming.plan(CFG, SIZES, budget)
    assert p.stream and p.slots_per_layer == 5 and p.policy == "lfu" and p.slot_bytes == 5 * PER_SLOT
    assert p.naive_hit_rate == 5 / E
    assert p.bytes_per_token(0.25) == L * CFG.num_experts_per_tok * 3 * X * 0.75
    p = streaming.plan(CFG, SIZES, CHECKPOINT - 1)          # one byte short: what is left after the reserve
    assert p.stream and p.slots_per_layer == (CHECKPOINT - 1 - RESIDENT - reserve) // PER_SLOT == 5
    # the reserve does not fit, but one slot per layer does: one slot
    assert streaming.plan(CFG, SIZES, RESIDENT + PER_SLOT).slots_per_layer == 1
    with pytest.raises(InputError, match=rf"memory_budget {RESIDENT + PER_SLOT - 1} bytes cannot hold the resident "
                                         rf"weights \({RESIDENT} bytes\) and 1 expert slot\(s\) per MoE layer "
                                         rf"\({PER_SLOT} bytes\)"):
        streaming.plan(CFG, SIZES, RESIDENT + PER_SLOT - 1)


def test_overrides_force_streaming():
    p = streaming.plan(CFG, SIZES, None, slots_per_layer=1, policy="lfu")
    assert p.stream and p.slots_per_layer == 1 and p.policy == "lfu"
    p = streaming.plan(CFG, SIZES, "1GiB", slots_per_layer=E, policy="os")   # "all": every expert has a slot
    assert p.stream and p.slots_per_layer == E and p.budget == 1 << 30
    assert streaming.plan(CFG, SIZES, None, policy="os").policy == "os"
    with pytest.raises(InputError, match=r"cannot hold the resident weights .* and 3 expert slot\(s\)"):
        streaming.plan(CFG, SIZES, RESIDENT + 2 * PER_SLOT, slots_per_layer=3)
    for bad in (0, E + 1):
        with pytest.raises(InputError, match=rf"expert_slots must be in \[1, {E}\] .*got {bad}") as ei:
            streaming.plan(CFG, SIZES, None, slots_per_layer=bad)
        assert ei.value.param == "expert_slots"
    with pytest.raises(InputError, match="expert_slots must be an int, got 1.5"):
        streaming.plan(CFG, SIZES, None, slots_per_layer=1.5)
    with pytest.raises(InputError, match="expert_policy must be one of lru, lfu, os, got 'fifo'"):
        streaming.plan(CFG, SIZES, None, policy="fifo")
    p = streaming.plan(CFG, SIZES, None, slots_per_layer=1)
    for bad in (-0.1, 1.5, "0.5", True):
        with pytest.raises(InputError, match="hit_rate must be a number in"):
            p.bytes_per_token(bad)


def test_plan_checks_the_expert_tensors():
    sizes = dict(SIZES)
    del sizes[weights.expert_names(2)[2]]
    with pytest.raises(CheckpointError, match=r"no tensor 'layers\.2\.mlp\.switch_mlp\.down_proj'"):
        streaming.plan(CFG, sizes, None)
    sizes = dict(SIZES, **{weights.expert_names(0)[0]: X * E + 1})
    with pytest.raises(CheckpointError, match=rf"{X * E + 1} bytes do not split into {E} experts"):
        streaming.plan(CFG, sizes, None)


def test_plan_from_weights_and_auto():
    c, w = _load("mlx-q4")
    p = streaming.plan(c, w, w.nbytes)
    assert not p.stream and p.checkpoint_bytes == w.nbytes
    expert = sum(w.tensors[n].nbytes for i in weights.moe_layers(c) for n in weights.expert_names(i))
    assert p.resident_bytes == w.nbytes - expert and p.expert_bytes * c.num_experts * p.moe_layers == expert
    assert streaming.plan(c, w, w.nbytes - 1).stream
    auto = streaming.plan(c, w)                         # this machine has more than a tiny fixture
    assert not auto.stream and auto.budget == pytest.approx(memory.available_memory(), rel=0.05)


@pytest.mark.parametrize("value,want", [
    (None, None), ("auto", "auto"), (12345, 12345), ("8GiB", 8 << 30), ("8G", 8 << 30), ("1.5 GB", 1_500_000_000),
    ("100MiB", 100 << 20), ("64k", 64 << 10), ("4096", 4096)])
def test_parse_budget(value, want):
    assert memory.parse_budget(value) == want


@pytest.mark.parametrize("value,match", [
    (0, "memory_budget must be positive, got 0"), (-5, "must be positive"), ("0GiB", "must be positive"),
    ("lots", "memory_budget must be 'auto', a number of bytes or a size like '8GiB', got 'lots'"),
    ("8 parsecs", "got '8 parsecs'"), (True, "got True"), (1.5e9, "got 1500000000.0")])
def test_parse_budget_errors(value, match):
    with pytest.raises(InputError, match=match) as ei:
        memory.parse_budget(value)
    assert ei.value.param == "memory_budget"


# ---- "auto" ------------------------------------------------------------------------------------------
def _tree(tmp_path, cgroup_lines, files, mem_available_kb=8 << 20):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("".join(l + "\n" for l in cgroup_lines))
    (proc / "meminfo").write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {mem_available_kb} kB\n")
    root = tmp_path / "cg"
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return str(proc), str(root)


def _auto(proc, root):
    return memory.available_memory(proc=proc, cgroup_root=root, platform="linux")


def test_auto_cgroup_v1_takes_the_tightest_limit_on_the_path(tmp_path):
    proc, root = _tree(tmp_path, ["5:cpu,cpuacct:/a", "4:memory:/a/b", "0::/"], {
        "memory/a/b/memory.limit_in_bytes": "9223372036854771712\n",   # unlimited
        "memory/a/memory.limit_in_bytes": str(3 << 30),
        "memory/memory.limit_in_bytes": "9223372036854771712\n"})
    headroom = 1 - memory.AUTO_HEADROOM["linux"]
    assert memory.cgroup_memory_limit(proc, root) == 3 << 30
    assert _auto(proc, root) == int((3 << 30) * headroom)
    # MemAvailable below the limit wins
    proc, root = _tree(tmp_path / "2", ["4:memory:/a"], {"memory/a/memory.limit_in_bytes": str(16 << 30)},
                       mem_available_kb=2 << 20)
    assert _auto(proc, root) == int((2 << 30) * headroom)


def test_auto_cgroup_v2_and_a_namespace_root(tmp_path):
    proc, root = _tree(tmp_path, ["0::/user.slice/job"], {
        "user.slice/job/memory.max": "max\n", "user.slice/memory.max": str(1 << 30)})
    assert memory.cgroup_memory_limit(proc, root) == 1 << 30
    # inside a container the path names the host's cgroup; the limit is at the namespace root
    proc, root = _tree(tmp_path / "2", ["0::/host/path/not/here"], {"memory.max": str(5 << 30)})
    assert memory.cgroup_memory_limit(proc, root) == 5 << 30
    # no limit anywhere, no cgroup file at all: MemAvailable
    proc, root = _tree(tmp_path / "3", ["0::/"], {"memory.max": "max\n"}, mem_available_kb=1 << 20)
    assert memory.cgroup_memory_limit(proc, root) is None
    assert _auto(proc, root) == int((1 << 30) * (1 - memory.AUTO_HEADROOM["linux"]))
    os.remove(os.path.join(proc, "self", "cgroup"))
    assert memory.cgroup_memory_limit(proc, root) is None


def test_auto_on_macos_is_physical_memory_less_headroom():
    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert memory.available_memory(platform="darwin") == int(phys * (1 - memory.AUTO_HEADROOM["darwin"]))


# ---- qwenmetal info ----------------------------------------------------------------------------------
def test_info_reports_streaming(capsys):
    d = cached_checkpoint("tiny", "mlx-q4")
    c, w = _load("mlx-q4")
    p = streaming.plan(c, w, w.nbytes - 1)
    assert cli.main(["info", "--model", str(d), "--memory-budget", str(w.nbytes - 1), "--hit-rate", "0.5"]) == 0
    out = capsys.readouterr().out
    assert f"expert streaming: yes, {p.slots_per_layer} of 8 expert slots per MoE layer" in out
    assert f"hit rate 12.5% (naive: slots / experts): {streaming.size_text(p.bytes_per_token(0.125))} per token" in out
    assert f"hit rate 50.0% (given): {streaming.size_text(p.bytes_per_token(0.5))} per token" in out
    assert cli.main(["info", "--model", str(d)]) == 0
    assert "expert streaming: no (the checkpoint fits the budget" in capsys.readouterr().out
    assert cli.main(["info", "--model", str(d), "--memory-budget", "1000"]) == 2
    assert "memory_budget 1000 bytes cannot hold the resident weights" in capsys.readouterr().err


def test_info_on_a_config_only_397b_directory_plans_streaming(tmp_path, capsys):
    import json

    from qwenmetal import bench
    from qwenmetal.weights_table import virtual_weight_table
    cfg = bench.qwen35_397b_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    c = ModelConfig.from_dict(cfg)
    p = streaming.plan(c, virtual_weight_table(c)[2], "48GB")
    assert p.stream and p.expert_bytes == 7_077_888 and 1 < p.slots_per_layer < 512
    assert cli.main(["info", "--model", str(tmp_path), "--memory-budget", "48GB", "--hit-rate", "0.71"]) == 0
    out = capsys.readouterr().out
    assert f"expert streaming: yes, {p.slots_per_layer} of 512 expert slots per MoE layer" in out
    assert f"hit rate 71.0% (given): {streaming.size_text(p.bytes_per_token(0.71))} per token" in out


# ---- concurrent sessions: their KV caches and GDN states times N ----------------------------------------
# the tiny preset by hand: 1 attention layer x K and V x 2 kv heads x 32 x bf16 = 256 bytes of KV per token;
# 3 GDN layers x float32 x (4 value heads x 32 x 32 recurrent + conv_dim 256 x (kernel 4 - 1)) = 58,368 bytes
TINY_KV_TOKEN, TINY_STATE = 256, 3 * 4 * (4 * 32 * 32 + 256 * 3)


def test_kv_capacity_follows_each_backends_growth():
    from qwenmetal.config import kv_capacity, session_alloc_bytes
    # cpu: the worst that growth by need leaves, max(need, 1.5 x capacity) in 256-token blocks
    # (0 -> 256 -> 512 (384 rounded) -> 768 -> 1280 (1152 rounded) -> ...)
    assert [kv_capacity(n) for n in (0, 1, 256, 257, 512, 513, 1000, 4096)] == [0, 256, 512, 512, 768, 768, 1536, 6144]
    # Metal: the tokens rounded up to its kv_block
    assert [kv_capacity(n, "metal") for n in (1, 256, 257, 1000, 4096)] == [256, 256, 512, 1024, 4096]
    assert session_alloc_bytes(CFG, 4096) == {"kv_tokens": 6144, "kv_cache": 6144 * TINY_KV_TOKEN,
                                              "gdn_state": TINY_STATE, "total": 6144 * 256 + TINY_STATE}
    assert session_alloc_bytes(CFG, 4096, 4, "metal-sim") == {      # float32 KV; the graph's ping-pong state
        "kv_tokens": 4096, "kv_cache": 4096 * 512, "gdn_state": 2 * TINY_STATE, "total": 4096 * 512 + 2 * TINY_STATE}
    assert TINY_STATE == 58_368


def test_plan_keeps_parallel_sessions_free():
    one = streaming.plan(CFG, SIZES, None)
    assert streaming.plan(CFG, SIZES, None, parallel=1).reserve_bytes == one.reserve_bytes    # the default
    p = streaming.plan(CFG, SIZES, None, parallel=3, context=1024)
    assert p.reserve_bytes == 3 * (1024 * TINY_KV_TOKEN + 2 * TINY_STATE) + streaming.SCRATCH_BYTES
    # the slots get what three sessions leave
    budget = RESIDENT + p.reserve_bytes + 4 * PER_SLOT
    assert streaming.plan(CFG, SIZES, budget, parallel=3, context=1024).slots_per_layer == 4
    assert streaming.plan(CFG, SIZES, budget - 1, parallel=3, context=1024).slots_per_layer == 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InputError, match="parallel must be a positive integer"):
            streaming.plan(CFG, SIZES, None, parallel=bad)


def test_parallel_plan_and_default_parallel():
    S = SCRATCH = streaming.SCRATCH_BYTES
    one = 6144 * TINY_KV_TOKEN + TINY_STATE                 # a cpu session at 4096 tokens: 1,631,232 bytes
    assert one == 1_631_232
    budget = CHECKPOINT + S + 5 * one + 1000                # five sessions beside the whole checkpoint
    p = streaming.parallel_plan(CFG, SIZES, budget, context=4096, parallel=3)
    assert (p.weights_bytes, p.scratch_bytes, p.max_sessions, p.streaming) == (CHECKPOINT, SCRATCH, 5, False)
    assert p.session["total"] == one and p.sessions_bytes == 3 * one and p.fits
    assert not streaming.parallel_plan(CFG, SIZES, budget, context=4096, parallel=6).fits
    assert streaming.default_parallel(CFG, SIZES, budget, 4096) == 5
    assert streaming.default_parallel(CFG, SIZES, budget, 4096, limit=4) == 4          # the backend's rows
    assert streaming.default_parallel(CFG, SIZES, CHECKPOINT + S + 100 * one, 4096) == 8      # at most 8
    assert streaming.default_parallel(CFG, SIZES, CHECKPOINT + S + one - 1, 4096) == 1        # at least 1
    assert streaming.parallel_plan(CFG, SIZES, CHECKPOINT + S + one - 1, context=4096).max_sessions == 0
    assert streaming.default_parallel(CFG, SIZES, None, 4096) == 8                    # no budget: the cap
    # Metal: KV rounded to its block, the state twice
    metal = 4096 * TINY_KV_TOKEN + 2 * TINY_STATE
    assert streaming.default_parallel(CFG, SIZES, CHECKPOINT + S + 7 * metal, 4096, backend="metal") == 7
    # a budget short of the checkpoint: the resident weights and top-k slots per layer are what is held
    small = RESIDENT + L * CFG.num_experts_per_tok * 3 * X
    p = streaming.parallel_plan(CFG, SIZES, small + S + 2 * one, context=4096)
    assert p.streaming and p.weights_bytes == small and p.max_sessions == 2
    lines = p.describe()
    assert "one session holds 1.56 MiB (KV allocated for 6,144 tokens 1.50 MiB + GDN state 57.00 KiB)" in lines[0]
    assert "at most 2 session(s) of 4,096 tokens fit" in lines[1]


def test_working_set_plan_counts_parallel_sessions():
    from qwenmetal import working_set
    p1 = working_set.plan(CFG, SIZES, 0, context=4096, memory_budget=None)
    p3 = working_set.plan(CFG, SIZES, 0, context=4096, memory_budget=None, parallel=3)
    assert (p1.kv_bytes, p1.state_bytes, p1.parallel) == (4096 * TINY_KV_TOKEN, 2 * TINY_STATE, 1)
    assert p3.sessions_bytes == 3 * (4096 * TINY_KV_TOKEN + 2 * TINY_STATE)
    assert p3.total_bytes - p1.total_bytes == 2 * (4096 * TINY_KV_TOKEN + 2 * TINY_STATE)
    assert "3 sessions x (KV at 4,096 tokens" in p3.describe()[1]


def test_info_parallel(capsys):
    d = cached_checkpoint("tiny", "mlx-q4")
    c, w = _load("mlx-q4")
    budget = w.nbytes + streaming.SCRATCH_BYTES + 3 * (1536 * TINY_KV_TOKEN + TINY_STATE)     # three at 1000 tokens
    assert cli.main(["info", "--model", str(d), "--parallel", "4", "--context", "1000",
                     "--memory-budget", str(budget)]) == 0
    out = capsys.readouterr().out
    assert ("concurrent sessions at 1,000 tokens of context: one session holds 441.00 KiB (KV allocated for "
            "1,536 tokens 384.00 KiB + GDN state 57.00 KiB) (cpu backend)") in out
    assert "4 session(s): 1.72 MiB" in out and "does NOT fit; at most 3 session(s) of 1,000 tokens fit" in out
    assert "default --parallel for this budget and context: 3" in out
    assert cli.main(["info", "--model", str(d)]) == 0
    assert "concurrent sessions" not in capsys.readouterr().out          # without --parallel: as before

"""Expert streaming on the cpu backend (docs/cpu.md, "Streaming experts"): with the routed experts read
from the files into a few cache slots per layer, the output equals the resident model's bit for bit
(tokens and logits, decode and multi-chunk prefill) for every slot count and policy; sessions (fork,
snapshot, save/load) work; bad options are refused naming them; a Ctrl-C mid-prefill leaves the session
unchanged; and no page of a streamed expert is ever mapped into this process through the checkpoint's
mmap (/proc/self/pagemap)."""
import gc
import json
import mmap
import os
import shutil

import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal.memlimit import drop_page_cache
from qwenmetal.errors import InputError
from qwenmetal.safetensors_io import SafetensorsWriter, TensorSource
from qwenmetal.expert_streaming import expert_layout
from qwenmetal.testing import PRESETS, cached_checkpoint

from test_interrupts import default_sigint, interrupt_mid_compute, same_state, session_at, timed  # noqa: F401

# The text model with experts large enough that each layer's expert stacks span many pages (the pagemap
# test needs whole 64 KiB fault-around windows inside them) and top-k 4 of 16, so that slots 1, 2, k
# and E are four different batchings. About 7 MB at 4 bits.
CFG = dict(PRESETS["tiny-text"], moe_intermediate_size=512, num_experts=16, num_experts_per_tok=4)
E, K = 16, 4
# float32 KV and float activations are not needed for bit equality (any arithmetic is the same on
# both paths); int16 activations (the default here) and a bf16 cache are what users run.
OPTS = dict(threads=2, prefill_chunk=5)
PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, 400, 23)]   # 5 chunks: 4 GEMM + 1 GEMV
STEPS = [7, 300, 42]


@pytest.fixture(scope="module")
def ckpt():
    return cached_checkpoint(CFG, "mlx-q4", seed=2, name="stream-cpu")


@pytest.fixture(scope="module")
def resident(ckpt):
    return qm.Model.load(ckpt, backend="cpu", memory_budget=None, **OPTS)


def run(m):
    """Logits of every prompt token (chunked prefill) and of three decode steps."""
    s = m.new_session()
    out = [m.prefill(s, PROMPT, return_logits="all")]
    out += [m.decode_step(s, t)[None] for t in STEPS]
    return np.concatenate(out)


@pytest.fixture(scope="module")
def expected(resident):
    return run(resident)


@pytest.mark.parametrize("policy", ["lru", "lfu", "os"])
@pytest.mark.parametrize("slots", [1, 2, K, E])
def test_streaming_equals_resident(ckpt, expected, slots, policy):
    m = qm.Model.load(ckpt, backend="cpu", memory_budget=None, expert_slots=slots, expert_policy=policy, **OPTS)
    st = m._backend.info()["experts"]
    assert st["streaming"] and st["slots_per_layer"] == slots and st["policy"] == policy
    np.testing.assert_array_equal(run(m), expected)
    st = m._backend.info()["experts"]
    moe = sum(m.config.is_moe_layer(i) for i in range(m.config.num_hidden_layers))
    assert st["bytes_read"] > 0 and st["io_seconds"] > 0
    assert st["bytes_read"] <= (len(PROMPT) + len(STEPS)) * moe * K * m._backend.plan.expert_bytes
    if slots == E and policy != "os":              # every expert read once at most
        assert st["bytes_read"] <= moe * E * m._backend.plan.expert_bytes and st["hit_rate"] > 0


def test_direct_io_equals_resident(ckpt, expected):
    """expert_direct_io reads the experts past the page cache: the cache's descriptors of the checkpoint
    files are O_DIRECT (Linux; none without the option), and the logits are the resident ones."""
    def direct_fds():       # this process's descriptors of the checkpoint's files: how many have O_DIRECT
        flags = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith(os.path.realpath(ckpt)):
                    flags.append(int(open(f"/proc/self/fdinfo/{fd}").read().split("flags:")[1].split()[0], 8))
            except (FileNotFoundError, IndexError):
                continue
        return sum(bool(f & os.O_DIRECT) for f in flags)

    buffered = qm.Model.load(ckpt, backend="cpu", memory_budget=None, expert_slots=2, **OPTS)
    assert direct_fds() == 0
    del buffered
    m = qm.Model.load(ckpt, backend="cpu", memory_budget=None, expert_slots=2, expert_direct_io=True, **OPTS)
    assert m._backend.plan.direct_io and direct_fds() >= 1
    np.testing.assert_array_equal(run(m), expected)
    assert m._backend.info()["experts"]["bytes_read"] > 0


def test_generate_stats_and_tokens(ckpt, resident):
    m = qm.Model.load(ckpt, backend="cpu", memory_budget=None, expert_slots=1, expert_policy="lru", **OPTS)
    want = list(resident.generate(PROMPT, max_tokens=6, temperature=0, cache=False))
    got = list(m.generate(PROMPT, max_tokens=6, temperature=0, cache=False))
    assert [o.token for o in got] == [o.token for o in want]
    x = got[-1].stats["experts"]
    assert x["streaming"] and x["slots_per_layer"] == 1 and x["policy"] == "lru"
    assert "experts='streamed from disk (1 slots per layer, lru)'" in repr(m)     # the repr says so
    assert "experts=" not in repr(resident)
    assert 0 <= x["hit_rate"] < 1 and x["bytes_read"] > 0 and x["bytes_per_token"] > 0
    assert x["decode_bytes_per_token"] > 0
    r = want[-1].stats["experts"]
    assert not r["streaming"] and r["bytes_read"] == 0 and r["slots_per_layer"] == E
    # per generation: a second generation's stats start from zero again
    again = list(m.generate(PROMPT, max_tokens=6, temperature=0, cache=False))[-1].stats["experts"]
    assert again["bytes_read"] <= x["bytes_read"] * 1.5 and again["hit_rate"] == again["hit_rate"]


def test_sessions_fork_snapshot_save(ckpt, resident, tmp_path):
    m = qm.Model.load(ckpt, backend="cpu", memory_budget=None, expert_slots=2, expert_policy="lfu", **OPTS)
    s, r = m.new_session(), resident.new_session()
    m.prefill(s, PROMPT)
    resident.prefill(r, PROMPT)
    snap, f = s.snapshot(), s.fork()
    np.testing.assert_array_equal(m.decode_step(f, 9), resident.decode_step(r.fork(), 9))
    m.decode_step(s, 11)
    s.restore(snap)
    same_state(s, r)
    s.save(tmp_path / "s.qms")
    back = qm.Session.load(tmp_path / "s.qms", m)
    np.testing.assert_array_equal(m.decode_step(back, 5), resident.decode_step(r, 5))


def test_bad_options_rejected(ckpt):
    def load(**kw):
        return qm.Model.load(ckpt, backend="cpu", **dict(OPTS, **kw))
    with pytest.raises(InputError, match=r"expert_slots must be in \[1, 16\].*got 0"):
        load(expert_slots=0)
    with pytest.raises(InputError, match=r"expert_slots must be in \[1, 16\].*got 17"):
        load(expert_slots=17)
    with pytest.raises(InputError, match="expert_slots must be an int"):
        load(expert_slots=1.5)
    with pytest.raises(InputError, match="expert_policy must be one of lru, lfu, os, got 'fifo'"):
        load(expert_slots=1, expert_policy="fifo")
    with pytest.raises(InputError, match="memory_budget must be 'auto'.*got 'lots'"):
        load(memory_budget="lots")
    with pytest.raises(InputError, match="memory_budget 1000 bytes cannot hold the resident weights"):
        load(memory_budget=1000)
    with pytest.raises(InputError, match="expert_direct_io cannot be used with expert_policy 'os'"):
        load(expert_slots=1, expert_policy="os", expert_direct_io=True)
    with pytest.raises(InputError, match="expert_direct_io must be True or False, got 1"):
        load(expert_slots=1, expert_direct_io=1)


def test_quantize_at_load_cannot_stream():
    d = cached_checkpoint("tiny", "mlx-bf16", seed=0)
    with pytest.raises(ValueError, match="quantize .at load. cannot be combined with streamed experts"):
        qm.Model.load(d, backend="cpu", quantize=4, memory_budget=None, expert_slots=1)


def test_budget_below_checkpoint_streams(ckpt, expected):
    """memory_budget alone decides: a budget the checkpoint does not fit streams, with the planner's slots
    (here 1: the planner's session reserve is larger than this tiny checkpoint)."""
    size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    m = qm.Model.load(ckpt, backend="cpu", memory_budget=size // 2, **OPTS)
    p = m._backend.plan
    assert p.stream and p.slots_per_layer == 1 and m._backend.info()["experts"]["streaming"]
    np.testing.assert_array_equal(run(m), expected)


def test_sigint_mid_streaming_prefill(ckpt, default_sigint):
    m = qm.Model.load(ckpt, backend="cpu", memory_budget=None, expert_slots=1, expert_policy="os",
                      threads=2, prefill_chunk=8)
    s = session_at(m, [5, 17, 3])
    ids = list(np.random.default_rng(1).integers(0, 250, 200))
    while (t := timed(lambda: m.prefill(s.fork(), ids, return_logits="none"))) < 0.4 and 2 * len(ids) < 4000:
        ids = ids * 2                           # enough chunks to take ~0.5 s on this machine
    interrupt_mid_compute(m, s, lambda: m.prefill(s, ids, return_logits="none"), t)


def test_failed_expert_read_leaves_session_unchanged(ckpt, tmp_path):
    """An expert read that fails in the last layer (after every GDN layer has updated its state) raises,
    and the session is as before the call, for a one-chunk decode step and a multi-chunk prefill."""
    last = CFG["num_hidden_layers"] - 1
    d = tmp_path / "split"                      # the last layer's experts in a shard of their own
    shutil.copytree(ckpt, d, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    src = TensorSource(ckpt)
    own = [k for k in src.keys() if f"layers.{last}.mlp.switch_mlp." in k]
    assert len(own) == 9
    shards = {"model-00001-of-00002.safetensors": [k for k in src.keys() if k not in own],
              "model-00002-of-00002.safetensors": own}
    for fn, keys in shards.items():
        with SafetensorsWriter(d / fn, {k: (src.get(k).dtype, src.get(k).shape) for k in keys}) as w:
            for k in keys:
                w.write(k, src.get(k))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: fn for fn, keys in shards.items() for k in keys}}))
    m = qm.Model.load(d, backend="cpu", memory_budget=None, expert_slots=1, expert_policy="lru", **OPTS)
    s = session_at(m, PROMPT[:7])
    before = s.fork()
    head = 8 + int.from_bytes((d / "model-00002-of-00002.safetensors").read_bytes()[:8], "little")
    os.truncate(d / "model-00002-of-00002.safetensors", head)   # the experts' bytes are gone
    with pytest.raises(RuntimeError, match="model-00002-of-00002.safetensors"):
        m.decode_step(s, 5)
    same_state(s, before)
    with pytest.raises(RuntimeError, match="model-00002-of-00002.safetensors"):
        m.prefill(s, PROMPT)
    same_state(s, before)


# ---------------------------------------------------------------------------------------------------
# nothing streamed is read through the mapping
# ---------------------------------------------------------------------------------------------------
PAGE = mmap.PAGESIZE
# Linux maps up to fault_around_bytes (64 KiB, /sys/kernel/debug/fault_around_bytes) of already-cached
# pages around a faulting address: touching a resident tensor can map pages of the expert bytes next to
# it without anyone reading them. Only pages whose whole aligned 64 KiB window lies inside expert bytes
# are checked. With 2 MiB page-cache folios (ext4 on 6.x reading a cold file) a fault maps the whole folio
# unless the expert bytes are a mapping of their own without huge pages (streaming.keep_unmapped); the
# tests evict the checkpoint from the page cache first so that the folios are built by this run.
FAULT_AROUND = 64 << 10


def mapped_pages(start: int, end: int) -> np.ndarray:
    """Present bits (/proc/self/pagemap bit 63) of the pages of virtual addresses [start, end)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start // PAGE * 8)
        raw = f.read((end - start + PAGE - 1) // PAGE * 8)
    return (np.frombuffer(raw, np.uint64) >> np.uint64(63)).astype(bool)


def expert_windows(m):
    """(file mapping base address, [(start, end)] byte ranges of whole fault-around windows inside the
    routed-expert bytes) per checkpoint file."""
    src = m.weights.source
    out = []
    for sf in src.files.values():
        base = np.frombuffer(sf._mmap, np.uint8).__array_interface__["data"][0]
        ranges = sorted((p.offset + e * p.stride, p.offset + e * p.stride + p.nbytes)
                        for parts in expert_layout(m.weights).values() for p in parts if p.path == sf.path
                        for e in range(m.config.num_experts))
        merged = []
        for a, b in ranges:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        wins = []
        for a, b in merged:
            lo = -(-(base + a) // FAULT_AROUND) * FAULT_AROUND
            hi = (base + b) // FAULT_AROUND * FAULT_AROUND
            if hi > lo:
                wins.append((lo, hi))
        out.append((base, wins))
    return out


def mapped_expert_pages(m) -> tuple[int, int]:
    """(pages of whole expert windows present in this process's page tables, pages checked)."""
    present = checked = 0
    for _, wins in expert_windows(m):
        for lo, hi in wins:
            bits = mapped_pages(lo, hi)
            present += int(bits.sum())
            checked += bits.size
    return present, checked


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux /proc/self/pagemap")
def test_streamed_experts_never_mapped(ckpt):
    # the probe sees pages a resident run reads through the mapping ...
    r = qm.Model.load(ckpt, backend="cpu", memory_budget=None, **OPTS)
    run(r)
    present, checked = mapped_expert_pages(r)
    total = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    assert checked * PAGE > total // 2           # most of the checkpoint is expert bytes in whole windows
    assert present > checked // 2, (present, checked)
    del r
    gc.collect()
    # ... and none after a streaming run of the same checkpoint (every expert read by the cache)
    drop_page_cache([ckpt])
    m = qm.Model.load(ckpt, backend="cpu", memory_budget=None, expert_slots=1, expert_policy="os", **OPTS)
    run(m)
    list(m.generate(PROMPT, max_tokens=4, temperature=0, cache=False))
    assert m._backend.info()["experts"]["bytes_read"] > 0
    present, checked = mapped_expert_pages(m)
    assert checked and present == 0, f"{present} of {checked} streamed expert pages mapped"


def test_pagemap_reads_one_page():
    """The probe itself: a private anonymous page is absent until written."""
    buf = mmap.mmap(-1, 4 * PAGE)
    addr = np.frombuffer(buf, np.uint8).__array_interface__["data"][0]
    assert not mapped_pages(addr, addr + 4 * PAGE).any()
    buf[PAGE:PAGE + 1] = b"x"
    assert mapped_pages(addr, addr + 4 * PAGE).tolist() == [False, True, False, False]

"""The Metal prefill graph (src/gpu/forward.cpp, GpuEngine::forward): a prompt in chunks of
``prefill_chunk`` rows, one command buffer per chunk, on the simulator, against the numpy reference in the
float build. Simulator-verified, hardware-unverified.

Tiny chunk sizes: 5 (every GEMM of a chunk is skinny: <= 16 rows) and 24 (the tiled GEMM); prompt
lengths 1, chunk - 1, chunk, chunk + 1 and several chunks; logits of every row (want 2) and of the last;
split prefills equal one prefill; prefill then the GPU greedy decode gives the CPU backend's tokens; an
interrupt between chunks rolls the session back; the counters show one command buffer and one host wait
per chunk; the prefix cache snapshots at the chunk boundaries.
"""
from __future__ import annotations

import copy
import signal
import threading

import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal.testing import PRESETS, cached_checkpoint

from model_runs import rel_range_err

from .gpu_harness import BACKEND

RNG = np.random.default_rng(12)
PROMPT = [int(t) for t in RNG.integers(0, 400, 52)]       # 2 chunks of 24 + 4


def dense_config():
    """Qwen3-Next with a dense MLP layer (mlp_only_layers): the graph's gemm swiglu + down path."""
    c = copy.deepcopy(PRESETS["tiny-qwen3-next"])
    c["mlp_only_layers"] = [1]
    return c


CHECKPOINTS = {"tiny": lambda: cached_checkpoint("tiny", "mlx-q4", seed=0),
               "qwen3-next-dense": lambda: cached_checkpoint(dense_config(), "mlx-q4", seed=0,
                                                              name="tiny-qwen3-next-dense")}


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(name):
        if name not in cache:
            m = qm.Model.load(CHECKPOINTS[name](), backend="reference", dtype="float32")
            cache[name] = m.prefill(m.new_session(), PROMPT, return_logits="all")
        return cache[name]
    return get


@pytest.fixture(scope="module")
def gpu():
    cache = {}

    def get(name, chunk):
        if (name, chunk) not in cache:
            m = qm.Model.load(CHECKPOINTS[name](), backend=BACKEND, dtype="float32", prefill_chunk=chunk)
            m.prefix_cache = None
            cache[name, chunk] = m
        return cache[name, chunk]
    return get


@pytest.mark.parametrize("name,chunk,n", [("tiny", 5, 13), ("tiny", 24, 52), ("qwen3-next-dense", 24, 27)])
def test_every_row_matches_reference(name, chunk, n, reference, gpu):
    """want 2 over several chunks (the last one partial): every row's logits are the reference's."""
    want = reference(name)[:n]
    m = gpu(name, chunk)
    got = m.prefill(m.new_session(), PROMPT[:n], return_logits="all")
    assert got.shape == want.shape
    for i in range(n):
        assert rel_range_err(got[i], want[i]) < 1e-4, f"row {i}"


@pytest.mark.parametrize("chunk", [5, 24])
def test_last_row_at_the_chunk_edges(chunk, reference, gpu):
    """want 1 for prompt lengths 1, chunk - 1, chunk, chunk + 1 (a chunk boundary inside, at, past the end)."""
    m = gpu("tiny", chunk)
    want = reference("tiny")
    for n in (1, chunk - 1, chunk, chunk + 1):
        s = m.new_session()
        got = m.prefill(s, PROMPT[:n], return_logits="last")
        assert s.position == n
        assert rel_range_err(got, want[n - 1]) < 1e-4, f"length {n}"


def state_arrays(m, s):
    return m._backend.state_to_arrays(s._state)


def test_split_prefills_equal_one(gpu):
    """Prefills of 7 + 6 + 14 tokens (chunk boundaries in other places) give one prefill's state and logits."""
    m = gpu("tiny", 5)
    one = m.new_session()
    want = m.prefill(one, PROMPT[:27], return_logits="last")
    split = m.new_session()
    for a, b in ((0, 7), (7, 13), (13, 27)):
        got = m.prefill(split, PROMPT[a:b], return_logits="last")
    assert split.tokens == one.tokens
    assert rel_range_err(got, want) < 1e-5
    A, B = state_arrays(m, split), state_arrays(m, one)
    for k in B:
        np.testing.assert_allclose(A[k], B[k], rtol=1e-5, atol=1e-6 * float(np.abs(B[k]).max(initial=1)), err_msg=k)


def test_prefill_then_decode_gives_cpu_tokens(gpu):
    """13-token prefill in chunks of 5, then the pipelined GPU greedy decode: the CPU backend's tokens."""
    cpu = qm.Model.load(CHECKPOINTS["tiny"](), backend="cpu", threads=2, kv_dtype="float32", activations="float")
    s = cpu.new_session()
    toks = [int(np.argmax(cpu.prefill(s, PROMPT[:13], return_logits="last")))]
    for _ in range(7):
        toks.append(int(np.argmax(cpu.decode_step(s, toks[-1]))))
    m = gpu("tiny", 5)
    g = m.new_session()
    first = int(np.argmax(m.prefill(g, PROMPT[:13], return_logits="last")))
    assert first == toks[0]
    got = m._backend.decode(g._state, first, 7, consumed=g._tokens)
    assert [first] + list(got) == toks


def test_one_command_buffer_and_one_wait_per_chunk(gpu):
    m = gpu("tiny", 5)
    dev = m._backend.device
    for n in (5, 13):
        dev.reset_counters()
        m.prefill(m.new_session(), PROMPT[:n], return_logits="last")
        k = dev.counters()
        chunks = -(-n // 5)
        assert k["command_buffers"] == chunks and k["host_waits"] == chunks, (n, k)


def test_interrupt_between_chunks_rolls_back(gpu):
    """SIGINT while the first chunk runs: the poll before the next chunk raises KeyboardInterrupt, and the
    session (tokens, position, KV, GDN states) is exactly as before the call."""
    m = gpu("tiny", 5)
    s = m.new_session()
    m.prefill(s, PROMPT[:3], return_logits="none")
    before = state_arrays(m, s)
    dev = m._backend.device
    dev.reset_counters()
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.05, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    try:
        with pytest.raises(KeyboardInterrupt, match="^$"):
            timer.start()
            m.prefill(s, PROMPT[3:23], return_logits="last")      # 4 chunks
    finally:
        timer.join()
        signal.signal(signal.SIGINT, old)
    assert 1 <= dev.counters()["command_buffers"] < 4           # it stopped between chunks
    assert s.position == 3 and list(s.tokens) == PROMPT[:3]
    after = state_arrays(m, s)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)


def test_prefix_cache_snapshots_at_chunk_boundaries():
    m = qm.Model.load(CHECKPOINTS["tiny"](), backend=BACKEND, dtype="float32", prefill_chunk=5)
    assert m.prefix_cache.chunk_tokens == 5 == m._backend.snapshot_chunk
    list(m.generate(PROMPT[:13], max_tokens=1, temperature=0))
    kinds = {len(e.tokens): e.kind for e in m.prefix_cache._entries.values()}
    assert {5, 10} <= {n for n, k in kinds.items() if k == "chunk"}, kinds
    # a prompt extending a boundary resumes from that snapshot and gives the uncached logits
    e = m.prefix_cache.lookup(PROMPT[:12])
    assert e is not None and len(e.tokens) == 10


@pytest.mark.parametrize("opt,bad,match", [("prefill_chunk", 0, "prefill_chunk must be a positive integer"),
                                           ("prefill_chunk", 2.5, "prefill_chunk must be a positive integer"),
                                           ("gemm_route", "fast", "gemm_route must be one of"),
                                           ("gdn_route", "x", "gdn_route must be one of")])
def test_options_are_validated(opt, bad, match):
    with pytest.raises(ValueError, match=match):
        qm.Model.load(CHECKPOINTS["tiny"](), backend=BACKEND, **{opt: bad})

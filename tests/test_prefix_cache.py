"""Prefix cache for the hybrid state: multi-turn chat gives identical output with and without it, the prefill it
skips is measured at the backend, matching is by exact tokens, and the byte budget evicts least recently used
entries."""
import os
from types import SimpleNamespace

import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal import prefix_cache
from qwenmetal.testing import make_checkpoint


# ------------------------------------------------------------------------------------------------
# the cache itself, on stand-in snapshots (anything with .state.nbytes): fast, so they run first
# (tools/mutation.py runs mutmut over prefix_cache.py with this file)
# ------------------------------------------------------------------------------------------------
def snap(nbytes):
    return SimpleNamespace(state=np.zeros(nbytes, np.uint8))


def test_lookup_returns_the_longest_matching_prefix_in_any_order():
    pc = qm.PrefixCache(max_bytes=10_000)
    full = (5, 6, 7, 8, 9)
    for order in ([3, 1, 4], [1, 3, 4], [4, 3, 1], [4, 1, 3]):
        pc.clear()
        for k in order:
            assert pc.put(full[:k], snap(10), kind=f"k{k}")
        assert pc.lookup(full + (1,)).kind == "k4"
        assert pc.lookup(full[:4] + (0,)).kind == "k4"
        assert pc.lookup(full[:3] + (0,)).kind == "k3"
        assert pc.lookup(full[:2]).kind == "k1"              # k3 is longer than the query
        assert pc.lookup((6,) + full[1:]) is None            # differs in the first token
    assert pc.lookup([]) is None and pc.lookup(np.array(full[:2], np.int32)).kind == "k1"


def test_lookup_of_a_whole_prompt_needs_its_logits():
    """An entry as long as the query is only usable with the next-token logits (unless the caller says it
    does not need them); a shorter entry stored later is still found."""
    pc = qm.PrefixCache(max_bytes=10_000)
    full = (1, 2, 3, 4)
    pc.put(full, snap(10), kind="end")                   # no logits
    pc.put(full[:2], snap(10), kind="half")
    assert pc.lookup(full).kind == "half"
    assert pc.lookup(full, need_logits=True).kind == "half"
    assert pc.lookup(full, need_logits=False).kind == "end"
    logits = np.arange(3, dtype=np.float64)
    assert pc.put(full, snap(10), logits=logits)          # the existing entry gains the logits ...
    logits[:] = -1.0                                      # ... as a float32 copy
    e = pc.lookup(full)
    assert e.kind == "end" and e.logits.dtype == np.float32 and e.logits.tolist() == [0.0, 1.0, 2.0]
    assert pc.put(full, snap(10), logits=np.ones(3))      # and keeps its first logits
    assert pc.lookup(full).logits.tolist() == [0.0, 1.0, 2.0]
    assert pc.lookup(full + (9,)).kind == "end"
    # float32 logits are copied too (the caller's buffer is reused for the next step), new entry or not
    for first in (None, np.zeros(2, np.float32)):
        pc = qm.PrefixCache(max_bytes=10_000)
        pc.put((7, 7), snap(10), logits=first)
        buf = np.array([3.0, 4.0], np.float32)
        pc.put((7, 7), snap(10), logits=buf)
        buf[:] = 0.0
        assert pc.lookup((7, 7)).logits.tolist() == ([3.0, 4.0] if first is None else [0.0, 0.0])
    pc = qm.PrefixCache(max_bytes=10_000)
    buf = np.array([3.0, 4.0], np.float32)
    pc.put((7,), snap(10), logits=buf)
    buf[:] = 0.0
    assert pc.lookup((7,)).logits.tolist() == [3.0, 4.0]


def test_put_and_counters():
    pc = qm.PrefixCache(max_bytes=100, chunk_tokens=1)
    assert (pc.hits, pc.misses, pc.evictions, pc.tokens_reused, len(pc), pc.nbytes) == (0, 0, 0, 0, 0, 0)
    assert repr(pc) == "PrefixCache(0 entries, 0.0 / 0 MiB, chunk 1 tokens, 0 hits / 0 misses)"
    assert not pc.put([], snap(1)) and len(pc) == 0       # the empty prefix is never stored
    logits = np.array([1.5, -2.0], np.float64)
    assert pc.put(np.array([4, 5, 6]), snap(40), logits=logits)
    logits[0] = 9.0
    assert pc.entries() == [(3, "prompt", 48)]            # state + float32 logits, default kind
    assert pc.lookup([4, 5, 6]).logits.tolist() == [1.5, -2.0]
    assert pc.lookup([4, 5, 6, 7]) is not None and pc.lookup([4]) is None and pc.lookup([7]) is None
    assert (pc.hits, pc.misses, pc.tokens_reused) == (2, 2, 6)
    assert pc.put((4, 5), snap(52), kind="chunk")        # 48 + 52 = 100: exactly the budget, nothing evicted
    assert pc.evictions == 0 and pc.nbytes == 100 and len(pc) == 2
    assert not pc.put((9,), snap(101))                   # alone over the budget: refused, nothing evicted
    assert pc.evictions == 0 and len(pc) == 2
    assert pc.put((9,), snap(100))                       # exactly the budget: fits, after evicting both
    assert pc.evictions == 2 and pc.entries() == [(1, "prompt", 100)]
    pc.put((8,), snap(1))
    assert pc.entries() == [(1, "prompt", 1)] and pc.evictions == 3


def test_eviction_is_least_recently_used_and_counts_every_entry():
    pc = qm.PrefixCache(max_bytes=30)
    for t in (1, 2, 3):
        pc.put((t,), snap(10))
    pc.lookup((1, 0))                                     # 1 is now the most recent
    pc.put((2,), snap(10))                                # re-put: 2 the most recent, nothing evicted
    assert [pc.lookup((t, 0)) is not None for t in (1, 2, 3)] == [True, True, True] and pc.evictions == 0
    pc.put((4,), snap(20))                                # evicts the two least recently used: 1, 2
    assert pc.evictions == 2 and [pc.lookup((t, 0)) is not None for t in (1, 2, 3, 4)] == [False, False, True, True]


def test_repr_and_validation():
    pc = qm.PrefixCache(max_bytes=3 << 20, chunk_tokens=16)
    pc.put((1, 2), snap(3 << 19))
    pc.lookup((1, 2, 3))
    pc.lookup((5,))
    assert repr(pc) == "PrefixCache(1 entries, 1.5 / 3 MiB, chunk 16 tokens, 1 hits / 1 misses)"
    assert qm.PrefixCache(chunk_tokens=1).chunk_tokens == 1
    assert qm.PrefixCache().chunk_tokens == prefix_cache.DEFAULT_CHUNK_TOKENS == 2048
    for bad in (0, -3):
        with pytest.raises(ValueError, match=r"^chunk_tokens must be >= 1$"):
            qm.PrefixCache(chunk_tokens=bad)


def test_default_budget(monkeypatch):
    """10 % of physical memory, at most 8 GiB; 256 MiB when sysconf cannot tell."""
    def fake(pages, page=4096):
        def sysconf(name):
            return {"SC_PAGE_SIZE": page, "SC_PHYS_PAGES": pages}[name]
        return sysconf

    monkeypatch.setattr(os, "sysconf", fake(1_000_000))
    assert prefix_cache.default_max_bytes() == 409_600_000 and qm.PrefixCache().max_bytes == 409_600_000
    monkeypatch.setattr(os, "sysconf", fake(1_000_003, page=1))
    assert prefix_cache.default_max_bytes() == 100_000
    assert type(prefix_cache.default_max_bytes()) is int
    monkeypatch.setattr(os, "sysconf", fake(100 << 20))          # 400 GiB -> capped
    assert prefix_cache.default_max_bytes() == 8 << 30
    monkeypatch.setattr(os, "sysconf", fake(-1))                 # "no limit / unknown"
    assert prefix_cache.default_max_bytes() == 256 << 20
    for exc in (ValueError, OSError, AttributeError):
        def failing(name, exc=exc):
            raise exc(name)
        monkeypatch.setattr(os, "sysconf", failing)
        assert prefix_cache.default_max_bytes() == 256 << 20
    assert qm.PrefixCache(max_bytes=123.0).max_bytes == 123


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen3-next"])
def ckpt(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("pc") / "ck", request.param, "mlx-q4", seed=5)


class Counting:
    """Wraps a backend and counts the tokens each forward call runs."""

    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, inner.name, []

    def new_state(self):
        return self.inner.new_state()

    def forward(self, state, ids, logits, consumed=None):
        self.calls.append(len(ids))
        return self.inner.forward(state, ids, logits, consumed)

    def __getattr__(self, k):
        return getattr(self.inner, k)


def load(ckpt, cache):
    m = qm.Model.load(ckpt, backend="reference")
    m._backend = Counting(m._backend)
    m.prefix_cache = cache
    return m


SYSTEM = "You are a helpful assistant. Answer briefly and precisely, in one short sentence."
TURNS = ["What is the capital of France?", "And of Germany?", "Which one is larger?"]


def converse(model, **kw):
    msgs = [{"role": "system", "content": SYSTEM}]
    replies = []
    for t in TURNS:
        msgs.append({"role": "user", "content": t})
        calls0 = len(model._backend.calls)
        r = model.chat(msgs, max_tokens=6, temperature=0, **kw)
        # every decode step runs one token; the rest is prefill
        computed = sum(model._backend.calls[calls0:]) - (r.stats["generated_tokens"] - 1)
        r.ids, r.head, _ = model.chat_prompt(msgs, **kw)       # head: where this turn's messages end
        replies.append((r, computed))
        msgs.append(r.message)
    return replies


@pytest.mark.parametrize("enable_thinking", [None, False])
def test_multi_turn_identical_with_and_without_cache(ckpt, enable_thinking):
    cached = load(ckpt, qm.PrefixCache(chunk_tokens=16))
    plain = load(ckpt, None)
    a = converse(cached, enable_thinking=enable_thinking)
    b = converse(plain, enable_thinking=enable_thinking)
    for (ra, computed_a), (rb, computed_b) in zip(a, b):
        assert ra.tokens == rb.tokens and ra.text == rb.text
        assert ra.stats["prompt_tokens"] == rb.stats["prompt_tokens"]
        # what the backend actually prefilled is the prompt minus what the cache supplied
        assert computed_b == rb.stats["prompt_tokens"] and rb.stats["cached_tokens"] == 0
        assert computed_a == ra.stats["prompt_tokens"] - ra.stats["cached_tokens"] == ra.stats["prefill_tokens"]
    # turns 2 and 3 resume at least where the previous turn's messages ended (a chunk boundary inside the
    # shared start of the assistant header can be a little later), never beyond the common prefix (these
    # replies end by length, so they have no transcript: the template re-renders them, and the part of the
    # previous reply that renders differently is prefilled again -- tests/test_chat_continuity.py has the rest)
    for (r_prev, _), (r, _) in zip(a, a[1:]):
        seen = r_prev.ids + r_prev.tokens[:-1]          # the previous turn's snapshot (its last token not fed)
        lcp = next((i for i, (x, y) in enumerate(zip(seen, r.ids)) if x != y), len(seen))
        assert r_prev.head <= r.stats["cached_tokens"] <= lcp and r_prev.head >= len(r_prev.ids) - 16
    assert sum(c for _, c in a) < 0.6 * sum(c for _, c in b)


def test_identical_prompt_needs_no_prefill_and_logits_match(ckpt):
    m = load(ckpt, qm.PrefixCache())
    ids = m.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    first = list(m.generate(ids, max_tokens=5, temperature=0, logprobs=True))
    n = len(m._backend.calls)
    again = list(m.generate(ids, max_tokens=5, temperature=0, logprobs=True))
    assert again[-1].stats["cached_tokens"] == len(ids) and again[-1].stats["prefill_tokens"] == 0
    assert m._backend.calls[n:] == [1] * (len(again) - 1)              # decode steps only
    assert [o.token for o in again] == [o.token for o in first]
    assert [o.logprob for o in again] == [o.logprob for o in first]
    # cache=False bypasses it
    off = list(m.generate(ids, max_tokens=2, temperature=0, cache=False))
    assert off[-1].stats["cached_tokens"] == 0


def test_chunk_boundaries_and_exact_token_matching(ckpt):
    m = load(ckpt, qm.PrefixCache(chunk_tokens=8))
    tok = m.tokenizer
    base = tok.encode("Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 and then some more words here")
    list(m.generate(base, max_tokens=1, temperature=0))
    kinds = {k for _, k, _ in m.prefix_cache.entries()}
    assert "chunk" in kinds and "prompt" in kinds
    # a prompt that diverges at token d resumes from the last chunk boundary at or before d
    d = 19
    other = base[:d] + [t for t in tok.encode(" zebra crossing") if t not in base[d:d + 1]][:3] + base[d + 3:]
    assert other[:d] == base[:d] and other[d] != base[d]
    outs = list(m.generate(other, max_tokens=3, temperature=0))
    assert outs[-1].stats["cached_tokens"] == (d // 8) * 8
    ref = load(ckpt, None)
    assert [o.token for o in outs] == [o.token for o in ref.generate(other, max_tokens=3, temperature=0)]
    # which boundaries are kept: chunk x 1, 2, 4, 8, ... and the last two before the end
    m2 = load(ckpt, qm.PrefixCache(chunk_tokens=8))
    list(m2.generate(list(range(3, 103)), max_tokens=1, temperature=0))
    assert sorted(n for n, k, _ in m2.prefix_cache.entries() if k == "chunk") == [8, 16, 32, 64, 88, 96]
    # a prompt that differs from a cached one in its first token reuses nothing
    outs = list(m.generate([base[0] + 1] + base[1:], max_tokens=1, temperature=0))
    assert outs[-1].stats["cached_tokens"] == 0


def test_lru_eviction_by_bytes(ckpt):
    m = qm.Model.load(ckpt, backend="reference")
    s = m.new_session()
    snaps = []
    for i in range(5):
        m.prefill(s, [10 + i] * 4)
        snaps.append((s.tokens, s.snapshot()))
    one = snaps[-1][1].state.nbytes
    pc = qm.PrefixCache(max_bytes=int(3.5 * one), chunk_tokens=4)
    for toks, snap in snaps[:3]:
        assert pc.put(toks, snap)
    assert len(pc) == 3
    assert pc.lookup(snaps[0][0] + (1,)) is not None                   # touch the oldest
    pc.put(*snaps[3])                                                 # evicts the least recently used (#1)
    assert pc.nbytes <= pc.max_bytes and pc.evictions >= 1
    assert pc.lookup(snaps[1][0] + (1,)).tokens == snaps[0][0]       # #1 is gone, #0 (a prefix) remains
    assert not qm.PrefixCache(max_bytes=10).put(*snaps[0])           # larger than the whole budget
    pc.clear()
    assert len(pc) == 0 and "PrefixCache(0 entries" in repr(pc)


def test_restored_state_equals_recomputed_state(ckpt):
    m = qm.Model.load(ckpt, backend="reference")
    ids = list(range(3, 40))
    s = m.new_session()
    m.prefill(s, ids[:16], return_logits="none")
    pc = qm.PrefixCache()
    pc.put(s.tokens, s.snapshot())
    e = pc.lookup(ids)
    r = m.new_session()
    r.restore(e.snapshot)
    a = m.prefill(r, ids[16:])
    b = m.prefill(s, ids[16:])
    np.testing.assert_array_equal(a, b)

"""The encoder's barriers (src/gpu/encoder.cpp) on dispatch pairs of every hazard kind, on the simulator under
the forward, reverse and random schedules. Simulator-verified, hardware-unverified.

A dispatch that reads a range written in the current dependency level (read after write), writes a range read
in it (write after read) or writes a range written in it (write after write) must start a new level; reads
of one range, and disjoint ranges of one buffer, share a level. In the whole-graph tests no write after read
is the only reason for its barrier (a read after write separates the pair already), so the encoder without
its write-after-read rule passes them; here every kind is encoded back to back, alone. A missing barrier is
reported by the simulator's own hazard check (msl::CommandBuffer: dispatches of one level that touch the
same memory, one writing) and by the levels the records carry; the results are checked against the pair's
sequential meaning. Each pair is a pair of rmsnorm dispatches (x and w read, y written), float, 64 wide.
"""
import numpy as np
import pytest

from .gpu_harness import SCHEDULES, SIM, ops, run

H = 64
EPS = 1e-6

pytestmark = pytest.mark.skipif(not SIM, reason="dependency levels are simulator records")


def norm(x, w):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def rows(rng, n=1):
    return (rng.standard_normal((n, H)) * 3).astype(np.float32)


def encode(schedule, arrays, pairs, seed=0):
    """Runs rmsnorm(x -> y) for each (x, y) of `pairs` (names of `arrays`, or (name, row) for one row of a
    2-row array: a view of part of its buffer) in one command buffer; returns the level of each dispatch."""
    w = (1 + 0.2 * np.random.default_rng(99).standard_normal(H)).astype(np.float32)
    with run(schedule, seed=seed, keep_records=True) as (dev, enc, buf):
        bufs = {k: buf(a, k) for k, a in arrays.items()}
        wb = buf(w, "w")

        def ref(name):
            if isinstance(name, tuple):
                return bufs[name[0]].view(name[1] * H * 4, H * 4)
            return bufs[name]
        for x, y in pairs:
            ops.rmsnorm(enc, "f32", ref(x), wb, ref(y), 1, H, EPS)
        levels = enc.levels
    got = [r["level"] for r in dev.records()]
    assert levels == max(got) + 1
    return got, w


def close(y, want):
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_hazard_pairs(schedule):
    rng = np.random.default_rng(SCHEDULES.index(schedule))
    # independent: disjoint buffers share a level; so do two reads of one buffer
    a, c = rows(rng), rows(rng)
    b, d, e = (np.zeros((1, H), np.float32) for _ in range(3))
    lv, w = encode(schedule, dict(a=a, b=b, c=c, d=d, e=e), [("a", "b"), ("c", "d"), ("a", "e")])
    assert lv == [0, 0, 0]
    close(b, norm(a, w)), close(d, norm(c, w)), close(e, norm(a, w))
    # read after write: the second reads what the first writes
    a = rows(rng)
    b, c = np.zeros((1, H), np.float32), np.zeros((1, H), np.float32)
    lv, w = encode(schedule, dict(a=a, b=b, c=c), [("a", "b"), ("b", "c")])
    assert lv == [0, 1]
    close(c, norm(norm(a, w), w))
    # write after read: the second overwrites what the first reads
    a, c = rows(rng), rows(rng)
    a0, b = a.copy(), np.zeros((1, H), np.float32)
    lv, w = encode(schedule, dict(a=a, b=b, c=c), [("a", "b"), ("c", "a")])
    assert lv == [0, 1]
    close(b, norm(a0, w)), close(a, norm(c, w))
    # write after write: the second's value stays
    a, c = rows(rng), rows(rng)
    b = np.zeros((1, H), np.float32)
    lv, w = encode(schedule, dict(a=a, b=b, c=c), [("a", "b"), ("c", "b")])
    assert lv == [0, 1]
    close(b, norm(c, w))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_hazards_through_views(schedule):
    """Two rows of one buffer as views: disjoint rows share a level, and a row written then read, read then
    written, or written twice starts a new one (ranges, not buffers, conflict)."""
    rng = np.random.default_rng(10 + SCHEDULES.index(schedule))
    x = rows(rng, 2)
    y = np.zeros((2, H), np.float32)
    x0 = x.copy()
    lv, w = encode(schedule, dict(x=x, y=y), [
        (("x", 0), ("y", 0)), (("x", 1), ("y", 1)),     # level 0: disjoint rows
        (("x", 0), ("x", 1)),                           # level 1: writes x[1], which d1 reads (WAR only)
        (("y", 1), ("y", 1)),                           # level 1: y[1] in place (nothing of level 1 touches it)
        (("y", 0), ("x", 1)),                           # level 2: writes x[1], which d2 writes (WAW only)
        (("x", 1), ("x", 0)),                           # level 3: reads x[1], which d4 writes (RAW only)
    ], seed=SCHEDULES.index(schedule))
    assert lv == [0, 0, 1, 1, 2, 3]
    n = lambda v: norm(v, w)   # noqa: E731
    close(y[0], n(x0[0])), close(y[1], n(n(x0[1])))
    close(x[1], n(n(x0[0]))), close(x[0], n(n(n(x0[0]))))


def test_level_after_barrier_is_minimal():
    """A dispatch conflicting only with an earlier level joins the current one (a barrier clears the level's
    ranges), and an explicit barrier starts a level whatever the declarations say."""
    rng = np.random.default_rng(5)
    a, c = rows(rng), rows(rng)
    b, d, e = (np.zeros((1, H), np.float32) for _ in range(3))
    # d0 a->b; d1 b->d (RAW: level 1); d2 a->e reads a, which level 0 read and nothing writes: level 1
    lv, w = encode("forward", dict(a=a, b=b, c=c, d=d, e=e), [("a", "b"), ("b", "d"), ("a", "e")])
    assert lv == [0, 1, 1]
    close(d, norm(norm(a, w), w)), close(e, norm(a, w))
    w = np.ones(H, np.float32)
    with run("forward", keep_records=True) as (dev, enc, buf):
        ops.rmsnorm(enc, "f32", buf(a), buf(w), buf(b), 1, H, EPS)
        enc.barrier()
        enc.barrier()                                   # consecutive barriers collapse
        ops.rmsnorm(enc, "f32", buf(c), buf(w), buf(d), 1, H, EPS)
        assert enc.levels == 2
    assert [r["level"] for r in dev.records()] == [0, 1]

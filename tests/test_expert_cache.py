"""The expert cache (src/core/expert_cache.h through _core.ExpertCache) on real temporary files of known
bytes: every slot holds exactly its expert's bytes after any sequence of acquires, under every policy, with
and without O_DIRECT and with reads split into odd chunks; LRU and LFU evict what they should; OS rereads;
bad arguments, short and failed reads are refused with errors naming what is wrong, and leave the cache
consistent; stats count what happened."""
import os
import sys
import threading

import numpy as np
import pytest

from qwenmetal import _core
from qwenmetal.memlimit import drop_page_cache

E = 6
# two files; parts at unaligned offsets, strides larger than the parts, and a part ending at end of file
LAYERS = {1: [(0, 101, 1000, 777), (0, 7000, 333, 250)],
          4: [(1, 0, 4096, 4096), (0, 9001, 512, 512)]}
SIZES = (16384, E * 4096)


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(7)
    paths, data = [], []
    for i, n in enumerate(SIZES):
        d = rng.integers(0, 256, n, dtype=np.uint8)
        p = tmp_path / f"f{i}.bin"
        d.tofile(p)
        paths.append(str(p))
        data.append(d)
    return paths, data


def make(paths, slots=3, layers=LAYERS, **kw):
    arrays = {l: [np.zeros(slots * nb, np.uint8) for (_, _, _, nb) in ps] for l, ps in layers.items()}
    return _core.ExpertCache(paths, layers, arrays, num_experts=E, slots_per_layer=slots, **kw), arrays


def expert_bytes(layer):
    return sum(nb for (_, _, _, nb) in LAYERS[layer])


def check(data, arrays, layer, experts, slots):
    for e, s in zip(experts, slots):
        for p, (f, off, stride, nb) in enumerate(LAYERS[layer]):
            got = arrays[layer][p][s * nb:(s + 1) * nb]
            want = data[f][off + e * stride:off + e * stride + nb]
            assert np.array_equal(got, want), f"layer {layer} expert {e} part {p} in slot {s}"


def acquire(c, layer, experts):
    return c.acquire(layer, np.array(experts, np.int32)).tolist()


SEQUENCE = [(1, [0, 1, 2]), (4, [5]), (1, [3, 1]), (1, [4, 5, 0]), (4, [0, 5, 2]), (1, [1]), (1, [2, 3, 4]),
            (4, [1, 3, 4]), (1, [0, 5])]


@pytest.mark.parametrize("policy,direct_io,read_chunk", [
    ("lru", False, 1 << 20), ("lru", False, 100), ("lfu", False, 333), ("os", False, 1 << 20),
    ("lru", True, 1 << 20), ("lfu", True, 1000)])
def test_every_slot_holds_its_expert(files, policy, direct_io, read_chunk):
    paths, data = files
    c, arrays = make(paths, policy=policy, direct_io=direct_io, read_chunk=read_chunk, io_threads=3)
    assert c.slots_per_layer == 3 and c.policy == policy
    for layer, experts in SEQUENCE:
        slots = acquire(c, layer, experts)
        assert len(set(slots)) == len(slots) and all(0 <= s < 3 for s in slots)
        check(data, arrays, layer, experts, slots)
    st = c.stats()
    assert st["lookups"] == sum(len(x) for _, x in SEQUENCE) == st["hits"] + st["misses"]
    if policy != "os":
        assert st["hits"] > 0
    else:   # no reuse: every lookup is read again
        assert st["bytes_read"] == sum(len(x) * expert_bytes(l) for l, x in SEQUENCE)


def test_lru_evicts_least_recently_used_and_never_this_calls_experts(files):
    paths, data = files
    c, arrays = make(paths, slots=3)
    s0, s1, s2 = (acquire(c, 1, [e])[0] for e in (0, 1, 2))
    assert sorted([s0, s1, s2]) == [0, 1, 2]
    assert acquire(c, 1, [0]) == [s0]                 # hit: 0 becomes the most recent
    assert acquire(c, 1, [3]) == [s1]                 # 1 is the least recently used
    assert acquire(c, 1, [1]) == [s2]                 # then 2
    assert acquire(c, 1, [0, 3]) == [s0, s1]          # both still cached
    # 1 (slot s2) is now the LRU, but a call never evicts its own experts
    got = acquire(c, 1, [1, 4, 5])
    assert got[0] == s2 and sorted(got) == [0, 1, 2]
    check(data, arrays, 1, [1, 4, 5], got)
    st = c.stats()
    assert (st["hits"], st["misses"]) == (4, 7)
    assert st["bytes_read"] == 7 * expert_bytes(1)


def test_lfu_evicts_least_frequently_used_ties_by_lru_and_counts_survive_eviction(files):
    paths, data = files
    c, arrays = make(paths, slots=2, policy="lfu")
    a = acquire(c, 1, [1])[0]
    acquire(c, 1, [1])                                # 1: asked twice
    b = acquire(c, 1, [0])[0]                         # 0: once, more recent than 1
    assert acquire(c, 1, [2]) == [b]                  # evicts 0 (count 1 < 2): LRU would evict 1
    assert acquire(c, 1, [0]) == [b]                  # 0 back (count 2), evicting 2 (count 1)
    # resident: 1 (count 2, older) and 0 (count 2 only if its count survived its eviction): a tie goes to
    # the least recently used, 1; had 0's count restarted at 1, 0 would go
    assert acquire(c, 1, [3]) == [a]
    check(data, arrays, 1, [0, 3], [b, a])
    # equal counts from a fresh cache: plain LRU
    c2, _ = make(paths, slots=2, policy="lfu")
    x, y = acquire(c2, 4, [4])[0], acquire(c2, 4, [5])[0]
    assert acquire(c2, 4, [0]) == [x] and acquire(c2, 4, [1]) == [y]


def _page_cache_probe_works(path) -> bool:
    if not sys.platform.startswith("linux") or not hasattr(os, "RWF_NOWAIT"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, 4096, 0)                          # now cached
        return os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT) == 4096
    except OSError:
        return False
    finally:
        os.close(fd)


def test_os_policy_rereads_every_time_and_counts_page_cache_hits(files):
    paths, data = files
    c, arrays = make(paths, slots=3, policy="os")
    for _ in range(2):
        assert acquire(c, 4, [3, 0]) == [0, 1]         # no reuse: expert i takes slot i
        check(data, arrays, 4, [3, 0], [0, 1])
    st = c.stats()
    assert st["lookups"] == 4 and st["bytes_read"] == 4 * expert_bytes(4)
    if _page_cache_probe_works(paths[0]):
        # the files were just written and read: all in the page cache
        assert st["hits"] == 4 and st["misses"] == 0
        # out of the page cache, a read misses (the kernel's readahead for it may bring the other expert's
        # pages in first). DONTNEED is best effort: pages the I/O threads just read can still be held where
        # the kernel cannot drop them, so it is tried until a drop took
        for _ in range(20):
            for p in paths:
                drop_page_cache([p])
            c.reset_stats()
            acquire(c, 4, [3, 0])
            if c.stats()["misses"]:
                break
        assert c.stats()["misses"] >= 1
    else:   # macOS (no probe) and filesystems without RWF_NOWAIT count every lookup a miss
        assert st["misses"] == 4


def test_bad_acquires_are_refused_and_change_nothing(files):
    paths, data = files
    c, arrays = make(paths, slots=2)
    acquire(c, 1, [0, 1])
    before = c.stats()
    with pytest.raises(ValueError, match=r"n must be in \[0, slots_per_layer=2\], got 3"):
        acquire(c, 1, [2, 3, 4])
    with pytest.raises(ValueError, match="experts must be distinct, 3 repeats"):
        acquire(c, 1, [3, 3])
    with pytest.raises(ValueError, match=r"experts\[1\] = 6 out of range \[0, 6\)"):
        acquire(c, 1, [0, 6])
    with pytest.raises(ValueError, match="layer 2 has no routed experts"):
        acquire(c, 2, [0])
    assert c.stats() == before
    assert acquire(c, 1, [1, 0]) == acquire(c, 1, [1, 0])     # still cached, same slots
    assert acquire(c, 1, []) == []
    assert c.stats()["hits"] == before["hits"] + 4


@pytest.mark.parametrize("kw,match", [
    (dict(slots=0), r"slots_per_layer must be in \[1, num_experts=6\], got 0"),
    (dict(slots=7), r"slots_per_layer must be in \[1, num_experts=6\], got 7"),
    (dict(policy="fifo"), "policy must be 'lru', 'lfu' or 'os', got 'fifo'"),
    (dict(policy="os", direct_io=True), "direct_io bypasses the page cache"),
    (dict(io_threads=0), r"io_threads must be in \[1, 64\], got 0"),
    (dict(read_chunk=0), "read_chunk must be >= 1"),
    (dict(layers={1: [(2, 0, 100, 10)]}), r"layer 1 part 0: file index 2 out of range \[0, 2\)"),
    (dict(layers={1: [(0, 0, 100, 200)]}), "stride 100 < nbytes 200"),
])
def test_bad_construction_is_refused(files, kw, match):
    paths, _ = files
    with pytest.raises(ValueError, match=match):
        make(paths, **kw)


def test_slot_arrays_must_fit(files):
    paths, _ = files
    arrays = {l: [np.zeros(3 * nb, np.uint8) for (_, _, _, nb) in ps] for l, ps in LAYERS.items()}
    arrays[4][1] = np.zeros(10, np.uint8)
    with pytest.raises(ValueError, match=r"slots\[4\]\[1\] must have slots_per_layer \* nbytes bytes, has 10"):
        _core.ExpertCache(paths, LAYERS, arrays, num_experts=E, slots_per_layer=3)


def test_missing_and_short_files_are_named(files, tmp_path):
    paths, _ = files
    with pytest.raises(RuntimeError, match="cannot open '.*nope.bin': No such file"):
        make([paths[0], str(tmp_path / "nope.bin")])
    os.truncate(paths[1], SIZES[1] - 1)
    with pytest.raises(RuntimeError, match=r"f1.bin' is 24575 bytes but layer 4 part 0 of expert 5 ends at "
                                           r"byte 24576 \(truncated\?\)"):
        make(paths)


@pytest.mark.parametrize("direct_io", [False, True])
def test_a_short_read_names_file_and_offset_and_leaves_the_cache_consistent(files, direct_io):
    paths, data = files
    c, arrays = make(paths, slots=2, direct_io=direct_io, read_chunk=1000)
    assert acquire(c, 4, [0, 1]) == [0, 1]
    # the file shrinks under the cache: expert 5's first part now ends 100 bytes early
    os.truncate(paths[1], SIZES[1] - 100)
    with pytest.raises(RuntimeError, match=r"reading '.*f1.bin' at offset 23480 \(1000 bytes\).*end of file"):
        acquire(c, 4, [0, 5])
    assert acquire(c, 4, [0]) == [0]                     # the hit survived
    check(data, arrays, 4, [0], [0])
    with pytest.raises(RuntimeError, match="f1.bin"):    # the failed slot was left empty: read again
        acquire(c, 4, [5])
    assert acquire(c, 4, [2, 0]) == [1, 0]               # the empty slot is reused first
    check(data, arrays, 4, [2, 0], [1, 0])


def test_stats_and_reset(files):
    paths, _ = files
    c, _ = make(paths, slots=3)
    acquire(c, 1, [0, 1])
    acquire(c, 1, [1, 2])
    acquire(c, 4, [5])
    st = c.stats()
    assert {k: st[k] for k in ("lookups", "hits", "misses", "bytes_read")} == dict(
        lookups=5, hits=1, misses=4, bytes_read=3 * expert_bytes(1) + expert_bytes(4))
    assert st["io_seconds"] > 0
    c.reset_stats()
    assert c.stats() == dict(lookups=0, hits=0, misses=0, bytes_read=0, io_seconds=0.0)
    acquire(c, 1, [2])
    assert c.stats()["hits"] == 1


def test_concurrent_python_callers_take_turns(files):
    paths, data = files
    c, arrays = make(paths, slots=3, io_threads=2)
    errors = []

    def work(layer, seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(50):
                ex = rng.choice(E, size=int(rng.integers(1, 4)), replace=False).tolist()
                slots = acquire(c, layer, ex)
                check(data, arrays, layer, ex, slots)
        except BaseException as e:   # reported by the main thread
            errors.append(e)

    # one thread per layer: a thread checks its slots after its acquire, which another layer's acquire
    # never touches
    threads = [threading.Thread(target=work, args=(l, s)) for l, s in ((1, 0), (4, 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors

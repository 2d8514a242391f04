"""Memory read bandwidth: every thread streams its share of a buffer far larger than the last-level
cache, best of N passes, in a child process (so its buffer stays out of the benchmark's peak RSS)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from ..memlimit import drop_page_cache

_BW_CHILD = r"""
import json, sys, threading, time
import numpy as np
nbytes, threads, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
buf = np.empty(nbytes // 64 * 64, np.uint8)
buf[::4096] = 1                                  # fault every page in before timing
buf[:] = 7
parts = [p.view(np.uint64) for p in np.array_split(buf.view(np.uint64), threads)]
try:
    from qwenmetal import _core
    reader = _core.bench_read_bytes if hasattr(_core, "bench_read_bytes") else None
except Exception:
    reader = None
method = "qwenmetal._core.bench_read_bytes" if reader is not None else "numpy.bitwise_or.reduce"
isa = _core.bench_read_isa() if reader is not None else None
def read(p):
    if reader is not None:
        reader(p)
    else:
        np.bitwise_or.reduce(p)
samples = []
for r in range(repeats + 1):
    ths = [threading.Thread(target=read, args=(p,)) for p in parts]
    t = time.perf_counter()
    for th in ths: th.start()
    for th in ths: th.join()
    dt = time.perf_counter() - t
    if r:                                        # the first pass is a warm-up
        samples.append(buf.nbytes / dt / 1e9)
print(json.dumps({"read_gbps": max(samples), "samples_gbps": samples, "buffer_bytes": int(buf.nbytes),
                  "threads": threads, "method": method, "isa": isa}))
"""


def measure_read_bandwidth(threads: int = 2, nbytes: int = 2 << 30, repeats: int = 5) -> dict:
    """Best-of-`repeats` read bandwidth (GB/s, 1e9 bytes) of `threads` threads each streaming its share
    of an `nbytes` buffer, measured in a child process (so its buffer stays out of this process's RSS)."""
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", _BW_CHILD, str(int(nbytes)), str(int(threads)), str(int(repeats))],
                         check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_file_read(paths, nbytes: int = 1 << 30, threads: int = 4, chunk: int = 4 << 20) -> dict:
    """Cold read bandwidth of the disk holding `paths` (files, e.g. the checkpoint's shards): their pages
    are evicted from the page cache first (POSIX_FADV_DONTNEED), then up to `nbytes` of them are read with
    `threads` threads of `chunk`-byte preads -- the access pattern of expert streaming's I/O pool, at a
    larger request size. GB/s = 1e9 bytes. Evicted again afterwards, so the benchmark starts cold."""


    spans, left = [], int(nbytes)
    for p in paths:
        n = min(os.path.getsize(p), left)
        spans += [(str(p), off, min(chunk, n - off)) for off in range(0, n, chunk)]
        left -= n
        if left <= 0:
            break
    drop_page_cache(paths)
    lock, todo = threading.Lock(), list(reversed(spans))

    def worker():
        fds = {}
        try:
            while True:
                with lock:
                    if not todo:
                        return
                    path, off, n = todo.pop()
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY)
                os.pread(fd, n, off)
        finally:
            for fd in fds.values():
                os.close(fd)

    ths = [threading.Thread(target=worker) for _ in range(threads)]
    t = time.perf_counter()
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    dt = time.perf_counter() - t
    drop_page_cache(paths)
    total = sum(s[2] for s in spans)
    return {"read_gbps": total / dt / 1e9, "bytes": total, "threads": threads, "chunk_bytes": chunk,
            "method": "cold pread of the checkpoint files after POSIX_FADV_DONTNEED"}

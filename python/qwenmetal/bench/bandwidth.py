"""Memory read bandwidth: every thread streams its share of a buffer far larger than the last-level
cache, best of N passes, in a child process (so its buffer stays out of the benchmark's peak RSS)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

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

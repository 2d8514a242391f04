"""Other work on the machine: busy fractions from /proc/stat, the CPU time foreign processes used while a
block ran, and waiting for a quiet machine (timings on 2 shared cores are unreliable under load)."""
from __future__ import annotations

import os
import resource
import time
from typing import Callable


def _cpu_times():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v), idle


def busy_fraction(seconds: float = 2.0) -> float | None:
    """Fraction of the machine's CPU time spent busy over the next `seconds` (None where /proc/stat is
    missing). Call it while nothing of ours runs to see other work on the box."""
    try:
        t0, i0 = _cpu_times()
        time.sleep(seconds)
        t1, i1 = _cpu_times()
    except OSError:
        return None
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


class ForeignLoad:
    """CPU time other processes used while a block ran: the machine's busy time from /proc/stat minus ours
    (this process and its finished children). ``fraction`` is that over the machine's capacity
    (wall time x CPUs); 0 means nothing else ran."""

    def __enter__(self):
        self._start = self._sample()
        return self

    def __exit__(self, *exc):
        end = self._sample()
        self.fraction = None
        if self._start is None or end is None:
            return False
        (b0, w0, o0), (b1, w1, o1) = self._start, end
        cpus = _usable_cpus_total()
        self.fraction = max(0.0, ((b1 - b0) - (o1 - o0)) / max(1e-9, (w1 - w0) * cpus))
        return False

    @staticmethod
    def _sample():
        try:
            total, idle = _cpu_times()
        except OSError:
            return None
        ru_s, ru_c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        ours = ru_s.ru_utime + ru_s.ru_stime + ru_c.ru_utime + ru_c.ru_stime
        return (total - idle) / os.sysconf("SC_CLK_TCK"), time.monotonic(), ours


def _usable_cpus_total() -> int:
    return os.cpu_count() or 1


def wait_quiet(max_wait: float, threshold: float = 0.10, log: Callable[[str], None] | None = None) -> float | None:
    """Wait (at most `max_wait` seconds) until other processes use less than `threshold` of the CPUs over a
    3-second window; returns the last busy fraction seen. Timings taken under foreign load are unreliable
    (2 cores, threads that wait for each other)."""
    deadline = time.monotonic() + max_wait
    busy = busy_fraction(3.0)
    said = False
    while busy is not None and busy > threshold and time.monotonic() < deadline:
        if log and not said:
            log(f"  waiting for the machine to be quiet (other processes use {100 * busy:.0f}% of the CPUs) ...")
            said = True
        busy = busy_fraction(3.0)
    return busy

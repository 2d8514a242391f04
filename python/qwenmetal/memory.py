"""What memory this process may use: /proc/meminfo, this process's memory cgroups (v1 and v2) and their
limits, physical memory, and the size strings users write ("8GiB"). One probe, used by expert streaming's
``memory_budget="auto"``, the reference backend's size check and the cgroup runner (`qwenmetal.memlimit`).
"""
from __future__ import annotations

import os
import re
import sys

from .errors import InputError

# "auto" leaves this share of the memory it finds to the kernel (Linux: reclaim headroom above MemAvailable
# or the cgroup limit) or to macOS and the other apps (macOS: of physical memory, as Metal's default
# working-set limit does).
AUTO_HEADROOM = {"linux": 1 / 16, "darwin": 1 / 4}
_UNLIMITED = 1 << 60     # cgroup v1 writes "no limit" as 2^63 rounded down to a page


def own_cgroups(proc: str = "/proc") -> dict[str, str]:
    """Controller list ("" for the v2 unified hierarchy) -> this process's cgroup path, from
    /proc/self/cgroup. Raises OSError if it cannot be read."""
    out = {}
    with open(os.path.join(proc, "self", "cgroup"), encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) == 3:
                out[parts[1]] = parts[2]
    return out


def total_memory() -> int:
    """Physical memory in bytes (0 if the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def read_int(path: str | os.PathLike) -> int | None:
    """The integer in a cgroup/proc file, None if absent or not a number ("max")."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def cgroup_memory_limit(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """The tightest memory limit on this process's cgroup and its ancestors (v2 memory.max, v1
    memory.limit_in_bytes), or None. Paths in /proc/self/cgroup are tried under `cgroup_root` (v1: under its
    memory/ hierarchy), walking up to the root: in a container the namespace root's files hold the limit."""
    try:
        own = own_cgroups(proc)
    except OSError:
        return None
    limits = []
    for controllers, path in own.items():
        if controllers == "":
            base, fname = cgroup_root, "memory.max"
        elif "memory" in controllers.split(","):
            base, fname = os.path.join(cgroup_root, "memory"), "memory.limit_in_bytes"
        else:
            continue
        rel = path.strip("/")
        while True:
            v = read_int(os.path.join(base, rel, fname))
            if v is not None and 0 < v < _UNLIMITED:
                limits.append(v)
            if not rel:
                break
            rel = os.path.dirname(rel)
    return min(limits) if limits else None


def mem_available(proc: str = "/proc") -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None."""
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            for line in f:
                m = re.match(r"MemAvailable:\s+(\d+)\s+kB", line)
                if m:
                    return int(m.group(1)) * 1024
    except OSError:
        pass
    return None


def available_memory(*, proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup", platform: str | None = None) -> int:
    """Bytes a model may use here, what ``memory_budget="auto"`` resolves to. Linux: min(MemAvailable, the
    cgroup memory limit) less AUTO_HEADROOM; macOS: physical memory (hw.memsize) less AUTO_HEADROOM;
    elsewhere physical memory as sysconf reports it."""
    platform = platform or sys.platform
    if platform.startswith("linux"):
        found = [v for v in (mem_available(proc), cgroup_memory_limit(proc, cgroup_root)) if v is not None]
        if found:
            return int(min(found) * (1 - AUTO_HEADROOM["linux"]))
    total = total_memory()    # hw.memsize on macOS
    return int(total * (1 - AUTO_HEADROOM.get("darwin" if platform == "darwin" else "linux")))


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def parse_budget(value, param: str = "memory_budget"):
    """A memory budget as given: None, "auto", an int of bytes, or a string "<number>[unit]" (K/M/G/T and
    KiB/MiB/GiB/TiB are binary, KB/MB/GB/TB decimal) -> None | "auto" | int bytes."""
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InputError(f"{param} must be 'auto', None, a number of bytes or a string like '8GiB', "
                         f"got {value!r}", param)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise InputError(f"{param} must be 'auto', a number of bytes or a size like '8GiB', got {value!r}", param)
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise InputError(f"{param} must be positive, got {value}", param)
    return value

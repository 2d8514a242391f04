"""Run a Python child process under a real memory limit: a memory cgroup created for it under this
process's own memory cgroup, so that everything the child charges -- its RSS *and* the page cache it
faults in (mapped weights, pread expert bytes) -- counts against the limit, as on a machine with that
much RAM. Used by tests/test_memory_limit.py (a checkpoint larger than the limit generates correctly)
and by ``qwenmetal bench --memory-limit`` (the streaming benchmark).

    from qwenmetal import memlimit
    if (why := memlimit.unavailable_reason()) is None:
        run = memlimit.run_python(CODE, limit_bytes=256 << 20, args=[ckpt])
        run.result, run.peak_bytes, run.vmhwm_bytes, run.oom_kills

The child runs ``python -c CODE ARGS...`` and hands back a JSON value with :func:`report` (it writes the
file named by ``$QWENMETAL_MEMLIMIT_RESULT``). Needs write access to the memory cgroup hierarchy (root,
or a delegated cgroup v2 subtree):

* cgroup v1 (the ``memory`` controller mounted on its own): ``memory.limit_in_bytes``, and
  ``memory.memsw.limit_in_bytes`` set to the same value where swap accounting exists (so the child
  cannot escape the limit into swap); the peak is ``memory.max_usage_in_bytes``.
* cgroup v2: ``memory.max`` and ``memory.swap.max = 0``; the peak is ``memory.peak`` (Linux >= 5.19;
  on older kernels ``memory.current`` is sampled every 5 ms and the peak is a lower bound -- the run
  says so in ``peak_method``).

The child's peak RSS (VmHWM) comes from ``wait4``'s rusage. The cgroup is removed after the run (any
process of ours still in it is killed first). Page cache the child charges to the cgroup is moved to
the parent cgroup by the kernel on removal.

Page cache already resident before the run is charged to whoever faulted it in, not to the child: pass
the files the child will read as ``drop_cache`` to evict their unmapped pages first (``fsync`` +
``POSIX_FADV_DONTNEED``), so that the child's reads are charged to it. Pages mapped by another process
(for instance a model this process has loaded from the same files) cannot be evicted: release it first.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .memory import own_cgroups

RESULT_ENV = "QWENMETAL_MEMLIMIT_RESULT"


class MemoryLimitUnavailable(RuntimeError):
    """The OS gives this process no way to put a child under a memory limit (no writable memory cgroup)."""


@dataclass(frozen=True)
class MemoryCgroup:
    version: int        # 1 or 2
    parent: Path        # this process's own memory cgroup directory (children are created in it)


@dataclass(frozen=True)
class LimitedRun:
    returncode: int             # negative: killed by that signal (-9 after the OOM killer)
    result: Any                 # the JSON value the child passed to report(), None if it did not
    stdout: str
    stderr: str
    limit_bytes: int
    peak_bytes: int             # the cgroup's peak usage: RSS + page cache + kernel memory charged to it
    peak_method: str            # "max_usage_in_bytes" (v1) | "memory.peak" (v2) | "sampled memory.current"
    vmhwm_bytes: int            # the child's peak resident set (wait4 rusage ru_maxrss)
    oom_kills: int              # OOM kills inside the cgroup during the run
    limit_hits: int             # times the usage reached the limit and the kernel had to reclaim (v1
    #                             memory.failcnt, v2 memory.events "max"): > 0 means the limit bit
    seconds: float
    cgroup_version: int

    def summary(self) -> dict:
        """The memory figures of the run, for a benchmark's JSON."""
        return {"limit_bytes": self.limit_bytes, "peak_bytes": self.peak_bytes, "peak_method": self.peak_method,
                "vmhwm_bytes": self.vmhwm_bytes, "oom_kills": self.oom_kills, "limit_hits": self.limit_hits,
                "cgroup_version": self.cgroup_version, "returncode": self.returncode, "seconds": self.seconds}

    def check(self, result: bool = True) -> "LimitedRun":
        """Raise RuntimeError with the child's stderr unless it exited 0 and (with `result`) reported a result."""
        if self.returncode != 0 or (result and self.result is None):
            what = (f"killed by signal {-self.returncode}" if self.returncode < 0 else f"exit status {self.returncode}")
            raise RuntimeError(f"the child under a {self.limit_bytes / 2**20:.0f} MiB memory limit failed ({what}, "
                               f"{self.oom_kills} OOM kills, cgroup peak {self.peak_bytes / 2**20:.1f} MiB); "
                               f"stderr:\n{self.stderr[-4000:]}")
        return self


def report(value: Any) -> None:
    """In the child: hand `value` (JSON-serialisable) back to :func:`run_python`."""
    path = os.environ.get(RESULT_ENV)
    if not path:
        raise RuntimeError(f"report() called outside a memlimit child (${RESULT_ENV} is not set)")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f)


# ---------------------------------------------------------------------------------------------------
# finding our memory cgroup
# ---------------------------------------------------------------------------------------------------
def _mounts() -> list[tuple[str, str, str, str]]:
    """(mount root within the hierarchy, mount point, fs type, super options) of every cgroup mount."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fields, tail = pre.split(), post.split()
            if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                out.append((fields[3], fields[4].replace("\\040", " "), tail[0], tail[2]))
    return out


def _under_mount(mount_root: str, mount_point: str, path: str) -> Path | None:
    rel = os.path.relpath(path, mount_root) if mount_root != "/" else path.lstrip("/")
    if rel.startswith(".."):
        return None                     # our cgroup is outside what this mount shows
    return Path(mount_point) / ("" if rel == "." else rel)


def find_memory_cgroup() -> MemoryCgroup:
    """This process's memory cgroup, if we can create children in it; MemoryLimitUnavailable (with the
    reason) otherwise."""
    if not sys.platform.startswith("linux"):
        raise MemoryLimitUnavailable(f"memory cgroups are Linux-only (this is {sys.platform})")
    try:
        mounts, own = _mounts(), own_cgroups()
    except OSError as e:
        raise MemoryLimitUnavailable(f"cannot read /proc/self/mountinfo or /proc/self/cgroup: {e}") from None
    reasons = []
    for root, point, fstype, opts in mounts:       # v1: a hierarchy with the memory controller
        if fstype == "cgroup" and "memory" in opts.split(","):
            path = next((p for c, p in own.items() if "memory" in c.split(",")), None)
            d = _under_mount(root, point, path) if path is not None else None
            if d is None or not (d / "memory.limit_in_bytes").is_file():
                reasons.append(f"cgroup v1 memory hierarchy at {point} does not show our cgroup {path!r}")
            elif not os.access(d, os.W_OK):
                reasons.append(f"no write access to {d} (cgroup v1; needs root)")
            else:
                return MemoryCgroup(1, d)
    for root, point, fstype, _ in mounts:          # v2: the unified hierarchy, memory enabled for children
        if fstype == "cgroup2" and "" in own:
            d = _under_mount(root, point, own[""])
            if d is None or not (d / "cgroup.controllers").is_file():
                reasons.append(f"cgroup v2 at {point} does not show our cgroup {own['']!r}")
                continue
            if "memory" not in (d / "cgroup.controllers").read_text().split():
                reasons.append(f"the memory controller is not available in {d} (cgroup v2)")
            elif not os.access(d, os.W_OK):
                reasons.append(f"no write access to {d} (cgroup v2; needs root or a delegated subtree)")
            else:
                return MemoryCgroup(2, d)
    raise MemoryLimitUnavailable("no usable memory cgroup: " + ("; ".join(reasons) or "none mounted"))


def unavailable_reason() -> str | None:
    """None when :func:`run_python` can limit memory here, else why not."""
    try:
        find_memory_cgroup()
    except MemoryLimitUnavailable as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------------------------
# the limited cgroup
# ---------------------------------------------------------------------------------------------------
def _write(path: Path, value: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(value)


def _read_int(path: Path) -> int:
    return int(path.read_text().split()[0])


def _keyed(path: Path, key: str) -> int:
    """The value of `key` in a flat-keyed cgroup file (memory.oom_control, memory.events); 0 if absent."""
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except OSError:
        pass
    return 0


class _Cgroup:
    """A fresh child cgroup of `cg.parent` with `limit` bytes of memory and no swap."""

    def __init__(self, cg: MemoryCgroup, limit: int):
        self.version = cg.version
        if cg.version == 2:
            sub = (cg.parent / "cgroup.subtree_control")
            if "memory" not in sub.read_text().split():
                try:
                    _write(sub, "+memory")
                except OSError as e:     # v2's "no internal processes": a cgroup with members cannot delegate
                    raise MemoryLimitUnavailable(f"cannot enable the memory controller for children of "
                                                 f"{cg.parent}: {e}") from None
        self.dir = Path(tempfile.mkdtemp(prefix=f"qwenmetal-memlimit-{os.getpid()}-", dir=cg.parent))
        try:
            if self.version == 1:
                _write(self.dir / "memory.limit_in_bytes", str(limit))
                if (self.dir / "memory.memsw.limit_in_bytes").exists():
                    _write(self.dir / "memory.memsw.limit_in_bytes", str(limit))
            else:
                _write(self.dir / "memory.max", str(limit))
                if (self.dir / "memory.swap.max").exists():
                    _write(self.dir / "memory.swap.max", "0")
        except BaseException:
            self.remove()
            raise
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def join_self(self) -> None:
        """Move the calling process into the cgroup (called in the child between fork and exec)."""
        _write(self.dir / "cgroup.procs", str(os.getpid()))

    def start_sampling(self) -> None:
        if self.version == 2 and not (self.dir / "memory.peak").exists():
            def sample():
                while not self._stop.wait(0.005):
                    try:
                        self._samples.append(_read_int(self.dir / "memory.current"))
                    except OSError:
                        return
            self._sampler = threading.Thread(target=sample, daemon=True)
            self._sampler.start()

    def peak(self) -> tuple[int, str]:
        if self.version == 1:
            return _read_int(self.dir / "memory.max_usage_in_bytes"), "max_usage_in_bytes"
        if (self.dir / "memory.peak").exists():
            return _read_int(self.dir / "memory.peak"), "memory.peak"
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()
        return max(self._samples, default=0), "sampled memory.current"

    def oom_kills(self) -> int:
        if self.version == 1:
            return _keyed(self.dir / "memory.oom_control", "oom_kill")
        return _keyed(self.dir / "memory.events", "oom_kill")

    def limit_hits(self) -> int:
        if self.version == 1:
            return _read_int(self.dir / "memory.failcnt")
        return _keyed(self.dir / "memory.events", "max")

    def remove(self) -> None:
        """Kill what is left of our child's process tree in the cgroup, then remove it."""
        self._stop.set()
        for _ in range(50):
            try:
                pids = [int(p) for p in (self.dir / "cgroup.procs").read_text().split()]
            except OSError:
                pids = []
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.rmdir(self.dir)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)
        os.rmdir(self.dir)          # still busy after a second: raise the OSError


def drop_page_cache(paths: Iterable[str | os.PathLike]) -> None:
    """Evict the unmapped page-cache pages of each file (POSIX_FADV_DONTNEED); directories: every file in
    them. The file is fsync'ed first: DONTNEED skips dirty pages, and a file written moments ago (a test
    fixture generated in the same run) is still mostly dirty. DONTNEED is given twice: the first call only
    drains the per-CPU batches that pages just read still sit in, which the kernel cannot drop from
    (measured: one call left 30 of 40 fresh files cached)."""
    for p in paths:
        p = Path(p)
        for f in (sorted(x for x in p.iterdir() if x.is_file()) if p.is_dir() else [p]):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_python(code: str, limit_bytes: int, *, args: Sequence[str] = (), **kw) -> LimitedRun:
    """:func:`run` of ``python -c code *args``; the child hands back a value with :func:`report`."""
    return run([sys.executable, "-c", code, *args], limit_bytes, **kw)


def run(argv: Sequence[str], limit_bytes: int, *, env: Mapping[str, str] | None = None,
        timeout: float | None = None, drop_cache: Iterable[str | os.PathLike] = (),
        stderr_to_ours: bool = False) -> LimitedRun:
    """Run the command `argv` in a new memory cgroup limited to `limit_bytes` (RSS + page cache, no swap)
    and return what happened (:class:`LimitedRun`). `env` replaces the environment (default: ours);
    `timeout` seconds, after which the child is killed; `drop_cache`: files / directories to evict from
    the page cache first (see the module docstring); `stderr_to_ours`: the child's stderr goes to ours
    (progress of a long run) instead of into ``LimitedRun.stderr``. Raises MemoryLimitUnavailable where
    the OS gives no way to limit memory."""
    if not isinstance(limit_bytes, int) or isinstance(limit_bytes, bool) or limit_bytes <= 0:
        raise ValueError(f"limit_bytes must be a positive int, got {limit_bytes!r}")
    cg_info = find_memory_cgroup()
    drop_page_cache(drop_cache)
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="qwenmetal-memlimit-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        env[RESULT_ENV] = result_path
        cg = _Cgroup(cg_info, limit_bytes)
        try:
            with open(os.path.join(tmp, "out"), "w+b") as out, open(os.path.join(tmp, "err"), "w+b") as err:
                t0 = time.perf_counter()
                proc = subprocess.Popen(list(argv), env=env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=None if stderr_to_ours else err, preexec_fn=cg.join_self)
                cg.start_sampling()
                timer = threading.Timer(timeout, proc.kill) if timeout else None
                if timer:
                    timer.start()
                try:
                    # wait4 instead of proc.wait(): its rusage carries the child's peak RSS
                    _, status, ru = os.wait4(proc.pid, 0)
                finally:
                    if timer:
                        timer.cancel()
                proc.returncode = os.waitstatus_to_exitcode(status)
                seconds = time.perf_counter() - t0
                peak, method = cg.peak()
                ooms, hits = cg.oom_kills(), cg.limit_hits()
                out.seek(0)
                err.seek(0)
                stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        finally:
            cg.remove()
        result = None
        if os.path.exists(result_path):
            with open(result_path, encoding="utf-8") as f:
                result = json.load(f)
    return LimitedRun(returncode=proc.returncode, result=result, stdout=stdout, stderr=stderr,
                      limit_bytes=limit_bytes, peak_bytes=peak, peak_method=method,
                      vmhwm_bytes=ru.ru_maxrss * 1024, oom_kills=ooms, limit_hits=hits, seconds=seconds,
                      cgroup_version=cg_info.version)

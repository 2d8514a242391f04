"""Run Metal compute kernels on the CPU: the msl_sim simulator (simulator-verified, hardware-unverified).

    from qwenmetal import msl_sim as sim
    lib = sim.builtin_library()                 # metal/*.metal, compiled into qwenmetal._core at build time
    lib = sim.compile("my_kernels.metal")       # or MSL source text: built now with the system C++ compiler
    counters = lib.dispatch("qmv_q4_sbf16_f32", threadgroups=(N // 8, 1), threads_per_threadgroup=(32, 2),
                            buffers=[None, w, scales, biases, x, y],          # params bind first: buffer(0)
                            params={0: sim.pack("IIIII", K, N, 64, K, N)}, schedule="random", seed=3)

``buffers`` are numpy arrays bound to ``[[buffer(0)]], [[buffer(1)]], ...`` in order and written in place
(``None`` leaves an index unbound); ``params`` is a ``setBytes`` blob (``bytes``, e.g. from :func:`pack`, or
a numpy array) bound at the next index, or a dict ``{index: blob}``. The grid is given in threadgroups, as
``dispatchThreadgroups`` does. Kernel errors -- a barrier or SIMD-group function reached by only part of its
group, a read of never-written threadgroup memory, threadgroup memory over 32 KB, more than 1024 threads,
an unbound buffer, an out-of-bounds access -- raise :class:`MetalSimError` naming the kernel, the
threadgroup and the source line.

:class:`CommandBuffer` records dispatches between memory barriers (dependency levels) with per-dispatch
counters, executing them or only encoding them (``execute=False``, with :class:`VirtualBuffer` in place of
data) so that a whole model configuration can be costed without its weights.

What the simulator checks and what it cannot is in ``docs/verification.md`` ("Metal simulator").
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import itertools
import os
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .native import core
from .paths import cache_dir

_core = core()
_m = _core.msl_sim
MetalSimError = _m.MetalSimError

__all__ = ["MetalSimError", "MetalSimCompileError", "Library", "CommandBuffer", "VirtualBuffer", "compile",
           "builtin_library", "pack", "include_dir", "kernel_path", "find_compiler", "info"]

SCHEDULES = ("forward", "reverse", "random")


class MetalSimCompileError(MetalSimError):
    """A kernel source failed to compile (the message carries the compiler's diagnostics)."""


# ------------------------------------------------------------------------------------------ locations
_PKG = Path(__file__).resolve().parent
_REPO = _PKG.parent.parent  # source checkout: python/qwenmetal -> repo root


_IN_CHECKOUT = (_REPO / "src" / "msl_sim" / "include" / "metal_stdlib").is_file() and (_REPO / "tools").is_dir()


def include_dir() -> Path:
    """Directory holding ``metal_stdlib`` and the simulator shim: the source tree's when this module runs from a
    checkout (editable install), else the copy installed with the package."""
    installed = (Path(_core.__file__).resolve().parent / "msl_include", _PKG / "msl_include")
    source = (_REPO / "src" / "msl_sim" / "include",)
    for d in (source + installed if _IN_CHECKOUT else installed + source):
        if (d / "metal_stdlib").is_file():
            return d
    raise MetalSimError("qwenmetal.msl_sim: the msl_sim shim headers are not installed (msl_include/ missing)")


def _metal_dir() -> Path | None:
    installed = (Path(_core.__file__).resolve().parent / "metal", _PKG / "metal")
    for d in ((_REPO / "metal",) + installed if _IN_CHECKOUT else installed + (_REPO / "metal",)):
        if (d / "common.h").is_file():
            return d
    return None


def kernel_path(name: str) -> Path:
    """Path of one of the project's kernel files (e.g. ``"quant.metal"``), installed or in the checkout."""
    d = _metal_dir()
    if d is None or not (d / name).is_file():
        raise FileNotFoundError(f"qwenmetal.msl_sim: no kernel file {name!r} (looked in {d})")
    return d / name


def _mslpp():
    cands = (include_dir() / "mslpp.py", _REPO / "tools" / "mslpp.py")
    for p in (cands[::-1] if _IN_CHECKOUT else cands):
        if p.is_file():
            spec = importlib.util.spec_from_file_location("qwenmetal_mslpp", p)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
    raise MetalSimError("qwenmetal.msl_sim: mslpp.py (the kernel source rewriter) is not installed")


def info() -> dict:
    """ABI version, fiber switch in use, limits."""
    return dict(_m.info())


# ------------------------------------------------------------------------------------------ compiler
def find_compiler(cxx: str | None = None) -> str:
    """The C++ compiler used by :func:`compile`: ``cxx``, else ``$CXX``, else c++ / g++ / clang++ on PATH."""
    explicit = cxx or os.environ.get("CXX")
    if explicit:
        if shutil.which(explicit.split()[0]):
            return explicit
        raise MetalSimError(f"qwenmetal.msl_sim.compile: the C++ compiler {explicit!r} (from "
                            f"{'cxx=' if cxx else '$CXX'}) was not found")
    for c in ["c++", "g++", "clang++", "clang++-19", "clang++-18", "clang++-17", "clang++-16", "clang++-15"]:
        if shutil.which(c):
            return c
    raise MetalSimError(
        "qwenmetal.msl_sim.compile needs a C++17 compiler (g++ >= 12 or clang++ >= 15) to build kernels at run time, "
        "and none was found: install one or set CXX. (sim.builtin_library() needs no compiler.)")


def _compiler_id(cxx: str) -> str:
    try:
        out = subprocess.run(cxx.split() + ["--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise MetalSimError(f"qwenmetal.msl_sim: cannot run the C++ compiler {cxx!r}: {e}") from e
    return out.strip().splitlines()[0] if out.strip() else cxx


def _cache_root() -> Path:
    root = cache_dir("msl")
    try:
        root.mkdir(parents=True, exist_ok=True)
        return root
    except OSError:
        d = Path(tempfile.gettempdir()) / f"qwenmetal-msl-{os.getuid()}"
        d.mkdir(parents=True, exist_ok=True)
        return d


def _file_hash(p: Path) -> str:
    try:
        return hashlib.sha256(p.read_bytes()).hexdigest()
    except OSError:
        return "missing"


def _deps_ok(entry: Path) -> bool:
    """The cached plugin's recorded dependencies (headers it included) are unchanged."""
    rec = entry / "deps.txt"
    if not (entry / "kernels.so").is_file() or not rec.is_file():
        return False
    for line in rec.read_text().splitlines():
        h, _, path = line.partition(" ")
        if _file_hash(Path(path)) != h:
            return False
    return True


def _parse_depfile(text: str) -> list[str]:
    body = text.split(":", 1)[1] if ":" in text else ""
    body = body.replace("\\\n", " ")
    return [t.replace("\\ ", " ") for t in re.split(r"(?<!\\)\s+", body) if t]


_loaded: dict[str, Any] = {}


def compile(source: str | os.PathLike, *, checked: bool = True, defines: Mapping[str, Any] | None = None,
            include_dirs: Iterable[str | os.PathLike] = (), cxx: str | None = None, opt: str = "-O2",
            name: str | None = None) -> "Library":
    """Compile a Metal kernel file (a path) or MSL source text into a :class:`Library`, now.

    The source is rewritten by mslpp (line numbers kept), compiled as C++17 (C++20 for a Metal 4 tensor-op file) by the system compiler against
    the shim headers into a plugin .so, cached under ``paths.cache_dir("msl")/<hash>/`` (the one cache rule, docs/usage.md)
    and loaded. ``checked`` (default) bounds-checks device and threadgroup accesses and
    reports reads of never-written threadgroup memory. ``#include "x.h"`` finds the source's directory,
    ``include_dirs`` and the project's ``metal/`` headers.
    """
    src_path: Path | None = None
    if isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source
                                            and source.strip().endswith((".metal", ".h", ".msl"))):
        src_path = Path(source)
        if not src_path.is_file():
            raise FileNotFoundError(f"qwenmetal.msl_sim.compile: no such file: {src_path}")
        text = src_path.read_text(encoding="utf-8")
        origin = name or str(source)
    else:
        text = str(source)
        origin = name or "<source>.metal"
    cxx = find_compiler(cxx)
    compiler = _compiler_id(cxx)
    rewritten = _mslpp().rewrite(text, "sim", checked, "plugin", origin)

    inc = [include_dir()]
    if src_path is not None:
        inc.append(src_path.resolve().parent)
    inc += [Path(d).resolve() for d in include_dirs]
    md = _metal_dir()
    if md is not None:
        inc.append(md)
    flags = [f"-std={_mslpp().cxx_std(text)}", opt, "-fPIC", "-shared", "-fvisibility=hidden", "-fvisibility-inlines-hidden",
             "-fno-strict-aliasing"]
    if "clang" not in compiler.lower():
        flags.append("-fno-gnu-unique")
    for k, v in sorted((defines or {}).items()):
        flags.append(f"-D{k}" if v is None else f"-D{k}={v}")
    flags += [f"-I{d}" for d in inc]

    key = hashlib.sha256("\0".join([rewritten, compiler, cxx, " ".join(flags), str(info()["abi_version"])])
                         .encode()).hexdigest()[:24]
    entry = _cache_root() / key
    entry.mkdir(parents=True, exist_ok=True)
    so = entry / "kernels.so"
    with open(entry / "lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        if not _deps_ok(entry):
            cpp = entry / "kernels.cpp"
            cpp.write_text(rewritten, encoding="utf-8")
            tmp = entry / f"kernels.{os.getpid()}.so"
            cmd = cxx.split() + flags + ["-MD", "-MF", str(entry / "kernels.d"), "-o", str(tmp), str(cpp)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                tmp.unlink(missing_ok=True)
                raise MetalSimCompileError(f"qwenmetal.msl_sim.compile: {origin} failed to compile with {cxx}:\n"
                                           + (r.stderr or r.stdout).strip())
            deps = _parse_depfile((entry / "kernels.d").read_text())
            deps = [d for d in deps if Path(d).resolve() != cpp.resolve()]
            (entry / "deps.txt").write_text("".join(f"{_file_hash(Path(d))} {Path(d).resolve()}\n" for d in deps))
            os.replace(tmp, so)
            _loaded.pop(str(so), None)
    path = str(so)
    if path not in _loaded:
        # a rebuilt plugin gets a fresh file name so that dlopen cannot hand back the stale mapping
        dst = entry / f"kernels.{_file_hash(so)[:12]}.so"
        if not dst.exists():
            shutil.copyfile(so, dst)
        _loaded[path] = _m.load_library(str(dst))
    return Library(_loaded[path], origin)


_builtin: "Library | None" = None


def builtin_library() -> "Library":
    """The project's kernels (metal/*.metal), compiled into qwenmetal._core at build time."""
    global _builtin
    if _builtin is None:
        _builtin = Library(_m.builtin_library(), "builtin")
    return _builtin


# ------------------------------------------------------------------------------------------ buffers
_vaddr = itertools.count(1)


class VirtualBuffer:
    """A buffer with a size and an identity but no memory, for encode-only command buffers."""

    def __init__(self, nbytes: int, name: str = ""):
        self.nbytes = int(nbytes)
        self.name = name
        self.addr = next(_vaddr) << 44  # disjoint from each other and from host addresses

    def __repr__(self):
        return f"VirtualBuffer({self.nbytes}{', ' + repr(self.name) if self.name else ''})"


def pack(fmt: str, *values) -> bytes:
    """``struct.pack`` with native sizes and C alignment (``@``), padded to a multiple of 4 bytes:
    a setBytes blob for a ``constant Params&`` kernel argument (``I`` uint, ``i`` int, ``f`` float, ...)."""
    b = struct.pack("@" + fmt.lstrip("@=<>!"), *values)
    return b + b"\0" * (-len(b) % 4)


def _blob(v) -> bytes:
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    if isinstance(v, np.ndarray) or np.isscalar(v):
        return np.ascontiguousarray(v).tobytes()
    raise TypeError(f"params must be bytes (e.g. sim.pack(...)) or a numpy array, not {type(v).__name__}")


def _declared(spec, i: int, nbytes: int) -> int:
    if spec is None:
        return -1
    v = spec.get(i) if isinstance(spec, Mapping) else (spec[i] if i < len(spec) else None)
    if v is None or v is False:
        return 0
    if v is True:
        return nbytes
    return int(v)


def _bindings(buffers: Sequence, params, reads, writes, executing: bool) -> list:
    out: list = []
    for i, b in enumerate(buffers):
        if b is None:
            out.append(None)
            continue
        if isinstance(b, VirtualBuffer):
            out.append((0, b.nbytes, b.addr, _declared(reads, i, b.nbytes), _declared(writes, i, b.nbytes)))
            continue
        if isinstance(b, (bytes, bytearray, memoryview)):
            blob = bytes(b)
            out.append((blob, len(blob), 0, len(blob), 0))
            continue
        if not isinstance(b, np.ndarray):
            raise TypeError(f"buffer({i}) must be a numpy array, a VirtualBuffer, bytes or None, not {type(b).__name__}")
        if not b.flags.c_contiguous:
            raise ValueError(f"buffer({i}) must be C-contiguous (a copy would not be written back)")
        w = _declared(writes, i, b.nbytes)
        if w != 0 and not b.flags.writeable and writes is not None:
            raise ValueError(f"buffer({i}) is read-only but declared written")
        ptr = b.__array_interface__["data"][0]
        out.append((ptr, b.nbytes, ptr, _declared(reads, i, b.nbytes), w))
    if params is not None:
        items = params.items() if isinstance(params, Mapping) else [(len(buffers), params)]
        for idx, v in items:
            idx = int(idx)
            while len(out) <= idx:
                out.append(None)
            if out[idx] is not None:
                raise ValueError(f"params bound at buffer({idx}), which already holds a buffer")
            blob = _blob(v)
            out[idx] = (blob, len(blob), 0, len(blob), 0)
    return out


def _dims(v, what: str) -> tuple[int, int, int]:
    t = (int(v),) if np.isscalar(v) else tuple(int(x) for x in v)
    if not 1 <= len(t) <= 3:
        raise ValueError(f"{what} must have 1 to 3 dimensions")
    return t + (1,) * (3 - len(t))


# ------------------------------------------------------------------------------------------ library
class Library:
    """A set of kernels looked up by Metal host name (``INSTANTIATE_KERNEL``'s name or the function name)."""

    def __init__(self, lib, origin: str):
        self._lib = lib
        self.origin = origin

    @property
    def kernels(self) -> list[str]:
        return [k["name"] for k in self._lib.kernels()]

    def kernel_info(self, name: str) -> dict:
        for k in self._lib.kernels():
            if k["name"] == name:
                return dict(k)
        raise KeyError(name)

    def __contains__(self, name: str) -> bool:
        return name in self.kernels

    def __repr__(self):
        return f"<qwenmetal.msl_sim.Library {self.origin}: {len(self.kernels)} kernels>"

    def dispatch(self, kernel: str, threadgroups, threads_per_threadgroup, buffers: Sequence = (), params=None, *,
                 schedule: str = "forward", seed: int = 0, reads=None, writes=None,
                 threadgroup_memory: Sequence[int] | None = None, workers: int | None = None,
                 count_banks: bool = False) -> dict:
        """Run one dispatch now (``dispatchThreadgroups(threadgroups, threads_per_threadgroup)``) and return
        its counters. ``schedule``: the order in which threads of a group run between synchronisation points
        ("forward", "reverse" or seeded "random", also used for the order of threadgroups).
        ``reads``/``writes``: bytes the kernel reads/writes per buffer index ({index: nbytes or True}), as a
        host wrapper declares them (counters and hazard checks). ``threadgroup_memory``: lengths of
        ``[[threadgroup(i)]]`` arguments. ``count_banks``: also count threadgroup-memory bank conflicts (the
        record's ``banks``: SIMD-group accesses, conflicted ones, replays; docs/metal.md, "What the simulator
        counts")."""
        cb = CommandBuffer(execute=True)
        return cb.dispatch(self, kernel, threadgroups, threads_per_threadgroup, buffers, params, schedule=schedule,
                           seed=seed, reads=reads, writes=writes, threadgroup_memory=threadgroup_memory,
                           workers=workers, count_banks=count_banks)

    def check_schedules(self, kernel: str, threadgroups, threads_per_threadgroup, buffers: Sequence = (),
                        params=None, *, seeds: Sequence[int] = (1, 2), **kw) -> dict:
        """Dispatch under every schedule -- forward (on ``buffers``, in place), reverse and random with each
        seed (on copies of the inputs) -- and raise :class:`MetalSimError` if any buffer ends up different:
        the result depends on thread order, i.e. a race (typically a missing barrier)."""
        arrays = [b for b in buffers if isinstance(b, np.ndarray)]
        originals = [a.copy() for a in arrays]
        counters = self.dispatch(kernel, threadgroups, threads_per_threadgroup, buffers, params,
                                 schedule="forward", **kw)
        runs = [("reverse", 0)] + [("random", s) for s in seeds]
        for sched, seed in runs:
            copies = [o.copy() for o in originals]
            it = iter(copies)
            bufs = [next(it) if isinstance(b, np.ndarray) else b for b in buffers]
            self.dispatch(kernel, threadgroups, threads_per_threadgroup, bufs, params, schedule=sched, seed=seed, **kw)
            for i, (a, c) in enumerate(zip(arrays, copies)):
                ab, cb_ = a.view(np.uint8).ravel(), c.view(np.uint8).ravel()
                if not np.array_equal(ab, cb_):
                    idx = [j for j, b in enumerate(buffers) if b is a][0]
                    av, cv = a.ravel(), c.ravel()
                    diff = np.flatnonzero((av.view(np.uint8).reshape(av.size, -1) !=
                                           cv.view(np.uint8).reshape(cv.size, -1)).any(axis=1))
                    j = int(diff[0])
                    where = f"{sched}" + (f"(seed={seed})" if sched == "random" else "")
                    raise MetalSimError(
                        f"msl_sim: kernel '{kernel}': the result depends on the thread schedule: buffer({idx}) "
                        f"differs between forward and {where} in {diff.size} of {av.size} elements (first: element "
                        f"{j}, {av[j]!r} vs {cv[j]!r}): a race, typically a missing threadgroup_barrier")
        return counters


class CommandBuffer:
    """Dispatches between memory barriers, as in one command buffer with a concurrent compute encoder.

    ``execute=True`` runs each dispatch as it is encoded; ``execute=False`` only records it (encode-only:
    buffers may be :class:`VirtualBuffer`). Dispatches in one dependency level may run concurrently on a
    GPU, so two of them touching the same memory with at least one writing raise :class:`MetalSimError`
    (``concurrent=False`` models a serial encoder: every dispatch is its own level)."""

    def __init__(self, execute: bool = True, concurrent: bool = True):
        self._cb = _m.CommandBuffer(execute, concurrent)

    @property
    def level(self) -> int:
        return self._cb.level

    def barrier(self) -> None:
        """``memoryBarrierWithScope(MTLBarrierScopeBuffers)``: later dispatches see earlier writes."""
        self._cb.barrier()

    def dispatch(self, library: Library, kernel: str, threadgroups, threads_per_threadgroup, buffers: Sequence = (),
                 params=None, *, schedule: str = "forward", seed: int = 0, reads=None, writes=None,
                 threadgroup_memory: Sequence[int] | None = None, workers: int | None = None,
                 count_banks: bool = False) -> dict:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, not {schedule!r}")
        b = _bindings(buffers, params, reads, writes, self._cb.executes)
        return self._cb.dispatch(library._lib, kernel, _dims(threadgroups, "threadgroups"),
                                 _dims(threads_per_threadgroup, "threads_per_threadgroup"), b, schedule, int(seed),
                                 int(workers or 0), [int(x) for x in (threadgroup_memory or ())],
                                 bool(count_banks))

    @property
    def dispatches(self) -> list[dict]:
        return self._cb.records()

    def counters(self) -> dict:
        """Per-dispatch records plus command-buffer totals (see docs/verification.md for the format)."""
        recs = self._cb.records()
        by_kernel: dict[str, dict] = {}
        for r in recs:
            k = by_kernel.setdefault(r["kernel"], {"dispatches": 0, "threads": 0, "bytes_read": 0, "bytes_written": 0})
            k["dispatches"] += 1
            k["threads"] += r["threads"]
            k["bytes_read"] += r["bytes_read"]
            k["bytes_written"] += r["bytes_written"]
        tgm = [r["threadgroup_memory"] for r in recs if r["threadgroup_memory"] is not None]
        return {
            "dispatches": recs,
            "num_dispatches": len(recs),
            "levels": (max(r["level"] for r in recs) + 1) if recs else 0,
            "barriers": (max(r["level"] for r in recs)) if recs else 0,
            "threads": sum(r["threads"] for r in recs),
            "bytes_read": sum(r["bytes_read"] for r in recs),
            "bytes_written": sum(r["bytes_written"] for r in recs),
            "threadgroup_memory_max": max(tgm) if tgm else None,
            "by_kernel": by_kernel,
            "executed": self._cb.executes,
        }

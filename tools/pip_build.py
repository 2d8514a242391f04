"""The build step of `pip install .`: configures and builds the real project in a persistent directory.

Run by the thin project of cmake/pip_build.cmake (scikit-build-core's build step; that file says why):

1. copies nanobind from pip's temporary build environment to a fixed path, rewriting only the files
   whose content changed (their times too), so that nothing that includes it is recompiled;
2. configures the real project in --build once, and again only when its settings (--init) changed:
   then the old cache goes, the object files stay, and ninja recompiles only what the new settings
   change;
3. builds it, passing the output on (pip shows it with -v) and writing a short progress report to the
   terminal (/dev/tty) if there is one: pip shows nothing of a build's output otherwise, and a clean
   build takes a minute or two. QWENMETAL_BUILD_PROGRESS=0 turns the report off.

Standard library only: it runs under the interpreter being installed into, not the build environment.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

STATUS = re.compile(r"^\[(\d+)/(\d+)\]\s+(.*)$")
# the environment variables CMake takes the compilers and their flags from: a change configures again
ENV_SETTINGS = ("CC", "CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "MACOSX_DEPLOYMENT_TARGET", "ARCHFLAGS",
                "SDKROOT")


def cached_source_dir(cache: Path) -> str | None:
    """The source directory a CMake cache was made for, or None."""
    try:
        for line in cache.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("CMAKE_HOME_DIRECTORY:"):
                return line.split("=", 1)[1]
    except OSError:
        pass
    return None


class Progress:
    """Progress lines on the terminal: one when the build starts, one per tenth of the steps (and at
    least every 20 s while steps finish), one at the end. Each line starts with a carriage return and
    clears the line, so pip's spinner character does not stay in front of it."""

    def __init__(self, out=None, clock=time.monotonic):
        self.out = out
        self.clock = clock
        self.t0 = clock()
        self.last_tenth = -1
        self.last_t = self.t0
        self.total = 0
        self.done = 0

    @classmethod
    def open_terminal(cls) -> "Progress":
        if os.environ.get("QWENMETAL_BUILD_PROGRESS", "1") == "0" or sys.stdout.isatty():
            return cls(None)        # off, or the output itself is on the terminal already
        try:
            fd = os.open("/dev/tty", os.O_WRONLY | getattr(os, "O_NOCTTY", 0))
        except OSError:
            return cls(None)        # no terminal (CI, a pipe): pip -v still shows the build's output
        return cls(os.fdopen(fd, "w", buffering=1, encoding="utf-8", errors="replace"))

    def say(self, text: str) -> None:
        if self.out is not None:
            try:
                self.out.write(f"\r\033[K{text}\n")
                self.out.flush()
            except OSError:
                self.out = None

    def elapsed(self) -> str:
        s = int(self.clock() - self.t0)
        return f"{s // 60}:{s % 60:02d}"

    def line(self, text: str) -> None:
        """One line of the build's output."""
        m = STATUS.match(text)
        if not m or "Re-checking globbed" in text or "Re-running CMake" in text:
            return
        self.done, self.total = int(m.group(1)), int(m.group(2))
        tenth = 10 * self.done // max(self.total, 1)
        now = self.clock()
        if tenth > self.last_tenth or now - self.last_t >= 20:
            self.last_tenth, self.last_t = tenth, now
            self.say(f"qwenmetal:   [{self.done}/{self.total}] {100 * self.done // max(self.total, 1):3d}%  "
                     f"{self.elapsed()}  {short(m.group(3))}")


def short(desc: str) -> str:
    """'Building CXX object CMakeFiles/t.dir/src/cpu/x.cpp.o' -> 'src/cpu/x.cpp'."""
    m = re.search(r"CMakeFiles/([^/]+)\.dir/(.+?)\.o(bj)?$", desc)
    if not m:
        return desc
    target, path = m.group(1), m.group(2)
    if path.startswith("Unity/"):                 # Unity/unity_0_cxx.cxx: several files of a target
        return f"{target}: {path[len('Unity/'):].split('_cxx')[0]}"
    return re.sub(r"^(.*/)?msl_gen/", "metal/", path).replace(".metal.cpp", ".metal")


def sync_tree(src: Path, dst: Path) -> int:
    """Make dst a copy of src, rewriting only files whose content differs; returns how many changed."""
    changed = 0
    wanted = set()
    for f in src.rglob("*"):
        if f.is_dir() or "__pycache__" in f.parts:
            continue
        rel = f.relative_to(src)
        wanted.add(rel)
        d = dst / rel
        data = f.read_bytes()
        if d.is_file() and d.read_bytes() == data:
            continue
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = d.with_name(d.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, d)
        changed += 1
    for f in list(dst.rglob("*")) if dst.exists() else []:
        if f.is_file() and f.relative_to(dst) not in wanted:
            f.unlink()
            changed += 1
    return changed


def run(cmd: list[str], progress: Progress | None = None) -> int:
    """Runs cmd with its output passed on line by line (and to `progress`)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                         bufsize=1)
    assert p.stdout is not None
    for line in p.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if progress is not None:
            progress.line(line.rstrip("\n"))
    return p.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", required=True, type=Path)
    ap.add_argument("--build", required=True, type=Path, help="the inner build directory")
    ap.add_argument("--init", required=True, type=Path, help="the inner build's settings (cmake -C)")
    ap.add_argument("--generator", required=True)
    ap.add_argument("--cmake", default="cmake")
    ap.add_argument("--nanobind", required=True, type=Path, help="nanobind's package directory")
    ap.add_argument("--nanobind-copy", required=True, type=Path)
    a = ap.parse_args(argv)
    prog = Progress.open_terminal()

    n = sync_tree(a.nanobind, a.nanobind_copy)
    if n:
        print(f"pip_build: nanobind copied to {a.nanobind_copy} ({n} files changed)", flush=True)

    # the settings: the outer build's cache entries, and the environment the compiler is found from
    settings = a.init.read_text(encoding="utf-8") + "".join(
        f"# env {k}={os.environ[k]}\n" for k in ENV_SETTINGS if k in os.environ)
    saved = a.build / "qwenmetal-init.cmake"
    cache = a.build / "CMakeCache.txt"
    home = cached_source_dir(cache)
    if home is not None and Path(home).resolve() != a.source.resolve():
        # a tree copied from elsewhere (a container build of the same checkout): nothing to reuse
        print(f"pip_build: {a.build} was configured for {home}: starting afresh", flush=True)
        shutil.rmtree(a.build)
    if not cache.exists() or not saved.exists() or saved.read_text(encoding="utf-8") != settings:
        prog.say(f"qwenmetal: configuring the C++ build in {a.build}")
        if cache.exists():
            print("pip_build: the build settings changed: configuring again (object files kept)", flush=True)
            cache.unlink()
        a.build.mkdir(parents=True, exist_ok=True)
        (a.build / "qwenmetal-init.cmake.new").write_text(settings, encoding="utf-8")
        rc = run([a.cmake, "-S", str(a.source), "-B", str(a.build), "-G", a.generator,
                  "-C", str(a.build / "qwenmetal-init.cmake.new")])
        if rc != 0:
            prog.say("qwenmetal: configuring failed (pip install -v . shows why)")
            return rc
        os.replace(a.build / "qwenmetal-init.cmake.new", saved)

    clean = not (a.build / ".ninja_log").exists()
    prog.say("qwenmetal: building the C++ extension" +
             (" from scratch (about 1.5 minutes on 2 cores; pip install -v . shows each step)" if clean else ""))
    rc = run([a.cmake, "--build", str(a.build)], prog)
    if rc != 0:
        prog.say(f"qwenmetal: the build failed after {prog.elapsed()} (pip install -v . shows why)")
        return rc
    if prog.total:
        prog.say(f"qwenmetal: built in {prog.elapsed()} ({prog.total} steps)")
    else:
        prog.say("qwenmetal: the C++ extension is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())

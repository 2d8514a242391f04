#!/usr/bin/env python3
"""Type-check Metal kernel files with clang (>= 15) in syntax-only mode, MSL address spaces enforced.

Each file is rewritten by mslpp (``--mode check``: threadgroup declarations become static, vector
constructors become declared functions; line numbers kept) and compiled with
``clang++ -std=c++17 (c++20 for tensor-op files) -fsyntax-only -DMSL_SIM_CHECK_AS`` against ``src/msl_sim/include``, where
``<metal_stdlib>`` maps ``device``/``constant``/``threadgroup`` to address spaces 1/2/3 (``constant`` is also
const). Diagnostics name the .metal file and line. Exit status 1 if any file fails, 2 if no suitable clang.

    python3 tools/msl_check.py metal/*.metal          # clang: $MSL_CLANG, else the newest clang++(-N) >= 15
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INCLUDE = ROOT / "src" / "msl_sim" / "include"
MIN_CLANG = 15


def _mslpp():
    spec = importlib.util.spec_from_file_location("mslpp", Path(__file__).resolve().parent / "mslpp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def clang_version(exe: str) -> int | None:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"clang version (\d+)", out)
    return int(m.group(1)) if m else None


def find_clang(min_version: int = MIN_CLANG) -> str | None:
    """$MSL_CLANG if set, else the newest clang++-N (or clang++) on PATH with N >= min_version."""
    env = os.environ.get("MSL_CLANG")
    if env:
        v = clang_version(env)
        return env if v is not None and v >= min_version else None
    best = None
    names = [f"clang++-{n}" for n in range(30, min_version - 1, -1)] + ["clang++"]
    for n in names:
        exe = shutil.which(n)
        if exe:
            v = clang_version(exe)
            if v is not None and v >= min_version and (best is None or v > best[0]):
                best = (v, exe)
    return best[1] if best else None


def check_file(path: str | os.PathLike, clang: str, include_dirs=()) -> tuple[bool, str]:
    """(ok, diagnostics) for one .metal file."""
    path = Path(path)
    src = path.read_text(encoding="utf-8")
    try:
        origin = str(path.resolve().relative_to(ROOT))
    except ValueError:
        origin = str(path)
    pp = _mslpp()
    text = pp.rewrite(src, "check", True, "check", origin)
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td) / (path.stem + ".check.cpp")
        tmp.write_text(text, encoding="utf-8")
        cmd = [clang, f"-std={pp.cxx_std(src)}", "-fsyntax-only", "-DMSL_SIM_CHECK_AS", "-Wno-unknown-attributes",
               "-Wno-user-defined-literals", "-ferror-limit=50", f"-I{INCLUDE}", f"-I{path.resolve().parent}",
               f"-I{ROOT / 'metal'}"] + [f"-I{d}" for d in include_dirs] + ["-x", "c++", str(tmp)]
        r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode == 0, (r.stderr + r.stdout).strip()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    files = argv or sorted(str(p) for p in (ROOT / "metal").glob("*.metal"))
    clang = find_clang()
    if clang is None:
        print(f"msl_check: no clang++ >= {MIN_CLANG} found (apt-get install clang-19, or set MSL_CLANG)",
              file=sys.stderr)
        return 2
    bad = 0
    for f in files:
        ok, diag = check_file(f, clang)
        print(f"{'ok  ' if ok else 'FAIL'} {f}")
        if diag:
            print(diag)
        bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

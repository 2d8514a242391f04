#!/usr/bin/env python3
"""Type-check the Objective-C++ Metal device on a machine without Apple's SDK.

``src/metal/device.mm`` is compiled with clang (>= 15) in syntax-only mode as Objective-C++ under ARC,
against the stand-in declarations in ``src/metal/decls/`` (``<Metal/Metal.h>``, ``<Foundation/Foundation.h>``:
exactly the API subset device.mm uses, written from Apple's documentation), with every warning an error:

    clang++ -fsyntax-only -x objective-c++ -std=c++17 -fobjc-arc -fobjc-runtime=macosx-14.0 -fblocks
            -Wall -Wextra -Werror -I src/metal/decls -I src src/metal/device.mm

``-fobjc-runtime=macosx-14.0`` is needed off Apple: clang's default runtime on Linux is the legacy GNU one,
for which it refuses ``-fobjc-arc``; with -fsyntax-only no runtime library or header is used (NSObject and
``nil`` come from the stand-in). ``-fblocks`` enables blocks (the completed handler), on by default only
on Apple targets. This catches what the compiler front end sees: selectors that do not exist or have the
wrong arity, messages sent to the wrong protocol, argument and return type mismatches, block signatures,
ARC violations (retain/release/autorelease, casts between object and C pointers without __bridge), and
plain C++ errors. It proves nothing about run time or about Apple's real headers (docs/metal.md).

The nanobind registration (src/bindings/gpu_metal.cpp, Apple-only) is checked as C++ with
-DQWENMETAL_CHECK_METAL_BINDINGS when nanobind's headers are importable.

    python3 tools/metal_device_check.py          # exit 1 on errors, 2 without a suitable clang
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEVICE = ROOT / "src" / "metal" / "device.mm"
DECLS = ROOT / "src" / "metal" / "decls"
BINDINGS = ROOT / "src" / "bindings" / "gpu_metal.cpp"

OBJC_FLAGS = ["-fsyntax-only", "-x", "objective-c++", "-std=c++17", "-fobjc-arc", "-fobjc-runtime=macosx-14.0",
              "-fblocks", "-Wall", "-Wextra", "-Werror", "-ferror-limit=50", f"-I{DECLS}", f"-I{ROOT / 'src'}"]


def _msl_check():
    spec = importlib.util.spec_from_file_location("msl_check", Path(__file__).resolve().parent / "msl_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MIN_CLANG = 15


def find_clang() -> str | None:
    """$MSL_CLANG if set, else the newest clang++(-N) >= 15 on PATH (tools/msl_check.py's rule)."""
    return _msl_check().find_clang(MIN_CLANG)


def check_source(text: str, clang: str, name: str = "device.mm", extra=()) -> tuple[bool, str]:
    """(ok, diagnostics) for Objective-C++ source text (diagnostics name the file `name`)."""
    with tempfile.TemporaryDirectory() as td:
        p = Path(td) / name
        p.write_text(text, encoding="utf-8")
        r = subprocess.run([clang, *OBJC_FLAGS, *extra, str(p)], capture_output=True, text=True)
    return r.returncode == 0, (r.stderr + r.stdout).strip()


def check_device(clang: str, path: str | os.PathLike = DEVICE) -> tuple[bool, str]:
    r = subprocess.run([clang, *OBJC_FLAGS, str(path)], capture_output=True, text=True)
    return r.returncode == 0, (r.stderr + r.stdout).strip()


def nanobind_includes() -> list[str] | None:
    """The -I flags for nanobind and Python's headers, or None when nanobind is not importable."""
    try:
        import nanobind  # noqa: F401
    except ImportError:
        return None
    inc = Path(nanobind.include_dir())
    return [f"-I{inc}", f"-I{inc.parent / 'ext' / 'robin_map' / 'include'}",
            f"-I{sysconfig.get_paths()['include']}"]


def check_bindings(clang: str, path: str | os.PathLike = BINDINGS) -> tuple[bool, str] | None:
    """(ok, diagnostics) for the nanobind registration as C++, or None without nanobind's headers."""
    inc = nanobind_includes()
    if inc is None:
        return None
    cmd = [clang, "-fsyntax-only", "-x", "c++", "-std=c++17", "-DQWENMETAL_CHECK_METAL_BINDINGS", "-Wall", "-Wextra",
           "-Werror", f"-I{ROOT / 'src'}", *inc, str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode == 0, (r.stderr + r.stdout).strip()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    clang = find_clang()
    if clang is None:
        print(f"metal_device_check: no clang++ >= {MIN_CLANG} found (apt-get install clang-19, or set MSL_CLANG)",
              file=sys.stderr)
        return 2
    bad = 0
    for f in argv or [str(DEVICE)]:
        ok, diag = check_device(clang, f)
        print(f"{'ok  ' if ok else 'FAIL'} {f}")
        if diag:
            print(diag)
        bad += not ok
    if not argv:
        res = check_bindings(clang)
        if res is None:
            print(f"skip {BINDINGS.relative_to(ROOT)} (nanobind is not importable)")
        else:
            ok, diag = res
            print(f"{'ok  ' if ok else 'FAIL'} {BINDINGS.relative_to(ROOT)}")
            if diag:
                print(diag)
            bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

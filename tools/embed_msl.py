#!/usr/bin/env python3
"""Embed the Metal kernel sources in the binary: one flattened MSL source per kernel family.

MetalDevice (src/metal/device.mm) compiles MSL at run time with newLibraryWithSource:, which has no
include path, and a Mac with only the Command Line Tools has no `metal` compiler to build a metallib
ahead of time. So each ``metal/<family>.metal`` is flattened here: every quoted ``#include "x.h"`` is
replaced by the header's text, resolved next to the including file and then in metal/, the way the
preprocessor would do it with ``-I metal`` (a header with ``#pragma once`` is inlined once per family,
its ``#pragma once`` line blanked; a header without it at every include; angle includes such as
``<metal_stdlib>`` stay). ``#line`` directives are kept around every inlined header, so the Metal
compiler's diagnostics name ``metal/<file>:<line>`` of the original files, not lines of the flattened
text.

A quoted include inside ``#if``/``#ifdef``/``#ifndef`` is rejected: inlining it unconditionally while
honouring ``#pragma once`` could differ from what the preprocessor does (tests/test_embed_msl.py checks
that every flattened family preprocesses to exactly the tokens of the original with ``-I metal``).

The output is a C++ file defining the table declared in src/metal/msl_sources.h: one entry per family
with the flattened source as a raw string literal (delimiter chosen so that ``)delim"`` does not occur
in the text), the kernel host names the family exports (``INSTANTIATE_KERNEL("name", ...)`` and
plain ``kernel void name(...)``, the same rule the simulator's registration uses, tools/mslpp.py) and the
MSL version it is compiled with (``LANGUAGE_VERSION`` below, also read by tools/msl_conform.py).

    python3 tools/embed_msl.py -o build/msl_sources.cpp            # every metal/*.metal
    python3 tools/embed_msl.py --print norm                         # one flattened family on stdout
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METAL_DIR = ROOT / "metal"

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"\s*(?://.*|/\*.*\*/\s*)?$')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\b")
_COND_OPEN = re.compile(r"^\s*#\s*(if|ifdef|ifndef)\b")
_COND_CLOSE = re.compile(r"^\s*#\s*endif\b")
_INSTANTIATE = re.compile(r'\bINSTANTIATE_KERNEL\s*\(\s*"([^"\\]+)"\s*,')

# The Metal Shading Language version each family is written for: MetalDevice compiles the family with
# MTLCompileOptions.languageVersion set to it (the generated table's MslSource::language_version), and
# tools/msl_conform.py checks the family against it (bfloat needs 3.1, tensor operations 4.0, a C++17
# feature 4.0, ...). One table for both, so the version the checker assumes is the one the Mac compiles with.
# A family not listed here is written for DEFAULT_LANGUAGE_VERSION.
DEFAULT_LANGUAGE_VERSION = "3.1"
LANGUAGE_VERSION = {
    "gemm_tensor": "4.0",  # Metal 4 tensor operations (<metal_tensor>, MetalPerformancePrimitives' matmul2d)
}
_VERSION_FORMAT = re.compile(r"^[1-9]\d*\.\d+$")


class EmbedError(Exception):
    pass


def _mslpp():
    spec = importlib.util.spec_from_file_location("mslpp", Path(__file__).resolve().parent / "mslpp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _origin(path: Path, metal_dir: Path) -> str:
    """The file name the #line directives carry: metal/<name> for files of the metal folder."""
    try:
        return "metal/" + path.resolve().relative_to(metal_dir.resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def _line_directive(line: int, origin: str) -> str:
    return '#line %d "%s"\n' % (line, origin.replace("\\", "/").replace('"', '\\"'))


def _code_lines(text: str):
    """(line number, line, in_comment) for each line; in_comment: the line starts inside a /* */ comment."""
    in_block = False
    for i, line in enumerate(text.splitlines(), 1):
        starts_in = in_block
        j = 0
        while j < len(line):
            if in_block:
                k = line.find("*/", j)
                if k < 0:
                    j = len(line)
                    continue
                in_block, j = False, k + 2
            else:
                k1, k2 = line.find("/*", j), line.find("//", j)
                if k1 >= 0 and (k2 < 0 or k1 < k2):
                    in_block, j = True, k1 + 2
                else:
                    j = len(line)
        yield i, line, starts_in


def flatten(path: str | Path, metal_dir: str | Path = METAL_DIR) -> str:
    """One translation unit: `path` with its quoted includes inlined (see the module docstring)."""
    path, metal_dir = Path(path), Path(metal_dir)
    once: set[Path] = set()
    out: list[str] = []

    def resolve(name: str, including: Path) -> Path:
        for d in (including.parent, metal_dir):
            p = (d / name)
            if p.is_file():
                return p.resolve()
        raise EmbedError(f"{_origin(including, metal_dir)}: #include \"{name}\" not found next to it or in "
                         f"{metal_dir}")

    def emit(p: Path, stack: tuple) -> None:
        if p in stack:
            chain = " -> ".join(_origin(s, metal_dir) for s in stack + (p,))
            raise EmbedError(f"include cycle: {chain}")
        text = p.read_text(encoding="utf-8")
        if any(_PRAGMA_ONCE.match(line) for _, line, c in _code_lines(text) if not c):
            once.add(p)
        origin = _origin(p, metal_dir)
        out.append(_line_directive(1, origin))
        depth = 0
        for n, line, in_comment in _code_lines(text):
            if not in_comment:
                if _COND_OPEN.match(line):
                    depth += 1
                elif _COND_CLOSE.match(line):
                    depth -= 1
                if _PRAGMA_ONCE.match(line):
                    out.append("\n")
                    continue
                m = _INCLUDE.match(line)
                if m:
                    if depth > 0:
                        raise EmbedError(f"{origin}:{n}: a quoted #include inside #if/#ifdef/#ifndef is not "
                                         "supported by tools/embed_msl.py (move it out of the conditional)")
                    h = resolve(m.group(1), p)
                    if h not in once:
                        emit(h, stack + (p,))
                    out.append(_line_directive(n + 1, origin))
                    continue
            out.append(line + "\n")

    emit(path.resolve(), ())
    return "".join(out)


def kernel_names(source: str) -> list[str]:
    """Host names the flattened source exports: INSTANTIATE_KERNEL("name", ...) and plain kernels."""
    mslpp = _mslpp()
    text = mslpp.blank_comments(source)
    names = [m.group(1) for m in _INSTANTIATE.finditer(text)]
    names += [k for k, _ in mslpp.plain_kernels(text)]
    seen, out = set(), []
    for n in names:
        if n not in seen:
            seen.add(n)
            out.append(n)
    return out


def language_version(family: str) -> str:
    """The MSL version ("3.1", "4.0") family `family` (metal/<family>.metal) is compiled with and checked against."""
    version = LANGUAGE_VERSION.get(family, DEFAULT_LANGUAGE_VERSION)
    if not _VERSION_FORMAT.match(version):
        raise EmbedError(f"LANGUAGE_VERSION[{family!r}] = {version!r} is not a version like \"3.1\"")
    return version


def raw_delimiter(text: str) -> str:
    """A raw-string delimiter d (at most 16 characters) with `)d"` nowhere in text."""
    for i in range(100000):
        d = "QMSL" if i == 0 else f"QMSL{i}"
        if f'){d}"' not in text:
            return d
    raise EmbedError("no raw string delimiter found")


def _c_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def families(metal_dir: str | Path = METAL_DIR, files=None) -> list[tuple[str, str, str, list[str]]]:
    """[(family, origin, flattened source, kernel names)] for metal/*.metal (or the given files), by name."""
    metal_dir = Path(metal_dir)
    paths = sorted(Path(f) for f in files) if files else sorted(metal_dir.glob("*.metal"))
    out = []
    for p in paths:
        src = flatten(p, metal_dir)
        out.append((p.stem, _origin(p, metal_dir), src, kernel_names(src)))
    return out


def emit_cpp(fams) -> str:
    parts = ["// Generated by tools/embed_msl.py from metal/*.metal: do not edit.\n"
             "// One flattened MSL source per kernel family (quoted includes inlined, #line kept), compiled by\n"
             "// MetalDevice with newLibraryWithSource: at first use (src/metal/msl_sources.h).\n"
             "#include \"metal/msl_sources.h\"\n\n"
             "namespace qwenmetal::gpu {\n\nnamespace {\n"]
    for i, (fam, origin, src, names) in enumerate(fams):
        d = raw_delimiter(src)
        parts.append(f"\n// {origin}\nconst char source_{i}[] = R\"{d}(" + src + f"){d}\";\n")
        parts.append(f"const char* const kernels_{i}[] = {{" +
                     "".join(_c_string(n) + ", " for n in names) + "nullptr};\n")
    parts.append("\n}  // namespace\n\n")
    parts.append("extern const MslSource kMslSources[] = {\n")
    for i, (fam, origin, src, names) in enumerate(fams):
        parts.append(f"    {{{_c_string(fam)}, {_c_string(origin)}, source_{i}, sizeof(source_{i}) - 1, "
                     f"kernels_{i}, {len(names)}, {_c_string(language_version(fam))}}},\n")
    if not fams:
        parts.append("    {nullptr, nullptr, nullptr, 0, nullptr, 0, nullptr},\n")
    parts.append("};\n")
    parts.append(f"extern const size_t kMslSourceCount = {len(fams)};\n\n}}  // namespace qwenmetal::gpu\n")
    return "".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="kernel files (default: every <metal-dir>/*.metal)")
    ap.add_argument("--metal-dir", default=str(METAL_DIR))
    ap.add_argument("-o", "--output", help="the C++ file to write")
    ap.add_argument("--print", metavar="FAMILY", help="print one family's flattened source instead")
    a = ap.parse_args(argv)
    try:
        fams = families(a.metal_dir, a.files or None)
    except (EmbedError, OSError) as e:
        print(f"embed_msl: {e}", file=sys.stderr)
        return 1
    if a.print:
        for fam, _, src, _ in fams:
            if fam == a.print:
                sys.stdout.write(src)
                return 0
        print(f"embed_msl: no family {a.print!r} (have: {', '.join(f for f, *_ in fams)})", file=sys.stderr)
        return 1
    if not a.output:
        ap.error("-o/--output or --print is required")
    text = emit_cpp(fams)
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists() or out.read_text(encoding="utf-8") != text:
        out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

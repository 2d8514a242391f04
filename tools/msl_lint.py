#!/usr/bin/env python3
"""msl_lint: reject in Metal kernel files what MSL does not have, and what the simulator would mis-model.

g++/clang accept plenty that Apple's Metal compiler rejects; the simulator compiles kernels as C++, so
without this lint such code would pass CI and fail on a Mac. Checked on comment- and string-stripped
source (line numbers reported):

  MSL has no ...        std::  new / delete  throw / try / catch  virtual  double (and long double)
                        printf and friends  goto  thread_local  recursion (a function calling itself,
                        where the call is visible in its own body)  #include <...> other than <metal_*> and
                        <MetalPerformancePrimitives/MetalPerformancePrimitives.h> (outside
                        `#ifndef __METAL_VERSION__` blocks of the shared headers)
  house rules           every kernel parameter carries an attribute ([[buffer(i)]], ...): the simulator
  (docs/metal.md)       binds arguments through them;  kernel-scope threadgroup variables are arrays
                        (T name[N], also for one value): the simulator tracks reads of never-written
                        threadgroup memory through array subscripts;  floating literals carry a suffix
                        (0.5f, 1.0h): unsuffixed ones are float in MSL but double in C++, so the
                        simulator would compute something else than the GPU.

    python3 tools/msl_lint.py metal/*.metal        # exit status 1 if anything is found
"""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _mslpp():
    spec = importlib.util.spec_from_file_location("mslpp", HERE / "mslpp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FORBIDDEN = [
    (r"\bstd\s*::", "std:: does not exist in MSL (use metal:: functions)"),
    (r"\bnew\b", "`new`: MSL has no dynamic allocation"),
    (r"\bdelete\b", "`delete`: MSL has no dynamic allocation"),
    (r"\b(?:throw|try|catch)\b", "exceptions do not exist in MSL"),
    (r"\bvirtual\b", "virtual functions do not exist in MSL"),
    (r"\bdouble\b", "`double` does not exist in MSL (use float)"),
    (r"\b(?:printf|fprintf|sprintf|snprintf|puts)\s*\(", "printf does not exist in MSL"),
    (r"\bgoto\b", "goto does not exist in MSL"),
    (r"\bthread_local\b", "thread_local does not exist in MSL"),
    (r"\b(?:malloc|calloc|realloc|free)\s*\(", "MSL has no heap"),
]
MPP_HEADER = "MetalPerformancePrimitives/MetalPerformancePrimitives.h"  # Metal 4 tensor ops (matmul2d)
CONTROL = {"if", "for", "while", "switch", "return", "sizeof", "catch", "decltype", "alignof", "static_assert"}
FLOAT_LIT = re.compile(r"(?<![\w.])(?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?(?![\w.])|(?<![\w.])\d+[eE][+-]?\d+(?![\w.])")


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _function_bodies(m: str):
    """(name, body_start, body_end) of function definitions found in masked source."""
    out = []
    for mt in re.finditer(r"\b([A-Za-z_]\w*)\s*\(", m):
        name = mt.group(1)
        if name in CONTROL:
            continue
        # find the closing paren of the parameter list
        depth, j = 0, mt.end() - 1
        while j < len(m):
            if m[j] == "(":
                depth += 1
            elif m[j] == ")":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        k = j + 1
        while k < len(m) and (m[k] in " \t\n\r" or m.startswith("const", k)):
            k += 5 if m.startswith("const", k) else 1
        if k < len(m) and m[k] == "{":
            depth, e = 0, k
            while e < len(m):
                if m[e] == "{":
                    depth += 1
                elif m[e] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                e += 1
            out.append((name, k, e))
    return out


def lint_source(src: str, path: str = "<source>", house_rules: bool = True) -> list[tuple[int, str]]:
    pp = _mslpp()
    text = pp.blank_comments(src)
    m = pp.mask(text)
    problems: list[tuple[int, str]] = []
    for pat, msg in FORBIDDEN:
        for mt in re.finditer(pat, m):
            problems.append((_line(m, mt.start()), msg))
    # host-only blocks of the shared family headers (`#ifndef __METAL_VERSION__` ... `#endif`, not nested)
    # may include host headers: Metal's compiler never sees them
    host_only = [(a.start(), a.end()) for a in re.finditer(r"^\s*#\s*ifndef\s+__METAL_VERSION__\b.*?^\s*#\s*endif",
                                                          text, re.M | re.S)]
    for mt in re.finditer(r"^\s*#\s*include\s*<([^>]+)>", text, re.M):
        if any(a <= mt.start() < b for a, b in host_only):
            continue
        if not mt.group(1).startswith("metal_") and mt.group(1) != MPP_HEADER:
            problems.append((_line(text, mt.start()), f"#include <{mt.group(1)}>: kernels include only <metal_*> "
                                                      f"headers, <{MPP_HEADER}> and their own headers"))
    # recursion: a function whose own body calls it (outermost definitions only)
    bodies = _function_bodies(m)
    for name, a, b in bodies:
        for call in re.finditer(r"(?<![\w.>:])" + re.escape(name) + r"\s*(?:<[^;{}()]*>)?\s*\(", m[a:b]):
            problems.append((_line(m, a + call.start()), f"recursion: {name}() calls itself (MSL has no recursion)"))
    if house_rules:
        for mt in pp.KERNEL_DEF.finditer(m):
            open_i = mt.end() - 1
            close_i = pp.matching(m, open_i, "(", ")")
            params = pp.split_top(m[open_i + 1:close_i])
            for p in params:
                if p.strip() and "[[" not in p:
                    problems.append((_line(m, open_i), f"kernel {mt.group(1)}: parameter '{' '.join(p.split())}' has no "
                                                      "attribute ([[buffer(i)]], [[thread_position_in_grid]], ...)"))
        for mt in pp.TG_DECL.finditer(m):
            decl = mt.group(2)
            if re.search(r"[*&(=]", pp.outside_brackets(decl)):
                continue
            if "[" not in decl:
                problems.append((_line(m, mt.start(2)), "threadgroup variable declared as a scalar: declare it as an "
                                                        "array (T name[1]) so the simulator can track its reads"))
        for mt in FLOAT_LIT.finditer(m):
            problems.append((_line(m, mt.start()), f"floating literal {mt.group(0)} without a suffix: write "
                                                   f"{mt.group(0)}f (in MSL it is a float, in C++ a double)"))
    return sorted(set(problems))


def lint_file(path: str | Path, house_rules: bool = True) -> list[tuple[int, str]]:
    return lint_source(Path(path).read_text(encoding="utf-8"), str(path), house_rules)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = HERE.parent
    files = argv or sorted(str(p) for p in list((root / "metal").glob("*.metal")) + list((root / "metal").glob("*.h")))
    bad = 0
    for f in files:
        for line, msg in lint_file(f):
            print(f"{f}:{line}: {msg}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""mslpp: the source rewrite that lets a Metal (.metal) file compile as C++17.

Used at build time by CMake (kernels linked into qwenmetal._core), at run time by
``qwenmetal.msl_sim.compile`` (installed next to the shim headers as ``msl_include/mslpp.py``) and by the
clang address-space check (``tools/msl_check.py``). Standard library only; line numbers are preserved
(every rewrite keeps the newlines of what it replaces) and the output starts with ``#line 1 "<origin>"``
so diagnostics and simulator errors point into the .metal file.

Modes
  sim     (default) for the simulator; ``--fast`` turns off checked mode
  check   for ``clang++ -fsyntax-only -DMSL_SIM_CHECK_AS`` (address spaces as clang address spaces)

Rewrites
  * ``[[threadgroup(n)]]`` -> ``[[threadgroup_arg(n)]]`` (``threadgroup`` is a macro in both modes).
  * kernel-scope ``threadgroup T a[N], b[M];`` ->
      sim:   ``auto& a = ::msl::tg_var<T[N], ID>("a", __FILE__, __LINE__); ...``  (one object per
             threadgroup in a poisoned 32 KB arena)
      check: ``static threadgroup T a[N]; ...``  (C++ forbids address-space-qualified automatics)
  * check: MSL vector constructors ``float4(a, b)``, ``static_cast<float4>(h)`` ->
    ``::msl_check::make<float4>(...)`` (clang's ext vectors have no constructors in C++).
  * sim: every non-template ``kernel void f(...)`` is registered (``MSL_REGISTER_KERNEL``);
    templates are registered by ``INSTANTIATE_KERNEL``. ``MSL_EXPORT_LIBRARY(<id>)`` is appended.
  * ``[[kernel, max_total_threads_per_threadgroup(N)]] void f(`` -> ``kernel void f(``; in sim mode the
    registrations of f carry N (``MSL_REGISTER_KERNEL_MT``, ``MSL_INSTANTIATE_KERNEL_MT``): the simulator
    reports N as the pipeline's thread limit, as Metal does.
  * sim: ``reinterpret_cast<device T*>(p)`` -> ``::msl::ptr_cast<device T*>(p)``.
  * sim, checked: ``device``/``constant`` pointer types -> ``::msl::dptr<T>`` and ``threadgroup``
    pointer types -> ``::msl::tgptr<T>`` (bounds-checked; tgptr also tracks poisoned reads), and
    subscripts ``name[i]`` of those pointers and of threadgroup arrays ->
    ``::msl::idx(__FILE__, __LINE__, name, (i))`` so that errors carry the source line.

    python3 tools/mslpp.py [--mode sim|check] [--fast] [--library-id ID] [--origin NAME] in.metal out.cpp
"""
from __future__ import annotations

import argparse
import re
import sys
import zlib

KEYWORDS_BEFORE_EXPR = {"return", "case", "else", "do", "co_return", "throw", "sizeof", "and", "or", "not"}


# ------------------------------------------------------------------------------------ lexing helpers
def blank_comments(src: str) -> str:
    """Comments -> spaces (newlines kept). String and character literals are left intact."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if c == "/" and i + 1 < n and src[i + 1] == "/":
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif c == "/" and i + 1 < n and src[i + 1] == "*":
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in src[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            out.append(src[i:j + 1])
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def mask(src: str) -> str:
    """Same length as src: literal contents and preprocessor lines blanked, for matching only."""
    out, i, n = [], 0, len(src)
    at_line_start = True
    while i < n:
        c = src[i]
        if at_line_start and c in " \t":
            out.append(c)
            i += 1
            continue
        if at_line_start and c == "#":
            j = i
            while True:  # directive, with backslash continuations
                k = src.find("\n", j)
                k = n if k < 0 else k
                if k > 0 and src[k - 1] == "\\" and k < n:
                    j = k + 1
                    continue
                break
            out.append("".join(ch if ch == "\n" else " " for ch in src[i:k]))
            i = k
            continue
        at_line_start = c == "\n"
        if c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            out.append(c + " " * (min(j, n) - i - 1) + (c if j < n else ""))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)[:n]


def apply_edits(src: str, edits) -> str:
    """edits: (start, end, replacement), non-overlapping."""
    out, pos = [], 0
    for a, b, r in sorted(edits):
        out.append(src[pos:a])
        out.append(r)
        pos = b
    out.append(src[pos:])
    return "".join(out)


def split_top(s: str, sep: str = ",") -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def outside_brackets(s: str) -> str:
    out, depth = [], 0
    for ch in s:
        if ch in "[<":
            depth += 1
        elif ch in "]>":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def matching(m: str, i: int, open_: str = "[", close: str = "]") -> int:
    """Index of the bracket closing the one at m[i]."""
    depth = 0
    for j in range(i, len(m)):
        if m[j] in "([{":
            depth += 1
        elif m[j] in ")]}":
            depth -= 1
            if depth == 0:
                return j
    raise ValueError("unbalanced brackets")


def prev_token(m: str, i: int) -> str:
    j = i - 1
    while j >= 0 and m[j] in " \t\r\n":
        j -= 1
    if j < 0:
        return ""
    if m[j].isalnum() or m[j] == "_":
        k = j
        while k >= 0 and (m[k].isalnum() or m[k] == "_"):
            k -= 1
        return m[k + 1:j + 1]
    if m[j] == ">" and j > 0 and m[j - 1] == "-":
        return "->"
    if m[j] == ":" and j > 0 and m[j - 1] == ":":
        return "::"
    return m[j]


# ------------------------------------------------------------------------------------ rewrites
def rewrite_tg_attr(src: str) -> str:
    return re.sub(r"\[\[\s*threadgroup\s*\(", "[[threadgroup_arg(", src)


TG_DECL = re.compile(r"(?:^|(?<=[;{}]))(\s*)threadgroup\s+([^;{}]*);", re.M)


def rewrite_tg_decls(src: str, mode: str, file_id: int, tg_names: set) -> str:
    m = mask(src)
    edits, n = [], 0
    for mt in TG_DECL.finditer(m):
        decl_m = mt.group(2)
        if re.search(r"[*&(=]", outside_brackets(decl_m)):
            continue  # pointer / reference / parameter-like: the macro handles it
        decl = src[mt.start(2):mt.end(2)]
        parts = split_top(decl)
        first = re.match(r"^\s*(.*?)\s*\b([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*)$", parts[0], flags=re.S)
        if not first or not first.group(1).strip():
            continue
        ty = first.group(1).strip()
        decls = [(first.group(2), first.group(3))]
        ok = True
        for p in parts[1:]:
            mm = re.match(r"^\s*([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*)$", p, flags=re.S)
            if not mm:
                ok = False
                break
            decls.append((mm.group(1), mm.group(2)))
        if not ok:
            continue
        new = []
        for name, dims in decls:
            n += 1
            dims1 = re.sub(r"\s+", " ", dims.strip())
            if mode == "check":
                new.append(f"static threadgroup {ty} {name}{dims1};")
            else:
                new.append(f'auto& {name} = ::msl::tg_var<{ty}{dims1}, {file_id + n}>("{name}", __FILE__, __LINE__);')
                if dims1:
                    tg_names.add(name)
        text = " ".join(new) + "\n" * src[mt.end(1):mt.end()].count("\n")
        edits.append((mt.end(1), mt.end(), text))
    return apply_edits(src, edits)


KERNEL_DEF = re.compile(r"(?:\bkernel\b|\[\[\s*kernel\s*(?:,[^\[\]]*)?\]\])\s+void\s+([A-Za-z_]\w*)\s*\(")
MAX_THREADS_ATTR = re.compile(r"\[\[\s*kernel\s*,\s*max_total_threads_per_threadgroup\s*\((.*?)\)\s*\]\]"
                              r"(?=\s*void\s+([A-Za-z_]\w*)\s*\()", re.S)
INSTANTIATE = re.compile(r"\bINSTANTIATE_KERNEL\s*\(\s*(\"[^\"]*\")\s*,\s*([A-Za-z_]\w*)\s*,")


def rewrite_max_threads(src: str, declared: dict) -> str:
    """``[[kernel, max_total_threads_per_threadgroup(N)]] void f(`` -> ``kernel void f(``, with f -> N recorded
    in ``declared`` (N: an expression the registration evaluates; it may not depend on template parameters)."""
    m = mask(src)
    edits = []
    for mt in MAX_THREADS_ATTR.finditer(m):
        declared[mt.group(2)] = src[mt.start(1):mt.end(1)].strip()
        edits.append((mt.start(), mt.end(), "kernel" + "\n" * src.count("\n", mt.start(), mt.end())))
    return apply_edits(src, edits)


def rewrite_instantiations(src: str, declared: dict) -> str:
    """sim: ``INSTANTIATE_KERNEL("name", f, ...)`` of a kernel with a declared thread limit ->
    ``MSL_INSTANTIATE_KERNEL_MT((N), "name", f, ...)``, so the simulator knows the pipeline's limit."""
    m = mask(src)
    edits = []
    for mt in INSTANTIATE.finditer(m):
        if mt.group(2) in declared:
            edits.append((mt.start(), mt.start(1), f"MSL_INSTANTIATE_KERNEL_MT(({declared[mt.group(2)]}), "))
    return apply_edits(src, edits)


def plain_kernels(src: str) -> list[tuple[str, int]]:
    m = mask(src)
    out = []
    for mt in KERNEL_DEF.finditer(m):
        before = m[:mt.start()].rstrip()
        if before.endswith(">"):
            continue  # template <...> kernel: registered by INSTANTIATE_KERNEL
        out.append((mt.group(1), src.count("\n", 0, mt.start(1)) + 1))
    return out


PTR_CAST = re.compile(r"\breinterpret_cast\s*<(\s*(?:const\s+)?(?:device|constant)\b)")

TYPE = r"(?:::)?[A-Za-z_]\w*(?:\s*::\s*[A-Za-z_]\w*)*(?:\s*<[^;{}()]*?>)?"
DPTR = re.compile(
    r"(?<![\w:])((?:(?:const|volatile)\s+)*)(device|constant|threadgroup)\s+((?:(?:const|volatile)\s+)*)(" + TYPE + r")\s*"
    r"((?:(?:const|volatile)\s*)*)\*(\s*(?:const|__restrict__|__restrict|restrict)\b)?(\s*[A-Za-z_]\w*)?")


def rewrite_device_ptrs(src: str, ptr_names: set) -> str:
    m = mask(src)
    edits = []
    for mt in DPTR.finditer(m):
        quals = " ".join((m[mt.start(1):mt.end(1)] + " " + m[mt.start(3):mt.end(3)] + " " +
                          m[mt.start(5):mt.end(5)]).split())
        const = "const " if ("const" in quals.split() or mt.group(2) == "constant") else ""
        ty = " ".join(src[mt.start(4):mt.end(4)].split())
        trailing = (m[mt.start(6):mt.end(6)] or "").strip()
        prefix = "const " if trailing == "const" else ""
        name = src[mt.start(7):mt.end(7)] if mt.group(7) else ""
        if name.strip() in ("operator",):
            continue
        if name.strip():
            ptr_names.add(name.strip())
        kind = "tgptr" if mt.group(2) == "threadgroup" else "dptr"
        core = f"{prefix}::msl::{kind}<{const}{ty}>"
        nl = "\n" * src[mt.start():mt.end()].count("\n")
        edits.append((mt.start(), mt.end(), core + nl + (" " + name.strip() if name.strip() else "")))
    return apply_edits(src, edits)


def rewrite_subscripts(src: str, names: set) -> str:
    if not names:
        return src
    pat = re.compile(r"(?<![\w.])(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True)) + r")\s*\[(?!\[)")

    def go(text: str) -> str:
        m = mask(text)
        out, pos = [], 0
        for mt in pat.finditer(m):
            if mt.start() < pos:
                continue
            prev = prev_token(m, mt.start())
            if prev in ("->", "::", ".") or (re.fullmatch(r"[A-Za-z_]\w*", prev or "") and prev not in KEYWORDS_BEFORE_EXPR) \
                    or prev == ">":
                continue  # member access, or a declaration reusing the name
            open_i = mt.end() - 1
            try:
                close_i = matching(m, open_i)
            except ValueError:
                continue
            expr = go(text[open_i + 1:close_i])
            repl = f"::msl::idx(__FILE__, __LINE__, {text[mt.start(1):mt.end(1)]}, ({expr}))"
            end = close_i + 1
            while True:  # chained subscripts: a[i][j]
                k = end
                while k < len(m) and m[k] in " \t":
                    k += 1
                if k < len(m) and m[k] == "[" and not (k + 1 < len(m) and m[k + 1] == "["):
                    c2 = matching(m, k)
                    e2 = go(text[k + 1:c2])
                    repl = f"::msl::idx(__FILE__, __LINE__, {repl}, ({e2}))"
                    end = c2 + 1
                else:
                    break
            out.append(text[pos:mt.start()])
            out.append(repl)
            pos = end
        out.append(text[pos:])
        return "".join(out)

    return go(src)


VEC_NAMES = r"(?:metal::)?(?:packed_)?(?:float|half|bfloat|int|uint|short|ushort|char|uchar|long|ulong|bool)[234]"
VEC_CTOR = re.compile(r"(?<![\w:.])(" + VEC_NAMES + r"|(?:metal::)?vec\s*<[^;{}()]*?>)\s*\(")
VEC_CAST = re.compile(r"\bstatic_cast\s*<\s*(" + VEC_NAMES + r"|(?:metal::)?vec\s*<[^;{}()]*?>)\s*>\s*\(")


def rewrite_vector_ctors(src: str) -> str:
    """check mode: MSL vector constructors -> ::msl_check::make<V>(...) (ext vectors have none)."""
    m = mask(src)
    edits = [(mt.start(), mt.end(), f"::msl_check::make<{' '.join(src[mt.start(1):mt.end(1)].split())}>(")
             for rx in (VEC_CTOR, VEC_CAST) for mt in rx.finditer(m)]
    return apply_edits(src, edits)


TENSOR_INCLUDE = re.compile(r"^\s*#\s*include\s*<metal_tensor>", re.M)


def cxx_std(src: str) -> str:
    """The C++ standard a kernel file compiles as: c++20 for Metal 4 tensor-op files (``#include <metal_tensor>``:
    matmul2d takes its descriptor as a class-type template parameter), else c++17."""
    return "c++20" if TENSOR_INCLUDE.search(blank_comments(src)) else "c++17"


def rewrite(src: str, mode: str = "sim", checked: bool = True, library_id: str = "plugin",
            origin: str = "kernel.metal") -> str:
    if mode not in ("sim", "check"):
        raise ValueError("mode must be 'sim' or 'check'")
    n_lines = src.count("\n")
    text = blank_comments(src)
    text = rewrite_tg_attr(text)
    file_id = (zlib.crc32(origin.encode()) % 100000) * 1000
    tg_names: set = set()
    text = rewrite_tg_decls(text, mode, file_id, tg_names)
    head, tail = "", ""
    declared: dict = {}
    text = rewrite_max_threads(text, declared)
    if mode == "check":
        text = rewrite_vector_ctors(text)
    if mode == "sim":
        text = rewrite_instantiations(text, declared)
        kernels = plain_kernels(text)
        m = mask(text)
        text = apply_edits(text, [(mt.start(), mt.end(), "::msl::ptr_cast<" + text[mt.start(1):mt.end(1)])
                                  for mt in PTR_CAST.finditer(m)])
        if checked:
            ptr_names: set = set()
            text = rewrite_device_ptrs(text, ptr_names)
            text = rewrite_subscripts(text, ptr_names | tg_names)
        head = f"#define MSL_SIM_CHECKED {1 if checked else 0}\n"
        tail = "\n" + "".join(f"MSL_REGISTER_KERNEL_MT({k}, {line}, ({declared[k]}))\n" if k in declared else
                              f"MSL_REGISTER_KERNEL({k}, {line})\n" for k, line in kernels) + \
            f"MSL_EXPORT_LIBRARY({library_id})\n"
    assert text.count("\n") == n_lines, "mslpp must preserve line numbers"
    origin_lit = origin.replace("\\", "/").replace('"', '\\"')
    return head + f'#line 1 "{origin_lit}"\n' + text + tail


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--mode", default="sim", choices=("sim", "check"))
    ap.add_argument("--fast", action="store_true", help="sim mode without bounds checks / poison tracking")
    ap.add_argument("--library-id", default="plugin")
    ap.add_argument("--origin", default=None, help="file name for #line (default: the input path)")
    a = ap.parse_args(argv)
    with open(a.input, encoding="utf-8") as f:
        src = f.read()
    out = rewrite(src, a.mode, not a.fast, a.library_id, a.origin or a.input)
    # an unchanged output is not rewritten: ninja (restat) then recompiles nothing when the command
    # re-runs for another reason (a pip build from another environment: another interpreter path)
    try:
        with open(a.output, encoding="utf-8") as f:
            if f.read() == out:
                return 0
    except OSError:
        pass
    with open(a.output, "w", encoding="utf-8") as f:
        f.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

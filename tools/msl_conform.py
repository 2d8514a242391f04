#!/usr/bin/env python3
"""msl_conform: check Metal kernel families against rules of Apple's Metal Shading Language Specification.

The simulator compiles kernels as C++ and clang's address-space check (tools/msl_check.py) types them as
C++: both accept code Apple's Metal compiler rejects (a [[threads_per_threadgroup]] scalar next to a uint2
[[threadgroup_position_in_grid]], a [[buffer(31)]], 40 KB of threadgroup memory, ...), and this project has
no Mac in CI. This checker reads what Apple's compiler would read, the flattened family
(tools/embed_msl.py), through clang's C++ front end, and applies rules written from the specification
(``RULES`` below: each names the section it comes from, numbered as in the MSL 4 specification).

How: the family is flattened, rewritten as for the address-space check (tools/mslpp.py ``--mode check``:
threadgroup declarations become ``static threadgroup``, vector constructors declared functions, line
numbers kept) and parsed by ``clang++ -fsyntax-only -Xclang -ast-dump=json`` with
``-DMSL_SIM_CHECK_AS -DMSL_SIM_CONFORM -D__METAL_VERSION__=<v>`` against src/msl_sim/include: there every
MSL attribute becomes a ``clang::annotate("msl", "<attribute>", args...)`` (msl_sim/conform.h), so the JSON
AST holds each [[buffer(n)]], [[thread_position_in_grid]], the ``kernel`` keyword and the host name of every
``INSTANTIATE_KERNEL`` on the declaration it belongs to. Template kernels are checked per explicit
instantiation, with concrete types (threadgroup array sizes that depend on template parameters included).
The family's MSL version comes from ``LANGUAGE_VERSION`` in tools/embed_msl.py, the table MetalDevice
compiles with; MSL 3.x is C++14-based (checked as ``-std=c++14``), MSL 4 C++17-based (checked as
``-std=c++20``, which the shim's Metal 4 tensor declarations need). Clang's own diagnostics in this mode
(an unknown attribute, a variable-length array, a C++17 feature in an MSL 3.x family, a parse error) are
reported as violations too. Locations are the original files' (#line markers of the flattened source).

The same AST also answers four performance questions (``PERF_RULES``, sources: Apple's GPU facts and MLX's
practice; docs/metal.md, "Performance checks"): thread arrays indexed by values the compiler cannot fold,
64-bit integer multiplies and shifts in loops, threadgroup columns on rows of a multiple of 32 words, and
run-time loops stepping over SIMD-group matrix operations. A deliberate exception is annotated in the kernel,
``// perf-ok(RULE): reason``, on the line or alone on the line above.

    python3 tools/msl_conform.py metal/*.metal    # prints file:line: [RULE] message; exit 1 on any, 2 without clang
    python3 tools/msl_conform.py --no-perf ...    # the conformance rules only
    python3 tools/msl_conform.py --rules          # the rules and their sections or sources
"""

import argparse
import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METAL = ROOT / "metal"
INCLUDE = ROOT / "src" / "msl_sim" / "include"
MIN_CLANG = 15

THREADGROUP_MEMORY_LIMIT = 32 * 1024  # bytes of threadgroup memory a kernel may declare (Apple GPU families)
MAX_BUFFER_INDEX = 30  # the argument table has 31 entries: [[buffer(0)]] .. [[buffer(30)]]
MAX_THREADS_PER_THREADGROUP = 1024  # the largest maxThreadsPerThreadgroup of any Apple GPU


@dataclasses.dataclass(frozen=True)
class Rule:
    section: str  # of the MSL 4 specification
    summary: str


RULES: dict[str, Rule] = {
    "MSL-ATTR-TYPE": Rule(
        "5.2.3.6 Kernel Function Input Attributes (Table 5.8)",
        "a built-in kernel attribute takes ushort or uint; the grid/position attributes also their 2- and "
        "3-component vectors"),
    "MSL-ATTR-WIDTH": Rule(
        "5.2.3.6 Kernel Function Input Attributes (notes)",
        "thread_position_in_grid, threads_per_grid, thread_position_in_threadgroup, threads_per_threadgroup, "
        "threadgroup_position_in_grid, dispatch_threads_per_threadgroup and threadgroups_per_grid of one "
        "kernel have one width: all scalars, or vectors with the same number of components (a scalar "
        "among vectors counts as width 1)"),
    "MSL-ATTR-MATCH": Rule(
        "5.2.3.6 Kernel Function Input Attributes (notes)",
        "thread_position_in_grid and threads_per_grid have the same type; so do "
        "thread_position_in_threadgroup, threads_per_threadgroup and dispatch_threads_per_threadgroup; "
        "thread_index_in_threadgroup is uint when thread_position_in_threadgroup is uint-based; the "
        "SIMD-group and quad-group attributes share one type"),
    "MSL-ATTR-KIND": Rule(
        "5.1.3 Compute Functions (Kernels), 5.2.1 Locating Buffer, Texture, and Sampler Arguments, "
        "5.2.3 Attributes for Built-in Variables",
        "kernel input and resource attributes only on kernel parameters, kernel function attributes "
        "([[max_total_threads_per_threadgroup]], [[host_name]]) only on kernels, no graphics-function or "
        "unknown attribute on a kernel"),
    "MSL-BUFFER": Rule(
        "5.2.1 Locating Buffer, Texture, and Sampler Arguments, 4 Address Spaces",
        "[[buffer(n)]]: 0 <= n <= 30 (31 argument-table entries), on a pointer or reference to device or "
        "constant memory; [[threadgroup(n)]] likewise on a pointer or reference to threadgroup memory"),
    "MSL-BUFFER-DUP": Rule(
        "5.2.1 Locating Buffer, Texture, and Sampler Arguments",
        "indices are unique within each resource group (buffer, threadgroup, texture) of a kernel"),
    "MSL-PARAM-ATTR": Rule(
        "5.2.1 Locating Buffer, Texture, and Sampler Arguments, 5.2.3.6 Kernel Function Input Attributes",
        "every kernel parameter carries an attribute (house rule: MSL would assign the first free index to "
        "an unattributed buffer; the host binds by explicit index, and the simulator binds through the "
        "attributes)"),
    "MSL-KERNEL": Rule(
        "5.1 Functions, 5.1.3 Compute Functions (Kernels), 1.5.1 Overloading",
        "a kernel returns void, is called by no function, is not overloaded, and its "
        "[[max_total_threads_per_threadgroup]] is at most 1024"),
    "MSL-HOST-NAME": Rule(
        "5.1.10 Host Name Attribute, 5.1.11 Templated Qualified Functions",
        "the host names of a family's kernels (INSTANTIATE_KERNEL names, plain kernel names) are unique"),
    "MSL-DOUBLE": Rule(
        "2.1 Scalar Data Types",
        "no double, long double, long long or unsigned long long"),
    "MSL-ATOMIC": Rule(
        "2.6 Atomic Data Types, 6.15.4 Atomic Functions",
        "atomics of int and uint in device or threadgroup memory, float in device memory only (MSL 3.0+), "
        "bool (MSL 2.4+); no 64-bit atomics (only a few fetch-min/max on some GPU families: not used "
        "here), no atomic in thread or constant memory"),
    "MSL-SIMDGROUP-MATRIX": Rule(
        "2.4 SIMD-group Matrix Data Types",
        "simdgroup_matrix<T, 8, 8> with T half, float, or bfloat (MSL 3.1+)"),
    "MSL-VERSION": Rule(
        "1.6.10 Compiler Options Controlling the Language Version, 1.5 Metal and C++17, 2.1, 2.6, 2.20 "
        "Tensor Types, 7 Metal Performance Primitives, 1.5.4 Restrictions",
        "nothing past the family's pinned MSL version (tools/embed_msl.py LANGUAGE_VERSION): bfloat and "
        "bfloat SIMD-group matrices 3.1, atomic_float 3.0, lambdas 3.2, <metal_tensor>, tensors and "
        "MetalPerformancePrimitives 4.0, C++17 language features 4.0 (MSL 3.x is C++14-based)"),
    "MSL-TG-SCOPE": Rule(
        "4.4 Threadgroup Address Space",
        "threadgroup variables are declared in kernels only (helper functions take them as pointers or "
        "references; no program-scope threadgroup variable)"),
    "MSL-TG-SIZE": Rule(
        "4.4 Threadgroup Address Space (size: the Apple GPU families' 32 KB of threadgroup memory)",
        "the threadgroup variables a kernel instantiation declares total at most 32 KiB, with sizes known "
        "at compile time (element sizes from 2.1 Table 2.2, 2.2 Table 2.3)"),
    "MSL-VLA": Rule(
        "1.5 Metal and C++17 (C++ has no variable-length arrays), 4.4 Threadgroup Address Space",
        "array sizes are constant expressions"),
    "MSL-RECURSION": Rule(
        "1.5.4 Restrictions",
        "no recursion, direct or through a call cycle (house rule, stricter than the specification: MSL "
        "2.4+ accepts recursion in compute context; the kernels need none, and the call stack it needs is "
        "unbounded)"),
    "MSL-FUNCPTR": Rule(
        "1.5.4 Restrictions, 5.1.4 Visible Functions, 2.15 Visible Function Table",
        "no function pointers (MSL 2.3+ has them only for [[visible]] functions linked through the "
        "pipeline descriptor; these families declare none)"),
    "MSL-VIRTUAL": Rule(
        "1.5.4 Restrictions",
        "no virtual functions, derived classes, dynamic_cast or typeid"),
    "MSL-EXCEPTION": Rule(
        "1.5.4 Restrictions",
        "no exception handling (throw, try, catch) and no noexcept operator"),
    "MSL-NEW": Rule(
        "1.5.4 Restrictions",
        "no new or delete"),
    "MSL-GOTO": Rule(
        "1.5.4 Restrictions",
        "no goto statement"),
    "MSL-TLS": Rule(
        "1.5.4 Restrictions, 5.3 Storage Class Specifiers",
        "no thread_local or register storage"),
    "MSL-STATIC": Rule(
        "5.3 Storage Class Specifiers, 4 Address Spaces, 4.2 Constant Address Space",
        "no static variable inside a function; a program-scope variable (and a static data member) is in "
        "the constant address space"),
    "MSL-STD": Rule(
        "1.5.4 Restrictions",
        "no C++ standard library (std::)"),
    "MSL-MAIN": Rule(
        "1.5.4 Restrictions",
        "no function named main"),
    "MSL-PARSE": Rule(
        "1.5 Metal and C++17",
        "the family parses as MSL in conform mode (a clang error that no other rule explains)"),
}

# 5.2.3.6 Table 5.8: the kernel input attributes, by the types they take
GRID_ATTRS = ("thread_position_in_grid", "threads_per_grid", "thread_position_in_threadgroup",
              "threads_per_threadgroup", "threadgroup_position_in_grid", "dispatch_threads_per_threadgroup",
              "threadgroups_per_grid")
VECTOR_ATTRS = set(GRID_ATTRS) | {"grid_origin", "grid_size"}
SIMD_ATTRS = ("thread_index_in_simdgroup", "threads_per_simdgroup", "thread_execution_width",
              "simdgroup_index_in_threadgroup", "simdgroups_per_threadgroup",
              "dispatch_simdgroups_per_threadgroup", "quadgroup_index_in_threadgroup",
              "quadgroups_per_threadgroup", "dispatch_quadgroups_per_threadgroup", "thread_index_in_quadgroup")
SCALAR_ATTRS = set(SIMD_ATTRS) | {"thread_index_in_threadgroup"}
KERNEL_INPUT_ATTRS = VECTOR_ATTRS | SCALAR_ATTRS | {"stage_in"}
RESOURCE_ATTRS = {"buffer", "threadgroup", "texture"}
FUNCTION_ATTRS = {"kernel", "host_name", "max_total_threads_per_threadgroup", "required_threads_per_threadgroup"}
GRAPHICS_ATTRS = {"vertex_id", "instance_id", "base_vertex", "base_instance", "amplification_id",
                  "amplification_count", "front_facing", "point_coord", "sample_id", "sample_mask",
                  "render_target_array_index", "viewport_array_index", "barycentric_coord", "patch_id"}
# the SIMD-group and quad-group attributes whose types must match (5.2.3.6 notes; thread_index_in_quadgroup
# is not in that list)
SIMD_MATCH_ATTRS = SIMD_ATTRS[:-1]

FUNCTION_KINDS = {"FunctionDecl", "CXXMethodDecl", "CXXConstructorDecl", "CXXDestructorDecl",
                  "CXXConversionDecl", "CXXDeductionGuideDecl"}
# declarations and explicit casts whose written type is checked (implicit expression types are not: an
# unsuffixed floating literal is a double to clang and a float to Metal)
TYPED_DECL_KINDS = {"VarDecl", "ParmVarDecl", "FieldDecl", "TypedefDecl", "TypeAliasDecl",
                    "NonTypeTemplateParmDecl", "CStyleCastExpr", "CXXFunctionalCastExpr",
                    "CXXStaticCastExpr", "CXXReinterpretCastExpr", "CXXConstCastExpr", "TemplateArgument",
                    "UnaryExprOrTypeTraitExpr"} | FUNCTION_KINDS


@dataclasses.dataclass(frozen=True, order=True)
class Violation:
    path: str  # repository-relative where possible: metal/attention.metal
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.message}"


class ConformError(Exception):
    """The check could not run (no clang, clang crashed, unreadable AST)."""


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


embed_msl = _tool("embed_msl")
mslpp = _tool("mslpp")
msl_check = _tool("msl_check")


def find_clang() -> str | None:
    """clang++ >= 15 as tools/msl_check.py finds it ($MSL_CLANG, else the newest clang++-N on PATH)."""
    return msl_check.find_clang(MIN_CLANG)


def _display_path(name: str) -> str:
    """A file name as reported: relative to the repository when it lies inside it."""
    p = Path(name)
    if p.is_absolute():
        try:
            return p.resolve().relative_to(ROOT).as_posix()
        except ValueError:
            return p.as_posix()
    return name


def version_number(version: str) -> int:
    """"3.1" -> 310, the value of __METAL_VERSION__."""
    major, minor = version.split(".")
    return int(major) * 100 + int(minor) * 10


def cxx_standard(version: str) -> str:
    """MSL 3.x is C++14-based, MSL 4 C++17-based (checked as C++20: the shim's matmul2d needs it)."""
    return "c++14" if version_number(version) < 400 else "c++20"


# ------------------------------------------------------------------------------------------- source
_LINE_DIRECTIVE = re.compile(r'^#line (\d+) "((?:[^"\\]|\\.)*)"$')
_ATTR_LIST = re.compile(r"\[\[(.*?)\]\]", re.S)


def _kernel_attribute_lists(text: str) -> str:
    """``[[kernel]]`` -> ``kernel`` and ``[[kernel, max_total_threads_per_threadgroup(N)]]`` ->
    ``[[max_total_threads_per_threadgroup(N)]] kernel`` (the same declaration in MSL): msl_sim/conform.h
    annotates the ``kernel`` keyword, which cannot stand inside a C++ attribute list. Comments are blanked
    first; line breaks are kept."""
    text = mslpp.blank_comments(text)
    masked = mslpp.mask(text)
    edits = []
    for m in _ATTR_LIST.finditer(masked):
        items = mslpp.split_top(text[m.start(1):m.end(1)])
        rest = [it for it in items if it.strip() != "kernel"]
        if len(rest) == len(items):
            continue
        kept = ",".join(rest)
        new = (f"[[{kept}]] kernel" if kept.strip() else "kernel")
        new += "\n" * (text.count("\n", m.start(), m.end()) - new.count("\n"))
        edits.append((m.start(), m.end(), new))
    return mslpp.apply_edits(text, edits)


def prepare(path: str | Path, metal_dir: str | Path = METAL) -> tuple[str, list[tuple[str, int]]]:
    """The text clang parses for family `path` and the map of its lines to original (file, line).

    The family is flattened as for Apple's compiler (tools/embed_msl.py), ``kernel`` is taken out of attribute
    lists (``_kernel_attribute_lists``), and the result is rewritten as for the address-space check
    (tools/mslpp.py --mode check). Line numbers are kept by every rewrite.
    """
    path = Path(path)
    flat = _kernel_attribute_lists(embed_msl.flatten(path, metal_dir))
    # (mslpp's own leading #line is overridden at once by the flattened source's first #line)
    text = mslpp.rewrite(flat, "check", True, "check", path.name)
    line_map: list[tuple[str, int]] = [("<conform>", 0)]  # index 0 unused: clang's lines start at 1
    cur_file, cur_line = "<conform>", 1
    for raw in text.split("\n"):
        m = _LINE_DIRECTIVE.match(raw)
        line_map.append((cur_file, cur_line))
        if m:
            cur_file = _display_path(m.group(2).replace('\\"', '"').replace("\\\\", "\\"))
            cur_line = int(m.group(1))
        else:
            cur_line += 1
    return text, line_map


_DIAG = re.compile(r"^(?P<file>.+?):(?P<line>\d+):(?P<col>\d+): (?P<sev>fatal error|error|warning): (?P<msg>.*)$")
_INCLUDED_FROM = re.compile(r"^In file included from (?P<file>.+?):(?P<line>\d+):")


def run_clang(text: str, version: str, clang: str) -> tuple[dict, list[tuple[str, int, str, str, list]]]:
    """(JSON AST, diagnostics) of `text`; a diagnostic is (file, line, severity, message, include chain)."""
    cmd = [clang, f"-std={cxx_standard(version)}", "-fsyntax-only", "-DMSL_SIM_CHECK_AS", "-DMSL_SIM_CONFORM",
           f"-D__METAL_VERSION__={version_number(version)}", "-Wno-everything", "-Wunknown-attributes",
           "-Wvla-extension", "-Wvla-cxx-extension", "-Wno-unknown-warning-option",  # clang 15-17 / 18+
           "-Wc++17-extensions", "-W#warnings", "-Wno-user-defined-literals",
           "-fno-caret-diagnostics", "-fno-color-diagnostics", "-fno-diagnostics-show-option",
           "-ferror-limit=0", f"-I{INCLUDE}", "-Xclang", "-ast-dump=json", "-x", "c++", "-"]
    try:
        r = subprocess.run(cmd, input=text.encode("utf-8"), capture_output=True)
    except OSError as e:
        raise ConformError(f"cannot run {clang}: {e}") from e
    if not r.stdout.strip():
        err = r.stderr.decode(errors="replace")[-2000:]
        raise ConformError(f"{clang} produced no AST (exit {r.returncode}): {err}")
    try:
        ast = json.loads(r.stdout)
    except json.JSONDecodeError as e:
        raise ConformError(f"unreadable JSON AST from {clang}: {e}") from e
    diags, chain = [], []
    for raw in r.stderr.decode("utf-8", errors="replace").splitlines():
        m = _INCLUDED_FROM.match(raw)
        if m:
            chain.append((_display_path(m.group("file")), int(m.group("line"))))
            continue
        m = _DIAG.match(raw)
        if m:
            diags.append((_display_path(m.group("file")), int(m.group("line")), m.group("sev"), m.group("msg"),
                          chain))
        chain = [] if not raw.startswith("In file included from") else chain
    return ast, diags


# ------------------------------------------------------------------------------------------- types
_AS_NUMBERS = {"1": "device", "2": "constant", "3": "threadgroup"}
_AS_TOKEN = re.compile(r"__attribute__\(\(address_space\((\d+)\)\)\)|\b(device|constant|threadgroup|"
                       r"threadgroup_imageblock|object_data|ray_data)\b")
_SCALAR_NAMES = {
    "unsigned int": "uint", "uint": "uint", "uint32_t": "uint", "unsigned": "uint",
    "unsigned short": "ushort", "ushort": "ushort", "uint16_t": "ushort",
    "int": "int", "int32_t": "int", "short": "short", "int16_t": "short",
    "unsigned char": "uchar", "uchar": "uchar", "uint8_t": "uchar", "char": "char", "signed char": "char",
    "int8_t": "char", "bool": "bool", "_Bool": "bool",
    "unsigned long": "ulong", "ulong": "ulong", "uint64_t": "ulong", "size_t": "ulong",
    "long": "long", "int64_t": "long", "ptrdiff_t": "long",
    "float": "float", "half": "half", "_Float16": "half", "__fp16": "half", "bfloat": "bfloat", "__bf16": "bfloat",
    "double": "double", "long double": "long double", "long long": "long long",
    "unsigned long long": "unsigned long long",
}
_SCALAR_SIZE = {"bool": 1, "char": 1, "uchar": 1, "short": 2, "ushort": 2, "half": 2, "bfloat": 2, "int": 4,
                "uint": 4, "float": 4, "long": 8, "ulong": 8}
_VECTOR_NAME = re.compile(r"^(packed_)?(bool|char|uchar|short|ushort|int|uint|long|ulong|half|bfloat|float)([234])$")
_EXT_VECTOR = re.compile(r"^(.*?)\s*__attribute__\(\(ext_vector_type\((\d+)\)\)\)$")
_VEC_TEMPLATE = re.compile(r"^(?:metal::)?vec<\s*(.+?)\s*,\s*(\d+)\s*>$")
_QUALIFIERS = re.compile(r"\b(?:const|volatile|__restrict|restrict|struct|class|union|enum|thread)\b|"
                         r"__attribute__\(\(address_space\(\d+\)\)\)|\b(?:device|constant|threadgroup)\b")
_FUNCPTR = re.compile(r"\(\s*(?:[\w:<>, ]*::)?[*&^][^()]*\)\s*\(")
_FUNCPTR_TOP = re.compile(r"^[^()]*\(\s*(?:[\w:<>, ]*::)?[*&^]\s*(?:const\s*)?\)\s*\(")  # the type *is* one
_ATOMIC = re.compile(r"_Atomic\(([^()]*)\)|\batomic_(int|uint|bool|ulong|long|float)\b|\batomic<\s*([^<>]*?)\s*>")
_SIMD_MATRIX = re.compile(r"\bsimdgroup_matrix<\s*([^,<>]+?)\s*,\s*([^,<>]+?)\s*,\s*([^,<>]+?)\s*>")
_TENSOR_NAME = re.compile(r"\b(?:tensor|dextents|cooperative_tensor|tensor_inline|tensor_handle|tensor_offset|"
                          r"execution_simdgroup|execution_simdgroups|execution_thread|execution_threadgroup)\b|"
                          r"\bmpp\b|\bmatmul2d\w*|\btensor_ops\b")


def _top_level_split(s: str, seps: str) -> list[tuple[str, str]]:
    """s cut at each character of `seps` outside (), <>, []: [(segment, separator after it)]."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        if depth == 0 and ch in seps:
            out.append(("".join(cur), ch))
            cur = []
        else:
            cur.append(ch)
    out.append(("".join(cur), ""))
    return out


def address_space(segment: str) -> str:
    """The address space named by the qualifiers of one declarator segment ("thread" when none)."""
    spaces = []
    for m in _AS_TOKEN.finditer(segment):
        if segment.count("<", 0, m.start()) == segment.count(">", 0, m.start()):  # not inside a template argument
            spaces.append(_AS_NUMBERS.get(m.group(1), "other") if m.group(1) else m.group(2))
    return spaces[-1] if spaces else "thread"


def object_space(type_str: str) -> str:
    """The address space of an object of type `type_str` itself (a pointer variable is in thread memory
    whatever it points to)."""
    return address_space(_top_level_split(type_str.split("[")[0] if "(" not in type_str else type_str, "*&")[-1][0])


def pointee(type_str: str) -> tuple[str, str] | None:
    """(kind "*"/"&", pointee type) when `type_str` is a pointer or reference type, else None."""
    s = type_str.strip()
    s = re.sub(r"(?:\s*(?:const|volatile|__restrict|restrict))+$", "", s)
    if s.endswith("&&"):
        return "&", s[:-2].strip()
    if s.endswith("*") or s.endswith("&"):
        parts = _top_level_split(s, "*&")
        if len(parts) >= 2:
            kind = parts[-2][1]
            head = "".join(seg + sep for seg, sep in parts[:-2]) + parts[-2][0]
            return kind, head.strip()
    return None


def scalar_name(type_str: str) -> str | None:
    """The MSL scalar a (qualifier-free) type string names, or None."""
    s = " ".join(_QUALIFIERS.sub(" ", type_str).split())
    s = re.sub(r"^(?:metal|::metal)::", "", s)
    return _SCALAR_NAMES.get(s)


def vector_shape(type_str: str) -> tuple[str, int] | None:
    """(scalar, components) of a scalar (components 1) or vector type string, else None."""
    s = " ".join(_QUALIFIERS.sub(" ", type_str).split())
    s = re.sub(r"^(?:metal|::metal)::", "", s)
    m = _EXT_VECTOR.match(s)
    if m:
        sc = scalar_name(m.group(1))
        return (sc, int(m.group(2))) if sc else None
    m = _VECTOR_NAME.match(s)
    if m:
        return _SCALAR_NAMES[m.group(2)], int(m.group(3))
    m = _VEC_TEMPLATE.match(s)
    if m:
        sc = scalar_name(m.group(1))
        return (sc, int(m.group(2))) if sc else None
    sc = scalar_name(s)
    return (sc, 1) if sc else None


def type_name(shape: tuple[str, int]) -> str:
    return shape[0] if shape[1] == 1 else f"{shape[0]}{shape[1]}"


def _show(type_str: str) -> str:
    """A type as MSL spells it: uint4 for clang's ext_vector_type(4) of uint, `constant` for the const
    address space 2 of the shim."""
    shape = vector_shape(type_str) if pointee(type_str) is None else None
    if shape:
        return type_name(shape)
    s = re.sub(r"\bconst\s+__attribute__\(\(address_space\(2\)\)\)", "constant", type_str)
    return re.sub(r"__attribute__\(\(address_space\((\d)\)\)\)", lambda m: _AS_NUMBERS.get(m.group(1), m.group(0)), s)


def _type_strings(node: dict) -> list[str]:
    t = node.get("type")
    if not isinstance(t, dict):
        return []
    return [s for s in (t.get("qualType"), t.get("desugaredQualType")) if s]


def _best_type(node: dict) -> str:
    t = node.get("type") or {}
    return t.get("desugaredQualType") or t.get("qualType") or ""


# ------------------------------------------------------------------------------------------- analysis
@dataclasses.dataclass
class _Function:
    id: str
    name: str
    kind: str
    loc: tuple[str, int]
    user: bool
    pattern: bool  # a template pattern (dependent): kernel rules are checked on its instantiations
    specialization: bool
    type: str
    attrs: list  # [(attribute, args, loc)]
    params: list  # [(name, type_str, [(attribute, args, loc)], loc)]
    has_body: bool = False
    calls: list = dataclasses.field(default_factory=list)  # [(callee id, loc)]
    tg_vars: list = dataclasses.field(default_factory=list)  # [(name, type_str, loc)]
    parent_record: str | None = None
    param_ids: list = dataclasses.field(default_factory=list)  # the ParmVarDecl ids, in order
    body: dict | None = None  # the CompoundStmt (for the performance rules)

    @property
    def is_kernel(self) -> bool:
        return any(a == "kernel" for a, _, _ in self.attrs)

    def attr(self, name: str):
        return next(((args, loc) for a, args, loc in self.attrs if a == name), None)


def _annotation(node: dict) -> tuple[str, list] | None:
    """(attribute, [argument values]) of an AnnotateAttr written by msl_sim/conform.h."""
    values = []
    for arg in node.get("inner", ()):
        v = arg.get("value")
        if v is None:
            # a string literal's value lives on the StringLiteral under the decay casts
            stack = [arg]
            while stack:
                x = stack.pop()
                if x.get("kind") == "StringLiteral":
                    v = x.get("value")
                    break
                stack.extend(x.get("inner", ()))
        if isinstance(v, str):
            m = re.fullmatch(r'&?"((?:[^"\\]|\\.)*)"(?:\[0\])?', v)
            if m:
                v = m.group(1)
            elif re.fullmatch(r"-?\d+", v):
                v = int(v)
        values.append(v)
    if not values or not isinstance(values[0], str):
        return None
    return values[0], values[1:]


class _Checker:
    """One family: walks the JSON AST once, collecting functions, calls and declarations, then applies the rules."""

    def __init__(self, line_map, version: str, main_file: str = "<stdin>"):
        self.line_map = line_map
        self.version = version
        self.vnum = version_number(version)
        self.main_file = main_file
        self.cur_file: str | None = None
        self.cur_line = 0
        self.found: set[Violation] = set()
        self.functions: dict[str, _Function] = {}
        self.canonical: dict[str, str] = {}  # decl id -> the first declaration's id
        self.std_decls: set[str] = set()
        self.typedefs: dict[str, str] = {}  # user typedef name -> desugared type
        self.vars: dict[str, dict] = {}  # VarDecl / ParmVarDecl id -> node (the performance rules' constants)
        self._type_cache: dict[tuple, list] = {}

    # ---- locations (JSON dumps a file and a line only when they change: resolved in document order)
    def _bare(self, d: dict):
        if "offset" not in d:
            return None
        if "file" in d:
            self.cur_file = d["file"]
        if "line" in d:
            self.cur_line = d["line"]
        return self.cur_file, self.cur_line

    def _loc(self, d):
        if not isinstance(d, dict):
            return None
        if "expansionLoc" in d or "spellingLoc" in d:
            res = None
            for k, v in d.items():
                r = self._bare(v) if isinstance(v, dict) else None
                if k == "expansionLoc":
                    res = r
            return res
        return self._bare(d)

    def _node_loc(self, node: dict):
        """(actual file, actual line) of a node, updating the location state from all its locations."""
        best = None
        for k, v in node.items():
            if k == "loc":
                r = self._loc(v)
                best = r or best
            elif k == "range" and isinstance(v, dict):
                b = self._loc(v.get("begin"))
                self._loc(v.get("end"))
                if best is None:
                    best = b
            elif k in ("attrLoc",):
                self._loc(v)
            elif k == "inner":
                break
        return best

    def origin(self, loc) -> tuple[str, int] | None:
        """The original (file, line) of an actual location; None outside the checked source."""
        if loc is None or loc[0] != self.main_file:
            return None
        line = loc[1]
        if 0 < line < len(self.line_map):
            return self.line_map[line]
        return None

    def report(self, loc, rule: str, message: str):
        if loc is None:
            return
        assert rule in RULES, rule
        self.found.add(Violation(loc[0], loc[1], rule, message))

    # ---- the walk
    def walk(self, ast: dict):
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 20000))
        self._walk(ast, {"fn": None, "pattern": False, "std": False, "record": None, "scope": "namespace"}, None, 0)

    def _skim(self, node: dict):
        """Only the locations of a subtree (to keep the location state exact where nothing else is needed)."""
        if not isinstance(node, dict):
            return
        self._node_loc(node)
        for child in node.get("inner") or ():
            self._skim(child)

    def _walk(self, node: dict, ctx: dict, parent: str | None, index: int):
        kind = node.get("kind")
        if kind is None:
            return
        if kind in ("FunctionTemplateDecl", "ClassTemplateDecl", "VarTemplateDecl", "TypeAliasTemplateDecl"):
            self._node_loc(node)
            self._walk_template(node, ctx)
            return
        if kind in FUNCTION_KINDS:
            self._function(node, ctx)
            return
        loc = self.origin(self._node_loc(node))
        node["_o"] = loc  # the original location, for the performance rules' second look at function bodies
        if kind in ("VarDecl", "EnumConstantDecl") and node.get("id"):
            self.vars[node["id"]] = node
        child_ctx = ctx
        if kind == "NamespaceDecl":
            child_ctx = dict(ctx, std=ctx["std"] or node.get("name") == "std")
            if loc and node.get("name") == "std":
                self.report(loc, "MSL-STD", "declarations in namespace std: MSL has no C++ standard library")
        elif kind in ("CXXRecordDecl", "ClassTemplateSpecializationDecl", "ClassTemplatePartialSpecializationDecl"):
            child_ctx = dict(ctx, record=node.get("name"), scope="record",
                             pattern=ctx["pattern"] or kind == "ClassTemplatePartialSpecializationDecl")
            if loc:
                self._record(node, loc)
        if ctx["std"] and node.get("id"):
            self.std_decls.add(node["id"])
        if loc:
            self._node_rules(node, kind, loc, ctx, parent, index)
        for i, child in enumerate(node.get("inner") or ()):
            if isinstance(child, dict):
                self._walk(child, child_ctx, kind, i)

    def _walk_template(self, node: dict, ctx: dict):
        """A template: its pattern is walked as dependent, its specializations (instantiations) as concrete."""
        pattern_seen = False
        kind = node["kind"]
        for i, child in enumerate(node.get("inner") or ()):
            if not isinstance(child, dict) or child.get("kind") is None:
                continue
            k = child["kind"]
            is_decl = k in FUNCTION_KINDS or k in ("CXXRecordDecl", "VarDecl", "TypeAliasDecl")
            if is_decl and not pattern_seen:
                pattern_seen = True
                self._walk(child, dict(ctx, pattern=True), kind, i)
            elif k in FUNCTION_KINDS:
                self._function(child, dict(ctx, pattern=False), template_id=node.get("id"))
            elif is_decl or k == "ClassTemplateSpecializationDecl":
                self._walk(child, dict(ctx, pattern=False), kind, i)
            else:
                self._walk(child, ctx, kind, i)

    def _function(self, node: dict, ctx: dict, template_id=None):
        if "loc" not in node and "range" not in node:
            return  # a reference to a specialization dumped in full elsewhere
        loc = self.origin(self._node_loc(node))
        if node.get("isImplicit"):
            for child in node.get("inner") or ():  # compiler-made (copy assignment, ...): nothing written
                self._skim(child)
            return
        user = loc is not None
        fid = node.get("id")
        prev = node.get("previousDecl")
        self.canonical[fid] = self.canonical.get(prev, prev) if prev else fid
        inner = node.get("inner") or ()
        is_spec = template_id is not None and not ctx["pattern"] or \
            any(isinstance(c, dict) and c.get("kind") == "TemplateArgument" for c in inner)
        fn = _Function(id=fid, name=node.get("name", ""), kind=node["kind"], loc=loc, user=user,
                       pattern=ctx["pattern"], specialization=is_spec, type=_best_type(node), attrs=[], params=[],
                       parent_record=ctx.get("record"))
        if ctx["std"]:
            self.std_decls.add(fid)
        if user:
            self._node_rules(node, node["kind"], loc, ctx, None, 0)
        # parameters, body, then the attributes (the order of the dump: walked in order, so that the location
        # state stays exact)
        fctx = dict(ctx, fn=fn, scope="function")
        for i, child in enumerate(inner):
            if not isinstance(child, dict) or child.get("kind") is None:
                continue
            k = child["kind"]
            if k == "ParmVarDecl":
                ploc = self.origin(self._node_loc(child))
                pattrs = []
                for a in child.get("inner") or ():
                    if isinstance(a, dict) and a.get("kind") == "AnnotateAttr":
                        aloc = self.origin(self._node_loc(a))
                        ann = _annotation(a)
                        for sub in a.get("inner") or ():
                            self._skim(sub)
                        if ann:
                            pattrs.append((ann[0], ann[1], aloc or ploc))
                    elif isinstance(a, dict):
                        self._walk(a, fctx, "ParmVarDecl", 0)
                fn.params.append((child.get("name", ""), _best_type(child), pattrs, ploc or loc))
                fn.param_ids.append(child.get("id"))
                if child.get("id"):
                    self.vars[child["id"]] = child
                if ploc:
                    self._node_rules(child, "ParmVarDecl", ploc, fctx, node["kind"], i)
            elif k == "AnnotateAttr":
                aloc = self.origin(self._node_loc(child))
                ann = _annotation(child)
                for sub in child.get("inner") or ():
                    self._skim(sub)
                if ann:
                    fn.attrs.append((ann[0], ann[1], aloc or loc))
            else:
                if k in ("CompoundStmt", "CXXTryStmt"):
                    fn.has_body = True
                    fn.body = child
                self._walk(child, fctx, node["kind"], i)
        if fid in self.functions and not fn.has_body:
            return
        self.functions[fid] = fn

    def _record(self, node: dict, loc):
        if node.get("bases"):
            self.report(loc, "MSL-VIRTUAL", f"class {node.get('name', '')} derives from "
                        f"{', '.join(b.get('type', {}).get('qualType', '?') for b in node['bases'])}: MSL has no "
                        "derived classes")

    # ---- per-node rules
    def _node_rules(self, node: dict, kind: str, loc, ctx: dict, parent: str | None, index: int):
        fn: _Function | None = ctx["fn"]
        if node.get("isImplicit") and kind != "ParmVarDecl":
            return
        if kind in ("DeclRefExpr", "MemberExpr"):
            ref = node.get("referencedDecl") if kind == "DeclRefExpr" else None
            rid = ref.get("id") if ref else node.get("referencedMemberDecl")
            rkind = ref.get("kind") if ref else None
            if ref and rid in self.std_decls:
                self.report(loc, "MSL-STD", f"{ref.get('name', '?')} is from the C++ standard library")
            if fn is not None and rid and (rkind in FUNCTION_KINDS or kind == "MemberExpr"):
                fn.calls.append((rid, loc))
            name = ref.get("name", "") if ref else ""
            if name.startswith('operator""') and name.endswith("bf") and self.vnum < 310:
                self.report(loc, "MSL-VERSION", f"bfloat literal: bfloat needs MSL 3.1 (2.1), the family is "
                                                f"pinned to {self.version}")
            if ref and rkind == "FunctionDecl" and name.startswith("atomic_"):
                self._atomic_types(ref.get("type", {}).get("qualType", ""), loc, "call of " + ref["name"])
        elif kind in ("CXXThrowExpr", "CXXTryStmt", "CXXCatchStmt"):
            self.report(loc, "MSL-EXCEPTION", {"CXXThrowExpr": "throw", "CXXTryStmt": "try",
                                               "CXXCatchStmt": "catch"}[kind] + ": MSL has no exception handling")
        elif kind == "CXXNoexceptExpr":
            self.report(loc, "MSL-EXCEPTION", "the noexcept operator does not exist in MSL")
        elif kind in ("CXXNewExpr", "CXXDeleteExpr"):
            what = "new" if kind == "CXXNewExpr" else "delete"
            self.report(loc, "MSL-NEW", f"{what}: MSL has no dynamic allocation")
        elif kind in ("GotoStmt", "IndirectGotoStmt", "AddrLabelExpr"):
            self.report(loc, "MSL-GOTO", "goto: MSL has no goto statement")
        elif kind in ("CXXTypeidExpr", "CXXDynamicCastExpr"):
            self.report(loc, "MSL-VIRTUAL", ("typeid" if kind == "CXXTypeidExpr" else "dynamic_cast") +
                        ": MSL has no run-time type identification")
        elif kind == "LambdaExpr" and self.vnum < 320:
            self.report(loc, "MSL-VERSION", f"lambda expression: MSL has lambdas from 3.2 (1.5.4), the family is "
                                            f"pinned to {self.version}")
        elif kind == "UsingDirectiveDecl" and (node.get("nominatedNamespace") or {}).get("name") == "std":
            self.report(loc, "MSL-STD", "using namespace std: MSL has no C++ standard library")
        elif kind == "AnnotateAttr":
            ann = _annotation(node)
            if ann and parent not in ("ParmVarDecl",) + tuple(FUNCTION_KINDS):
                self.report(loc, "MSL-ATTR-KIND", f"[[{ann[0]}]] on a {parent or 'declaration'}: the MSL "
                            "attributes checked here belong on kernel parameters and kernels (program-scope "
                            "built-in variables, 5.2.3.6, are not used in these families)")
        if kind in ("CXXMethodDecl", "CXXDestructorDecl") and (node.get("virtual") or node.get("pure")):
            self.report(loc, "MSL-VIRTUAL", f"virtual function {node.get('name', '')}: MSL has no virtual functions")
        if kind in ("FunctionDecl",) and node.get("name") == "main" and ctx["scope"] == "namespace":
            self.report(loc, "MSL-MAIN", "a function named main: MSL does not allow one")
        if kind == "VarDecl":
            self._var_rules(node, loc, ctx)
        elif kind in ("TypedefDecl", "TypeAliasDecl") and not ctx["pattern"] and node.get("name"):
            self.typedefs.setdefault(node["name"], _best_type(node))
        if kind in TYPED_DECL_KINDS:
            self._type_rules(node, kind, loc, ctx["pattern"])
            if kind == "UnaryExprOrTypeTraitExpr" and node.get("argType"):
                self._type_rules({"type": node["argType"]}, "UnaryExprOrTypeTraitExpr", loc, ctx["pattern"])
        elif "type" in node and fn is not None and kind not in ("AnnotateAttr",):
            # an expression of function-pointer type (other than the decayed callee of a call)
            t = (node.get("type") or {}).get("qualType", "")
            if "(" in t and _FUNCPTR_TOP.search(t) and not (
                    kind == "ImplicitCastExpr" and node.get("castKind") == "FunctionToPointerDecay"
                    and index == 0 and parent in ("CallExpr", "CXXMemberCallExpr", "CXXOperatorCallExpr")):
                self.report(loc, "MSL-FUNCPTR", f"expression of function-pointer type {t}: these families use no "
                                                "function pointers (only [[visible]] functions have them)")

    def _var_rules(self, node: dict, loc, ctx: dict):
        t = _best_type(node)
        name = node.get("name", "")
        space = object_space(t)
        sc = node.get("storageClass")
        if node.get("tls"):
            self.report(loc, "MSL-TLS", f"thread_local {name}: MSL has no thread_local storage")
        if sc == "register":
            self.report(loc, "MSL-TLS", f"register {name}: MSL has no register storage class")
        fn: _Function | None = ctx["fn"]
        if space == "threadgroup":
            if fn is None:
                self.report(loc, "MSL-TG-SCOPE", f"threadgroup variable {name} at program scope: declare it in "
                                                 "the kernel")
            else:
                fn.tg_vars.append((name, t, loc))
            return
        if ctx["scope"] == "function" and sc == "static":
            self.report(loc, "MSL-STATIC", f"static variable {name} inside a function: MSL allows static only "
                                           "for program-scope constant variables")
        elif ctx["scope"] in ("namespace", "record") and fn is None and space != "constant":
            what = "static data member" if ctx["scope"] == "record" else "program-scope variable"
            self.report(loc, "MSL-STATIC", f"{what} {name} is not in the constant address space (declare it "
                                           "`constant`)")

    def _type_rules(self, node: dict, kind: str, loc, pattern: bool = False):
        """Rules on a declared type, as written (qualType) and desugared: one report per rule and node. In a
        template pattern an unknown element type (a template parameter) is left to the instantiations."""
        reported = set()
        for t in _type_strings(node):
            if kind in FUNCTION_KINDS:
                t = t.split("(")[0].strip()  # the return type: parameters are checked as ParmVarDecls
            key = (t, kind, pattern)
            found = self._type_cache.get(key)
            if found is None:
                found = self._type_findings(t, kind, pattern)
                self._type_cache[key] = found
            for rule, msg in found:
                if rule not in reported:
                    reported.add(rule)
                    self.report(loc, rule, msg)

    def _type_findings(self, t: str, kind: str, pattern: bool = False) -> list[tuple[str, str]]:
        out = []
        for bad in ("long double", "unsigned long long", "long long", "double"):
            if re.search(r"\b" + bad.replace(" ", r"\s+") + r"\b", t):
                out.append(("MSL-DOUBLE", f"type {t}: {bad} does not exist in MSL (2.1)"))
                break
        if "std::" in t and "std::nullptr_t" not in t:
            out.append(("MSL-STD", f"type {t} is from the C++ standard library"))
        if kind not in FUNCTION_KINDS and _FUNCPTR.search(t):
            out.append(("MSL-FUNCPTR", f"function pointer type {t}: these families use no function pointers "
                                       "(only [[visible]] functions have them)"))
        if self.vnum < 310 and re.search(r"\b(?:bfloat\d?|__bf16|simdgroup_bfloat8x8)\b", t):
            out.append(("MSL-VERSION", f"type {t}: bfloat needs MSL 3.1 (2.1), the family is pinned to {self.version}"))
        if self.vnum < 400 and _TENSOR_NAME.search(t):
            out.append(("MSL-VERSION", f"type {t}: tensors need MSL 4.0 (2.20), the family is pinned to "
                                       f"{self.version}"))
        for m in _SIMD_MATRIX.finditer(t):
            elem = scalar_name(m.group(1))
            if pattern and (elem is None or not m.group(2).isdigit() or not m.group(3).isdigit()):
                continue  # dependent: checked in the instantiations
            if elem not in ("half", "float", "bfloat") or m.group(2) != "8" or m.group(3) != "8":
                out.append(("MSL-SIMDGROUP-MATRIX", f"{m.group(0)}: SIMD-group matrices are 8x8 of half, float or "
                                                    "bfloat"))
            elif elem == "bfloat" and self.vnum < 310:
                out.append(("MSL-VERSION", f"{m.group(0)}: bfloat SIMD-group matrices need MSL 3.1 (2.4)"))
        if kind in ("VarDecl", "ParmVarDecl", "FieldDecl", "TypedefDecl", "TypeAliasDecl", "TemplateArgument"):
            out.extend(self._atomic_findings(t, kind, pattern=pattern))
        return out

    def _atomic_types(self, t: str, loc, what: str):
        for rule, msg in self._atomic_findings(t, "call", what):
            self.report(loc, rule, msg)

    def _atomic_findings(self, t: str, kind: str, what: str | None = None,
                         pattern: bool = False) -> list[tuple[str, str]]:
        """Atomic element types and the address spaces they live in, from a declared (or callee) type."""
        if "atomic" not in t.lower():
            return []
        out = []
        segments = []
        if kind in FUNCTION_KINDS or kind == "call":
            m = re.match(r"^[^(]*\((.*)\)\s*(?:const)?\s*$", t)
            params = _top_level_split(m.group(1), ",") if m else []
            segments = [s for s, _ in params[:1]]  # the atomic object is the first argument
        else:
            segments = [t]
        for seg in segments:
            parts = _top_level_split(seg, "*&")
            for idx, (part, _) in enumerate(parts):
                for m in _ATOMIC.finditer(part):
                    elem = scalar_name(m.group(1) or m.group(2) or m.group(3) or "") or \
                        (m.group(1) or m.group(2) or m.group(3) or "").strip()
                    pointer_target = idx < len(parts) - 1
                    space = address_space(part)
                    where = what or "type " + _show(t)
                    if elem in ("ulong", "long"):
                        out.append(("MSL-ATOMIC", f"{where}: 64-bit atomics (atomic<{elem}>) are not available on "
                                                  "the targeted GPU families (only a few fetch-min/max, on some)"))
                    elif elem not in ("int", "uint", "float", "bool") and pattern and not scalar_name(elem):
                        continue  # atomic<T> in a template pattern: checked in the instantiations
                    elif elem not in ("int", "uint", "float", "bool"):
                        out.append(("MSL-ATOMIC", f"{where}: atomic<{elem}> is not an MSL atomic type (int, uint, "
                                                  "bool, float)"))
                    elif elem == "float" and self.vnum < 300:
                        out.append(("MSL-VERSION", f"{where}: atomic_float needs MSL 3.0 (2.6)"))
                    elif elem == "bool" and self.vnum < 240:
                        out.append(("MSL-VERSION", f"{where}: atomic_bool needs MSL 2.4 (2.6)"))
                    if kind == "FieldDecl" and not pointer_target:
                        continue  # a member: the enclosing object's address space decides
                    if kind in ("TypedefDecl", "TypeAliasDecl", "TemplateArgument") and not pointer_target:
                        continue
                    if space == "thread" or space == "constant":
                        out.append(("MSL-ATOMIC", f"{where}: an atomic in {space} memory (atomics live in device or "
                                                  "threadgroup memory)"))
                    elif elem == "float" and space != "device":
                        out.append(("MSL-ATOMIC", f"{where}: atomic_float in {space} memory (atomic float add/sub "
                                                  "exist in device memory only, 6.15.4.5)"))
        return out

    # ---- diagnostics of clang
    def diagnostics(self, diags):
        for file, line, sev, msg, chain in diags:
            loc = (file, line)
            if "msl_conform: <metal_tensor>" in msg:
                user = next(((f, n) for f, n in chain if not f.startswith("src/msl_sim") and "<" not in f), loc)
                self.report(user, "MSL-VERSION", f"<metal_tensor> / MetalPerformancePrimitives: tensor operations "
                                                 f"need MSL 4.0 (2.20, 7), the family is pinned to {self.version}")
                continue
            if file.startswith("src/msl_sim") and sev == "warning":
                continue
            if "unknown attribute" in msg:
                name = re.search(r"'([^']+)'", msg)
                self.report(loc, "MSL-ATTR-KIND", f"[[{name.group(1) if name else '?'}]] is not a kernel "
                                                  "attribute MSL knows here (5.2.3.6 Table 5.8, 5.2.1)")
            elif "variable length array" in msg:
                self.report(loc, "MSL-VLA", f"variable-length array ({msg})")
            elif "C++17" in msg:
                self.report(loc, "MSL-VERSION", f"{msg}: MSL {self.version} is C++14-based (1.5), C++17 needs MSL 4.0")
            elif sev != "warning":
                rule = "MSL-STD" if re.search(r"'std'|namespace 'std'|std::", msg) else "MSL-PARSE"
                if rule == "MSL-PARSE" and self.vnum < 400 and _TENSOR_NAME.search(msg):
                    rule = "MSL-VERSION"
                    msg += f" (tensor operations need MSL 4.0; the family is pinned to {self.version})"
                self.report(loc, rule, f"clang: {msg}")

    # ---- whole-family rules
    def finish(self):
        funcs = self.functions
        canon = lambda i: self.canonical.get(i, i)  # noqa: E731
        by_canon: dict[str, _Function] = {}
        for f in funcs.values():
            c = canon(f.id)
            if f.has_body or c not in by_canon:
                by_canon[c] = f
        kernels = [f for f in funcs.values() if f.is_kernel and f.has_body and not f.pattern]
        for f in funcs.values():
            if f.user and not f.pattern:
                self._attribute_placement(f)
        for f in funcs.values():
            if f.user and f.is_kernel and f.pattern:
                self._kernel_params_attributed(f)
        host_names: dict[str, _Function] = {}
        for k in sorted(kernels, key=lambda f: (f.loc or ("", 0))):
            if not k.user:
                continue
            self._kernel_params_attributed(k)
            self._kernel_attributes(k)
            self._kernel_function(k)
            self._threadgroup_memory(k)
            hn = self._host_name(k)
            where = self._instance_loc(k)
            if hn in host_names and host_names[hn] is not k:
                self.report(where, "MSL-HOST-NAME", f"host name {hn!r} is already used by the kernel at "
                                                    f"{self._where(host_names[hn])}")
            host_names.setdefault(hn, k)
        self._overloads([f for f in funcs.values() if f.is_kernel and f.user and not f.specialization])
        for f in funcs.values():
            if f.user and not f.pattern and f.has_body and not f.is_kernel:
                for name, t, loc in f.tg_vars:
                    self.report(loc, "MSL-TG-SCOPE", f"threadgroup variable {name} declared in {f.name}(), which is "
                                                     "not a kernel: declare it in the kernel and pass a pointer")
        self._call_graph(funcs, by_canon, canon)

    def _where(self, f: _Function) -> str:
        loc = self._instance_loc(f)
        return f"{loc[0]}:{loc[1]}" if loc else "?"

    def _host_name(self, k: _Function) -> str:
        a = k.attr("host_name")
        if a and a[0] and isinstance(a[0][0], str):
            return a[0][0]
        return k.name

    def _instance_loc(self, k: _Function):
        """Where a kernel instance is named: its INSTANTIATE_KERNEL line for an instantiation, else its declaration."""
        a = k.attr("host_name")
        return (a[1] if a and a[1] else None) or k.loc

    def _label(self, k: _Function) -> str:
        hn = self._host_name(k)
        return f"kernel {k.name}" + (f" ({hn})" if hn != k.name else "")

    def _attribute_placement(self, f: _Function):
        kernel = f.is_kernel
        for a, args, loc in f.attrs:
            if a in FUNCTION_ATTRS and a != "kernel" and not kernel:
                self.report(loc, "MSL-ATTR-KIND", f"[[{a}]] on {f.name}(), which is not a kernel (5.1.3, 5.1.10)")
            elif a in KERNEL_INPUT_ATTRS or a in RESOURCE_ATTRS or a in GRAPHICS_ATTRS:
                self.report(loc, "MSL-ATTR-KIND", f"[[{a}]] on the function {f.name}(): it belongs on a kernel "
                                                  "parameter")
        for pname, t, attrs, ploc in f.params:
            for a, args, aloc in attrs:
                if a in GRAPHICS_ATTRS:
                    self.report(aloc, "MSL-ATTR-KIND", f"[[{a}]] on parameter {pname} of {f.name}(): a vertex/fragment "
                                                       "attribute, not a kernel input (5.2.3.1-5.2.3.5 vs 5.2.3.6)")
                elif not kernel and (a in KERNEL_INPUT_ATTRS or a in RESOURCE_ATTRS):
                    self.report(aloc, "MSL-ATTR-KIND", f"[[{a}]] on parameter {pname} of {f.name}(), which is not a "
                                                       "kernel: built-in and resource attributes belong on kernel "
                                                       "parameters")
                elif a in FUNCTION_ATTRS:
                    self.report(aloc, "MSL-ATTR-KIND", f"[[{a}]] on parameter {pname}: a function attribute")

    def _kernel_params_attributed(self, k: _Function):
        for pname, t, attrs, ploc in k.params:
            if not attrs:
                self.report(ploc, "MSL-PARAM-ATTR", f"parameter {pname} of kernel {k.name} has no attribute "
                                                    "([[buffer(i)]], [[thread_position_in_grid]], ...)")

    def _kernel_attributes(self, k: _Function):
        label = f"kernel {k.name}"  # not the host name: one report for all instantiations with the same types
        shapes: dict[str, tuple] = {}  # attribute -> (shape or None, type string, param, loc)
        groups: dict[str, dict[int, tuple]] = {"buffer": {}, "threadgroup": {}, "texture": {}}
        for pname, t, attrs, ploc in k.params:
            for a, args, aloc in attrs:
                if a in VECTOR_ATTRS or a in SCALAR_ATTRS:
                    shape = vector_shape(t) if pointee(t) is None else None
                    ok = shape is not None and shape[0] in ("uint", "ushort") and (
                        shape[1] == 1 or a in VECTOR_ATTRS and shape[1] in (2, 3))
                    if not ok:
                        allowed = ("ushort, ushort2, ushort3, uint, uint2 or uint3" if a in VECTOR_ATTRS
                                   else "ushort or uint")
                        self.report(aloc, "MSL-ATTR-TYPE", f"{label}: [[{a}]] parameter {pname} is {_show(t)}; "
                                                           f"it takes {allowed}")
                    if a in shapes:
                        self.report(aloc, "MSL-ATTR-KIND", f"{label}: [[{a}]] appears twice")
                    shapes[a] = (shape if ok else None, t, pname, aloc)
                elif a in RESOURCE_ATTRS:
                    self._resource(k, label, a, args, pname, t, aloc, groups)
        # one width for the grid attributes
        present = [(a, shapes[a]) for a in GRID_ATTRS if a in shapes and shapes[a][0] is not None]
        present.sort(key=lambda x: x[1][3] or ("", 0))
        vectors = [(a, s) for a, s in present if s[0][1] > 1]
        if vectors:
            ref_attr, ref = vectors[0]
            for a, s in present:
                if s[0][1] != ref[0][1]:
                    self.report(s[3], "MSL-ATTR-WIDTH",
                                f"{label}: [[{a}]] {s[2]} is {type_name(s[0])} (width {s[0][1]}) but [[{ref_attr}]] "
                                f"{ref[2]} is {type_name(ref[0])} (width {ref[0][1]}): the grid attributes of a kernel "
                                "are all scalars or all vectors of one width")
        # pairs whose types match
        for group in (("thread_position_in_grid", "threads_per_grid"),
                      ("thread_position_in_threadgroup", "threads_per_threadgroup",
                       "dispatch_threads_per_threadgroup")):
            self._same_type(label, shapes, group, "have the same type")
        tpt = shapes.get("thread_position_in_threadgroup")
        tit = shapes.get("thread_index_in_threadgroup")
        if tpt and tit and tpt[0] and tit[0] and tpt[0][0] == "uint" and tit[0][0] != "uint":
            self.report(tit[3], "MSL-ATTR-MATCH", f"{label}: [[thread_index_in_threadgroup]] {tit[2]} is "
                        f"{type_name(tit[0])} but [[thread_position_in_threadgroup]] is {type_name(tpt[0])}: it must "
                        "be uint then")
        self._same_type(label, shapes, SIMD_MATCH_ATTRS, "(the SIMD-group and quad-group attributes) share one type")

    def _same_type(self, label, shapes, group, what):
        present = [(a, shapes[a]) for a in group if a in shapes and shapes[a][0] is not None]
        present.sort(key=lambda x: x[1][3] or ("", 0))
        if not present:
            return
        ref_attr, ref = present[0]
        for a, s in present[1:]:
            if s[0] != ref[0]:
                names = ", ".join(f"[[{g}]]" for g in group)
                self.report(s[3], "MSL-ATTR-MATCH", f"{label}: [[{a}]] {s[2]} is {type_name(s[0])} but [[{ref_attr}]] "
                                                    f"{ref[2]} is {type_name(ref[0])}: {names} {what}")

    def _resource(self, k, label, a, args, pname, t, aloc, groups):
        index = args[0] if args else None
        if not isinstance(index, int):
            self.report(aloc, "MSL-BUFFER", f"{label}: [[{a}({index})]] on {pname}: the index is not an integer "
                                            "constant")
            return
        if a in ("buffer", "threadgroup") and not 0 <= index <= MAX_BUFFER_INDEX:
            self.report(aloc, "MSL-BUFFER", f"{label}: [[{a}({index})]] on {pname}: indices run from 0 to "
                                            f"{MAX_BUFFER_INDEX} (31 argument-table entries)")
        if index in groups[a]:
            first = groups[a][index]
            self.report(aloc, "MSL-BUFFER-DUP", f"{label}: [[{a}({index})]] on {pname} repeats the index of {first[0]} "
                                                f"(line {first[1][1] if first[1] else '?'})")
        else:
            groups[a][index] = (pname, aloc)
        if a == "texture":
            self.report(aloc, "MSL-ATTR-KIND", f"{label}: [[texture({index})]] on {pname}: these families bind no "
                                               "textures (the checker knows no texture types)")
            return
        p = pointee(t)
        want = ("device", "constant") if a == "buffer" else ("threadgroup",)
        if p is None:
            self.report(aloc, "MSL-BUFFER", f"{label}: [[{a}({index})]] parameter {pname} is {_show(t)}, not a "
                                            f"pointer or reference to {' or '.join(want)} memory")
            return
        seg = _top_level_split(p[1], "*&")[-1][0]
        space = address_space(seg)
        if space not in want:
            self.report(aloc, "MSL-BUFFER", f"{label}: [[{a}({index})]] parameter {pname} is {t}: a pointer or "
                                            f"reference to {space} memory, not {' or '.join(want)}")

    def _kernel_function(self, k: _Function):
        ret = k.type.split("(")[0].strip()
        if ret and ret != "void":
            self.report(k.loc, "MSL-KERNEL", f"kernel {k.name} returns {ret}: kernels return void (5.1.3)")
        for name in ("max_total_threads_per_threadgroup", "required_threads_per_threadgroup"):
            a = k.attr(name)
            if a:
                v = a[0][0] if a[0] else None
                if not isinstance(v, int) or not 0 < v <= MAX_THREADS_PER_THREADGROUP:
                    self.report(a[1], "MSL-KERNEL", f"{self._label(k)}: [[{name}({v})]]: at most "
                                                    f"{MAX_THREADS_PER_THREADGROUP} threads per threadgroup on any "
                                                    "Apple GPU")
                if name == "required_threads_per_threadgroup" and self.vnum < 400:
                    self.report(a[1], "MSL-VERSION", f"[[{name}]] needs MSL 4.0 (5.1.3), the family is pinned to "
                                                     f"{self.version}")

    def _overloads(self, kernels):
        seen: dict[tuple, _Function] = {}
        for k in sorted(kernels, key=lambda f: f.loc or ("", 0)):
            key = (k.parent_record, k.name)
            if key in seen and seen[key].type != k.type and self.canonical.get(k.id, k.id) != \
                    self.canonical.get(seen[key].id, seen[key].id):
                self.report(k.loc, "MSL-KERNEL", f"kernel {k.name} is overloaded (also at {self._where(seen[key])}): "
                                                 "kernel functions cannot be overloaded (1.5.1)")
            seen.setdefault(key, k)

    def _threadgroup_memory(self, k: _Function):
        total, parts = 0, []
        for name, t, loc in k.tg_vars:
            size, why = self.sizeof(t)
            if size is None:
                self.report(loc, "MSL-TG-SIZE", f"{self._label(k)}: threadgroup variable {name} of type {t}: {why}")
                return
            total += size
            parts.append(f"{name} {size}")
        if total > THREADGROUP_MEMORY_LIMIT:
            self.report(self._instance_loc(k), "MSL-TG-SIZE",
                        f"{self._label(k)} declares {total} bytes of threadgroup memory ({', '.join(parts)}), more "
                        f"than the {THREADGROUP_MEMORY_LIMIT} bytes of Apple GPUs")

    # ---- sizes (2.1 Table 2.2, 2.2 Tables 2.3 and 2.4)
    def sizeof(self, t: str, depth: int = 0) -> tuple[int | None, str]:
        size, align, why = self._layout(t, depth)
        return size, why

    def _layout(self, t: str, depth: int = 0) -> tuple[int | None, int, str]:
        if depth > 20:
            return None, 1, "type nesting too deep"
        s = t.strip()
        dims = re.findall(r"\[([^\]]*)\]", s)
        base = re.sub(r"\[[^\]]*\]", "", s).strip()
        count = 1
        for d in dims:
            if not d.strip().isdigit():
                return None, 1, f"array bound [{d}] is not a compile-time constant"
            count *= int(d)
        base_clean = " ".join(_QUALIFIERS.sub(" ", base).split())
        base_clean = re.sub(r"^(?:metal|::metal)::", "", base_clean)
        m = re.match(r"^_Atomic\((.*)\)$", base_clean) or re.match(r"^atomic<(.*)>$", base_clean)
        if m:
            base_clean = m.group(1).strip()
        am = re.match(r"^atomic_(int|uint|bool|float|ulong|long)$", base_clean)
        if am:
            base_clean = am.group(1)
        vm = _VECTOR_NAME.match(base_clean)
        shape = vector_shape(base_clean)
        if shape and shape[0] in _SCALAR_SIZE:
            es = _SCALAR_SIZE[shape[0]]
            n = shape[1]
            if vm and vm.group(1):  # packed_ vectors: no padding
                size = align = es * n
                align = es
            else:
                size = es * (4 if n == 3 else n)
                align = size
            return size * count, align, ""
        if base_clean in self.typedefs and depth < 20:
            size, align, why = self._layout(self.typedefs[base_clean], depth + 1)
            return (size * count if size is not None else None), align, why
        return None, 1, (f"the checker cannot size {base_clean!r} (threadgroup arrays of scalars and vectors only: a "
                         "structure in threadgroup memory does not parse in check mode either)")

    # ---- the call graph: recursion, kernels called by functions
    def _call_graph(self, funcs, by_canon, canon):
        graph: dict[str, list] = {}
        for f in funcs.values():
            if f.pattern or not f.has_body:
                continue
            edges = []
            for callee, loc in f.calls:
                target = by_canon.get(canon(callee)) or funcs.get(callee)
                if target is None:
                    continue
                if target.is_kernel and f.user and loc:
                    self.report(loc, "MSL-KERNEL", f"{f.name}() calls kernel {target.name}: kernels cannot be called "
                                                   "by other functions (5.1)")
                if target.has_body and not target.pattern:
                    edges.append((target.id, loc))
            graph[f.id] = edges
        for scc in _strongly_connected(graph):
            if len(scc) == 1:
                only = scc[0]
                if not any(t == only for t, _ in graph.get(only, ())):
                    continue
            members = set(scc)
            names = " -> ".join(funcs[i].name + "()" for i in scc) + " -> " + funcs[scc[0]].name + "()"
            sites = sorted((loc, funcs[src].name, funcs[t].name) for src in scc for t, loc in graph.get(src, ())
                           if t in members and loc)
            if sites:
                loc, a, b = sites[0]
                self.report(loc, "MSL-RECURSION", f"recursion: {a}() calls {b}() in the cycle {names}")


def _strongly_connected(graph: dict[str, list]) -> list[list[str]]:
    """Tarjan's strongly connected components of {node: [(node, _), ...]}, iteratively."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack.add(v)
            edges = graph.get(v, ())
            recurse = False
            while i < len(edges):
                w = edges[i][0]
                i += 1
                if w not in index:
                    work.append((v, i))
                    work.append((w, 0))
                    recurse = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if recurse:
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(comp[::-1])
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return out


# ------------------------------------------------------------------------------------------- performance rules
# Four shapes that keep a kernel far from its bandwidth or FLOP bound on an Apple GPU, decided on the same AST
# (no second parse): they are checked on the concrete function bodies (template instantiations, non-template
# functions), after the conformance walk has resolved every node's original location.
PERF_RULES: dict[str, Rule] = {
    "PERF-STACK-ARRAY": Rule(
        "Apple GPU register file and its spilling (philipturner/metal-benchmarks: registers are not "
        "addressable; a dynamically indexed private array goes to stack memory), MLX steel kernels (register "
        "fragments indexed only by unrolled compile-time loops)",
        "a thread-space array (local arrays of scalars, vectors, SIMD-group matrices, also array members of "
        "local structures) is indexed only by values the compiler can fold: constants, loop variables of loops "
        "with compile-time bounds, arithmetic of those"),
    "PERF-INT64-LOOP": Rule(
        "Apple GPU instruction rates (philipturner/metal-benchmarks: 64-bit integer multiply and shift are "
        "emulated, 4-13x the 32-bit cost), MLX kernels (64-bit offsets formed once outside the loops)",
        "no 64-bit integer multiply or shift (*, <<, >> and their compound forms on ulong/long/size_t) inside a "
        "loop, nor a call from inside a loop of a helper that does one outside its own loops (helpers are "
        "inlined)"),
    "PERF-TG-COLUMN": Rule(
        "Apple GPU threadgroup memory: 32 banks of 4 bytes (philipturner/metal-benchmarks), MLX steel kernels "
        "(tile rows padded by 16 bytes)",
        "no threadgroup access whose row index varies across the lanes of one access with a compile-time row "
        "stride of a multiple of 32 words (a[x * S + y], a[x][y]), nor a simdgroup_load/store of threadgroup "
        "memory with such a constant stride: the lanes hit one bank at different addresses"),
    "PERF-SIMDMAT-LOOP": Rule(
        "Apple GPU SIMD-group matrices (Metal feature set tables: Apple7+; fragments live in registers), MLX "
        "steel kernels (compile-time loops around register fragments, only the tile loop at run time)",
        "a loop whose bounds are not compile-time constants does not step over SIMD-group matrix operations "
        "(simdgroup_load/store/multiply/multiply_accumulate whose arguments use the loop's variable)"),
    "PERF-ANNOTATION": Rule(
        "house rule (docs/metal.md, Performance checks)",
        "a `// perf-ok(RULE): reason` exception (on a line of code: that line; alone on its line: the next) "
        "gives a reason and names a performance rule that fires on the line it covers"),
}
RULES.update(PERF_RULES)

LANE_ATTRS = {"thread_index_in_simdgroup", "thread_index_in_threadgroup", "thread_position_in_threadgroup",
              "thread_position_in_grid", "thread_index_in_quadgroup"}  # differ between the lanes of one access
SIMD_MATRIX_OPS = {"simdgroup_load", "simdgroup_store", "simdgroup_multiply", "simdgroup_multiply_accumulate"}
# dry passes over the bodies that decide which helper parameters fold (the first starts from all of them; a
# second would only refine loops whose bounds are such parameters: none in these families)
PARAM_PASSES = 1
BANK_ROW_BYTES = 32 * 4  # 32 banks of 4 bytes: a row stride of a multiple of this puts a column in one bank
_ASSIGN_OPS = {"=", "+=", "-=", "*=", "/=", "%=", "<<=", ">>=", "&=", "|=", "^="}
_WIDE_OPS = {"*", "<<", ">>", "*=", "<<=", ">>="}
_TRANSPARENT = {"ImplicitCastExpr", "ParenExpr", "CStyleCastExpr", "CXXFunctionalCastExpr", "CXXStaticCastExpr",
                "ExprWithCleanups", "MaterializeTemporaryExpr", "CXXBindTemporaryExpr", "ConstantExpr",
                "SubstNonTypeTemplateParmExpr"}
_PERF_OK = re.compile(r"//.*?\bperf-ok\(([^)]*)\)(?:\s*:)?\s*(.*?)\s*$")


class _Known:
    """A compile-time constant whose value the checker does not compute (sizeof of a structure, ...)."""


KNOWN = _Known()


def _kids(n: dict) -> list:
    k = n.get("_k")
    if k is None:
        k = n["_k"] = [c for c in (n.get("inner") or ()) if isinstance(c, dict) and c.get("kind")]
    return k


def _strip(n: dict) -> dict:
    """The expression under casts, parentheses and template-argument substitutions."""
    while n and n.get("kind") in _TRANSPARENT:
        if n["kind"] == "ConstantExpr" and "value" in n:
            return n
        k = _kids(n)
        if not k:
            return n
        n = k[-1]
    return n


def _refs(n: dict) -> frozenset:
    """The ids of the variables a subtree names (cached on the node)."""
    r = n.get("_r")
    if r is None:
        out = set()
        stack = [n]
        while stack:
            x = stack.pop()
            if x.get("kind") == "DeclRefExpr":
                ref = x.get("referencedDecl") or {}
                if ref.get("kind") in ("VarDecl", "ParmVarDecl") and ref.get("id"):
                    out.add(ref["id"])
            stack.extend(_kids(x))
        r = n["_r"] = frozenset(out)
    return r


def _callee(call: dict) -> dict | None:
    k = _kids(call)
    f = _strip(k[0]) if k else None
    if f and f.get("kind") == "DeclRefExpr":
        return f.get("referencedDecl")
    return None


def _assigned(lhs: dict) -> set:
    """The variable an assignment writes: the root of a[i].x = ... is a (i is only read)."""
    n = _strip(lhs)
    while n.get("kind") in ("ArraySubscriptExpr", "MemberExpr", "UnaryOperator") and _kids(n):
        n = _strip(_kids(n)[0])
    return set(_refs(n)) if n.get("kind") == "DeclRefExpr" else set()


def _init(var: dict) -> dict | None:
    """The initializer of a VarDecl (its last expression child)."""
    if not var.get("init"):
        return None
    k = [c for c in _kids(var) if not c["kind"].endswith("Attr")]
    return k[-1] if k else None


def _is_const_type(t: str) -> bool:
    return pointee(t) is None and "[" not in t and re.search(r"\bconst\b", t) is not None


@dataclasses.dataclass
class _Loop:
    loc: tuple | None
    unrolled: bool  # compile-time bounds: constant (or foldable) start, bound and step
    vars: set  # its induction variables and the variables derived from them inside it


class _Perf:
    """The performance rules over the function bodies of one family (after _Checker.walk and finish)."""

    def __init__(self, checker: "_Checker"):
        self.c = checker
        self.found: set[Violation] = set()
        self.values: dict[str, object] = {}
        self.param_fold: set[str] = set()  # helper parameters passed a foldable value at every call
        self.sites: list = []  # (parameter id, argument, folded variables at the call)
        self.dry = False  # a pass that only collects the call sites and the flows of values
        self.flows: list = []  # (variable id, ids of the variables its value comes from)
        self.locals: set[str] = set()  # variables declared in function bodies
        self.lane: set[str] = set()  # variables whose value differs between the lanes of a SIMD-group
        self.covered: set[tuple] = set()  # original (file, line) of the analysed bodies
        self.wide_outside: dict[str, tuple] = {}  # function id -> (loc, what) of a 64-bit op outside its loops
        self.calls_outside: dict[str, list] = {}  # function id -> callee ids called outside its loops
        self.calls_inside: list = []  # (caller, callee id, loc, loop loc)

    # ---- the functions
    def run(self) -> set[Violation]:
        c = self.c
        canon = lambda i: c.canonical.get(i, i)  # noqa: E731
        self.by_canon: dict[str, _Function] = {}
        for f in c.functions.values():
            if f.has_body and f.body is not None:
                self.by_canon[canon(f.id)] = f
        self.canon = canon
        bodies = [f for f in c.functions.values()
                  if f.user and not f.pattern and f.has_body and f.body is not None]
        # helper parameters that every call passes a foldable value (the helper is inlined there): start from
        # all of them, keep those whose every call site folds, until nothing changes
        self.param_fold = {pid for f in bodies if not f.is_kernel for pid in f.param_ids if pid}
        self.dry = True
        for _ in range(PARAM_PASSES):  # loop bounds may depend on the parameters: again when the set shrank
            self.sites, self.flows = [], []
            for f in bodies:
                self._visit(f.body, f, [], frozenset())
            by_param: dict[str, list] = {}
            for pid, a, fo in self.sites:
                by_param.setdefault(pid, []).append((a, fo))
            before = set(self.param_fold)
            self.param_fold &= set(by_param)
            changed = True
            while changed:
                changed = False
                for pid in list(self.param_fold):
                    if not all(self.foldable(a, fo) for a, fo in by_param[pid]):
                        self.param_fold.discard(pid)
                        changed = True
            if self.param_fold == before:
                break
        self.dry = False
        self._lanes(bodies)
        self.wide_outside, self.calls_outside, self.calls_inside = {}, {}, []
        for f in bodies:
            self._visit(f.body, f, [], frozenset())
        self._wide_calls()
        return self._annotations()

    def _target(self, callee_id):
        return self.by_canon.get(self.canon(callee_id)) if callee_id else None

    def report(self, loc, rule, message):
        if loc is not None and not self.dry:
            self.found.add(Violation(loc[0], loc[1], rule, message))

    # ---- constants and what the compiler folds
    def value(self, n: dict, depth: int = 0):
        """The value of a compile-time constant expression (int or float, KNOWN when not computed), else None."""
        if n is None or depth > 40:
            return None
        k = n.get("kind")
        if k == "ConstantExpr" and "value" in n:
            try:
                return int(n["value"])
            except (TypeError, ValueError):
                return KNOWN
        if k in ("IntegerLiteral", "CharacterLiteral"):
            return int(n.get("value", 0))
        if k == "CXXBoolLiteralExpr":
            return int(bool(n.get("value")))
        if k == "FloatingLiteral":
            try:
                return float(n.get("value"))
            except (TypeError, ValueError):
                return KNOWN
        if k in _TRANSPARENT:
            kids = _kids(n)
            return self.value(kids[-1], depth + 1) if kids else None
        if k == "UnaryExprOrTypeTraitExpr":
            return KNOWN
        if k == "DeclRefExpr":
            ref = n.get("referencedDecl") or {}
            rk, rid = ref.get("kind"), ref.get("id")
            if rk == "NonTypeTemplateParmDecl":
                return KNOWN
            if rk not in ("VarDecl", "EnumConstantDecl") or rid not in self.c.vars:
                return None
            if rid in self.values:
                return self.values[rid]
            self.values[rid] = None  # a cycle is not a constant
            var = self.c.vars[rid]
            if rk == "EnumConstantDecl":
                kids = _kids(var)
                v = self.value(kids[-1], depth + 1) if kids else KNOWN
            elif var.get("constexpr") or _is_const_type(_best_type(var)):
                v = self.value(_init(var), depth + 1)
            else:
                v = None
            self.values[rid] = v
            return v
        if k == "BinaryOperator" and n.get("opcode") not in _ASSIGN_OPS and n.get("opcode") != ",":
            a, b = (self.value(x, depth + 1) for x in _kids(n)[:2])
            if n["opcode"] == "%" and b == 1 or n["opcode"] in ("*", "&") and 0 in (a, b):
                return 0  # x % 1, x * 0: folded whatever x is
            if a is None or b is None:
                return None
            if a is KNOWN or b is KNOWN:
                return KNOWN
            return _arith(n["opcode"], a, b)
        if k == "UnaryOperator" and n.get("opcode") in ("-", "+", "~", "!"):
            a = self.value(_kids(n)[0], depth + 1) if _kids(n) else None
            if a is None or a is KNOWN:
                return a
            op = n["opcode"]
            return -a if op == "-" else a if op == "+" else int(not a) if op == "!" else ~int(a)
        if k == "ConditionalOperator":
            vals = [self.value(x, depth + 1) for x in _kids(n)[:3]]
            if any(v is None for v in vals):
                return None
            return KNOWN if vals[0] is KNOWN else (vals[1] if vals[0] else vals[2])
        if k == "CallExpr":
            ref = _callee(n) or {}
            if ref.get("name") in ("min", "max"):
                vals = [self.value(x, depth + 1) for x in _kids(n)[1:]]
                if len(vals) == 2 and all(v is not None for v in vals):
                    if KNOWN in vals:
                        return KNOWN
                    return min(vals) if ref["name"] == "min" else max(vals)
        return None

    def foldable(self, n: dict, folded: frozenset, depth: int = 0) -> bool:
        """True when the compiler can fold `n` once loops with compile-time bounds are unrolled and helpers
        inlined: a constant, a variable of such a loop, a helper parameter every call passes a foldable value,
        a const local initialised from foldable values, or arithmetic of these."""
        if n is None or depth > 20:
            return False
        if self.value(n) is not None:
            return True
        k = n.get("kind")
        if k == "DeclRefExpr":
            rid = (n.get("referencedDecl") or {}).get("id")
            if rid in folded or rid in self.param_fold:
                return True
            var = self.c.vars.get(rid)
            return var is not None and var.get("kind") == "VarDecl" and _is_const_type(_best_type(var)) and \
                self.foldable(_init(var), folded, depth + 1)
        if k in _TRANSPARENT or (k == "BinaryOperator" and n.get("opcode") not in _ASSIGN_OPS) or \
                k == "ConditionalOperator" or (k == "UnaryOperator" and n.get("opcode") in ("-", "+", "~", "!")):
            kids = _kids(n)
            return bool(kids) and all(self.foldable(x, folded, depth + 1) for x in kids)
        if k == "CallExpr" and (_callee(n) or {}).get("name") in ("min", "max"):
            return all(self.foldable(x, folded, depth + 1) for x in _kids(n)[1:])
        return False

    def _for_loop(self, init, cond, inc, folded) -> tuple[list, bool]:
        """(induction variables, compile-time bounds?) of a for statement."""
        ivars, ok = [], True
        if init and init.get("kind") == "DeclStmt":
            for v in _kids(init):
                if v.get("kind") == "VarDecl":
                    ivars.append(v.get("id"))
                    ok = ok and self.foldable(_init(v), folded)
        elif init and init.get("kind") == "BinaryOperator" and init.get("opcode") == "=":
            lhs, rhs = (_strip(x) for x in _kids(init)[:2])
            if lhs.get("kind") == "DeclRefExpr":
                ivars.append((lhs.get("referencedDecl") or {}).get("id"))
                ok = ok and self.foldable(rhs, folded)
        if not ivars:
            return ivars, False
        inner = folded | set(ivars)

        def is_var(x):
            x = _strip(x)
            return x.get("kind") == "DeclRefExpr" and (x.get("referencedDecl") or {}).get("id") in ivars

        def bound(x):  # i < N with N foldable; in `i < N && more`, the compiler unrolls N guarded copies
            x = _strip(x) if x else {}
            if x.get("kind") == "BinaryOperator" and x.get("opcode") == "&&":
                return any(bound(y) for y in _kids(x)[:2])
            if not (x.get("kind") == "BinaryOperator" and x.get("opcode") in ("<", "<=", ">", ">=", "!=")):
                return False
            a, b = _kids(x)[:2]
            return is_var(a) and self.foldable(b, inner) or is_var(b) and self.foldable(a, inner)

        ok = ok and bound(cond)

        def step(x):
            x = _strip(x) if x else {}
            k = x.get("kind")
            if k == "UnaryOperator" and x.get("opcode") in ("++", "--"):
                return is_var(_kids(x)[0])
            if k == "CompoundAssignOperator" and x.get("opcode") in ("+=", "-=", "*=", "<<=", ">>="):
                return is_var(_kids(x)[0]) and self.foldable(_kids(x)[1], inner)
            if k == "BinaryOperator" and x.get("opcode") == ",":
                return all(step(y) for y in _kids(x))
            return False

        return ivars, ok and step(inc)

    # ---- lane-varying values: from the kernel's per-lane attributes, through assignments and helper arguments
    def _lanes(self, bodies):
        """The lane-varying variables: the kernels' per-lane parameters, then every variable an initializer,
        assignment or helper argument (self.flows, from the dry pass) carries them to, to a fixpoint."""
        for f in bodies:
            if f.is_kernel:
                for pid, (_, _, attrs, _) in zip(f.param_ids, f.params):
                    if any(a in LANE_ATTRS for a, _, _ in attrs):
                        self.lane.add(pid)
        changed = True
        while changed:
            changed = False
            for v, r in self.flows:
                if v and v not in self.lane and r & self.lane:
                    self.lane.add(v)
                    changed = True

    # ---- the walk of one body
    def _visit(self, n: dict, f: _Function, loops: list, folded: frozenset):
        k = n.get("kind")
        if k is None:
            return
        loc = n.get("_o")
        if loc:
            self.covered.add(loc)
        if k == "ForStmt":
            inner = (list(n.get("inner") or ()) + [{}] * 5)[:5]
            init, _, cond, inc, body = inner
            if init:
                self._visit(init, f, loops, folded)
            ivars, unrolled = self._for_loop(init, cond, inc, folded)
            loop = _Loop(loc, unrolled, set(ivars))
            inner_folded = folded | set(ivars) if unrolled else folded
            for part in (cond, inc, body):
                if part:
                    self._visit(part, f, loops + [loop], inner_folded)
            return
        if k in ("WhileStmt", "DoStmt"):
            kids = _kids(n)
            cond = kids[0] if k == "WhileStmt" else kids[-1]
            loop = _Loop(loc, False, set(_refs(cond)) if cond else set())
            for x in kids:
                self._visit(x, f, loops + [loop], folded)
            return
        if k == "VarDecl":
            self.locals.add(n.get("id"))
            init = _init(n)
            if init is not None:
                r = _refs(init)
                if self.dry:
                    self.flows.append((n.get("id"), r))
                for lp in loops:
                    if r & lp.vars:
                        lp.vars.add(n.get("id"))
        elif k in ("BinaryOperator", "CompoundAssignOperator"):
            op = n.get("opcode")
            if op in _ASSIGN_OPS:
                lhs, rhs = _kids(n)[:2]
                if self.dry:
                    self.flows.extend((v, _refs(rhs)) for v in _assigned(lhs))
                for lp in loops:
                    if _refs(rhs) & lp.vars:
                        lp.vars |= _assigned(lhs)
            if op in _WIDE_OPS:
                self._wide(n, f, loops, folded, loc)
        elif k == "ArraySubscriptExpr":
            self._stack_array(n, f, folded, loc)
            self._tg_column(n, f, loc)
        elif k == "CallExpr":
            self._call(n, f, loops, folded, loc)
        for x in _kids(n):
            self._visit(x, f, loops, folded)

    # ---- PERF-STACK-ARRAY
    def _stack_array(self, n, f, folded, loc):
        kids = _kids(n)
        if len(kids) < 2:
            return
        base, index = kids[0], kids[1]
        if not (base.get("kind") == "ImplicitCastExpr" and base.get("castKind") == "ArrayToPointerDecay"):
            # a pointer: a helper's parameter pointing to thread memory is the caller's array, inlined
            ptr = _strip(base)
            ref = ptr.get("referencedDecl") or {} if ptr.get("kind") == "DeclRefExpr" else {}
            var = self.c.vars.get(ref.get("id"))
            pt = pointee(_best_type(var)) if var is not None and var.get("kind") == "ParmVarDecl" else None
            if pt and address_space(pt[1]) == "thread" and not f.is_kernel and not self.foldable(index, folded):
                self.report(loc, "PERF-STACK-ARRAY",
                            f"in {f.name}(): thread array behind the parameter {ref.get('name', '?')} indexed by a "
                            "value the compiler cannot fold, even with the helper inlined: the caller's array "
                            "lives in stack memory, not registers")
            return
        root = _strip(base)
        while root.get("kind") in ("ArraySubscriptExpr", "MemberExpr") and not root.get("isArrow"):
            root = _strip(_kids(root)[0])
        if root.get("kind") != "DeclRefExpr":
            return
        ref = root.get("referencedDecl") or {}
        var = self.c.vars.get(ref.get("id"))
        if var is None or ref.get("id") not in self.locals or ref.get("kind") != "VarDecl":
            return
        if object_space(_best_type(var)) != "thread" or var.get("storageClass") == "static":
            return
        if not self.foldable(index, folded):
            self.report(loc, "PERF-STACK-ARRAY",
                        f"in {f.name}(): thread array {ref.get('name', '?')} indexed by a value the compiler cannot "
                        "fold (not a constant nor the variable of a loop with compile-time bounds): the array "
                        "lives in stack memory, not registers")

    # ---- PERF-INT64-LOOP
    def _wide(self, n, f, loops, folded, loc):
        shape = vector_shape(_best_type(n))
        if shape is None or shape[0] not in ("ulong", "long") or self.foldable(n, folded):
            return
        what = f"64-bit integer {n.get('opcode')} ({type_name(shape)})"
        if loops:
            self.report(loc, "PERF-INT64-LOOP", f"in {f.name}(): {what} inside the loop at line "
                                                f"{loops[-1].loc[1] if loops[-1].loc else '?'}: emulated on "
                                                "Apple GPUs; form the 64-bit offset outside the loop or use 32-bit "
                                                "arithmetic")
        elif f.id not in self.wide_outside and loc:
            self.wide_outside[f.id] = (loc, what)

    def _call(self, n, f, loops, folded, loc):
        ref = _callee(n) or {}
        name = ref.get("name", "")
        target = self._target(ref.get("id"))
        if self.dry:
            if target is not None:
                self.flows.extend((pid, _refs(a)) for pid, a in zip(target.param_ids, _kids(n)[1:]))
            if target is not None and target.user and not target.is_kernel:
                self.sites.extend((pid, a, folded) for pid, a in zip(target.param_ids, _kids(n)[1:]) if pid)
            return
        if target is not None and target.user:
            if loops:
                self.calls_inside.append((f, target, loc, loops[-1].loc))
            else:
                self.calls_outside.setdefault(f.id, []).append(target)
        if name not in SIMD_MATRIX_OPS:
            return
        args = _kids(n)[1:]
        refs = frozenset().union(*(_refs(a) for a in args)) if args else frozenset()
        for lp in reversed(loops):
            if not lp.unrolled and refs & lp.vars:
                self.report(loc, "PERF-SIMDMAT-LOOP",
                            f"in {f.name}(): {name} steps with the loop at line {lp.loc[1] if lp.loc else '?'}, "
                            "whose bounds are not compile-time constants: the fragments cannot stay in registers "
                            "and the MMA sequence is not unrolled")
                break
        if name in ("simdgroup_load", "simdgroup_store") and len(args) >= 3:
            ptype = _best_type(args[1])
            pt = pointee(ptype)
            stride = self.value(args[2])
            if pt is None or address_space(pt[1]) != "threadgroup" or not isinstance(stride, int) or stride <= 0:
                return
            esize = self.c.sizeof(pt[1])[0]
            if esize and stride * esize % BANK_ROW_BYTES == 0:
                self.report(loc, "PERF-TG-COLUMN",
                            f"in {f.name}(): {name} of threadgroup memory with a row stride of {stride} elements "
                            f"({stride * esize // 4} words, a multiple of 32): the 8 rows of the matrix hit the "
                            "same banks; pad the rows (e.g. by 16 bytes)")

    def _wide_calls(self):
        """PERF-INT64-LOOP across calls: a call inside a loop of a function that does a 64-bit multiply or shift
        outside its own loops, directly or through the functions it calls there."""
        witness: dict[str, tuple] = dict(self.wide_outside)
        changed = True
        while changed:
            changed = False
            for fid, callees in self.calls_outside.items():
                if fid in witness:
                    continue
                w = next((witness[t.id] for t in callees if t.id in witness), None)
                if w:
                    witness[fid] = w
                    changed = True
        for f, target, loc, loop_loc in self.calls_inside:
            w = witness.get(target.id)
            if w:
                (wf, wl), what = w
                self.report(loc, "PERF-INT64-LOOP", f"in {f.name}(): call of {target.name}() inside the loop at "
                                                    f"line {loop_loc[1] if loop_loc else '?'}, which does a {what} "
                                                    f"at {wf}:{wl} (inlined into the loop)")

    # ---- PERF-TG-COLUMN on subscripts
    def _tg_column(self, n, f, loc):
        t = _best_type(n)
        if address_space(t) != "threadgroup":
            return
        esize = self.c.sizeof(t)[0]
        kids = _kids(n)
        if not esize or len(kids) < 2:
            return
        base = _strip(kids[0])
        if base.get("kind") == "ArraySubscriptExpr":  # a[x][y]: x selects a row of the declared length
            m = re.search(r"\[(\d+)\]\s*$", _best_type(base))
            row_index = _kids(base)[1] if len(_kids(base)) > 1 else None
            if m and row_index is not None and _refs(row_index) & self.lane and \
                    int(m.group(1)) * esize % BANK_ROW_BYTES == 0:
                self._column(loc, f, int(m.group(1)), esize)
            return
        for factors in self._terms(kids[1], 0):
            consts = [self.value(x) for x in factors]
            stride = 1
            known = True
            for v in consts:
                if v is None:
                    continue
                if not isinstance(v, int):
                    known = False
                    break
                stride *= v
            rows = [x for x, v in zip(factors, consts) if v is None]
            if not known or not rows or len(rows) == len(factors):
                continue
            if any(_refs(x) & self.lane for x in rows) and stride * esize % BANK_ROW_BYTES == 0 and stride:
                self._column(loc, f, stride, esize)
                return

    def _column(self, loc, f, stride, esize):
        self.report(loc, "PERF-TG-COLUMN",
                    f"in {f.name}(): threadgroup access whose row index varies across the lanes, with a row "
                    f"stride of {stride} elements ({stride * esize // 4} words, a multiple of 32): the lanes hit "
                    "one bank at different addresses; pad the rows (e.g. by 16 bytes)")

    def _terms(self, n, depth) -> list[list]:
        """The index as a sum of products: [[factor, ...], ...] (const locals expanded, shifts by constants as
        products)."""
        n = _strip(n)
        k = n.get("kind")
        if depth < 4 and k == "DeclRefExpr":
            ref = n.get("referencedDecl") or {}
            var = self.c.vars.get(ref.get("id"))
            if var is not None and ref.get("id") in self.locals and _is_const_type(_best_type(var)) and \
                    _init(var) is not None:
                return self._terms(_init(var), depth + 1)
        if k == "BinaryOperator" and n.get("opcode") in ("+", "-"):
            a, b = _kids(n)[:2]
            return self._terms(a, depth) + self._terms(b, depth)
        return [self._factors(n, depth)]

    def _factors(self, n, depth) -> list:
        n = _strip(n)
        if n.get("kind") == "BinaryOperator" and n.get("opcode") == "*":
            a, b = _kids(n)[:2]
            return self._factors(a, depth) + self._factors(b, depth)
        if n.get("kind") == "BinaryOperator" and n.get("opcode") == "<<":
            a, b = _kids(n)[:2]
            v = self.value(b)
            if isinstance(v, int) and 0 <= v < 32:
                return self._factors(a, depth) + [{"kind": "IntegerLiteral", "value": str(1 << v)}]
        return [n]

    # ---- exceptions: // perf-ok(RULE): reason, on the line or the line above
    def _annotations(self) -> set[Violation]:
        files = sorted({fl for fl, _ in self.c.line_map[1:] if fl != "<conform>"})
        notes = []  # (file, line, [rules], reason)
        for fl in files:
            path = Path(fl) if Path(fl).is_absolute() else ROOT / fl
            try:
                lines = path.read_text().splitlines()
            except OSError:
                continue
            for i, text in enumerate(lines, 1):
                m = _PERF_OK.search(text)
                if m:
                    # on a line of code it covers that line; alone on its line, the next one
                    target = i + 1 if text.lstrip().startswith("//") else i
                    notes.append((fl, i, target, [r.strip() for r in m.group(1).split(",") if r.strip()],
                                  m.group(2)))
        out, used = set(), set()
        for v in self.found:
            hit = next(((fl, ln, r) for fl, ln, target, rules, reason in notes for r in rules
                        if reason and fl == v.path and v.line == target and r == v.rule), None)
            if hit:
                used.add(hit)
            else:
                out.add(v)
        for fl, ln, target, rules, reason in notes:
            if not reason:
                out.add(Violation(fl, ln, "PERF-ANNOTATION", "perf-ok without a reason: say why the exception "
                                                            "is deliberate"))
            for r in rules or ["?"]:
                if r not in PERF_RULES or r == "PERF-ANNOTATION":
                    out.add(Violation(fl, ln, "PERF-ANNOTATION", f"perf-ok({r}): not a performance rule"))
                elif reason and (fl, ln, r) not in used and (fl, target) in self.covered:
                    out.add(Violation(fl, ln, "PERF-ANNOTATION", f"perf-ok({r}): {r} does not fire on the line it "
                                                                 "annotates (a stale exception)"))
        return out


def _arith(op: str, a, b):
    try:
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        if op == "/":
            return (int(a / b) if isinstance(a, int) and isinstance(b, int) else a / b) if b else KNOWN
        if op == "%":
            return (a - b * int(a / b)) if b and isinstance(a, int) and isinstance(b, int) else KNOWN
        if op in ("<<", ">>", "&", "|", "^") and isinstance(a, int) and isinstance(b, int):
            return {"<<": lambda: a << b, ">>": lambda: a >> b, "&": lambda: a & b, "|": lambda: a | b,
                    "^": lambda: a ^ b}[op]()
        if op in ("<", ">", "<=", ">=", "==", "!=", "&&", "||"):
            return int({"<": a < b, ">": a > b, "<=": a <= b, ">=": a >= b, "==": a == b, "!=": a != b,
                        "&&": bool(a) and bool(b), "||": bool(a) or bool(b)}[op])
    except (ValueError, OverflowError):
        pass
    return KNOWN


# ------------------------------------------------------------------------------------------- entry points
def family_version(path: str | Path) -> str:
    """The MSL version of metal/<family>.metal from tools/embed_msl.py's LANGUAGE_VERSION (default for others)."""
    return embed_msl.language_version(Path(path).stem)


def check_family(path: str | Path, clang: str | None = None, version: str | None = None,
                 metal_dir: str | Path = METAL, perf: bool = True) -> list[Violation]:
    """The violations of one family (a .metal file with the headers it includes), sorted by file and line.

    `version` overrides the family's pinned MSL version (tests check one source at two versions); `perf`
    adds the performance rules (PERF-*), checked on the same parse."""
    clang = clang or find_clang()
    if clang is None:
        raise ConformError(f"no clang++ >= {MIN_CLANG} (apt-get install clang-19, or set MSL_CLANG)")
    version = version or family_version(path)
    text, line_map = prepare(path, metal_dir)
    ast, diags = run_clang(text, version, clang)
    checker = _Checker(line_map, version)
    checker.walk(ast)
    checker.diagnostics(diags)
    checker.finish()
    if perf:
        checker.found |= _Perf(checker).run()
    return sorted(checker.found)


def check_files(paths, clang: str | None = None) -> list[Violation]:
    out = []
    for p in paths:
        out.extend(check_family(p, clang))
    return sorted(set(out))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="kernel families (default: every metal/*.metal)")
    ap.add_argument("--rules", action="store_true", help="list the rules and the specification sections")
    ap.add_argument("--no-perf", action="store_true", help="leave out the performance rules (PERF-*)")
    a = ap.parse_args(argv)
    if a.rules:
        for rid, r in RULES.items():
            print(f"{rid}: {r.summary} [{'' if rid in PERF_RULES else 'MSL '}{r.section}]")
        return 0
    files = a.files or sorted(str(p) for p in METAL.glob("*.metal"))
    clang = find_clang()
    if clang is None:
        print(f"msl_conform: no clang++ >= {MIN_CLANG} found (apt-get install clang-19, or set MSL_CLANG)",
              file=sys.stderr)
        return 2
    bad = 0
    for f in files:
        try:
            found = check_family(f, clang, perf=not a.no_perf)
        except (ConformError, embed_msl.EmbedError, OSError) as e:
            print(f"msl_conform: {f}: {e}", file=sys.stderr)
            return 2
        for v in found:
            print(v)
        bad += len(found)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

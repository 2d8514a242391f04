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

    python3 tools/msl_conform.py metal/*.metal    # prints file:line: [RULE] message; exit 1 on any, 2 without clang
    python3 tools/msl_conform.py --rules          # the rules and their sections
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


# ------------------------------------------------------------------------------------------- entry points
def family_version(path: str | Path) -> str:
    """The MSL version of metal/<family>.metal from tools/embed_msl.py's LANGUAGE_VERSION (default for others)."""
    return embed_msl.language_version(Path(path).stem)


def check_family(path: str | Path, clang: str | None = None, version: str | None = None,
                 metal_dir: str | Path = METAL) -> list[Violation]:
    """The violations of one family (a .metal file with the headers it includes), sorted by file and line.

    `version` overrides the family's pinned MSL version (tests check one source at two versions)."""
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
    a = ap.parse_args(argv)
    if a.rules:
        for rid, r in RULES.items():
            print(f"{rid}: {r.summary} [MSL {r.section}]")
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
            found = check_family(f, clang)
        except (ConformError, embed_msl.EmbedError, OSError) as e:
            print(f"msl_conform: {f}: {e}", file=sys.stderr)
            return 2
        for v in found:
            print(v)
        bad += len(found)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""The C++ sources are a stack of layers, and an include only ever reaches down.

    src/core                    device-agnostic: config, dtypes, weights table, state layout, expert cache,
                                thread pool, floating-point environment
    src/cpu    src/gpu          the CPU engine; the GPU host side (device interface, encoder, ops, graph)
    src/metal  src/msl_sim      the two GPU devices: Metal (Apple) and the Metal-on-CPU simulator
    src/bindings                the Python module: anything

plus metal/ (the MSL kernels and their parameter structs, shared with the host ops of src/gpu), which
includes nothing from src/. Each quoted ``#include "..."`` is resolved the way the compiler does (the
including file's directory, then the include directories CMakeLists.txt gives: src/, the repository root,
src/msl_sim/include) and the file it finds must belong to a layer the includer may use. Cheap: it only
reads the files.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
INCLUDE_DIRS = [SRC, ROOT, SRC / "msl_sim" / "include"]
SUFFIXES = {".h", ".hpp", ".cpp", ".cc", ".mm", ".inc", ".metal", ""}   # "" : the shim's <metal_stdlib> etc.

# layer -> the layers it may include (itself always)
ALLOWED = {
    "core": set(),
    "cpu": {"core"},
    "gpu": {"core", "kernels"},          # the host ops bind the kernels' parameter structs (metal/<family>.h)
    "metal": {"gpu", "core", "kernels"},  # src/metal: embeds the kernel sources
    "msl_sim": {"gpu", "core", "kernels"},
    "bindings": {"core", "cpu", "gpu", "metal", "msl_sim", "kernels"},
    "kernels": set(),                    # metal/*.metal, metal/*.h
}
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def layer_of(path: Path) -> str | None:
    rel = path.resolve().relative_to(ROOT)
    if rel.parts[0] == "metal":
        return "kernels"
    if rel.parts[0] == "src" and len(rel.parts) > 2:
        return rel.parts[1]
    return None


def sources() -> list[Path]:
    files = [p for p in SRC.rglob("*") if p.is_file() and p.suffix in SUFFIXES]
    files += [p for p in (ROOT / "metal").iterdir() if p.suffix in {".h", ".metal"}]
    return sorted(files)


def resolve(includer: Path, name: str) -> Path | None:
    for d in [includer.parent, *INCLUDE_DIRS]:
        cand = d / name
        if cand.is_file():
            return cand
    return None


def violations(files: list[Path], text_of=None) -> list[str]:
    """Every include of `files` that reaches up; `text_of(path)` gives a file's text (default: read it)."""
    text_of = text_of or (lambda p: p.read_text(encoding="utf-8", errors="replace"))
    bad = []
    for f in files:
        mine = layer_of(f)
        if mine is None or mine not in ALLOWED:
            bad.append(f"{f.relative_to(ROOT)}: in no known layer (add its directory to tests/test_cpp_layers.py)")
            continue
        for name in INCLUDE.findall(text_of(f)):
            target = resolve(f, name)
            if target is None:
                continue            # generated at build time (msl_sources.h's .cpp) or a system header
            theirs = layer_of(target)
            if theirs != mine and theirs not in ALLOWED[mine]:
                bad.append(f'{f.relative_to(ROOT)}: #include "{name}" reaches up into {theirs} '
                           f"({target.relative_to(ROOT)}); {mine} may include only "
                           f"{sorted(ALLOWED[mine] | {mine})}")
    return bad


def test_every_source_directory_is_a_known_layer():
    assert {p.name for p in SRC.iterdir() if p.is_dir()} == set(ALLOWED) - {"kernels"}


def test_includes_only_reach_down():
    files = sources()
    assert len(files) > 50                      # the scan sees the tree
    assert not violations(files), "\n".join(violations(files))


@pytest.mark.parametrize("where,include", [
    ("src/core/planted.cpp", "cpu/engine.h"),
    ("src/core/planted.cpp", "gpu/device.h"),
    ("src/cpu/planted.cpp", "gpu/model.h"),
    ("src/gpu/planted.cpp", "cpu/engine.h"),
    ("src/gpu/planted.cpp", "msl_sim/runtime.h"),
    ("src/msl_sim/planted.cpp", "bindings/registry.h"),
    ("src/msl_sim/planted.cpp", "cpu/quant.h"),
    ("metal/planted.metal", "../src/core/config.h"),
])
def test_an_upward_include_is_found(where, include):
    """The check is not vacuous: a planted include that reaches up fails it."""
    found = violations([ROOT / where], text_of=lambda p: f'#include "{include}"\n')
    assert len(found) == 1 and include in found[0]


@pytest.mark.parametrize("where,include", [
    ("src/cpu/planted.cpp", "core/threadpool.h"),
    ("src/cpu/planted.cpp", "cpu/kernels.h"),
    ("src/gpu/planted.cpp", "metal/quant.h"),       # metal/quant.h: the kernels' parameter structs
    ("src/msl_sim/planted.cpp", "gpu/device.h"),
    ("src/bindings/planted.cpp", "msl_sim/sim_device.h"),
    ("src/core/planted.cpp", "core/fpenv.h"),
    ("metal/planted.metal", "quant_dot.h"),
])
def test_downward_and_sibling_includes_pass(where, include):
    assert violations([ROOT / where], text_of=lambda p: f'#include "{include}"\n') == []

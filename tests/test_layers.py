"""The package's import structure: every module of python/qwenmetal imports only from its own layer or the
layers below (the table in docs/architecture.md, "Python layers"), no group of modules imports itself in a
circle, and imports inside functions are only of optional dependencies. Imports are read with `ast` from
every module, those inside functions and `if TYPE_CHECKING:` blocks included. The C++ side has its own
check (tests/test_cpp_layers.py)."""
from __future__ import annotations

import ast
import graphlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "python" / "qwenmetal"
DOC = ROOT / "docs" / "architecture.md"
#: what a function may import (a dependency that is optional, slow to import, or absent in a source tree
#: that was never built): everything else is imported at the top of its module
OPTIONAL = {"starlette", "uvicorn", "matplotlib", "tqdm", "huggingface_hub", "mlx", "mlx_lm", "llama_cpp",
            "gguf", "torch", "transformers", "markdown_it", "qwenmetal._core", "openai"}
#: the package's face (python/qwenmetal/__init__.py) imports what it exports from anywhere; nothing in the
#: package imports it
FACE = "qwenmetal"


def layer_table(text: str) -> dict[str, tuple[int, str]]:
    """module (or "pkg.*" pattern) -> (layer index, layer name), from the table under "## Python layers"."""
    m = re.search(r"^## Python layers\n(.*?)(?=^## )", text, re.S | re.M)
    assert m, "docs/architecture.md has no '## Python layers' section"
    out = {}
    for row in re.finditer(r"^\|\s*(\d+)\s+([\w ]+?)\s*\|(.*)\|\s*$", m.group(1), re.M):
        for mod in re.findall(r"`([\w.*]+)`", row.group(3)):
            assert mod not in out, f"{mod} is in two layers of the table"
            out[mod] = (int(row.group(1)), row.group(2))
    assert out, "the layer table has no rows"
    return out


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = p.relative_to(PKG).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(("qwenmetal",) + parts)] = p
    return out


def layer_of(mod: str, table: dict) -> tuple[int, str] | None:
    short = mod[len("qwenmetal."):]
    if short in table:
        return table[short]
    for pat, v in table.items():
        if pat.endswith(".*") and (short == pat[:-2] or short.startswith(pat[:-1])):
            return v
    return None


def imports(mod: str, path: Path, known: set) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function?) of every import in `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    in_function: set = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(n) for n in ast.walk(node) if n is not node)
    out = []
    for node in ast.walk(tree):
        fn = id(node) in in_function
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, fn) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module
            for a in node.names:            # `from pkg import submodule` imports the submodule
                sub = f"{target}.{a.name}"
                out.append((sub if sub in known or a.name == "_core" else target, node.lineno, fn))
    return out


def check(table: dict, mods: dict) -> list[str]:
    problems = []
    graph: dict[str, set] = {m: set() for m in mods}
    for mod, path in mods.items():
        here = layer_of(mod, table) if mod != FACE else None
        if mod != FACE and here is None:
            problems.append(f"{mod}: not in the layer table of docs/architecture.md")
            continue
        where = str(path.relative_to(ROOT)) if ROOT in path.parents else str(path)
        for target, line, fn in imports(mod, path, set(mods)):
            top = target.split(".")[0]
            if top != "qwenmetal" or target == "qwenmetal._core":
                if fn and top not in OPTIONAL and target not in OPTIONAL and top not in sys.stdlib_module_names:
                    problems.append(f"{where}:{line}: imports {target} inside a function (only optional "
                                    f"dependencies may be: {', '.join(sorted(OPTIONAL))})")
                if fn and top in sys.stdlib_module_names:
                    problems.append(f"{where}:{line}: imports the standard library's {target} inside a function")
                continue
            if mod == FACE:
                continue
            if target == FACE:
                problems.append(f"{where}:{line}: imports the package's face ({FACE}); import the module instead")
                continue
            if fn:
                problems.append(f"{where}:{line}: imports {target} inside a function (a package module: at the top)")
            there = layer_of(target, table)
            if there is None:
                continue                    # reported as a module of its own
            if there[0] > here[0]:
                problems.append(f"{where}:{line}: imports {target} ({there[1]}, layer {there[0]}) from "
                                f"{here[1]} (layer {here[0]}): an import that runs upward")
            if target != mod:
                graph[mod].add(target)
    problems += [f"import circle: {' -> '.join(c)}" for c in cycles(graph)]
    return problems


def cycles(graph: dict[str, set]) -> list[list[str]]:
    """An import circle of `graph` (module -> modules it imports), if there is one (graphlib finds it)."""
    try:
        graphlib.TopologicalSorter({m: graph[m] & graph.keys() for m in graph}).prepare()
    except graphlib.CycleError as e:
        return [list(reversed(e.args[1]))]
    return []


def test_imports_run_downward_only():
    problems = check(layer_table(DOC.read_text(encoding="utf-8")), modules())
    assert not problems, "\n".join(problems)


def test_every_table_entry_is_a_module():
    mods = {m[len("qwenmetal."):] for m in modules() if m != FACE}
    for entry in layer_table(DOC.read_text(encoding="utf-8")):
        ok = entry in mods if not entry.endswith(".*") else any(
            m == entry[:-2] or m.startswith(entry[:-1]) for m in mods)
        assert ok, f"docs/architecture.md's layer table names {entry!r}, which is not a module"


@pytest.mark.parametrize("planted, expect", [
    ("from .model import Model\n", "an import that runs upward"),
    ("def f():\n    from .config import ModelConfig\n", "inside a function"),
    ("def f():\n    import json\n", "standard library"),
    ("import qwenmetal\n", "package's face"),
])
def test_the_check_catches(tmp_path, planted, expect):
    """A planted upward import, function-level import or face import is reported (the check can fail)."""
    table = layer_table(DOC.read_text(encoding="utf-8"))
    mods = modules()
    bad = tmp_path / "config.py"
    bad.write_text(PKG.joinpath("config.py").read_text(encoding="utf-8") + "\n" + planted, encoding="utf-8")
    mods["qwenmetal.config"] = bad
    assert any(expect in p for p in check(table, mods)), planted


def test_the_check_catches_a_circle():
    g = {"qwenmetal.a": {"qwenmetal.b"}, "qwenmetal.b": {"qwenmetal.c"}, "qwenmetal.c": {"qwenmetal.a"},
         "qwenmetal.d": {"qwenmetal.a"}}
    [c] = cycles(g)
    assert c[0] == c[-1] and set(c) == {"qwenmetal.a", "qwenmetal.b", "qwenmetal.c"}
    assert cycles({"qwenmetal.a": {"qwenmetal.b"}, "qwenmetal.b": set()}) == []

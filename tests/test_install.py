"""The README's test command installs everything the tests build with.

pip builds the wheel in an isolated environment from ``[build-system].requires``; those packages are gone
afterwards. The tests that build the extension themselves (``tools/sanitize_build.sh``, the ASan + UBSan
build of tests/test_sanitizers.py) need the same tools in the environment that runs the tests, so the
``test`` extra must declare them: every ``[build-system].requires`` entry, and whatever the build scripts
call or import. The scan below reads the scripts for the commands and the inline ``python -c 'import X'``
they run; a new one that is not declared fails here, on any machine, whatever was installed by hand.
"""
from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ImportError:            # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
# the scripts the tests run to build the extension (the cross and MSL builds use apt's compilers only)
TEST_TIME_BUILDS = [ROOT / "tools" / "sanitize_build.sh"]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _names(reqs: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in reqs}


def tools_called(script: str) -> set[str]:
    """Distributions a build script takes from the interpreter's environment: cmake and ninja when it
    runs them, and the module of each ``import X`` in its inline Python."""
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    names = set()
    if re.search(r"(^|[\s;(|&])cmake\s", code, re.M):
        names.add("cmake")
    if re.search(r"-G\s*\"?Ninja\b", code) or re.search(r"(^|[\s;(|&])ninja\s", code, re.M):
        names.add("ninja")
    for _, inline in re.findall(r"-c\s+(['\"])(.*?)\1", code):
        names |= set(re.findall(r"\bimport\s+(\w+)", inline))
    return {canonicalize_name(n) for n in names}


def needed() -> set[str]:
    build = _names(_pyproject()["build-system"]["requires"])
    return build.union(*(tools_called(p.read_text(encoding="utf-8")) for p in TEST_TIME_BUILDS))


def test_every_tool_of_a_test_time_build_is_declared_in_the_test_extra():
    declared = _names(_pyproject()["project"]["optional-dependencies"]["test"])
    assert {"cmake", "ninja", "nanobind", "scikit-build-core"} <= needed()   # the scan sees today's scripts
    missing = needed() - declared
    assert not missing, (f"the tests build with {sorted(missing)}, which the `test` extra does not declare: "
                         "add them to [project.optional-dependencies].test in pyproject.toml")


def test_the_declared_build_tools_are_installed_for_this_interpreter():
    """What the README's command installed: each tool is a distribution of the environment running the
    tests (not a program some other Python put on PATH)."""
    absent = []
    for name in sorted(needed()):
        try:
            md.version(name)
        except md.PackageNotFoundError:
            absent.append(name)
    assert not absent, f"{sorted(absent)} not installed for {sys.executable}: pip install \".[test]\""


def test_the_scan_finds_an_undeclared_tool():
    script = ("#!/usr/bin/env bash\n# cmake in a comment is not a call\n"
              "\"$python\" -c 'import pybind11; print(pybind11.get_cmake_dir())'\n"
              "meson setup b && cmake --build b\n")
    assert tools_called(script) == {"pybind11", "cmake"}
    assert tools_called("cmake -S . -B b -G Ninja\n") == {"cmake", "ninja"}
    assert tools_called("# cmake -G Ninja\n") == set()
    assert tools_called("echo 'set PYTHON to the interpreter that will import the build'\n") == set()


def test_no_build_script_calls_a_bare_python3():
    """The scripts take the interpreter from $PYTHON (the tests pass sys.executable): the first python3 on
    PATH need not be the one whose environment has the tools."""
    for p in [*TEST_TIME_BUILDS, ROOT / "tools" / "dev_build.sh"]:
        text = p.read_text(encoding="utf-8")
        code = [line for line in text.splitlines()[1:] if not line.lstrip().startswith("#")]
        assert not [line for line in code if re.search(r"\bpython3\b", line)], f"{p.name} calls python3"
        assert "${PYTHON" in text, f"{p.name} does not take the interpreter from $PYTHON"

"""MSL checks that do not execute anything: clang's address-space type check (tools/msl_check.py) and the
MSL-subset lint (tools/msl_lint.py) over every metal/*.metal file, and the planted address-space mix-up.

clang >= 15 is needed for the type check: in CI (CI=true; .ci/run installs clang-19) a missing clang fails
these tests, elsewhere they are skipped.
"""
import importlib.util
import re
from pathlib import Path

import pytest

from oracles import unavailable  # fails in CI, skips elsewhere

ROOT = Path(__file__).resolve().parent.parent
KERNEL_FILES = sorted((ROOT / "metal").glob("*.metal"))
TEST_KERNELS = [ROOT / "tests" / "msl" / "sim_features.metal", ROOT / "tests" / "msl" / "planted_bugs.metal",
                ROOT / "tests" / "msl" / "sim_tensor.metal"]


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


msl_check = _tool("msl_check")
msl_lint = _tool("msl_lint")
mslpp = _tool("mslpp")


def require_clang() -> str:
    """clang++ >= 15, or fail (CI=true) / skip (elsewhere)."""
    clang = msl_check.find_clang()
    if clang is None:
        unavailable(f"no clang++ >= {msl_check.MIN_CLANG} (apt-get install clang-19, or set MSL_CLANG)")
    return clang


def test_there_are_kernel_files():
    names = {p.name for p in KERNEL_FILES}
    assert {"quant.metal", "norm.metal"} <= names


@pytest.mark.parametrize("path", KERNEL_FILES + TEST_KERNELS, ids=lambda p: p.name)
def test_address_space_check_passes(path):
    ok, diag = msl_check.check_file(path, require_clang())
    assert ok, diag


def test_address_space_mixups_are_rejected():
    clang = require_clang()
    path = ROOT / "tests" / "msl" / "bug_address_space.metal"
    ok, diag = msl_check.check_file(path, clang)
    assert not ok
    lines = path.read_text().splitlines()
    for tag, pattern in [("tg-to-device", r"'device float \*' with an lvalue of type 'threadgroup float\[64\]'"),
                         ("device-to-thread", r"'float \*' with an lvalue of type 'device float const \*'"),
                         ("tg-arg", r"no matching function for call to 'load_device'"),
                         ("write-constant", r"cannot assign to variable 'n' with const-qualified type")]:
        line = next(i for i, t in enumerate(lines, 1) if f"BUG:{tag}" in t)
        assert re.search(rf"bug_address_space\.metal:{line}:\d+: error: [^\n]*{pattern}", diag), (tag, diag)


@pytest.mark.parametrize("path", KERNEL_FILES + sorted((ROOT / "metal").glob("*.h")), ids=lambda p: p.name)
def test_kernel_files_are_lint_clean(path):
    assert msl_lint.lint_file(path) == []


def test_lint_rejects_what_msl_does_not_have():
    src = """#include <metal_stdlib>
#include <vector>
using namespace metal;
struct A { virtual void f(); };
inline float fact(float x) { return x <= 1.0f ? 1.0f : x * fact(x - 1.0f); }
kernel void k(device float* y [[buffer(0)]], uint n, uint i [[thread_position_in_grid]]) {
    threadgroup float s;
    double d = 0.5;
    float* p = new float[4];
    delete[] p;
    try { throw 1; } catch (...) {}
    printf("x");
    goto end;
end:
    y[i] = std::sqrt(2.0f) + 1e-6;
}
"""
    found = msl_lint.lint_source(src)
    text = "\n".join(f"{line}: {msg}" for line, msg in found)
    for line, pat in [(2, "#include <vector>"), (4, "virtual"), (5, "recursion: fact"), (6, "parameter 'uint n'"),
                      (7, "threadgroup variable declared as a scalar"), (8, "`double`"), (8, "literal 0.5"),
                      (9, "`new`"), (10, "`delete`"), (11, "exceptions"), (12, "printf"), (13, "goto"),
                      (15, "std::"), (15, "literal 1e-6")]:
        assert any(ln == line and pat in msg for ln, msg in found), (line, pat, text)


@pytest.mark.parametrize("path", KERNEL_FILES + TEST_KERNELS + [ROOT / "tests" / "msl" / "bug_address_space.metal"],
                         ids=lambda p: p.name)
@pytest.mark.parametrize("mode,checked", [("sim", True), ("sim", False), ("check", True)])
def test_mslpp_keeps_line_numbers(path, mode, checked):
    src = path.read_text()
    out = mslpp.rewrite(src, mode, checked, "x", path.name)
    body = out.split(f'#line 1 "{path.name}"\n', 1)[1]
    assert body.count("\n") >= src.count("\n")
    # every line that declares or uses something keeps its line: compare identifiers line by line
    for a, b in zip(src.splitlines(), body.splitlines()):
        if "//" in a or "threadgroup" in a:
            continue
        # (a kernel with a declared thread limit is instantiated through MSL_INSTANTIATE_KERNEL_MT in sim mode)
        kinds = r"\bkernel\b|\b(?:MSL_)?INSTANTIATE_KERNEL(?:_MT)?\b"
        assert [k.replace("MSL_", "").replace("_MT", "") for k in re.findall(kinds, b)] == re.findall(kinds, a)

"""tools/msl_conform.py: the MSL conformance checker (rules from Apple's Metal Shading Language Specification,
checked on clang's JSON AST of each flattened family) and its performance rules (PERF-*, on the same AST).

Every metal/*.metal family must conform, and every planted violation under tests/msl/conform/ must be
reported at its file and line with its rule: a planted line says ``EXPECT: <rule> ...``, and the set of
(line, rule) the checker reports for the file must be exactly the set the file expects (so a rule that
stops firing fails, and so does one that fires where nothing is planted). Each family is parsed once per
test session (module-scoped fixtures): clang's JSON dump of quant.metal alone is ~130 MB.

clang >= 15 is needed: in CI (CI=true; .ci/run installs clang-19) a missing clang fails these tests,
elsewhere they are skipped.
"""
import importlib.util
import re
from pathlib import Path

import pytest

from oracles import unavailable  # fails in CI, skips elsewhere

ROOT = Path(__file__).resolve().parent.parent
KERNEL_FILES = sorted((ROOT / "metal").glob("*.metal"))
PLANTED = sorted((ROOT / "tests" / "msl" / "conform").glob("*.metal"))


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


msl_conform = _tool("msl_conform")
embed = _tool("embed_msl")

_EXPECT = re.compile(r"EXPECT:((?:\s+(?:MSL|PERF)-[A-Z0-9-]+)+)")
# the families with no performance finding (PERF-*); the others are being reshaped for Apple GPUs, and join
# this list as their findings are fixed or annotated (docs/metal.md, "Performance checks")
PERF_CLEAN = tuple(p.name for p in KERNEL_FILES)
_VERSION = re.compile(r"^// conform-version: (\d+\.\d+)$", re.M)


@pytest.fixture(scope="module")
def clang() -> str:
    """clang++ >= 15, or fail (CI=true) / skip (elsewhere)."""
    exe = msl_conform.find_clang()
    if exe is None:
        unavailable(f"no clang++ >= {msl_conform.MIN_CLANG} (apt-get install clang-19, or set MSL_CLANG)")
    return exe


@pytest.fixture(scope="module")
def family_results(clang) -> dict:
    """{family path: violations} of every metal/*.metal, each parsed once."""
    return {p: msl_conform.check_family(p, clang) for p in KERNEL_FILES}


def _planted_version(path: Path) -> str | None:
    m = _VERSION.search(path.read_text())
    return m.group(1) if m else None


@pytest.fixture(scope="module")
def planted_results(clang) -> dict:
    """{planted file: violations}, at the version its header names (else the family default)."""
    return {p: msl_conform.check_family(p, clang, version=_planted_version(p)) for p in PLANTED}


def expected(path: Path) -> set[tuple[int, str]]:
    out = set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = _EXPECT.search(line)
        if m:
            out |= {(n, rule) for rule in m.group(1).split()}
    return out


def test_there_are_families_and_planted_files():
    assert {"attention.metal", "gemm_tensor.metal", "norm.metal"} <= {p.name for p in KERNEL_FILES}
    assert len(PLANTED) >= 6


def _is_perf(v) -> bool:
    return v.rule in msl_conform.PERF_RULES


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_family_conforms(path, family_results):
    found = [v for v in family_results[path] if not _is_perf(v)]
    assert found == [], "\n".join(map(str, found))


@pytest.mark.parametrize("path", [p for p in KERNEL_FILES if p.name in PERF_CLEAN], ids=lambda p: p.name)
def test_family_performance(path, family_results):
    """No performance finding (from the same parse as test_family_conforms): every exception is annotated
    in the kernel with its reason."""
    found = [v for v in family_results[path] if _is_perf(v)]
    assert found == [], "\n".join(map(str, found))


@pytest.mark.parametrize("path", PLANTED, ids=lambda p: p.name)
def test_planted_violations_are_reported_at_their_line(path, planted_results):
    found = planted_results[path]
    rel = path.relative_to(ROOT).as_posix()
    for v in found:  # file:line: [RULE] message
        assert str(v).startswith(f"{rel}:{v.line}: [{v.rule}] ") and v.path == rel, str(v)
    got = {(v.line, v.rule) for v in found}
    want = expected(path)
    assert got == want, (f"missing: {sorted(want - got)}\nunexpected: {sorted(got - want)}\n" +
                         "\n".join(map(str, found)))


def test_every_rule_is_planted():
    planted = {rule for p in PLANTED for _, rule in expected(p)}
    assert planted == set(msl_conform.RULES), sorted(set(msl_conform.RULES) ^ planted)


def test_every_rule_cites_a_section():
    for rid, rule in msl_conform.RULES.items():
        assert re.match(r"^(MSL|PERF)-[A-Z0-9-]+$", rid)
        if rid in msl_conform.PERF_RULES:  # a source: Apple's GPU facts, MLX's practice, a house rule
            assert len(rule.section) > 20, (rid, rule.section)
        else:
            assert re.match(r"^\d+(\.\d+)* [A-Z]", rule.section), (rid, rule.section)
        assert rule.summary


def test_the_seven_kernels_bug_shape_is_caught(planted_results):
    """A scalar [[threads_per_threadgroup]] next to a uint2 [[threadgroup_position_in_grid]]."""
    path = ROOT / "tests" / "msl" / "conform" / "attrs.metal"
    line = next(n for n, t in enumerate(path.read_text().splitlines(), 1)
                if "uint nthreads [[threads_per_threadgroup]]) {" in t)
    msgs = [str(v) for v in planted_results[path] if v.line == line]
    assert msgs == [f"tests/msl/conform/attrs.metal:{line}: [MSL-ATTR-WIDTH] kernel scalar_among_vectors: "
                    "[[threads_per_threadgroup]] nthreads is uint (width 1) but [[threadgroup_position_in_grid]] tg "
                    "is uint2 (width 2): the grid attributes of a kernel are all scalars or all vectors of one width"]


def test_version_gated_features_pass_at_the_newer_version(clang):
    """version.metal's violations are all version-gated: at MSL 4.0 the same file conforms."""
    path = ROOT / "tests" / "msl" / "conform" / "version.metal"
    assert {rule for _, rule in expected(path)} == {"MSL-VERSION"}
    found = msl_conform.check_family(path, clang, version="4.0")
    assert found == [], "\n".join(map(str, found))


def test_language_versions_come_from_the_embed_table():
    assert msl_conform.family_version(ROOT / "metal" / "gemm_tensor.metal") == "4.0"
    assert msl_conform.family_version(ROOT / "metal" / "norm.metal") == embed.DEFAULT_LANGUAGE_VERSION == "3.1"
    assert msl_conform.version_number("3.1") == 310 and msl_conform.version_number("4.0") == 400
    assert msl_conform.cxx_standard("3.1") == "c++14" and msl_conform.cxx_standard("4.0") == "c++20"


def test_type_helpers():
    shape, space, pointee = msl_conform.vector_shape, msl_conform.address_space, msl_conform.pointee
    assert shape("unsigned int __attribute__((ext_vector_type(3)))") == ("uint", 3)
    assert shape("const ushort2") == ("ushort", 2) and shape("vec<uint, 2>") == ("uint", 2)
    assert shape("uint") == ("uint", 1) and shape("int") == ("int", 1) and shape("Params") is None
    assert pointee("device const float *") == ("*", "device const float")
    constant_params = "const __attribute__((address_space(2))) Params"
    assert pointee(constant_params + " &") == ("&", constant_params)
    assert pointee("uint2") is None
    assert space("const __attribute__((address_space(2))) Params") == "constant"
    assert space("threadgroup float") == "threadgroup" and space("float") == "thread"
    assert msl_conform.object_space("threadgroup float *") == "thread"
    assert msl_conform.object_space("threadgroup float[64]") == "threadgroup"


def test_cli_prints_violations_and_exits_1(capsys):
    path = ROOT / "tests" / "msl" / "conform" / "buffers.metal"
    if msl_conform.find_clang() is None:
        unavailable("no clang++ >= 15")
    assert msl_conform.main([str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(expected(path))
    assert all(re.match(r"^tests/msl/conform/buffers\.metal:\d+: \[MSL-BUFFER(-DUP)?\] ", line) for line in out), out


def test_cli_exits_0_on_a_clean_family(capsys):
    if msl_conform.find_clang() is None:
        unavailable("no clang++ >= 15")
    assert msl_conform.main([str(ROOT / "metal" / "norm.metal")]) == 0
    assert capsys.readouterr().out == ""


def test_perf_rules_can_be_left_out(planted_results, capsys):
    """--no-perf (check_family(perf=False)) reports the conformance rules only: perf.metal then conforms."""
    path = ROOT / "tests" / "msl" / "conform" / "perf.metal"
    assert {v.rule for v in planted_results[path]} == set(msl_conform.PERF_RULES)
    assert msl_conform.main(["--no-perf", str(path)]) == 0
    assert capsys.readouterr().out == ""


def test_perf_annotations_cover_their_line_or_the_next(planted_results):
    """A perf-ok with a reason suppresses its rule on its own line of code, or on the next line when it stands
    alone; one without a reason suppresses nothing and is reported."""
    path = ROOT / "tests" / "msl" / "conform" / "perf.metal"
    lines = path.read_text().splitlines()
    found = {(v.line, v.rule) for v in planted_results[path]}
    same = next(n for n, t in enumerate(lines, 1) if "a deliberate exception, with its reason" in t)
    alone = next(n for n, t in enumerate(lines, 1) if "alone on its line covers the next" in t)
    bare = next(n for n, t in enumerate(lines, 1) if t.rstrip().endswith("// perf-ok(PERF-STACK-ARRAY)"))
    assert not {r for ln, r in found if ln in (same, alone, alone + 1)}
    assert {(bare, "PERF-STACK-ARRAY"), (bare, "PERF-ANNOTATION")} <= found


def test_cli_lists_the_rules(capsys):
    assert msl_conform.main(["--rules"]) == 0
    out = capsys.readouterr().out
    assert all(f"{rid}: " in out for rid in msl_conform.RULES)


def test_cli_without_clang_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(msl_conform, "find_clang", lambda: None)
    assert msl_conform.main([str(ROOT / "metal" / "norm.metal")]) == 2
    assert "no clang++" in capsys.readouterr().err


def test_a_clang_that_cannot_run_is_an_error(tmp_path):
    with pytest.raises(msl_conform.ConformError, match="cannot run"):
        msl_conform.check_family(ROOT / "metal" / "norm.metal", clang=str(tmp_path / "no-such-clang"))


def test_docs_list_every_rule():
    """docs/metal.md's "MSL conformance checker" section names every rule and the test that checks it."""
    doc = (ROOT / "docs" / "metal.md").read_text()
    section = re.split(r"\n#{1,2} ", doc.split("\n## MSL conformance checker", 1)[1], maxsplit=1)[0]
    for rid, rule in msl_conform.RULES.items():
        row = next((ln for ln in section.splitlines() if ln.startswith(f"| `{rid}`")), None)
        assert row is not None, rid
        assert rule.section.split(" ")[0] in row, (rid, row)

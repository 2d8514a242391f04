"""Conventions of the test suite that a test can check: every ``pytest.raises`` names the error it expects
(``match=``), so a test cannot pass on an unrelated exception of the same type."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _raises_without_match(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "raises"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "pytest"
                and not any(k.arg == "match" for k in node.keywords)):
            lines.append(node.lineno)
    return lines


def test_every_pytest_raises_has_match():
    bad = {}
    for path in sorted(TESTS.rglob("*.py")):
        lines = _raises_without_match(path)
        if lines:
            bad[str(path.relative_to(TESTS))] = lines
    assert not bad, f"pytest.raises without match= (file: lines): {bad}"


def test_the_check_finds_a_bare_raises(tmp_path):
    f = tmp_path / "t.py"
    f.write_text("import pytest\nwith pytest.raises(ValueError):\n    pass\n"
                 "with pytest.raises(ValueError, match='x'):\n    pass\n")
    assert _raises_without_match(f) == [2]

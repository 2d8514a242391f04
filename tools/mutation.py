#!/usr/bin/env python3
"""Mutation testing with mutmut over the modules that decide what users get.

mutmut (pinned in the ``test`` extra) mutates the code of a package found at ``./``, ``src/`` or
``source/`` of the directory it runs in, and names mutants after the import path seen from there. This
repository keeps the package in ``python/``, so the run happens in a staging directory laid out the way
mutmut expects: ``<dir>/src/qwenmetal`` (a copy of ``python/qwenmetal`` with the compiled extension of the
interpreter running this script), ``<dir>/tests`` and a ``pyproject.toml`` carrying the pytest settings
and a ``[tool.mutmut]`` section for the chosen modules (``TARGETS``: each module with the tests that
exercise it). Everything is rebuilt on each run, so no result is reused from a previous source.

A surviving mutant is either killed by a new test or listed in ``tools/mutation-equivalent.txt``
(``mutant-name<TAB>mutated line<TAB>why it cannot change behaviour``); the mutated line is compared too, so
an entry goes stale (and is reported) when the function it refers to changes.

    python tools/mutation.py                       # every module in TARGETS, one worker
    python tools/mutation.py sampling              # one module
    python tools/mutation.py --dir /tmp/mut sampling --max-children 2

Prints mutmut's counts (killed / survived / timeout / ...) per run and the surviving mutants that are
not documented as equivalent, with their diff; exits 1 if there are any (or if an equivalence entry is
stale). Afterwards ``cd <dir> && mutmut results`` / ``mutmut show NAME`` / ``mutmut browse`` work as usual.
"""
from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT_FILE = ROOT / "tools" / "mutation-equivalent.txt"

#: module of python/qwenmetal -> the test files that check it (kept small: mutmut runs, for each mutant,
#: the tests of this selection that call the mutated function)
TARGETS: dict[str, list[str]] = {
    "sampling": ["tests/test_sampling.py"],
    "prefix_cache": ["tests/test_prefix_cache.py"],
}


@dataclass
class Outcome:
    """One mutmut run: counts by status, the surviving mutants' names and their diffs."""
    counts: dict[str, int]
    survivors: list[str]
    diffs: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def mutmut_env() -> dict:
    """The environment for mutmut: no PYTHONPATH (the staged copy must be what the tests import)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _extension() -> Path:
    spec = importlib.util.find_spec("qwenmetal._core")
    if spec is None or spec.origin is None:
        raise OSError("qwenmetal._core is not importable: build it (tools/dev_build.sh) or pip install the package")
    return Path(spec.origin)


def stage(dest: Path, modules: list[str]) -> None:
    """Lay out ``dest`` for mutmut: src/qwenmetal (+ the extension), tests/, pyproject.toml."""
    unknown = [m for m in modules if m not in TARGETS]
    if unknown:
        raise ValueError(f"unknown module(s) {unknown}; known: {sorted(TARGETS)}")
    if dest.exists():
        shutil.rmtree(dest)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache")
    pkg = dest / "src" / "qwenmetal"
    shutil.copytree(ROOT / "python" / "qwenmetal", pkg, ignore=skip)
    if not list(pkg.glob("_core*")):
        shutil.copy2(_extension(), pkg)
    shutil.copytree(ROOT / "tests", dest / "tests", ignore=skip)
    tests = sorted({t for m in modules for t in TARGETS[m]})
    conf = "\n".join([
        "[tool.pytest.ini_options]",
        'testpaths = ["tests"]',
        "",
        "[tool.mutmut]",
        'source_paths = ["src/qwenmetal"]',
        f"only_mutate = {json.dumps([f'src/qwenmetal/{m}.py' for m in modules])}",
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}",
        'pytest_add_cli_args = ["-q", "-p", "no:cacheprovider"]',
        "use_git_change_detection = false",
        "",
    ])
    (dest / "pyproject.toml").write_text(conf)


def _mutmut(dest: Path, *args: str, check: bool = True) -> str:
    r = subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=dest, env=mutmut_env(),
                       stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"mutmut {' '.join(args)} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return r.stdout


def run(dest: Path, modules: list[str], max_children: int = 1, names: list[str] | None = None) -> Outcome:
    """Stage ``modules`` in ``dest`` and run mutmut there: all their mutants, or only ``names`` (mutmut's
    names, ``*`` wildcards allowed, e.g. ``qwenmetal.sampling.xǁSamplerǁ_draw__mutmut_*``)."""
    stage(dest, modules)
    t0 = time.monotonic()
    _mutmut(dest, "run", "--max-children", str(max_children), *(names or []))
    seconds = time.monotonic() - t0
    counts: dict[str, int] = {}
    status: dict[str, str] = {}
    for line in _mutmut(dest, "results", "--all", "true").splitlines():
        m = re.fullmatch(r"\s*(\S+): (.+)", line)
        if m:
            status[m.group(1)] = m.group(2).strip()
    if names:
        status = {k: v for k, v in status.items() if any(fnmatch.fnmatchcase(k, n) for n in names)}
    for v in status.values():
        counts[v] = counts.get(v, 0) + 1
    survivors = sorted(k for k, v in status.items() if v == "survived")
    diffs = {k: _mutmut(dest, "show", k) for k in survivors}
    return Outcome(counts, survivors, diffs, seconds)


def mutated_line(diff: str) -> str:
    """The first added line of a mutant's diff, stripped (how the equivalence list identifies it)."""
    for line in diff.splitlines():
        if line.startswith("+") and not line.startswith("+++"):
            return line[1:].strip()
    return ""


def load_equivalent(path: Path = EQUIVALENT_FILE) -> dict[str, tuple[str, str]]:
    """name -> (mutated line, reason) from the equivalence list (``#`` comments and blank lines ignored)."""
    out = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) != 3 or not all(p.strip() for p in parts):
            raise ValueError(f"{path}:{n}: expected 'name<TAB>mutated line<TAB>reason', got {line!r}")
        out[parts[0].strip()] = (parts[1].strip(), parts[2].strip())
    return out


def unexplained(outcome: Outcome, equivalent: dict[str, tuple[str, str]]) -> list[str]:
    """Survivors that the equivalence list does not explain (absent, or listed with another mutated line)."""
    bad = []
    for name in outcome.survivors:
        entry = equivalent.get(name)
        if entry is None or entry[0] != mutated_line(outcome.diffs[name]):
            bad.append(name)
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="*", help=f"modules to mutate (default: all of {sorted(TARGETS)})")
    ap.add_argument("--dir", type=Path, default=ROOT / "build" / "mutation", help="staging directory (rebuilt)")
    ap.add_argument("--max-children", type=int, default=1, help="mutmut workers (default 1)")
    ap.add_argument("--only", action="append", metavar="NAME", help="only these mutants (wildcards allowed)")
    a = ap.parse_args(argv)
    modules = a.modules or list(TARGETS)
    out = run(a.dir, modules, a.max_children, a.only)
    total = sum(out.counts.values())
    killed = out.counts.get("killed", 0)
    print(f"{', '.join(modules)}: {total} mutants in {out.seconds:.0f} s: "
          + ", ".join(f"{v} {k}" for k, v in sorted(out.counts.items()))
          + (f"; score {100 * killed / total:.1f} %" if total else ""))
    bad = unexplained(out, load_equivalent())
    for name in bad:
        print(f"\nsurvived, not in {EQUIVALENT_FILE.relative_to(ROOT)}: {name}\n{out.diffs[name]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

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
    "options": ["tests/test_options.py", "tests/test_chat_messages.py"],
    "chat": ["tests/test_chat_messages.py", "tests/test_options.py"],
    "session_io": ["tests/test_session_io.py", "tests/test_files.py"],
    "generation": ["tests/test_generate.py", "tests/test_stop_strings.py"],
    # request validation only (_num, _bool, _options, _check_n, read_json = create_app__mutmut_62..152):
    # run with --only; the rest of server.py is checked by tests/test_server.py (subprocess servers)
    "server": ["tests/test_server_validation.py"],
}


@dataclass
class Outcome:
    """One mutmut run: the status of every mutant it ran, the survivors' diffs, and the documented
    equivalents it skipped (with their diffs, to check that the entries still describe them)."""
    status: dict[str, str]
    diffs: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for v in self.status.values():
            out[v] = out.get(v, 0) + 1
        return out

    @property
    def survivors(self) -> list[str]:
        return sorted(k for k, v in self.status.items() if v == "survived")


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


def mutant_names(modules: list[str]) -> list[str]:
    """Every mutant mutmut makes of ``modules``, by mutmut's own generator and naming (what ``mutmut run``
    creates from the same source)."""
    from mutmut.mutation.file_mutation import mutate_file_contents
    from mutmut.utils.format_utils import get_mutant_name

    out = []
    for m in modules:
        rel = Path("src") / "qwenmetal" / f"{m}.py"
        code = (ROOT / "python" / "qwenmetal" / f"{m}.py").read_text(encoding="utf-8")
        out += [get_mutant_name(rel, n) for n in mutate_file_contents(str(rel), code).mutant_names]
    return out


def run(dest: Path, modules: list[str], max_children: int = 1, names: list[str] | None = None,
        skip_equivalent: bool = False) -> Outcome:
    """Stage ``modules`` in ``dest`` and run mutmut there: all their mutants, or only ``names`` (mutmut's
    names, ``*`` wildcards allowed, e.g. ``qwenmetal.sampling.xǁSamplerǁ_draw__mutmut_*``). With
    ``skip_equivalent`` the mutants documented as equivalent are not run (they survive by definition and
    cost a full test run each); their diffs are still read, so a stale entry is found."""
    every = mutant_names(modules)
    chosen = [k for k in every if not names or any(fnmatch.fnmatchcase(k, n) for n in names)]
    if not chosen:
        raise ValueError(f"no mutant of {modules} matches {names}")
    equivalent = load_equivalent() if skip_equivalent else {}
    skipped = [k for k in chosen if k in equivalent]
    todo = [k for k in chosen if k not in equivalent]
    if not todo:
        raise ValueError(f"every mutant of {modules} matching {names} is a documented equivalent: nothing to run")
    stage(dest, modules)
    t0 = time.monotonic()
    _mutmut(dest, "run", "--max-children", str(max_children), *(todo if names or skipped else []))
    seconds = time.monotonic() - t0
    status: dict[str, str] = {}
    for line in _mutmut(dest, "results", "--all", "true").splitlines():
        m = re.fullmatch(r"\s*(\S+): (.+)", line)
        if m:
            status[m.group(1)] = m.group(2).strip()
    if sorted(status) != sorted(every):
        raise RuntimeError(f"mutmut made other mutants than mutant_names() lists: "
                           f"{sorted(set(status) ^ set(every))[:10]}")
    status = {k: status[k] for k in todo}
    out = Outcome(status, skipped=skipped, seconds=seconds)
    out.diffs = {k: _mutmut(dest, "show", k) for k in out.survivors + skipped}
    return out


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
    """Survivors that the equivalence list does not explain (absent, or listed with another mutated line),
    and skipped equivalents whose entry no longer describes the mutant of that name."""
    bad = []
    for name in outcome.survivors + outcome.skipped:
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
    ap.add_argument("--skip-equivalent", action="store_true",
                    help="do not run the mutants documented as equivalent (their entries are still checked)")
    a = ap.parse_args(argv)
    modules = a.modules or list(TARGETS)
    out = run(a.dir, modules, a.max_children, a.only, a.skip_equivalent)
    total = sum(out.counts.values())
    killed = out.counts.get("killed", 0)
    print(f"{', '.join(modules)}: {total} mutants run in {out.seconds:.0f} s: "
          + ", ".join(f"{v} {k}" for k, v in sorted(out.counts.items()))
          + (f"; score {100 * killed / total:.1f} %" if total else "")
          + (f"; {len(out.skipped)} documented equivalents not run" if out.skipped else ""))
    bad = unexplained(out, load_equivalent())
    for name in bad:
        print(f"\nsurvived, not in {EQUIVALENT_FILE.relative_to(ROOT)}: {name}\n{out.diffs[name]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Packaging: a wheel and an sdist built here install into fresh environments and run the demo; the
cibuildwheel configuration builds the platforms it promises; the pip build's helper (tools/pip_build.py)
reuses what it can and reports progress.

Cost (CI budget): the wheel comes from the persistent build directory of this checkout (build/{wheel_tag},
the one `pip install .` filled: cmake/pip_build.cmake), so it takes seconds when the README's install ran
first; only the sdist compiles from scratch (about 1.5 minutes on 2 cores). The fresh environments borrow
the running environment's installed distributions through a .pth file (the dependencies are not
downloaded again); each checks that `qwenmetal` itself is imported from its own site-packages.
"""
from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:            # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import pip_build  # noqa: E402

COMPILERS = ("cc", "c++", "gcc", "g++", "clang", "clang++", "clang++-19", "clang-19")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _run(cmd, timeout=900, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "CC", "CXX"))}
    env["QWENMETAL_BUILD_PROGRESS"] = "0"       # no progress lines on a developer's terminal
    env.update(extra)
    return env


def _fresh_venv(where: Path) -> Path:
    """A new virtual environment that sees this one's installed distributions (after its own)."""
    _run([sys.executable, "-m", "venv", where])
    py = where / "bin" / "python"
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    ours = [p for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]} if p]
    # everything but qwenmetal itself: the borrowed directories come after the venv's own site-packages
    (site / "borrowed.pth").write_text("\n".join(ours) + "\n", encoding="utf-8")
    return py


def _demo_command(platform: str = "linux") -> str:
    cfg = _pyproject()["tool"]["cibuildwheel"]
    return cfg.get(platform, {}).get("test-command", cfg["test-command"])


def _run_demo(venv_py: Path, tmp: Path, path: str) -> str:
    venv_bin = venv_py.parent
    where = _run([venv_py, "-c", "import qwenmetal, qwenmetal._core as c; print(qwenmetal.__file__); print(c.__file__)"],
                 env=_env(PATH=path)).stdout.split()
    assert all(Path(w).is_relative_to(venv_bin.parent) for w in where), where   # not the borrowed copy
    cmd = _demo_command().split()
    assert cmd[0] == "qwenmetal"
    r = _run([venv_bin / "qwenmetal", *cmd[1:]], env=_env(PATH=path, QWENMETAL_CACHE=str(tmp / "cache")),
             cwd=tmp, timeout=600)
    assert "loaded on backend 'cpu'" in r.stdout and "RANDOM weights" in r.stdout, r.stdout
    return r.stdout


# ------------------------------------------------------------------------------------- wheel and sdist
def test_wheel_installs_and_runs_without_a_compiler(tmp_path):
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", dist, ROOT], env=_env(), timeout=1200)
    (wheel,) = dist.glob("qwenmetal-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(re.fullmatch(r"qwenmetal/_core\..*(so|pyd)", n) for n in names), names
    assert "qwenmetal/msl_include/mslpp.py" in names and "qwenmetal/metal/quant.metal" in names
    assert "qwenmetal/cli.py" in names

    py = _fresh_venv(tmp_path / "venv")
    # --ignore-installed: the qwenmetal this suite runs from is visible through the borrowed directories, and
    # pip would call the wheel's requirement satisfied by it (and install nothing)
    _run([py, "-m", "pip", "install", "--no-index", "--no-deps", "--ignore-installed", wheel], env=_env())
    # PATH: the venv's bin alone -- no compiler can be found, and none is needed
    path = str(py.parent)
    assert not [c for c in COMPILERS if shutil.which(c, path=path)]
    _run_demo(py, tmp_path, path)


def test_sdist_builds_and_installs_from_scratch(tmp_path):
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--sdist", "-o", dist, ROOT], env=_env())
    (sdist,) = dist.glob("qwenmetal-*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for needed in ["CMakeLists.txt", "cmake/pip_build.cmake", "tools/pip_build.py", "tools/mslpp.py",
                   "tools/embed_msl.py", "src/core/threadpool.cpp", "src/msl_sim/include/metal_stdlib",
                   "metal/quant.metal", "python/qwenmetal/cli.py", "pyproject.toml", "README.md"]:
        assert needed in names, f"the sdist lacks {needed}"
    assert not [n for n in names if n.startswith("build/") or n.endswith((".so", ".o"))]

    py = _fresh_venv(tmp_path / "venv")
    # --no-cache-dir: pip would otherwise reuse a wheel it built from an identical sdist before
    r = _run([py, "-m", "pip", "install", "--no-cache-dir", "-v", sdist], env=_env(), timeout=1800)
    log = r.stdout + r.stderr
    assert re.search(r"\[\d+/\d+\] Building CXX object", log), f"the sdist install compiled nothing?\n{log[-3000:]}"
    _run_demo(py, tmp_path, str(py.parent) + os.pathsep + os.environ.get("PATH", ""))


# ------------------------------------------------------------------------------------- cibuildwheel
def _identifiers(platform: str) -> set[str]:
    """What cibuildwheel would build for `platform` from pyproject.toml (it prints them on any host)."""
    env = {k: v for k, v in _env().items() if not k.startswith("CIBW_")}
    r = _run([sys.executable, "-m", "cibuildwheel", "--platform", platform, "--print-build-identifiers", ROOT],
             cwd=ROOT, env=env)
    return set(r.stdout.split())


def test_cibuildwheel_builds_macos_arm64_and_manylinux_x86_64_aarch64():
    linux, macos = _identifiers("linux"), _identifiers("macos")
    for v in ("cp310", "cp311", "cp312", "cp313"):
        assert {f"{v}-manylinux_x86_64", f"{v}-manylinux_aarch64"} <= linux, linux
        assert f"{v}-macosx_arm64" in macos, macos
    assert not [i for i in linux | macos if "musllinux" in i or "x86_64" in i and "macosx" in i or "i686" in i]


def test_cibuildwheel_tests_each_wheel_with_the_demo_and_metal_with_selftest():
    cfg = _pyproject()["tool"]["cibuildwheel"]
    assert _demo_command("linux").startswith("qwenmetal demo")
    assert "qwenmetal selftest" in _demo_command("macos")      # the Metal device was built and compiles kernels
    assert cfg["macos"]["environment"]["MACOSX_DEPLOYMENT_TARGET"] == "14.0"
    for env in (cfg["environment"], cfg["macos"]["environment"]):
        assert env["SKBUILD_BUILD_DIR"].startswith("build/cibw/")
    assert {cfg["linux"]["manylinux-x86_64-image"], cfg["linux"]["manylinux-aarch64-image"]} == {"manylinux_2_28"}
    wf = (ROOT / ".github" / "workflows" / "wheels.yml").read_text(encoding="utf-8")
    assert "cibuildwheel" in wf and "macos-14" in wf and "ubuntu-24.04-arm" in wf


# ------------------------------------------------------------------------------------- tools/pip_build.py
class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_progress_reports_each_tenth_on_the_terminal():
    out, clock = io.StringIO(), _Clock()
    p = pip_build.Progress(out, clock)
    p.line("[0/2] Re-checking globbed directories...")
    for i in range(1, 51):
        clock.t = i * 1.5
        p.line(f"[{i}/50] Building CXX object CMakeFiles/qwenmetal_cpu.dir/src/cpu/k{i}.cpp.o")
    lines = out.getvalue().split("\n")[:-1]
    assert len(lines) == 11 and all(ln.startswith("\r\x1b[K") for ln in lines)     # 10%, 20%, ... 100%
    assert lines[-1].endswith("[50/50] 100%  1:15  src/cpu/k50.cpp")
    assert "Re-checking" not in out.getvalue()
    p.line("some compiler warning")               # not a status line: nothing
    assert len(out.getvalue().split("\n")) == 12


def test_progress_names_what_is_compiled():
    assert pip_build.short("Building CXX object CMakeFiles/qwenmetal_msl_kernels.dir/msl_gen/quant.metal.cpp.o") \
        == "metal/quant.metal"
    assert pip_build.short("Building CXX object CMakeFiles/_core.dir/Unity/unity_2_cxx.cxx.o") == "_core: unity_2"
    assert pip_build.short("Linking CXX static library libqwenmetal_cpu.a") == "Linking CXX static library libqwenmetal_cpu.a"


def test_no_terminal_no_progress(monkeypatch):
    monkeypatch.setenv("QWENMETAL_BUILD_PROGRESS", "0")
    assert pip_build.Progress.open_terminal().out is None
    pip_build.Progress.open_terminal().say("nothing happens")


def test_sync_tree_rewrites_only_what_changed(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "include").mkdir(parents=True)
    (src / "include" / "a.h").write_text("a")
    (src / "b.cpp").write_text("b")
    assert pip_build.sync_tree(src, dst) == 2
    os.utime(dst / "b.cpp", (1, 1))
    os.utime(dst / "include" / "a.h", (1, 1))
    (src / "include" / "a.h").write_text("a2")
    (dst / "stale.h").write_text("gone")
    assert pip_build.sync_tree(src, dst) == 2      # a.h rewritten, stale.h removed
    assert (dst / "b.cpp").stat().st_mtime == 1    # unchanged: not touched (nothing recompiles)
    assert (dst / "include" / "a.h").read_text() == "a2" and not (dst / "stale.h").exists()


def test_a_cache_from_another_checkout_is_recognised(tmp_path):
    cache = tmp_path / "CMakeCache.txt"
    cache.write_text("FOO:BOOL=ON\nCMAKE_HOME_DIRECTORY:INTERNAL=/project\n")
    assert pip_build.cached_source_dir(cache) == "/project"
    assert pip_build.cached_source_dir(tmp_path / "none") is None

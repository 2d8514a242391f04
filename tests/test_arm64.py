"""The arm64 kernels, built with a cross compiler and run under user-mode qemu (qemu-verified, not run on
arm64 hardware): tests/native/kernel_check.cpp compares every NEON kernel with the portable one and every
integer-activation variant (plain NEON, FEAT_DotProd sdot, FEAT_I8MM smmla) bit for bit with the portable
integer kernel, on three emulated CPUs that exercise the run-time detection: ``max`` (dotprod + i8mm),
``cortex-a76`` (dotprod only) and ``cortex-a72`` (neither: the plain NEON fallback).

Needs aarch64-linux-gnu-g++ and qemu-aarch64 (Debian: g++-aarch64-linux-gnu, qemu-user; .ci/run installs
them): in CI (CI=true) their absence fails these tests, elsewhere they are skipped.
"""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from oracles import unavailable  # fails in CI, skips elsewhere

ROOT = Path(__file__).resolve().parent.parent
# the CPU kernels and what the checker links against (CPU detection, quantizer, thread pool); the x86
# files compile to their "not this architecture" stubs
SOURCES = ["src/cpu/kernels_portable.cpp", "src/cpu/kernels_neon.cpp", "src/cpu/kernels_x86.cpp",
           "src/cpu/kernels_amx.cpp", "src/cpu/cpu_info.cpp", "src/cpu/quant.cpp", "src/core/threadpool.cpp",
           "tests/native/kernel_check.cpp"]
CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
# emulated CPU -> the integer variant the detection must pick there
CPUS = {"max": "i8mm", "cortex-a76": "dotprod", "cortex-a72": "neon"}


@pytest.fixture(scope="module")
def checker(tmp_path_factory) -> Path:
    """kernel_check.cpp and the CPU kernels cross-compiled for arm64 (-O2 as the extension, static)."""
    for tool, pkg in ((CXX, "g++-aarch64-linux-gnu"), (QEMU, "qemu-user")):
        if shutil.which(tool) is None:
            unavailable(f"no {tool} (apt-get install {pkg})")
    out = tmp_path_factory.mktemp("arm64")
    launcher = ["ccache"] if shutil.which("ccache") else []
    env = dict(os.environ, CCACHE_BASEDIR=str(ROOT.parent), CCACHE_NOHASHDIR="1")
    jobs = [(src, subprocess.Popen(launcher + [CXX, "-std=c++17", "-O2", "-Wall", "-Werror", f"-I{ROOT / 'src'}",
                                               "-c", str(ROOT / src), "-o", str(out / (Path(src).name + ".o"))],
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            for src in SOURCES]   # (parallel: the objects are independent)
    for src, p in jobs:
        log = p.communicate(timeout=600)[0]
        assert p.returncode == 0, f"{CXX} {src} failed:\n{log}"
    exe = out / "kernel_check"
    subprocess.run([CXX, "-static", "-pthread", *sorted(map(str, out.glob("*.o"))), "-o", str(exe)], check=True,
                   timeout=300)
    return exe


@pytest.mark.parametrize("cpu", list(CPUS))
def test_neon_kernels_under_qemu(checker, cpu):
    r = subprocess.run([QEMU, "-cpu", cpu, str(checker)], capture_output=True, text=True, timeout=300)
    lines = r.stdout.splitlines()
    assert lines[0] == "checking neon against portable", r.stdout
    assert f"neon_dot: {CPUS[cpu]}" in lines, r.stdout
    # cpu_info() sees the same features, and its kernel report names the variants in use
    features = next(ln for ln in lines if ln.startswith("features:")).split()[1:]
    assert ("dotprod" in features) == (CPUS[cpu] != "neon"), features
    assert ("i8mm" in features) == (CPUS[cpu] == "i8mm"), features
    assert f"kernel gemm_int: neon-{CPUS[cpu]}" in lines, r.stdout
    assert f"kernel gemv_int: neon-{'neon' if CPUS[cpu] == 'neon' else 'dotprod'}" in lines, r.stdout
    # every variant up to the detected one was compared (int8 and int16, GEMV and GEMM)
    variants = list(CPUS.values())[::-1]
    for v in variants[:variants.index(CPUS[cpu]) + 1]:
        for planes in ("int8", "int16"):
            assert f"{planes} {v} M 1 rows [0, 37): same bits (0.00e+00)" in lines, r.stdout
            assert f"{planes} {v} M 9 rows [0, 37): same bits (0.00e+00)" in lines, r.stdout
    assert any(line.startswith("gemm_nn: ") for line in lines), r.stdout
    assert r.returncode == 0 and lines[-1] == "all ok", r.stdout + r.stderr


def test_neon_dot_switch_follows_the_cpu():
    """cpu_set_neon_dot takes each variant the CPU has (cpu_neon_dot and cpu_info()["kernels"] follow it)
    and refuses the others by name; on x86 only "neon" (the NEON table is not built there)."""
    from qwenmetal import _core

    features = set(_core.cpu_info()["features"])
    have = ["neon"] + (["dotprod"] if "dotprod" in features else []) + \
        (["i8mm"] if {"dotprod", "i8mm"} <= features else [])
    assert _core.cpu_neon_dot() == have[-1]
    try:
        for v in have:
            _core.cpu_set_neon_dot(v)
            assert _core.cpu_neon_dot() == v
            if _core.cpu_isa() == "neon":
                assert _core.cpu_info()["kernels"]["gemm_int"] == f"neon-{v}"
        for v in ["neon", "dotprod", "i8mm"][len(have):]:
            with pytest.raises(ValueError, match=f"variant '{v}' is not available on this CPU"):
                _core.cpu_set_neon_dot(v)
        with pytest.raises(ValueError, match=r"unknown variant 'sve' \(neon, dotprod, i8mm\)"):
            _core.cpu_set_neon_dot("sve")
    finally:
        _core.cpu_set_neon_dot(have[-1])

"""`_core.cpu_info()`: the engine's one CPU detection (src/cpu/cpu_info.cpp).

* keys and types as the contract states; isa == cpu_isa(), amx == cpu_amx();
* on Linux x86-64 the features agree with the kernel's /proc/cpuinfo flags (same names), the vendor,
  family and model with its fields;
* "kernels" follows the forcing switches (cpu_set_isa / cpu_set_vnni / cpu_set_amx).
"""
from __future__ import annotations

import platform
from pathlib import Path

import pytest

from qwenmetal import _core

X86 = platform.machine().lower() in ("x86_64", "amd64")
CPUINFO = Path("/proc/cpuinfo")
FEATURES_X86 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                "avx512_bf16", "avx_vnni", "gfni", "amx_tile", "amx_int8", "amx_bf16"}
FEATURES_ARM = {"asimd", "dotprod", "i8mm", "bf16"}


def _proc_field(name: str) -> str:
    for line in CPUINFO.read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    raise AssertionError(f"/proc/cpuinfo has no {name!r}")


def test_keys_and_types():
    ci = _core.cpu_info()
    for key, typ in [("vendor", str), ("model_name", str), ("family", int), ("model", int), ("stepping", int),
                     ("uarch", str), ("isa", str), ("features", list), ("amx", bool), ("kernels", dict)]:
        assert isinstance(ci[key], typ), key
    assert ci["vendor"] and ci["model_name"] and ci["uarch"]
    assert set(ci["features"]) <= FEATURES_X86 | FEATURES_ARM
    assert ci["isa"] == _core.cpu_isa()
    assert ci["amx"] == _core.cpu_amx()
    assert {"gemv", "gemv_int", "gemm_int"} <= set(ci["kernels"])
    assert all(isinstance(v, str) and v for v in ci["kernels"].values())


@pytest.mark.skipif(not (X86 and CPUINFO.exists()), reason="Linux x86-64 only (/proc/cpuinfo flags)")
def test_features_agree_with_proc_cpuinfo():
    ci = _core.cpu_info()
    flags = set(_proc_field("flags").split())
    assert set(ci["features"]) == FEATURES_X86 & flags
    assert ci["vendor"] == _proc_field("vendor_id")
    assert ci["family"] == int(_proc_field("cpu family"))
    assert ci["model"] == int(_proc_field("model"))
    assert ci["model_name"] == " ".join(_proc_field("model name").split())
    # an AVX-512 CPU runs the avx512 kernels unless forced otherwise; features name what the ISA needs
    if "avx512" in _core.cpu_isas():
        assert {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"} <= set(ci["features"])
    if "amx_int8" in flags and "amx_tile" in flags:
        assert ci["uarch"] in ("sapphirerapids", "emeraldrapids", "graniterapids")


def test_kernels_follow_the_switches():
    saved = _core.cpu_isa()
    try:
        _core.cpu_set_isa("portable")
        k = _core.cpu_info()["kernels"]
        assert k["gemv"] == "portable" and k["gemv_int"] == "scalar"
        if "avx2" in _core.cpu_isas():   # AVX-VNNI where the CPU has it, unless forbidden
            _core.cpu_set_isa("avx2")
            vnni = "avx_vnni" in _core.cpu_info()["features"]
            assert _core.cpu_info()["kernels"]["gemv_int"] == ("avx-vnni" if vnni else "avx2")
            assert _core.cpu_info()["kernels"]["gemm_int"] == ("avx-vnni-gemm" if vnni else "avx2-rows")
            _core.cpu_set_vnni_gemm(False)
            assert _core.cpu_info()["kernels"]["gemm_int"] == ("avx-vnni-rows" if vnni else "avx2-rows")
            _core.cpu_set_vnni_gemm(True)
            _core.cpu_set_vnni(False)
            assert _core.cpu_info()["kernels"]["gemv_int"] == "avx2"
            assert _core.cpu_info()["kernels"]["gemm_int"] == "avx2-rows"
            _core.cpu_set_vnni(True)
        if "avx512" in _core.cpu_isas():
            _core.cpu_set_isa("avx512")
            _core.cpu_set_amx(False)
            _core.cpu_set_vnni(False)
            k = _core.cpu_info()["kernels"]
            assert (k["gemv"], k["gemv_int"], k["gemm_int"]) == ("avx512", "avx512bw", "avx512bw")
            _core.cpu_set_vnni(True)
            _core.cpu_set_amx(True)
            k = _core.cpu_info()["kernels"]
            assert k["gemv_int"] == ("avx512-vnni" if _core.cpu_vnni() else "avx512bw")
            assert (k["gemm_int"] == "amx") == _core.cpu_amx()
    finally:
        _core.cpu_set_vnni(True)
        _core.cpu_set_vnni_gemm(True)
        _core.cpu_set_amx(True)
        _core.cpu_set_isa(saved)

"""tools/embed_msl.py: the MSL that MetalDevice compiles with newLibraryWithSource: (no include path there).

For every metal/*.metal the flattened source must be the same translation unit as the original with
``-I metal``: no quoted include left, the same tokens after preprocessing as Apple's compiler would see
them (``__METAL_VERSION__`` defined, ``<metal_*>`` headers stubbed), accepted by the address-space type
check, and with ``#line`` markers so that a compile error names the original file and line. The generated
C++ must compile and hold exactly the flattened text and each family's MSL version (``LANGUAGE_VERSION``,
also read by tools/msl_conform.py), and its kernel table must list exactly the kernels the simulator's
build of the same files registers.

Compilers: clang++ >= 15 (tools/msl_check.py's rule) for the type check, any C++ compiler (c++, g++,
clang++) for the rest. With CI=true a missing compiler fails these tests; elsewhere they are skipped.
"""
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from oracles import unavailable  # fails in CI, skips elsewhere

ROOT = Path(__file__).resolve().parent.parent
METAL = ROOT / "metal"
KERNEL_FILES = sorted(METAL.glob("*.metal"))
SHIM = ROOT / "src" / "msl_sim" / "include"


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


embed = _tool("embed_msl")
msl_check = _tool("msl_check")
mslpp = _tool("mslpp")


def require_clang() -> str:
    clang = msl_check.find_clang()
    if clang is None:
        unavailable(f"no clang++ >= {msl_check.MIN_CLANG} (apt-get install clang-19, or set MSL_CLANG)")
    return clang


def require_cxx() -> str:
    for c in (os.environ.get("CXX"), "c++", "g++", "clang++", msl_check.find_clang()):
        if c and shutil.which(c):
            return shutil.which(c)
    unavailable("no C++ compiler")


def _quoted_includes(src: str) -> list[str]:
    return [ln for ln in mslpp.blank_comments(src).splitlines() if re.match(r'\s*#\s*include\s*"', ln)]


def _stub_dir(tmp_path: Path) -> Path:
    """Empty <metal_*> (and MetalPerformancePrimitives) headers: preprocessing then yields only the project's
    own text."""
    d = tmp_path / "stub"
    d.mkdir()
    for h in SHIM.glob("metal_*"):
        (d / h.name).write_text("")
    (d / "MetalPerformancePrimitives").mkdir()
    (d / "MetalPerformancePrimitives" / "MetalPerformancePrimitives.h").write_text("")
    return d


def _preprocess(cxx: str, path: Path, includes, defines=("__METAL_VERSION__=310",)) -> str:
    cmd = [cxx, "-E", "-P", "-x", "c++", "-std=c++17", "-nostdinc", "-nostdinc++"]
    cmd += [f"-D{d}" for d in defines] + [f"-I{i}" for i in includes] + [str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return " ".join(r.stdout.split())


def _check_flat(clang: str, text: str, name: str, tmp_path: Path) -> tuple[bool, str]:
    """tools/msl_check.py's clang command on a flattened source, with only the shim on the include path."""
    checked = mslpp.rewrite(text, "check", True, "check", name)
    p = tmp_path / (Path(name).stem + ".flat.check.cpp")
    p.write_text(checked, encoding="utf-8")
    cmd = [clang, f"-std={mslpp.cxx_std(text)}", "-fsyntax-only", "-DMSL_SIM_CHECK_AS", "-Wno-unknown-attributes",
           "-Wno-user-defined-literals", "-ferror-limit=50", f"-I{SHIM}", "-x", "c++", str(p)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode == 0, (r.stderr + r.stdout).strip()


def test_there_are_kernel_files():
    assert {"norm.metal", "quant.metal"} <= {p.name for p in KERNEL_FILES}


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_flattened_source_is_self_contained(path):
    flat = embed.flatten(path)
    assert flat.startswith(f'#line 1 "metal/{path.name}"\n')
    assert _quoted_includes(flat) == []
    assert not re.search(r"^\s*#\s*pragma\s+once", flat, re.M)
    for inc in _quoted_includes(path.read_text()):  # every header it includes is inlined with a marker
        name = re.search(r'"([^"]+)"', inc).group(1)
        assert f'#line 1 "metal/{name}"\n' in flat


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_flattened_source_preprocesses_like_the_original(path, tmp_path):
    """Same tokens as the preprocessor makes of the original with -I metal, as Apple's compiler sees it."""
    cxx = require_cxx()
    stub = _stub_dir(tmp_path)
    flat = tmp_path / path.name
    flat.write_text(embed.flatten(path))
    want = _preprocess(cxx, path, [stub, METAL])
    got = _preprocess(cxx, flat, [stub])  # no -I metal: nothing left to include from there
    assert got == want
    if "INSTANTIATE_KERNEL" in path.read_text():
        assert "host_name" in got  # INSTANTIATE_KERNEL took common.h's Metal form


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_flattened_source_passes_the_address_space_check(path, tmp_path):
    ok, diag = _check_flat(require_clang(), embed.flatten(path), f"metal/{path.name}", tmp_path)
    assert ok, diag


def _copy_metal(tmp_path: Path) -> Path:
    d = tmp_path / "metal"
    d.mkdir()
    for p in list(METAL.glob("*.metal")) + list(METAL.glob("*.h")):
        shutil.copy(p, d / p.name)
    return d


def test_compile_errors_name_the_original_file_and_line(tmp_path):
    """#line markers: an error planted in common.h and one in norm.metal after the includes."""
    clang = require_clang()
    d = _copy_metal(tmp_path)
    common = (d / "common.h").read_text().splitlines(keepends=True)
    at = next(i for i, ln in enumerate(common) if ln.startswith("enum : uint { SIMD_WIDTH"))
    common.insert(at + 1, "inline float planted_common() { return undeclared_in_common; }\n")
    (d / "common.h").write_text("".join(common))
    norm = (d / "norm.metal").read_text().splitlines(keepends=True)
    k = max(i for i, ln in enumerate(norm) if ln.startswith('#include "')) + 1
    norm.insert(k + 1, "inline float planted_norm() { return undeclared_in_norm; }\n")
    (d / "norm.metal").write_text("".join(norm))
    ok, diag = _check_flat(clang, embed.flatten(d / "norm.metal", d), "metal/norm.metal", tmp_path)
    assert not ok
    assert re.search(rf"metal/common\.h:{at + 2}:\d+: error: use of undeclared identifier 'undeclared_in_common'", diag), diag
    assert re.search(rf"metal/norm\.metal:{k + 2}:\d+: error: use of undeclared identifier 'undeclared_in_norm'", diag), diag


def test_include_rules(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "once.h").write_text("#pragma once\nint once_body;\n")
    (d / "twice.h").write_text("int twice_body;\n")
    (d / "a.metal").write_text('#include "once.h"\n#include "twice.h"\n#include "once.h"\n#include "twice.h"\n'
                               "#include <metal_stdlib>\nint tail;\n")
    flat = embed.flatten(d / "a.metal", d)
    assert flat.count("once_body") == 1 and flat.count("twice_body") == 2
    assert "#include <metal_stdlib>" in flat
    assert '#line 5 "metal/a.metal"\n#include <metal_stdlib>\nint tail;\n' in flat
    # a commented-out include stays a comment
    (d / "c.metal").write_text('// #include "missing.h"\n/*\n#include "missing.h"\n*/\nint c;\n')
    assert "missing" in embed.flatten(d / "c.metal", d)
    (d / "cond.metal").write_text('#ifdef X\n#include "once.h"\n#endif\n')
    with pytest.raises(embed.EmbedError, match=r"cond\.metal:2: a quoted #include inside #if"):
        embed.flatten(d / "cond.metal", d)
    (d / "miss.metal").write_text('#include "nope.h"\n')
    with pytest.raises(embed.EmbedError, match="nope.h"):
        embed.flatten(d / "miss.metal", d)
    (d / "x.h").write_text('#include "y.h"\n')
    (d / "y.h").write_text('#include "x.h"\n')
    (d / "cyc.metal").write_text('#include "x.h"\n')
    with pytest.raises(embed.EmbedError, match="include cycle"):
        embed.flatten(d / "cyc.metal", d)


def test_generated_cpp_compiles_and_holds_exactly_the_flattened_sources(tmp_path):
    cxx = require_cxx()
    fams = embed.families()
    # a family whose text contains the default delimiter's terminator: another delimiter is picked
    tricky = '#line 1 "metal/tricky.metal"\n// )QMSL" and )QMSL1" and R"( and \\ and ??=\nkernel void k();\n'
    fams.append(("tricky", "metal/tricky.metal", tricky, ["k"]))
    gen = tmp_path / "msl_sources.cpp"
    gen.write_text(embed.emit_cpp(fams))
    main = tmp_path / "main.cpp"
    main.write_text(r'''#include "metal/msl_sources.h"
#include <cstdio>
#include <cstring>
#include <string>
int main(int, char** argv) {
    for (size_t i = 0; i < qwenmetal::gpu::kMslSourceCount; ++i) {
        const qwenmetal::gpu::MslSource& s = qwenmetal::gpu::kMslSources[i];
        if (std::strlen(s.source) != s.length) return 3;
        size_t n = 0;
        while (s.kernels[n]) ++n;
        if (n != s.kernel_count) return 4;
        std::FILE* f = std::fopen((std::string(argv[1]) + "/" + s.family + ".out").c_str(), "wb");
        std::fwrite(s.source, 1, s.length, f);
        std::fprintf(f, "\n--kernels--\n%s\n%s\n", s.origin, s.language_version);
        for (size_t k = 0; k < n; ++k) std::fprintf(f, "%s\n", s.kernels[k]);
        std::fclose(f);
    }
    return 0;
}
''')
    exe = tmp_path / "dump"
    r = subprocess.run([cxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", f"-I{ROOT / 'src'}", str(gen), str(main),
                        "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([str(exe), str(out)], capture_output=True, text=True)
    assert r.returncode == 0
    for fam, origin, src, names in fams:
        text = (out / f"{fam}.out").read_bytes().decode("utf-8")
        assert text == (src + "\n--kernels--\n" + origin + "\n" + embed.language_version(fam) + "\n" +
                        "".join(n + "\n" for n in names))
    assert 'R"QMSL2(' in gen.read_text()


def test_language_version_table():
    """LANGUAGE_VERSION (the MSL version MetalDevice compiles a family with, and tools/msl_conform.py checks it
    against) names existing families only; the tensor-op family is 4.0, every other family the default 3.1."""
    families = {p.stem for p in KERNEL_FILES}
    assert set(embed.LANGUAGE_VERSION) <= families
    assert embed.DEFAULT_LANGUAGE_VERSION == "3.1"
    assert embed.language_version("gemm_tensor") == "4.0"
    assert all(embed.language_version(f) == "3.1" for f in families - {"gemm_tensor"})
    for fam, _, src, _ in embed.families():  # a family with Metal 4 tensor operations is pinned to 4.0 or later
        if re.search(r"^\s*#\s*include\s*<metal_tensor>", src, re.M):
            assert float(embed.language_version(fam)) >= 4.0, fam
    gen = embed.emit_cpp([("norm", "metal/norm.metal", "x", ["rmsnorm_f32"])])
    assert 'kernels_0, 1, "3.1"},' in gen


def test_a_malformed_language_version_is_rejected(monkeypatch):
    monkeypatch.setitem(embed.LANGUAGE_VERSION, "norm", "metal3.1")
    with pytest.raises(embed.EmbedError, match=r"LANGUAGE_VERSION\['norm'\] = 'metal3.1' is not a version"):
        embed.emit_cpp([("norm", "metal/norm.metal", "x", [])])


def test_main_writes_the_file_and_prints_a_family(tmp_path, capsys):
    out = tmp_path / "gen" / "msl_sources.cpp"
    assert embed.main(["-o", str(out)]) == 0
    assert out.read_text() == embed.emit_cpp(embed.families())
    assert embed.main(["--print", "norm"]) == 0
    assert capsys.readouterr().out == embed.flatten(METAL / "norm.metal")
    assert embed.main(["--print", "no_such_family"]) == 1


def test_kernel_table_matches_the_simulator_build():
    """The embedded table names exactly the kernels the simulator registers from the same files."""
    try:
        from qwenmetal import msl_sim as sim
        lib = sim.builtin_library()
    except ImportError as e:
        unavailable(f"qwenmetal._core is not built: {e}")
    table = sorted(n for _, _, _, names in embed.families() for n in names)
    assert len(table) == len(set(table)), "a kernel name is exported by two families"
    assert table == sorted(lib.kernels)

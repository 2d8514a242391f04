"""The Objective-C++ Metal device type check (tools/metal_device_check.py) and the planted errors it must catch.

src/metal/device.mm is compiled by clang as Objective-C++ under ARC against the stand-in declarations in
src/metal/decls/ (no Apple SDK here). The planted tests apply one mistake at a time to device.mm itself
(or compile small snippets over the decls) and require the check to reject it at the right line: a selector
with a missing part, a misspelled selector or property, a message to the wrong protocol, a wrong argument
type, a wrong block signature, an undeclared enumerator, and ARC violations (explicit release/retain/
autorelease/dealloc, object <-> C pointer casts without __bridge). The decls must declare nothing
device.mm does not use; on macOS their enum values are compared with the SDK's.

What this does not prove (run time, Apple's headers beyond the enum values, shader compilation) is in
docs/metal.md. clang >= 15 is needed: with CI=true a missing clang fails these tests, elsewhere
they are skipped.
"""
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from oracles import unavailable  # fails in CI, skips elsewhere

ROOT = Path(__file__).resolve().parent.parent
DEVICE = ROOT / "src" / "metal" / "device.mm"
DECLS = ROOT / "src" / "metal" / "decls"


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


check = _tool("metal_device_check")


def require_clang() -> str:
    """clang++ >= 15, or fail (CI=true) / skip (elsewhere)."""
    clang = check.find_clang()
    if clang is None:
        unavailable(f"no clang++ >= {check.MIN_CLANG} (apt-get install clang-19, or set MSL_CLANG)")
    return clang


def test_device_passes_the_check():
    ok, diag = check.check_device(require_clang())
    assert ok, diag


def test_bindings_pass_the_check():
    res = check.check_bindings(require_clang())
    if res is None:
        pytest.skip("nanobind's headers are not importable (a build-time dependency only)")
    ok, diag = res
    assert ok, diag


def test_tool_main(capsys):
    require_clang()
    assert check.main([]) == 0
    assert "ok   " in capsys.readouterr().out


# (id, text in device.mm, replacement, expected diagnostic): each must be rejected at the replaced line
MUTATIONS = [
    ("arity", "[enc_ setBuffer:bufs[i] offset:offs[i] atIndex:i];", "[enc_ setBuffer:bufs[i] offset:offs[i]];",
     r"no known instance method for selector 'setBuffer:offset:'"),
    ("extra-part", "[enc_ setBytes:a.bytes.data() length:a.bytes.size() atIndex:i];",
     "[enc_ setBytes:a.bytes.data() length:a.bytes.size() offset:0 atIndex:i];",
     r"no known instance method for selector 'setBytes:length:offset:atIndex:'"),
    ("misspelled", "[d.device newBufferWithBytesNoCopy:reinterpret_cast<void*>(base + x.start)",
     "[d.device newBufferWithBytesNoCpy:reinterpret_cast<void*>(base + x.start)",
     r"(no known instance method for selector|instance method) 'newBufferWithBytesNoCpy:length:options:deallocator:'"),
    ("property", "threads > pso.maxTotalThreadsPerThreadgroup)", "threads > pso.maxThreadsPerThreadgroup)",
     r"property 'maxThreadsPerThreadgroup' not found on object of type '(__strong )?id<MTLComputePipelineState>'"),
    ("wrong-protocol", "[cb_ commit];", "[enc_ commit];",
     r"(no known instance method for selector 'commit'|instance method '-commit' not found)"),
    ("arg-type", "dispatchThreadgroups:MTLSizeMake(g.x, g.y, g.z)", "dispatchThreadgroups:g",
     r"(cannot initialize a parameter of type 'MTLSize'|no viable conversion|incompatible type)"),
    ("out-param", "newLibraryWithSource:src options:options error:&error]", "newLibraryWithSource:src options:options error:error]",
     r"cannot initialize a parameter of type 'NSError \*[^']*\*"),
    ("enumerator", "computeCommandEncoderWithDispatchType:MTLDispatchTypeConcurrent]",
     "computeCommandEncoderWithDispatchType:MTLDispatchConcurrent]", r"use of undeclared identifier 'MTLDispatchConcurrent'"),
    ("block", "addCompletedHandler:^(id<MTLCommandBuffer> done) {",
     "addCompletedHandler:^(id<MTLCommandBuffer> done, int extra) {",
     r"cannot initialize a parameter of type 'MTLCommandBufferHandler"),
    ("arc-release", "[enc_ endEncoding];\n            enc_ = nil;\n            [cb_ addCompletedHandler",
     "[enc_ endEncoding];\n            [enc_ release]; enc_ = nil;\n            [cb_ addCompletedHandler",
     r"ARC forbids explicit message send of 'release'"),
    ("arc-bridge", ", {buf}, [buf contents], ", ", {buf}, (void*)buf, ",
     r"cast of Objective-C pointer type 'id<MTLBuffer>' to C pointer type 'void \*' requires a bridged cast"),
]


@pytest.mark.parametrize("tag,old,new,pattern", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_planted_error_in_device_is_caught(tag, old, new, pattern):
    clang = require_clang()
    src = DEVICE.read_text()
    assert src.count(old) == 1, f"{tag}: the text to mutate must occur once in device.mm: {old!r}"
    mutated = src.replace(old, new)
    start = src.index(old)
    first = src.count("\n", 0, start) + 1
    lines = range(first, first + new.count("\n") + 1)
    ok, diag = check.check_source(mutated, clang, name="device.mm")
    assert not ok, f"{tag}: the check accepted the planted error"
    hits = [ln for ln in lines if re.search(rf"device\.mm:{ln}:\d+: error: [^\n]*{pattern}", diag)]
    assert hits, (tag, diag)


# snippets over the decls alone (ARC rules and bridging, independent of device.mm's text)
SNIPPET_HEAD = "#import <Foundation/Foundation.h>\n#import <Metal/Metal.h>\n"
SNIPPETS_OK = [
    "void* f(id<MTLBuffer> b) { return (__bridge void*)b; }",
    "id<MTLBuffer> f(void* p) { return (__bridge id<MTLBuffer>)p; }",
    "void f(id<MTLDevice> d) { @autoreleasepool { id<MTLBuffer> b = [d newBufferWithLength:16 "
    "options:MTLResourceStorageModeShared]; (void)b.contents; } }",
]
SNIPPETS_BAD = [
    ("void* f(id<MTLBuffer> b) { return (void*)b; }", r"requires a bridged cast"),
    ("id<MTLBuffer> f(void* p) { return (id<MTLBuffer>)p; }", r"requires a bridged cast"),
    ("void f(id<MTLBuffer> b) { [b retain]; }", r"ARC forbids explicit message send of 'retain'"),
    ("void f(id<MTLBuffer> b) { [b autorelease]; }", r"ARC forbids explicit message send of 'autorelease'"),
    ("void f(id<MTLBuffer> b) { [b dealloc]; }", r"ARC forbids explicit message send of 'dealloc'"),
    ("unsigned long f(id<MTLBuffer> b) { return (unsigned long)[b retainCount]; }",
     r"ARC forbids explicit message send of 'retainCount'"),
    ("void f(id<MTLCommandBuffer> c) { [c addCompletedHandler:^(id<MTLCommandBuffer> x, int y) { (void)x; (void)y; }]; }",
     r"cannot initialize a parameter of type 'MTLCommandBufferHandler"),
]


@pytest.mark.parametrize("body", SNIPPETS_OK, ids=range(len(SNIPPETS_OK)))
def test_snippet_accepted(body):
    ok, diag = check.check_source(SNIPPET_HEAD + body + "\n", require_clang(), name="snippet.mm")
    assert ok, diag


@pytest.mark.parametrize("body,pattern", SNIPPETS_BAD, ids=range(len(SNIPPETS_BAD)))
def test_snippet_rejected(body, pattern):
    ok, diag = check.check_source(SNIPPET_HEAD + body + "\n", require_clang(), name="snippet.mm")
    assert not ok
    assert re.search(rf"snippet\.mm:3:\d+: error: [^\n]*{pattern}", diag), diag


# ------------------------------------------------------------------------------------------------
def _strip_parens(s: str) -> str:
    while True:
        t = re.sub(r"\([^()]*\)", " ", s)
        if t == s:
            return s
        s = t


def _declared(text: str):
    """(selectors, properties, enumerators) declared in a decls header."""
    text = re.sub(r"//[^\n]*", "", text)
    sels, props, enums = [], [], []
    for m in re.finditer(r"^\s*[-+]\s*(\([^;]*?);", text, re.M | re.S):
        body = _strip_parens(m.group(1))
        body = re.sub(r"\b(NS_RETURNS_INNER_POINTER|NS_RETURNS_RETAINED)\b", "", body)
        parts = re.findall(r"(\w+)\s*:", body)
        sels.append((parts, True) if parts else ([body.split()[0]], False))
    for m in re.finditer(r"@property\s*(?:\([^)]*\))?[^;]*?\b(\w+)\s*(?:NS_RETURNS_INNER_POINTER)?\s*;", text):
        props.append(m.group(1))
    for m in re.finditer(r"NS_(?:ENUM|OPTIONS)\(\s*\w+\s*,\s*\w+\s*\)\s*\{([^}]*)\}", text):
        enums += re.findall(r"(\w+)\s*=", m.group(1))
    return sels, props, enums


DECL_FILES = [DECLS / "Metal" / "Metal.h", DECLS / "Foundation" / "Foundation.h"]


def test_decls_declare_only_what_device_uses():
    """Every selector, property and enumerator of the stand-ins appears in device.mm (the compile proves
    the converse), so the decls cannot drift into an unchecked copy of Apple's API."""
    src = re.sub(r"//[^\n]*", "", DEVICE.read_text())
    unused = []
    for f in DECL_FILES:
        sels, props, enums = _declared(f.read_text())
        assert sels and (f.name == "Foundation.h" or enums)
        for parts, keyed in sels:
            if not keyed:
                name = parts[0]
                if name in ("alloc", "init"):  # [[X alloc] init]
                    ok = re.search(rf"\b{name}\]", src)
                else:
                    ok = re.search(rf"(\[[^\]]*\s{name}\]|\.{name}\b)", src)
            else:
                ok = all(re.search(rf"\b{p}:", src) for p in parts)
            if not ok:
                unused.append(f"{f.name}: selector {':'.join(parts)}")
        for p in props:
            if not re.search(rf"\.{p}\b|\s{p}\]", src):
                unused.append(f"{f.name}: property {p}")
        for e in enums:
            if not re.search(rf"\b{e}\b", src):
                unused.append(f"{f.name}: enumerator {e}")
    assert unused == []


def _enum_values():
    text = (DECLS / "Metal" / "Metal.h").read_text()
    out = []
    for m in re.finditer(r"NS_(?:ENUM|OPTIONS)\(\s*\w+\s*,\s*\w+\s*\)\s*\{([^}]*)\}", text):
        for name, val in re.findall(r"(\w+)\s*=\s*([^,\n]+),", m.group(1)):
            out.append((name, val.strip()))
    return out


def _enum_snippet() -> str:
    lines = ["#import <Metal/Metal.h>"]
    for name, val in _enum_values():
        lines.append(f"static_assert((long long){name} == (long long)({val}), \"{name}\");")
    return "\n".join(lines) + "\n"


def test_enum_values_are_parsed():
    vals = dict(_enum_values())
    assert vals["MTLGPUFamilyApple7"] == "1007" and vals["MTLCommandBufferStatusError"] == "5"
    ok, diag = check.check_source(_enum_snippet(), require_clang(), name="enums.mm")
    assert ok, diag


@pytest.mark.skipif(sys.platform != "darwin", reason="needs Apple's SDK (macOS)")
def test_decls_agree_with_the_sdk_on_macos(tmp_path):
    """On a Mac: the stand-in enum values equal the SDK's, and device.mm compiles against the real headers."""
    xcrun = shutil.which("xcrun")
    assert xcrun, "xcrun (Xcode or the Command Line Tools) is needed"
    p = tmp_path / "enums.mm"
    p.write_text(_enum_snippet())
    base = [xcrun, "clang++", "-fsyntax-only", "-x", "objective-c++", "-std=c++17", "-fobjc-arc"]
    r = subprocess.run(base + [str(p)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(base + ["-Wall", "-Werror", "-Wno-deprecated-declarations", f"-I{ROOT / 'src'}", str(DEVICE)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr

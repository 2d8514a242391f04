"""device.mm's messages against Apple's declarations as pyobjc's macOS wheels carry them (tools/metal_selectors.py).

tests/test_metal_device_check.py compiles device.mm against the project's own stand-ins (src/metal/decls/); a
mistake made in both places passes it. Here the oracle is Apple's: the protocol descriptions compiled into
pyobjc-framework-Metal's extension module and the signatures in its generated metadata (pinned pyobjc wheels,
downloaded once into $QWENMETAL_CACHE/pyobjc or ~/.cache/qwenmetal/pyobjc). Today's device.mm and stand-ins
must agree with it; planted mistakes, each applied to a copy of device.mm and of the stand-ins so that clang
alone accepts them, must be reported: a misspelled selector or property, a wrong argument type, a wrong return
type, a wrong object type, a wrong block signature, a wrong enumerator value.

The wheels are an oracle: with CI=true a failed download fails these tests, elsewhere they are skipped. So is
a missing clang++ >= 15.
"""
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from oracles import unavailable  # fails in CI, skips elsewhere

ROOT = Path(__file__).resolve().parent.parent
DEVICE = ROOT / "src" / "metal" / "device.mm"
DECLS = ROOT / "src" / "metal" / "decls"
METAL_H = "Metal/Metal.h"
FOUNDATION_H = "Foundation/Foundation.h"


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ms = _tool("metal_selectors")
device_check = _tool("metal_device_check")


@pytest.fixture(scope="module")
def clang():
    c = ms.find_clang()
    if c is None:
        unavailable("no clang++ >= 15 (apt-get install clang-19, or set MSL_CLANG)")
    return c


@pytest.fixture(scope="module")
def apple():
    try:
        return ms.Apple(ms.fetch_oracle())
    except ms.OracleUnavailable as e:
        unavailable(f"the pyobjc {ms.PYOBJC_VERSION} wheels (Apple's declarations): {e}")


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory, clang):
    """A copy of device.mm and of the stand-ins as they are when the module starts, and the messages clang sees
    in it (reused by the planted errors that change the stand-ins only)."""
    d = tmp_path_factory.mktemp("metal")
    shutil.copy(DEVICE, d / "device.mm")
    shutil.copytree(DECLS, d / "decls")
    sends, diag = ms.collect_sends(d / "device.mm", d / "decls", clang)
    return d, sends, diag, _clang_errors(clang, d / "device.mm", d / "decls")


# ------------------------------------------------------------------------------------------------
# the oracle itself: the parser must find what the wheels are known to hold
def test_the_wheels_describe_metal_protocols(apple):
    enc = apple.protocols["MTLComputeCommandEncoder"]
    assert "MTLCommandEncoder" in enc["adopts"]
    types, ext, required = enc["methods"][("setBuffer:offset:atIndex:", True)]
    ret, args = ms.parse_method(types)
    assert required and str(ret) == "v" and [str(a) for a in args] == ["@", "Q", "Q"]
    assert ms.parse_method(ext)[1][0].name == "<MTLBuffer>"
    assert ("dispatchThreadgroups:threadsPerThreadgroup:", True) in enc["methods"]
    assert ("maxTotalThreadsPerThreadgroup", True) in apple.protocols["MTLComputePipelineState"]["methods"]
    assert ("addAllocation:", True) in apple.protocols["MTLResidencySet"]["methods"]
    assert ("respondsToSelector:", True) in apple.protocols["NSObject"]["methods"]
    assert len(apple.protocols) > 50


def test_the_metadata_tables(apple):
    sig = apple.pool_lookup("newBufferWithBytesNoCopy:length:options:deallocator:")
    assert [str(a) for a in sig.args] == ["^v", "Q", "Q", "@?<v@?^vQ>"]
    assert str(apple.pool_lookup("supportsFamily:").ret) == "Z"
    assert str(apple.classes["MTLCompileOptions"]["setFastMathEnabled:"].args[0]) == "Z"
    assert str(apple.classes["NSString"]["UTF8String"].ret) == "^t"
    assert apple.enums["MTLGPUFamilyApple7"] == 1007 and apple.enums["MTLResourceHazardTrackingModeUntracked"] == 256
    assert apple.functions["MTLSizeMake"] == "{MTLSize=QQQ}QQQ"
    assert apple.structs["MTLSize"] == "{MTLSize=QQQ}"


@pytest.mark.parametrize("ours,theirs,ok", [
    ("Q", "Q", True), ("B", "Z", True), ("r*", "^t", True), ("r^v", "^v", True), ("{?=QQQ}", "{MTLSize=QQQ}", True),
    ('@"<MTLBuffer>"', "@", True), ('@"<MTLBuffer>"', '@"<MTLBuffer>"', True), ("Q", "q", False), ("f", "Q", False),
    ("d", "Q", False), ('@"<MTLBuffer>"', '@"<MTLTexture>"', False), ("{?=QQ}", "{MTLSize=QQQ}", False),
    ("@?<v@?@>", "@?<v@?@Q>", False), ("@?<v@?^vQ>", "@?<v@?^vQ>", True), ("^@", "^@", True), ("@", "@?", False),
])
def test_encoding_compatibility(ours, theirs, ok):
    assert (ms.compatible(ms.parse_type(ours), ms.parse_type(theirs)) is None) == ok


def test_method_encodings_parse():
    ret, args = ms.parse_method('v48@0:8@"<MTLBuffer>"16Q24Q32{?=QQ}40')
    assert str(ret) == "v" and [str(a) for a in args] == ['@"<MTLBuffer>"', "Q", "Q", "{?=QQ}"]
    ret, args = ms.parse_method('v24@0:8@?<v@?@"<MTLCommandBuffer>">16')
    assert args[0].kind == "block" and args[0].sig[1][0].name == "<MTLCommandBuffer>"
    with pytest.raises(ValueError, match="without self and _cmd"):
        ms.parse_method("v16")


# ------------------------------------------------------------------------------------------------
def test_device_agrees_with_apples_declarations(apple, clang, snapshot):
    d, sends, diag, _errors = snapshot
    rep = ms.check(d / "device.mm", d / "decls", apple, clang, sends=sends, diagnostics=diag)
    assert rep.ok, rep.format()
    # the walk saw the messages (property accesses included), and found the protocol ones in Apple's
    # declarations: the wheel's protocol descriptions or Metal's protocol-method table
    protocol_sends = {s.selector for s in sends if "protocols" in s.receiver}
    assert {"setBuffer:offset:atIndex:", "newBufferWithBytesNoCopy:length:options:deallocator:", "commit",
            "addCompletedHandler:", "maxTotalThreadsPerThreadgroup"} <= protocol_sends
    levels = {f.what.split(" ")[-1].rstrip("]"): f.level for f in rep.verified + rep.unverified}
    assert levels["setBuffer:offset:atIndex:"] == "exact" and levels["newCommandQueue"] == "pool"
    assert not [f for f in rep.unverified if f.level not in ("class", "pool")], rep.format()


def test_messages_outside_the_filtered_namespace_are_found(clang, snapshot, tmp_path):
    """The fast path dumps device.mm's namespace only; a message elsewhere makes clang's count of message
    expressions disagree, and the whole translation unit is read instead."""
    src = tmp_path / "x.mm"
    src.write_text("#import <Foundation/Foundation.h>\n#import <Metal/Metal.h>\n"
                   f"namespace {ms.AST_FILTER} {{ void f(id<MTLCommandBuffer> c) {{ [c commit]; }} }}\n"
                   "void g(id<MTLCommandBuffer> c) { [c waitUntilCompleted]; }\n")
    sends, _diag = ms.collect_sends(src, snapshot[0] / "decls", clang)
    assert sorted((s.selector, s.line, s.receiver["protocols"][0]) for s in sends) == [
        ("commit", 3, "MTLCommandBuffer"), ("waitUntilCompleted", 4, "MTLCommandBuffer")]


def test_tool_main(apple, clang, capsys):
    assert ms.main([]) == 0
    assert "0 errors" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# planted mistakes
def _copy(snapshot, tmp_path):
    d = snapshot[0]
    shutil.copy(d / "device.mm", tmp_path / "device.mm")
    shutil.copytree(d / "decls", tmp_path / "decls")
    return tmp_path / "device.mm", tmp_path / "decls"


def _sub(path: Path, pattern: str, repl: str, count: int | None = 1):
    text = path.read_text()
    new, n = re.subn(pattern, repl, text)
    if count is None:
        assert n >= 1, f"{path.name}: {pattern!r} does not occur"
    else:
        assert n == count, f"{path.name}: {pattern!r} occurs {n} times, the planted error needs {count}"
    path.write_text(new)


def _clang_errors(clang, device: Path, decls: Path) -> set:
    """tools/metal_device_check.py's errors for a copy of device.mm and of the stand-ins (file names without
    their directories)."""
    flags = [f"-I{decls}" if f == f"-I{device_check.DECLS}" else f for f in device_check.OBJC_FLAGS]
    r = subprocess.run([clang, *flags, str(device)], capture_output=True, text=True)
    return {re.sub(r"^\S*/", "", ln) for ln in r.stderr.splitlines() if ": error:" in ln}


# (id, selector or property in device.mm and the stand-ins, its misspelling, expected report)
MISSPELLED = [
    ("exact-protocol", "setComputePipelineState", "setComputePipelineStat",
     r"Apple declares no instance method 'setComputePipelineStat:' in protocol MTLComputeCommandEncoder"),
    ("protocol-table", "newCommandQueue", "newCommandQeue",
     r"Apple declares no instance method 'newCommandQeue' in protocol MTLDevice"),
    ("property", "maxTotalThreadsPerThreadgroup", "maxTotalThreadPerThreadgroup",
     r"Apple declares no instance method 'maxTotalThreadPerThreadgroup' in protocol MTLComputePipelineState"),
]


@pytest.mark.parametrize("tag,old,new,pattern", MISSPELLED, ids=[m[0] for m in MISSPELLED])
def test_misspelled_selector_in_device_and_decls(tag, old, new, pattern, apple, clang, snapshot, tmp_path):
    device, decls = _copy(snapshot, tmp_path)
    before = snapshot[3]
    _sub(device, rf"\b{old}\b", new, None)
    _sub(decls / METAL_H, rf"\b{old}\b", new, None)
    # consistent in both: clang's check against the stand-ins sees nothing new
    after = _clang_errors(clang, device, decls)
    assert after == before, f"{tag}: the clang check itself rejects the mutation: {after - before}"
    rep = ms.check(device, decls, apple, clang)
    assert not rep.ok
    assert any(re.search(pattern, f.message) for f in rep.errors), rep.format()


# (id, stand-in header, pattern, replacement, expected report): the stand-ins change, device.mm's messages stay
DECL_MUTATIONS = [
    ("arg-type-exact", METAL_H, r"(\)\s*setThreadgroupMemoryLength:\s*\()NSUInteger(\))", r"\1float\2",
     r"setThreadgroupMemoryLength:atIndex:\]: argument 1 \(setThreadgroupMemoryLength:\): our 'float' encodes as f, "
     r"Apple's is Q"),
    ("arg-type-table", METAL_H, r"(newBufferWithLength:\s*\()NSUInteger(\))", r"\1float\2",
     r"newBufferWithLength:options:\]: argument 1 \(newBufferWithLength:\): our 'float' encodes as f, Apple's is Q"),
    ("arg-enum-type", METAL_H, r"(memoryBarrierWithScope:\s*\()MTLBarrierScope(\))", r"\1NSInteger\2",
     r"memoryBarrierWithScope:\]: argument 1 \(memoryBarrierWithScope:\): our 'NSInteger' encodes as q, "
     r"Apple's is Q"),
    ("return-type-exact", METAL_H, r"(\)\s*)NSUInteger(\s+threadExecutionWidth\s*;)", r"\1float\2",
     r"threadExecutionWidth\]: return type: our 'float' encodes as f, Apple's is Q"),
    ("return-type-table", METAL_H, r"(\)\s*)NSUInteger(\s+maxBufferLength\s*;)", r"\1double\2",
     r"maxBufferLength\]: return type: our 'double' encodes as d, Apple's is Q"),
    ("return-type-class", FOUNDATION_H, r"const char \*(\s*UTF8String)", r"const unsigned short *\1",
     r"UTF8String\]: return type: our 'const unsigned short \*' encodes as \^S, Apple's is \^t"),
    ("object-type", METAL_H, r"(setComputePipelineState:\s*\()id<MTLComputePipelineState>(\))", r"\1id<MTLFunction>\2",
     r"setComputePipelineState:\]: argument 1 .*object <MTLFunction> is not <MTLComputePipelineState>"),
    ("block-signature", METAL_H, r"(\(\^MTLCommandBufferHandler\)\(id<MTLCommandBuffer>)\)", r"\1, NSUInteger)",
     r"addCompletedHandler:\]: argument 1 .*block of 2 arguments, Apple's takes 1"),
    ("deallocator-block", METAL_H, r"(\(void \*pointer, )NSUInteger( length\))", r"\1float\2",
     r"newBufferWithBytesNoCopy:length:options:deallocator:\]: argument 4 .*block argument 2: f is not Q"),
    ("enum-value", METAL_H, r"(MTLGPUFamilyApple7\s*=\s*)1007", r"\g<1>1070",
     r"ours is 1070, Apple's is 1007"),
    ("struct", METAL_H, r"NSUInteger width, height, depth;", "NSUInteger width, height; unsigned depth;",
     r"ours encodes as \{\?=QQI\}, Apple's is \{MTLSize=QQQ\}"),
]


@pytest.mark.parametrize("tag,header,pattern,repl,expected", DECL_MUTATIONS, ids=[m[0] for m in DECL_MUTATIONS])
def test_planted_error_in_decls(tag, header, pattern, repl, expected, apple, clang, snapshot, tmp_path):
    _device, decls = _copy(snapshot, tmp_path)
    _sub(decls / header, pattern, repl)
    rep = ms.check(snapshot[0] / "device.mm", decls, apple, clang, sends=snapshot[1])
    assert not rep.ok, f"{tag}: accepted"
    assert any(re.search(expected, f"{f.what}: {f.message}") for f in rep.errors), rep.format()


def test_wrong_argument_type_in_decl_and_call(apple, clang, snapshot, tmp_path):
    """NSUInteger -> float in the declaration and at the call, so that the call converts explicitly."""
    device, decls = _copy(snapshot, tmp_path)
    _sub(decls / METAL_H, r"(\)\s*setThreadgroupMemoryLength:\s*\()NSUInteger(\))", r"\1float\2")
    before = snapshot[3]
    _sub(device, r"setThreadgroupMemoryLength:(\S+)(\s+atIndex:)", r"setThreadgroupMemoryLength:float(\1)\2")
    assert _clang_errors(clang, device, decls) == before
    rep = ms.check(device, decls, apple, clang)
    assert any("our 'float' encodes as f, Apple's is Q" in f.message and "setThreadgroupMemoryLength:" in f.what
               for f in rep.errors), rep.format()


def test_misspelled_class_method_is_reported_unverified(apple, clang, snapshot, tmp_path):
    """What the wheels cannot show: pyobjc reads class methods from the runtime, so a class selector missing
    from its metadata is reported as unverified, not as an error."""
    device, decls = _copy(snapshot, tmp_path)
    _sub(device, r"\bstringWithUTF8String\b", "stringWithUTF8Strin", None)
    _sub(decls / FOUNDATION_H, r"\bstringWithUTF8String\b", "stringWithUTF8Strin")
    rep = ms.check(device, decls, apple, clang)
    assert rep.ok, rep.format()
    assert any(f.what == "+[NSString stringWithUTF8Strin:]" for f in rep.unverified), rep.format()

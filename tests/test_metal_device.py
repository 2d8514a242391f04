"""MetalDevice (src/metal/device.mm) on a real Mac: macOS only, skipped elsewhere.

What runs depends on the GPU:
  * every Mac, including the paravirtual GPU of GitHub's macos-14 runners: device info, the compile gate
    (Apple's Metal compiler on every embedded kernel family), buffers (zero-filled allocation, wrapping
    host memory without a copy at an unaligned address), command buffers with a small test kernel that
    uses no SIMD-group functions (setBytes, buffer offsets, threadgroup memory, a barrier between
    dependent dispatches, completion handlers, counters) and the error paths;
  * Apple7+ GPUs only (M1 and later, simd_reductions): a pipeline for every kernel, and real kernels
    through their host functions against numpy.

With CI=true on macOS a build without gpu.MetalDevice fails these tests.
"""
import importlib.util
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

if sys.platform != "darwin":
    pytest.skip("MetalDevice exists on macOS only", allow_module_level=True)

from qwenmetal import _core  # noqa: E402

gpu = _core.gpu
if not hasattr(gpu, "MetalDevice"):
    if os.environ.get("CI") == "true":
        raise RuntimeError("this macOS build of qwenmetal._core has no gpu.MetalDevice")
    pytest.skip("this build has no gpu.MetalDevice", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent


def _embed():
    spec = importlib.util.spec_from_file_location("embed_msl", ROOT / "tools" / "embed_msl.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TEST_MSL = r"""
#include <metal_stdlib>
using namespace metal;
struct ScaleParams { uint n; float scale; };
// y[i] = x[i] * scale
kernel void qm_test_scale(constant ScaleParams& p [[buffer(0)]], device const float* x [[buffer(1)]],
                          device float* y [[buffer(2)]], uint i [[thread_position_in_grid]]) {
    if (i < p.n) y[i] = x[i] * p.scale;
}
// each threadgroup reverses its slice of x through threadgroup memory
kernel void qm_test_reverse(constant ScaleParams& p [[buffer(0)]], device const float* x [[buffer(1)]],
                            device float* y [[buffer(2)]], threadgroup float* tmp [[threadgroup(0)]],
                            uint tid [[thread_index_in_threadgroup]], uint g [[threadgroup_position_in_grid]],
                            uint nt [[threads_per_threadgroup]]) {
    const uint i = g * nt + tid;
    tmp[tid] = i < p.n ? x[i] : 0.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (i < p.n) y[i] = tmp[nt - 1 - tid];
}
"""


@pytest.fixture(scope="module")
def dev():
    d = gpu.MetalDevice()
    d.add_source("qm_test", TEST_MSL)
    return d


def _f32(buf, n=None):
    a = np.frombuffer(buf.to_bytes(), np.float32)
    return a if n is None else a[:n]


def test_info(dev):
    i = dev.info
    print(i)
    assert i["name"] and i["family"] and i["executes"]
    assert i["max_buffer_length"] >= 1 << 28
    assert i["max_threads_per_threadgroup"] >= 256 and i["max_threadgroup_memory"] >= 16384
    if "Paravirtual" in i["name"]:
        assert not i["simd_reductions"] and not i["simdgroup_matrix"]
    if i["family"] in ("apple7", "apple8", "apple9") and "Paravirtual" not in i["name"]:
        assert i["simd_reductions"] and i["simdgroup_matrix"]


def test_embedded_sources_are_this_tree(dev):
    embed = _embed()
    fams = embed.families()
    assert sorted(gpu.MetalDevice.embedded_families()) == sorted(f for f, *_ in fams)
    for fam, _, src, _ in fams:
        assert gpu.MetalDevice.embedded_source(fam) == src, f"{fam}: rebuild the package"


def test_compile_gate(dev):
    """Apple's Metal compiler accepts every embedded family, and each exports what the table lists."""
    table = {f: names for f, _, _, names in _embed().families()}
    reports = dev.compile_all()
    bad = [f"{r['origin']}:\n{r['log']}" for r in reports if not r["ok"]]
    assert not bad, "\n\n".join(bad)
    for r in reports:
        assert sorted(r["kernels"]) == sorted(table[r["family"]]), r["family"]
        if r["log"]:
            print(f"{r['origin']} warnings:\n{r['log']}")


def test_every_pipeline(dev):
    if not dev.info["simd_reductions"]:
        pytest.skip(f"{dev.info['name']}: no SIMD-group reductions, the kernels cannot run here")
    for k in dev.kernel_names():
        dev.prepare(k)


def test_errors(dev):
    with pytest.raises(gpu.DeviceError, match="no Metal kernel named 'no_such_kernel'"):
        dev.prepare("no_such_kernel")
    assert not dev.has_kernel("no_such_kernel")
    assert dev.has_kernel("qm_test_scale")
    with pytest.raises(gpu.DeviceError, match=r"(?s)the Metal compiler failed:.*error"):
        dev.add_source("broken", "kernel void k(device float* y [[buffer(0)]]) { y[0] = undeclared; }")
    cb = dev.command_buffer()
    x = dev.alloc(64)
    with pytest.raises(gpu.DeviceError, match="threads per threadgroup"):
        dev.dispatch(cb, "qm_test_scale", [1], [4096], [struct.pack("If", 16, 1.0), x, x])
    cb.commit()
    cb.wait()
    with pytest.raises(gpu.DeviceError, match="dispatch after commit"):
        dev.dispatch(cb, "qm_test_scale", [1], [16], [struct.pack("If", 16, 1.0), x, x])


def test_alloc_is_zero_filled_and_host_visible(dev):
    b = dev.alloc(1 << 20, "zeros")
    assert b.nbytes == 1 << 20 and b.offset == 0 and b.label == "zeros"
    assert b.to_bytes() == bytes(1 << 20)
    b.write(b"\x01\x02\x03", 10)
    assert b.to_bytes()[8:14] == b"\x00\x00\x01\x02\x03\x00"


def test_wrap_uses_host_memory_in_place(dev):
    page = os.sysconf("SC_PAGESIZE")
    big = np.zeros(3 * page // 4, np.float32)
    a = big[3:1003]  # an unaligned, C-contiguous view
    buf, copied = dev.wrap_checked(a, "view")
    assert not copied
    assert buf.nbytes == a.nbytes and buf.address == a.ctypes.data
    assert buf.offset == a.ctypes.data % page
    buf.write(struct.pack("f", 2.5), 4)
    assert a[1] == 2.5


def test_command_buffer_runs_a_kernel_on_wrapped_memory(dev):
    n = 1000
    x = np.arange(n, dtype=np.float32)
    y = np.zeros(n, np.float32)
    z = np.zeros(n, np.float32)
    bx, cx = dev.wrap_checked(x)
    by, cy = dev.wrap_checked(y)
    bz, cz = dev.wrap_checked(z)
    assert not (cx or cy or cz)
    dev.reset_counters()
    cb = dev.command_buffer()
    p = struct.pack("If", n, 3.0)
    dev.dispatch(cb, "qm_test_scale", [(n + 63) // 64], [64], [p, bx, by])
    cb.barrier()  # the second dispatch reads what the first wrote
    dev.dispatch(cb, "qm_test_scale", [(n + 63) // 64], [64], [struct.pack("If", n, 0.5), by, bz])
    assert not cb.completed
    cb.commit()
    cb.wait()
    assert cb.completed
    np.testing.assert_array_equal(y, x * 3.0)
    np.testing.assert_array_equal(z, x * 1.5)
    c = dev.counters()
    assert (c["command_buffers"], c["dispatches"], c["barriers"], c["host_waits"]) == (1, 2, 1, 1)


def test_offsets_and_threadgroup_memory(dev):
    n, tg = 256, 64
    src = dev.alloc(4 * (n + 16))
    dst = dev.alloc(4 * (n + 16))
    vals = np.arange(n, dtype=np.float32) + 1
    src.write(vals.tobytes(), 4 * 16)
    cb = dev.command_buffer()
    dev.dispatch(cb, "qm_test_reverse", [n // tg], [tg], [struct.pack("If", n, 0.0), src.view(64), dst.view(64)],
                 tg_memory=[4 * tg])
    cb.commit()
    cb.wait()
    got = _f32(dst)[16:16 + n]
    np.testing.assert_array_equal(got, vals.reshape(-1, tg)[:, ::-1].reshape(-1))
    assert _f32(dst)[:16].tolist() == [0.0] * 16


def test_two_command_buffers_in_flight(dev):
    n = 4096
    a = dev.alloc(4 * n)
    a.write(np.ones(n, np.float32).tobytes())
    b = dev.alloc(4 * n)
    c = dev.alloc(4 * n)
    cb1, cb2 = dev.command_buffer(), dev.command_buffer()
    dev.dispatch(cb1, "qm_test_scale", [n // 256], [256], [struct.pack("If", n, 2.0), a, b])
    dev.dispatch(cb2, "qm_test_scale", [n // 256], [256], [struct.pack("If", n, 5.0), b, c])
    cb1.commit()
    cb2.commit()  # same queue: runs after cb1; b is tracked by Metal across command buffers
    cb2.wait()
    cb1.wait()
    assert set(_f32(c).tolist()) == {10.0}


def test_rmsnorm_through_its_host_function(dev):
    if not dev.info["simd_reductions"]:
        pytest.skip(f"{dev.info['name']}: no SIMD-group reductions")
    rows, H, eps = 3, 2048, 1e-6
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, H)).astype(np.float32)
    w = rng.standard_normal(H).astype(np.float32)
    y = np.zeros_like(x)
    cb = dev.command_buffer()
    enc = gpu.Encoder(dev, cb)
    gpu.ops.rmsnorm(enc, "f32", dev.wrap(x), dev.wrap(w), dev.wrap(y), rows, H, eps)
    cb.commit()
    cb.wait()
    xd = x.astype(np.float64)
    ref = xd / np.sqrt((xd * xd).mean(axis=1, keepdims=True) + eps) * w
    assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-5

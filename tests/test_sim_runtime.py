"""The Metal-on-CPU simulator's model of MSL (qwenmetal.msl_sim, src/msl_sim): SIMD-group functions, vectors,
half/bfloat, atomics, simdgroup matrices, builtins, threadgroup memory, schedules, the runtime compiler path,
command buffers and their counters. Kernels: tests/msl/sim_features.metal.
"""
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from qwenmetal import msl_sim as sim

HERE = Path(__file__).resolve().parent
FEATURES = HERE / "msl" / "sim_features.metal"
SCHEDULES = [("forward", 0), ("reverse", 0), ("random", 7)]


@pytest.fixture(scope="module")
def lib():
    return sim.compile(FEATURES)


def test_info_and_builtin_library():
    info = sim.info()
    assert info["simd_width"] == 32 and info["max_threads_per_threadgroup"] == 1024
    assert info["max_threadgroup_memory"] == 32768
    builtin = sim.builtin_library()
    for name in ("qmv_q4_sbf16_f32", "qmv_q8_sbf16_bf16", "qmv_q4_sbf16_bf16_f32out", "qmv_bf16_bf16", "embed_q4_sbf16_bf16",
                 "moe_topk_f32", "moe_gate_up_q4_sbf16_bf16", "moe_down_q4_sbf16_bf16", "rmsnorm_bf16", "add_rmsnorm_f32"):
        assert name in builtin.kernels
    k = builtin.kernel_info("qmv_q4_sbf16_f32")
    assert k["file"] == "metal/quant.metal" and k["line"] > 0 and k["checked"]


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
def test_simd_ops(lib, schedule, seed):
    x = np.random.default_rng(1).standard_normal(32).astype(np.float32)
    out = np.zeros(20 * 32, np.float32)
    c = lib.dispatch("simd_ops", 1, 32, [x, out], schedule=schedule, seed=seed)
    r = out.reshape(20, 32)
    lanes = np.arange(32)
    np.testing.assert_allclose(r[0], x.sum(), rtol=1e-6)
    np.testing.assert_array_equal(r[1], x.max())
    np.testing.assert_array_equal(r[2], x.min())
    np.testing.assert_allclose(r[3], np.cumsum(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r[4], np.concatenate([[0], np.cumsum(x)[:-1]]), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(r[5], x[31 - lanes])
    np.testing.assert_array_equal(r[6], x[lanes ^ 5])
    np.testing.assert_array_equal(r[7], np.where(lanes >= 3, x[np.maximum(lanes - 3, 0)], x))  # up: edges keep own
    np.testing.assert_array_equal(r[8], np.where(lanes + 3 < 32, x[np.minimum(lanes + 3, 31)], x))
    np.testing.assert_array_equal(r[9], x[7])
    np.testing.assert_array_equal(r[10], x[0])
    np.testing.assert_array_equal(r[11], np.float32(sum(1 << i for i in range(32) if i % 3 == 0)))
    np.testing.assert_array_equal(r[12], 1.0)
    np.testing.assert_array_equal(r[13], 1.0)
    np.testing.assert_allclose(r[14], 1.5 ** 16, rtol=1e-6)
    np.testing.assert_array_equal(r[15], x[(lanes - 1) % 32])
    np.testing.assert_array_equal(r[16], x[(lanes + 2) % 32])
    np.testing.assert_array_equal(r[17], float(lanes.sum()))
    np.testing.assert_array_equal(r[18], 255.0)
    np.testing.assert_array_equal(r[19], (lanes == 0).astype(np.float32))
    assert c["simd_ops"] == 22 and c["barriers"] == 0  # 20 calls, simd_all counts 2, simdgroup_barrier 1


@pytest.mark.parametrize("threads", [64, 48, 32, 1])
def test_partial_simdgroups(lib, threads):
    x = np.arange(threads, dtype=np.float32)
    out = np.zeros(threads, np.float32)
    lib.dispatch("simd_partial", 1, threads, [x, out], schedule="random", seed=threads)
    nsg = (threads + 31) // 32
    for i in range(threads):
        sg = i // 32
        expect = x[sg * 32:(sg + 1) * 32].sum() + 1000 * sg + 100000 * nsg
        assert out[i] == expect


def test_vectors_and_swizzles(lib):
    x = np.array([1, 2, 3, 4], np.float32)
    x4 = np.array([[0, 0, 0, 0], [3, 4, 7, 8]], np.float32)
    out = np.zeros(32, np.float32)
    lib.dispatch("vectors", 1, 32, [x, out, x4])
    w = [4, 3, 2, 1]
    a = [4, 6]
    b = [4, 6, 5]
    c = [5, 6, 4, 6]
    v = [3, 4, 3, 4]
    d = [2 * v[i] - w[i] for i in range(4)]
    f = x4[1]
    expect = w + a + b + c + v + [d[0], d[3], d[1] + 1, 3, 4, float(f @ f), float(np.hypot(3, 4)), 3 + 8, 6, 4,
                                  2, 1, 1, 16, 12]
    np.testing.assert_allclose(out, expect, rtol=1e-6)


def test_half_and_bfloat_rounding(lib):
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(250).astype(np.float32) * 100,
                        np.array([0, -0.0, 65504, 1e-8, 3.0e38, np.inf], np.float32)]).astype(np.float32)
    n = x.size
    yb = np.zeros(n, ml_dtypes.bfloat16)
    yh = np.zeros(n, np.float16)
    back = np.zeros(n, np.float32)
    assert n % 64 == 0
    lib.dispatch("round16", n // 64, 64, [x, yb, yh, back])
    np.testing.assert_array_equal(yb.view(np.uint16), x.astype(ml_dtypes.bfloat16).view(np.uint16))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(yh.view(np.uint16), x.astype(np.float16).view(np.uint16))


def test_atomics(lib):
    n = 256
    counters = np.zeros(2, np.uint32)
    fsum = np.zeros(1, np.float32)
    x = np.full(n, 0.5, np.float32)
    lib.dispatch("atomics_device", n // 64, 64, [counters, fsum, x], workers=2)
    assert counters[0] == n and counters[1] == n - 1 and fsum[0] == n * 0.5
    out = np.zeros(3, np.uint32)
    for sched, seed in SCHEDULES:
        lib.dispatch("atomics_tg", 3, 100, [out], schedule=sched, seed=seed)
        np.testing.assert_array_equal(out, 50)


@pytest.mark.parametrize("dt,name", [(np.float32, "f32"), (np.float16, "f16"), (ml_dtypes.bfloat16, "bf16")])
def test_simdgroup_matrix_gemm(lib, dt, name):
    rng = np.random.default_rng(3)
    M, N, K = 16, 24, 32
    A = rng.standard_normal((M, K)).astype(dt)
    B = rng.standard_normal((K, N)).astype(dt)
    C = np.zeros((M, N), np.float32)
    lib.dispatch(f"sg_gemm_{name}", (N // 8, M // 8), 32, [A, B, C], sim.pack("III", M, N, K), schedule="random")
    ref = A.astype(np.float64) @ B.astype(np.float64)
    np.testing.assert_allclose(C, ref, rtol=1e-5, atol=1e-5)


def test_builtins_3d(lib):
    groups, tpg = (3, 2, 2), (4, 2, 3)
    gx, gy, gz = (groups[i] * tpg[i] for i in range(3))
    out = np.zeros(gx * gy * gz * 8, np.uint32)
    lib.dispatch("builtins", groups, tpg, [out], schedule="reverse")
    o = out.reshape(gz, gy, gx, 8)
    z, y, xx = np.meshgrid(np.arange(gz), np.arange(gy), np.arange(gx), indexing="ij")
    np.testing.assert_array_equal(o[..., 0], xx)
    np.testing.assert_array_equal(o[..., 1], y)
    np.testing.assert_array_equal(o[..., 2], z)
    lx, ly, lz = xx % tpg[0], y % tpg[1], z % tpg[2]
    np.testing.assert_array_equal(o[..., 3], lx + 100 * ly + 10000 * lz)
    np.testing.assert_array_equal(o[..., 4], xx // tpg[0] + 100 * (y // tpg[1]) + 10000 * (z // tpg[2]))
    np.testing.assert_array_equal(o[..., 5], 4 + 100 * 2 + 10000 * 3)
    np.testing.assert_array_equal(o[..., 6], 3 + 100 * 2 + 10000 * 2)
    np.testing.assert_array_equal(o[..., 7], lx + tpg[0] * (ly + tpg[1] * lz))


def test_dynamic_threadgroup_memory_and_tree_reduction(lib):
    x = np.arange(128, dtype=np.float32)
    y = np.zeros(128, np.float32)
    c = lib.dispatch("tg_dynamic", 2, 64, [x, y], threadgroup_memory=[64 * 4], schedule="random", seed=5)
    np.testing.assert_array_equal(y, np.concatenate([x[:64][::-1], x[64:][::-1]]))
    assert c["threadgroup_memory"] == 256
    with pytest.raises(sim.MetalSimError, match=r"threadgroup\(0\)"):
        lib.dispatch("tg_dynamic", 2, 64, [x, y])
    x = np.random.default_rng(4).standard_normal(256 * 5).astype(np.float32)
    y = np.zeros(5, np.float32)
    for sched, seed in SCHEDULES:
        c = lib.dispatch("tree_sum", 5, 256, [x, y], schedule=sched, seed=seed)
        np.testing.assert_allclose(y, x.reshape(5, 256).sum(1), rtol=1e-5, atol=1e-5)
    assert c["barriers"] == 5 * 9 and c["threadgroup_memory"] == 1024


def test_fiber_switches_agree(lib, monkeypatch):
    """The ucontext fallback (used on non-x86-64 hosts) gives the same results as the assembly switch."""
    import subprocess
    import sys
    code = ("import numpy as np; from qwenmetal import msl_sim as sim; lib = sim.compile(%r); "
            "x = np.arange(1280, dtype=np.float32); y = np.zeros(5, np.float32); "
            "lib.dispatch('tree_sum', 5, 256, [x, y], schedule='random', seed=2); "
            "print(sim.info()['fiber_switch'], y.tolist())" % str(FEATURES))
    outs = []
    for mode in ("", "ucontext"):
        env = dict(__import__("os").environ, QWENMETAL_SIM_FIBERS=mode)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout.split(" ", 1 if "assembly" not in r.stdout else 2))
    assert "ucontext" in outs[1][0]
    assert outs[0][-1] == outs[1][-1]


def test_compile_errors_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QWENMETAL_CACHE", str(tmp_path / "cache"))
    src = ("#include <metal_stdlib>\nusing namespace metal;\n"
           "kernel void k(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {\n"
           "    y[i] = undefined_name;\n}\n")
    with pytest.raises(sim.MetalSimCompileError, match=r"kernel\.metal:4"):
        sim.compile(src, name="kernel.metal")
    ok = src.replace("undefined_name", "float(i) * 2.0f")
    lib = sim.compile(ok)
    y = np.zeros(8, np.float32)
    lib.dispatch("k", 1, 8, [y])
    np.testing.assert_array_equal(y, np.arange(8) * 2)
    assert list((tmp_path / "cache" / "msl").iterdir())
    # a header change invalidates the cached plugin
    (tmp_path / "h.h").write_text("constexpr constant float kScale = 2.0f;\n")
    f = tmp_path / "inc.metal"
    f.write_text('#include <metal_stdlib>\nusing namespace metal;\n#include "h.h"\n'
                 "kernel void k(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {\n"
                 "    y[i] = kScale;\n}\n")
    sim.compile(f).dispatch("k", 1, 8, [y])
    assert (y == 2).all()
    (tmp_path / "h.h").write_text("constexpr constant float kScale = 3.0f;\n")
    sim.compile(f).dispatch("k", 1, 8, [y])
    assert (y == 3).all()


def test_no_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(sim.MetalSimError, match="'no-such-compiler-xyz' \\(from \\$CXX\\) was not found"):
        sim.compile("kernel void k() {}\n")
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(sim.MetalSimError, match="needs a C\\+\\+17 compiler"):
        sim.compile("kernel void k() {}\n")


def test_dispatch_validation(lib):
    y = np.zeros(64, np.float32)
    with pytest.raises(sim.MetalSimError, match="over Metal's limit of 1024"):
        lib.dispatch("add_one", 1, (32, 33), [y, y])
    with pytest.raises(sim.MetalSimError, match="no kernel named 'nope'"):
        lib.dispatch("nope", 1, 32, [y])
    with pytest.raises(ValueError, match="C-contiguous"):
        lib.dispatch("add_one", 1, 32, [y[::2], y])
    with pytest.raises(ValueError, match="schedule"):
        lib.dispatch("add_one", 1, 32, [y, y], schedule="sideways")


def test_threadgroup_bounds_and_params_size(lib):
    y = np.zeros(64, np.float32)
    lib.dispatch("tg_adjacent", 1, 32, [y])       # a pointer to the second of two adjacent arrays
    np.testing.assert_array_equal(y[:32], 1 + np.arange(32)[::-1])
    with pytest.raises(sim.MetalSimError, match=r"sim_features\.metal:\d+: kernel 'tg_oob'.*thread 56: threadgroup "
                                                r"array index 64 out of bounds \[0, 64\)"):
        lib.dispatch("tg_oob", 1, 64, [y])
    A = np.zeros((8, 8), np.float32)
    with pytest.raises(sim.MetalSimError, match=r"buffer\(3\) has 8 bytes; the kernel binds it to a 12-byte object"):
        lib.dispatch("sg_gemm_f32", 1, 32, [A, A, A], sim.pack("II", 8, 8))


def test_command_buffer_counters_levels_and_hazards(lib):
    x = np.arange(64, dtype=np.float32)
    y = np.zeros(64, np.float32)
    z = np.zeros(64, np.float32)
    cb = sim.CommandBuffer()
    cb.dispatch(lib, "add_one", 2, 32, [x, y], reads={0: True}, writes={1: True})
    cb.barrier()
    cb.barrier()  # consecutive barriers collapse
    cb.dispatch(lib, "add_one", 2, 32, [y, z], reads={0: True}, writes={1: True})
    np.testing.assert_array_equal(z, x + 2)
    c = cb.counters()
    assert c["num_dispatches"] == 2 and c["levels"] == 2 and c["barriers"] == 1
    assert [d["level"] for d in c["dispatches"]] == [0, 1]
    assert c["bytes_read"] == 512 and c["bytes_written"] == 512
    assert c["by_kernel"]["add_one"]["dispatches"] == 2
    d = c["dispatches"][0]
    assert d["threadgroups"] == (2, 1, 1) and d["threads_per_threadgroup"] == (32, 1, 1) and d["threads"] == 64
    assert d["buffers"][0] == {"index": 0, "nbytes": 256, "read": 256, "written": 0, "params": False}
    # reading y in the same level as the dispatch writing it: a missing barrier
    cb2 = sim.CommandBuffer()
    cb2.dispatch(lib, "add_one", 2, 32, [x, y], reads={0: True}, writes={1: True})
    with pytest.raises(sim.MetalSimError, match="memory barrier is missing"):
        cb2.dispatch(lib, "add_one", 2, 32, [y, z], reads={0: True}, writes={1: True})
    # two readers of x in one level are fine
    cb3 = sim.CommandBuffer()
    cb3.dispatch(lib, "add_one", 2, 32, [x, y], reads={0: True}, writes={1: True})
    cb3.dispatch(lib, "add_one", 2, 32, [x, z], reads={0: True}, writes={1: True})
    assert cb3.level == 0
    # a serial encoder puts every dispatch in its own level
    cb4 = sim.CommandBuffer(concurrent=False)
    cb4.dispatch(lib, "add_one", 2, 32, [x, y], reads={0: True}, writes={1: True})
    cb4.dispatch(lib, "add_one", 2, 32, [y, z], reads={0: True}, writes={1: True})
    assert [r["level"] for r in cb4.dispatches] == [0, 1]


def test_encode_only_with_virtual_buffers():
    """Cost a configuration without data: the real model's lm_head and norm dims, no weights."""
    lib = sim.builtin_library()
    H, V = 2048, 248320
    x = np.ones((1, H), ml_dtypes.bfloat16)
    w = np.ones(H, ml_dtypes.bfloat16)
    y = np.zeros((1, H), ml_dtypes.bfloat16)
    # params bind first ([[buffer(0)]]): buffers start at index 1
    lib.dispatch("rmsnorm_bf16", 1, 512, [None, x, w, y], {0: sim.pack("If", H, 1e-6)})  # one real run: tg memory seen
    cb = sim.CommandBuffer(execute=False)
    hb = sim.VirtualBuffer(H * 2, "h")
    nb = sim.VirtualBuffer(H * 2, "normed")
    cb.dispatch(lib, "rmsnorm_bf16", 1, 512, [None, hb, sim.VirtualBuffer(H * 2), nb], {0: sim.pack("If", H, 1e-6)},
                reads={1: H * 2, 2: H * 2}, writes={3: H * 2})
    cb.barrier()
    wq, sc = sim.VirtualBuffer(V * H // 2, "lm_head.weight"), sim.VirtualBuffer(V * H // 64 * 2)
    logits = sim.VirtualBuffer(V * 4, "logits")
    cb.dispatch(lib, "qmv_q4_sbf16_bf16_f32out", (V // 8, 1), (32, 2), [None, wq, sc, sc, nb, logits],
                {0: sim.pack("IIIII", H, V, 64, H, V)},
                reads={1: True, 2: True, 3: True, 4: True}, writes={5: True})
    c = cb.counters()
    assert not c["executed"] and c["num_dispatches"] == 2 and c["levels"] == 2
    norm, head = c["dispatches"]
    assert norm["threadgroup_memory"] == 128 and not norm["executed"]
    assert head["threadgroup_memory"] is None or head["threadgroup_memory"] == 0
    assert head["threads"] == V // 8 * 64
    assert head["bytes_read"] == V * H // 2 + 2 * (V * H // 64 * 2) + H * 2 + 20  # + the setBytes params
    assert head["bytes_written"] == V * 4
    with pytest.raises(sim.MetalSimError, match="virtual buffer"):
        sim.CommandBuffer().dispatch(lib, "rmsnorm_bf16", 1, 512, [None, hb, hb, nb], {0: sim.pack("If", H, 1e-6)})


def test_runtime_compiled_quant_matches_builtin():
    """The product path (kernels linked into _core) and sim.compile of the same source (metal/quant.metal with
    its headers quant.h and quant_dot.h) agree."""
    from qwenmetal import quant
    lib = sim.builtin_library()
    rt = sim.compile(sim.kernel_path("quant.metal"))
    rng = np.random.default_rng(5)
    N, K = 24, 320
    wq, s, b = quant.quantize(rng.standard_normal((N, K)).astype(np.float32), 4, 64, scale_dtype=np.float32)
    wd = quant.dequantize(wq, s, b, 4, 64).astype(np.float64)
    x = rng.standard_normal(K).astype(np.float32)
    y1, y2 = np.zeros(N, np.float32), np.zeros(N, np.float32)
    # QmvParams {K, N, group_size, x_stride, y_stride, flags, eps, batch, bits, conv_k, conv_c}; buffers 5 (gain),
    # 6 (residual), 8 (normalised input) and 9-12 (the conv epilogue) are unused without fusion flags: bound to
    # arrays the dispatch binds anyway
    params = {0: sim.pack("IIIIIIfIIII", K, N, 64, K, N, 0, 0.0, 1, 4, 0, 0)}
    lib.dispatch("qmv_q4_sf32_f32", (3, 1), (32, 2), [None, wq, s, b, x, x, y1, y1, x, x, x, x, x], params)
    rt.dispatch("qmv_q4_sf32_f32", (3, 1), (32, 2), [None, wq, s, b, x, x, y2, y2, x, x, x, x, x], params,
                schedule="reverse")
    np.testing.assert_array_equal(y1, y2)
    assert float(np.abs(y1 - wd @ x).max() / np.abs(wd @ x).max()) <= 1e-5

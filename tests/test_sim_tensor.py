"""The simulator's emulation of Metal 4 tensor operations (src/msl_sim/include/msl_sim/tensor.h) against numpy:
matmul2d's operand layouts (extent 0 contiguous; left M x K, right K x N, destination M x N), the four
transposes, multiply vs multiply_accumulate, dynamic and static k, edge checking at the extents, slices,
threadgroup operands, the documented type combinations, and the checks (divergence, non-uniform operands,
bounds, unwritten threadgroup memory). Kernels: tests/msl/sim_tensor.metal. This checks the emulation
against our reading of Apple's documentation only; no Apple GPU was involved.
"""
import importlib.util
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from oracles import unavailable  # fails in CI, skips elsewhere
from qwenmetal import msl_sim as sim

HERE = Path(__file__).resolve().parent
SCHEDULES = [("forward", 0), ("reverse", 0), ("random", 5)]
ROWS = 16  # two SIMD-groups of 8 destination rows; 16 destination columns (the descriptor's m, n)


@pytest.fixture(scope="module")
def lib():
    return sim.compile(HERE / "msl" / "sim_tensor.metal")


def _operands(rng, M, N, K, tl, tr, dt):
    A = rng.standard_normal((M, K)).astype(dt)
    B = rng.standard_normal((K, N)).astype(dt)
    a = np.ascontiguousarray(A.T if tl else A)  # stored K x M when transposed: extents (M, K)
    b = np.ascontiguousarray(B.T if tr else B)  # stored N x K when transposed: extents (K, N)
    return A.astype(np.float64), B.astype(np.float64), a, b


@pytest.mark.parametrize("tl,tr,name", [(False, False, "nn"), (False, True, "nt"), (True, False, "tn"), (True, True, "tt")])
@pytest.mark.parametrize("M,N,K", [(16, 16, 32), (5, 11, 7), (16, 3, 1), (9, 16, 40)])
def test_transposes_and_edges(lib, tl, tr, name, M, N, K):
    """D = A B for each transpose; M, N below the 16 x 16 the SIMD-groups cover: rows and columns outside
    the destination's extents are not written (the sentinel after the buffer's M x N stays)."""
    rng = np.random.default_rng(M * 100 + N + K)
    A, B, a, b = _operands(rng, M, N, K, tl, tr, np.float32)
    for sched, seed in SCHEDULES:
        d = np.full(M * N + 8, 7.0, np.float32)
        lib.dispatch(f"mm_f32_{name}", 1, 64, [None, a, b, d], {0: sim.pack("iiii", M, N, K, 0)},
                     schedule=sched, seed=seed)
        np.testing.assert_allclose(d[:M * N].reshape(M, N), A @ B, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(d[M * N:], 7.0)


def test_multiply_overwrites_and_accumulate_adds(lib):
    rng = np.random.default_rng(2)
    M, N, K = 13, 16, 24
    A, B, a, b = _operands(rng, M, N, K, False, True, np.float32)
    d0 = rng.standard_normal((M, N)).astype(np.float32)
    d = d0.copy()
    lib.dispatch("mm_f32_nt", 1, 64, [None, a, b, d], {0: sim.pack("iiii", M, N, K, 0)})
    np.testing.assert_allclose(d, A @ B, rtol=1e-5, atol=1e-5)  # mode::multiply: the old D is not read
    d = d0.copy()
    lib.dispatch("mm_f32_nt_acc", 1, 64, [None, a, b, d], {0: sim.pack("iiii", M, N, K, 0)})
    np.testing.assert_allclose(d, d0 + A @ B, rtol=1e-5, atol=1e-5)
    lib.dispatch("mm_f32_nt_acc", 1, 64, [None, a, b, d], {0: sim.pack("iiii", M, N, K, 0)})
    np.testing.assert_allclose(d, d0 + 2 * (A @ B), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("K", [3, 8, 20])
def test_static_k(lib, K):
    """A descriptor with k = 8: the product over k < 8; operand elements past a K extent below 8 read as
    zero (edge checking), K above 8 is not summed beyond 8."""
    rng = np.random.default_rng(K)
    M, N = 16, 16
    A, B, a, b = _operands(rng, M, N, K, False, True, np.float32)
    d = np.zeros(M * N, np.float32)
    lib.dispatch("mm_f32_nt_k8", 1, 64, [None, a, b, d], {0: sim.pack("iiii", M, N, K, 0)})
    k = min(K, 8)
    np.testing.assert_allclose(d.reshape(M, N), A[:, :k] @ B[:k], rtol=1e-5, atol=1e-5)


def test_types(lib):
    """bfloat x bfloat accumulated in float into float; into bfloat and half x half into half: the float
    sum rounded once to the destination type."""
    rng = np.random.default_rng(4)
    M, N, K = 16, 16, 48
    for kern, dt, out_dt in (("mm_bf16_nt_f32", ml_dtypes.bfloat16, np.float32),
                             ("mm_bf16_nt_bf16", ml_dtypes.bfloat16, ml_dtypes.bfloat16),
                             ("mm_f16_nt_f16", np.float16, np.float16)):
        A, B, a, b = _operands(rng, M, N, K, False, True, dt)
        d = np.zeros(M * N, out_dt)
        lib.dispatch(kern, 1, 64, [None, a, b, d], {0: sim.pack("iiii", M, N, K, 0)})
        ref = (A @ B).astype(np.float32)
        if out_dt is not np.float32:
            ref = ref.astype(out_dt).astype(np.float64)
            np.testing.assert_allclose(d.astype(np.float64).reshape(M, N), ref, rtol=1e-2, atol=1e-2)
            exact = (A @ B).astype(np.float32).astype(out_dt)
            assert np.mean(d.reshape(M, N) == exact) > 0.9  # rounded once from a float sum
        else:
            np.testing.assert_allclose(d.reshape(M, N), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("M,N,K", [(16, 16, 32), (7, 10, 5)])
def test_threadgroup_operands(lib, M, N, K):
    rng = np.random.default_rng(M + K)
    A, B, a, b = _operands(rng, M, N, K, False, True, np.float32)
    for sched, seed in SCHEDULES:
        d = np.zeros(M * N, np.float32)
        lib.dispatch("mm_threadgroup", 1, 64, [None, a, b, d], {0: sim.pack("iiii", M, N, K, 0)},
                     schedule=sched, seed=seed)
        np.testing.assert_allclose(d.reshape(M, N), A @ B, rtol=1e-5, atol=1e-5)


def test_missing_barrier_reads_unwritten_threadgroup_memory(lib):
    rng = np.random.default_rng(6)
    _, _, a, b = _operands(rng, 16, 16, 32, False, True, np.float32)
    d = np.zeros(256, np.float32)
    with pytest.raises(sim.MetalSimError, match=r"sim_tensor\.metal:\d+.*matmul2d::run: (left|right) element .* "
                                                r"threadgroup memory that no thread has written"):
        lib.dispatch("mm_threadgroup", 1, 64, [None, a, b, d], {0: sim.pack("iiii", 16, 16, 32, 1)},
                     schedule="forward")


def test_errors(lib):
    M, N, K = 8, 16, 8
    a = np.ones(M * K, np.float32)
    b = np.ones(N * K, np.float32)
    d = np.zeros(M * N, np.float32)
    lib.dispatch("mm_errors", 1, 32, [None, a, b, d], {0: sim.pack("iiii", M, N, K, 0)})
    np.testing.assert_array_equal(d, K)
    with pytest.raises(sim.MetalSimError, match=r"diverges at a SIMD-group function.*16 lanes at matmul2d::run"):
        lib.dispatch("mm_errors", 1, 32, [None, a, b, d], {0: sim.pack("iiii", M, N, K, 1)})
    with pytest.raises(sim.MetalSimError, match="lane 1 passes another left tensor than lane 0: run's operands must be "
                                                "SIMD-group-uniform"):
        lib.dispatch("mm_errors", 1, 32, [None, a, b, d], {0: sim.pack("iiii", M, N, K, 2)})
    with pytest.raises(sim.MetalSimError, match=r"left element \(0, 4\) lies outside its buffer"):
        lib.dispatch("mm_errors", 1, 32, [None, a, b, d], {0: sim.pack("iiii", M, N, K, 3)})
    with pytest.raises(sim.MetalSimError, match="needs all 32 lanes of the SIMD-group"):
        lib.dispatch("mm_errors", 1, 16, [None, a, b, d], {0: sim.pack("iiii", M, N, K, 0)})


def test_unchecked_build(lib):
    """The fast (unchecked) build of the emulation computes the same."""
    fast = sim.compile(HERE / "msl" / "sim_tensor.metal", checked=False)
    rng = np.random.default_rng(9)
    A, B, a, b = _operands(rng, 11, 16, 9, False, True, np.float32)
    d = np.zeros(11 * 16, np.float32)
    fast.dispatch("mm_f32_nt", 1, 64, [None, a, b, d], {0: sim.pack("iiii", 11, 16, 9, 0)})
    np.testing.assert_allclose(d.reshape(11, 16), A @ B, rtol=1e-5, atol=1e-5)


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, HERE.parent / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_address_space_check_of_tensors(tmp_path):
    """tools/msl_check.py type-checks tensor code as C++20 against check_as.h: a device tensor over
    threadgroup memory is an error at its line."""
    check = _tool("msl_check")
    clang = check.find_clang()
    if clang is None:
        unavailable("no clang++ >= 15 for tools/msl_check.py")
    src = (HERE / "msl" / "sim_tensor.metal").read_text()
    bad = "auto A = tensor<threadgroup float, ext2, tensor_inline>(As"
    assert bad in src
    line = src[:src.index(bad)].count("\n") + 1
    planted = tmp_path / "planted.metal"
    planted.write_text(src.replace(bad, bad.replace("threadgroup float", "device float")))
    ok, diag = check.check_file(planted, clang, include_dirs=[HERE / "msl"])
    assert not ok and f"planted.metal:{line}:" in diag and "no matching constructor" in diag, diag
    assert _tool("mslpp").cxx_std(src) == "c++20" and _tool("mslpp").cxx_std("// #include <metal_tensor>\n") == "c++17"


def test_lint_allows_metal_performance_primitives():
    lint = _tool("msl_lint")
    assert lint.lint_file(HERE / "msl" / "sim_tensor.metal") == []
    found = lint.lint_source("#include <MetalPerformancePrimitives/Other.h>\n")
    assert found and "kernels include only" in found[0][1]

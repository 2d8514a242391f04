"""AddressSanitizer + UndefinedBehaviorSanitizer and LeakSanitizer runs of the extension, and RSS across
session churn (docs/verification.md, "Sanitizers").

* ``tools/sanitize_build.sh`` builds ``_core`` with ``-fsanitize=address,undefined`` in build/asan (ninja:
  incremental, so a second run only relinks what changed) and lays out build/asan/pkg/qwenmetal (this
  checkout's Python sources + the instrumented module).
* the engine, simulator and kernel tests below (``SANITIZED_TESTS``, tiny shapes) run in a subprocess on
  that build with the sanitizer runtime preloaded into the (uninstrumented) interpreter; any ASan or UBSan
  report aborts the run.
* LeakSanitizer: 1,000 sessions per backend (cpu, metal-sim) created, forked, snapshotted, restored and
  freed (tests/session_churn.py), then a leak check; the same check with a planted leak must fail.
* RSS: the same churn on the normal build; VmRSS after a warm-up grows less than ``RSS_BOUND``.

Under CI=true a missing compiler or sanitizer runtime fails these tests; elsewhere they skip with the reason.
cmake, ninja and nanobind are the `test` extra's, taken from the environment of the interpreter that runs the
tests (``sys.executable``, passed to the script as $PYTHON); without them the tests fail everywhere.
``QWENMETAL_SANITIZE_TESTS`` replaces the test selection (e.g. ``tests`` for all of it).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from session_churn import LEAK_EXIT

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "asan"
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
CXX = os.environ.get("CXX", "g++")

# the C++ of the CPU engine, the simulator runtime (fibers, schedules, planted bugs) and the kernels + GPU
# graph on tiny shapes. Left to the normal run: the model-sized / real-vocabulary kernel cases, the float
# and bf16 build sweeps of test_backend.py (10 checkpoints x 64 simulated decode steps), the statistical
# sampler tests, the self-test (the same kernels on larger inputs) and test_backend.py's other multi-step
# graph runs (~4 min under ASan); the graph is covered here by its session-contract and pipelined tests.
# Streaming: the CPU path and the expert cache in full; on metal the one-slot-per-token step, the S = E and
# S = k steps and the mapping check, not the other formats, the low-bit fixtures (the qn kernels are in the
# kernel tests) or the longest prefill splits (~90 s under ASan; all of them run in the normal run).
SANITIZED_TESTS = ["tests/test_cpu_engine.py", "tests/test_cpu_session.py", "tests/test_sim_runtime.py",
                   "tests/test_sim_planted.py", "tests/metal", "tests/test_expert_cache.py",
                   "tests/test_streaming_cpu.py",
                   "-k", "not model_shape and not real and not float_build and not bfloat_build and not distribution"
                         " and not selftest and not sample_grid and not argmax_sizes and not every_schedule"
                         " and not attention_routes_in_graph and not generate_takes and not stop_token"
                         " and not gpu_sampling_is_seeded and not demo_checkpoint and not low_bit"
                         " and not streaming_other_formats and not (streaming_matches_resident and one)"
                         " and not split_prefills_equal_one and not (last_row_at_the_chunk_edges and 24)"
                         " and not lowered_limit and not 131072_token and not real_graph_fits"
                         " and not mix_matches_mlx and not unpaired_shared_expert"]
N_SESSIONS = 1000
RSS_BOUND_KIB = 2048     # one tiny-fixture session state is ~60 KiB: a leak per session would be ~60 MiB


def _missing(why: str):
    if CI:
        pytest.fail(f"CI=true: the sanitizer build cannot run: {why}")
    pytest.skip(why)


def _runtime(lib: str) -> str:
    """Absolute path of the compiler's sanitizer runtime ``lib`` (g++/clang++ -print-file-name)."""
    try:
        out = subprocess.run([CXX, f"-print-file-name={lib}"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        _missing(f"cannot run the C++ compiler {CXX!r}: {e}")
    path = out.strip()
    if not os.path.isabs(path) or not os.path.isfile(path):
        _missing(f"{CXX} has no {lib} (install the compiler's sanitizer runtime, e.g. libasan8 / libubsan1)")
    return path


@pytest.fixture(scope="module")
def asan_env() -> dict:
    """Builds the instrumented extension; the environment that runs Python on it."""
    if shutil.which(CXX) is None:
        _missing(f"{CXX} not found on PATH")
    # cmake, ninja and nanobind from this interpreter's environment (the `test` extra, tests/test_install.py),
    # first on PATH, so that no tool another Python installed stands in for a missing one
    try:
        import cmake
        import nanobind  # noqa: F401
        import ninja
    except ImportError as e:
        pytest.fail(f"{e.name} is not installed for {sys.executable}, though the `test` extra declares it")
    path = os.pathsep.join([cmake.CMAKE_BIN_DIR, ninja.BIN_DIR, os.environ.get("PATH", os.defpath)])
    preload = ":".join(_runtime(lib) for lib in ("libasan.so", "libubsan.so"))
    r = subprocess.run([str(ROOT / "tools" / "sanitize_build.sh")], capture_output=True, text=True,
                       env={**os.environ, "CXX": CXX, "PYTHON": sys.executable, "PATH": path})
    assert r.returncode == 0, f"tools/sanitize_build.sh failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    so = list((BUILD / "pkg" / "qwenmetal").glob("_core*.so"))
    assert len(so) == 1, f"no instrumented _core in {BUILD / 'pkg'}"
    blob = so[0].read_bytes()
    assert b"__asan_report_" in blob and b"__ubsan_handle_" in blob, f"{so[0]} is not instrumented"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}
    env.update(
        PYTHONPATH=str(BUILD / "pkg"),
        LD_PRELOAD=preload,
        PYTHONMALLOC="malloc",   # every Python allocation through malloc: ASan sees them, LSan scans them
        # halt on the first report; no leak check at exit (the interpreter does not free everything);
        # detect_stack_use_after_return=0: the simulator switches between fiber stacks (see docs)
        ASAN_OPTIONS="halt_on_error=1:abort_on_error=1:detect_leaks=0:detect_stack_use_after_return=0",
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
    )
    return env


def _run(env: dict, args: list[str], timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _sanitizer_report(text: str) -> bool:
    return any(m in text for m in ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer"))


def test_asan_build_is_the_one_imported(asan_env):
    r = _run(asan_env, ["-c", "import ctypes, qwenmetal._core as c; ctypes.CDLL(None).__asan_init; "
                              "print(c.__file__)"], timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.strip().startswith(str(BUILD / "pkg")), r.stdout


def test_engine_simulator_and_kernel_tests_under_asan_ubsan(asan_env):
    sel = os.environ.get("QWENMETAL_SANITIZE_TESTS")
    tests = sel.split() if sel else SANITIZED_TESTS
    r = _run(asan_env, ["-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests], timeout=3600)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and not _sanitizer_report(out), out[-8000:]


SUPPRESSIONS = ROOT / "tests" / "native" / "lsan.supp"


@pytest.mark.parametrize("plant", [False, True], ids=["churn", "planted-leak"])
def test_lsan_session_churn(asan_env, plant):
    opts = asan_env["ASAN_OPTIONS"].replace("detect_leaks=0", "detect_leaks=1") + ":leak_check_at_exit=0"
    if plant:
        opts += ":fast_unwind_on_malloc=0"   # full allocation stacks through the interpreter (slow: 10 sessions)
    env = {**asan_env, "ASAN_OPTIONS": opts, "LSAN_OPTIONS": f"suppressions={SUPPRESSIONS}:print_suppressions=0"}
    args = ["tests/session_churn.py", "10", "cpu", "--plant-leak"] if plant else \
        ["tests/session_churn.py", str(N_SESSIONS), "cpu", "metal-sim"]
    r = _run(env, args, timeout=1800)
    if plant:
        assert r.returncode == LEAK_EXIT, f"the planted leak was not reported:\n{r.stderr[-8000:]}"
        assert "ERROR: LeakSanitizer" in r.stderr and "state_export" in r.stderr, r.stderr[-8000:]
    else:
        assert r.returncode == 0 and not _sanitizer_report(r.stderr), r.stderr[-8000:]


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="VmRSS comes from /proc/self/status (Linux)")
@pytest.mark.parametrize("backend", ["cpu", "metal-sim"])
def test_rss_flat_across_session_churn(backend):
    """Measured in a fresh process (tests/session_churn.py --rss): inside a long test run the allocator's
    state left by earlier tests moves VmRSS by megabytes either way."""
    import json

    import qwenmetal as qm
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(qm.__file__).parents[1]), *sys.path]))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "session_churn.py"), "--rss", backend, str(N_SESSIONS)],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"{backend}: VmRSS {m['before_kib']} KiB -> +{m['grown_kib']} KiB over {N_SESSIONS} sessions; "
          f"+{m['retained_kib']} KiB with them kept")
    assert m["grown_kib"] < RSS_BOUND_KIB, f"VmRSS grew {m['grown_kib']} KiB over {N_SESSIONS} sessions (bound {RSS_BOUND_KIB})"
    # the measurement sees a leak of that size: keeping the forks alive grows VmRSS past the bound
    assert m["retained_kib"] > RSS_BOUND_KIB, "VmRSS does not see 1,000 retained sessions"

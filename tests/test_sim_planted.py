"""Planted bugs (tests/msl/planted_bugs.metal): every mistake a real GPU would hide or corrupt on must be
reported by the simulator, with the kernel name and the source line of the mistake (marked BUG:<name> in the
file). The address-space mix-up, which the simulator cannot see, is in tests/test_msl_check.py.
"""
import re
from pathlib import Path

import numpy as np
import pytest

from qwenmetal import msl_sim as sim

HERE = Path(__file__).resolve().parent
BUGS = HERE / "msl" / "planted_bugs.metal"


def bug_line(name: str) -> int:
    for i, line in enumerate(BUGS.read_text().splitlines(), 1):
        if re.search(r"BUG:" + re.escape(name) + r"\b", line) and "belongs here" not in line:
            return i
    raise AssertionError(f"no BUG:{name} marker")


@pytest.fixture(scope="module")
def lib():
    return sim.compile(BUGS)


@pytest.fixture(scope="module")
def fast_lib():
    return sim.compile(BUGS, checked=False)


def expect_error(lib, kernel, *args, line=None, match=None, **kw):
    with pytest.raises(sim.MetalSimError, match=re.escape(f"kernel '{kernel}'")) as ei:
        lib.dispatch(kernel, *args, **kw)
    msg = str(ei.value)
    if line is not None:
        assert f"planted_bugs.metal:{line}:" in msg, msg
    if match is not None:
        assert re.search(match, msg), msg
    return msg


@pytest.mark.parametrize("schedule", ["forward", "reverse", "random"])
def test_divergent_barrier(lib, schedule):
    y = np.zeros(64, np.float32)
    expect_error(lib, "divergent_barrier", 1, 64, [y], schedule=schedule, line=bug_line("divergent-barrier"),
                 match=r"32 threads exited while 32 wait at threadgroup_barrier.*divergent")


def test_missing_barrier_is_caught_by_the_random_schedule(lib, fast_lib):
    x = np.arange(128, dtype=np.float32)
    y = np.zeros(128, np.float32)
    # forward order: every writer runs before its reader, so the bug is invisible
    lib.dispatch("missing_barrier", 2, 64, [x, y], schedule="forward")
    expected = np.concatenate([[0], x[:63], [64], x[64:127]])
    np.testing.assert_array_equal(y, expected)
    # reverse / random: the read happens before the write and is reported at its line
    for schedule, seed in [("random", 1), ("random", 2), ("reverse", 0)]:
        expect_error(lib, "missing_barrier", 2, 64, [x, y], schedule=schedule, seed=seed,
                     line=bug_line("missing-barrier-read"),
                     match=r"read of threadgroup memory t\[\d+\] that no thread has written.*threadgroup_barrier")
    # without checked mode the schedules still disagree
    with pytest.raises(sim.MetalSimError, match=r"missing_barrier.*depends on the thread schedule"):
        fast_lib.check_schedules("missing_barrier", 2, 64, [x, y], seeds=(1,))


def test_missing_barrier_on_reused_tile_is_caught_by_the_schedules(lib):
    """No slot is ever unwritten here: only the random/reverse schedules expose the race."""
    x = np.arange(64, dtype=np.float32)
    y = np.zeros(64, np.float32)
    with pytest.raises(sim.MetalSimError, match=r"kernel 'missing_barrier_reuse'.*depends on the thread schedule.*"
                                                r"missing threadgroup_barrier"):
        lib.check_schedules("missing_barrier_reuse", 1, 64, [x, y])


@pytest.mark.parametrize("schedule", ["forward", "reverse", "random"])
def test_uninitialised_threadgroup_read(lib, fast_lib, schedule):
    y = np.zeros(64, np.float32)
    expect_error(lib, "uninit_tg_read", 1, 64, [y], schedule=schedule, line=bug_line("uninit-read"),
                 match=r"read of threadgroup memory t\[(3[2-9]|[4-6]\d)\] that no thread has written")
    # unchecked: the poison shows through as NaN
    fast_lib.dispatch("uninit_tg_read", 1, 64, [y], schedule=schedule)
    assert (y[:32] == 2).all() and np.isnan(y[32:]).all()


def test_out_of_bounds_read(lib):
    x = np.arange(64, dtype=np.float32)
    y = np.zeros(64, np.float32)
    msg = expect_error(lib, "oob_read", 2, 32, [x, y], line=bug_line("oob-read"),
                       match=r"out-of-bounds device access: bytes \[256, 260\) of buffer\(0\), which has 256 bytes")
    assert "threadgroup (1,0,0), thread 31" in msg


def test_divergent_simd_function(lib):
    y = np.zeros(32, np.float32)
    expect_error(lib, "divergent_simd", 1, 32, [y], line=bug_line("divergent-simd"),
                 match=r"SIMD-group 0 diverges.*16 lanes exited; 16 lanes at simd_sum")


def test_threadgroup_memory_over_32k(lib):
    y = np.zeros(64, np.float32)
    expect_error(lib, "too_much_tg", 1, 64, [y], line=bug_line("tg-overflow"),
                 match=r"declaring big \(36864 bytes\).*over the 32768-byte limit")


def test_unbound_buffer(lib):
    x = np.zeros(64, np.float32)
    expect_error(lib, "reads_two", 1, 64, [x, None, x], match=r"unbound buffer\(1\)")
    expect_error(lib, "reads_two", 1, 64, [x], match=r"unbound buffer\((1|2)\)")


def test_too_many_threads(lib):
    y = np.zeros(64, np.float32)
    expect_error(lib, "divergent_barrier", 1, (1025, 1, 1), [y], match=r"1025 threads per threadgroup.*1024")
    expect_error(lib, "divergent_barrier", 1, (32, 32, 2), [y], match=r"2048 threads per threadgroup.*1024")


def test_shuffle_from_inactive_lane(lib):
    y = np.zeros(64, np.float32)
    expect_error(lib, "shuffle_inactive", 1, 48, [y], line=bug_line("shuffle-inactive"),
                 match=r"simd_shuffle_down: lane 15 reads lane 16, which is not active")
    lib.dispatch("shuffle_inactive", 1, 64, [y])  # full SIMD-groups: lane 31 keeps its own value
    assert y[31] == 31 and y[30] == 31

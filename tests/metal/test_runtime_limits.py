"""Apple's runtime limits as SimDevice models them, so that CI fails where a Mac would (docs/metal.md,
"Runtime limits"). Simulator-verified, hardware-unverified; the GPU times are modelled.

* GPU time per command buffer: SimDevice fails a command buffer whose modelled time on the slowest supported
  GPU exceeds the budget, as macOS's watchdog would abort it; the graph cuts a prefill chunk into command
  buffers committed back to back (attention over a long context in query blocks), so a 131,072-token prefill
  of the real config stays under the budget in every command buffer, and the cut output equals the uncut;
* per-pipeline thread limit: a pipeline's limit is its kernel's declared max_total_threads_per_threadgroup,
  else the device's (lowered to 256/384/512 here); a dispatch above it is refused; the kernel families and the
  whole graph give the reference's results under the lowered limits;
* GPU faults: a failed or timed-out command buffer in decode, prefill, verification or expert streaming
  raises DeviceError naming the kernels it ran, leaves the session as it was, and the engine gets a new queue
  so that the next call runs.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qwenmetal as qm
from qwenmetal import _core, bench
from qwenmetal.config import ModelConfig
from qwenmetal.backends.cpu import config_dict
from qwenmetal.bench.cost import encode_only_prefill_cost, slowest_chip
from qwenmetal.backends.metal import prefill_options
from qwenmetal.testing import cached_checkpoint
from qwenmetal.weights_table import virtual_weight_table

from model_runs import rel_range_err

from .gpu_harness import SIM

pytestmark = pytest.mark.skipif(not SIM, reason="the modelled limits are the simulator's; a Mac has its own")

gpu = _core.gpu
ROOT = Path(__file__).resolve().parents[2]
PROMPT = [5, 17, 3, 99, 42, 7, 250, 1] * 10          # 80 tokens: 2 chunks of 64, attention past one query block
CHIP = slowest_chip()


@pytest.fixture(scope="module")
def real():
    return ModelConfig.from_dict(bench.real_config(40))


def _encode_only_engine(config, **prefill):
    mappings, tensors, _ = virtual_weight_table(config)
    dev = gpu.SimDevice(execute=False)
    opts = {**prefill_options(prefill.pop("chunk", 4096), "auto", "auto"), **prefill}
    return dev, gpu.GpuEngine(dev, config_dict(config), mappings, tensors, "bf16", False, {}, [], opts)


def _state(m, s):
    return m._backend.state_to_arrays(s._state)


def _same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]).astype(np.float32), np.asarray(b[k]).astype(np.float32), err_msg=k)


# ---- GPU time per command buffer ------------------------------------------------------------------
def test_a_command_buffer_past_the_budget_fails_as_the_watchdog_would(real):
    """One uncut chunk of 4096 rows of the real config is several seconds on the slowest GPU: SimDevice fails
    it naming the budget and the kernels, and the engine leaves the device usable (a new queue)."""
    dev, eng = _encode_only_engine(real, command_buffer_seconds=0.0)      # 0: never cut
    st = eng.new_state()
    with pytest.raises(gpu.DeviceError, match=r"ImpactingInteractivity\): modelled \d+ ms on the M1.*"
                                              r"watchdog.*dispatches of embed"):
        eng.prefill_cost(st, 4096)
    assert dev.faults == 1 and not dev.faulted
    assert dev.max_command_buffer_seconds > CHIP["watchdog_seconds"]


def test_a_131072_token_prefill_stays_under_the_budget(real):
    """The whole 131,072-token prefill of the real config, costed encode-only: no command buffer of any chunk
    is modelled above the target on the slowest GPU (so SimDevice's watchdog never fires), on either GEMM
    route; the report names the longest command buffer per chip."""
    r = encode_only_prefill_cost(real, (131072,))
    p = r["prompts"]["131072"]
    assert p["max_command_buffer_ms"][CHIP["name"]] <= 1e3 * CHIP["command_buffer_seconds"]
    for chip, ms in p["max_command_buffer_ms"].items():
        assert 0 < ms <= r["watchdog_budget_ms"], chip
    for route in p["routes"].values():
        assert len(route["chunks"]) == 32
        # the last chunk attends over 127K keys: its attention runs in query blocks, so it is cut more often
        assert route["chunks"][-1]["command_buffers"] > route["chunks"][0]["command_buffers"] >= 2


def test_cut_prefill_equals_one_command_buffer():
    """Every dispatch in a command buffer of its own (and attention in 32-row query blocks) against one
    command buffer per chunk: the same logits and the same state, bit for bit, on a prompt of two chunks."""
    path = cached_checkpoint("tiny", "mlx-q4", seed=0)
    runs = []
    for seconds in (0, 1e-12):
        m = qm.Model.load(path, backend="metal-sim", dtype="float32", prefill_chunk=64, command_buffer_seconds=seconds)
        s = m.new_session()
        m._backend.device.reset_counters()
        logits = m.prefill(s, PROMPT, return_logits="all")
        runs.append((logits, _state(m, s), m._backend.device.counters()))
    (a, sa, ka), (b, sb, kb) = runs
    np.testing.assert_array_equal(a, b)
    _same_state(sa, sb)
    assert ka["command_buffers"] == 2 and kb["command_buffers"] == kb["dispatches"] > ka["dispatches"]


# ---- per-pipeline thread limit ------------------------------------------------------------------
def test_pipeline_limits_follow_the_declarations():
    dev = gpu.SimDevice(pipeline_max_threads=256)
    assert dev.max_threads("gdn_step_f32_dk128") == 1024  # [[max_total_threads_per_threadgroup(32 x 32)]]
    assert dev.max_threads("gemm_q4_sbf16_f32") == 128
    assert dev.max_threads("sample_sorted") == 1024
    assert dev.max_threads("rmsnorm_f32") == 256            # no declaration: the device's lowered limit
    x = np.zeros((1, 4096), np.float32)
    w = np.ones(4096, np.float32)
    cb = dev.command_buffer()
    enc = gpu.Encoder(dev, cb)
    gpu.ops.rmsnorm(enc, "f32", dev.wrap(x), dev.wrap(w), dev.wrap(x.copy()), 1, 4096, 1e-6)   # sized to 256
    cb.commit()
    cb.wait()
    with pytest.raises(ValueError, match="pipeline_max_threads must be a multiple of 32"):
        gpu.SimDevice(pipeline_max_threads=300)


def test_a_dispatch_above_the_pipeline_limit_is_refused():
    """What a host function that ignored the limit would encode: refused when encoded, as Metal's validation
    refuses it, naming the kernel and the pipeline's limit."""
    dev = gpu.SimDevice(pipeline_max_threads=256)
    cb = dev.command_buffer()
    buf = dev.alloc(4096)
    with pytest.raises(gpu.DeviceError, match=r"'rmsnorm_f32': 512 threads per threadgroup .* allows 1 to 256"):
        dev.dispatch(cb, "rmsnorm_f32", [1], [512], [b"\0" * 8, buf, buf, buf])
    dev.dispatch(cb, "rmsnorm_f32", [1], [256], [b"\0" * 8, buf, buf, buf])   # within the limit: encoded


def test_the_real_graph_fits_lowered_limits(real):
    """The real config's decode step and prefill chunk encode under every lowered limit: every fixed-size
    kernel declares its size, every other host function sizes its threadgroups from the pipeline."""
    for limit in (256, 384, 512):
        mappings, tensors, _ = virtual_weight_table(real)
        dev = gpu.SimDevice(execute=False, pipeline_max_threads=limit)
        eng = gpu.GpuEngine(dev, config_dict(real), mappings, tensors, "bf16", False, {}, [],
                            prefill_options(512, "auto", "auto"))
        eng.prefill_cost(eng.new_state(), 512)
        st = eng.new_state()
        st._set_position(4096)
        eng.encode_cost(st)


@pytest.mark.parametrize("limit", [256, 384, 512])
def test_the_graph_under_a_lowered_limit(limit):
    """The tiny model's prefill and greedy decode under a lowered limit: the float build's tolerance against
    the reference, the same tokens."""
    path = cached_checkpoint("tiny", "mlx-q4", seed=0)
    ref = qm.Model.load(path, backend="reference")
    m = qm.Model.load(path, backend="metal-sim", dtype="float32", device_options={"pipeline_max_threads": limit})
    want = ref.prefill(ref.new_session(), PROMPT[:24], return_logits="all")
    s = m.new_session()
    got = m.prefill(s, PROMPT[:24], return_logits="all")
    assert rel_range_err(got, want) < 1e-4
    t = int(np.argmax(got[-1]))
    toks = m._backend.decode(s._state, t, 6)
    rs = ref.new_session()
    ref.prefill(rs, PROMPT[:24])
    want_toks, u = [], t
    for _ in range(6):
        u = int(np.argmax(ref.decode_step(rs, u)))
        want_toks.append(u)
    assert toks == want_toks


def test_kernel_families_under_a_lowered_limit():
    """The kernel tests of every family (small shapes and one realistic shape each) rerun on devices whose
    undeclared pipelines allow 256 threads."""
    env = dict(os.environ, QWENMETAL_TEST_PIPELINE_THREADS="256")
    files = [f"tests/metal/test_{f}.py"
             for f in ("norm", "quant", "gdn", "attention", "moe", "sample", "gemm", "vision")]
    r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *files,
                        "-k", "not model_shape and not distribution and not every_schedule and not argmax_sizes"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]


# ---- GPU faults ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    path = cached_checkpoint("tiny", "mlx-q4", seed=0)
    return {"resident": qm.Model.load(path, backend="metal-sim", dtype="float32", prefill_chunk=16),
            "streaming": qm.Model.load(path, backend="metal-sim", dtype="float32", expert_slots=2)}


def _fault_then_recover(m, s, call, after, kind):
    """`call(state)` with the after-th command buffer failing: DeviceError naming the fault and the kernels, the
    session's state and tokens untouched, the queue recreated; then the same call runs and matches a clean run
    on a fork taken before."""
    dev = m._backend.device
    clean = s.fork()
    before, tokens, position = _state(m, s), list(s.tokens), s.position
    dev.inject_fault(after, kind)
    faults = dev.faults
    with pytest.raises(gpu.DeviceError, match=r"Metal command buffer failed: .*(Timeout|page fault).*"
                                              r"injected by SimDevice.*; it ran \d+ dispatches of \w+"):
        call(s)
    assert dev.faults > faults and not dev.faulted            # the engine made a new queue
    _same_state(_state(m, s), before)
    assert list(s.tokens) == tokens and s.position == position
    got, want = call(s), call(clean)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    _same_state(_state(m, s), _state(m, clean))


@pytest.mark.parametrize("mode", ["resident", "streaming"])
@pytest.mark.parametrize("kind", ["error", "timeout"])
def test_fault_in_prefill(tiny, mode, kind):
    m = tiny[mode]
    s = m.new_session()
    m.prefill(s, PROMPT[:8])
    # resident: the second of three chunks fails; streaming: a command buffer inside the second token
    _fault_then_recover(m, s, lambda x: m.prefill(x, PROMPT[8:48], return_logits="all"), after=1 if mode == "resident" else 7,
                        kind=kind)


@pytest.mark.parametrize("mode", ["resident", "streaming"])
def test_fault_in_decode(tiny, mode):
    """The pipelined decode (two command buffers in flight: the one after the failed one is ignored by the
    faulted queue) and the streaming decode (per-layer command buffers)."""
    m = tiny[mode]
    s = m.new_session()
    m.prefill(s, PROMPT[:8])
    _fault_then_recover(m, s, lambda x: m._backend.decode(x._state, 7, 6, consumed=x._tokens), after=3, kind="error")


def test_fault_in_verification(tiny):
    m = tiny["resident"]
    s = m.new_session()
    m.prefill(s, PROMPT[:8])

    def verify(x):
        out = m._backend.verify(x._state, np.array([3, 99, 42, 7], np.int64), x._tokens)
        m._backend.rewind(x._state, 4, x._tokens)            # keep them all: a chain ends before the next call
        return out
    _fault_then_recover(m, s, verify, after=0, kind="timeout")


# ---- buffers past maxBufferLength -------------------------------------------------------------------
PAGE = 16384


@settings(max_examples=200, deadline=None)
@given(pages=st.integers(1, 400), max_pages=st.integers(2, 64), view_pages=st.integers(0, 63), data=st.data())
def test_windows_hold_every_view_whole(pages, max_pages, view_pages, data):
    """MetalDevice.wrap maps a weights file past maxBufferLength as overlapping buffers (gpu.plan_windows):
    whole pages, each at most the maximum, covering the range, and every view up to max_view bytes lies in one
    of them (gpu.window_of finds it)."""
    bytes_, max_len, max_view = pages * PAGE, max_pages * PAGE, view_pages * PAGE + data.draw(st.integers(0, PAGE - 1))
    if max_view + PAGE > max_len and bytes_ > max_len:
        with pytest.raises(ValueError, match="cannot be mapped within buffers"):
            gpu.plan_windows(bytes_, max_len, max_view, PAGE)
        return
    w = gpu.plan_windows(bytes_, max_len, max_view, PAGE)
    assert w[0][0] == 0 and w[-1][0] + w[-1][1] == bytes_
    for (s, n), (s2, _) in zip(w, w[1:]):     # whole pages, at most the maximum, overlapping by max_view
        assert s % PAGE == 0 and n % PAGE == 0 and n <= max_len and s < s2 and s + n - s2 >= max_view
    n = data.draw(st.integers(0, min(max_view, bytes_)))
    off = data.draw(st.integers(0, bytes_ - n))
    i = gpu.window_of(w, off, n)
    assert i >= 0 and w[i][0] <= off and off + n <= w[i][0] + w[i][1]


def test_a_view_larger_than_max_view_may_fall_between_windows():
    w = gpu.plan_windows(10 * PAGE, 4 * PAGE, PAGE, PAGE)         # steps of 3 pages
    assert w == [(0, 4 * PAGE), (3 * PAGE, 4 * PAGE), (6 * PAGE, 4 * PAGE)]
    assert gpu.window_of(w, 5 * PAGE // 2, 2 * PAGE) == -1         # pages 2.5 .. 4.5: in no window
    assert gpu.window_of(w, 5 * PAGE // 2, PAGE) == 0

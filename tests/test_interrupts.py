"""Interrupts and errors are all-or-nothing (docs/api.md, "Interrupts"), on the reference, cpu and
metal-sim backends:

* a SIGINT at any Python line of prefill, decode_step, generate (with a session), chat and
  Session.restore / reset / fork -- delivered by a trace hook at the k-th line event inside qwenmetal's
  modules, for k sampled over the whole call -- leaves the session at a token boundary
  (position == len(tokens)) whose state is that of its tokens (a continuation gives a clean session's
  logits), exactly as before or after the call for the calls that are one step; save/load round-trips;
  the prefix cache holds only entries whose state is that of their tokens;
* a real SIGINT (from a timer thread) in the middle of C++ compute -- a multi-chunk cpu prefill, a
  metal-sim prefill and decode loop -- abandons the call part-way (the engines poll between chunks /
  tokens / steps) and leaves the session exactly as before it;
* `qwenmetal generate` interrupted prints one line and exits 130.

QWENMETAL_INTERRUPT_SAMPLES=N: injection points per call (default 10; the long run uses e.g. 200).
"""
from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from functools import partial

import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal.testing import cached_checkpoint

SAMPLES = int(os.environ.get("QWENMETAL_INTERRUPT_SAMPLES", "10"))
QM_DIR = os.path.dirname(qm.__file__)
CONT = [11, 12, 13]                        # the continuation that probes a state
OPTIONS = {"reference": {},
           # a small chunk: the prefills under test run several chunks (the C++ poll is between them)
           "cpu": dict(threads=2, kv_dtype="float32", prefill_chunk=4, activations="float"),
           "metal-sim": dict(dtype="float32", prefill_chunk=1)}
# (what the session holds before the call, the prompt of the call, injection points): the simulator runs
# about 3 tokens/s, so it gets short inputs and few random points (the last lines of a call, where it
# commits, are always all tried)
INPUTS = {"reference": ([5, 17, 3, 99, 42, 7], [250, 1, 0, 64, 9, 33, 71, 8, 2, 120], SAMPLES),
          "cpu": ([5, 17, 3, 99, 42, 7], [250, 1, 0, 64, 9, 33, 71, 8, 2, 120], SAMPLES),
          "metal-sim": ([5, 17], [250, 1], max(2, SAMPLES // 5))}


@pytest.fixture(autouse=True)
def default_sigint():
    """Python's own SIGINT handler (KeyboardInterrupt), whatever the test runner installed."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@functools.lru_cache(maxsize=None)
def load(backend: str) -> qm.Model:
    return qm.Model.load(cached_checkpoint("tiny", "mlx-q4", seed=0), backend=backend, **OPTIONS[backend])


@pytest.fixture(scope="module", params=list(OPTIONS))
def model(request):
    return load(request.param)


@pytest.fixture(scope="module", params=["reference", "cpu"])
def host_model(request):
    """Off the simulator (a chat prompt would take it minutes; generate covers its GPU decode path)."""
    return load(request.param)


# ---------------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------------
def close(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * float(np.ptp(want)))


def arrays(s) -> dict:
    """The session's state in the backend-independent layout of Session.save."""
    return s._model._backend.state_to_arrays(s._state)


def same_state(a, b, exact=True):
    """Sessions `a` and `b` hold the same tokens and state (bit for bit, or to rounding: a state reached by
    other call splits; on the cpu backend's int16 activations a split can move a value by an int16 step,
    which grows through the layers: 5e-5 of a key row whose max is 3.5, seen on an AVX2 Zen 3)."""
    assert a.tokens == b.tokens and a.position == b.position == len(a.tokens)
    A, B = arrays(a), arrays(b)
    assert A.keys() == B.keys()
    for k in A:
        if exact:
            np.testing.assert_array_equal(A[k], B[k], err_msg=k)
        else:
            np.testing.assert_allclose(A[k], B[k], rtol=1e-4, atol=1e-4 * float(np.abs(B[k]).max(initial=1)),
                                       err_msg=k)


def continuation(model, s):
    return model.prefill(s.fork(), CONT, return_logits="all")


def clean_session(model, base, tokens):
    """A session holding `tokens` (which extend base's), computed from `base` in one uninterrupted call."""
    s = base.fork()
    if len(tokens) > len(base.tokens):
        model.prefill(s, list(tokens[len(base.tokens):]), return_logits="none")
    return s


def check_consistent(model, s, base, tmp_path):
    """`s` is at a token boundary after `base` and its state is that of its tokens: that of a clean session
    (and, off the simulator, a continuation gives its logits); save/load round-trips it."""
    assert s.position == len(s.tokens) and s.tokens[:len(base.tokens)] == base.tokens
    clean = clean_session(model, base, s.tokens)
    same_state(s, clean, exact=False)
    if model.backend != "metal-sim":
        close(continuation(model, s), continuation(model, clean))
    path = tmp_path / "s.safetensors"
    s.save(path)
    same_state(qm.Session.load(path, model), s)


def check_one_of(s, outcomes):
    """`s` is exactly one of `outcomes` (sessions)."""
    match = [o for o in outcomes if o.tokens == s.tokens]
    assert match, f"session tokens {s.tokens} are neither before nor after the call"
    same_state(s, match[0])


def check_cache(model):
    """Every prefix-cache entry holds the state (and logits) of exactly its tokens."""
    empty = model.new_session()
    for e in list(model.prefix_cache._entries.values()):
        s = model.new_session()
        s.restore(e.snapshot)
        clean = clean_session(model, empty, e.tokens)
        same_state(s, clean, exact=False)
        if e.logits is not None:
            close(e.logits, model.prefill(clean_session(model, empty, e.tokens[:-1]), [e.tokens[-1]]))


# ---------------------------------------------------------------------------------------------------
# SIGINT at the k-th Python line
# ---------------------------------------------------------------------------------------------------
class LineSignal:
    """sys.settrace hook: SIGINT raised (signal.raise_signal: the handler in force runs right there, as for
    a signal arriving at that line) at the k-th line event in a frame of qwenmetal's modules."""

    def __init__(self, k: int):
        self.k, self.seen = k, 0

    def __call__(self, frame, event, arg):
        return self.line if frame.f_code.co_filename.startswith(QM_DIR) else None

    def line(self, frame, event, arg):
        if event == "line":
            self.seen += 1
            if self.seen == self.k:
                signal.raise_signal(signal.SIGINT)
        return self.line


def run_with_signal_at(fn, k):
    """Run fn() with SIGINT at the k-th line; (lines seen, whether fn completed)."""
    hook = LineSignal(k)
    sys.settrace(hook)
    try:
        fn()
        done = True
    except KeyboardInterrupt:
        done = False
    finally:
        sys.settrace(None)
    return hook.seen, done


def points(fn_factory, samples: int, tail: int = 0):
    """A sample of k over the whole call fn_factory() (its line count n measured on an uninterrupted run,
    the factory's own work untraced): evenly spread and random points, and every one of the last `tail`
    lines (where a call commits)."""
    n, done = run_with_signal_at(fn_factory(), 0)
    assert done and n > 0
    rng = np.random.default_rng(n)
    ks = set(np.linspace(1, n, max(samples // 2, 2)).astype(int)) | set(rng.integers(1, n + 1, samples // 2))
    ks |= set(range(max(1, n - tail + 1), n + 1))
    return sorted(int(k) for k in ks)


def session_at(model, tokens):
    s = model.new_session()
    if tokens:
        model.prefill(s, tokens)
    return s


@pytest.mark.parametrize("call", ["prefill", "decode_step", "restore", "reset", "fork"])
def test_one_step_calls_are_all_or_nothing(model, call):
    head, prompt, samples = INPUTS[model.backend]
    base = session_at(model, head)
    other = session_at(model, prompt).snapshot()
    after = base.fork()
    run = {"prefill": lambda s: model.prefill(s, prompt), "decode_step": lambda s: model.decode_step(s, 77),
           "restore": lambda s: s.restore(other), "reset": lambda s: s.reset(), "fork": lambda s: s.fork()}[call]
    run(after)
    interrupted = 0
    for k in points(lambda: partial(run, base.fork()), samples, tail=12):
        s = base.fork()
        _, done = run_with_signal_at(lambda: run(s), k)
        interrupted += not done
        check_one_of(s, [base] if call == "fork" else [base, after])   # fork: its source never changes
    assert interrupted > 0


def test_interrupted_session_roundtrips(model, tmp_path):
    """A session interrupted part-way through a prefill saves and loads as it is."""
    head, prompt, samples = INPUTS[model.backend]
    base = session_at(model, head)
    ks = points(lambda: partial(model.prefill, base.fork(), prompt), samples)
    s = base.fork()
    run_with_signal_at(lambda: model.prefill(s, prompt), ks[len(ks) // 2])
    check_consistent(model, s, base, tmp_path)


def test_generate_with_session_stops_at_a_token_boundary(model, tmp_path):
    head, prompt, samples = INPUTS[model.backend]
    base = session_at(model, head)

    def gen(s):
        return lambda: list(model.generate(prompt, session=s, max_tokens=4, temperature=0, ignore_eos=True))

    clean = base.fork()
    gen(clean)()
    interrupted = 0
    for k in points(lambda: gen(base.fork()), samples):
        model.prefix_cache.clear()
        s = base.fork()
        _, done = run_with_signal_at(gen(s), k)
        interrupted += not done
        # a prefix of the uninterrupted run's tokens (prompt, then the generated ones fed back)
        assert s.tokens == clean.tokens[:len(s.tokens)]
        check_consistent(model, s, base, tmp_path)
        check_cache(model)
    assert interrupted > 0


def test_chat_keeps_the_prefix_cache_consistent(host_model):
    model = host_model
    msgs = [{"role": "user", "content": "hello there"}]
    more = msgs + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "and then?"}]

    def chat():
        model.chat(msgs, max_tokens=3, temperature=0)
        model.chat(more, max_tokens=3, temperature=0)    # reuses the first turn's cache entries

    def fresh():
        model.prefix_cache.clear()
        return chat

    interrupted = 0
    for k in points(fresh, SAMPLES):
        model.prefix_cache.clear()
        _, done = run_with_signal_at(chat, k)
        interrupted += not done
        check_cache(model)
    assert interrupted > 0
    model.prefix_cache.clear()


# ---------------------------------------------------------------------------------------------------
# a real SIGINT in the middle of C++ compute
# ---------------------------------------------------------------------------------------------------
def interrupt_after(delay, call):
    """Run call() with SIGINT sent to the main thread after `delay` s from another thread:
    (seconds until the call ended, whether the KeyboardInterrupt came out of the call, returned)."""
    timer = threading.Timer(delay, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    returned = inside = False
    t0 = time.perf_counter()
    try:
        try:
            timer.start()
            try:
                call()
                returned = True
            except KeyboardInterrupt:
                inside = True
            elapsed = time.perf_counter() - t0
        finally:
            timer.join()                       # a late signal is delivered here at the latest ...
            for _ in range(1000):              # ... or on these bytecodes
                pass
    except KeyboardInterrupt:
        pass
    return elapsed, inside, returned


def interrupt_mid_compute(model, s, call, clean_seconds, reps=3):
    """SIGINT at random points inside call() (which takes `clean_seconds` uninterrupted): each time the
    interrupt comes out of the call part-way and the session is exactly as before it."""
    before = s.fork()
    rng = np.random.default_rng(0)
    latencies = []
    for _ in range(reps):
        delay = float(rng.uniform(0.15, 0.5)) * clean_seconds
        elapsed, inside, returned = interrupt_after(delay, call)
        assert inside and not returned, "the interrupt did not come out of the call"
        same_state(s, before)
        assert elapsed < clean_seconds
        latencies.append(elapsed - delay)
    print(f"{model.backend}: call {clean_seconds:.2f} s, interrupt latency {max(latencies) * 1e3:.1f} ms max")


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_sigint_mid_cpu_prefill():
    m = qm.Model.load(cached_checkpoint("tiny", "mlx-q4", seed=0), backend="cpu", threads=2, prefill_chunk=8)
    s = session_at(m, [5, 17, 3])
    ids = list(np.random.default_rng(1).integers(0, 250, 600))
    while (t := timed(lambda: m.prefill(s.fork(), ids, return_logits="none"))) < 0.4 and 2 * len(ids) < 4000:
        ids = ids * 2                           # enough chunks to take ~0.5 s on this machine
    interrupt_mid_compute(m, s, lambda: m.prefill(s, ids, return_logits="none"), t)


def test_sigint_mid_metal_sim_prefill_and_decode():
    m = load("metal-sim")
    s = session_at(m, [5, 17])
    ids = [250, 1, 0, 64, 9, 33]
    interrupt_mid_compute(m, s, lambda: m.prefill(s, ids), timed(lambda: m.prefill(s.fork(), ids)), reps=2)
    be = m._backend

    def decode(f):                              # the GPU decode loop as generate runs it
        return lambda: be.decode(f._state, 7, 6, consumed=f._tokens)

    interrupt_mid_compute(m, s, decode(s), timed(decode(s.fork())), reps=2)


# ---------------------------------------------------------------------------------------------------
# the CLI
# ---------------------------------------------------------------------------------------------------
def test_cli_generate_interrupted_prints_one_line(tmp_path):
    ck = cached_checkpoint("tiny", "mlx-q4", seed=0)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    p = subprocess.Popen([sys.executable, "-m", "qwenmetal.cli", "generate", "--model", str(ck), "--backend",
                          "reference", "--prompt", "hello", "--max-tokens", "4000", "--ignore-eos", "--quiet",
                          "--temperature", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert p.stdout.read(1), "no output before the interrupt"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err.decode()
    assert err.decode() == "qwenmetal: interrupted\n"

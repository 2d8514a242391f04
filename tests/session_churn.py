"""Session churn for the leak checks (tests/test_sanitizers.py, docs/verification.md "Sanitizers").

``churn(model, n)`` creates ``n`` sessions from a prefilled base session and forks, snapshots, restores
and frees each one; every ``decode_every``-th session also decodes a token (the allocation path of a
growing KV cache). Run as a script it loads the tiny fixture on each backend named on the command line,
churns, drops everything and asks LeakSanitizer for a leak check *before* interpreter shutdown (Python
does not free everything at exit, which is not ours to fix), then leaves with ``os._exit``:

    python tests/session_churn.py N cpu metal-sim [--plant-leak]

``python tests/session_churn.py --rss BACKEND N`` prints the VmRSS growth over the churn (``rss_churn``),
measured in a process of its own so that the rest of a test run's allocations do not blur it.

Exit status: 0 no leak, 23 leaks reported (the report is on stderr). ``--plant-leak`` exports a cpu session's state
(``CpuState._export``: bf16 KV rows in a buffer that the extension allocates with ``new[]`` and frees through
a capsule) and raises one array's reference count with nobody holding the reference (``Py_IncRef`` through
ctypes): the extension's buffer becomes unreachable, as it would if a binding lost an owner, so the check
is shown to fail on a leak of memory that our code allocated.
"""
from __future__ import annotations

import ctypes
import gc
import os
import sys

PROMPT = [5, 17, 3, 99, 42]
LEAK_EXIT = 23


def churn(model, n: int, decode_every: int = 1) -> None:
    """Create, fork, snapshot, restore and free ``n`` sessions of ``model``."""
    base = model.new_session()
    model.prefill(base, PROMPT)
    for i in range(n):
        s = base.fork()
        snap = s.snapshot()
        f = s.fork()
        if i % decode_every == 0:
            model.decode_step(f, 7)
        f.restore(snap)
        assert f.position == len(PROMPT) and s.nbytes > 0
        del s, snap, f


# metal-sim runs a decode step through the simulator (~1 s on a tiny fixture): 1 in 100 sessions decodes
DECODE_EVERY = {"cpu": 1, "metal-sim": 100}


def load_tiny(backend: str):
    """The tiny fixture checkpoint on ``backend`` (cached by qwenmetal.testing)."""
    import qwenmetal as qm
    from qwenmetal.testing import cached_checkpoint

    opts = {"threads": 2} if backend == "cpu" else {}
    return qm.Model.load(cached_checkpoint("tiny", "mlx-q4", seed=0), backend=backend, **opts)


def _churn_backends(argv: list[str]) -> None:
    n = int(argv[0])
    plant = "--plant-leak" in argv
    for backend in [a for a in argv[1:] if not a.startswith("--")]:
        model = load_tiny(backend)
        churn(model, n, DECODE_EVERY[backend])
        if plant and backend == "cpu":
            s = model.new_session()
            model.prefill(s, PROMPT)
            _, kv, _, _ = s._state._export()
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(kv[0]))


def _leak_check_and_exit() -> None:
    # called with no Python frame of ours holding objects: CPython 3.11 keeps frames in mmap'd chunks
    # that LeakSanitizer does not scan, so an object referenced only by a live frame looks leaked
    gc.collect()
    found = ctypes.CDLL(None).__lsan_do_recoverable_leak_check()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(LEAK_EXIT if found else 0)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def rss_churn(backend: str, n: int) -> dict:
    """VmRSS growth (KiB) over ``n`` churned sessions after a 100-session warm-up, and the growth with
    ``n`` forks kept alive (what a leak of that size would look like)."""
    model = load_tiny(backend)
    churn(model, 100, DECODE_EVERY[backend])          # warm-up: pools, scratch, allocator arenas
    gc.collect()
    before = _rss_kib()
    churn(model, n, DECODE_EVERY[backend])
    gc.collect()
    grown = _rss_kib() - before
    base = model.new_session()
    model.prefill(base, PROMPT)
    kept = [base.fork() for _ in range(n)]
    retained = _rss_kib() - before - grown
    del kept
    return {"backend": backend, "before_kib": before, "grown_kib": grown, "retained_kib": retained}


if __name__ == "__main__":
    if sys.argv[1] == "--rss":                        # python tests/session_churn.py --rss BACKEND N
        import json
        print(json.dumps(rss_churn(sys.argv[2], int(sys.argv[3]))))
        sys.exit(0)
    _churn_backends(sys.argv[1:])
    _leak_check_and_exit()

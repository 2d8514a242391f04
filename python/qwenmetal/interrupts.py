"""Keeping a session's Python-side commits whole under Ctrl-C.

A session's state and its token list must change together. The C++ backends append the tokens inside
the engine call (the GIL is held there, so no signal handler can run in between); the Python-side
commits (the reference backend's forward, ``Session.restore`` / ``reset``) make a few stores in a row
and run them under :func:`sigint_deferred`, so a SIGINT arriving in between is delivered right after
the last one. See docs/api.md, "Interrupts".
"""
from __future__ import annotations

import signal
import threading


class sigint_deferred:
    """Context manager: a SIGINT delivered inside the block is held and re-delivered (to the handler that
    was installed before, normally raising KeyboardInterrupt) when the block ends. Only on the main
    thread, the only one Python delivers signals to; elsewhere, and when SIGINT is ignored or not
    handled by Python, it does nothing. Nests."""

    __slots__ = ("_old", "_held")

    def __enter__(self) -> "sigint_deferred":
        self._old = None
        self._held = False
        if threading.current_thread() is threading.main_thread():
            old = signal.getsignal(signal.SIGINT)
            if callable(old):
                signal.signal(signal.SIGINT, self._hold)
                self._old = old
        return self

    def _hold(self, signum, frame) -> None:
        self._held = True

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            if self._held:
                signal.raise_signal(signal.SIGINT)

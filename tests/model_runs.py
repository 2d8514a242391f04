"""Whole-model runs shared by the backend tests (tests/test_cpu_engine.py, tests/metal/test_backend.py)."""
import numpy as np


def rel_range_err(got, want) -> float:
    """max |got - want| relative to the range of `want` (the logit range for logits)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(want.max() - want.min(), 1e-30))


def run_greedy(model, ids, n):
    """Prefill logits of every position, then n greedy steps: (prefill [L,V], decode rows [n,V], tokens)."""
    s = model.new_session()
    pre = model.prefill(s, ids, return_logits="all")
    toks, rows = [int(np.argmax(pre[-1]))], []
    for _ in range(n):
        rows.append(model.decode_step(s, toks[-1]))
        toks.append(int(np.argmax(rows[-1])))
    return pre, np.stack(rows), toks

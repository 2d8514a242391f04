"""Whole-model runs shared by the backend tests (tests/test_cpu_engine.py, tests/metal/test_backend.py) and
the generation tests' model."""
import numpy as np

from qwenmetal.accuracy import run_greedy  # noqa: F401  (re-exported: the tests' whole-model runs)


def rel_range_err(got, want) -> float:
    """max |got - want| relative to the range of `want` (the logit range for logits)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(want.max() - want.min(), 1e-30))


def uncached_reference_model(directory):
    """The tiny mlx-q4 fixture (seed 4) written to `directory`, on the reference backend, without a prefix
    cache: the model of the generation tests (tests/test_generate.py, tests/test_stop_strings.py)."""
    import qwenmetal as qm
    from qwenmetal.testing import make_checkpoint

    m = qm.Model.load(make_checkpoint(directory, "tiny", "mlx-q4", seed=4), backend="reference")
    m.prefix_cache = None
    return m

"""Shared pytest setup.

* ``require(name)`` (fixture, and the plain function ``oracles.require``): import an optional test
  dependency. With ``CI=true`` a missing module fails the test with its ImportError; elsewhere the test
  is skipped (``pytest.importorskip``).
* ``oracle``: session-wide cache of the random HF models, their saved checkpoints, mlx-lm conversions
  and the peers' logits (see ``tests/oracles.py``), so every oracle test builds each thing once.
* ``spawned_ckpt`` / ``spawned_url``: the tiny checkpoint and one ``qwenmetal serve`` process on loopback
  serving it (``tests/live_server.py``), shared by the modules that drive it with the official clients;
  ``openai_client``: the official openai client on it; ``spawned_local``: the same checkpoint loaded in
  this process (reference backend, no prefix cache), for expected outputs.

No marks are registered: every test runs by default.
"""
import importlib.util
import os
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
_ROOT = _TESTS.parent

if str(_TESTS) not in sys.path:           # `import oracles` from any test module / rootdir
    sys.path.insert(0, str(_TESTS))
if importlib.util.find_spec("qwenmetal") is None and (_ROOT / "python" / "qwenmetal").is_dir():
    sys.path.insert(0, str(_ROOT / "python"))  # source checkout without `pip install -e .`

from oracles import require as _require  # noqa: E402


@pytest.fixture(scope="session")
def require():
    """``require("torch")`` -> the module, or skip (fail when CI=true)."""
    return _require


@pytest.fixture(scope="session")
def oracle(tmp_path_factory):
    """The session's :class:`oracles.OracleCache` (needs torch + transformers)."""
    for m in ("torch", "transformers"):
        _require(m)
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    from oracles import OracleCache

    return OracleCache(tmp_path_factory.mktemp("oracles"))


@pytest.fixture(scope="session")
def spawned_ckpt(tmp_path_factory):
    """The tiny mlx-q4 checkpoint the spawned server serves."""
    from qwenmetal.testing import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("srv") / "ck", "tiny", "mlx-q4", seed=3)


@pytest.fixture(scope="session")
def spawned_url(spawned_ckpt, tmp_path_factory):
    """The base URL of ``qwenmetal serve`` on `spawned_ckpt` (`live_server.spawned_args`), one process per
    session."""
    for m in ("starlette", "uvicorn", "httpx"):
        _require(m)
    from live_server import spawned_args, spawned_server

    with spawned_server(spawned_args(spawned_ckpt), tmp_path_factory.mktemp("srvlog") / "server.log") as (_, base):
        yield base


@pytest.fixture(scope="session")
def openai_client(spawned_url):
    """The official openai client on the spawned server."""
    openai = _require("openai")
    from live_server import API_KEY

    return openai.OpenAI(base_url=spawned_url + "/v1", api_key=API_KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="session")
def spawned_local(spawned_ckpt):
    """The spawned server's checkpoint in this process (reference, prefix cache off), for expected outputs."""
    import qwenmetal as qm

    m = qm.Model.load(spawned_ckpt, backend="reference")
    m.prefix_cache = None
    return m

"""Shared pytest setup.

* ``require(name)`` (fixture, and the plain function ``oracles.require``): import an optional test
  dependency. With ``CI=true`` a missing module fails the test with its ImportError; elsewhere the test
  is skipped (``pytest.importorskip``).
* ``oracle``: session-wide cache of the random HF models, their saved checkpoints, mlx-lm conversions
  and the peers' logits (see ``tests/oracles.py``), so every oracle test builds each thing once.
* ``server_checkpoint``, ``server``, ``client`` (per test module): a tiny random checkpoint, ``qwenmetal
  serve`` running it in a subprocess on loopback (``tests/live_server.py``: its base URL) and the official
  openai client on it.

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


@pytest.fixture(scope="module")
def server_checkpoint(tmp_path_factory):
    """The checkpoint the ``server`` fixture serves (tiny, random, mlx-q4)."""
    from qwenmetal.testing import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("srv") / "ck", "tiny", "mlx-q4", seed=3)


@pytest.fixture(scope="module")
def server(server_checkpoint, tmp_path_factory):
    """The base URL of ``qwenmetal serve`` on `server_checkpoint` (``live_server.SERVE_ARGS``)."""
    from live_server import SERVE_ARGS, spawned_server

    for m in ("starlette", "uvicorn", "httpx"):
        _require(m)
    with spawned_server(["--model", str(server_checkpoint), *SERVE_ARGS],
                        tmp_path_factory.mktemp("srvlog") / "server.log") as (_, base):
        yield base


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on `server`."""
    from live_server import API_KEY

    openai = _require("openai")
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, timeout=60, max_retries=0)

"""A real ``qwenmetal serve`` for tests: a subprocess on 127.0.0.1 and a free port (`spawned_server`), with
the settings the server tests share (`API_KEY`, `NAME`, `MAX_BODY`, `SERVE_ARGS`). The fixtures ``server``
(its base URL, one server per test module) and ``client`` (the official openai client on it) are in
tests/conftest.py; tests/test_server.py, tests/test_api_responses.py and tests/test_server_soak.py use them."""
import contextlib
import os
import socket
import subprocess
import sys
import time

API_KEY = "sk-test-key"
NAME = "tiny"
MAX_BODY = 64 * 1024
#: ``qwenmetal serve`` arguments of the ``server`` fixture (after ``--model``)
SERVE_ARGS = ["--api-key", API_KEY, "--served-model-name", NAME, "--max-request-bytes", str(MAX_BODY),
              "--log-level", "warning", "--backend", "reference"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def spawned_server(args, log):
    """``qwenmetal serve ARGS`` on 127.0.0.1 and a free port, as a subprocess writing to `log`; yields
    (process, base url) once /health answers, and stops the process on exit."""
    import httpx

    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "qwenmetal.cli", "serve", "--port", str(port), *args],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{log.read_text()}")
            time.sleep(0.2)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    assert proc.returncode is not None

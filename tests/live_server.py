"""Servers on loopback for tests, each on a free port: `live_server(model, **create_app options)` runs the
app in this process (uvicorn on a thread) and yields its base URL; `spawned_server(args, log)` runs
``qwenmetal serve ARGS`` as a subprocess. `API_KEY`, `NAME`, `MAX_BODY` and `SERVE_ARGS` are the settings of
the ``server`` fixture (tests/conftest.py: one spawned server per test module, and ``client``, the official
openai client on it), which tests/test_server.py and tests/test_api_responses.py use."""
import contextlib
import os
import socket
import subprocess
import sys
import threading
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
def live_server(model, **opts):
    from qwenmetal.server import create_app, uvicorn_server

    port = free_port()
    srv = uvicorn_server(create_app(model, **opts), "127.0.0.1", port, log_level="warning")
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert th.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        th.join(30)
        assert not th.is_alive(), "the server did not shut down"


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

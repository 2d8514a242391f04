"""qwenmetal servers on loopback, for the tests that drive them with real clients.

- `live_server(model, **create_app options)`: a server in this process (uvicorn on a thread, a free port);
  yields its base URL and shuts it down afterwards.
- `spawned_server(args, log)`: ``qwenmetal serve ARGS`` as a separate process. The session fixtures
  ``spawned_ckpt`` and ``spawned_url`` (tests/conftest.py) share one such server, with the settings below
  (`spawned_args`), between every module that uses it (tests/test_server.py with the openai client,
  tests/test_api_anthropic.py with the anthropic client); tests/test_server_soak.py starts its own.
"""
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(model, **opts):
    from oracles import require

    require("uvicorn")
    require("starlette")
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


def spawned_args(ckpt) -> list:
    """The shared spawned server's arguments: the tiny checkpoint on the reference backend, with a key and a
    small body limit."""
    return ["--model", str(ckpt), "--api-key", API_KEY, "--served-model-name", NAME, "--max-request-bytes",
            str(MAX_BODY), "--log-level", "warning", "--backend", "reference"]

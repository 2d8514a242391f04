"""A qwenmetal server on loopback in this process: `live_server(model, **create_app options)` yields its
base URL (uvicorn on a thread, a free port) and shuts it down afterwards."""
import contextlib
import socket
import threading
import time


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

"""Run an ASGI app (an engine server, the router) with uvicorn on a thread, on a loopback socket.

For tests and benchmarks that need a real HTTP server in this process; `rollwise serve ...` runs
uvicorn in the foreground instead.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


def free_port() -> int:
    """A loopback port free right now (for a server started in another process, which binds it itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app: Any, sock: socket.socket | None = None, *, start_timeout_s: float = 60.0,
                    stop_timeout_s: float = 30.0) -> Iterator[tuple[str, Any]]:
    """Serve `app` until the block ends; yields (base url, uvicorn.Server). Without `sock`, a free
    loopback port is bound here (before the server starts, so there is no race for the port)."""
    import uvicorn

    if sock is None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError("the server did not start (see its log above)")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join(timeout=stop_timeout_s)
        sock.close()

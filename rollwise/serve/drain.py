"""Running a rollwise server so that SIGTERM drains it instead of cutting its requests off.

On the first SIGTERM the front starts draining (rollwise.serve.gate): /ready answers 503 and new requests get
503 with Retry-After; the listening sockets close at the next tick, so new connections go elsewhere (a router
started with --reuse-port on the same port takes them). Requests already in flight finish; once none is left, or
--drain-timeout has passed, uvicorn shuts down as usual (lifespan shutdown: engines closed, state written) and
the process exits 0: a drain asked for is a clean stop. A second SIGTERM, or Ctrl-C, stops at once (uvicorn's
own handling).
"""

from __future__ import annotations

import signal
import socket
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from rollwise.serve.front import Front

CLOSE_AFTER_DRAIN_S = 1.0  # what uvicorn waits, after the drain, for connections to close


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM drains `front` (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, front: Front) -> None:
        super().__init__(config)
        self.front = front
        self.drain_deadline: float | None = None
        self.listening = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.drain_deadline is None and not self.should_exit:
            # Only flags here (a signal handler runs between any two bytecodes of the loop); on_tick acts on them.
            self.drain_deadline = time.monotonic() + self.front.settings.drain_timeout_s
            self.front.gate.draining = True
            return  # not recorded as captured: uvicorn does not re-raise it, the process exits 0
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            if self.listening:
                for server in self.servers:
                    server.close()  # no new connections; requests on open ones get 503
                self.listening = False
            if self.front.gate.in_flight <= 0 or time.monotonic() >= self.drain_deadline:
                self.should_exit = True
        return await super().on_tick(counter)


def server_for(app: FastAPI, front: Front, **config: object) -> DrainingServer:
    """The uvicorn server for `app` with its front's log level and drain; `config`: more uvicorn.Config fields."""
    settings = front.settings
    return DrainingServer(uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                                         timeout_graceful_shutdown=CLOSE_AFTER_DRAIN_S, **config), front)


def serve_app(app: FastAPI, front: Front, sockets: list[socket.socket] | None = None) -> None:
    """Serve until stopped: SIGTERM drains, then returns; Ctrl-C stops at once (KeyboardInterrupt)."""
    server_for(app, front).run(sockets=sockets)

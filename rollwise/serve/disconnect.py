"""Stop work for a client that left: a non-streaming request whose client closed its connection is cancelled.

Streaming responses notice a closed connection on their own (Starlette stops the generator); a plain JSON answer
is only written at the end, so without this an abandoned request kept its engine slots until it finished
(22-24 s of generation nobody read).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response

T = TypeVar("T")


class ClientGone(Exception):
    """The client left before its answer was ready; the work was cancelled (its cleanup aborted it)."""


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client of `request` closes its connection. The body was read already, so the next ASGI
    message is the disconnect (uvicorn sends it as soon as the socket closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work` in this task unless the client leaves first: then it is cancelled and ClientGone raised.
    One watcher task cancels this one (cheaper per request than running `work` as a second task and
    asyncio.wait over both: the router calls this on its hot path)."""
    this = asyncio.current_task()
    assert this is not None  # called from a request handler's task
    left = False

    async def watch() -> None:
        nonlocal left
        await wait_for_disconnect(request)
        left = True
        this.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not left:  # this handler itself was cancelled (shutdown): the work went with it
            raise
        if hasattr(this, "uncancel"):  # Python 3.11+: this task goes on (to answer 499), no longer cancelled
            this.uncancel()
        raise ClientGone from None
    finally:
        watcher.cancel()


async def client_gone(request: Request, exc: ClientGone) -> Response:
    """The exception handler: 499 (nginx's "client closed request"), which nobody reads."""
    return Response(status_code=499)

"""Stop work for a client that left: a non-streaming request whose client closed its connection is cancelled.

Streaming responses notice a closed connection on their own (Starlette stops the generator); a plain JSON answer
is only written at the end, so without this an abandoned request kept its engine slots until it finished
(22-24 s of generation nobody read).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

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


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await `work` unless the client leaves first: then cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled (shutdown): the work goes with it
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    raise ClientGone


async def client_gone(request: Request, exc: ClientGone) -> Response:
    """The exception handler: 499 (nginx's "client closed request"), which nobody reads."""
    return Response(status_code=499)

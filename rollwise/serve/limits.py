"""A request-body size limit for every rollwise HTTP server, checked before any handler runs.

A 10 MB prompt used to reach the tokenizer on the event loop and stall `/health` for seconds, so the router
marked a healthy replica down. This middleware answers 413 as soon as the declared `Content-Length` (or the
bytes received so far, for chunked bodies) pass the limit: nothing is parsed, nothing is buffered beyond it.
It is plain ASGI rather than a Starlette `BaseHTTPMiddleware` because that one reads the whole body first.

The 413 names the field that carries the route's bulk (`messages` on a chat route, `prompt` on completions...),
known from the path alone: the body is refused unread, so it is the route's bulky field that is named (and in
`param`), not a measurement of which field was large.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024

# (path ending, the field that makes that route's bodies large): the ending matches every server's spelling,
# e.g. /v1/chat/completions and the agent proxy's /sessions/{id}/v1/chat/completions. First match wins.
BULK_FIELDS = (
    ("/chat/completions", "messages"),
    ("/completions", "prompt"),
    ("/inference/v1/generate", "token_ids"),
    ("/generate", "prompt_ids"),
    ("/score", "sequences"),  # the engine server's batch of sequences to score (a teacher engine)
    ("/requests", "requests"),  # the pool's batch of requests for a job
    ("/forward_backward", "data"),  # the Tinker service's protobuf batch of datums
    ("/asample", "prompt"),
)


def bulk_field(path: str) -> str | None:
    """The field that carries the bulk of a request body sent to `path`, if the route has one."""
    return next((name for ending, name in BULK_FIELDS if path.rstrip("/").endswith(ending)), None)


def check_max_request_bytes(max_bytes: int, option: str = "--max-request-bytes") -> int:
    """Refuse a limit that would refuse every request (at start-up, not at the first request)."""
    if max_bytes < 1:
        raise ValueError(f"{option} must be >= 1 byte, got {max_bytes}")
    return max_bytes


def too_large_body(limit: int, option: str, field: str | None = None, size: int | None = None) -> bytes:
    body = "request body" if size is None else f"request body of {size} bytes"
    fix = f"send fewer or shorter {field}" if field else "send a smaller request"
    message = f"{body} exceeds {limit} bytes; {fix}, or raise the server's {option}"
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": field,
                                 "code": "request_too_large"}}).encode()


class RequestSizeLimit:
    """ASGI middleware: refuse bodies over `max_bytes` with 413. `option` names the setting that raises it
    (e.g. "--max-request-bytes"), so the error says what to do. `exempt(scope)` true: no limit for that request
    (the pool's weight uploads, raw bytes as large as the model)."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 option: str = "--max-request-bytes", exempt: Callable[[Scope], bool] | None = None) -> None:
        check_max_request_bytes(max_bytes, option)
        self.app, self.max_bytes, self.option, self.exempt = app, max_bytes, option, exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (self.exempt is not None and self.exempt(scope)):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:  # the server holds the body to its declared length
            if declared.isdigit() and int(declared) > self.max_bytes:
                await self._refuse(scope, send, int(declared))
                return
            await self.app(scope, receive, send)
            return
        # A chunked body: read it here, up to the limit, then hand it over. (Refusing from inside the app's
        # receive does not work: FastAPI turns any error while it reads the body into its own 400.)
        messages: list[Message] = []
        received = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client left
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                await self._refuse(scope, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, send: Send, size: int | None = None) -> None:
        body = too_large_body(self.max_bytes, self.option, bulk_field(scope.get("path", "")), size)
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

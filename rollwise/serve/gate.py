"""The gate every request of a rollwise server passes first: drain, API key, per-key in-flight bound, metrics.

One plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which reads bodies and hides the client's
disconnect), outermost on every server, so the same rule holds on each of them:

- draining (SIGTERM was received, rollwise.serve.drain): a new request gets 503 with Retry-After; requests
  already in flight finish;
- with API keys, every route needs `Authorization: Bearer KEY` (401 naming what to send), except the public
  probes (/health, /ready, /metrics) and the routes the app guards with a secret of its own (the pool's job
  tokens): `own_auth(method, path)`;
- a key holds at most `max_in_flight_per_key` requests at once (429 with Retry-After);
- every answer is counted by route template and status, its time until the response starts observed
  (rollwise.serve.front_metrics).

Refusals are the servers' error envelope (rollwise.serve.errors), rendered here: the gate sits outside the app's
exception handlers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from rollwise.serve.auth import ANONYMOUS, CALLER_STATE, ApiKeys
from rollwise.serve.errors import APIError
from rollwise.serve.front_metrics import FrontMetrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes: no key, never refused while draining
DRAIN_RETRY_AFTER_S = 5


def no_own_auth(method: str, path: str) -> bool:
    """Every non-public route needs an API key (the default)."""
    return False


class GateState:
    """What the gate shares with the rest of the front: whether the server drains, what is in flight."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self.by_key: dict[str, int] = {}
        self._lock = threading.Lock()  # in-process servers may run apps on several loops (tests)

    def enter(self, label: str, limit: int | None) -> bool:
        with self._lock:
            held = self.by_key.get(label, 0)
            if limit is not None and held >= limit:
                return False
            self.by_key[label] = held + 1
            self.in_flight += 1
            return True

    def leave(self, label: str) -> None:
        with self._lock:
            self.in_flight -= 1
            left = self.by_key.get(label, 0) - 1
            if left > 0:
                self.by_key[label] = left
            else:
                self.by_key.pop(label, None)


def bearer_token(scope: Scope) -> str | None:
    """The sent key: `Authorization: Bearer KEY`, else `X-API-Key: KEY` (the header the `tinker` SDK sends)."""
    api_key = None
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
        if name == b"x-api-key":
            api_key = value.decode("latin-1").strip()
    return api_key


class FrontGate:
    """ASGI middleware (see the module docstring). `keys` None: every caller is ANONYMOUS (one bucket for the
    in-flight bound)."""

    def __init__(self, app: ASGIApp, state: GateState, metrics: FrontMetrics, keys: ApiKeys | None = None,
                 max_in_flight_per_key: int | None = None, own_auth: Callable[[str, str], bool] = no_own_auth
                 ) -> None:
        self.app, self.state, self.metrics, self.keys = app, state, metrics, keys
        self.max_in_flight_per_key, self.own_auth = max_in_flight_per_key, own_auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        started = time.monotonic()
        status = [500]

        async def observed(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                self.metrics.observe_start(scope, status[0], time.monotonic() - started)
            await send(message)

        if path in PUBLIC_PATHS:
            await self.app(scope, receive, observed)
            return
        try:
            label = self._admit(scope, path)
        except APIError as refusal:
            await refusal.response()(scope, receive, observed)
            return
        scope.setdefault("state", {})[CALLER_STATE] = label  # the app's caller_dependency reads it (no second check)
        try:
            await self.app(scope, receive, observed)
        finally:
            self.state.leave(label)

    def _admit(self, scope: Scope, path: str) -> str:
        """The caller's key label, counted in flight; or the refusal (503 draining, 401 key, 429 bound)."""
        if self.state.draining:
            raise APIError(503, "the server is shutting down (draining after SIGTERM): send the request to another "
                           "replica or retry after it restarts", None, "server_error", "draining",
                           headers={"Retry-After": str(DRAIN_RETRY_AFTER_S), "Connection": "close"})
        label = ANONYMOUS
        if self.keys is not None and not self.own_auth(scope["method"], path):
            label = self.keys.check(bearer_token(scope))
        if not self.state.enter(label, self.max_in_flight_per_key):
            who = "this API key" if label != ANONYMOUS else "this server's callers (no API keys)"
            raise APIError(429, f"too many requests in flight: {who} already has {self.max_in_flight_per_key} "
                           f"(--max-in-flight-per-key={self.max_in_flight_per_key}); wait for one to finish",
                           None, "rate_limit_error", "quota_exceeded", headers={"Retry-After": "1"})
        return label

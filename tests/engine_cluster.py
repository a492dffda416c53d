"""Test helper: engine servers (tiny random model, prefix cache on) on loopback ports and rollwise's router in
front of them, for the modules that test routes through both. Not a test module itself."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import httpx

from rollwise.engine.server import build_engine, create_app
from rollwise.local_server import serve_in_thread
from rollwise.router.app import bind_socket
from rollwise.router.app import create_app as create_router_app
from rollwise.router.config import RouterConfig

MODEL = "tiny:0"


def engine_app():
    engine, tokenizer = build_engine(MODEL, max_num_seqs=4, max_model_len=256, seed=0, prefix_cache_tokens=4096)
    return create_app(engine, tokenizer, MODEL)


@contextlib.contextmanager
def engine_cluster(policy: str, replicas: int = 2, wrap_router: Callable[[Any], Any] | None = None
                   ) -> Iterator[SimpleNamespace]:
    """`replicas` engine servers and a router with `policy`: .replicas (urls), .router (url), .http (a client).
    `wrap_router` wraps the router's ASGI app (e.g. to record what clients send it)."""
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(engine_app()))[0] for _ in range(replicas)]
        config = RouterConfig(replicas=urls, policy=policy, health_interval_s=0.2, queue_timeout_s=30, model=MODEL)
        router_app = create_router_app(config)
        router, _ = stack.enter_context(serve_in_thread(wrap_router(router_app) if wrap_router else router_app,
                                                        bind_socket("127.0.0.1", 0, reuse_port=False)))
        http = stack.enter_context(httpx.Client(timeout=60))
        yield SimpleNamespace(replicas=urls, router=router, http=http)

"""The API process of `rollwise serve tinker`: stateless FastAPI over the store (rollwise.service.store).

Every accepted request becomes a durable row and is answered as a future (`{request_id, model_id}`); the worker
process runs the rows; `retrieve_future` reads them. So this process can be killed at any time: the supervisor
(rollwise.service.supervisor) starts a new one on the same port, and every accepted request still completes once.

The shared serving front (rollwise.serve.front) gives it the API keys (the SDK sends `X-API-Key`), the request
size limit (413), the error envelope, drain on SIGTERM, /health and /metrics. Run as
`python -m rollwise.service.api ARGS` (the supervisor does this with its own arguments).
"""

from __future__ import annotations

import os
import sys
import threading
import time

from fastapi import FastAPI

from rollwise.serve.drain import serve_app
from rollwise.serve.front import Front, install_front
from rollwise.service import futures, routes_sampling, routes_session, routes_training
from rollwise.service.api_common import ApiSettings
from rollwise.service.store import Store


def build_app(store: Store, front: Front, settings: ApiSettings | None = None) -> FastAPI:
    app = FastAPI(title="rollwise serve tinker", description="A Tinker-compatible training and sampling service")
    app.state.store = store
    app.state.api_settings = settings or ApiSettings()
    app.state.future_watch = futures.FutureWatch(store)
    for module in (routes_session, routes_training, routes_sampling, futures):
        app.include_router(module.router)
    install_front(app, front, ready=lambda: bool(store.bases()))
    return app


def exit_with_parent(parent: int) -> None:
    """The API child must not outlive its supervisor (a killed supervisor would leave the port taken)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    from rollwise.service.options import api_settings, build_parser, database_url

    args = build_parser().parse_args(argv)
    exit_with_parent(os.getppid())
    front = Front.from_args(args)
    store = Store(database_url(args))
    serve_app(build_app(store, front, api_settings(args)), front)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`POST /api/v1/retrieve_future`: the result of a request row, long-polled.

A pending row is held up to --long-poll seconds, then answered `{"type": "try_again", ...}` so the SDK polls
again. While held, the request waits on `FutureWatch`: one task per API process asks the store, in one query,
which of all awaited rows finished (every few ms), so a thousand waiting futures cost one query per tick, not a
thousand. A finished row answers its result: protobuf bytes (`application/x-protobuf`) for sample and
forward_backward, JSON otherwise; a failed row answers `{"error", "category"}` (the SDK's RequestFailedError;
"user" means the request was wrong and nothing was applied). A row of another key is 404 like an unknown id."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from tinker import types

from rollwise.service.api_common import PREFIX, caller, not_found, settings_of, store_of
from rollwise.service.store import Store

router = APIRouter(prefix=PREFIX)
PROTO = "application/x-protobuf"
TICK_S = 0.005
log = logging.getLogger("rollwise.service.futures")


class FutureWatch:
    """Wakes the requests waiting on rows once the worker finished them (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.waiting: dict[str, asyncio.Event] = {}
        self.task: asyncio.Task[None] | None = None

    async def wait(self, request_id: str, timeout: float) -> None:
        event = self.waiting.setdefault(request_id, asyncio.Event())
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._watch())
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            if self.waiting.get(request_id) is event:
                self.waiting.pop(request_id, None)

    async def _watch(self) -> None:
        while self.waiting:
            try:
                done = await run_in_threadpool(self.store.finished_among, list(self.waiting))
            except Exception:  # noqa: BLE001 - the database busy or briefly gone: the waiters time out, then poll again
                log.warning("checking futures failed", exc_info=True)
                done = set()
            for request_id in done:
                event = self.waiting.get(request_id)
                if event is not None:
                    event.set()
            await asyncio.sleep(TICK_S)


@router.post("/retrieve_future")
async def retrieve_future(request: Request, body: types.FutureRetrieveRequest) -> Response:
    store, label = store_of(request), caller(request)
    row = await run_in_threadpool(store.request, body.request_id)
    if row is None or row.owner != label:
        raise not_found("request_id", body.request_id)
    if row.status in ("queued", "running"):
        watch: FutureWatch = request.app.state.future_watch
        await watch.wait(body.request_id, settings_of(request).long_poll_s)
        row = await run_in_threadpool(store.request, body.request_id)
        assert row is not None
    if row.status == "done":
        media = PROTO if row.result_kind == "proto" else "application/json"
        return Response(row.result or b"{}", media_type=media)
    if row.status == "failed":
        return JSONResponse({"error": row.error, "category": row.category or "unknown"})
    return JSONResponse({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})

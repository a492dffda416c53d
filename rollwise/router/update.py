"""POST /update_weights_from_disk through the router: a rolling update, one replica at a time drained
(no new requests; those in flight finish, up to drain_timeout_s), paused, updated and resumed, while
the others keep serving."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from rollwise.router.core import Router
from rollwise.router.replicas import Replica
from rollwise.router.requests import RouterError, parse_object
from rollwise.router.upstream import upstream_url


class RollingUpdate:
    def __init__(self, router: Router) -> None:
        self.router = router
        self._running = asyncio.Lock()

    async def run(self, raw: bytes) -> dict[str, Any]:
        body = parse_object(raw)
        version = body.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise RouterError(400, "version must be an integer >= 0", "version")
        if not isinstance(body.get("path"), str) or not body["path"]:
            raise RouterError(400, "path must be a non-empty string (a path on the replicas' machine)", "path")
        drain = body.pop("drain_timeout_s", self.router.config.drain_timeout_s)
        if not isinstance(drain, (int, float)) or isinstance(drain, bool) or not 0 <= drain < float("inf"):
            raise RouterError(400, "drain_timeout_s must be a finite number >= 0", "drain_timeout_s")
        forward = json.dumps(body).encode()
        if self._running.locked():
            raise RouterError(409, "a rolling weight update is already running; wait for it to finish",
                              code="update_in_progress", retry_after=5)
        async with self._running:
            pool = self.router.pool
            updated: list[dict[str, Any]] = []
            skipped = [r.url for r in pool if not r.healthy]
            for replica in sorted((r for r in pool if r.healthy), key=lambda r: r.name):
                updated.append(await self._update_one(replica, forward, version, float(drain), updated))
            return {"policy_version": version, "updated": updated, "skipped_unhealthy": skipped}

    async def _update_one(self, replica: Replica, forward: bytes, version: int, drain_s: float,
                          done: list[dict[str, Any]]) -> dict[str, Any]:
        router = self.router
        started = time.monotonic()
        replica.draining = True
        try:
            deadline = started + drain_s
            while replica.in_flight and time.monotonic() < deadline:
                await router.pool.wait(min(0.2, deadline - time.monotonic()))
            drained = replica.in_flight == 0
            try:
                await router.http.post(upstream_url(replica, "/pause"), timeout=30)
                response = await router.http.post(upstream_url(replica, "/update_weights_from_disk"), content=forward,
                                                  headers={"content-type": "application/json"})
                await router.http.post(upstream_url(replica, "/resume"), timeout=30)
            except httpx.HTTPError as exc:
                router.failed(replica, f"{type(exc).__name__}: {exc}", connection=True)
                raise RouterError(502, f"replica {replica.url} failed during the weight update ({exc}); "
                                  f"{_done_note(done, version)}", kind="server_error", code="update_failed") from exc
            if response.status_code >= 400:
                raise _refused(replica, response, done, version)
            replica.policy_version = version
            router.forget_cache(replica)
            return {"replica": replica.url, "drained": drained, "seconds": round(time.monotonic() - started, 3)}
        finally:
            replica.draining = False
            router.pool.notify()


def _refused(replica: Replica, response: httpx.Response, done: list[dict[str, Any]], version: int) -> RouterError:
    try:
        error = response.json()["error"]
        message, param = error["message"], error.get("param")
    except (ValueError, KeyError, TypeError):
        message, param = response.text[:300], None
    status = response.status_code if response.status_code < 500 else 502
    kind = "invalid_request_error" if status < 500 else "server_error"
    return RouterError(status, f"replica {replica.url} refused the update: {message}; {_done_note(done, version)}",
                       param, kind, code="update_failed")


def _done_note(done: list[dict[str, Any]], version: int) -> str:
    if not done:
        return "no replica was changed"
    return (f"already at version {version}: {', '.join(d['replica'] for d in done)}; the others still serve "
            "their old version")

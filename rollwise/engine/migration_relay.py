"""The answers of requests migrated between engine servers (rollwise.engine.migration_http), from the target back to
each request's client on the source: one long poll per /migrate, shared by all the requests it moved.

On the target, each request migrated in is `Adopted`: its events (tokens, for a client that streams them, then its
finished samples) queue up until collected. `POST /migration/results {request_ids}` answers as soon as any of the
named requests has something (a token of a streamed request, or all its samples), with everything each of them has
then; `POST /migration/result {request_id}` is the same for one request. On the source, `relay_all` polls for every
request of one /migrate in one loop and hands each its events (EngineFrontend.relay): N streamed requests cost one
poll per batch of tokens, not N long polls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from prometheus_client.core import CounterMetricFamily

from rollwise.types.generation import Completion

if TYPE_CHECKING:
    from rollwise.engine.frontend import EngineFrontend


@dataclass(eq=False)
class Adopted:
    """A request migrated here whose client waits on another server: its events, and what is not collected yet."""

    queue: asyncio.Queue
    count: int  # samples to wait for
    done: list[Completion] = field(default_factory=list)  # those back so far
    tokens: list[tuple[int, int, float, int]] = field(default_factory=list)  # (index, token, logprob, version)
    error: str | None = None  # the engine failed: the client gets this

    def drain(self) -> None:
        """Take whatever its queue holds (never waits)."""
        while not self.queue.empty():
            self.take(self.queue.get_nowait())

    def take(self, events: list[tuple]) -> None:
        for event in events:
            if event[0] == "error":
                self.error = f"the engine failed: {event[1]}"
            elif event[0] == "token":
                self.tokens.append(event[2:])
            elif event[0] == "done":
                self.done.append(event[1])

    @property
    def finished(self) -> bool:
        return self.error is not None or len(self.done) >= self.count

    @property
    def ready(self) -> bool:
        """Something to answer with: all its samples back (or its error), or new tokens of a streamed request."""
        return self.finished or bool(self.tokens)

    def collect(self, request_id: str) -> dict[str, Any]:
        """What is new since the last collection (`done`: all of it; the caller forgets the request then)."""
        tokens, self.tokens = self.tokens, []
        if self.error is not None:
            return {"request_id": request_id, "done": True, "tokens": tokens, "completions": [], "error": self.error}
        if not self.finished:
            return {"request_id": request_id, "done": False, "tokens": tokens, "completions": []}
        return {"request_id": request_id, "done": True, "tokens": tokens, "completions": [asdict(c) for c in self.done]}


async def wait_any(entries: list[Adopted], timeout_s: float) -> None:
    """Until one of `entries` is ready, or `timeout_s` passed; each takes what its queue held meanwhile. (A get
    cancelled here loses nothing: asyncio.Queue keeps an item until a get_nowait takes it.)"""
    for entry in entries:
        entry.drain()
    if any(e.ready for e in entries):
        return
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not any(e.ready for e in entries):
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return
        getters = {asyncio.ensure_future(e.queue.get()): e for e in entries}
        done, pending = await asyncio.wait(getters, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task, entry in getters.items():
            if task in done:
                entry.take(task.result())
            entry.drain()


async def relay_all(frontend: EngineFrontend, http: httpx.AsyncClient, move: tuple[str, str], rids: list[str],
                    on_answered: Callable[[str, bool], None]) -> None:
    """The migrated requests' events, from the target to their clients here (or each one's error, never silence),
    one long poll at a time for all of them: a streamed request's tokens as the target samples them, then (every
    request) its finished samples, which record this move first, then any the target made of it in turn.
    on_answered(rid, ok) once per request, when its last events were relayed (ok) or its client got an error."""
    pending = list(rids)

    def fail(rid: str, why: str) -> None:
        frontend.fail_engine_request(rid, f"request migrated to {http.base_url}, whose answer failed: {why}")
        pending.remove(rid)
        on_answered(rid, False)

    async with http:
        try:
            while pending:
                response = await http.post("/migration/results", json={"request_ids": pending})
                if response.status_code >= 400:
                    raise ValueError(f"{response.status_code} {response.text[:300]}")
                for item in response.json()["results"]:
                    rid = item["request_id"]
                    if rid not in pending:
                        continue
                    if item.get("error"):
                        fail(rid, item["error"])
                        continue
                    events: list[tuple] = [("token", rid, *token) for token in item["tokens"]]
                    if item["done"]:
                        done = [Completion(**c) for c in item["completions"]]
                        for c in done:
                            c.migrations = [move] + [(str(s), str(t)) for s, t in c.migrations]
                        events += [("done", c) for c in done]
                    frontend.relay(rid, events)
                    if item["done"]:
                        pending.remove(rid)
                        on_answered(rid, True)
        except Exception as exc:  # noqa: BLE001 - each client still waiting is answered with it
            for rid in list(pending):
                fail(rid, repr(exc))


@dataclass
class MigrationCounts:
    """An engine server's migrations, over its life (its /metrics)."""

    migrated_requests: int = 0  # moved away from here
    stayed_requests: int = 0  # named by a /migrate, refused, kept running here
    failed_requests: int = 0  # neither engine could run them: their clients got the error
    adopted_requests: int = 0  # migrated in from another engine server
    relay_failures: int = 0  # moved away, but their answer could not be relayed: their clients got the error
    result_polls: int = 0  # /migration/result(s) answered here (one per batch of news, for all of a move's requests)


class MigrationCollector:
    """Prometheus collector over MigrationCounts (registered on the engine server's registry)."""

    def __init__(self, counts: MigrationCounts) -> None:
        self.counts = counts

    def collect(self):  # noqa: ANN201 - the prometheus_client protocol
        for key, doc in (
            ("migrated_requests", "requests live-migrated from this engine to another"),
            ("stayed_requests", "requests a migration refused (named by reason in its answer): they ran on here"),
            ("failed_requests", "requests a migration lost on both engines: their clients were answered the error"),
            ("adopted_requests", "requests live-migrated to this engine from another"),
            ("relay_failures", "migrated requests whose answer could not be relayed back: their clients got the error"),
            ("result_polls", "polls for migrated-in requests' news answered (one serves all of a move's requests)"),
        ):
            yield CounterMetricFamily(f"rollwise_engine_migration_{key}", doc, value=getattr(self.counts, key))


__all__ = ["Adopted", "MigrationCollector", "MigrationCounts", "relay_all", "wait_any"]

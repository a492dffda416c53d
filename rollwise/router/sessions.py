"""Router state that outlives one request: session/group placements and idempotent results.

- AffinityTable: session or group key -> the replica it was last routed to (bounded LRU). Sticky
  policies use it, and after a router restart it sends each live session back to the replica whose
  engine cache holds its history.
- IdempotencyCache: `Idempotency-Key` -> the response. A client retry with the same key joins the
  request still running or gets the stored response, so a retry never generates twice. (The official
  `openai` client sends no key by itself: `extra_headers={"Idempotency-Key": key}` or `default_headers`.)
- RouterState: both (plus the prefix tree) in one JSON file, written periodically and at shutdown,
  read at startup, so a restarted router carries on where the old one stopped.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import tempfile
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class AffinityTable:
    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, str] = OrderedDict()
        self.version = 0  # bumps on every change (the state file is rewritten only when it moved)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str | None) -> str | None:
        return None if key is None else self._entries.get(key)

    def set(self, key: str, replica: str) -> None:
        if self._entries.get(key) != replica:
            self.version += 1
        self._entries[key] = replica
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def drop_replica(self, replica: str) -> None:
        """A dead replica's sessions move: their next request is placed afresh."""
        for key in [k for k, r in self._entries.items() if r == replica]:
            del self._entries[key]
        self.version += 1

    def export(self) -> dict[str, str]:
        return dict(self._entries)

    def load(self, entries: dict[str, str]) -> None:
        for key, replica in entries.items():
            self.set(key, replica)


@dataclass
class StoredResponse:
    status: int
    media_type: str
    body: bytes
    headers: dict[str, str]


class IdempotencyConflict(Exception):
    """A streamed request with this key is still running: it cannot be joined halfway."""


class IdempotencyCache:
    """Bounded by entries and bytes; only successful responses are kept (a failed request may be retried)."""

    def __init__(self, max_entries: int = 4096, max_bytes: int = 64 << 20, ttl_s: float = 3600.0) -> None:
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self._done: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()
        self._running: dict[str, asyncio.Future] = {}
        self._bytes = 0
        self.replays = 0  # responses served from the cache or joined (for metrics)

    def lookup(self, key: str) -> StoredResponse | None:
        entry = self._done.get(key)
        if entry is None:
            return None
        if time.monotonic() - entry[0] > self.ttl_s:
            self._forget(key)
            return None
        return entry[1]

    def running(self, key: str) -> asyncio.Future | None:
        return self._running.get(key)

    async def run(self, key: str, produce: Callable[[], Awaitable[StoredResponse]]) -> StoredResponse:
        """The stored response, the running one's, or produce() — exactly one generation per key."""
        stored = self.lookup(key)
        if stored is not None:
            self.replays += 1
            return stored
        running = self._running.get(key)
        if running is not None:
            self.replays += 1
            return await asyncio.shield(running)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._running[key] = future
        try:
            result = await produce()
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: joiners re-raise it, nobody else needs to
            raise
        finally:
            self._running.pop(key, None)
        future.set_result(result)
        self.store(key, result)
        return result

    def begin_stream(self, key: str) -> None:
        if key in self._running:
            raise IdempotencyConflict(key)
        self._running[key] = asyncio.get_running_loop().create_future()

    def end_stream(self, key: str, result: StoredResponse | None) -> None:
        future = self._running.pop(key, None)
        if future is not None and not future.done():
            future.cancel()
        if result is not None:
            self.store(key, result)

    def store(self, key: str, result: StoredResponse) -> None:
        if not 200 <= result.status < 300 or len(result.body) > self.max_bytes:
            return
        self._forget(key)
        self._done[key] = (time.monotonic(), result)
        self._bytes += len(result.body)
        while len(self._done) > self.max_entries or self._bytes > self.max_bytes:
            self._forget(next(iter(self._done)))

    def _forget(self, key: str) -> None:
        entry = self._done.pop(key, None)
        if entry is not None:
            self._bytes -= len(entry[1].body)

    def export(self, max_entries: int = 1024) -> list[dict[str, Any]]:
        items = list(self._done.items())[-max_entries:]
        return [{"key": k, "status": r.status, "media_type": r.media_type, "headers": r.headers,
                 "body": base64.b64encode(r.body).decode()} for k, (_, r) in items]

    def load(self, entries: list[dict[str, Any]]) -> None:
        for e in entries:
            self.store(e["key"], StoredResponse(e["status"], e["media_type"], base64.b64decode(e["body"]),
                                                e.get("headers", {})))


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Atomically (write + rename): a router killed mid-write leaves the previous file intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)


def read_state(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise ValueError(f"--state-file {path} is not valid JSON ({exc}); move it away to start fresh") from exc

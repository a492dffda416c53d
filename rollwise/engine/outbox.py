"""The acknowledged outbox: how a completion leaves a process exactly once.

A consumer on the other side of a network (HTTP client, Ray fleet, pool job) may lose an answer in flight,
so completions are not forgotten when sent but when acknowledged: each gets a sequence number, a poll says
"I have everything up to `after`", and only then are those entries dropped. A retried poll with the same
`after` returns the same entries again (nothing lost), and a consumer that never acknowledges an entry twice
never sees it twice (nothing trained on twice, invariant 3). One class serves the engine server's
frontend, the pool's jobs and the Ray engine actor.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class Outbox(Generic[T]):
    def __init__(self) -> None:
        self._entries: deque[tuple[int, T]] = deque()
        self._seq = 0
        self._cond = threading.Condition()
        self._closed = False

    @property
    def seq(self) -> int:
        """The sequence number of the newest entry ever put (0: none)."""
        with self._cond:
            return self._seq

    def put(self, item: T) -> int:
        return self.put_many([item])

    def put_many(self, items: Iterable[T]) -> int:
        """Append items in order; returns the newest sequence number."""
        with self._cond:
            for item in items:
                self._seq += 1
                self._entries.append((self._seq, item))
            self._cond.notify_all()
            return self._seq

    def acknowledge(self, after: int) -> None:
        """The consumer holds every entry with seq <= `after`: forget them."""
        with self._cond:
            while self._entries and self._entries[0][0] <= after:
                self._entries.popleft()

    def poll(self, after: int, timeout: float = 0.0, refill: Callable[[float], list[T]] | None = None
             ) -> list[tuple[int, T]]:
        """Acknowledge `after`, then return the entries after it, waiting up to `timeout` seconds for one.

        `refill(wait)`, when given, is asked for new items (it may block up to `wait` seconds): the Ray
        actor pulls completions from its engine worker this way instead of a thread pushing them."""
        self.acknowledge(after)
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            with self._cond:
                if self._entries or self._closed:
                    return list(self._entries)
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                if refill is None:
                    self._cond.wait(left)
                    continue
            fresh = refill(left)
            if fresh:
                self.put_many(fresh)

    def pending(self) -> int:
        """Entries put and not yet acknowledged."""
        with self._cond:
            return len(self._entries)

    def close(self) -> None:
        """Wake every waiting poll (they return what is there)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

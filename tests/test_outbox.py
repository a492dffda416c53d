"""The acknowledged outbox (rollwise.engine.outbox): nothing lost when an answer is lost, nothing twice."""

from __future__ import annotations

import threading
import time

from rollwise.engine.outbox import Outbox


def test_entries_stay_until_acknowledged_and_are_never_repeated_after():
    box: Outbox[str] = Outbox()
    assert box.put_many(["a", "b"]) == 2
    first = box.poll(after=0)
    assert first == [(1, "a"), (2, "b")]
    assert box.poll(after=0) == first  # the answer was lost: the retry gets the same entries
    box.put("c")
    assert box.poll(after=2) == [(3, "c")]  # 1 and 2 acknowledged: forgotten
    assert box.pending() == 1 and box.seq == 3
    assert box.poll(after=3, timeout=0.01) == []


def test_poll_waits_for_a_producer_thread_and_close_wakes_it():
    box: Outbox[int] = Outbox()
    threading.Timer(0.05, box.put, args=(7,)).start()
    started = time.monotonic()
    assert box.poll(after=0, timeout=5) == [(1, 7)]
    assert time.monotonic() - started < 4
    threading.Timer(0.05, box.close).start()
    started = time.monotonic()
    assert box.poll(after=1, timeout=5) == []
    assert time.monotonic() - started < 4


def test_refill_pulls_from_a_source_until_something_arrives():
    box: Outbox[int] = Outbox()
    source = [[], [], [4, 5]]
    calls = []

    def refill(wait: float) -> list[int]:
        calls.append(wait)
        return source.pop(0) if source else []

    assert box.poll(after=0, timeout=5, refill=refill) == [(1, 4), (2, 5)]
    assert len(calls) == 3 and all(0 < w <= 5 for w in calls)

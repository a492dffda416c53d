"""The discrete-event loop of the job-level simulators (rollwise.sim.mux, rollwise.sim.lora)."""

from __future__ import annotations

import heapq
from collections.abc import Callable

from rollwise.sim.engine import VirtualClock


class EventQueue:
    """Calls at simulated times on a VirtualClock, in time order (ties: in the order scheduled). An event may
    carry `valid`, asked when it is due: False means it was superseded (e.g. an op cut short and rescheduled)
    and it is skipped without moving the clock."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self._events: list[tuple[float, int, Callable[[], None], Callable[[], bool] | None]] = []
        self._serial = 0

    def at(self, t: float, fn: Callable[[], None], valid: Callable[[], bool] | None = None) -> None:
        """Call fn at time t (unless valid() says by then that the event was superseded)."""
        self._serial += 1
        heapq.heappush(self._events, (t, self._serial, fn, valid))

    def run(self, decide: Callable[[], None]) -> None:
        """Every event until none is left; `decide` once everything due at an instant has happened."""
        events = self._events
        while events:
            t, _, fn, valid = heapq.heappop(events)
            if valid is not None and not valid():
                continue
            self.clock.now = max(self.clock.now, t)
            fn()
            if not events or events[0][0] > self.clock.now:
                decide()

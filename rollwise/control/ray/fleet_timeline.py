"""The fleet's merged timeline: running sequences summed over its engine actors, in this process's
monotonic clock (what the training loop reads as 'the engine's timeline'). RayEngineFleet
(rollwise.control.ray.fleet) fetches each actor's new points; this module holds the view and the merge.
"""

from __future__ import annotations

import bisect
from typing import Protocol

TIMELINE_REFRESH_S = 2.0


class TimelineSource(Protocol):
    """What the view asks of the fleet (RayEngineFleet) before it is read: fetch the engines' new points."""

    def refresh_timeline(self, force: bool = False) -> None: ...


class FleetView:
    """What the loop reads from 'the engine': the fleet's merged timeline (running sequences summed over
    engines, in this process's monotonic clock) and its capacity (engines x max_num_seqs)."""

    def __init__(self, fleet: TimelineSource, name: str, max_num_seqs: int) -> None:
        self._fleet = fleet
        self.name = name
        self.max_num_seqs = max_num_seqs
        self._timeline: list[tuple[float, int]] = []

    @property
    def timeline(self) -> list[tuple[float, int]]:
        self._fleet.refresh_timeline()
        return self._timeline

    def merge(self, timelines: list[list[tuple[float, int]]], since: float) -> None:
        """The engines' timelines summed into this view's, from time `since` on (see merge_from)."""
        merge_from(self._timeline, timelines, since)


def merge_from(merged: list[tuple[float, int]], timelines: list[list[tuple[float, int]]], since: float) -> None:
    """Sum step functions (each sorted): at each point in time, the running sequences of all engines
    together. `merged` is recomputed in place from time `since` on; what lies before stays (incremental:
    a refresh costs the new points, not the whole run's)."""
    key = (since, -1)  # sorts before every point at `since`
    del merged[bisect.bisect_left(merged, key):]
    current, events = [], []
    for i, tl in enumerate(timelines):
        k = bisect.bisect_left(tl, key)
        current.append(tl[k - 1][1] if k else 0)
        events += [(t, i, n) for t, n in tl[k:]]
    events.sort()
    total = sum(current)
    for t, i, n in events:
        total += n - current[i]
        current[i] = n
        merged.append((t, total))

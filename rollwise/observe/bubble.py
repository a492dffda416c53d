"""The rollout bubble ratio (DESIGN.md): 1 - ∫ running_sequences(t) dt / (capacity × T).

Engines record a timeline of (monotonic time, running sequences) whenever the count changes;
the count holds until the next record (a step function).
"""

from __future__ import annotations

from collections.abc import Sequence


def busy_integral(timeline: Sequence[tuple[float, int]], t_start: float, t_end: float) -> float:
    """∫ running(t) dt over [t_start, t_end] for a step-function timeline (sequence-seconds)."""
    if t_end <= t_start:
        return 0.0
    total = 0.0
    points = sorted(timeline)
    for i, (t, running) in enumerate(points):
        nxt = points[i + 1][0] if i + 1 < len(points) else t_end
        lo, hi = max(t, t_start), min(nxt, t_end)
        if hi > lo:
            total += running * (hi - lo)
    return total


def bubble_ratio(
    timelines: Sequence[Sequence[tuple[float, int]]], capacities: Sequence[int], t_start: float, t_end: float
) -> float:
    """Summed over engines: 1 - busy sequence-seconds / (capacity × wall time). 1.0 = always idle."""
    wall = t_end - t_start
    capacity_seconds = sum(capacities) * wall
    if capacity_seconds <= 0:
        return 0.0
    busy = sum(busy_integral(tl, t_start, t_end) for tl in timelines)
    return 1.0 - busy / capacity_seconds

"""Processor sharing of a machine's CPU cores, for the simulators that run on a virtual clock.

A task is a piece of CPU work, in seconds at the full speed of one core. It belongs to a process (its
`group`) whose tasks together make at most `cap` cores' worth of progress once two or more run: about 1
for a Python process however many threads it runs, since they take turns under one interpreter lock
(below 1 when the handoffs cost: rollwise.sim.host measures it). One task alone always runs at full
speed. A task with no group is a process of its own. Between events the rates are fixed: a group with
n tasks asks for n cores if n <= 1, else min(n, cap), and when everything asks for more than the
machine's (effective) `cores`, every group slows alike:

    machine = min(1, cores / total demand)        (cores = 0: no shared limit, each process its own device)
    rate of a task in a group = machine * demand / n

`cores` may also depend on how many processes have work (`crowding`: effective cores measured with n
processes side by side, rollwise.sim.host): more processes than cores lose time to each other on a
real machine (context switches, caches), which plain processor sharing does not charge.

Every change of the task set re-plans the next task end; an end planned before a change is ignored.
Used by the router simulator (replicas, router and client on bench router's cores) and the pool
simulator (trainers and the pool's engine slots on bench mux's cores). overlap_slowdowns is the same
sharing per thread for one engine and one trainer in one process (the GRPO simulator, rollwise.sim.run,
where a cost file sets `shared_cores`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

Schedule = Callable[[float, Callable[[], None]], None]  # at(time, callback) on the simulator's clock


@dataclass(eq=False)
class _Task:
    work_s: float  # remaining, in seconds at full speed
    on_done: Callable[[], None]
    group: str | None


def crowded_cores(cores: float, crowding: Sequence[tuple[int, float]], processes: int) -> float:
    """Effective cores with `processes` processes running: `crowding` holds measured (processes, cores)
    points, sorted by processes; linear between them, the nearest one beyond them; no points: `cores`."""
    points = crowding
    if not points:
        return cores
    if processes <= points[0][0]:
        return points[0][1]
    for (n0, c0), (n1, c1) in zip(points, points[1:]):
        if processes <= n1:
            return c0 + (c1 - c0) * (processes - n0) / (n1 - n0)
    return points[-1][1]


def overlap_slowdowns(step_s: float, serial_s: float, threads: int, cores: float) -> tuple[float, float]:
    """(engine step slowdown, train step slowdown) while an engine steps and a trainer trains at once on
    `cores` shared cores, each running `threads` torch threads (rollwise bench rollout: one process, the
    engine on its own thread). Derived from the engine's step time alone, not fitted to any rollout mode.

    An engine step of `step_s` seconds alone is a serial part of `serial_s` (Python holding the interpreter
    lock, one thread: the step at batch 1 is nearly all of it) and a torch part on `threads` threads. The
    trainer is torch work on `threads` threads throughout. The OS shares the cores per thread, so:

        during the engine's torch part:  2 x threads threads on the cores, each at min(1, cores / (2 threads))
        during its serial part:          1 + threads threads,              each at min(1, cores / (1 + threads))

    The engine's step stretches by both shares; the trainer progresses at the time-weighted share.
    With cores >= 2 x threads nothing slows (separate devices behave like cores = 0: see SharedCores)."""
    if cores <= 0 or step_s <= 0:
        return 1.0, 1.0
    serial = min(max(serial_s, 0.0), step_s)
    share_torch = min(1.0, cores / (2 * threads))
    share_serial = min(1.0, cores / (1 + threads))
    torch_s = (step_s - serial) / share_torch  # the torch part, stretched
    serial_stretched = serial / share_serial
    together = torch_s + serial_stretched
    trainer_rate = (torch_s * share_torch + serial_stretched * share_serial) / together
    return together / step_s, 1.0 / trainer_rate


class SharedCores:
    def __init__(self, cores: float, at: Schedule, now: Callable[[], float],
                 caps: Mapping[str, float] | None = None, crowding: Sequence[tuple[int, float]] = ()) -> None:
        self.cores = cores
        self.crowding = tuple(sorted(crowding))  # (processes, effective cores) measured; empty: `cores` always
        self.caps = dict(caps or {})  # group -> cores' worth its tasks make together (default 1)
        self._at, self._now = at, now
        self._tasks: list[_Task] = []
        self._since = 0.0
        self._event = 0  # bumped on every change: a planned end from before it is stale

    def run(self, work_s: float, on_done: Callable[[], None], group: str | None = None) -> None:
        """Start `work_s` seconds of CPU work now; `on_done()` is called when it has had them."""
        self._advance()
        self._tasks.append(_Task(work_s, on_done, group))
        self._plan()

    @property
    def running(self) -> int:
        return len(self._tasks)

    def _rates(self) -> list[float]:
        counts: dict[str | None, int] = {}
        for t in self._tasks:
            counts[t.group] = counts.get(t.group, 0) + 1
        # a task without a group is a process of its own: its demand is 1; a group's cap applies from 2 tasks
        demand = {g: float(n) if n <= 1 else min(float(n), self.caps.get(g, 1.0))
                  for g, n in counts.items() if g is not None}
        total = sum(demand.values()) + counts.get(None, 0)
        cores = crowded_cores(self.cores, self.crowding, len(demand) + counts.get(None, 0))
        machine = min(1.0, cores / total) if self.cores > 0 and total > 0 else 1.0
        return [machine if t.group is None else machine * demand[t.group] / counts[t.group] for t in self._tasks]

    def _advance(self) -> None:
        elapsed = self._now() - self._since
        for task, rate in zip(self._tasks, self._rates()):
            task.work_s -= elapsed * rate
        self._since = self._now()

    def _plan(self) -> None:
        self._event += 1
        if not self._tasks:
            return
        event = self._event
        first = min(max(t.work_s, 0.0) / rate for t, rate in zip(self._tasks, self._rates()))
        self._at(self._now() + first, lambda: self._tick(event))

    def _tick(self, event: int) -> None:
        if event != self._event:
            return
        self._advance()
        ended = [t for t in self._tasks if t.work_s <= 1e-12]
        self._tasks = [t for t in self._tasks if t.work_s > 1e-12]
        self._plan()
        for task in ended:
            task.on_done()

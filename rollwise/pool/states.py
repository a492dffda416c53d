"""The per-(engine slot, job) state machine of the shared engine pool.

Every job that has ever run on a slot is in one of three states there:

    active    its engine instance is the slot's engine: weights loaded, KV cache allocated, serving
    sleeping  its instance is kept but idle: KV cache freed, weights in host memory (on a GPU this
              is the engine's sleep mode, weights offloaded); waking it is cheap
    evicted   no instance on this slot: the weights live only in the pool's per-job store (the
              latest pushed version); activating means building an engine and loading them

Allowed transitions (anything else raises `StateError`, nothing is changed):

    evicted  -> active    "load"   build an engine from the job's model and load its current weights
    active   -> sleeping  "sleep"  the slot switches to another job; this one's instance is kept
    sleeping -> active    "wake"   the slot switches back (plus a weight load if the job moved on)
    sleeping -> evicted   "evict"  host-memory budget, or the job detached
    active   -> evicted   "evict"  the job detached while active

At most one job is active on a slot at any time. Every transition is recorded with the time it
took (measured by the caller around the real work), so the pool reports measured transition costs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any


class EngineState(str, Enum):
    ACTIVE = "active"
    SLEEPING = "sleeping"
    EVICTED = "evicted"


ACTIVE, SLEEPING, EVICTED = EngineState.ACTIVE, EngineState.SLEEPING, EngineState.EVICTED

# (from, to) -> the transition's name
TRANSITIONS: dict[tuple[EngineState, EngineState], str] = {
    (EVICTED, ACTIVE): "load",
    (ACTIVE, SLEEPING): "sleep",
    (SLEEPING, ACTIVE): "wake",
    (SLEEPING, EVICTED): "evict",
    (ACTIVE, EVICTED): "evict",
}


class StateError(RuntimeError):
    """An illegal transition was asked for; the state is unchanged."""


@dataclass(frozen=True)
class Transition:
    slot: int
    job: str
    source: EngineState
    target: EngineState
    kind: str  # load | sleep | wake | evict
    seconds: float  # measured cost of the transition's work
    at: float  # time.monotonic() when it was recorded
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["source"], d["target"] = self.source.value, self.target.value
        return d


class StateMachine:
    """States of every (slot, job) pair, the transition log and the measured costs. Thread-safe."""

    def __init__(self, num_slots: int, log_limit: int = 10_000) -> None:
        self.num_slots = num_slots
        self._states: dict[tuple[int, str], EngineState] = {}
        self._lock = threading.Lock()
        self.log: list[Transition] = []
        self._log_limit = log_limit
        self._totals: dict[str, list[float]] = {}  # kind -> [count, seconds, max seconds]

    def state(self, slot: int, job: str) -> EngineState:
        with self._lock:
            return self._states.get((slot, job), EVICTED)

    def active_job(self, slot: int) -> str | None:
        with self._lock:
            return next((j for (s, j), st in self._states.items() if s == slot and st is ACTIVE), None)

    def jobs_in(self, slot: int, state: EngineState) -> list[str]:
        with self._lock:
            return sorted(j for (s, j), st in self._states.items() if s == slot and st is state)

    def transition(self, slot: int, job: str, target: EngineState, seconds: float, reason: str = "",
                   at: float | None = None) -> Transition:
        if not 0 <= slot < self.num_slots:
            raise StateError(f"slot {slot} does not exist (the pool has {self.num_slots})")
        with self._lock:
            source = self._states.get((slot, job), EVICTED)
            kind = TRANSITIONS.get((source, target))
            if kind is None:
                raise StateError(f"slot {slot}, job {job!r}: {source.value} -> {target.value} is not a "
                                 f"transition of the pool's state machine")
            if target is ACTIVE:
                other = next((j for (s, j), st in self._states.items() if s == slot and st is ACTIVE), None)
                if other is not None:
                    raise StateError(f"slot {slot}: job {other!r} is active, so job {job!r} cannot be "
                                     "(one active job per slot; put the other to sleep first)")
            if target is EVICTED:
                self._states.pop((slot, job), None)
            else:
                self._states[(slot, job)] = target
            record = Transition(slot, job, source, target, kind, seconds,
                                time.monotonic() if at is None else at, reason)
            self.log.append(record)
            if len(self.log) > self._log_limit:
                del self.log[: len(self.log) - self._log_limit]
            total = self._totals.setdefault(kind, [0, 0.0, 0.0])
            total[0] += 1
            total[1] += seconds
            total[2] = max(total[2], seconds)
            return record

    def costs(self) -> dict[str, dict[str, float]]:
        """Measured cost per transition kind: count, mean and max seconds, total seconds."""
        with self._lock:
            return {kind: {"count": int(c), "mean_s": s / c if c else 0.0, "max_s": m, "total_s": s}
                    for kind, (c, s, m) in sorted(self._totals.items())}

    def snapshot(self) -> dict[str, dict[str, str]]:
        """slot -> {job: state} for every job not evicted there."""
        with self._lock:
            out: dict[str, dict[str, str]] = {str(s): {} for s in range(self.num_slots)}
            for (s, j), st in sorted(self._states.items()):
                out[str(s)][j] = st.value
            return out


def check_log(log: Iterable[Transition | dict[str, Any]], num_slots: int) -> list[str]:
    """Replay a transition log from the empty pool; return every violation of the state machine
    (an illegal transition, a source that is not the pair's current state, two active jobs on one
    slot, a negative cost, time going backwards). [] = the log is a legal history."""
    states: dict[tuple[int, str], EngineState] = {}
    problems: list[str] = []
    last_at = float("-inf")
    for i, entry in enumerate(log):
        e = entry.as_dict() if isinstance(entry, Transition) else entry
        slot, job = int(e["slot"]), str(e["job"])
        source, target = EngineState(e["source"]), EngineState(e["target"])
        where = f"#{i} slot {slot} job {job!r} {source.value}->{target.value}"
        if not 0 <= slot < num_slots:
            problems.append(f"{where}: no such slot")
        current = states.get((slot, job), EVICTED)
        if current is not source:
            problems.append(f"{where}: the pair was {current.value}")
        if TRANSITIONS.get((source, target)) != e["kind"]:
            problems.append(f"{where}: not an allowed transition (kind {e['kind']!r})")
        if target is ACTIVE and any(s == slot and st is ACTIVE and j != job for (s, j), st in states.items()):
            problems.append(f"{where}: another job is active on the slot")
        if e["seconds"] < 0:
            problems.append(f"{where}: negative cost")
        if e["at"] < last_at:
            problems.append(f"{where}: recorded before the previous transition")
        last_at = e["at"]
        if target is EVICTED:
            states.pop((slot, job), None)
        else:
            states[(slot, job)] = target
    return problems

"""The state EnginePool's two sides share: its API side (rollwise.pool.engine_pool: attach, weights, submit, abort,
poll, detach, reports) and its slot loops (rollwise.pool.slots.SlotLoops, on the slot threads).

One object both hold, instead of the slot loops being a mixin half of EnginePool that reads its attributes: what
they share is declared here once, and neither side reaches into the other's private state. `lock` guards jobs,
queues, slot assignments and accounting (rollwise.pool.engine_pool's docstring gives the lock order).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from rollwise.pool.jobs import Job, LoraBase, QueuedRequest, Slot
from rollwise.pool.scheduler import Policy
from rollwise.pool.states import StateMachine


@dataclass(eq=False)
class PoolState:
    slots: list[Slot]
    states: StateMachine  # each slot's engines: active, sleeping, evicted (and what each transition cost)
    policy: Policy
    max_sleeping: int  # sleeping engines kept per slot (host memory); the least recently used beyond are evicted
    lock: threading.RLock = field(default_factory=threading.RLock)
    jobs: dict[str, Job] = field(default_factory=dict)
    bases: dict[str, LoraBase] = field(default_factory=dict)  # LoRA tenancies (Job.key) -> the jobs sharing its engines
    by_internal: dict[str, QueuedRequest] = field(default_factory=dict)  # engine request id -> its queued request
    stop: threading.Event = field(default_factory=threading.Event)
    isolation_checks: int = 0  # admissions checked: engine owner == job and weights == job's current
    violations: list[str] = field(default_factory=list)  # must stay empty
    wakeup: threading.Condition = field(default_factory=threading.Condition)  # idle slot loops wait on it
    kicks: int = 0
    # live migrations of running requests between slots (rollwise.pool.slot_migration): the newest, and samples moved
    migrations: list[dict[str, float | int | str]] = field(default_factory=list)
    migrated_samples: int = 0

    def tenancy(self, key: str) -> Job | LoraBase | None:
        """What a slot's active key names: a full-parameter job, or a LoRA base shared by its jobs."""
        return self.bases.get(key) or self.jobs.get(key)

    def kick(self) -> None:
        """New work (or a resumed job): idle slot loops re-plan now instead of at their next idle tick."""
        with self.wakeup:
            self.kicks += 1
            self.wakeup.notify_all()

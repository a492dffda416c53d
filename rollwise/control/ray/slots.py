"""The fleet's bookkeeping (RayEngineFleet, rollwise.control.ray.fleet): one `Slot` per engine actor, one
`Outstanding` per request it owes samples of, and `Owed`, which holds those requests and routes each group to
its engine. Their own module, so that the fleet's components that act on them (restart handling in
fleet_recovery, the collective weight push in fleet_collective) are given them instead of reading the fleet.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollwise.types.generation import Completion, GenerationRequest

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle


@dataclass
class Slot:
    """One engine actor: its handle and bundle, its incarnation (`info`), the last sequence number the
    fleet acknowledged, its load and its timeline."""

    index: int
    actor: ActorHandle  # an EngineActor (rollwise.control.ray.engine_actor)
    bundle: int
    info: dict = field(default_factory=dict)
    ack: int = 0
    drain_ref: ObjectRef | None = None
    alive: bool = True
    restarts: int = 0
    timeline_cursor: int = 0
    timeline: list[tuple[float, int]] = field(default_factory=list)  # in this process's monotonic clock
    load: int = 0  # samples submitted and not yet back

    @property
    def token(self) -> str:
        return self.info.get("token", "")


@dataclass
class Outstanding:
    """A request the fleet was given and still owes samples of, and the slot it runs on."""

    request: GenerationRequest
    slot: int
    pending: set[int]  # sample indices not yet back


def group_key(request_id: str) -> str:
    """Requests of one GRPO group share the part before '/' (the controller names a group's request
    `g12` and a regenerated sample of it `g12/3#1`): they go to the same engine (shared prefix)."""
    return request_id.split("/", 1)[0]


class Owed:
    """Every request the fleet was given until each of its samples came back, the engine (slot) each group runs
    on, and the slots' loads. A completion is accounted once per (request id, sample index): one that is not owed
    (generated again after a restart, already delivered) is counted in `discarded` and dropped."""

    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots
        self.requests: dict[str, Outstanding] = {}
        self.home: dict[str, int] = {}  # group key -> slot
        self._home_count: collections.Counter[str] = collections.Counter()
        self.discarded = 0

    def route(self, request_id: str) -> int:
        """The slot for a request: its group's engine while that one lives, else the least loaded live one."""
        key = group_key(request_id)
        s = self.home.get(key)
        if s is None or not self.slots[s].alive:
            s = min((slot for slot in self.slots if slot.alive), key=lambda slot: slot.load).index
            self.home[key] = s
        return s

    def track(self, r: GenerationRequest, s: int, pending: set[int] | None = None) -> None:
        pending = set(range(r.params.n)) if pending is None else pending
        self.requests[r.request_id] = Outstanding(r, s, pending)
        self._home_count[group_key(r.request_id)] += 1
        self.slots[s].load += len(pending)

    def untrack(self, request_id: str) -> None:
        o = self.requests.pop(request_id)
        self.slots[o.slot].load -= len(o.pending)
        key = group_key(request_id)
        self._home_count[key] -= 1
        if self._home_count[key] <= 0:
            del self._home_count[key]
            self.home.pop(key, None)

    def on_slot(self, s: int) -> list[Outstanding]:
        return [o for o in self.requests.values() if o.slot == s]

    def forget_slot(self, s: int) -> None:
        """A slot given up: no group calls it home any more."""
        for key in [k for k, v in self.home.items() if v == s]:
            del self.home[key]

    def receive(self, s: int, c: Completion) -> bool:
        """Account for a completion from slot s; False if it is not owed (already delivered)."""
        o = self.requests.get(c.request_id)
        if o is None or o.slot != s or c.index not in o.pending:
            self.discarded += 1
            return False
        o.pending.discard(c.index)
        self.slots[s].load -= 1
        if not o.pending:
            self.untrack(c.request_id)
        return True

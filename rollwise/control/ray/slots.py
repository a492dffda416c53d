"""The fleet's bookkeeping (RayEngineFleet, rollwise.control.ray_fleet): one `Slot` per engine actor and one
`Outstanding` per request it owes samples of. Their own module, so that the parts of the fleet that act on
them (restart handling in ray_fleet_recovery, the collective weight push in ray_fleet_collective) import
them from below instead of from the fleet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollwise.types.generation import GenerationRequest


@dataclass
class Slot:
    """One engine actor: its handle and bundle, its incarnation (`info`), the last sequence number the
    fleet acknowledged, its load and its timeline."""

    index: int
    actor: Any
    bundle: int
    info: dict = field(default_factory=dict)
    ack: int = 0
    drain_ref: Any = None
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

"""What the fleet (rollwise.control.ray.fleet) does when an engine actor dies: wait for Ray's restart,
bring the new incarnation up to the fleet's current state, or give the actor up and hand its requests on.

`FleetRecovery` is a component the fleet holds: it is given the fleet's slots and the requests they owe
(rollwise.control.ray.slots), and the fleet's own steps it needs (bring a new incarnation to the current
weights and pause state; mark the merged timeline stale). The guarantees it keeps are listed in
rollwise.control.ray.fleet's docstring.
"""

from __future__ import annotations

import bisect
import collections
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from rollwise.control.ray.calls import log
from rollwise.control.ray.engine_actor import GONE
from rollwise.control.ray.slots import Owed, Slot
from rollwise.types.generation import GenerationRequest


class FleetRecovery:
    """Restart handling for RayEngineFleet (see the module docstring).

    `resync(slot)`: load the fleet's current update into a new incarnation (raising GONE if it died again);
    `paused()`: whether the fleet is paused (a new incarnation is paused too); `version()`: the policy version
    the fleet serves now (logged); `stale(since)`: the fleet's merged timeline must be rebuilt from `since` on."""

    def __init__(self, slots: list[Slot], owed: Owed, *, max_restarts: int, restart_timeout_s: float,
                 resync: Callable[[Slot], None], paused: Callable[[], bool], version: Callable[[], int],
                 stale: Callable[[float], None]) -> None:
        self.slots, self.owed = slots, owed
        self.max_restarts = max_restarts
        self.restart_timeout_s = restart_timeout_s
        self._resync, self._paused, self._version, self._stale = resync, paused, version, stale
        self.restarts = 0
        self.restart_log: list[dict[str, Any]] = []

    def recover(self, s: int, exc: BaseException) -> None:
        """Slot `s`'s actor failed a call with `exc`: bring it back into service, or hand its requests on."""
        slot = self.slots[s]
        slot.drain_ref = None
        t0 = time.monotonic()
        while True:
            info = self._await_restart(slot)
            if info is None:
                self._give_up(slot, exc)
                return
            if info["token"] == slot.token:
                return  # the same incarnation answered: a transient error, its state is intact
            t_up = time.monotonic()
            bisect.insort(slot.timeline, (t0, 0))  # nothing ran between the death and now
            self._stale(t0)
            old = slot.info
            slot.info, slot.ack, slot.timeline_cursor = info, 0, 0
            slot.restarts += 1
            self.restarts += 1
            outstanding = self.owed.on_slot(s)
            try:
                self._resync(slot)
                t_sync = time.monotonic()
                if self._paused():
                    ray.get(slot.actor.pause.remote(slot.token))
                if outstanding:
                    ray.get(slot.actor.submit.remote([o.request for o in outstanding], slot.token))
            except GONE as again:
                exc = again
                continue  # died again before it was back in service
            version = self._version()
            entry = {
                "engine": s, "old_pid": old.get("pid"), "new_pid": info["pid"], "node_ip": info["node_ip"],
                "policy_version": version, "restart_s": t_up - t0, "resync_s": t_sync - t_up,
                "requests_resubmitted": len(outstanding), "samples_resubmitted": sum(len(o.pending) for o in outstanding),
                "at": t0, "error": type(exc).__name__,
            }
            self.restart_log.append(entry)
            log(f"engine actor {s} died ({type(exc).__name__}); Ray restarted it in {entry['restart_s']:.1f}s "
                 f"(pid {entry['old_pid']} -> {entry['new_pid']} on {info['node_ip']}), re-synced to policy "
                 f"v{version} in {entry['resync_s']:.2f}s, resubmitted {len(outstanding)} requests "
                 f"({entry['samples_resubmitted']} samples)")
            return

    def _await_restart(self, slot: Slot) -> dict | None:
        """The actor's info once Ray has it running again; None if it will not come back."""
        # Calls already in flight at the death fail too: retry until the new incarnation answers. With
        # its restarts used up Ray will not bring it back: dead (ActorDiedError) means gone; unavailable
        # (a network blip) gets a short grace period.
        exhausted = slot.restarts >= self.max_restarts
        deadline = time.monotonic() + (min(self.restart_timeout_s, 10.0) if exhausted else self.restart_timeout_s)
        while time.monotonic() < deadline:
            try:
                return ray.get(slot.actor.info.remote(), timeout=max(deadline - time.monotonic(), 1.0))
            except GetTimeoutError:
                break
            except ActorDiedError:
                if exhausted:
                    return None
                time.sleep(0.2)
            except RayActorError:
                time.sleep(0.2)
        return None

    def _give_up(self, slot: Slot, exc: BaseException) -> None:
        slot.alive = False
        slot.drain_ref = None
        now = time.monotonic()
        bisect.insort(slot.timeline, (now, 0))
        self._stale(now)
        survivors = [s for s in self.slots if s.alive]
        orphans = self.owed.on_slot(slot.index)
        if not survivors:
            raise RuntimeError(f"every engine actor is dead (engine {slot.index}: {exc!r}, {slot.restarts} restarts "
                               f"of ray.max_restarts={self.max_restarts}); {len(orphans)} requests were in flight") from exc
        log(f"engine actor {slot.index} is gone for good after {slot.restarts} restarts ({type(exc).__name__}); "
             f"its {len(orphans)} requests move to the {len(survivors)} other engines")
        for o in orphans:
            self.owed.untrack(o.request.request_id)
        self.owed.forget_slot(slot.index)
        by_slot: dict[int, list[GenerationRequest]] = collections.defaultdict(list)
        for o in orphans:  # same request, same samples still owed
            s = self.owed.route(o.request.request_id)
            self.owed.track(o.request, s, o.pending)
            by_slot[s].append(o.request)
        for s, reqs in by_slot.items():
            try:
                ray.get(self.slots[s].actor.submit.remote(reqs, self.slots[s].token))
            except GONE as again:
                self.recover(s, again)

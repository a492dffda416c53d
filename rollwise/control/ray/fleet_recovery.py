"""What the fleet (rollwise.control.ray_fleet) does when an engine actor dies: wait for Ray's restart,
bring the new incarnation up to the fleet's current state, or give the actor up and hand its requests on.

`FleetRecovery` is a mixin of `RayEngineFleet`: these methods read and change the fleet's own state
(its slots, the requests it is owed, the current weight update), declared below for the reader. The
guarantees they keep are listed in rollwise.control.ray_fleet's docstring.
"""

from __future__ import annotations

import bisect
import collections
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from rollwise.control.ray_calls import log
from rollwise.control.ray_engine_actor import GONE
from rollwise.control.ray_slots import Outstanding, Slot
from rollwise.types.generation import GenerationRequest


class FleetRecovery:
    """Restart handling for RayEngineFleet (see the module docstring)."""

    # The fleet's state these methods use (set by RayEngineFleet.__init__).
    slots: list[Slot]
    max_restarts: int
    restart_timeout_s: float
    restarts: int
    restart_log: list[dict[str, Any]]
    _paused: bool
    _requests: dict[str, Outstanding]
    _home: dict[str, int]
    _dirty_since: float
    _version: int
    _send: Callable[[Slot], Any]
    _route: Callable[[str], int]
    _track: Callable[..., None]
    _untrack: Callable[[str], None]

    def _recover(self, s: int, exc: BaseException) -> None:
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
            self._dirty_since = min(self._dirty_since, t0)
            old = slot.info
            slot.info, slot.ack, slot.timeline_cursor = info, 0, 0
            slot.restarts += 1
            self.restarts += 1
            outstanding = [o for o in self._requests.values() if o.slot == s]
            try:
                ray.get(self._send(slot))
                t_sync = time.monotonic()
                if self._paused:
                    ray.get(slot.actor.pause.remote(slot.token))
                if outstanding:
                    ray.get(slot.actor.submit.remote([o.request for o in outstanding], slot.token))
            except GONE as again:
                exc = again
                continue  # died again before it was back in service
            entry = {
                "engine": s, "old_pid": old.get("pid"), "new_pid": info["pid"], "node_ip": info["node_ip"],
                "policy_version": self._version, "restart_s": t_up - t0, "resync_s": t_sync - t_up,
                "requests_resubmitted": len(outstanding), "samples_resubmitted": sum(len(o.pending) for o in outstanding),
                "at": t0, "error": type(exc).__name__,
            }
            self.restart_log.append(entry)
            log(f"engine actor {s} died ({type(exc).__name__}); Ray restarted it in {entry['restart_s']:.1f}s "
                 f"(pid {entry['old_pid']} -> {entry['new_pid']} on {info['node_ip']}), re-synced to policy "
                 f"v{self._version} in {entry['resync_s']:.2f}s, resubmitted {len(outstanding)} requests "
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
        self._dirty_since = min(self._dirty_since, now)
        survivors = [s for s in self.slots if s.alive]
        orphans = [o for o in self._requests.values() if o.slot == slot.index]
        if not survivors:
            raise RuntimeError(f"every engine actor is dead (engine {slot.index}: {exc!r}, {slot.restarts} restarts "
                               f"of ray.max_restarts={self.max_restarts}); {len(orphans)} requests were in flight") from exc
        log(f"engine actor {slot.index} is gone for good after {slot.restarts} restarts ({type(exc).__name__}); "
             f"its {len(orphans)} requests move to the {len(survivors)} other engines")
        for o in orphans:
            self._untrack(o.request.request_id)
        for key in [k for k, v in self._home.items() if v == slot.index]:
            del self._home[key]
        by_slot: dict[int, list[GenerationRequest]] = collections.defaultdict(list)
        for o in orphans:  # same request, same samples still owed
            s = self._route(o.request.request_id)
            self._track(o.request, s, o.pending)
            by_slot[s].append(o.request)
        for s, reqs in by_slot.items():
            try:
                ray.get(self.slots[s].actor.submit.remote(reqs, self.slots[s].token))
            except GONE as again:
                self._recover(s, again)

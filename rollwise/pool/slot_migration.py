"""Draining a pool slot by live migration (issue 42 item 3): when a slot drains its tenancy to switch to another
job, the requests running there move to another slot whose engine serves the same tenancy (same model, same
weights version) and has room, instead of making the slot wait for them to finish. The slot then switches at once.

The move is rollwise.engine.migration.migrate_between over the two slots' engine workers: the source keeps
decoding while the target prefills the requests' tokens, the delta is caught up, then the target continues each
sample from where it stopped (its tokens, logprobs and versions as one engine would have produced them). Requests
that do not fit the target's free room stay and finish on the source (the drain as before). An engine that cannot
migrate (ValueError from the coordinator) changes nothing: the slot drains by waiting, as without migration. A
request the target refuses, even at the handover, stays on the source, which kept its slot and KV until the target
confirmed and runs it on from where it stopped (the coordinator's `stayed`); only one the move left on neither engine
(the source's engine failed taking it back: the coordinator's `failed`) is queued again and rerun, as a request of a
failed engine is.

Accounting: the samples moved leave the source slot's running count and join the target's; every migration is
recorded in the pool's migration log (GET /state's "migrations") and on the request, whose samples carry their
moves ("migrations": [[from slot, to slot], ...]) so a trainer's RolloutLedger can record them (ledger.migrate).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from rollwise.engine.migration import migrate_between
from rollwise.pool.jobs import QueuedRequest, Slot
from rollwise.pool.pool_state import PoolState
from rollwise.pool.scheduler import Decision
from rollwise.pool.states import ACTIVE

LOG_ENTRIES = 200  # the newest migrations kept for GET /state


@dataclass(frozen=True)
class MigrationRecord:
    at: float  # time.time()
    tenancy: str
    source: int
    target: int
    requests: int
    samples: int
    tokens: int  # tokens the moved samples had sampled: what regenerating them would have cost
    tokens_prefilled: int  # what the move cost on the target instead
    finished_on_source: int  # requests that finished on the source during the catch-up
    seconds: float

    def as_dict(self) -> dict[str, float | int | str]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class SlotMigration:
    """Moves a draining slot's requests to a peer slot (SlotLoops calls `drain_to_peer`)."""

    def __init__(self, state: PoolState, route: Callable[[Slot], None],
                 requeue: Callable[[Slot, QueuedRequest, str], None]) -> None:
        self.state = state
        self.route = route  # SlotLoops.drain: route a slot's finished samples (caller holds its route_lock)
        self.requeue = requeue  # SlotLoops.requeue_lost: a request the move left on neither engine is rerun

    def peer(self, slot: Slot, decisions: list[Decision]) -> Slot | None:
        """The slot this draining slot's requests can move to: the same tenancy active there with the same weights,
        serving (not draining or switching itself), most free room first (caller holds state.lock)."""
        if slot.job is None:
            return None
        source = slot.instances.get(slot.job)
        best = None
        for other in self.state.slots:
            if other is slot or other.job != slot.job or other.switching or decisions[other.index].action != "serve":
                continue
            inst = other.instances.get(other.job)
            if (inst is None or source is None or self.state.states.state(other.index, other.job) is not ACTIVE
                    or inst.policy_version != source.policy_version or other.running >= other.capacity):
                continue
            if best is None or other.capacity - other.running > best.capacity - best.running:
                best = other
        return best

    def drain_to_peer(self, slot: Slot, target: Slot, on_empty: Callable[[], None]) -> MigrationRecord | None:
        """Migrate what of `slot`'s requests fits `target`'s room (caller holds slot.route_lock, not state.lock).
        None: nothing moved (the target's loop held its lock, nothing fits, or an engine refused: the error is
        on the slot's errors and the slot drains by waiting). `on_empty` runs (under state.lock, before the
        target's loop plans again) when nothing runs on `slot` any more: the caller claims the slot for the job it
        drains for, so the target, now busy with the moved requests, is not drained back in turn."""
        if not target.route_lock.acquire(timeout=0.05):  # its loop is routing (or draining itself): next tick
            return None
        try:
            with self.state.lock:
                if target.job != slot.job or target.switching:
                    return None
                room = target.capacity - target.running
                moving: list[QueuedRequest] = []
                for req in (r for r in self.state.by_internal.values() if r.slot == slot.index):
                    if req.remaining <= room:
                        moving.append(req)
                        room -= req.remaining
            if not moving:
                return None
            started = time.perf_counter()
            try:
                result = migrate_between(slot.worker, target.worker, [r.internal_id for r in moving])
            except ValueError as exc:  # refused whole (unsupported engine, no room there): nothing moved
                slot.errors.append(f"{time.strftime('%H:%M:%S')} migration to slot {target.index} refused, "
                                   f"draining by waiting: {exc}")
                del slot.errors[:-20]
                return None
            # Samples that finished on the source meanwhile are already in its worker's queue: route them first,
            # so what stays counted is exactly the samples that moved.
            self.route(slot)
            with self.state.lock:
                samples = self._account(slot, target, [r for r in moving if r.internal_id in result.migrated])
                for req in (r for r in moving if r.internal_id in result.failed):  # nothing lost: run it again
                    self.requeue(slot, req, result.failed[req.internal_id])
                record = MigrationRecord(time.time(), slot.job or "", slot.index, target.index, len(result.migrated),
                                         samples, sum(result.migrated.values()), result.tokens_prefilled,
                                         len(result.finished_on_source), time.perf_counter() - started)
                self.state.migrations.append(record.as_dict())
                del self.state.migrations[:-LOG_ENTRIES]
                self.state.migrated_samples += samples
                if slot.running == 0:
                    on_empty()
            return record
        finally:
            target.route_lock.release()

    def _account(self, slot: Slot, target: Slot, moved: list[QueuedRequest]) -> int:
        """Move the moved requests' unfinished samples from `slot`'s counts to `target`'s (caller holds state.lock)."""
        total = 0
        for req in moved:
            left = req.remaining
            if left <= 0 or req.slot != slot.index:
                continue
            req.slot = target.index
            req.migrations.append((slot.index, target.index))
            slot.running -= left
            target.running += left
            slot.running_by[req.job] = slot.running_by.get(req.job, 0) - left
            target.running_by[req.job] = target.running_by.get(req.job, 0) + left
            total += left
        return total

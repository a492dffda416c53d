"""The fleet: the EngineWorker interface over engine actors (rollwise.control.ray.engine_actor).

`EngineActor` builds its own engine (rollwise.engine.factory) inside the actor and runs it on an
`EngineWorker` thread, exactly as local placement does in the trainer's process. `RayEngineFleet`
is the RolloutBackend (rollwise.types.contracts) the rollout controller drives: submit / next_completion /
abort / pause / resume / load_weights over `ray.num_engines` actors. A weight update travels as
its manifest plus an ObjectRef: each actor fetches the tensors from the object store and commits
them through the checked two-phase path; with `sync.sender: collective` it is one gloo/NCCL broadcast
from this process to every actor instead (rollwise.control.ray.fleet_collective), committed the same way.

Nothing lost, nothing twice (DESIGN.md invariant 3), through actor deaths:

- the fleet remembers every request it was given until each of its samples came back;
- completions leave an actor only when the fleet acknowledges them (`drain(ack, timeout)` returns
  everything after sequence number `ack` and forgets what is <= `ack`), so a reply lost in transit
  is sent again, and a completion is delivered at most once per (request id, sample index);
- when an actor dies, Ray restarts it (`max_restarts`); the fleet waits for the new incarnation,
  loads the *current* weights and policy version into it, pauses it if the fleet is paused, and
  submits its outstanding requests again: they regenerate from scratch under the current policy,
  so their tokens carry the current version. Samples of a resubmitted request that had already come
  back are generated again and discarded (counted in `discarded`), never delivered twice.
- an actor Ray cannot bring back (restarts exhausted) hands its requests to the surviving actors.

The fleet holds its parts as components: the requests it owes and their routing (`Owed`, with the per-actor
records, rollwise.control.ray.slots), the restart handling (`FleetRecovery`, rollwise.control.ray.fleet_recovery),
the collective weight group (rollwise.control.ray.fleet_collective) and the merged timeline
(rollwise.control.ray.fleet_timeline); this module keeps the calls to the actors.
"""

from __future__ import annotations

import collections
import functools
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError

from rollwise.control.ray.calls import get_all
from rollwise.control.ray.engine_actor import GONE
from rollwise.control.ray.fleet_collective import FleetWeightGroup
from rollwise.control.ray.fleet_recovery import FleetRecovery
from rollwise.control.ray.fleet_timeline import TIMELINE_REFRESH_S, FleetView
from rollwise.control.ray.slots import Owed, Slot
from rollwise.types.generation import Completion, GenerationRequest, ModelInfo
from rollwise.types.weight_update import WeightUpdate

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

DRAIN_WAIT_S = 0.25  # how long one drain call waits on an idle actor before it answers []


def _locked(method: Callable) -> Callable:
    """One caller at a time: the agent layer drives a worker from several threads (sessions submit
    while a drain thread takes completions), as a local EngineWorker allows."""

    @functools.wraps(method)
    def wrapper(self: RayEngineFleet, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class _Running:
    """`worker._thread.is_alive()`, which rollwise.agent.generator asks a local EngineWorker."""

    def __init__(self, fleet: RayEngineFleet) -> None:
        self._fleet = fleet

    def is_alive(self) -> bool:
        return not self._fleet._closed


class RayEngineFleet:
    """The EngineWorker interface over engine actors (see the module docstring for the guarantees)."""

    def __init__(self, actors: list[ActorHandle], bundles: list[int], *, initial: WeightUpdate,
                 max_restarts: int, restart_timeout_s: float, start_timeout_s: float,
                 collective: FleetWeightGroup | None = None) -> None:
        self.slots = [Slot(i, a, b) for i, (a, b) in enumerate(zip(actors, bundles))]
        self.collective = collective  # sync.sender=collective: updates are broadcast over this group
        self._update = _in_store(initial)  # the weights engines must hold now (an ObjectRef payload)
        self._paused = False
        self._closed = False
        self.owed = Owed(self.slots)  # every request given until each of its samples came back
        self.recovery = FleetRecovery(
            self.slots, self.owed, max_restarts=max_restarts, restart_timeout_s=restart_timeout_s,
            resync=lambda slot: ray.get(self._send(slot)), paused=lambda: self._paused,
            version=lambda: self._version, stale=self._stale)
        self._buffer: collections.deque[tuple[int, Completion]] = collections.deque()
        self._last_refresh = 0.0
        self._dirty_since = math.inf  # merged timeline is stale from this time on
        self.delivered = 0
        # Tests and debugging: every delivery as (slot, incarnation token, completion), when a list.
        self.deliveries: list[tuple[int, str, Completion]] | None = None
        self.on_deliver: Callable[[RayEngineFleet, int, Completion], None] | None = None
        self.view: FleetView | None = None
        self._lock = threading.RLock()
        self._thread = _Running(self)
        infos = get_all([a.info.remote() for a in actors], start_timeout_s, "engine actors to start")
        for slot, info in zip(self.slots, infos):
            slot.info = info
        # Every engine starts from the trainer's current weights (a resumed run's included), through
        # the object store; with sync.sender=collective every engine then joins the weight group.
        ray.get([self._send(s) for s in self.slots])
        if self.collective is not None:
            self.collective.form(self.slots)
        self.view = FleetView(self, infos[0]["name"], sum(i["max_num_seqs"] for i in infos))
        self.engine = self.view  # what a local EngineWorker calls its engine (read-only here)

    @property
    def restarts(self) -> int:
        return self.recovery.restarts

    @property
    def restart_log(self) -> list[dict[str, Any]]:
        return self.recovery.restart_log

    @property
    def discarded(self) -> int:
        """Samples generated again after a restart that had already come back."""
        return self.owed.discarded

    def _stale(self, since: float) -> None:
        self._dirty_since = min(self._dirty_since, since)

    # ------------------------------------------------------------ EngineWorker interface

    @_locked
    def submit(self, requests: list[GenerationRequest]) -> None:
        by_slot: dict[int, list[GenerationRequest]] = collections.defaultdict(list)
        for r in requests:
            if r.request_id in self.owed.requests:
                raise ValueError(f"request id {r.request_id!r} is already in flight")
            by_slot[self.owed.route(r.request_id)].append(r)
        for s, reqs in by_slot.items():  # recorded first: a death during submit resubmits them
            for r in reqs:
                self.owed.track(r, s)
        calls = {s: self.slots[s].actor.submit.remote(reqs, self.slots[s].token) for s, reqs in by_slot.items()}
        for s, ref in calls.items():
            try:
                ray.get(ref)
            except GONE as exc:
                self.recovery.recover(s, exc)
            except Exception:
                for r in by_slot[s]:  # refused (bad request): nothing of it is in the engine
                    self.owed.untrack(r.request_id)
                raise

    @_locked
    def next_completion(self, timeout: float) -> Completion | None:
        if self._closed:  # actors gone: nothing more will come (a drain thread may still ask once)
            return self._buffer.popleft()[1] if self._buffer else None
        if not self._buffer:
            self._poll(timeout)
        if not self._buffer:
            return None
        s, c = self._buffer.popleft()
        self.delivered += 1
        if self.deliveries is not None:
            self.deliveries.append((s, self.slots[s].token, c))
        if self.on_deliver is not None:
            self.on_deliver(self, s, c)
        return c

    @_locked
    def abort(self, request_ids: list[str]) -> list[Completion]:
        out: list[Completion] = []
        todo = [rid for rid in dict.fromkeys(request_ids) if rid in self.owed.requests]
        while todo:
            by_slot: dict[int, list[str]] = collections.defaultdict(list)
            for rid in todo:
                if rid in self.owed.requests:
                    by_slot[self.owed.requests[rid].slot].append(rid)
            todo = []
            calls = {s: self.slots[s].actor.abort.remote(rids, self.slots[s].ack, self.slots[s].token)
                     for s, rids in by_slot.items()}
            for s, ref in calls.items():
                try:
                    aborted, unacked = ray.get(ref)
                except GONE as exc:
                    self.recovery.recover(s, exc)  # resubmitted (possibly elsewhere): abort them there
                    todo += by_slot[s]
                    continue
                self._take(self.slots[s], unacked)  # finished before the abort: next_completion has them
                out += [c for c in aborted if self.owed.receive(s, c)]
        return out

    @property
    def _version(self) -> int:
        return self._update.version

    def _send(self, slot: Slot) -> ObjectRef:
        """The current update to one actor: the manifest, and the payload's ObjectRef (Ray hands the
        actor the tensors from the object store). With sync.sender=collective the fleet keeps the
        tensors here and puts them in the store only when a restarted engine needs them."""
        self._update = _in_store(self._update)
        return slot.actor.load_weights.remote(self._update.manifest, self._update.payload, slot.token)

    @_locked
    def load_weights(self, update: WeightUpdate) -> None:
        """Every live engine checks the whole update, then applies it between two steps; a refusal
        (WeightUpdateError) is raised here, and an engine restarted later gets this update too."""
        if self.collective is None:
            self._update = _in_store(update)
            self._broadcast(self._send)
        else:  # one broadcast to every live engine; only an update all of them took is kept for restarts
            self._update = self.collective.push_update(self.slots, update, self.recovery.recover)
        self.refresh_timeline(force=True)

    @_locked
    def pause(self) -> None:
        self._paused = True
        self._broadcast(lambda slot: slot.actor.pause.remote(slot.token))

    @_locked
    def resume(self) -> None:
        self._paused = False
        self._broadcast(lambda slot: slot.actor.resume.remote(slot.token))

    @_locked
    def model_info(self) -> ModelInfo:
        """The first live engine's (every engine runs the same model and version)."""
        slot = next(s for s in self.slots if s.alive)
        return ray.get(slot.actor.model_info.remote())

    @_locked
    def close(self) -> None:
        if self._closed:
            return
        try:
            self.refresh_timeline(force=True)
        except Exception:  # teardown must not fail on a dying cluster
            pass
        self._closed = True
        if self.collective is not None:
            self.collective.abandon()
        for slot in self.slots:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:
                pass

    # ------------------------------------------------------------ metrics

    def metrics(self) -> dict[str, float]:
        return {"engine_restarts": float(self.restarts), "engines_alive": float(sum(s.alive for s in self.slots)),
                "engine_restart_discarded": float(self.discarded)}

    placement_metrics = metrics  # the name the training loop used before the RolloutBackend protocol

    def pending_samples(self, slot: int) -> int:
        return self.slots[slot].load

    @_locked
    def refresh_timeline(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._closed or self.view is None or (not force and now - self._last_refresh < TIMELINE_REFRESH_S):
            return
        self._last_refresh = now
        live = [s for s in self.slots if s.alive]
        refs = [s.actor.timeline_since.remote(s.timeline_cursor, s.token) for s in live]
        since, self._dirty_since = self._dirty_since, math.inf
        for slot, ref in zip(live, refs):
            try:
                points, offset = ray.get(ref, timeout=30)
            except (*GONE, GetTimeoutError):
                continue  # a dead actor is noticed (and restarted) by the calls that drive it
            if not points:
                continue
            # Same node: the shift is ~0 (one CLOCK_MONOTONIC); across nodes, via the wall clocks.
            shift = offset - (time.time() - time.monotonic())
            slot.timeline_cursor += len(points)
            new = [(t + shift, n) for t, n in points]
            since = min(since, new[0][0])
            if slot.timeline and new[0] < slot.timeline[-1]:
                slot.timeline = sorted(slot.timeline + new)
            else:
                slot.timeline += new
        if since < math.inf:
            self.view.merge([s.timeline for s in self.slots], since)

    # ------------------------------------------------------------ internals

    def _poll(self, timeout: float) -> None:
        live = [s for s in self.slots if s.alive]
        for slot in live:
            if slot.drain_ref is None:
                slot.drain_ref = slot.actor.drain.remote(slot.ack, DRAIN_WAIT_S, slot.token)
        refs = {slot.drain_ref: slot for slot in live}
        ready, _ = ray.wait(list(refs), num_returns=1, timeout=timeout)
        if ready:  # take whatever else is ready too
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in ready:
            slot = refs[ref]
            slot.drain_ref = None
            try:
                items = ray.get(ref)
            except GONE as exc:
                self.recovery.recover(slot.index, exc)
                continue
            self._take(slot, items)
        self.refresh_timeline()

    def _take(self, slot: Slot, items: list[tuple[int, Completion]]) -> None:
        """Completions an actor sent (each reply: everything after the ack it was given, in order)."""
        for seq, c in items:
            if seq <= slot.ack:
                continue  # already taken from an earlier reply
            slot.ack = seq
            if self.owed.receive(slot.index, c):
                self._buffer.append((slot.index, c))

    def _broadcast(self, call: Callable[[Slot], ObjectRef]) -> None:
        """Run a state-setting call on every live engine; an engine that died gets the current state
        (weights, version, paused) when it comes back, which covers the call."""
        calls = [(s, call(s)) for s in self.slots if s.alive]
        for slot, ref in calls:
            try:
                ray.get(ref)
            except GONE as exc:
                self.recovery.recover(slot.index, exc)


def _in_store(update: WeightUpdate) -> WeightUpdate:
    """The update with its tensors in the object store (put once, fetched by every engine)."""
    if isinstance(update.payload, Mapping):
        return update.with_payload(ray.put(dict(update.payload)))
    return update


"""The fleet: the EngineWorker interface over engine actors (rollwise.control.ray_engine_actor).

`EngineActor` builds its own engine (rollwise.engine.factory) inside the actor and runs it on an
`EngineWorker` thread, exactly as local placement does in the trainer's process. `RayEngineFleet`
is the RolloutBackend (rollwise.types.contracts) the rollout controller drives: submit / next_completion /
abort / pause / resume / load_weights over `ray.num_engines` actors. A weight update travels as
its manifest plus an ObjectRef: each actor fetches the tensors from the object store and commits
them through the checked two-phase path; with `sync.sender: collective` it is one gloo/NCCL broadcast
from this process to every actor instead (rollwise.control.ray_fleet_collective), committed the same way.

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

The restart handling lives in rollwise.control.ray_fleet_recovery (a mixin of the fleet), the merged
timeline in rollwise.control.ray_fleet_timeline, the per-actor and per-request records they share in
rollwise.control.ray_slots; this module keeps the fleet's bookkeeping and calls.
"""

from __future__ import annotations

import collections
import functools
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import ray
from ray.exceptions import GetTimeoutError

from rollwise.control.ray_calls import get_all
from rollwise.control.ray_engine_actor import GONE
from rollwise.control.ray_fleet_collective import FleetWeightGroup
from rollwise.control.ray_fleet_recovery import FleetRecovery
from rollwise.control.ray_fleet_timeline import TIMELINE_REFRESH_S, FleetView
from rollwise.control.ray_slots import Outstanding, Slot
from rollwise.types.generation import ModelInfo
from rollwise.types.generation import Completion, GenerationRequest
from rollwise.types.weight_update import WeightUpdate

DRAIN_WAIT_S = 0.25  # how long one drain call waits on an idle actor before it answers []


def _group_key(request_id: str) -> str:
    """Requests of one GRPO group share the part before '/' (the controller names a group's request
    `g12` and a regenerated sample of it `g12/3#1`): they go to the same engine (shared prefix)."""
    return request_id.split("/", 1)[0]


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


class RayEngineFleet(FleetRecovery):
    """The EngineWorker interface over engine actors (see the module docstring for the guarantees)."""

    def __init__(self, actors: list[Any], bundles: list[int], *, initial: WeightUpdate,
                 max_restarts: int, restart_timeout_s: float, start_timeout_s: float,
                 collective: FleetWeightGroup | None = None) -> None:
        self.slots = [Slot(i, a, b) for i, (a, b) in enumerate(zip(actors, bundles))]
        self.collective = collective  # sync.sender=collective: updates are broadcast over this group
        self.max_restarts = max_restarts
        self.restart_timeout_s = restart_timeout_s
        self._update = _in_store(initial)  # the weights engines must hold now (an ObjectRef payload)
        self._paused = False
        self._closed = False
        self._requests: dict[str, Outstanding] = {}
        self._home: dict[str, int] = {}  # group key -> slot
        self._home_count: collections.Counter[str] = collections.Counter()
        self._buffer: collections.deque[tuple[int, Completion]] = collections.deque()
        self._last_refresh = 0.0
        self._dirty_since = math.inf  # merged timeline is stale from this time on
        self.restarts = 0
        self.restart_log: list[dict[str, Any]] = []
        self.discarded = 0  # samples generated again after a restart that had already come back
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

    # ------------------------------------------------------------ EngineWorker interface

    @_locked
    def submit(self, requests: list[GenerationRequest]) -> None:
        by_slot: dict[int, list[GenerationRequest]] = collections.defaultdict(list)
        for r in requests:
            if r.request_id in self._requests:
                raise ValueError(f"request id {r.request_id!r} is already in flight")
            by_slot[self._route(r.request_id)].append(r)
        for s, reqs in by_slot.items():  # recorded first: a death during submit resubmits them
            for r in reqs:
                self._track(r, s)
        calls = {s: self.slots[s].actor.submit.remote(reqs, self.slots[s].token) for s, reqs in by_slot.items()}
        for s, ref in calls.items():
            try:
                ray.get(ref)
            except GONE as exc:
                self._recover(s, exc)
            except Exception:
                for r in by_slot[s]:  # refused (bad request): nothing of it is in the engine
                    self._untrack(r.request_id)
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
        todo = [rid for rid in dict.fromkeys(request_ids) if rid in self._requests]
        while todo:
            by_slot: dict[int, list[str]] = collections.defaultdict(list)
            for rid in todo:
                if rid in self._requests:
                    by_slot[self._requests[rid].slot].append(rid)
            todo = []
            calls = {s: self.slots[s].actor.abort.remote(rids, self.slots[s].ack, self.slots[s].token)
                     for s, rids in by_slot.items()}
            for s, ref in calls.items():
                try:
                    aborted, unacked = ray.get(ref)
                except GONE as exc:
                    self._recover(s, exc)  # resubmitted (possibly elsewhere): abort them there
                    todo += by_slot[s]
                    continue
                self._take(self.slots[s], unacked)  # finished before the abort: next_completion has them
                out += [c for c in aborted if self._receive(s, c)]
        return out

    @property
    def _version(self) -> int:
        return self._update.version

    def _send(self, slot: Slot) -> Any:
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
            self._update = self.collective.push_update(self.slots, update, self._recover)
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

    def _route(self, request_id: str) -> int:
        key = _group_key(request_id)
        s = self._home.get(key)
        if s is None or not self.slots[s].alive:
            s = min((slot for slot in self.slots if slot.alive), key=lambda slot: slot.load).index
            self._home[key] = s
        return s

    def _track(self, r: GenerationRequest, s: int, pending: set[int] | None = None) -> None:
        pending = set(range(r.params.n)) if pending is None else pending
        self._requests[r.request_id] = Outstanding(r, s, pending)
        self._home_count[_group_key(r.request_id)] += 1
        self.slots[s].load += len(pending)

    def _untrack(self, request_id: str) -> None:
        o = self._requests.pop(request_id)
        self.slots[o.slot].load -= len(o.pending)
        key = _group_key(request_id)
        self._home_count[key] -= 1
        if self._home_count[key] <= 0:
            del self._home_count[key]
            self._home.pop(key, None)

    def _receive(self, s: int, c: Completion) -> bool:
        """Account for a completion from slot s; False if it is not owed (already delivered)."""
        o = self._requests.get(c.request_id)
        if o is None or o.slot != s or c.index not in o.pending:
            self.discarded += 1
            return False
        o.pending.discard(c.index)
        self.slots[s].load -= 1
        if not o.pending:
            self._untrack(c.request_id)
        return True

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
                self._recover(slot.index, exc)
                continue
            self._take(slot, items)
        self.refresh_timeline()

    def _take(self, slot: Slot, items: list[tuple[int, Completion]]) -> None:
        """Completions an actor sent (each reply: everything after the ack it was given, in order)."""
        for seq, c in items:
            if seq <= slot.ack:
                continue  # already taken from an earlier reply
            slot.ack = seq
            if self._receive(slot.index, c):
                self._buffer.append((slot.index, c))

    def _broadcast(self, call: Callable[[Slot], Any]) -> None:
        """Run a state-setting call on every live engine; an engine that died gets the current state
        (weights, version, paused) when it comes back, which covers the call."""
        calls = [(s, call(s)) for s in self.slots if s.alive]
        for slot, ref in calls:
            try:
                ray.get(ref)
            except GONE as exc:
                self._recover(slot.index, exc)


def _in_store(update: WeightUpdate) -> WeightUpdate:
    """The update with its tensors in the object store (put once, fetched by every engine)."""
    if isinstance(update.payload, Mapping):
        return update.with_payload(ray.put(dict(update.payload)))
    return update


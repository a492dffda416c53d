"""The pool's slot loops: each slot's control thread plans (rollwise.pool.scheduler.plan), admits a job's
queued requests to that job's own engine, routes finished samples to the job's outbox, and switches the slot
between jobs (sleep the outgoing engine, wake or build the incoming one, through EngineWorker.swap_engine).
A slot's engine belongs to a *tenancy* (Job.key): a full-parameter job, or a LoRA base whose engine serves
every LoRA job on that base in one batch, each request with its own job's adapter (no switch between them).

`SlotLoops` is EnginePool's half that runs on the slot threads (rollwise.pool.engine_pool holds the other:
jobs, weights, requests, reports); it reads the pool's state through the attributes declared below.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rollwise.config import EngineConfig
from rollwise.engine.contract import add_all
from rollwise.engine.factory import create_engine
from rollwise.engine.types import Completion, GenerationRequest
from rollwise.pool.jobs import Job, LoraBase, QueuedRequest, Slot, empty_abort, stamp
from rollwise.pool.scheduler import JobView, Policy, SlotView, plan
from rollwise.pool.states import ACTIVE, EVICTED, SLEEPING, StateMachine

TICK_S = 0.005  # a busy slot's control loop: how long it waits for a finished sample before re-planning
IDLE_TICK_S = 0.05  # an idle slot re-plans at least this often (time slices expire, jobs finish training)


class SlotLoops:
    # EnginePool's state these loops work on (EnginePool.__init__ sets it)
    lock: threading.RLock
    jobs: dict[str, Job]
    bases: dict[str, LoraBase]
    slots: list[Slot]
    states: StateMachine
    policy: Policy
    engine_config: EngineConfig
    max_sleeping: int
    seed: int | None
    prefix_cache_tokens: int
    isolation_checks: int
    violations: list[str]
    _by_internal: dict[str, QueuedRequest]
    _stop: threading.Event
    _kick: threading.Condition
    _kicks: int

    def tenancy(self, key: str) -> Job | LoraBase | None: ...  # EnginePool.tenancy

    def kick(self) -> None:
        """New work (or a resumed job): idle slot loops re-plan now instead of at their next idle tick."""
        with self._kick:
            self._kicks += 1
            self._kick.notify_all()

    def _slot_loop(self, slot: Slot) -> None:
        seen = 0
        switched = False
        while not self._stop.is_set():
            try:
                if slot.running > 0:  # samples running here: wait for the next one to finish
                    with slot.route_lock:
                        self._drain(slot, timeout=TICK_S)
                elif not switched:  # idle: sleep until kicked (submit, resume), re-planning at least every IDLE_TICK_S
                    with self._kick:
                        if self._kicks == seen:
                            self._kick.wait(IDLE_TICK_S)
                        seen = self._kicks
                    with slot.route_lock:
                        self._drain(slot)
                # Right after a switch the new job's queued work is admitted at once: the kick that announced
                # it was consumed before the switch, and waiting for the next idle tick cost up to
                # IDLE_TICK_S per switch (found by the simulator: bench mux's shared jobs waited ~50 ms a step).
                switched = self._tick(slot)
            except Exception as exc:  # noqa: BLE001 - keep serving the other jobs; /state shows it
                slot.errors.append(f"{time.strftime('%H:%M:%S')} {exc!r}")
                del slot.errors[:-20]
                time.sleep(0.1)

    def _drain(self, slot: Slot, timeout: float = 0.0) -> None:
        """Route the slot's finished samples to their jobs (caller holds slot.route_lock)."""
        c = slot.worker.next_completion(timeout=timeout)
        while c is not None:
            with self.lock:
                req = self._by_internal.get(c.request_id)
                job = self.jobs.get(req.job) if req is not None else None
                if req is not None and job is None:  # its job detached
                    self._by_internal.pop(c.request_id, None)
                if req is not None and job is not None:
                    self._count_finished(slot, job, req, c)
                    bad = [v for v in c.versions if v not in job.versions]
                    if bad:
                        self.violations.append(f"job {job.name}: sample of {req.public_id} carries versions "
                                               f"{sorted(set(bad))} this job never pushed")
                    if req.waiter is None:
                        job.post(stamp(c, req, slot.index))
            c = slot.worker.next_completion(timeout=0)

    def _count_finished(self, slot: Slot, job: Job, req: QueuedRequest, c: Completion) -> None:
        """One sample of `req` came back from `slot` (caller holds self.lock)."""
        now = time.monotonic()
        self._account(slot, now)
        req.remaining -= 1
        slot.running -= 1
        slot.running_by[job.name] = slot.running_by.get(job.name, 0) - 1
        job.running -= 1
        job.samples += 1
        job.tokens += len(c.token_ids)
        job.timeline.append((now, job.running))
        if req.waiter is not None:
            req.done.append(c)
        if req.remaining <= 0:
            self._forget(job, req)

    def _forget(self, job: Job, req: QueuedRequest) -> None:
        job.requests.pop(req.public_id, None)
        self._by_internal.pop(req.internal_id, None)
        if req.waiter is not None:
            req.waiter.set()

    def _account(self, slot: Slot, now: float) -> None:
        """Charge the time since the last call to the slot's active job (caller holds self.lock)."""
        dt = now - slot.accounted_at
        slot.accounted_at = now
        tenancy = self.tenancy(slot.job) if slot.job is not None else None
        if tenancy is None or dt <= 0:
            return
        if isinstance(tenancy, Job):
            tenancy.allocated_s += dt
            if slot.running > 0:
                tenancy.busy_s += dt
            return
        # A LoRA base's engine: its time is split among its jobs, evenly while it is held, and by their share
        # of the running samples while it is busy (engine-hours add up to the slot's time, never more).
        members = list(tenancy.members.values())
        for job in members:
            job.allocated_s += dt / len(members)
            running = slot.running_by.get(job.name, 0)
            if running > 0 and slot.running > 0:
                job.busy_s += dt * running / slot.running

    def _views(self) -> tuple[list[SlotView], list[JobView]]:
        slots = [SlotView(s.index, s.job, s.since, s.running, s.capacity) for s in self.slots]
        jobs = [JobView(j.name, j.priority, j.queued_samples() if j.version is not None else 0,
                        j.busy_s + j.transition_s, j.paused, base=j.model if j.lora else None)
                for j in self.jobs.values()]
        return slots, jobs

    def _tick(self, slot: Slot) -> bool:
        """Plan this slot once: admit work or switch jobs. True when it switched."""
        # Deciding, assigning and submitting happen under route_lock: an abort (which takes it too) never
        # sees a request assigned to the slot but not yet on its engine.
        with slot.route_lock:
            switch = self._decide_and_admit(slot)
        if switch is None:
            return False
        try:
            self._switch(slot, *switch)
        finally:
            with self.lock:
                slot.switching = False
                slot.since = time.monotonic()
                if slot.job is not None and self.states.state(slot.index, slot.job) is not ACTIVE:
                    slot.job = None  # the switch failed (see the slot's errors): the slot is free
        return True

    def _decide_and_admit(self, slot: Slot) -> tuple[Job | LoraBase | None, Job | LoraBase] | None:
        admit: list[QueuedRequest] = []
        switch: tuple[Job | LoraBase | None, Job | LoraBase] | None = None
        with self.lock:
            now = time.monotonic()
            self._account(slot, now)
            if slot.job is not None and self.tenancy(slot.job) is None:
                return None  # its job is detaching: detach() evicts its engine and frees the slot
            slots, jobs = self._views()
            decision = plan(slots, jobs, now, self.policy)[slot.index]
            if decision.action == "serve":
                room = slot.capacity - slot.running
                for name in decision.tenants:  # a LoRA base's jobs share the batch, most deserving first
                    admitted, room = self._take(slot, self.jobs[name], room, now)
                    admit += admitted
            elif decision.action == "switch":
                incoming = self.tenancy(decision.job)
                assert incoming is not None  # plan() names only tenancies of attached jobs
                switch = (self.tenancy(slot.job) if slot.job is not None else None, incoming)
                slot.job, slot.since, slot.switching = decision.job, now, True
                slot.running_by.clear()
        for name in dict.fromkeys(r.job for r in admit):
            self._admit(slot, [r for r in admit if r.job == name])
        return switch

    def _take(self, slot: Slot, job: Job, room: int, now: float) -> tuple[list[QueuedRequest], int]:
        """Whole queued requests of `job` that fit in `room` samples, assigned to `slot` (caller holds self.lock)."""
        taken = []
        while job.queue and not job.paused and job.queue[0].remaining <= room:
            req = job.queue.popleft()
            req.slot = slot.index
            room -= req.remaining
            slot.running += req.remaining
            slot.running_by[job.name] = slot.running_by.get(job.name, 0) + req.remaining
            job.running += req.remaining
            job.requests_admitted += 1
            taken.append(req)
        if taken:
            job.timeline.append((now, job.running))
        return taken, room

    def _admit(self, slot: Slot, reqs: list[QueuedRequest]) -> None:
        job = self.jobs.get(reqs[0].job)
        if job is None:
            return
        with job.lock:
            inst = slot.instances.get(job.key)
            # The isolation invariant: this job's request runs only on this job's engine (a LoRA job's: its base's,
            # with the job's own adapter), holding its current weights.
            problem = None
            held = inst.loaded_adapters().get(job.name) if job.lora and inst is not None else getattr(
                inst, "policy_version", None)
            if inst is None or self.states.state(slot.index, job.key) is not ACTIVE:
                problem = f"slot {slot.index}: job {job.name!r} is not active there"
            elif getattr(inst, "pool_owner", None) != job.key:
                problem = f"slot {slot.index}: engine belongs to {getattr(inst, 'pool_owner', None)!r}, not {job.key!r}"
            elif held != job.version:
                problem = (f"slot {slot.index}: job {job.name!r} engine holds version {held}, "
                           f"the job's current version is {job.version}")
            if problem is None:
                self.isolation_checks += 1
                try:
                    slot.worker.call(lambda e: _submit_to(e, inst, [r.request for r in reqs]))
                    return
                except Exception as exc:  # noqa: BLE001 - refused: the samples come back as aborted
                    problem = f"slot {slot.index}: engine refused job {job.name!r}'s requests: {exc}"
            self.violations.append(problem)
        with self.lock:
            for req in reqs:
                for i in range(req.remaining):
                    c = empty_abort(req, i)
                    self._count_finished(slot, job, req, c)
                    if req.waiter is None:
                        job.post(stamp(c, req, slot.index) | {"error": problem})

    def _switch(self, slot: Slot, prev_job: Job | LoraBase | None, new_job: Job | LoraBase) -> None:
        worker = slot.worker
        target = new_job.name
        if prev_job is not None:
            with prev_job.lock:  # detach() evicts under the same lock: whichever comes first, the other sees it
                inst = slot.instances.get(prev_job.name)
                if inst is not None and self.states.state(slot.index, prev_job.name) is ACTIVE:
                    t = time.perf_counter()

                    def sleep(_e: Any, inst: Any = inst) -> None:
                        if inst.has_unfinished():
                            raise RuntimeError("switching away from an engine with requests in flight")
                        inst.sleep()
                        inst.reset_timeline()

                    worker.call(sleep)  # between two steps; with nothing unfinished, it is not stepped again
                    worker.swap_engine(None)
                    self.states.transition(slot.index, prev_job.name, SLEEPING, time.perf_counter() - t,
                                           f"slot switches to {target}")
                    slot.last_active[prev_job.name] = time.monotonic()
        self._evict_beyond_budget(slot, keep=target)
        with new_job.lock:
            if new_job.detached:
                with self.lock:
                    slot.job = None
                return
            inst = slot.instances.get(new_job.name)
            state = self.states.state(slot.index, new_job.name)
            lora = isinstance(new_job, LoraBase)
            weights, version = (None, None) if lora else (new_job.weights, new_job.version)
            paused = False if lora else new_job.paused  # a LoRA job's pause holds its admissions only
            t = time.perf_counter()
            if inst is not None and state is SLEEPING:
                why = "wake" + ("" if lora or inst.policy_version == version else " + weights")

                def wake(_e: Any, inst: Any = inst) -> None:
                    inst.wake()
                    if lora:
                        _sync_adapters(inst, new_job)
                    elif inst.policy_version != version:
                        inst.update_weights(weights, version)
                    inst.resume() if not paused else inst.pause()

                worker.call(wake)  # on the engine thread (the slot steps nothing meanwhile)
                worker.swap_engine(inst)
            else:
                inst = self._build(new_job)
                if paused:
                    inst.pause()
                worker.swap_engine(inst)
                slot.instances[new_job.name] = inst
                why = "load"
            seconds = time.perf_counter() - t
            self.states.transition(slot.index, new_job.name, ACTIVE, seconds,
                                   f"{why} for {target}" + (f" (after {prev_job.name})" if prev_job else ""))
            with self.lock:
                charged = list(new_job.members.values()) if lora else [new_job]
                for job in charged:  # a LoRA base's switch is shared by its jobs
                    job.transition_s += seconds / len(charged)

    def _build(self, tenancy: Job | LoraBase) -> Any:
        lora = isinstance(tenancy, LoraBase)
        engine = create_engine(self.engine_config, tenancy.template, tenancy.tokenizer,
                               max_model_len=tenancy.max_model_len, eos_token_ids=tenancy.eos_ids,
                               policy_version=0 if lora else tenancy.version, seed=self.seed,
                               model_name=tenancy.model, tokenizer_fingerprint=tenancy.fingerprint,
                               prefix_cache_tokens=self.prefix_cache_tokens)
        if lora:  # the base as loaded (LoRA jobs never change it), and every member's latest adapter
            _sync_adapters(engine, tenancy)
        else:
            engine.update_weights(tenancy.weights, tenancy.version)  # the job's latest pushed weights, validated whole
        engine.pool_owner = tenancy.name
        return engine

    def _evict_beyond_budget(self, slot: Slot, keep: str) -> None:
        """At most max_sleeping sleeping engines per slot (host memory): evict the least recently used."""
        sleeping = [j for j in self.states.jobs_in(slot.index, SLEEPING) if j != keep]
        sleeping.sort(key=lambda j: slot.last_active.get(j, 0.0))
        for name in sleeping[: max(0, len(sleeping) - self.max_sleeping)]:
            with self.lock:
                job = self.tenancy(name)
            lock = job.lock if job is not None else threading.Lock()
            with lock:
                if self.states.state(slot.index, name) is not SLEEPING:
                    continue
                t = time.perf_counter()
                slot.instances.pop(name, None)
                self.states.transition(slot.index, name, EVICTED, time.perf_counter() - t,
                                       f"more than {self.max_sleeping} sleeping engines on the slot")


def _submit_to(current: Any, inst: Any, requests: list[GenerationRequest]) -> None:
    """On the slot's engine thread: the engine being stepped must be the job's own."""
    if current is not inst:
        raise RuntimeError("the slot is stepping another engine than the job's")
    add_all(inst, requests)



def _sync_adapters(inst: Any, base: LoraBase) -> None:
    """A LoRA base's engine serves exactly its jobs' latest adapters (caller holds base.lock; the engine is
    not being stepped): detached jobs' adapters off, pushed versions on."""
    loaded = inst.loaded_adapters()
    for name in set(loaded) - set(base.members):
        inst.unload_adapter(name)
    for job in base.members.values():
        if job.version is not None and job.adapter is not None and loaded.get(job.name) != job.version:
            inst.load_adapter(job.adapter, job.weights, job.version)

"""The pool's slot loops: each slot's control thread plans (rollwise.pool.scheduler.plan), admits a job's
queued requests to that job's own engine, routes finished samples to the job's outbox, and switches the slot
between jobs (sleep the outgoing engine, wake or build the incoming one, through EngineWorker.swap_engine).
A slot's engine belongs to a *tenancy* (Job.key): a full-parameter job, or a LoRA base whose engine serves
every LoRA job on that base in one batch, each request with its own job's adapter (no switch between them).

A tenant's failure stays its own (issue 43): a job whose weights or adapter fail to load when its engine is
activated, or break an engine step (the slot's engine thread dies: `_recover` gives the slot a fresh one and
finds the culprit by probing each suspect alone), is *faulted*: its requests are answered with the error and
new ones refused until it pushes weights that load, while the slot keeps serving the other jobs.

`SlotLoops` is the component of EnginePool that runs on the slot threads (rollwise.pool.engine_pool holds the
API side: jobs, weights, requests, reports); both work on one PoolState (rollwise.pool.pool_state).
"""

from __future__ import annotations

import contextlib
import threading
import time

from rollwise.engine.contract import Engine
from rollwise.engine.core import EngineWorker
from rollwise.types.generation import Completion
from rollwise.pool.jobs import Job, LoraBase, PoolError, QueuedRequest, Slot, empty_abort, fault_error, stamp
from rollwise.pool.pool_state import PoolState
from rollwise.pool.scheduler import JobView, SlotView, plan
from rollwise.pool.slot_migration import SlotMigration
from rollwise.pool.states import ACTIVE, EVICTED, SLEEPING
from rollwise.pool.tenant_engines import TenantEngines, put_aside, same_engine, submit_to, sync_adapters

TICK_S = 0.005  # a busy slot's control loop: how long it waits for a finished sample before re-planning
IDLE_TICK_S = 0.05  # an idle slot re-plans at least this often (time slices expire, jobs finish training)


class SlotLoops:
    """The loops on the slot threads, over the pool's shared state (EnginePool owns both and starts `run` per slot)."""

    def __init__(self, state: PoolState, engines: TenantEngines) -> None:
        self.state = state
        self.engines = engines
        # a draining slot's requests move to a peer (issue 42); one lost in the move is queued again
        self.migration = SlotMigration(state, self.drain, self.requeue_lost)

    def run(self, slot: Slot) -> None:
        seen = 0
        switched = False
        while not self.state.stop.is_set():
            try:
                if slot.running > 0:  # samples running here: wait for the next one to finish
                    with slot.route_lock:
                        self.drain(slot, timeout=TICK_S)
                elif not switched:  # idle: sleep until kicked (submit, resume), re-planning at least every IDLE_TICK_S
                    with self.state.wakeup:
                        if self.state.kicks == seen:
                            self.state.wakeup.wait(IDLE_TICK_S)
                        seen = self.state.kicks
                    with slot.route_lock:
                        self.drain(slot)
                # Right after a switch the new job's queued work is admitted at once: the kick that announced
                # it was consumed before the switch, and waiting for the next idle tick cost up to
                # IDLE_TICK_S per switch (found by the simulator: bench mux's shared jobs waited ~50 ms a step).
                switched = self._tick(slot)
            except Exception as exc:  # noqa: BLE001 - keep serving the other jobs; /state shows it
                if slot.worker.failure is not None:  # the engine thread died in a step: contain it (_recover)
                    try:
                        self._recover(slot)
                        continue
                    except Exception as again:  # noqa: BLE001 - reported; the next pass tries again
                        exc = again
                slot.errors.append(f"{time.strftime('%H:%M:%S')} {exc!r}")
                del slot.errors[:-20]
                time.sleep(0.1)

    def drain(self, slot: Slot, timeout: float = 0.0) -> None:
        """Route the slot's finished samples to their jobs (caller holds slot.route_lock)."""
        c = slot.worker.next_completion(timeout=timeout)
        while c is not None:
            with self.state.lock:
                req = self.state.by_internal.get(c.request_id)
                job = self.state.jobs.get(req.job) if req is not None else None
                if req is not None and job is None:  # its job detached
                    self.state.by_internal.pop(c.request_id, None)
                if req is not None and job is not None:
                    again = c.index in req.returned  # a rerun (after an engine failure) samples it a second time
                    self.count_finished(slot, job, req, c)
                    bad = [v for v in c.versions if v not in job.versions]
                    if bad:
                        self.state.violations.append(f"job {job.name}: sample of {req.public_id} carries versions "
                                                     f"{sorted(set(bad))} this job never pushed")
                    if req.waiter is None and not again:
                        job.post(stamp(c, req, slot.index))
            c = slot.worker.next_completion(timeout=0)

    def count_finished(self, slot: Slot, job: Job, req: QueuedRequest, c: Completion) -> None:
        """One sample of `req` came back from `slot` (caller holds state.lock)."""
        now = time.monotonic()
        self.account(slot, now)
        req.remaining -= 1
        slot.running -= 1
        slot.running_by[job.name] = slot.running_by.get(job.name, 0) - 1
        job.running -= 1
        job.timeline.append((now, job.running))
        if c.index not in req.returned:  # (a rerun's second sample of an index is not answered again)
            req.returned.add(c.index)
            job.samples += 1
            job.tokens += len(c.token_ids)
            if req.waiter is not None:
                req.done.append(c)
        if req.remaining <= 0:
            self.forget(job, req)

    def forget(self, job: Job, req: QueuedRequest) -> None:
        job.requests.pop(req.public_id, None)
        self.state.by_internal.pop(req.internal_id, None)
        if req.waiter is not None:
            req.waiter.set()

    def account(self, slot: Slot, now: float) -> None:
        """Charge the time since the last call to the slot's active job (caller holds state.lock)."""
        dt = now - slot.accounted_at
        slot.accounted_at = now
        tenancy = self.state.tenancy(slot.job) if slot.job is not None else None
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
        tenancies = {j.key: t for j in self.state.jobs.values() if (t := self.state.tenancy(j.key)) is not None}
        # start-up-aware placement (issue 42): each tenancy's estimated start on each slot
        slots = [SlotView(s.index, s.job, s.since, s.running, s.capacity,
                          self.engines.tiers.starts(set(self.state.states.jobs_in(s.index, SLEEPING)), tenancies))
                 for s in self.state.slots]
        jobs = [JobView(j.name, j.priority, j.queued_samples() if j.version is not None and j.fault is None else 0,
                        j.busy_s + j.transition_s, j.paused, base=j.model if j.lora else None)
                for j in self.state.jobs.values()]
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
            with self.state.lock:
                slot.switching = False
                slot.since = time.monotonic()
                if slot.job is not None and self.state.states.state(slot.index, slot.job) is not ACTIVE:
                    slot.job = None  # the switch failed (see the slot's errors): the slot is free
        return True

    def _decide_and_admit(self, slot: Slot) -> tuple[Job | LoraBase | None, Job | LoraBase] | None:
        admit: list[QueuedRequest] = []
        switch: tuple[Job | LoraBase | None, Job | LoraBase] | None = None
        peer: Slot | None = None
        with self.state.lock:
            now = time.monotonic()
            self.account(slot, now)
            if slot.job is not None and self.state.tenancy(slot.job) is None:
                return None  # its job is detaching: detach() evicts its engine and frees the slot
            slots, jobs = self._views()
            decisions = plan(slots, jobs, now, self.state.policy)
            decision = decisions[slot.index]
            if decision.action == "serve":
                room = slot.capacity - slot.running
                for name in decision.tenants:  # a LoRA base's jobs share the batch, most deserving first
                    admitted, room = self._take(slot, self.state.jobs[name], room, now)
                    admit += admitted
            elif decision.action == "switch":
                switch = self._claim(slot, decision.job, now)
            elif decision.action == "drain" and self.state.policy.drain_by == "migration":
                peer = self.migration.peer(slot, decisions)  # issue 42: its requests move to a peer with room
        if admit:
            self._admit(slot, admit)
        if peer is not None and decision.target is not None:
            claimed: list[tuple[Job | LoraBase | None, Job | LoraBase]] = []
            target = decision.target

            def claim() -> None:  # (under state.lock) unless the job it drains for detached meanwhile
                if self.state.tenancy(target) is not None:
                    claimed.append(self._claim(slot, target, time.monotonic()))

            self.migration.drain_to_peer(slot, peer, claim)
            switch = claimed[0] if claimed else None
        return switch

    def _claim(self, slot: Slot, key: str, now: float) -> tuple[Job | LoraBase | None, Job | LoraBase]:
        """The slot switches to tenancy `key` (caller holds state.lock): (outgoing, incoming) for _switch."""
        incoming = self.state.tenancy(key)
        assert incoming is not None  # plan() names only tenancies of attached jobs
        switch = (self.state.tenancy(slot.job) if slot.job is not None else None, incoming)
        slot.job, slot.since, slot.switching = key, now, True
        slot.running_by.clear()
        return switch

    def _take(self, slot: Slot, job: Job, room: int, now: float) -> tuple[list[QueuedRequest], int]:
        """Whole queued requests of `job` that fit in `room` samples, assigned to `slot` (caller holds state.lock)."""
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

    def _admit(self, slot: Slot, admit: list[QueuedRequest]) -> None:
        """Put the admitted requests of every job on the slot's engine in ONE call on its engine thread, so jobs
        sharing a LoRA base's engine start in the same engine step (separate calls let the engine step between
        them: under load one job's requests could finish before the next job's arrived). Each job's isolation
        check and refusal stay its own."""
        by_job = {name: [r for r in admit if r.job == name] for name in sorted({r.job for r in admit})}
        jobs = {name: job for name in by_job if (job := self.state.jobs.get(name)) is not None}
        problems: dict[str, str] = {}
        with contextlib.ExitStack() as held:
            for job in jobs.values():  # in name order: the one order two admissions take several job locks in
                held.enter_context(job.lock)
            ready: dict[str, Engine] = {}
            for name, job in jobs.items():
                inst, problem = self._isolation(slot, job)
                if problem is None and inst is not None:
                    ready[name] = inst
                else:
                    problems[name] = problem or f"slot {slot.index}: job {name!r} has no engine"
            if ready:
                self.state.isolation_checks += len(ready)

                def submit_each(current: Engine | None) -> dict[str, Exception]:
                    refused: dict[str, Exception] = {}
                    for name, inst in ready.items():
                        try:
                            submit_to(current, inst, [r.request for r in by_job[name]])
                        except Exception as exc:  # noqa: BLE001 - this job's requests are refused, not the others'
                            refused[name] = exc
                    return refused

                # If the engine thread died, call() raises: the slot's recovery reruns these requests (_recover).
                for name, exc in slot.worker.call(submit_each).items():
                    problems[name] = f"slot {slot.index}: engine refused job {name!r}'s requests: {exc}"
            self.state.violations.extend(problems.values())
        for name, problem in problems.items():
            self._refuse(slot, jobs[name], by_job[name], problem)

    def _isolation(self, slot: Slot, job: Job) -> tuple[Engine | None, str | None]:
        """The isolation invariant (caller holds job.lock): this job's request runs only on this job's engine (a
        LoRA job's: its base's, with the job's own adapter), holding its current weights. (engine, problem)."""
        inst = slot.instances.get(job.key)
        held = None if inst is None else inst.loaded_adapters().get(job.name) if job.lora else inst.policy_version
        owners = [key for key, engine in slot.instances.items() if engine is inst]  # the slot's record of it
        if inst is None or self.state.states.state(slot.index, job.key) is not ACTIVE:
            return inst, f"slot {slot.index}: job {job.name!r} is not active there"
        if owners != [job.key]:
            return inst, f"slot {slot.index}: engine belongs to {owners!r}, not only {job.key!r}"
        if held != job.version:
            return inst, (f"slot {slot.index}: job {job.name!r} engine holds version {held}, "
                          f"the job's current version is {job.version}")
        return inst, None

    def _refuse(self, slot: Slot, job: Job, reqs: list[QueuedRequest], problem: str) -> None:
        """The requests come back as aborted samples carrying the problem."""
        with self.state.lock:
            for req in reqs:
                for i in range(req.remaining):
                    c = empty_abort(req, i)
                    self.count_finished(slot, job, req, c)
                    if req.waiter is None:
                        job.post(stamp(c, req, slot.index) | {"error": problem})

    def _switch(self, slot: Slot, prev_job: Job | LoraBase | None, new_job: Job | LoraBase) -> None:
        worker = slot.worker
        target = new_job.name
        if prev_job is not None:
            with prev_job.lock:  # detach() evicts under the same lock: whichever comes first, the other sees it
                inst = slot.instances.get(prev_job.name)
                if inst is not None and self.state.states.state(slot.index, prev_job.name) is ACTIVE:
                    t = time.perf_counter()
                    # nothing may sleep here: the incoming job of the same model takes this engine over at once
                    handover = self.state.max_sleeping == 0 and target not in slot.instances and same_engine(
                        prev_job, new_job)
                    worker.call(lambda _e, inst=inst: put_aside(inst, handover))  # between two steps, not stepped again
                    worker.swap_engine(None)
                    self.state.states.transition(slot.index, prev_job.name, SLEEPING, time.perf_counter() - t,
                                                 f"slot switches to {target}" + (" (memory kept)" if handover else ""))
                    slot.last_active[prev_job.name] = time.monotonic()
        recycled = self._evict_beyond_budget(slot, target, None if target in slot.instances else new_job)
        with new_job.lock:
            if new_job.detached:
                with self.state.lock:
                    slot.job = None
                return
            t = time.perf_counter()
            try:
                why, failed = self._activate(slot, new_job, recycled)
            except Exception as exc:
                if slot.worker.failure is not None or isinstance(new_job, LoraBase):
                    raise  # the engine thread died (the slot recovers), or the base itself: no one tenant's doing
                # The job's own weights fail on its engine: contain it to the job (the slot stays free).
                self._drop_instance(slot, new_job.name, f"its weights failed to load: {exc!r}")
                with self.state.lock:
                    self._fault(new_job, f"its weights (version {new_job.version}) failed to load on the engine "
                                         f"({exc!r})")
                    slot.job = None
                return
            seconds = time.perf_counter() - t
            self.state.states.transition(slot.index, new_job.name, ACTIVE, seconds,
                                         f"{why} for {target}" + (f" (after {prev_job.name})" if prev_job else ""))
            with self.state.lock:
                for name, reason in failed.items():  # a LoRA job whose adapter does not load: the others are served
                    self._fault(new_job.members[name], reason)
                charged = list(new_job.members.values()) if isinstance(new_job, LoraBase) else [new_job]
                for job in charged:  # a LoRA base's switch is shared by its jobs
                    job.transition_s += seconds / max(len(charged), 1)

    def _activate(self, slot: Slot, tenancy: Job | LoraBase, recycled: Engine | None) -> tuple[str, dict[str, str]]:
        """Make the tenancy's engine the slot's: wake its sleeping one, recycle an evicted one or build one (caller
        holds tenancy.lock). Returns how, and the LoRA jobs whose adapter failed to load (name -> why; left out)."""
        worker = slot.worker
        inst = slot.instances.get(tenancy.name)
        lora = isinstance(tenancy, LoraBase)
        weights, version = (None, None) if lora else (tenancy.weights, tenancy.version)
        paused = False if lora else tenancy.paused  # a LoRA job's pause holds its admissions only
        if inst is not None and self.state.states.state(slot.index, tenancy.name) is SLEEPING:
            why = "wake" + ("" if lora or inst.policy_version == version else " + weights")

            def wake(_e: Engine, inst: Engine = inst) -> dict[str, str]:
                inst.wake()
                failed = sync_adapters(inst, tenancy) if lora else {}
                if not lora and inst.policy_version != version:
                    inst.apply_weights(weights, version)
                inst.resume() if not paused else inst.pause()
                return failed

            failed = worker.call(wake)  # on the engine thread (the slot steps nothing meanwhile)
            worker.swap_engine(inst)
            return why, failed
        how, engine = "load", None
        if recycled is not None and isinstance(tenancy, Job):  # (here, not on the idle worker: EngineWorker.call_here)
            with contextlib.suppress(ValueError):  # weights that do not replace it whole: built instead
                tier, engine, failed, how = self.engines.recycle(recycled, tenancy), recycled, {}, "recycle"
        if engine is None:
            engine, failed, tier = self.engines.build(tenancy)
        if paused:
            engine.pause()
        worker.swap_engine(engine)
        slot.instances[tenancy.name] = engine
        return f"{how} ({tier})", failed

    def _drop_instance(self, slot: Slot, key: str, why: str) -> None:
        """Evict the tenancy's engine on the slot, whatever state it is in (caller holds the tenancy's lock)."""
        slot.instances.pop(key, None)
        if self.state.states.state(slot.index, key) is not EVICTED:
            self.state.states.transition(slot.index, key, EVICTED, 0.0, why)

    # ------------------------------------------------------------ containment: a tenant's failure stays its own

    def _recover(self, slot: Slot) -> None:
        """The slot's engine thread died: an engine step raised (an adapter or weights that passed every check
        but break the forward, or an engine bug). The other tenants keep the slot: it gets a fresh engine thread,
        the failed engine is evicted, the jobs whose requests were on it are probed (TenantEngines.probe) and those
        that break an engine are faulted (_fault: their requests answered with the error, new ones refused until they
        push weights that load); the others' requests are queued again and rerun. A request on a failed engine twice
        is answered with an error instead (it may be what breaks it)."""
        dead = slot.worker
        failure = dead.failure
        with slot.route_lock:  # no admission or abort on this slot meanwhile
            key = next((k for k, inst in slot.instances.items() if inst is dead.engine), slot.job)
            with self.state.lock:
                tenancy = self.state.tenancy(key) if key is not None else None
            with tenancy.lock if tenancy is not None else contextlib.nullcontext():
                slot.worker = EngineWorker(None, name=f"pool-engine-{slot.index}")
                dead.close()
                if key is not None:
                    self._drop_instance(slot, key, f"its engine failed: {failure!r}")
                with self.state.lock:
                    self.account(slot, time.monotonic())
                    crashed = [r for r in self.state.by_internal.values() if r.slot == slot.index]
                    for req in crashed:
                        req.slot = None
                        job = self.state.jobs.get(req.job)
                        if job is not None:
                            job.running -= req.remaining
                    slot.job, slot.running = None, 0
                    slot.running_by.clear()
                    jobs = self.state.jobs
                    suspects = [jobs[n] for n in dict.fromkeys(r.job for r in crashed) if n in jobs]
                faults = self.engines.probe(tenancy, suspects) if tenancy is not None else {}
                with self.state.lock:
                    for name, reason in faults.items():
                        if name in self.state.jobs:
                            self._fault(self.state.jobs[name], reason)
                    for req in reversed(crashed):  # appendleft: they keep their order at the head of the queue
                        self._rerun(req, failure)
        who = f"; faulted {sorted(faults)}" if faults else ""
        slot.errors.append(f"{time.strftime('%H:%M:%S')} engine of {key} failed ({failure!r}): evicted, "
                           f"{len(crashed)} request(s) rerun or answered{who}")
        del slot.errors[:-20]
        self.state.kick()

    def _fault(self, job: Job, reason: str) -> None:
        """Stop running `job`: its queued requests are answered with the error, new ones refused (409) until it
        pushes weights that load (caller holds state.lock). Requests of it running on other slots finish there."""
        job.fault = reason
        error = fault_error(job)
        queued = list(job.queue)
        job.queue.clear()
        for req in queued:
            self._answer_failed(job, req, error)

    def requeue_lost(self, slot: Slot, req: QueuedRequest, reason: str) -> None:
        """A request a migration left on neither engine (the target refused it and the source could not take it
        back): it leaves `slot`'s counts and is rerun like a request of a failed engine (caller holds state.lock)."""
        if req.slot != slot.index:
            return
        left = max(req.remaining, 0)
        slot.running -= left
        slot.running_by[req.job] = slot.running_by.get(req.job, 0) - left
        job = self.state.jobs.get(req.job)
        if job is not None:
            job.running -= left
        req.slot = None
        self._rerun(req, RuntimeError(f"lost in a migration from slot {slot.index}: {reason}"))

    def _rerun(self, req: QueuedRequest, failure: BaseException | None) -> None:
        """A request that was on a failed engine: queued again at its job's head, or answered with an error if
        its job faulted or it was on a failed engine before (caller holds state.lock)."""
        job = self.state.jobs.get(req.job)
        if job is None:  # its job detached meanwhile
            self.state.by_internal.pop(req.internal_id, None)
            if req.waiter is not None:
                req.waiter.set()
            return
        if job.fault is not None:
            self._answer_failed(job, req, fault_error(job))
            return
        req.crashes += 1
        if req.crashes >= 2:
            self._answer_failed(job, req, PoolError(
                503, f"request {req.public_id!r} was on an engine that failed, twice ({failure!r}); it was not "
                     "answered. Submit it again (changed, if it is what breaks the engine)", "request_id",
                retry_after=1))
            return
        req.remaining = req.request.params.n  # the rerun samples every index; those answered already are skipped
        job.queue.appendleft(req)

    def _answer_failed(self, job: Job, req: QueuedRequest, error: PoolError) -> None:
        """End a request that is on no engine with `error`: its unanswered samples come back aborted, carrying the
        error (a /generate call answers with it); caller holds state.lock."""
        req.error = error
        if req.waiter is None:
            for i in range(req.request.params.n):
                if i not in req.returned:
                    job.post(stamp(empty_abort(req, i), req, -1) | {"error": error.message})
        self.forget(job, req)

    def _evict_beyond_budget(self, slot: Slot, keep: str, recycle_for: Job | LoraBase | None) -> Engine | None:
        """At most max_sleeping sleeping engines per slot (host memory): evict the least recently used; one that
        `recycle_for` (a job with no engine here) can take over (TenantEngines.recyclable) is returned, not dropped."""
        recycled: Engine | None = None
        sleeping = [j for j in self.state.states.jobs_in(slot.index, SLEEPING) if j != keep]
        sleeping.sort(key=lambda j: slot.last_active.get(j, 0.0))
        for name in sleeping[: max(0, len(sleeping) - self.state.max_sleeping)]:
            with self.state.lock:
                job = self.state.tenancy(name)
            with job.lock if job is not None else threading.Lock():
                if self.state.states.state(slot.index, name) is not SLEEPING:
                    continue
                t, inst = time.perf_counter(), slot.instances.pop(name, None)
                why = f"more than {self.state.max_sleeping} sleeping engines on the slot"
                if recycled is None and self.engines.recyclable(inst, job, recycle_for):
                    recycled, why = inst, f"{why}: engine recycled for {keep}"
                self.state.states.transition(slot.index, name, EVICTED, time.perf_counter() - t, why)
        return recycled


"""The pool's core: engines (slots), the jobs attached to them, and their requests, weights and accounting.

`EnginePool` answers the API's calls (attach, weights, submit, abort, poll, pause, detach, state); its slot threads
run its `SlotLoops` component (rollwise.pool.slots); both work on one PoolState (rollwise.pool.pool_state) that the
pool owns. rollwise.pool.app puts it on HTTP.
Locks: `lock` guards jobs, queues, slot assignments and accounting; each `Job.lock` a job's weights,
activation and pause (taken before `lock` when both are held). LoRA jobs of one base share their
LoraBase's lock as their Job.lock (rollwise.pool.jobs): they share that base's engines.
"""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from rollwise.types.engine_config import EngineConfig
from rollwise.engine.core import EngineWorker
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.pool.jobs import (Job, LoraBase, PoolError, QueuedRequest, Slot, Waiter, check_priority, empty_abort,
                                fault_error, stamp)
from rollwise.pool.scheduler import Policy
from rollwise.pool.pool_state import PoolState
from rollwise.pool.slots import SlotLoops
from rollwise.pool.states import ACTIVE, EVICTED, StateMachine
from rollwise.pool.tenancy import MemoryBudget, footprint, kv_bytes, module_bytes
from rollwise.pool.cache_settings import CacheSettings
from rollwise.pool.model_cache import ModelCache
from rollwise.pool.startup_cost import StartupCost
from rollwise.pool.tenant_engines import TenantEngines
from rollwise.pool.weight_tiers import WeightTiers
from rollwise.pool.weights import JobAdapter, JobTarget, JobWeights, own_adapter, parse_weight_upload
from rollwise.serve.auth import ANONYMOUS, KeyQuota
from rollwise.engine.weight_receiver import WeightReceiver
from rollwise.types.bucket_layout import build_manifest
from rollwise.types.weights import ExpectedWeights, WeightManifest, WeightUpdateError


class EnginePool:
    """The engines, the jobs, and the slot loops that time-slice one over the other."""

    def __init__(self, num_engines: int = 1, *, max_num_seqs: int = 16, max_model_len: int = 1024,
                 policy: Policy | None = None, max_sleeping: int = 4, seed: int | None = 0,
                 prefix_cache_tokens: int = 0, job_timeout_s: float = 120.0, max_jobs: int = 16,
                 max_jobs_per_key: int | None = None, max_queued_per_job: int = 4096,
                 memory_budget_bytes: int | None = None, cache: CacheSettings | None = None,
                 startup: StartupCost | None = None) -> None:
        if num_engines < 1:
            raise ValueError(f"--engines must be >= 1, got {num_engines}")
        if max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {max_num_seqs}")
        if max_model_len < 16:
            raise ValueError(f"--max-model-len must be >= 16, got {max_model_len}")
        if max_sleeping < 0:
            raise ValueError(f"--max-sleeping must be >= 0, got {max_sleeping}")
        if job_timeout_s <= 0:
            raise ValueError(f"--job-timeout must be > 0 seconds, got {job_timeout_s}")
        if max_queued_per_job < 1:
            raise ValueError(f"--max-queued-per-job must be >= 1, got {max_queued_per_job}")
        self.job_timeout_s = job_timeout_s
        # Tenancy limits (issue 43): jobs per API key and in all, host memory, requests in flight per job.
        self.quota = KeyQuota(max_jobs if max_jobs_per_key is None else max_jobs_per_key, max_jobs,
                              retry_after_s=min(job_timeout_s, 30.0),
                              how_to_free="detach a job (DELETE /jobs/{job}) or ask the pool's operator for more")
        self.memory = MemoryBudget(memory_budget_bytes)
        self.max_queued_per_job = max_queued_per_job
        self._attaching = threading.Lock()  # one model load at a time: each is counted before the next is loaded
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        # every job's engines: the reference engine (a job's max_model_len may be shorter than the pool's)
        self.engines = TenantEngines(EngineConfig(kind="reference", max_num_seqs=max_num_seqs,
                                                  max_model_len=max_model_len),
                                     seed=seed, prefix_cache_tokens=prefix_cache_tokens,
                                     tiers=WeightTiers(ModelCache(cache), startup))
        # What this side and the slot loops share (rollwise.pool.pool_state); its containers are also read here
        # under their own names (never rebound: the same objects).
        slots = [Slot(i, max_num_seqs, EngineWorker(None, name=f"pool-engine-{i}")) for i in range(num_engines)]
        self.shared = PoolState(slots, StateMachine(num_engines), policy or Policy(), max_sleeping)
        self.lock, self.jobs, self.bases = self.shared.lock, self.shared.jobs, self.shared.bases
        self.slots, self.states, self.policy = self.shared.slots, self.shared.states, self.shared.policy
        self.loops = SlotLoops(self.shared, self.engines)
        self.detached: dict[str, dict[str, Any]] = {}  # accounting of jobs that left
        self.t0 = time.monotonic()
        self._threads = [threading.Thread(target=self.loops.run, args=(s,), name=f"pool-slot-{s.index}",
                                          daemon=True) for s in self.slots]
        self._threads.append(threading.Thread(target=self._reaper, name="pool-reaper", daemon=True))
        self._started = False

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if not self._started:
            self._started = True
            for t in self._threads:
                t.start()

    def close(self) -> None:
        self.shared.stop.set()
        self.shared.kick()  # idle slot loops wake now instead of at their next idle tick
        with self.lock:
            jobs = list(self.jobs.values())
        for job in jobs:  # long polls return now
            job.out.close()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=30)
        for s in self.slots:
            s.worker.close()

    # ------------------------------------------------------------ jobs

    def attach(self, name: str, model: str, priority: float, fingerprint: str | None, lora: bool = False,
               owner: str = ANONYMOUS, loaded: tuple[Any, Any] | None = None) -> Job:
        """Attach job `name` for the API key labelled `owner`: counted against the key's and the pool's job limits
        before its model is loaded (429), and against the pool's memory once it is (503); refused whole.
        `loaded`: (HF model, tokenizer) of `model` a caller in this process holds already (not loaded again)."""
        check_priority(priority)
        with self.lock:
            if name in self.jobs:
                raise PoolError(409, f"job {name!r} is already attached to this pool: detach it first "
                                     "(DELETE /jobs/{job}) or attach under another name (pool.job=...)", "job")
        self.quota.acquire(owner)
        try:
            with self._attaching:  # the memory check sees every job attached before this one
                job = self._load_job(name, model, priority, fingerprint, lora, owner, loaded)
        except BaseException:
            self.quota.release(owner)
            raise
        return job

    def _load_job(self, name: str, model: str, priority: float, fingerprint: str | None, lora: bool,
                  owner: str, loaded: tuple[Any, Any] | None = None) -> Job:
        from rollwise.model.loading import load_model, tokenizer_fingerprint

        try:
            template, tokenizer = load_model(model) if loaded is None else loaded
        except Exception as exc:  # noqa: BLE001 - unknown spec, missing directory
            raise PoolError(400, f"model {model!r} cannot be loaded by the pool: {exc}", "model") from exc
        own = tokenizer_fingerprint(tokenizer)
        if fingerprint is not None and fingerprint != own:
            raise PoolError(409, f"tokenizer fingerprint mismatch: the pool loads {model!r} with tokenizer "
                                 f"{own[:16]}..., the trainer's is {fingerprint[:16]}...; the engine would sample "
                                 "token ids the trainer reads differently. Start the trainer and the pool from the "
                                 "same model/tokenizer files", "tokenizer_fingerprint")
        template.eval()
        max_len = min(self.max_model_len, getattr(template.config, "max_position_embeddings", None) or self.max_model_len)
        eos_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
        job = Job(name=name, token=secrets.token_urlsafe(24), priority=priority, model=model, fingerprint=own,
                  template=template, tokenizer=tokenizer, expected=ExpectedWeights.of_module(template),
                  vocab_size=int(template.config.vocab_size), eos_ids=eos_ids, max_model_len=max_len, lora=lora,
                  owner=owner)
        with self.lock:
            base_held = lora and job.key in self.bases
            committed = sum(j.footprint for j in self.jobs.values())
        job.footprint = footprint(module_bytes(template), kv_bytes(template.config, self.max_num_seqs, max_len),
                                  len(self.slots), lora=lora, base_held=base_held)
        self.memory.check(name, job.footprint, committed)
        with self.lock:
            if name in self.jobs:
                raise PoolError(409, f"job {name!r} is already attached to this pool", "job")
            if lora:  # the LoRA jobs of one base model share its engines: one lock for all of them
                base = self.bases.setdefault(job.key, LoraBase(job.key, model, template, tokenizer, own, eos_ids, max_len))
                job.lock = base.lock
                base.members[name] = job
            self.jobs[name] = job
        return job

    def job(self, name: str, token: str | None) -> Job:
        """The job, if `token` is its token: unknown job 404, any other token 403."""
        with self.lock:
            job = self.jobs.get(name)
        if job is None:
            raise PoolError(404, f"no job {name!r} is attached to this pool")
        if token is None or not secrets.compare_digest(token, job.token):
            raise PoolError(403, f"this token does not belong to job {name!r}: every call for a job must carry "
                                 "the token its attach returned (Authorization: Bearer TOKEN)", "authorization")
        job.last_seen = time.monotonic()
        return job

    def reap(self, now: float | None = None) -> list[str]:
        """Detach jobs that made no call for job_timeout_s (their trainer died without detaching): their
        queued work is dropped and their engines evicted, so they stop holding slots and host memory."""
        now = time.monotonic() if now is None else now
        with self.lock:
            dead = [j for j in self.jobs.values() if now - j.last_seen > self.job_timeout_s]
        for job in dead:
            try:
                report = self.detach(job)
            except PoolError:
                continue
            report["detached_because"] = f"no call for {now - job.last_seen:.0f}s (> {self.job_timeout_s:g}s)"
        return [j.name for j in dead]

    def _reaper(self) -> None:
        while not self.shared.stop.wait(min(5.0, self.job_timeout_s / 4)):
            try:
                self.reap()
            except Exception as exc:  # noqa: BLE001 - never take the pool down
                self.slots[0].errors.append(f"reaper: {exc!r}")

    def detach(self, job: Job) -> dict[str, Any]:
        with self.lock:
            if self.jobs.get(job.name) is not job:
                raise PoolError(404, f"no job {job.name!r} is attached to this pool")
            del self.jobs[job.name]
            job.detached = True
        self.quota.release(job.owner)
        self.abort(job, list(job.requests))
        self.engines.tiers.forget(job)  # its cached weights (every tier) go with it
        with job.lock:
            base = self.bases.get(job.key) if job.lora else None
            if base is not None:
                base.members.pop(job.name, None)
                if base.members:  # other LoRA jobs keep the base engines: take only this job's adapter off them
                    self._unload_adapter(job)
                    job.out.close()
                    report = self._job_report(job)
                    with self.lock:
                        self.detached[job.name] = report
                        for slot in self.slots:
                            slot.running_by.pop(job.name, None)
                    return report
                with self.lock:
                    self.bases.pop(job.key, None)
            for slot in self.slots:
                inst = slot.instances.pop(job.key, None)
                state = self.states.state(slot.index, job.key)
                if inst is None or state is EVICTED:
                    continue
                t = time.perf_counter()
                # Under job.lock no switch moves this job's engine in or out of the slot: the check holds.
                if state is ACTIVE and slot.worker.engine is inst and slot.worker.failure is None:
                    slot.worker.swap_engine(None)  # (a failed worker: its recovery swaps in a fresh one)
                self.states.transition(slot.index, job.key, EVICTED, time.perf_counter() - t, "job detached")
                with self.lock:
                    self.loops.account(slot, time.monotonic())
                    if slot.job == job.key:
                        slot.job, slot.running = None, 0
                        slot.running_by.clear()
        job.out.close()  # its long polls return now
        report = self._job_report(job)
        with self.lock:
            self.detached[job.name] = report
        return report

    def _unload_adapter(self, job: Job) -> None:
        """Take a detached LoRA job's adapter off its base's engines (caller holds job.lock; its requests are
        aborted, so no row of the engines uses the adapter any more)."""
        for slot in self.slots:
            inst = slot.instances.get(job.key)
            if inst is None or job.name not in inst.loaded_adapters():
                continue
            unload = lambda _e, inst=inst: inst.unload_adapter(job.name)  # noqa: E731
            try:
                if self.states.state(slot.index, job.key) is ACTIVE:
                    slot.call_if_alive(unload)  # between two steps of the shared engine
                else:
                    unload(None)  # sleeping: nothing steps it
            except ValueError as exc:  # still in use (cannot happen after the abort): report, keep serving
                slot.errors.append(f"detach {job.name}: {exc}")

    # ------------------------------------------------------------ weights

    def load_weights(self, job: Job, body: bytes) -> dict[str, Any]:
        """A whole update (manifest + flat buckets), checked like any transport's (rollwise.sync.buckets)."""
        staged = parse_weight_upload(body)
        own_adapter(staged, job)  # an adapter loads as this job's own, a full upload only for a full job
        return self._commit(job, staged.manifest, lambda receiver: receiver.commit(staged))

    def push_weights(self, job: Job, state: dict[str, Any], version: int) -> dict[str, Any]:
        """load_weights for a full-parameter job's caller in this process: `state` as is (no bytes), checked by
        the same receiver (rollwise.service.full_samplers pushes a Tinker sampler's weights this way)."""
        if job.lora:
            raise PoolError(400, f"job {job.name!r} attached as a LoRA job: push_weights takes full weights", "weights")
        manifest = build_manifest(state, version, job.fingerprint, bucket_mb=None, checksum=False)
        return self._commit(job, manifest, lambda receiver: receiver.apply_state(manifest, state))

    def _commit(self, job: Job, manifest: WeightManifest, commit: Callable[[WeightReceiver], None]) -> dict[str, Any]:
        t = time.perf_counter()
        with job.lock:
            if job.detached:
                raise PoolError(404, f"job {job.name!r} detached")
            previous = job.version
            target: JobTarget
            if job.lora:  # an adapter job's target loads adapters, a full job's applies weights
                target = adapters = JobAdapter(self.slots, self.states, job)
                receiver = WeightReceiver(target, job.fingerprint, adapters=adapters)
            else:
                target = JobWeights(self.slots, self.states, job)
                receiver = WeightReceiver(target, job.fingerprint)
            try:
                commit(receiver)
            except WeightUpdateError as exc:  # param: the manifest field or tensor at fault
                raise PoolError(400, str(exc), exc.field or "body") from exc
            job.fault = None  # a new version: the pool runs the job again (a fault recurs if it fails again)
        return {"job": job.name, "policy_version": manifest.version, "previous_version": previous,
                "applied_to_slots": target.applied, "bytes": manifest.total_bytes,
                "seconds": time.perf_counter() - t}

    # ------------------------------------------------------------ requests

    def submit(self, job: Job, requests: list[tuple[str, list[int], SamplingParams]],
               waiter: Waiter | None = None) -> list[QueuedRequest]:
        """Queue every request or none (ValueError-style problems are PoolError 400/409, naming the field)."""
        if job.version is None:
            raise PoolError(409, f"job {job.name!r} has no weights yet: push them (PUT /jobs/{{job}}/weights) first")
        self._refuse_if_faulted(job)
        self._bound_queue(job, len(requests))
        seen: set[str] = set()
        for i, (rid, prompt, params) in enumerate(requests):
            where = f"requests[{i}]"
            if rid in seen or rid in job.requests:
                raise PoolError(409, f"{where}.request_id {rid!r} is already in flight for this job; use another",
                                f"{where}.request_id")
            seen.add(rid)
            if not prompt:
                raise PoolError(400, f"{where}.prompt_ids must not be empty", f"{where}.prompt_ids")
            bad = next((j for j, t in enumerate(prompt) if not 0 <= t < job.vocab_size), None)
            if bad is not None:
                raise PoolError(400, f"{where}.prompt_ids[{bad}] = {prompt[bad]} is outside the vocabulary "
                                     f"[0, {job.vocab_size})", f"{where}.prompt_ids")
            if len(prompt) >= job.max_model_len:
                raise PoolError(400, f"{where}.prompt_ids has {len(prompt)} tokens, which leaves no room to generate "
                                     f"within max_model_len={job.max_model_len}", f"{where}.prompt_ids")
            if params.n > self.max_num_seqs:
                raise PoolError(400, f"{where}.params.n must be <= max_num_seqs ({self.max_num_seqs}): a request's "
                                     "samples share one prefill and run together", f"{where}.params.n")
        made = []
        with self.lock:
            if job.detached:
                raise PoolError(404, f"job {job.name!r} detached")
            self._refuse_if_faulted(job)
            self._bound_queue(job, len(requests))
            taken = next((i for i, (rid, _, _) in enumerate(requests) if rid in job.requests), None)
            if taken is not None:  # submitted meanwhile by another call of this job
                raise PoolError(409, f"requests[{taken}].request_id {requests[taken][0]!r} is already in flight "
                                     "for this job; use another", f"requests[{taken}].request_id")
            for rid, prompt, params in requests:
                internal = uuid.uuid4().hex
                # A LoRA job's requests always name its own adapter: a job cannot ask for another's.
                request = GenerationRequest(internal, list(prompt), params, adapter=job.name if job.lora else None)
                req = QueuedRequest(internal, rid, job.name, request, params.n, waiter=waiter)
                job.queue.append(req)
                job.requests[rid] = req
                self.shared.by_internal[internal] = req
                made.append(req)
        self.shared.kick()
        return made

    def _refuse_if_faulted(self, job: Job) -> None:
        if job.fault is not None:
            raise fault_error(job)

    def _bound_queue(self, job: Job, adding: int) -> None:
        """At most max_queued_per_job requests of a job in flight (queued or running): 429 with Retry-After."""
        held = len(job.requests)
        if held + adding > self.max_queued_per_job:
            raise PoolError(429, f"job {job.name!r} has {held} requests in flight (queued or running) and this call "
                                 f"adds {adding}: the pool holds at most {self.max_queued_per_job} per job "
                                 "(--max-queued-per-job); wait for completions (or abort some) and retry",
                            "requests", retry_after=1)

    def abort(self, job: Job, public_ids: list[str]) -> tuple[list[dict[str, Any]], int]:
        """Abort the job's requests: (their samples, finish_reason 'abort', with the tokens so far; upto):
        every sample of this job that finished before the abort is in the outbox with seq <= upto."""
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + 120
        while public_ids:
            # Requests on a slot whose engine died are its recovery's (rollwise.pool.slots): it queues them again
            # or ends them; the abort takes them once it has.
            public_ids = self._abort_once(job, public_ids, out)
            if public_ids and time.monotonic() > deadline:
                raise PoolError(503, f"requests {public_ids[:4]} are on an engine that failed and has not recovered "
                                     "for 120 s (see GET /state's slot errors); abort them again later",
                                "request_ids", retry_after=5)
            if public_ids:
                time.sleep(0.05)
        return out, job.out.seq

    def _abort_once(self, job: Job, public_ids: list[str], out: list[dict[str, Any]]) -> list[str]:
        """One pass of abort(): the ids still on a failed engine, to try again once its slot recovered."""
        by_slot: dict[int, list[QueuedRequest]] = {}
        with self.lock:
            for rid in public_ids:
                req = job.requests.get(rid)
                if req is None:
                    continue  # finished already (its samples are in the outbox) or unknown
                if req.slot is None:
                    if req in job.queue:
                        job.queue.remove(req)
                    out += [stamp(empty_abort(req, i), req, -1) for i in range(req.request.params.n)
                            if i not in req.returned]
                    self.loops.forget(job, req)
                else:
                    by_slot.setdefault(req.slot, []).append(req)
        later: list[str] = []
        for index, reqs in by_slot.items():
            slot = self.slots[index]
            with slot.route_lock:
                # A request migrated to another slot meanwhile (rollwise.pool.slot_migration) is aborted there, next pass.
                with self.lock:
                    later += [r.public_id for r in reqs if r.slot is not None and r.slot != index]
                    reqs = [r for r in reqs if r.slot == index or r.slot is None]
                # On the job's own engine there (the slot may have switched away since: then the requests
                # finished, and their samples are routed by _drain below).
                inst = slot.instances.get(job.key)
                ids = [r.internal_id for r in reqs]
                try:
                    aborted = [] if inst is None else slot.worker.call(
                        lambda _e, inst=inst, ids=ids: [c for rid in ids for c in inst.abort(rid)])
                    self.loops.drain(slot)  # samples that finished before the abort reach the outbox first
                except RuntimeError:
                    if slot.worker.failure is None:
                        raise
                    later += [r.public_id for r in reqs]
                    continue
                with self.lock:
                    for c in aborted:
                        req = self.shared.by_internal.get(c.request_id)
                        if req is None:
                            continue
                        self.loops.count_finished(slot, job, req, c)
                        out.append(stamp(c, req, slot.index))
        return later

    def poll(self, job: Job, after: int, timeout: float) -> dict[str, Any]:
        """Acknowledge `after`; the job's completions after it, waiting up to `timeout` (30 s at most) for one."""
        entries = [{**entry, "seq": seq} for seq, entry in job.out.poll(after, min(timeout, 30.0))]
        with self.lock:
            timeline, job.timeline = job.timeline, []
        return {"completions": entries, "seq": job.out.seq, "timeline": timeline, "now": time.monotonic(),
                "policy_version": job.version, "fault": job.fault}

    def set_paused(self, job: Job, paused: bool) -> None:
        with job.lock:
            job.paused = paused
            # A LoRA job shares its engine with other jobs: pausing stops its admissions only (what runs finishes).
            for slot in ([] if job.lora else self.slots):
                inst = slot.instances.get(job.name)
                if inst is not None and self.states.state(slot.index, job.name) is ACTIVE:
                    slot.call_if_alive(lambda _e, inst=inst: inst.pause() if paused else inst.resume())
        self.shared.kick()

    # ------------------------------------------------------------ the slot loops


    # ------------------------------------------------------------ reports

    def _job_report(self, job: Job) -> dict[str, Any]:
        return {
            "job": job.name, "model": job.model, "priority": job.priority, "policy_version": job.version,
            "lora": job.lora, "engine_tenancy": job.key, "fault": job.fault, "api_key": job.owner,
            "memory_bytes": job.footprint, "paused": job.paused, "queued_samples": job.queued_samples(),
            "running_samples": job.running,
            "requests_in_flight": len(job.requests), "requests_admitted": job.requests_admitted,
            "samples": job.samples, "tokens": job.tokens,
            "engine_seconds_allocated": job.allocated_s, "engine_seconds_busy": job.busy_s,
            "engine_seconds_transitions": job.transition_s, "engine_hours": job.allocated_s / 3600,
            "attached_s": time.monotonic() - job.attached_at,
        }

    def state(self) -> dict[str, Any]:
        with self.lock:
            now = time.monotonic()
            for s in self.slots:
                self.loops.account(s, now)
            uptime = now - self.t0
            held = len(self.slots) * uptime
            allocated = sum(j.allocated_s for j in self.jobs.values()) + sum(
                d["engine_seconds_allocated"] for d in self.detached.values())
            return {
                "engines": len(self.slots), "max_num_seqs": self.max_num_seqs, "max_model_len": self.max_model_len,
                "min_slice_s": self.policy.min_slice_s, "max_sleeping": self.shared.max_sleeping,
                "uptime_s": uptime, "engine_hours": held / 3600, "engine_hours_unallocated": max(held - allocated, 0) / 3600,
                "slots": [{"index": s.index, "job": s.job, "running": s.running, "switching": s.switching,
                           "running_by_job": {j: n for j, n in s.running_by.items() if n},
                           "since_s": now - s.since if s.job else None, "states": self.states.snapshot()[str(s.index)],
                           "errors": list(s.errors)} for s in self.slots],
                "jobs": {name: self._job_report(j) for name, j in sorted(self.jobs.items())},
                "detached_jobs": dict(self.detached),
                "transition_costs": self.states.costs(),
                "model_cache": self.engines.tiers.cache.report(),
                "transitions": [t.as_dict() for t in self.states.log],
                "migrations": {"migrated_samples": self.shared.migrated_samples,
                               "log": list(self.shared.migrations)},
                "isolation": {"checked_admissions": self.shared.isolation_checks,
                              "violations": list(self.shared.violations)},
                "limits": {"max_jobs": self.quota.total, "max_jobs_per_key": self.quota.per_key,
                           "jobs_by_key": self.quota.held(), "max_queued_per_job": self.max_queued_per_job,
                           "memory_budget_bytes": self.memory.budget,
                           "memory_committed_bytes": sum(j.footprint for j in self.jobs.values())},
            }

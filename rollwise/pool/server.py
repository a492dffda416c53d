"""`rollwise serve pool`: one set of engines shared by several `rollwise train` jobs.

Each job attaches with its own model and gets a secret token; every call it makes carries the token
and names the job, so one job can never submit to, read from or update another. A job's requests are
queued in the pool and admitted only to an engine instance built for that job, holding that job's
current weights (checked on every admission, and every completion is stamped with the job and the
policy versions that sampled it).

Engines ("slots") are time-sliced across jobs by the pure policy in rollwise.pool.scheduler. On a
switch, the outgoing job's engine instance goes to sleep (KV cache freed, weights kept in host
memory) and the incoming one wakes, or is built from the job's model and its latest pushed weights
if it was evicted (rollwise.pool.states; every transition is timed). Each slot is an EngineWorker
thread whose engine is swapped between two steps, plus a control thread that routes finished
samples and admits work.

Endpoints (JSON; `Authorization: Bearer TOKEN` on every /jobs/{job}/... call):

    POST   /jobs                         attach {job, model, priority, tokenizer_fingerprint} -> {token, ...}
    PUT    /jobs/{job}/weights?version=V  a whole weight update: 8-byte big-endian manifest length, the
                                         rollwise.weights/v1 manifest (JSON), then every bucket's flat bytes;
                                         validated whole (names, shapes, dtypes, checksums, tokenizer) or refused
    POST   /jobs/{job}/requests          {requests: [{request_id, prompt_ids, params}]} queued, all or none
    GET    /jobs/{job}/completions?after=SEQ&timeout=S
                                         long poll: finished samples with seq > SEQ (acknowledges <= SEQ),
                                         plus the job's running-sequence timeline since the last poll
    POST   /jobs/{job}/generate          one token-level request, answered when done (the engine server's /generate)
    POST   /jobs/{job}/abort             {request_ids} -> aborted samples + `upto`, the last seq of samples that
                                         finished before the abort (the client waits for those)
    POST   /jobs/{job}/pause, /resume    freeze / continue the job's generation
    DELETE /jobs/{job}                   detach: abort its work, evict its engines; returns its accounting
    GET    /state                        slots, (slot, job) states, jobs' queues and engine-hours, measured
                                         transition costs, the transition log
    GET    /health, /metrics (Prometheus text)

The server binds loopback by default: tokens separate jobs, they are not an authentication scheme
for a network.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import Field

from rollwise.engine.types import Completion, GenerationRequest, SamplingParams
from rollwise.pool.scheduler import JobView, Policy, SlotView, plan
from rollwise.pool.states import ACTIVE, EVICTED, SLEEPING, StateMachine
from rollwise.rollout.worker import EngineWorker
from rollwise.serve.disconnect import ClientGone, client_gone, unless_disconnected
from rollwise.serve.errors import APIError, error_responses, honest_openapi, install_error_handlers
from rollwise.serve.limits import DEFAULT_MAX_REQUEST_BYTES, RequestSizeLimit, check_max_request_bytes
from rollwise.serve.openai_schemas import GenerateRequest, RequestBody
from rollwise.sync.buckets import ExpectedWeights, StagedUpdate, WeightReceiver, WeightUpdateError, parse_manifest

TICK_S = 0.005  # a busy slot's control loop: how long it waits for a finished sample before re-planning
IDLE_TICK_S = 0.05  # an idle slot re-plans at least this often (time slices expire, jobs finish training)


class _NoEngine:
    """What an EngineWorker steps while its slot holds no job (nothing to do, ever)."""

    name = "none"
    paused = False
    policy_version = -1

    def has_unfinished(self) -> bool:
        return False

    def abort(self, request_id: str) -> list[Completion]:
        return []

    def step(self) -> list[Completion]:
        return []


# ==================================================================== jobs, requests, slots


class Waiter(Protocol):
    """What a /generate call waits on: set() by the pool's threads when the request is done or aborted."""

    def set(self) -> None: ...


@dataclass(eq=False)
class _Request:
    internal_id: str  # what the engine sees (fresh uuid: jobs can never collide)
    public_id: str  # the job's own id
    job: str
    request: GenerationRequest
    remaining: int  # samples not yet returned
    slot: int | None = None  # None: queued in the pool
    waiter: Waiter | None = None  # /generate: answered when done, not through the long poll
    done: list[Completion] = field(default_factory=list)


@dataclass(eq=False)
class _Job:
    name: str
    token: str
    priority: float
    model: str
    fingerprint: str
    template: Any  # the job's HF model (architecture; engines are built from it)
    tokenizer: Any
    expected: ExpectedWeights
    vocab_size: int
    eos_ids: list[int] | None
    max_model_len: int
    lock: threading.RLock = field(default_factory=threading.RLock)  # weights, activation, pause
    version: int | None = None  # latest pushed policy version (None: nothing pushed yet)
    weights: dict[str, torch.Tensor] | None = None  # the pool's copy of that version (host memory)
    versions: set[int] = field(default_factory=set)  # every version this job pushed
    queue: deque[_Request] = field(default_factory=deque)
    requests: dict[str, _Request] = field(default_factory=dict)  # public id -> request in flight
    paused: bool = False
    detached: bool = False
    running: int = 0  # samples on engines now
    # the job's outbox: (seq, stamped completion); acknowledged entries are dropped
    cond: threading.Condition = field(default_factory=threading.Condition)
    out: deque[tuple[int, dict[str, Any]]] = field(default_factory=deque)
    seq: int = 0
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (monotonic, running) since last poll
    # accounting (seconds of one engine)
    allocated_s: float = 0.0  # a slot held for this job (its engine active there)
    busy_s: float = 0.0  # ... with samples of this job running
    transition_s: float = 0.0  # loads and wakes done for this job
    samples: int = 0
    tokens: int = 0
    requests_admitted: int = 0
    attached_at: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)  # last authenticated call (the receiver polls)

    def queued_samples(self) -> int:
        return sum(r.remaining for r in self.queue)

    def post(self, entry: dict[str, Any]) -> None:
        with self.cond:
            self.seq += 1
            entry["seq"] = self.seq
            self.out.append((self.seq, entry))
            self.cond.notify_all()


@dataclass(eq=False)
class _Slot:
    index: int
    capacity: int
    worker: EngineWorker
    job: str | None = None  # active job (or the job being switched in)
    since: float = 0.0
    running: int = 0  # samples of the active job on the engine
    switching: bool = False
    instances: dict[str, Any] = field(default_factory=dict)  # job -> its engine here (active or sleeping)
    last_active: dict[str, float] = field(default_factory=dict)  # job -> when it last left the slot
    route_lock: threading.Lock = field(default_factory=threading.Lock)
    accounted_at: float = field(default_factory=time.monotonic)
    errors: list[str] = field(default_factory=list)


class PoolError(Exception):
    """Refused with an HTTP status and a message naming the problem."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class _LoopEvent:
    """A Waiter the pool's threads set and the event loop awaits (a /generate call holds no thread)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()

    def set(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:  # the loop is closed: the server is shutting down, nobody waits
            pass

    async def wait(self) -> None:
        await self._event.wait()


def _stamp(c: Completion, req: _Request, slot: int) -> dict[str, Any]:
    return {"request_id": req.public_id, "index": c.index, "prompt_ids": c.prompt_ids, "token_ids": c.token_ids,
            "logprobs": c.logprobs, "versions": c.versions, "finish_reason": c.finish_reason,
            "cached_prompt_tokens": c.cached_prompt_tokens, "job": req.job, "slot": slot}


def _empty_abort(req: _Request, index: int) -> Completion:
    r = req.request
    return Completion(r.request_id, index, list(r.prompt_ids), [], [], [], "abort")


# ==================================================================== the pool


class EnginePool:
    """The engines, the jobs, and the slot loops that time-slice one over the other."""

    def __init__(self, num_engines: int = 1, *, max_num_seqs: int = 16, max_model_len: int = 1024,
                 policy: Policy | None = None, max_sleeping: int = 4, seed: int | None = 0,
                 prefix_cache_tokens: int = 0, job_timeout_s: float = 120.0) -> None:
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
        self.job_timeout_s = job_timeout_s
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.policy = policy or Policy()
        self.max_sleeping = max_sleeping
        self.seed = seed
        self.prefix_cache_tokens = prefix_cache_tokens
        self.lock = threading.RLock()  # jobs, queues, slot assignments, accounting
        self.states = StateMachine(num_engines)
        self.jobs: dict[str, _Job] = {}
        self.detached: dict[str, dict[str, Any]] = {}  # accounting of jobs that left
        self._by_internal: dict[str, _Request] = {}
        self.slots = [_Slot(i, max_num_seqs, EngineWorker(_NoEngine(), name=f"pool-engine-{i}"))
                      for i in range(num_engines)]
        self.isolation_checks = 0  # admissions checked: engine owner == job and weights == job's current
        self.violations: list[str] = []  # must stay empty
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._slot_loop, args=(s,), name=f"pool-slot-{s.index}",
                                          daemon=True) for s in self.slots]
        self._threads.append(threading.Thread(target=self._reaper, name="pool-reaper", daemon=True))
        self._started = False
        self._kick = threading.Condition()
        self._kicks = 0

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if not self._started:
            self._started = True
            for t in self._threads:
                t.start()

    def close(self) -> None:
        self._stop.set()
        self.kick()  # idle slot loops wake now instead of at their next idle tick
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=30)
        for s in self.slots:
            s.worker.close()

    # ------------------------------------------------------------ jobs

    def attach(self, name: str, model: str, priority: float, fingerprint: str | None) -> _Job:
        from rollwise.model.loading import load_model, tokenizer_fingerprint

        with self.lock:
            if name in self.jobs:
                raise PoolError(409, f"job {name!r} is already attached to this pool: detach it first "
                                     "(DELETE /jobs/{job}) or attach under another name (pool.job=...)", "job")
        try:
            template, tokenizer = load_model(model)
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
        job = _Job(name=name, token=secrets.token_urlsafe(24), priority=priority, model=model, fingerprint=own,
                   template=template, tokenizer=tokenizer, expected=ExpectedWeights.of_module(template),
                   vocab_size=int(template.config.vocab_size),
                   eos_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None,
                   max_model_len=max_len)
        with self.lock:
            if name in self.jobs:
                raise PoolError(409, f"job {name!r} is already attached to this pool", "job")
            self.jobs[name] = job
        return job

    def job(self, name: str, token: str | None) -> _Job:
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
        while not self._stop.wait(min(5.0, self.job_timeout_s / 4)):
            try:
                self.reap()
            except Exception as exc:  # noqa: BLE001 - never take the pool down
                self.slots[0].errors.append(f"reaper: {exc!r}")

    def detach(self, job: _Job) -> dict[str, Any]:
        with self.lock:
            if self.jobs.get(job.name) is not job:
                raise PoolError(404, f"no job {job.name!r} is attached to this pool")
            del self.jobs[job.name]
            job.detached = True
        self.abort(job, list(job.requests))
        with job.lock:
            for slot in self.slots:
                inst = slot.instances.pop(job.name, None)
                state = self.states.state(slot.index, job.name)
                if inst is None or state is EVICTED:
                    continue
                t = time.perf_counter()
                if state is ACTIVE:
                    def unload(_e: Any, worker: EngineWorker = slot.worker, inst: Any = inst) -> None:
                        if worker.engine is inst:
                            worker.engine = _NoEngine()

                    slot.worker.call(unload)
                self.states.transition(slot.index, job.name, EVICTED, time.perf_counter() - t, "job detached")
                with self.lock:
                    self._account(slot, time.monotonic())
                    if slot.job == job.name:
                        slot.job, slot.running = None, 0
        with job.cond:
            job.cond.notify_all()
        report = self._job_report(job)
        with self.lock:
            self.detached[job.name] = report
        return report

    # ------------------------------------------------------------ weights

    def update_weights(self, job: _Job, body: bytes) -> dict[str, Any]:
        """A whole update (manifest + flat buckets), checked like any transport's (rollwise.sync.buckets)."""
        if len(body) < 8:
            raise PoolError(400, "weights body must start with an 8-byte manifest length", "body")
        size = int.from_bytes(body[:8], "big")
        if size > len(body) - 8:
            raise PoolError(400, f"manifest length {size} exceeds the body ({len(body) - 8} bytes)", "body")
        try:
            manifest = parse_manifest(body[8 : 8 + size].decode("utf-8", "replace"), "manifest")
        except WeightUpdateError as exc:
            raise PoolError(400, str(exc), "manifest") from exc
        data = bytearray(body[8 + size :])
        wanted = sum(b.nbytes for b in manifest.buckets)
        if len(data) != wanted:
            raise PoolError(400, f"weight bytes: got {len(data)}, the manifest's buckets hold {wanted}; "
                                 "the update was not applied", "body")
        flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        staged = StagedUpdate(manifest)
        offset = 0
        for bucket in manifest.buckets:
            staged.add_flat(bucket.index, flat[offset : offset + bucket.nbytes])
            offset += bucket.nbytes
        t = time.perf_counter()
        with job.lock:
            if job.detached:
                raise PoolError(404, f"job {job.name!r} detached")
            previous = job.version
            target = _JobWeights(self, job)
            try:
                WeightReceiver(target, job.fingerprint, expected=job.expected).commit(staged)
            except WeightUpdateError as exc:
                raise PoolError(400, str(exc), "body") from exc
        return {"job": job.name, "policy_version": manifest.version, "previous_version": previous,
                "applied_to_slots": target.applied, "bytes": manifest.total_bytes,
                "seconds": time.perf_counter() - t}

    # ------------------------------------------------------------ requests

    def submit(self, job: _Job, requests: list[tuple[str, list[int], SamplingParams]],
               waiter: Waiter | None = None) -> list[_Request]:
        """Queue every request or none (ValueError-style problems are PoolError 400/409, naming the field)."""
        if job.version is None:
            raise PoolError(409, f"job {job.name!r} has no weights yet: push them (PUT /jobs/{{job}}/weights) first")
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
            taken = next((i for i, (rid, _, _) in enumerate(requests) if rid in job.requests), None)
            if taken is not None:  # submitted meanwhile by another call of this job
                raise PoolError(409, f"requests[{taken}].request_id {requests[taken][0]!r} is already in flight "
                                     "for this job; use another", f"requests[{taken}].request_id")
            for rid, prompt, params in requests:
                internal = uuid.uuid4().hex
                req = _Request(internal, rid, job.name, GenerationRequest(internal, list(prompt), params), params.n,
                               waiter=waiter)
                job.queue.append(req)
                job.requests[rid] = req
                self._by_internal[internal] = req
                made.append(req)
        self.kick()
        return made

    def abort(self, job: _Job, public_ids: list[str]) -> tuple[list[dict[str, Any]], int]:
        """Abort the job's requests: (their samples, finish_reason 'abort', with the tokens so far; upto):
        every sample of this job that finished before the abort is in the outbox with seq <= upto."""
        out: list[dict[str, Any]] = []
        by_slot: dict[int, list[_Request]] = {}
        with self.lock:
            for rid in public_ids:
                req = job.requests.get(rid)
                if req is None:
                    continue  # finished already (its samples are in the outbox) or unknown
                if req.slot is None:
                    job.queue.remove(req)
                    done = {c.index for c in req.done}
                    out += [_stamp(_empty_abort(req, i), req, -1) for i in range(req.request.params.n) if i not in done]
                    self._forget(job, req)
                else:
                    by_slot.setdefault(req.slot, []).append(req)
        for index, reqs in by_slot.items():
            slot = self.slots[index]
            with slot.route_lock:
                # On the job's own engine there (the slot may have switched away since: then the requests
                # finished, and their samples are routed by _drain below).
                inst = slot.instances.get(job.name)
                ids = [r.internal_id for r in reqs]
                aborted = [] if inst is None else slot.worker.call(
                    lambda _e, inst=inst, ids=ids: [c for rid in ids for c in inst.abort(rid)])
                self._drain(slot)  # samples that finished before the abort reach the outbox first
                with self.lock:
                    for c in aborted:
                        req = self._by_internal.get(c.request_id)
                        if req is None:
                            continue
                        self._count_finished(slot, job, req, c)
                        out.append(_stamp(c, req, slot.index))
        return out, job.seq

    def poll(self, job: _Job, after: int, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + max(0.0, min(timeout, 30.0))
        with job.cond:
            while job.out and job.out[0][0] <= after:
                job.out.popleft()  # acknowledged
            while not job.out and not job.detached and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                job.cond.wait(left)
            entries = [e for s, e in job.out if s > after]
        with self.lock:
            timeline, job.timeline = job.timeline, []
        return {"completions": entries, "seq": job.seq, "timeline": timeline, "now": time.monotonic(),
                "policy_version": job.version}

    def set_paused(self, job: _Job, paused: bool) -> None:
        with job.lock:
            job.paused = paused
            for slot in self.slots:
                inst = slot.instances.get(job.name)
                if inst is not None and self.states.state(slot.index, job.name) is ACTIVE:
                    slot.worker.call(lambda _e, inst=inst: inst.pause() if paused else inst.resume())
        self.kick()

    # ------------------------------------------------------------ the slot loops

    def kick(self) -> None:
        """New work (or a resumed job): idle slot loops re-plan now instead of at their next idle tick."""
        with self._kick:
            self._kicks += 1
            self._kick.notify_all()

    def _slot_loop(self, slot: _Slot) -> None:
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

    def _drain(self, slot: _Slot, timeout: float = 0.0) -> None:
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
                        job.post(_stamp(c, req, slot.index))
            c = slot.worker.next_completion(timeout=0)

    def _count_finished(self, slot: _Slot, job: _Job, req: _Request, c: Completion) -> None:
        """One sample of `req` came back from `slot` (caller holds self.lock)."""
        now = time.monotonic()
        self._account(slot, now)
        req.remaining -= 1
        slot.running -= 1
        job.running -= 1
        job.samples += 1
        job.tokens += len(c.token_ids)
        job.timeline.append((now, job.running))
        if req.waiter is not None:
            req.done.append(c)
        if req.remaining <= 0:
            self._forget(job, req)

    def _forget(self, job: _Job, req: _Request) -> None:
        job.requests.pop(req.public_id, None)
        self._by_internal.pop(req.internal_id, None)
        if req.waiter is not None:
            req.waiter.set()

    def _account(self, slot: _Slot, now: float) -> None:
        """Charge the time since the last call to the slot's active job (caller holds self.lock)."""
        dt = now - slot.accounted_at
        slot.accounted_at = now
        job = self.jobs.get(slot.job) if slot.job is not None else None
        if job is not None and dt > 0:
            job.allocated_s += dt
            if slot.running > 0:
                job.busy_s += dt

    def _views(self) -> tuple[list[SlotView], list[JobView]]:
        slots = [SlotView(s.index, s.job, s.since, s.running, s.capacity) for s in self.slots]
        jobs = [JobView(j.name, j.priority, j.queued_samples() if j.version is not None else 0,
                        j.busy_s + j.transition_s, j.paused) for j in self.jobs.values()]
        return slots, jobs

    def _tick(self, slot: _Slot) -> bool:
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

    def _decide_and_admit(self, slot: _Slot) -> tuple[_Job | None, _Job] | None:
        admit: list[_Request] = []
        switch: tuple[_Job | None, _Job] | None = None
        with self.lock:
            now = time.monotonic()
            self._account(slot, now)
            if slot.job is not None and slot.job not in self.jobs:
                return None  # its job is detaching: detach() evicts its engine and frees the slot
            slots, jobs = self._views()
            decision = plan(slots, jobs, now, self.policy)[slot.index]
            if decision.action == "serve":
                job = self.jobs[decision.job]
                room = slot.capacity - slot.running
                while job.queue and not job.paused and job.queue[0].remaining <= room:
                    req = job.queue.popleft()
                    req.slot = slot.index
                    room -= req.remaining
                    slot.running += req.remaining
                    job.running += req.remaining
                    job.requests_admitted += 1
                    admit.append(req)
                if admit:
                    job.timeline.append((now, job.running))
            elif decision.action == "switch":
                switch = (self.jobs.get(slot.job) if slot.job is not None else None, self.jobs[decision.job])
                slot.job, slot.since, slot.switching = decision.job, now, True
        if admit:
            self._admit(slot, admit)
        return switch

    def _admit(self, slot: _Slot, reqs: list[_Request]) -> None:
        job = self.jobs.get(reqs[0].job)
        if job is None:
            return
        with job.lock:
            inst = slot.instances.get(job.name)
            # The isolation invariant: this job's request runs only on this job's engine, holding its current weights.
            problem = None
            if inst is None or self.states.state(slot.index, job.name) is not ACTIVE:
                problem = f"slot {slot.index}: job {job.name!r} is not active there"
            elif getattr(inst, "pool_owner", None) != job.name:
                problem = f"slot {slot.index}: engine belongs to {getattr(inst, 'pool_owner', None)!r}, not {job.name!r}"
            elif inst.policy_version != job.version:
                problem = (f"slot {slot.index}: job {job.name!r} engine holds version {inst.policy_version}, "
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
                    c = _empty_abort(req, i)
                    self._count_finished(slot, job, req, c)
                    if req.waiter is None:
                        job.post(_stamp(c, req, slot.index) | {"error": problem})

    def _switch(self, slot: _Slot, prev_job: _Job | None, new_job: _Job) -> None:
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
                        worker.engine = _NoEngine()
                        inst.sleep()
                        inst.reset_timeline()

                    worker.call(sleep)
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
            weights, version, paused = new_job.weights, new_job.version, new_job.paused
            t = time.perf_counter()
            if inst is not None and state is SLEEPING:
                why = "wake" + ("" if inst.policy_version == version else " + weights")

                def wake(_e: Any, inst: Any = inst) -> None:
                    inst.wake()
                    if inst.policy_version != version:
                        inst.update_weights(weights, version)
                    inst.resume() if not paused else inst.pause()
                    worker.engine = inst

                worker.call(wake)
            else:
                inst = self._build(new_job)
                if paused:
                    inst.pause()
                worker.call(lambda _e: setattr(worker, "engine", inst))
                slot.instances[new_job.name] = inst
                why = "load"
            seconds = time.perf_counter() - t
            self.states.transition(slot.index, new_job.name, ACTIVE, seconds,
                                   f"{why} for {target}" + (f" (after {prev_job.name})" if prev_job else ""))
            with self.lock:
                new_job.transition_s += seconds

    def _build(self, job: _Job) -> Any:
        from rollwise.engine.factory import create_engine

        engine = create_engine("reference", job.template, job.tokenizer, max_num_seqs=self.max_num_seqs,
                               max_model_len=job.max_model_len, eos_token_ids=job.eos_ids, policy_version=job.version,
                               seed=self.seed, model_name=job.model, tokenizer_fingerprint=job.fingerprint,
                               prefix_cache_tokens=self.prefix_cache_tokens)
        engine.update_weights(job.weights, job.version)  # the job's latest pushed weights, validated whole
        engine.pool_owner = job.name
        return engine

    def _evict_beyond_budget(self, slot: _Slot, keep: str) -> None:
        """At most max_sleeping sleeping engines per slot (host memory): evict the least recently used."""
        sleeping = [j for j in self.states.jobs_in(slot.index, SLEEPING) if j != keep]
        sleeping.sort(key=lambda j: slot.last_active.get(j, 0.0))
        for name in sleeping[: max(0, len(sleeping) - self.max_sleeping)]:
            with self.lock:
                job = self.jobs.get(name)
            lock = job.lock if job is not None else threading.Lock()
            with lock:
                if self.states.state(slot.index, name) is not SLEEPING:
                    continue
                t = time.perf_counter()
                slot.instances.pop(name, None)
                self.states.transition(slot.index, name, EVICTED, time.perf_counter() - t,
                                       f"more than {self.max_sleeping} sleeping engines on the slot")

    # ------------------------------------------------------------ reports

    def _job_report(self, job: _Job) -> dict[str, Any]:
        return {
            "job": job.name, "model": job.model, "priority": job.priority, "policy_version": job.version,
            "paused": job.paused, "queued_samples": job.queued_samples(), "running_samples": job.running,
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
                self._account(s, now)
            uptime = now - self.t0
            held = len(self.slots) * uptime
            allocated = sum(j.allocated_s for j in self.jobs.values()) + sum(
                d["engine_seconds_allocated"] for d in self.detached.values())
            return {
                "engines": len(self.slots), "max_num_seqs": self.max_num_seqs, "max_model_len": self.max_model_len,
                "min_slice_s": self.policy.min_slice_s, "max_sleeping": self.max_sleeping,
                "uptime_s": uptime, "engine_hours": held / 3600, "engine_hours_unallocated": max(held - allocated, 0) / 3600,
                "slots": [{"index": s.index, "job": s.job, "running": s.running, "switching": s.switching,
                           "since_s": now - s.since if s.job else None, "states": self.states.snapshot()[str(s.index)],
                           "errors": list(s.errors)} for s in self.slots],
                "jobs": {name: self._job_report(j) for name, j in sorted(self.jobs.items())},
                "detached_jobs": dict(self.detached),
                "transition_costs": self.states.costs(),
                "transitions": [t.as_dict() for t in self.states.log],
                "isolation": {"checked_admissions": self.isolation_checks, "violations": list(self.violations)},
            }


def _submit_to(current: Any, inst: Any, requests: list[GenerationRequest]) -> None:
    """On the slot's engine thread: the engine being stepped must be the job's own."""
    if current is not inst:
        raise RuntimeError("the slot is stepping another engine than the job's")
    from rollwise.engine.contract import add_all

    add_all(inst, requests)


class _JobWeights:
    """WeightReceiver's target for one job: store the version, apply it to the job's active engines."""

    def __init__(self, pool: EnginePool, job: _Job) -> None:
        self.pool, self.job = pool, job
        self.applied: list[int] = []

    @property
    def policy_version(self) -> int | None:
        return self.job.version

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        # caller holds job.lock: no activation or admission of this job interleaves
        for slot in self.pool.slots:
            inst = slot.instances.get(self.job.name)
            if inst is not None and self.pool.states.state(slot.index, self.job.name) is ACTIVE:
                slot.worker.call(lambda _e, inst=inst: inst.update_weights(state, version))  # between two steps
                self.applied.append(slot.index)
        self.job.weights, self.job.version = state, version
        self.job.versions.add(version)


# ==================================================================== HTTP


class AttachRequest(RequestBody):
    job: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    model: str = Field(min_length=1)
    priority: float = Field(1.0, gt=0)
    tokenizer_fingerprint: str | None = None


class PoolSampling(RequestBody):
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1)
    stop_token_ids: list[int] = []
    seed: int | None = Field(None, ge=0, le=2**62)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    top_logprobs: int = Field(0, ge=0, le=20)


class PoolRequest(RequestBody):
    request_id: str = Field(min_length=1, max_length=256)
    prompt_ids: list[int] = Field(min_length=1)
    params: PoolSampling = PoolSampling()


class SubmitRequest(RequestBody):
    requests: list[PoolRequest] = Field(min_length=1)


class AbortIds(RequestBody):
    request_ids: list[str]


def _params(p: PoolSampling | GenerateRequest, max_tokens: int, where: str = "") -> SamplingParams:
    """Engine SamplingParams; its own checks (e.g. min_tokens <= max_tokens) become a 400 naming the field."""
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if p.temperature is None else p.temperature,
                              top_p=1.0 if p.top_p is None else p.top_p, top_k=p.top_k, n=p.n,
                              stop_token_ids=list(p.stop_token_ids), seed=p.seed, ignore_eos=p.ignore_eos,
                              min_tokens=p.min_tokens, repetition_penalty=p.repetition_penalty or 1.0,
                              frequency_penalty=p.frequency_penalty or 0.0,
                              presence_penalty=p.presence_penalty or 0.0)
    except ValueError as exc:  # SamplingParams' messages start with the field's name
        field_name = str(exc).split(" ", 1)[0]
        raise PoolError(400, f"{where}{exc}", f"{where}{field_name}") from exc


def _bearer(authorization: str | None) -> str | None:
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return None


def _prometheus(state: dict[str, Any]) -> str:
    lines = []

    def metric(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {doc}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {value}" for labels, value in samples)

    jobs = state["jobs"]
    metric("rollwise_pool_engines", "gauge", "engines (slots) in the pool", [("", state["engines"])])
    metric("rollwise_pool_job_engine_seconds", "counter", "engine time held for a job (allocated)",
           [(f'{{job="{n}"}}', j["engine_seconds_allocated"]) for n, j in jobs.items()])
    metric("rollwise_pool_job_busy_engine_seconds", "counter", "engine time with the job's samples running",
           [(f'{{job="{n}"}}', j["engine_seconds_busy"]) for n, j in jobs.items()])
    metric("rollwise_pool_job_queued_samples", "gauge", "samples queued in the pool",
           [(f'{{job="{n}"}}', j["queued_samples"]) for n, j in jobs.items()])
    metric("rollwise_pool_job_running_samples", "gauge", "samples on engines",
           [(f'{{job="{n}"}}', j["running_samples"]) for n, j in jobs.items()])
    metric("rollwise_pool_job_generated_tokens", "counter", "tokens sampled for the job",
           [(f'{{job="{n}"}}', j["tokens"]) for n, j in jobs.items()])
    costs = state["transition_costs"]
    metric("rollwise_pool_transitions", "counter", "engine state transitions by kind",
           [(f'{{kind="{k}"}}', c["count"]) for k, c in costs.items()])
    metric("rollwise_pool_transition_seconds", "counter", "time spent in transitions by kind",
           [(f'{{kind="{k}"}}', c["total_s"]) for k, c in costs.items()])
    metric("rollwise_pool_isolation_violations", "counter", "admissions refused by the isolation check",
           [("", len(state["isolation"]["violations"]))])
    return "\n".join(lines) + "\n"


# What each route can answer besides 200 (the OpenAPI schema lists them; the envelope is rollwise.serve.errors').
_JOB_CALL = error_responses(403, 404)  # a job's token: unknown job 404, another job's token 403
_JOB_BODY = error_responses(400, 403, 404, 409, 413)


def _is_weight_upload(scope: Any) -> bool:
    """PUT /jobs/{job}/weights carries a whole model; it is raw bytes, never parsed as JSON on the loop."""
    return scope.get("method") == "PUT" and str(scope.get("path", "")).endswith("/weights")


def create_app(pool: EnginePool, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The pool's HTTP API. JSON bodies over `max_request_bytes` get 413 before they are read
    (`--max-request-bytes`); weight uploads are exempt (they are as large as the model)."""
    check_max_request_bytes(max_request_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        pool.start()
        try:
            yield
        finally:
            pool.close()

    app = FastAPI(title="rollwise pool", summary="engines shared by several training jobs", lifespan=lifespan)
    app.state.pool = pool
    install_error_handlers(app)
    honest_openapi(app)
    app.add_middleware(RequestSizeLimit, max_bytes=max_request_bytes, option="--max-request-bytes",
                       exempt=_is_weight_upload)

    async def pool_error(request: Request, exc: PoolError) -> JSONResponse:
        kind = {403: "permission_error", 404: "not_found_error", 409: "conflict"}.get(exc.status, "invalid_request_error")
        return APIError(exc.status, exc.message, exc.param, kind).response()

    app.add_exception_handler(PoolError, pool_error)
    app.add_exception_handler(ClientGone, client_gone)

    def auth(job: str, authorization: str | None) -> _Job:
        return pool.job(job, _bearer(authorization))

    @app.post("/jobs", responses=error_responses(400, 409, 413))
    def attach(body: AttachRequest) -> dict[str, Any]:
        job = pool.attach(body.job, body.model, body.priority, body.tokenizer_fingerprint)
        return {"job": job.name, "token": job.token, "model": job.model, "engines": len(pool.slots),
                "max_num_seqs": pool.max_num_seqs, "max_model_len": job.max_model_len,
                "vocab_size": job.vocab_size, "tokenizer_fingerprint": job.fingerprint, "engine": "reference",
                "eos_token_ids": list(job.eos_ids or [])}

    @app.put("/jobs/{job}/weights", responses=error_responses(400, 403, 404))
    async def weights(job: str, request: Request, authorization: str | None = Header(None)) -> dict[str, Any]:
        import asyncio

        j = auth(job, authorization)
        body = await request.body()
        return await asyncio.to_thread(pool.update_weights, j, body)

    @app.post("/jobs/{job}/requests", responses=_JOB_BODY)
    def submit(job: str, body: SubmitRequest, authorization: str | None = Header(None)) -> dict[str, Any]:
        j = auth(job, authorization)
        reqs = [(r.request_id, r.prompt_ids, _params(r.params, r.params.max_tokens, f"requests[{i}].params."))
                for i, r in enumerate(body.requests)]
        pool.submit(j, reqs)
        return {"queued": len(reqs)}

    @app.post("/jobs/{job}/generate", responses=_JOB_BODY)
    async def generate(job: str, body: GenerateRequest, request: Request,
                       authorization: str | None = Header(None)) -> dict[str, Any]:
        j = auth(job, authorization)
        waiter = _LoopEvent()
        rid = body.request_id or f"gen-{uuid.uuid4().hex}"
        params = _params(body, body.max_tokens or j.max_model_len)
        (req,) = pool.submit(j, [(rid, body.prompt_ids, params)], waiter=waiter)
        try:
            await unless_disconnected(request, waiter.wait())
        except ClientGone:  # nobody will read the answer: free the engine now
            await asyncio.to_thread(pool.abort, j, [rid])
            raise
        done = sorted(req.done, key=lambda c: c.index)
        return {"request_id": rid, "prompt_ids": body.prompt_ids, "job": j.name, "choices": [
            {"index": c.index, "token_ids": c.token_ids, "logprobs": c.logprobs, "versions": c.versions,
             "finish_reason": c.finish_reason, "cached_prompt_tokens": c.cached_prompt_tokens} for c in done]}

    @app.get("/jobs/{job}/completions", responses=error_responses(400, 403, 404))
    def completions(job: str, after: int = 0, timeout: float = 1.0,
                    authorization: str | None = Header(None)) -> dict[str, Any]:
        return pool.poll(auth(job, authorization), after, timeout)

    @app.post("/jobs/{job}/abort", responses=error_responses(400, 403, 404, 413))
    def abort(job: str, body: AbortIds, authorization: str | None = Header(None)) -> dict[str, Any]:
        aborted, upto = pool.abort(auth(job, authorization), body.request_ids)
        return {"aborted": aborted, "upto": upto}

    @app.post("/jobs/{job}/pause", responses=_JOB_CALL)
    def pause(job: str, authorization: str | None = Header(None)) -> dict[str, Any]:
        pool.set_paused(auth(job, authorization), True)
        return {"paused": True}

    @app.post("/jobs/{job}/resume", responses=_JOB_CALL)
    def resume(job: str, authorization: str | None = Header(None)) -> dict[str, Any]:
        pool.set_paused(auth(job, authorization), False)
        return {"paused": False}

    @app.delete("/jobs/{job}", responses=_JOB_CALL)
    def detach(job: str, authorization: str | None = Header(None)) -> dict[str, Any]:
        return pool.detach(auth(job, authorization))

    @app.get("/state")
    def state() -> dict[str, Any]:
        return pool.state()

    @app.get("/health")
    def health() -> dict[str, Any]:
        errors = [e for s in pool.slots for e in s.errors]
        return {"status": "ok" if not errors else "degraded", "engines": len(pool.slots),
                "jobs": sorted(pool.jobs), "errors": errors[-5:]}

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> Response:
        return Response(_prometheus(pool.state()), media_type="text/plain; version=0.0.4")

    return app


def serve(engines: int = 1, host: str = "127.0.0.1", port: int = 8300, max_num_seqs: int = 16,
          max_model_len: int = 1024, min_slice_s: float = 5.0, max_sleeping: int = 4, log_level: str = "info",
          job_timeout_s: float = 120.0, on_start: Callable[[EnginePool], None] | None = None,
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
    import uvicorn

    check_max_request_bytes(max_request_bytes)
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    if min_slice_s < 0:
        raise ValueError(f"--min-slice must be >= 0 seconds, got {min_slice_s}")
    pool = EnginePool(engines, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                      policy=Policy(min_slice_s=min_slice_s), max_sleeping=max_sleeping, job_timeout_s=job_timeout_s)
    if on_start is not None:
        on_start(pool)
    print(f"rollwise serve pool: {engines} reference engine(s), max_num_seqs={max_num_seqs}, max_model_len="
          f"{max_model_len}, min slice {min_slice_s:g}s, up to {max_sleeping} sleeping engines per slot; "
          f"http://{host}:{port}/state", flush=True)
    uvicorn.run(create_app(pool, max_request_bytes), host=host, port=port, log_level=log_level)

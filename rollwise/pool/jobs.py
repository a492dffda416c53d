"""The pool's records: a job (its model, weights, queue, outbox, accounting), a queued request, a slot.

Every field is guarded by the pool's locks as EnginePool (rollwise.pool.engine_pool) documents: `EnginePool.lock`
for queues, slot assignments and accounting; `Job.lock` for a job's weights, activation and pause.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from rollwise.engine.contract import Engine
from rollwise.engine.core import Command, EngineWorker
from rollwise.engine.outbox import Outbox
from rollwise.types.generation import Completion, GenerationRequest
from rollwise.pool.scheduler import LORA_PREFIX
from rollwise.types.weights import ExpectedWeights
from rollwise.types.weights import AdapterSpec


class Waiter(Protocol):
    """What a /generate call waits on: set() by the pool's threads when the request is done or aborted."""

    def set(self) -> None: ...


@dataclass(eq=False)
class QueuedRequest:
    internal_id: str  # what the engine sees (fresh uuid: jobs can never collide)
    public_id: str  # the job's own id
    job: str
    request: GenerationRequest
    remaining: int  # samples not yet returned
    slot: int | None = None  # None: queued in the pool
    waiter: Waiter | None = None  # /generate: answered when done, not through the long poll
    done: list[Completion] = field(default_factory=list)
    returned: set[int] = field(default_factory=set)  # sample indices already answered (a rerun skips them)
    crashes: int = 0  # times an engine failed while running it (rerun once, then answered with an error)
    error: PoolError | None = None  # why it ends without samples (its job faulted, or its engine kept failing)
    migrations: list[tuple[int, int]] = field(default_factory=list)  # (from slot, to slot) of each live migration


@dataclass(eq=False)
class Job:
    name: str
    token: str
    priority: float
    model: str
    fingerprint: str
    template: nn.Module  # the job's HF model (architecture; engines are built from it)
    tokenizer: Any
    expected: ExpectedWeights
    vocab_size: int
    eos_ids: list[int] | None
    max_model_len: int
    lock: threading.RLock = field(default_factory=threading.RLock)  # weights, activation, pause
    lora: bool = False  # a LoRA job: it pushes adapters and runs on its base's shared engine (engine_key)
    owner: str = "anonymous"  # the API key's label it attached with (rollwise.serve.auth): its quota
    footprint: int = 0  # host bytes the pool set aside for it at attach (rollwise.pool.tenancy)
    # Why the pool stopped running this job (its weights or adapter failed on an engine; rollwise.pool.slots):
    # its requests were answered with the error, new ones are refused until it pushes weights that load.
    fault: str | None = None
    version: int | None = None  # latest pushed policy version (None: nothing pushed yet)
    weights: dict[str, torch.Tensor] | None = None  # the pool's copy of that version (host memory; LoRA: the adapter)
    adapter: AdapterSpec | None = None  # LoRA: the pushed adapter's spec, named after the job
    versions: set[int] = field(default_factory=set)  # every version this job pushed
    queue: deque[QueuedRequest] = field(default_factory=deque)
    requests: dict[str, QueuedRequest] = field(default_factory=dict)  # public id -> request in flight
    paused: bool = False
    detached: bool = False
    running: int = 0  # samples on engines now
    # the job's outbox of stamped completions (their seq is added when polled); acknowledged entries are dropped
    out: Outbox[dict[str, Any]] = field(default_factory=Outbox)
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

    @property
    def key(self) -> str:
        """The engine tenancy this job runs in (rollwise.pool.scheduler.engine_key): its own, or its base's."""
        return LORA_PREFIX + self.model if self.lora else self.name

    def queued_samples(self) -> int:
        return sum(r.remaining for r in self.queue)

    def post(self, entry: dict[str, Any]) -> None:
        self.out.put(entry)


@dataclass(eq=False)
class Slot:
    index: int
    capacity: int
    worker: EngineWorker
    job: str | None = None  # active tenancy (Job.key: a job, or a LoRA base shared by its jobs), or the one switched in
    since: float = 0.0
    running: int = 0  # samples of the active tenancy on the engine
    running_by: dict[str, int] = field(default_factory=dict)  # job -> its samples among them
    switching: bool = False
    # tenancy (Job.key) -> its engine here (active or sleeping): the key is the engine's owner, the one record of it
    instances: dict[str, Engine] = field(default_factory=dict)
    last_active: dict[str, float] = field(default_factory=dict)  # tenancy -> when it last left the slot
    route_lock: threading.Lock = field(default_factory=threading.Lock)
    accounted_at: float = field(default_factory=time.monotonic)
    errors: list[str] = field(default_factory=list)

    def call_if_alive(self, fn: Command[object]) -> bool:
        """Run fn on the slot's engine thread, between two steps; False (and nothing run) if that thread died in
        a step: the slot's recovery (rollwise.pool.slots) then evicts its engine, so there is nothing to change."""
        worker = self.worker
        try:
            worker.call(fn)
        except RuntimeError:
            if worker.failure is None:
                raise
            return False
        return True




class PoolError(Exception):
    """Refused with an HTTP status and a message naming the problem (`retry_after`: seconds, sent as Retry-After)."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after = status, message, param, retry_after


def check_priority(priority: float) -> None:
    """The one check of a job's priority, for HTTP attaches and in-process ones alike: the scheduler divides
    engine time by it (rollwise.pool.scheduler), so 0 would never schedule the job and inf/NaN break the shares."""
    if not (math.isfinite(priority) and priority > 0):
        raise PoolError(400, f"priority must be a finite number > 0 (the job's share of engine time relative to "
                             f"other jobs; 1 is the default), got {priority!r}", "priority")


@dataclass(eq=False)
class LoraBase:
    """The LoRA jobs sharing one base model: one engine per slot serves all of them (one batch, each row with
    its job's adapter). Its `lock` is every member's `Job.lock`: an adapter push and a switch of the shared
    engine never interleave."""

    key: str
    model: str
    template: nn.Module  # the base model (every member attached with this model spec)
    tokenizer: Any
    fingerprint: str
    eos_ids: list[int] | None
    max_model_len: int
    lock: threading.RLock = field(default_factory=threading.RLock)
    members: dict[str, Job] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.key

    @property
    def detached(self) -> bool:
        return not self.members



def fault_error(job: Job) -> PoolError:
    """What a faulted job's requests are answered with, and its new ones refused with."""
    return PoolError(409, f"job {job.name!r}: {job.fault}. The pool stopped running this job (the other jobs keep "
                          "their engines): push weights that load (PUT /jobs/{job}/weights), or detach", "weights")


def stamp(c: Completion, req: QueuedRequest, slot: int) -> dict[str, Any]:
    return {"request_id": req.public_id, "index": c.index, "prompt_ids": c.prompt_ids, "token_ids": c.token_ids,
            "logprobs": c.logprobs, "versions": c.versions, "finish_reason": c.finish_reason,
            "cached_prompt_tokens": c.cached_prompt_tokens, "job": req.job, "slot": slot,
            "adapter": req.request.adapter,
            **({"migrations": [list(m) for m in req.migrations]} if req.migrations else {}),
            **({"routed_experts": c.routed_experts.to_wire()} if c.routed_experts is not None else {})}


def empty_abort(req: QueuedRequest, index: int) -> Completion:
    r = req.request
    return Completion(r.request_id, index, list(r.prompt_ids), [], [], [], "abort")


"""Full-parameter samplers of the Tinker service as jobs of one in-process EnginePool (rollwise.pool).

Each full-parameter sampler is a pool job on its base model; `save_weights_for_sampler` pushes the tenant's state
dict into the pool (EnginePool.push_weights: the same checks as any weight push), so switching a slot between
tenants is the pool's switching (sleep / wake / load from the tiered model cache, accounted in `state()`), not a
second mechanism here. Samples go through the pool's submit and come back with tokens, logprobs and top-k logprobs;
prompt scores run on the job's own engine (rollwise.pool.job_engine).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from torch import Tensor

from rollwise.engine.contract import Engine
from rollwise.pool.cache_settings import CacheSettings
from rollwise.pool.engine_pool import EnginePool
from rollwise.pool.job_engine import on_job_engine
from rollwise.pool.jobs import Job, PoolError, QueuedRequest
from rollwise.service.base_models import BaseModel
from rollwise.types.generation import GenerationRequest

T = TypeVar("T")
FOREVER_S = 10 * 365 * 86400.0  # the service detaches its jobs itself: the pool's idle reaper never should


class FullSamplers:
    """The pool (started on the first full-parameter sampler) and its jobs by sampler id, least recently used
    first. `slots`: the pool's engines; `max_sleeping`: engines kept asleep per slot (the rest are rebuilt from the
    tiered cache when switched back in); `max_samplers`: jobs kept (past it the least recently used is detached)."""

    def __init__(self, *, slots: int = 1, max_num_seqs: int = 32, max_model_len: int = 1024,
                 max_sleeping: int = 1, max_samplers: int = 16, seed: int | None = None,
                 cache: CacheSettings | None = None) -> None:
        self._new_pool = lambda: EnginePool(slots, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                            max_sleeping=max_sleeping, seed=seed, job_timeout_s=FOREVER_S,
                                            max_jobs=max_samplers, cache=cache)
        self.max_samplers = max_samplers
        self.pool: EnginePool | None = None
        self._jobs: OrderedDict[str, Job] = OrderedDict()

    def publish(self, sampler_id: str, base: BaseModel, state: dict[str, Tensor]) -> Job:
        """Serve `state` (a full state dict by HF names) as `sampler_id`: its job attached on `base` (once), the
        weights pushed as the job's next version. A state the pool's checks refuse raises ValueError."""
        job = self._jobs.get(sampler_id)
        if job is not None and job.model != base.name:
            self.drop(sampler_id)
            job = None
        if job is None:
            self._evict(keep=self.max_samplers - 1)
            job = self._pool().attach(job_name(sampler_id), base.name, 1.0, None,
                                      loaded=(base.model, base.tokenizer))
            self._jobs[sampler_id] = job
        self._jobs.move_to_end(sampler_id)
        try:
            self._pool().push_weights(job, state, (job.version or 0) + 1)
        except PoolError as exc:
            self.drop(sampler_id)
            raise ValueError(f"full-parameter sampler weights refused: {exc.message}") from None
        return job

    def job(self, sampler_id: str) -> Job | None:
        job = self._jobs.get(sampler_id)
        if job is not None:
            self._jobs.move_to_end(sampler_id)
        return job

    def drop(self, sampler_id: str) -> None:
        job = self._jobs.pop(sampler_id, None)
        if job is not None and self.pool is not None:
            self.pool.detach(job)

    def submit(self, job: Job, requests: list[GenerationRequest], waiter: threading.Event) -> list[QueuedRequest]:
        """Queue the requests (one sample each) on the pool; `waiter` is set as each one ends."""
        return self._pool().submit(job, [(r.request_id, r.prompt_ids, r.params) for r in requests], waiter=waiter)

    def abort(self, job: Job, request_ids: list[str]) -> None:
        if self.pool is not None and not job.detached:
            self.pool.abort(job, request_ids)

    def on_engine(self, job: Job, fn: Callable[[Engine], T]) -> T:
        return on_job_engine(self._pool(), job, fn)

    def state(self) -> dict[str, Any]:
        """The pool's /state (switches with the tier that served each load, accounting); {} before the first."""
        return {} if self.pool is None else self.pool.state()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def _pool(self) -> EnginePool:
        if self.pool is None:
            self.pool = self._new_pool()
            self.pool.start()
        return self.pool

    def _evict(self, keep: int) -> None:
        while len(self._jobs) > max(keep, 0):
            self.drop(next(iter(self._jobs)))


def job_name(sampler_id: str) -> str:
    """The pool job of a sampler (sampler ids carry ':'; a pool job's name is a plain word)."""
    return "sampler-full-" + hashlib.sha256(sampler_id.encode()).hexdigest()[:24]

"""Run a call on a full-parameter job's own engine in the pool, for work that is not a generation request (the Tinker
service scores prompts on the weights a sampler serves: rollwise.service.full_samplers).

Under the job's lock (no weight push or switch of this job interleaves): on its active engine between two steps
of the slot, on its sleeping engine directly (nothing steps it), else on an engine built for the call from the
tiered cache (rollwise.pool.tenant_engines), as a switch would build it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from rollwise.engine.contract import Engine
from rollwise.pool.engine_pool import EnginePool
from rollwise.pool.jobs import Job, PoolError
from rollwise.pool.states import ACTIVE, SLEEPING

T = TypeVar("T")


def on_job_engine(pool: EnginePool, job: Job, fn: Callable[[Engine], T]) -> T:
    """fn(the job's engine): its result."""
    if job.lora:
        raise PoolError(400, f"job {job.name!r} is a LoRA job: its engine is shared by its base's jobs", "job")
    with job.lock:
        if job.detached or job.version is None:
            raise PoolError(409, f"job {job.name!r} has no weights to run on (detached, or nothing pushed)", "job")
        for slot in pool.slots:
            inst = slot.instances.get(job.key)
            state = pool.states.state(slot.index, job.key)
            if inst is None or inst.policy_version != job.version:
                continue  # (a sleeping engine holding an older version is woken with the new one, not used here)
            if state is SLEEPING:
                return fn(inst)
            if state is ACTIVE:
                out: list[T] = []
                if slot.call_if_alive(lambda _e, inst=inst: out.append(fn(inst))):
                    return out[0]
        engine, _, _ = pool.engines.build(job)
        return fn(engine)

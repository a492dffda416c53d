"""Which job each engine slot of the pool serves next: a pure policy (no I/O, no threads, no clock).

The pool's slot loops (rollwise.pool.server) call `plan()` with a snapshot of the pool and the
current time; the cluster simulator can drive the same function on a virtual clock.

Policy, in order:

1. A slot keeps serving its active job while that job has work on it or queued, unless another job
   is *starving* (has queued work and no slot serving it) and deserves the slot more: then, once the
   active job has held the slot for at least `min_slice_s`, the slot *drains* (admits nothing new
   from the active job, lets what runs finish) and switches when it is empty. Running requests are
   never preempted: their KV cache would be lost.
2. A slot whose active job has no work left (a GRPO job that finished generating and is training), or
   none, is free: it switches at once to a starving job, most deserving first: one job's generation fills
   another's training gap. Each starving job goes to the free slot where it starts soonest (`SlotView.starts`:
   it sleeps there, else its weights load from the memory, disk or remote tier; rollwise.pool.startup_cost;
   ties by slot order), as ServerlessLLM's scheduler places by estimated start-up time.
3. Still-idle slots go to jobs that have more queued work than their slots can take (a job may
   run on several slots), most deserving first.
4. Otherwise the slot stays as it is: the active job keeps its warm engine (no needless sleep/wake).

"Deserving" is weighted fair share: the job with the fewest engine-seconds used per unit of
priority (virtual time = used / priority) goes first; ties by higher priority, then name.
Paused jobs admit nothing and keep their slots while requests of theirs are frozen on them.

LoRA jobs (issue 22): jobs whose `base` is set train adapters on that base model. One engine holding the
base serves all of them in the same batch (each row with its job's adapter), so the policy plans *engine
tenancies* (`engine_key`): a full-parameter job is a tenancy of its own, the LoRA jobs of one base share
one. A LoRA job whose base is active on a slot is served there at once: no switch, no weight load, and
the other LoRA jobs on that base keep their place (`Decision.tenants` lists every job the slot admits
from, most deserving first). A tenancy's fair-share rank is its members' engine-seconds per unit of
their summed priority.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal


@dataclass(frozen=True)
class JobView:
    name: str
    priority: float  # > 0: share of engine time relative to other jobs
    queued: int  # samples waiting in the pool, not yet on an engine
    engine_seconds: float  # engine time charged so far (busy time + transition costs)
    paused: bool = False
    base: str | None = None  # a LoRA job: the base model its adapter runs on (None: full-parameter job)

    @property
    def virtual_time(self) -> float:
        return self.engine_seconds / self.priority


@dataclass(frozen=True)
class SlotView:
    index: int
    job: str | None  # the active tenancy (engine_key of its jobs), None: no engine loaded
    since: float  # when the active job got the slot (same clock as `now`)
    running: int  # samples of the active tenancy on this slot now
    capacity: int  # max_num_seqs
    # estimated seconds until each tenancy would serve here (rollwise.pool.startup_cost.estimate_start: it sleeps
    # here, or loads from the memory/disk/remote tier); a tenancy not named: 0 (placement by slot order)
    starts: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    slot: int
    action: Literal["serve", "drain", "switch", "idle"]
    job: str | None  # serve/drain: the active tenancy; switch: the tenancy to activate; idle: None
    target: str | None = None  # drain: the tenancy the slot will switch to once empty
    reason: str = ""
    tenants: tuple[str, ...] = ()  # serve: the jobs whose queued work the slot admits, most deserving first

    @property
    def switches(self) -> bool:
        """Whether the decision costs an engine switch (a sleep and a wake or load) on this slot."""
        return self.action in ("switch", "drain")


LORA_PREFIX = "lora:"  # tenancy names of LoRA bases; ':' is not allowed in job names, so they never collide


def engine_key(job: JobView) -> str:
    """The engine tenancy a job runs in: its own engine (full parameters), or its base's (LoRA)."""
    return job.name if job.base is None else LORA_PREFIX + job.base


def _tenancies(jobs: Sequence[JobView]) -> tuple[list[JobView], dict[str, list[JobView]]]:
    """Jobs grouped by engine_key: one JobView per tenancy (LoRA members summed), and its members."""
    members: dict[str, list[JobView]] = {}
    for j in jobs:
        members.setdefault(engine_key(j), []).append(j)
    views = []
    for key, group in members.items():
        if len(group) == 1 and group[0].base is None:
            views.append(group[0])
            continue
        active = [j for j in group if not j.paused]
        views.append(JobView(key, sum(j.priority for j in group), sum(j.queued for j in active),
                             sum(j.engine_seconds for j in group), paused=not active))
    return views, members


@dataclass(frozen=True)
class Policy:
    min_slice_s: float = 5.0  # an active job with work keeps its slot at least this long
    # How a draining slot empties (issue 42): "migration" moves its running requests to a peer slot serving the same
    # tenancy when one has room (rollwise.pool.slot_migration), else waits; "wait" always lets them finish there.
    drain_by: Literal["migration", "wait"] = "migration"


def _rank(job: JobView) -> tuple[float, float, str]:
    return (job.virtual_time, -job.priority, job.name)


def plan(slots: Sequence[SlotView], jobs: Sequence[JobView], now: float, policy: Policy = Policy()) -> list[Decision]:
    """One decision per slot (in slot order) for the pool state given; slots name tenancies (engine_key)."""
    views, members = _tenancies(jobs)
    out = []
    for d in _plan_tenancies(slots, views, now, policy):
        if d.action == "serve" and d.job is not None:
            wanting = sorted((j for j in members.get(d.job, []) if j.queued > 0 and not j.paused), key=_rank)
            d = replace(d, tenants=tuple(j.name for j in wanting))
        out.append(d)
    return out


def _plan_tenancies(slots: Sequence[SlotView], jobs: Sequence[JobView], now: float, policy: Policy) -> list[Decision]:
    by_name = {j.name: j for j in jobs}
    wants = {j.name for j in jobs if j.queued > 0 and not j.paused}
    served = {s.job for s in slots if s.job is not None}
    starving = sorted((by_name[n] for n in wants - served), key=_rank)
    decisions: dict[int, Decision] = {}
    idle: list[SlotView] = []
    spare = {j.name: j.queued for j in jobs if j.name in wants}  # queued work no slot will take yet

    # 1 + 2: slots with an active job.
    for s in sorted(slots, key=lambda s: s.index):
        job = by_name.get(s.job) if s.job is not None else None
        if job is None:
            idle.append(s)
            continue
        has_work = s.running > 0 or (job.queued > 0 and not job.paused)
        if has_work:
            rival = starving[0] if starving else None
            if (rival is not None and not job.paused and now - s.since >= policy.min_slice_s
                    and _rank(rival) < _rank(job)):
                starving.pop(0)
                spare[rival.name] -= s.capacity
                if s.running == 0:
                    decisions[s.index] = Decision(s.index, "switch", rival.name,
                                                  reason=f"time slice over; {rival.name} is owed engine time")
                else:
                    decisions[s.index] = Decision(s.index, "drain", job.name, rival.name,
                                                  reason=f"time slice over; {rival.name} is owed engine time")
            else:
                decisions[s.index] = Decision(s.index, "serve", job.name)
                if job.name in spare:
                    spare[job.name] -= max(s.capacity - s.running, 0)
        else:  # no work: the slot is free for a starving job (placed below, where it starts soonest)
            idle.append(s)

    # 2 (empty slots): each starving job, most deserving first, to the idle slot where it starts soonest
    # (start-up-aware placement, as ServerlessLLM's scheduler: a slot where it sleeps beats one that loads it
    # from the memory tier, which beats disk, which beats remote; ties by slot order).
    free = sorted(idle, key=lambda s: s.index)
    while free and starving:
        rival = starving.pop(0)
        s = min(free, key=lambda v, r=rival.name: (v.starts.get(r, 0.0), v.index))
        free.remove(s)
        held = by_name.get(s.job) if s.job is not None else None
        why = f"{held.name} has no work; {rival.name} has" if held is not None else f"{rival.name} has queued work"
        decisions[s.index] = Decision(s.index, "switch", rival.name, reason=why)
        spare[rival.name] -= s.capacity
    # 3: still-idle slots to jobs with more work than their slots hold.
    for s in free:
        extra = sorted((by_name[n] for n, left in spare.items() if left > 0 and n != s.job), key=_rank)
        if extra:
            decisions[s.index] = Decision(s.index, "switch", extra[0].name,
                                          reason=f"{extra[0].name} has more queued work than its slots take")
            spare[extra[0].name] -= s.capacity
        elif s.job is not None:
            decisions[s.index] = Decision(s.index, "serve", s.job, reason="no other job has work")
        else:
            decisions[s.index] = Decision(s.index, "idle", None)
    return [decisions[s.index] for s in sorted(slots, key=lambda s: s.index)]

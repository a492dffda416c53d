"""Which job each engine slot of the pool serves next: a pure policy (no I/O, no threads, no clock).

The pool's slot loops (rollwise.pool.server) call `plan()` with a snapshot of the pool and the
current time; the cluster simulator can drive the same function on a virtual clock.

Policy, in order:

1. A slot keeps serving its active job while that job has work on it or queued, unless another job
   is *starving* (has queued work and no slot serving it) and deserves the slot more: then, once the
   active job has held the slot for at least `min_slice_s`, the slot *drains* (admits nothing new
   from the active job, lets what runs finish) and switches when it is empty. Running requests are
   never preempted: their KV cache would be lost.
2. A slot whose active job has no work left (a GRPO job that finished generating and is training)
   switches at once to the most deserving starving job: one job's generation fills another's
   training gap.
3. Still-idle slots go to jobs that have more queued work than their slots can take (a job may
   run on several slots), most deserving first.
4. Otherwise the slot stays as it is: the active job keeps its warm engine (no needless sleep/wake).

"Deserving" is weighted fair share: the job with the fewest engine-seconds used per unit of
priority (virtual time = used / priority) goes first; ties by higher priority, then name.
Paused jobs admit nothing and keep their slots while requests of theirs are frozen on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class JobView:
    name: str
    priority: float  # > 0: share of engine time relative to other jobs
    queued: int  # samples waiting in the pool, not yet on an engine
    engine_seconds: float  # engine time charged so far (busy time + transition costs)
    paused: bool = False

    @property
    def virtual_time(self) -> float:
        return self.engine_seconds / self.priority


@dataclass(frozen=True)
class SlotView:
    index: int
    job: str | None  # the active job, None: no engine loaded
    since: float  # when the active job got the slot (same clock as `now`)
    running: int  # samples of the active job on this slot now
    capacity: int  # max_num_seqs


@dataclass(frozen=True)
class Decision:
    slot: int
    action: Literal["serve", "drain", "switch", "idle"]
    job: str | None  # serve/drain: the active job; switch: the job to activate; idle: None
    target: str | None = None  # drain: the job the slot will switch to once empty
    reason: str = ""


@dataclass(frozen=True)
class Policy:
    min_slice_s: float = 5.0  # an active job with work keeps its slot at least this long


def _rank(job: JobView) -> tuple[float, float, str]:
    return (job.virtual_time, -job.priority, job.name)


def plan(slots: Sequence[SlotView], jobs: Sequence[JobView], now: float, policy: Policy = Policy()) -> list[Decision]:
    """One decision per slot (in slot order) for the pool state given."""
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
        elif starving:
            rival = starving.pop(0)
            spare[rival.name] -= s.capacity
            decisions[s.index] = Decision(s.index, "switch", rival.name,
                                          reason=f"{job.name} has no work; {rival.name} has")
        else:
            idle.append(s)

    # 2 (empty slots) + 3: idle slots to starving jobs, then to jobs with more work than their slots hold.
    for s in sorted(idle, key=lambda s: s.index):
        if starving:
            rival = starving.pop(0)
            decisions[s.index] = Decision(s.index, "switch", rival.name, reason=f"{rival.name} has queued work")
            spare[rival.name] -= s.capacity
            continue
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

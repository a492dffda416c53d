"""What the pool's scheduler does with given jobs when engines and trainers do not share hardware.

A small discrete-time replay that drives the pure policy (rollwise.pool.scheduler.plan) on a virtual
clock: each job alternates a generation phase (its whole batch on one engine slot; running work is
never preempted, as in the pool) and a training phase (no engine), for its number of steps, after a
fixed start-up time. Engines switch jobs at a measured cost. Phase times come from real runs (the
dedicated arm of `rollwise bench mux`), so the projection answers: with these jobs, what would sharing
cost in wall time and save in engine-hours if trainers had their own devices (GPU jobs), i.e. without
the CPU contention of a small machine where engines and trainers share cores.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollwise.pool.scheduler import JobView, Policy, SlotView, plan


@dataclass
class PhaseJob:
    name: str
    steps: int
    generate_s: float  # engine time of one step's generation
    train_s: float  # one step's training (+ weight sync), no engine
    startup_s: float = 0.0  # before the first step (model load, evaluation), no engine
    priority: float = 1.0


def project(jobs: list[PhaseJob], engines: int, *, switch_s: float = 0.0, policy: Policy = Policy(),
            dt: float = 0.002, capacity: int = 32) -> dict:
    """Wall time of every job sharing `engines` slots, and the engine-hours saving against one engine each."""
    t = 0.0
    step = {j.name: 0 for j in jobs}
    phase = {j.name: "startup" for j in jobs}
    left = {j.name: j.startup_s for j in jobs}  # time left in the current phase
    used = {j.name: 0.0 for j in jobs}
    done_at: dict[str, float] = {}
    slot_job: list[str | None] = [None] * engines
    slot_since = [0.0] * engines
    slot_busy_until = [0.0] * engines  # a switch in progress
    while len(done_at) < len(jobs):
        serving = {slot_job[i] for i in range(engines) if phase.get(slot_job[i] or "") == "running"}
        views = [JobView(j.name, j.priority, capacity if phase[j.name] == "queued" else 0, used[j.name])
                 for j in jobs if j.name not in done_at]
        slots = [SlotView(i, slot_job[i], slot_since[i],
                          capacity if slot_job[i] in serving and phase[slot_job[i]] == "running" else 0, capacity)
                 for i in range(engines)]
        for d in plan(slots, views, t, policy):
            i = d.slot
            if t < slot_busy_until[i]:
                continue
            if d.action == "switch" and d.job != slot_job[i]:
                slot_job[i], slot_since[i] = d.job, t
                slot_busy_until[i] = t + switch_s
                used[d.job] += switch_s
            elif d.action in ("serve", "switch") and phase[d.job] == "queued" and t >= slot_busy_until[i]:
                phase[d.job] = "running"  # the whole batch is admitted (it fits in one slot)
        # advance the clock
        t += dt
        for j in jobs:
            n = j.name
            if n in done_at:
                continue
            if phase[n] == "running":
                used[n] += dt
            if phase[n] in ("startup", "running", "training"):
                left[n] -= dt
                if left[n] > 1e-12:
                    continue
                if phase[n] == "running":
                    phase[n], left[n] = "training", j.train_s
                    continue
                if phase[n] == "training":
                    step[n] += 1
                if step[n] >= j.steps:
                    done_at[n] = t
                    for i in range(engines):
                        if slot_job[i] == n:
                            slot_job[i] = None
                else:
                    phase[n], left[n] = "queued", j.generate_s
    dedicated = {j.name: j.startup_s + j.steps * (j.generate_s + j.train_s) for j in jobs}
    span = max(done_at.values())
    dedicated_s = sum(dedicated.values())
    return {
        "wall_shared_s": done_at, "wall_dedicated_s": dedicated,
        "slowdown": {n: done_at[n] / dedicated[n] - 1 for n in done_at},
        "engine_s_dedicated": dedicated_s, "engine_s_shared": engines * span,
        "engine_hours_saving": 1 - engines * span / dedicated_s,
    }

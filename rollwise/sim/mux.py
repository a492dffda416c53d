"""Several RL jobs sharing one engine pool, on a virtual clock: the pool's own scheduler
(rollwise.pool.scheduler.plan, the function `rollwise serve pool` calls) decides which job each engine
slot serves; engines are SimEngines (cost model); each job is a sync GRPO loop (generate a batch, train,
push weights). Compared with the same jobs each on dedicated engines, as `rollwise bench mux` measures.

What is modelled, and what is not:
- a slot admits whole requests of its active job while they fit (as EnginePool._decide_and_admit);
  switching a slot costs the measured transition time (wake for a sleeping engine, load for one never
  built there), charged to the job switched to, as the pool charges it;
- the job's step: generation until its last sample is back, then `train_s(tokens)`, then `push_s`
  (the weight push to the pool), then the next batch is submitted;
- the `Host`: by default (a GPU cluster) every engine and trainer has its own device. On a CPU machine
  the trainers (one process each) and the pool's engine slots share `cores`, and the CPU pool's slots
  are threads of one Python process, which take turns under its interpreter lock: together they do
  `pool_cores` (1) cores' worth of steps.
  Processor sharing (rollwise.sim.cores), engines stepping one decode step at a time;
- LoRA jobs (`MuxJob.base`): the jobs on one base share that base's engine on a slot and run in one batch,
  as the pool serves them (the scheduler plans engine tenancies, rollwise.pool.scheduler.engine_key): no
  switch between them; a tenancy's engine time is split evenly among its jobs for fair share;
- not modelled: the HTTP hops (they are inside the measured phase times bench mux feeds in).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.pool.scheduler import JobView, Policy, SlotView, engine_key, plan
from rollwise.pool.startup_cost import StartupCost, Tier, estimate_start
from rollwise.sim.cores import SharedCores
from rollwise.sim.cost import CostModel
from rollwise.sim.engine import SimEngine, VirtualClock
from rollwise.sim.events import EventQueue


@dataclass(frozen=True)
class MuxJob:
    name: str
    steps: int
    prompts_per_step: int
    group_size: int
    prompt_tokens: int
    max_tokens: int
    train_s: Callable[[int], float]  # trained tokens (prompt + response) -> seconds of one train step
    push_s: float = 0.0  # trainer -> pool weight push, after each step
    priority: float = 1.0
    mean_response_tokens: float = 0.0  # exponential lengths with this mean; 0: every sample runs to max_tokens
    response_tokens: int | None = None  # every sample exactly this long (overrides the mean)
    start_s: float = 0.0  # when the job is launched
    startup_s: float = 0.0  # launch to first batch (model load, first evaluation): no engine needed
    # How much a step's generation and its training vary from step to step (coefficients of variation;
    # lognormal, mean 1). Two jobs whose generate and train times fit each other's gaps would otherwise
    # interleave perfectly forever; measured, they drift and collide on the shared engine and cores.
    generate_cv: float = 0.0  # the step's engine steps all run this much slower or faster
    train_cv: float = 0.0
    base: str | None = None  # a LoRA job: its base model (jobs on one base share its engine, in one batch)


@dataclass(frozen=True)
class Transitions:
    """Seconds a slot spends switching to a job (the pool's measured transition costs)."""

    load_s: float = 0.0  # build an engine + load weights (first time on this slot, or after eviction)
    wake_s: float = 0.0  # a sleeping engine back to active (+ the job's newer weights)
    sleep_s: float = 0.0  # the outgoing job's engine to sleep
    # Start-up-aware placement (issue 42): per-tier bandwidths (rollwise.pool.startup_cost, the pool's model);
    # None: a load costs load_s and a wake wake_s. `model_bytes`: a job's weights; `load_tier`: where a job not
    # sleeping on the slot loads from (the pool's model cache tier).
    startup: StartupCost | None = None
    model_bytes: int = 0
    load_tier: Tier = "remote"

    def start_s(self, sleeping: bool) -> float:
        """Seconds until a job serves on a slot: estimate_start, the function the pool's placement uses."""
        cost = self.startup or StartupCost(wake_s=self.wake_s, build_s=self.load_s)
        return estimate_start(cost, "sleeping" if sleeping else self.load_tier, self.model_bytes)


@dataclass(frozen=True)
class Host:
    """Where the jobs and the pool run. Default: a GPU cluster, nothing shared (each engine and trainer
    on its own device). `rollwise bench mux` on a CPU machine: rollwise.sim.host.measure_cpu_host()."""

    cores: float = 0.0  # > 0: trainers (one process each) and engine slots share this many CPU cores
    pool_cores: float = 0.0  # > 0: the pool's engine slots together use at most this many cores (one interpreter)
    # (processes, effective cores) measured with that many processes at work: the machine gives less when
    # crowded (rollwise.sim.cores.crowded_cores); empty: `cores` however many
    crowding: tuple[tuple[int, float], ...] = ()
    # The share of the CPU pool engine's decode step that grows with its batch, at one job's batch (0: a
    # step costs the same at any batch, as a GPU's decode step nearly does). bench mux measures it
    # (rollwise.bench.mux.measure_batch_share) and builds its engine cost model from it.
    engine_batch_share: float = 0.0

    @classmethod
    def measured(cls, measurement: dict[str, Any]) -> Host:
        """From rollwise.sim.host.measure_cpu_host() (+ bench mux's `engine_batch_share`)."""
        return cls(cores=measurement["cores"], pool_cores=measurement["pool_cores"],
                   crowding=tuple((int(n), float(c)) for n, c in measurement.get("crowding", ())),
                   engine_batch_share=float(measurement.get("engine_batch_share", 0.0)))

    @property
    def shared(self) -> bool:
        return self.cores > 0 or self.pool_cores > 0


@dataclass
class _JobState:
    spec: MuxJob
    queue: deque = field(default_factory=deque)  # GenerationRequests not yet on a slot
    outstanding: int = 0  # samples of this step not back yet
    tokens: int = 0  # trained tokens of this step
    step: int = 0
    busy_s: float = 0.0  # engine time charged (running + transitions)
    generate_factor: float = 1.0  # this step's draw of the generation variation (engine slowdown)
    finished_at: float | None = None
    started_at: float = 0.0
    # where its time went, as bench mux reports a job's (sums over its steps): submit to last sample back,
    # and train + push
    phase_since: float = 0.0
    generate_s: float = 0.0
    train_s: float = 0.0


@dataclass
class _SlotState:
    engine: SimEngine
    job: str | None = None
    since: float = 0.0
    switching_until: float | None = None
    built: set[str] = field(default_factory=set)
    accounted_at: float = 0.0


def _lognormal(rng: random.Random, cv: float) -> float:
    """A factor with mean 1 and coefficient of variation `cv`; exactly 1 (no draw) when cv is 0."""
    if cv <= 0:
        return 1.0
    sigma2 = math.log(1 + cv * cv)
    return rng.lognormvariate(-sigma2 / 2, math.sqrt(sigma2))


def simulate_mux(jobs: list[MuxJob], engines: int, cost: CostModel, transitions: Transitions = Transitions(),
                 policy: Policy = Policy(), seed: int = 0, host: Host = Host(),
                 engine_slowdown: float = 1.0) -> dict[str, Any]:
    """Run the jobs to their last step on `engines` shared slots; per-job wall time and engine-hours.
    engine_slowdown: every engine step takes this much longer (e.g. unmerged multi-LoRA batches)."""
    clock = VirtualClock()
    rng = random.Random(seed)
    by_name = {j.name: j for j in jobs}
    variation = random.Random(seed * 7919 + 1)  # its own stream: lengths drawn as before when all CVs are 0

    def length(req: GenerationRequest, i: int) -> int:
        spec = by_name[req.request_id.split(":", 1)[0]]
        if spec.response_tokens is not None:
            return spec.response_tokens
        if not spec.mean_response_tokens:
            return spec.max_tokens
        return max(1, min(spec.max_tokens, round(rng.expovariate(1 / spec.mean_response_tokens))))

    slots = [_SlotState(SimEngine(cost, clock=clock, length_sampler=length, engine_id=f"slot-{i}", seed=seed + i,
                                  cache_history=False)) for i in range(engines)]
    state = {j.name: _JobState(j, started_at=j.start_s) for j in jobs}
    events = EventQueue(clock)
    at = events.at

    cores = None  # no sharing: every engine and trainer at its own speed
    if host.shared:
        cores = SharedCores(host.cores, at, lambda: clock.now, caps={"pool": host.pool_cores or 1.0},
                            crowding=host.crowding)

    def compute(seconds: float, group: str | None, on_done: Callable[[], None]) -> None:
        """CPU (or device) work of one process: timed as given, or shared with the others on the host."""
        if cores is None:
            at(clock.now + seconds, on_done)
        else:
            cores.run(seconds, on_done, group)

    def submit_step(js: _JobState) -> None:
        spec = js.spec
        params = SamplingParams(max_tokens=spec.max_tokens, temperature=1.0, n=spec.group_size, seed=js.step)
        for g in range(spec.prompts_per_step):
            prompt = [3 + (g * 7919 + k) % 1000 for k in range(spec.prompt_tokens)]
            js.queue.append(GenerationRequest(f"{spec.name}:{js.step}:g{g}", prompt, params))
        js.outstanding = spec.prompts_per_step * spec.group_size
        js.tokens = 0
        js.phase_since = clock.now
        js.generate_factor = _lognormal(variation, spec.generate_cv)

    # A LoRA base's engine time is charged to the base and split evenly among its running jobs, as the pool does.
    key_of = {j.name: engine_key(JobView(j.name, j.priority, 0, 0.0, base=j.base)) for j in jobs}
    base_busy = {key: 0.0 for name, key in key_of.items() if key != name}
    running_jobs = {key: sum(1 for n in key_of if key_of[n] == key) for key in base_busy}  # not finished yet

    def busy_of(js: _JobState) -> float:
        if js.spec.base is None:
            return js.busy_s
        key = key_of[js.spec.name]
        return base_busy[key] / max(1, running_jobs[key])

    def view(js: _JobState) -> JobView:
        busy = busy_of(js)
        return JobView(js.spec.name, js.spec.priority, sum(r.params.n for r in js.queue), busy, base=js.spec.base)

    def account(s: _SlotState) -> None:
        now = clock.now
        if s.job is not None and (s.engine.has_unfinished() or s.switching_until is not None):
            if s.job in base_busy:
                base_busy[s.job] += now - s.accounted_at
            else:
                state[s.job].busy_s += now - s.accounted_at
        s.accounted_at = now

    start_s = {sleeping: transitions.start_s(sleeping) for sleeping in (False, True)}  # per slot: wake or load

    def schedule() -> None:
        now = clock.now
        for s in slots:
            account(s)
        job_views = [view(js) for js in state.values() if js.finished_at is None and js.started_at <= now]
        keys = {engine_key(j) for j in job_views}
        views = [SlotView(i, s.job, s.since, s.engine.unfinished_samples, cost.max_num_seqs,
                          {k: start_s[k in s.built] for k in keys})
                 for i, s in enumerate(slots)]
        for decision in plan(views, job_views, now, policy):
            s = slots[decision.slot]
            if s.switching_until is not None:
                continue  # mid-switch: the pool's slot loop is busy switching too
            if decision.action == "switch":
                cost_s = (transitions.sleep_s if s.job is not None else 0.0) + start_s[decision.job in s.built]
                s.job, s.since = decision.job, now
                s.built.add(decision.job)
                s.switching_until = now + cost_s
                at(now + cost_s, lambda s=s: setattr(s, "switching_until", None))
            elif decision.action == "serve":
                room = cost.max_num_seqs - s.engine.unfinished_samples
                added = False
                for name in decision.tenants:  # LoRA jobs of one base: one batch, most deserving first
                    js = state[name]
                    if js.queue and js.queue[0].params.n <= room and not added:  # this step's generation speed
                        s.engine.set_slowdown(js.generate_factor * engine_slowdown)
                    while js.queue and js.queue[0].params.n <= room:
                        req = js.queue.popleft()
                        room -= req.params.n
                        s.engine.add_request(req)
                        added = True
                if added or (s.engine.op is None and s.engine.has_unfinished()):
                    start(decision.slot)

    def start(i: int) -> None:
        e = slots[i].engine
        if cores is not None:  # shared cores: one step at a time, at the rate it gets; a running one ends by itself
            if e.op is None and e.has_unfinished() and e.start_op(max_steps=1) is not None:
                cores.run(e.op.end - clock.now, lambda: op_done(i), "pool" if host.pool_cores > 0 else None)
            return
        if e.op is None and e.has_unfinished():
            e.start_op()  # no sharing: the op runs at its own speed to the next finish
        if e.op is not None:  # (re)plan its end: a request added mid-op cuts it short, superseding the old end
            at(e.op.end, lambda: op_done(i), valid=lambda serial=e.op_serial: e.op is not None
               and e.op_serial == serial)

    def op_done(i: int) -> None:
        for c in slots[i].engine.finish_op():
            js = state[c.request_id.split(":", 1)[0]]
            js.outstanding -= 1
            js.tokens += len(c.prompt_ids) + len(c.token_ids)
            if js.outstanding == 0:
                js.generate_s += clock.now - js.phase_since
                js.phase_since = clock.now
                train_s = js.spec.train_s(js.tokens) * _lognormal(variation, js.spec.train_cv)
                compute(train_s + js.spec.push_s, f"trainer:{js.spec.name}",
                        lambda js=js: trained(js))
        start(i)

    def trained(js: _JobState) -> None:
        js.train_s += clock.now - js.phase_since
        js.step += 1
        if js.step >= js.spec.steps:
            js.finished_at = clock.now
            if js.spec.base is not None:
                js.busy_s = busy_of(js)  # its share of the base's engine time so far
                running_jobs[key_of[js.spec.name]] -= 1
        else:
            submit_step(js)

    for js in state.values():  # start-up (model load, first evaluation) is the trainer process's work
        at(js.started_at, lambda js=js: compute(js.spec.startup_s, f"trainer:{js.spec.name}",
                                                lambda: submit_step(js)))
    events.run(schedule)  # decide once everything due now has happened

    makespan = max(js.finished_at or 0.0 for js in state.values())
    return {
        "engines": engines,
        "makespan_s": makespan,
        "engine_hours": engines * makespan / 3600,
        "jobs": {n: {"wall_s": (js.finished_at or 0.0) - js.started_at,
                     "engine_busy_s": js.busy_s if js.finished_at else busy_of(js),
                     "generate_s": js.generate_s, "train_s": js.train_s} for n, js in state.items()},
    }


def compare_shared_vs_dedicated(jobs: list[MuxJob], shared_engines: int, cost: CostModel,
                                transitions: Transitions = Transitions(), policy: Policy = Policy(),
                                seed: int = 0, host: Host = Host()) -> dict[str, Any]:
    """`rollwise bench mux` in simulation: each job alone on one dedicated engine (no switching), then all
    jobs on `shared_engines`; engine-hours saved and per-job slowdown."""
    dedicated = {j.name: simulate_mux([j], 1, cost, Transitions(load_s=transitions.load_s), policy, seed, host)
                 for j in jobs}
    shared = simulate_mux(jobs, shared_engines, cost, transitions, policy, seed, host)
    dedicated_hours = sum(d["engine_hours"] for d in dedicated.values())
    per_job = {n: {"dedicated_wall_s": dedicated[n]["jobs"][n]["wall_s"], "shared_wall_s": s["wall_s"],
                   "slowdown": s["wall_s"] / dedicated[n]["jobs"][n]["wall_s"] - 1}
               for n, s in shared["jobs"].items()}
    return {"jobs": per_job, "dedicated_engine_hours": dedicated_hours, "shared_engine_hours": shared["engine_hours"],
            "engine_hours_saved": 1 - shared["engine_hours"] / dedicated_hours,
            "max_slowdown": max(p["slowdown"] for p in per_job.values())}

"""LoRA jobs sharing engines (issue 22), on a virtual clock: `rollwise sim lora`.

With full-parameter jobs a pool slot serves one job at a time and switching costs a weight load
(rollwise.sim.mux). LoRA jobs on one base need no switch: every engine holds the base, and requests of
all jobs run in the same batch, each row with its job's adapter (rollwise.engine.reference.lora; vLLM's
multi-LoRA). Modelled here:

- every engine admits queued requests of any job while its batch has room, the job with the least
  engine service so far first (fair share, as the pool's scheduler ranks jobs);
- a batch holding adapters steps `decode_overhead` slower than the base alone (the per-row adapter
  matmuls: punica/S-LoRA's batched LoRA kernels; an assumption, set it from a measurement);
- each job is a sync GRPO loop: generate a batch, train (its own trainer GPU, as in the dedicated arm),
  push its adapter (`adapter_push_s`: megabytes, not the model), next batch;
- dedicated arm: each job alone on one engine serving its adapter merged (no overhead) — the
  comparison `rollwise bench mux` makes, in engine-hours (DESIGN.md: Σ engines × time held).

Trainer GPUs are the same in both arms and not counted in engine-hours.

`--pool` adds the same jobs through the pool's own scheduler (rollwise.sim.mux, which drives
rollwise.pool.scheduler.plan, validated against `rollwise bench mux --lora` by `rollwise sim validate-mux
--lora`): once as LoRA jobs on one base (one engine tenancy, one batch, no switches) and once as
full-parameter jobs, time-sliced as the pool serves them (a full weight push per step, a switch costs a
sleep and a wake, or an engine load: `FULL_SWITCH`, assumptions stated there). The gap between the two is
what adapters add to multiplexing (PlexRL's time-slicing of full models measured 37.58% fewer GPU-hours).
"""

from __future__ import annotations

import argparse
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from rich.console import Console
from rich.table import Table

from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.sim.commands import SimCommand, write_json
from rollwise.sim.cost import CostModel, TrainerModel, load_cost_file
from rollwise.sim.engine import SimEngine, VirtualClock
from rollwise.sim.events import EventQueue
from rollwise.sim.mux import MuxJob, Transitions, simulate_mux

# Full-parameter 7B on an H100, switching jobs (assumptions): sleep offloads the weights to host memory
# (15 GB at ~25 GB/s pinned PCIe, ~0.6 s) and wake brings them back (~0.6 s + KV cache re-allocation); a
# load builds an engine and reads the weights from the job's store (~20 s: engine start, CUDA graphs).
FULL_SWITCH = Transitions(load_s=20.0, wake_s=1.0, sleep_s=0.7)


@dataclass(frozen=True)
class AdapterCost:
    decode_overhead: float = 0.10  # batch step time x (1 + this) while adapters are applied unmerged
    adapter_push_s: float = 0.05  # a rank-16 adapter of a 7B model (~40 MB bf16) to the engines


@dataclass
class _Job:
    spec: MuxJob
    queue: deque = field(default_factory=deque)
    outstanding: int = 0
    tokens: int = 0
    step: int = 0
    served: float = 0.0  # engine samples admitted so far (fair-share key)
    started_at: float = 0.0
    finished_at: float | None = None


@dataclass(frozen=True)
class SharedTrainers:
    """Training as a service (`rollwise serve tinker`, rollwise.sim.service): the jobs' train steps queue on `gpus`
    shared trainer GPUs instead of one trainer each; a free GPU takes the queued steps in arrival order, up to
    `max_batch_tokens`, and runs them as one batch (one forward over the base with per-adapter deltas), which
    costs `step_s(total tokens)`: the per-update overhead is paid once per batch, not once per tenant."""

    gpus: int
    step_s: Callable[[int], float]
    max_batch_tokens: int = 1 << 20


def simulate_lora(jobs: list[MuxJob], engines: int, cost: CostModel, serving: AdapterCost = AdapterCost(),
                  *, merged: bool = False, seed: int = 0, trainers: SharedTrainers | None = None) -> dict[str, Any]:
    """All `jobs` on `engines` engines holding their shared base; per-job wall time, engine-hours.
    merged=True: the adapter merged into the weights (a dedicated engine): no decode overhead.
    trainers: the jobs train on these shared GPUs (batched) instead of each on its own (`spec.train_s`)."""
    clock = VirtualClock()
    rng = random.Random(seed)
    by_name = {j.name: j for j in jobs}

    def length(req: GenerationRequest, i: int) -> int:
        spec = by_name[req.request_id.split(":", 1)[0]]
        if not spec.mean_response_tokens:
            return spec.max_tokens
        return max(1, min(spec.max_tokens, round(rng.expovariate(1 / spec.mean_response_tokens))))

    pool = [SimEngine(cost, clock=clock, length_sampler=length, engine_id=f"e{i}", seed=seed + i, cache_history=False)
            for i in range(engines)]
    for e in pool:
        e.set_slowdown(1.0 if merged else 1.0 + serving.decode_overhead)
    state = {j.name: _Job(j, started_at=j.start_s) for j in jobs}
    events = EventQueue(clock)
    at = events.at

    def submit_step(job: _Job) -> None:
        spec = job.spec
        params = SamplingParams(max_tokens=spec.max_tokens, temperature=1.0, n=spec.group_size, seed=job.step)
        for g in range(spec.prompts_per_step):
            prompt = [3 + (g * 7919 + k) % 1000 for k in range(spec.prompt_tokens)]
            job.queue.append(GenerationRequest(f"{spec.name}:{job.step}:g{g}", prompt, params, adapter=spec.name))
        job.outstanding = spec.prompts_per_step * spec.group_size
        job.tokens = 0

    def schedule() -> None:
        waiting = [j for j in state.values() if j.queue]
        for i, e in enumerate(pool):
            room = cost.max_num_seqs - e.unfinished_samples
            added = False
            while waiting and room > 0:
                job = min(waiting, key=lambda j: (j.served / j.spec.priority, j.spec.name))
                if job.queue[0].params.n > room:
                    break
                req = job.queue.popleft()
                room -= req.params.n
                job.served += req.params.n
                e.add_request(req)
                added = True
                if not job.queue:
                    waiting.remove(job)
            if added or (e.op is None and e.has_unfinished()):
                start(i)

    def start(i: int) -> None:
        e = pool[i]
        if e.op is None and e.has_unfinished():
            e.start_op()
        if e.op is not None:  # a request added mid-op cuts it short: the old end is superseded
            at(e.op.end, lambda: op_done(i), valid=lambda s=e.op_serial: e.op is not None and e.op_serial == s)

    def op_done(i: int) -> None:
        for c in pool[i].finish_op():
            job = state[c.request_id.split(":", 1)[0]]
            job.outstanding -= 1
            job.tokens += len(c.prompt_ids) + len(c.token_ids)
            if job.outstanding == 0:
                if trainers is None:
                    at(clock.now + job.spec.train_s(job.tokens) + serving.adapter_push_s, lambda job=job: trained(job))
                else:
                    train_queue.append(job)
                    dispatch_training()
        start(i)

    train_queue: deque[_Job] = deque()
    free_trainers = [trainers.gpus if trainers is not None else 0]
    trainer_busy = [0.0]

    def dispatch_training() -> None:
        assert trainers is not None
        while free_trainers[0] > 0 and train_queue:
            batch = [train_queue.popleft()]
            tokens = batch[0].tokens
            while train_queue and tokens + train_queue[0].tokens <= trainers.max_batch_tokens:
                tokens += train_queue[0].tokens
                batch.append(train_queue.popleft())
            free_trainers[0] -= 1
            seconds = trainers.step_s(tokens)
            trainer_busy[0] += seconds
            at(clock.now + seconds + serving.adapter_push_s, lambda batch=batch: batch_trained(batch))

    def batch_trained(batch: list[_Job]) -> None:
        free_trainers[0] += 1
        for job in batch:
            trained(job)
        dispatch_training()

    def trained(job: _Job) -> None:
        job.step += 1
        if job.step >= job.spec.steps:
            job.finished_at = clock.now
        else:
            submit_step(job)

    for job in state.values():
        at(job.started_at + job.spec.startup_s, lambda job=job: submit_step(job))
    events.run(schedule)
    start_s = min(j.started_at for j in state.values())
    makespan = max(j.finished_at or 0.0 for j in state.values()) - start_s
    out = {"engines": engines, "makespan_s": makespan, "engine_hours": engines * makespan / 3600,
           "jobs": {n: {"wall_s": (j.finished_at or 0.0) - j.started_at} for n, j in state.items()}}
    if trainers is not None:
        out["trainer_gpus"] = trainers.gpus
        out["trainer_utilisation"] = trainer_busy[0] / (trainers.gpus * makespan) if makespan > 0 else 0.0
    return out


def compare_lora(jobs: list[MuxJob], engines: int, cost: CostModel, serving: AdapterCost = AdapterCost(),
                 seed: int = 0) -> dict[str, Any]:
    """Each job on its own engine (adapter merged) vs all on `engines` shared engines (unmerged, one batch)."""
    dedicated = {j.name: simulate_lora([replace(j, start_s=0.0)], 1, cost, serving, merged=True, seed=seed)
                 for j in jobs}
    shared = simulate_lora(jobs, engines, cost, serving, seed=seed)
    dedicated_hours = sum(d["engine_hours"] for d in dedicated.values())
    slowdowns = sorted(shared["jobs"][n]["wall_s"] / dedicated[n]["makespan_s"] - 1 for n in shared["jobs"])
    return {"jobs": len(jobs), "engines": engines, "dedicated_engine_hours": dedicated_hours,
            "shared_engine_hours": shared["engine_hours"],
            "engine_hours_saved": 1 - shared["engine_hours"] / dedicated_hours,
            "median_slowdown": slowdowns[len(slowdowns) // 2], "max_slowdown": slowdowns[-1]}


def compare_pool(jobs: list[MuxJob], engines: int, cost: CostModel, serving: AdapterCost = AdapterCost(),
                 full_switch: Transitions = FULL_SWITCH, seed: int = 0,
                 dedicated_runs: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The jobs through the pool's scheduler (rollwise.sim.mux) on `engines` shared engines vs one dedicated
    engine each: as LoRA jobs on one base (adapter pushes; unmerged overhead on the shared engines only) and
    as full-parameter jobs (full weight pushes, time-sliced with `full_switch` costs). `dedicated_runs`: a cache
    of the dedicated arms (they do not depend on `engines`), filled on first use."""
    dedicated_runs = {} if dedicated_runs is None else dedicated_runs
    out: dict[str, Any] = {"jobs": len(jobs), "engines": engines}
    for kind in ("lora", "full"):
        lora = kind == "lora"
        specs = [replace(j, base="base" if lora else None,
                         push_s=serving.adapter_push_s if lora else cost.weight_update_s) for j in jobs]
        # (the pool's default policy: a job with work keeps a slot at least 5 s)
        if kind not in dedicated_runs:
            dedicated_runs[kind] = {j.name: simulate_mux([replace(j, start_s=0.0)], 1, cost, Transitions(), seed=seed)
                                    for j in specs}
        dedicated = dedicated_runs[kind]
        shared = simulate_mux(specs, engines, cost, Transitions() if lora else full_switch, seed=seed,
                              engine_slowdown=1.0 + serving.decode_overhead if lora else 1.0)
        dedicated_hours = sum(d["engine_hours"] for d in dedicated.values())
        start = min(j.start_s for j in specs)
        span = max(j.start_s + shared["jobs"][j.name]["wall_s"] for j in specs) - start
        slowdowns = sorted(shared["jobs"][n]["wall_s"] / dedicated[n]["makespan_s"] - 1 for n in dedicated)
        out[kind] = {"dedicated_engine_hours": dedicated_hours, "shared_engine_hours": engines * span / 3600,
                     "engine_hours_saved": 1 - engines * span / 3600 / dedicated_hours,
                     "median_slowdown": slowdowns[len(slowdowns) // 2], "max_slowdown": slowdowns[-1]}
    return out


def projection_jobs(n: int, trainer: TrainerModel, steps: int = 10, seed: int = 0) -> list[MuxJob]:
    """n GRPO LoRA jobs on one 7B base: 8 prompts x 8 samples a step, 512-token prompts, responses of
    ~512 tokens (exponential, at most 2048); launched within the first minute; each trains on one GPU."""
    rng = random.Random(seed)
    return [MuxJob(name=f"job{i:02d}", steps=steps, prompts_per_step=8, group_size=8, prompt_tokens=512,
                   max_tokens=2048, mean_response_tokens=512.0, start_s=rng.uniform(0, 60),
                   train_s=lambda tokens: trainer.step_s(tokens, gpus=1)) for i in range(n)]


def project(cost_name: str = "h100-7b", jobs: int = 64, engine_counts: tuple[int, ...] = (8, 16, 32, 64),
            serving: AdapterCost = AdapterCost(), steps: int = 10, pool: bool = False) -> list[dict[str, Any]]:
    """compare_lora per engine count; pool=True adds compare_pool's two arms (key "pool")."""
    from rollwise.sim.cost import CONFIG_DIR

    cost, trainer = load_cost_file(CONFIG_DIR / f"{cost_name}.yaml")
    if trainer is None:
        raise ValueError(f"cost model {cost_name!r} has no trainer section")
    specs = projection_jobs(jobs, trainer, steps)
    rows = [compare_lora(specs, e, cost, serving) for e in engine_counts]
    if pool:
        dedicated_runs: dict[str, dict[str, Any]] = {}
        for row in rows:
            row["pool"] = compare_pool(specs, row["engines"], cost, serving, dedicated_runs=dedicated_runs)
    return rows


# ---------------------------------------------------------------------------- `rollwise sim lora`


def add_projection_arguments(p: argparse.ArgumentParser) -> None:
    """--cost and --steps, which every projection of LoRA jobs takes (this command's, `rollwise sim service`)."""
    p.add_argument("--cost", default="h100-7b", help="bundled cost model (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="steps per job (default: %(default)s)")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_projection_arguments(p)
    p.add_argument("--jobs", type=int, default=64)
    p.add_argument("--engines", default="8,16,32,64", help="shared engine (GPU) counts (default: %(default)s)")
    p.add_argument("--decode-overhead", type=float, default=AdapterCost.decode_overhead,
                   help="unmerged multi-adapter batch slowdown (default: %(default)s)")
    p.add_argument("--pool", action="store_true",
                   help="also through the pool's scheduler: the jobs as LoRA jobs, and as full-parameter jobs time-sliced")


def _run(args: argparse.Namespace, console: Console) -> int:
    engines = tuple(int(x) for x in args.engines.split(","))
    rows = project(args.cost, args.jobs, engines, AdapterCost(decode_overhead=args.decode_overhead), args.steps,
                   pool=args.pool)
    table = Table(title=f"{args.jobs} LoRA jobs on one base ({args.cost}): shared engines vs one dedicated engine each")
    for col in ("engines", "engine-h dedicated", "engine-h shared", "saved", "median slowdown", "max slowdown"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["engines"]), f"{r['dedicated_engine_hours']:.2f}", f"{r['shared_engine_hours']:.2f}",
                      f"{r['engine_hours_saved']:.0%}", f"{r['median_slowdown']:+.0%}", f"{r['max_slowdown']:+.0%}")
    console.print(table)
    if args.pool:
        console.print(_pool_table(rows, args))
    write_json(args.json, rows, console)
    return 0


def _pool_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> Table:
    table = Table(title=f"the same {args.jobs} jobs through the pool's scheduler: LoRA (one batch) vs full-parameter "
                        "(time-sliced)")
    for col in ("engines", "LoRA saved", "LoRA median / max slowdown", "full saved", "full median / max slowdown"):
        table.add_column(col, justify="right")
    for r in rows:
        lora, full = r["pool"]["lora"], r["pool"]["full"]
        table.add_row(str(r["engines"]), f"{lora['engine_hours_saved']:.0%}",
                      f"{lora['median_slowdown']:+.0%} / {lora['max_slowdown']:+.0%}",
                      f"{full['engine_hours_saved']:.0%}",
                      f"{full['median_slowdown']:+.0%} / {full['max_slowdown']:+.0%}")
    return table


def command() -> SimCommand:
    return SimCommand("lora", "project N LoRA jobs sharing engines vs dedicated engines (issue 22)",
                      _add_arguments, _run)

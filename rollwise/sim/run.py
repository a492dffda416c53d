"""Run a scenario: the production RolloutController (unchanged) drives a SimCluster in virtual time.

The loop is the one `rollwise bench rollout` runs on a real engine (bench/rollout.py: next_batch,
before_update, train, mark_trained, push weights, after_update); only the trainer's step is a
modelled duration here, during which the engines keep generating.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollwise.config import RunConfig
from rollwise.observe.bubble import busy_integral
from rollwise.reward.batch import Unscored
from rollwise.rollout.controller import LengthFn, RolloutController
from rollwise.router.policies import make_policy
from rollwise.sim.cluster import SimCluster
from rollwise.sim.cost import CostModel, TrainerModel
from rollwise.sim.engine import SimEngine, VirtualClock
from rollwise.sim.scenario import LengthModel, Scenario
from rollwise.types.task import Problem
from rollwise.types.compact import version_runs


class _NullTokenizer:
    """The controller decodes responses for logging and scoring; simulated tokens mean nothing."""

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""


class SimEncoder:
    """Synthetic prompts: a shared prefix (system prompt, few-shot examples) + per-problem tokens."""

    def __init__(self, prompt_tokens: int, shared_prefix_tokens: int, vocab: int = 32000) -> None:
        shared = min(shared_prefix_tokens, prompt_tokens - 1)
        self.shared = [3 + (7919 * i) % (vocab - 3) for i in range(shared)]
        self.own = prompt_tokens - shared
        self.vocab = vocab
        self.tokenizer = _NullTokenizer()

    def __call__(self, problem: Problem, with_few_shot: bool = False) -> list[int]:
        # Two leading tokens encode the problem number uniquely (no false prefix-cache hits), then a run.
        k, v = int(problem.id[1:]), self.vocab - 3
        head = [3 + k % v, 3 + (k // v) % v][: self.own]
        start = 3 + (k * 104729) % (v - self.own)
        return self.shared + head + list(range(start, start + self.own - len(head)))


class _LazyBatch:
    def __init__(self, start: int) -> None:
        self.start = start

    def __getitem__(self, slot: int) -> Problem:
        return Problem(id=f"p{self.start + slot}", question="", answer="")


class SimStream:
    """ProblemStream's interface in O(1) per problem (the real one builds the whole step's list)."""

    def batch(self, step: int, size: int) -> _LazyBatch:
        return _LazyBatch(step * size)


def run_config(s: Scenario, prompts_per_step: int) -> RunConfig:
    eta = s.rollout.max_staleness
    w = s.workload
    return RunConfig.model_validate({
        "model": "sim", "seed": s.seed,
        "task": {"kind": "reasoning_gym", "name": "basic_arithmetic"},  # never loaded: SimStream serves problems
        # The simulated engines are sized by the cost model (rollwise.sim.cost); this section only has to admit
        # the workload's requests (RunConfig refuses a group or a budget that cannot fit its engine).
        "engine": {"max_num_seqs": max(64, w.group_size), "max_model_len": max(1024, w.prompt_tokens + w.output.max_tokens + 1)},
        "rollout": {"mode": s.rollout.mode, "prompts_per_step": prompts_per_step,
                    "group_size": s.workload.group_size, "max_tokens": s.workload.output.max_tokens,
                    "max_staleness": eta, "partial_rollout": s.rollout.partial_rollout,
                    "oversubscription": s.rollout.oversubscription or eta + 1.0,
                    "update_batch": s.rollout.update_batch, "max_batch_factor": s.rollout.max_batch_factor},
    })


@dataclass
class SimRun:
    scenario: Scenario
    cost: CostModel
    trainer: TrainerModel
    cluster: SimCluster
    controller: RolloutController
    clock: VirtualClock


def build(s: Scenario, *, cost: CostModel | None = None, trainer: TrainerModel | None = None,
          prompts_per_step: int | None = None, length_fn: LengthFn | None = None, encoder: Any = None,
          stream: Any = None, cfg: RunConfig | None = None, vocab_size: int = 32000, eos_token_id: int = 2) -> SimRun:
    """The scenario's cluster and the production controller. Validation passes the real benchmark's
    encoder, problem stream, config and forced lengths, so the controller sees exactly its inputs."""
    if cost is None or trainer is None:
        file_cost, file_trainer = s.cost()
        cost, trainer = cost or file_cost, trainer or file_trainer
    clock = VirtualClock()
    lengths = LengthModel(s.workload.output, s.seed, s.base_dir)
    engines = [SimEngine(cost, clock=clock, length_sampler=lengths.for_request, seed=s.seed * 7919 + i,
                         engine_id=f"e{i:05d}", cache_history=s.sessions.count > 0, vocab_size=vocab_size,
                         eos_token_id=eos_token_id)
               for i in range(s.engines(cost))]
    policy = make_policy(s.cluster.routing)
    cluster = SimCluster(engines, clock, policy, shard_size=s.cluster.shard_size)
    cfg = cfg or run_config(s, prompts_per_step or s.workload.prompts_per_step)
    if length_fn is None and s.workload.force_lengths:
        length_fn = lambda g, i: min(lengths.draw(g * 1009 + i), s.workload.output.max_tokens)  # noqa: E731
    encoder = encoder or SimEncoder(s.workload.prompt_tokens, s.workload.shared_prefix_tokens, vocab_size)
    controller = RolloutController(cfg, cluster, encoder, stream or SimStream(),  # type: ignore[arg-type]
                                   Unscored(), length_fn=length_fn)
    controller.pump_in_background = False  # virtual time: simulate() pumps at every engine event instead
    return SimRun(s, cost, trainer, cluster, controller, clock)


def simulate(run: SimRun, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The benchmark loop in virtual time. Returns the DESIGN.md metrics."""
    s, cost, trainer, cluster, controller, clock = (run.scenario, run.cost, run.trainer, run.cluster,
                                                    run.controller, run.clock)
    wall0 = time.perf_counter()
    t0 = clock.now
    version = 0
    staleness_sum = staleness_n = staleness_max = 0
    trained_tokens = trained_samples = 0
    rollout_phases: list[tuple[float, float]] = []
    updates_at: list[float] = []
    per_step: list[dict[str, Any]] = []
    for step in range(s.workload.updates):
        ta = clock.now
        batch = controller.next_batch()
        rollout_phases.append((ta, clock.now))
        step_max = 0
        for sample in batch:
            for v, k in version_runs(sample.versions):
                staleness_sum += (version - v) * k
                staleness_n += k
                step_max = max(step_max, version - v)
        staleness_max = max(staleness_max, step_max)
        if step_max > controller.eta:  # the bound every policy must keep (DESIGN.md invariant 2)
            raise RuntimeError(f"update {step}: a trained token has staleness {step_max} > eta={controller.eta}")
        controller.before_update()
        tokens = round(trainer.batch_tokens(batch, controller.cfg.train) * s.workload.trainer_work)
        t_train = clock.now
        pump = (lambda: _pump_queued(cluster, controller)) if controller.pumps_while_training else None
        train_through_contention(cluster, clock, trainer.step_s(tokens, s.trainer_gpus()), trainer, cost, pump)
        train_s = clock.now - t_train
        controller.mark_trained(batch)
        trained_tokens += sum(len(x.response_ids) for x in batch)
        trained_samples += len(batch)
        version += 1
        cluster.advance_to(cluster.load_version(version))
        controller.after_update(version)
        updates_at.append(clock.now)
        per_step.append({"step": step, "t": clock.now - t0, "rollout_s": rollout_phases[-1][1] - ta,
                         "train_s": train_s, "train_tokens": tokens, "groups": len(batch) // controller.group_size,
                         "staleness_max": step_max})
        if progress is not None:
            progress(f"update {step + 1}/{s.workload.updates} at t={clock.now - t0:.1f}s (virtual)")
    t1 = clock.now
    waste = controller.ledger.waste()
    controller.close("simulation over")
    engines = cluster.engines
    wall = t1 - t0
    capacity = sum(e.max_num_seqs for e in engines)
    busy = sum(busy_integral(e.timeline, t0, t1) for e in engines)
    rollout_time = sum(b - a for a, b in rollout_phases)
    busy_rollout = sum(busy_integral(e.timeline, a, b) for e in engines for a, b in rollout_phases)
    prompt = sum(e.stats["prompt_tokens"] for e in engines)
    cached = sum(e.stats["cached_prompt_tokens"] for e in engines)
    n_eng = len(engines)
    return {
        "scenario": s.name, "mode": s.rollout.mode, "routing": s.cluster.routing, "gpus": s.cluster.gpus,
        "update_batch": s.rollout.update_batch if s.rollout.mode != "sync" else "fixed", "eta": s.rollout.max_staleness,
        "trainer_gpus": s.trainer_gpus(), "engines": n_eng, "capacity": capacity, "cost_model": cost.name,
        "prompts_per_step": controller.batch_groups, "group_size": controller.group_size,
        "updates": len(per_step),
        "virtual_s": wall,
        "bubble_ratio": 1 - busy / (capacity * wall) if wall > 0 else 0.0,
        "bubble_ratio_rollout": 1 - busy_rollout / (capacity * rollout_time) if rollout_time > 0 else 0.0,
        "samples_per_s": trained_samples / wall if wall > 0 else 0.0,
        "trained_tokens_per_s": trained_tokens / wall if wall > 0 else 0.0,
        "rollout_tokens_per_s": sum(e.stats["generated_tokens"] for e in engines) / wall if wall > 0 else 0.0,
        "trained_samples": trained_samples,
        # Below the workload's mean length when the staleness bound regenerates long samples (fresh draws come
        # back shorter) or the run ends before they finish (sorted trains short groups first): skewed short.
        "trained_response_mean": trained_tokens / trained_samples if trained_samples else 0.0,
        "samples_per_s_per_gpu": trained_samples / wall / (n_eng * cost.gpus_per_engine + s.trainer_gpus()) if wall > 0 else 0.0,
        "staleness_mean": staleness_sum / staleness_n if staleness_n else 0.0,
        "staleness_max": staleness_max,
        **waste,
        "prefix_hit_rate": cached / prompt if prompt else 0.0,
        "engine_hours": n_eng * cost.gpus_per_engine * wall / 3600,
        "gpu_hours_total": (n_eng * cost.gpus_per_engine + s.trainer_gpus()) * wall / 3600,
        "sim_wall_s": time.perf_counter() - wall0,
        "per_step": per_step,
        "_updates": [t - t0 for t in updates_at],
        "_t0": t0, "_t1": t1,
    }


def train_through_contention(cluster: SimCluster, clock: VirtualClock, work_s: float, trainer: TrainerModel,
                             cost: CostModel, pump: Callable[[], int] | None = None) -> None:
    """Let one train step of `work_s` uncontended seconds run. Where trainer and engines share cores
    (calibrated on this machine), the trainer runs slower while an engine step runs and at full speed once
    the engines are idle, and each engine's steps run slower while the trainer trains; both slowdowns
    depend on the engine's running batch (cost.engine_contention, train_slowdown: derived from the shared
    cores where the cost file sets `shared_cores`, else the calibrated tables). The batch only
    changes at engine events, so the rates are set afresh at each. (Charging the whole step at the
    full-batch contention whenever an engine had work at its start made overlapped modes look no faster
    than sync: 20-28% off against bench rollout.)

    `pump` (flexible update batch): the controller's pump, run at every engine event while the trainer
    trains, as its pump thread does on real engines."""
    if pump is not None and _no_contention(cost, trainer):  # separate devices: only the pump needs events
        end = clock.now + work_s
        while clock.now < end:
            cluster.advance_to(end, stop_on_completion=True)
            if cluster.completions:
                pump()
        return
    while work_s > 1e-9:
        if pump is not None and cluster.completions:
            pump()
        busy = [e for e in cluster.engines if e.busy()]  # an engine step (or weight load) is running
        for i, e in enumerate(cluster.engines):
            cluster.set_engine_slowdown(i, cost.engine_contention(e.num_running))
        if not busy:
            cluster.advance_to(clock.now + work_s)
            break
        rate = 1.0 / train_slowdown(cost, trainer, max(e.num_running for e in busy))
        t = clock.now
        until = t + work_s / rate
        nxt = cluster.next_event_time()
        if nxt is not None and nxt < until:
            until = max(nxt, t)
        cluster.advance_to(until)
        work_s -= (clock.now - t) * rate
    cluster.set_slowdown(1.0)


def _pump_queued(cluster: SimCluster, controller: RolloutController) -> int:
    """The controller's pump on what the engines finished by now (no poll moves virtual time)."""
    cluster.queued_only = True
    try:
        return controller.pump()
    finally:
        cluster.queued_only = False


def train_slowdown(cost: CostModel, trainer: TrainerModel, engine_batch: int) -> float:
    """The train step's slowdown while an engine step of `engine_batch` sequences runs: derived from the
    shared cores where the cost file sets them (cost.shared_cores), else the calibrated table."""
    if cost.shared_cores > 0:
        return cost.overlap_slowdowns(engine_batch)[1]
    return trainer.contention_at(engine_batch)


def _no_contention(cost: CostModel, trainer: TrainerModel) -> bool:
    """Trainer and engines on separate devices (or cores enough for both): neither slows the other."""
    if cost.shared_cores > 0:  # the derived model replaces the calibrated tables
        return not cost.shares_cores
    return (cost.train_contention == 1.0 and not cost.train_contention_by_batch
            and trainer.contention == 1.0 and not trainer.contention_by_batch)


def cluster_timeline(engines: list[SimEngine], t0: float, t1: float, max_points: int = 4000) -> list[tuple[float, int]]:
    """Running sequences summed over engines (a step function), thinned for plotting."""
    deltas: list[tuple[float, int]] = []
    for e in engines:
        prev = 0
        for t, n in e.timeline:
            if n != prev:
                deltas.append((t, n - prev))
                prev = n
    deltas.sort()
    out, total = [], 0
    for i, (t, d) in enumerate(deltas):
        total += d
        last_at_t = i + 1 == len(deltas) or deltas[i + 1][0] != t  # one point per instant, after all its changes
        if last_at_t and t0 <= t <= t1:
            out.append((t - t0, total))
    if len(out) > max_points:
        stride = math.ceil(len(out) / max_points)
        out = out[::stride]
    return out

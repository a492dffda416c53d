"""The placement planner (issue 26): split a cluster's GPUs between trainer ranks and engine replicas,
and choose the staleness bound eta, to maximise trained samples/s.

Why a split matters more than the scheduler: at eta versions of staleness, engines can run at most eta
train steps ahead of the trainer. If a train step takes longer than generating the next batch, the
engines wait whatever the admission policy does; if generation takes longer, the trainer waits. So the
planner first balances the two from the cost model (a closed form, below), then simulates the few
splits around that balance point, at each eta asked for, with the production controller and the
flexible update batch (one or two more past the edge when the best is the smallest or largest
trainer tried), and ranks them by trained samples/s. Staleness never exceeds eta in any of
them (the simulator raises if it would).

Closed form (the screen): one engine at its full batch B emits B tokens per decode step, so it finishes
B / (mean output tokens x step_s) samples/s; the trainer trains one sample's (prompt + output) tokens in
s_per_token_gpu x tokens / T seconds on T GPUs. Balanced: E x engine rate = T x trainer rate per GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rollwise.sim.cost import CostModel, TrainerModel
from rollwise.sim.run import build, simulate
from rollwise.sim.scenario import LengthModel, Scenario


@dataclass(frozen=True)
class Split:
    trainer_gpus: int
    engine_gpus: int  # a multiple of the cost model's gpus_per_engine
    eta: int


@dataclass
class PlanRow:
    split: Split
    samples_per_s: float
    samples_per_s_per_gpu: float
    bubble_ratio: float
    staleness_max: int
    samples_regenerated: int  # every regeneration, aborts of requests still queued (no cost) included
    samples_regenerated_after_sampling: int  # those that had sampled tokens: the ones that cost engine time
    tokens_discarded: int
    generated_tokens: int
    trained_samples: int
    trained_response_mean: float  # tokens per trained response
    response_mean: float  # the workload's own mean response length (capped): what unbiased sampling trains

    @property
    def length_bias(self) -> float:
        """Trained responses against the workload's, -0.33: a third shorter. Regenerating what went stale draws
        afresh, and long samples are the ones that go stale, so a tight eta trains a distribution skewed short;
        sorted batches train short groups first, so what still runs when a run ends is long (a short run's share)."""
        return self.trained_response_mean / self.response_mean - 1 if self.response_mean else 0.0

    @property
    def wasted_token_share(self) -> float:
        """Of the tokens the engines generated, the share thrown away (sampled, then regenerated)."""
        return self.tokens_discarded / self.generated_tokens if self.generated_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self.split), **{k: v for k, v in asdict(self).items() if k != "split"},
                "wasted_token_share": self.wasted_token_share, "length_bias": self.length_bias}


def mean_output_tokens(s: Scenario, draws: int = 4000) -> float:
    """The workload's mean sample length under its cap (the same seeded draws the simulator uses)."""
    lengths = LengthModel(s.workload.output, s.seed, s.base_dir)
    cap = s.workload.output.max_tokens
    return sum(min(lengths.draw(k), cap) for k in range(draws)) / draws


def balanced_trainer_share(s: Scenario, cost: CostModel, trainer: TrainerModel) -> float:
    """The share of GPUs for the trainer at which it trains samples as fast as the engines finish them."""
    out = mean_output_tokens(s)
    batch = cost.max_num_seqs
    context = batch * (s.workload.prompt_tokens + out / 2)  # half-way through the average sample
    engine_per_gpu = batch / (out * cost.decode_s(batch, context)) / cost.gpus_per_engine
    # a recipe's trainer work scales the trainer's seconds per sample (workload.trainer_work, as the simulator does)
    per_sample_s = trainer.s_per_token_gpu * (s.workload.prompt_tokens + out) * s.workload.trainer_work
    trainer_per_gpu = 1.0 / per_sample_s if per_sample_s else float("inf")
    return engine_per_gpu / (engine_per_gpu + trainer_per_gpu)


def candidate_splits(total_gpus: int, share: float, gpus_per_engine: int, etas: list[int],
                     spread: tuple[float, ...] = (0.8, 0.9, 1.0, 1.1, 1.25)) -> list[Split]:
    """Splits around the balance point (trainer share x spread), each at every eta; at least one
    trainer GPU and one engine."""
    if total_gpus < 1 + gpus_per_engine:
        raise ValueError(f"--gpus {total_gpus}: a plan needs at least one trainer GPU and one engine "
                         f"({gpus_per_engine} GPUs); ask for more GPUs")
    seen: dict[int, None] = {}
    for f in spread:
        trainer = min(max(1, round(total_gpus * share * f)), total_gpus - gpus_per_engine)
        engines = (total_gpus - trainer) // gpus_per_engine
        seen[total_gpus - engines * gpus_per_engine] = None  # GPUs left over from whole engines go to the trainer
    return [Split(t, total_gpus - t, eta) for t in seen for eta in etas]


def scenario_for(base: Scenario, split: Split, mode: str = "sorted", update_batch: str = "flexible") -> Scenario:
    """The base scenario on this split: engine GPUs as the cluster's rollout GPUs, trainer GPUs explicit."""
    data = base.model_dump(exclude={"base_dir"})
    data["cluster"].update(gpus=split.engine_gpus, trainer_gpus=split.trainer_gpus)
    data["rollout"].update(mode=mode, max_staleness=split.eta, update_batch=update_batch)
    if update_batch == "flexible" and base.rollout.oversubscription is None:
        # Running samples up to 2 batches (the batch sized to the slots): whole groups queue on one engine
        # while another has free slots, and long contexts fill the KV cache before the slots; with 1.0-1.25
        # batches engines idled at 256 GPUs (bubble 0.21-0.37; 0.09-0.16 with 2; docs/benchmarks.md).
        data["rollout"]["oversubscription"] = 2.0
    s = Scenario.model_validate(data)
    s.base_dir = base.base_dir
    return s


def evaluate(base: Scenario, split: Split, mode: str = "sorted", update_batch: str = "flexible") -> PlanRow:
    r = simulate(build(scenario_for(base, split, mode, update_batch)))
    gpus = split.trainer_gpus + split.engine_gpus
    return PlanRow(split, r["samples_per_s"], r["samples_per_s"] / gpus, r["bubble_ratio"], r["staleness_max"],
                   r["samples_regenerated"], r["samples_regenerated_after_sampling"], r["tokens_discarded"],
                   round(r["rollout_tokens_per_s"] * r["virtual_s"]), r["trained_samples"],
                   r["trained_response_mean"], mean_output_tokens(base))


@dataclass
class Plan:
    total_gpus: int
    trainer_share_balanced: float
    rows: list[PlanRow]  # best first
    sync: PlanRow  # sync at the chosen split: the baseline at the same GPU count
    bubble_target: float
    gpus_per_engine: int = 1

    @property
    def best(self) -> PlanRow:
        return self.rows[0]

    def as_dict(self) -> dict[str, Any]:
        b = self.best
        return {"total_gpus": self.total_gpus, "trainer_share_balanced": self.trainer_share_balanced,
                "bubble_target": self.bubble_target,
                "choice": {"trainer_gpus": b.split.trainer_gpus, "engine_gpus": b.split.engine_gpus,
                           "gpus_per_engine": self.gpus_per_engine,
                           "engine_replicas": b.split.engine_gpus // self.gpus_per_engine,
                           "max_staleness": b.split.eta, "update_batch": "flexible"},
                "rows": [r.as_dict() for r in self.rows], "sync": self.sync.as_dict(),
                "speedup_per_gpu_vs_sync": b.samples_per_s_per_gpu / self.sync.samples_per_s_per_gpu
                if self.sync.samples_per_s_per_gpu else None}


def rank(rows: list[PlanRow], bubble_target: float) -> list[PlanRow]:
    """Most trained samples/s first; a split whose bubble ratio is within the target before one that is not."""
    return sorted(rows, key=lambda r: (r.bubble_ratio > bubble_target, -r.samples_per_s))


def _extend_at_the_edge(base: Scenario, total_gpus: int, gpus_per_engine: int, rows: list[PlanRow],
                        bubble_target: float, progress: Any, steps: int = 2) -> list[PlanRow]:
    """The closed form is only a screen: where the best split is the smallest (largest) trainer tried,
    try a smaller (larger) one at its eta, up to `steps` times, until the best is inside the range."""
    rows, added = list(rows), []
    for _ in range(steps):
        best = rank(rows, bubble_target)[0]
        trainers = sorted({r.split.trainer_gpus for r in rows})
        t = best.split.trainer_gpus
        if t == trainers[0] and t > 1:
            t = max(1, round(t * 0.85))
        elif t == trainers[-1] and t < total_gpus - gpus_per_engine:
            t = min(total_gpus - gpus_per_engine, round(t * 1.15))
        else:
            break
        t = total_gpus - (total_gpus - t) // gpus_per_engine * gpus_per_engine  # whole engines
        if t in trainers:
            break
        added.append(evaluate(base, Split(t, total_gpus - t, best.split.eta)))
        rows.append(added[-1])
        if progress is not None:
            progress(f"trainer {t} / engines {total_gpus - t} GPUs, eta {best.split.eta}: "
                     f"{added[-1].samples_per_s:.1f} samples/s, bubble {added[-1].bubble_ratio:.2f} (past the edge)")
    return added


def plan(base: Scenario, total_gpus: int, etas: list[int], bubble_target: float = 0.25,
         progress: Any = None) -> Plan:
    cost, trainer = base.cost()
    share = balanced_trainer_share(base, cost, trainer)
    rows = []
    for split in candidate_splits(total_gpus, share, cost.gpus_per_engine, etas):
        rows.append(evaluate(base, split))
        if progress is not None:
            r = rows[-1]
            progress(f"trainer {split.trainer_gpus} / engines {split.engine_gpus} GPUs, eta {split.eta}: "
                     f"{r.samples_per_s:.1f} samples/s, bubble {r.bubble_ratio:.2f}")
    rows += _extend_at_the_edge(base, total_gpus, cost.gpus_per_engine, rows, bubble_target, progress)
    ranked = rank(rows, bubble_target)
    sync = evaluate(base, Split(ranked[0].split.trainer_gpus, ranked[0].split.engine_gpus, 0), mode="sync",
                    update_batch="fixed")
    return Plan(total_gpus, share, ranked, sync, bubble_target, cost.gpus_per_engine)

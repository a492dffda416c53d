"""What `rollwise bench algorithms`' step-time ratios to GRPO become when rollouts run on GPUs (issue 41): the
recipes' trainer work is measured here, its cost in a step is projected with the cluster simulator.

Why a projection: on this 2-core CPU the trainer is over half of GRPO's step (train 6 of 11 s) and every phase runs
at the same matmul rate, so a recipe that trains more tokens or adds a reference forward costs its FLOPs' ratio
(REINFORCE++: every sample has an advantage, where GRPO skips zero-variance groups, plus the reference's forward).
On GPUs generation is most of a step, and the same extra trainer work is a smaller share of it.

Measured (means over the seeds in the bench's JSON), per recipe r:
- GRPO's trained fraction f: the share of the batch's samples its update trains;
- r's train-phase seconds over GRPO's, t_r / t_grpo (the same trainer at the same matmul rate: their work's ratio).
So r's trainer work relative to one update over the whole batch is f x t_r / t_grpo (GRPO's: f): the scenario's
`workload.trainer_work`. Projected: each recipe's seconds per update in the bundled GPU scenario
(rollwise/sim/configs/scenarios/grpo-7b.yaml: a 7B model on H100s, 256 prompts x 16, long-tailed outputs), on its
96 GPUs (64 rollout + 32 trainer), in three ways:
- `sync`: the scenario's split, synchronous rollout (as the bench runs here);
- `sorted`: the scenario's split, rollwise's GPU mode (staleness 1: the engines generate the next batch while the
  trainer trains);
- `planned`: each recipe on its fastest split at the same 96 GPUs among those `rollwise sim plan` tries
  (staleness 1, the flexible update batch): what a user does with a recipe whose trainer work differs (`placement:
  ray` takes the plan). The planner tries a handful of splits around its closed-form balance point, each simulated
  for a few updates: its choice moves in steps of a few GPUs, so ratios within ~5% of each other are not different.
"""

from __future__ import annotations

from typing import Any

from rollwise.sim.cost import CONFIG_DIR
from rollwise.sim.plan import plan
from rollwise.sim.run import build, simulate
from rollwise.sim.scenario import Scenario, load_scenario

SCENARIO = CONFIG_DIR / "scenarios" / "grpo-7b.yaml"
MODES = ("sync", "sorted", "planned")
# sync / sorted: the mean interval between updates, the first (which includes the first rollout's ramp-up) left out;
# planned: the planner's samples/s over the whole simulated run, ramp-up included (the same for every recipe)
UPDATES = 4


def trainer_work(recipes: dict[str, dict[str, Any]], baseline: str) -> dict[str, float]:
    """Each recipe's trainer work per update relative to one policy update over the whole batch (module doc);
    empty when the baseline's trained fraction or train time was not measured."""
    base = recipes.get(baseline, {})
    fraction, base_train = base.get("trained_fraction"), base.get("train_s")
    if not fraction or not base_train:
        return {}
    return {name: fraction * r["train_s"] / base_train for name, r in recipes.items() if r.get("train_s")}


def scenario(work: float, overrides: dict[str, Any] | None = None) -> Scenario:
    """The projection's scenario at one recipe's trainer work (`overrides`: dotted keys, e.g. a smaller cluster)."""
    return load_scenario(SCENARIO, {"workload.updates": UPDATES, **(overrides or {}), "workload.trainer_work": work})


def seconds_per_update(s: Scenario, mode: str) -> tuple[float, str]:
    """Seconds per trained batch of the scenario's size, and the split it ran on (trainer / engine GPUs)."""
    gpus = s.cluster.gpus + s.trainer_gpus()
    if mode == "planned":
        # the fastest split, whatever its engines' bubble (the planner's default prefers a small bubble over speed)
        best = plan(s, gpus, etas=[1], bubble_target=1.0).best
        split = f"{best.split.trainer_gpus} / {best.split.engine_gpus}"
        return s.workload.prompts_per_step * s.workload.group_size / best.samples_per_s, split
    run = simulate(build(s.model_copy(update={"rollout": s.rollout.model_copy(update={"mode": mode})})))
    times = run["_updates"]
    return (times[-1] - times[0]) / (len(times) - 1), f"{s.trainer_gpus()} / {s.cluster.gpus}"


def project(recipes: dict[str, dict[str, Any]], baseline: str,
            overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per mode, each recipe's projected seconds per update, its ratio to the baseline's and its split; {} when
    the inputs were not measured."""
    work = trainer_work(recipes, baseline)
    if not work:
        return {}
    out: dict[str, Any] = {"scenario": SCENARIO.relative_to(CONFIG_DIR.parents[2]).as_posix(),
                           "overrides": overrides or {}, "trainer_work": work, "modes": {}}
    for mode in MODES:
        rows = {name: seconds_per_update(scenario(w, overrides), mode) for name, w in work.items()}
        out["modes"][mode] = {name: {"s_per_update": s, "ratio_vs_baseline": s / rows[baseline][0],
                                     "trainer_engine_gpus": split} for name, (s, split) in rows.items()}
    return out

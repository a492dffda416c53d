"""What `rollwise bench algorithms`' step-time ratios to GRPO become when rollouts run on GPUs (issue 41): the
recipes' trainer work is measured here, its cost in a step is projected with the cluster simulator.

Why a projection: on this 2-core CPU the trainer is over half of GRPO's step (train 6 of 11 s) and every phase runs
at the same matmul rate, so a recipe that trains more tokens or adds a reference forward costs its FLOPs' ratio
(REINFORCE++: every sample has an advantage, where GRPO skips zero-variance groups, plus the reference's forward).
On GPUs generation is most of a step, and with rollwise's GPU rollout mode (`sorted`, staleness 1) the trainer's
GPUs train beside the engines: the same extra trainer work is a smaller share of the step, or hidden behind it.

Measured (means over the seeds in the bench's JSON), per recipe r:
- GRPO's trained fraction f: the share of the batch's samples its update trains;
- r's train-phase seconds over GRPO's, t_r / t_grpo (the same trainer at the same matmul rate: their work's ratio).
So r's trainer work relative to one update over the whole batch is f x t_r / t_grpo (GRPO's: f): the scenario's
`workload.trainer_work`. Projected: each recipe's seconds per update in the bundled GPU scenario
(rollwise/sim/configs/scenarios/grpo-7b.yaml: a 7B model on 64 H100 rollout GPUs, long-tailed outputs), in the
synchronous mode the bench runs here and in the `sorted` mode rollwise runs on GPUs; the ratio to GRPO's.
"""

from __future__ import annotations

import statistics
from typing import Any

from rollwise.sim.cost import CONFIG_DIR
from rollwise.sim.run import build, simulate
from rollwise.sim.scenario import load_scenario

SCENARIO = CONFIG_DIR / "scenarios" / "grpo-7b.yaml"
MODES = ("sync", "sorted")
UPDATES = 4  # the first update's interval includes the first rollout's ramp-up: the mean is over the others


def trainer_work(recipes: dict[str, dict[str, Any]], baseline: str) -> dict[str, float]:
    """Each recipe's trainer work per update relative to one policy update over the whole batch (module doc);
    empty when the baseline's trained fraction or train time was not measured."""
    base = recipes.get(baseline, {})
    fraction, base_train = base.get("trained_fraction"), base.get("train_s")
    if not fraction or not base_train:
        return {}
    return {name: fraction * r["train_s"] / base_train for name, r in recipes.items() if r.get("train_s")}


def seconds_per_update(work: float, mode: str, updates: int = UPDATES) -> float:
    """The scenario's mean seconds between trainer updates (after the first) at this trainer work and mode."""
    scenario = load_scenario(SCENARIO, {"workload.trainer_work": work, "rollout.mode": mode,
                                        "workload.updates": updates})
    times = simulate(build(scenario))["_updates"]
    return statistics.mean(b - a for a, b in zip(times, times[1:]))


def project(recipes: dict[str, dict[str, Any]], baseline: str, updates: int = UPDATES) -> dict[str, Any]:
    """Per mode, each recipe's projected seconds per update and its ratio to the baseline's; {} without inputs."""
    work = trainer_work(recipes, baseline)
    if not work:
        return {}
    out: dict[str, Any] = {"scenario": str(SCENARIO.relative_to(CONFIG_DIR.parent.parent.parent)),
                           "trainer_work": work, "modes": {}}
    for mode in MODES:
        seconds = {name: seconds_per_update(w, mode, updates) for name, w in work.items()}
        out["modes"][mode] = {name: {"s_per_update": s, "ratio_vs_baseline": s / seconds[baseline]}
                              for name, s in seconds.items()}
    return out

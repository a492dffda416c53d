"""Issue 26: the admission / flexible-update-batch policy (pure rules, run by the production controller in
the simulator), the staleness bound the simulator enforces, and the placement planner."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollwise.types.ray_config import RayConfig
from rollwise.rollout.admission import AdmissionPolicy, RolloutCounts, batch_size, may_admit
from rollwise.sim.cli import main as sim_main
from rollwise.sim.plan import Split, candidate_splits, evaluate, plan, scenario_for
from rollwise.sim.run import build, simulate
from rollwise.sim.scenario import Scenario

SCENARIOS = Path(__file__).parent.parent / "rollwise" / "sim" / "configs" / "scenarios"


def _scenario(**rollout) -> Scenario:
    """8 engine GPUs of 16 slots, a trainer of 4 GPUs: small enough for a second per run."""
    s = Scenario.model_validate({
        "name": "t", "seed": 1,
        "cluster": {"gpus": 8, "cost": "h100-7b", "max_num_seqs": 16, "trainer_gpus": 4},
        "workload": {"updates": 5, "prompts_per_step": 8, "group_size": 8, "prompt_tokens": 64,
                     "output": {"median": 200, "sigma": 1.0, "max_tokens": 2048}},
        "rollout": {"mode": "sorted", "max_staleness": 1, **rollout},
    })
    s.base_dir = SCENARIOS
    return s


def _slow_trainer(s: Scenario) -> Scenario:
    s.cluster.trainer_gpus = 1
    return s


# ---------------------------------------------------------------- the pure rules


def test_fixed_policy_keeps_the_original_rules():
    p = AdmissionPolicy("sorted", eta=1, batch_groups=4, oversubscription=2.0, group_size=8)
    assert p.max_batch_groups == 4 and batch_size(p, ready=7) == 4
    # Groups started and not trained, the batch in training included, capped at 2 x 4.
    assert may_admit(p, RolloutCounts(generating=3, ready=0, training=4), 10, updates=0)
    assert not may_admit(p, RolloutCounts(generating=4, ready=0, training=4), 10, updates=0)
    # async: at most eta versions ahead of the trainer.
    a = AdmissionPolicy("async", eta=1, batch_groups=4, oversubscription=10.0)
    assert may_admit(a, RolloutCounts(0, 0, 0), group_index=7, updates=0)
    assert not may_admit(a, RolloutCounts(0, 0, 0), group_index=8, updates=0)
    assert not may_admit(AdmissionPolicy("sync", 1, 4, 2.0), RolloutCounts(0, 0, 0), 0, 0)


def test_flexible_policy_admits_by_running_samples_and_takes_every_complete_group():
    p = AdmissionPolicy("sorted", eta=1, batch_groups=4, oversubscription=1.0, group_size=8,
                        update_batch="flexible", max_batch_factor=2.0)
    assert batch_size(p, ready=7) == 7 and batch_size(p, ready=20) == 8  # up to 2 x prompts_per_step
    # 12 groups in their long tails hold 10 slots of 32: more may start (the fixed rule would refuse).
    tails = RolloutCounts(generating=12, ready=0, training=4, running_samples=10)
    assert may_admit(p, tails, 30, updates=0)
    assert not may_admit(AdmissionPolicy("sorted", 1, 4, 1.0, 8), tails, 30, updates=0)
    assert not may_admit(p, RolloutCounts(generating=4, ready=0, training=0, running_samples=32), 30, 0)
    # Complete groups beyond what eta more updates can train: stop (the trainer is the bottleneck).
    assert not may_admit(p, RolloutCounts(generating=0, ready=8, training=8, running_samples=0), 30, 0)


def test_config_names_the_field_for_a_bad_update_batch():
    from rollwise.config import RunConfig

    with pytest.raises(ValueError, match="update_batch"):
        RunConfig.model_validate({"rollout": {"update_batch": "elastic"}})


# ---------------------------------------------------------------- in the simulator


def test_flexible_batch_keeps_engines_busier_within_eta():
    fixed = simulate(build(_scenario()))
    results = {eta: simulate(build(_scenario(update_batch="flexible", oversubscription=1.0, max_staleness=eta)))
               for eta in (1, 2)}
    for eta, r in results.items():
        assert r["staleness_max"] <= eta
        assert r["bubble_ratio"] < fixed["bubble_ratio"]
    assert results[2]["samples_per_s"] > fixed["samples_per_s"]
    # Batches follow completions: with a slow trainer (1 GPU), groups finished during a step all train next.
    slow = simulate(build(_slow_trainer(_scenario(update_batch="flexible", oversubscription=1.0))))
    assert max(s["groups"] for s in slow["per_step"]) > 8
    assert max(s["groups"] for s in slow["per_step"]) <= 16  # max_batch_factor 2 x prompts_per_step


def test_the_simulator_refuses_a_run_that_would_train_beyond_eta(monkeypatch):
    """Take away the controller's regeneration of stale samples: the run must fail, not report."""
    from rollwise.rollout.controller import RolloutController

    monkeypatch.setattr(RolloutController, "_regenerate_older_than", lambda self, limit, reason: None)
    with pytest.raises(RuntimeError, match="staleness"):
        simulate(build(_scenario(update_batch="flexible", oversubscription=1.0)))


# ---------------------------------------------------------------- the planner


def test_candidate_splits_stay_inside_the_cluster_and_name_the_fix():
    splits = candidate_splits(12, 0.4, 2, etas=[1, 2])
    assert splits and all(s.trainer_gpus >= 1 and s.engine_gpus >= 2 and s.engine_gpus % 2 == 0
                          and s.trainer_gpus + s.engine_gpus == 12 for s in splits)
    assert {s.eta for s in splits} == {1, 2}
    with pytest.raises(ValueError, match="--gpus"):
        candidate_splits(2, 0.5, 2, etas=[1])


def test_plan_picks_the_fastest_split_and_beats_sync(tmp_path):
    base = _scenario()
    result = plan(base, total_gpus=12, etas=[1, 2])
    best = result.best
    assert all(best.samples_per_s >= r.samples_per_s for r in result.rows if r.bubble_ratio <= 0.25) \
        or best.bubble_ratio > 0.25
    assert all(r.staleness_max <= r.split.eta for r in result.rows)
    # What regeneration costs: only the samples that had sampled tokens, their tokens a share of what was generated.
    for r in [*result.rows, result.sync]:
        assert r.samples_regenerated_after_sampling <= r.samples_regenerated and r.generated_tokens > 0
        assert 0.0 <= r.wasted_token_share < 1.0 and (r.tokens_discarded > 0) == (r.samples_regenerated_after_sampling > 0)
    assert result.sync.tokens_discarded == 0  # sync never throws a sampled token away
    # Sync trains the workload's own lengths; a staleness bound can only bias them shorter (regenerated long samples).
    assert abs(result.sync.length_bias) < 0.05
    assert all(r.length_bias < 0.05 for r in result.rows)
    assert best.samples_per_s_per_gpu > result.sync.samples_per_s_per_gpu
    # The split it reports is the one it simulated.
    again = evaluate(base, best.split)
    assert again.samples_per_s == pytest.approx(best.samples_per_s)
    assert scenario_for(base, Split(3, 9, 2)).trainer_gpus() == 3


def test_plan_command_writes_a_file_placement_ray_takes(tmp_path):
    out = tmp_path / "plan.yaml"
    assert sim_main(["plan", str(SCENARIOS / "grpo-7b-sweep.yaml"), "--gpus", "6", "--etas", "1",
                     "--updates", "2", "--out", str(out)]) == 0
    ray = RayConfig(plan=str(out))
    assert ray.num_engines + ray.trainer_ranks == 6 and ray.engine_gpus == 1.0
    with pytest.raises(ValueError, match="ray.plan"):
        RayConfig(plan=str(tmp_path / "missing.yaml"))
    assert sim_main(["plan", str(SCENARIOS / "grpo-7b-sweep.yaml"), "--etas", "0"]) == 2  # eta >= 1, said so


def test_a_tight_staleness_bound_trains_shorter_responses_and_says_so():
    """Long samples are the ones that go stale; regenerating them draws afresh, so eta=1 trains a distribution
    skewed short and throws sampled tokens away, where a loose bound trains close to the workload's lengths."""
    base = _scenario()
    base.workload.updates = 10
    tight, loose = evaluate(base, Split(4, 8, 1)), evaluate(base, Split(4, 8, 8))
    assert tight.length_bias < loose.length_bias - 0.05, (tight.length_bias, loose.length_bias)
    assert tight.wasted_token_share > loose.wasted_token_share
    assert tight.response_mean == loose.response_mean > 0  # one workload, one yardstick


def test_a_recipes_trainer_work_moves_the_balance_and_the_step():
    """workload.trainer_work (a recipe's trainer seconds over a plain update's, rollwise bench algorithms): the
    simulator's train time and the planner's balanced trainer share both follow it."""
    from rollwise.sim.plan import balanced_trainer_share

    light, heavy = _scenario(), _scenario()
    heavy.workload.trainer_work = 2.0
    cost, trainer = light.cost()
    share = balanced_trainer_share(light, cost, trainer)
    assert balanced_trainer_share(heavy, cost, trainer) > share
    # the closed form: twice the trainer seconds per sample at the same engine rate
    engine_over_trainer = share / (1 - share)
    assert balanced_trainer_share(heavy, cost, trainer) == pytest.approx(2 * engine_over_trainer / (1 + 2 * engine_over_trainer))
    # synchronous: the same batches in both runs, each trained at twice the tokens' worth, and nothing else changes
    light, heavy = _scenario(mode="sync"), _scenario(mode="sync")
    heavy.workload.trainer_work = 2.0
    runs = [simulate(build(s)) for s in (light, heavy)]
    for a, b in zip(runs[0]["per_step"], runs[1]["per_step"]):
        assert abs(b["train_tokens"] - 2 * a["train_tokens"]) <= 1 and b["rollout_s"] == pytest.approx(a["rollout_s"])
        assert b["train_s"] == pytest.approx(trainer.step_s(b["train_tokens"], 4))

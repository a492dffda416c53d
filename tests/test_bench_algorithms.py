"""`rollwise bench algorithms` (issue 41's benchmark): --quick runs end to end through the CLI (two recipes on a
tiny model, in one process) and writes the JSON the lead's full run writes; a bad recipe is refused before any
run, naming it. The recipe table is the config's: every recipe's overrides load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollwise.config import load_config
from rollwise.types.recipes import RECIPES
from cli_run import run_rollwise


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_recipe_is_a_valid_config(recipe):
    cfg = load_config(None, RECIPES[recipe])
    assert cfg.train.policy_loss in ("ppo_clip", "gspo", "cispo")


def test_quick_runs_end_to_end(tmp_path):
    proc = run_rollwise(["bench", "algorithms", "--quick", "--json", str(tmp_path / "out.json")], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert list(result["recipes"]) == ["grpo", "ppo_gae"] and result["quick"] and result["steps"] == 2
    for name, r in result["recipes"].items():
        assert r["seeds"] == 1 and r["step_s"] > 0 and r["peak_memory_gb"] > 0
        assert r["strict_before"] is not None and r["strict_after"] is not None and r["strict_early"] is not None
    assert result["recipes"]["grpo"]["step_ratio_vs_grpo"] == 1.0
    run = result["runs"]["ppo_gae"][0]
    assert run["critic_value_loss"] is not None  # the critic trained in the run
    assert "ppo_gae: seconds per step <= 1.6x GRPO" in result["checks"]
    goals = result["goals"]  # the index's stable keys: the worst recipe's gain, PPO+GAE's ratio
    assert goals["gain_end_worst"] == min(r["gain_end"] for r in result["recipes"].values())
    assert goals["ppo_gae_step_ratio_vs_grpo"] == result["recipes"]["ppo_gae"]["step_ratio_vs_grpo"]
    assert goals["step_ratio_vs_grpo_worst"] is None  # no recipe without a critic besides GRPO in --quick
    # the measured trainer work, simulated on GPU rollouts: nothing to scale when the tiny model's GRPO trained no
    # sample (every group's rewards equal)
    projected, fraction = result["gpu_projection"], result["recipes"]["grpo"]["trained_fraction"]
    assert 0 <= fraction <= 1
    if fraction:
        assert projected["modes"]["sync"]["grpo"]["ratio_vs_baseline"] == 1.0
    else:
        assert projected == {} and "step_ratio_vs_grpo_worst_projected_sync" not in goals
    assert result["markdown"].startswith("| recipe |") and "| ppo_gae |" in result["markdown"]
    assert (Path(run["run_dir"]) / "metrics.jsonl").is_file()
    assert not (Path(run["run_dir"]) / "checkpoints").exists()  # read by no one: dropped (they filled a disk)


def test_unknown_recipe_refused_before_any_run(tmp_path):
    proc = run_rollwise(["bench", "algorithms", "--quick", "--arms", "grpo,ppo", "--json", str(tmp_path / "out.json")],
                     tmp_path)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2 and "unknown recipe 'ppo'" in out and "Traceback" not in out
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "runs").exists()


def test_resume_keeps_earlier_runs_and_runs_only_the_missing(tmp_path):
    first = tmp_path / "first.json"
    proc = run_rollwise(["bench", "algorithms", "--quick", "--arms", "grpo", "--json", str(first)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kept = json.loads(first.read_text())["runs"]["grpo"][0]
    second = tmp_path / "second.json"
    proc = run_rollwise(["bench", "algorithms", "--quick", "--arms", "grpo,ppo_gae", "--resume", str(first),
                         "--json", str(second)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(second.read_text())
    assert result["runs"]["grpo"] == [kept]  # not run again: the same run directory and figures
    assert len(result["runs"]["ppo_gae"]) == 1 and result["complete"]
    assert result["recipes"]["ppo_gae"]["step_ratio_vs_grpo"] > 0


def test_resume_from_a_file_that_is_not_a_bench_json_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"goals": {}}')
    proc = run_rollwise(["bench", "algorithms", "--quick", "--resume", str(bad)], tmp_path)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2 and "--resume" in out and "runs" in out and "Traceback" not in out
    assert not (tmp_path / "runs").exists()


def test_trainer_work_scales_grpo_fraction_by_measured_train_time():
    from rollwise.bench.algorithms_projection import trainer_work

    recipes = {"grpo": {"trained_fraction": 0.5, "train_s": 4.0}, "reinforce_pp": {"train_s": 10.0},
               "dapo": {"train_s": None}}
    work = trainer_work(recipes, "grpo")
    assert work == {"grpo": 0.5, "reinforce_pp": 1.25}  # 0.5 x 10 / 4; a recipe without a train time is left out
    assert trainer_work({"grpo": {"trained_fraction": None, "train_s": 4.0}}, "grpo") == {}  # older JSON: no input


def test_projection_runs_the_gpu_scenario_and_more_work_costs_more():
    from rollwise.bench.algorithms_projection import MODES, project

    small = {"cluster.gpus": 8, "cluster.trainer_gpus": 4, "workload.prompts_per_step": 8, "workload.updates": 3}
    out = project({"grpo": {"trained_fraction": 0.6, "train_s": 6.0}, "heavy": {"train_s": 12.0}}, "grpo", small)
    assert out["trainer_work"] == {"grpo": 0.6, "heavy": 1.2}
    assert set(out["modes"]) == set(MODES)
    for mode, by_recipe in out["modes"].items():
        assert by_recipe["grpo"]["ratio_vs_baseline"] == 1.0
        # twice the trainer work, the same rollouts: a step costs more, but less than twice as much
        assert 1.0 < by_recipe["heavy"]["ratio_vs_baseline"] < 2.0, mode
    assert out["modes"]["sync"]["heavy"]["trainer_engine_gpus"] == "4 / 8"
    # the planner gives the heavier recipe at least as many trainer GPUs, out of the same 12
    planned = {n: tuple(map(int, r["trainer_engine_gpus"].split(" / "))) for n, r in out["modes"]["planned"].items()}
    assert all(sum(split) == 12 for split in planned.values()) and planned["heavy"][0] >= planned["grpo"][0]

"""`rollwise bench environments` (issue 40, "Benchmark"): its environment-service and tool-environment arms run on a
tiny model (--quick), and the single-turn environment arm scores the default run's own problems."""

from __future__ import annotations

import pytest

from rollwise.bench.environments import ARMS, BENCH_ENV, arm_config, pick_arms, run_environments_bench
from rollwise.config import ConfigError, load_config
from rollwise.tasks import make_task
from rollwise.tasks.prompts import build_messages

pytestmark = [pytest.mark.usefixtures("single_torch_thread"), pytest.mark.timeout(180)]


def test_every_task_executor_and_reward_is_an_arm():
    assert {(a.task, a.executor, a.reward) for a in ARMS} == {
        (t, e, r) for t in ("single", "tool") for e in ("inprocess", "pool", "env") for r in ("regex", "slow")}
    with pytest.raises(ConfigError, match="--arms: unknown arm.*single-gpu-slow.*known: single-inprocess-regex"):
        pick_arms(["single-pool-slow", "single-gpu-slow"])


def test_the_single_turn_environment_arm_serves_the_default_runs_problems(tmp_path):
    arm = next(a for a in ARMS if a.name == "single-env-slow")
    cfg = arm_config(arm, quick=True, model=None, output_dir=str(tmp_path))
    default = load_config(None, ["model=tiny:0", "rollout.max_tokens=16"])
    problems = make_task(default.task).problems("train")
    assert cfg.task.kind == "verifiers" and cfg.task.env == BENCH_ENV and cfg.task.train_size == len(problems)
    rows = cfg.task.args["rows"]
    assert cfg.task.args["slow"] is True and len(rows) == len(problems)
    for row, p in zip(rows, problems):
        assert row == {"prompt": build_messages(p, default.prompt, default.reward), "answer": p.answer}
    # the pool arms of the same task score with the bench's reward function, the env arms with the rubric
    pool = arm_config(next(a for a in ARMS if a.name == "single-pool-slow"), True, None, str(tmp_path))
    assert pool.reward.function == "rollwise.bench.env_rewards:slow_reward" and pool.task.kind == "reasoning_gym"


def test_the_tool_environment_service_arm_runs_quick():
    """The new executor on the multi-turn task, with the 100 ms rubric (one arm: a worker's start is most of it; the
    agent arms' scoring is tests/test_agent_scoring_overlap.py's)."""
    pytest.importorskip("verifiers")
    result = run_environments_bench(quick=True, arms=["tool-env-slow"])
    [arm] = result["arms"]
    assert (arm["task"], arm["executor"], arm["reward"], arm["model"]) == ("tool", "env", "slow", "tiny:0")
    assert arm["steps_timed"] == 1 and arm["step_time_s"] > 0 and arm["turns_mean"] >= 1.0
    # every rollout was scored by the environment's rubric (the 0-weight wait included), none failed
    assert arm["reward_errors"] == 0 and arm["env_failed_rollouts"] == 0.0 and arm["env_rubric_waited"] == 1.0
    # the goal is the single task's pool arms: not run here, so not reported (nor a ratio without both rewards)
    assert "goals" not in result and result["tool_step_time_ratio_slow_vs_regex"] == {}

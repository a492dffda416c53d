"""The reward pool on the training path (issue 40 item 5): `rollwise train` scores every sample in the reward pool's
worker processes by default, a reward that raises, hangs, crashes its worker or returns NaN costs that sample only
(the error reward, its kind and reason in the step's metrics), and scoring overlaps generation (asserted from the
controller's own timestamps, not from wall-clock thresholds).

Runs go through the Python API (`rollwise.control.train_loop.train`) on the tiny random model: this process is the
driver, so "scored elsewhere" is checked against its pid.
"""

from __future__ import annotations

import io
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from rich.console import Console

sys.path.insert(0, str(Path(__file__).parent))
from run_configs import tiny_run_config  # noqa: E402

from rollwise.config import ConfigError, load_config  # noqa: E402
from rollwise.control.train_loop import train  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# Reward functions a user would write, in their own file (loaded by path in the pool's workers). Each call takes
# the next number from a counter file (a lock makes it exact across workers), so which calls fail is fixed.
REWARDS = textwrap.dedent('''
    import fcntl, os, time

    def _next_call() -> int:
        with open(os.environ["RW_TEST_CALLS"], "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            n = len(f.read()) + 1
            f.write("x")  # one byte per call
            return n

    def flaky(problem, response, finish_reason):
        n = _next_call()
        if n == 1:
            raise ZeroDivisionError("verifier bug on call 1")
        if n == 2:
            time.sleep(60)  # past reward.timeout_s: killed, replaced
        if n == 3:
            return float("nan")
        if n == 4:
            os._exit(3)  # kills its worker
        return 1.0

    def slow(problem, response, finish_reason):
        time.sleep(0.15)
        return 1.0
''')


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=200, force_terminal=False)


def _config(tmp_path: Path, reward: dict, rollout: dict | None = None, engine: dict | None = None,
            steps: int = 2) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return tiny_run_config(
        tmp_path, reward=reward, eval={"size": 0}, checkpoint={"every": 0}, tensorboard=False,
        train={"steps": steps, "lr": 1e-3},
        rollout={"prompts_per_step": 2, "group_size": 4, "max_tokens": 8, **(rollout or {})},
        engine={"kind": "reference", "max_num_seqs": 8, "max_model_len": 256, **(engine or {})},
    )


def _records(summary: dict) -> list[dict]:
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def test_training_scores_the_task_in_reward_worker_processes(tmp_path):
    """Default config, a built-in task (JSONL, exact verifier): every sample is scored in a pool worker, not here."""
    summary = train(load_config(_config(tmp_path, reward={})), _quiet())
    records = _records(summary)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["reward_worker_pids"], "no sample was scored in a reward worker"
        assert os.getpid() not in r["reward_worker_pids"]
        assert r["reward_errors"] == 0


@pytest.mark.parametrize("task", [
    {"kind": "jsonl", "verifier": "exact"},
    # math_verify and reasoning_gym run the same function (rollwise.reward.task_reward) with their task's verifier;
    # left out here for time: their imports alone take 5-8 s in a fresh worker on a busy 2-core machine.
], ids=["jsonl-exact"])
def test_the_pool_scores_built_in_tasks_as_the_in_process_verifier_does(tmp_path, task):
    """The same responses (right, equivalent, wrong, unformatted, truncated) through both executors: same rewards,
    outcomes and flags; the pool's computed in its workers."""
    from rollwise.reward.batch import InProcessScorer
    from rollwise.reward.pool_scorer import PoolScorer
    from rollwise.reward.scoring import RewardConfig
    from rollwise.tasks import TaskConfig, make_task
    from rollwise.types.sample import Sample

    if task["kind"] == "jsonl":
        jsonl = tmp_path / "t.jsonl"
        jsonl.write_text(json.dumps({"prompt": "Half of one?", "answer": "0.5"}) + "\n"
                         + json.dumps({"prompt": "Two and two?", "answer": "4"}) + "\n")
        task = {**task, "path": str(jsonl), "eval_fraction": 0.0}
    task_cfg = TaskConfig.model_validate(task)
    built = make_task(task_cfg)
    problem = built.problems("train")[0]
    cfg = RewardConfig()
    responses = [(f"<answer>{problem.answer}</answer>", "stop"), ("<answer>1/2</answer>", "stop"),
                 ("<answer>-12345</answer>", "stop"), ("no tags at all", "stop"),
                 (f"<answer>{problem.answer}</answer>", "length")]

    def samples() -> list[Sample]:
        return [Sample(problem_id=problem.id, sample_id=f"s{i}", group_id="g", prompt_ids=[1], response_ids=[2], behaviour_logprobs=[0.0],
                       response_text=text, finish_reason=reason, versions=[0])
                for i, (text, reason) in enumerate(responses)]

    pooled, local = samples(), samples()
    scorer = PoolScorer({problem.id: problem}, task_cfg.model_dump(mode="json", exclude_unset=True), cfg)
    try:
        scorer.score(pooled)
    finally:
        scorer.close()
    InProcessScorer({problem.id: problem}, built, cfg).score(local)
    got = [(s.reward, s.outcome, s.strict_correct, s.lenient_correct, s.extra.get("reward_error")) for s in pooled]
    assert got == [(s.reward, s.outcome, s.strict_correct, s.lenient_correct, s.extra.get("reward_error"))
                   for s in local]
    assert got[0][1] == "correct" and got[3][1] == "unparseable"
    assert all(s.extra["reward_worker_pid"] != os.getpid() for s in pooled)


def test_a_failing_reward_costs_its_sample_never_the_step(tmp_path, rewards_file, monkeypatch):
    """Calls 1-4 raise, hang past the timeout, return NaN and kill their worker; the other 12 of the 16 samples
    score 1.0. Both steps complete; the four get the error reward, each kind counted with its reason."""
    monkeypatch.setenv("RW_TEST_CALLS", str(tmp_path / "calls"))
    cfg = _config(tmp_path, reward={"function": f"{rewards_file}:flaky", "timeout_s": 1.0, "workers": 2})
    summary = train(load_config(cfg), _quiet())
    records = _records(summary)
    assert [r["step"] for r in records] == [1, 2]
    kinds = {k: sum(r.get(f"reward_errors/{k}", 0) for r in records) for k in
             ("exception", "timeout", "bad_return", "crash")}
    assert kinds == {"exception": 1, "timeout": 1, "bad_return": 1, "crash": 1}
    assert sum(r["reward_errors"] for r in records) == 4
    reasons = {k: v for r in records for k, v in r.get("reward_error_reasons", {}).items()}
    assert "ZeroDivisionError: verifier bug on call 1" in reasons["exception"]
    assert "did not return within 1 s" in reasons["timeout"]
    assert "nan" in reasons["bad_return"]
    assert "crashed its worker" in reasons["crash"]
    # The error reward is `unparseable` (0.0); every other sample got the function's 1.0: 12 over 16 samples.
    assert sum(r["reward_mean"] * r["batch_samples"] for r in records) == pytest.approx(12.0)
    assert len((tmp_path / "calls").read_text()) == 16  # each sample scored once: none retried, none lost


def test_scoring_overlaps_generation(tmp_path, rewards_file):
    """A slow reward (0.15 s a sample): with the pool, completions of later groups arrive at the controller while
    an earlier group is being scored (the controller's timestamps); scoring in process blocks the controller, so
    no completion arrives during a group's scoring."""
    overlapped = {}
    for executor in ("pool", "inprocess"):
        cfg = _config(tmp_path / executor, reward={"function": f"{rewards_file}:slow", "executor": executor,
                                                   "workers": 4},
                      rollout={"max_tokens": 16}, engine={"max_num_seqs": 4}, steps=1)  # group 1 generates after group 0
        records = _records(train(load_config(cfg), _quiet()))
        assert all(r["reward_mean"] == 1.0 for r in records)
        overlapped[executor] = sum(r["reward_overlapped_completions"] for r in records)
        pids = {p for r in records for p in r["reward_worker_pids"]}
        assert (os.getpid() not in pids and pids) if executor == "pool" else not pids
    assert overlapped["pool"] > 0
    assert overlapped["inprocess"] == 0


def test_a_reward_function_that_cannot_load_stops_the_run_before_it_starts(tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("import no_such_module_here\n")
    cfg = _config(tmp_path, reward={"function": f"{bad}:fn"})
    with pytest.raises(ConfigError, match=r"reward\.function: .*no_such_module_here"):
        train(load_config(cfg), _quiet())
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_reward_section_refuses_bad_pool_settings(tmp_path):
    for key, value in (("workers", 0), ("timeout_s", 0), ("executor", "threads")):
        path = _config(tmp_path, reward={key: value})
        with pytest.raises(ConfigError, match=rf"reward\.{key}"):
            load_config(path)
    assert yaml.safe_load(path.read_text())["reward"] == {"executor": "threads"}

"""`rollwise bench environments`: what scoring costs the training loop (issue 40, "Benchmark").

One `rollwise train` run per arm in this process, same seed, same steps. An arm is a task, where scoring runs, and a
reward:

    task       single    the default run (1-digit +/-, single-turn)
               tool      a multi-turn tool environment: 2-digit multiplication with a calculator tool (a worked
                         episode before the question), rollwise/configs/agent_calculator.yaml (the built-in agent)
                         or, for `env`, rollwise/configs/verifiers_calc.yaml (examples/verifiers_calc_env)
    executor   inprocess (the trainer's process scores each group as it completes: the controller stops meanwhile)
               pool      (the reward pool's worker processes, each group scored while others generate; the agent
                         controller hands a group over as soon as its episodes are done)
               env       (an environment service: a classic-verifiers environment in ENV_WORKERS worker processes,
                         rollwise.bench.env_package.rw_bench_env, scores each rollout with its rubric as the rollout
                         ends, while the other rollouts go on; the single task's rows are the default run's problems,
                         prompted as the built-in task prompts them)
    reward     regex     (rollwise.bench.env_rewards:regex_reward, microseconds; env: the same check as the rubric)
               slow      (the same after a 100 ms wait a sample: a verifier that calls a model or runs tests; env: a
                         0-weight rubric function that waits 100 ms)

Per arm, over the steps after the first (which pays for start-up): step time, rollouts (samples) per second, and
the trainer's idle time waiting for rewards (`time_reward_s`: scoring inline, or waiting for generated groups'
scores; an environment service scores inside its rollouts, so there its wait shows in generation time). Every
pool arm uses `reward.workers` = WORKERS, so pool arms differ only in where scoring runs.

Goal (issue 40): with the 100 ms reward in the pool, step time within 10% of the regex reward's
(`goals.slow_reward_step_time_ratio` <= 1.10, the single task). Beside it, the same ratio for every executor and
task (`step_time_ratio_slow_vs_regex`, `tool_step_time_ratio_slow_vs_regex`).

--quick: tiny random model, 2 steps of 2 groups (checks the benchmark runs; its numbers are not the goal's).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rollwise.bench.env_rewards import SLOW_REWARD_S
from rollwise.config import ConfigError, RunConfig, load_config

GOAL_SLOW_REWARD_STEP_TIME_RATIO = 1.10
WORKERS = 8
ENV_WORKERS = 2  # environment worker processes (each runs its rollouts concurrently on an event loop)
QUICK_ENV_WORKERS = 1  # --quick: a worker's start (importing verifiers) is most of a quick arm
REWARDS = {"regex": "rollwise.bench.env_rewards:regex_reward", "slow": "rollwise.bench.env_rewards:slow_reward"}
EXECUTORS = ("inprocess", "pool", "env")
TASKS = ("single", "tool")
FULL = ["train.steps=4", "eval.size=0", "eval.every=0", "checkpoint.every=0"]
QUICK = ["train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_tokens=16",
         "eval.size=0", "eval.every=0", "checkpoint.every=0", "model=tiny:0"]
QUICK_AGENT = ["agent.max_tokens_per_turn=16", "agent.max_tokens=48"]
BENCH_ENV = "rw-bench-env"  # rollwise/bench/env_package/rw_bench_env.py, on the environment workers' PYTHONPATH
ENV_PACKAGE = Path(__file__).resolve().parent / "env_package"
CALC_ENV = Path(__file__).resolve().parents[2] / "examples" / "verifiers_calc_env"  # in a source checkout


@dataclass(frozen=True)
class Arm:
    task: str  # TASKS
    executor: str  # EXECUTORS
    reward: str  # REWARDS

    @property
    def name(self) -> str:
        return f"{self.task}-{self.executor}-{self.reward}"


ARMS = [Arm(task, executor, reward) for task in TASKS for executor in EXECUTORS for reward in REWARDS]


def pick_arms(names: list[str] | None) -> list[Arm]:
    """The arms by name (`single-pool-slow`, ...), all when None; an unknown name is refused, naming the known."""
    if names is None:
        return list(ARMS)
    known = {a.name: a for a in ARMS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"--arms: unknown arm(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[n] for n in names]


def _config_file(name: str) -> Path:
    return Path(str(resources.files("rollwise") / "configs" / name))


def _single_env_task(base: RunConfig, slow: bool, env_workers: int) -> dict[str, Any]:
    """The default run's task as rows of the bench's SingleTurnEnv: each train problem prompted as the built-in task
    prompts it (same order: the problem stream permutes positions by the run's seed either way)."""
    from rollwise.tasks import make_task
    from rollwise.tasks.prompts import build_messages

    problems = make_task(base.task).problems("train")
    rows = [{"prompt": build_messages(p, base.prompt, base.reward, with_few_shot=True), "answer": p.answer}
            for p in problems]
    return {"kind": "verifiers", "env": BENCH_ENV, "args": {"kind": "single", "slow": slow, "rows": rows},
            "train_size": len(rows), "eval_size": 1, "workers": env_workers}


def arm_config(arm: Arm, quick: bool, model: str | None, output_dir: str) -> RunConfig:
    overrides = list(QUICK if quick else FULL) + [f"output_dir={output_dir}"] + (
        [f"model={model}"] if model is not None else [])
    if arm.executor != "env":
        overrides += [f"reward.executor={arm.executor}", f"reward.function={REWARDS[arm.reward]}",
                      f"reward.workers={WORKERS}"]
    slow, env_workers = arm.reward == "slow", QUICK_ENV_WORKERS if quick else ENV_WORKERS
    if arm.task == "single":
        if arm.executor == "env":
            overrides.append("task=" + json.dumps(_single_env_task(load_config(None, overrides), slow, env_workers)))
        return load_config(None, overrides)
    if arm.executor != "env":
        return load_config(_config_file("agent_calculator.yaml"), overrides + (QUICK_AGENT if quick else []))
    calc_args = {"num_train": 8, "num_eval": 2} if quick else {"num_train": 400, "num_eval": 50}
    overrides += [f"task.env={BENCH_ENV}", f"task.workers={env_workers}",
                  "task.args=" + json.dumps({"kind": "calc", "slow": slow, "calc_args": calc_args}),
                  f"task.train_size={calc_args['num_train']}", f"task.eval_size={calc_args['num_eval']}"]
    return load_config(_config_file("verifiers_calc.yaml"), overrides)


@contextmanager
def _env_workers_path(arm: Arm) -> Iterator[None]:
    """Environment workers (subprocesses) import the bench's environment package, and the example it wraps when it
    is not installed, from PYTHONPATH: set for this arm's run only."""
    if arm.executor != "env":
        yield
        return
    before = os.environ.get("PYTHONPATH")
    paths = [str(ENV_PACKAGE)] + ([str(CALC_ENV)] if CALC_ENV.is_dir() else []) + ([before] if before else [])
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def run_arm(arm: Arm, quick: bool, model: str | None, root: Path) -> dict[str, Any]:
    from rollwise.control.train_loop import train  # heavy: torch, the engines
    from rollwise.observe.metrics import read_metrics

    cfg = arm_config(arm, quick, model, str(root / arm.name))
    t0 = time.monotonic()
    with _env_workers_path(arm):
        summary = train(cfg, Console(quiet=True))
    records = read_metrics(Path(summary["run_dir"]) / "metrics.jsonl")
    timed = records[1:] or records  # the first step pays for start-up (engine warm-up, reward workers' imports)
    return {
        "task": arm.task, "executor": arm.executor, "reward": arm.reward, "steps_timed": len(timed),
        "wall_s": time.monotonic() - t0,
        "step_time_s": _mean([r["time_step_s"] for r in timed]),
        "rollouts_per_s": _mean([r["batch_samples"] / r["time_step_s"] for r in timed]),
        "trainer_idle_reward_s": _mean([r["time_reward_s"] for r in timed]),
        "generate_s": _mean([r["time_generate_s"] for r in timed]),
        "overlapped_completions": sum(r.get("reward_overlapped_completions", 0) for r in timed),
        "reward_errors": sum(r.get("reward_errors", 0) for r in timed),
        # multi-turn arms: model turns per episode (agent) or rollout (environment); failed environment rollouts
        "turns_mean": _mean([r.get("agent_turns_mean", r.get("env_turns_mean", 1.0)) for r in timed]),
        "env_failed_rollouts": _mean([r.get("env_failed_rollouts", 0.0) for r in timed]),
        "env_rubric_waited": _mean([r.get("env_wait_slow", 0.0) for r in timed]),  # env slow arms: 1.0
        "model": cfg.model, "batch": f"{cfg.rollout.prompts_per_step}x{cfg.rollout.group_size}",
    }


def _ratios(arms: list[dict[str, Any]], task: str) -> dict[str, float]:
    """Step time with the slow reward over the regex reward's, per executor that ran both for `task`."""
    by = {(a["executor"], a["reward"]): a for a in arms if a["task"] == task}
    return {ex: by[(ex, "slow")]["step_time_s"] / by[(ex, "regex")]["step_time_s"]
            for ex in EXECUTORS if (ex, "slow") in by and (ex, "regex") in by}


def run_environments_bench(quick: bool = False, model: str | None = None,
                           arms: list[str] | None = None) -> dict[str, Any]:
    picked = pick_arms(arms)
    if any(a.executor == "env" for a in picked) and find_spec("verifiers") is None:  # before any arm runs
        raise ConfigError("the env arms run a classic-verifiers environment: install verifiers (README, Bring your own "
                          "environment) or leave them out with --arms")
    with tempfile.TemporaryDirectory(prefix="rollwise-bench-env-") as tmp:
        results = [run_arm(arm, quick, model, Path(tmp)) for arm in picked]
    ratio = _ratios(results, "single")
    out: dict[str, Any] = {
        "quick": quick, "model": results[0]["model"], "batch": results[0]["batch"], "reward_workers": WORKERS,
        "env_workers": QUICK_ENV_WORKERS if quick else ENV_WORKERS, "slow_reward_s": SLOW_REWARD_S, "arms": results,
        "step_time_ratio_slow_vs_regex": ratio,
        "tool_step_time_ratio_slow_vs_regex": _ratios(results, "tool"),
    }
    if "pool" in ratio:  # the goal: the single task's pool arms (every arm runs unless --arms picks some)
        out["goals"] = {
            "slow_reward_step_time_ratio": ratio["pool"],
            "slow_reward_step_time_ratio_met": ratio["pool"] <= GOAL_SLOW_REWARD_STEP_TIME_RATIO,
        }
    return out


def format_environments_bench(r: dict[str, Any]) -> Table:
    table = Table(title=f"rollwise bench environments — {r['model']}, batch {r['batch']}, {r['reward_workers']} reward "
                        f"workers, {r.get('env_workers', '-')} environment workers, slow reward "
                        f"{r['slow_reward_s'] * 1000:.0f} ms" + (" (--quick)" if r["quick"] else ""))
    for col in ("task", "executor", "reward", "step time", "rollouts/s", "trainer idle on reward",
                "overlapped completions", "reward errors", "turns"):
        table.add_column(col, justify="left" if col in ("task", "executor", "reward") else "right")
    for a in r["arms"]:
        table.add_row(a.get("task", "single"), a["executor"], a["reward"], f"{a['step_time_s']:.2f} s",
                      f"{a['rollouts_per_s']:.1f}", f"{a['trainer_idle_reward_s']:.2f} s",
                      f"{a['overlapped_completions']:.0f}", f"{a['reward_errors']}", f"{a.get('turns_mean', 1.0):.2f}")
    parts = []
    for label, key in (("single", "step_time_ratio_slow_vs_regex"), ("tool", "tool_step_time_ratio_slow_vs_regex")):
        ratios = r.get(key, {})
        if ratios:
            parts.append(f"{label}: " + ", ".join(f"{ex} {v:.2f}x" for ex, v in ratios.items()))
    caption = "slow / regex step time: " + ("; ".join(parts) if parts else "-")
    if "goals" in r:
        met = r["goals"]["slow_reward_step_time_ratio_met"]
        caption += (f"; goal single pool <= {GOAL_SLOW_REWARD_STEP_TIME_RATIO:.2f}x: "
                    f"{'met' if met else 'NOT met'}")
    table.caption = caption
    return table

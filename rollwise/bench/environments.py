"""`rollwise bench environments`: what scoring costs the training loop (issue 40, "Benchmark").

The default `rollwise train` config, run once per arm in this process, same seed, same steps:

    executor   inprocess (the trainer's process scores each group as it completes: the controller stops meanwhile)
               pool      (the reward pool's worker processes, each group scored while others generate)
    reward     regex     (rollwise.bench.env_rewards:regex_reward, microseconds)
               slow      (the same after a 100 ms wait a sample: a verifier that calls a model or runs tests)

Per arm, over the steps after the first (which pays for start-up): step time, rollouts (samples) per second, and
the trainer's idle time waiting for rewards (`time_reward_s`: scoring inline, or waiting for generated groups'
scores). Every arm uses `reward.workers` = WORKERS, so pool arms differ only in where scoring runs.

Goal (issue 40): with the 100 ms reward in the pool, step time within 10% of the regex reward's
(`goals.slow_reward_step_time_ratio` <= 1.10). Not covered here: an environment service arm and a tool
environment (rollwise.environments; add them beside these arms).

--quick: tiny random model, 2 steps of 2 groups (checks the benchmark runs; its numbers are not the goal's).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rollwise.bench.env_rewards import SLOW_REWARD_S
from rollwise.config import load_config

GOAL_SLOW_REWARD_STEP_TIME_RATIO = 1.10
WORKERS = 8
REWARDS = {"regex": "rollwise.bench.env_rewards:regex_reward", "slow": "rollwise.bench.env_rewards:slow_reward"}
EXECUTORS = ("inprocess", "pool")
FULL = ["train.steps=4", "eval.size=0", "eval.every=0", "checkpoint.every=0"]
QUICK = ["train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_tokens=16",
         "eval.size=0", "eval.every=0", "checkpoint.every=0", "model=tiny:0"]


def arm_overrides(executor: str, reward: str, quick: bool, model: str | None, output_dir: str) -> list[str]:
    overrides = list(QUICK if quick else FULL) + [
        f"output_dir={output_dir}", f"reward.executor={executor}", f"reward.function={REWARDS[reward]}",
        f"reward.workers={WORKERS}"]
    return overrides + ([f"model={model}"] if model is not None else [])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def run_arm(executor: str, reward: str, quick: bool, model: str | None, root: Path) -> dict[str, Any]:
    from rollwise.control.train_loop import train  # heavy: torch, the engines
    from rollwise.observe.metrics import read_metrics

    cfg = load_config(None, arm_overrides(executor, reward, quick, model, str(root / f"{executor}-{reward}")))
    t0 = time.monotonic()
    summary = train(cfg, Console(quiet=True))
    records = read_metrics(Path(summary["run_dir"]) / "metrics.jsonl")
    timed = records[1:] or records  # the first step pays for start-up (engine warm-up, reward workers' imports)
    return {
        "executor": executor, "reward": reward, "steps_timed": len(timed), "wall_s": time.monotonic() - t0,
        "step_time_s": _mean([r["time_step_s"] for r in timed]),
        "rollouts_per_s": _mean([r["batch_samples"] / r["time_step_s"] for r in timed]),
        "trainer_idle_reward_s": _mean([r["time_reward_s"] for r in timed]),
        "generate_s": _mean([r["time_generate_s"] for r in timed]),
        "overlapped_completions": sum(r.get("reward_overlapped_completions", 0) for r in timed),
        "reward_errors": sum(r.get("reward_errors", 0) for r in timed),
        "model": cfg.model, "batch": f"{cfg.rollout.prompts_per_step}x{cfg.rollout.group_size}",
    }


def run_environments_bench(quick: bool = False, model: str | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rollwise-bench-env-") as tmp:
        arms = [run_arm(executor, reward, quick, model, Path(tmp)) for executor in EXECUTORS for reward in REWARDS]
    by = {(a["executor"], a["reward"]): a for a in arms}
    ratio = {ex: by[(ex, "slow")]["step_time_s"] / by[(ex, "regex")]["step_time_s"] for ex in EXECUTORS}
    return {
        "quick": quick, "model": arms[0]["model"], "batch": arms[0]["batch"], "reward_workers": WORKERS,
        "slow_reward_s": SLOW_REWARD_S, "arms": arms,
        "step_time_ratio_slow_vs_regex": ratio,
        "goals": {
            "slow_reward_step_time_ratio": ratio["pool"],
            "slow_reward_step_time_ratio_met": ratio["pool"] <= GOAL_SLOW_REWARD_STEP_TIME_RATIO,
        },
    }


def format_environments_bench(r: dict[str, Any]) -> Table:
    table = Table(title=f"rollwise bench environments — {r['model']}, batch {r['batch']}, {r['reward_workers']} reward "
                        f"workers, slow reward {r['slow_reward_s'] * 1000:.0f} ms" + (" (--quick)" if r["quick"] else ""))
    for col in ("executor", "reward", "step time", "rollouts/s", "trainer idle on reward", "overlapped completions",
                "reward errors"):
        table.add_column(col, justify="left" if col in ("executor", "reward") else "right")
    for a in r["arms"]:
        table.add_row(a["executor"], a["reward"], f"{a['step_time_s']:.2f} s", f"{a['rollouts_per_s']:.1f}",
                      f"{a['trainer_idle_reward_s']:.2f} s", f"{a['overlapped_completions']:.0f}",
                      f"{a['reward_errors']}")
    ratio = r["step_time_ratio_slow_vs_regex"]
    met = r["goals"]["slow_reward_step_time_ratio_met"]
    table.caption = (f"slow / regex step time: pool {ratio['pool']:.2f}x, in-process {ratio['inprocess']:.2f}x; goal "
                     f"pool <= {GOAL_SLOW_REWARD_STEP_TIME_RATIO:.2f}x: {'met' if met else 'NOT met'}")
    return table

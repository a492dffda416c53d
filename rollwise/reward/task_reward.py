"""The task's own verifier as a reward-pool function: how a run's built-in scoring (reasoning_gym, a JSONL task
with its exact or math_verify verifier, an environment task's fallback) runs in the pool's worker processes.

It has the pool's call contract plus two keyword arguments the scorer passes with every call (small, picklable):
the run's task config (as set, `exclude_unset`) and its reward config. Each worker builds the task once per
config and keeps it (tasks are deterministic: the worker's problems are the driver's).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from rollwise.reward.scoring import RewardConfig, RewardResult, score
from rollwise.types.task import Problem, Task

TASK_VERIFIER = "rollwise.reward.task_reward:task_verifier"


def verifier_imports(task: dict[str, Any]) -> tuple[str, ...]:
    """The modules a task's verifier imports on its first call (seconds each): a pool worker imports them as it
    starts, so the first call's timeout does not pay for them."""
    heavy = {"reasoning_gym": ("reasoning_gym",), "jsonl": ("math_verify",) if task.get("verifier") == "math_verify"
             else ()}.get(task.get("kind", ""), ())
    return ("rollwise.tasks", *heavy)


@lru_cache(maxsize=8)
def _task(task_json: str) -> Task:
    from rollwise.tasks import make_task  # the task's dependencies load in the worker only

    return make_task(json.loads(task_json))


@lru_cache(maxsize=8)
def _reward_config(reward_json: str) -> RewardConfig:
    return RewardConfig.model_validate(json.loads(reward_json))


def task_verifier(problem: Problem, response: str, finish_reason: str | None, *,
                  task: dict[str, Any], reward: dict[str, Any]) -> RewardResult:
    """Strict answer format, then the task's `score_answer` (rollwise.reward.scoring.score): the same result the
    in-process scorer gives, computed in a pool worker."""
    cfg = _reward_config(json.dumps(reward, sort_keys=True))
    return score(problem, _task(json.dumps(task, sort_keys=True)), response, finish_reason, cfg)

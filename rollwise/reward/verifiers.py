"""Built-in verifiers: math-verify for math answers, reasoning-gym's own scorers, (and, in
rollwise.reward.code_exec, code tests in a sandbox). Each `*_reward` function has the reward-pool
signature `fn(problem, response, finish_reason) -> RewardResult`, so it runs by import path in
`RewardPool` (e.g. "rollwise.reward.verifiers:math_verify_reward"); `math_equal` (the JSONL task's
`verifier: math_verify`) lives with the tasks, in rollwise.tasks.math_equal.
"""

from __future__ import annotations

from functools import lru_cache

from rollwise.reward.scoring import RewardConfig, RewardResult, score
from rollwise.types.task import Problem, Task
from rollwise.tasks.math_equal import math_equal


class _MathVerifyTask(Task):
    """Adapts math_equal to the Task verifier interface, so `score` does the format check as usual."""

    name = "math_verify"

    def problems(self, split: str) -> list[Problem]:  # pragma: no cover - never used for data
        raise NotImplementedError

    def score_answer(self, problem: Problem, extracted_answer: str) -> float:
        return 1.0 if math_equal(extracted_answer, problem.answer) else 0.0


def math_verify_reward(problem: Problem, response: str, finish_reason: str | None) -> RewardResult:
    """Strict answer tags (RewardConfig defaults), then math-verify equivalence with problem.answer."""
    return score(problem, _MathVerifyTask(), response, finish_reason, RewardConfig())


@lru_cache(maxsize=64)
def _rg_task(dataset: str) -> Task:
    from rollwise.tasks.reasoning_gym_task import ReasoningGymTask

    return ReasoningGymTask(name=dataset, params={}, train_size=1, eval_size=0, seed=0)


def reasoning_gym_reward(problem: Problem, response: str, finish_reason: str | None) -> RewardResult:
    """reasoning-gym's own `score_answer` for the dataset a problem came from (problem.metadata
    from a reasoning_gym task carries the dataset name and the untouched entry)."""
    dataset = problem.metadata.get("dataset")
    if problem.metadata.get("source") != "reasoning_gym" or not dataset:
        raise ValueError(f"problem {problem.id!r} did not come from a reasoning_gym task (no metadata.dataset)")
    return score(problem, _rg_task(dataset), response, finish_reason, RewardConfig())

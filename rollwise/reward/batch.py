"""Score a batch of samples with the task's verifier (reward code is untrusted: `score` never raises)."""

from __future__ import annotations

from typing import Any, Protocol

from rollwise.reward.scoring import RewardConfig, score
from rollwise.types.task import Problem, Task


class ScoredSample(Protocol):
    """The fields of a sample that scoring reads and fills (rollwise.types.sample.Sample has them).
    A protocol, so reward imports nothing of rollout (rollout imports reward, one way)."""

    problem_id: str
    response_text: str
    finish_reason: str
    reward: float
    outcome: str  # one of rollwise.reward.scoring.OUTCOMES once scored
    strict_correct: bool
    lenient_correct: bool
    extra: dict[str, Any]


def score_samples(samples: list[ScoredSample], problems: dict[str, Problem], task: Task, cfg: RewardConfig) -> None:
    """Fill reward, outcome and correctness flags on each sample in place."""
    for s in samples:
        result = score(problems[s.problem_id], task, s.response_text, s.finish_reason, cfg)
        s.reward = result.reward
        s.outcome = result.outcome
        s.strict_correct = result.strict_correct
        s.lenient_correct = result.lenient_correct
        if result.error:
            s.extra["reward_error"] = result.error

"""Score a batch of samples with the task's verifier (reward code is untrusted: `score` never raises)."""

from __future__ import annotations

from rollwise.reward.scoring import RewardConfig, score
from rollwise.rollout.types import Sample
from rollwise.tasks import Problem, Task


def score_samples(samples: list[Sample], problems: dict[str, Problem], task: Task, cfg: RewardConfig) -> None:
    """Fill reward, outcome and correctness flags on each sample in place."""
    for s in samples:
        result = score(problems[s.problem_id], task, s.response_text, s.finish_reason, cfg)
        s.reward = result.reward
        s.outcome = result.outcome
        s.strict_correct = result.strict_correct
        s.lenient_correct = result.lenient_correct
        if result.error:
            s.extra["reward_error"] = result.error

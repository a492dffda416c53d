"""Score a batch of samples with the task's verifier (reward code is untrusted: `score` never raises), and the
Scorers the rollout controller holds (rollwise.types.contracts.Scorer): scoring in this process, or none."""

from __future__ import annotations

from collections.abc import Sequence
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


def score_samples(samples: Sequence[ScoredSample], problems: dict[str, Problem], task: Task, cfg: RewardConfig) -> None:
    """Fill reward, outcome and correctness flags on each sample in place."""
    for s in samples:
        result = score(problems[s.problem_id], task, s.response_text, s.finish_reason, cfg)
        s.reward = result.reward
        s.outcome = result.outcome
        s.strict_correct = result.strict_correct
        s.lenient_correct = result.lenient_correct
        if result.error:
            s.extra["reward_error"] = result.error


class InProcessScorer:
    """The Scorer of a run whose reward runs in this process (placement local and pool.url): the task's verifier
    on each finished group, as the controller completes it."""

    def __init__(self, problems: dict[str, Problem], task: Task, cfg: RewardConfig) -> None:
        self.problems, self.task, self.cfg = problems, task, cfg

    def score(self, samples: Sequence[ScoredSample]) -> None:
        score_samples(samples, self.problems, self.task, self.cfg)


class Unscored:
    """A Scorer that leaves every sample as it is: benchmarks and the simulator, which time generation only."""

    def score(self, samples: Sequence[ScoredSample]) -> None:
        return None

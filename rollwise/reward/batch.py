"""Score a batch of samples with the task's verifier (reward code is untrusted: `score` never raises), and the
Scorers the rollout controller holds (rollwise.types.contracts.Scorer): scoring in this process, or none."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from rollwise.reward.scoring import CORRECT_THRESHOLD, RewardConfig, score
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


# Why a sample's reward code failed, and the kind of failure (reward_errors/<kind> in the step metrics): `verifier`
# in this process; the pool's kinds (rollwise.reward.pool.ErrorKind) there.
REWARD_ERROR = "reward_error"
REWARD_ERROR_KIND = "reward_error_kind"

# Set on a sample an environment service scored (rollwise.environments): its rubric's reward, which scoring keeps.
ENV_REWARD = "env_reward"
ENV_ERROR = "env_error"


def apply_env_reward(s: ScoredSample, reward: float, error: str | None, cfg: RewardConfig) -> None:
    """A sample scored by its environment: the environment's reward (or, for a rollout that failed, the lowest
    reward, `unparseable`, with the reason in extra[ENV_ERROR]). Correct = reward at least `correct`."""
    if error is not None:
        reward = cfg.unparseable
        s.extra[ENV_ERROR] = error
    s.extra[ENV_REWARD] = reward
    s.reward = reward
    s.outcome = "unparseable" if error is not None else "correct" if reward >= cfg.correct * CORRECT_THRESHOLD \
        else "formatted_wrong"
    s.strict_correct = s.lenient_correct = s.outcome == "correct"


def score_samples(samples: Sequence[ScoredSample], problems: dict[str, Problem], task: Task, cfg: RewardConfig) -> None:
    """Fill reward, outcome and correctness flags on each sample in place (an environment's samples keep its reward)."""
    for s in samples:
        if ENV_REWARD in s.extra:
            apply_env_reward(s, s.extra[ENV_REWARD], s.extra.get(ENV_ERROR), cfg)
            continue
        result = score(problems[s.problem_id], task, s.response_text, s.finish_reason, cfg)
        s.reward = result.reward
        s.outcome = result.outcome
        s.strict_correct = result.strict_correct
        s.lenient_correct = result.lenient_correct
        if result.error:
            s.extra[REWARD_ERROR], s.extra[REWARD_ERROR_KIND] = result.error, "verifier"


class InProcessScorer:
    """The Scorer of a run whose reward runs in this process (placement local and pool.url): the task's verifier
    on each finished group, as the controller completes it."""

    def __init__(self, problems: dict[str, Problem], task: Task, cfg: RewardConfig) -> None:
        self.problems, self.task, self.cfg = problems, task, cfg

    def score(self, samples: Sequence[ScoredSample]) -> None:
        score_samples(samples, self.problems, self.task, self.cfg)

    def close(self) -> None:
        return None


class Unscored:
    """A Scorer that leaves every sample as it is: benchmarks and the simulator, which time generation only."""

    def score(self, samples: Sequence[ScoredSample]) -> None:
        return None

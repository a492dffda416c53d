"""Turn one response into a reward: strict format check, then the task's verifier.

Three outcomes, three reward levels (RewardConfig). The small `formatted_wrong` bonus teaches the
format early without making it worth more than being right. Task verifiers are treated as untrusted
code: if one raises or returns garbage, the sample gets the unparseable reward and an `error`
string, and the run goes on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from rollwise.tasks.answer_format import AnswerFormat, answers_match, last_number, parse_number, parse_response

from rollwise.types.task import Problem, Task  # reward -> tasks: one way (tasks import nothing of reward)
from rollwise.types.config_section import ConfigSection

Outcome = Literal["correct", "formatted_wrong", "unparseable"]
OUTCOMES: tuple[Outcome, ...] = ("correct", "formatted_wrong", "unparseable")

# A verifier score at or above this counts as correct. Anything less (including reasoning-gym's
# substring partial credit, e.g. 0.5 for "-4" when the answer is "4") is wrong.
CORRECT_THRESHOLD = 1.0 - 1e-6


class RewardConfig(ConfigSection):  # no unknown keys, finite rewards (rollwise.types.config_section)

    correct: float = 1.0
    formatted_wrong: float = 0.1  # well-formatted but wrong
    unparseable: float = 0.0
    answer_open: str = "<answer>"
    answer_close: str = "</answer>"
    # Where scoring runs (issue 40): `pool`, worker processes (rollwise.reward.pool; Ray reward actors under
    # `placement: ray`), each group scored while others generate; `inprocess`, in the trainer's process, for a debugger.
    executor: Literal["pool", "inprocess"] = Field(
        "pool", description="pool: isolated reward worker processes, overlapped with generation; inprocess: debugging")
    workers: int = Field(2, ge=1, le=256, description="reward worker processes (executor pool)")
    timeout_s: float = Field(30.0, gt=0, description="a reward call with no result by then: worker killed, the "
                             "sample gets the `unparseable` reward with the reason in metrics")
    memory_mb: int | None = Field(2048, ge=64, description="each reward worker's address-space limit (null: none)")
    function: str | None = Field(
        None, description="a reward function 'package.module:function' or 'path/to/file.py:function', "
        "fn(problem, response, finish_reason) -> float | RewardResult, instead of the task's verifier")

    @model_validator(mode="after")
    def _check(self) -> RewardConfig:
        if not self.correct > self.formatted_wrong >= self.unparseable:
            # Otherwise the policy is paid to be wrong, or to break the format.
            raise ValueError(
                "rewards must satisfy correct > formatted_wrong >= unparseable, got "
                f"{self.correct} / {self.formatted_wrong} / {self.unparseable}"
            )
        self.answer_format()  # validates the tags
        return self

    def answer_format(self) -> AnswerFormat:
        return AnswerFormat(open=self.answer_open, close=self.answer_close)


@dataclass(frozen=True)
class RewardResult:
    reward: float
    outcome: Outcome
    extracted: str | None  # the answer inside the tags, when the format was ok
    strict_correct: bool  # what the reward is based on: format ok and verifier says correct
    lenient_correct: bool  # diagnostic only: the response's last number equals the answer
    error: str | None = None  # set when the task's verifier failed; outcome is then "unparseable"
    parse_reason: str | None = None  # why the format check failed, when it did
    verifier_score: float | None = None  # the verifier's raw score, when it ran


def lenient_match(response_text: str, answer: str) -> bool:
    """Does the last number in the response equal the (numeric) reference answer?"""
    if parse_number(answer) is None:
        return False
    guess = last_number(response_text)
    return guess is not None and answers_match(guess, answer)


def score(
    problem: Problem,
    task: Task,
    response_text: str,
    finish_reason: str | None,
    cfg: RewardConfig | None = None,
) -> RewardResult:
    """Reward one response. Never raises because of the verifier."""
    cfg = cfg or RewardConfig()
    lenient = lenient_match(response_text, problem.answer)
    parsed = parse_response(response_text, cfg.answer_format(), finish_reason=finish_reason)
    if parsed.status != "ok" or parsed.answer is None:
        return RewardResult(
            reward=cfg.unparseable,
            outcome="unparseable",
            extracted=None,
            strict_correct=False,
            lenient_correct=lenient,
            parse_reason=parsed.reason,
        )

    try:
        raw = task.score_answer(problem, parsed.answer)
        value = float(raw)
        if not math.isfinite(value) or not 0.0 <= value <= 1.0:
            raise ValueError(f"verifier returned {raw!r}, expected a score in [0, 1]")
    except Exception as exc:  # untrusted verifier code: record it, never crash the run
        return RewardResult(
            reward=cfg.unparseable,
            outcome="unparseable",
            extracted=parsed.answer,
            strict_correct=False,
            lenient_correct=lenient,
            error=f"{type(exc).__name__}: {exc}",
        )

    correct = value >= CORRECT_THRESHOLD
    return RewardResult(
        reward=cfg.correct if correct else cfg.formatted_wrong,
        outcome="correct" if correct else "formatted_wrong",
        extracted=parsed.answer,
        strict_correct=correct,
        lenient_correct=lenient,
        verifier_score=value,
    )

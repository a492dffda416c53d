"""The reward functions `rollwise bench environments` scores with (by import path, in the reward pool's workers or
in the trainer's process): a cheap regex check of the answer tags, and the same check behind a 100 ms wait (a
verifier that calls a model or runs tests). Not for training: they know only the default answer tags."""

from __future__ import annotations

import re
import time

from rollwise.types.task import Problem

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
SLOW_REWARD_S = 0.1


def regex_reward(problem: Problem, response: str, finish_reason: str | None) -> float:
    """1.0 when the last <answer>...</answer> holds the reference answer, else 0.0."""
    found = _ANSWER.findall(response)
    return 1.0 if found and found[-1].strip() == problem.answer.strip() else 0.0


def slow_reward(problem: Problem, response: str, finish_reason: str | None) -> float:
    """regex_reward after SLOW_REWARD_S of waiting (not computing: the cores stay with generation)."""
    time.sleep(SLOW_REWARD_S)
    return regex_reward(problem, response, finish_reason)

"""Arithmetic with feedback and retries, as an OpenEnv environment: reset() poses a problem, step() checks the
answer and, when it is wrong, says "too high" / "too low" and lets the agent try again.

Offline and synthetic: 1-digit addition and subtraction, 200 problems, shuffled once. Seeds below
EVAL_SEED_START draw from the first half (training), seeds from EVAL_SEED_START on from the second half (held
out; rollwise's `args.eval_seed_offset` defaults to the same number).

Rewards (on the step that ends the episode; 0 on the others): 1.0 right at the first attempt, 0.5 at the
second, 0.25 at the third, 0.0 when every attempt was wrong. The answer is read from <answer>...</answer>;
the problem does not say so (the agent's system prompt may), a reply without the tags is told on its retry.
"""

from __future__ import annotations

import random
import re
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

EVAL_SEED_START = 1_000_000
ATTEMPT_REWARDS = (1.0, 0.5, 0.25)
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def _problems() -> list[tuple[int, str, int]]:
    problems = [(a, op, b) for a in range(10) for b in range(10) for op in "+-"]
    random.Random(0).shuffle(problems)
    return problems


PROBLEMS = _problems()
HALF = len(PROBLEMS) // 2


class ArithAction(BaseModel):
    """The agent's reply; the answer is the number inside <answer></answer>."""

    model_config = ConfigDict(extra="forbid")
    message: str = Field(max_length=20_000)
    metadata: dict[str, Any] = Field(default_factory=dict)


class ArithObservation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str
    attempt: int = 0
    done: bool = False
    reward: float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class ArithState(BaseModel):
    episode_id: str | None = None
    step_count: int = 0
    question: str = ""
    solved: bool = False


class ArithEnvironment:
    """OpenEnv's Environment interface (reset / step / state), one episode per instance at a time."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        self._state = ArithState()
        self._answer = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> ArithObservation:
        seed = random.randrange(EVAL_SEED_START) if seed is None else seed
        index = HALF + (seed - EVAL_SEED_START) % HALF if seed >= EVAL_SEED_START else seed % HALF
        a, op, b = PROBLEMS[index]
        self._answer = a + b if op == "+" else a - b
        question = f"Calculate {a} {op} {b}."
        self._state = ArithState(episode_id=episode_id or uuid.uuid4().hex, question=question)
        return ArithObservation(prompt=question)  # the answer format is the agent's to learn (hints on retries)

    def step(self, action: ArithAction, timeout_s: float | None = None, **kwargs: Any) -> ArithObservation:
        st = self._state
        if st.solved or st.step_count >= len(ATTEMPT_REWARDS):
            return ArithObservation(prompt="The episode is over.", attempt=st.step_count, done=True, reward=0.0)
        st.step_count += 1
        match = _ANSWER.search(action.message)
        last = st.step_count >= len(ATTEMPT_REWARDS)
        if match is not None and int(match.group(1)) == self._answer:
            st.solved = True
            return ArithObservation(prompt="Correct.", attempt=st.step_count, done=True,
                                    reward=ATTEMPT_REWARDS[st.step_count - 1])
        if match is None:
            hint = "I found no <answer></answer> tags with a number in your reply."
        else:
            hint = f"{match.group(1)} is too {'high' if int(match.group(1)) > self._answer else 'low'}."
        return ArithObservation(prompt=f"{hint} Try again: {st.question}", attempt=st.step_count, done=last,
                                reward=0.0)

    @property
    def state(self) -> ArithState:
        return self._state

    def close(self) -> None:
        pass

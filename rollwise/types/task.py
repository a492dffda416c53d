"""What a task is: a fixed set of problems per split, plus the task's own answer verifier.

The reward code (rollwise.reward) decides *format*: it pulls the answer out of a response.
The task decides *correctness*: `score_answer` compares that extracted answer to the truth.
Keeping the two apart means every task shares one anti-hacking format check.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")


@dataclass(frozen=True)
class Problem:
    """One question with its reference answer.

    `id` is stable across runs with the same task config, so logs, eval results and
    per-problem statistics can be joined on it.
    """

    id: str
    question: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


def question_digest(question: str, n: int = 10) -> str:
    """Short content hash used in problem ids: the id changes if the question text does."""
    return hashlib.sha1(question.encode("utf-8")).hexdigest()[:n]


def check_split(split: str) -> Split:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    return split  # type: ignore[return-value]


class Task(ABC):
    """A named source of problems with a held-out evaluation split.

    Subclasses must make `problems()` deterministic for a given config and seed, and keep the
    train and eval splits disjoint by question text, so eval accuracy measures generalisation.
    """

    name: str

    @abstractmethod
    def problems(self, split: Split) -> list[Problem]:
        """All problems of `split` ("train" or "eval"), in a fixed order."""

    @abstractmethod
    def score_answer(self, problem: Problem, extracted_answer: str) -> float:
        """The task's verifier: a score in [0, 1] for an already extracted answer (1.0 = correct).

        May raise on odd input; callers (rollwise.reward.scoring) treat that as untrusted-code failure.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

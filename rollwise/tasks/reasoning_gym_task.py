"""Procedurally generated tasks from reasoning-gym, by dataset name + generator parameters.

reasoning-gym datasets are indexable generators: `create_dataset(name, size=, seed=, **params)`
returns an object whose item i is `{"question", "answer", "metadata"}`, and whose
`score_answer(answer, entry)` is the dataset's own verifier. We use the verifier as-is.

Held-out eval: generated with a second seed derived from the task seed. Several datasets seed item i
with `Random(seed + i)`, so neighbouring seeds produce shifted copies of the same items; the eval
seed is therefore a hash of the task seed, and eval items whose question text appears in train are
dropped anyway.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import re
from typing import Any

from rollwise.types.task import Problem, Split, Task, check_split, question_digest

# Sentences in reasoning-gym questions that only say "reply with nothing but the answer". They
# conflict with our own format (reason, then <answer>...</answer>), so `strip_instructions` removes
# them. Instructions about the answer's *content* ("Do not include units", "to 3 significant
# figures", "as a comma-separated list") are kept: the dataset's verifier depends on them.
_ANSWER_ONLY_INSTRUCTIONS = [
    # "Give only the result as your final answer.", "Provide only the color as your final answer.",
    # "Return the secret sentence as your final answer.", "Give the result as your final answer.",
    # "Give only the number of steps as your final answer, no other text or formatting."
    re.compile(
        r"\s*\b(?:Give|Provide|Return)(?: only)? the [^.\n]{1,60}? as your (?:final )?answer"
        r"(?:, no other text or formatting)?\.",
        re.IGNORECASE,
    ),
    re.compile(r"\s*\bOnly reply with the final value\.", re.IGNORECASE),
]


def strip_answer_instructions(question: str) -> str:
    """Remove reasoning-gym's "answer only" instructions; never returns an empty question."""
    stripped = question
    for pattern in _ANSWER_ONLY_INSTRUCTIONS:
        stripped = pattern.sub("", stripped)
    stripped = stripped.strip()
    return stripped or question


def derive_eval_seed(seed: int) -> int:
    """A seed far (in hash space) from `seed`, so eval items are not shifted train items."""
    digest = hashlib.sha256(f"rollwise-eval-split:{seed}".encode()).hexdigest()
    return int(digest[:8], 16)


def _registry() -> dict[str, tuple[type, type]]:
    # Imported lazily: reasoning_gym imports ~100 generators (seconds), and JSONL-only runs skip it.
    import reasoning_gym  # noqa: F401  (registers all datasets)
    from reasoning_gym.factory import DATASETS

    return DATASETS


def _check_name(name: str) -> None:
    datasets = _registry()
    if name in datasets:
        return
    close = difflib.get_close_matches(name, list(datasets), n=5, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    raise ValueError(
        f"unknown reasoning-gym dataset {name!r}.{hint} "
        f"The {len(datasets)} valid names are the keys of reasoning_gym.factory.DATASETS."
    )


def _check_params(name: str, params: dict[str, Any]) -> None:
    _, config_cls = _registry()[name]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    for key in params:
        if key in ("seed", "size"):
            raise ValueError(
                f"reasoning-gym param {key!r} is set by rollwise; use the task's "
                f"{'seed' if key == 'seed' else 'train_size / eval_size'} instead"
            )
        if key not in fields:
            valid = sorted(fields - {"seed", "size"})
            close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            raise ValueError(
                f"unknown param {key!r} for reasoning-gym dataset {name!r}.{hint} "
                f"Valid params: {', '.join(valid)}"
            )


class ReasoningGymTask(Task):
    """A reasoning-gym dataset as a Task; the dataset's own `score_answer` is the verifier."""

    def __init__(
        self,
        name: str,
        params: dict[str, Any] | None = None,
        train_size: int = 1000,
        eval_size: int = 200,
        seed: int = 0,
        strip_instructions: bool = False,
    ) -> None:
        if train_size < 1:
            raise ValueError(f"train_size must be >= 1, got {train_size}")
        if eval_size < 0:
            raise ValueError(f"eval_size must be >= 0, got {eval_size}")
        self.params = dict(params or {})
        _check_name(name)
        _check_params(name, self.params)
        self.name = name
        self.train_size = train_size
        self.eval_size = eval_size
        self.seed = seed
        self.eval_seed = derive_eval_seed(seed)
        self.strip_instructions = strip_instructions
        # Built eagerly so bad param *values* (the config's validate()) fail at construction.
        self._train_ds = self._create(train_size, seed)
        self._cache: dict[str, list[Problem]] = {}

    def _create(self, size: int, seed: int) -> Any:
        import reasoning_gym

        try:
            return reasoning_gym.create_dataset(self.name, size=size, seed=seed, **self.params)
        except (AssertionError, TypeError, ValueError) as exc:
            # reasoning-gym validates configs with bare asserts; surface them with context.
            raise ValueError(f"invalid params {self.params} for reasoning-gym dataset {self.name!r}: {exc}") from exc

    def _problem(self, entry: dict[str, Any], split: Split, index: int, seed: int) -> Problem:
        raw_question = str(entry["question"])
        question = strip_answer_instructions(raw_question) if self.strip_instructions else raw_question
        return Problem(
            id=f"{self.name}/{split}/{index}-{question_digest(question)}",
            question=question,
            answer=str(entry["answer"]),
            # The untouched entry is kept so the verifier sees exactly what reasoning-gym produced,
            # and so a Problem alone (e.g. sent to another process) is enough to score an answer.
            metadata={
                "source": "reasoning_gym",
                "dataset": self.name,
                "index": index,
                "seed": seed,
                "rg_question": raw_question,
                "rg_answer": entry["answer"],
                "rg_metadata": entry.get("metadata", {}),
            },
        )

    def _train(self) -> list[Problem]:
        return [self._problem(self._train_ds[i], "train", i, self.seed) for i in range(self.train_size)]

    def _eval(self, train: list[Problem]) -> list[Problem]:
        if self.eval_size == 0:
            return []
        seen = {p.question for p in train}
        size = 2 * self.eval_size + 16
        # Grow the candidate pool if small generators keep producing train (or repeated) questions.
        for _ in range(4):
            ds = self._create(size, self.eval_seed)
            out: list[Problem] = []
            taken = set(seen)
            for i in range(size):
                problem = self._problem(ds[i], "eval", i, self.eval_seed)
                if problem.question in taken:
                    continue
                taken.add(problem.question)
                out.append(problem)
                if len(out) == self.eval_size:
                    return out
            size *= 4
        raise ValueError(
            f"reasoning-gym dataset {self.name!r} with params {self.params} yielded only {len(out)} distinct "
            f"eval questions outside the train split (needed {self.eval_size}); lower eval_size/train_size "
            "or widen the params"
        )

    def problems(self, split: Split) -> list[Problem]:
        split = check_split(split)
        if "train" not in self._cache:
            self._cache["train"] = self._train()
        if split == "eval" and "eval" not in self._cache:
            self._cache["eval"] = self._eval(self._cache["train"])
        return list(self._cache[split])

    def score_answer(self, problem: Problem, extracted_answer: str) -> float:
        md = problem.metadata
        entry = {
            "question": md.get("rg_question", problem.question),
            "answer": md.get("rg_answer", problem.answer),
            "metadata": md.get("rg_metadata", {}),
        }
        return float(self._train_ds.score_answer(extracted_answer, entry))

    def __repr__(self) -> str:
        return (
            f"ReasoningGymTask(name={self.name!r}, params={self.params}, train_size={self.train_size}, "
            f"eval_size={self.eval_size}, seed={self.seed})"
        )

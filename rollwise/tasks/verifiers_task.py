"""`task: {kind: verifiers, env: <id>, args: {...}, python: <interpreter>}`: a classic verifiers environment.

The environment's dataset lives in the environment's process (rollwise.environments runs it, maybe under
another interpreter), so the problems here are positions: train problem i is the environment's dataset row
i % len(dataset), eval problem i its eval row. The environment's own rubric scores every rollout; a sample
it scored carries that reward (rollwise.reward.batch.ENV_REWARD), so `score_answer` here is never the reward.
"""

from __future__ import annotations

from rollwise.types.task import Problem, Split, Task, check_split


class EnvironmentTask(Task):
    def __init__(self, kind: str, env: str, train_size: int, eval_size: int) -> None:
        self.name = env
        self.kind, self.env = kind, env
        self.sizes = {"train": train_size, "eval": eval_size}

    def problems(self, split: str) -> list[Problem]:
        checked: Split = check_split(split)
        return [Problem(id=f"{self.env}:{checked}:{i}", question=f"{self.env} {checked} row {i}", answer="",
                        metadata={"source": self.kind, "split": checked, "index": i})
                for i in range(self.sizes[checked])]

    def score_answer(self, problem: Problem, extracted_answer: str) -> float:
        return 0.0  # the environment's rubric scores its rollouts (samples carry ENV_REWARD)

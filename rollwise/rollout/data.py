"""Which problems each step trains on: a seeded shuffle per epoch, addressed by step number.

The data position is a pure function of (seed, step), so resume needs no iterator state and can
never train a problem twice or skip one.
"""

from __future__ import annotations

import numpy as np

from rollwise.types.task import Problem


class ProblemStream:
    def __init__(self, problems: list[Problem], seed: int):
        if not problems:
            raise ValueError("the task's train split is empty")
        self.problems = problems
        self.seed = seed
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.problems))
        return self._orders[epoch]

    def batch(self, step: int, size: int) -> list[Problem]:
        """Problems for `step` (0-based): global positions [step*size, (step+1)*size)."""
        out = []
        for pos in range(step * size, (step + 1) * size):
            epoch, index = divmod(pos, len(self.problems))
            out.append(self.problems[int(self._order(epoch)[index])])
        return out

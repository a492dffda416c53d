"""The one interface every experiment tracker implements (TensorBoard, Weights & Biases, MLflow), what they
are given, and the fan-out that hands each of them the same thing.

The metric names and values are decided once, here (`tracked_metrics`), so that every backend holds the same
series: a record's finite numbers, each under its name with dots turned into slashes (the grouping separator
of all three UIs; MLflow and wandb accept slashes in names, TensorBoard groups by them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Completion:
    """One sampled completion of a step, for the per-step table."""

    prompt: str
    completion: str
    reward: float


COMPLETION_COLUMNS = ("step", "prompt", "completion", "reward")


def completion_rows(step: int, completions: Sequence[Completion]) -> list[list[Any]]:
    """The table's rows in COMPLETION_COLUMNS order (every backend writes these)."""
    return [[step, c.prompt, c.completion, c.reward] for c in completions]


@dataclass(frozen=True)
class RunInfo:
    """What a tracker records about the run once, at its start."""

    name: str  # the run directory's name
    config: dict[str, Any]  # the resolved run config (rollwise.config.dump_config)
    versions: dict[str, str | None]  # rollwise, torch, transformers, vllm, python (None: not installed)
    git_sha: str | None = None  # the commit of the rollwise source tree, when it is a git checkout
    start_step: int = 0  # a resumed run starts after its checkpoint's step


class Tracker(Protocol):
    """An experiment tracker: opened with the run's RunInfo (config and versions recorded then)."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """`metrics` as tracked_metrics made them: the same names and values for every backend."""

    def log_completions(self, step: int, completions: Sequence[Completion]) -> None:
        """The step's table of sampled completions with their rewards."""

    def close(self) -> None:
        """Flush and finish the run."""


def metric_name(key: str) -> str:
    return key.replace(".", "/")


def tracked_metrics(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The record's finite numbers (not "step", not booleans), named for the trackers. NaN and infinities are
    left out, as metrics.jsonl writes them as null."""
    return {metric_name(prefix + key): float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


class FanOut:
    """Every open tracker, handed the same calls in order."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers = list(trackers)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        for tracker in self.trackers:
            tracker.log_metrics(step, metrics)

    def log_completions(self, step: int, completions: Sequence[Completion]) -> None:
        for tracker in self.trackers:
            tracker.log_completions(step, completions)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()

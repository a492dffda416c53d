"""Open the trackers a run's `logging.backends` names, each on the same RunInfo, behind one FanOut."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rollwise.observe.trackers.base import FanOut, RunInfo, Tracker
from rollwise.types.logging_config import LoggingConfig


def open_tracker(backend: str, run_dir: Path, info: RunInfo, settings: LoggingConfig,
                 purge_after_step: int | None) -> Tracker:
    # Each backend's module is imported only when it is used (wandb and mlflow take a second or more).
    if backend == "wandb":
        from rollwise.observe.trackers.wandb_tracker import WandbTracker

        return WandbTracker(run_dir, info, settings.wandb)
    if backend == "mlflow":
        from rollwise.observe.trackers.mlflow_tracker import MlflowTracker

        return MlflowTracker(run_dir, info, settings.mlflow)
    from rollwise.observe.trackers.tensorboard_tracker import TensorBoardTracker

    return TensorBoardTracker(run_dir, info, purge_after_step)


def open_trackers(backends: Sequence[str], run_dir: Path, info: RunInfo, settings: LoggingConfig,
                  purge_after_step: int | None = None) -> FanOut:
    """`backends` (validated by the config: known names, installed). A tracker that fails to open closes
    those opened before it."""
    opened: list[Tracker] = []
    try:
        for backend in backends:
            opened.append(open_tracker(backend, run_dir, info, settings, purge_after_step))
    except BaseException:
        FanOut(opened).close()
        raise
    return FanOut(opened)

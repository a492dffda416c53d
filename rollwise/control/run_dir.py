"""Where a `rollwise train` run writes, and which checkpoint it resumes from: output_dir filled in, or with
checkpoint.resume the run directory found again (auto: the newest run of this pattern with a whole checkpoint;
a path: that checkpoint, verified), and what a stopped run prints so that the user can continue it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

from rollwise.config import ConfigError, RunConfig
from rollwise.observe.run_logs import has_logs
from rollwise.train.checkpoint import latest_checkpoint, whole_checkpoint
from rollwise.train.checkpoint_manifest import verify_checkpoint


def run_dir_of(cfg: RunConfig) -> Path:
    """output_dir filled in for this run's model and task (a fresh {timestamp})."""
    return cfg.output_path(cfg.task.name or Path(cfg.task.path or "task").stem)


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def resolve_run_dir(cfg: RunConfig, warn: Callable[[str], None] = _warn) -> tuple[Path, Path | None]:
    """(run directory, checkpoint to resume from or None). The checkpoint is verified (its manifest's
    checksums, its state.json): `auto` skips damaged ones (`warn`ing, naming the file); a named one that
    is damaged is refused (rollwise.train.checkpoint_manifest.CheckpointError)."""
    resume = cfg.checkpoint.resume
    if not resume:
        run_dir = run_dir_of(cfg)
        if has_logs(run_dir):
            # Appending a fresh run to an old run's logs would mix two curves in one file.
            raise ConfigError(
                f"run directory {run_dir} already holds a run: pass checkpoint.resume=auto to continue it, "
                "or choose another output_dir (the default has a {timestamp})"
            )
        return run_dir, None
    if resume == "auto":
        # output_dir may hold {timestamp}: resume the newest run directory that matches the pattern.
        pattern = cfg.output_dir.replace("{timestamp}", "*")
        pattern = str(run_dir_of(cfg.model_copy(update={"output_dir": pattern})))
        candidates = sorted(Path().glob(pattern) if not Path(pattern).is_absolute()
                            else Path("/").glob(pattern.lstrip("/")))
        for run_dir in reversed(candidates):
            if latest_checkpoint(run_dir) is not None:
                return run_dir, whole_checkpoint(run_dir, warn)
        return run_dir_of(cfg), None  # nothing to resume: a fresh run (one stopped before its first checkpoint: again)
    ckpt = Path(resume)
    if not (ckpt / "state.json").exists():
        raise ConfigError(
            f"checkpoint.resume={resume!r} is not a checkpoint directory (expected RUN_DIR/checkpoints/step_NNNNNN "
            "holding state.json), or use checkpoint.resume=auto"
        )
    verify_checkpoint(ckpt)
    return ckpt.parent.parent, ckpt


def how_to_continue(cfg: RunConfig, run_dir: Path) -> str:
    """What a stopped run prints last: the checkpoint `checkpoint.resume=auto` continues from, or, with none
    written yet, the setting that writes them."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        every = cfg.checkpoint.every
        when = f"now {every}: the first after step {every}" if every else "now 0: only at the end"
        return f"run {run_dir} stopped before its first checkpoint: checkpoint.every=N saves one every N steps ({when})"
    return f"run {run_dir} stopped; the same command with checkpoint.resume=auto continues from {ckpt.name}"

"""TensorBoard: event files in <run dir>/tensorboard; scalars, and the run's config, versions and each step's
completions as text (markdown)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from rollwise.observe.trackers.base import COMPLETION_COLUMNS, Completion, RunInfo, completion_rows

TENSORBOARD_DIR = "tensorboard"


def _cell(value: object) -> str:
    # A markdown table cell: one line, no column separators.
    return str(value).replace("|", "\\|").replace("\r", "").replace("\n", "<br>")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows])


class TensorBoardTracker:
    def __init__(self, run_dir: Path, info: RunInfo, purge_after_step: int | None = None) -> None:
        # Imported lazily: the TensorBoard writer pulls in protobuf and takes a second to import.
        from torch.utils.tensorboard import SummaryWriter

        # On resume, purge events logged after the checkpoint so steps are not shown twice.
        purge = purge_after_step + 1 if purge_after_step is not None else None
        self._writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=purge)
        # Indented by four spaces: a code block in TensorBoard's markdown.
        config = "\n".join("    " + line for line in json.dumps(info.config, indent=2).splitlines())
        versions = {**info.versions, "git_sha": info.git_sha}
        self._writer.add_text("run/config", config, info.start_step)
        self._writer.add_text("run/versions", markdown_table(("package", "version"), list(versions.items())),
                              info.start_step)
        self._writer.flush()

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def log_completions(self, step: int, completions: Sequence[Completion]) -> None:
        table = markdown_table(COMPLETION_COLUMNS, completion_rows(step, completions))
        self._writer.add_text("completions", table, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

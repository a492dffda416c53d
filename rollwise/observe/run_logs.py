"""The run's append-only logs, and cutting them back to a checkpoint on resume.

Each checkpoint records the size of every log when it was written (state.json `log_sizes`); a resumed run
cuts each log back to that size, so whatever was appended after the checkpoint (steps, samples, a mid or
final evaluation) is dropped and written again once, and every step, evaluation and sample appears once.
A run restarted from step 0 (stopped before its first checkpoint) cuts them to nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Every file the training loop appends to (rollwise.control.train_loop, rollwise.observe.metrics).
METRICS_LOG = "metrics.jsonl"
SAMPLES_LOG = "samples.jsonl"
EVALS_LOG = "evals.jsonl"
EVAL_SAMPLES_LOG = "eval_samples.jsonl"
RUN_LOGS = (METRICS_LOG, SAMPLES_LOG, EVALS_LOG, EVAL_SAMPLES_LOG)


def log_sizes(run_dir: Path) -> dict[str, int]:
    """Bytes of each run log now (recorded in a checkpoint; every writer has flushed whole lines by then)."""
    return {name: (run_dir / name).stat().st_size if (run_dir / name).exists() else 0 for name in RUN_LOGS}


def has_logs(run_dir: Path) -> bool:
    return any((run_dir / name).exists() and (run_dir / name).stat().st_size for name in RUN_LOGS)


def cut_logs(run_dir: Path, sizes: dict[str, int]) -> None:
    """Cut each log back to its size in `sizes` (a log absent from it: to nothing)."""
    for name in RUN_LOGS:
        path = run_dir / name
        if path.exists() and path.stat().st_size > sizes.get(name, 0):
            os.truncate(path, sizes.get(name, 0))


def cut_logs_by_step(run_dir: Path, step: int) -> None:
    """For a checkpoint that recorded no log sizes (one written through the Python API): drop the records
    of the steps after `step`."""
    for name in RUN_LOGS:
        path = run_dir / name
        if path.exists():
            path.write_text("".join(json.dumps(r) + "\n" for r in _records(path) if r["step"] <= step))


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

"""Per-step metrics to metrics.jsonl (one JSON object per line) and TensorBoard event files."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool = True, purge_after_step: int | None = None):
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            # Imported lazily: the TensorBoard writer pulls in protobuf and takes a second to import.
            from torch.utils.tensorboard import SummaryWriter

            # On resume, purge events logged after the checkpoint so steps are not shown twice.
            purge = purge_after_step + 1 if purge_after_step is not None else None
            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)

    def log(self, record: dict[str, Any]) -> None:
        """record must hold "step"; every numeric field also goes to TensorBoard under its name."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = int(record["step"])
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key.replace(".", "/"), value, step)
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

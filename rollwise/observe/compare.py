"""Runs side by side, and arms of several seeds each: does one setting learn as well as another?

One run's held-out curve moves by several points from seed to seed, so "learns as well per sample"
is a question about arms (the same config, several seeds), not single runs. An arm is written
`LABEL=DIR[,DIR...]` on the command line; a bare DIR is an arm of one run labelled by its folder.

For each arm this reads every run's metrics.jsonl and evals.jsonl, and lines up the held-out
evaluations by step with the samples trained so far (the x axis the per-sample comparison needs).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from rollwise.observe.metrics import read_metrics


@dataclass(frozen=True)
class RunCurves:
    directory: Path
    records: list[dict[str, Any]]  # metrics.jsonl: one per update
    evals: list[dict[str, Any]]  # evals.jsonl: held-out evaluations (step 0 = before training)

    @cached_property
    def _samples_by_step(self) -> list[tuple[int, int]]:
        """(step, samples taken by its end), in step order: one pass over the records."""
        total, out = 0, []
        for r in sorted(self.records, key=lambda r: r["step"]):
            total += r.get("batch_samples", 0) or 0
            out.append((r["step"], total))
        return out

    def samples_at(self, step: int) -> int:
        """Samples the trainer had taken when step `step` ended (the batches, zero-advantage groups
        included: that is what an update consumed)."""
        return max((n for s, n in self._samples_by_step if s <= step), default=0)


@dataclass(frozen=True)
class Arm:
    label: str
    runs: list[RunCurves]

    def eval_steps(self) -> list[int]:
        """Steps every run of the arm evaluated at (runs cut short contribute what they have in common)."""
        common = set.intersection(*({e["step"] for e in run.evals} for run in self.runs))
        return sorted(common)

    def strict_at(self, step: int) -> list[float]:
        return [next(e["strict_accuracy"] for e in run.evals if e["step"] == step) for run in self.runs]

    def samples_at(self, step: int) -> float:
        return statistics.fmean(run.samples_at(step) for run in self.runs)


def parse_arm(spec: str) -> tuple[str, list[Path]]:
    """`LABEL=DIR,DIR` or `DIR`: (label, directories)."""
    label, sep, dirs = spec.partition("=")
    if not sep:
        return Path(spec).name, [Path(spec)]
    paths = [Path(d) for d in dirs.split(",") if d]
    if not label or not paths:
        raise ValueError(f"{spec!r}: write an arm as LABEL=RUN_DIR[,RUN_DIR...] or a single RUN_DIR")
    return label, paths


def load_run(directory: Path) -> RunCurves:
    metrics = directory / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{directory} has no metrics.jsonl (is it a rollwise run directory?)")
    evals_path = directory / "evals.jsonl"
    evals = [json.loads(line) for line in evals_path.read_text().splitlines() if line.strip()] \
        if evals_path.exists() else []
    return RunCurves(directory, read_metrics(metrics), evals)


def load_arms(specs: list[str]) -> list[Arm]:
    arms: dict[str, list[RunCurves]] = {}
    for spec in specs:
        label, paths = parse_arm(spec)
        arms.setdefault(label, []).extend(load_run(p) for p in paths)
    return [Arm(label, runs) for label, runs in arms.items()]


def mean_and_spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one run)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def held_out_table(arms: list[Arm]) -> list[dict[str, Any]]:
    """One row per evaluated step (the steps all arms share): per arm the mean held-out strict
    accuracy, its spread over seeds and the mean samples trained by then; plus the area under each
    arm's curve (mean accuracy over the evaluations after training began) as the last row."""
    steps = sorted(set.intersection(*(set(arm.eval_steps()) for arm in arms))) if arms else []
    rows: list[dict[str, Any]] = []
    for step in steps:
        row: dict[str, Any] = {"step": step}
        for arm in arms:
            mean, spread = mean_and_spread(arm.strict_at(step))
            row[arm.label] = {"strict_mean": mean, "strict_std": spread, "runs": arm.strict_at(step),
                              "samples": arm.samples_at(step)}
        rows.append(row)
    trained = [s for s in steps if s > 0]
    if trained:
        area: dict[str, Any] = {"step": "mean after step 0"}
        for arm in arms:
            per_run = [statistics.fmean(arm.strict_at(s)[i] for s in trained) for i in range(len(arm.runs))]
            mean, spread = mean_and_spread(per_run)
            area[arm.label] = {"strict_mean": mean, "strict_std": spread, "runs": per_run, "samples": None}
        rows.append(area)
    return rows


def against_first(rows: list[dict[str, Any]], arms: list[Arm]) -> list[dict[str, Any]]:
    """Each later arm against the first, on the last evaluation and on the mean after step 0: the
    difference of the means and its standard error (Welch: sqrt(sd_a^2/n_a + sd_b^2/n_b)), so that
    "equal within seed noise" is a number, not an impression. Needs two runs in each arm for an error."""
    if len(arms) < 2 or len(rows) < 2:
        return []
    base = arms[0]
    out = []
    for arm in arms[1:]:
        for row, what in ((rows[-2], f"step {rows[-2]['step']}"), (rows[-1], "mean after step 0")):
            a, b = row[base.label], row[arm.label]
            error = (a["strict_std"] ** 2 / len(base.runs) + b["strict_std"] ** 2 / len(arm.runs)) ** 0.5
            out.append({"arm": arm.label, "baseline": base.label, "at": what,
                        "difference": b["strict_mean"] - a["strict_mean"],
                        "standard_error": error if len(base.runs) > 1 and len(arm.runs) > 1 else None})
    return out

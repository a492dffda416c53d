"""Per-step metrics to metrics.jsonl (one JSON object per line) and the experiment trackers, and the
loop's utilisation: model-FLOPs utilisation (MFU) and idle core-seconds per step, evaluation and run."""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil
import torch

from rollwise.observe.flops import DenseModel, Flops, generation_flops, training_flops, utilisation
from rollwise.observe.peak import Peak, machine_peak
from rollwise.observe.run_logs import METRICS_LOG
from rollwise.observe.trackers.base import Completion, tracked_metrics
from rollwise.observe.trackers.factory import open_trackers
from rollwise.observe.trackers.run_info import run_info
from rollwise.types.logging_config import LoggingConfig
from rollwise.types.microbatch import MicroBatchSettings
from rollwise.types.sample import Sample
from rollwise.types.task import Problem


class MetricsLogger:
    """Each step's record to metrics.jsonl, and its finite numbers to every experiment tracker of
    `tracking.backends` (TensorBoard, wandb, MLflow: rollwise.observe.trackers), under the same names."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, purge_after_step: int | None = None, *,
                 tracking: LoggingConfig | None = None, config: dict[str, Any] | None = None):
        self.path = run_dir / METRICS_LOG
        backends = tracking.backends if tracking is not None else ["tensorboard"]
        # `tensorboard: false` (the older switch) leaves TensorBoard out whatever the backends say.
        backends = [b for b in backends if b != "tensorboard" or tensorboard]
        info = run_info(run_dir, config or {}, start_step=purge_after_step or 0)
        self.trackers = open_trackers(backends, run_dir, info, tracking or LoggingConfig(), purge_after_step)
        self._file = self.path.open("a")

    def log(self, record: dict[str, Any]) -> None:
        """record must hold "step"; every finite number in it also goes to the trackers under its name."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        self.trackers.log_metrics(int(record["step"]), tracked_metrics(record))

    def log_eval(self, result: dict[str, Any]) -> None:
        """An evaluation's numbers to the trackers, as eval/<name> at its step (evals.jsonl is the loop's)."""
        self.trackers.log_metrics(int(result["step"]), tracked_metrics(result, prefix="eval/"))

    def log_samples(self, step: int, samples: Sequence[Sample], problems: Mapping[str, Problem]) -> None:
        """The step's table of sampled completions for the trackers: each sample's question, response, reward."""
        self.trackers.log_completions(step, [
            Completion(problems[s.problem_id].question if s.problem_id in problems else "", s.response_text, s.reward)
            for s in samples])

    def close(self) -> None:
        self._file.close()
        self.trackers.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------- utilisation: MFU and idle cores


def idle_core_seconds() -> float:
    """Seconds the machine's cores have spent idle (or waiting on I/O) since boot, summed over
    cores (/proc/stat through psutil). Differences of two readings give idle core-seconds."""
    times = psutil.cpu_times()
    return times.idle + getattr(times, "iowait", 0.0)


@dataclass
class StepTimes:
    """Wall seconds of a training step's phases (rollwise.control.train_loop.train_step)."""

    generate: float
    train: float
    step: float


class LoopMeter:
    """Model FLOPs, MFU and idle core-seconds of a training loop, per step, per evaluation and for
    the run. `overlapped`: generation runs while the trainer trains (rollout modes sorted and async),
    so a step's generation FLOPs are spread over the whole step, not over its wait for the batch."""

    def __init__(self, model: DenseModel, peak: Peak, settings: MicroBatchSettings, *, updates: int = 1,
                 kl_reference: bool = False, frozen_weights: bool = False, overlapped: bool = False,
                 skip_zero_advantage: bool | None = None) -> None:
        self.model, self.peak, self.settings = model, peak, settings
        self.skip_zero_advantage = skip_zero_advantage  # TrainConfig.skips_zero_advantage (None: no KL term)
        self.updates, self.kl_reference, self.overlapped = updates, kl_reference, overlapped
        self.frozen_weights = frozen_weights
        self.cores = psutil.cpu_count() or 1  # idle time is read machine-wide, over every core
        self.flops = Flops()  # this process's totals (a resumed run counts from its resume)
        self.seconds = {"generate": 0.0, "train": 0.0, "eval": 0.0}
        self._t0, self._idle0 = time.monotonic(), idle_core_seconds()
        self._step_idle0 = self._idle0
        self._marks: list[tuple[str, float, float]] = []  # (phase that ended, monotonic time, idle core-s)

    def step_begin(self) -> None:
        self._step_idle0 = idle_core_seconds()
        self._marks = [("", time.monotonic(), self._step_idle0)]

    def phase_end(self, phase: str) -> None:
        """The step's `phase` ends now: the record gets idle_core_fraction_<phase>, the share of the
        cores idle while it ran (do generation and training each keep every core busy?)."""
        if self._marks:
            self._marks.append((phase, time.monotonic(), idle_core_seconds()))

    def step_metrics(self, samples: list[Sample], times: StepTimes) -> dict[str, float | None]:
        """The step's FLOPs by phase, MFU overall and per phase, and the cores' idle seconds."""
        gen = generation_flops(self.model, samples)
        train = training_flops(self.model, samples, self.settings, updates=self.updates,
                               kl_reference=self.kl_reference, frozen_weights=self.frozen_weights,
                               skip_zero_advantage=self.skip_zero_advantage)
        self.flops += Flops(generate=gen, train=train)
        self.seconds["generate"] += times.step if self.overlapped else times.generate
        self.seconds["train"] += times.train
        idle = idle_core_seconds() - self._step_idle0
        by_phase = {f"idle_core_fraction_{phase}": self._fraction(idle1 - idle0, t1 - t0)
                    for (_, t0, idle0), (phase, t1, idle1) in zip(self._marks, self._marks[1:])}
        return {
            **by_phase,
            "flops_generate": gen,
            "flops_train": train,
            "mfu_step": utilisation(gen + train, times.step, self.peak.flops),
            "mfu_generate": utilisation(gen, times.step if self.overlapped else times.generate, self.peak.flops),
            "mfu_train": utilisation(train, times.train, self.peak.flops),
            "idle_core_s": idle,
            "idle_core_fraction": self._fraction(idle, times.step),
        }

    def _fraction(self, idle_core_s: float, seconds: float) -> float:
        """Idle share of the cores over `seconds`; /proc/stat counts in 10 ms ticks, so a phase of a
        few milliseconds can read above 1: clamped."""
        return min(1.0, idle_core_s / max(seconds * self.cores, 1e-9))

    def eval_metrics(self, samples: list[Sample], seconds: float) -> dict[str, float | None]:
        flops = generation_flops(self.model, samples)
        self.flops += Flops(eval=flops)
        self.seconds["eval"] += seconds
        return {"flops_eval": flops, "mfu_eval": utilisation(flops, seconds, self.peak.flops)}

    def run_metrics(self, wall_s: float) -> dict[str, Any]:
        """For summary.json: totals since this meter started, over `wall_s` seconds of the run."""
        idle = idle_core_seconds() - self._idle0
        mfu = {"run": utilisation(self.flops.total, wall_s, self.peak.flops)}
        for phase, flops in (("generate", self.flops.generate), ("train", self.flops.train), ("eval", self.flops.eval)):
            mfu[phase] = utilisation(flops, self.seconds[phase], self.peak.flops)
        return {
            "mfu": mfu,
            "flops": {**asdict(self.flops), "total": self.flops.total},
            "phase_seconds": dict(self.seconds),
            "peak": asdict(self.peak),
            "cores": self.cores,
            "idle_core_s": idle,
            "idle_core_fraction": self._fraction(idle, wall_s),
        }


class LoopTrainSettings(MicroBatchSettings, Protocol):
    """The fields of the train section (rollwise.types.train_config.TrainConfig) the FLOP count reads."""

    updates_per_step: int
    kl_coef: float
    lora: object | None  # LoRA adapters: the base weights are frozen


def loop_meter(model: Any, train: LoopTrainSettings, *, overlapped: bool,
               compute_dtypes: Sequence[torch.dtype] = ()) -> LoopMeter | None:
    """A meter for the loop that trains `model` (a Hugging Face causal LM); None (and MFU left out of
    the logs) for an architecture the dense formula cannot count, so that a mixture of experts still
    trains. The peak is this machine's in the fastest of `compute_dtypes` (the engine's and the
    trainer's matmul dtypes; default: the model's): a run that computes in bfloat16 anywhere is held
    to the bfloat16 peak, as GPU MFU is quoted against the bf16 tensor-core peak."""
    try:
        spec = DenseModel.from_hf_config(model.config)
    except ValueError as exc:
        warnings.warn(f"no MFU for this run: {exc}", stacklevel=2)
        return None
    peaks = [machine_peak(dtype) for dtype in dict.fromkeys(compute_dtypes or [next(model.parameters()).dtype])]
    peak = max(peaks, key=lambda p: p.flops)
    return LoopMeter(spec, peak, train, updates=train.updates_per_step, kl_reference=train.kl_coef > 0,
                     skip_zero_advantage=train.skips_zero_advantage(),
                     frozen_weights=train.lora is not None, overlapped=overlapped)

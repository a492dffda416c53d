"""What `rollwise train` checks before it writes anything: a bad input is a one-line ConfigError naming the
field (or the file), and no run directory is left behind.

Order (rollwise.control.train_loop.train): the machine (threads, CUDA, Ray) before torch is told anything;
the run directory's place on disk (writable); the inputs, loaded for real (the model, the task; the agent's
tool-call parser), since a real load is the only check that sees a truncated safetensors file or a binary
task file; the least free space the run needs; only then is the run directory created (`create_run_dir`).
What fails after that, before the run logged anything, takes the directory away again (`discard_unstarted_run`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rollwise.agent.toolcalls import get_parser
from rollwise.config import ConfigError, RunConfig, RunError
from rollwise.model.loading import load_model
from rollwise.scratch import size_text
from rollwise.tasks import make_task
from rollwise.types.task import Problem, Task

CONFIG_FILE = "config.yaml"
# The first logs, plots and TensorBoard events of a run, beyond its checkpoints: the least free space it starts with.
LOG_ROOM_BYTES = 256 * 2**10


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_machine(cfg: RunConfig) -> None:
    """What the config asks of this machine: CPU threads, a CUDA device, Ray. Before torch.set_num_threads,
    which takes threads=100000 and then crashes the process."""
    cores = usable_cores()
    if cfg.threads > cores:
        raise ConfigError(f"threads={cfg.threads}: this process may use {cores} CPU cores; set threads to at most "
                          f"{cores} (0: all of them)")
    if cfg.placement != "ray" and not torch.cuda.is_available():  # placement=ray: the trainer runs on its actor's node
        if cfg.trainer.device == "cuda":
            raise ConfigError("trainer.device=cuda but torch sees no CUDA device on this machine: set "
                              "trainer.device=cpu (or auto), or run where a GPU is")
        if cfg.trainer.cpu_offload:
            raise ConfigError("trainer.cpu_offload=true offloads CUDA ranks' state to CPU memory, and torch sees no "
                              "CUDA device on this machine: set trainer.cpu_offload=false")
    if cfg.placement == "ray":
        try:
            import ray  # noqa: F401  (placement=ray imports it next anyway)
        except ImportError:
            raise ConfigError("placement=ray needs Ray, which is not installed: pip install -e \".[ray]\" "
                              "(or `pip install 'ray[default]'`), or use placement=local") from None


def check_run_dir(run_dir: Path) -> None:
    """The run directory can be created and written: its nearest existing folder takes a file (made and
    removed again, the only way to know on a read-only mount or for root)."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"output_dir: cannot create run directory {run_dir}: {existing} is a file, not a "
                          "directory; set output_dir to a directory path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".rollwise-write-check-", dir=existing)
    except OSError as exc:
        raise ConfigError(f"output_dir: cannot write run directory {run_dir} ({existing}: {exc.strerror or exc}); "
                          "set output_dir to a writable directory") from None
    os.close(fd)
    os.unlink(probe)


@dataclass
class RunInputs:
    """The model and the task, loaded before the run directory exists (their errors write nothing)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    task: Task
    train_problems: list[Problem]
    eval_problems: list[Problem]


def load_inputs(cfg: RunConfig) -> RunInputs:
    """Load the model and build the task; a ConfigError naming `model` or `task` (and the file) if either
    cannot be (rollwise.model.loading and rollwise.tasks raise ValueError naming the file and line)."""
    try:
        model, tokenizer = load_model(cfg.model)
    except (ValueError, OSError) as exc:
        message = " ".join(str(exc).split())
        raise ConfigError(message if repr(cfg.model) in message else f"model={cfg.model}: {message}") from None
    try:
        task = make_task(cfg.task)
        train_problems = task.problems("train")
    except (ValueError, OSError) as exc:
        raise ConfigError(f"task: {' '.join(str(exc).split())}") from None
    if not train_problems:
        raise ConfigError(f"task: {task!r} has no training problems: check task.train_size and the task's source")
    if cfg.agent is not None:  # a name from a registry filled at run time (register_parser): known only now
        try:
            get_parser(cfg.agent.parser)
        except ValueError as exc:
            raise ConfigError(f"agent.parser={cfg.agent.parser}: {exc}") from None
    return RunInputs(model, tokenizer, task, train_problems, task.problems("eval")[: cfg.eval.size])


def check_space(cfg: RunConfig, run_dir: Path, model: PreTrainedModel) -> None:
    """The least a run writes must fit on the run directory's disk: its logs and, when it trains, one copy of
    the weights (in every full-parameter checkpoint; the optimizer state may come on top). A lower bound, so
    it refuses no run that could have worked: a disk that fills later stops the run at a checkpoint, with
    the earlier checkpoints intact (rollwise.train.checkpoint)."""
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    weights = 0
    if cfg.train.steps > 0 and cfg.train.lora is None:  # a LoRA checkpoint holds the adapter only: small
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
    needed = LOG_ROOM_BYTES + weights
    if free < needed:
        what = f"{size_text(weights)} for a checkpoint's weights, " if weights else ""
        raise RunError(f"output_dir: the disk of {run_dir} has {size_text(free)} free; this run needs at least "
                       f"{size_text(needed)} ({what}{size_text(LOG_ROOM_BYTES)} for logs): free space, or set output_dir to "
                       "a directory on another disk")


def create_run_dir(run_dir: Path, config_text: str) -> Path | None:
    """Create the run directory (and any missing parents) and write config.yaml into it. Returns the topmost
    directory this call created (None: the run directory was there already), for discard_unstarted_run."""
    created = None
    for folder in (run_dir, *run_dir.parents):
        if folder.exists():
            break
        created = folder
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / CONFIG_FILE).write_text(config_text)
    except OSError as exc:
        discard_unstarted_run(run_dir, created)
        raise RunError(f"output_dir: cannot write run directory {run_dir} ({exc.strerror or exc}); "
                       "set output_dir to a writable directory with free space") from None
    return created


def discard_unstarted_run(run_dir: Path, created: Path | None) -> None:
    """A run that failed before logging anything leaves no directory: if this run created `run_dir` and it
    holds nothing but config.yaml, remove it and the empty parents created with it."""
    if created is None or not run_dir.is_dir():
        return
    if {p.name for p in run_dir.iterdir()} - {CONFIG_FILE}:
        return  # something was logged: keep it
    (run_dir / CONFIG_FILE).unlink(missing_ok=True)
    folder = run_dir
    while True:
        try:
            folder.rmdir()
        except OSError:
            return
        if folder == created:
            return
        folder = folder.parent

"""Checkpoint and exact resume: model, optimizer, scheduler, policy version, data position, RNG states.

A checkpoint is a directory `step_000012/` holding a loadable Hugging Face model (`model/`), the
optimizer and scheduler state, RNG states and `state.json`. It is written to a temporary folder
and renamed, so a crash mid-save never leaves a half checkpoint that resume would pick up. Its last file is
`manifest.json` (every file's size and xxh3-64 checksum, rollwise.train.checkpoint_manifest): a run resumes
only from a checkpoint that verifies, and `checkpoint.resume=auto` skips damaged ones with a warning.

The optimizer state comes in one of two forms, and either trainer reads both (so a run resumes at
another `trainer.world_size`):
- `optimizer.pt`: the single-process trainer's optimizer and scheduler state (torch.save);
- `dcp/` + `scheduler.pt`: the sharded trainer's model and optimizer, every rank's shard, written
  with torch.distributed.checkpoint (rollwise.train.rank), which reshards on load.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from rollwise.config import RunError
from rollwise.scratch import out_of_space, size_text
from rollwise.train.checkpoint_manifest import (
    RNG_FILE, STATE_FILE, CheckpointError, reading, state_record, verify_checkpoint, write_manifest,
)
from rollwise.train.lora import is_lora, load_adapter

OPTIMIZER_FILE = "optimizer.pt"
PARTIAL_PREFIX = "."  # a checkpoint being written: `.step_000012.XXXX`, renamed to `step_000012` when whole
DCP_DIR = "dcp"
SCHEDULER_FILE = "scheduler.pt"


class CheckpointedTrainer(Protocol):
    """What a checkpoint saves and restores of a trainer: GRPOTrainer (rollwise.train.trainer), which calls
    save_checkpoint / load_checkpoint with itself. Named by its shape, so this module imports nothing of the
    trainer and the trainer imports it without a circle."""

    model: nn.Module  # a Hugging Face model (save_pretrained), LoRA-wrapped with train.lora
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    version: int


def write_checkpoint(run_dir: Path, step: int, version: int, extra: dict[str, Any], keep_last: int,
                     write_trainer: Callable[[Path], None]) -> Path:
    """A checkpoint directory: `write_trainer(tmp)` writes the trainer's files; RNG and state.json
    are added here, the manifest last, then the folder is renamed into place and old checkpoints pruned."""
    record = state_record(step, version, extra)  # a value resume would refuse is refused before GBs are written
    ckpt_root = run_dir / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    for unfinished in ckpt_root.glob(f"{PARTIAL_PREFIX}*"):  # a save killed midway: never resumable, often GBs
        shutil.rmtree(unfinished, ignore_errors=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{PARTIAL_PREFIX}{final.name}.", dir=ckpt_root))
    try:
        write_trainer(tmp)
        torch.save(
            {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
            tmp / RNG_FILE,
        )
        (tmp / STATE_FILE).write_text(json.dumps(record, indent=2))
        write_manifest(tmp)  # after every other file (the ranks' shards included): it vouches for them all
    except KeyboardInterrupt:
        # A stop (Ctrl-C, SIGTERM) can land while sharded ranks, other processes, still write into `tmp`: removing
        # it under them would fail their write. It is hidden (never resumed from) and the next save sweeps it.
        raise
    except BaseException as exc:  # a full disk, a failed write: no half checkpoint stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        if out_of_space(exc):
            raise RunError(_no_space_message(ckpt_root, final.name)) from exc
        raise
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in sorted(ckpt_root.glob("step_*"))[:-keep_last]:
        shutil.rmtree(old)
    return final


def _no_space_message(ckpt_root: Path, name: str) -> str:
    free = shutil.disk_usage(ckpt_root).free
    previous = latest_checkpoint(ckpt_root.parent)
    size = f"; {previous.name} takes {size_text(_tree_bytes(previous))}" if previous is not None else ""
    kept = (f"{previous.name} and the checkpoints before it are intact: free space, then rerun the same command with "
            "checkpoint.resume=auto" if previous is not None else
            "no earlier checkpoint exists: free space and start again")
    return (f"checkpoint {name} could not be written to {ckpt_root}: the disk is full ({size_text(free)} free{size}). "
            f"The partial checkpoint was removed; {kept} (checkpoint.keep_last=1 keeps fewer, "
            "output_dir=... puts the run on another disk).")


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def save_checkpoint(run_dir: Path, trainer: CheckpointedTrainer, tokenizer, step: int, extra: dict[str, Any], keep_last: int,
                    also: Callable[[Path], None] | None = None) -> Path:
    """`step` is the number of completed training steps; resume starts at `step`. `also(tmp)` writes the trainer's
    other files (the critic of train.advantage=gae: rollwise.train.critic) into the checkpoint, before its manifest."""

    def write(tmp: Path) -> None:
        trainer.model.save_pretrained(tmp / "model", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "model")
        torch.save(
            {"optimizer": trainer.optimizer.state_dict(), "scheduler": trainer.scheduler.state_dict()},
            tmp / OPTIMIZER_FILE,
        )
        if also is not None:
            also(tmp)

    return write_checkpoint(run_dir, step, trainer.version, extra, keep_last, write)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint folder (whole or not: see whole_checkpoint)."""
    found = sorted((run_dir / "checkpoints").glob("step_*"))
    return found[-1] if found else None


def whole_checkpoint(run_dir: Path, warn: Callable[[str], None]) -> Path | None:
    """The newest checkpoint that verifies (rollwise.train.checkpoint_manifest.verify_checkpoint); each newer,
    damaged one is skipped with a warning naming the file. None: the run has no checkpoint. Checkpoints that
    are all damaged: a RunError saying so, since starting over would silently throw the run away."""
    found = sorted((run_dir / "checkpoints").glob("step_*"), reverse=True)
    damaged: list[CheckpointError] = []
    for ckpt in found:
        try:
            verify_checkpoint(ckpt)
        except CheckpointError as exc:
            damaged.append(exc)
            warn(f"checkpoint {ckpt.name} is damaged and is skipped: {exc.file} {exc.problem}")
            continue
        return ckpt
    if damaged:
        names = "; ".join(f"{exc.ckpt.name}: {exc.file}" for exc in damaged)
        raise RunError(f"no whole checkpoint left in {run_dir / 'checkpoints'} to resume from (damaged: {names}): "
                       f"move {run_dir} away and start the run again, or resume from a copy of an intact checkpoint "
                       "with checkpoint.resume=PATH")
    return None


def load_rng_and_state(ckpt: Path) -> dict[str, Any]:
    """Verify the checkpoint (every trainer's load starts here), restore this process's RNG states;
    return state.json."""
    state = verify_checkpoint(ckpt)
    with reading(ckpt, RNG_FILE):
        rng = torch.load(ckpt / RNG_FILE, weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
    return state


def optimizer_state_by_name(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """A torch optimizer state dict (parameters numbered in model.parameters() order, trainable
    only, as GRPOTrainer builds its optimizer) keyed by parameter names instead: the form
    torch.distributed.checkpoint.state_dict reads and writes."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    return {
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def load_checkpoint(ckpt: Path, trainer: CheckpointedTrainer) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler, policy version and RNG states; return state.json."""
    state = load_rng_and_state(ckpt)
    if is_lora(trainer.model):  # train.lora: model/ holds the adapter only (the base is the run's model)
        load_adapter(trainer.model, ckpt / "model")
    else:
        _load_model_weights(ckpt, trainer.model)
    if (ckpt / OPTIMIZER_FILE).exists():
        with reading(ckpt, OPTIMIZER_FILE):
            opt = torch.load(ckpt / OPTIMIZER_FILE, weights_only=False)
        trainer.optimizer.load_state_dict(opt["optimizer"])
        trainer.scheduler.load_state_dict(opt["scheduler"])
    else:  # written by the sharded trainer: its optimizer shards, gathered by DCP into this process
        _load_sharded_optimizer(ckpt, trainer)
    trainer.version = int(state["policy_version"])
    return state


def _load_model_weights(ckpt: Path, model: nn.Module) -> None:
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted((ckpt / "model").glob("*.safetensors")):
        with reading(ckpt, shard.relative_to(ckpt).as_posix()):
            weights.update(load_file(shard))
    # strict=False only for tied weights that safetensors stores once; anything else missing is an error.
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"checkpoint {ckpt} does not match the model: missing {missing}, unexpected {unexpected}")


def load_dcp_optimizer(ckpt: Path, dcp_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer state of a sharded trainer's `ckpt/dcp_dir` (every rank's shard), gathered by DCP into this
    process's `optimizer` (the policy's `dcp/`, the critic's `critic/dcp/`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    optim_sd = get_optimizer_state_dict(model, optimizer)
    with reading(ckpt, dcp_dir):
        dcp.load({"optim": optim_sd}, checkpoint_id=ckpt / dcp_dir)
    set_optimizer_state_dict(model, optimizer, optim_sd)


def _load_sharded_optimizer(ckpt: Path, trainer: CheckpointedTrainer) -> None:
    load_dcp_optimizer(ckpt, DCP_DIR, trainer.model, trainer.optimizer)
    with reading(ckpt, SCHEDULER_FILE):
        scheduler = torch.load(ckpt / SCHEDULER_FILE, weights_only=False)["scheduler"]
    trainer.scheduler.load_state_dict(scheduler)

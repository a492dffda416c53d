"""Checkpoint and exact resume: model, optimizer, scheduler, policy version, data position, RNG states.

A checkpoint is a directory `step_000012/` holding a loadable Hugging Face model (`model/`), the
optimizer and scheduler state, RNG states and `state.json`. It is written to a temporary folder
and renamed, so a crash mid-save never leaves a half checkpoint that resume would pick up.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from rollwise.train.trainer import GRPOTrainer

STATE_FILE = "state.json"


def save_checkpoint(run_dir: Path, trainer: GRPOTrainer, tokenizer, step: int, extra: dict[str, Any], keep_last: int) -> Path:
    """`step` is the number of completed training steps; resume starts at `step`."""
    ckpt_root = run_dir / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=ckpt_root))
    trainer.model.save_pretrained(tmp / "model", safe_serialization=True)
    tokenizer.save_pretrained(tmp / "model")
    torch.save(
        {"optimizer": trainer.optimizer.state_dict(), "scheduler": trainer.scheduler.state_dict()},
        tmp / "optimizer.pt",
    )
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        tmp / "rng.pt",
    )
    (tmp / STATE_FILE).write_text(
        json.dumps({"step": step, "policy_version": trainer.version, **extra}, indent=2)
    )
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in sorted(ckpt_root.glob("step_*"))[:-keep_last]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted((run_dir / "checkpoints").glob("step_*"))
    return found[-1] if found else None


def load_checkpoint(ckpt: Path, trainer: GRPOTrainer) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler, policy version and RNG states; return state.json."""
    if not (ckpt / STATE_FILE).exists():
        raise FileNotFoundError(f"{ckpt} is not a rollwise checkpoint (no {STATE_FILE})")
    state = json.loads((ckpt / STATE_FILE).read_text())
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted((ckpt / "model").glob("*.safetensors")):
        weights.update(load_file(shard))
    # strict=False only for tied weights that safetensors stores once; anything else missing is an error.
    missing, unexpected = trainer.model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if getattr(trainer.model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"checkpoint {ckpt} does not match the model: missing {missing}, unexpected {unexpected}")
    opt = torch.load(ckpt / "optimizer.pt", weights_only=False)
    trainer.optimizer.load_state_dict(opt["optimizer"])
    trainer.scheduler.load_state_dict(opt["scheduler"])
    rng = torch.load(ckpt / "rng.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    trainer.version = int(state["policy_version"])
    return state

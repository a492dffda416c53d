"""What every placement returns, and the pieces placements share.

A placement decides where the trainer, the engines and the reward run. `place(request)` returns a
`Placement`: a Trainer, a RolloutBackend, the WeightSender that carries the trainer's weights to
that backend, the scorer, and the read-only engine view the loop's metrics use. The training loop
holds these and never asks which placement made them (rollwise.types.contracts).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from rollwise.config import ConfigError, RunConfig
from rollwise.types.train_config import TrainerConfig
from rollwise.types.contracts import RolloutBackend, Scorer, Trainer
from rollwise.reward.pool import RewardFnError
from rollwise.reward.pool_scorer import ScorerWithClose, make_scorer
from rollwise.sync.senders import WeightSender
from rollwise.types.task import Problem, Task
from rollwise.train.distributed import resolve_device
from rollwise.train.sharded import ShardedTrainer
from rollwise.train.torchrun import TorchrunRankGroup, launched_rank
from rollwise.train.trainer import GRPOTrainer

class EngineView(Protocol):
    """What the loop reads from 'the engine' for metrics and plots, wherever it runs."""

    name: str
    max_num_seqs: int
    timeline: list[tuple[float, int]]  # (monotonic time, running sequences); appended as the engine steps


@dataclass
class PlaceRequest:
    """Everything a placement needs to start a run's parts."""

    cfg: RunConfig
    model: nn.Module  # this process's copy: the local trainer's model, else the layout of the remote one
    tokenizer: Any
    fingerprint: str  # the tokenizer's (invariant 1: engines and trainer tokenize identically)
    problems: dict[str, Problem]
    task: Task
    resume_dir: Path | None = None
    # Called with a resumed checkpoint's state.json before any engine starts (raises ConfigError to stop).
    check_resume: Callable[[dict[str, Any]], None] | None = None

    @property
    def eos_ids(self) -> list[int] | None:
        eos = self.tokenizer.eos_token_id
        return [eos] if eos is not None else None


@dataclass
class Placement:
    trainer: Trainer
    backend: RolloutBackend
    sender: WeightSender
    scorer: Scorer  # the reward layer: in this process, or reward actors
    engine: EngineView
    description: str  # one line for the console
    resumed: dict[str, Any] | None = None  # the checkpoint's state.json when the run resumed
    # Extra teardown after backend.close() (engine-owned files, actors, pool detach).
    on_close: list[Callable[[], None]] = field(default_factory=list)

    def push_weights(self) -> None:
        """The trainer's current weights to every engine, through the one checked path."""
        self.backend.load_weights(self.sender.update(self.trainer))

    def close(self) -> None:
        try:
            self.backend.close()
        finally:
            for fn in self.on_close:
                fn()
            if isinstance(self.trainer, ShardedTrainer):
                self.trainer.close()  # its rank processes


def local_trainer(req: PlaceRequest) -> GRPOTrainer | ShardedTrainer:
    """The trainer in this process, on `req.model`; FSDP2 ranks started from here (each a process with
    a copy of `req.model`, which stays the engines' starting point) when the trainer needs them
    (needs_ranks), or joined when torchrun started them."""
    tok = req.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if needs_ranks(req.cfg.trainer):
        launched = launched_rank(os.environ, req.cfg)
        if launched is not None:  # torchrun started the ranks: this process is rank 0, the others follow
            group = TorchrunRankGroup(launched, req.model, req.cfg, pad_id)
            return ShardedTrainer.over(group, req.cfg.train, tokenizer=tok)
        return ShardedTrainer(req.model, req.cfg.train, req.cfg.trainer, pad_token_id=pad_id,
                              temperature=req.cfg.rollout.temperature or 1.0, tokenizer=tok,
                              threads=req.cfg.threads)
    return GRPOTrainer(req.model, req.cfg.train, pad_token_id=pad_id, temperature=req.cfg.rollout.temperature or 1.0,
                       tokenizer=tok)


def needs_ranks(trainer: TrainerConfig) -> bool:
    """FSDP2 ranks (rollwise.train.sharded) for more than one rank, for a CUDA device (one rank on
    NCCL), or for what only FSDP2 offers (bf16 mixed precision, CPU offload); else GRPOTrainer here."""
    return (trainer.world_size > 1 or resolve_device(trainer.device) == "cuda"
            or trainer.mixed_precision != "none" or trainer.cpu_offload)


def local_scorer(req: PlaceRequest) -> ScorerWithClose:
    """Scoring on this machine: the reward pool's worker processes (`reward.executor: pool`), or this process
    (`inprocess`). Built first, so a `reward.function` that cannot be loaded stops the run before anything starts."""
    try:
        return make_scorer(req.problems, req.task, req.cfg.task.model_dump(mode="json", exclude_unset=True),
                           req.cfg.reward)
    except RewardFnError as exc:
        raise ConfigError(f"reward.function: {exc}") from None


def placed_with_scorer(req: PlaceRequest, place: Callable[[PlaceRequest, ScorerWithClose], Placement]) -> Placement:
    """`place(req, scorer)` with the local scorer built first; the scorer's workers are closed if placing fails."""
    scorer = local_scorer(req)
    try:
        return place(req, scorer)
    except BaseException:
        scorer.close()
        raise


def resume(trainer: Trainer, req: PlaceRequest) -> dict[str, Any] | None:
    """Load the checkpoint into the trainer (before the engines start from its weights)."""
    if req.resume_dir is None:
        return None
    state = trainer.load_checkpoint(req.resume_dir)
    if state.get("tokenizer_fingerprint") not in (None, req.fingerprint):
        raise ConfigError(f"checkpoint {req.resume_dir} was trained with a different tokenizer (fingerprint mismatch)")
    if req.check_resume is not None:
        req.check_resume(state)
    if isinstance(trainer, ShardedTrainer):  # the engines start from req.model: give it the resumed weights
        req.model.load_state_dict(trainer.weights())
    return state

"""`pool.url`: the trainer and the reward in this process, generation in a shared engine pool
(`rollwise serve pool`), driven over HTTP by a PoolWorker (rollwise.control.pool_backend)."""

from __future__ import annotations

from rollwise.control.placement.base import Placement, PlaceRequest, local_trainer, placed_with_scorer, resume
from rollwise.control.pool_backend import attach_to_pool
from rollwise.reward.pool_scorer import ScorerWithClose
from rollwise.sync.senders import in_process_sender


def place_pool(req: PlaceRequest) -> Placement:
    return placed_with_scorer(req, _place)


def _place(req: PlaceRequest, scorer: ScorerWithClose) -> Placement:
    trainer = local_trainer(req)
    resumed = resume(trainer, req)
    # Attaching pushes the trainer's current weights (checked and committed whole by the pool).
    sender = in_process_sender(req.fingerprint, req.cfg.train.lora)  # train.lora: the job attaches as a LoRA job
    attached = attach_to_pool(req.cfg, req.model, req.tokenizer, fingerprint=req.fingerprint,
                              policy_version=trainer.version,
                              initial=sender.update(trainer) if req.cfg.train.lora is not None else None)
    return Placement(trainer, attached.worker, sender, scorer, attached.view,
                     attached.description, resumed, on_close=[attached.detach, scorer.close])

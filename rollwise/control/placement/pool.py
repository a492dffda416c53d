"""`pool.url`: the trainer and the reward in this process, generation in a shared engine pool
(`rollwise serve pool`), driven over HTTP by a PoolWorker (rollwise.control.pool_backend)."""

from __future__ import annotations

from rollwise.control.placement.base import Placement, PlaceRequest, local_scorer, local_trainer, resume
from rollwise.control.pool_backend import attach_to_pool
from rollwise.sync.senders import in_process_sender


def place_pool(req: PlaceRequest) -> Placement:
    trainer = local_trainer(req)
    resumed = resume(trainer, req)
    # Attaching pushes the trainer's current weights (checked and committed whole by the pool).
    sender = in_process_sender(req.fingerprint, req.cfg.train.lora)  # train.lora: the job attaches as a LoRA job
    attached = attach_to_pool(req.cfg, req.model, req.tokenizer, fingerprint=req.fingerprint,
                              policy_version=trainer.version,
                              initial=sender.update(trainer) if req.cfg.train.lora is not None else None)
    return Placement(trainer, attached.worker, sender, local_scorer(req), attached.view,
                     attached.description, resumed, on_close=[attached.detach])

"""`pool.url`: the trainer and the reward in this process, generation in a shared engine pool
(`rollwise serve pool`), driven over HTTP by a PoolWorker (rollwise.control.pool_backend)."""

from __future__ import annotations

from rollwise.control.placement.base import Placement, PlaceRequest, local_score, local_trainer, resume
from rollwise.control.pool_backend import attach_to_pool
from rollwise.sync.senders import InProcessSender


def place_pool(req: PlaceRequest) -> Placement:
    trainer = local_trainer(req)
    resumed = resume(trainer, req)
    # Attaching pushes the trainer's current weights (checked and committed whole by the pool).
    attached = attach_to_pool(req.cfg, req.model, req.tokenizer, fingerprint=req.fingerprint,
                              policy_version=trainer.version)
    return Placement(trainer, attached.worker, InProcessSender(req.fingerprint), local_score(req), attached.view,
                     attached.description, resumed, on_close=[attached.detach])

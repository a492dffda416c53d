"""`placement: ray`: the trainer, the engines and the reward workers as Ray actors
(rollwise.control.ray.placement); weights go from the trainer actor to the engine actors through
Ray's object store, or with `sync.sender: collective` as one gloo/NCCL broadcast from this process
(rollwise.control.ray.fleet_collective)."""

from __future__ import annotations

from rollwise.control.placement.base import Placement, PlaceRequest, resume
from rollwise.control.ray.placement import place_on_ray, session, start_trainer
from rollwise.control.ray.reward import start_reward_workers
from rollwise.sync.senders import CollectiveSender, ObjectStoreSender


def place_ray(req: PlaceRequest) -> Placement:
    cfg = req.cfg
    trainer = start_trainer(cfg, fingerprint=req.fingerprint, tokenizer=req.tokenizer)
    try:
        resumed = resume(trainer, req)
        scorer = start_reward_workers(cfg)
        # The driver's model is only the layout of the trainer actor's (same spec): names, shapes, ties.
        kind = CollectiveSender if cfg.weight_sender == "collective" else ObjectStoreSender
        sender = kind(req.fingerprint, req.model.state_dict())
        fleet, description, close = place_on_ray(cfg, fingerprint=req.fingerprint, eos_ids=req.eos_ids,
                                                 initial=sender.update(trainer))
    except BaseException:
        session(cfg).close()
        raise
    return Placement(trainer, fleet, sender, scorer, fleet.view, description, resumed, on_close=[close])

"""The sending side of the one weight path: trainer weights -> a `WeightUpdate` for the backend.

Placement picks the sender from the run's configuration (rollwise.control.placement):

    in-process    placement: local, or pool.url   the trainer's tensors as views (zero-copy); a pool
                                                   job's PoolWorker then ships them over HTTP
    object store  placement: ray                   an ObjectRef: engine actors fetch the weights from
                                                   Ray's object store, never through the driver
    collective    placement: ray,                  the tensors as they are: the fleet broadcasts them
                  sync.sender: collective          from the driver to every engine actor at once over
                                                   torch.distributed (rollwise.sync.distributed: gloo on
                                                   CPU, NCCL on GPU; rollwise.control.ray.fleet_collective)

Every update lands through WeightReceiver.commit on the engine side: checked whole, then applied.
LoRA adapter-only updates (rollwise.sync.adapters) go in process; the collective transport can carry them
(DistributedSender.push(adapter=)), but train.lora still refuses placement=ray: the fleet does not send them yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from rollwise.types.contracts import Trainer
from rollwise.types.train_config import LoraConfig
from rollwise.sync.adapters import AdapterSender
from rollwise.types.weight_update import WeightUpdate
from rollwise.types.bucket_layout import build_manifest

if TYPE_CHECKING:
    from ray import ObjectRef


class WeightSender(Protocol):
    def update(self, trainer: Trainer) -> WeightUpdate:
        """The trainer's current weights as one update stamped with its version."""


class InProcessSender:
    def __init__(self, tokenizer_fingerprint: str) -> None:
        self.tokenizer_fingerprint = tokenizer_fingerprint

    def update(self, trainer: Trainer) -> WeightUpdate:
        return WeightUpdate.of_state(trainer.weights(), trainer.version, self.tokenizer_fingerprint)


def in_process_sender(tokenizer_fingerprint: str, lora: LoraConfig | None) -> WeightSender:
    """The sender of a trainer in this process: its adapter only under train.lora (rollwise.sync.adapters),
    else its whole weights as views."""
    return InProcessSender(tokenizer_fingerprint) if lora is None else AdapterSender(tokenizer_fingerprint, lora)


class ObjectStoreSender:
    """Weights through Ray's object store. The manifest is built from `layout`, this process's copy
    of the same model spec (only names, shapes, dtypes and ties are read), so the weights themselves
    never pass through here when the trainer is an actor."""

    def __init__(self, tokenizer_fingerprint: str, layout: Mapping[str, Tensor]) -> None:
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.layout = {name: t.detach() for name, t in layout.items()}

    def update(self, trainer: Trainer) -> WeightUpdate:
        import ray

        manifest = build_manifest(self.layout, trainer.version, self.tokenizer_fingerprint, bucket_mb=None,
                                  checksum=False)
        payload: Mapping[str, Tensor] | ObjectRef = trainer.weights()
        if isinstance(payload, Mapping):  # a trainer in this process: put it in the store once for all engines
            payload = ray.put(dict(payload))
        return WeightUpdate(manifest, payload)


class CollectiveSender(ObjectStoreSender):
    """Weights for the fleet's broadcast (sync.sender=collective): the same manifest as the object
    store's, with the payload left as the trainer gives it. Tensors in this process (the sharded
    trainer's gathered weights) are broadcast from here as they are; a trainer actor's ObjectRef is
    fetched here once and broadcast (the driver is rank 0 of the weight group)."""

    def update(self, trainer: Trainer) -> WeightUpdate:
        manifest = build_manifest(self.layout, trainer.version, self.tokenizer_fingerprint, bucket_mb=None,
                                  checksum=False)
        return WeightUpdate(manifest, trainer.weights())


"""Adapter-only weight sync (train.lora): the trainer pushes its LoRA adapter, not the model.

An adapter update is an ordinary `WeightUpdate` (manifest + checksummed buckets, versioned) whose
manifest carries an `AdapterSpec` (name, rank, alpha, targets; rollwise.types.weights, which refuses
a rank below 1, a non-finite or absurd alpha and a name that is not a plain path component): every
transport moves it unchanged, and `WeightReceiver.check`/`commit` check and load it as an adapter
(rollwise.engine.weight_receiver, with rollwise.engine.adapter_checks). The checks are the full-weight ones (rollwise.types.weight_checks: version only
moves forward, same tokenizer, every tensor's shape and dtype fit the engine's base projection,
checksums, every bucket arrived, finite values), then the engine's `load_adapter(spec, tensors,
version)` loads it without touching the base weights. A rejected adapter leaves the engine serving
what it served before, and a pool stores nothing of it.

The tensors are named by the base model's modules: `model.layers.0.self_attn.q_proj.lora_A.weight`
[rank, in] and `....lora_B.weight` [out, rank] (rollwise.train.lora.adapter_state).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from rollwise.types.train_config import LoraConfig
from rollwise.types.contracts import Trainer
from rollwise.types.weight_update import WeightUpdate
from rollwise.types.bucket_layout import build_manifest
from rollwise.types.weights import AdapterSpec

# The name a single LoRA run's policy adapter is pushed under (it serves requests naming no adapter).
POLICY_ADAPTER = "policy"


def adapter_update(state: Mapping[str, Tensor], spec: AdapterSpec, version: int, tokenizer_fingerprint: str,
                   *, checksum: bool = False, bucket_mb: float | None = None) -> WeightUpdate:
    """An update of adapter `state` (detached views; checksum for transports that move bytes)."""
    tensors = {name: t.detach() for name, t in state.items()}
    manifest = build_manifest(tensors, version, tokenizer_fingerprint, bucket_mb, checksum=checksum)
    return WeightUpdate(manifest.model_copy(update={"adapter": spec}), tensors)


class AdapterSender:
    """The WeightSender of a train.lora trainer: its adapter as the engines' default policy adapter. Built
    from the run's `train.lora` section (the one the trainer wrapped its model with), so nothing asks the
    trainer what it is."""

    def __init__(self, tokenizer_fingerprint: str, lora: LoraConfig, name: str = POLICY_ADAPTER, *,
                 default: bool = True) -> None:
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.lora = lora
        self.name = name
        self.default = default

    def spec(self) -> AdapterSpec:
        cfg = self.lora
        return AdapterSpec(name=self.name, rank=cfg.rank, alpha=cfg.alpha, target_modules=tuple(cfg.target_modules),
                           default=self.default)

    def update(self, trainer: Trainer) -> WeightUpdate:
        return adapter_update(trainer.weights(), self.spec(), trainer.version, self.tokenizer_fingerprint)

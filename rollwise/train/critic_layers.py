"""train.gae.critic_trainable_layers: a critic that trains only its top k decoder layers (trlx's num_layers_unfrozen).

The value model starts as a copy of the policy's decoder (rollwise.train.critic). With k set, its embedding and its
lower layers keep the policy's initial weights: `requires_grad_(False)` on them, so autograd builds no graph and keeps
no activations below the first trainable layer (their forward is all they cost), and the critic's optimizer, its
gradient clipping and its checkpointed optimizer state cover the trainable parameters only. The sharded trainer
shards the frozen layers as it shards the others (FSDP2 units whose parameters take no gradient).

A checkpoint records k (`critic/trainable_layers.json`), since its optimizer state is over that k's parameters: a
resume with another k is refused naming the field (a checkpoint without the file was written with every layer
trained).
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from rollwise.config import ConfigError, RunError

FIELD = "train.gae.critic_trainable_layers"
MARKER_FILE = "trainable_layers.json"  # in a checkpoint's critic/


def check_trainable_layers(k: int | None, n_layers: int) -> None:
    """A ConfigError naming the field when k is more than the model's `n_layers` decoder layers (the config alone
    bounds it below: ge=1). Called where the critic is built, and by the sharded trainer before any rank starts."""
    if k is not None and not 1 <= k <= n_layers:
        raise ConfigError(f"{FIELD}={k}, but the model has {n_layers} decoder layers: set it to 1..{n_layers} "
                          "(or null to train every layer)")


def freeze_lower_layers(backbone: nn.Module, k: int | None) -> None:
    """With k set: freeze the embedding and every decoder layer below the top `k` (the final norm stays trainable),
    after check_trainable_layers (nothing frozen when it refuses)."""
    if k is None:
        return
    layers = backbone.layers
    check_trainable_layers(k, len(layers))
    for module in (backbone.embed_tokens, *layers[:len(layers) - k]):
        module.requires_grad_(False)


def write_marker(folder: Path, k: int | None) -> None:
    (folder / MARKER_FILE).write_text(json.dumps({FIELD: k}))


def check_marker(folder: Path, k: int | None) -> None:
    """A RunError naming the field when the checkpoint's critic was trained with another k (its optimizer state is
    over other parameters); nothing is loaded before this check."""
    path = folder / MARKER_FILE
    saved = json.loads(path.read_text())[FIELD] if path.exists() else None
    if saved != k:
        raise RunError(f"checkpoint {folder.parent}: its critic was trained with {FIELD}={_show(saved)}, this run "
                       f"sets {_show(k)}: resume with {FIELD}={_show(saved)} (its optimizer state covers those "
                       "layers' parameters only)")


def _show(k: int | None) -> str:
    return "null" if k is None else str(k)

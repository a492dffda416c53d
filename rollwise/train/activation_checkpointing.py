"""Activation checkpointing of the decoder layers that also works over a KV cache (train.gradient_checkpointing).

Each decoder layer's forward runs under torch.utils.checkpoint (non-reentrant): its activations are
freed after the forward and recomputed in the backward, so a micro-batch keeps one hidden state per
layer and token instead of every intermediate (about 20x less for a Llama-shaped layer).

Hugging Face's own switch (gradient_checkpointing_enable) drops the KV cache, because the recompute
would append a layer's keys and values to the cache a second time. The trainer's shared-prompt
forwards (rollwise.train.logprobs.shared_prompt_logprobs, rollwise.train.packing) need that cache:
the prompt runs once and the responses attend to its keys/values. Here the recompute first puts
the cache back as it was when the layer ran in the forward (the cache layers' tensors are replaced,
never written in place, by DynamicLayer.update, so keeping references is enough), and the layer
then recomputes exactly what it computed. The forward is patched on each layer instance, inside
the module's hooks (FSDP2's unshard runs before the layer's backward, and so before its recompute),
and parameter names do not change (checkpoints, weight pushes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rollwise.train.logprobs import backbone_of

__all__ = ["CheckpointedForward", "enable_activation_checkpointing"]


def _cache_state(cache: Any) -> list[dict[str, Any]] | None:
    """References to every cache layer's attributes (keys, values, initialised flag), or None for no cache."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return None
    return [dict(vars(layer)) for layer in layers]


def _restore(cache: Any, state: list[dict[str, Any]] | None) -> None:
    if state is None:
        return
    del cache.layers[len(state):]  # layers a lazily grown cache added after the snapshot
    for layer, attrs in zip(cache.layers, state):
        vars(layer).clear()
        vars(layer).update(attrs)


class CheckpointedForward:
    """A decoder layer's forward under non-reentrant activation checkpointing, the KV cache it is given
    (`past_key_values`) restored before the recompute. Without autograd (reference model, evaluation)
    it is the plain forward."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        cache = kwargs.get("past_key_values")
        state = _cache_state(cache)

        def run(*args: Any, **kwargs: Any) -> Any:
            _restore(cache, state)  # a no-op in the forward; in the backward's recompute, the forward's cache
            return self.forward(*args, **kwargs)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)


def enable_activation_checkpointing(model: nn.Module) -> int:
    """Checkpoint every decoder layer of `model` (idempotent); returns how many layers are checkpointed."""
    layers = backbone_of(model).layers
    for layer in layers:
        if not isinstance(layer.forward, CheckpointedForward):
            layer.forward = CheckpointedForward(layer.forward)
    return len(layers)

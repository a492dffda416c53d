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

Selective checkpointing (train.gradient_checkpointing: selective) keeps what is costly to recompute, the
outputs of the matmuls and of attention, and recomputes the rest of the layer from them in the backward:
the norms (whose float32 copies are the largest saved tensors of a Llama layer under bfloat16 autocast),
the autocast casts of inputs and weights, rotary, SiLU and the key/value head expansion. It is torch's
selective activation checkpointing (create_selective_checkpoint_contexts, the same op policy torchtitan's
"op" mode uses, without its every-other-matmul skip): the recompute is all elementwise. Measured on the
default run (2-core CPU, bfloat16): 1.5 GiB off a step's peak for 12-23% more train time (full: 2 GiB, ~1/3);
elementwise ops are a larger share of a CPU step than of a GPU one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from rollwise.train.logprobs import backbone_of
from rollwise.types.train_config import CheckpointingMode

__all__ = ["CheckpointedForward", "autocast_cache_enabled", "checkpoint_layer", "enable_activation_checkpointing"]

_aten = torch.ops.aten
# The ops whose outputs selective checkpointing keeps: every matmul a linear layer lowers to, and each
# scaled-dot-product-attention kernel (CPU flash, CUDA flash / memory-efficient / cuDNN). Looked up by
# name: a build without a kernel (no CUDA) has no such op.
_KEPT_OPS = frozenset(
    getattr(_aten, name).default
    for name in ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention")
    if hasattr(_aten, name))


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_keep_matmuls)


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
    it is the plain forward. `selective`: the matmuls' and attention's outputs are kept, the rest recomputed."""

    def __init__(self, forward: Callable[..., Any], selective: bool = False) -> None:
        self.forward = forward
        self.selective = selective

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        cache = kwargs.get("past_key_values")
        state = _cache_state(cache)

        def run(*args: Any, **kwargs: Any) -> Any:
            _restore(cache, state)  # a no-op in the forward; in the backward's recompute, the forward's cache
            return self.forward(*args, **kwargs)

        if self.selective:
            return checkpoint(run, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)
        return checkpoint(run, *args, use_reentrant=False, **kwargs)


def autocast_cache_enabled(mode: CheckpointingMode) -> bool:
    """Whether the forward's torch.autocast may cache its weight casts (`cache_enabled`). Not under selective
    checkpointing: its recompute must replay the forward's ops one for one, and a cast the forward took from
    autocast's cache (filled by an earlier use of the weight, e.g. the shared prompt's forward) would run again
    in the recompute. Each use then casts the weight itself."""
    return mode != "selective"


def checkpoint_layer(layer: nn.Module, mode: CheckpointingMode) -> None:
    """Put `layer`'s forward under checkpointing as train.gradient_checkpointing says (true: the whole
    layer recomputed; "selective"); idempotent, and a falsy mode leaves the layer alone."""
    if mode and not isinstance(layer.forward, CheckpointedForward):
        layer.forward = CheckpointedForward(layer.forward, selective=mode == "selective")


def enable_activation_checkpointing(model: nn.Module, mode: CheckpointingMode = True) -> int:
    """Checkpoint every decoder layer of `model` (idempotent); returns how many layers are checkpointed."""
    layers = backbone_of(model).layers
    for layer in layers:
        checkpoint_layer(layer, mode)
    return len(layers)

"""Random LoRA adapters for the benchmarks that push or serve them (bench sync, bench mux): every projection
of a model targeted, at a given rank, without PEFT (the bytes and the engine's work are what is measured,
not what the adapter says)."""

from __future__ import annotations

import torch
from torch import nn

from rollwise.engine.reference.lora import projection_targets
from rollwise.types.weights import AdapterSpec

EVERY_PROJECTION = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(model: nn.Module, rank: int, *, name: str = "policy", default: bool = True,
                   seed: int = 0) -> tuple[dict[str, torch.Tensor], AdapterSpec]:
    """A rank-`rank` adapter on every projection of `model` (an HF model or a ReferenceEngine's), alpha 2 x rank,
    with small random A and B (both nonzero, so it changes the outputs), and its spec."""
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for module, (out_dim, in_dim) in projection_targets(model).items():
        state[f"{module}.lora_A.weight"] = torch.randn(rank, in_dim, generator=generator) * 0.01
        state[f"{module}.lora_B.weight"] = torch.randn(out_dim, rank, generator=generator) * 0.01
    spec = AdapterSpec(name=name, rank=rank, alpha=2.0 * rank, default=default, target_modules=EVERY_PROJECTION)
    return state, spec

"""Test helper: a LoRA adapter that changes a model's outputs. Imported by the LoRA test modules; not a
test module itself."""

from __future__ import annotations

import torch
from torch import nn

from rollwise.types.train_config import LoraConfig
from rollwise.train.lora import adapter_state, wrap_lora


def random_adapter(base: nn.Module, cfg: LoraConfig, seed: int) -> dict[str, torch.Tensor]:
    """A trained-looking adapter on `base`: PEFT's init (B = 0) with B randomised so it changes the outputs.
    PEFT wraps `base` in place: pass a model this test does not use afterwards."""
    torch.manual_seed(seed)
    peft_model = wrap_lora(base, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return {k: v.detach().clone() for k, v in adapter_state(peft_model).items()}

"""LoRA RL (`train.lora: {rank, alpha, target_modules, dropout}`): PEFT adapters on the policy.

The base weights are frozen; only the adapters' parameters reach the optimizer (GRPOTrainer builds
it from `requires_grad` parameters), and the loss, off-policy corrections and metrics are the
full-parameter ones. What leaves the trainer is the adapter alone:

- weight sync: `adapter_state` names each tensor by the base model's module
  (`model.layers.0.self_attn.q_proj.lora_A.weight`), the names the engines apply them to, and
  `adapter_spec` says rank, alpha and targets (rollwise.sync.adapters pushes both);
- checkpoints: `model/` holds PEFT's adapter files (adapter_config.json + adapter_model.safetensors,
  loadable with `peft.PeftModel.from_pretrained(base, path)`), read back exactly by `load_adapter`.
"""

from __future__ import annotations

import copy
from pathlib import Path

from typing import TYPE_CHECKING

from safetensors.torch import load_file
from torch import Tensor, nn

from rollwise.types.train_config import LoraConfig
from rollwise.types.weights import AdapterSpec

if TYPE_CHECKING:
    from peft import PeftModel

# peft is imported where it is used: importing it loads transformers' auto classes (seconds), which a
# full-parameter run never needs.

# PEFT's names inside a PeftModel: base_model.model.<HF name>; the adapter's own name ("default") is
# dropped by get_peft_model_state_dict.
PEFT_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"
# Projections the engines know how to adapt (the reference engine's LoRA hooks, vLLM's LoRA layers).
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def wrap_lora(model: nn.Module, cfg: LoraConfig) -> PeftModel:
    """A PEFT LoRA model over a copy of `model`. A copy, because PEFT rewrites the module tree in
    place and the caller's model stays the base the engines start from (by HF names)."""
    unknown = [t for t in cfg.target_modules if t not in SUPPORTED_TARGETS]
    if unknown:
        raise ValueError(f"train.lora.target_modules: {unknown} cannot be served by the engines; "
                         f"choose from {list(SUPPORTED_TARGETS)}")
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=list(cfg.target_modules),
                              lora_dropout=cfg.dropout, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(copy.deepcopy(model), peft_cfg)


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")  # a PeftModel, without importing peft to ask


def adapter_state(model: PeftModel) -> dict[str, Tensor]:
    """The adapter's tensors by base-model module name (detached views: nothing is copied)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    return {name.removeprefix(PEFT_PREFIX): t.detach() for name, t in state.items()}


def adapter_spec(cfg: LoraConfig, name: str, *, default: bool) -> AdapterSpec:
    return AdapterSpec(name=name, rank=cfg.rank, alpha=cfg.alpha, target_modules=tuple(cfg.target_modules),
                       default=default)


def save_adapter(model: PeftModel, path: Path) -> None:
    model.save_pretrained(path, safe_serialization=True)


def load_adapter(model: PeftModel, path: Path) -> None:
    """Load an adapter saved by `save_adapter` into `model` exactly; a mismatch names the tensors."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    file = path / ADAPTER_FILE
    if not file.exists():
        raise FileNotFoundError(f"{path} holds no LoRA adapter ({ADAPTER_FILE}); was the run trained with "
                                "train.lora? Resume with the same train.lora settings it was written with")
    saved = load_file(file)
    expected = set(get_peft_model_state_dict(model))
    if set(saved) != expected:
        missing, unexpected = sorted(expected - set(saved)), sorted(set(saved) - expected)
        raise ValueError(f"adapter checkpoint {path} does not match train.lora: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]} (same rank and target_modules as when it was written?)")
    result = set_peft_model_state_dict(model, saved)
    if result.unexpected_keys:
        raise ValueError(f"adapter checkpoint {path}: unexpected {result.unexpected_keys[:4]}")

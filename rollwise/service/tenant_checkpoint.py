"""A tenant model's checkpoint directory (the API names it; `TenantModel.save_state` / `load_state` fill and read it).

- `tenant.json`: what was saved (LoRA rank and targets, or full parameters; the base model), checked on load;
- LoRA: PEFT's adapter files (`adapter_config.json` + `adapter_model.safetensors`, tensors named
  `base_model.model.<HF module>.lora_A.weight`), loadable with `peft.PeftModel.from_pretrained(base, dir)`;
- full parameters: `model.safetensors` (+ the HF config and tokenizer: the directory is a model directory);
- with the optimizer: `optimizer.pt` (rollwise.service.tenant_optimizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ValidationError
from safetensors.torch import load_file, save_file
from tinker import types
from torch import Tensor

from rollwise.service.errors import ServiceUserError
from rollwise.service.multi_lora import ATTN_TARGETS, MLP_TARGETS, UNEMBED_TARGET
from rollwise.train.lora import ADAPTER_FILE, PEFT_PREFIX

META_FILE = "tenant.json"
FULL_FILE = "model.safetensors"


class TenantCheckpoint(BaseModel):
    kind: Literal["lora", "full"]
    base_model: str
    rank: int | None = None  # LoRA only
    alpha: float | None = None
    target_modules: list[str] = []


def write_meta(path: Path, meta: TenantCheckpoint) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / META_FILE).write_text(meta.model_dump_json(indent=2))


def read_meta(path: Path) -> TenantCheckpoint:
    file = path / META_FILE
    try:
        return TenantCheckpoint.model_validate_json(file.read_bytes())
    except (OSError, ValidationError) as exc:
        raise ServiceUserError(f"path: {path.name!r} is not a checkpoint of this service ({file.name}: "
                               f"{type(exc).__name__}); pass a tinker:// path that save_state/save_weights "
                               "returned") from exc


def lora_config_of(meta: TenantCheckpoint) -> types.LoraConfig | None:
    """The LoraConfig a model must be created with to load this checkpoint (None: full parameters)."""
    if meta.kind == "full":
        return None
    targets = set(meta.target_modules)
    return types.LoraConfig(rank=meta.rank or 1, train_attn=bool(targets & set(ATTN_TARGETS)),
                            train_mlp=bool(targets & set(MLP_TARGETS)), train_unembed=UNEMBED_TARGET in targets)


def check_meta(path: Path, saved: TenantCheckpoint, mine: TenantCheckpoint) -> None:
    """A checkpoint loads only into a model of the same kind, base and LoRA shape."""
    if saved != mine:
        raise ServiceUserError(f"path: checkpoint {path.name!r} is of a {_describe(saved)}, this model is a "
                               f"{_describe(mine)}; load it into a model created with the same settings")


def _describe(meta: TenantCheckpoint) -> str:
    if meta.kind == "full":
        return f"full-parameter model of {meta.base_model}"
    return f"LoRA rank {meta.rank} on {meta.target_modules} of {meta.base_model}"


def save_adapter(path: Path, meta: TenantCheckpoint, state: dict[str, Tensor]) -> None:
    save_file({PEFT_PREFIX + name: t.contiguous() for name, t in state.items()}, path / ADAPTER_FILE)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": meta.rank, "lora_alpha": meta.alpha,
              "target_modules": meta.target_modules, "lora_dropout": 0.0, "bias": "none",
              "base_model_name_or_path": meta.base_model, "fan_in_fan_out": False, "inference_mode": True}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))


def read_adapter(path: Path) -> dict[str, Tensor]:
    file = path / ADAPTER_FILE
    if not file.is_file():
        raise ServiceUserError(f"path: checkpoint {path.name!r} holds no {ADAPTER_FILE}")
    return {name.removeprefix(PEFT_PREFIX): t for name, t in load_file(file).items()}

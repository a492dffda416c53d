"""The base models a Tinker service trains and samples on: each loaded once per name, frozen, shared.

Every LoRA tenant of a base trains its adapter over the one `BaseModel.model` (rollwise.service.multi_lora
hooks per-row adapter deltas into it); full-parameter tenants copy it. The sampler (rollwise.service.sampler)
builds its engines from the same object and serves what `TenantModel.sampler_weights()` hands it
(`SamplerWeights`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from rollwise.model.loading import TINY_MOE_PREFIX, TINY_PREFIX, load_model, resolve_model_path
from rollwise.service.errors import ServiceUserError
from rollwise.service.multi_lora import MultiLora
from rollwise.types.weights import AdapterSpec

DEFAULT_BASE_MODEL = "bundled:smollm2-135m-instruct"


@dataclass
class BaseModel:
    """One loaded base model. `model` is frozen (no parameter requires grad) and never written: LoRA
    tenants add their deltas through `lora`'s hooks, full-parameter tenants train a copy."""

    name: str  # as the client names it (`base_model` of create_model)
    model: nn.Module  # a Hugging Face causal LM, eval mode
    tokenizer: PreTrainedTokenizerBase
    tokenizer_id: str  # a local directory `AutoTokenizer.from_pretrained` loads offline (get_info's tokenizer_id)
    max_context_length: int  # the model's max_position_embeddings
    lora: MultiLora  # the per-row adapter hooks installed in `model` (inert outside a LoRA forward)
    # Held for a forward+backward over `model` with per-row adapters: the hooks read one row assignment at a time.
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])


@dataclass
class SamplerWeights:
    """What a sampler serves, a detached snapshot (copies, never live parameters): a LoRA adapter on
    `base_model` (spec + its `<module>.lora_A.weight` / `.lora_B.weight` tensors by the base's HF module names,
    the names rollwise.engine.reference.lora applies them to), or a full-parameter model's state dict by HF
    names. `version` counts the snapshots of one tenant (1, 2, ...)."""

    base_model: str
    version: int
    adapter: tuple[AdapterSpec, dict[str, Tensor]] | None = None
    full_state: dict[str, Tensor] | None = None


class BaseModels:
    """Loads each base model once, on first use, through rollwise.model.loading (`bundled:NAME`, a local
    Hugging Face directory, `tiny:SEED` test models). `names`: the base models this service offers (None: any
    that loads); `data_dir`: where tokenizers of models without a directory (`tiny:`) are saved."""

    def __init__(self, data_dir: Path, names: Sequence[str] | None = None, dtype: torch.dtype = torch.float32) -> None:
        self.data_dir = Path(data_dir)
        self.names = None if names is None else tuple(names)
        self.dtype = dtype
        self._loaded: dict[str, BaseModel] = {}
        self._lock = threading.Lock()

    def loaded(self) -> dict[str, BaseModel]:
        return dict(self._loaded)

    def get(self, name: str) -> BaseModel:
        """The base model `name`, loaded once; a name not offered or not loadable -> ServiceUserError naming
        `base_model`."""
        if self.names is not None and name not in self.names:
            raise ServiceUserError(f"base_model: {name!r} is not served here; choose one of {list(self.names)}")
        with self._lock:
            base = self._loaded.get(name)
            if base is None:
                base = self._loaded[name] = self._load(name)
            return base

    def _load(self, name: str) -> BaseModel:
        try:
            model, tokenizer = load_model(name, self.dtype)
            tokenizer_dir = None if name.startswith((TINY_PREFIX, TINY_MOE_PREFIX)) else resolve_model_path(name)
        except (ValueError, FileNotFoundError) as exc:
            raise ServiceUserError(f"base_model: cannot load {name!r}: {exc}") from exc
        if tokenizer_dir is None:  # built in code: save it where the SDK's AutoTokenizer finds it offline
            tokenizer_dir = self.data_dir / "tokenizers" / _slug(name)
            if not (tokenizer_dir / "tokenizer_config.json").exists():
                tokenizer.save_pretrained(tokenizer_dir)
        model.eval()
        model.requires_grad_(False)
        config = model.config
        return BaseModel(name=name, model=model, tokenizer=tokenizer, tokenizer_id=str(tokenizer_dir),
                         max_context_length=int(getattr(config, "max_position_embeddings", 2048)),
                         lora=MultiLora.install(model))


def _slug(name: str) -> str:
    """A file name for a model name (`tiny:qwen2:3` -> `tiny_qwen2_3`)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).strip(".") or "model"

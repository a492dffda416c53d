"""The engine contract's data types: token ids in, token ids + logprobs + policy versions out.

Every backend (reference, vLLM, SGLang) speaks these types, so the rollout controller and the
trainer never care which engine produced a sample.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from rollwise.types.routing import RoutedExperts

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class SamplingParams:
    """How to sample, with vLLM's meanings. The logits are processed in vLLM's order: min_tokens
    (stop tokens masked), then the penalties (repetition, frequency, presence), then temperature,
    then top-k/top-p. Logprobs (of the sampled token, and the `top_logprobs` alternatives) are those
    of the distribution actually sampled from: the penalised, temperature-scaled logits *before*
    top-p/top-k truncation (the reference engine; vLLM's processed logprobs also include the
    truncation). They are the behaviour policy's logprobs, which is what off-policy corrections
    need: with penalties on they differ from what a trainer recomputes from the model alone."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    n: int = 1  # samples per prompt; they share one prefill
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # sample i of a request uses seed + i, so results do not depend on batching
    ignore_eos: bool = False  # benchmarks force lengths with this
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (vLLM/CTRL formula)
    frequency_penalty: float = 0.0  # subtracted from a logit once per earlier occurrence in the output
    presence_penalty: float = 0.0  # subtracted from a logit if the token occurred in the output
    top_logprobs: int = 0  # also return this many most likely tokens (and their logprobs) at each step

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (vLLM's range), got {getattr(self, name)}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
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
    # A loaded LoRA adapter's name (multi-LoRA: jobs sharing a base differ by adapter); None: the
    # engine's default policy (its base weights, or the default adapter of a LoRA run).
    adapter: str | None = None
    # vLLM's cache_salt: requests share prefix-cache entries (and a batched prefill) only with requests of the
    # same salt, so one tenant cannot learn from cache timing what another sent. None: the unsalted cache.
    cache_salt: str | None = None


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
    # Per token, when SamplingParams.top_logprobs > 0: the most likely (token id, logprob) pairs, best first.
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # MoE engines: the experts every token was routed to (prompt + token_ids[:-1]); None for dense models.
    routed_experts: RoutedExperts | None = None
    # Live migrations of the sample between engines while it ran, in order: (from engine, to engine)
    # (rollwise.engine.migration); the rollout controller records them in its ledger.
    migrations: list[tuple[str, str]] = field(default_factory=list)

    @property
    def sample_id(self) -> str:
        return f"{self.request_id}/{self.index}"


@dataclass
class EngineLoad:
    """What a router or a pool needs to place work: a snapshot, read between steps."""

    running: int  # sequences holding KV cache and decoding
    waiting: int  # samples queued, not yet admitted
    max_num_seqs: int
    kv_cache_usage: float  # fraction of KV capacity in use, 0..1
    prompt_tokens: int  # totals since start: prefix hit rate = cached_prompt_tokens / prompt_tokens
    cached_prompt_tokens: int
    generated_tokens: int
    paused: bool
    sleeping: bool
    policy_version: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ModelInfo:
    engine: str  # "reference" | "vllm"
    model: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    eos_token_ids: list[int]
    tokenizer_fingerprint: str | None  # invariant 1: the trainer refuses an engine whose tokenizer differs
    policy_version: int

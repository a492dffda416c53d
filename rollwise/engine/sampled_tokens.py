"""What a running sample has sampled so far, kept the same way by every engine, and its Completion."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollwise.types.generation import Completion, FinishReason, GenerationRequest


@dataclass
class SampledTokens:
    """The sampled token ids, each one's logprob and policy version, and (only if params.top_logprobs) its
    top alternatives; the Completion hands these lists over as they are."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    def add(self, token: int, logprob: float, version: int, top: list[tuple[int, float]] | None = None) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if top is not None:
            self.top_logprobs.append(top)

    def completion(self, request: GenerationRequest, index: int, reason: FinishReason,
                   cached_prompt_tokens: int = 0) -> Completion:
        return Completion(
            request_id=request.request_id, index=index, prompt_ids=list(request.prompt_ids),
            token_ids=self.token_ids, logprobs=self.logprobs, versions=self.versions,
            finish_reason=reason, cached_prompt_tokens=cached_prompt_tokens, top_logprobs=self.top_logprobs,
        )

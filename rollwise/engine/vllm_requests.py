"""Rollwise requests in vLLM's terms and vLLM's outputs back in rollwise's (rollwise.engine.vllm_backend).

A request's n samples are n single-sample vLLM requests (see vllm_backend's docstring); each one's
tokens, logprobs and policy versions gather in a `VllmSample` (rollwise.engine.sampled_tokens) until vLLM
finishes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from rollwise.engine.sampled_tokens import SampledTokens
from rollwise.types.generation import Completion, FinishReason, GenerationRequest, SamplingParams

# SamplingParams fields that map one to one onto vLLM's SamplingParams fields of the same names.
SAME_NAMED_FIELDS = ("max_tokens", "temperature", "top_p", "ignore_eos", "min_tokens", "repetition_penalty",
                     "frequency_penalty", "presence_penalty")


@dataclass
class VllmSample:
    """One sample (one vLLM request) while it is running."""

    request: GenerationRequest
    index: int
    # A LoRA request's adapter version: vLLM keeps a request's adapter to its end. None: the engine's version.
    adapter_version: int | None = None
    sampled: SampledTokens = field(default_factory=SampledTokens)
    # A migrated sample's prompt tokens its source served from cache (rollwise.engine.vllm_migration): its vLLM
    # request here counts its earlier tokens as prompt. None: vLLM's own count, read when it finishes.
    cached_prompt_tokens: int | None = None

    def cached_tokens(self, reported: int | None) -> int:
        """The prompt tokens served from cache: vLLM's count (`reported`), or a migrated sample's source's."""
        return self.cached_prompt_tokens if self.cached_prompt_tokens is not None else int(reported or 0)

    def completion(self, reason: FinishReason, cached_prompt_tokens: int = 0) -> Completion:
        return self.sampled.completion(self.request, self.index, reason, cached_prompt_tokens)


def vllm_sampling_params(params: SamplingParams, seed: int, eos_token_ids: Iterable[int]) -> Any:
    """One sample's vLLM SamplingParams: token ids only (no detokenizing), EOS among the stop token ids
    (vLLM without a tokenizer does not know it), each step's new tokens only."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    stops = list(params.stop_token_ids) + ([] if params.ignore_eos else sorted(eos_token_ids))
    return VLLMSamplingParams(
        n=1,
        top_k=params.top_k if params.top_k > 0 else -1,
        seed=seed,
        stop_token_ids=stops,
        logprobs=params.top_logprobs,
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA,  # each step brings only the new tokens
        **{name: getattr(params, name) for name in SAME_NAMED_FIELDS},
    )


def top_logprobs(token_lps: Mapping[int, Any], k: int) -> list[tuple[int, float]]:
    """vLLM's per-token logprobs dict (the sampled token plus the k best, each with its rank) as the
    k best (token id, logprob), best first; the sampled token is among them only if it ranks in the k."""
    ranked = [(lp.rank, int(token), float(lp.logprob)) for token, lp in token_lps.items() if lp.rank is not None]
    best = sorted(r for r in ranked if r[0] <= k)
    return [(token, logprob) for _, token, logprob in best]


def config_eos(hf_model: nn.Module) -> list[int]:
    """The model config's EOS token ids (none, one or several)."""
    eos = getattr(hf_model.config, "eos_token_id", None)
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]

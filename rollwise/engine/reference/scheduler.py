"""The reference engine's scheduling state: a running `Sequence` (one of a request's n samples) and the
`Scheduler` that admits whole requests into free KV-cache slots. ReferenceEngine (rollwise.engine.reference.engine)
owns one; its components (session_retention, migration) act on the same one.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rollwise.types.generation import Completion, FinishReason, GenerationRequest
from rollwise.types.routing import RoutedExperts


@dataclass
class Sequence:
    """One of a request's n samples while it is running."""

    request: GenerationRequest
    index: int
    slot: int
    generator: torch.Generator
    cached_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # only if params.top_logprobs
    # MoE: experts of the prompt tokens [P, layers, top_k] (shared by the group), then one row per decoded token.
    prompt_routing: Tensor | None = None
    routing: list[Tensor] = field(default_factory=list)
    num_experts: int = 0

    def routed_experts(self) -> RoutedExperts | None:
        if self.prompt_routing is None:
            return None
        return RoutedExperts.from_array(torch.cat([self.prompt_routing, *self.routing]), self.num_experts)

    def completion(self, reason: FinishReason) -> Completion:
        return Completion(
            request_id=self.request.request_id,
            index=self.index,
            prompt_ids=list(self.request.prompt_ids),
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            versions=self.versions,
            finish_reason=reason,
            cached_prompt_tokens=self.cached_prompt_tokens,
            top_logprobs=self.top_logprobs,
            routed_experts=self.routed_experts(),
        )


class Scheduler:
    """First-come-first-served admission of whole requests into free KV-cache slots.

    A request is admitted only when all n of its samples fit, because they share one prefill.
    Admission never skips past the head of the queue, so large-n requests cannot starve. Every slot
    reserves max_model_len positions, so running sequences never need preemption.
    """

    def __init__(self, num_slots: int) -> None:
        self.waiting: deque[GenerationRequest] = deque()
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self._free = list(range(num_slots))  # a min-heap: lowest slots first keeps the batch contiguous

    def admit(self, reclaim: Callable[[int], None] | None = None) -> list[tuple[GenerationRequest, list[int]]]:
        """reclaim(k): asked to free k more slots (held session KV) when the head of the queue needs them."""
        admitted = []
        while self.waiting:
            if reclaim is not None and self.waiting[0].params.n > len(self._free):
                reclaim(self.waiting[0].params.n - len(self._free))
            if self.waiting[0].params.n > len(self._free):
                break
            request = self.waiting.popleft()
            admitted.append((request, [heapq.heappop(self._free) for _ in range(request.params.n)]))
        return admitted

    def start(self, seq: Sequence) -> None:
        self.running[seq.slot] = seq

    def release(self, slot: int) -> None:
        self.running.pop(slot, None)
        heapq.heappush(self._free, slot)

    def hold(self, slot: int) -> None:
        """The sequence in `slot` is done but its KV stays (session retention); free(slot) later."""
        self.running.pop(slot, None)

    def free(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def reserve(self) -> int | None:
        """Take a free slot outside admission (a migrating request's KV is staged in it); free(slot) or
        start() a sequence in it later. None: no slot is free."""
        return heapq.heappop(self._free) if self._free else None

"""Speculative decoding in the simulator: the drafter's acceptance model over the engines' own budget.

The simulated engine emits one token per sequence per (virtual) step and never drafts anything; this
model turns that into speculation's wall time. A verification step checks k drafted tokens per
sequence in one forward and emits, on average, E(k) = (1 - a^(k+1)) / (1 - a) tokens per sequence for
a per-token acceptance rate a (accepted drafts, then the target's own token). k is the engines' own
length-aware budget (rollwise.engine.speculation.budget.draft_budget), the same pure function the
reference engine and vLLM run: long drafts while few sequences run (the long tail), short ones in a
full batch. The forward itself costs what the cost model says a decode step of batch * (k + 1)
sequences costs (memory-bound and flat at small batches, compute-bound and linear at large ones), with
the KV of each sequence read once. So the time of one emitted token is that step's time / E(k).

The acceptance rate comes from measurements (`rollwise bench speculation` reports it, early and late
in training); the simulator takes it as given.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from rollwise.engine.speculation.budget import BudgetPolicy, draft_budget


class SpeculationModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    acceptance: float = Field(0.7, ge=0, lt=1, description="per drafted token: probability it is accepted")
    max_draft: int = Field(8, ge=1, description="engine.speculation_max_draft")
    batch_knee: int = Field(8, ge=1, description="engine.speculation_batch_knee")
    tokens_per_draft: float = Field(4.0, gt=0, description="engine.speculation_tokens_per_draft")
    # 0 here, not the engines' CPU default of 32: on a GPU the verification forward stays memory-bound to
    # hundreds of tokens (h100-7b: per-sequence compute reaches the weight read at ~500), and the cost model
    # already charges batch * (k + 1) tokens of compute past that.
    max_step_tokens: int = Field(0, ge=0, description="engine.speculation_max_step_tokens (0: no bound)")
    expected_remaining: float = Field(256, gt=0, description="remaining tokens the budget assumes (history's)")

    def draft_length(self, batch: int) -> int:
        """Tokens drafted per sequence in a step of `batch` running sequences (the engines' budget)."""
        policy = BudgetPolicy(max_draft=self.max_draft, min_draft=1, batch_knee=self.batch_knee,
                              tokens_per_draft=self.tokens_per_draft, max_step_tokens=self.max_step_tokens)
        return draft_budget(self.expected_remaining, batch, policy)

    def tokens_per_step(self, k: int) -> float:
        """Expected tokens one sequence emits per verification of a k-token draft."""
        a = self.acceptance
        return (1 - a ** (k + 1)) / (1 - a)

    def per_step(self, batch: int) -> dict[str, float]:
        """Expected drafted, accepted and emitted tokens of one verification step of `batch` sequences."""
        k = self.draft_length(batch)
        emitted = self.tokens_per_step(k)
        return {"drafted": batch * k, "accepted": batch * (emitted - 1), "emitted": batch * emitted}

    def token_step(self, decode_s: Callable[[int, float], float], batch: int, context: float) -> tuple[float, float]:
        """(seconds per emitted token per sequence, the factor on per-step context growth): a verification
        of batch * (k + 1) tokens, reading each sequence's KV once, over the tokens it emits."""
        k = self.draft_length(batch)
        emitted = self.tokens_per_step(k)
        return decode_s(batch * (k + 1), context) / emitted, 1 / emitted

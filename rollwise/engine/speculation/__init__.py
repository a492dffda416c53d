"""Speculative decoding from the policy's own rollout history (issue 19, DAS).

- history.HistoryDrafter: per-problem and global suffix counts over recent rollouts; proposes drafts.
- budget.draft_budget: the pure, length-aware draft length (the simulator can use it).
- the reference engine verifies drafts exactly (rollwise/engine/reference/sampling.py: verify_draft_token).
"""

from typing import Protocol

from rollwise.engine.speculation.budget import BudgetPolicy, draft_budget
from rollwise.engine.speculation.history import HistoryDrafter, HistorySettings, SuffixCounts


class Drafter(Protocol):
    """What an engine asks of a drafter (HistoryDrafter is the one rollwise ships)."""

    def budget_for(self, prompt_ids: list[int], generated: int, running: int) -> int: ...
    def propose(self, prompt_ids: list[int], generated: list[int], k: int) -> list[int]: ...
    def observe(self, prompt_ids: list[int], token_ids: list[int], version: int, key: str | None = None) -> None: ...
    def on_policy_version(self, version: int) -> None: ...
    def memory(self) -> dict[str, int]: ...


__all__ = ["BudgetPolicy", "Drafter", "HistoryDrafter", "HistorySettings", "SuffixCounts", "draft_budget"]

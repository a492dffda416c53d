"""What an engine asks of a drafter (`Drafter`), and the drafter an engine section asks for (`drafter_for`)."""

from __future__ import annotations

from typing import Protocol

from rollwise.engine.speculation.budget import BudgetPolicy
from rollwise.engine.speculation.history import HistoryDrafter, HistorySettings


class Drafter(Protocol):
    """What an engine asks of a drafter (HistoryDrafter is the one rollwise ships)."""

    def budget_for(self, prompt_ids: list[int], generated: int, running: int) -> int: ...
    def propose(self, prompt_ids: list[int], generated: list[int], k: int) -> list[int]: ...
    def observe(self, prompt_ids: list[int], token_ids: list[int], version: int, key: str | None = None) -> None: ...
    def on_policy_version(self, version: int) -> None: ...
    def clear(self) -> None:
        """Forget every rollout (its engine now serves another owner's weights: Engine.replace_weights)."""
    def memory(self) -> dict[str, int]: ...


def drafter_for(engine_cfg: object) -> HistoryDrafter | None:
    """The drafter an engine section asks for (`engine.speculation` and its knobs; rollwise.types.engine_config.EngineConfig),
    or None for `none` and for sections without the fields (older EngineSettings)."""
    if getattr(engine_cfg, "speculation", "none") == "none":
        return None
    get = engine_cfg.__getattribute__
    budget = BudgetPolicy(max_draft=get("speculation_max_draft"), min_draft=1, batch_knee=get("speculation_batch_knee"),
                          tokens_per_draft=get("speculation_tokens_per_draft"),
                          max_step_tokens=getattr(engine_cfg, "speculation_max_step_tokens", 0))
    history = HistorySettings(window_rollouts=get("speculation_window_rollouts"),
                              max_versions=get("speculation_max_versions"), max_tokens=get("speculation_max_tokens"))
    return HistoryDrafter(history, budget)

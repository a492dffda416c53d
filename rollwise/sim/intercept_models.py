"""The intercept simulator's inputs and result (rollwise.sim.intercept): the agentic workload, the engine's
retention side (budgets, swap tier, prefix cache, TTLs, the park grace), and what one run measures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollwise.engine.retention import RetentionLimits


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    median_s: float = Field(gt=0, description="median latency (lognormal)")
    sigma: float = Field(1.0, ge=0, description="lognormal sigma: 1.0 puts p99 at ~10x the median")
    weight: float = Field(1.0, gt=0, description="relative frequency of this tool (tool_order: random)")
    cap_factor: float | None = Field(None, gt=0, description="latency capped at this multiple of the median "
                                     "(rollwise bench intercept caps its slow tool at 10x); None: no cap")


class InterceptWorkload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sessions: int = Field(64, ge=1, description="episodes to run")
    concurrency: int = Field(16, ge=1, description="episodes in flight at once (per engine)")
    turns: int = Field(4, ge=1, description="engine turns per episode; a tool call between two turns")
    prompt_tokens: int = Field(256, ge=1)
    tool_result_tokens: int = Field(32, ge=0)
    output_tokens: int = Field(32, ge=1)
    tools: list[ToolSpec] = Field(default_factory=lambda: [ToolSpec(name="python", median_s=1.0)])
    tool_order: Literal["random", "rotate"] = Field("random", description="random: drawn by weight; rotate: "
                                                    "session i's k-th call uses tools[(i + k) % len(tools)], "
                                                    "as rollwise bench intercept does")
    expected_default_s: float | None = Field(None, gt=0, description="expected latency of a tool before its "
                                             "first return (None: the median of the tools' medians)")


_LIMITS = RetentionLimits()  # the engine's defaults for what the bench does not set


class RetentionModel(BaseModel):
    """The engine's retention side: budgets, the swap tier and how memory is charged."""

    model_config = ConfigDict(extra="forbid")
    slot_tokens: int | None = Field(None, ge=1, description="a turn/pin costs one slot of this many tokens "
                                    "(reference engine); None: context + output (paged KV)")
    pin_budget_tokens: int = Field(0, ge=0)
    swap_budget_tokens: int = Field(0, ge=0)
    swap_s_per_token: float = Field(1e-6, ge=0, description="one-way swap transfer per token")
    swap_overlap: float = Field(0.0, ge=0, le=1, description="fraction of swaps hidden behind compute")
    prefix_cache_tokens: int = Field(0, ge=0, description="prefix cache in tokens (every policy but always_discard)")
    ttl_factor: float = Field(_LIMITS.ttl_factor, gt=0, description="a promise lasts expected latency x this ...")
    ttl_min_s: float = Field(_LIMITS.ttl_min_s, gt=0, description="... clamped to [ttl_min_s, ttl_max_s]")
    ttl_max_s: float = Field(_LIMITS.ttl_max_s, gt=0)
    park_grace_s: float | None = Field(_LIMITS.park_grace_s, ge=0, description="a finished turn's KV is parked "
                                       "until the caller's retain() is served (after the next step), protected "
                                       "this long on at most half the slots (the reference engine); 0: not "
                                       "parked (retain() finds nothing and discards); None: no parking, the "
                                       "engine decides when the turn ends (it learns of the tool call with it)")


@dataclass
class InterceptResult:
    policy: str
    episodes: int
    sim_seconds: float
    episodes_per_s: float
    prompt_tokens: int
    recomputed_tokens: int
    waste_token_s: float
    turn_latency_p50_s: float
    turn_latency_p99_s: float
    actions: dict[str, int] = field(default_factory=dict)
    # held KV admission took for waiting requests, in the bench's terms (its taken_by_admission)
    reclaimed: dict[str, int] = field(default_factory=dict)

    @property
    def recomputed_fraction(self) -> float:
        return self.recomputed_tokens / max(1, self.prompt_tokens)

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "recomputed_fraction": self.recomputed_fraction}

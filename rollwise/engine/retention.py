"""Session KV retention across tool calls (InferCept, arXiv 2402.01869): the contract's types.

An agentic episode stops at every tool call and comes back seconds later with a longer prompt. When a
turn ends in a tool call the caller tells the engine so (`Engine.retain(RetentionRequest)`), and the
engine chooses, per interception, what happens to that turn's KV and reports it (`RetentionDecision`):

- preserve: the KV stays where it is, pinned against eviction until the session's next turn, its end,
  or a TTL (expected tool latency x a margin). The next turn recomputes none of its context.
- discard:  the KV is freed now; the next turn recomputes it (or finds part of it in the prefix cache).
- swap:     the KV moves to a second, slower tier and comes back when the session resumes.

Promises are bounded, never blocking: pins and swapped KV live within memory budgets; a pin is released
when its TTL expires (unless the session is back, its next turn queued), the session ends
(`Engine.release_session`), its request is aborted or the weights change (the KV was computed by the old
policy). When a request waits for memory a held session occupies, admission keeps it, moves it to the
swap tier or drops it, whichever wastes least (retention_policy.reclaim); with no slot about to free
itself it always takes one, so a promise never idles the engine. A just-finished turn's KV is protected
for at most park_grace_s, on at most half the engine, for the caller's retain(). A released promise costs
only recomputation: the next turn's request always carries the whole context, so nothing is lost, even
if the engine restarts mid-tool-call.

The next turn is matched to its retained KV by tokens, not by id: the retained tokens must be a prefix
of the new prompt (invariant 1 makes every turn's prompt a token prefix of the next one's).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

RetentionAction = Literal["preserve", "discard", "swap"]
RETENTION_ACTIONS: tuple[RetentionAction, ...] = ("preserve", "discard", "swap")
# Why a promise ended: the session came back (resumed) or one of the releases listed above.
ReleaseReason = Literal["resumed", "ttl", "session_end", "abort", "weight_update", "evicted", "sleep"]


@dataclass(frozen=True)
class RetentionRequest:
    """A turn ended in a tool call. request_id: the engine request of that turn (its KV is what is kept);
    expected_latency_s: how long the tool is expected to run (None: the engine's own estimate for tool_name)."""

    session_id: str
    request_id: str
    tool_name: str = "tool"
    expected_latency_s: float | None = None

    def __post_init__(self) -> None:
        if not self.session_id:
            raise ValueError("retention request: session_id must be a non-empty string")
        if not self.request_id:
            raise ValueError("retention request: request_id (the engine request of the turn that ended) is empty")
        latency = self.expected_latency_s
        if latency is not None and not (math.isfinite(latency) and latency >= 0):
            raise ValueError(f"retention request: expected_latency_s must be a finite number >= 0 (seconds), "
                             f"got {latency}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RetentionRequest:
        unknown = sorted(set(data) - {"session_id", "request_id", "tool_name", "expected_latency_s"})
        if unknown:
            raise ValueError(f"retention request: unknown fields {unknown}; expected session_id, request_id, "
                             "tool_name, expected_latency_s")
        return cls(**data)


@dataclass(frozen=True)
class RetentionDecision:
    """What the engine did with the session's KV. tokens: context tokens whose KV the decision concerns
    (0 when the turn's KV was already gone); ttl_s: how long a preserve/swap promise holds at most."""

    session_id: str
    action: RetentionAction
    tokens: int
    ttl_s: float
    reason: str  # why this action: the policy's waste comparison, a budget, or "kv already released"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RetentionLimits:
    """The budgets that keep promises from blocking the engine.

    pin_budget_tokens: KV tokens all preserved sessions may hold (the reference engine charges a pinned
    session one whole KV slot, max_model_len tokens, because that is what it keeps from other requests);
    swap_budget_tokens: tokens the swap tier holds; swap_bytes_per_s: the swap tier's bandwidth, charged
    on every transfer (see rollwise.engine.reference.kv_tiers); ttl_factor/ttl_min_s/ttl_max_s: a promise
    lasts expected latency x ttl_factor, clamped to [ttl_min_s, ttl_max_s]."""

    pin_budget_tokens: int = 0
    swap_budget_tokens: int = 0
    swap_bytes_per_s: float = 8e9
    ttl_factor: float = 2.0
    ttl_min_s: float = 1.0
    ttl_max_s: float = 120.0
    # A finished turn's KV is held this long for the caller's retain() (it comes milliseconds after the
    # turn, from the agent), on at most half the engine's slots; admission may not take it meanwhile.
    # Past it the turn stays parked, reclaimable like a pin, until ttl_max_s (a late retain() finds it).
    park_grace_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("pin_budget_tokens", "swap_budget_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"retention: {name} must be >= 0 (0 turns that tier off), got {getattr(self, name)}")
        if not self.swap_bytes_per_s > 0:
            raise ValueError(f"retention: swap_bytes_per_s must be > 0, got {self.swap_bytes_per_s}")
        if not 0 <= self.park_grace_s <= 10:
            raise ValueError(f"retention: park_grace_s must be in [0, 10] seconds, got {self.park_grace_s}")
        if not (self.ttl_factor > 0 and 0 < self.ttl_min_s <= self.ttl_max_s):
            raise ValueError("retention: need ttl_factor > 0 and 0 < ttl_min_s <= ttl_max_s, got "
                             f"{self.ttl_factor}, {self.ttl_min_s}, {self.ttl_max_s}")

    def ttl(self, expected_latency_s: float) -> float:
        return min(self.ttl_max_s, max(self.ttl_min_s, expected_latency_s * self.ttl_factor))


RETENTION_MODES = ("off", "min_waste", "always_discard", "always_preserve", "prefix_cache_only")


def engine_retention(engine_cfg: Any, capacity_tokens: int, mode: str | None = None) -> dict[str, Any]:
    """ReferenceEngine keywords for the run's engine section (`engine.retention*`; {} when off or absent;
    `mode` overrides engine.retention). The pin budget is a fraction of the KV capacity (slots x length)."""
    mode = mode or getattr(engine_cfg, "retention", "off")
    if mode == "off":
        return {}
    if mode not in RETENTION_MODES:
        raise ValueError(f"engine.retention: unknown mode {mode!r}; choose one of {', '.join(RETENTION_MODES)}")
    limits = RetentionLimits(
        pin_budget_tokens=int(capacity_tokens * getattr(engine_cfg, "retention_pin_fraction", 0.5)),
        swap_budget_tokens=getattr(engine_cfg, "retention_swap_tokens", 0),
        swap_bytes_per_s=getattr(engine_cfg, "retention_swap_gbps", 8.0) * 1e9,
        ttl_max_s=getattr(engine_cfg, "retention_ttl_max_s", 120.0),
    )
    return {"retention": limits, "retention_policy": mode}


class RetainBody(BaseModel):
    """POST /retain: the turn `request_id` (the id /generate returned) ended in a tool call."""

    model_config = ConfigDict(extra="forbid")
    session_id: str = Field(min_length=1)
    request_id: str = Field(min_length=1)
    tool_name: str = Field("tool", min_length=1)
    expected_latency_s: float | None = Field(None, ge=0, allow_inf_nan=False)


class ReleaseSessionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session_id: str = Field(min_length=1)

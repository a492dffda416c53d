"""The retention policy: per interception, preserve, discard or swap the session's KV, whichever wastes
least memory x time (InferCept, arXiv 2402.01869, section 4). A pure function of numbers, so the
engines and the simulator (rollwise.sim.intercept) run the very same policy.

Waste is counted in token-seconds: KV memory (in tokens) that is held without doing useful work,
multiplied by how long it is held.

- preserve: the session's KV (pin_cost_tokens) sits idle for the whole tool call. It is only a waste
  to the extent someone else could use the memory: scaled by the memory pressure (1 while requests
  wait for memory, else the fraction of KV capacity in use).
- discard:  when the session comes back its context is recomputed; for that time the running batch
  and the session itself hold memory without producing tokens: recompute_s(context) x (batch + context);
  with a prefix cache, times the chance the cached KV is evicted before it returns (see EVICTION_FROM).
- swap:     the KV goes out and comes back through the slower tier; the part of those transfers not
  hidden behind computation (1 - swap_overlap; 0 on the CPU reference engine, whose copies run on the
  engine thread) stalls the batch the same way.

Preserve and swap are only candidates while their budgets have room; discard always is. When a request
later waits for memory that a held session occupies, reclaim() weighs the same way whether admission keeps
the slot (the request waits for the soonest of a running sequence's end and the session's return), moves
the KV to the swap tier, or drops it: pins are not taken back merely because memory is short. The fixed
policies (always_discard, always_preserve, prefix_cache_only) are the comparison points of
`rollwise bench intercept`; prefix_cache_only discards and leaves reuse to the engine's LRU prefix cache.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

from rollwise.engine.retention import RetentionAction

PolicyName = Literal["min_waste", "always_discard", "always_preserve", "prefix_cache_only"]
POLICY_NAMES: tuple[PolicyName, ...] = ("min_waste", "always_discard", "always_preserve", "prefix_cache_only")
EVICTION_FROM = 0.75  # fraction of KV capacity in use from which a prefix cache starts losing entries


@dataclass(frozen=True)
class RetentionCosts:
    """Measured costs: seconds to recompute one context token (prefill), seconds to move one token's KV
    one way through the swap tier, and the fraction of a swap hidden behind computation."""

    recompute_s_per_token: float
    swap_s_per_token: float
    swap_overlap: float = 0.0


@dataclass(frozen=True)
class EngineSnapshot:
    """What the policy sees of the engine when a turn ends in a tool call (token counts are KV tokens)."""

    context_tokens: int  # the session's context: what discard would make the next turn recompute
    pin_cost_tokens: int  # what preserving holds back from others (reference: a whole slot; paged: context)
    running_tokens: int  # KV held by the running batch
    used_tokens: int  # KV in use: the running batch, pins, this session's own
    capacity_tokens: int  # the engine's KV capacity
    waiting: int  # sequences queued for memory
    pin_free_tokens: int  # room left in the pin budget
    swap_free_tokens: int  # room left in the swap tier (0: no swap tier)
    prefix_cached: bool = False  # a discarded context stays in the engine's prefix cache until memory is needed


@dataclass(frozen=True)
class Choice:
    action: RetentionAction
    waste: dict[str, float]  # token-seconds per candidate action considered
    reason: str


def wastes(snap: EngineSnapshot, expected_latency_s: float, costs: RetentionCosts) -> dict[str, float]:
    """Memory x time waste (token-seconds) of each feasible action."""
    stalled = snap.running_tokens + snap.context_tokens  # memory idle while the batch waits
    pressure = 1.0 if snap.waiting > 0 else min(1.0, snap.used_tokens / max(1, snap.capacity_tokens))
    # With a prefix cache, discarded KV is only recomputed if something evicts it first. LRU eviction starts
    # when memory runs out, so a ramp: none below EVICTION_FROM of capacity in use, certain when it is full
    # or requests wait for memory (a heuristic; `rollwise sim intercept` shows its effect).
    used = snap.used_tokens / max(1, snap.capacity_tokens)
    evicted = (1.0 if snap.waiting > 0 else min(1.0, max(0.0, (used - EVICTION_FROM) / (1 - EVICTION_FROM)))
               ) if snap.prefix_cached else 1.0
    out = {"discard": costs.recompute_s_per_token * snap.context_tokens * stalled * evicted}
    if 0 < snap.pin_cost_tokens <= snap.pin_free_tokens:
        out["preserve"] = snap.pin_cost_tokens * expected_latency_s * pressure
    if 0 < snap.context_tokens <= snap.swap_free_tokens:
        transfer_s = 2 * costs.swap_s_per_token * snap.context_tokens * (1.0 - costs.swap_overlap)
        out["swap"] = transfer_s * stalled
    return out


def choose(policy: PolicyName, snap: EngineSnapshot, expected_latency_s: float, costs: RetentionCosts) -> Choice:
    """The action `policy` takes for one interception. Pure: same numbers, same choice."""
    if policy not in POLICY_NAMES:
        raise ValueError(f"unknown retention policy {policy!r}; choose one of {', '.join(POLICY_NAMES)}")
    if not (math.isfinite(expected_latency_s) and expected_latency_s >= 0):
        raise ValueError(f"expected_latency_s must be a finite number >= 0, got {expected_latency_s}")
    options = wastes(snap, expected_latency_s, costs)
    if snap.context_tokens <= 0:
        return Choice("discard", options, "no KV to keep")
    if policy in ("always_discard", "prefix_cache_only"):
        return Choice("discard", options, f"fixed policy {policy}")
    if policy == "always_preserve":
        if "preserve" in options:
            return Choice("preserve", options, "fixed policy always_preserve")
        return Choice("discard", options, "always_preserve: the pin budget is full")
    action = min(options, key=lambda a: (options[a], a != "preserve"))  # ties keep the KV where it is
    detail = ", ".join(f"{a} {w:.3g}" for a, w in sorted(options.items()))
    return Choice(action, options, f"least waste (token-s): {detail}")  # type: ignore[arg-type]


ReclaimAction = Literal["keep", "swap", "discard"]


@dataclass(frozen=True)
class HeldSlot:
    """A slot admission could take from a held session (a pin, or a finished turn awaiting retain()) for a
    request that waits for memory. remaining_s: how long the session is expected to stay away (its tool's
    expected remaining time); wait_s: how long the waiting request would otherwise wait for a slot (the
    soonest a running sequence finishes; inf when nothing runs: then only taking a slot keeps the engine busy)."""

    context_tokens: int  # the held KV: what discarding makes the session recompute
    slot_tokens: int  # the memory the waiting request needs from it
    remaining_s: float
    wait_s: float
    stalled_tokens: int  # KV of the running batch, idle while a recomputation or a transfer runs
    swap_free_tokens: int  # room left in the swap tier (0: none)


def reclaim_wastes(held: HeldSlot, costs: RetentionCosts) -> dict[str, float]:
    """Memory x time waste (token-seconds) of keeping the held slot, moving its KV to the swap tier, or
    dropping it (recomputed later), when a request waits for its memory."""
    stalled = held.stalled_tokens + held.context_tokens
    out = {"discard": costs.recompute_s_per_token * held.context_tokens * stalled}
    if 0 < held.context_tokens <= held.swap_free_tokens:
        out["swap"] = 2 * costs.swap_s_per_token * held.context_tokens * (1.0 - costs.swap_overlap) * stalled
    idle_s = min(held.remaining_s, held.wait_s)  # the waiting request gets a slot when either ends
    if math.isfinite(held.wait_s) and math.isfinite(idle_s):
        out["keep"] = held.slot_tokens * max(0.0, idle_s)
    return out


def reclaim(held: HeldSlot, costs: RetentionCosts) -> ReclaimAction:
    """What admission does with a held slot it could take: the least waste (ties: keep, then swap). A
    promise never idles the engine: with nothing running, keeping is not an option. Pure, like choose()."""
    options = reclaim_wastes(held, costs)
    order = {"keep": 0, "swap": 1, "discard": 2}
    return min(options, key=lambda a: (options[a], order[a]))  # type: ignore[return-value]


class ToolLatencies:
    """Expected tool latency per tool name, learned from measured durations (the sandbox's, or the time
    between an interception and the session's return): the mean of the last `window` calls, because
    waste is linear in latency, so the mean is what minimises expected waste even for long tails."""

    def __init__(self, default_s: float = 1.0, window: int = 64) -> None:
        self.default_s = default_s
        self._seen: dict[str, deque[float]] = {}
        self._window = window

    def observe(self, tool: str, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self._seen.setdefault(tool, deque(maxlen=self._window)).append(seconds)

    def expected(self, tool: str) -> float:
        seen = self._seen.get(tool)
        return sum(seen) / len(seen) if seen else self.default_s


class CostMeter:
    """Exponentially weighted seconds per token of one kind of work (prefill, swap transfers)."""

    def __init__(self, initial_s_per_token: float, weight: float = 0.2) -> None:
        self.s_per_token = initial_s_per_token
        self._weight = weight

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds >= 0:
            self.s_per_token += self._weight * (seconds / tokens - self.s_per_token)

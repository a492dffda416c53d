"""Session KV retention in the reference engine: parked turns, pinned slots and a slower swap tier.

The reference engine gives every sequence one fixed KV slot (max_model_len positions). With retention
on, a finished single-sample turn does not return its slot to the free list at once: it is *parked*
(KV intact; when admission may take it: below) until the caller says whether the turn ended in a
tool call (`retain`). Then, as the policy chooses:

- preserve: the slot stays the session's, pinned until its TTL; the next turn whose prompt extends the
  pinned tokens is admitted straight into that slot and prefills only its new tokens. Cost: one whole
  slot (max_model_len tokens) kept from other requests, which is what the pin budget counts.
- swap: the slot's filled positions are copied into a separate tensor store (the second tier) and the
  slot is freed; on return they are copied into a fresh slot. On this CPU both tiers are host memory,
  so the slower tier is charged honestly: every transfer takes at least bytes / swap_bytes_per_s
  (the engine thread sleeps out the rest of that time after the real copy), which stands for a
  host link (PCIe) on a GPU machine. The store is bounded by swap_budget_tokens.
- discard: the slot is freed; the next turn recomputes the context (minus any prefix-cache hit).

When the head of the queue needs slots that held sessions occupy, admission weighs each held slot by the
policy's reclaim() (least waste, as retain() does): keep it (the request waits for the sooner of a running
sequence's end, a parked turn's grace, and the session's expected return), move its KV to the swap tier
(a demotion: the KV is kept), or drop it. When no slot will free itself (nothing runs, no turn awaits its
retain()), a held slot is always taken, so a promise never idles the engine.
Every fresh finished turn is parked; up to half the slots are *protected* for a short grace (park_grace_s),
so that the caller's retain(), which follows the turn within milliseconds, finds its KV even when turns
finish together; the rest, and every parked turn past its grace, stay parked unprotected: admission may
demote or drop them by reclaim(), and a late retain() still finds them (they go at ttl_max_s). Every
release records the session's context, and so does a turn that was not parked, so the engine counts every
prompt token it recomputes (`recomputed_prompt_tokens`). A turn that resumes a session is known to belong
to it, so release_session() also frees that session's last, parked turn at once.

This module holds the state (Held, KVTiers); the engine's side (retain, the loop's hooks) is
rollwise.engine.reference.session_retention.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from rollwise.engine.retention import ReleaseReason, RetentionAction, RetentionLimits
from rollwise.engine.retention_policy import CostMeter, ToolLatencies

KNOWN_CONTEXTS = 4096  # released sessions remembered for recompute accounting (oldest forgotten first)


@dataclass(eq=False)
class Held:
    """A turn's KV the engine still holds: parked (undecided), pinned in a slot, or swapped out."""

    request_id: str
    tokens: list[int]  # the context whose KV is held: prompt + sampled tokens but the last
    state: RetentionAction | None = None  # None: parked
    session_id: str | None = None
    tool_name: str = "tool"
    slot: int | None = None  # parked and preserved entries occupy a slot
    k: Tensor | None = field(default=None, repr=False)  # swapped entries: [layers, kv_heads, tokens, head_dim]
    v: Tensor | None = field(default=None, repr=False)
    deadline: float = float("inf")
    since: float = 0.0  # when the tool call started (retain), for learning its latency
    expected_s: float = 0.0  # the tool's expected latency (retain), for reclaim()
    protected_until: float = 0.0  # a parked turn within its grace: admission may not take it before then


class KVTiers:
    """The sessions whose KV the engine holds on, and the budgets bounding them."""

    def __init__(self, limits: RetentionLimits, slot_tokens: int, bytes_per_token: int, max_parked: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.max_parked = max_parked  # turns whose slots are protected at once (for the grace)
        self.slot_tokens = slot_tokens  # what a pinned slot costs: one whole slot
        self.bytes_per_token = bytes_per_token  # K and V over all layers, for the swap tier's charge
        self.clock = clock
        self.parked: OrderedDict[str, Held] = OrderedDict()  # request id -> turn, oldest first
        self.sessions: dict[str, Held] = {}  # session id -> preserved or swapped turn
        # released turns, by session id (else request id): (session id or None, the context a resume recomputes)
        self.contexts: OrderedDict[str, tuple[str | None, list[int]]] = OrderedDict()
        self.owners: OrderedDict[str, str] = OrderedDict()  # request id -> the session it resumed
        self.latencies = ToolLatencies()
        self.swap_cost = CostMeter(bytes_per_token / limits.swap_bytes_per_s)
        self.counts: dict[str, int] = {}

    # ------------------------------------------------------------ what is held

    def pinned_slots(self) -> int:
        return sum(1 for h in self.sessions.values() if h.state == "preserve")

    def swapped_tokens(self) -> int:  # swapped sessions and parked turns demoted to the swap tier
        return sum(len(h.tokens) for h in self.everything() if h.k is not None)

    def pin_free_tokens(self) -> int:
        return self.limits.pin_budget_tokens - self.pinned_slots() * self.slot_tokens

    def swap_free_tokens(self) -> int:
        return self.limits.swap_budget_tokens - self.swapped_tokens()

    def count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    # ------------------------------------------------------------ transitions

    def park(self, held: Held, slot: int) -> bool:
        """Keep a finished turn's slot until retain() decides (or its grace ends); False: grace is off."""
        if self.limits.park_grace_s <= 0:
            return False
        now = self.clock()
        held.slot, held.deadline = slot, now + self.limits.ttl_max_s
        if len(self.protected(now)) < self.max_parked:
            held.protected_until = now + self.limits.park_grace_s
        self.parked[held.request_id] = held
        return True

    def own(self, request_id: str, session_id: str | None) -> None:
        """Request `request_id` resumes `session_id` (its parked turn is that session's)."""
        if session_id is not None:
            self.owners[request_id] = session_id
            while len(self.owners) > KNOWN_CONTEXTS:
                self.owners.popitem(last=False)

    def unpark(self, request_id: str) -> Held | None:
        return self.parked.pop(request_id, None)

    def hold(self, held: Held, session_id: str, tool_name: str, action: RetentionAction, ttl_s: float,
             expected_s: float) -> None:
        """Keep a decided turn for `session_id` (preserve: in its slot; swap: k/v already set)."""
        held.state, held.session_id, held.tool_name = action, session_id, tool_name
        held.since, held.expected_s, held.protected_until = self.clock(), expected_s, 0.0
        held.deadline = held.since + ttl_s
        self.sessions[session_id] = held
        self.count(action)

    def take_resume(self, prompt: list[int], state: RetentionAction) -> Held | None:
        """The session held in `state` whose tokens the prompt extends (by at least one token), removed
        from the store: the caller resumes it. Its tool latency is learned here."""
        for session_id, held in self.sessions.items():
            n = len(held.tokens)
            if held.state == state and n < len(prompt) and prompt[:n] == held.tokens:
                del self.sessions[session_id]
                self.latencies.observe(held.tool_name, self.clock() - held.since)
                self.forget_context(session_id)
                self.count("resumed")
                return held
        return None

    def forget_context(self, session_id: str) -> None:
        self.contexts.pop(session_id, None)

    def remember_context(self, held: Held) -> None:
        key = held.session_id or held.request_id
        self.contexts[key] = (held.session_id, held.tokens)
        self.contexts.move_to_end(key)
        while len(self.contexts) > KNOWN_CONTEXTS:
            self.contexts.popitem(last=False)

    def recomputed(self, request_id: str, prompt: list[int], reused: int) -> int:
        """Prompt tokens of a released context that this prefill computes again (reused: prefix-cache hit).
        The request is then known to continue that context's session."""
        for key, (session_id, tokens) in self.contexts.items():
            n = len(tokens)
            if n < len(prompt) and prompt[:n] == tokens:
                del self.contexts[key]
                self.own(request_id, session_id)
                return max(0, n - reused)
        return 0

    def release(self, held: Held, reason: ReleaseReason) -> int | None:
        """Forget a held turn; returns the slot it occupied (the engine frees it) or None."""
        if held.state is None:
            self.parked.pop(held.request_id, None)
        elif held.session_id is not None:
            self.sessions.pop(held.session_id, None)
            self.count(f"released_{reason}")
        if reason != "session_end":  # an ended session never comes back: nothing to recompute
            self.remember_context(held)
        held.k = held.v = None
        slot, held.slot = held.slot, None
        return slot

    def expired(self, now: float) -> list[Held]:
        return [h for h in [*self.parked.values(), *self.sessions.values()] if h.deadline <= now]

    def reclaimable(self) -> list[Held]:
        """Held slots admission may take when it needs slots: pins and unprotected parked turns (protected
        ones wait for retain(): a short, bounded wait, at most half the slots for park_grace_s)."""
        protected = self.protected(self.clock())
        parked = [h for h in self.parked.values() if h not in protected and h.slot is not None]
        return parked + [h for h in self.sessions.values() if h.state == "preserve"]

    def protected(self, now: float) -> list[Held]:
        return [h for h in self.parked.values() if now < h.protected_until and h.slot is not None]

    def remaining_s(self, held: Held, now: float) -> float:
        """How long the session is expected to stay away: a parked turn until its retain() (at most its grace),
        a pin for its tool's expected remaining time (past that, until its TTL: a long tail's remaining is unknown)."""
        if held.state is None:  # within its grace retain() is due; past it, nothing is known
            return held.protected_until - now if now < held.protected_until else float("inf")
        left = held.expected_s - (now - held.since)
        return left if left > 0 else max(0.0, held.deadline - now)

    def everything(self) -> list[Held]:
        return [*self.parked.values(), *self.sessions.values()]

    # ------------------------------------------------------------ the swap tier's charge

    def charge_transfer(self, tokens: int, started: float) -> None:
        """Make a swap transfer take at least its bytes over the tier's bandwidth (time.perf_counter
        `started` before the real copy); the engine thread waits out the difference."""
        floor = tokens * self.bytes_per_token / self.limits.swap_bytes_per_s
        elapsed = time.perf_counter() - started
        if floor > elapsed:
            time.sleep(floor - elapsed)
        self.swap_cost.observe(tokens, max(floor, elapsed))

"""Session KV retention in the reference engine: parked turns, pinned slots and a slower swap tier.

The reference engine gives every sequence one fixed KV slot (max_model_len positions). With retention
on, a finished single-sample turn does not return its slot to the free list at once: it is *parked*
(KV intact, reclaimable by admission at any time) until the caller says whether the turn ended in a
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
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from torch import Tensor

from rollwise.engine.retention import (
    ReleaseReason, RetentionAction, RetentionDecision, RetentionLimits, RetentionRequest,
)
from rollwise.engine.retention_policy import (
    CostMeter, EngineSnapshot, HeldSlot, PolicyName, RetentionCosts, ToolLatencies, choose, reclaim,
    reclaim_wastes,
)
from rollwise.engine.types import GenerationRequest

if TYPE_CHECKING:
    from rollwise.engine.reference.engine import Scheduler
    from rollwise.engine.reference.model import KVCache
    from rollwise.engine.reference.prefix_cache import PrefixCache

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


class SessionRetention:
    """ReferenceEngine's side of retention (a mixin, like SpeculativeDecoding): `retain` and
    `release_session` from the contract, and the hooks the engine loop calls. Off (kv_tiers None):
    every turn's slot is freed at once and `retain` reports discard."""

    # The engine's state these methods use (set by ReferenceEngine.__init__).
    kv_tiers: KVTiers | None
    prefix_cache: PrefixCache | None
    retention_policy: PolicyName
    recompute_cost: CostMeter
    decode_step_cost: CostMeter
    scheduler: Scheduler
    cache: KVCache
    max_model_len: int
    max_num_seqs: int
    _version: int
    num_running: int
    num_waiting: int

    # ------------------------------------------------------------ the contract

    def retain(self, req: RetentionRequest) -> RetentionDecision:
        """A turn ended in a tool call: preserve, swap or discard its KV (see the module docstring)."""
        tiers = self.kv_tiers
        if tiers is None:
            return RetentionDecision(req.session_id, "discard", 0, 0.0, "retention is off on this engine")
        self._expire_retained()
        held = tiers.unpark(req.request_id)
        if held is None:
            return RetentionDecision(req.session_id, "discard", 0, 0.0,
                                     f"request {req.request_id!r} holds no KV (not finished, aborted or reclaimed)")
        if req.session_id in tiers.sessions:  # an older turn of the same session: superseded
            self._free(tiers.release(tiers.sessions[req.session_id], "session_end"))
        latency = req.expected_latency_s if req.expected_latency_s is not None else tiers.latencies.expected(req.tool_name)
        choice = choose(self.retention_policy, self._snapshot(len(held.tokens)), latency, self._costs())
        action, reason = choice.action, choice.reason
        if held.slot is None and action == "preserve":  # admission already moved it to the swap tier
            action, reason = "swap", f"{reason}; moved to the swap tier while awaiting retain (memory was needed)"
        ttl = tiers.limits.ttl(latency)
        held.session_id = req.session_id
        if action == "discard":
            self._free(tiers.release(held, "evicted"))
            tiers.count("discard")
            ttl = 0.0
        else:
            if action == "swap" and held.slot is not None:
                self._swap_out(held)
            tiers.hold(held, req.session_id, req.tool_name, action, ttl, latency)
        return RetentionDecision(req.session_id, action, len(held.tokens), ttl, reason)

    def release_session(self, session_id: str) -> bool:
        """The session ended: drop what is held for it. Returns whether anything was held."""
        if self.kv_tiers is None:
            return False
        tiers = self.kv_tiers
        held = [h for h in tiers.everything() if h.session_id == session_id]  # a pin, a swap, its last turn
        for h in held:
            self._free(tiers.release(h, "session_end"))
        tiers.forget_context(session_id)
        return any(h.state is not None for h in held)

    def retention_stats(self) -> dict[str, int]:
        tiers = self.kv_tiers
        if tiers is None:
            return {}
        return {"pinned_sessions": tiers.pinned_slots(), "swapped_tokens": tiers.swapped_tokens(),
                "parked_turns": len(tiers.parked), **tiers.counts}

    # ------------------------------------------------------------ hooks of the engine loop

    def _park(self, request_id: str, tokens: list[int], slot: int, fresh: bool) -> bool:
        """A finished turn: keep its slot parked (instead of freeing it) when a retain may follow.
        fresh: all of it was sampled by the current weights (older KV is never kept)."""
        if self.kv_tiers is None:
            return False
        held = Held(request_id, tokens[: self.cache.lengths[slot]], session_id=self.kv_tiers.owners.pop(request_id, None))
        if not fresh or not self.kv_tiers.park(held, slot):
            self.kv_tiers.remember_context(held)  # let go at once: a next turn recomputes it, and is counted
            return False
        self.scheduler.hold(slot)
        return True

    def _expire_retained(self) -> None:
        """Release promises past their TTL, except those whose session is back: its next turn already waits
        for a slot (a swapped session is swapped in only when admitted). A TTL bounds a tool that does not
        return, not a queue."""
        if self.kv_tiers is None:
            return
        expired = self.kv_tiers.expired(self.kv_tiers.clock())
        if not expired:
            return
        waiting = [r.prompt_ids for r in self.scheduler.waiting if r.params.n == 1]
        for held in expired:
            n = len(held.tokens)
            if held.state is not None and any(n < len(p) and p[:n] == held.tokens for p in waiting):
                continue
            self._free(self.kv_tiers.release(held, "ttl"))

    def _admit_pinned(self) -> list[tuple[GenerationRequest, list[int]]]:
        """Waiting single-sample requests that resume a pinned session go straight into its slot
        (they need no free slot: the session holds one)."""
        if self.kv_tiers is None or not self.kv_tiers.sessions:
            return []
        admitted = []
        for request in [r for r in self.scheduler.waiting if r.params.n == 1]:
            held = self.kv_tiers.take_resume(request.prompt_ids, "preserve")
            if held is not None:
                self.scheduler.waiting.remove(request)
                self._resuming[request.request_id] = held
                self.kv_tiers.own(request.request_id, held.session_id)
                admitted.append((request, [held.slot]))
        return admitted

    def _reclaim(self, slots_needed: int) -> None:
        """Admission needs slots that held sessions occupy: take those whose keeping wastes more than moving
        them to the swap tier or dropping them (reclaim(), least waste first). When no slot will free itself
        every held slot may be taken: a promise never idles the engine."""
        tiers = self.kv_tiers
        if tiers is None:
            return
        now, costs = tiers.clock(), self._costs()
        wait_s = self._slot_wait_s(now)
        running = self.num_running * self.max_model_len
        taken: list[tuple[float, str, Held]] = []
        for held in tiers.reclaimable():
            case = HeldSlot(len(held.tokens), self.max_model_len, tiers.remaining_s(held, now), wait_s, running,
                            tiers.swap_free_tokens())
            action = reclaim(case, costs)
            if action != "keep":
                waste = min(w for a, w in reclaim_wastes(case, costs).items() if a != "keep")
                taken.append((waste, action, held))
        for _, action, held in sorted(taken, key=lambda t: t[0])[:slots_needed]:
            if action == "swap" and len(held.tokens) <= tiers.swap_free_tokens():
                self._swap_out(held)  # demoted, the KV kept (a parked turn's retain() still decides)
                if held.state == "preserve":
                    held.state = "swap"
                tiers.count("demoted")
            else:
                self._free(tiers.release(held, "evicted"))

    def _resume_start(self, group: list[tuple[GenerationRequest, list[int]]]) -> int:
        """Positions of the group's prompt already in its slot: a resumed pinned or swapped session's
        context (swapped KV is copied back in here), else 0."""
        if self.kv_tiers is None or len(group) != 1 or group[0][0].params.n != 1:
            return 0
        request, [slot] = group[0]
        held = self._resuming.pop(request.request_id, None) or self.kv_tiers.take_resume(request.prompt_ids, "swap")
        if held is None:
            return 0
        self.kv_tiers.own(request.request_id, held.session_id)
        n = len(held.tokens)
        if held.state == "swap":
            started = time.perf_counter()
            self.cache.k[:, slot, :, :n] = held.k
            self.cache.v[:, slot, :, :n] = held.v
            self.kv_tiers.charge_transfer(n, started)
            held.k = held.v = None
        return n

    def _recomputed(self, request_id: str, prompt: list[int], reused: int) -> int:
        return self.kv_tiers.recomputed(request_id, prompt, reused) if self.kv_tiers is not None else 0

    def _release_retained(self, reason: ReleaseReason, request_id: str | None = None) -> None:
        """Release what is held (only what came from `request_id`, if given): abort, weight update, sleep."""
        if self.kv_tiers is not None:
            for held in self.kv_tiers.everything():
                if request_id is None or held.request_id == request_id:
                    self._free(self.kv_tiers.release(held, reason))

    # ------------------------------------------------------------ internals

    def _swap_out(self, held: Held) -> None:
        n, slot = len(held.tokens), held.slot
        started = time.perf_counter()
        held.k = self.cache.k[:, slot, :, :n].clone()
        held.v = self.cache.v[:, slot, :, :n].clone()
        self.kv_tiers.charge_transfer(n, started)
        self._free(slot)
        held.slot = None

    def _costs(self) -> RetentionCosts:
        return RetentionCosts(self.recompute_cost.s_per_token, self.kv_tiers.swap_cost.s_per_token)

    def _slot_wait_s(self, now: float) -> float:
        """How long until a slot frees itself: a running sequence finishing (its token budget at the measured
        seconds per decode step) or a protected parked turn's grace ending; inf when neither can happen."""
        left = [min(s.request.params.max_tokens - len(s.token_ids),
                    self.max_model_len - len(s.request.prompt_ids) - len(s.token_ids))
                for s in self.scheduler.running.values()]
        running = max(1, min(left)) * self.decode_step_cost.s_per_token if left else float("inf")
        return min([running, *(h.protected_until - now for h in self.kv_tiers.protected(now))])

    def _free(self, slot: int | None) -> None:
        if slot is not None:
            self.scheduler.free(slot)

    def _snapshot(self, context_tokens: int) -> EngineSnapshot:
        """The engine in tokens, as the policy sees it: every slot costs max_model_len tokens."""
        tiers, L = self.kv_tiers, self.max_model_len
        held_slots = tiers.pinned_slots() + len(tiers.parked) + 1  # + 1: this turn's own slot
        return EngineSnapshot(
            context_tokens=context_tokens, pin_cost_tokens=L, running_tokens=self.num_running * L,
            used_tokens=(self.num_running + held_slots) * L, capacity_tokens=self.max_num_seqs * L,
            waiting=self.num_waiting, pin_free_tokens=tiers.pin_free_tokens(), swap_free_tokens=tiers.swap_free_tokens(),
            prefix_cached=self.prefix_cache is not None,
        )

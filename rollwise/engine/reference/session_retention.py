"""ReferenceEngine's side of session KV retention (issue 21): `retain` and `release_session` from the
contract, and the hooks the engine loop calls (park a finished turn, expire promises, admit a pinned
session into its slot, take held slots for waiting requests by reclaim(), swap in and out). The state
they act on, and the mechanism in words, are in rollwise.engine.reference.kv_tiers. `SessionRetention` is a
component ReferenceEngine holds (also with retention off: kv_tiers None); the engine's KV cache is an argument of
the methods that copy or measure KV, as the engine frees and re-allocates it on sleep/wake."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rollwise.engine.reference.kv_tiers import Held, KVTiers
from rollwise.engine.retention import ReleaseReason, RetentionDecision, RetentionRequest
from rollwise.engine.retention_policy import (
    CostMeter, EngineSnapshot, HeldSlot, PolicyName, RetentionCosts, choose, reclaim, reclaim_wastes,
)
from rollwise.types.generation import GenerationRequest

if TYPE_CHECKING:
    from rollwise.engine.reference.scheduler import Scheduler
    from rollwise.engine.reference.model import KVCache, LlamaFamilyModel
    from rollwise.engine.retention import RetentionLimits


class SessionRetention:
    """ReferenceEngine's retention component: `retain` and `release_session` from the contract, and the hooks
    the engine loop calls. Off (kv_tiers None): every turn's slot is freed at once and `retain` reports discard."""

    @classmethod
    def for_model(cls, model: LlamaFamilyModel, limits: RetentionLimits | None, policy: PolicyName,
                  scheduler: Scheduler, max_model_len: int, max_num_seqs: int, prefix_cached: bool) -> SessionRetention:
        """The component for an engine over `model` (ValueError: retention on with a mixture-of-experts model)."""
        if limits is not None and model.is_moe:
            raise ValueError("session KV retention with a mixture-of-experts model is not supported by the reference "
                             "engine (a resumed prefix would need its routing kept); turn engine retention off")
        shape = model.config.shape
        bytes_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * model.dtype.itemsize
        return cls(limits, policy, scheduler, max_model_len, max_num_seqs, bytes_per_token, prefix_cached)

    def __init__(self, limits: RetentionLimits | None, policy: PolicyName, scheduler: Scheduler, max_model_len: int,
                 max_num_seqs: int, bytes_per_token: int, prefix_cached: bool) -> None:
        self.kv_tiers = None if limits is None else KVTiers(limits, max_model_len, bytes_per_token,
                                                            max_parked=max(1, max_num_seqs // 2))
        self.retention_policy = policy
        self.decode_step_cost = CostMeter(1e-2)  # seconds per decode step: when a running sequence frees its slot
        self.recompute_cost = CostMeter(1e-4)  # seconds per prefilled token, measured by every prefill
        self.scheduler = scheduler  # the engine's
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.prefix_cached = prefix_cached  # the engine keeps a prefix cache (the policy weighs it)
        self.resuming: dict[str, Held] = {}  # request id -> the pinned session it resumes (admitted into its slot)

    # ------------------------------------------------------------ the contract

    def retain(self, req: RetentionRequest, cache: KVCache) -> RetentionDecision:
        """A turn ended in a tool call: preserve, swap or discard its KV (see the module docstring)."""
        tiers = self.kv_tiers
        if tiers is None:
            return RetentionDecision(req.session_id, "discard", 0, 0.0, "retention is off on this engine")
        self.expire()
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
                self._swap_out(held, cache)
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

    def park(self, request_id: str, tokens: list[int], slot: int, fresh: bool, cache: KVCache) -> bool:
        """A finished turn: keep its slot parked (instead of freeing it) when a retain may follow.
        fresh: all of it was sampled by the current weights (older KV is never kept)."""
        if self.kv_tiers is None:
            return False
        held = Held(request_id, tokens[: cache.lengths[slot]], session_id=self.kv_tiers.owners.pop(request_id, None))
        if not fresh or not self.kv_tiers.park(held, slot):
            self.kv_tiers.remember_context(held)  # let go at once: a next turn recomputes it, and is counted
            return False
        self.scheduler.hold(slot)
        return True

    def expire(self) -> None:
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

    def admit_pinned(self) -> list[tuple[GenerationRequest, list[int]]]:
        """Waiting single-sample requests that resume a pinned session go straight into its slot
        (they need no free slot: the session holds one)."""
        if self.kv_tiers is None or not self.kv_tiers.sessions:
            return []
        admitted = []
        for request in [r for r in self.scheduler.waiting if r.params.n == 1]:
            held = self.kv_tiers.take_resume(request.prompt_ids, "preserve")
            if held is not None:
                self.scheduler.waiting.remove(request)
                self.resuming[request.request_id] = held
                self.kv_tiers.own(request.request_id, held.session_id)
                admitted.append((request, [held.slot]))
        return admitted

    def reclaim(self, slots_needed: int, cache: KVCache) -> None:
        """Admission needs slots that held sessions occupy: take those whose keeping wastes more than moving
        them to the swap tier or dropping them (reclaim(), least waste first). When no slot will free itself
        every held slot may be taken: a promise never idles the engine."""
        tiers = self.kv_tiers
        if tiers is None:
            return
        now, costs = tiers.clock(), self._costs()
        wait_s = self._slot_wait_s(now)
        running = len(self.scheduler.running) * self.max_model_len
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
                self._swap_out(held, cache)  # demoted, the KV kept (a parked turn's retain() still decides)
                if held.state == "preserve":
                    held.state = "swap"
                tiers.count("demoted")
            else:
                self._free(tiers.release(held, "evicted"))

    def resume_start(self, group: list[tuple[GenerationRequest, list[int]]], cache: KVCache) -> int:
        """Positions of the group's prompt already in its slot: a resumed pinned or swapped session's
        context (swapped KV is copied back in here), else 0."""
        if self.kv_tiers is None or len(group) != 1 or group[0][0].params.n != 1:
            return 0
        request, [slot] = group[0]
        held = self.resuming.pop(request.request_id, None) or self.kv_tiers.take_resume(request.prompt_ids, "swap")
        if held is None:
            return 0
        self.kv_tiers.own(request.request_id, held.session_id)
        n = len(held.tokens)
        if held.state == "swap":
            started = time.perf_counter()
            cache.k[:, slot, :, :n] = held.k
            cache.v[:, slot, :, :n] = held.v
            self.kv_tiers.charge_transfer(n, started)
            held.k = held.v = None
        return n

    def recomputed(self, request_id: str, prompt: list[int], reused: int) -> int:
        return self.kv_tiers.recomputed(request_id, prompt, reused) if self.kv_tiers is not None else 0

    def release(self, reason: ReleaseReason, request_id: str | None = None) -> None:
        """Release what is held (only what came from `request_id`, if given): abort, weight update, sleep."""
        if self.kv_tiers is not None:
            for held in self.kv_tiers.everything():
                if request_id is None or held.request_id == request_id:
                    self._free(self.kv_tiers.release(held, reason))

    # ------------------------------------------------------------ internals

    def _swap_out(self, held: Held, cache: KVCache) -> None:
        n, slot = len(held.tokens), held.slot
        started = time.perf_counter()
        held.k = cache.k[:, slot, :, :n].clone()
        held.v = cache.v[:, slot, :, :n].clone()
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
        parked = sum(h.slot is not None for h in tiers.parked.values())  # not those already moved to the swap tier
        held_slots = tiers.pinned_slots() + parked + 1  # + 1: this turn's own slot
        return EngineSnapshot(
            context_tokens=context_tokens, pin_cost_tokens=L, running_tokens=len(self.scheduler.running) * L,
            used_tokens=(len(self.scheduler.running) + held_slots) * L, capacity_tokens=self.max_num_seqs * L,
            waiting=sum(r.params.n for r in self.scheduler.waiting), pin_free_tokens=tiers.pin_free_tokens(),
            swap_free_tokens=tiers.swap_free_tokens(),
            prefix_cached=self.prefix_cached,
        )

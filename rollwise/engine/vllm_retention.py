"""VLLMEngine's side of session KV retention (issue 21): pins in vLLM's own prefix cache.

What vLLM 0.32 does with a finished request's KV (checked against its source, vllm/v1/core/block_pool.py):
its blocks go back to the block pool's free queue; full blocks keep their hash (the automatic prefix cache)
and sit at the queue's LRU end until an allocation evicts them. A pin here is one more reference on those
cached blocks: the turn's tokens (prompt + output) are hashed with the engine core's own block hasher, the
blocks looked up the way admission does (`find_longest_cache_hit`) and `touch`ed, which takes them out of
the free queue, so no allocation can evict them. The next turn's admission finds them as a prefix-cache hit
and takes its own reference; the pin is then released (`free_blocks`, back at the LRU end, still cached).
A preserved session therefore recomputes only its last, partial block (< block_size tokens) and its new
tokens. The retain() call comes from the agent after the turn's completion reached it, and under memory
pressure the very next step's allocations would evict the turn's blocks (tail first) before then, so a
finished single-sample turn is parked: pinned at once, within the pin budget, for park_grace_s, until its
retain() decides (a later retain() finds what is still cached). Discard under `always_discard` removes the turn's idle blocks from the prefix cache
(`evict_blocks`); under the other policies discard leaves them to the LRU (that is vLLM's prefix cache).
Swap is not offered: vLLM's KV offloading connectors copy with CUDA streams and do not run on the CPU build,
so every decision is preserve or discard (`swap_free_tokens` 0 for the shared policy).

Promises never block the engine: pins hold at most `pin_budget_tokens` of KV; before every step, while a
request waits for blocks that pins hold (or the running batch is about to run out of blocks), pins are
released by reclaim(), least waste first, all of them when nothing runs; TTLs, abort, weight updates
(the KV was computed by the old weights), sleep and the session's end release them too.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from rollwise.engine.retention import ReleaseReason, RetentionDecision, RetentionLimits, RetentionRequest
from rollwise.engine.retention_policy import (
    CostMeter, EngineSnapshot, HeldSlot, PolicyName, RetentionCosts, ToolLatencies, choose, reclaim, reclaim_wastes,
)

RECENT_TURNS = 256  # finished single-sample turns remembered for a retain() that follows (it comes within ms)
# The policy's view of memory pressure: the peak over the last steps, not the instant of retain(), which on
# vLLM comes just after the turn's own blocks went back to the pool (and reads low: the first vLLM bench
# discarded 12 of 16 turns on that reading, then the LRU evicted them). ~2-3 s of steps on this CPU.
PRESSURE_WINDOW_STEPS = 32


@dataclass
class Pin:
    """One preserved session: the cached blocks it holds a reference on, and until when."""

    session_id: str
    request_id: str
    tokens: list[int]  # the turn's whole context (prompt + output): the next turn's prompt starts with it
    blocks: list[Any]  # vLLM KVCacheBlocks (its full blocks still cached), touched once by this pin
    expires_at: float
    started_at: float
    tool_name: str
    resumed_by: str | None = None  # the vLLM request of the session's next turn, once it arrived


@dataclass
class _Turn:
    """A finished single-sample turn, awaiting its retain(): parked (its blocks touched) until parked_until."""

    tokens: list[int]
    lora: Any
    blocks: list[Any] = field(default_factory=list)
    parked_until: float = 0.0


@dataclass
class VllmSessionPins:
    """Preserve (pin) or discard a finished turn's KV inside one in-process vLLM engine core."""

    core: Any  # vllm.v1.engine.core.EngineCore (in-process)
    limits: RetentionLimits
    policy: PolicyName
    clock: Callable[[], float] = time.monotonic
    latencies: ToolLatencies = field(default_factory=ToolLatencies)
    # Seconds per recomputed context token and per decode step, measured on this engine's steps.
    recompute_cost: CostMeter = field(default_factory=lambda: CostMeter(1e-4))
    decode_step_cost: CostMeter = field(default_factory=lambda: CostMeter(0.02))
    pins: dict[str, Pin] = field(default_factory=dict)  # session id -> pin
    counts: dict[str, int] = field(default_factory=lambda: {
        "preserve": 0, "discard": 0, "released_resumed": 0, "released_ttl": 0, "released_session_end": 0,
        "released_abort": 0, "released_weight_update": 0, "released_evicted": 0, "released_sleep": 0, "parked_dropped": 0,
        "resumed_context_tokens": 0, "recomputed_context_tokens": 0})
    _turns: OrderedDict[str, _Turn] = field(default_factory=OrderedDict)
    _resuming: dict[str, Pin] = field(default_factory=dict)  # vLLM request id of a next turn -> its pin
    # (blocks in use, requests waiting) after each of the last steps
    _recent: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=PRESSURE_WINDOW_STEPS))

    # ------------------------------------------------------------ vLLM's parts

    @property
    def _scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def _pool(self) -> Any:
        return self._scheduler.kv_cache_manager.block_pool

    @property
    def block_size(self) -> int:
        return int(self._scheduler.block_size)

    @property
    def capacity_tokens(self) -> int:
        return (self._pool.num_gpu_blocks - 1) * self.block_size  # block 0 is vLLM's null block

    def _used_blocks(self) -> int:
        """KV blocks in use now (block 0, vLLM's null block, never counts)."""
        return self._pool.num_gpu_blocks - 1 - self._pool.get_num_free_blocks()

    def pinned_tokens(self) -> int:
        return sum(len(p.blocks) for p in self.pins.values()) * self.block_size

    def held_tokens(self) -> int:
        """Pins and parked turns: what the pin budget bounds."""
        return self.pinned_tokens() + sum(len(t.blocks) for t in self._turns.values()) * self.block_size

    def _cached_blocks(self, tokens: list[int], lora: Any) -> list[Any]:
        """The turn's full blocks still in the prefix cache, found as admission would find them."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        hasher = self.core.request_block_hasher
        if hasher is None or len(tokens) < self.block_size:
            return []
        probe = Request(request_id="rollwise-retention-probe", prompt_token_ids=list(tokens),
                        sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                        lora_request=lora, block_hasher=hasher)
        groups, _, _ = self._scheduler.kv_cache_manager.coordinator.find_longest_cache_hit(
            probe.block_hashes, len(tokens))
        return [block for group in groups for block in group]

    # ------------------------------------------------------------ the engine's hooks

    def turn_finished(self, vid: str, request_id: str, tokens: list[int], lora: Any, cached_prompt_tokens: int) -> None:
        """A single-sample turn finished: remember its tokens for retain(); if it resumed a pinned session,
        count how much of the pinned context it recomputed."""
        old = self._turns.pop(request_id, None)
        if old is not None:
            self._unpark(old)
        turn = _Turn(tokens, lora)
        blocks = self._cached_blocks(tokens, lora) if self.limits.park_grace_s > 0 else []
        if blocks and self.held_tokens() + len(blocks) * self.block_size <= self.limits.pin_budget_tokens:
            self._pool.touch(blocks)
            turn.blocks, turn.parked_until = blocks, self.clock() + self.limits.park_grace_s
        self._turns[request_id] = turn
        while len(self._turns) > RECENT_TURNS:
            self._unpark(self._turns.popitem(last=False)[1])
        pin = self._resuming.pop(vid, None)
        if pin is not None:
            context = len(pin.tokens)
            self.counts["resumed_context_tokens"] += context
            self.counts["recomputed_context_tokens"] += max(0, context - cached_prompt_tokens)
            if pin.blocks:  # admitted and finished within one step: its own reference is gone already
                self._release(pin, "resumed")

    def request_added(self, vid: str, prompt: list[int]) -> None:
        """A new single-sample request: the next turn of a pinned session when the pin's tokens prefix it."""
        for pin in self.pins.values():
            n = len(pin.tokens)
            if pin.resumed_by is None and n < len(prompt) and prompt[:n] == pin.tokens:
                pin.resumed_by = vid
                self._resuming[vid] = pin
                self.latencies.observe(pin.tool_name, self.clock() - pin.started_at)
                return

    def request_aborted(self, vid: str) -> None:
        """A vLLM request ended by abort. If it was a session's next turn, the pin it would have resumed from
        is released: nothing else would (a pin whose session is back neither expires nor is reclaimed)."""
        pin = self._resuming.pop(vid, None)
        if pin is not None:
            self._release(pin, "abort")

    def expire(self) -> None:
        """Release pins past their TTL, except those whose session is back (its next turn keeps the pin until
        vLLM admits it: a TTL bounds a tool that does not return, not a queue)."""
        now = self.clock()
        for pin in [p for p in self.pins.values() if p.expires_at <= now and p.resumed_by is None]:
            self._release(pin, "ttl")
        for turn in self._turns.values():
            if turn.blocks and turn.parked_until <= now:
                self._unpark(turn)  # back to the LRU: a later retain() finds what is still cached

    def before_step(self) -> None:
        """Expire TTLs and give blocks back to waiting requests by reclaim()."""
        self.expire()
        if self.held_tokens():
            self._reclaim(self.clock())

    def after_step(self, seconds: float, scheduled_prompt_tokens: int, running: int) -> None:
        """Release pins whose next turn vLLM admitted (it holds its own reference on the blocks now), and
        measure: a step that computed many prompt tokens prices recomputation, a decode-only step a step."""
        from vllm.v1.request import RequestStatus

        if self._resuming:
            # vLLM's input processor makes each request id unique as f"{our id}-{8 random hex}"
            requests = {rid.rsplit("-", 1)[0]: r for rid, r in self._scheduler.requests.items()}
            for vid, pin in list(self._resuming.items()):
                req = requests.get(vid)
                # Running: it holds its own references on the blocks now (waiting, it holds none).
                if pin.blocks and (req is None or req.status == RequestStatus.RUNNING):
                    self._release(pin, "resumed")
        if scheduled_prompt_tokens > 4 * max(1, running):
            self.recompute_cost.observe(scheduled_prompt_tokens, seconds)
        elif scheduled_prompt_tokens == 0 and running > 0:
            self.decode_step_cost.observe(1, seconds)
        self._recent.append((self._used_blocks(), len(self._scheduler.waiting)))

    # ------------------------------------------------------------ the contract

    def retain(self, req: RetentionRequest) -> RetentionDecision:
        self.expire()
        turn = self._turns.pop(req.request_id, None)
        if turn is None:
            return RetentionDecision(req.session_id, "discard", 0, 0.0,
                                     f"request {req.request_id!r} holds no KV (not finished, more than one "
                                     "sample, or unknown)")
        old = self.pins.get(req.session_id)
        if old is not None:  # an older turn of the same session: superseded
            self._release(old, "session_end")
        parked = bool(turn.blocks)
        blocks = turn.blocks if parked else self._cached_blocks(turn.tokens, turn.lora)
        tokens = len(blocks) * self.block_size
        latency = req.expected_latency_s if req.expected_latency_s is not None else self.latencies.expected(req.tool_name)
        # the budget left besides this turn's own parked blocks
        room = self.limits.pin_budget_tokens - self.held_tokens() + (tokens if parked else 0)
        choice = choose(self.policy, self._snapshot(len(turn.tokens), 0 if parked else tokens, tokens, room), latency,
                        self._costs())
        if choice.action != "preserve":
            self._unpark(turn)
            if self.policy == "always_discard":  # no prefix cache either: the next turn recomputes it all
                self._pool.evict_blocks({b.block_id for b in blocks if b.ref_cnt == 0})
            self.counts["discard"] += 1
            return RetentionDecision(req.session_id, "discard", tokens, 0.0, choice.reason)
        if not parked:
            self._pool.touch(blocks)
        ttl = self.limits.ttl(latency)
        now = self.clock()
        self.pins[req.session_id] = Pin(req.session_id, req.request_id, turn.tokens, blocks, now + ttl, now,
                                        req.tool_name)
        self.counts["preserve"] += 1
        return RetentionDecision(req.session_id, "preserve", tokens, ttl, choice.reason)

    def release_session(self, session_id: str) -> bool:
        pin = self.pins.get(session_id)
        if pin is None:
            return False
        self._release(pin, "session_end")
        return True

    def release_all(self, reason: ReleaseReason, request_id: str | None = None) -> None:
        """Abort (the pins that came from `request_id`), weight update or sleep (every pin)."""
        for pin in list(self.pins.values()):
            if request_id is None or pin.request_id == request_id:
                self._release(pin, reason)
        if request_id is None:  # their KV is stale (weights) or gone (sleep)
            for turn in self._turns.values():
                self._unpark(turn)
            self._turns.clear()
            self._resuming.clear()  # their pins are released: nothing left to resume from
        else:
            turn = self._turns.pop(request_id, None)
            if turn is not None:
                self._unpark(turn)

    def stats(self) -> dict[str, int]:
        return {"pinned_sessions": len(self.pins), "pinned_tokens": self.pinned_tokens(), **self.counts}

    # ------------------------------------------------------------ internals

    def _unpark(self, turn: _Turn) -> None:
        if turn.blocks:
            self._pool.free_blocks(reversed(turn.blocks))
            turn.blocks = []

    def _release(self, pin: Pin, reason: ReleaseReason) -> None:
        if self.pins.get(pin.session_id) is pin:
            del self.pins[pin.session_id]
        if pin.blocks:
            self._pool.free_blocks(reversed(pin.blocks))  # the prefix's tail is evicted first, as vLLM frees
            pin.blocks = []
            self.counts[f"released_{reason}"] += 1

    def _costs(self) -> RetentionCosts:
        return RetentionCosts(self.recompute_cost.s_per_token, swap_s_per_token=float("inf"))

    def _snapshot(self, context_tokens: int, unheld_tokens: int, pin_cost_tokens: int,
                  pin_room_tokens: int) -> EngineSnapshot:
        """unheld_tokens: this turn's blocks that are free (cached) now; preserving would hold them."""
        sched, bs = self._scheduler, self.block_size
        peak_used = max([self._used_blocks(), *(u for u, _ in self._recent)])
        waiting = max([len(sched.waiting), *(w for _, w in self._recent)])
        running = sum(r.num_computed_tokens for r in sched.running)
        return EngineSnapshot(
            context_tokens=context_tokens, pin_cost_tokens=pin_cost_tokens, running_tokens=running,
            used_tokens=min(self.capacity_tokens, peak_used * bs + unheld_tokens),
            capacity_tokens=self.capacity_tokens, waiting=waiting,
            pin_free_tokens=max(0, pin_room_tokens),
            swap_free_tokens=0, prefix_cached=True,
        )

    def _blocks_needed(self) -> int:
        """Blocks the engine needs now and lacks: the head of the waiting queue's prompt, and one block per
        running sequence (each may cross into a new block this step). 0: memory is not short."""
        sched, bs = self._scheduler, self.block_size
        want = len(sched.running)
        if sched.waiting:
            head = next(iter(sched.waiting))
            want += -(-head.num_tokens // bs)
        return max(0, want - self._pool.get_num_free_blocks())

    def _reclaim(self, now: float) -> None:
        short = self._blocks_needed()
        if short <= 0:
            return
        sched, bs, costs = self._scheduler, self.block_size, self._costs()
        left = [r.max_tokens - r.num_output_tokens for r in sched.running]
        wait_s = max(1, min(left)) * self.decode_step_cost.s_per_token if left else float("inf")
        running = sum(r.num_computed_tokens for r in sched.running)
        taken: list[tuple[float, Pin]] = []
        for pin in self.pins.values():
            if pin.resumed_by is not None:
                continue  # its next turn is queued: the pin is what it will resume from
            case = HeldSlot(len(pin.tokens), short * bs, max(0.0, pin.expires_at - now), wait_s, running, 0)
            if reclaim(case, costs) != "keep":
                taken.append((reclaim_wastes(case, costs)["discard"], pin))
        for _, pin in sorted(taken, key=lambda t: t[0]):
            if short <= 0:
                break
            short -= len(pin.blocks)
            self._release(pin, "evicted")
        if short > 0 and not sched.running:  # parked turns are protected for their retain(), but never idle the engine
            for turn in self._turns.values():
                if short <= 0:
                    break
                short -= len(turn.blocks)
                if turn.blocks:
                    self.counts["parked_dropped"] += 1
                self._unpark(turn)

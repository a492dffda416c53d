"""The simulator's model of intercept-aware KV retention (issue 21): agentic sessions that stop at tool
calls, on one engine under KV pressure, with the production retention policy (rollwise.engine.
retention_policy.choose and reclaim, unchanged) deciding at every interception.

Per engine step (the cost model's shape, rollwise.sim.cost): the prefills of admitted turns (their new
tokens, plus the context again when it was discarded; on the reference engine each its own forward pass,
at least a decode step's cost), one decode token for every running turn (the reference engine also
decodes a turn in its prefill's step: cost.decode_after_prefill), plus the swap tier's transfers.

Memory: a running turn holds `slot_tokens` (the reference engine: one whole slot) or its context + output
(paged engines: vLLM on GPU). What the engine does with a finished turn, as rollwise.engine.reference does:
- it parks: the turn's KV stays until the caller's retain() (or, after the last turn, release_session())
  is served. The caller learns of the turn when its step ends and its call arrives while the next step
  runs, so it is served after that step; on up to half the slots the turn is protected, the rest
  admission may take by reclaim() (moved to the swap tier, or dropped: retain() then discards). When a
  step runs nothing the calls are served one by one, admission trying between them.
- retain(): the policy preserves (the memory stays pinned until the session is back and its turn runs, or
  its TTL ends), swaps (the swap tier, with a TTL too) or discards. A TTL does not end a promise whose
  session is back. Admission weighs pins by reclaim() as well: keep, demote to swap, or drop.
- the prefix cache (every policy but always_discard, when prefix_cache_tokens > 0): on paged engines the
  discarded contexts in free KV, evicted first when admission needs memory (as vLLM's freed blocks are);
  on the reference engine an LRU over blocks of every prompt and history, beside the slots
  (rollwise.sim.intercept_cache).
Tool latencies are lognormal per tool (long tails, optionally capped); the expected latency the policy
sees is learned per tool from the latencies seen so far, as in the agent.

Engines are independent here (the router keeps a session on the replica holding its KV), so a cluster
of G GPUs is G / gpus_per_engine copies of one engine: `rollwise sim intercept` reports one engine's
run and its projection to 64..4096 GPUs with a cost model (bundled: h100-7b, h100-32b), or replays
`rollwise bench intercept` (rollwise.sim.intercept_cli).
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from rollwise.engine.retention_policy import (
    POLICY_NAMES, EngineSnapshot, HeldSlot, PolicyName, ReclaimAction, RetentionCosts, ToolLatencies, choose,
    reclaim, reclaim_wastes,
)
from rollwise.sim.cost import CostModel
from rollwise.sim.intercept_cache import BlockPrefixCache
from rollwise.sim.intercept_models import InterceptResult, InterceptWorkload, RetentionModel, ToolSpec


@dataclass
class _Session:
    sid: int
    turn: int = 0
    context: int = 0  # tokens with KV after the last turn
    held: str | None = None  # preserve | swap | cache (paged prefix cache) | None
    deadline: float = math.inf
    since: float = 0.0  # when its tool call started
    expected: float = 0.0  # its tool's expected latency then
    ready_at: float = 0.0
    tool: str = ""
    calls: int = 0  # tool calls so far (tool_order: rotate)


@dataclass
class _Run:
    session: _Session
    remaining: int
    tokens: int  # context + tokens so far
    memory: int


@dataclass
class _Parked:
    """A finished turn whose KV stays in its memory until the caller's retain() (or, after the episode's
    last turn, release_session()) is served. The caller learns of the turn when the step ends and its call
    reaches the engine while the next step runs, so it is served after that step: the next step's
    admission sees the turn parked (protected, or reclaimable like a pin)."""

    session: _Session
    memory: int  # 0 once admission took it (dropped, or demoted to the swap tier)
    protected_until: float
    last: bool  # the episode's last turn
    demoted: bool = False


def simulate(cost: CostModel, model: RetentionModel, work: InterceptWorkload, policy: PolicyName,
             seed: int = 0) -> InterceptResult:
    """One engine running `work` under `policy`, on a virtual clock."""
    return _Sim(cost, model, work, policy, seed).run()


class _Sim:
    def __init__(self, cost: CostModel, model: RetentionModel, work: InterceptWorkload, policy: PolicyName,
                 seed: int) -> None:
        if policy not in POLICY_NAMES:
            raise ValueError(f"policy: unknown retention policy {policy!r}; choose one of {', '.join(POLICY_NAMES)}")
        self.cost, self.model, self.work, self.policy = cost, model, work, policy
        self.rng = random.Random(seed)
        self.t = 0.0
        self.waiting: deque[_Session] = deque()
        self.tools: list[tuple[float, int, _Session]] = []  # (return time, sid, session)
        self.running: list[_Run] = []
        self.admitting: list[_Run] = []  # admitted in the admission under way
        self.held: dict[int, _Session] = {}  # preserved and swapped sessions (the engine's tiers.sessions)
        self.parked: list[_Parked] = []  # turns finished in the last step, their retain() not served yet
        self.swapped = 0
        self.max_protected = max(1, cost.max_num_seqs // 2)  # as the reference engine's max_parked
        cached = policy != "always_discard" and model.prefix_cache_tokens > 0
        # The prefix cache: in free KV blocks on paged engines (discarded contexts, evicted first when memory
        # is needed); beside the slots on the reference engine (BlockPrefixCache: every prompt and history).
        self.cache: OrderedDict[int, _Session] | None = OrderedDict() if cached and model.slot_tokens is None else None
        self.blocks = BlockPrefixCache(model.prefix_cache_tokens, cost.block_size) if cached and model.slot_tokens else None
        default_s = work.expected_default_s or statistics.median(t.median_s for t in work.tools)
        self.latencies = ToolLatencies(default_s=default_s)
        self.costs = RetentionCosts(cost.prefill_s_per_token, model.swap_s_per_token, model.swap_overlap)
        self.started = self.done = 0
        self.prompt_tokens = self.recomputed = 0
        self.waste = 0.0
        self.turn_latencies: list[float] = []
        self.actions: dict[str, int] = {}
        self.reclaimed: dict[str, int] = {}
        self.pending_swap = 0  # swap-out tokens charged to the next step

    # ------------------------------------------------------------ the loop

    def run(self) -> InterceptResult:
        # The first turn finds the engine idle, and it steps at once; the other sessions' first turns (the
        # callers start one after another) arrive while that first step runs.
        self._start_session()
        while self.done < self.work.sessions:
            self._returns()
            self._expire()
            prefills, recompute, swap_in = self._admit()
            while self.started < min(self.work.concurrency, self.work.sessions):
                self._start_session()
            if not self.running:
                # An empty step: the engine spins, admitting whenever a caller's call is served; the calls
                # arrive one at a time (milliseconds apart), so between two of them admission may take a
                # parked turn whose retain() has not come (once no protected one is left, it must).
                if self.parked:
                    self._serve([self.parked.pop(0)])
                    continue
                if not self.tools:
                    raise RuntimeError("intercept sim: nothing runs and no tool is out (a turn never fits: "
                                       "raise kv_capacity_tokens or lower the workload's token counts)")
                self.t = max(self.t, self.tools[0][0])
                continue
            held = sum(r.memory for r in self.running)
            swap_s = (swap_in + self.pending_swap) * self.model.swap_s_per_token * (1 - self.model.swap_overlap)
            dt = (sum(self._prefill_s(n) for n in prefills) + swap_s
                  + self.cost.decode_s(len(self.running), sum(r.tokens for r in self.running)))
            self.waste += (recompute * self.cost.prefill_s_per_token + swap_s) * held
            self.pending_swap = 0
            self.t += dt
            served, self.parked = self.parked, []
            self._decode(served)
            self._returns()  # sessions back during the step are queued when the calls are served
            self._serve(served)
        return InterceptResult(
            self.policy, self.done, self.t, self.done / self.t if self.t else 0.0, self.prompt_tokens,
            self.recomputed, self.waste, _quantile(self.turn_latencies, 0.5), _quantile(self.turn_latencies, 0.99),
            dict(self.actions), dict(self.reclaimed))

    def _start_session(self) -> None:
        session = _Session(self.started, ready_at=self.t)
        self.started += 1
        self.waiting.append(session)

    def _returns(self) -> None:
        while self.tools and self.tools[0][0] <= self.t:
            back, _, session = heapq.heappop(self.tools)
            self.latencies.observe(session.tool, back - session.since)
            session.ready_at = back
            # Back: a promise is kept until its turn runs (a TTL bounds tools that do not return, not a queue).
            session.deadline = math.inf
            if session.held == "preserve":  # it goes first, as the engine admits a pinned session into its own
                self.waiting.appendleft(session)  # memory ahead of the queue (reference SessionRetention.admit_pinned)
            else:
                self.waiting.append(session)

    def _expire(self) -> None:
        for session in [s for s in self.held.values() if s.deadline <= self.t]:
            self._count(self.reclaimed, "pins_expired")  # as the bench counts them: pins and swapped sessions
            self._release(session)

    # ------------------------------------------------------------ memory

    def _memory(self, prompt: int) -> int:
        return self.model.slot_tokens or prompt + self.work.output_tokens

    def _pins(self) -> list[_Session]:
        return [s for s in self.held.values() if s.held == "preserve"]

    def _used(self) -> int:
        used = (sum(r.memory for r in [*self.running, *self.admitting]) + sum(self._memory(s.context) for s in self._pins())
                + sum(p.memory for p in self.parked))
        if self.cache is not None:  # paged engines keep their prefix cache in free KV blocks
            used += sum(s.context for s in self.cache.values())
        return used

    def _prefill_s(self, tokens: int) -> float:
        """One admitted turn's prefill. The reference engine (slots) runs each in a forward pass of its own, which
        costs at least what a decode step costs (both read every weight once): a resumed turn's few new tokens
        cost a step, not tokens x the per-token rate measured on long prefills. Paged engines (vLLM) batch
        prefill chunks into the decode step's forward pass: per token only."""
        linear = self.cost.prefill_s_per_token * tokens
        return max(linear, self.cost.decode_s(1, 0.0)) if self.model.slot_tokens else linear

    def _admit(self) -> tuple[list[int], int, int]:
        """Admit waiting turns while memory allows; returns their prefilled token counts, the context tokens
        computed again, and the tokens swapped in."""
        prefills: list[int] = []
        recompute = swap_in = 0
        first = 1 if self.cost.decode_after_prefill else 0  # the prefill samples a token, decoded in its step
        # Admitted turns join the running batch once admission is over (the engine prefills them after it): the
        # reclaim() weighing for the next waiting turn sees the batch as it was when the step began.
        self.admitting = []
        while self.waiting and len(self.running) + len(self.admitting) < self.cost.max_num_seqs:
            session = self.waiting[0]
            prompt = self.work.prompt_tokens if session.turn == 0 else session.context + 1 + self.work.tool_result_tokens
            need = self._memory(prompt)
            own = self._memory(session.context) if session.held == "preserve" else 0
            if not self._make_room(need - own, session):
                break
            self.waiting.popleft()
            reused = self._reused(session, prompt)
            if session.held == "swap":
                swap_in += session.context
                self.swapped -= session.context
            self._drop(session)
            again = max(0, session.context - reused)  # context computed before and computed again now
            recompute += again
            self.recomputed += again
            self.prompt_tokens += prompt
            prefills.append(prompt - reused)
            if self.blocks is not None:
                self.blocks.insert(session.sid, prompt)
            remaining = max(1, self.work.output_tokens - first)
            self.admitting.append(_Run(session, remaining, prompt + self.work.output_tokens - remaining, need))
        self.running += self.admitting
        self.admitting = []
        return prefills, recompute, swap_in

    def _reused(self, session: _Session, prompt: int) -> int:
        """Context tokens whose KV the session's prefill finds: held for it, or in the prefix cache."""
        if session.held in ("preserve", "swap", "cache"):
            return session.context
        if self.blocks is not None:
            return min(session.context, self.blocks.match(session.sid, prompt))
        return 0

    def _make_room(self, need: int, resuming: _Session) -> bool:
        """Free memory for `need` tokens: the prefix cache's least recently used entries go first (paged),
        then held KV (pins, unprotected parked turns) that reclaim() says to take, least waste first;
        False: the request waits (for a running turn to end, a parked turn's retain(), or a pin to return)."""
        while self._used() + need > self.cost.kv_capacity_tokens:
            cached = [s for s in self.cache.values() if s is not resuming] if self.cache is not None else []
            if cached:
                self.cache.pop(cached[0].sid)
                cached[0].held = None
                continue
            taken = self._to_take(resuming)
            if taken is None:
                return False
            action, held = taken
            if isinstance(held, _Parked):
                self._take_parked(held, action)
            elif action == "swap":
                self._count(self.reclaimed, "demoted_to_swap")
                self.waste += self._memory(held.context) * (self.t - held.since)
                held.held = "swap"
                self.swapped += held.context
                self.pending_swap += held.context
            else:
                self._count(self.reclaimed, "pins_dropped")
                self._release(held)
        return True

    def _take_parked(self, parked: _Parked, action: ReclaimAction) -> None:
        """Admission takes a parked turn's memory before its retain() is served: its KV moves to the swap
        tier (retain() then decides with it there) or is dropped (retain() finds nothing and discards)."""
        parked.memory = 0
        if action == "swap":
            self._count(self.reclaimed, "demoted_to_swap")
            parked.demoted = True
            self.swapped += parked.session.context
            self.pending_swap += parked.session.context
        else:
            self._count(self.reclaimed, "turns_dropped_before_retain")

    def _to_take(self, resuming: _Session) -> tuple[ReclaimAction, _Session | _Parked] | None:
        """The held KV whose taking wastes least, with what reclaim() does with it (the reference engine's SessionRetention.reclaim);
        None: keeping it all is cheaper."""
        wait_s = self._slot_wait_s()
        stalled = sum(r.memory for r in self.running)
        swap_free = self.model.swap_budget_tokens - self.swapped
        best: tuple[float, ReclaimAction, _Session | _Parked] | None = None
        candidates: list[tuple[_Session | _Parked, HeldSlot]] = []
        for pin in self._pins():
            if pin is resuming:
                continue
            left = pin.expected - (self.t - pin.since)  # past its expected return: until its TTL
            remaining = left if left > 0 else max(0.0, pin.deadline - self.t)
            candidates.append((pin, HeldSlot(pin.context, self._memory(pin.context), remaining, wait_s, stalled, swap_free)))
        for parked in self.parked:  # unprotected: nothing is known of when its session returns
            if parked.memory and self.t >= parked.protected_until:
                context = parked.session.context
                candidates.append((parked, HeldSlot(context, parked.memory, math.inf, wait_s, stalled, swap_free)))
        for held, case in candidates:
            action = reclaim(case, self.costs)
            if action == "keep":
                continue
            waste = reclaim_wastes(case, self.costs)[action]
            if best is None or waste < best[0]:
                best = (waste, action, held)
        return None if best is None else (best[1], best[2])

    def _slot_wait_s(self) -> float:
        """How long until memory frees itself: a running turn ends, or a protected parked turn's grace does."""
        step_s = self.cost.decode_s(max(1, len(self.running)), sum(r.tokens for r in self.running))
        running = max(1, min(r.remaining for r in self.running)) * step_s if self.running else math.inf
        graces = [p.protected_until - self.t for p in self.parked if p.memory and self.t < p.protected_until]
        return min([running, *graces])

    # ------------------------------------------------------------ turns end, calls are served

    def _decode(self, unserved: list[_Parked]) -> None:
        """One token for every running turn; finished turns park (unserved: last step's, still parked), or,
        without parking (park_grace_s None), have their calls served at once."""
        still, finished = [], []
        for run in self.running:
            run.remaining -= 1
            run.tokens += 1
            if run.remaining > 0:
                still.append(run)
                continue
            session = run.session
            self.turn_latencies.append(self.t - session.ready_at)
            session.turn += 1
            session.context = run.tokens - 1
            if self.blocks is not None:  # the finished history (all but the last token) is cached
                self.blocks.insert(session.sid, session.context)
            finished.append(run)
        self.running = still
        for run in finished:
            self._park(run.session, run.memory, unserved)

    def _park(self, session: _Session, memory: int, unserved: list[_Parked]) -> None:
        last = session.turn >= self.work.turns
        grace = self.model.park_grace_s
        if grace is None:  # the engine learns of the tool call with the turn's end: decided now
            self._serve([_Parked(session, memory, 0.0, last)])
            return
        protected = sum(1 for p in [*unserved, *self.parked] if p.memory and self.t < p.protected_until)
        until = self.t + grace if protected < self.max_protected else 0.0
        self.parked.append(_Parked(session, memory, until, last))
        if grace <= 0:  # not parked: the memory is free at once
            self._take_parked(self.parked[-1], "discard")

    def _serve(self, parked: list[_Parked]) -> None:
        """The callers' calls for turns parked before the step that just ran: retain(), or the end of the
        episode (release_session(); a new episode starts and queues its first turn)."""
        for p in parked:
            if not p.last:
                self._retain(p)
                continue
            if p.demoted:
                self.swapped -= p.session.context
            self.done += 1
            if self.started < self.work.sessions:
                self._start_session()

    def _pick_tool(self, session: _Session) -> tuple[ToolSpec, float]:
        tools = self.work.tools
        if self.work.tool_order == "rotate":
            tool = tools[(session.sid + session.calls) % len(tools)]
        else:
            tool = self.rng.choices(tools, weights=[t.weight for t in tools])[0]
        session.calls += 1
        latency = tool.median_s * math.exp(self.rng.gauss(0.0, tool.sigma))
        if tool.cap_factor is not None:
            latency = min(latency, tool.median_s * tool.cap_factor)
        return tool, latency

    def _retain(self, parked: _Parked) -> None:
        """The turn ended in a tool call: the policy decides (the engine's retain()), and the tool runs."""
        session = parked.session
        tool, latency = self._pick_tool(session)
        expected = self.latencies.expected(tool.name)
        session.tool, session.since, session.expected = tool.name, self.t, expected
        if parked.memory == 0 and not parked.demoted:
            action: str = "discard"  # its KV was taken before retain() (or never parked): nothing to keep
        else:
            action = choose(self.policy, self._snapshot(session), expected, self.costs).action
            if parked.demoted and action == "preserve":  # admission already moved it to the swap tier
                action = "swap"
        self._count(self.actions, action)
        ttl = min(self.model.ttl_max_s, max(self.model.ttl_min_s, expected * self.model.ttl_factor))
        if action in ("preserve", "swap"):
            session.held, session.deadline = action, self.t + ttl
            self.held[session.sid] = session
            if action == "swap" and not parked.demoted:
                self.swapped += session.context
                self.pending_swap += session.context
        else:
            if parked.demoted:
                self.swapped -= session.context
            if self.cache is not None:  # paged: the discarded KV stays in free blocks until memory is needed
                self._cache_context(session)
        heapq.heappush(self.tools, (self.t + latency, session.sid, session))

    def _snapshot(self, session: _Session) -> EngineSnapshot:
        """The engine as retain() sees it: the running batch, pins, other parked turns and this turn's own."""
        running = sum(r.memory for r in self.running)
        pinned = sum(self._memory(s.context) for s in self._pins())
        parked = sum(p.memory for p in self.parked)
        pin_cost = self._memory(session.context)
        # queued for memory: a full batch (max_num_seqs) keeps them waiting whatever a paged KV holds
        waiting = len(self.waiting) if len(self.running) < self.cost.max_num_seqs or self.model.slot_tokens else 0
        return EngineSnapshot(
            context_tokens=session.context, pin_cost_tokens=pin_cost, running_tokens=running,
            used_tokens=running + pinned + parked + pin_cost, capacity_tokens=self.cost.kv_capacity_tokens,
            waiting=waiting, pin_free_tokens=self.model.pin_budget_tokens - pinned,
            swap_free_tokens=self.model.swap_budget_tokens - self.swapped,
            prefix_cached=self.cache is not None or self.blocks is not None)

    def _cache_context(self, session: _Session) -> None:
        assert self.cache is not None
        session.held = "cache"
        self.cache[session.sid] = session
        while sum(s.context for s in self.cache.values()) > self.model.prefix_cache_tokens:
            _, evicted = self.cache.popitem(last=False)
            evicted.held = None

    def _release(self, session: _Session) -> None:
        """A promise ends before its session returns (TTL or memory needed): its context will be recomputed."""
        if session.held == "preserve":
            self.waste += self._memory(session.context) * (self.t - session.since)
        elif session.held == "swap":
            self.swapped -= session.context
        self.held.pop(session.sid, None)
        session.held = None

    def _drop(self, session: _Session) -> None:
        """The session resumes: whatever was held for it is used now."""
        if session.held == "preserve":
            self.waste += self._memory(session.context) * (self.t - session.since)
        self.held.pop(session.sid, None)
        if self.cache is not None:
            self.cache.pop(session.sid, None)
        session.held = None

    @staticmethod
    def _count(counts: dict[str, int], key: str) -> None:
        counts[key] = counts.get(key, 0) + 1


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---------------------------------------------------------------- rollwise sim intercept

PROJECTION_GPUS = (64, 256, 1024, 4096)


def projection(cost: CostModel, model: RetentionModel, work: InterceptWorkload, seed: int = 0) -> list[dict[str, Any]]:
    """Every policy on one engine, scaled to the cluster sizes (engines independent: see the docstring)."""
    rows = []
    for policy in POLICY_NAMES:
        result = simulate(cost, model, work, policy, seed)
        for gpus in PROJECTION_GPUS:
            engines = gpus // cost.gpus_per_engine
            rows.append({"gpus": gpus, "engines": engines, "episodes_per_s": result.episodes_per_s * engines,
                         **{k: v for k, v in result.as_dict().items() if k != "episodes_per_s"}})
    return rows


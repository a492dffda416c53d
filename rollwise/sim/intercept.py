"""The simulator's model of intercept-aware KV retention (issue 21): agentic sessions that stop at tool
calls, on one engine under KV pressure, with the production retention policy (rollwise.engine.
retention_policy.choose, unchanged) deciding at every interception.

Per engine step (the cost model's shape, rollwise.sim.cost): prefill of admitted turns (their new tokens,
plus the context again when it was discarded), one decode token for every running turn, plus the swap
tier's transfers (swap_s_per_token per token each way). Memory: a running turn holds `slot_tokens` (the
reference engine: one whole slot) or its context + output (paged engines: vLLM on GPU); a preserved
session holds the same until its tool returns or its TTL expires; when admission needs its memory the
engine's reclaim() (the same pure function) keeps it (the request waits for a running turn to end or the
session to return), moves it to the swap tier, or drops it, whichever wastes least; swapped sessions hold the swap tier; every policy but always_discard keeps discarded
contexts in an LRU prefix cache of at most prefix_cache_tokens: in free KV on paged engines (evicted first when admission
needs memory, as vLLM's freed blocks are), beside the slots on the reference engine (whose bench arm pays
for it with slots). Tool latencies are lognormal per tool (long tails); the
expected latency the policy sees is learned per tool from the latencies seen so far, as in the agent.

Engines are independent here (the router keeps a session on the replica holding its KV), so a cluster
of G GPUs is G / gpus_per_engine copies of one engine: `rollwise sim intercept` reports one engine's
run and its projection to 64..4096 GPUs with a cost model (bundled: h100-7b, h100-32b).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console
from rich.table import Table

from rollwise.engine.retention_policy import (
    POLICY_NAMES, EngineSnapshot, HeldSlot, PolicyName, RetentionCosts, ToolLatencies, choose, reclaim,
)
from rollwise.sim.cost import CostModel, load_cost_file


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    median_s: float = Field(gt=0, description="median latency (lognormal)")
    sigma: float = Field(1.0, ge=0, description="lognormal sigma: 1.0 puts p99 at ~10x the median")
    weight: float = Field(1.0, gt=0, description="relative frequency of this tool")


class InterceptWorkload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sessions: int = Field(64, ge=1, description="episodes to run")
    concurrency: int = Field(16, ge=1, description="episodes in flight at once (per engine)")
    turns: int = Field(4, ge=1, description="engine turns per episode; a tool call between two turns")
    prompt_tokens: int = Field(256, ge=1)
    tool_result_tokens: int = Field(32, ge=0)
    output_tokens: int = Field(32, ge=1)
    tools: list[ToolSpec] = Field(default_factory=lambda: [ToolSpec(name="python", median_s=1.0)])


class RetentionModel(BaseModel):
    """The engine's retention side: budgets, the swap tier and how memory is charged."""

    model_config = ConfigDict(extra="forbid")
    slot_tokens: int | None = Field(None, ge=1, description="a turn/pin costs one slot of this many tokens "
                                    "(reference engine); None: context + output (paged KV)")
    pin_budget_tokens: int = Field(0, ge=0)
    swap_budget_tokens: int = Field(0, ge=0)
    swap_s_per_token: float = Field(1e-6, ge=0, description="one-way swap transfer per token")
    swap_overlap: float = Field(0.0, ge=0, le=1, description="fraction of swaps hidden behind compute")
    prefix_cache_tokens: int = Field(0, ge=0, description="LRU prefix cache (prefix_cache_only) in tokens")
    ttl_factor: float = Field(2.0, gt=0)


@dataclass
class _Session:
    sid: int
    turn: int = 0
    context: int = 0  # tokens with KV after the last turn
    held: str | None = None  # preserve | swap | cache | None
    deadline: float = math.inf
    since: float = 0.0
    ready_at: float = 0.0
    tool: str = ""


@dataclass
class _Run:
    session: _Session
    remaining: int
    tokens: int  # context + tokens so far
    memory: int


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
    reclaimed: dict[str, int] = field(default_factory=dict)  # pins admission took: demoted to swap, or dropped

    @property
    def recomputed_fraction(self) -> float:
        return self.recomputed_tokens / max(1, self.prompt_tokens)

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "recomputed_fraction": self.recomputed_fraction}


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
        self.pins: dict[int, _Session] = {}
        self.swapped = 0
        self.cache: OrderedDict[int, _Session] = OrderedDict()
        self.latencies = ToolLatencies(default_s=statistics.median(t.median_s for t in work.tools))
        self.started = self.done = 0
        self.prompt_tokens = self.recomputed = 0
        self.waste = 0.0
        self.turn_latencies: list[float] = []
        self.actions: dict[str, int] = {}
        self.reclaimed: dict[str, int] = {}
        self.pending_swap = 0  # swap-out tokens charged to the next step

    # ------------------------------------------------------------ the loop

    def run(self) -> InterceptResult:
        for _ in range(min(self.work.concurrency, self.work.sessions)):
            self._start_session()
        while self.done < self.work.sessions:
            self._returns()
            self._expire()
            prefill, recompute, swap_in = self._admit()
            if not self.running:
                if not self.tools:
                    raise RuntimeError("intercept sim: nothing runs and no tool is out (a turn never fits: "
                                       "raise kv_capacity_tokens or lower the workload's token counts)")
                self.t = max(self.t, self.tools[0][0])
                continue
            held = sum(r.memory for r in self.running)
            swap_s = (swap_in + self.pending_swap) * self.model.swap_s_per_token * (1 - self.model.swap_overlap)
            dt = (self.cost.prefill_s_per_token * prefill + swap_s
                  + self.cost.decode_s(len(self.running), sum(r.tokens for r in self.running)))
            self.waste += (recompute * self.cost.prefill_s_per_token + swap_s) * held
            self.pending_swap = 0
            self.t += dt
            self._decode()
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
            if session.held == "preserve":
                # Back with its KV pinned: the promise is kept until its turn runs (a TTL bounds tools that
                # do not return, not a queue), and it goes first, as the engine admits a pinned session into
                # its own memory ahead of the queue (ReferenceEngine._admit_pinned).
                session.deadline = math.inf
                self.waiting.appendleft(session)
            else:
                self.waiting.append(session)

    def _expire(self) -> None:
        for session in [s for s in self.pins.values() if s.deadline <= self.t]:
            self._release(session)

    def _memory(self, prompt: int) -> int:
        return self.model.slot_tokens or prompt + self.work.output_tokens

    def _used(self) -> int:
        used = sum(r.memory for r in self.running) + sum(self._memory(s.context) for s in self.pins.values())
        if self.model.slot_tokens is None:  # paged engines keep their prefix cache in free KV blocks
            used += sum(s.context for s in self.cache.values())
        return used

    def _admit(self) -> tuple[int, int, int]:
        prefill = recompute = swap_in = 0
        while self.waiting and len(self.running) < self.cost.max_num_seqs:
            session = self.waiting[0]
            prompt = self.work.prompt_tokens if session.turn == 0 else session.context + 1 + self.work.tool_result_tokens
            need = self._memory(prompt)
            own = self._memory(session.context) if session.held == "preserve" else 0
            if not self._make_room(need - own, session):
                break
            self.waiting.popleft()
            reused = session.context if session.held in ("preserve", "swap", "cache") else 0
            if session.held == "swap":
                swap_in += session.context
                self.swapped -= session.context
            self._drop(session)
            again = session.context - reused  # context computed before and computed again now
            recompute += again
            self.recomputed += again
            self.prompt_tokens += prompt
            prefill += prompt - reused
            self.running.append(_Run(session, self.work.output_tokens, prompt, need))
        return prefill, recompute, swap_in

    def _make_room(self, need: int, resuming: _Session) -> bool:
        """Free memory for `need` tokens: the prefix cache's least recently used entries go first (paged),
        then pins that reclaim() says to take (demoted to the swap tier or dropped), least waste first;
        False: the request waits (for a running turn to end, or a pinned session to return)."""
        while self._used() + need > self.cost.kv_capacity_tokens:
            cached = [s for s in self.cache.values() if s is not resuming]
            if self.model.slot_tokens is None and cached:
                self.cache.pop(cached[0].sid)
                cached[0].held = None
                continue
            taken = self._pin_to_take(resuming)
            if taken is None:
                return False
            action, pin = taken
            self.reclaimed[action] = self.reclaimed.get(action, 0) + 1
            if action == "swap":
                self.pins.pop(pin.sid)
                self.waste += self._memory(pin.context) * (self.t - pin.since)
                pin.held = "swap"
                self.swapped += pin.context
                self.pending_swap += pin.context
            else:
                self._release(pin)
        return True

    def _pin_to_take(self, resuming: _Session) -> tuple[str, _Session] | None:
        """The pin whose taking wastes least, with what reclaim() does with it; None: keeping them all is cheaper."""
        costs = RetentionCosts(self.cost.prefill_s_per_token, self.model.swap_s_per_token, self.model.swap_overlap)
        step_s = self.cost.decode_s(max(1, len(self.running)), sum(r.tokens for r in self.running))
        wait_s = min((r.remaining for r in self.running), default=math.inf) * step_s
        stalled = sum(r.memory for r in self.running)
        best: tuple[float, str, _Session] | None = None
        for pin in (s for s in self.pins.values() if s is not resuming):
            left = self.latencies.expected(pin.tool) - (self.t - pin.since)
            remaining = left if left > 0 else max(0.0, pin.deadline - self.t)
            held = HeldSlot(pin.context, self._memory(pin.context), remaining, wait_s, stalled,
                            self.model.swap_budget_tokens - self.swapped)
            action = reclaim(held, costs)
            if action == "keep":
                continue
            taking = (2 * costs.swap_s_per_token * (1 - costs.swap_overlap) if action == "swap"
                      else costs.recompute_s_per_token) * pin.context
            if best is None or taking < best[0]:
                best = (taking, action, pin)
        return None if best is None else (best[1], best[2])

    def _decode(self) -> None:
        still = []
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
            if session.turn >= self.work.turns:
                self.done += 1
                if self.started < self.work.sessions:
                    self._start_session()
            else:
                self._intercept(session, exclude=run)
        self.running = still

    def _intercept(self, session: _Session, exclude: _Run) -> None:
        tool = self.rng.choices(self.work.tools, weights=[t.weight for t in self.work.tools])[0]
        latency = tool.median_s * math.exp(self.rng.gauss(0.0, tool.sigma))
        expected = self.latencies.expected(tool.name)
        others = [r for r in self.running if r is not exclude and r.remaining > 0]
        pin_cost = self._memory(session.context)
        pinned = sum(self._memory(s.context) for s in self.pins.values())
        snap = EngineSnapshot(
            context_tokens=session.context, pin_cost_tokens=pin_cost, running_tokens=sum(r.memory for r in others),
            used_tokens=sum(r.memory for r in others) + pinned + pin_cost, capacity_tokens=self.cost.kv_capacity_tokens,
            # queued for memory: a full batch (max_num_seqs) keeps them waiting whatever the KV holds
            waiting=len(self.waiting) if len(others) < self.cost.max_num_seqs - 1 or self.model.slot_tokens else 0,
            pin_free_tokens=self.model.pin_budget_tokens - pinned,
            swap_free_tokens=self.model.swap_budget_tokens - self.swapped,
            prefix_cached=self.policy != "always_discard" and self.model.prefix_cache_tokens > 0)
        costs = RetentionCosts(self.cost.prefill_s_per_token, self.model.swap_s_per_token, self.model.swap_overlap)
        action = choose(self.policy, snap, expected, costs).action
        self.actions[action] = self.actions.get(action, 0) + 1
        session.tool, session.since = tool.name, self.t
        if action == "preserve":
            session.held, session.deadline = "preserve", self.t + expected * self.model.ttl_factor
            self.pins[session.sid] = session
        elif action == "swap":
            session.held = "swap"
            self.swapped += session.context
            self.pending_swap += session.context
        elif self.policy != "always_discard" and self.model.prefix_cache_tokens:  # discarded KV stays cached
            session.held = "cache"
            self.cache[session.sid] = session
            while sum(s.context for s in self.cache.values()) > self.model.prefix_cache_tokens:
                _, evicted = self.cache.popitem(last=False)
                evicted.held = None
        heapq.heappush(self.tools, (self.t + latency, session.sid, session))

    def _release(self, session: _Session) -> None:
        """A pin ends before its session returns (TTL or memory needed): its context will be recomputed."""
        self.waste += self._memory(session.context) * (self.t - session.since)
        self.pins.pop(session.sid, None)
        session.held = None

    def _drop(self, session: _Session) -> None:
        """The session resumes: whatever was held for it is used now."""
        if session.held == "preserve":
            self.waste += self._memory(session.context) * (self.t - session.since)
        self.pins.pop(session.sid, None)
        self.cache.pop(session.sid, None)
        session.held = None


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


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cost", default="h100-7b", help="cost model YAML or bundled name (default: %(default)s)")
    parser.add_argument("--scenario", type=Path, help="YAML with workload: and retention: sections "
                        "(default: a long-tailed agentic mix on a KV-pressured engine)")
    parser.add_argument("--from-bench", type=Path, metavar="JSON", help="replay `rollwise bench intercept --json` "
                        "with the costs it measured, and compare medians with what it measured")
    parser.add_argument("--kv-bytes-per-token", type=int, default=57344, help="KV bytes per token, all layers "
                        "(default: Qwen2.5-7B in bf16, 2*28*4*128*2); swap time = this / 25 GB/s (PCIe 5 x16, effective)")
    parser.add_argument("--seed", type=int, default=0)


def _default_scenario(cost: CostModel, kv_bytes_per_token: int) -> tuple[RetentionModel, InterceptWorkload]:
    """Sessions of ~2-4k-token contexts whose KV fills the engine; tools from 50 ms to seconds, long-tailed.
    Four waves of sessions, so that episodes/s is a steady state: with one wave the run's length is the
    longest chain of long-tailed tool calls, whatever the engine does."""
    concurrency = int(cost.kv_capacity_tokens // 2500)
    work = InterceptWorkload(sessions=4 * concurrency, concurrency=concurrency, turns=6,
                             prompt_tokens=1500, tool_result_tokens=200, output_tokens=150,
                             tools=[ToolSpec(name="calculator", median_s=0.05, sigma=0.5, weight=2),
                                    ToolSpec(name="python", median_s=1.0, sigma=1.0, weight=2),
                                    ToolSpec(name="search", median_s=4.0, sigma=1.5, weight=1)])
    model = RetentionModel(pin_budget_tokens=cost.kv_capacity_tokens // 2, swap_budget_tokens=cost.kv_capacity_tokens * 4,
                           swap_s_per_token=kv_bytes_per_token / cost.gpus_per_engine / 25e9, swap_overlap=0.8,
                           prefix_cache_tokens=cost.kv_capacity_tokens // 2)
    return model, work


def _run(args: argparse.Namespace, console: Console) -> int:
    if args.from_bench:
        return _replay_bench(args, console)
    from rollwise.sim.cli import write_json  # noqa: PLC0415 - the cli imports this module lazily

    cost, _ = load_cost_file(args.cost)  # a path or a bundled name
    model, work = _default_scenario(cost, args.kv_bytes_per_token)
    if args.scenario:
        import yaml

        raw = yaml.safe_load(args.scenario.read_text()) or {}
        model, work = RetentionModel.model_validate(raw.get("retention", {})), InterceptWorkload.model_validate(raw.get("workload", {}))
    rows = projection(cost, model, work, args.seed)
    table = Table(title=f"intercept-aware KV retention at scale ({cost.name})")
    for col in ("gpus", "policy", "episodes/s", "recomputed", "waste (token-s)", "turn p50 s", "turn p99 s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["gpus"]), r["policy"], f"{r['episodes_per_s']:.1f}", f"{r['recomputed_fraction']:.1%}",
                      f"{r['waste_token_s']:.3g}", f"{r['turn_latency_p50_s']:.3f}", f"{r['turn_latency_p99_s']:.3f}")
    console.print(table)
    write_json(args.json, {"command": " ".join(["rollwise"] + sys.argv[1:]), "cost": cost.name, "rows": rows,
                           "workload": work.model_dump(), "retention": model.model_dump()}, console)
    return 0


def _replay_bench(args: argparse.Namespace, console: Console) -> int:
    """The bench's workload and measured costs in simulation, medians side by side (goal: within 10%)."""
    bench = json.loads(args.from_bench.read_text())
    sim = bench["simulation_inputs"]
    cost = CostModel.model_validate(sim["cost"])
    model, work = RetentionModel.model_validate(sim["retention"]), InterceptWorkload.model_validate(sim["workload"])
    table = Table(title="rollwise bench intercept vs its simulation (medians)")
    for col in ("policy", "episodes/s bench", "sim", "turn p50 bench", "sim", "recomputed bench", "sim"):
        table.add_column(col, justify="right")
    rows = []
    for measured in bench["policies"]:
        arm_cost = cost
        if measured["policy"] == "prefix_cache_only" and "prefix_cache_only_slots" in sim:
            slots = sim["prefix_cache_only_slots"]
            arm_cost = cost.model_copy(update={"max_num_seqs": slots, "kv_capacity_tokens": slots * cost.max_model_len})
        result = simulate(arm_cost, model, work, measured["policy"], args.seed)
        rows.append({"policy": measured["policy"], "bench": measured, "sim": result.as_dict()})
        table.add_row(measured["policy"], f"{measured['episodes_per_s']:.3f}", f"{result.episodes_per_s:.3f}",
                      f"{measured['turn_latency_p50_s']:.3f}", f"{result.turn_latency_p50_s:.3f}",
                      f"{measured['recomputed_fraction']:.1%}", f"{result.recomputed_fraction:.1%}")
    console.print(table)
    from rollwise.sim.cli import write_json  # noqa: PLC0415

    write_json(args.json, {"rows": rows}, console)
    return 0


def command() -> Any:
    from rollwise.sim.cli import SimCommand  # noqa: PLC0415 - sim.cli imports this module lazily

    return SimCommand("intercept", "session KV retention policies at 64-4096 GPUs (--from-bench: validate)",
                      _add_arguments, _run)

"""Multi-turn agent sessions on the simulated cluster: generate, call a tool (a latency), append the
tool's result, generate again. No trainer: this measures routing and prefix caching under agent
traffic (each turn's prompt is the previous prompt + its output + the tool result, so the engine
that served the last turn holds most of the next prompt in its prefix cache)."""

from __future__ import annotations

import heapq
import math
import time
from typing import Any

from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.observe.bubble import busy_integral
from rollwise.router.policies import make_policy
from rollwise.sim.cluster import SimCluster
from rollwise.sim.engine import SimEngine, VirtualClock
from rollwise.sim.scenario import LengthModel, Scenario, uniform_draw


def simulate_sessions(s: Scenario) -> dict[str, Any]:
    wall0 = time.perf_counter()
    cost, _ = s.cost()
    clock = VirtualClock()
    lengths = LengthModel(s.workload.output, s.seed, s.base_dir)
    engines = [SimEngine(cost, clock=clock, length_sampler=lengths.for_request, seed=s.seed * 7919 + i,
                         engine_id=f"e{i:05d}", cache_history=True) for i in range(s.engines(cost))]
    cluster = SimCluster(engines, clock, make_policy(s.cluster.routing), shard_size=s.cluster.shard_size)
    spec, w = s.sessions, s.workload
    shared = [3 + (7919 * j) % 31997 for j in range(min(w.shared_prefix_tokens, w.prompt_tokens - 1))]
    timers: list[tuple[float, int, int, list[int]]] = []  # (due, session, turn, prompt)
    sent: dict[str, float] = {}
    latencies: list[float] = []
    for k in range(spec.count):
        own = [3 + (k * 104729 + 31 * j) % 31997 for j in range(w.prompt_tokens - len(shared))]
        heapq.heappush(timers, (0.0, k, 0, shared + own))

    def submit(k: int, turn: int, prompt: list[int]) -> None:
        rid = f"s{k}/t{turn}"
        sent[rid] = clock.now
        cluster.submit([GenerationRequest(rid, prompt, SamplingParams(max_tokens=w.output.max_tokens,
                                                                      seed=k * 1000 + turn))])

    prompts: dict[str, list[int]] = {}
    while True:
        while timers and timers[0][0] <= clock.now:
            _, k, turn, prompt = heapq.heappop(timers)
            prompts[f"s{k}/t{turn}"] = prompt
            submit(k, turn, prompt)
        nxt = cluster.next_event_time()
        if nxt is None and not timers and not cluster.completions:
            break
        if not cluster.completions and timers and (nxt is None or timers[0][0] < nxt):
            cluster.advance_to(timers[0][0])
            continue
        c = cluster.next_completion(timeout=0.0)
        if c is None:
            continue
        latencies.append(clock.now - sent.pop(c.request_id))
        k, turn = int(c.request_id[1:].split("/")[0]), int(c.request_id.split("/t")[1])
        prompt = prompts.pop(c.request_id)
        if turn + 1 < spec.turns:
            u1, u2 = uniform_draw(s.seed, k * 1000 + turn, 3), uniform_draw(s.seed, k * 1000 + turn, 4)
            z = math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)
            delay = spec.tool_latency_median_s * math.exp(spec.tool_latency_sigma * z)
            result = [3 + (k * 7 + turn * 131 + j) % 31997 for j in range(spec.tool_result_tokens)]
            if len(prompt) + len(c.token_ids) + len(result) + 1 < cost.max_model_len:
                heapq.heappush(timers, (clock.now + delay, k, turn + 1, prompt + c.token_ids + result))
    t1 = clock.now
    capacity = sum(e.max_num_seqs for e in engines)
    busy = sum(busy_integral(e.timeline, 0.0, t1) for e in engines)
    prompt_tokens = sum(e.stats["prompt_tokens"] for e in engines)
    cached = sum(e.stats["cached_prompt_tokens"] for e in engines)
    lat = sorted(latencies)
    return {
        "scenario": s.name, "mode": "sessions", "routing": s.cluster.routing, "gpus": s.cluster.gpus,
        "engines": len(engines), "capacity": capacity, "turns": len(latencies), "virtual_s": t1,
        "bubble_ratio": 1 - busy / (capacity * t1) if t1 > 0 else 0.0,
        "prefix_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "prefill_tokens": sum(e.stats["prefill_tokens"] for e in engines),
        "turn_latency_p50_s": lat[len(lat) // 2] if lat else 0.0,
        "turn_latency_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else 0.0,
        "rollout_tokens_per_s": sum(e.stats["generated_tokens"] for e in engines) / t1 if t1 > 0 else 0.0,
        "samples_per_s": len(latencies) / t1 if t1 > 0 else 0.0,
        "engine_hours": len(engines) * cost.gpus_per_engine * t1 / 3600,
        "sim_wall_s": time.perf_counter() - wall0,
    }

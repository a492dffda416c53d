"""Validation of the router simulation against `rollwise bench router`, side by side in one run.

1. Calibrate the benchmark's replica engine here: its model and engine (rollwise.bench.router: a random
   256-wide, 4-layer Llama, the reference engine), on one thread as each replica runs, timed with the
   same step fit as `rollwise sim calibrate` (rollwise.bench.calibrate.time_steps / rollwise.sim.fit.fit_steps).
2. Measure, on the benchmark's real replicas (4 subprocesses on this machine's cores): their serving
   costs (sequential requests through a router: work per request, step time behind the server), then
   every policy.
3. Simulate: the same rounds (the same token workloads) through rollwise/sim/routing.py with the calibrated
   costs, the replicas and the serving work sharing the machine's cores (processor sharing).

Compared per policy: throughput (requests per second of workload wall time), prefix-cache hit rate,
prompt tokens computed, latency p50/p99.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

from rollwise.bench.router_processes import cpu_clock_s
from rollwise.bench.router import (
    FULL,
    QUICK,
    BenchShape,
    engine_counters,
    measure_real,
    replicas,
    round_workload,
    summarize,
)
from rollwise.bench.router_processes import MODEL_SIZE
from rollwise.router.policies import POLICIES, make_policy
from rollwise.sim.routing import SimConfig, simulate

# (batch, prompt tokens): the benchmark's prompts are 512+ tokens (a shared 128-token prefix + a
# 384-token question; sessions grow past 700); GRPO groups run up to 16 sequences per replica.
REPLICA_SHAPES = ((1, 64), (1, 512), (2, 256), (4, 128), (4, 512), (8, 64), (8, 512), (16, 64), (16, 384))


def calibrate_replica(shape: BenchShape, seed: int = 0, progress: Any = None,
                      shapes: tuple[tuple[int, int], ...] = REPLICA_SHAPES) -> dict[str, Any]:
    """The replica engine's step costs on one thread (how bench router's replicas run)."""
    from rollwise.bench.calibrate import time_steps
    from rollwise.engine.reference.engine import ReferenceEngine
    from rollwise.model.tiny import tiny_llama, tiny_tokenizer
    from rollwise.sim.fit import fit_steps

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = tiny_tokenizer()
        model = tiny_llama(seed=0, max_position_embeddings=shape.max_model_len, **MODEL_SIZE)
        engine = ReferenceEngine(model, max_num_seqs=shape.max_num_seqs, max_model_len=shape.max_model_len,
                                 eos_token_ids=[tokenizer.eos_token_id], seed=seed, prefix_cache_tokens=16384)
        vocab = int(model.config.vocab_size)
        if progress:
            progress("calibrating the replica engine (one thread)")
        time_steps(engine, vocab, seed, shapes=((16, 64),))  # warm-up, discarded
        fit = fit_steps(time_steps(engine, vocab, seed + 1, shapes=shapes))
        hit_s = _cache_hit_cost(engine, vocab, seed, shape.shared_tokens + shape.question_tokens)
        fit["cached_s_per_token"] = hit_s / (shape.shared_tokens + shape.question_tokens)
    finally:
        torch.set_num_threads(threads)
    return fit


def _cache_hit_cost(engine: Any, vocab: int, seed: int, prompt_tokens: int, pairs: int = 12) -> float:
    """Extra step time of admitting a request whose whole prompt is in the prefix cache (its cached KV
    is copied into the sequence's slot; only the last token is computed): steps with and without such
    an admission, alternating, while a few sequences decode."""
    import random

    from rollwise.types.generation import GenerationRequest, SamplingParams

    rng = random.Random(seed)
    prompt = [rng.randrange(5, vocab - 1) for _ in range(prompt_tokens)]
    engine.add_request(GenerationRequest("hit-warm", prompt, SamplingParams(max_tokens=1)))
    background = [GenerationRequest(f"hit-bg{i}", [rng.randrange(5, vocab - 1) for _ in range(64)],
                                    SamplingParams(max_tokens=4 * pairs + 8, ignore_eos=True)) for i in range(4)]
    for r in background:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    with_hit, without = [], []
    for i in range(2 * pairs):
        if i % 2:
            engine.add_request(GenerationRequest(f"hit{i}", prompt, SamplingParams(max_tokens=1, seed=i)))
        t = time.perf_counter()
        engine.step()
        (with_hit if i % 2 else without).append(time.perf_counter() - t)
    for r in background:
        engine.abort(r.request_id)
    return max(statistics.median(with_hit) - statistics.median(without), 0.0)


def _replica_cpu_s(urls: list[str]) -> float:
    """CPU seconds (user + system) the replica processes have used, from the kernel's per-process CPU clock
    (router_processes.cpu_clock_s, as the bench's replica arm reads it): each is found by its `--port` on the
    command line."""
    ports = {url.rsplit(":", 1)[1] for url in urls}
    total = 0.0
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            if b"--replica-worker" not in cmd or cmd[cmd.index(b"--port") + 1].decode() not in ports:
                continue
            total += cpu_clock_s(int(pid))
        except (OSError, ValueError, IndexError):
            continue  # a process that ended or is not ours
    return total


def measure_serving(urls: list[str], fit: dict[str, Any], prompt_tokens: int, n: int = 30) -> dict[str, float]:
    """What a replica behind HTTP costs beyond its engine, from sequential requests with distinct prompts
    of the benchmark's length (JSON, hashing and cache lookups grow with it) through a router (client ->
    router -> replica and back, as the benchmark sends them). Per 1-token request: the CPU time of this
    process (client and router: `request_s`) and of the replica processes beyond their engine steps (HTTP,
    asyncio, the hand-offs to and from the engine thread: `replica_request_s`, as `bench router`'s replica arm
    measures a server: the processes' CPU clocks less their engine steps' CPU, GET /bench/engine_cpu).
    33-token requests give the step time as the replica's server runs it. Sequential, so latency is work."""
    import random

    import httpx

    from rollwise.bench.router import router

    rng = random.Random(7)

    def busy() -> float:
        return sum(c.get("step_seconds", 0.0) for c in engine_counters(urls))

    def engine_cpu() -> float:  # the engines' own CPU: their steps' thread clocks
        return sum(httpx.get(f"{url}/bench/engine_cpu", timeout=30).json()["step_cpu_s"] for url in urls)

    def timed(http: httpx.Client, max_tokens: int) -> dict[str, float]:
        for _ in range(3):  # warm up connections
            http.post("/generate", json={"prompt_ids": [7] * 16, "max_tokens": 1}).raise_for_status()
        latencies = []
        busy0, cpu0, own0, replicas0 = busy(), engine_cpu(), time.process_time(), _replica_cpu_s(urls)
        for _ in range(n):
            body = {"prompt_ids": [rng.randrange(5, 95) for _ in range(prompt_tokens)], "max_tokens": max_tokens,
                    "ignore_eos": True}
            t = time.perf_counter()
            http.post("/generate", json=body).raise_for_status()
            latencies.append(time.perf_counter() - t)
        own, replicas, engine = time.process_time() - own0, _replica_cpu_s(urls) - replicas0, busy() - busy0
        engine_cpu_s = engine_cpu() - cpu0
        return {"latency_s": statistics.median(latencies), "latency_cv": statistics.pstdev(latencies) / statistics.mean(latencies),
                "client_router_cpu_s": own / n,
                "replica_serving_cpu_s": max(replicas - engine_cpu_s, 0.0) / n,
                "latency_less_busy_s": max(sum(latencies) - engine, 0.0) / n}

    with router(urls, "round_robin") as url, httpx.Client(base_url=url, timeout=60) as http:
        one, long = timed(http, 1), timed(http, 33)
    return {"latency_1_token_s": one["latency_s"], "latency_33_tokens_s": long["latency_s"],
            "served_step_s": max((long["latency_s"] - one["latency_s"]) / 32, 0.0),
            "engine_step_s": fit["step_overhead_s"] + fit["decode_s_per_seq"],
            "latency_less_busy_s": one["latency_less_busy_s"],
            "request_s": one["client_router_cpu_s"], "replica_request_s": one["replica_serving_cpu_s"],
            "request_cv": one["latency_cv"]}


def sim_config(shape: BenchShape, fit: dict[str, Any], cores: float, serving: dict[str, float] | None = None) -> SimConfig:
    """The calibrated engine; with `serving` (measure_serving), the step overhead as the replica's
    server runs it and the serving work per request."""
    step_s = fit["step_overhead_s"]
    if serving is not None:
        step_s = max(step_s, serving["served_step_s"] - fit["decode_s_per_seq"])
    return SimConfig(replicas=shape.replicas, max_num_seqs=shape.max_num_seqs, cache_tokens=16384, block_size=16,
                     step_s=step_s, prefill_s_per_token=fit["prefill_s_per_token"],
                     decode_s_per_seq=fit["decode_s_per_seq"], decode_s_per_ctx_token=fit["decode_s_per_ctx_token"],
                     cached_s_per_token=fit.get("cached_s_per_token", 0.0),
                     cores=cores, request_s=serving["request_s"] if serving else 0.0,
                     replica_request_s=serving.get("replica_request_s", 0.0) if serving else 0.0,
                     request_cv=serving.get("request_cv", 0.0) if serving else 0.0,
                     router_s=0.0,  # request_s already holds the router's work: it runs in the measuring process
                     padded_context=True)


def simulate_bench(shape: BenchShape, config: SimConfig, seed: int, policies: list[str]) -> dict[str, dict]:
    """Every round of every policy, cold caches per round (as the benchmark flushes them), summed and
    summarized as the benchmark summarizes its measured rounds."""
    out = {}
    for name in policies:
        results = [simulate(make_policy(name), round_workload(shape, seed, rnd), config) for rnd in range(shape.rounds)]
        out[name] = summarize([x for r in results for x in r["latencies"]], sum(r["prompt_tokens"] for r in results),
                              sum(r["cached_prompt_tokens"] for r in results),
                              [sum(w) for w in zip(*(r["replica_work"] for r in results))],
                              sum(r["makespan_s"] for r in results))
        out[name]["prefill_tokens"] = sum(r["prefill_tokens"] for r in results)  # computed, as the engines count
        out[name]["engine_busy_s"] = sum(r["engine_busy_s"] for r in results)
    return out


def compare(real: dict[str, dict], simulated: dict[str, dict]) -> list[dict[str, Any]]:
    rows = []
    for name, m in real.items():
        s = simulated[name]
        row: dict[str, Any] = {"policy": name, "requests_per_s_measured_runs": m.get("requests_per_s_runs", [])}
        m = {**m, "requests_per_s": m["requests"] / m["wall_s"]}
        s = {**s, "requests_per_s": s["requests"] / s["wall_s"]}
        for key in ("requests_per_s", "prefix_hit_rate", "prefill_tokens", "p50_latency_s", "p99_latency_s",
                    "engine_busy_s"):
            row[f"{key}_measured"], row[f"{key}_simulated"] = m[key], s[key]
            row[f"{key}_error"] = s[key] / m[key] - 1 if m[key] else None
        rows.append(row)
    return rows


def validate_router(*, quick: bool = True, seed: int = 0, policies: list[str] | None = None,
                    cores: float | None = None, rounds: int = 1, progress: Any = None) -> dict[str, Any]:
    """rounds > 1: the benchmark measured that many times on the same replicas; per policy, the run with
    the median throughput is compared (the same run varied by up to 20% here between two tries)."""
    shape = QUICK if quick else FULL
    policies = policies or list(POLICIES)
    cores = cores if cores is not None else float(len(os.sched_getaffinity(0)))
    fit = calibrate_replica(shape, seed, progress)
    runs: list[dict[str, dict]] = []
    with replicas(shape) as urls:
        if progress:
            progress("timing the replicas' serving costs (router, HTTP, server loop)")
        serving = measure_serving(urls, fit, prompt_tokens=shape.shared_tokens + shape.question_tokens)
        for r in range(rounds):
            say = (lambda msg, r=r: progress(f"measured run {r + 1}/{rounds}: {msg}")) if progress else None
            runs.append(measure_real(shape, seed, policies, say, urls=urls))
    real = {}
    for name in policies:
        ordered = sorted((run[name] for run in runs), key=lambda m: m["requests"] / m["wall_s"])
        real[name] = {**ordered[(len(ordered) - 1) // 2],
                      "requests_per_s_runs": [run[name]["requests"] / run[name]["wall_s"] for run in runs]}
    config = sim_config(shape, fit, cores, serving)
    simulated = simulate_bench(shape, config, seed, policies)
    return {"benchmark": "router", "quick": quick, "replicas": shape.replicas, "cores": cores, "rounds": rounds,
            "calibration": {**fit, "serving": serving}, "sim_config": config.__dict__,
            "measured": real, "simulated": simulated, "comparison": compare(real, simulated)}

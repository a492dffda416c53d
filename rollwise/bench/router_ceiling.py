"""How low can a policy's p99 go on `bench router`'s workload? The first burst's work, replayed per replica.

`python -m rollwise.bench.router_ceiling docs/bench/router.json` reads a `bench router --json` file. In every
round the p99 requests are the first burst's (router_tail.py): the 4 session openings and the first 3 GRPO groups,
all sent at t=0. This tool takes each arm's recorded placement of that burst (which replica answered each request)
and recomputes it here, with nothing else running: for each replica, a fresh reference engine of the bench's model,
caches empty (the bench flushes them), one torch thread (as the replicas run), the replica's burst requests added
together and stepped to completion. It times each replica's CPU seconds (the thread's clock).

A burst can finish no sooner than max(its busiest replica, all replicas' work / cores). The ratio of those bounds
between two arms is the most a router can gain on the tail here, with no HTTP, no client and no router cost.
Nothing is simulated: the same engine code runs the same token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollwise.bench.router_processes import MODEL_SIZE


def first_burst(round_log: list[dict[str, Any]], size: int) -> list[dict[str, Any]]:
    """The round's first `size` requests by start time (the requests sent before any answer came back)."""
    return sorted(round_log, key=lambda r: r["start_s"])[:size]


@dataclass(frozen=True)
class ReplicaWork:
    cpu_s: float  # the thread's CPU seconds, start to finish
    prefill_tokens: int  # prompt tokens computed (not served from the prefix cache or shared by identical prompts)
    steps: int


def replica_work(requests: list[tuple[list[int], int]], max_num_seqs: int, max_model_len: int,
                 model: torch.nn.Module) -> ReplicaWork:
    """One replica computing `requests` (prompt ids, max_tokens) from an empty cache, all admitted together."""
    from rollwise.engine.reference.engine import ReferenceEngine
    from rollwise.types.generation import GenerationRequest, SamplingParams

    engine = ReferenceEngine(model, max_num_seqs=max_num_seqs, max_model_len=max_model_len, seed=0,
                             prefix_cache_tokens=16384)
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add_request(GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                             seed=i)))
    started, steps = time.thread_time(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    cpu_s = time.thread_time() - started
    return ReplicaWork(cpu_s, engine.stats["prompt_tokens"] - engine.stats["cached_prompt_tokens"], steps)


def burst_bound(replica_cpu_s: list[float], cores: float) -> float:
    """The soonest a burst can finish: no replica is faster than its own work, nor the replicas together
    faster than their cores allow."""
    return max(max(replica_cpu_s), sum(replica_cpu_s) / cores)


def burst_bounds(path: Path, arms: list[str], cores: float, repeats: int = 3) -> dict[str, Any]:
    """Per arm and round: each replica's CPU seconds for its share of the first burst (median of `repeats`,
    the arms interleaved), and the burst's lower bound on `cores` cores."""
    from rollwise.bench.router import BenchShape, round_workload
    from rollwise.model.tiny import tiny_llama

    data = json.loads(Path(path).read_text())
    real = data["real"]
    fields = {k: v for k, v in real["workload"].items() if k in BenchShape.__dataclass_fields__}
    shape = BenchShape(**fields)
    seed = _seed_of(data.get("command", ""))
    torch.set_num_threads(1)
    model = tiny_llama(seed=0, max_position_embeddings=shape.max_model_len, **MODEL_SIZE)
    rounds = min(len(real["policies"][arm]["requests_log"]) for arm in arms)
    burst = shape.sessions + shape.group_workers * shape.group_size  # every session's opening, the first groups
    per_round = []
    for rnd in range(rounds):
        workload = round_workload(shape, seed, rnd)
        placed: dict[str, list[list[tuple[list[int], int]]]] = {}
        for arm in arms:
            by_replica: dict[str, list[tuple[list[int], int]]] = defaultdict(list)
            for r in first_burst(real["policies"][arm]["requests_log"][rnd], burst):
                index = int(r["key"][1:])
                prompt = (workload.group_prompts[index] if r["kind"] == "group"
                          else workload.session_turns[index][0])
                by_replica[r["replica"]].append((prompt, shape.max_tokens))
            placed[arm] = list(by_replica.values())
        samples: dict[str, list[list[ReplicaWork]]] = {arm: [] for arm in arms}
        for _ in range(repeats):
            for arm in arms:
                samples[arm].append([replica_work(reqs, shape.max_num_seqs, shape.max_model_len, model)
                                     for reqs in placed[arm]])
        row = {}
        for arm in arms:
            work = [statistics.median(s[i].cpu_s for s in samples[arm]) for i in range(len(placed[arm]))]
            row[arm] = {"replica_cpu_s": work, "requests_per_replica": [len(r) for r in placed[arm]],
                        "prefill_tokens_per_replica": [w.prefill_tokens for w in samples[arm][0]],
                        "bound_s": burst_bound(work, cores)}
        per_round.append(row)
    summary = {arm: statistics.median(r[arm]["bound_s"] for r in per_round) for arm in arms}
    # how much longer each other arm's burst must take than the first arm's: the most a router can gain
    ceiling = {arm: summary[arm] / summary[arms[0]] for arm in arms[1:]}
    return {"source": str(path), "cores": cores, "arms": arms, "rounds": per_round, "median_bound_s": summary,
            "ceiling": ceiling,
            "measured_p99_median_round_s": {arm: real["policies"][arm]["p99_latency_s_median_round"] for arm in arms},
            "measured_p99_s": {arm: real["policies"][arm]["p99_latency_s"] for arm in arms}}


def _seed_of(command: str) -> int:
    parts = command.split()
    return int(parts[parts.index("--seed") + 1]) if "--seed" in parts else 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench_json", type=Path, help="a `rollwise bench router --json` file (with requests_log)")
    p.add_argument("--arms", default="prefix,round_robin", help="rollwise arms to compare (the first against the rest)")
    p.add_argument("--cores", type=float, default=float(os.cpu_count() or 1), help="cores the replicas shared")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    result = burst_bounds(args.bench_json, arms, args.cores, args.repeats)
    first = arms[0]
    for arm in arms:
        bound = result["median_bound_s"][arm]
        meas, pooled = result["measured_p99_median_round_s"][arm], result["measured_p99_s"][arm]
        work = statistics.median(sum(r[arm]["replica_cpu_s"]) for r in result["rounds"])
        prefill = statistics.median(sum(r[arm]["prefill_tokens_per_replica"]) for r in result["rounds"])
        print(f"{arm:>14}: first burst's CPU {work:.3f} s ({prefill:,.0f} prompt tokens computed), "
              f"bound {bound:.3f} s on {args.cores:g} cores "
              f"(measured p99: median round {meas:.3f} s, all requests {pooled:.3f} s)")
    for arm in arms[1:]:
        meas = result["measured_p99_median_round_s"][arm] / result["measured_p99_median_round_s"][first]
        pooled = result["measured_p99_s"][arm] / result["measured_p99_s"][first]
        print(f"{first} vs {arm}: the burst's work allows {result['ceiling'][arm]:.2f}x; "
              f"measured p99 {meas:.2f}x (median round), {pooled:.2f}x (all requests)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

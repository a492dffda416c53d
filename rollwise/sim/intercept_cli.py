"""`rollwise sim intercept`: the retention policies at 64-4096 GPUs with a cost model, or (--from-bench) the
replay of `rollwise bench intercept --json`: its workload on its measured costs, medians side by side with
what the bench measured, PASS/FAIL per policy against the goal (issue 21: within 10%).

How the replay builds each arm (rollwise.bench.intercept._engine, the arms as the bench runs them; the
numbers come from the json's simulation_inputs): the reference engine (one slot per turn or pin; a new
turn's prefill samples a token that is decoded in the same step); a swap tier only in min_waste; a prefix
cache only in prefix_cache_only, on fewer slots (its cache is paid for with the pinnable slots); tools in
the bench's rotation (session i's k-th call: calculator, python, slow in turn), the slow one capped at 10x
its median; a tool's expected latency before its first return is the slow tool's median (the bench's
ToolLatencies default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rollwise.sim.commands import SimCommand, write_json
from rollwise.sim.cost import CostModel, load_cost_file
from rollwise.sim.intercept import projection, simulate
from rollwise.sim.intercept_models import InterceptWorkload, RetentionModel, ToolSpec

REPLAY_TOLERANCE = 0.10  # issue 21: the simulator within 10% of the bench on medians
REPLAY_SEEDS = 9  # simulator seeds per arm (tool latencies drawn afresh); the median of their medians is compared
COMPARED = (("episodes_per_s", "episodes/s"), ("turn_latency_p50_s", "turn p50"))
SLOW_TOOL_CAP = 10.0  # rollwise bench intercept caps its long-tailed tool at 10x the median


def bench_arm(inputs: dict[str, Any], bench_workload: dict[str, Any], policy: str
              ) -> tuple[CostModel, RetentionModel, InterceptWorkload]:
    """The simulator's engine, retention and workload for one arm of the bench (see the module docstring)."""
    cost = CostModel.model_validate(inputs["cost"]).model_copy(update={"decode_after_prefill": True})
    model = RetentionModel.model_validate(inputs["retention"])
    model = model.model_copy(update={
        "swap_budget_tokens": model.swap_budget_tokens if policy == "min_waste" else 0,
        "prefix_cache_tokens": model.prefix_cache_tokens if policy == "prefix_cache_only" else 0})
    if policy == "prefix_cache_only" and "prefix_cache_only_slots" in inputs:
        slots = inputs["prefix_cache_only_slots"]
        cost = cost.model_copy(update={"max_num_seqs": slots, "kv_capacity_tokens": slots * cost.max_model_len})
    raw = inputs["workload"]
    tools = [ToolSpec.model_validate({**t, "cap_factor": SLOW_TOOL_CAP if t["name"] == "slow" else None})
             for t in raw["tools"]]
    slow = bench_workload.get("slow_tool_median_s") or max(t.median_s for t in tools)
    work = InterceptWorkload.model_validate({**raw, "tools": tools, "tool_order": "rotate", "expected_default_s": slow})
    return cost, model, work


def replay_rows(bench: dict[str, Any], seed: int = 0, seeds: int = REPLAY_SEEDS) -> list[dict[str, Any]]:
    """Per policy: what the bench measured, what the simulator gives, and the comparison of the medians.

    The bench is one draw of the tools' long-tailed latencies; the simulator draws them afresh per seed. A turn
    median can fall between two clusters of latencies (always_preserve: pinned resumes at a few seconds, queued
    or recomputing turns at several times that) and then swings with the draw (+-13% over seeds on the full
    bench), so the compared medians are each the median over `seeds` simulator seeds; the counts shown
    (recomputed tokens, actions) are those of the first seed's run."""
    rows = []
    for measured in bench["policies"]:
        cost, model, work = bench_arm(bench["simulation_inputs"], bench.get("workload", {}), measured["policy"])
        runs = [simulate(cost, model, work, measured["policy"], seed + i) for i in range(seeds)]
        sim = runs[0].as_dict()
        for key, _ in COMPARED:
            sim[key] = statistics.median(getattr(r, key) for r in runs)
            sim[f"{key}_over_seeds"] = [min(getattr(r, key) for r in runs), max(getattr(r, key) for r in runs)]
        sim["seeds"] = seeds
        rows.append({"policy": measured["policy"], "bench": measured, "sim": sim, **compare(measured, sim)})
    return rows


def compare(measured: dict[str, Any], simulated: dict[str, Any]) -> dict[str, Any]:
    """The simulated medians' errors relative to the measured ones, and PASS within REPLAY_TOLERANCE."""
    errors = {key: simulated[key] / measured[key] - 1 for key, _ in COMPARED}
    return {"error": errors, "pass": all(abs(e) <= REPLAY_TOLERANCE for e in errors.values())}


def replay_bench(args: argparse.Namespace, console: Console) -> int:
    bench = json.loads(args.from_bench.read_text())
    rows = replay_rows(bench, args.seed)
    table = Table(title=f"rollwise bench intercept vs its simulation (medians; simulated: median over {REPLAY_SEEDS} "
                  f"seeds; goal: within {REPLAY_TOLERANCE:.0%})")
    for col in ("policy", "episodes/s bench", "sim", "error", "turn p50 bench", "sim", "error",
                "recomputed bench", "sim", "goal"):
        table.add_column(col, justify="right")
    for r in rows:
        b, s, e = r["bench"], r["sim"], r["error"]
        table.add_row(r["policy"], f"{b['episodes_per_s']:.3f}", f"{s['episodes_per_s']:.3f}",
                      f"{e['episodes_per_s']:+.1%}", f"{b['turn_latency_p50_s']:.3f}",
                      f"{s['turn_latency_p50_s']:.3f}", f"{e['turn_latency_p50_s']:+.1%}",
                      f"{b['recomputed_fraction']:.1%}", f"{s['recomputed_fraction']:.1%}",
                      "PASS" if r["pass"] else "FAIL")
    console.print(table)
    for r in rows:
        errors = ", ".join(f"{label} {r['error'][key]:+.1%}" for key, label in COMPARED)
        console.print(f"{'PASS' if r['pass'] else 'FAIL'} {r['policy']}: {errors} (goal: within "
                      f"{REPLAY_TOLERANCE:.0%})", highlight=False)
    write_json(args.json, {"source": str(args.from_bench), "tolerance": REPLAY_TOLERANCE,
                           "pass": all(r["pass"] for r in rows), "rows": rows}, console)
    return 0


def default_scenario(cost: CostModel, kv_bytes_per_token: int) -> tuple[RetentionModel, InterceptWorkload]:
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
                           prefix_cache_tokens=cost.kv_capacity_tokens // 2, park_grace_s=None)
    return model, work


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cost", default="h100-7b", help="cost model YAML or bundled name (default: %(default)s)")
    parser.add_argument("--scenario", type=Path, help="YAML with workload: and retention: sections "
                        "(default: a long-tailed agentic mix on a KV-pressured engine)")
    parser.add_argument("--from-bench", type=Path, metavar="JSON", help="replay `rollwise bench intercept --json` "
                        "with the costs it measured, and compare medians with what it measured (PASS/FAIL per policy)")
    parser.add_argument("--kv-bytes-per-token", type=int, default=57344, help="KV bytes per token, all layers "
                        "(default: Qwen2.5-7B in bf16, 2*28*4*128*2); swap time = this / 25 GB/s (PCIe 5 x16, effective)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace, console: Console) -> int:
    if args.from_bench:
        return replay_bench(args, console)
    cost, _ = load_cost_file(args.cost)  # a path or a bundled name
    model, work = default_scenario(cost, args.kv_bytes_per_token)
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


def command() -> SimCommand:
    return SimCommand("intercept", "session KV retention policies at 64-4096 GPUs (--from-bench: validate)",
                      add_arguments, run)

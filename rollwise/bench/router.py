"""Router benchmark: every routing arm side by side, on real engine replicas and on 64 simulated ones.

Real: R reference-engine replicas (`rollwise serve engine`'s app over a random Llama-architecture
model, sized so prefill costs real time: a 2-core CPU still runs them) in subprocesses, with their
prefix caches on. The arms: rollwise's router under each policy, and vLLM's router (`vllm-router`,
policy cache_aware; skipped with a message when the optional extra is not installed). Every router
runs in its own process (router_processes.py), started fresh for each round with the replicas'
caches flushed; the same closed-loop workload goes through vLLM's token-in route
(POST /inference/v1/generate, which every arm forwards unchanged):

- GRPO groups: `group_size` samples of one prompt, sent as separate concurrent requests (as rollout
  workers send them, with X-Group-Id), `group_workers` groups in flight; all prompts share a
  system/few-shot prefix and differ in their question;
- multi-turn sessions (X-Session-Id): each turn's prompt is the previous prompt + its answer + a
  new user message, run back to back.

The workload runs in rounds; in each round every arm runs it, in an order rotated from round to
round, so the machine's noise falls on all arms alike.

Measured: prefix-cache hit rate (cached / prompt tokens, as the engines report them), prompt tokens
actually computed (prefill), client-side latency p50/p99 over all requests (and per round, with the
median round), load imbalance (max / mean of tokens computed per replica: prefill + generated), and
the router process's CPU seconds per request (/proc, via psutil). Ratios are against round robin, in
the same run. Simulated: the same policies and workload shape on 64 cost-model replicas
(rollwise/sim/routing.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from rich import box
from rich.console import Group
from rich.markup import escape
from rich.table import Table

from rollwise.bench import percentile, router_processes
from rollwise.bench.router_processes import MODEL_SIZE, Arm, arms, flush_caches, router_process
from rollwise.bench.router_replica import FULL as REPLICA_FULL
from rollwise.bench.router_replica import QUICK as REPLICA_QUICK
from rollwise.bench.router_replica import format_replica, measure_replica, replica_goal_line
from rollwise.bench.router_tail import format_tail, tail_of
from rollwise.router.policies import POLICIES, make_policy
from rollwise.sim.commands import write_json
from rollwise.sim.routing import SimConfig, Workload, make_workload, simulate

# vLLM's token-in route: every router arm forwards it to the replicas as sent (rollwise's /generate would
# be rewritten by vllm-router into its own schema).
ROUTE = "/inference/v1/generate"
__all__ = ["cli_bench_router", "measure_real", "replicas", "router", "run_router_bench"]


@dataclass(frozen=True)
class BenchShape:
    replicas: int
    groups: int
    group_size: int
    group_workers: int
    sessions: int
    turns: int
    shared_tokens: int
    question_tokens: int
    opening_tokens: int
    user_tokens: int
    max_tokens: int
    rounds: int = 1  # the workload above runs once per round; every policy runs each round, in rotated order
    max_num_seqs: int = 16
    max_model_len: int = 1536


QUICK = BenchShape(replicas=4, groups=3, group_size=8, group_workers=2, sessions=3, turns=3, shared_tokens=128,
                   question_tokens=384, opening_tokens=384, user_tokens=48, max_tokens=8, rounds=2)
FULL = BenchShape(replicas=4, groups=6, group_size=8, group_workers=3, sessions=4, turns=5, shared_tokens=128,
                  question_tokens=384, opening_tokens=384, user_tokens=48, max_tokens=16, rounds=4)
SIM_QUICK: dict[str, int] = {"groups": 128, "group_size": 8, "group_workers": 48, "sessions": 128, "turns": 5,
                              "shared_tokens": 256, "question_tokens": 256, "opening_tokens": 512, "user_tokens": 64,
                              "max_tokens": 64}
SIM_FULL = {**SIM_QUICK, "groups": 512, "sessions": 256, "turns": 6}


# ==================================================================== processes


@contextlib.contextmanager
def replicas(shape: BenchShape):
    with router_processes.replicas(shape.replicas, shape.max_num_seqs, shape.max_model_len) as urls:
        yield urls


@contextlib.contextmanager
def router(urls: list[str], policy: str):
    """rollwise's router in this process's thread (the validation's serving-cost probe counts it as this
    process's CPU); the benchmark's arms run every router in its own process (router_processes.py)."""
    from rollwise.local_server import serve_in_thread
    from rollwise.model.tiny import tiny_tokenizer
    from rollwise.router.config import RouterConfig
    from rollwise.router.app import bind_socket, create_app

    config = RouterConfig(replicas=urls, policy=policy, health_interval_s=0.5, queue_timeout_s=300)
    sock = bind_socket("127.0.0.1", 0, reuse_port=False)
    with serve_in_thread(create_app(config, tokenizer=tiny_tokenizer()), sock) as (url, _server):
        yield url


def engine_counters(urls: list[str]) -> list[dict[str, float]]:
    out = []
    for url in urls:
        counters: dict[str, float] = {}
        for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
            name, _, value = line.partition(" ")
            if name.startswith("rollwise_engine_finished_samples_total{"):  # every finish reason: one per request
                counters["finished_samples"] = counters.get("finished_samples", 0.0) + float(value)
                continue
            if name in ("rollwise_engine_prompt_tokens_total", "rollwise_engine_cached_prompt_tokens_total",
                        "rollwise_engine_generated_tokens_total", "rollwise_engine_step_seconds_total"):
                counters[name.removeprefix("rollwise_engine_").removesuffix("_total")] = float(value)
        out.append(counters)
    return out


# ==================================================================== the workload over HTTP


async def _run_workload(router: str, workload: Workload) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=router, timeout=600, limits=limits) as http:

        round_started = time.monotonic()

        async def one(prompt: list[int], headers: dict[str, str], kind: str) -> list[int]:
            params = {"max_tokens": workload.max_tokens, "ignore_eos": True, "seed": len(records)}
            started = time.monotonic()
            r = await http.post(ROUTE, json={"token_ids": prompt, "sampling_params": params}, headers=headers)
            r.raise_for_status()
            answer = r.json()
            # Per request, for the JSON's log (what makes a tail): rollwise's router names the replica that
            # answered (x-rollwise-replica); vllm-router does not.
            records.append({"kind": kind, "key": next(iter(headers.values())), "start_s": started - round_started,
                            "latency_s": time.monotonic() - started, "prompt_tokens": len(prompt),
                            "cached_prompt_tokens": answer["usage"]["prompt_tokens_details"]["cached_tokens"],
                            "replica": r.headers.get("x-rollwise-replica")})
            return answer["choices"][0]["token_ids"]

        groups = list(enumerate(workload.group_prompts))

        async def group_worker() -> None:
            while groups:
                g, prompt = groups.pop(0)
                headers = {"X-Group-Id": f"g{g}"}
                await asyncio.gather(*(one(prompt, headers, "group") for _ in range(workload.group_size)))

        async def session(s: int) -> None:
            history: list[int] = []
            for user in workload.session_turns[s]:
                prompt = history + user
                output = await one(prompt, {"X-Session-Id": f"s{s}"}, "session")
                history = prompt + output

        await asyncio.gather(*(group_worker() for _ in range(workload.group_workers)),
                             *(session(s) for s in range(len(workload.session_turns))))
    return records


def summarize(latencies: list[float], prompt: float, cached: float, work: list[float], wall_s: float) -> dict:
    mean_work = sum(work) / len(work) if work else 0.0
    return {
        "requests": len(latencies),
        "prefix_hit_rate": cached / prompt if prompt else 0.0,
        "prompt_tokens": int(prompt),
        "prefill_tokens": int(prompt - cached),
        "p50_latency_s": percentile(latencies, 0.5),
        "p99_latency_s": percentile(latencies, 0.99),
        "load_imbalance": max(work) / mean_work if mean_work else 0.0,
        "wall_s": wall_s,
    }


def _real_round(urls: list[str], arm: Arm, workload: Workload) -> dict:
    """One round of one arm: its router freshly started in its own process, the replicas' caches flushed;
    latencies, per-replica engine counters and the router process's CPU seconds."""
    flush_caches(urls)  # every arm starts cold
    with router_process(arm, urls) as proc:
        before, cpu_before = engine_counters(urls), proc.cpu_s()
        started = time.monotonic()
        records = asyncio.run(_run_workload(proc.url, workload))
        wall = time.monotonic() - started
        cpu = proc.cpu_s() - cpu_before
        after = engine_counters(urls)
    return {"latencies": [r["latency_s"] for r in records], "records": records, "wall_s": wall, "router_cpu_s": cpu,
            "delta": [{k: a[k] - b.get(k, 0.0) for k in a} for a, b in zip(after, before)]}


def _real_summary(rounds: list[dict]) -> dict:
    delta = [{k: sum(r["delta"][i][k] for r in rounds) for k in rounds[0]["delta"][i]}
             for i in range(len(rounds[0]["delta"]))]
    prompt = sum(d["prompt_tokens"] for d in delta)
    cached = sum(d["cached_prompt_tokens"] for d in delta)
    work = [d["prompt_tokens"] - d["cached_prompt_tokens"] + d["generated_tokens"] for d in delta]
    out = summarize([x for r in rounds for x in r["latencies"]], prompt, cached, work, sum(r["wall_s"] for r in rounds))
    # From the engines (every request is one sample): vllm-router does not say which replica answered.
    out["requests_per_replica"] = [int(d.get("finished_samples", 0)) for d in delta]
    out["engine_busy_s"] = sum(d.get("step_seconds", 0.0) for d in delta)  # summed over replicas
    out["p50_latency_s_per_round"] = [percentile(r["latencies"], 0.5) for r in rounds]
    out["p99_latency_s_per_round"] = [percentile(r["latencies"], 0.99) for r in rounds]
    # Medians over rotated rounds: the goals compare these (one slow phase of the machine moves a mean).
    out["p50_latency_s_median_round"] = percentile(out["p50_latency_s_per_round"], 0.5)
    out["p99_latency_s_median_round"] = percentile(out["p99_latency_s_per_round"], 0.5)
    out["router_cpu_s_per_round"] = [r["router_cpu_s"] for r in rounds]
    out["router_cpu_s_per_request"] = sum(r["router_cpu_s"] for r in rounds) / max(out["requests"], 1)
    out["requests_log"] = [r["records"] for r in rounds]  # per round, per request: kind, start, latency, replica
    return out


def _sim_policy(policy: str, workload: Workload, config: SimConfig) -> dict:
    result = simulate(make_policy(policy), workload, config)
    out = summarize(result["latencies"], result["prompt_tokens"], result["cached_prompt_tokens"],
                   result["replica_work"], result["makespan_s"])
    out["prefill_tokens"] = result["prefill_tokens"]
    return out


def vs_round_robin(results: dict[str, dict]) -> None:
    """Each arm's p99 and prefill tokens against round robin's (higher is better), in place."""
    base = results["round_robin"]
    for r in results.values():
        r["p99_vs_round_robin"] = base["p99_latency_s"] / r["p99_latency_s"] if r["p99_latency_s"] else None
        r["prefill_vs_round_robin"] = base["prefill_tokens"] / r["prefill_tokens"] if r["prefill_tokens"] else None
        if r.get("p99_latency_s_median_round"):  # real replicas, by round: the reading the vllm-router goals use
            r["p99_vs_round_robin_median_round"] = base["p99_latency_s_median_round"] / r["p99_latency_s_median_round"]


def round_workload(shape: BenchShape, seed: int, rnd: int) -> Workload:
    """The workload of one round (the simulator's validation replays exactly these)."""
    fields = {k: v for k, v in asdict(shape).items()
              if k not in ("replicas", "max_num_seqs", "max_model_len", "rounds")}
    return make_workload(seed * 1000 + rnd, **fields)


def measure_real(shape: BenchShape, seed: int, policies: list[str], progress: Any = None,
                 urls: list[str] | None = None, arm_list: list[Arm] | None = None) -> dict[str, dict]:
    """Every arm (rollwise's router under each policy, by default) on real replicas (started here, or `urls`
    already running): per-arm summaries (rounds summed), ratios against round robin."""
    # The machine is shared and noisy: arms take turns in short rounds (rotated order), so slow
    # phases hit every arm alike, instead of one arm running entirely in a slow phase.
    arm_list = arm_list or [Arm(p, "rollwise", p) for p in policies]
    rounds: dict[str, list[dict]] = {arm.name: [] for arm in arm_list}
    with contextlib.nullcontext(urls) if urls else replicas(shape) as urls:
        for rnd in range(shape.rounds):
            workload = round_workload(shape, seed, rnd)
            shift = rnd % len(arm_list)
            for arm in arm_list[shift:] + arm_list[:shift]:
                if progress:
                    progress(f"real replicas, round {rnd + 1}/{shape.rounds}: {arm.name}")
                rounds[arm.name].append(_real_round(urls, arm, workload))
    real = {arm.name: {"router": arm.router, **_real_summary(rounds[arm.name])} for arm in arm_list}
    vs_round_robin(real)
    return real


def run_replica_arm(quick: bool = False, seed: int = 0, baseline: Path | None = None, progress: Any = None) -> dict:
    """Only the replica arm (router_replica.py): one engine server's CPU per request beyond its engine."""
    replica = measure_replica(REPLICA_QUICK if quick else REPLICA_FULL, seed, baseline, progress=progress)
    return {"benchmark": "router", "quick": quick, "replica": replica, "goals": replica["goals"]}


def run_router_bench(quick: bool = False, seed: int = 0, plot: Path | None = None,
                     policies: list[str] | None = None, progress: Any = None, rounds: int | None = None,
                     replica_baseline: Path | None = None) -> dict:
    policies = policies or list(POLICIES)
    if "round_robin" not in policies:
        policies = ["round_robin", *policies]
    shape = QUICK if quick else FULL
    if rounds is not None:
        if rounds < 1:
            raise ValueError(f"--rounds must be at least 1, got {rounds}")
        shape = replace(shape, rounds=rounds)
    arm_list, skipped = arms(policies, with_vllm_router=True)
    real = measure_real(shape, seed, policies, progress, arm_list=arm_list)
    sim_config = SimConfig()
    sim_workload = make_workload(seed, **(SIM_QUICK if quick else SIM_FULL))
    sim = {}
    for name in policies:
        if progress:
            progress(f"{sim_config.replicas} simulated replicas: {name}")
        sim[name] = _sim_policy(name, sim_workload, sim_config)
    vs_round_robin(sim)
    result = {
        "benchmark": "router",
        "quick": quick,
        "real": {"replicas": shape.replicas, "model": {**MODEL_SIZE, "note": "random Llama-architecture weights"},
                 "workload": asdict(shape), "policies": real, "skipped": skipped, "route": ROUTE},
        "simulated": {"config": asdict(sim_config), "workload": dict(SIM_QUICK if quick else SIM_FULL),
                      "policies": sim},
        "goal": {"p99_vs_round_robin": 1.5, "prefill_vs_round_robin": 2.0, "policy": "prefix"},
    }
    result["replica"] = measure_replica(REPLICA_QUICK if quick else REPLICA_FULL, seed, replica_baseline,
                                        progress=progress)
    result["goals"] = result["replica"]["goals"]
    if plot is not None:
        result["plot"] = str(_plot(result, plot))
    return result


def _plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for row, (label, key) in enumerate((("real replicas", "real"), ("64 simulated replicas", "simulated"))):
        policies = result[key]["policies"]
        names = list(policies)
        for ax, (metric, title) in zip(axes[row], (("p99_latency_s", "p99 latency (s)"),
                                                   ("prefill_tokens", "prompt tokens computed"),
                                                   ("prefix_hit_rate", "prefix-cache hit rate"))):
            ax.bar(names, [policies[n][metric] for n in names],
                   color=["tab:gray" if n == "round_robin" else "tab:blue" for n in names])
            ax.set_title(f"{label}: {title}", fontsize=9)
            ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_router_bench(result: dict) -> Group:
    """Two tables (real replicas, simulated replicas), one row per arm; the real one adds the router's CPU."""
    tables = []
    for key, label in (("real", f"{result['real']['replicas']} real replicas"),
                       ("simulated", f"{result['simulated']['config']['replicas']} simulated replicas")):
        table = Table(title=f"rollwise bench router{' --quick' if result['quick'] else ''}: {label}", box=box.SIMPLE)
        real = key == "real"
        for col in ("arm", "hit", "prefill", "p50 s", "p99 s", "imbal", "p99÷", "prefill÷",
                    *(("router CPU ms/req",) if real else ())):
            table.add_column(col, justify="left" if col == "arm" else "right", no_wrap=True)
        for name, r in result[key]["policies"].items():
            cpu = (f"{r['router_cpu_s_per_request'] * 1000:.2f}",) if real else ()
            table.add_row(name, f"{r['prefix_hit_rate']:.0%}", f"{r['prefill_tokens']:,}",
                          f"{r['p50_latency_s']:.3f}", f"{r['p99_latency_s']:.3f}", f"{r['load_imbalance']:.2f}",
                          f"{r['p99_vs_round_robin']:.2f}x", f"{r['prefill_vs_round_robin']:.2f}x", *cpu)
        tables.append(table)
    legend = ("hit: prefix-cache hit rate (engine-reported); prefill: prompt tokens computed; imbal: max/mean "
              "tokens computed per replica; ÷: round robin's value / the arm's (higher is better); router CPU: "
              "the router process's user+system CPU seconds per request (every router runs in its own process)")
    return Group(*tables, legend)


def _peer_line(real: dict[str, dict]) -> str | None:
    """rollwise's prefix against vllm-router's cache_aware, on the issue's goals (medians over rounds)."""
    peer, ours = real.get("vllm-router:cache_aware"), real.get("prefix")
    if peer is None or ours is None:
        return None
    cpu = ours["router_cpu_s_per_request"] / peer["router_cpu_s_per_request"] if peer["router_cpu_s_per_request"] \
        else float("inf")
    # Round k of every arm runs the same workload, arms side by side in time: compare them round by round too.
    diffs = [a - b for a, b in zip(ours["p99_latency_s_per_round"], peer["p99_latency_s_per_round"])]
    return (f"prefix vs vllm-router cache_aware: hit {ours['prefix_hit_rate']:.1%} vs {peer['prefix_hit_rate']:.1%}, "
            f"prefill {ours['prefill_tokens']:,} vs {peer['prefill_tokens']:,}, median-round p50 "
            f"{ours['p50_latency_s_median_round']:.3f} vs {peer['p50_latency_s_median_round']:.3f} s, p99 "
            f"{ours['p99_latency_s_median_round']:.3f} vs {peer['p99_latency_s_median_round']:.3f} s (paired by round: "
            f"{sum(diffs) / len(diffs) * 1000:+.0f} ms on average, lower in {sum(d < 0 for d in diffs)} of {len(diffs)}), "
            f"router CPU per request {cpu:.2f}x theirs (goal <= 2x)")


def cli_bench_router(args: argparse.Namespace, console: Any) -> int:
    # --plot defaults to the rollout bench's file name; the router bench plots only when asked.
    plot = args.plot if args.plot != Path("rollout_timeline.png") else None
    baseline = getattr(args, "replica_baseline", None)
    with console.status("starting replicas") as status:
        if getattr(args, "replica_only", False):
            result = run_replica_arm(quick=args.quick, seed=args.seed, baseline=baseline, progress=status.update)
        else:
            result = run_router_bench(quick=args.quick, seed=args.seed, plot=plot, progress=status.update,
                                      rounds=getattr(args, "rounds", None), replica_baseline=baseline)
    result["command"] = " ".join(["rollwise"] + sys.argv[1:])
    console.print(format_replica(result["replica"]))
    console.print(replica_goal_line(result["goals"]))
    if "real" not in result:  # --replica-only
        write_json(args.json, result, console)
        return 0
    console.print(format_router_bench(result))
    for message in result["real"]["skipped"]:
        console.print(f"[yellow]skipped:[/yellow] {escape(message)}")  # its [extra] is not markup
    prefix = result["real"]["policies"]["prefix"]
    by_round = prefix.get("p99_vs_round_robin_median_round")
    by_round = f" ({by_round:.2f}x on the median round)" if by_round else ""
    console.print(f"prefix vs round robin on real replicas: p99 {prefix['p99_vs_round_robin']:.2f}x lower over all "
                  f"requests{by_round} (goal 1.5x), prefill tokens {prefix['prefill_vs_round_robin']:.2f}x fewer (goal 2x)")
    peer = _peer_line(result["real"]["policies"])
    if peer:
        console.print(peer)
    console.print(format_tail(tail_of(result)))  # which requests make each round's p99, and where they ran
    if result.get("plot"):
        console.print(f"plot: {result['plot']}")
    write_json(args.json, result, console)
    return 0


if __name__ == "__main__":
    if "--replica-worker" in sys.argv:  # older command lines: the worker lives in router_processes.py
        router_processes.replica_main(sys.argv[1:])

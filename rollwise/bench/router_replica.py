"""`rollwise bench router`'s replica arm: what one engine server costs per request beyond its engine.

One bench replica (the router bench's engine and model, one torch thread) serves closed-loop token-in requests
from the aiohttp load generator (load_generator.py), in a process of its own, at concurrency 1, 8 and 64 (the
bench's replicas run 16 sequences at most, so 64 also queues in the engine). Short requests (32 prompt tokens,
4 sampled) so the server's share is large. Measured per concurrency: the replica process's CPU seconds (the
kernel's per-process clock) less its engine steps' CPU seconds (the step thread's clock, replica_server.py) per
request: the server's CPU per request over the bare engine (HTTP, JSON, asyncio, the hand-offs to and from the
engine thread); the engine's own per request; client-side latency p50/p99.

`baseline`: another checkout (e.g. `git worktree add /tmp/before HEAD`) whose engine server runs as a second
replica arm in the same run, rounds interleaved with this one's, so before and after see the same machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rollwise.bench import percentile
from rollwise.bench.router_processes import MODEL_SIZE, cpu_clock_s, stop, wait_healthy
from rollwise.local_server import free_port

CONCURRENCY = (1, 8, 64)
GOAL_SERVER_CPU_MS = 1.0  # issue 44: ~2.7 ms before the submit queue
SERVER = Path(__file__).with_name("replica_server.py")
ROUTE = "/inference/v1/generate"  # the route every router arm of the bench forwards


@dataclass(frozen=True)
class ReplicaShape:
    requests: int  # per concurrency and round
    rounds: int
    prompt_tokens: int = 32
    max_tokens: int = 4
    max_num_seqs: int = 16


QUICK = ReplicaShape(requests=128, rounds=2)
FULL = ReplicaShape(requests=512, rounds=4)


@dataclass(frozen=True)
class Replica:
    name: str
    url: str
    pid: int

    def cpu(self) -> tuple[float, float]:
        """(the process's CPU seconds, its engine steps' CPU seconds) now."""
        steps = httpx.get(f"{self.url}/bench/engine_cpu", timeout=30).json()["step_cpu_s"]
        return cpu_clock_s(self.pid), steps


@contextlib.contextmanager
def replica(name: str, source: Path | None, shape: ReplicaShape) -> Iterator[Replica]:
    """A replica server from this checkout, or from `source` (its rollwise package first on the path)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if source is not None:
        if not (source / "rollwise" / "engine" / "server.py").is_file():
            raise ValueError(f"--replica-baseline {source}: no rollwise/engine/server.py there; give a checkout "
                             "of rollwise (e.g. `git worktree add /tmp/before HEAD`)")
        env["PYTHONPATH"] = os.pathsep.join([str(source.resolve()), *filter(None, [env.get("PYTHONPATH")])])
    log = tempfile.TemporaryFile()  # a file, not a pipe nobody reads (a full pipe would block the server)
    proc = subprocess.Popen([sys.executable, str(SERVER), "--port", str(port), "--model-size", json.dumps(MODEL_SIZE),
                             "--max-num-seqs", str(shape.max_num_seqs)], env=env, stdout=subprocess.DEVNULL,
                            stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, f"the {name} replica server")
        yield Replica(name, url, proc.pid)
    finally:
        stop([proc])
        log.close()


def load(url: str, concurrency: int, requests: int, shape: ReplicaShape, seed: int) -> dict[str, Any]:
    """The load generator's run, in its own process."""
    out = subprocess.run([sys.executable, "-m", "rollwise.bench.load_generator", "--url", url, "--route", ROUTE,
                          "--concurrency", str(concurrency), "--requests", str(requests),
                          "--prompt-tokens", str(shape.prompt_tokens), "--max-tokens", str(shape.max_tokens),
                          "--seed", str(seed)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the load generator failed: {out.stderr[-2000:]}")
    result = json.loads(out.stdout)
    if result["errors"]:
        raise RuntimeError(f"{len(result['errors'])} requests failed, e.g. {result['errors'][0]}")
    return result


def measure_once(rep: Replica, concurrency: int, shape: ReplicaShape, seed: int) -> dict[str, Any]:
    load(rep.url, concurrency, min(shape.requests, 4 * concurrency), shape, seed + 1)  # warm: connections, caches
    cpu0, engine0 = rep.cpu()
    run = load(rep.url, concurrency, shape.requests, shape, seed)
    cpu1, engine1 = rep.cpu()
    n = len(run["latencies_s"])
    return {"requests": n, "process_cpu_s": cpu1 - cpu0, "engine_cpu_s": engine1 - engine0,
            "latencies_s": run["latencies_s"], "wall_s": run["wall_s"], "client_cpu_s": run["client_cpu_s"]}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    n = sum(r["requests"] for r in runs)
    latencies = [x for r in runs for x in r["latencies_s"]]
    server = [(r["process_cpu_s"] - r["engine_cpu_s"]) / r["requests"] * 1000 for r in runs]
    return {
        "requests": n,
        "server_cpu_ms_per_request": sum(r["process_cpu_s"] - r["engine_cpu_s"] for r in runs) / n * 1000,
        "server_cpu_ms_per_request_per_round": server,
        "server_cpu_ms_per_request_median_round": percentile(server, 0.5),
        "engine_cpu_ms_per_request": sum(r["engine_cpu_s"] for r in runs) / n * 1000,
        "process_cpu_ms_per_request": sum(r["process_cpu_s"] for r in runs) / n * 1000,
        "client_cpu_ms_per_request": sum(r["client_cpu_s"] for r in runs) / n * 1000,
        "p50_latency_s": percentile(latencies, 0.5),
        "p99_latency_s": percentile(latencies, 0.99),
        "requests_per_s": n / sum(r["wall_s"] for r in runs),
    }


def measure_replica(shape: ReplicaShape, seed: int = 0, baseline: Path | None = None,
                    concurrency: tuple[int, ...] = CONCURRENCY, progress: Any = None) -> dict[str, Any]:
    """Every arm (this checkout's server; `baseline`'s too when given) at every concurrency, rounds rotated."""
    sources = {"replica": None, **({"replica:baseline": baseline} if baseline is not None else {})}
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {name: {c: [] for c in concurrency} for name in sources}
    with contextlib.ExitStack() as stack:
        reps = [stack.enter_context(replica(name, source, shape)) for name, source in sources.items()]
        for rnd in range(shape.rounds):
            shift = rnd % len(reps)
            for rep in reps[shift:] + reps[:shift]:
                for c in concurrency:
                    if progress:
                        progress(f"replica arm, round {rnd + 1}/{shape.rounds}: {rep.name}, concurrency {c}")
                    runs[rep.name][c].append(measure_once(rep, c, shape, seed * 1000 + rnd))
    arms = {name: {str(c): summarize(by_c[c]) for c in concurrency} for name, by_c in runs.items()}
    return {"shape": shape.__dict__, "route": ROUTE, "model": MODEL_SIZE,
            "baseline": str(baseline) if baseline is not None else None, "arms": arms,
            "goals": goals(arms)}


def goals(arms: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The issue's goal, server CPU per request <= 1 ms, read as the worst concurrency; with a baseline, its
    figure beside (before / after)."""

    def worst(name: str) -> float:
        return max(a["server_cpu_ms_per_request"] for a in arms[name].values())

    out: dict[str, Any] = {"server_cpu_ms_per_request": {
        "target": f"<= {GOAL_SERVER_CPU_MS:g}", "value": worst("replica"), "met": worst("replica") <= GOAL_SERVER_CPU_MS,
        "by_concurrency": {c: a["server_cpu_ms_per_request"] for c, a in arms["replica"].items()}}}
    if "replica:baseline" in arms:
        before = out["server_cpu_ms_per_request"]["before"] = worst("replica:baseline")
        out["server_cpu_ms_per_request"]["before_by_concurrency"] = {
            c: a["server_cpu_ms_per_request"] for c, a in arms["replica:baseline"].items()}
        out["server_cpu_ms_per_request"]["after_vs_before"] = worst("replica") / before if before else None
    return out


def format_replica(result: dict[str, Any]) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(title="replica arm: one engine server, aiohttp load generator in its own process", box=box.SIMPLE)
    for col in ("arm", "concurrency", "server CPU ms/req", "engine CPU ms/req", "p50 s", "p99 s", "req/s"):
        table.add_column(col, justify="left" if col == "arm" else "right", no_wrap=True)
    for name, by_c in result["arms"].items():
        for c, r in by_c.items():
            table.add_row(name, c, f"{r['server_cpu_ms_per_request']:.2f}", f"{r['engine_cpu_ms_per_request']:.2f}",
                          f"{r['p50_latency_s']:.4f}", f"{r['p99_latency_s']:.4f}", f"{r['requests_per_s']:.1f}")
    return table


def replica_goal_line(goals: dict[str, Any]) -> str:
    g = goals["server_cpu_ms_per_request"]
    before = f", before {g['before']:.2f} ms ({g['after_vs_before']:.2f}x)" if "before" in g else ""
    return (f"engine server CPU per request over the bare engine (worst concurrency): {g['value']:.2f} ms{before}; "
            f"goal {g['target']} ms: {'met' if g['met'] else 'not met'}")

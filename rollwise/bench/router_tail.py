"""What makes `rollwise bench router`'s tail: its slowest requests per round, from the JSON's `requests_log`.

Nothing is timed here: it reads what a run recorded (per round and request: kind, group/session key, start,
latency, cached prompt tokens, and, for rollwise's arms, the replica that answered) and reconstructs, for
each round's requests at or above its p99 (the 2 slowest of 68 in the full workload), how many requests
were in flight on their replica and on all replicas when they started. vllm-router does not say which
replica answered, so its rows have no replica columns.

    python -m rollwise.bench.router_tail docs/bench/router.json [ARM ...]
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from rollwise.bench import percentile

DEFAULT_ARMS = ("prefix", "vllm-router:cache_aware")


@dataclass(frozen=True)
class TailRequest:
    arm: str
    round: int
    p99_s: float
    key: str  # g3: GRPO group 3; s1: session 1
    start_s: float
    latency_s: float
    cached_tokens: int
    prompt_tokens: int
    replica: int | None  # index among the arm's replicas (sorted URLs); None: the router does not say
    in_flight_replica: int | None  # requests in flight on that replica when it started, itself included
    in_flight_all: int  # requests in flight on all replicas when it started, itself included
    requests_per_replica: tuple[int, ...]  # the round's requests per replica (rollwise's arms)


def _in_flight(log: list[dict[str, Any]], at: float, replica: str | None = None) -> int:
    return sum(1 for r in log if r["start_s"] <= at < r["start_s"] + r["latency_s"]
               and (replica is None or r["replica"] == replica))


def tail_requests(arm: str, rounds: list[list[dict[str, Any]]]) -> list[TailRequest]:
    """Per round, every request at or above the round's p99 latency (nearest rank, as the benchmark's)."""
    replicas = sorted({r["replica"] for log in rounds for r in log if r.get("replica")})
    out = []
    for number, log in enumerate(rounds):
        p99 = percentile([r["latency_s"] for r in log], 0.99)
        per_replica = Counter(r.get("replica") for r in log)
        counts = tuple(per_replica.get(name, 0) for name in replicas)
        for r in sorted((r for r in log if r["latency_s"] >= p99), key=lambda r: -r["latency_s"]):
            name = r.get("replica")
            out.append(TailRequest(
                arm, number, p99, r["key"], r["start_s"], r["latency_s"], r["cached_prompt_tokens"], r["prompt_tokens"],
                replicas.index(name) if name else None, _in_flight(log, r["start_s"], name) if name else None,
                _in_flight(log, r["start_s"]), counts))
    return out


def format_tail(rows: list[TailRequest]) -> Table:
    table = Table(title="bench router: each round's requests at or above its p99", box=box.SIMPLE)
    for col in ("arm", "round", "p99 s", "request", "start s", "latency s", "cached", "replica",
                "in flight (replica / all)", "requests per replica"):
        table.add_column(col, justify="left" if col in ("arm", "request") else "right", no_wrap=True)
    for t in rows:
        on_replica = "?" if t.in_flight_replica is None else str(t.in_flight_replica)
        table.add_row(t.arm, str(t.round), f"{t.p99_s:.3f}", t.key, f"{t.start_s:.3f}", f"{t.latency_s:.3f}",
                      f"{t.cached_tokens}/{t.prompt_tokens}", "?" if t.replica is None else str(t.replica),
                      f"{on_replica} / {t.in_flight_all}", "/".join(map(str, t.requests_per_replica)) or "?")
    return table


def tail_of(result: dict[str, Any], arms: tuple[str, ...] = DEFAULT_ARMS) -> list[TailRequest]:
    """The tail rows of `arms` in a `bench router --json` result (arms the run lacks are left out)."""
    policies = result["real"]["policies"]
    return [row for arm in arms if arm in policies and "requests_log" in policies[arm]
            for row in tail_requests(arm, policies[arm]["requests_log"])]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    result = json.loads(Path(argv[0]).read_text())
    Console().print(format_tail(tail_of(result, tuple(argv[1:]) or DEFAULT_ARMS)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

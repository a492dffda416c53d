"""Sandbox benchmark: what a rollout pays for isolation, and how many sandboxes this machine holds.

Latencies (p50/p99 over N trials, all limits on, at the strongest isolation level this machine allows):
- create: a new LocalSandbox (its workspace directory);
- exec: `run("true")`, a whole isolated launch (bubblewrap namespaces, rlimits, process-group kill);
- fork: copying a workspace holding a typical setup (a few hundred files, ~1 MB) for a GRPO sibling;
- destroy: `close()` (kill anything left, remove the workspace).
Concurrency: K sandboxes each run `sleep` at once (one thread per sandbox); K doubles until a run
fails or K reaches the cap. The largest K where every run succeeded is what the machine holds.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from rich.table import Table

from rollwise.bench import percentile
from rollwise.sandbox.isolation import detect_isolation
from rollwise.sandbox.local import LocalSandbox
from rollwise.sandbox.types import SandboxLimits


def _summary(samples: list[float]) -> dict[str, float]:
    return {"p50_ms": 1e3 * statistics.median(samples), "p99_ms": 1e3 * percentile(samples, 0.99),
            "mean_ms": 1e3 * statistics.fmean(samples), "n": len(samples)}


def _timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _populate(sb: LocalSandbox, files: int) -> None:
    # A typical "repo checkout" setup: many small files in a few directories, ~1 MB in all.
    sb.run(f"mkdir -p src tests && for i in $(seq 1 {files}); do head -c 3000 /dev/urandom > src/f$i.bin; done")


def _concurrency(limits: SandboxLimits, isolation: Any, cap: int, hold_s: float) -> dict[str, Any]:
    tried: list[dict[str, Any]] = []
    k, held = 8, 0
    while k <= cap:
        boxes = [LocalSandbox(limits, isolation=isolation) for _ in range(k)]
        results: list[Any] = [None] * k

        def work(i: int) -> None:
            try:
                results[i] = boxes[i].run(f"sleep {hold_s}")
            except Exception as exc:  # noqa: BLE001 - a failed launch is what this measures
                results[i] = exc

        threads = [threading.Thread(target=work, args=(i,)) for i in range(k)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        for sb in boxes:
            sb.close()
        ok = sum(1 for r in results if not isinstance(r, Exception) and r.exit_code == 0 and not r.killed)
        tried.append({"sandboxes": k, "ok": ok, "wall_s": wall})
        if ok < k:
            break
        held = k
        k *= 2
    return {"held": held, "cap": cap, "hold_s": hold_s, "tried": tried}


def run_sandbox_bench(*, quick: bool = False) -> dict[str, Any]:
    """quick: 10 trials per operation and up to 32 concurrent sandboxes (well under a minute here);
    full: 50 trials and up to 1024."""
    trials, files, cap = (10, 100, 32) if quick else (50, 300, 1024)
    limits = SandboxLimits(timeout_s=30)
    isolation = detect_isolation()
    create, execs, forks, destroy = [], [], [], []
    for _ in range(trials):
        seconds, sb = _timed(lambda: LocalSandbox(limits, isolation=isolation))
        create.append(seconds)
        seconds, result = _timed(lambda: sb.run("true"))
        if result.exit_code != 0:
            raise RuntimeError(f"`true` failed in the sandbox: {result.reason or result.stderr}")
        execs.append(seconds)
        destroy.append(_timed(sb.close)[0])
    parent = LocalSandbox(limits, isolation=isolation)
    _populate(parent, files)
    for _ in range(trials):
        seconds, child = _timed(parent.fork)
        forks.append(seconds)
        child.close()
    parent.close()
    return {
        "quick": quick,
        "isolation": f"{isolation.mode.name} ({isolation.level.value})",
        "limits": limits.model_dump(),
        "fork_files": files,
        "create": _summary(create),
        "exec": _summary(execs),
        "fork": _summary(forks),
        "destroy": _summary(destroy),
        "concurrency": _concurrency(limits, isolation, cap, hold_s=2.0),
    }


def format_sandbox_bench(result: dict[str, Any]) -> Table:
    table = Table(title=f"Sandbox benchmark: isolation={result['isolation']}, all limits on "
                        f"({'quick' if result['quick'] else 'full'})")
    for col in ("operation", "p50 ms", "p99 ms", "mean ms", "trials"):
        table.add_column(col, justify="left" if col == "operation" else "right")
    names = {"create": "create (workspace)", "exec": "exec (`true`, isolated launch)",
             "fork": f"fork ({result['fork_files']} files, copy)", "destroy": "destroy (kill + remove)"}
    for key, label in names.items():
        s = result[key]
        table.add_row(label, f"{s['p50_ms']:.1f}", f"{s['p99_ms']:.1f}", f"{s['mean_ms']:.1f}", str(s["n"]))
    c = result["concurrency"]
    steps = ", ".join(f"{t['ok']}/{t['sandboxes']} in {t['wall_s']:.1f}s" for t in c["tried"])
    table.caption = (f"concurrent sandboxes held (each running `sleep {c['hold_s']:g}`): {c['held']}"
                     f"{' (the cap of this run)' if c['held'] == c['cap'] else ''}; tried: {steps}")
    return table

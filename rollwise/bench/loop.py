"""`rollwise bench loop`: the whole RL loop at the machine's limit (issue 23).

It runs `rollwise train` on the default config (the embedded rollwise/configs/default.yaml: 15
steps, evaluations every 3 steps, vLLM when installed) in this process, and reports what a user
waits for and what the hardware did:

    wall time           from the call to the summary (model load, engine start, every evaluation)
    samples/s           trained samples over the wall time
    MFU                 model FLOPs (rollwise.observe.flops) over wall x the machine's matmul peak
                        (rollwise.observe.peak, measured once and cached): for the run, and for
                        generation, training and evaluation over their own seconds
    idle core-seconds   machine-wide, over the run (/proc/stat through psutil)
    held-out accuracy   strict accuracy before, at the first mid-run evaluation, and at the end

--quick: 2 steps of a quarter of the batch (2 groups of 16), 10 held-out problems, no mid-run
evaluation (checks that the benchmark runs; its numbers are not the goal's). Time it on an idle
machine: the peak and the wall time both drop when other work shares the cores (delete
~/.cache/rollwise/matmul_peak.json, or $ROLLWISE_CACHE's, if it was measured on a busy machine).

Goals on a 2-core CPU with vLLM (issue 23): run MFU >= 45% of the measured peak; the default run in
<= 7 minutes; held-out strict accuracy +50 points at the end and +40 at the first mid-run evaluation.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from rollwise.config import load_config
from rollwise.observe.metrics import idle_core_seconds

GOAL_MFU = 0.45
GOAL_WALL_S = 7 * 60
GOAL_GAIN_END = 0.50
GOAL_GAIN_FIRST_MID = 0.40
QUICK = ["train.steps=2", "rollout.prompts_per_step=2", "eval.size=10", "eval.every=0", "checkpoint.every=0"]


def loop_overrides(quick: bool, model: str | None, output_dir: str, extra: list[str] | None = None) -> list[str]:
    """The default config, as `rollwise train` runs it, with the bench's own run directory, and
    `extra` overrides last (`--set train.pack_responses=false`: a before/after row of one change)."""
    overrides = [f"output_dir={output_dir}"]
    if model is not None:
        overrides.append(f"model={model}")
    return overrides + (QUICK if quick else []) + list(extra or [])


def run_loop_bench(quick: bool = False, model: str | None = None, console: Console | None = None,
                   output_dir: str = "runs/bench-loop-{model_name}-{timestamp}",
                   overrides: list[str] | None = None) -> dict[str, Any]:
    from rollwise.control.train_loop import train  # heavy: torch, the engines

    cfg = load_config(None, loop_overrides(quick, model, output_dir, overrides))
    process = psutil.Process()
    cpu0, idle0, t0 = _process_cpu_s(process), idle_core_seconds(), time.monotonic()
    summary = train(cfg, console or Console())
    wall = time.monotonic() - t0
    cpu, idle = _process_cpu_s(process) - cpu0, idle_core_seconds() - idle0
    run_dir = Path(summary["run_dir"])
    evals = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines() if line.strip()]
    result = summarise(cfg.model, quick, wall, cpu, idle, summary, evals)
    result["overrides"] = list(overrides or [])
    return result


def _process_cpu_s(process: psutil.Process) -> float:
    """CPU seconds of this process and its finished children (engine processes included)."""
    t = process.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def summarise(model: str, quick: bool, wall: float, cpu: float, idle: float, summary: dict[str, Any],
              evals: list[dict[str, Any]]) -> dict[str, Any]:
    """The bench's result from train()'s summary and evaluations, with the issue's goals checked."""
    cores = psutil.cpu_count() or 1
    before = next((e for e in evals if e["label"] == "before"), None)
    mid = next((e for e in evals if e["label"] == "mid"), None)
    after = summary.get("eval_after")
    gain = (lambda e: e["strict_accuracy"] - before["strict_accuracy"] if e and before else None)
    trained = (summary.get("samples") or {}).get("trained", 0)
    mfu = summary.get("mfu") or {}
    result = {
        "model": model, "quick": quick, "engine": summary.get("engine"), "steps": summary.get("steps"),
        "run_dir": summary["run_dir"], "wall_s": wall, "samples_trained": trained, "samples_per_s": trained / wall,
        "mfu": mfu, "peak": summary.get("peak"), "flops": summary.get("flops"),
        "phase_seconds": summary.get("phase_seconds"), "time_split_s": summary.get("time_split_s"),
        "idle_core_s": idle, "idle_core_fraction": idle / max(wall * cores, 1e-9), "cores": cores,
        "process_cpu_s": cpu,
        "strict_before": before["strict_accuracy"] if before else None,
        "strict_first_mid": mid["strict_accuracy"] if mid else None, "first_mid_step": mid["step"] if mid else None,
        "strict_after": after["strict_accuracy"] if after else None,
        "gain_first_mid": gain(mid), "gain_end": gain(after),
    }
    result["goals"] = {
        "run MFU >= 45% of the measured peak": _met(mfu.get("run"), GOAL_MFU),
        "wall <= 7 min (default run)": None if quick else wall <= GOAL_WALL_S,
        "held-out strict +50 points at the end": _met(result["gain_end"], GOAL_GAIN_END),
        "held-out strict +40 points at the first mid-run eval": _met(result["gain_first_mid"], GOAL_GAIN_FIRST_MID),
    }
    return result


def _met(value: float | None, goal: float) -> bool | None:
    return None if value is None else value >= goal


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def format_loop_bench(r: dict[str, Any]) -> Table:
    peak = r.get("peak") or {}
    table = Table(title=f"rollwise bench loop — {r['model']} on {r['engine']}, {r['steps']} steps"
                        + (" (--quick)" if r["quick"] else "")
                        + (f" with {' '.join(r['overrides'])}" if r.get("overrides") else ""))
    table.add_column("measure")
    table.add_column("value", justify="right")
    mfu = r["mfu"]
    rows = [
        ("wall time (call to summary)", f"{r['wall_s']:.0f} s ({r['wall_s'] / 60:.1f} min)"),
        ("samples trained / per second", f"{r['samples_trained']} / {r['samples_per_s']:.2f}"),
        ("matmul peak", f"{peak.get('flops', 0) / 1e9:,.0f} GFLOP/s ({peak.get('source')}, {peak.get('units')} "
                        f"{'GPUs' if peak.get('kind') == 'cuda' else 'cores'}, {peak.get('dtype')})"),
        ("MFU run", _pct(mfu.get("run"))),
        ("MFU generate / train / eval", " / ".join(_pct(mfu.get(k)) for k in ("generate", "train", "eval"))),
        ("idle core-seconds", f"{r['idle_core_s']:.0f} ({r['idle_core_fraction']:.0%} of {r['cores']} cores x wall)"),
        ("this process's CPU seconds", f"{r['process_cpu_s']:.0f}"),
        ("held-out strict: before / first mid / end",
         f"{_pct(r['strict_before'])} / {_pct(r['strict_first_mid'])} / {_pct(r['strict_after'])}"),
    ]
    if r.get("time_split_s"):
        total = sum(r["time_split_s"].values()) or 1.0
        rows.append(("time split", ", ".join(f"{k.replace('_', ' ')} {v / total:.0%}"
                                             for k, v in r["time_split_s"].items())))
    rows += [(f"goal: {goal}", {True: "met", False: "NOT met", None: "—"}[met]) for goal, met in r["goals"].items()]
    for row in rows:
        table.add_row(*row)
    return table

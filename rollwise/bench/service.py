"""`rollwise bench service`: the training service (`rollwise serve tinker`) under 1, 2, 4 and 8 LoRA tenants, each
running the arithmetic RL loop through the unmodified `tinker` SDK (rollwise/bench/service_tenant.py, one client
process per tenant), against each tenant alone and against the same workload through `rollwise train` (issue 39's
benchmark).

Per arm: aggregate and per-tenant samples/s and train tokens/s, p50/p99 of asample and forward_backward latency
(submission to result, as a client sees it). Goals (in the JSON's `goals`):
- `service_overhead_1_tenant`: one tenant's mean step time over `rollwise train`'s on the same workload (model,
  LoRA rank, groups x group size, max tokens, steps), minus 1; goal <= 0.15. First steps (warm-up) are left out.
- `aggregate_throughput_8_vs_1`: aggregate samples/s at the most tenants over one tenant's; goal >= 3.

A fresh server per arm, so no arm inherits another's caches or tenants; arms run one after another in one run.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from rich.table import Table

from rollwise.bench.router_processes import stop, wait_healthy
from rollwise.bench.service_tenant import problem
from rollwise.local_server import free_port

GOALS = {"service_overhead_1_tenant": 0.15, "aggregate_throughput_8_vs_1": 3.0}
# Why skyrl-tx (SkyRL's Tinker server, the only open one) has no arm here: tried on this machine, 2026-11-29.
SKYRL_TX = (
    "not run side by side: skyrl-tx 0.3.0 installs on this CPU only in its own venv (transformers<5, JAX CPU), "
    "its API has no client/config and no protobuf, so SDK 0.38 cannot talk to it; with SDK 0.16.1 its JAX engine "
    "compiled each new sampling shape for ~2 min and was killed (SIGKILL, memory) compiling the train step: "
    "docs/benchmarks/service.md")


def _workload(quick: bool) -> dict[str, int]:
    if quick:
        return {"steps": 2, "groups": 2, "group_size": 4, "max_tokens": 6, "lora_rank": 8}
    return {"steps": 4, "groups": 4, "group_size": 4, "max_tokens": 8, "lora_rank": 8}


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _start_server(root: Path, model: str, keys: list[str]) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    keys_file = root / "keys.txt"
    keys_file.write_text("\n".join(keys) + "\n")
    log = root / f"server-{port}.log"
    with log.open("w+b") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollwise.cli", "serve", "tinker", "--host", "127.0.0.1", "--port", str(port),
             "--api-keys", str(keys_file), "--base-model", model, "--data-dir", str(root / f"data-{port}")],
            stdout=subprocess.DEVNULL, stderr=out)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, out, "rollwise serve tinker", timeout_s=300, path="/api/v1/healthz",
                         headers={"X-API-Key": keys[0]})
        except RuntimeError:
            stop([proc])
            raise
    return proc, url, log


def run_tenants(root: Path, model: str, tenants: int, workload: dict[str, int]) -> dict[str, Any]:
    """`tenants` client processes at once against one fresh server; each its own API key and seed."""
    arm = root / f"tenants-{tenants}"
    arm.mkdir(parents=True, exist_ok=True)
    keys = [f"tml-bench-tenant-{i}" for i in range(tenants)]
    server, url, log = _start_server(arm, model, keys)
    env = {**os.environ, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
    try:
        procs = []
        for i, key in enumerate(keys):
            out = arm / f"tenant-{i}.json"
            cmd = [sys.executable, "-m", "rollwise.bench.service_tenant", "--url", url, "--api-key", key,
                   "--model", model, "--seed", str(i), "--json", str(out)]
            cmd += [f"--{k.replace('_', '-')}={v}" for k, v in workload.items()]
            procs.append((out, subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                                stderr=(arm / f"tenant-{i}.log").open("wb"))))
        start = time.perf_counter()
        for out, proc in procs:
            if proc.wait(timeout=3600) != 0:
                raise RuntimeError(f"tenant client failed: {out.with_suffix('.log').read_text()[-2000:]}")
        wall = time.perf_counter() - start
    finally:
        stop([server])
    results = [json.loads(out.read_text()) for out, _ in procs]
    return summarize(tenants, wall, results)


def summarize(tenants: int, wall_s: float, results: list[dict[str, Any]]) -> dict[str, Any]:
    samples = sum(r["samples"] for r in results)
    tokens = sum(r["train_tokens"] for r in results)
    steady = [s for r in results for s in r["step_s"][1:]] or [s for r in results for s in r["step_s"]]
    sample_lat = [x for r in results for x in r["sample_latency_s"]]
    fb_lat = [x for r in results for x in r["forward_backward_latency_s"]]
    return {
        "tenants": tenants, "wall_s": wall_s,
        "aggregate_samples_per_s": samples / wall_s, "aggregate_train_tokens_per_s": tokens / wall_s,
        "per_tenant_samples_per_s": [r["samples"] / r["wall_s"] for r in results],
        "per_tenant_train_tokens_per_s": [r["train_tokens"] / r["wall_s"] for r in results],
        "mean_step_s": statistics.fmean(steady),
        "asample_p50_s": _percentile(sample_lat, 0.5), "asample_p99_s": _percentile(sample_lat, 0.99),
        "forward_backward_p50_s": _percentile(fb_lat, 0.5), "forward_backward_p99_s": _percentile(fb_lat, 0.99),
        "reward_mean_by_step": [statistics.fmean(step) for step in zip(*(r["reward_mean"] for r in results))],
    }


def run_train_arm(root: Path, model: str, workload: dict[str, int]) -> dict[str, Any]:
    """The same work through `rollwise train`: the tenants' arithmetic problems as a JSONL task (no system prompt,
the chat template around them), a LoRA of the same rank on the same projections, one engine."""
    arm = root / "rollwise-train"
    arm.mkdir(parents=True, exist_ok=True)
    task = arm / "task.jsonl"
    rng = random.Random(0)
    rows = [problem(rng) for _ in range(64)]  # the tenants' prompts (few-shot prefix included) and answers
    task.write_text("".join(json.dumps({"prompt": text, "answer": answer}) + "\n" for text, answer in rows))
    cfg = {
        "model": model, "seed": 0, "output_dir": str(arm / "run"),
        "task": {"kind": "jsonl", "path": str(task)},
        "prompt": {"system": None, "few_shot": []},
        "rollout": {"mode": "sync", "prompts_per_step": workload["groups"], "group_size": workload["group_size"],
                    "max_tokens": workload["max_tokens"], "temperature": 1.0},
        "engine": {"kind": "reference"},
        "train": {"steps": workload["steps"], "lr": 1e-4, "lora": {"rank": workload["lora_rank"], "alpha": 32}},
        "eval": {"size": 0},
        "tensorboard": False,
    }
    config = arm / "config.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log = arm / "train.log"
    subprocess.run([sys.executable, "-m", "rollwise.cli", "train", "--config", str(config)], check=True,
                   stdout=log.open("wb"), stderr=subprocess.STDOUT, timeout=3600)
    metrics = [json.loads(line) for run in (arm / "run").iterdir() if (run / "metrics.jsonl").exists()
               for line in (run / "metrics.jsonl").read_text().splitlines()] if (arm / "run").is_dir() else []
    if not metrics:  # output_dir is the run directory itself when it has no {placeholders}
        metrics = [json.loads(line) for line in (arm / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m["time_step_s"] for m in metrics]
    return {"mean_step_s": statistics.fmean(steps[1:] or steps), "steps": len(steps)}


def run_service_bench(quick: bool, model: str, root: Path | None = None) -> dict[str, Any]:
    workload = _workload(quick)
    tenant_counts = [1, 2] if quick else [1, 2, 4, 8]
    with tempfile.TemporaryDirectory(prefix="rollwise-bench-service-") as tmp:
        base = root or Path(tmp)
        arms = [run_tenants(base, model, n, workload) for n in tenant_counts]
        train = run_train_arm(base, model, workload)
    one, most = arms[0], arms[-1]
    goals = {"service_overhead_1_tenant": one["mean_step_s"] / train["mean_step_s"] - 1.0,
             f"aggregate_throughput_{most['tenants']}_vs_1": most["aggregate_samples_per_s"]
             / one["aggregate_samples_per_s"]}
    return {"benchmark": "service", "quick": quick, "model": model, "workload": workload, "arms": arms,
            "rollwise_train": train, "goals": goals, "goal_targets": GOALS,
            "skyrl_tx": SKYRL_TX}


def format_service_bench(result: dict[str, Any]) -> Table:
    table = Table(title=f"rollwise bench service ({result['model']}, workload {result['workload']})")
    for col in ("tenants", "agg samples/s", "agg train tok/s", "per-tenant samples/s", "step s",
                "asample p50/p99 s", "fwd_bwd p50/p99 s"):
        table.add_column(col)
    for arm in result["arms"]:
        table.add_row(str(arm["tenants"]), f"{arm['aggregate_samples_per_s']:.2f}",
                      f"{arm['aggregate_train_tokens_per_s']:.0f}",
                      f"{statistics.fmean(arm['per_tenant_samples_per_s']):.2f}", f"{arm['mean_step_s']:.2f}",
                      f"{arm['asample_p50_s']:.2f}/{arm['asample_p99_s']:.2f}",
                      f"{arm['forward_backward_p50_s']:.2f}/{arm['forward_backward_p99_s']:.2f}")
    table.add_row("rollwise train", "", "", "", f"{result['rollwise_train']['mean_step_s']:.2f}", "", "")
    goals = ", ".join(f"{k} {v:.2f}" for k, v in result["goals"].items())
    table.caption = f"goals: {goals} (targets {result['goal_targets']})"
    return table

"""Training as a service at cluster scale (issue 39): `rollwise sim service` projects N LoRA tenants of one base
sharing G GPUs, as `rollwise serve tinker` runs them (sampling in one engine batch across tenants, train steps
batched on shared trainer GPUs), against each tenant alone on a dedicated engine GPU and trainer GPU.

The tenants are rollwise.sim.lora's projection jobs (GRPO LoRA loops on a 7B base: 8 prompts x 8 samples a step);
the GPUs split between engines and trainers, every split tried, the fastest kept. What is modelled and what is
not is rollwise.sim.lora's (`simulate_lora` with `SharedTrainers`): the API hops and the request store are not
(bench service measures them on this machine).

`--tenants-sweep` instead runs `rollwise bench service`'s own workload at 1-8 tenants on one worker, validated
against the benchmark's CPU arms and projected onto one H100 engine + one H100 trainer (rollwise.sim.service_sweep).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rollwise.sim.commands import SimCommand, write_json
from rollwise.sim.cost import CONFIG_DIR, load_cost_file
from rollwise.sim.lora import AdapterCost, SharedTrainers, add_projection_arguments, projection_jobs, simulate_lora


def project_service(cost_name: str = "h100-7b", tenants: int = 64, gpu_counts: tuple[int, ...] = (8, 16, 32, 64),
                    steps: int = 10, serving: AdapterCost = AdapterCost()) -> list[dict[str, Any]]:
    cost, trainer = load_cost_file(CONFIG_DIR / f"{cost_name}.yaml")
    if trainer is None:
        raise ValueError(f"cost model {cost_name!r} has no trainer section")
    specs = projection_jobs(tenants, trainer, steps)
    alone = {j.name: simulate_lora([replace(j, start_s=0.0)], 1, cost, serving, merged=True)["makespan_s"]
             for j in specs}
    dedicated_gpu_hours = sum(2 * s for s in alone.values()) / 3600  # one engine GPU + one trainer GPU each
    rows = []
    for gpus in gpu_counts:
        best: dict[str, Any] | None = None
        for engines in sorted({max(1, round(gpus * f)) for f in (0.25, 0.5, 0.625, 0.75, 0.875)}):
            if engines >= gpus:
                continue
            shared = SharedTrainers(gpus=gpus - engines, step_s=lambda tokens: trainer.step_s(tokens, gpus=1))
            run = simulate_lora(specs, engines, cost, serving, trainers=shared)
            start = min(j.start_s for j in specs)
            span = max(j.start_s + run["jobs"][j.name]["wall_s"] for j in specs) - start
            if best is None or span < best["makespan_s"]:
                slowdowns = sorted(run["jobs"][n]["wall_s"] / alone[n] - 1 for n in alone)
                samples = sum(j.steps * j.prompts_per_step * j.group_size for j in specs)
                best = {"gpus": gpus, "engine_gpus": engines, "trainer_gpus": gpus - engines, "makespan_s": span,
                        "gpu_hours": gpus * span / 3600, "dedicated_gpu_hours": dedicated_gpu_hours,
                        "gpu_hours_saved": 1 - gpus * span / 3600 / dedicated_gpu_hours,
                        "samples_per_s": samples / span, "trainer_utilisation": run["trainer_utilisation"],
                        "median_slowdown": slowdowns[len(slowdowns) // 2], "max_slowdown": slowdowns[-1]}
        assert best is not None
        rows.append(best)
    return rows


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_projection_arguments(p)
    p.add_argument("--tenants", type=int, default=64)
    p.add_argument("--gpus", default="8,16,32,64", help="GPU counts shared by all tenants (default: %(default)s)")
    p.add_argument("--tenants-sweep", action="store_true",
                   help="instead: `rollwise bench service`'s own workload at --tenant-counts tenants on one worker, "
                   "validated against --measured on this CPU, projected onto 1 H100 engine + 1 H100 trainer "
                   "(rollwise.sim.service_sweep)")
    p.add_argument("--tenant-counts", default="1,2,4,8", help="with --tenants-sweep (default: %(default)s)")
    p.add_argument("--measured", type=Path, default=Path("docs/bench/service.json"), metavar="JSON",
                   help="with --tenants-sweep: `rollwise bench service --json` output (default: %(default)s)")
    p.add_argument("--host", type=Path, default=Path("docs/bench/mux_lora.json"), metavar="JSON",
                   help="with --tenants-sweep: this CPU's measured core sharing (rollwise.sim.host.measure_cpu_host, "
                   "as `rollwise bench mux --json` records it), which the worker's two lanes share in the "
                   "validation (default: %(default)s)")


def _run(args: argparse.Namespace, console: Console) -> int:
    if args.tenants_sweep:
        return _run_tenants_sweep(args, console)
    rows = project_service(args.cost, args.tenants, tuple(int(x) for x in args.gpus.split(",")), args.steps)
    table = Table(title=f"{args.tenants} LoRA tenants on one service ({args.cost}) vs each alone on 1 engine + "
                        "1 trainer GPU")
    for col in ("GPUs", "engines/trainers", "GPU-h shared", "GPU-h alone", "saved", "samples/s",
                "trainer busy", "median / max slowdown"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["gpus"]), f"{r['engine_gpus']}/{r['trainer_gpus']}", f"{r['gpu_hours']:.2f}",
                      f"{r['dedicated_gpu_hours']:.2f}", f"{r['gpu_hours_saved']:.0%}", f"{r['samples_per_s']:.0f}",
                      f"{r['trainer_utilisation']:.0%}",
                      f"{r['median_slowdown']:+.0%} / {r['max_slowdown']:+.0%}")
    console.print(table)
    write_json(args.json, rows, console)
    return 0


def _run_tenants_sweep(args: argparse.Namespace, console: Console) -> int:
    from rollwise.sim.service_sweep import run_sweep, sweep_tables

    try:
        counts = tuple(int(x) for x in args.tenant_counts.split(","))
    except ValueError:
        raise ValueError(f"--tenant-counts: give tenant counts like 1,2,4,8, got {args.tenant_counts!r}") from None
    result = run_sweep(args.measured, counts, args.steps, args.host)
    for table in sweep_tables(result):
        console.print(table)
    for key, value in result["goals"].items():
        console.print(f"{key}: {value:+.3f}" if "error" in key else f"{key}: {value:.2f}x")
    write_json(args.json, {"command": " ".join(["rollwise", *sys.argv[1:]]), **result}, console)
    return 0


def command() -> SimCommand:
    return SimCommand("service", "project N LoRA tenants of a training service sharing G GPUs vs each alone "
                      "(issue 39)", _add_arguments, _run)

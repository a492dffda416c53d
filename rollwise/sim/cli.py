"""`rollwise sim ...`: the cluster simulator's command line (rollwise/cli.py hands `sim` over here)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from rollwise.sim.commands import SimCommand, write_json

DESCRIPTION = """\
The cluster simulator: the production rollout controller and routing policies (unchanged code) drive
simulated engines on a virtual clock, so scheduling and routing can be evaluated at 8 to 4096 GPUs on
one CPU. Engines follow a cost model (prefill time per token; decode step time from batch size and
context length; KV capacity; prefix cache; weight-update time): calibrated from real runs on this
machine (`rollwise sim calibrate`) or derived from published GPU figures (rollwise/sim/configs/*.yaml,
sources cited inside).

  rollwise sim CONFIG [--json PATH] [--plot PNG] [--set key=value ...]
      run a scenario (YAML: cluster, cost model, workload, rollout mode, routing policy) and report
      bubble ratio, samples/s, staleness, prefix hit rate and engine-hours (DESIGN.md definitions)
  rollwise sim sweep CONFIG --sizes 8,64,512,4096 --modes sync,sorted,async [--routing a,b]
      the scenario at several cluster sizes (batch per GPU held constant) and policies: table + chart
  rollwise sim plan CONFIG [--gpus N] [--etas 1,2] [--out PLAN.yaml] [--json PATH]
      split N GPUs between trainer ranks and engine replicas (and choose eta) for the most trained
      samples/s, with the flexible update batch; prints the choice and the runner-ups. `placement: ray`
      takes the split from the written file (ray.plan: PLAN.yaml)
  rollwise sim calibrate [--engine reference|vllm] [--json PATH] [--out YAML]
      time a real engine and trainer here (~1-2 min) and fit the cost model
  rollwise sim validate [--cost YAML] [--rollout-only] [--json PATH] [--from-json PATH]
      run `rollwise bench rollout --quick` for real and in simulation, side by side (--rollout-only:
      the trainer taken out on both sides, to check the engine cost model and the scheduling alone;
      --from-json: measure nothing, simulate again against an earlier --json's measured side)
  rollwise sim validate-router [--full] [--rounds 3] [--json PATH]
      run `rollwise bench router --quick` on real replicas and in simulation (rollwise/sim/routing.py with the
      replica engine calibrated here and the replicas sharing this machine's cores), side by side
  rollwise sim validate-mux [--full] [--rounds 3] [--json PATH]
      run `rollwise bench mux --quick` (jobs sharing one engine pool) for real and in simulation
      (rollwise.sim.mux on this machine's measured effective cores), shared wall times side by side;
      each shared arm between two dedicated arms, so that this machine's drift cancels

Bundled scenarios: rollwise/sim/configs/scenarios/ (grpo-7b.yaml, agent-sessions.yaml); bundled cost
models: h100-7b, h100-32b (roofline estimates), cpu-reference-full (engine + trainer) and cpu-reference-calibrated (engine only), measured here.
"""


def _scenario_path(name: str) -> Path:
    from rollwise.sim.cost import CONFIG_DIR

    p = Path(name)
    for c in (p, CONFIG_DIR / "scenarios" / p, CONFIG_DIR / "scenarios" / f"{name}.yaml"):
        if c.is_file():
            return c
    raise FileNotFoundError(f"no scenario file {name!r} (a path, or a name under {CONFIG_DIR / 'scenarios'})")


def _overrides(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set wants key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key] = yaml.safe_load(value)
    return out


def _public(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if not k.startswith("_")}


def run_one(path: Path, overrides: dict[str, Any], progress: Any = None) -> tuple[dict[str, Any], Any]:
    from rollwise.sim.run import build, simulate
    from rollwise.sim.scenario import load_scenario
    from rollwise.sim.sessions import simulate_sessions

    s = load_scenario(path, overrides)
    if s.sessions.count > 0:
        return simulate_sessions(s), None
    run = build(s)
    return simulate(run, progress), run


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from rollwise.sim.report import plot_run, results_table
    from rollwise.sim.run import cluster_timeline

    result, run = run_one(_scenario_path(args.config), _overrides(args.set),
                          progress=lambda m: console.log(m) if args.verbose else None)
    result["command"] = " ".join(["rollwise"] + sys.argv[1:])
    console.print(results_table([result], f"{result['scenario']} ({result.get('cost_model', '')})"))
    if result["mode"] == "sessions":
        console.print(f"turns {result['turns']}, turn latency p50 {result['turn_latency_p50_s']:.2f}s "
                      f"p99 {result['turn_latency_p99_s']:.2f}s, prefill tokens {result['prefill_tokens']}")
    if args.plot and run is not None:
        plot_run(result, cluster_timeline(run.cluster.engines, result["_t0"], result["_t1"]), args.plot)
        console.print(f"wrote {args.plot}")
    write_json(args.json, _public(result), console)
    return 0


def cmd_sweep(args: argparse.Namespace, console: Console) -> int:
    from rollwise.sim.report import plot_sweep, results_table
    from rollwise.sim.scenario import load_scenario

    path = _scenario_path(args.config)
    base = load_scenario(path, _overrides(args.set))
    sizes = [int(x) for x in args.sizes.split(",")]
    modes = args.modes.split(",") if args.modes else [base.rollout.mode]
    routings = args.routing.split(",") if args.routing else [base.cluster.routing]
    rows = []
    for gpus in sizes:
        for routing in routings:
            for mode in modes:
                over = {**_overrides(args.set), "cluster.gpus": gpus, "cluster.routing": routing, "rollout.mode": mode}
                if base.sessions.count == 0:  # weak scaling: the same batch per GPU as the scenario's
                    over["workload.prompts_per_step"] = max(1, round(base.workload.prompts_per_step * gpus / base.cluster.gpus))
                else:
                    over["sessions.count"] = max(1, round(base.sessions.count * gpus / base.cluster.gpus))
                t = time.perf_counter()
                result, _ = run_one(path, over)
                rows.append(_public(result))
                console.log(f"{gpus} GPUs, {mode}, {routing}: bubble {result['bubble_ratio']:.2f}, "
                            f"{result['samples_per_s']:.1f} samples/s ({time.perf_counter() - t:.1f}s)")
    console.print(results_table(rows, f"sweep: {base.name}"))
    if args.plot:
        plot_sweep(rows, args.plot)
        console.print(f"wrote {args.plot}")
    write_json(args.json, {"command": " ".join(["rollwise"] + sys.argv[1:]), "rows": rows}, console)
    return 0


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    from rollwise.sim.plan import plan
    from rollwise.sim.report import plan_table
    from rollwise.sim.scenario import load_scenario

    over = _overrides(args.set)
    if args.updates is not None:
        over["workload.updates"] = args.updates
    base = load_scenario(_scenario_path(args.config), over)
    total = args.gpus or base.cluster.gpus + base.trainer_gpus()
    etas = [int(x) for x in args.etas.split(",")]
    if any(e < 1 for e in etas):
        raise ValueError(f"--etas {args.etas}: the planner overlaps training and generation, so eta >= 1")
    result = plan(base, total, etas, args.bubble_target, progress=console.log)
    console.print(plan_table(result, f"plan: {base.name}, {total} GPUs ({base.cluster.cost})"))
    b = result.best
    console.print(f"choice: {b.split.trainer_gpus} trainer GPUs, {b.split.engine_gpus} engine GPUs, "
                  f"eta={b.split.eta}, update_batch=flexible: {b.samples_per_s_per_gpu:.3f} samples/s per GPU, "
                  f"{result.as_dict()['speedup_per_gpu_vs_sync'] or 0:.2f}x sync on the same split")
    doc = {"command": " ".join(["rollwise"] + sys.argv[1:]), **result.as_dict()}
    if args.out is not None:
        args.out.write_text(yaml.safe_dump(doc, sort_keys=False))
        console.print(f"wrote {args.out} (placement: ray takes it as ray.plan={args.out})")
    write_json(args.json, doc, console)
    return 0


def build_parser(extra: Sequence[SimCommand] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollwise sim", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    names = ",".join(["CONFIG", "sweep", "plan", *(c.name for c in extra)])
    sub = parser.add_subparsers(dest="sim_command", metavar=f"{{{names}}}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", type=Path, metavar="PATH", help="also write results as JSON")
    run = sub.add_parser("run", parents=[common], help="run a scenario (also: rollwise sim CONFIG)")
    run.add_argument("config", help="scenario YAML (a path or a bundled name, e.g. grpo-7b)")
    run.add_argument("--plot", type=Path, metavar="PNG", help="timeline of running sequences vs capacity")
    run.add_argument("--set", nargs="*", default=[], metavar="key=value",
                     help="override scenario fields, e.g. cluster.gpus=512 rollout.mode=async")
    run.add_argument("-v", "--verbose", action="store_true", help="log every update")
    sweep = sub.add_parser("sweep", parents=[common], help="cluster sizes x rollout modes x routing policies")
    sweep.add_argument("config")
    sweep.add_argument("--sizes", default="8,64,512", help="rollout GPU counts (default: %(default)s)")
    sweep.add_argument("--modes", default="sync,sorted,async", help="rollout modes (default: %(default)s)")
    sweep.add_argument("--routing", default=None, help="routing policies (default: the scenario's)")
    sweep.add_argument("--plot", type=Path, metavar="PNG", default=Path("sim_sweep.png"),
                       help="chart of bubble ratio and samples/s per GPU (default: %(default)s)")
    sweep.add_argument("--set", nargs="*", default=[], metavar="key=value")
    plan = sub.add_parser("plan", parents=[common], help="split GPUs between trainer and engines (and choose eta)")
    plan.add_argument("config", help="scenario YAML (a path or a bundled name)")
    plan.add_argument("--gpus", type=int, default=None,
                      help="GPUs to split (default: the scenario's rollout GPUs + its trainer GPUs)")
    plan.add_argument("--etas", default="1,2", help="staleness bounds to try (default: %(default)s)")
    plan.add_argument("--bubble-target", type=float, default=0.25,
                      help="splits within this whole-run bubble ratio rank first (default: %(default)s)")
    plan.add_argument("--updates", type=int, default=None, help="trainer updates per simulation (default: the scenario's)")
    plan.add_argument("--out", type=Path, metavar="YAML", help="write the plan (placement: ray reads it as ray.plan)")
    plan.add_argument("--set", nargs="*", default=[], metavar="key=value")
    for command in extra:
        command.add_arguments(sub.add_parser(command.name, parents=[common], help=command.help))
    return parser


def main(argv: list[str], extra: Sequence[SimCommand] = ()) -> int:
    """`rollwise sim ARGV`; `extra`: the bench side's subcommands (calibrate, validate*), from rollwise/cli.py."""
    from rollwise.sim.intercept_cli import command as intercept_command  # issue 21
    from rollwise.sim.lora import command as lora_command
    from rollwise.sim.service import command as service_command
    from rollwise.sim.switch_costs import command as switch_costs_command  # issue 42

    # lora: issue 22 (rollwise.sim.lora); service: issue 39 (rollwise.sim.service)
    extra = (*extra, intercept_command(), lora_command(), service_command(), switch_costs_command())
    parser = build_parser(extra)
    handlers = {"run": cmd_run, "sweep": cmd_sweep, "plan": cmd_plan, **{c.name: c.run for c in extra}}
    if argv and argv[0] not in (*handlers, "-h", "--help"):
        argv = ["run", *argv]  # rollwise sim CONFIG ...
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 160))  # the results tables are wide; pipes default to 80
    if args.sim_command is None:
        parser.print_help()
        return 0
    try:
        return handlers[args.sim_command](args, console)
    except (FileNotFoundError, ValueError) as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        return 2

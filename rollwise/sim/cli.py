"""`rollwise sim ...`: the cluster simulator's command line (rollwise/cli.py hands `sim` over here)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

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
  rollwise sim calibrate [--engine reference|vllm] [--json PATH] [--out YAML]
      time a real engine and trainer here (~1-2 min) and fit the cost model
  rollwise sim validate [--cost YAML] [--rollout-only] [--json PATH]
      run `rollwise bench rollout --quick` for real and in simulation, side by side (--rollout-only:
      the trainer taken out on both sides, to check the engine cost model and the scheduling alone)
  rollwise sim validate-router [--full] [--rounds 3] [--json PATH]
      run `rollwise bench router --quick` on real replicas and in simulation (router/sim.py with the
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


def _write_json(path: Path | None, data: Any, console: Console) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str))
        console.print(f"wrote {path}")


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
    _write_json(args.json, _public(result), console)
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
    _write_json(args.json, {"command": " ".join(["rollwise"] + sys.argv[1:]), "rows": rows}, console)
    return 0


def cmd_calibrate(args: argparse.Namespace, console: Console) -> int:
    from rollwise.engine.factory import resolve_engine_kind
    from rollwise.model.loading import load_model
    from rollwise.sim.calibrate import calibrate

    kind = resolve_engine_kind(args.engine, args.model)
    t = time.perf_counter()
    with console.status(f"loading {args.model}"):
        model, tokenizer = load_model(args.model)
    cost, trainer, raw = calibrate(model, tokenizer, kind, seed=args.seed, progress=console.log,
                                   with_trainer=not args.engine_only)
    fit = raw["fit"]
    table = Table(title=f"calibrated cost model: {kind} engine, {args.model} ({time.perf_counter() - t:.0f}s)")
    table.add_column("parameter")
    table.add_column("value", justify="right")
    for key in ("step_overhead_s", "prefill_s_per_token", "decode_s_per_seq", "decode_s_per_ctx_token",
                "weight_update_s", "train_contention"):
        table.add_row(f"engine.{key}", f"{getattr(cost, key):.4g}")
    table.add_row("decode fit R^2 (all steps)", f"{fit['decode_r2_all_steps']:.3f}")
    for key in ("step_overhead_s", "s_per_token_gpu", "contention"):
        table.add_row(f"trainer.{key}", f"{getattr(trainer, key):.4g}")
    console.print(table)
    out = args.out or Path(f"sim-cost-{kind}.yaml")
    doc = {"engine": cost.model_dump(), "trainer": trainer.model_dump()}
    out.write_text(f"# written by: rollwise {' '.join(sys.argv[1:])}\n" + yaml.safe_dump(doc, sort_keys=False))
    console.print(f"wrote {out}")
    _write_json(args.json, {"command": " ".join(["rollwise"] + sys.argv[1:]), **doc, "raw": raw}, console)
    return 0


def cmd_validate(args: argparse.Namespace, console: Console) -> int:
    from rollwise.engine.factory import resolve_engine_kind
    from rollwise.model.loading import load_model
    from rollwise.sim.cost import load_cost_file
    from rollwise.sim.validate import validate

    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    cost, trainer = load_cost_file(args.cost)
    if args.rollout_only:
        from rollwise.sim.validate import validate_rollout_only

        with console.status(f"loading {args.model}"):
            model, tokenizer = load_model(args.model)
        kind = resolve_engine_kind(args.engine, args.model)
        with console.status("measured generation (trainer taken out), then the simulation"):
            result = validate_rollout_only(model, tokenizer, cost, engine_kind=kind, quick=not args.full, seed=args.seed)
        return _print_validation(result, kind, cost.name, args, console)
    if trainer is None or trainer.s_per_token_gpu == 0:
        console.print("[red]error:[/] the cost file has no calibrated trainer (run rollwise sim calibrate without "
                      "--engine-only), or use --rollout-only")
        return 2
    with console.status(f"loading {args.model}"):
        model, tokenizer = load_model(args.model)
    kind = resolve_engine_kind(args.engine, args.model)
    with console.status(f"measured runs (rollwise bench rollout, {args.rounds} round(s)), then the simulation"):
        result = validate(model, tokenizer, cost, trainer, engine_kind=kind, quick=not args.full, seed=args.seed,
                          rounds=args.rounds)
    return _print_validation(result, kind, cost.name, args, console)


def _print_validation(result: dict[str, Any], kind: str, cost_name: str, args: argparse.Namespace,
                      console: Console) -> int:
    what = "generation only (no trainer)" if result.get("rollout_only") else "bench rollout"
    table = Table(title=f"{what} {'full' if args.full else '--quick'}: measured ({kind}) vs simulated ({cost_name})")
    for col in ("mode", "bubble meas.", "bubble sim", "error", "samples/s meas.", "samples/s sim", "error",
                "meas. runs", "wall meas.", "wall sim"):
        table.add_column(col, justify="right")
    for r in result["comparison"]:
        runs = r.get("samples_per_s_measured_runs", [])
        table.add_row(r["mode"], f"{r['bubble_ratio_measured']:.3f}", f"{r['bubble_ratio_simulated']:.3f}",
                      f"{r.get('bubble_ratio_error', 0):+.0%}", f"{r['samples_per_s_measured']:.2f}",
                      f"{r['samples_per_s_simulated']:.2f}", f"{r.get('samples_per_s_error', 0):+.0%}",
                      " ".join(f"{x:.2f}" for x in runs) if len(runs) > 1 else "-",
                      f"{r['wall_s_measured']:.1f}", f"{r['wall_s_simulated']:.1f}")
    console.print(table)
    result["command"] = " ".join(["rollwise"] + sys.argv[1:])
    _write_json(args.json, result, console)
    return 0


def cmd_validate_router(args: argparse.Namespace, console: Console) -> int:
    from rollwise.sim.router_validate import validate_router

    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")

    with console.status("calibrating the replica engine") as status:
        result = validate_router(quick=not args.full, seed=args.seed, cores=args.cores, rounds=args.rounds,
                                 progress=status.update)
    table = Table(title=f"bench router {'full' if args.full else '--quick'}: {result['replicas']} real replicas "
                        f"vs simulated (calibrated here, sharing {result['cores']:g} cores)")
    for col in ("policy", "req/s meas.", "runs", "req/s sim", "error", "hit meas.", "hit sim", "prefill meas.",
                "prefill sim", "busy meas.", "busy sim", "p50 meas.", "p50 sim", "p99 meas.", "p99 sim"):
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    for r in result["comparison"]:
        runs = r.get("requests_per_s_measured_runs", [])
        table.add_row(r["policy"], f"{r['requests_per_s_measured']:.1f}",
                      " ".join(f"{x:.1f}" for x in runs) if len(runs) > 1 else "-", f"{r['requests_per_s_simulated']:.1f}",
                      f"{r['requests_per_s_error']:+.0%}", f"{r['prefix_hit_rate_measured']:.0%}",
                      f"{r['prefix_hit_rate_simulated']:.0%}", f"{r['prefill_tokens_measured']:,}",
                      f"{r['prefill_tokens_simulated']:,}", f"{r['engine_busy_s_measured']:.1f}",
                      f"{r['engine_busy_s_simulated']:.1f}", f"{r['p50_latency_s_measured']:.2f}",
                      f"{r['p50_latency_s_simulated']:.2f}", f"{r['p99_latency_s_measured']:.2f}",
                      f"{r['p99_latency_s_simulated']:.2f}")
    console.print(table)
    result["command"] = " ".join(["rollwise"] + sys.argv[1:])
    _write_json(args.json, result, console)
    return 0


def cmd_validate_mux(args: argparse.Namespace, console: Console) -> int:
    from rollwise.bench.mux import describe_cores
    from rollwise.sim.mux_validate import validate_mux

    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    with console.status("measuring this machine") as status:
        result = validate_mux(full=args.full, rounds=args.rounds, progress=status.update)
    host = result["host"]
    table = Table(title=f"bench mux {'full' if args.full else '--quick'}: shared arm measured vs simulated "
                        f"({describe_cores(host)}, measured; medians of {args.rounds} round(s), "
                        "each a shared arm between two dedicated arms)")
    for col in ("scenario", "job", "shared wall meas.", "runs", "shared wall sim", "error", "dedicated drift",
                "saving meas.", "saving sim", "saving, separate devices"):
        table.add_column(col, justify="left" if col in ("scenario", "job") else "right", no_wrap=True)
    for c in result["comparison"]:
        first = True
        for name, j in c["per_job"].items():
            table.add_row(f"{c['jobs']} jobs / {c['engines']} engine(s)" if first else "", name,
                          f"{j['wall_shared_s_measured']:.1f}s",
                          " ".join(f"{x:.1f}" for x in j["measured_runs"]) if len(j["measured_runs"]) > 1 else "-",
                          f"{j['wall_shared_s_simulated']:.1f}s", f"{j['error']:+.0%}",
                          " ".join(f"{x:+.0%}" for x in j["dedicated_drift_runs"]),
                          f"{c['engine_hours_saving_measured']:.0%}" if first else "",
                          f"{c['engine_hours_saving_simulated']:.0%}" if first else "",
                          f"{c['engine_hours_saving_separate_devices']:.0%}" if first else "",
                          end_section=name == list(c["per_job"])[-1])
            first = False
    console.print(table)
    result["command"] = " ".join(["rollwise"] + sys.argv[1:])
    _write_json(args.json, result, console)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollwise sim", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="sim_command", metavar="{CONFIG,sweep,calibrate,validate,validate-router,validate-mux}")
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
    cal = sub.add_parser("calibrate", parents=[common], help="fit the cost model from a real engine here")
    cal.add_argument("--engine", default="auto", choices=["auto", "reference", "vllm"],
                     help="auto: vLLM when installed, as `rollwise bench rollout` (default: %(default)s)")
    cal.add_argument("--model", default="bundled:smollm2-135m-instruct")
    cal.add_argument("--out", type=Path, metavar="YAML", help="cost file to write (default: sim-cost-ENGINE.yaml)")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--engine-only", action="store_true",
                     help="skip the trainer timings (the slow part on a busy CPU); the trainer section is zero")
    val = sub.add_parser("validate", parents=[common], help="bench rollout measured vs simulated")
    val.add_argument("--cost", default="cpu-reference-full", help="calibrated cost file (default: %(default)s)")
    val.add_argument("--engine", default="auto", choices=["auto", "reference", "vllm"])
    val.add_argument("--model", default="bundled:smollm2-135m-instruct")
    val.add_argument("--full", action="store_true", help="the full benchmark workload instead of --quick")
    val.add_argument("--seed", type=int, default=0)
    val.add_argument("--rounds", type=int, default=1,
                     help="measure every mode this many times (rotated order) and compare medians (default: 1)")
    val.add_argument("--rollout-only", action="store_true",
                     help="take the trainer out on both sides: validates the engine cost model and the scheduling")
    vr = sub.add_parser("validate-router", parents=[common], help="bench router measured vs simulated")
    vr.add_argument("--full", action="store_true", help="the full benchmark workload instead of --quick")
    vr.add_argument("--seed", type=int, default=0)
    vr.add_argument("--rounds", type=int, default=1,
                    help="measure the benchmark this many times and compare each policy's median (default: 1)")
    vr.add_argument("--cores", type=float, default=None,
                    help="cores the simulated replicas share (default: the cores this process may use)")
    vm = sub.add_parser("validate-mux", parents=[common], help="bench mux measured vs simulated")
    vm.add_argument("--full", action="store_true",
                    help="2 jobs / 1 engine and 4 jobs / 2 engines, 24 steps (3 rounds ~13 min, 5 ~19 min)")
    vm.add_argument("--rounds", type=int, default=1,
                    help="shared arms per scenario, each between two dedicated arms; each job's median over "
                         "them is compared (default: 1)")
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    if argv and argv[0] not in ("run", "sweep", "calibrate", "validate", "validate-router", "validate-mux", "-h",
                                "--help"):
        argv = ["run", *argv]  # rollwise sim CONFIG ...
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 160))  # the results tables are wide; pipes default to 80
    if args.sim_command is None:
        parser.print_help()
        return 0
    handlers = {"run": cmd_run, "sweep": cmd_sweep, "calibrate": cmd_calibrate, "validate": cmd_validate,
                "validate-router": cmd_validate_router, "validate-mux": cmd_validate_mux}
    try:
        return handlers[args.sim_command](args, console)
    except (FileNotFoundError, ValueError) as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        return 2

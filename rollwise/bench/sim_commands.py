"""`rollwise sim calibrate | validate | validate-router | validate-mux`: the simulator's subcommands that run
real engines and benchmarks. They live on the bench side, so that bench imports the simulator and never
the reverse (.importlinter); rollwise/cli.py hands SIM_COMMANDS to rollwise.sim.cli.main.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from rollwise.sim.commands import SimCommand, write_json


def cmd_calibrate(args: argparse.Namespace, console: Console) -> int:
    from rollwise.bench.calibrate import calibrate
    from rollwise.engine.factory import resolve_engine_kind
    from rollwise.model.loading import load_model

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
    write_json(args.json, {"command": " ".join(["rollwise"] + sys.argv[1:]), **doc, "raw": raw}, console)
    return 0


def cmd_validate(args: argparse.Namespace, console: Console) -> int:
    from rollwise.bench.validate_rollout import validate
    from rollwise.engine.factory import resolve_engine_kind
    from rollwise.model.loading import load_model
    from rollwise.sim.cost import load_cost_file

    _check_rounds(args)
    cost, trainer = load_cost_file(args.cost)
    if args.from_json is not None:  # the simulated side again against a stored measurement: nothing is timed
        from rollwise.bench.validate_rollout import load_tokenizer, replay

        if trainer is None or trainer.s_per_token_gpu == 0 or args.rollout_only:
            console.print("[red]error:[/] --from-json replays a full validation: it needs a cost file with a "
                          "calibrated trainer, and no --rollout-only")
            return 2
        try:
            result = replay(args.from_json, load_tokenizer(args.model), cost, trainer, shared_cores=args.shared_cores)
        except (OSError, ValueError) as exc:
            console.print(f"[red]error:[/] --from-json: {exc}")
            return 2
        return _print_validation(result, result["engine"], cost.name, args, console)
    if args.rollout_only:
        from rollwise.bench.validate_rollout import validate_rollout_only

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
                          rounds=args.rounds, update_batch=args.update_batch, shared_cores=args.shared_cores)
    return _print_validation(result, kind, cost.name, args, console)


def _print_validation(result: dict[str, Any], kind: str, cost_name: str, args: argparse.Namespace,
                      console: Console) -> int:
    what = "generation only (no trainer)" if result.get("rollout_only") else "bench rollout"
    if result.get("update_batch", "fixed") != "fixed":
        what += f" (update_batch={result['update_batch']})"
    table = Table(title=f"{what} {'full' if args.full else '--quick'}: measured ({kind}) vs simulated ({cost_name})")
    for col in ("mode", "bubble meas.", "bubble sim", "error", "samples/s meas.", "samples/s sim", "error",
                "meas. runs", "wall meas.", "wall sim"):
        table.add_column(col, justify="right")
    for r in result["comparison"]:
        runs = r.get("samples_per_s_measured_runs", [])
        table.add_row(r["mode"], f"{r['bubble_ratio_measured']:.3f}", f"{r['bubble_ratio_simulated']:.3f}",
                      f"{r.get('bubble_ratio_error', 0):+.0%}", f"{r['samples_per_s_measured']:.2f}",
                      f"{r['samples_per_s_simulated']:.2f}", f"{r.get('samples_per_s_error', 0):+.0%}",
                      _runs(runs, "{:.2f}"),
                      f"{r['wall_s_measured']:.1f}", f"{r['wall_s_simulated']:.1f}")
    return _show_and_write(table, result, args, console)


def cmd_validate_router(args: argparse.Namespace, console: Console) -> int:
    from rollwise.bench.validate_router import validate_router

    _check_rounds(args)

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
                      _runs(runs, "{:.1f}"), f"{r['requests_per_s_simulated']:.1f}",
                      f"{r['requests_per_s_error']:+.0%}", f"{r['prefix_hit_rate_measured']:.0%}",
                      f"{r['prefix_hit_rate_simulated']:.0%}", f"{r['prefill_tokens_measured']:,}",
                      f"{r['prefill_tokens_simulated']:,}", f"{r['engine_busy_s_measured']:.1f}",
                      f"{r['engine_busy_s_simulated']:.1f}", f"{r['p50_latency_s_measured']:.2f}",
                      f"{r['p50_latency_s_simulated']:.2f}", f"{r['p99_latency_s_measured']:.2f}",
                      f"{r['p99_latency_s_simulated']:.2f}")
    return _show_and_write(table, result, args, console)


def cmd_validate_mux(args: argparse.Namespace, console: Console) -> int:
    from rollwise.bench.mux import describe_cores
    from rollwise.bench.validate_mux import validate_mux

    _check_rounds(args)
    with console.status("measuring this machine") as status:
        result = validate_mux(full=args.full, rounds=args.rounds, progress=status.update, lora=args.lora)
    host = result["host"]
    table = Table(title=f"bench mux {'full' if args.full else '--quick'}{' --lora' if args.lora else ''}: "
                        "shared arm measured vs simulated "
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
                          _runs(j["measured_runs"], "{:.1f}"),
                          f"{j['wall_shared_s_simulated']:.1f}s", f"{j['error']:+.0%}",
                          " ".join(f"{x:+.0%}" for x in j["dedicated_drift_runs"]),
                          f"{c['engine_hours_saving_measured']:.0%}" if first else "",
                          f"{c['engine_hours_saving_simulated']:.0%}" if first else "",
                          f"{c['engine_hours_saving_separate_devices']:.0%}" if first else "",
                          end_section=name == list(c["per_job"])[-1])
            first = False
    return _show_and_write(table, result, args, console)


def _check_rounds(args: argparse.Namespace) -> None:
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")


def _runs(values: list[float], fmt: str) -> str:
    """Each measured round, when there was more than one (the table shows their median)."""
    return " ".join(fmt.format(x) for x in values) if len(values) > 1 else "-"


def _show_and_write(table: Table, result: dict[str, Any], args: argparse.Namespace, console: Console) -> int:
    """Print a validation's table, and write its result (with the command that made it) to --json."""
    console.print(table)
    result["command"] = " ".join(["rollwise"] + sys.argv[1:])
    write_json(args.json, result, console)
    return 0


def _calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", default="auto", choices=["auto", "reference", "vllm"],
                        help="auto: vLLM when installed, as `rollwise bench rollout` (default: %(default)s)")
    parser.add_argument("--model", default="bundled:smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, metavar="YAML", help="cost file to write (default: sim-cost-ENGINE.yaml)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-only", action="store_true",
                        help="skip the trainer timings (the slow part on a busy CPU); the trainer section is zero")


def _validate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cost", default="cpu-reference-full", help="calibrated cost file (default: %(default)s)")
    parser.add_argument("--engine", default="auto", choices=["auto", "reference", "vllm"])
    parser.add_argument("--model", default="bundled:smollm2-135m-instruct")
    parser.add_argument("--full", action="store_true", help="the full benchmark workload instead of --quick")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every mode this many times (rotated order) and compare medians (default: 1)")
    parser.add_argument("--rollout-only", action="store_true",
                        help="take the trainer out on both sides: validates the engine cost model and the scheduling")
    parser.add_argument("--update-batch", default="fixed", choices=["fixed", "flexible"],
                        help="rollout.update_batch on both sides (flexible: issue 26's policy; default: %(default)s)")
    parser.add_argument("--shared-cores", type=float, default=None,
                        help="cores the engine and trainer share: their contention is derived from these and the "
                             "cost model's step times (default: this machine's; 0: the cost file's calibrated tables)")
    parser.add_argument("--from-json", type=Path, metavar="JSON", default=None,
                        help="measure nothing: simulate again against the measured side of an earlier --json "
                             "(its workload, seed and update batch)")


def _validate_router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--full", action="store_true", help="the full benchmark workload instead of --quick")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure the benchmark this many times and compare each policy's median (default: 1)")
    parser.add_argument("--cores", type=float, default=None,
                        help="cores the simulated replicas share (default: the cores this process may use)")


def _validate_mux_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--full", action="store_true",
                        help="2 jobs / 1 engine and 4 jobs / 2 engines, 24 steps (3 rounds ~13 min, 5 ~19 min)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="shared arms per scenario, each between two dedicated arms; each job's median over "
                             "them is compared (default: 1)")
    parser.add_argument("--lora", action="store_true",
                        help="bench mux --lora's scenarios: train.lora jobs on one base in one engine batch (issue 22)")


SIM_COMMANDS = (
    SimCommand("calibrate", "fit the cost model from a real engine here", _calibrate_arguments, cmd_calibrate),
    SimCommand("validate", "bench rollout measured vs simulated", _validate_arguments, cmd_validate),
    SimCommand("validate-router", "bench router measured vs simulated", _validate_router_arguments, cmd_validate_router),
    SimCommand("validate-mux", "bench mux measured vs simulated", _validate_mux_arguments, cmd_validate_mux),
)

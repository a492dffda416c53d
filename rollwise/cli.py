"""The `rollwise` command line.

    rollwise train [--config FILE] [key=value ...]   GRPO end to end (default: the embedded config)
    rollwise config [--config FILE] [key=value ...]  print the resolved config as YAML
    rollwise bench engine [--quick] [--json PATH]     reference engine vs. HF generate, side by side
    rollwise bench rollout [--quick] [--json PATH]    rollout modes sync / sorted / async, side by side
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from rollwise import __version__

OVERRIDES_HELP = (
    "dotted overrides of the YAML config, e.g. train.lr=1e-5 rollout.group_size=8 task.params.max_terms=3; "
    "shortcuts: lr, steps, group_size, prompts_per_step, max_tokens, resume"
)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollwise",
        description=(
            "rollwise: RL post-training for LLMs (GRPO with verifiable rewards) built as infrastructure. "
            "Runs end to end on a CPU with the bundled SmolLM2-135M-Instruct."
        ),
        epilog="Run `rollwise COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"rollwise {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser(
        "train",
        help="train a policy with GRPO (no arguments: the embedded default run, ~15 min on 2 CPU cores)",
        description=(
            "Train with GRPO: roll out groups on the engine, score them with the task's verifier, update the "
            "policy, push weights to the engine. Writes metrics.jsonl, TensorBoard events, curve.png, "
            "checkpoints and summary.json (held-out accuracy before and after) into the run directory."
        ),
    )
    train.add_argument("--config", type=Path, help="YAML config (default: the embedded rollwise/configs/default.yaml)")
    train.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)

    config = sub.add_parser("config", help="print the resolved config (defaults + file + overrides) as YAML")
    config.add_argument("--config", type=Path, help="YAML config (default: the embedded one)")
    config.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)

    bench = sub.add_parser(
        "bench",
        help="run a benchmark: measured ratios side by side in one run",
        description="Benchmarks print a table; --json writes machine-readable results. --quick finishes in < 1 min.",
    )
    bench.add_argument(
        "name", choices=["engine", "rollout"],
        help="engine: reference engine vs. HF generate (tokens/s); rollout: sync vs sorted vs async rollout "
        "(bubble ratio, samples/s, staleness) with a timeline PNG",
    )
    bench.add_argument("--quick", action="store_true", help="small workload (< 1 minute on 2 CPU cores)")
    bench.add_argument("--json", type=Path, metavar="PATH", help="also write results as JSON")
    bench.add_argument("--model", default="bundled:smollm2-135m-instruct", help="model spec (default: bundled)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--plot", type=Path, metavar="PNG", default=Path("rollout_timeline.png"),
                       help="rollout: where to write the timeline plot (default: rollout_timeline.png)")
    return parser


def _cmd_train(args: argparse.Namespace, console: Console) -> int:
    from rollwise.config import load_config

    cfg = load_config(args.config, args.overrides)  # before the heavy imports: config typos fail fast
    from rollwise.control.train_loop import train

    train(cfg, console)
    return 0


def _cmd_config(args: argparse.Namespace, console: Console) -> int:
    import yaml

    from rollwise.config import dump_config, load_config

    cfg = load_config(args.config, args.overrides)
    print(yaml.safe_dump(dump_config(cfg), sort_keys=False), end="")
    return 0


def _cmd_bench(args: argparse.Namespace, console: Console) -> int:
    from rollwise.model.loading import load_model

    with console.status(f"loading {args.model}"):
        model, tokenizer = load_model(args.model)
    if args.name == "rollout":
        from rollwise.bench.rollout import format_rollout_bench, run_rollout_bench

        with console.status("running sync, sorted and async (the same work in each)"):
            result = run_rollout_bench(model, tokenizer, quick=args.quick, seed=args.seed, plot=args.plot)
        table = format_rollout_bench(result)
    else:
        from rollwise.bench.engine import format_engine_bench, run_engine_bench

        result = run_engine_bench(model, tokenizer, quick=args.quick, seed=args.seed)
        table = format_engine_bench(result)
    result["command"] = " ".join(["rollwise"] + sys.argv[1:])
    console.print(table)
    if result.get("timeline_png"):
        console.print(f"timeline plot: {result['timeline_png']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        console.print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    console = Console()
    if args.command is None:
        parser.print_help()
        return 0
    from rollwise.config import ConfigError

    handlers = {"train": _cmd_train, "config": _cmd_config, "bench": _cmd_bench}
    try:
        return handlers[args.command](args, console)
    except ConfigError as exc:
        console.print(f"[bold red]config error:[/] {exc}", highlight=False)
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())

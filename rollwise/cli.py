"""The `rollwise` command line.

    rollwise train [--config FILE] [key=value ...]   GRPO end to end (default: the embedded config)
    rollwise config [--config FILE] [key=value ...]  print the resolved config as YAML
    rollwise sft [--config FILE] sft.data=CHAT.jsonl [key=value ...]
                                                     supervised fine-tuning on chat JSONL (assistant tokens only),
                                                     checkpoints `rollwise train model=CKPT` starts from
    rollwise bench engine [--quick] [--json PATH]     reference engine vs. HF generate, side by side
    rollwise bench rollout [--quick] [--json PATH]    rollout modes sync / sorted / async, side by side
    rollwise bench sync [--quick] [--json PATH]       weight transports (in-process, files, gloo) vs memcpy, adapter pushes
    rollwise bench speculation [--quick] [--engine both|vllm|reference] [--json PATH]
                                                     rollouts with / without drafts from rollout history
    rollwise bench trainer [--quick] [--json PATH]    1 trainer rank vs 2 FSDP2 ranks: tokens/s, MFU, memory/rank, push
    rollwise bench trainer-step [--quick] [--arms A,B] one train step per trainer variant, interleaved: ratios
    rollwise bench loop [--quick] [--json PATH]       the default `rollwise train`: wall, samples/s, MFU, idle cores
    rollwise bench algorithms [--quick] [--arms R,..] [--seeds N] [--steps N] [--json PATH]
                                                     the default run per RL recipe (GRPO ... PPO+GAE): accuracy, s/step
    rollwise bench r3 [--quick] [--json PATH]         an MoE trained with / without rollout routing replay (mismatch)
    rollwise bench allocator [--quick] [--rounds N]   glibc malloc as it is vs unbounded vs bounded keeping (fresh processes)
    rollwise bench index [--check]                    docs/benchmarks.md: every goal's latest figure, from the JSON files
    rollwise bench load [--quick] [--json PATH]       flat checkpoints vs from_pretrained / safetensors / vLLM vs read limit
    rollwise bench load --switch [--quick]            a pool job switch from the memory / disk / remote tier vs a full load
    rollwise model flatten SRC DST [--chunk-mb MB]    a loading-optimised (flat) copy of a model directory or checkpoint
    rollwise compare RUN_DIR|LABEL=DIR,DIR ... [--out PNG]  runs or seed arms side by side, held-out table
    rollwise serve engine [--model SPEC] [--host 127.0.0.1] [--port 8000] [--max-num-seqs N] [--max-model-len N] [--dtype D]
                                                     the engine over HTTP: OpenAI-compatible completions,
                                                     token-level /generate, weight updates, /metrics
    rollwise serve router --replica URL --replica URL ... [--policy prefix] [--port 8080]
                                                     a gateway over engine replicas: prefix/session/load-aware
                                                     routing, failover, rolling weight updates, /metrics
    rollwise serve pool [--engines N] [--port 8300] [--host 127.0.0.1] [--max-num-seqs N] [--max-model-len N]
                                                     engines shared by several `rollwise train pool.url=...` jobs:
                                                     time-sliced, per-job weights/tokens/engine-hours, /state
    rollwise serve tinker [--port 8400] --api-keys FILE [--base-model NAME ...] [--data-dir DIR] [--database URL]
                                                     the Tinker SDK's API: many tenants' LoRA/full training and
                                                     sampling, durable requests, per-key isolation and quotas
    rollwise bench mux [--quick] [--lora] [--json PATH] jobs sharing one pool vs. each on dedicated engines:
                                                     engine-hours, wall time per job, slowdown
    rollwise bench router [--quick] [--rounds N] [--json PATH] [--plot PNG]
                                                     routing policies side by side on real replicas + 64 simulated
    rollwise sim CONFIG [--json PATH] [--plot PNG] | sim sweep CONFIG --sizes 8,64,512,4096 | sim calibrate | sim validate
                                                     the cluster simulator: production controller and routing
                                                     policies on simulated engines (virtual clock, cost model)
    rollwise check sandbox [--level bwrap|unshare|rlimits] [--json PATH]
                                                     the sandbox isolation this machine gives, and probes
                                                     (network, filesystem, limits, fork) that try to break out
    rollwise check tito [--model SPEC] [--engine reference|vllm|auto] [--json PATH]
                                                     multi-turn tool-calling conversations through a real engine:
                                                     token-for-token equality of sampled ids and the trajectory
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from rollwise import __version__
from rollwise.bench.cli import add_bench_parser, run_bench

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

    sft = sub.add_parser(
        "sft",
        help="supervised fine-tuning on chat JSONL: loss on assistant tokens only, packed rows, checkpoints that "
        "`rollwise train model=CHECKPOINT` starts from",
        description="Train on OpenAI chat-format JSONL ({\"messages\": [{\"role\", \"content\"}, ...]} per line), "
        "rendered with the model's chat template, next-token loss on the assistant's tokens only, conversations "
        "packed into rows of sft.pack_tokens. Held-out loss before and after (evals.jsonl), metrics.jsonl, "
        "TensorBoard, checkpoints in `rollwise train`'s format. Settings: the sft: section (sft.data, sft.lr, "
        "sft.epochs or sft.steps, sft.pack_tokens, sft.held_out_fraction, ...), model:, checkpoint:.",
        epilog="example: rollwise sft sft.data=examples/sft_chat.jsonl model=tiny:0 output_dir=runs/sft, then "
        "rollwise train model=runs/sft/checkpoints/step_NNNNNN",
    )
    sft.add_argument("--config", type=Path, help="YAML config (default: the embedded one)")
    sft.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)

    config = sub.add_parser("config", help="print the resolved config (defaults + file + overrides) as YAML")
    config.add_argument("--config", type=Path, help="YAML config (default: the embedded one)")
    config.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)

    add_bench_parser(sub)  # rollwise/bench/cli.py: the benchmarks' options and what each one runs
    compare = sub.add_parser(
        "compare",
        help="plot runs (or arms of several seeds) side by side: reward and held-out accuracy vs time and samples",
        description="Reads metrics.jsonl and evals.jsonl of each run directory, writes one PNG and prints the "
        "held-out strict accuracy per evaluated step. An arm of several seeds is LABEL=DIR,DIR,...: its "
        "runs are averaged (mean ± sd), since one run's curve moves by several points from seed to seed. "
        "Example: rollwise compare sync=runs/sync-s0,runs/sync-s1 sorted=runs/sorted-s0,runs/sorted-s1",
    )
    compare.add_argument("runs", nargs="+", metavar="RUN_DIR | LABEL=RUN_DIR[,RUN_DIR...]")
    compare.add_argument("--out", type=Path, default=Path("compare.png"), help="PNG to write (default: compare.png)")
    compare.add_argument("--json", type=Path, default=None, help="also write the held-out table as JSON")

    serve = sub.add_parser(
        "serve",
        help="serve an engine over HTTP (OpenAI-compatible completions + token-level endpoints), a router "
        "in front of several (`rollwise serve router --help`), an engine pool shared by several training "
        "jobs (`rollwise serve pool --help`), or a Tinker-compatible training service "
        "(`rollwise serve tinker --help`)",
        description=(
            "Serve the reference engine over HTTP until interrupted. Endpoints: POST /v1/completions and "
            "/v1/chat/completions (OpenAI-compatible, stream=true for server-sent events; every choice also "
            "carries token_ids, prompt_token_ids, per-token logprobs and policy_versions), POST /generate "
            "(token ids in, token ids + logprobs + versions out), GET /model_info (incl. the tokenizer "
            "fingerprint), /v1/models, /health, /ready, /load, /metrics (Prometheus), POST /pause, /resume, /sleep, /wake, /abort, "
            "/update_weights_from_disk."
        ),
        epilog=(
            "example: rollwise serve engine --model tiny:0 --port 8000, then "
            "curl -s localhost:8000/v1/completions -H 'content-type: application/json' "
            "-d '{\"prompt\": \"hi\", \"max_tokens\": 8}'"
        ),
    )
    serve.add_argument("name", choices=["engine", "router", "pool", "tinker"],
                       help="engine: the reference engine (the options below); router: a gateway over engine "
                       "replicas with its own options, see `rollwise serve router --help`; pool: engines shared "
                       "by several training jobs, see `rollwise serve pool --help`; tinker: the Tinker SDK's training "
                       "and sampling API, see `rollwise serve tinker --help`")
    serve.add_argument("--model", default="bundled:smollm2-135m-instruct", metavar="SPEC",
                       help="model spec: bundled:NAME, a local Hugging Face directory, or tiny:SEED "
                       "(a random test model) (default: %(default)s)")
    serve.add_argument("--engine", default="auto", choices=["auto", "reference", "vllm"],
                       help="backend: auto = vLLM when installed (except tiny: test models), else the reference "
                       "engine (default: %(default)s)")
    serve.add_argument("--max-num-seqs", type=int, default=16, metavar="N",
                       help="KV-cache slots: sequences generated at once (default: %(default)s)")
    serve.add_argument("--max-model-len", type=int, default=None, metavar="N",
                       help="prompt + generated tokens per sequence (default: the model's "
                       "max_position_embeddings, at most 2048)")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the name clients send as `model` (default: the --model spec)")
    serve.add_argument("--seed", type=int, default=None, help="seeds the samples of requests that bring no seed")
    serve.add_argument("--prefix-cache-tokens", type=int, default=16384, metavar="N",
                       help="engine: KV of up to N recent prompt/history tokens reused across requests "
                       "(0 disables) (default: %(default)s)")
    serve.add_argument("--retention", default="off", metavar="MODE",
                       choices=["off", "min_waste", "always_discard", "always_preserve", "prefix_cache_only"],
                       help="session KV across tool calls (POST /retain; vLLM: preserve or discard, no swap): off, min_waste, "
                       "always_discard, always_preserve, prefix_cache_only (default: %(default)s)")
    serve.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                       help="the engine's weights and matmuls; auto = bfloat16 where the hardware computes it "
                       "natively (default: %(default)s)")
    from rollwise.serve.settings import add_front_arguments  # the flags every rollwise server shares

    add_front_arguments(serve, port=8000)

    sub.add_parser(
        "sim", add_help=False,
        help="cluster simulator: the production controller and routing policies on simulated engines, 8 to 4096 "
        "GPUs (scenarios, sweeps, calibration, validation; `rollwise sim --help`)",
    )

    check = sub.add_parser(
        "check",
        help="check a part of the system on this machine",
        description="sandbox: print the isolation level available here (and what is missing), then run probes "
        "that try to reach the network, write outside the workspace, exceed memory/CPU/process/file/output "
        "limits and fork a workspace. Exit code 1 if any probe was not contained. tito: drive multi-turn "
        "conversations with tool calls through a real engine and prove token-for-token equality between what the "
        "engine sampled and the trajectory the trainer receives; report chat-template transitions that break the "
        "prefix property. Exit code 1 on a violation.",
    )
    check.add_argument("name", choices=["sandbox", "tito"],
                       help="sandbox: isolation level and break-out probes; tito: token-in/token-out on an engine")
    check.add_argument("--level", choices=["bwrap", "unshare", "rlimits"], default=None,
                       help="sandbox: probe at most this isolation level (default: the strongest available)")
    check.add_argument("--json", type=Path, metavar="PATH", help="also write results as JSON")
    check.add_argument("--model", default="tiny:0", metavar="SPEC",
                       help="tito: model spec (default: %(default)s, a tiny model taught to call tools)")
    check.add_argument("--engine", default="auto", choices=["auto", "reference", "vllm"],
                       help="tito: engine backend (default: %(default)s)")
    check.add_argument("--episodes", type=int, default=3, metavar="N", help="tito: conversations (default: 3)")
    check.add_argument("--strict-prefix", action="store_true",
                       help="tito: also exit 1 when the chat template breaks the prefix property (splits)")
    return parser


def _cmd_check(args: argparse.Namespace, console: Console) -> int:
    if args.name == "tito":
        from rollwise.agent.check import cli_check_tito

        return cli_check_tito(args, console)
    from rollwise.sandbox.probes import cli_check_sandbox

    return cli_check_sandbox(args, console)


def _cmd_compare(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    from rollwise.observe.compare import against_first, held_out_table, load_arms
    from rollwise.observe.plots import plot_run_comparison

    try:
        arms = load_arms(args.runs)
    except (FileNotFoundError, ValueError) as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    out = plot_run_comparison(arms, args.out)
    rows = held_out_table(arms)
    if rows:
        table = Table(title="held-out strict accuracy: mean ± sd over an arm's runs (samples taken by then)")
        table.add_column("step")
        for arm in arms:
            table.add_column(f"{arm.label} ({len(arm.runs)} run{'s' if len(arm.runs) > 1 else ''})", justify="right")
        for row in rows:
            cells = []
            for arm in arms:
                cell = row[arm.label]
                text = f"{cell['strict_mean']:.1%}"
                if len(arm.runs) > 1:
                    text += f" ± {cell['strict_std']:.1%}"
                if cell["samples"] is not None:
                    text += f" ({cell['samples']:,.0f})"
                cells.append(text)
            table.add_row(str(row["step"]), *cells)
        console.print(table)
    differences = against_first(rows, arms)
    for d in differences:
        error = f" ± {100 * d['standard_error']:.1f} (standard error: {abs(d['difference']) / d['standard_error']:.1f} of them)" \
            if d["standard_error"] else " (an arm of one run: no error to weigh it against)"
        console.print(f"held-out strict, {d['arm']} - {d['baseline']}, {d['at']}: {100 * d['difference']:+.1f} points{error}")
    if args.json is not None:
        args.json.write_text(json.dumps({"arms": {a.label: [str(r.directory) for r in a.runs] for a in arms},
                                         "held_out": rows, "against_first": differences}, indent=1))
        console.print(f"wrote {args.json}")
    console.print(f"wrote {out}")
    return 0


def _cmd_train(args: argparse.Namespace, console: Console) -> int:
    from rollwise.config import load_config

    cfg = load_config(args.config, args.overrides)  # before the heavy imports: config typos fail fast
    from rollwise.train.torchrun import launched_rank

    launched = launched_rank(os.environ, cfg)
    if launched is not None and launched.rank > 0:  # torchrun: rank 0 runs the training, this rank follows it
        from rollwise.model.loading import load_model
        from rollwise.train.torchrun import follow

        model, tokenizer = load_model(cfg.model)
        follow(launched, model, cfg, tokenizer.pad_token_id if tokenizer.pad_token_id is not None
               else tokenizer.eos_token_id)
        return 0
    from rollwise.control.train_loop import train

    train(cfg, console)
    return 0


def _cmd_sft(args: argparse.Namespace, console: Console) -> int:
    from rollwise.config import load_config

    cfg = load_config(args.config, args.overrides)
    from rollwise.train.sft import run_sft  # the command's body

    run_sft(cfg, lambda line: console.print(escape(line), highlight=False, soft_wrap=True))
    return 0


def _cmd_config(args: argparse.Namespace, console: Console) -> int:
    import yaml

    from rollwise.config import dump_config, load_config

    cfg = load_config(args.config, args.overrides)
    print(yaml.safe_dump(dump_config(cfg), sort_keys=False), end="")
    return 0


def _cmd_serve(args: argparse.Namespace, console: Console) -> int:
    from rollwise.engine.server import serve
    from rollwise.serve.front import Front

    try:
        serve(
            args.model, front=Front.from_args(args), max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len, served_model_name=args.served_model_name, seed=args.seed,
            prefix_cache_tokens=args.prefix_cache_tokens, engine_kind=args.engine, retention=args.retention,
            dtype=args.dtype,
        )
    except ValueError as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from rollwise.model.allocator import keep_freed_memory

    keep_freed_memory()  # for this process and every one it starts (rollwise/model/allocator.py says why)
    from rollwise.control.stop_signal import Stopped, stop_on_sigterm

    stop_on_sigterm()  # a scheduler's SIGTERM closes engines and child processes like Ctrl-C does
    if argv[:2] == ["bench", "index"]:  # not a measurement: writes docs/benchmarks.md from the JSON files
        from rollwise.bench.index import main as bench_index

        return bench_index(argv[2:])
    if argv[:2] == ["serve", "router"]:  # the router has its own options: rollwise/router/cli.py
        from rollwise.router.cli import main as serve_router

        return serve_router(argv[2:])
    if argv[:2] == ["serve", "pool"]:  # the shared engine pool has its own options: rollwise/pool/cli.py
        from rollwise.pool.cli import main as serve_pool

        return serve_pool(argv[2:])
    if argv[:2] == ["serve", "tinker"]:  # the Tinker-compatible service has its own options: rollwise/service/cli.py
        from rollwise.service.cli import main as serve_tinker

        return serve_tinker(argv[2:])
    if argv[:1] == ["model"]:  # model files: rollwise/model/flatten_cli.py
        from rollwise.model.flatten_cli import main as model_main

        return model_main(argv[1:])
    if argv[:1] == ["sim"]:  # the simulator has its own subcommands: rollwise/sim/cli.py
        from rollwise.bench.sim_commands import SIM_COMMANDS  # calibrate, validate*: they run real engines
        from rollwise.sim.cli import main as sim_main

        return sim_main(argv[1:], extra=SIM_COMMANDS)
    parser = _build_parser()
    args = parser.parse_args(argv)
    # the benchmark tables are wide, and a pipe (tee to a log) would squash them to 80 columns
    console = Console(width=max(Console().width, 160)) if args.command == "bench" else Console()
    if args.command is None:
        parser.print_help()
        return 0
    from rollwise.config import ConfigError, RunError

    handlers = {"train": _cmd_train, "sft": _cmd_sft, "config": _cmd_config, "bench": run_bench, "compare": _cmd_compare,
                "serve": _cmd_serve, "check": _cmd_check}
    try:
        return handlers[args.command](args, console)
    except ConfigError as exc:  # as written: no [markup] or :emoji: (model=tiny:abc:); soft_wrap: one line, however long
        console.print(f"[bold red]config error:[/] {escape(str(exc))}", highlight=False, emoji=False, soft_wrap=True)
        return 2
    except RunError as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, emoji=False, soft_wrap=True)
        return 1
    except Stopped as stop:
        console.print(f"[yellow]stopped by {stop}[/]: engines and child processes closed")
        return stop.exit_code
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""`rollwise bench NAME`: the benchmarks' command-line options and what each one runs (rollwise/cli.py hands
`bench` over to this module). Each benchmark lives in its own module under rollwise/bench/, imported only when
it runs, so `rollwise --help` stays fast and the product never imports measurement code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def add_bench_parser(sub: Any) -> None:
    """The `bench` subcommand on the top-level parser's subparsers (argparse's private action type: Any)."""
    bench = sub.add_parser(
        "bench",
        help="run a benchmark: measured ratios side by side in one run",
        description="Benchmarks print a table; --json writes machine-readable results. --quick finishes in < 1 min.",
    )
    bench.add_argument(
        "name", choices=["engine", "rollout", "sync", "router", "sandbox", "mux", "speculation", "trainer", "loop",
                 "intercept", "r3", "trainer-step", "allocator", "index", "load", "algorithms", "service",
                 "environments"],
        help="index: regenerate docs/benchmarks.md (every goal's latest figure) from the JSON files (--check: only "
        "say whether it is current); router: routing policies (round robin ... prefix-aware) side by side on real tiny-model replicas and "
        "64 simulated ones, every router in its own process, vllm-router's cache_aware too when installed "
        "(prefix hit rate, prefill tokens, p50/p99 latency, load imbalance, router CPU per request); "
        "sandbox: create/exec/fork/destroy latency (p50/p99) and how many concurrent sandboxes this machine holds; "
        "engine: HF generate, the reference engine and vLLM (through our contract and its own LLM.generate), "
        "tokens/s; rollout: sync vs sorted vs async rollout "
        "(bubble ratio, samples/s, staleness) with a timeline PNG; sync: weight transports (in-process, safetensors "
        "files, gloo broadcast) in seconds and GB/s next to a memory copy of the same bytes; mux: `rollwise train` "
        "jobs sharing one engine pool vs. each on a dedicated engine (engine-hours, wall time per job, slowdown; "
        "tiny models; --quick: 2 jobs on 1 engine, full: also 4 jobs on 2 engines; --model is not used); "
        "speculation: GRPO rollouts with and without drafts from rollout history on vLLM and/or the reference "
        "engine (--engine; wall and tail time ratio, tokens/s by batch size, acceptance); "
        "trainer: one GRPO batch through 1 trainer rank (2 threads) and 2 "
        "FSDP2 ranks (1 thread each): trained tokens/s, MFU vs a measured matmul peak, memory per rank, weight "
        "gather+push time (--quick: a tiny model); loop: the default `rollwise train` run end to end: wall time, "
        "samples/s, model-FLOPs utilisation (run and per phase) against this machine's matmul peak, idle "
        "core-seconds, held-out accuracy (--quick: 2 steps of 2 groups, 10 held-out problems; --model overrides "
        "the config's model only when given); r3: the upcycled MoE (bundled:smollm2-moe unless --model is given; --quick: a tiny random "
        "MoE) trained with and without rollout routing replay, engine in bf16 and trainer in fp32: router "
        "disagreement, logprob mismatch, k3 KL, ratio>2 per step, held-out accuracy, replay cost, MoE-CAP counts; "
        "trainer-step: one default-shaped train step under trainer variants (train.fused_*), interleaved in one "
        "process, step-time ratios to the baseline (--quick: a tiny model, 1 round); "
        "allocator: glibc's default malloc vs every freed block kept (unbounded) vs kept up to a bound (bounded, "
        "rollwise's default) in fresh processes side by side: reference-engine decode steps and "
        "train steps, time, page faults, kernel time, peak memory; "
        "algorithms: the default run under each RL recipe (grpo, dr_grpo, dapo, rloo, reinforce_pp, gspo, cispo, "
        "ppo_gae: rollwise/types/recipes.py) x seeds, held-out strict accuracy after 3 steps and at the end, seconds "
        "per step vs GRPO, peak memory (--quick: tiny model, 2 steps, grpo and ppo_gae, 1 seed); "
        "load: weights from files to resident memory, flat checkpoints (`rollwise model flatten`) against "
        "from_pretrained, safetensors load_file and vLLM's weight iterator, and against a raw parallel read and a "
        "memcpy of the same bytes (--quick: SmolLM2 from the page cache; full: also a 1B-shaped model, and cold "
        "reads where the page cache can be dropped; --model is not used); "
        "service: `rollwise serve tinker` under 1, 2, 4, 8 LoRA tenants each running the arithmetic RL loop through "
        "the unmodified tinker SDK vs one alone and vs `rollwise train` on the same work (--quick: 1 and 2 tenants, "
        "2 steps; use --model tiny:llama for a fast check); "
        "environments: the default run and a calculator tool environment with scoring in-process vs in the reward "
        "pool vs an environment service (classic verifiers), for a regex reward and a 100 ms one: step time, "
        "rollouts/s, trainer idle time on rewards (--quick: tiny model, 2 steps of 2 groups; --arms: some arms)",
    )
    bench.add_argument("--quick", action="store_true", help="small workload (< 1 minute on 2 CPU cores)")
    bench.add_argument("--json", type=Path, metavar="PATH", help="also write results as JSON")
    bench.add_argument("--model", default="bundled:smollm2-135m-instruct",
                       help="model spec (default: bundled); sync also takes shape:llama-3.2-1b, that model's shape "
                       "with random weights")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="loop, speculation: a config override as for `rollwise train` (repeatable), e.g. "
                       "--set train.pack_responses=false for the row before one change, --set engine.dtype=float32")
    bench.add_argument("--engine", default="both", choices=["both", "vllm", "reference"],
                       help="speculation, intercept: the engines to run (both: the reference engine and vLLM, when installed)")
    bench.add_argument("--adapter-only", action="store_true",
                       help="sync: only the full push and a rank-16 adapter push, on the training path and over gloo "
                       "(for big models: no memcpy buffers or files copy), e.g. with --model shape:llama-3.2-1b")
    bench.add_argument("--migration", action="store_true",
                       help="mux: the migration arm instead: a pool slot drained for another job by live migration "
                       "vs by waiting vs by abort and regenerate (issue 42; drain episode, tokens regenerated)")
    bench.add_argument("--switch", action="store_true",
                       help="load: only its pool job-switch section: a switch from the memory, disk and remote tier "
                       "of the pool's model cache vs a full load through from_pretrained (issue 42)")
    bench.add_argument("--lora", action="store_true",
                       help="mux: train.lora jobs on one base sharing one engine batch (2 jobs; full: also 4) "
                       "vs. dedicated engines (issue 22)")
    bench.add_argument("--steps", type=int, default=None, metavar="N",
                       help="r3: GRPO steps per run (default: 2 with --quick, else 6; a step of the upcycled MoE "
                       "takes ~3 min on 2 CPU cores); algorithms: steps per run (default: 15; 2 with --quick)")
    bench.add_argument("--rounds", type=int, default=None, metavar="N",
                       help="router: rotated rounds of the workload per arm (default: 2 with --quick, else 4); "
                       "more rounds make the median-round p50/p99 steadier; allocator: pairs of processes per "
                       "workload (default: 1 with --quick, else 3)")
    bench.add_argument("--replica-only", action="store_true",
                       help="router: only the replica arm (one engine server's CPU per request beyond its engine, "
                       "p50/p99 at concurrency 1, 8, 64, an aiohttp load generator in its own process)")
    bench.add_argument("--replica-baseline", type=Path, default=None, metavar="DIR",
                       help="router: also run the replica arm on the engine server of this checkout (e.g. "
                       "`git worktree add /tmp/before HEAD`), rounds interleaved: the before figure in the same run")
    bench.add_argument("--memory", action="store_true",
                       help="trainer: the memory arm instead: one train step per response length (512 to 16k "
                       "tokens; --quick: 512 to 2k, a few minutes), each in a fresh process, with and without "
                       "train.gradient_checkpointing: the step's peak memory, per token and per further token")
    bench.add_argument("--arms", default=None, metavar="A,B,...",
                       help="trainer-step: the trainer variants to run, comma-separated, baseline among them "
                       "(default: all; e.g. --arms baseline,default,default_bfloat16); algorithms: the recipes "
                       "(default: all; e.g. --arms grpo,ppo_gae); environments: the arms, TASK-EXECUTOR-REWARD "
                       "(default: all; e.g. --arms single-pool-slow,tool-env-slow)")
    bench.add_argument("--seeds", type=int, default=None, metavar="N",
                       help="algorithms: seeds per recipe (default: 3; 1 with --quick)")
    bench.add_argument("--resume", type=Path, default=None, metavar="JSON",
                       help="algorithms: keep the runs of an earlier --json output (written after every run) and "
                       "run only the (recipe, seed) pairs it lacks, e.g. --seeds 3 on a 1-seed JSON")
    bench.add_argument("--plot", type=Path, metavar="PNG", default=Path("rollout_timeline.png"),
                       help="rollout: where to write the timeline plot (default: rollout_timeline.png)")


def run_bench(args: argparse.Namespace, console: Console) -> int:
    """`rollwise bench NAME`: run the benchmark, print its table, write its JSON (--json) with the command."""
    if args.name == "algorithms":  # `rollwise train` runs, one per recipe and seed: rollwise/bench/algorithms.py
        from rollwise.bench.algorithms import cli_bench_algorithms

        return cli_bench_algorithms(args, console)
    if args.name == "load":  # its own models, written and read as files: rollwise/bench/load.py
        from rollwise.bench.load import cli_bench_load

        return cli_bench_load(args, console)
    if args.name == "service":  # a server and client processes per arm: rollwise/bench/service.py
        from rollwise.bench.service import format_service_bench, run_service_bench

        with console.status("running tenants against `rollwise serve tinker`, then `rollwise train`"):
            result = run_service_bench(quick=args.quick, model=args.model)
        return _finish(args, console, format_service_bench(result), result)
    if args.name == "environments":  # train() per arm: rollwise/bench/environments.py
        from rollwise.bench.environments import format_environments_bench, run_environments_bench

        with console.status("training with scoring in-process, in the reward pool and in an environment service, "
                            "regex and 100 ms rewards"):
            explicit_model = any(a == "--model" or a.startswith("--model=") for a in sys.argv)
            arms = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
            result = run_environments_bench(quick=args.quick, model=args.model if explicit_model else None, arms=arms)
        return _finish(args, console, format_environments_bench(result), result)
    if args.name == "sandbox":  # no model
        from rollwise.bench.sandbox import format_sandbox_bench, run_sandbox_bench

        with console.status("timing sandboxes (create / exec / fork / destroy, then concurrency)"):
            result = run_sandbox_bench(quick=args.quick)
        return _finish(args, console, format_sandbox_bench(result), result)
    if args.name == "mux" and args.migration:
        from rollwise.bench.mux_migration import format_migration_bench, run_migration_bench

        with console.status("draining a pool slot by migration, by waiting, by abort and regenerate"):
            result = run_migration_bench(quick=args.quick, model=args.model, rounds=args.rounds)
        return _finish(args, console, format_migration_bench(result), result)
    if args.name == "mux":  # each job loads its own model in its own process
        from rollwise.bench.mux import format_mux_bench, run_mux_bench

        with console.status("running the jobs on dedicated engines, then sharing one pool (same steps)"):
            result = run_mux_bench(quick=args.quick, lora=args.lora)
        return _finish(args, console, format_mux_bench(result), result)
    if args.name == "loop":  # the default config, as `rollwise train` runs it
        from rollwise.bench.loop import format_loop_bench, run_loop_bench

        # --model has a default for the other benchmarks; here only a given one overrides the config's
        explicit_model = any(a == "--model" or a.startswith("--model=") for a in sys.argv)
        result = run_loop_bench(quick=args.quick, model=args.model if explicit_model else None, console=console,
                                overrides=args.set)
        return _finish(args, console, format_loop_bench(result), result)
    if args.name == "r3":  # --quick: a tiny random MoE; else the upcycled MoE unless --model is given
        from rollwise.bench.r3 import format_r3_bench, run_r3_bench
        from rollwise.model.loading import BUNDLED_PREFIX, UPCYCLED_MODELS, load_model

        explicit_model = any(a == "--model" or a.startswith("--model=") for a in sys.argv)
        spec = "tiny-moe:0" if args.quick else (args.model if explicit_model else "bundled:smollm2-moe")
        with console.status(f"GRPO on {spec} with and without routing replay (engine bf16, trainer fp32)"):
            model, tokenizer = load_model(spec)
            upcycled = UPCYCLED_MODELS.get(spec.removeprefix(BUNDLED_PREFIX)) if spec.startswith(BUNDLED_PREFIX) else None
            dense = None if upcycled is None else load_model(BUNDLED_PREFIX + upcycled[0])[0]  # timed beside it
            result = run_r3_bench(model, tokenizer, quick=args.quick, seed=args.seed, steps=args.steps, dense=dense,
                                  log=console.log)
        result["model"] = spec
        return _finish(args, console, format_r3_bench(result), result)
    if args.name == "allocator":  # fresh child processes per arm; each loads the model itself
        from rollwise.bench.allocator import format_allocator_bench, run_allocator_bench

        with console.status("glibc's malloc as it is vs unbounded vs bounded, in fresh processes") as status:
            result = run_allocator_bench(quick=args.quick, pairs=args.rounds, progress=status.update)
        return _finish(args, console, format_allocator_bench(result), result)
    if args.name == "trainer-step":  # --quick: a tiny model built in code instead of --model
        from rollwise.bench.trainer import format_trainer_step_bench, run_trainer_step_bench
        from rollwise.model.loading import load_model

        spec = "tiny:0" if args.quick else args.model
        with console.status(f"one train step per trainer variant, interleaved ({spec})"):
            model, tokenizer = load_model(spec)
            arms = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
            try:
                result = run_trainer_step_bench(model, tokenizer, model_spec=spec, quick=args.quick,
                                                rounds=1 if args.quick else 3, seed=args.seed, arms=arms)
            except ValueError as exc:
                console.print(f"[bold red]error:[/] {exc}", highlight=False)
                return 2
        return _finish(args, console, format_trainer_step_bench(result), result)
    if args.name == "trainer" and args.memory:  # the memory arm: SmolLM2 (--model) also with --quick
        from rollwise.bench.trainer_memory import format_memory_bench, run_memory_bench

        with console.status(f"train-step memory by response length ({args.model})") as status:
            result = run_memory_bench(args.model, quick=args.quick, seed=args.seed, progress=status.update)
        return _finish(args, console, format_memory_bench(result), result)
    if args.name == "trainer":  # --quick: a tiny model built in code instead of --model
        from rollwise.bench.trainer import format_trainer_bench, run_trainer_bench
        from rollwise.model.loading import load_model

        spec = "tiny:0" if args.quick else args.model
        with console.status(f"training one batch on 1 rank, then on 2 FSDP2 ranks ({spec})"):
            model, tokenizer = load_model(spec)
            result = run_trainer_bench(model, tokenizer, model_spec=spec, quick=args.quick, seed=args.seed)
        return _finish(args, console, format_trainer_bench(result), result)
    if args.name == "router":  # tiny models built in code: no --model to load
        from rollwise.bench.router import cli_bench_router

        return cli_bench_router(args, console)
    if args.name == "sync":  # its own loader: it also takes public model shapes with random weights
        from rollwise.bench.sync import format_sync_bench, load_bench_model, run_sync_bench

        with console.status(f"loading {args.model}"):
            model, tokenizer = load_bench_model(args.model)
        paths = "in-process and gloo" if args.adapter_only else "memcpy, in-process, files and gloo"
        with console.status(f"pushing the weights and a LoRA adapter through {paths}"):
            result = run_sync_bench(model, tokenizer, model_spec=args.model, quick=args.quick, seed=args.seed,
                                    adapter_only=args.adapter_only)
        return _finish(args, console, format_sync_bench(result), result)
    from rollwise.model.loading import load_model

    with console.status(f"loading {args.model}"):
        model, tokenizer = load_model(args.model)
    from rollwise.engine.factory import resolve_engine_kind

    if args.name == "rollout":
        from rollwise.bench.rollout import format_rollout_bench, run_rollout_bench

        with console.status("running sync, sorted and async (the same work in each)"):
            result = run_rollout_bench(model, tokenizer, quick=args.quick, seed=args.seed, plot=args.plot,
                                       engine_kind=resolve_engine_kind("auto", args.model))
        table = format_rollout_bench(result)
    elif args.name == "speculation":
        from rollwise.bench.engines import bench_engine_kinds
        from rollwise.bench.speculation import format_speculation_bench, run_speculation_bench

        with console.status("rollouts with and without speculation from rollout history (the same work)"):
            result = run_speculation_bench(model, tokenizer, quick=args.quick, seed=args.seed,
                                           engines=bench_engine_kinds(args.engine, args.model), overrides=args.set)
        table = format_speculation_bench(result)
    elif args.name == "intercept":  # issue 21: session KV retention across tool calls
        from rollwise.bench.intercept import format_intercept_bench, run_intercept_bench
        from rollwise.bench.engines import bench_engine_kinds

        with console.status("agentic sessions with tool calls under each retention policy (the same work)") as status:
            kinds = tuple(bench_engine_kinds(args.engine, args.model, reference_first=True))
            result = run_intercept_bench(model, tokenizer, quick=args.quick, seed=args.seed, engines=kinds,
                                         progress=lambda msg: status.update(f"{msg} (4 policies, the same work)"))
        table = format_intercept_bench(result)
    else:
        from rollwise.bench.engine import format_engine_bench, run_engine_bench

        with_vllm = resolve_engine_kind("auto", args.model) == "vllm"
        with console.status("timing HF generate, the reference engine" + (" and vLLM" if with_vllm else "")):
            result = run_engine_bench(model, tokenizer, quick=args.quick, seed=args.seed, with_vllm=with_vllm)
        table = format_engine_bench(result)
    return _finish(args, console, table, result)


def _finish(args: argparse.Namespace, console: Console, table: Table | str, result: dict) -> int:
    """Print a benchmark's table (and plot), and write its JSON with the command that produced it."""
    from rollwise.sim.commands import write_json

    result["command"] = " ".join(["rollwise"] + sys.argv[1:])
    console.print(table)
    if result.get("timeline_png"):
        console.print(f"timeline plot: {result['timeline_png']}")
    write_json(args.json, result, console)
    return 0

"""`rollwise bench algorithms`: the default task under each RL recipe users name (issue 41's benchmark).

For each recipe of rollwise.types.recipes (GRPO, Dr. GRPO, DAPO, RLOO, REINFORCE++, GSPO, CISPO, PPO+GAE: the
overrides that make it from rollwise's advantage estimators and policy losses) and each seed, the default
config (`rollwise train`: 15 steps, evaluations every 3) runs in a fresh process, and the bench reports:

    held-out strict accuracy   before training, after 3 steps (the first mid-run evaluation) and at the end
    seconds per step           mean `time_step_s` over the steps (rollout + train + weight push), and the
                               train phase alone (`time_train_s`)
    peak memory                the run's peak RSS, engine child processes included; on CUDA also the
                               trainer's peak allocated GPU memory

At the end, each recipe's trainer work (its train seconds over GRPO's, times GRPO's trained fraction) is projected
onto GPU rollouts with the cluster simulator (rollwise.bench.algorithms_projection): the step-time ratios where
generation, not training, is most of a step.

Goals (issue 41): every recipe learns, +40 points of held-out strict accuracy or more at the end (mean over
seeds); none costs more than 1.2x GRPO's seconds per step, except PPO+GAE (a critic trained each step): 1.6x.

--quick: a tiny random model (tiny:0) on the default task, 2 steps of 2 groups of 4, 4 held-out problems, GRPO
and PPO+GAE, one seed, in this process: it checks that the command runs end to end (a test runs it), its
numbers are not the goal's. The full run takes hours on a CPU: 8 recipes x 3 seeds x the default run.
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

from rollwise.bench.algorithms_projection import project
from rollwise.types.recipes import BASELINE, CRITIC_RECIPES, RECIPES

GOAL_GAIN = 0.40
GOAL_STEP_RATIO = 1.2
GOAL_STEP_RATIO_CRITIC = 1.6
EARLY_STEP = 3
QUICK_RECIPES = ("grpo", "ppo_gae")
QUICK_CRITIC = ["train.gae.critic_trainable_layers=1"]
# --quick projects onto a small cluster (12 GPUs, 128 samples an update): seconds, where the full scenario takes minutes
QUICK_PROJECTION = {"cluster.gpus": 8, "cluster.trainer_gpus": 4, "workload.prompts_per_step": 8, "workload.updates": 3}
QUICK = ["model=tiny:0", "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_tokens=8",
         "engine.kind=reference", "engine.max_num_seqs=8", "engine.max_model_len=256", "eval.size=4",
         "train.micro_batch_size=8", "tensorboard=false", "threads=1"]


def arm_overrides(recipe: str, seed: int, steps: int, output_dir: str, quick: bool, model: str | None,
                  extra: list[str]) -> list[str]:
    """The default config's overrides for one (recipe, seed) run: the recipe's, then the bench's, then --set's."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose among {', '.join(RECIPES)}")
    early = min(EARLY_STEP, steps)
    bench = [f"seed={seed}", f"train.steps={steps}", f"eval.every={early}", "checkpoint.every=0",
             f"output_dir={output_dir}"]
    # the tiny model has 2 layers: a recipe's frozen-critic depth (8 of SmolLM2's 30) becomes 1 there
    tiny = [*QUICK, *(QUICK_CRITIC if recipe in CRITIC_RECIPES else [])] if quick else []
    return [*RECIPES[recipe], *tiny, *([f"model={model}"] if model else []), *bench, *extra]


def run_arm(overrides: list[str]) -> dict[str, Any]:
    """One `rollwise train` run (in the calling process); its evaluations, step times and peak memory."""
    import torch

    from rollwise.config import load_config
    from rollwise.control.train_loop import train

    cfg = load_config(None, overrides)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.monotonic()
    summary = train(cfg, Console(quiet=True))
    wall = time.monotonic() - t0
    run_dir = Path(summary["run_dir"])
    evals = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # the run's final checkpoint (1 GB, 2 with a critic) is not read: 24 runs of them filled this VM's disk
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    before = next((e["strict_accuracy"] for e in evals if e["label"] == "before"), None)
    early = next((e["strict_accuracy"] for e in evals if e["step"] == min(EARLY_STEP, cfg.train.steps)
                  and e["label"] != "before"), None)
    after = (summary.get("eval_after") or {}).get("strict_accuracy")
    # the first step also warms caches (and compiles, on GPU): its time is kept out of the mean where there are more
    timed = records[1:] if len(records) > 1 else records
    last = records[-1] if records else {}
    return {
        "strict_before": before, "strict_early": early, "strict_after": after,
        "gain_early": None if early is None or before is None else early - before,
        "gain_end": None if after is None or before is None else after - before,
        "step_s": statistics.mean(r["time_step_s"] for r in timed) if timed else None,
        "train_s": statistics.mean(r["time_train_s"] for r in timed) if timed else None,
        # where a recipe's extra train time goes: the reference's forwards (KL) and the critic's values + update
        "ref_s": statistics.mean(r.get("time_ref_s", 0.0) for r in timed) if timed else None,
        "critic_s": statistics.mean(r.get("time_critic_s", 0.0) for r in timed) if timed else None,
        # the share of the batch's samples the update trained (GRPO skips zero-variance groups): the projection's input
        "trained_fraction": trained_fraction(timed),
        "peak_memory_gb": summary.get("peak_rss_run_gb") or summary.get("peak_rss_gb"),
        "cuda_peak_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "critic_value_loss": last.get("critic/value_loss"),
        "critic_explained_variance": last.get("critic/explained_variance"),
        "wall_s": wall, "run_dir": str(run_dir.resolve()), "engine": summary.get("engine"),
    }


def trained_fraction(records: list[dict[str, Any]]) -> float | None:
    """Trained samples over rolled-out samples, over the steps' metrics records (None: not recorded)."""
    trained = sum(r.get("trained_samples", 0.0) for r in records)
    batch = sum(r.get("batch_samples", 0.0) for r in records)
    return trained / batch if batch else None


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.mean(kept) if kept else None


def summarise(arms: dict[str, list[dict[str, Any]]], quick: bool, project_gpu: bool = False) -> dict[str, Any]:
    """Per recipe: the means over seeds, the step-time ratio to GRPO, and the issue's goals checked; with
    `project_gpu`, also each recipe's ratio projected onto GPU rollouts (rollwise.bench.algorithms_projection)."""
    recipes: dict[str, dict[str, Any]] = {}
    for name, runs in arms.items():
        recipes[name] = {key: _mean([r[key] for r in runs]) for key in
                         ("strict_before", "strict_early", "strict_after", "gain_early", "gain_end", "step_s",
                          "train_s", "ref_s", "critic_s", "peak_memory_gb", "cuda_peak_gb")}
        recipes[name]["trained_fraction"] = _mean([r.get("trained_fraction") for r in runs])
        recipes[name]["seeds"] = len(runs)
    base = recipes.get(BASELINE, {}).get("step_s")
    checks: dict[str, bool | None] = {}
    for name, r in recipes.items():
        r["step_ratio_vs_grpo"] = r["step_s"] / base if base and r["step_s"] is not None else None
        checks[f"{name}: held-out strict +40 points at the end"] = (
            None if r["gain_end"] is None else r["gain_end"] >= GOAL_GAIN)
        if name != BASELINE:
            bound = GOAL_STEP_RATIO_CRITIC if name in CRITIC_RECIPES else GOAL_STEP_RATIO
            checks[f"{name}: seconds per step <= {bound}x GRPO"] = (
                None if r["step_ratio_vs_grpo"] is None else r["step_ratio_vs_grpo"] <= bound)
    projection = project(recipes, BASELINE, QUICK_PROJECTION if quick else None) if project_gpu else {}
    return {"quick": quick, "recipes": recipes, "goals": _goals(recipes, projection), "checks": checks,
            "recipe_overrides": {n: RECIPES[n] for n in arms}, "gpu_projection": projection}


def _goals(recipes: dict[str, dict[str, Any]], projection: dict[str, Any]) -> dict[str, Any]:
    """The measured figures under stable keys (the benchmark index reads them): the worst recipe's gain, the
    worst step-time ratio of a recipe without a critic, and each critic recipe's ratio; projected onto GPU
    rollouts (when `projection` has them), the worst ratio of a recipe without a critic in each rollout mode."""
    gains = [r["gain_end"] for r in recipes.values() if r["gain_end"] is not None]
    plain = [r["step_ratio_vs_grpo"] for n, r in recipes.items()
             if n != BASELINE and n not in CRITIC_RECIPES and r["step_ratio_vs_grpo"] is not None]
    values: dict[str, float | None] = {"gain_end_worst": min(gains) if gains else None,
                                       "step_ratio_vs_grpo_worst": max(plain) if plain else None}
    targets: dict[str, float] = {"gain_end_worst": GOAL_GAIN, "step_ratio_vs_grpo_worst": GOAL_STEP_RATIO}
    for name in CRITIC_RECIPES:
        if name in recipes:
            values[f"{name}_step_ratio_vs_grpo"] = recipes[name]["step_ratio_vs_grpo"]
            targets[f"{name}_step_ratio_vs_grpo"] = GOAL_STEP_RATIO_CRITIC
    for mode, by_recipe in projection.get("modes", {}).items():
        ratios = [r["ratio_vs_baseline"] for n, r in by_recipe.items() if n != BASELINE and n not in CRITIC_RECIPES]
        values[f"step_ratio_vs_grpo_worst_projected_{mode}"] = max(ratios) if ratios else None
        targets[f"step_ratio_vs_grpo_worst_projected_{mode}"] = GOAL_STEP_RATIO
    met = {key: None if value is None else (value >= targets[key] if key.startswith("gain") else value <= targets[key])
           for key, value in values.items()}
    return {**values, "targets": targets, "met": met}


def _warm_up(steps_dir: str, model: str | None, extra: list[str], log: Any) -> None:
    """A short GRPO run, in a fresh process, before the timed ones: the first run after a fresh start loads the
    libraries and the model from disk into the page cache and ran ~8% slower than the same recipe later (seed 0's
    GRPO against the recipes sharing its trainer). Its results are thrown away."""
    overrides = [*arm_overrides(BASELINE, 0, 2, steps_dir, False, model, extra), "eval.size=8"]
    log(f"warm-up (not timed): rollwise train {' '.join(overrides)}")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(run_arm, overrides).result()


def run_algorithms_bench(quick: bool = False, steps: int | None = None, seeds: int | None = None,
                         recipes: list[str] | None = None, model: str | None = None, extra: list[str] | None = None,
                         output_dir: str = "runs/bench-algorithms", log: Any = print,
                         done: dict[str, list[dict[str, Any]]] | None = None,
                         save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every (recipe, seed) run, each in a fresh process (--quick: in this one), then the summary.

    `done` holds runs of an earlier, interrupted or shorter invocation (--resume): a (recipe, seed) found there is
    not run again. `save` gets the summary so far after every run, so hours of runs are never lost to a stop."""
    steps = steps or (2 if quick else 15)
    seeds = seeds or (1 if quick else 3)
    names = list(recipes or (QUICK_RECIPES if quick else RECIPES))
    from rollwise.config import load_config

    for name in names:  # an unknown recipe or a bad override is refused before any run starts
        load_config(None, arm_overrides(name, 0, steps, output_dir, quick, model, list(extra or [])))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    arms: dict[str, list[dict[str, Any]]] = {name: list((done or {}).get(name, [])) for name in names}
    commit = _commit()

    def summary(final: bool = False) -> dict[str, Any]:
        out = summarise({n: sorted(runs, key=lambda r: r["seed"]) for n, runs in arms.items() if runs}, quick,
                        project_gpu=final)
        commits = sorted({str(r.get("commit")) for runs in arms.values() for r in runs})
        out.update({"steps": steps, "seeds": seeds, "early_step": min(EARLY_STEP, steps),
                    "model": model or ("tiny:0" if quick else "the default config's"), "runs": arms,
                    "complete": all(len(runs) >= seeds for runs in arms.values()), "commits": commits})
        out["markdown"] = markdown_table(out)
        return out

    pending = [(name, seed) for seed in range(seeds) for name in names
               if not any(r["seed"] == seed for r in arms[name])]
    if pending and not quick:
        _warm_up(f"{output_dir}/{stamp}/warm-up", model, list(extra or []), log)
    # Seed by seed, every recipe in turn: a drift in the machine's speed during the hours this takes falls on
    # every recipe alike, so each seed's ratios to GRPO are measured side by side. Odd seeds run the recipes in
    # reverse: over seeds no recipe is always first (the warm-up above takes the first run's slowness; the order
    # guards against what it does not).
    for seed in range(seeds):
        for name in (names if seed % 2 == 0 else names[::-1]):
            if any(r["seed"] == seed for r in arms[name]):
                log(f"{name} seed {seed}: kept from --resume")
                continue
            overrides = arm_overrides(name, seed, steps, f"{output_dir}/{stamp}/{name}-seed{seed}", quick, model,
                                      list(extra or []))
            log(f"{name} seed {seed}: rollwise train {' '.join(overrides)}")
            if quick:
                result = run_arm(overrides)
            else:  # a fresh process per run: its own peak memory, nothing cached from the run before
                with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                    result = pool.submit(run_arm, overrides).result()
            arms[name].append({"seed": seed, "commit": commit, **result})
            if save is not None:
                save(summary())
    return summary(final=True)


def _commit() -> str | None:
    """The checked-out commit (recorded per run: runs resumed across sessions may come from different code)."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def load_resume(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The runs of an earlier `rollwise bench algorithms --json PATH` (ValueError saying what is wrong)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--resume {path}: cannot read it as a bench algorithms JSON ({exc})") from None
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, dict) or not all(isinstance(v, list) for v in runs.values()):
        raise ValueError(f"--resume {path}: no 'runs' table of recipe -> runs; give the JSON an earlier "
                         "`rollwise bench algorithms --json` wrote")
    return runs


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.0%}"


def _points(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:+.0f}"


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _projected(result: dict[str, Any], name: str) -> list[str]:
    """The recipe's projected ratio to GRPO per rollout mode (columns only when the projection ran)."""
    modes = result.get("gpu_projection", {}).get("modes", {})
    return [_num(modes[m].get(name, {}).get("ratio_vs_baseline"), ".2f") + "x" for m in modes]


def _rows(result: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, r in result["recipes"].items():
        rows.append([name, str(r["seeds"]), _pct(r["strict_before"]), _pct(r["strict_early"]), _pct(r["strict_after"]),
                     _points(r["gain_end"]), _num(r["step_s"], ".1f"), _num(r["step_ratio_vs_grpo"], ".2f") + "x",
                     _num(r["train_s"], ".1f"), _num(r.get("ref_s"), ".1f"), _num(r.get("critic_s"), ".1f"),
                     _num(r["peak_memory_gb"], ".1f"), *_projected(result, name)])
    return rows


def _header(result: dict[str, Any]) -> list[str]:
    return ["recipe", "seeds", "strict before", f"after {result['early_step']}", "end", "gain (points)", "s/step",
            "vs GRPO", "train s/step", "ref s", "critic s", "peak GB",
            *(f"vs GRPO, GPU {mode} (projected)" for mode in result.get("gpu_projection", {}).get("modes", {}))]


def markdown_table(result: dict[str, Any]) -> str:
    header = _header(result)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(result)]
    return "\n".join(lines)


def format_algorithms_bench(result: dict[str, Any]) -> Table:
    table = Table(title=f"rollwise bench algorithms — {result['model']}, {result['steps']} steps x {result['seeds']} "
                        f"seed(s)" + (" (--quick)" if result["quick"] else ""))
    header = _header(result)
    for i, column in enumerate(header):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in _rows(result):
        table.add_row(*row)
    for goal, met in result["checks"].items():
        table.add_row(f"goal: {goal}", {True: "met", False: "NOT met", None: "—"}[met], *[""] * (len(header) - 2))
    return table


def cli_bench_algorithms(args: Any, console: Console) -> int:
    from rollwise.sim.commands import write_json

    explicit_model = args.model if any(a == "--model" or a.startswith("--model=") for a in _argv()) else None
    recipes = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
    command = " ".join(["rollwise", *_argv()[1:]])

    def save(partial: dict[str, Any]) -> None:  # after every run: an interrupted bench resumes from its JSON
        if args.json is not None:
            write_json(args.json, {**partial, "command": command}, Console(quiet=True))

    try:
        done = load_resume(args.resume) if args.resume is not None else None
        result = run_algorithms_bench(quick=args.quick, steps=args.steps, seeds=args.seeds, recipes=recipes,
                                      model=explicit_model, extra=args.set, log=console.log, done=done, save=save)
    except ValueError as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        return 2
    result["command"] = command
    console.print(format_algorithms_bench(result))
    write_json(args.json, result, console)
    return 0


def _argv() -> list[str]:
    import sys

    return sys.argv

"""`rollwise train`: the GRPO loop (engines placed by rollwise.control.placement: local, Ray or a shared pool).

    problems -> rollout controller (engine on its own thread) -> reward -> advantages -> trainer
             -> weight push -> engine

rollout.mode picks how generation and training interleave (rollwise.rollout.controller): sync
generates a batch, then trains; sorted and async keep the engine generating while the trainer trains.

Every step writes one line of metrics.jsonl; held-out evaluation runs before and after training;
the run ends with summary.json, a curve PNG and a summary table.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from rollwise.config import ConfigError, RunConfig, dump_config
from rollwise.control.controllers import build_controller
from rollwise.control.placement import place
from rollwise.control.placement.base import EngineView, Placement, PlaceRequest
from rollwise.control.preflight import (
    RunInputs, check_machine, check_run_dir, check_space, create_run_dir, discard_unstarted_run, load_inputs,
)
from rollwise.engine.speculation.counters import counters_of, run_summary, step_metrics
from rollwise.types.generation import SamplingParams
from rollwise.model.allocator import keep_freed_memory
from rollwise.model.loading import tokenizer_fingerprint
from rollwise.model.precision import resolve_dtype
from rollwise.observe.bubble import bubble_ratio
from rollwise.observe.memory import MemoryWatch
from rollwise.observe.metrics import LoopMeter, MetricsLogger, StepTimes, loop_meter, read_metrics
from rollwise.observe.plots import plot_rollout_timelines, plot_time_split, plot_training_curve
from rollwise.observe.run_logs import (
    EVAL_SAMPLES_LOG, EVALS_LOG, METRICS_LOG, SAMPLES_LOG, cut_logs, cut_logs_by_step, has_logs, log_sizes,
)
from rollwise.observe.summary import render_summary, total_time_split
from rollwise.types.contracts import RolloutBackend, RolloutControl, Trainer
from rollwise.reward.error_metrics import reward_error_metrics
from rollwise.rollout.data import ProblemStream
from rollwise.rollout.sync_rollout import PromptEncoder
from rollwise.types.sample import Sample
from rollwise.types.task import Problem, Task
from rollwise.control.run_dir import how_to_continue, resolve_run_dir
from rollwise.control.teacher import Teacher
from rollwise.train.policy_loss import resolve_policy_loss


@dataclass
class Run:
    """Everything the loop's phases share."""

    cfg: RunConfig
    run_dir: Path
    task: Task
    problems: dict[str, Problem]
    encoder: PromptEncoder
    engine: EngineView  # owned by `worker`'s thread: only read here (name, timeline)
    worker: RolloutBackend  # where samples are generated (this process, Ray actors, a pool)
    controller: RolloutControl
    trainer: Trainer  # this process, or a proxy to the trainer actor
    placement: Placement  # carries the trainer's weights to `worker` (push_weights)
    progress: Progress
    t0: float
    update_times: list[float] = field(default_factory=list)  # when each weight update landed (timeline plot)
    meter: LoopMeter | None = None  # model FLOPs, MFU and idle cores (None: an architecture it cannot count)
    teacher: Teacher | None = None  # train.teacher: on-policy distillation's teacher engine (rollwise.control.teacher)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def evaluate(run: Run, step: int, label: str) -> dict[str, Any]:
    """Greedy decoding on the held-out split: strict accuracy = exactly one well-formed answer, correct."""
    cfg = run.cfg
    problems = run.task.problems("eval")[: cfg.eval.size]
    if not problems:
        return {}
    params = SamplingParams(max_tokens=cfg.eval.max_tokens or cfg.rollout.max_tokens, temperature=0.0, n=1)
    bar = run.progress.add_task(f"eval ({label})", total=len(problems))
    t = time.monotonic()
    samples = run.controller.evaluate_problems(problems, params, f"{step}",  # agent: episodes with the tools
                                               progress=lambda n: run.progress.advance(bar, n))
    run.placement.scorer.score(samples)  # as training's: the reward pool, or reward.executor inprocess
    run.progress.remove_task(bar)
    n = len(samples)
    result = {
        "step": step,
        "label": label,
        "elapsed_s": time.monotonic() - run.t0,
        "eval_seconds": time.monotonic() - t,
        "n": n,
        "strict_accuracy": sum(s.strict_correct for s in samples) / n,
        "lenient_accuracy": sum(s.lenient_correct for s in samples) / n,
        "format_rate": sum(s.outcome != "unparseable" for s in samples) / n,
        "response_len_mean": sum(len(s.response_ids) for s in samples) / n,
    }
    if run.meter is not None:
        result.update(run.meter.eval_metrics(samples, result["eval_seconds"]))
    with (run.run_dir / EVAL_SAMPLES_LOG).open("a") as f:
        for s in samples:
            f.write(json.dumps({"step": step, "problem_id": s.problem_id, "response": s.response_text,
                                "outcome": s.outcome, "answer": run.problems[s.problem_id].answer}) + "\n")
    return result


def _rollout_metrics(samples: list[Sample]) -> dict[str, Any]:
    n = len(samples)
    lengths = [len(s.response_ids) for s in samples]
    rewards = torch.tensor([s.reward for s in samples])
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if n > 1 else 0.0,
        "strict_accuracy": sum(s.strict_correct for s in samples) / n,
        "lenient_accuracy": sum(s.lenient_correct for s in samples) / n,
        "format_rate": sum(s.outcome != "unparseable" for s in samples) / n,
        "outcome_correct": sum(s.outcome == "correct" for s in samples) / n,
        "outcome_formatted_wrong": sum(s.outcome == "formatted_wrong" for s in samples) / n,
        "outcome_unparseable": sum(s.outcome == "unparseable" for s in samples) / n,
        "truncated_fraction": sum(s.finish_reason == "length" for s in samples) / n,
        "response_len_mean": sum(lengths) / n,
        "response_len_max": max(lengths),
        "reward_errors": sum("reward_error" in s.extra for s in samples),
        **reward_error_metrics(samples),  # reward_errors/<kind>, a reason per kind, the reward worker pids
    }


def train_step(run: Run, step: int, logger: MetricsLogger) -> dict[str, Any]:
    cfg = run.cfg
    t_step = time.monotonic()
    if run.meter is not None:
        run.meter.step_begin()
    timeline = run.engine.timeline  # appended by the engine thread; read-only here

    # 1. rollout (+ reward: the controller scores each group as it completes)
    batch_size = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    bar = run.progress.add_task(f"step {step + 1} generate", total=batch_size)
    score_s0 = run.controller.score_seconds
    # Speculation (engine.speculation): the engine's running totals now, so the record holds this step's.
    spec_before = counters_of(run.engine) if cfg.engine.speculation != "none" else None
    tail = _TailClock(batch_size)

    def progress(n: int) -> None:
        run.progress.update(bar, advance=n)
        tail.advance(n)

    samples = run.controller.next_batch(progress=progress)
    run.progress.remove_task(bar)
    t_gen_end = time.monotonic()
    reward_s = run.controller.score_seconds - score_s0
    # train.teacher: the teacher engine scores the sampled tokens; each token's log-ratio is its reward
    distill = run.teacher.reward(samples) if run.teacher is not None else {}
    # agent: one advantage per episode (a split episode's segments share it)
    zero_var = run.controller.assign_advantages(samples, cfg.train.advantage)
    t_reward_end = time.monotonic()
    if run.meter is not None:
        run.meter.phase_end("generate")  # idle cores while generating (and scoring)

    # 2. train
    version_at_update = run.trainer.version  # the policy the gradient is taken on
    run.controller.before_update()
    train_metrics = run.trainer.train_step(samples)
    run.controller.mark_trained(samples)
    t_train_end = time.monotonic()
    if run.meter is not None:
        run.meter.phase_end("train")

    # 3. weight sync: checked whole, lands between two engine steps; in-flight samples continue or are
    # regenerated. The placement's sender picks the transport (in-process views, Ray's object store, HTTP).
    run.placement.push_weights()
    run.controller.after_update(run.trainer.version)
    t_sync_end = time.monotonic()
    run.update_times.append(t_sync_end)

    gen_s = t_gen_end - t_step
    step_s = t_sync_end - t_step
    generated = sum(len(s.response_ids) for s in samples)
    prompt_tokens = sum(len(s.prompt_ids) for s in samples)
    cached = sum(s.extra.get("cached_prompt_tokens", 0) for s in samples)
    staleness = [st for s in samples for st in s.staleness(version_at_update)]
    record = {
        "step": step + 1,
        "elapsed_s": t_sync_end - run.t0,
        "policy_version": run.trainer.version,
        **_rollout_metrics(samples),
        "zero_variance_groups": zero_var,
        **distill,
        "batch_samples": len(samples),
        "few_shot_fraction": round(cfg.prompt.few_shot_fraction(step) * cfg.rollout.prompts_per_step) / cfg.rollout.prompts_per_step,
        **train_metrics,
        "time_generate_s": gen_s - reward_s,
        "time_reward_s": reward_s + (t_reward_end - t_gen_end),
        "time_train_s": t_train_end - t_reward_end,
        "time_weight_sync_s": t_sync_end - t_train_end,
        "time_step_s": step_s,
        "rollout_tokens_per_s": generated / max(gen_s, 1e-9),
        "trained_tokens_per_s": train_metrics["trained_tokens"] / max(t_train_end - t_reward_end, 1e-9),
        "samples_per_s": len(samples) / max(step_s, 1e-9),
        "prefix_cache_hit_rate": cached / max(prompt_tokens, 1),
        # Bubble ratio over the whole step (training included) and over the rollout phase alone.
        "bubble_ratio": bubble_ratio([run.engine.timeline], [run.engine.max_num_seqs], t_step, t_sync_end),
        "bubble_ratio_rollout": bubble_ratio([timeline], [run.engine.max_num_seqs], t_step, t_gen_end),
        # Versions that sampled the trained tokens vs. the version they were trained at (sync: 0).
        "staleness_mean": sum(staleness) / max(len(staleness), 1),
        "staleness_max": max(staleness, default=0),
        "groups_in_flight": run.controller.in_flight(),
        **run.controller.ledger.waste(),  # regenerated samples, those that had sampled, tokens thrown away
        **run.controller.step_metrics(),
        **run.worker.metrics(),  # ray: engine_restarts
        # The long tail of the rollout: from the moment half the batch's samples had finished until the
        # batch was ready (what speculation shortens).
        "time_rollout_tail_s": tail.since_half(t_gen_end),
    }
    spec_after = counters_of(run.engine) if spec_before is not None else None
    if spec_before is not None and spec_after is not None:  # engines that keep no counters report none
        record.update(step_metrics(spec_before, spec_after))
    if run.meter is not None:  # model FLOPs by phase, MFU overall and per phase, idle core-seconds
        times = StepTimes(generate=record["time_generate_s"], train=record["time_train_s"], step=step_s)
        record.update(run.meter.step_metrics(samples, times))
    logger.log(record)
    with (run.run_dir / SAMPLES_LOG).open("a") as f:
        for s in samples[: cfg.rollout.group_size]:  # one group per step, for reading what the model writes
            f.write(json.dumps({"step": step + 1, "response": s.response_text, "reward": s.reward,
                                "outcome": s.outcome}) + "\n")
    logger.log_samples(step + 1, samples[: cfg.rollout.group_size], run.problems)  # the trackers' table of the step
    return record


class _TailClock:
    """When half of a batch's samples had finished (counted through the controller's progress calls)."""

    def __init__(self, batch_size: int) -> None:
        self.half = max(1, batch_size // 2)
        self.finished = 0
        self.half_at: float | None = None

    def advance(self, n: int) -> None:
        self.finished += n
        if self.half_at is None and self.finished >= self.half:
            self.half_at = time.monotonic()

    def since_half(self, end: float) -> float:
        return end - self.half_at if self.half_at is not None else 0.0


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold blue]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def train(cfg: RunConfig, console: Console | None = None) -> dict[str, Any]:
    """Run GRPO as configured; returns the summary that is also written to summary.json."""
    console = console or Console()
    t0 = time.monotonic()
    keep_freed_memory()  # (already done by the CLI; here for train() called from Python)
    check_machine(cfg)  # before torch.set_num_threads, which takes threads=100000 and then crashes
    resolve_policy_loss(cfg.train)  # a custom train.policy_loss: imported and tried on a dummy batch, before loading
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    _seed_everything(cfg.seed)

    run_dir, resume_dir = resolve_run_dir(cfg, lambda message: console.print(f"[bold red]warning:[/] {escape(message)}"))
    # Bad inputs are refused before anything is written (rollwise.control.preflight): the run directory is
    # created only once it is writable, the model and the task are loaded and its disk has room for them.
    check_run_dir(run_dir)
    memory = MemoryWatch(lambda message: console.print(f"[bold red]warning:[/] {message}"), _memory_hints(cfg)).start()
    created: Path | None = None
    try:
        with console.status(f"loading model {cfg.model} and task {cfg.task.name or cfg.task.path}"):
            inputs = load_inputs(cfg)
        check_space(cfg, run_dir, inputs.model)
        created = create_run_dir(run_dir, yaml.safe_dump(dump_config(cfg), sort_keys=False))
        return _train(cfg, console, t0, run_dir, resume_dir, memory, inputs)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (rollwise.control.stop_signal): everything is closed by now
        if run_dir.exists():
            console.print(how_to_continue(cfg, run_dir))
        raise
    except Exception:
        discard_unstarted_run(run_dir, created)  # failed before logging anything: no directory holding only config.yaml
        raise
    finally:
        memory.stop()


def _memory_hints(cfg: RunConfig) -> str:
    """The settings that size this run's memory, with their values, for the low-memory warning."""
    return (f"engine.kv_cache_gib={cfg.engine.kv_cache_gib} (vLLM's KV cache on CPU), "
            f"engine.max_num_seqs={cfg.engine.max_num_seqs}, train.micro_batch_tokens={cfg.train.micro_batch_tokens} "
            f"and train.micro_batch_size={cfg.train.micro_batch_size} (activations per forward)")


def _train(cfg: RunConfig, console: Console, t0: float, run_dir: Path, resume_dir: Path | None,
           memory: MemoryWatch, inputs: RunInputs) -> dict[str, Any]:
    """train()'s body, inside the memory watch (which started before anything big loads)."""
    model, tokenizer, task = inputs.model, inputs.tokenizer, inputs.task
    train_problems, eval_problems = inputs.train_problems, inputs.eval_problems
    with console.status("this machine's matmul peak (measured once, then cached)"):  # before any engine runs
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtypes = [resolve_dtype(cfg.engine.dtype, device), resolve_dtype(cfg.train.compute_dtype, device)]
        meter = loop_meter(model, cfg.train, overlapped=cfg.rollout.mode != "sync", compute_dtypes=dtypes)
    problems = {p.id: p for p in train_problems + eval_problems}
    fingerprint = tokenizer_fingerprint(tokenizer)
    # before any engine starts: refused early (placement: ray: on a teacher actor of the run's placement group)
    teacher = None if cfg.train.teacher is None else Teacher.for_run(cfg, tokenizer)

    def check_resume(state: dict[str, Any]) -> None:
        """Before any engine starts: the checkpoint must fit this configuration."""
        consumed = state.get("problems_consumed")
        step = int(state["step"])
        if cfg.rollout.mode == "sync" and consumed is not None and consumed != step * cfg.rollout.prompts_per_step:
            raise ConfigError(
                f"checkpoint consumed {consumed} problems in {step} steps, but rollout.prompts_per_step="
                f"{cfg.rollout.prompts_per_step} would place it at {step * cfg.rollout.prompts_per_step}: "
                "resume with the prompts_per_step the run was started with, or problems would be skipped or repeated"
            )

    # Placement says where the trainer, the engines and the reward run (this process, Ray actors, or a
    # shared pool); the engines start from the trainer's current weights (a resumed run's included).
    placement = place(PlaceRequest(cfg, model, tokenizer, fingerprint, problems, task, resume_dir, check_resume))
    trainer, scorer = placement.trainer, placement.scorer
    start_step = 0
    start_group, pending_groups = 0, []
    logs_cut = False  # the run's logs were cut back to where this run starts (TensorBoard's too, below)
    if placement.resumed is not None:
        state = placement.resumed
        start_step = int(state["step"])
        start_group = int(state.get("next_group", start_step * cfg.rollout.prompts_per_step))
        pending_groups = list(state.get("pending_groups", []))
        # Whatever was logged after the checkpoint is logged again from here: cut back, so each record is there once.
        if state.get("log_sizes") is not None:
            cut_logs(run_dir, state["log_sizes"])
        else:  # a checkpoint written through the Python API, without the loop's log sizes
            cut_logs_by_step(run_dir, start_step)
        logs_cut = True
        console.print(f"[green]resumed[/] from {resume_dir} at step {start_step} (policy version {trainer.version})")
        if cfg.train.lora is not None:  # the engines start from the base: give them the adapter
            placement.push_weights()
    elif cfg.checkpoint.resume == "auto" and has_logs(run_dir):
        console.print(f"[yellow]no checkpoint[/] in {escape(str(run_dir))} (stopped before its first one): "
                      "starting it again from step 0, its logs cut")
        cut_logs(run_dir, {})
        logs_cut = True
    engine, worker = placement.engine, placement.backend
    encoder = PromptEncoder(tokenizer, cfg.prompt, cfg.reward)
    stream = ProblemStream(train_problems, cfg.seed)
    controller, end_controller = build_controller(
        cfg, worker, tokenizer, encoder, stream, scorer, policy_version=trainer.version, updates=start_step,
        start_group=start_group, pending_groups=pending_groups)

    n_params = sum(p.numel() for p in model.parameters())
    console.print(
        f"[bold]rollwise train[/]  model={cfg.model} ({n_params / 1e6:.0f}M params)  engine={placement.description} "
        f"(max_num_seqs={cfg.engine.max_num_seqs})  rollout={cfg.rollout.mode}"
        + (f" (eta={cfg.rollout.max_staleness}, correction={cfg.train.off_policy_correction})"
           if cfg.rollout.mode != "sync" else "")
        + f"  task={task.name}  train={len(train_problems)} "
        f"eval={len(eval_problems)}  steps={cfg.train.steps}  batch={cfg.rollout.prompts_per_step}x"
        f"{cfg.rollout.group_size}  lr={cfg.train.lr}\n  run dir: {run_dir}\n"
        f"  tokenizer fingerprint: {fingerprint[:16]}…" + (f"\n  teacher: {teacher.describe()}" if teacher else "")
    )

    logger = MetricsLogger(run_dir, tensorboard=cfg.tensorboard, purge_after_step=start_step if logs_cut else None,
                           tracking=cfg.logging, config=dump_config(cfg))
    evals_path = run_dir / EVALS_LOG
    try:
        with _progress(console) as progress:
            run = Run(cfg, run_dir, task, problems, encoder, engine, worker, controller, trainer, placement, progress, t0,
                      meter=meter, teacher=teacher)

            def record_eval(step: int, label: str) -> dict[str, Any]:
                result = evaluate(run, step, label)
                if result:
                    with evals_path.open("a") as f:
                        f.write(json.dumps(result) + "\n")
                    logger.log_eval(result)
                    progress.console.print(
                        f"[cyan]eval[/] {label:>6} step {step:>3}: strict accuracy {result['strict_accuracy']:.1%}  "
                        f"format {result['format_rate']:.1%}  last-number {result['lenient_accuracy']:.1%}"
                    )
                return result

            if start_step == 0:
                record_eval(0, "before")
            steps_bar = progress.add_task("training steps", total=cfg.train.steps, completed=start_step)
            t_loop = time.monotonic()
            for step in range(start_step, cfg.train.steps):
                record = train_step(run, step, logger)
                progress.advance(steps_bar)
                progress.console.print(
                    f"step {record['step']:>3}  reward {record['reward_mean']:.3f}  strict {record['strict_accuracy']:.1%}"
                    f"  format {record['format_rate']:.1%}  len {record['response_len_mean']:.0f}"
                    f"  zero-var {record['zero_variance_groups']:.0%}  gen {record['time_generate_s']:.1f}s"
                    f"  train {record['time_train_s']:.1f}s  bubble {record['bubble_ratio']:.2f}"
                    + (f"  MFU {record['mfu_step']:.0%}" if record.get("mfu_step") is not None else "")
                    + (f"  spec {record['spec_accepted']:.0f}/{record['spec_drafted']:.0f} accepted"
                       f"  tail {record['time_rollout_tail_s']:.1f}s" if "spec_drafted" in record else "")
                )
                done = step + 1
                if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.train.steps:
                    record_eval(done, "mid")
                if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == cfg.train.steps:
                    extra = {"tokenizer_fingerprint": fingerprint, "problems_consumed": done * cfg.rollout.prompts_per_step,
                             # Started but untrained groups are generated again on resume: none lost.
                             "next_group": controller.next_group, "pending_groups": controller.pending_groups(),
                             # Where a resume from this checkpoint cuts the logs back to (rollwise.observe.run_logs).
                             "log_sizes": log_sizes(run_dir)}
                    # The Ray trainer actor writes it itself (run_dir on a filesystem it shares with this process).
                    trainer.save_checkpoint(run_dir, done, extra, cfg.checkpoint.keep_last)
            t_loop_end = time.monotonic()
            controller.close("the run ended")  # samples still in flight are recorded as dropped
            final_eval = record_eval(cfg.train.steps, "after")
    finally:
        end_controller()
        try:
            placement.close()  # also on errors: a live engine thread at exit aborts the interpreter
        finally:
            if teacher is not None:
                teacher.close()
            logger.close()  # also on errors: trackers end their runs (MLflow's would stay RUNNING)

    records = read_metrics(run_dir / METRICS_LOG)
    evals = [json.loads(line) for line in evals_path.read_text().splitlines()] if evals_path.exists() else []
    curve = plot_training_curve(records, evals, run_dir / "curve.png")
    # The picture of the bubbles: running sequences over the training loop, weight updates marked.
    loop_timeline = [(t - t_loop, n) for t, n in engine.timeline if t_loop <= t <= t_loop_end]
    timeline_png = plot_rollout_timelines(
        {f"engine-0 ({cfg.rollout.mode})": (loop_timeline, [t - t_loop for t in run.update_times])},
        engine.max_num_seqs, run_dir / "timeline.png")
    before = next((e for e in evals if e["label"] == "before"), None)
    summary = {
        "run_dir": str(run_dir),
        "model": cfg.model,
        "task": task.name,
        "engine": engine.name,
        "steps": cfg.train.steps,
        "policy_version": trainer.version,
        "wall_time_s": time.monotonic() - t0,
        "eval_before": before,
        "eval_after": final_eval or None,
        "strict_accuracy_gain": (final_eval["strict_accuracy"] - before["strict_accuracy"])
        if before and final_eval else None,
        "train_reward_first": records[0]["reward_mean"] if records else None,
        "train_reward_last": records[-1]["reward_mean"] if records else None,
        "rollout_mode": cfg.rollout.mode,
        "mean_bubble_ratio": sum(r["bubble_ratio"] for r in records) / len(records) if records else None,
        # Over the whole training loop (mid-run evaluations included: the engine serves them too).
        "bubble_ratio_run": bubble_ratio([engine.timeline], [engine.max_num_seqs], t_loop, t_loop_end),
        "samples": controller.ledger.counts(),
        **controller.ledger.waste(),
        **worker.metrics(),  # ray: engine_restarts
        **run_summary(records),  # speculation totals and tail time over the run
        "peak_rss_gb": _peak_rss_gb(),
        **memory.summary(),  # with its children (a vLLM engine core), the machine's lowest available memory
        "tokenizer_fingerprint": fingerprint,
        "artifacts": {"metrics": "metrics.jsonl", "evals": "evals.jsonl", "curve": curve.name, "timeline": timeline_png.name,
                      "tensorboard": "tensorboard/" if cfg.tensorboard else None, "checkpoints": "checkpoints/"},
    }
    if meter is not None:  # MFU overall and per phase, idle core-seconds, FLOPs by phase, the peak
        summary.update(meter.run_metrics(summary["wall_time_s"]))
    summary["time_split_s"] = total_time_split(records, evals, summary["wall_time_s"])  # adds up to the wall time
    summary["artifacts"]["time_split"] = plot_time_split(records, evals, summary, run_dir / "time_split.png").name
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(render_summary(summary, records))
    return summary


def _peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 / 1024  # Linux reports KiB

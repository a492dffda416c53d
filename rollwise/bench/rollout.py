"""Rollout benchmark: sync vs sorted vs async on the real engine and trainer, side by side.

Every mode trains the same number of samples from the same start weights, on the same prompts,
with the same seeded long-tailed output lengths (lognormal max_tokens, EOS ignored), so the runs
do identical useful work and differ only in scheduling. Rewards are seeded random numbers so that
every group carries advantage and every update really trains (this measures the system, not
learning; the learning comparison is a `rollwise train` run per mode, see docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.table import Table

from rollwise.config import RunConfig
from rollwise.types.engine_config import EngineConfig
from rollwise.engine.factory import create_engine
from rollwise.observe.bubble import bubble_ratio
from rollwise.observe.plots import plot_rollout_timelines
from rollwise.reward.batch import Unscored
from rollwise.rollout.controller import RolloutController
from rollwise.rollout.data import ProblemStream
from rollwise.rollout.sync_rollout import PromptEncoder
from rollwise.types.sample import Sample
from rollwise.engine.core import EngineWorker
from rollwise.sync.inprocess import push_weights
from rollwise.tasks import make_task
from rollwise.train.advantages import assign_advantages
from rollwise.train.trainer import GRPOTrainer
from rollwise.types.microbatch import computed_tokens

MODES = ("sync", "sorted", "async")


@dataclass
class Workload:
    updates: int
    prompts_per_step: int
    group_size: int
    max_num_seqs: int
    median_tokens: int
    sigma: float
    max_tokens: int
    eta: int = 1


QUICK = Workload(updates=4, prompts_per_step=4, group_size=4, max_num_seqs=32, median_tokens=24, sigma=0.9,
                 max_tokens=160)
FULL = Workload(updates=6, prompts_per_step=4, group_size=4, max_num_seqs=32, median_tokens=32, sigma=1.0,
                max_tokens=256, eta=2)


def forced_lengths(seed: int, w: Workload):
    """(group, sample) -> forced length: a pure function of the seed, identical in every mode."""

    def length(group: int, sample: int) -> int:
        rng = np.random.default_rng([seed, group, sample])
        return int(np.clip(round(rng.lognormal(math.log(w.median_tokens), w.sigma)), 1, w.max_tokens))

    return length


def _random_rewards(samples: list[Sample], seed: int) -> None:
    for s in samples:
        g, i = s.extra["group_index"], s.extra["sample_index"]
        s.reward = float(np.random.default_rng([seed, g, i, 7]).random())
    assign_advantages(samples, "mean_std")


def bench_config(mode: str, w: Workload, seed: int, update_batch: str = "fixed") -> RunConfig:
    """The run config of one mode of this benchmark (the simulator's validation uses it too);
    update_batch: rollout.update_batch (issue 26: `rollwise sim validate --update-batch flexible`)."""
    return RunConfig.model_validate({
        "model": "bench", "seed": seed,
        "task": {"kind": "reasoning_gym", "name": "basic_arithmetic", "train_size": 64, "eval_size": 0,
                 "params": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}},
        "rollout": {"mode": mode, "prompts_per_step": w.prompts_per_step, "group_size": w.group_size,
                    "max_tokens": w.max_tokens, "max_staleness": w.eta, "oversubscription": w.eta + 1.0,
                    "update_batch": update_batch},
        "engine": {"max_num_seqs": w.max_num_seqs, "max_model_len": w.max_tokens + 128},
        "train": {"steps": w.updates, "lr": 1e-6, "micro_batch_size": 8},
    })


def with_kind(section: EngineConfig, kind: str) -> EngineConfig:
    """The benchmark's engine section with the engine kind asked for on the command line (validated)."""
    return EngineConfig.model_validate({**section.model_dump(), "kind": kind})


def _run_mode(mode: str, model: Any, tokenizer: Any, base_state: dict, w: Workload, seed: int,
              engine_kind: str = "reference", update_batch: str = "fixed") -> dict[str, Any]:
    model.load_state_dict(base_state)  # every mode starts from the same weights
    cfg = bench_config(mode, w, seed, update_batch)
    task = make_task(cfg.task)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer = GRPOTrainer(model, cfg.train, pad_token_id=pad)
    engine = create_engine(with_kind(cfg.engine, engine_kind), model, tokenizer, seed=seed)
    worker = EngineWorker(engine)
    controller = RolloutController(cfg, worker, PromptEncoder(tokenizer, cfg.prompt, cfg.reward),
                                   ProblemStream(task.problems("train"), seed), Unscored(),
                                   length_fn=forced_lengths(seed, w))
    staleness: list[int] = []
    trained_tokens = 0
    updates_at: list[float] = []
    per_step: list[dict[str, float]] = []  # where the time goes: waiting for the batch, training on it
    t0 = time.monotonic()
    for _ in range(w.updates):
        ta = time.monotonic()
        batch = controller.next_batch()
        _random_rewards(batch, seed)
        version = trainer.version
        staleness += [version - v for s in batch for v in s.versions]
        controller.before_update()
        tb = time.monotonic()
        trainer.train_step(batch)
        per_step.append({"rollout_s": tb - ta, "train_s": time.monotonic() - tb,
                         "train_tokens": computed_tokens(batch, cfg.train)})
        controller.mark_trained(batch)
        trained_tokens += sum(len(s.response_ids) for s in batch)
        push_weights(trainer.model, [worker], trainer.version)
        controller.after_update(trainer.version)
        updates_at.append(time.monotonic())
    t1 = time.monotonic()
    controller.close("benchmark over")
    worker.close()
    getattr(engine, "close", lambda: None)()
    timeline = list(engine.timeline)
    wall = t1 - t0
    n_samples = controller.ledger.counts()["trained"]  # a flexible update batch trains what finished
    return {
        "mode": mode,
        "wall_s": wall,
        "bubble_ratio": bubble_ratio([timeline], [w.max_num_seqs], t0, t1),
        "samples_per_s": n_samples / wall,
        "trained_tokens_per_s": trained_tokens / wall,
        "trained_samples": n_samples,
        "staleness_mean": float(np.mean(staleness)),
        "staleness_max": int(max(staleness)),
        **controller.ledger.waste(),
        "generated_tokens": engine.stats["generated_tokens"],
        "per_step": per_step,
        "_timeline": [(t - t0, n) for t, n in timeline if t0 <= t <= t1],
        "_updates": [t - t0 for t in updates_at],
    }


def run_rollout_bench(model: Any, tokenizer: Any, *, quick: bool = False, seed: int = 0,
                      plot: Path | None = None, modes: tuple[str, ...] = MODES,
                      engine_kind: str = "reference", update_batch: str = "fixed") -> dict[str, Any]:
    """engine_kind: "reference" or "vllm" (the CLI passes vLLM when installed)."""
    w = QUICK if quick else FULL
    base_state = copy.deepcopy(model.state_dict())
    results = [_run_mode(mode, model, tokenizer, base_state, w, seed, engine_kind, update_batch) for mode in modes]
    model.load_state_dict(base_state)
    sync = next((r for r in results if r["mode"] == "sync"), None)
    if sync is not None:
        for r in results:
            r["bubble_ratio_vs_sync"] = r["bubble_ratio"] / sync["bubble_ratio"] if sync["bubble_ratio"] else None
            r["samples_per_s_vs_sync"] = r["samples_per_s"] / sync["samples_per_s"]
            r["wall_vs_sync"] = r["wall_s"] / sync["wall_s"]
    if plot is not None:
        plot_rollout_timelines({r["mode"]: (r["_timeline"], r["_updates"]) for r in results}, w.max_num_seqs, plot)
    return {
        "engine": engine_kind,
        "workload": w.__dict__,
        "threads": torch.get_num_threads(),
        "modes": [{k: v for k, v in r.items() if not k.startswith("_")} for r in results],
        "timeline_png": str(plot) if plot else None,
    }


def format_rollout_bench(result: dict[str, Any]) -> Table:
    w = result["workload"]
    table = Table(title=f"rollout modes: {w['updates']} updates x {w['prompts_per_step']} groups x "
                        f"{w['group_size']} samples, lognormal lengths (median {w['median_tokens']}, "
                        f"cap {w['max_tokens']}), eta={w['eta']}, engine={result.get('engine', 'reference')}")
    for col in ("mode", "wall s", "bubble", "bubble vs sync", "samples/s", "vs sync", "trained tok/s",
                "staleness mean/max", "regenerated"):
        table.add_column(col, justify="right")
    for r in result["modes"]:
        vs = r.get("bubble_ratio_vs_sync")
        table.add_row(
            r["mode"], f"{r['wall_s']:.1f}", f"{r['bubble_ratio']:.2f}",
            f"{(1 - vs):+.0%} lower" if vs is not None and r["mode"] != "sync" else "-",
            f"{r['samples_per_s']:.2f}",
            f"{r['samples_per_s_vs_sync']:.2f}x" if "samples_per_s_vs_sync" in r else "-",
            f"{r['trained_tokens_per_s']:.0f}", f"{r['staleness_mean']:.2f} / {r['staleness_max']}",
            str(r["samples_regenerated"]),
        )
    return table

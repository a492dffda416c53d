"""`rollwise bench speculation`: the same rollouts with and without speculation from rollout history
(issue 19), on vLLM (the default engine) and on the reference engine, side by side.

Workloads (each one per engine, with and without engine.speculation=history):
- the default task's prompts (rollwise/configs/default.yaml: 8 problems x 16 samples, <= 48 tokens) at
  low temperature, standing in for a checkpoint late in training (the default run ends near entropy
  0.04: siblings and earlier rollouts nearly agree), and at T = 1 for one early in training;
- the long-tailed workload of `bench rollout` (its seeded lognormal lengths, EOS ignored), at the low
  temperature: the tail is where drafts pay (few sequences running, decoding memory-bound).
Each workload runs two rounds over the same prompts on the same engine: the first (untimed) is "the
previous training step" and fills the drafter's history (cleared between workloads); the second is
timed. The engine without speculation runs the same two rounds (the prefix cache warms alike).
Reported: rollout wall time with and without, their ratio, tail-phase time (after half the samples
finished), tokens/s by active batch size (sequences running in the step), acceptance rate, mean
accepted length per verification. Wall time depends on the machine: run it on an idle one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.table import Table
from torch import nn

from rollwise.config import load_config
from rollwise.types.engine_config import EngineConfig
from rollwise.engine.contract import add_all
from rollwise.engine.factory import create_engine
from rollwise.engine.speculation.counters import counters_of, step_metrics
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.rollout.sync_rollout import PromptEncoder
from rollwise.tasks import make_task

LATE_T, EARLY_T = 0.3, 1.0


@dataclass(frozen=True)
class Workload:
    name: str
    temperature: float
    prompts: list[list[int]]
    group: int
    max_tokens: int
    length: Callable[[int, int], int] | None = None  # (prompt, sample) -> forced length (EOS ignored)

    def requests(self, round_tag: str, seed: int) -> list[GenerationRequest]:
        """One n-sample request per prompt; with forced lengths one request per sample (its own max_tokens)."""
        if self.length is None:
            return [GenerationRequest(f"{round_tag}-{i}", ids, SamplingParams(
                max_tokens=self.max_tokens, temperature=self.temperature, n=self.group, seed=seed + 1000 * i))
                for i, ids in enumerate(self.prompts)]
        return [GenerationRequest(f"{round_tag}-{i}-{j}", ids, SamplingParams(
            max_tokens=self.length(i, j), temperature=self.temperature, ignore_eos=True, seed=seed + 1000 * i + j))
            for i, ids in enumerate(self.prompts) for j in range(self.group)]


def _task_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """The default run's first `count` training prompts, through its chat template and few-shot examples."""
    cfg = load_config()
    encode = PromptEncoder(tokenizer, cfg.prompt, cfg.reward)
    return [encode(problem) for problem in make_task(cfg.task).problems("train")[:count]]


def _lognormal_lengths(seed: int, median: int, sigma: float, cap: int) -> Callable[[int, int], int]:
    """`bench rollout`'s long tail: a seeded lognormal length per (prompt, sample), in [1, cap]."""
    def length(group: int, sample: int) -> int:
        rng = np.random.default_rng([seed, group, sample])
        return int(np.clip(round(rng.lognormal(math.log(median), sigma)), 1, cap))
    return length


def workloads(tokenizer: Any, quick: bool, seed: int) -> list[Workload]:
    prompts, group, max_tokens = (2, 4, 16) if quick else (8, 16, 48)  # the default run's step shape
    task = _task_prompts(tokenizer, max(prompts, 4))
    # bench rollout's FULL workload (4 x 4, median 32, sigma 1, <= 256); quick: shorter.
    tail_median, tail_cap = (8, 32) if quick else (32, 256)
    return [
        Workload("task, late (T=0.3)", LATE_T, task[:prompts], group, max_tokens),
        Workload("task, early (T=1.0)", EARLY_T, task[:prompts], group, max_tokens),
        Workload("long tail, late (T=0.3)", LATE_T, task[:4] if not quick else task[:2], 4, tail_cap,
                 _lognormal_lengths(seed, tail_median, 1.0, tail_cap)),
    ]


def _bucket(running: int) -> str:
    """Active batch size bucket: 1, 2-3, 4-7, 8-15, ... (powers of two)."""
    low = 1 << (max(running, 1).bit_length() - 1)
    return "1" if low == 1 else f"{low}-{2 * low - 1}"


def timed_round(engine: Any, requests: list[GenerationRequest]) -> dict[str, Any]:
    """Step the engine over `requests` until all finish: wall time, tail-phase time (from half the samples
    finished to the last), tokens, and tokens/s per active-batch-size bucket (the running count at each step)."""
    total = sum(r.params.n for r in requests)
    emitted = [0]
    engine.on_tokens = lambda *_: emitted.__setitem__(0, emitted[0] + 1)
    by_bucket: dict[str, list[float]] = {}  # bucket -> [tokens, seconds]
    done, half_at = 0, None
    start = time.perf_counter()
    add_all(engine, requests)
    try:
        while engine.has_unfinished():
            running, before, t0 = engine.num_running, emitted[0], time.perf_counter()
            done += len(engine.step())
            now = time.perf_counter()
            cell = by_bucket.setdefault(_bucket(running), [0.0, 0.0])
            cell[0] += emitted[0] - before
            cell[1] += now - t0
            if half_at is None and done >= total / 2:
                half_at = now
    finally:
        engine.on_tokens = None
    end = time.perf_counter()
    order = sorted(by_bucket, key=lambda b: int(b.split("-")[0]))
    return {"wall_s": end - start, "tail_s": end - (half_at or end), "tokens": emitted[0],
            "tokens_per_s_by_running": {b: by_bucket[b][0] / by_bucket[b][1] for b in order if by_bucket[b][1] > 0}}


def _run_engine(kind: str, spec: bool, model: nn.Module, tokenizer: Any, loads: list[Workload],
                seed: int, quick: bool, engine_section: EngineConfig) -> list[dict[str, Any]]:
    """Every workload on one engine (one vLLM start): untimed history round, then the timed round."""
    # The default run's engine section (max_num_seqs 64: a 128-sample step runs in two waves, as in training);
    # quick: a small one (the reference engine allocates its whole KV cache up front).
    sizes = {"max_num_seqs": 16, "max_model_len": 512} if quick else {}
    cfg = EngineConfig.model_validate({**engine_section.model_dump(), **sizes, "kind": kind,
                                       "speculation": "history" if spec else "none"})
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
    engine = create_engine(cfg, model, tokenizer, seed=seed, eos_token_ids=eos)
    out = []
    try:
        for load in loads:
            if engine.drafter is not None:
                engine.drafter.clear()
            engine.generate(load.requests("warm", seed))
            before = counters_of(engine)
            result = timed_round(engine, load.requests("timed", seed + 1))
            after = counters_of(engine)
            if engine.drafter is not None and before is not None and after is not None:
                result["metrics"] = step_metrics(before, after)
                result["metrics"]["spec_history_tokens"] = float(engine.drafter.memory()["tokens"])
            out.append(result)
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    return out


def run_speculation_bench(model: nn.Module, tokenizer: Any, *, quick: bool = False, seed: int = 0,
                          engines: Sequence[str] = ("reference",), overrides: Sequence[str] = ()) -> dict[str, Any]:
    loads = workloads(tokenizer, quick, seed)
    # `overrides` (--set engine.dtype=float32): the engine section as `rollwise train` would read it
    engine_section = load_config(None, list(overrides)).engine
    rows = []
    for kind in engines:
        plain = _run_engine(kind, False, model, tokenizer, loads, seed, quick, engine_section)
        spec = _run_engine(kind, True, model, tokenizer, loads, seed, quick, engine_section)
        for load, p, s in zip(loads, plain, spec):
            rows.append({"engine": kind, "setting": load.name, "temperature": load.temperature,
                         "samples": len(load.prompts) * load.group, "plain": p, "spec": s,
                         "metrics": s.pop("metrics"), "speedup": p["wall_s"] / max(s["wall_s"], 1e-9)})
    return {"quick": quick, "engines": list(engines), "overrides": list(overrides),
            "engine_dtype": engine_section.dtype, "rows": rows}


def format_speculation_bench(result: dict[str, Any]) -> Table:
    table = Table(title="speculation from rollout history: the same rollouts with and without (timed round)")
    for col in ("engine", "workload", "samples", "plain s", "spec s", "speedup", "tail s plain / spec",
                "acceptance", "accepted / verification", "tokens/s by running: plain -> spec"):
        table.add_column(col)
    for r in result["rows"]:
        m, p, s = r["metrics"], r["plain"]["tokens_per_s_by_running"], r["spec"]["tokens_per_s_by_running"]
        rates = " ".join(f"{b}:{p.get(b, 0):.0f}->{s.get(b, 0):.0f}" for b in dict.fromkeys([*p, *s]))
        table.add_row(r["engine"], r["setting"], str(r["samples"]), f"{r['plain']['wall_s']:.2f}",
                      f"{r['spec']['wall_s']:.2f}", f"{r['speedup']:.2f}x",
                      f"{r['plain']['tail_s']:.2f} / {r['spec']['tail_s']:.2f}", f"{m['spec_acceptance_rate']:.2f}",
                      f"{m['spec_mean_accepted_length']:.2f}", rates)
    return table

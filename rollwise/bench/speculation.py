"""`rollwise bench speculation`: the same rollout workload with and without speculation from rollout
history (issue 19), on the reference engine, side by side.

Each setting runs two rounds of GRPO groups over the same prompts: the first (untimed) is "the
previous training step" and fills the drafter's history; the second is timed. The engine without
speculation runs the same two rounds. Low temperature stands in for late training (low entropy:
siblings and earlier rollouts nearly agree); T = 1 for early training.
Reported: rollout wall time with and without, their ratio, tail-phase time (after half the samples
finished), acceptance rate and mean accepted length per verification.
"""

from __future__ import annotations

import time
from typing import Any

from rich.table import Table
from torch import nn

from rollwise.engine.reference import ReferenceEngine
from rollwise.engine.speculation import HistoryDrafter
from rollwise.engine.types import GenerationRequest, SamplingParams

QUESTIONS = ["What is 17 + 25?", "Name three primary colors.", "What is 9 times 7?", "Spell 'rollout' backwards.",
             "What is the capital of France?", "Count from 1 to 10.", "What is 144 / 12?", "Why is the sky blue?"]


def _requests(tokenizer: Any, round_tag: str, prompts: int, group: int, max_tokens: int,
              temperature: float, seed: int) -> list[GenerationRequest]:
    reqs = []
    for i, question in enumerate((QUESTIONS * 4)[:prompts]):
        ids = tokenizer.encode(f"Question {i}: {question}\nAnswer:")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, n=group, seed=seed + 1000 * i)
        reqs.append(GenerationRequest(f"{round_tag}-{i}", ids, params))
    return reqs


def _timed_round(engine: ReferenceEngine, requests: list[GenerationRequest]) -> dict[str, float]:
    total = sum(r.params.n for r in requests)
    done, half_at = 0, None

    def progress(n: int) -> None:
        nonlocal done, half_at
        done += n
        if half_at is None and done >= total / 2:
            half_at = time.perf_counter()

    start = time.perf_counter()
    out = engine.generate(requests, progress)
    end = time.perf_counter()
    return {"wall_s": end - start, "tail_s": end - (half_at or end),
            "tokens": float(sum(len(c.token_ids) for c in out))}


def run_speculation_bench(model: nn.Module, tokenizer: Any, *, quick: bool = False, seed: int = 0) -> dict[str, Any]:
    prompts, group, max_tokens = (2, 4, 24) if quick else (8, 16, 128)
    settings = [("late (T=0.3)", 0.3), ("early (T=1.0)", 1.0)]
    rows = []
    for label, temperature in settings:
        row: dict[str, Any] = {"setting": label, "temperature": temperature}
        for spec in (False, True):
            engine = ReferenceEngine(model, max_num_seqs=prompts * group, max_model_len=512, seed=seed,
                                     eos_token_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None,
                                     drafter=HistoryDrafter() if spec else None)
            engine.generate(_requests(tokenizer, "warm", prompts, group, max_tokens, temperature, seed))
            timed = _timed_round(engine, _requests(tokenizer, "timed", prompts, group, max_tokens, temperature,
                                                   seed + 1))
            row["spec" if spec else "plain"] = timed
            if spec:
                row["metrics"] = engine.speculation_metrics()
        row["speedup"] = row["plain"]["wall_s"] / max(row["spec"]["wall_s"], 1e-9)
        rows.append(row)
    return {"quick": quick, "prompts": prompts, "group_size": group, "max_tokens": max_tokens, "rows": rows}


def format_speculation_bench(result: dict[str, Any]) -> Table:
    table = Table(title=f"speculation from rollout history (reference engine; {result['prompts']} prompts x "
                  f"{result['group_size']} samples, <= {result['max_tokens']} tokens)")
    for col in ("setting", "plain s", "spec s", "speedup", "plain tail s", "spec tail s", "acceptance",
                "mean accepted len", "history tokens"):
        table.add_column(col)
    for r in result["rows"]:
        m = r["metrics"]
        table.add_row(r["setting"], f"{r['plain']['wall_s']:.2f}", f"{r['spec']['wall_s']:.2f}", f"{r['speedup']:.2f}x",
                      f"{r['plain']['tail_s']:.2f}", f"{r['spec']['tail_s']:.2f}", f"{m['spec_acceptance_rate']:.2f}",
                      f"{m['spec_mean_accepted_length']:.2f}", f"{m['spec_history_tokens']:.0f}")
    return table

"""`rollwise bench trainer --memory` (issue 41 item 7): a train step's peak memory against response length.

One sample (a 64-token prompt and a response of 512 ... 16k tokens, SmolLM2 by default) per train step,
each length in a fresh process (a process's memory high-water mark only rises, and memory it freed stays
with it). In that process: the model and the trainer, one short warm-up step (gradients and AdamW state
exist from then on: they do not grow with length), then the resident size as the base, the kernel's
high-water mark reset (/proc/self/clear_refs), the measured step, and the high-water mark again. The step's
memory is high-water mark - base; per token, that over the response length. Linear growth keeps it
constant; a [tokens x vocabulary] logits tensor or a [tokens x tokens] attention matrix makes it grow.

Arms: today's defaults, and train.gradient_checkpointing=true. A length whose memory, extrapolated from
the arm's longest measured one, would not fit in the machine's available memory is skipped (and said so)
instead of ending in the kernel's OOM killer.
Goal `memory_growth_linear`: the marginal step memory per token (between consecutive lengths) at the
longest length the checkpointing arm ran, over that up to 2k tokens (--quick: 512 -> 1k, against 1k -> 2k),
is at most GROWTH_GOAL (linear growth: ~1; growth with length squared: ~2 per doubling). Only differences
between lengths of MIN_REFERENCE_LENGTH or more are read: below, the step's costs that do not grow with length
(allocator rounding, the warm-up's leftovers) swamp the difference and the ratio means nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from rich.table import Table

LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (512, 1024, 2048)
PROMPT_TOKENS = 64
ARMS: dict[str, dict[str, Any]] = {"default": {}, "gradient_checkpointing": {"gradient_checkpointing": True}}
GOAL_ARM = "gradient_checkpointing"
GROWTH_GOAL = 1.25  # marginal bytes per token at the longest length / at the reference length
REFERENCE_LENGTH = 2048
MIN_REFERENCE_LENGTH = 512  # both ends of the reference difference are at least this long
FIT_FRACTION = 0.8  # a length runs when its extrapolated memory is below this share of available memory
THREADS = 2


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Reset this process's resident high-water mark (VmHWM); False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure_step(model_spec: str, length: int, overrides: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """In this process: one warm-up step, then one step on a `length`-token response; its memory."""
    import torch

    from rollwise.bench.trainer import bench_batch
    from rollwise.types.train_config import TrainConfig
    from rollwise.model.loading import load_model
    from rollwise.train.trainer import GRPOTrainer

    torch.set_num_threads(THREADS)
    model, tokenizer = load_model(model_spec)
    cfg = TrainConfig(lr=1e-9, off_policy_correction="none", **overrides)
    trainer = GRPOTrainer(model, cfg, pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer)
    vocab = int(model.config.vocab_size)
    trainer.train_step(bench_batch(vocab, 1, 1, PROMPT_TOKENS, 16, seed))  # gradients + optimizer state exist
    base = _status_kib("VmRSS") * 1024
    reset = _reset_peak()
    start = time.perf_counter()
    metrics = trainer.train_step(bench_batch(vocab, 1, 1, PROMPT_TOKENS, length, seed + 1))
    step_s = time.perf_counter() - start
    peak = _status_kib("VmHWM") * 1024
    step_bytes = peak - base if reset else float("nan")  # without a reset the mark is the whole run's
    return {"length": length, "base_rss_bytes": base, "peak_rss_bytes": peak, "step_bytes": step_bytes,
            "step_bytes_per_token": step_bytes / length, "step_s": step_s,
            "trained_tokens": metrics["trained_tokens"], "peak_reset": reset}


def _run_child(model_spec: str, length: int, overrides: dict[str, Any], seed: int) -> dict[str, Any]:
    """measure_step in a fresh process; a process the kernel killed is reported, not raised."""
    command = [sys.executable, "-m", "rollwise.bench.trainer_memory", model_spec, str(length),
               json.dumps(overrides), str(seed)]
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        reason = "killed (out of memory?)" if done.returncode < 0 else done.stderr.strip().splitlines()[-1:]
        return {"length": length, "error": f"exit {done.returncode}: {reason}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fits(rows: list[dict[str, Any]], length: int) -> tuple[bool, float]:
    """Whether `length` is expected to fit: the arm's longest measured step, scaled linearly, plus its base."""
    measured = _measured(rows)
    if not measured:
        return True, 0.0
    last = measured[-1]
    need = last["base_rss_bytes"] + last["step_bytes_per_token"] * length
    return need < FIT_FRACTION * psutil.virtual_memory().available, need


def _measured(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "error" not in r and "skipped" not in r]


def marginal_per_token(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Bytes each further response token adds to the step, between consecutive measured lengths (keyed by the
    longer one). The step also allocates what does not depend on length (the gradients, ~4 bytes a
    parameter): the per-token figure at one length carries that constant, these differences do not."""
    rows = _measured(rows)
    return {b["length"]: (b["step_bytes"] - a["step_bytes"]) / (b["length"] - a["length"])
            for a, b in zip(rows, rows[1:])}


def reference_length(lengths: tuple[int, ...]) -> int | None:
    """The length whose marginal (from the length before it) the growth is read against: REFERENCE_LENGTH or
    the longest below it, among those whose difference starts at MIN_REFERENCE_LENGTH or more and that a longer
    length follows (else the shortest such); None: `lengths` has no such pair of differences."""
    ordered = sorted(lengths)
    usable = [b for a, b in zip(ordered, ordered[1:-1]) if a >= MIN_REFERENCE_LENGTH]
    if not usable:
        return None
    return max((b for b in usable if b <= REFERENCE_LENGTH), default=usable[0])


def growth(rows: list[dict[str, Any]], reference: int | None) -> float | None:
    """Marginal bytes per token at the longest measured length over those up to `reference` (None: not both
    ran): about 1 when memory grows linearly, about 2 per doubling when it grows with length squared."""
    slopes = marginal_per_token(rows)
    if reference is None or reference not in slopes or max(slopes) <= reference:
        return None
    return slopes[max(slopes)] / slopes[reference]


def run_memory_bench(model_spec: str, *, quick: bool = False, seed: int = 0,
                     lengths: tuple[int, ...] | None = None, progress=lambda _: None) -> dict[str, Any]:
    lengths = lengths or (QUICK_LENGTHS if quick else LENGTHS)
    arms: dict[str, list[dict[str, Any]]] = {}
    for arm, overrides in ARMS.items():
        rows: list[dict[str, Any]] = []
        for length in lengths:
            fits, need = _fits(rows, length)
            if not fits:
                rows.append({"length": length, "skipped": f"would need ~{need / 2**30:.1f} GiB"})
                continue
            progress(f"memory arm {arm}: {length}-token response ({model_spec})")
            rows.append(_run_child(model_spec, length, overrides, seed))
        arms[arm] = rows
    reference = reference_length(lengths)
    measured = growth(arms[GOAL_ARM], reference)
    return {"benchmark": "trainer-memory", "model": model_spec, "quick": quick, "prompt_tokens": PROMPT_TOKENS,
            "threads": THREADS, "lengths": list(lengths), "arms": {a: {"overrides": ARMS[a], "rows": r}
                                                                  for a, r in arms.items()},
            "marginal_bytes_per_token": {a: marginal_per_token(r) for a, r in arms.items()},
            "growth_by_arm": {a: growth(r, reference) for a, r in arms.items()}, "reference_length": reference,
            "goals": {"memory_growth_linear": {"goal": GROWTH_GOAL, "measured": measured, "arm": GOAL_ARM,
                                               "met": measured is not None and measured <= GROWTH_GOAL}}}


def format_memory_bench(result: dict[str, Any]) -> Table:
    table = Table(title=f"trainer memory: {result['model']}, one sample ({result['prompt_tokens']}-token prompt) "
                        f"per step, each length in a fresh process, {result['threads']} threads")
    for col in ("arm", "response tokens", "step MiB (peak - base)", "KiB/token", "marginal KiB/token",
                "base RSS MiB", "step s"):
        table.add_column(col, justify="left" if col == "arm" else "right")
    for arm, data in result["arms"].items():
        for row in data["rows"]:
            if "error" in row or "skipped" in row:
                table.add_row(arm, str(row["length"]), row.get("error") or row["skipped"], "", "", "", "")
                continue
            slope = result["marginal_bytes_per_token"][arm].get(row["length"])
            table.add_row(arm, str(row["length"]), f"{row['step_bytes'] / 2**20:.0f}",
                          f"{row['step_bytes_per_token'] / 1024:.1f}", "" if slope is None else f"{slope / 1024:.1f}",
                          f"{row['base_rss_bytes'] / 2**20:.0f}", f"{row['step_s']:.1f}")
    goal = result["goals"]["memory_growth_linear"]
    shown = "n/a" if goal["measured"] is None else f"{goal['measured']:.2f}x"
    if result["reference_length"] is None:
        table.caption = (f"goal: not measured: it needs three lengths of {MIN_REFERENCE_LENGTH} tokens or more "
                         f"(two differences among them), got {result['lengths']}")
        return table
    table.caption = (f"goal ({goal['arm']}): marginal KiB/token at the longest length over that at "
                     f"{result['reference_length']} tokens (lengths >= {MIN_REFERENCE_LENGTH} only) "
                     f"<= {goal['goal']}x -> {shown} "
                     f"({'met' if goal['met'] else 'NOT met'})")
    return table


if __name__ == "__main__":  # the child process of _run_child: one measurement, JSON on the last line
    spec, length_arg, overrides_arg, seed_arg = sys.argv[1:5]
    print(json.dumps(measure_step(spec, int(length_arg), json.loads(overrides_arg), int(seed_arg))))

"""The closing summary table of a run."""

from __future__ import annotations

from typing import Any

from rich.table import Table


# Where a step's wall time goes, in the order the bars stack (bottom first).
PHASES = [("generate", "tab:blue"), ("reward", "tab:cyan"), ("train", "tab:orange"), ("weight_sync", "tab:red"),
           ("eval", "tab:green"), ("startup", "tab:brown"), ("other", "tab:gray")]


def time_split(records: list[dict[str, Any]], evals: list[dict[str, Any]], wall_time_s: float
               ) -> tuple[dict[str, float], list[dict[str, float]]]:
    """(before the first step, then per step) seconds by phase. A step's share holds what ran after
    it until the next step began: a mid-run or final evaluation ("eval"), checkpoints and the rest
    ("other"); the start holds loading and engine start-up ("startup") and the first evaluation."""
    eval_s: dict[int, float] = {}
    for e in evals:
        eval_s[e["step"]] = eval_s.get(e["step"], 0.0) + e.get("eval_seconds", 0.0)
    starts = [r["elapsed_s"] - r["time_step_s"] for r in records] + [wall_time_s]
    first_step = records[0]["step"] - 1 if records else 0
    before = eval_s.get(first_step, 0.0)
    start = {"eval": before, "startup": max(starts[0] - before, 0.0)}
    steps = []
    for i, r in enumerate(records):
        gap = max(starts[i + 1] - r["elapsed_s"], 0.0)
        after_eval = min(eval_s.get(r["step"], 0.0), gap)
        steps.append({"generate": r["time_generate_s"], "reward": r["time_reward_s"], "train": r["time_train_s"],
                      "weight_sync": r["time_weight_sync_s"], "eval": after_eval, "other": gap - after_eval})
    return start, steps


def total_time_split(records: list[dict[str, Any]], evals: list[dict[str, Any]], wall_time_s: float
                     ) -> dict[str, float]:
    """Seconds of the whole run by phase (the sum of time_split's bars: it adds up to the wall time)."""
    start, steps = time_split(records, evals, wall_time_s)
    return {phase: sum(bar.get(phase, 0.0) for bar in [start, *steps]) for phase, _ in PHASES}


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def render_summary(summary: dict[str, Any], records: list[dict[str, Any]]) -> Table:
    table = Table(title=f"rollwise run summary — {summary['run_dir']}", show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    for key, label in [("strict_accuracy", "held-out strict accuracy"), ("format_rate", "held-out format ok"),
                       ("lenient_accuracy", "held-out last-number accuracy")]:
        table.add_row(label, _pct(before.get(key)), _pct(after.get(key)))
    if records:
        first, last = records[0], records[-1]
        table.add_row("train reward (step)", f"{first['reward_mean']:.3f}", f"{last['reward_mean']:.3f}")
        table.add_row("response length", f"{first['response_len_mean']:.0f}", f"{last['response_len_mean']:.0f}")
        n = len(records)
        split = summary.get("time_split_s") or {
            k: sum(r[f"time_{k}_s"] for r in records) for k in ("generate", "reward", "train", "weight_sync")}
        total = sum(split.values()) or 1.0
        table.add_row("time split", ", ".join(f"{k.replace('_', ' ')} {v / total:.0%}" for k, v in split.items()),
                      "of the wall time" if "time_split_s" in summary else "of the steps")
        table.add_row("mean bubble ratio", f"{sum(r['bubble_ratio'] for r in records) / n:.2f}", "")
        table.add_row("staleness mean / max", f"{sum(r['staleness_mean'] for r in records) / n:.2f} / "
                      f"{max(r['staleness_max'] for r in records)}", "")
        table.add_row("rollout tok/s (mean)", f"{sum(r['rollout_tokens_per_s'] for r in records) / n:.0f}", "")
    if summary.get("samples"):
        counts = summary["samples"]
        table.add_row(f"samples ({summary.get('rollout_mode', 'sync')} rollout)",
                      f"{counts['trained']} trained, {counts['dropped']} dropped at the end, "
                      f"{summary.get('samples_regenerated', 0)} regenerated",
                      _regeneration_cost(summary))
    if summary.get("mfu"):
        _add_utilisation_rows(table, summary)
    table.add_row("wall time", f"{summary['wall_time_s'] / 60:.1f} min", "")
    with_children = summary.get("peak_rss_run_gb")
    table.add_row("peak memory (RSS)", f"{summary['peak_rss_gb']:.1f} GB"
                  + (f", {with_children:.1f} GB with its child processes" if with_children else ""),
                  f"{summary['low_memory_warnings']} low-memory warning(s)" if summary.get("low_memory_warnings") else "")
    return table


def _regeneration_cost(summary: dict[str, Any]) -> str:
    """What regenerating cost: a sample aborted while still queued cost nothing, one that had sampled did."""
    if "tokens_discarded" not in summary or not summary.get("samples_regenerated"):
        return ""
    return (f"{summary['samples_regenerated_after_sampling']} had sampled "
            f"({summary['tokens_discarded']:,} tokens thrown away)")


def _add_utilisation_rows(table: Table, summary: dict[str, Any]) -> None:
    """Model-FLOPs utilisation against the machine's peak, and the cores left idle."""
    mfu, peak, phase_s = summary["mfu"], summary["peak"], summary.get("phase_seconds", {})
    table.add_row("model-FLOPs utilisation (run)", _pct(mfu.get("run")),
                  f"of {peak['flops'] / 1e9:,.0f} GFLOP/s ({peak['source']} {peak['dtype']} peak, "
                  f"{peak['units']} {'GPUs' if peak.get('kind') == 'cuda' else 'cores'})")
    table.add_row("MFU generate / train / eval",
                  " / ".join(_pct(mfu.get(k)) for k in ("generate", "train", "eval")),
                  " / ".join(f"{phase_s.get(k, 0.0):.0f}s" for k in ("generate", "train", "eval")))
    table.add_row("model GFLOP generate / train / eval",
                  " / ".join(f"{summary['flops'][k] / 1e9:,.1f}" for k in ("generate", "train", "eval")), "")
    table.add_row("idle core-seconds", f"{summary['idle_core_s']:.0f}",
                  f"{summary['idle_core_fraction']:.0%} of {summary['cores']} cores x wall")

"""PNG plots people would rather look at than read: the reward / accuracy curve of a run, where its
wall time went."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

from rollwise.observe.compare import Arm, mean_and_spread
from rollwise.observe.summary import PHASES, time_split

matplotlib.use("Agg")  # headless: no display on training machines
import matplotlib.pyplot as plt  # noqa: E402


def plot_training_curve(records: list[dict[str, Any]], evals: list[dict[str, Any]], out: Path) -> Path:
    """Left: train reward and strict accuracy per step vs. minutes. Right: held-out strict accuracy."""
    steps = [r for r in records if "reward_mean" in r]
    fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(11, 4))
    if steps:
        minutes = [r["elapsed_s"] / 60 for r in steps]
        ax_train.plot(minutes, [r["reward_mean"] for r in steps], label="reward (mean)", color="tab:blue")
        ax_train.plot(minutes, [r["strict_accuracy"] for r in steps], label="strict accuracy", color="tab:green")
        ax_train.plot(minutes, [r["format_rate"] for r in steps], label="format ok", color="tab:orange", ls="--")
        if "agent_episodes_with_tool_result" in steps[0]:  # agentic runs: is the tool used, and used right?
            ax_train.plot(minutes, [r["agent_episodes_with_tool_result"] for r in steps],
                          label="episodes with a tool result", color="tab:purple", ls="-.")
            ax_train.plot(minutes, [r["agent_tool_error_rate"] for r in steps], label="tool-call error rate",
                          color="tab:red", ls=":")
    ax_train.set(title="training samples", xlabel="minutes since start", ylim=(-0.02, 1.02))
    ax_train.grid(alpha=0.3)
    ax_train.legend(loc="lower right")
    if evals:
        ax_eval.plot([e["elapsed_s"] / 60 for e in evals], [e["strict_accuracy"] for e in evals], "o-",
                     color="tab:green", label="strict accuracy (greedy)")
        ax_eval.plot([e["elapsed_s"] / 60 for e in evals], [e["lenient_accuracy"] for e in evals], "s--",
                     color="tab:gray", label="last-number accuracy")
        for e in evals:
            ax_eval.annotate(f"step {e['step']}", (e["elapsed_s"] / 60, e["strict_accuracy"]),
                             textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax_eval.set(title="held-out evaluation", xlabel="minutes since start", ylim=(-0.02, 1.02))
    ax_eval.grid(alpha=0.3)
    ax_eval.legend(loc="lower right")
    return _save(fig, out)


def plot_rollout_timelines(runs: dict[str, tuple[list[tuple[float, int]], list[float]]], capacity: int,
                           out: Path) -> Path:
    """One row per mode: running sequences over time (a step function), the engine's capacity as a
    dashed line, and each weight update as a vertical red line. White space under the capacity
    line is the bubble."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.4 * len(runs)), sharex=True, squeeze=False)
    for ax, (mode, (timeline, updates)) in zip(axes[:, 0], runs.items()):
        if timeline:
            times, running = zip(*timeline)
            ax.step(times, running, where="post", color="tab:blue", lw=0.8)
            ax.fill_between(times, running, step="post", alpha=0.3, color="tab:blue")
        ax.axhline(capacity, color="gray", ls="--", lw=0.8)
        for i, t in enumerate(updates):
            ax.axvline(t, color="tab:red", lw=0.8, label="weight update" if i == 0 else None)
        ax.set(ylabel="running seqs", ylim=(0, capacity * 1.1), title=mode)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(loc="upper right")
    axes[-1, 0].set_xlabel("seconds")
    return _save(fig, out)


def plot_run_comparison(arms: list[Arm], out: Path) -> Path:
    """Arms side by side: train reward against wall time and against trained samples, held-out strict
    accuracy against wall time and against samples. An arm of several seeds draws each run thin and,
    against samples, its mean with a band of one standard deviation."""
    fig, (ax_time, ax_samples, ax_eval, ax_eval_samples) = plt.subplots(1, 4, figsize=(20, 4))
    for arm in arms:
        color = None
        for i, run in enumerate(arm.runs):
            steps = [r for r in run.records if "reward_mean" in r]
            samples = [run.samples_at(r["step"]) for r in steps]
            label = arm.label if i == 0 else None
            width = 1.5 if len(arm.runs) == 1 else 0.8
            line = ax_time.plot([r["elapsed_s"] / 60 for r in steps], [r["reward_mean"] for r in steps],
                                label=label, color=color, lw=width)[0]
            color = line.get_color()
            ax_samples.plot(samples, [r["reward_mean"] for r in steps], label=label, color=color, lw=width)
            ax_eval.plot([e["elapsed_s"] / 60 for e in run.evals], [e["strict_accuracy"] for e in run.evals], "o-",
                         label=label, color=color, lw=width, ms=3)
        steps = arm.eval_steps()
        x = [arm.samples_at(s) for s in steps]
        mean, spread = zip(*(mean_and_spread(arm.strict_at(s)) for s in steps)) if steps else ((), ())
        label = arm.label if len(arm.runs) == 1 else f"{arm.label} (mean of {len(arm.runs)})"
        ax_eval_samples.plot(x, mean, "o-", color=color, label=label)
        if len(arm.runs) > 1:
            ax_eval_samples.fill_between(x, [m - d for m, d in zip(mean, spread)],
                                         [m + d for m, d in zip(mean, spread)], color=color, alpha=0.2)
    ax_time.set(title="train reward vs wall time", xlabel="minutes since start", ylim=(-0.02, 1.02))
    ax_samples.set(title="train reward vs samples", xlabel="samples", ylim=(-0.02, 1.02))
    ax_eval.set(title="held-out strict accuracy", xlabel="minutes since start", ylim=(-0.02, 1.02))
    ax_eval_samples.set(title="held-out strict accuracy vs samples (±1 sd)", xlabel="samples",
                        ylim=(-0.02, 1.02))
    for ax in (ax_time, ax_samples, ax_eval, ax_eval_samples):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    return _save(fig, out)


def plot_time_split(records: list[dict[str, Any]], evals: list[dict[str, Any]], summary: dict[str, Any],
                    out: Path) -> Path:
    """A stacked bar per step of where the wall time went (the start: loading and the first
    evaluation), with each step's model-FLOPs utilisation on the right axis when it was measured."""
    start, steps = time_split(records, evals, summary["wall_time_s"])
    bars = [start] + steps
    labels = ["start"] + [str(r["step"]) for r in records]
    fig, ax = plt.subplots(figsize=(max(8.0, 0.5 * len(bars) + 4), 4))
    bottom = [0.0] * len(bars)
    for phase, color in PHASES:
        heights = [b.get(phase, 0.0) for b in bars]
        ax.bar(labels, heights, bottom=bottom, color=color, label=phase.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights)]
    title = "where the wall time went"
    mfu = (summary.get("mfu") or {}).get("run")
    if mfu is not None:
        title += f"\nrun MFU {mfu:.1%} of a {summary['peak']['flops'] / 1e9:,.0f} GFLOP/s {summary['peak']['source']} peak"
    ax.set_title(title, fontsize=10)
    ax.set(xlabel="step (its bar: the step, then what ran until the next step)", ylabel="seconds")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="upper left", bbox_to_anchor=(1.1, 1.0), fontsize=8)
    if any(r.get("mfu_step") is not None for r in records):
        twin = ax.twinx()
        twin.plot([str(r["step"]) for r in records], [r.get("mfu_step") or 0.0 for r in records], "k.-", label="step MFU")
        twin.set(ylabel="step MFU", ylim=(0, max(0.05, 1.2 * max(r.get("mfu_step") or 0.0 for r in records))))
        twin.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        twin.legend(loc="lower left", bbox_to_anchor=(1.1, 0.0), fontsize=8)
    return _save(fig, out)


def _save(fig: Any, out: Path) -> Path:
    """Lay out, write as PNG and free the figure (pyplot keeps every open figure alive otherwise)."""
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

"""Tables and plots for simulation results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.table import Table  # noqa: E402

COLUMNS = (("gpus", "GPUs", "{}"), ("mode", "mode", "{}"), ("routing", "routing", "{}"),
           ("bubble_ratio", "bubble", "{:.2f}"), ("bubble_ratio_rollout", "bubble (rollout)", "{:.2f}"),
           ("samples_per_s", "samples/s", "{:.1f}"), ("trained_tokens_per_s", "trained tok/s", "{:.0f}"),
           ("trained_response_mean", "trained length", "{:.0f}"),
           ("staleness_mean", "staleness mean", "{:.2f}"), ("staleness_max", "max", "{}"),
           ("prefix_hit_rate", "prefix hit", "{:.2f}"), ("engine_hours", "engine-h", "{:.2f}"),
           ("virtual_s", "sim time s", "{:.0f}"), ("sim_wall_s", "wall s", "{:.1f}"))


def results_table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for _, head, _ in COLUMNS:
        table.add_column(head, justify="right")
    for r in rows:
        table.add_row(*(fmt.format(r[key]) if key in r else "-" for key, _, fmt in COLUMNS))
    return table


def plot_run(result: dict[str, Any], timeline: list[tuple[float, int]], out: Path) -> Path:
    """Running sequences over the cluster vs capacity; weight updates as red lines."""
    fig, ax = plt.subplots(figsize=(11, 3.2))
    if timeline:
        xs = [t for t, _ in timeline]
        ax.step(xs, [n for _, n in timeline], where="post", color="tab:blue", lw=0.8, label="running sequences")
    ax.axhline(result["capacity"], color="gray", ls="--", lw=1, label="capacity")
    ax.set_ylim(0, result["capacity"] * 1.05)  # from zero: a drain and a dip must look like what they are
    for t in result.get("_updates", []):
        ax.axvline(t, color="tab:red", lw=0.6, alpha=0.7)
    ax.set(xlabel="simulated seconds", ylabel="sequences",
           title=f"{result['scenario']}: {result['gpus']} GPUs, {result['mode']}, {result['routing']} - "
                 f"bubble {result['bubble_ratio']:.2f}, {result['samples_per_s']:.1f} samples/s")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_sweep(rows: list[dict[str, Any]], out: Path) -> Path:
    """Bubble ratio and samples/s per GPU against cluster size, one line per mode (and routing)."""
    fig, (ax_b, ax_s) = plt.subplots(1, 2, figsize=(11, 4))
    keys = sorted({(r["mode"], r["routing"]) for r in rows})
    for mode, routing in keys:
        pts = sorted((r["gpus"], r) for r in rows if r["mode"] == mode and r["routing"] == routing)
        label = mode if len({k[1] for k in keys}) == 1 else f"{mode} / {routing}"
        ax_b.plot([g for g, _ in pts], [r["bubble_ratio"] for _, r in pts], "o-", label=label)
        ax_s.plot([g for g, _ in pts], [r["samples_per_s"] / g for g, r in pts], "o-", label=label)
    for ax, title in ((ax_b, "bubble ratio (lower is better)"), (ax_s, "trained samples/s per rollout GPU")):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="rollout GPUs", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_b.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plan_table(plan: Any, title: str) -> Table:
    """The planner's splits, best first, and sync on the chosen split (rollwise.sim.plan.Plan)."""
    table = Table(title=title)
    for head in ("rank", "trainer GPUs", "engine GPUs", "eta", "samples/s", "per GPU", "bubble",
                 "staleness max", "regenerated after sampling", "tokens wasted",
                 "trained length"):
        table.add_column(head, justify="right")
    rows = [(str(i + 1), r) for i, r in enumerate(plan.rows)] + [("sync", plan.sync)]
    for label, r in rows:
        table.add_row(label, str(r.split.trainer_gpus), str(r.split.engine_gpus),
                      "-" if label == "sync" else str(r.split.eta), f"{r.samples_per_s:.1f}",
                      f"{r.samples_per_s_per_gpu:.3f}", f"{r.bubble_ratio:.2f}", str(r.staleness_max),
                      str(r.samples_regenerated_after_sampling), f"{r.wasted_token_share:.1%}",
                      f"{r.trained_response_mean:.0f} ({r.length_bias:+.0%})",
                      style="bold" if label == "1" else None)
    return table

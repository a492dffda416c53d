"""Per-step speculation metrics from an engine's cumulative counters (the training loop's step record).

An engine that speculates keeps running totals (ReferenceEngine.spec_stats): tokens drafted, accepted
and rejected, and verifications (one sequence's draft checked in one forward). A step's numbers are the
difference of two snapshots, so the engine never resets anything and a reader on another thread only
copies a small dict of ints.
"""

from __future__ import annotations

from collections.abc import Mapping

COUNTERS = ("drafted", "accepted", "rejected", "verifications")


def counters_of(engine: object) -> dict[str, int] | None:
    """A copy of the engine's speculation counters, or None for an engine that keeps none (vLLM, a
    remote fleet). dict() of a small dict is one step under the GIL: safe while the engine thread counts."""
    stats = getattr(engine, "spec_stats", None)
    return dict(stats) if isinstance(stats, Mapping) else None


def step_metrics(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, float]:
    """The step's drafted / accepted / rejected tokens, acceptance rate (accepted / drafted) and mean
    accepted length (accepted tokens per verification), keyed `spec_*` for metrics.jsonl."""
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
    return {
        "spec_drafted": float(delta["drafted"]),
        "spec_accepted": float(delta["accepted"]),
        "spec_rejected": float(delta["rejected"]),
        "spec_acceptance_rate": delta["accepted"] / delta["drafted"] if delta["drafted"] else 0.0,
        "spec_mean_accepted_length": delta["accepted"] / delta["verifications"] if delta["verifications"] else 0.0,
    }


def run_summary(records: list[Mapping[str, float]]) -> dict[str, float]:
    """summary.json's totals over the step records: tail-phase time, and with speculation on the drafted,
    accepted and rejected tokens and the run's acceptance rate (accepted / drafted over all steps)."""
    out: dict[str, float] = {}
    tails = [r["time_rollout_tail_s"] for r in records if "time_rollout_tail_s" in r]
    if tails:
        out["time_rollout_tail_s_mean"] = sum(tails) / len(tails)
    spec = [r for r in records if "spec_drafted" in r]
    if spec:
        totals = {k: sum(r[f"spec_{k}"] for r in spec) for k in ("drafted", "accepted", "rejected")}
        out.update({f"spec_{k}_total": v for k, v in totals.items()})
        out["spec_acceptance_rate"] = totals["accepted"] / totals["drafted"] if totals["drafted"] else 0.0
    return out

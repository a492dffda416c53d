"""Per-step speculation metrics from an engine's cumulative counters (the training loop's step record).

An engine that speculates keeps running totals (ReferenceEngine.spec_stats, VLLMEngine.spec_stats):
tokens drafted, accepted and rejected, and verifications (one sequence's draft checked in one forward);
vLLM also counts, per draft position i (1-based), the verifications that accepted position i
(`accepted_at_i`). A step's numbers are the difference of two snapshots, so the engine never resets
anything and a reader on another thread only copies a small dict of ints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

COUNTERS = ("drafted", "accepted", "rejected", "verifications")
POSITION_PREFIX = "accepted_at_"  # + draft position (1-based): verifications that accepted that position


def new_counters(max_draft: int = 0) -> dict[str, int]:
    """Zeroed counters; with max_draft > 0 also the per-position ones (an engine that can report them)."""
    return {**dict.fromkeys(COUNTERS, 0), **{f"{POSITION_PREFIX}{i}": 0 for i in range(1, max_draft + 1)}}


def add_accept_histogram(counters: dict[str, int], histogram: Sequence[int], drafted: int) -> None:
    """Add one finished sequence's verifications, given as vLLM reports them per request
    (vllm.v1.metrics.stats.RequestSpecDecodeMetrics, "summary" level): histogram[j] = verifications
    that accepted exactly j draft tokens, `drafted` = draft tokens it verified in all. Position i was
    accepted by every verification that accepted more than i - 1 tokens (acceptance is a prefix)."""
    accepted = sum(j * n for j, n in enumerate(histogram))
    counters["drafted"] += drafted
    counters["accepted"] += accepted
    counters["rejected"] += drafted - accepted
    counters["verifications"] += sum(histogram)
    for i in range(1, len(histogram)):
        key = f"{POSITION_PREFIX}{i}"
        counters[key] = counters.get(key, 0) + sum(histogram[i:])


def counters_of(engine: object) -> dict[str, int] | None:
    """A copy of the engine's speculation counters, or None for an engine that keeps none (no drafter, a
    remote fleet). dict() of a small dict is one step under the GIL: safe while the engine thread counts."""
    stats = getattr(engine, "spec_stats", None)
    return dict(stats) if isinstance(stats, Mapping) else None


def step_metrics(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, float]:
    """The step's drafted / accepted / rejected tokens, acceptance rate (accepted / drafted) and mean
    accepted length (accepted tokens per verification), keyed `spec_*` for metrics.jsonl; where the engine
    counts them (vLLM), `spec_acceptance_at_i`: the share of verifications that accepted draft position i."""
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in (*COUNTERS, *after)}
    positions = {k.removeprefix(POSITION_PREFIX): v for k, v in delta.items() if k.startswith(POSITION_PREFIX)}
    verifications = delta.get("verifications", 0)
    return {
        "spec_drafted": float(delta["drafted"]),
        "spec_accepted": float(delta["accepted"]),
        "spec_rejected": float(delta["rejected"]),
        "spec_acceptance_rate": delta["accepted"] / delta["drafted"] if delta["drafted"] else 0.0,
        "spec_mean_accepted_length": delta["accepted"] / verifications if verifications else 0.0,
        **{f"spec_acceptance_at_{i}": n / verifications if verifications else 0.0 for i, n in positions.items()},
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

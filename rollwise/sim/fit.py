"""The engine cost model's fit from timed engine steps (pure: numpy only). The timing itself runs a real
engine, on the bench side (rollwise.bench.calibrate: `rollwise sim calibrate`, `rollwise sim validate-router`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rollwise.sim.cost import interpolate


@dataclass
class StepRecord:
    run: int
    step: int
    seconds: float
    batch: int
    context: int
    prefill: int


def nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: drop the most negative one and refit until none is."""
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        coef[active] = sol
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda i: coef[i]))


def fit_steps(records: list[StepRecord], robust: bool = True) -> dict[str, float]:
    """robust (default): one point per run, its lower-quartile decode step, and the lower quartile of the
    runs' prefill rates. On a shared machine other jobs only ever add time, so the lower quartile
    estimates the engine's own cost; plain least squares over every step follows the spikes (measured
    here: single steps 10-25x their run's median while other sessions trained)."""
    runs = sorted({r.run for r in records})
    if robust:
        decode = []
        for run in runs:
            steps = sorted((r for r in records if r.run == run and r.step >= 2), key=lambda r: r.seconds)
            if steps:
                decode.append(steps[len(steps) // 4])
    else:
        decode = [r for r in records if r.step >= 2]
    x = np.array([[1.0, r.batch, r.context] for r in decode])
    y = np.array([r.seconds for r in decode])
    c0, c_seq, c_ctx = nonneg_lstsq(x, y)
    # A whole run can fall into another job's burst: drop the run furthest above the fit (noise only adds
    # time) while it sits > 50% above, keeping at least 3 runs for 3 coefficients.
    while robust and len(y) > 3:
        rel = y / np.maximum(x @ np.array([c0, c_seq, c_ctx]), 1e-9) - 1
        worst = int(np.argmax(rel))
        if rel[worst] <= 0.5:
            break
        x, y = np.delete(x, worst, axis=0), np.delete(y, worst)
        c0, c_seq, c_ctx = nonneg_lstsq(x, y)
    # Step time by batch: each run's robust decode step, less the context term; the fastest run per batch.
    by_batch: dict[int, float] = {}
    for r in decode:
        t = max(r.seconds - c_ctx * r.context, 0.0)
        by_batch[r.batch] = min(t, by_batch.get(r.batch, t))

    def decode_pred(r: StepRecord) -> float:
        if robust and by_batch:
            return interpolate(by_batch, r.batch, 0.0) + c_ctx * r.context
        return c0 + c_seq * r.batch + c_ctx * r.context

    every = [r for r in records if r.step >= 2]
    ye = np.array([r.seconds for r in every])
    pred = np.array([decode_pred(r) for r in every])
    r2 = 1 - float(((ye - pred) ** 2).sum() / max(((ye - ye.mean()) ** 2).sum(), 1e-12))
    rates, excess, prefill = [], 0.0, 0.0
    for run in runs:
        first = [r for r in records if r.run == run and r.step < 2]
        run_excess = sum(r.seconds - decode_pred(r) for r in first)
        run_prefill = sum(r.prefill for r in first)
        if run_prefill:
            rates.append(max(run_excess / run_prefill, 0.0))
        excess += run_excess
        prefill += run_prefill
    if robust and rates:
        prefill_rate = sorted(rates)[len(rates) // 4]
    else:
        prefill_rate = max(excess / prefill, 0.0) if prefill else 0.0
    return {"step_overhead_s": float(c0), "decode_s_per_seq": float(c_seq), "decode_s_per_ctx_token": float(c_ctx),
            "prefill_s_per_token": prefill_rate, "decode_r2_all_steps": r2, "robust": robust,
            "decode_s_by_batch": dict(sorted(by_batch.items())) if robust else {}}

"""`rollwise sim service --tenants-sweep`: `rollwise bench service`'s workload at 1, 2, 4, 8 tenants on one worker,
validated against the benchmark on this CPU, then projected onto one H100 engine + one H100 trainer.

1. Validation: the model (rollwise.sim.service_loop) with this CPU's costs (rollwise.sim.service_costs.cpu_costs,
   levelled on the measured one-tenant arm only) against the measured 2-, 4-, 8-tenant arms: steady-state
   aggregate samples/s (tenants x samples a step / mean step time, first step out, as the benchmark's
   mean_step_s) and the 8-vs-1 ratio. The error is simulated / measured - 1.
2. Projection: the same model and workload with H100 roofline costs (h100_costs) for the bench's SmolLM2-135M and
   a 7B shape; the worker as built (one thread: sampling and training take turns) and with sampling and training
   overlapped on their two devices. Beside each, the devices' bound (every call batched, back to back).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.table import Table

from rollwise.sim.service_costs import SHAPES, MeasuredArm, cpu_costs, h100_costs
from rollwise.sim.service_loop import ServiceCosts, ServiceWorkload, device_bound_samples_per_s, simulate_service

GOAL_MODEL = "smollm2-135m"  # the benchmark's own model: its goal's projection


def load_measured(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
        arms = {arm.tenants: arm for arm in (MeasuredArm.model_validate(a) for a in doc["arms"])}
    except (OSError, ValueError, KeyError, TypeError, ValidationError) as exc:
        raise ValueError(f"--measured: {path} is not a `rollwise bench service --json` file ({exc}); give the "
                         "benchmark's JSON, e.g. docs/bench/service.json") from None
    if 1 not in arms:
        raise ValueError(f"--measured: {path} has no 1-tenant arm, which levels this CPU's costs")
    return {"arms": arms, "workload": doc.get("workload", {}), "goals": doc.get("goals", {})}


def workload_of(measured: dict[str, Any]) -> ServiceWorkload:
    fields = ("groups", "group_size", "max_tokens", "lora_rank")
    return ServiceWorkload(**{k: int(v) for k, v in measured["workload"].items() if k in fields})


def _steady(arm: MeasuredArm, workload: ServiceWorkload) -> float:
    return arm.tenants * workload.samples_per_step / arm.mean_step_s


def validate(measured: dict[str, Any], workload: ServiceWorkload, steps: int) -> dict[str, Any]:
    costs = cpu_costs(measured["arms"][1], workload)
    rows = []
    for n, arm in sorted(measured["arms"].items()):
        sim = simulate_service(n, workload, costs, steps=steps)
        real = _steady(arm, workload)
        rows.append({"tenants": n, "simulated_samples_per_s": sim["aggregate_samples_per_s"],
                     "measured_samples_per_s": real, "error": sim["aggregate_samples_per_s"] / real - 1,
                     "simulated_step_s": sim["step_s"], "measured_step_s": arm.mean_step_s})
    most = rows[-1]
    sim_ratio = most["simulated_samples_per_s"] / rows[0]["simulated_samples_per_s"]
    real_ratio = most["measured_samples_per_s"] / rows[0]["measured_samples_per_s"]
    return {"costs": costs.model_dump(), "arms": rows, "most_tenants": most["tenants"],
            "ratio_simulated": sim_ratio, "ratio_measured_steady": real_ratio,
            "ratio_error": sim_ratio / real_ratio - 1,
            "ratio_measured_goal": measured["goals"].get(f"aggregate_throughput_{most['tenants']}_vs_1")}


def _curve(counts: tuple[int, ...], workload: ServiceWorkload, costs: ServiceCosts, steps: int,
           overlap: bool) -> list[dict[str, float]]:
    rows = []
    for n in counts:
        row = simulate_service(n, workload, costs, steps=steps, overlap=overlap)
        row["device_bound_samples_per_s"] = device_bound_samples_per_s(n, workload, costs, overlap=overlap)
        rows.append(row)
    return rows


def _ratio(rows: list[dict[str, float]]) -> float:
    return rows[-1]["aggregate_samples_per_s"] / rows[0]["aggregate_samples_per_s"]


def project(counts: tuple[int, ...], workload: ServiceWorkload, steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, shape in SHAPES.items():
        costs = h100_costs(shape, workload)
        serial, overlap = (_curve(counts, workload, costs, steps, o) for o in (False, True))
        out[key] = {"model": shape.name, "costs": costs.model_dump(), "serial": serial, "overlap": overlap,
                    "ratio_serial": _ratio(serial), "ratio_overlap": _ratio(overlap)}
    return out


def sensitivity(counts: tuple[int, ...], workload: ServiceWorkload, steps: int) -> list[dict[str, Any]]:
    """The goal's projection (bench model, worker as built) with each assumption halved and doubled."""
    base = h100_costs(SHAPES[GOAL_MODEL], workload)
    knobs = {"off-device latency (rpc_s, client_s)": ("rpc_s", "client_s"),
             "kernel launches (fb_call_s, fb_per_tenant_s)": ("fb_call_s", "fb_per_tenant_s"),
             "adapter push (push_s)": ("push_s",)}
    rows = []
    for label, names in knobs.items():
        for factor in (0.5, 2.0):
            costs = base.model_copy(update={n: getattr(base, n) * factor for n in names})
            rows.append({"assumption": label, "factor": factor,
                         "ratio": _ratio(_curve((counts[0], counts[-1]), workload, costs, steps, False))})
    return rows


def run_sweep(measured_path: Path, counts: tuple[int, ...], steps: int) -> dict[str, Any]:
    if not counts or counts[0] != 1:
        raise ValueError(f"--tenant-counts: start at 1 (the ratio is over one tenant), got {counts}")
    measured = load_measured(measured_path)
    workload = workload_of(measured)
    validation = validate(measured, workload, steps)
    projection = project(counts, workload, steps)
    most = counts[-1]
    return {"workload": workload.model_dump(), "measured": str(measured_path), "validation": validation,
            "projection": projection, "sensitivity": sensitivity(counts, workload, steps),
            "goals": {f"aggregate_throughput_{most}_vs_1_projected": projection[GOAL_MODEL]["ratio_serial"],
                      f"aggregate_throughput_{most}_vs_1_projected_overlap": projection[GOAL_MODEL]["ratio_overlap"],
                      f"aggregate_throughput_{most}_vs_1_projected_7b": projection["7b"]["ratio_serial"],
                      f"validation_error_{validation['most_tenants']}_vs_1": validation["ratio_error"],
                      "validation_max_abs_error": max(abs(r["error"]) for r in validation["arms"])}}


def sweep_tables(result: dict[str, Any]) -> list[Table]:
    v = result["validation"]
    val = Table(title="validation on this CPU: simulated (costs levelled on the 1-tenant arm) vs measured, steady "
                      "aggregate samples/s")
    for col in ("tenants", "simulated", "measured", "error", "step s sim / measured"):
        val.add_column(col, justify="right")
    for r in v["arms"]:
        val.add_row(str(r["tenants"]), f"{r['simulated_samples_per_s']:.2f}", f"{r['measured_samples_per_s']:.2f}",
                    f"{r['error']:+.1%}", f"{r['simulated_step_s']:.2f} / {r['measured_step_s']:.2f}")
    val.add_row(f"{v['most_tenants']} vs 1", f"{v['ratio_simulated']:.2f}x", f"{v['ratio_measured_steady']:.2f}x",
                f"{v['ratio_error']:+.1%}", "")
    proj = Table(title="projection on 1 H100 engine + 1 H100 trainer (roofline costs): aggregate samples/s, worker "
                       "as built (one thread) | sampling and training overlapped; device bound")
    proj.add_column("model")
    for col in ("tenants", "as built", "overlapped", "device bound (as built)", "devices busy (as built)"):
        proj.add_column(col, justify="right")
    for p in result["projection"].values():
        for s, o in zip(p["serial"], p["overlap"], strict=True):
            proj.add_row(p["model"], str(s["tenants"]), f"{s['aggregate_samples_per_s']:.1f}",
                         f"{o['aggregate_samples_per_s']:.1f}", f"{s['device_bound_samples_per_s']:.1f}",
                         f"{s['device_busy']:.0%}")
        proj.add_row(p["model"], "ratio", f"{p['ratio_serial']:.2f}x", f"{p['ratio_overlap']:.2f}x", "", "")
    return [val, proj]

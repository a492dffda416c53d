"""`rollwise sim service --tenants-sweep`: `rollwise bench service`'s workload at 1, 2, 4, 8 tenants on one worker,
validated against the benchmark on this CPU, then projected onto one H100 engine + one H100 trainer.

Two workers (rollwise.sim.service_loop): "two_lane", as built (rollwise/service/worker.py `run`: sampler rows on
a sampling thread beside the training thread, each polling the store), and "serial", the one-thread worker before
it (sampling and training take turns), kept for comparison.

1. Validation: the model with this CPU's costs (rollwise.sim.service_costs.cpu_costs, levelled on the measured
   one-tenant arm only) against the measured 2-, 4-, 8-tenant arms: steady-state aggregate samples/s (tenants x
   samples a step / mean step time, first step out, as the benchmark's mean_step_s) and the 8-vs-1 ratio, for
   both workers. The error is simulated / measured - 1. On the CPU the two lanes share its cores (both threads
   run torch on all of them): the host measured by rollwise.sim.host.measure_cpu_host (`--host`, the same
   measurement the pool simulator uses) slows lanes that compute at once (service_loop.LaneSharing).
2. Projection: the same model and workload with H100 roofline costs (h100_costs) for the bench's SmolLM2-135M and
   a 7B shape, both workers, the lanes on their own devices. Beside each, the devices' bound (every call batched,
   back to back; two lanes: the busier device).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.table import Table

from rollwise.sim.mux import Host
from rollwise.sim.service_costs import SHAPES, MeasuredArm, cpu_costs, h100_costs
from rollwise.sim.service_loop import (WORKERS, LaneSharing, ServiceCosts, ServiceWorkload, Worker,
                                       device_bound_samples_per_s, simulate_service)

GOAL_MODEL = "smollm2-135m"  # the benchmark's own model: its goal's projection
AS_BUILT: Worker = "two_lane"


def load_measured(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
        arms = {arm.tenants: arm for arm in (MeasuredArm.model_validate(a) for a in doc["arms"])}
    except (OSError, ValueError, KeyError, TypeError, ValidationError) as exc:
        raise ValueError(f"--measured: {path} is not a `rollwise bench service --json` file ({exc}); give the "
                         "benchmark's JSON, e.g. docs/bench/service.json") from None
    if 1 not in arms:
        raise ValueError(f"--measured: {path} has no 1-tenant arm, which levels this CPU's costs")
    workload, goals = doc.get("workload"), doc.get("goals")
    return {"arms": arms, "workload": workload if isinstance(workload, dict) else {},
            "goals": goals if isinstance(goals, dict) else {}}


def load_host(path: Path) -> LaneSharing:
    """The CPU's measured sharing: a JSON holding rollwise.sim.host.measure_cpu_host's result under "host" (as
    `rollwise bench mux --json` writes it) or at its top."""
    try:
        doc = json.loads(path.read_text())
        measurement = doc.get("host", doc)
        host = Host.measured(measurement)
        cpu_count = int(measurement.get("effective_cores", {}).get("cpu_count") or round(host.cores))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"--host: {path} holds no host measurement ({exc}); give a `rollwise bench mux --json` "
                         "file, e.g. docs/bench/mux_lora.json") from None
    if host.cores <= 0:
        raise ValueError(f"--host: {path}: its host has no cores measured (cores > 0 needed)")
    return LaneSharing(host=host, threads=max(1, cpu_count))


def workload_of(measured: dict[str, Any]) -> ServiceWorkload:
    fields = ("groups", "group_size", "max_tokens", "lora_rank")
    return ServiceWorkload(**{k: int(v) for k, v in measured["workload"].items() if k in fields})


def _steady(arm: MeasuredArm, workload: ServiceWorkload) -> float:
    return arm.tenants * workload.samples_per_step / arm.mean_step_s


def _validate_worker(measured: dict[str, Any], workload: ServiceWorkload, costs: ServiceCosts, steps: int,
                     worker: Worker, sharing: LaneSharing) -> dict[str, Any]:
    rows = []
    for n, arm in sorted(measured["arms"].items()):
        sim = simulate_service(n, workload, costs, steps=steps, worker=worker, sharing=sharing)
        real = _steady(arm, workload)
        rows.append({"tenants": n, "simulated_samples_per_s": sim["aggregate_samples_per_s"],
                     "measured_samples_per_s": real, "error": sim["aggregate_samples_per_s"] / real - 1,
                     "simulated_step_s": sim["step_s"], "measured_step_s": arm.mean_step_s})
    most = rows[-1]
    sim_ratio = most["simulated_samples_per_s"] / rows[0]["simulated_samples_per_s"]
    real_ratio = most["measured_samples_per_s"] / rows[0]["measured_samples_per_s"]
    return {"arms": rows, "most_tenants": most["tenants"], "ratio_simulated": sim_ratio,
            "ratio_measured_steady": real_ratio, "ratio_error": sim_ratio / real_ratio - 1,
            "max_abs_error": max(abs(r["error"]) for r in rows)}


def validate(measured: dict[str, Any], workload: ServiceWorkload, steps: int,
             sharing: LaneSharing) -> dict[str, Any]:
    costs = cpu_costs(measured["arms"][1], workload)
    most = max(measured["arms"])
    return {"costs": costs.model_dump(), "host": {"cores": sharing.host.cores, "crowding": sharing.host.crowding,
                                                  "threads_per_lane": sharing.threads},
            "ratio_measured_goal": measured["goals"].get(f"aggregate_throughput_{most}_vs_1"),
            **{w: _validate_worker(measured, workload, costs, steps, w, sharing) for w in WORKERS}}


def _curve(counts: tuple[int, ...], workload: ServiceWorkload, costs: ServiceCosts, steps: int,
           worker: Worker) -> list[dict[str, float]]:
    rows = []
    for n in counts:
        row = simulate_service(n, workload, costs, steps=steps, worker=worker)
        row["device_bound_samples_per_s"] = device_bound_samples_per_s(n, workload, costs, worker=worker)
        rows.append(row)
    return rows


def _ratio(rows: list[dict[str, float]]) -> float:
    return rows[-1]["aggregate_samples_per_s"] / rows[0]["aggregate_samples_per_s"]


def project(counts: tuple[int, ...], workload: ServiceWorkload, steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, shape in SHAPES.items():
        costs = h100_costs(shape, workload)
        curves = {w: _curve(counts, workload, costs, steps, w) for w in WORKERS}
        out[key] = {"model": shape.name, "costs": costs.model_dump(), **curves,
                    **{f"ratio_{w}": _ratio(c) for w, c in curves.items()}}
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
                         "ratio": _ratio(_curve((counts[0], counts[-1]), workload, costs, steps, AS_BUILT))})
    return rows


def run_sweep(measured_path: Path, counts: tuple[int, ...], steps: int, host_path: Path) -> dict[str, Any]:
    if not counts or counts[0] != 1:
        raise ValueError(f"--tenant-counts: start at 1 (the ratio is over one tenant), got {counts}")
    measured = load_measured(measured_path)
    sharing = load_host(host_path)
    workload = workload_of(measured)
    validation = validate(measured, workload, steps, sharing)
    projection = project(counts, workload, steps)
    most, vmost = counts[-1], validation[AS_BUILT]["most_tenants"]
    return {"workload": workload.model_dump(), "measured": str(measured_path), "host": str(host_path),
            "as_built": AS_BUILT, "validation": validation, "projection": projection,
            "sensitivity": sensitivity(counts, workload, steps),
            "goals": {f"aggregate_throughput_{most}_vs_1_projected": projection[GOAL_MODEL][f"ratio_{AS_BUILT}"],
                      f"aggregate_throughput_{most}_vs_1_projected_serial": projection[GOAL_MODEL]["ratio_serial"],
                      f"aggregate_throughput_{most}_vs_1_projected_7b": projection["7b"][f"ratio_{AS_BUILT}"],
                      f"validation_error_{vmost}_vs_1": validation[AS_BUILT]["ratio_error"],
                      "validation_max_abs_error": validation[AS_BUILT]["max_abs_error"],
                      f"validation_error_{vmost}_vs_1_serial": validation["serial"]["ratio_error"],
                      "validation_max_abs_error_serial": validation["serial"]["max_abs_error"]}}


def sweep_tables(result: dict[str, Any]) -> list[Table]:
    v = result["validation"]
    val = Table(title="validation on this CPU: simulated (costs levelled on the 1-tenant arm; two lanes share "
                      f"{v['host']['cores']:.2f} effective cores) vs measured, steady aggregate samples/s")
    for col in ("tenants", "two lanes (as built)", "serial (before)", "measured", "error two lanes / serial"):
        val.add_column(col, justify="right")
    for t, s in zip(v["two_lane"]["arms"], v["serial"]["arms"], strict=True):
        val.add_row(str(t["tenants"]), f"{t['simulated_samples_per_s']:.2f}", f"{s['simulated_samples_per_s']:.2f}",
                    f"{t['measured_samples_per_s']:.2f}", f"{t['error']:+.1%} / {s['error']:+.1%}")
    t, s = v["two_lane"], v["serial"]
    val.add_row(f"{t['most_tenants']} vs 1", f"{t['ratio_simulated']:.2f}x", f"{s['ratio_simulated']:.2f}x",
                f"{t['ratio_measured_steady']:.2f}x", f"{t['ratio_error']:+.1%} / {s['ratio_error']:+.1%}")
    proj = Table(title="projection on 1 H100 engine + 1 H100 trainer (roofline costs): aggregate samples/s, worker "
                       "as built (two lanes) | serial (one thread, before); device bound")
    proj.add_column("model")
    for col in ("tenants", "two lanes", "serial", "device bound (two lanes)", "devices busy (two lanes)"):
        proj.add_column(col, justify="right")
    for p in result["projection"].values():
        for t, s in zip(p["two_lane"], p["serial"], strict=True):
            proj.add_row(p["model"], str(t["tenants"]), f"{t['aggregate_samples_per_s']:.1f}",
                         f"{s['aggregate_samples_per_s']:.1f}", f"{t['device_bound_samples_per_s']:.1f}",
                         f"{t['device_busy']:.0%}")
        proj.add_row(p["model"], "ratio", f"{p['ratio_two_lane']:.2f}x", f"{p['ratio_serial']:.2f}x", "", "")
    return [val, proj]

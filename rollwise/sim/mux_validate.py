"""`rollwise sim validate-mux`: `rollwise bench mux` measured and simulated on this machine, side by side.

Each scenario of the benchmark runs for real (every job a `rollwise train` process on a
`rollwise serve pool`) as dedicated and shared arms in turn, starting and ending with a dedicated one:

    dedicated 0, shared 0, dedicated 1, shared 1, ..., shared R-1, dedicated R

Round r compares shared arm r with the mean of the dedicated arms on either side of it (r and r + 1):
this machine's speed drifts by 10-40% between minutes, and a dedicated arm measured only before the
shared one made the simulation (calibrated on it) run 5% fast on average and 20% in the worst rounds.
A drift that is steady over the round cancels. How far the two dedicated arms of a round disagree is
reported with it: the noise floor of that round's comparison.

The simulator (rollwise.sim.mux: the pool's own scheduler on simulated engines) replays each shared
arm, calibrated on the round's dedicated arms (each job's per-step generate and train seconds, its
start-up, the pool's switch costs) and on a model of this machine: the trainers and the pool share its
cores (processor sharing), and the pool's engine slots, threads of one Python process, make one core's
worth of steps together. How many cores' worth the machine gives is fitted first, on calibration runs
of their own (bench mux --quick, the same dedicated/shared/dedicated design), and then held fixed for
the rounds compared. Why fitted: the benchmark's processes lose more to each other than two processes
computing side by side do (rollwise.sim.host measures 1.8-2.0 effective cores here, while in the shared
arm each process spends ~15% more CPU seconds on the same work than alone, and the cores are busy ~85%
of the time: HTTP hand-offs between 3-5 processes wait for a core). The simulation with the measured
effective cores is reported beside it.

Per job, the median over the rounds of the measured shared wall time is compared with the median of
the simulated ones; the same for the engine-hours saving.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollwise.bench.mux import (mean_dedicated, prepare_scenario, project_from_dedicated, run_dedicated,
                                run_shared, scenario_specs, summarize_scenario)
from rollwise.sim.host import measure_cpu_host
from rollwise.sim.mux import Host


def _measure_rounds(root: Path, spec: dict[str, Any], rounds: int,
                    progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """One scenario measured as dedicated 0, shared 0, dedicated 1, ..., shared R-1, dedicated R: per round,
    the shared arm, the mean of the dedicated arms on either side of it, and how far those two disagree."""
    tag = f"{spec['jobs']}x{spec['engines']}"
    base = root / tag
    configs = prepare_scenario(base, spec["jobs"], spec["models"], spec["steps"], spec["workload"])
    args = {"workload": spec["workload"], "min_slice_s": spec["min_slice_s"]}
    progress(f"{tag}: dedicated arm 1/{rounds + 1}")
    before = run_dedicated(base, configs, **args, arm="dedicated0")
    measured = []
    for r in range(rounds):
        progress(f"{tag}: shared arm {r + 1}/{rounds}")
        shared = run_shared(base, configs, spec["engines"], **args, arm=f"shared{r}")
        progress(f"{tag}: dedicated arm {r + 2}/{rounds + 1}")
        after = run_dedicated(base, configs, **args, arm=f"dedicated{r + 1}")
        measured.append({"dedicated": mean_dedicated([before, after]), "shared": shared,
                         # the noise floor: how much the same dedicated runs moved within this round
                         "dedicated_drift": {n: after[n]["wall_s"] / before[n]["wall_s"] - 1 for n in configs}})
        before = after
    return measured


def _simulated_walls(spec: dict[str, Any], measured: dict[str, Any], host: Host) -> dict[str, float]:
    costs = measured["shared"]["pool_state"].get("transition_costs", {})
    return project_from_dedicated(measured["dedicated"], spec["engines"], spec["workload"], costs,
                                  spec["min_slice_s"], host)["wall_shared_s"]


def fit_cores(spec: dict[str, Any], rounds: list[dict[str, Any]], lo: float = 0.5, hi: float | None = None) -> float:
    """The cores (processor sharing, the pool's slots one core's worth together) at which the simulated
    shared walls of these measured rounds match the measured ones: geometric mean of sim / measured = 1.
    More cores, faster simulation, so bisection."""
    hi = hi or 2.0 * (os.cpu_count() or 1)

    def log_error(cores: float) -> float:
        errors = []
        for m in rounds:
            simulated = _simulated_walls(spec, m, Host(cores=cores, pool_cores=1.0))
            errors += [math.log(simulated[n] / job["wall_s"]) for n, job in m["shared"]["jobs"].items()]
        return sum(errors) / len(errors)

    if log_error(hi) >= 0:
        return hi
    if log_error(lo) <= 0:
        return lo
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if log_error(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


def validate_mux(full: bool = False, rounds: int = 1, root: Path | None = None, calibration_rounds: int = 2,
                 progress: Callable[[str], None] = lambda _msg: None) -> dict[str, Any]:
    if rounds < 1 or calibration_rounds < 1:
        raise ValueError(f"rounds and calibration rounds must be at least 1, got {rounds}, {calibration_rounds}")
    root = Path(tempfile.mkdtemp(prefix="rollwise-validate-mux-")) if root is None else root
    t0 = time.monotonic()
    progress("measuring this machine's effective cores (~25 s)")
    measured_host = measure_cpu_host()
    host_measured = Host(cores=measured_host["cores"], pool_cores=measured_host["pool_cores"])
    # The host's cores, fitted on runs of their own (bench mux --quick), then held fixed for the rounds that
    # are compared: the benchmark's processes lose more to each other than the measurement's (see above).
    calibration_spec = scenario_specs(quick=True)[0]
    calibration = _measure_rounds(root / "calibration", calibration_spec, calibration_rounds,
                                  lambda msg: progress(f"calibration, {msg}"))
    fitted = fit_cores(calibration_spec, calibration)
    host = Host(cores=fitted, pool_cores=1.0)
    specs = scenario_specs(quick=not full)
    rounds_by_scenario: list[list[dict[str, Any]]] = []  # scenario -> its rounds' results
    for spec in specs:
        results = []
        for m in _measure_rounds(root, spec, rounds, progress):
            result = summarize_scenario(spec["engines"], spec["models"], spec["steps"], spec["workload"],
                                        m["dedicated"], m["shared"], spec["min_slice_s"], host)
            result["dedicated_drift"] = m["dedicated_drift"]
            result["wall_shared_s_simulated_measured_cores"] = _simulated_walls(spec, m, host_measured)
            results.append(result)
        rounds_by_scenario.append(results)

    comparison = []
    for spec, per_round in zip(specs, rounds_by_scenario, strict=True):
        jobs = {}
        for name in per_round[0]["per_job"]:
            measured_walls = [s["per_job"][name]["wall_shared_s"] for s in per_round]
            simulated_walls = [s["simulated_here"]["wall_shared_s"][name] for s in per_round]
            unfitted_walls = [s["wall_shared_s_simulated_measured_cores"][name] for s in per_round]
            meas, sim = statistics.median(measured_walls), statistics.median(simulated_walls)
            jobs[name] = {"wall_shared_s_measured": meas, "wall_shared_s_simulated": sim, "error": sim / meas - 1,
                          "error_measured_cores": statistics.median(unfitted_walls) / meas - 1,
                          "measured_runs": measured_walls, "simulated_runs": simulated_walls,
                          "dedicated_drift_runs": [s["dedicated_drift"][name] for s in per_round],
                          "wall_dedicated_s_runs": [s["per_job"][name]["wall_dedicated_s"] for s in per_round]}
        saving_meas = statistics.median(s["engine_hours_saving"] for s in per_round)
        saving_sim = statistics.median(s["simulated_here"]["engine_hours_saving"] for s in per_round)
        comparison.append({
            "scenario": per_round[0]["scenario"], "jobs": spec["jobs"], "engines": spec["engines"],
            "per_job": jobs, "max_abs_error": max(abs(j["error"]) for j in jobs.values()),
            "engine_hours_saving_measured": saving_meas, "engine_hours_saving_simulated": saving_sim,
            # what sharing would give with each engine and trainer on its own device (GPU engines)
            "engine_hours_saving_separate_devices": statistics.median(
                s["projection"]["engine_hours_saving"] for s in per_round),
        })
    calibrated = {"scenario": "bench mux --quick (2 jobs / 1 engine, 16 steps)", "rounds": calibration_rounds,
                  "cores": fitted, "measured_effective_cores": measured_host["cores"],
                  "wall_shared_s_measured": [{n: j["wall_s"] for n, j in m["shared"]["jobs"].items()}
                                             for m in calibration],
                  "dedicated_drift": [m["dedicated_drift"] for m in calibration]}
    return {"validation": "bench mux", "full": full, "rounds": rounds, "host": measured_host,
            "host_fitted": calibrated,
            "comparison": comparison,
            "rounds_by_scenario": rounds_by_scenario, "workdir": str(root),
            "seconds": time.monotonic() - t0}

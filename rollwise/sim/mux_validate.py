"""`rollwise sim validate-mux`: `rollwise bench mux` measured and simulated on this machine, side by side.

Each round runs the benchmark's scenarios for real (every job a `rollwise train` process on a
`rollwise serve pool`, dedicated arm then shared arm) and simulates the shared arm with rollwise.sim.mux
(the pool's own scheduler on simulated engines), calibrated on that round's dedicated arm and on this
machine as measured once at the start: its effective cores (rollwise.sim.host), shared by the trainers
and the pool, whose engine slots are threads of one Python process. Per job, the median over the rounds
of the measured shared wall time is compared with the median of the simulated ones; the same for the
engine-hours saving. Rounds, because
this machine's speed drifts by 10-20% between minutes (the dedicated arm the simulation starts from and
the shared arm it predicts are measured minutes apart).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollwise.bench.mux import run_scenario, scenario_specs
from rollwise.sim.host import measure_cpu_host
from rollwise.sim.mux import Host


def validate_mux(full: bool = False, rounds: int = 1, root: Path | None = None,
                 progress: Callable[[str], None] = lambda _msg: None) -> dict[str, Any]:
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    root = Path(tempfile.mkdtemp(prefix="rollwise-validate-mux-")) if root is None else root
    t0 = time.monotonic()
    progress("measuring this machine's effective cores (~25 s)")
    measured = measure_cpu_host()
    host = Host(cores=measured["cores"], pool_cores=measured["pool_cores"])
    specs = scenario_specs(quick=not full)
    runs: list[list[dict[str, Any]]] = []  # round -> scenario results
    for r in range(rounds):
        results = []
        for spec in specs:
            progress(f"round {r + 1}/{rounds}: {spec['jobs']} jobs / {spec['engines']} engine(s), "
                     "dedicated then shared")
            results.append(run_scenario(root / f"round{r}", **spec, host=host))
        runs.append(results)

    comparison = []
    for k, spec in enumerate(specs):
        per_round = [results[k] for results in runs]
        jobs = {}
        for name in per_round[0]["per_job"]:
            measured_walls = [s["per_job"][name]["wall_shared_s"] for s in per_round]
            simulated_walls = [s["simulated_here"]["wall_shared_s"][name] for s in per_round]
            meas, sim = statistics.median(measured_walls), statistics.median(simulated_walls)
            jobs[name] = {"wall_shared_s_measured": meas, "wall_shared_s_simulated": sim, "error": sim / meas - 1,
                          "measured_runs": measured_walls, "simulated_runs": simulated_walls,
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
    return {"validation": "bench mux", "full": full, "rounds": rounds, "host": measured,
            "comparison": comparison, "runs": runs, "workdir": str(root),
            "seconds": time.monotonic() - t0}

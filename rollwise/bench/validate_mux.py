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
arm, calibrated on the round's dedicated arms (each job's per-step generate and train seconds and their
step-to-step variation, its start-up, the pool's switch costs) and on this machine as measured once at
the start: its effective cores (rollwise.sim.host), with two processes and with as many as the benchmark
runs (crowded, they lose more to each other), shared by the trainers and the pool, whose engine slots
are threads of one Python process (one core's worth together). Nothing is fitted to the shared
arms. Per job, the median over the rounds of the measured shared wall time is compared with the median
of the simulated ones; the same for the engine-hours saving.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollwise.bench.mux import (measure_host, prepare_scenario, run_dedicated, run_shared, scenario_specs,
                                summarize_between)
from rollwise.sim.mux import Host


def _measure_rounds(root: Path, spec: dict[str, Any], rounds: int, host: Host,
                    progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """One scenario measured as dedicated 0, shared 0, dedicated 1, ..., shared R-1, dedicated R: per round,
    its summary (rollwise.bench.mux.summarize_between: the shared arm against the mean of the dedicated
    arms on either side of it, simulated on `host`)."""
    tag = f"{spec['jobs']}x{spec['engines']}"
    base = root / tag
    configs = prepare_scenario(base, spec["jobs"], spec["models"], spec["steps"], spec["workload"], spec.get("lora"))
    args = {"workload": spec["workload"], "min_slice_s": spec["min_slice_s"]}
    progress(f"{tag}: dedicated arm 1/{rounds + 1}")
    before = run_dedicated(base, configs, **args, arm="dedicated0")
    results = []
    for r in range(rounds):
        progress(f"{tag}: shared arm {r + 1}/{rounds}")
        shared = run_shared(base, configs, spec["engines"], **args, arm=f"shared{r}")
        progress(f"{tag}: dedicated arm {r + 2}/{rounds + 1}")
        after = run_dedicated(base, configs, **args, arm=f"dedicated{r + 1}")
        results.append(summarize_between(spec["engines"], spec["models"], spec["steps"], spec["workload"],
                                         before, shared, after, spec["min_slice_s"], host, spec.get("lora")))
        before = after
    return results


def validate_mux(full: bool = False, rounds: int = 1, root: Path | None = None,
                 progress: Callable[[str], None] = lambda _msg: None, lora: bool = False) -> dict[str, Any]:
    """lora: the LoRA scenarios (bench mux --lora: train.lora jobs on one base, one engine batch)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    root = Path(tempfile.mkdtemp(prefix="rollwise-validate-mux-")) if root is None else root
    t0 = time.monotonic()
    progress("measuring this machine's effective cores (~1 min)")
    specs = scenario_specs(quick=not full, lora=lora)
    measured_host, host = measure_host(specs)
    # scenario -> its rounds' results
    rounds_by_scenario = [_measure_rounds(root, spec, rounds, host, progress) for spec in specs]

    comparison = []
    for spec, per_round in zip(specs, rounds_by_scenario, strict=True):
        jobs = {}
        for name in per_round[0]["per_job"]:
            measured_walls = [s["per_job"][name]["wall_shared_s"] for s in per_round]
            simulated_walls = [s["simulated_here"]["wall_shared_s"][name] for s in per_round]
            meas, sim = statistics.median(measured_walls), statistics.median(simulated_walls)
            jobs[name] = {"wall_shared_s_measured": meas, "wall_shared_s_simulated": sim, "error": sim / meas - 1,
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
    return {"validation": "bench mux" + (" --lora" if lora else ""), "full": full, "lora": lora, "rounds": rounds,
            "host": measured_host,
            "comparison": comparison, "rounds_by_scenario": rounds_by_scenario, "workdir": str(root),
            "seconds": time.monotonic() - t0}

"""`rollwise bench mux`: training jobs sharing one engine pool vs. each on its own dedicated engine.

Every job is a real `rollwise train` run (its own process, one torch thread) on its own model
(tiny:0, tiny:1, ... : different weights), to the same number of steps in both arms:

    dedicated  each job alone with its own engine (a 1-engine pool serving only that job), one job after
               another, so each has the machine to itself; engines held = 1 per job, for its wall time.
               Run before and after the shared arm; a job's dedicated time is the mean of the two
    shared     all jobs at once, attached to one `rollwise serve pool` with fewer engines than jobs
               (2 jobs / 1 engine; the full run adds 4 jobs / 2 engines); engines held = the pool's
               engines, from the first job's start to the last job's end

Reported per scenario: engine-hours of each arm (Σ engines × time held, DESIGN.md), the saving
(1 - shared / dedicated), each job's wall time in both arms and its slowdown (shared / dedicated - 1),
and the pool's own per-job accounting (engine-seconds allocated and busy, transition costs). The cluster
simulator (rollwise.sim.mux, the pool's own scheduler on simulated engines) replays the same jobs with the
phase times measured in the dedicated arm, twice: on this machine as it is (its measured effective cores
shared by the trainers and the pool, whose engine slots are threads of one Python process), checked
against the measured shared arm; and projected onto separate devices (GPU engines): what sharing gives
without CPU contention between trainers and engines.
Goal (issue 7): >= 40% fewer engine-hours with <= 15% slowdown per job.

`--lora` (issue 22): the jobs are train.lora runs on one base (tiny:0, each job its own seed, so its own
samples and adapter), attached to the pool as LoRA jobs: on a shared engine they run in one batch, each
request with its job's adapter, and never switch. Scenarios: 2 jobs and 4 jobs on 1 engine. Goal: >= 45%
fewer engine-hours with <= 10% slowdown per job. The simulator replays them with the jobs as LoRA jobs
(rollwise.sim.mux with MuxJob.base: the pool's scheduler plans the base as one tenancy). Wall time of a job is its
`train()` call (model load, evaluations before/after, the training loop), measured inside its process.

Both arms attach through the same pool code (HTTP, token-level), so the comparison isolates sharing.
torch runs one thread per process: a dedicated job keeps one core busy at a time (its engine or its
trainer), two jobs on one shared engine keep two (one job's engine phase beside the other's training).

The workload is GRPO in rollout.mode=sync with a small KL term (every step trains on every sample, so
training takes real time even when rewards are flat): generation and training alternate within a
job, which is the gap the pool fills with the other jobs' generation.

Why this file runs past ~400 lines: it is one experiment's protocol end to end (jobs, both arms, the
summary, the simulator's replay and projection, the report), read top to bottom like docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from rollwise.bench import process_cpu_s
from rollwise.local_server import free_port
from rollwise.sim.host import measure_cpu_host
from rollwise.sim.mux import Host

GOAL_SAVING = 0.40
GOAL_SLOWDOWN = 0.15
GOAL_SAVING_LORA = 0.45  # issue 22: LoRA jobs sharing one engine batch
GOAL_SLOWDOWN_LORA = 0.10
LORA = {"rank": 8, "alpha": 16.0}  # bench mux --lora: every job's train.lora
LORA_BASE = "tiny:0"


def goals(lora: bool) -> tuple[float, float]:
    """(minimum engine-hours saving, maximum slowdown per job) the scenario aims at."""
    return (GOAL_SAVING_LORA, GOAL_SLOWDOWN_LORA) if lora else (GOAL_SAVING, GOAL_SLOWDOWN)


def _write_task(path: Path, n: int = 64) -> Path:
    with path.open("w") as f:
        for i in range(n):
            a, b = i % 8, i // 8
            f.write(json.dumps({"prompt": f"{a}+{b}=?", "answer": a + b}) + "\n")
    return path


def _job_config(root: Path, name: str, model: str, task: Path, steps: int, workload: dict[str, Any],
                lora: dict[str, Any] | None = None, seed: int = 0) -> Path:
    cfg = {
        "model": model, "seed": seed, "output_dir": str(root / "runs" / name), "threads": 1,
        "task": {"kind": "jsonl", "path": str(task)},
        "prompt": {"system": None, "few_shot": []},
        "rollout": {"mode": "sync", "prompts_per_step": workload["prompts_per_step"],
                    "group_size": workload["group_size"], "max_tokens": workload["max_tokens"], "temperature": 1.0},
        "engine": {"kind": "reference", "max_num_seqs": workload["max_num_seqs"],
                   "max_model_len": workload["max_model_len"]},
        "train": {"steps": steps, "lr": 1e-4, "kl_coef": 0.01, "updates_per_step": workload["updates_per_step"],
                  "micro_batch_size": workload["micro_batch_size"]},
        "eval": {"size": workload["eval_size"]},
        "tensorboard": False,
    }
    if lora is not None:  # a LoRA job: it pushes only its adapter, and shares its base's engine in the pool
        cfg["train"]["lora"] = dict(lora)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _job_main(config: str, out: str, *overrides: str) -> None:
    """One job, in its own process: `rollwise train`'s loop, timed from inside (start/end wall clock)."""
    import io

    from rich.console import Console

    from rollwise.config import load_config
    from rollwise.control.train_loop import train

    cfg = load_config(Path(config), list(overrides))
    t0, cpu0 = time.time(), os.times()
    summary = train(cfg, Console(file=io.StringIO(), width=160))
    t1, cpu1 = time.time(), os.times()
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    Path(out).write_text(json.dumps({"start": t0, "end": t1, "wall_s": t1 - t0, "steps": summary["steps"],
                                     "generate_s": sum(r["time_generate_s"] for r in records),
                                     "train_s": sum(r["time_train_s"] for r in records),
                                     "weight_sync_s": sum(r["time_weight_sync_s"] for r in records),
                                     "reward_s": sum(r["time_reward_s"] for r in records),
                                     # launch to the first step, and after the last one (final evaluation, summary):
                                     # the simulator counts both as start-up CPU (docs/benchmarks/lora.md, bench mux --lora)
                                     "first_step_s": records[0]["elapsed_s"] - records[0]["time_step_s"],
                                     "after_last_step_s": (t1 - t0) - records[-1]["elapsed_s"],
                                     # step-to-step variation (coefficient of variation), for the simulator
                                     "generate_cv": _cv([r["time_generate_s"] for r in records]),
                                     "train_cv": _cv([r["time_train_s"] for r in records]),
                                     # CPU time of this process (all threads): what it asks of the cores
                                     "cpu_s": (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system),
                                     "policy_version": summary["policy_version"], "run_dir": summary["run_dir"],
                                     "engine": summary["engine"]}))


def _cv(values: list[float]) -> float:
    import statistics

    return statistics.pstdev(values) / statistics.mean(values) if len(values) > 1 and sum(values) > 0 else 0.0


def _spawn_job(config: Path, out: Path, overrides: list[str], log: Path) -> subprocess.Popen:
    code = "import sys, rollwise.bench.mux as m; m._job_main(*sys.argv[1:])"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen([sys.executable, "-c", code, str(config), str(out), *overrides],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def _wait(procs: list[tuple[str, subprocess.Popen, Path]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for name, proc, log in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            raise RuntimeError(f"job {name} did not finish within {timeout:.0f}s; log: {log}") from None
        if proc.returncode != 0:
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"job {name} failed (exit {proc.returncode}); log {log}:\n{tail}")


def _start_pool(engines: int, workload: dict[str, Any], min_slice_s: float, log: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollwise.cli", "serve", "pool", "--engines", str(engines), "--port", str(port),
         "--max-num-seqs", str(workload["max_num_seqs"]), "--max-model-len", str(workload["max_model_len"]),
         "--min-slice", str(min_slice_s), "--max-sleeping", "4", "--threads", "1", "--log-level", "warning"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the pool exited (code {proc.returncode}); log {log}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the pool did not start within 120 s; log {log}")


def prepare_scenario(base: Path, jobs: int, models: list[str], steps: int,
                     workload: dict[str, Any], lora: dict[str, Any] | None = None) -> dict[str, Path]:
    """In folder `base`: the task file and one `rollwise train` config per job (job0, job1, ...). LoRA jobs
    share their base model; each has its own seed (its own samples, so its own adapter)."""
    base.mkdir(parents=True, exist_ok=True)
    task = _write_task(base / "add.jsonl")
    return {f"job{i}": _job_config(base, f"job{i}", models[i % len(models)], task, steps, workload, lora,
                                   seed=i if lora is not None else 0)
            for i in range(jobs)}


def _stop(pool: subprocess.Popen) -> None:
    pool.terminate()
    try:
        pool.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pool.kill()


def _spawn_arm_job(base: Path, arm: str, name: str, config: Path, url: str) -> tuple[str, subprocess.Popen, Path]:
    """Job `name` of arm `arm` on the pool at `url`: its result goes to {arm}-{name}.json (_read_arm_job)."""
    log = base / f"{arm}-{name}.log"
    overrides = [f"pool.url={url}", f"pool.job={name}", f"output_dir={base / 'runs' / (arm + '-' + name)}"]
    return name, _spawn_job(config, base / f"{arm}-{name}.json", overrides, log), log


def _read_arm_job(base: Path, arm: str, name: str) -> dict[str, Any]:
    return json.loads((base / f"{arm}-{name}.json").read_text())


def run_dedicated(base: Path, configs: dict[str, Path], workload: dict[str, Any], min_slice_s: float = 5.0,
                  timeout: float = 1800.0, arm: str = "dedicated") -> dict[str, dict[str, Any]]:
    """The dedicated arm: one job at a time, each on a fresh 1-engine pool of its own, so both arms run the
    same code path and differ only in sharing. Fresh, because a dedicated engine is built for its job:
    reusing one pool let a LoRA job find the previous job's base engine warm (its build, ~5-7 s of a
    ~25 s job here, paid by the first job only), which the shared arm's jobs all wait for. Per job: its
    timings and the CPU seconds of its pool while it ran."""
    dedicated: dict[str, dict[str, Any]] = {}
    for n, config in configs.items():  # one after another: each has the machine (and its engine) to itself
        pool, url = _start_pool(1, workload, min_slice_s, base / f"pool-{arm}-{n}.log")
        try:
            cpu0 = process_cpu_s(pool.pid)
            _wait([_spawn_arm_job(base, arm, n, config, url)], timeout)
            dedicated[n] = _read_arm_job(base, arm, n) | {"pool_cpu_s": process_cpu_s(pool.pid) - cpu0}
        finally:
            _stop(pool)
    return dedicated


def run_shared(base: Path, configs: dict[str, Path], engines: int, workload: dict[str, Any],
               min_slice_s: float = 5.0, timeout: float = 1800.0, arm: str = "shared") -> dict[str, Any]:
    """The shared arm: all jobs at once on one pool of `engines` engines. Per job its timings, the pool's
    own accounting (/state) and the pool process's CPU seconds."""
    import httpx

    pool, url = _start_pool(engines, workload, min_slice_s, base / f"pool-{arm}.log")
    try:
        cpu0 = process_cpu_s(pool.pid)
        _wait([_spawn_arm_job(base, arm, n, config, url) for n, config in configs.items()], timeout)
        pool_state = httpx.get(f"{url}/state", timeout=30).json()
        pool_cpu_s = process_cpu_s(pool.pid) - cpu0
    finally:
        _stop(pool)
    return {"jobs": {n: _read_arm_job(base, arm, n) for n in configs},
            "pool_state": pool_state, "pool_cpu_s": pool_cpu_s}


def mean_dedicated(arms: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Several dedicated arms as one: per job, the mean of each measured time (the first arm's other
    fields). rollwise sim validate-mux measures one before and one after each shared arm, so that this
    machine's drift between minutes cancels (to first order) in the comparison."""
    merged = {}
    for name, first in arms[0].items():
        merged[name] = dict(first)
        for key, value in first.items():
            if isinstance(value, float) and key not in ("start", "end"):  # (timestamps: the first arm's)
                merged[name][key] = sum(arm[name][key] for arm in arms) / len(arms)
    return merged


def run_scenario(root: Path, jobs: int, engines: int, models: list[str], steps: int, workload: dict[str, Any],
                 min_slice_s: float = 5.0, timeout: float = 1800.0, host: Host | None = None,
                 lora: dict[str, Any] | None = None) -> dict[str, Any]:
    """Both arms of one scenario: `jobs` jobs, dedicated (one engine each, in turn) vs. shared (`engines`),
    as dedicated, shared, dedicated: each job's dedicated time is the mean of the runs before and after
    the shared arm, so that this machine's drift between minutes (10-40%) cancels to first order.
    `host`: this machine for the simulator (default: every core at full speed; run_mux_bench passes the
    measured effective cores). `lora`: every job's train.lora (LoRA jobs on their one base)."""
    base = root / f"{jobs}x{engines}"
    configs = prepare_scenario(base, jobs, models, steps, workload, lora)
    before = run_dedicated(base, configs, workload, min_slice_s, timeout, arm="dedicated-before")
    shared = run_shared(base, configs, engines, workload, min_slice_s, timeout)
    after = run_dedicated(base, configs, workload, min_slice_s, timeout, arm="dedicated-after")
    return summarize_between(engines, models, steps, workload, before, shared, after, min_slice_s, host, lora)


def summarize_between(engines: int, models: list[str], steps: int, workload: dict[str, Any],
                      before: dict[str, dict[str, Any]], shared_arm: dict[str, Any],
                      after: dict[str, dict[str, Any]], min_slice_s: float = 5.0,
                      host: Host | None = None, lora: dict[str, Any] | None = None) -> dict[str, Any]:
    """A shared arm between two dedicated arms: summarize_scenario on the dedicated arms' mean, with how
    far the two dedicated runs of each job disagree (`dedicated_drift`, after / before - 1): the noise
    floor of that job's slowdown."""
    result = summarize_scenario(engines, models, steps, workload, mean_dedicated([before, after]), shared_arm,
                                min_slice_s, host, lora)
    result["dedicated_drift"] = {n: after[n]["wall_s"] / before[n]["wall_s"] - 1 for n in before}
    return result


def summarize_scenario(engines: int, models: list[str], steps: int, workload: dict[str, Any],
                       dedicated: dict[str, dict[str, Any]], shared_arm: dict[str, Any], min_slice_s: float = 5.0,
                       host: Host | None = None, lora: dict[str, Any] | None = None) -> dict[str, Any]:
    """One scenario's report: engine-hours of both arms, per-job slowdown, and the simulator's replay of
    the dedicated arm (on this machine, and on separate devices)."""
    names = list(dedicated)
    jobs = len(names)
    shared, pool_state = shared_arm["jobs"], shared_arm["pool_state"]
    dedicated_eh = sum(r["wall_s"] for r in dedicated.values()) / 3600  # one engine per job, for its run
    span = max(r["end"] for r in shared.values()) - min(r["start"] for r in shared.values())
    shared_eh = engines * span / 3600  # the pool's engines, while any job runs
    per_job = {}
    for n in names:
        acct = pool_state["detached_jobs"].get(n) or pool_state["jobs"].get(n) or {}
        per_job[n] = {
            "model": models[names.index(n) % len(models)],
            "wall_dedicated_s": dedicated[n]["wall_s"], "wall_shared_s": shared[n]["wall_s"],
            "slowdown": shared[n]["wall_s"] / dedicated[n]["wall_s"] - 1,
            "pool_engine_s_allocated": acct.get("engine_seconds_allocated"),
            "pool_engine_s_busy": acct.get("engine_seconds_busy"),
            "pool_engine_s_transitions": acct.get("engine_seconds_transitions"),
            "policy_version_dedicated": dedicated[n]["policy_version"], "policy_version_shared": shared[n]["policy_version"],
            # where the time went (sums over the steps): generation includes waiting for a shared engine;
            # training never waits on the pool, so a slower train phase is CPU contention on this machine
            "generate_s_dedicated": dedicated[n]["generate_s"], "generate_s_shared": shared[n]["generate_s"],
            "train_s_dedicated": dedicated[n]["train_s"], "train_s_shared": shared[n]["train_s"],
            "weight_sync_s_dedicated": dedicated[n]["weight_sync_s"], "weight_sync_s_shared": shared[n]["weight_sync_s"],
            # CPU seconds: the job's process, and the pool's process while this job ran alone on it
            "cpu_s_dedicated": dedicated[n]["cpu_s"], "cpu_s_shared": shared[n]["cpu_s"],
            "pool_cpu_s_dedicated": dedicated[n]["pool_cpu_s"],
        }
    saving = 1 - shared_eh / dedicated_eh
    worst = max(j["slowdown"] for j in per_job.values())
    goal_saving, goal_slowdown = goals(lora is not None)
    base = models[0] if lora is not None else None  # LoRA jobs: one tenancy of the pool's scheduler
    # The same jobs in the cluster simulator (rollwise.sim.mux: the pool's own scheduler, simulated engines),
    # with phase times measured in the dedicated arm. Twice: on this machine as it is (its cores shared by
    # the trainers and the pool, whose engine slots are threads of one Python process), which checks the
    # simulator against the measured shared arm; and with each engine and trainer on a device of its own,
    # as on a GPU cluster, which is what sharing gives there.
    costs = pool_state.get("transition_costs", {})
    projection = project_from_dedicated(dedicated, engines, workload, costs, min_slice_s, base=base)
    host = host or Host(cores=float(os.cpu_count() or 1), pool_cores=1.0)
    here = project_from_dedicated(dedicated, engines, workload, costs, min_slice_s, host, base=base)
    simulated_here = {**here, "host": {"cores": host.cores, "pool_cores": host.pool_cores,
                                       "crowding": [list(point) for point in host.crowding]},
                      "wall_shared_error": {n: here["wall_shared_s"][n] / shared[n]["wall_s"] - 1 for n in names}}
    return {
        "scenario": f"{jobs}x{engines}" + ("-lora" if lora is not None else ""), "jobs": jobs,
        "engines_shared": engines, "steps": steps, "lora": lora,
        "engine_hours_dedicated": dedicated_eh, "engine_hours_shared": shared_eh, "engine_hours_saving": saving,
        "shared_span_s": span, "dedicated_total_s": dedicated_eh * 3600, "pool_cpu_s_shared": shared_arm["pool_cpu_s"],
        "max_slowdown": worst, "mean_slowdown": sum(j["slowdown"] for j in per_job.values()) / jobs,
        "meets_goal": saving >= goal_saving and worst <= goal_slowdown,
        "per_job": per_job,
        "projection": {**projection, "max_slowdown": max(projection["slowdown"].values()),
                       "meets_goal": projection["engine_hours_saving"] >= goal_saving
                       and max(projection["slowdown"].values()) <= goal_slowdown},
        "simulated_here": simulated_here,
        "transition_costs": costs,
        "isolation": {"checked_admissions": pool_state["isolation"]["checked_admissions"],
                      "violations": len(pool_state["isolation"]["violations"])},
        "pool_engine_hours_unallocated": pool_state.get("engine_hours_unallocated"),
    }


def project_from_dedicated(dedicated: dict[str, dict[str, Any]], engines: int, workload: dict[str, Any],
                           transition_costs: dict[str, Any], min_slice_s: float = 5.0,
                           host: Host = Host(), base: str | None = None) -> dict[str, Any]:
    """The scenario in simulation, calibrated on its dedicated arm: each job's generation, train (+ weight
    sync) and start-up times per step as measured alone; an engine cost model whose decode step makes the
    slowest job's measured generation (every sample runs to max_tokens: the tiny models rarely stop),
    `host.engine_batch_share` of it growing with the batch (measure_batch_share; the default Host, a GPU
    cluster: 0, a step costs the same at any batch); the pool's measured switch costs. `base`: the jobs
    are LoRA jobs on that base (one engine tenancy)."""
    from rollwise.pool.scheduler import Policy
    from rollwise.sim.cost import CostModel
    from rollwise.sim.mux import MuxJob, Transitions, compare_shared_vs_dedicated

    max_tokens = workload["max_tokens"]
    per_step = {n: d["generate_s"] / max(d["steps"], 1) for n, d in dedicated.items()}
    step_s = max(per_step.values()) / max_tokens
    batch, share = workload["prompts_per_step"] * workload["group_size"], host.engine_batch_share
    cost = CostModel(name="fitted to bench mux's dedicated arm", step_overhead_s=step_s * (1 - share),
                     decode_s_per_seq=step_s * share / batch,
                     max_num_seqs=workload["max_num_seqs"], max_model_len=workload["max_model_len"])
    jobs = []
    for n, d in dedicated.items():
        steps = max(d["steps"], 1)
        train = d["train_s"] + d["weight_sync_s"]
        jobs.append(MuxJob(n, steps, workload["prompts_per_step"], workload["group_size"], prompt_tokens=8,
                           max_tokens=max_tokens, train_s=lambda _tokens, t=train / steps: t,
                           response_tokens=max(1, round(per_step[n] / step_s)),
                           startup_s=max(d["wall_s"] - d["generate_s"] - train, 0.0),
                           generate_cv=d.get("generate_cv", 0.0), train_cv=d.get("train_cv", 0.0), base=base))
    mean = {k: transition_costs.get(k, {}).get("mean_s", 0.0) for k in ("load", "wake", "sleep")}
    r = compare_shared_vs_dedicated(jobs, engines, cost, Transitions(mean["load"], mean["wake"], mean["sleep"]),
                                    Policy(min_slice_s=min_slice_s), host=host)
    return {"wall_shared_s": {n: j["shared_wall_s"] for n, j in r["jobs"].items()},
            "wall_dedicated_s": {n: j["dedicated_wall_s"] for n, j in r["jobs"].items()},
            "slowdown": {n: j["slowdown"] for n, j in r["jobs"].items()},
            "engine_s_dedicated": r["dedicated_engine_hours"] * 3600, "engine_s_shared": r["shared_engine_hours"] * 3600,
            "engine_hours_saving": r["engine_hours_saved"], "transitions_s": mean}


def _cpu_busy(seconds: float = 1.0) -> float | None:
    """Cores kept busy by everything on the machine over `seconds` (/proc/stat), before the bench starts:
    what other jobs leave to this one."""
    def read() -> tuple[int, int] | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    a = read()
    time.sleep(seconds)
    b = read()
    if a is None or b is None or b[0] == a[0]:
        return None
    total, idle = b[0] - a[0], b[1] - a[1]
    return (total - idle) / total * (os.cpu_count() or 1)


# A sync GRPO step whose training (2 PPO updates over 32 samples) takes somewhat longer than its generation
# (32 samples x <= 96 tokens): measured on one core, ~0.25 s generate, ~0.4 s train on the tiny models.
# The engine idles for the training part of every step: the gap the pool fills.
QUICK = {"prompts_per_step": 4, "group_size": 8, "max_tokens": 96, "max_num_seqs": 32, "max_model_len": 192,
         "updates_per_step": 2, "micro_batch_size": 16, "eval_size": 4}
FULL = QUICK
# LoRA jobs share one engine *batch*, so the engine must seat every job's step at once (4 jobs x 32 samples),
# as a GPU engine's batch (vLLM: 256 sequences) seats several small jobs; with room for one job's 32 the
# second job's step queued behind the first and sharing became time-slicing. Both arms use this engine
# (a dedicated job fills a quarter of it).
LORA_WORKLOAD = {**QUICK, "max_num_seqs": 128}


def scenario_specs(quick: bool, lora: bool = False) -> list[dict[str, Any]]:
    """run_scenario's arguments for each scenario of the benchmark (lora: LoRA jobs on one base, issue 22)."""
    if lora:
        two = {"jobs": 2, "engines": 1, "models": [LORA_BASE], "min_slice_s": 5.0, "lora": LORA}
        if quick:
            return [{**two, "steps": 12, "workload": LORA_WORKLOAD}]
        return [{**two, "steps": 24, "workload": LORA_WORKLOAD},
                {**two, "jobs": 4, "steps": 24, "workload": LORA_WORKLOAD}]
    two = {"jobs": 2, "engines": 1, "models": ["tiny:0", "tiny:1"], "min_slice_s": 5.0}
    if quick:
        return [{**two, "steps": 16, "workload": QUICK}]
    four = {"jobs": 4, "engines": 2, "models": [f"tiny:{i}" for i in range(4)], "min_slice_s": 5.0}
    return [{**two, "steps": 24, "workload": FULL}, {**four, "steps": 24, "workload": FULL}]


def measure_host(specs: list[dict[str, Any]]) -> tuple[dict[str, Any], Host]:
    """This machine for the simulation of these scenarios: how much single-threaded work its cores do at
    once (less than os.cpu_count() on a VM), with two processes and with as many as the largest scenario
    runs (its trainers and the pool); the CPU pool's engine slots are threads of one Python process; and how
    the pool engine's step grows with its batch (measure_batch_share)."""
    measured = measure_cpu_host(processes=max(spec["jobs"] for spec in specs) + 1)
    measured["engine_batch_share"] = measure_batch_share(specs[0].get("lora") is not None, specs[0]["workload"])
    return measured, Host.measured(measured)


def measure_batch_share(lora: bool, workload: dict[str, Any], repeats: int = 3) -> float:
    """The share of the pool engine's decode step that grows with its batch, at one job's batch (B = prompts x
    group sequences), on this machine: r = (a step of 2B sequences, LoRA: two jobs' adapters in the one
    batch) / (a step of B, one job), share = r - 1 if the step is overhead + per sequence x batch. The
    simulator's engine needs it: the tiny models' steps are their op count and per-sequence Python work,
    so two jobs in one batch cost ~1.3x one job's step here (session 17), where a GPU's decode step barely grows
    (and the dedicated arm, always B sequences, cannot tell the two parts apart). One torch thread, as the
    pool's engine; the median of `repeats` interleaved pairs."""
    import statistics

    import torch

    from rollwise.bench.adapters import random_adapter
    from rollwise.engine.reference.engine import ReferenceEngine
    from rollwise.types.generation import GenerationRequest, SamplingParams
    from rollwise.model.loading import load_model
    from rollwise.engine.weight_receiver import WeightReceiver
    from rollwise.sync.adapters import adapter_update

    batch, tokens = workload["prompts_per_step"] * workload["group_size"], workload["max_tokens"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, _ = load_model(LORA_BASE)
        engine = ReferenceEngine(model, max_num_seqs=2 * batch, max_model_len=workload["max_model_len"], seed=0)
        adapters = [None, None]
        if lora:
            for j in range(2):
                state, spec = random_adapter(engine.model, LORA["rank"], name=f"job{j}", default=False, seed=j)
                WeightReceiver(engine, None, adapters=engine).receive(adapter_update(state, spec, 1, ""))
            adapters = ["job0", "job1"]

        def step_s(jobs: int) -> float:
            requests = [GenerationRequest(f"{j}-{i}", [5 + i % 7, 6, 7, 8, 9, 10, 11, 12],
                                          SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i), adapter=adapters[j])
                        for j in range(jobs) for i in range(batch)]
            start = time.process_time()
            engine.generate(requests)
            return time.process_time() - start

        step_s(1)  # warm-up
        ratios = [step_s(2) / step_s(1) for _ in range(repeats)]
    finally:
        torch.set_num_threads(threads)
    return min(max(statistics.median(ratios) - 1, 0.0), 1.0)


def run_mux_bench(quick: bool = False, root: Path | None = None, lora: bool = False) -> dict[str, Any]:
    """quick: 2 tiny jobs on 1 engine, 16 steps (about a minute here). Full: 2 jobs / 1 engine and 4 jobs /
    2 engines, 24 steps. Jobs use tiny:0, tiny:1, ... (different weights). lora: train.lora jobs on tiny:0,
    2 on 1 engine (quick: 12 steps), full: also 4 on 1 engine."""
    root = Path(tempfile.mkdtemp(prefix="rollwise-mux-")) if root is None else root
    t0 = time.monotonic()
    busy_before = _cpu_busy()
    specs = scenario_specs(quick, lora)
    measured, host = measure_host(specs)
    scenarios = [run_scenario(root, **spec, host=host) for spec in specs]
    goal_saving, goal_slowdown = goals(lora)
    return {"bench": "mux", "quick": quick, "lora": lora, "scenarios": scenarios, "workdir": str(root),
            "cpu_busy_before_start": busy_before, "host": measured,
            "goal": {"engine_hours_saving_min": goal_saving, "slowdown_max": goal_slowdown},
            "bench_seconds": time.monotonic() - t0, "cpu_count": os.cpu_count(),
            "load_average_1m_at_end": os.getloadavg()[0]}


def describe_cores(measured: dict[str, Any]) -> str:
    """'1.92 effective cores (1.80 with 5 processes)': rollwise.sim.host.measure_cpu_host's result, in words."""
    crowded = [f"{c:.2f} with {n} processes" for n, c in measured.get("crowding", [])[1:]]
    text = f"{measured['cores']:.2f} effective cores" + (f" ({', '.join(crowded)})" if crowded else "")
    if "engine_batch_share" in measured:  # (bench results before session 17 lack it)
        text += f"; the engine's step {1 + measured['engine_batch_share']:.2f}x as long with two jobs' batches"
    return text


def format_mux_bench(result: dict[str, Any]):
    from rich.table import Table

    title = "shared engine pool vs. dedicated engines (same jobs, same steps, one run)"
    if result.get("lora"):
        title = f"LoRA jobs on one base ({LORA_BASE}, rank {LORA['rank']}): " + title + "; shared = one engine batch"
    table = Table(title=title)
    for col in ("scenario", "job", "wall ded. -> shared", "slowdown", "ded. after/before", "generate ded. -> shared",
                "train ded. -> shared", "pool engine-s (busy)", "engine-s ded. -> shared", "saving"):
        table.add_column(col, justify="left" if col in ("scenario", "job") else "right")
    for s in result["scenarios"]:
        first = True
        here = s["simulated_here"]
        for name, j in s["per_job"].items():
            table.add_row(
                f"{s['jobs']} jobs / {s['engines_shared']} engine(s)" if first else "", f"{name} ({j['model']})",
                f"{j['wall_dedicated_s']:.1f} -> {j['wall_shared_s']:.1f}s (sim** {here['wall_shared_s'][name]:.1f}s, "
                f"{here['wall_shared_error'][name]:+.0%})", f"{j['slowdown']:+.0%}",
                f"{s['dedicated_drift'][name]:+.0%}",
                f"{j['generate_s_dedicated']:.1f} -> {j['generate_s_shared']:.1f}s",
                f"{j['train_s_dedicated']:.1f} -> {j['train_s_shared']:.1f}s",
                f"{(j['pool_engine_s_allocated'] or 0):.1f} ({(j['pool_engine_s_busy'] or 0):.1f})",
                f"{s['engine_hours_dedicated'] * 3600:.0f} -> {s['engine_hours_shared'] * 3600:.0f}" if first else "",
                (f"{s['engine_hours_saving']:.0%}" + (" (goal met)" if s["meets_goal"] else "")) if first else "",
            )
            first = False
        costs = ", ".join(f"{k} {v['count']}x {v['mean_s'] * 1000:.0f} ms" for k, v in s["transition_costs"].items())
        table.add_row("", "", "max", f"{s['max_slowdown']:+.0%}", "", "", "", "", "", "")
        p = s["projection"]
        table.add_row("", "projected*", "max", f"{p['max_slowdown']:+.0%}", "", "", "", "",
                      f"{p['engine_s_dedicated']:.0f} -> {p['engine_s_shared']:.0f}",
                      f"{p['engine_hours_saving']:.0%}" + (" (goal met)" if p["meets_goal"] else ""), end_section=True)
        table.caption = (table.caption or "") + f"{s['scenario']} transitions: {costs}. "
    table.caption = (table.caption or "") + (
        "Dedicated: the mean of a run before and one after the shared arm (this machine drifts); "
        "ded. after/before: how far they disagree. "
        "*projected: the same jobs in the cluster simulator (rollwise.sim.mux: the pool's own scheduler on "
        "simulated engines) with the phase times measured in the dedicated arm and the measured switch costs "
        "(trainers not competing with engines for cores, as with GPU engines). **sim: the same simulation of this "
        f"machine ({describe_cores(result['host'])}, measured, shared by the trainers and the pool; "
        "the pool's engine slots, threads of one Python process, one core's worth together): shared wall time "
        "and its error against the measured one. ")
    busy = result.get("cpu_busy_before_start")
    table.caption = (table.caption or "") + (
        f"Goal: >= {result['goal']['engine_hours_saving_min']:.0%} fewer engine-hours, "
        f"<= {result['goal']['slowdown_max']:.0%} slowdown per job. "
        + (f"Other load before the bench: {busy:.1f} of {result['cpu_count']} cores busy." if busy is not None else ""))
    return table

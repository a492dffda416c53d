"""Validation: the rollout benchmark measured on the real engine, and simulated with a calibrated cost
model, side by side. The simulation gets the benchmark's own controller inputs (config, prompts from
the real tokenizer and task, forced lengths), so only the engine and trainer are modelled."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollwise.bench.rollout import FULL, MODES, QUICK, bench_config, forced_lengths, run_rollout_bench, with_kind
from rollwise.rollout.data import ProblemStream
from rollwise.rollout.sync_rollout import PromptEncoder
from rollwise.sim.cost import CostModel, TrainerModel
from rollwise.sim.run import build, simulate
from rollwise.sim.scenario import Scenario
from rollwise.tasks import make_task


@dataclass(frozen=True)
class SharedHost:
    """Where bench rollout ran: `cores` cores shared by the engine and the trainer, `threads` torch threads
    each (one process). 0 cores: use the cost file's calibrated contention tables instead."""

    cores: float
    threads: int

    @staticmethod
    def here(cores: float | None = None) -> SharedHost:
        import torch

        from rollwise.observe.peak import usable_cores

        # default: the cores this process may use (a container's limit)
        return SharedHost(float(usable_cores()) if cores is None else cores, torch.get_num_threads())


def simulate_bench(tokenizer: Any, cost: CostModel, trainer: TrainerModel, *, quick: bool = True, seed: int = 0,
                   modes: tuple[str, ...] = MODES, update_batch: str = "fixed",
                   host: SharedHost | None = None) -> list[dict[str, Any]]:
    """host: the cores the measured engine and trainer shared (their contention is then derived from them,
    rollwise.sim.cores.overlap_slowdowns); None: the cost file's own contention (tables or shared_cores)."""
    w = QUICK if quick else FULL
    out = []
    for mode in modes:
        cfg = bench_config(mode, w, seed, update_batch)
        task = make_task(cfg.task)
        update: dict[str, Any] = {"max_num_seqs": w.max_num_seqs, "max_model_len": cfg.engine.max_model_len}
        if host is not None:
            update |= {"shared_cores": host.cores, "torch_threads": host.threads}
        engine_cost = cost.model_copy(update=update)
        scenario = Scenario.model_validate({
            "name": "bench-rollout-" + ("quick" if quick else "full"), "seed": seed,
            "cluster": {"gpus": 1, "routing": "round_robin", "trainer_gpus_ratio": 1.0},
            "workload": {"updates": w.updates, "prompts_per_step": w.prompts_per_step, "group_size": w.group_size,
                         "output": {"max_tokens": w.max_tokens}},
            "rollout": {"mode": mode, "max_staleness": w.eta, "oversubscription": w.eta + 1.0,
                        "update_batch": update_batch},
        })
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 2
        run = build(scenario, cost=engine_cost, trainer=trainer, length_fn=forced_lengths(seed, w),
                    encoder=PromptEncoder(tokenizer, cfg.prompt, cfg.reward),
                    stream=ProblemStream(task.problems("train"), seed), cfg=cfg, vocab_size=len(tokenizer),
                    eos_token_id=eos)
        out.append(simulate(run))
    return out


def compare(measured: dict[str, Any], simulated: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for m, s in zip(measured["modes"], simulated):
        row: dict[str, Any] = {"mode": m["mode"]}
        if "samples_per_s_runs" in m:  # several rounds: the measured spread, against which the error reads
            row["samples_per_s_measured_runs"] = m["samples_per_s_runs"]
        for key in ("bubble_ratio", "samples_per_s", "wall_s", "staleness_mean", "samples_regenerated"):
            sim_key = "virtual_s" if key == "wall_s" else key
            row[f"{key}_measured"] = m[key]
            row[f"{key}_simulated"] = s[sim_key]
            if key in ("bubble_ratio", "samples_per_s", "wall_s") and m[key]:
                row[f"{key}_error"] = s[sim_key] / m[key] - 1
        rows.append(row)
    return rows


def measure_rounds(model: Any, tokenizer: Any, *, engine_kind: str, quick: bool = True, seed: int = 0,
                   rounds: int = 1, update_batch: str = "fixed") -> dict[str, Any]:
    """The benchmark `rounds` times, the modes in an order rotated each round (the machine's slow
    phases fall on every mode alike). Per mode: the median run by wall time, with every run's wall
    time and bubble ratio beside it (on this shared 2-core machine the same run varies by 10-30%)."""
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    result: dict[str, Any] = {}
    for r in range(rounds):
        order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]
        result = run_rollout_bench(model, tokenizer, quick=quick, seed=seed, engine_kind=engine_kind, modes=order,
                                   update_batch=update_batch)
        for m in result["modes"]:
            runs[m["mode"]].append(m)
    modes = []
    for mode in MODES:
        ordered = sorted(runs[mode], key=lambda m: m["wall_s"])
        median = ordered[(len(ordered) - 1) // 2]
        modes.append({**median, "wall_s_runs": [m["wall_s"] for m in runs[mode]],
                      "samples_per_s_runs": [m["samples_per_s"] for m in runs[mode]],
                      "bubble_ratio_runs": [m["bubble_ratio"] for m in runs[mode]]})
    return {**result, "rounds": rounds, "modes": modes}


def validate(model: Any, tokenizer: Any, cost: CostModel, trainer: TrainerModel, *, engine_kind: str,
             quick: bool = True, seed: int = 0, rounds: int = 1, update_batch: str = "fixed",
             shared_cores: float | None = None) -> dict[str, Any]:
    """update_batch=flexible (issue 26): both sides run the flexible update batch (sync is unchanged by it).
    shared_cores: the cores engine and trainer share here (None: this process's; 0: the calibrated tables)."""
    measured = measure_rounds(model, tokenizer, quick=quick, seed=seed, engine_kind=engine_kind, rounds=rounds,
                              update_batch=update_batch)
    host = SharedHost.here(shared_cores)
    return _result(measured, tokenizer, cost, trainer, engine_kind=engine_kind, quick=quick, seed=seed,
                   update_batch=update_batch, host=host)


def replay(path: Path, tokenizer: Any, cost: CostModel, trainer: TrainerModel, *,
           shared_cores: float | None = None) -> dict[str, Any]:
    """The simulated side again, against the measured side of an earlier `sim validate --json` (nothing is
    measured: a cost-model change is checked offline). Workload, seed and update batch come from the file;
    the shared cores from `shared_cores` where given (0: the calibrated tables), else the file's, else this
    process's (the file was measured on this machine)."""
    doc = json.loads(Path(path).read_text())
    measured = doc.get("measured")
    if not isinstance(measured, dict) or "modes" not in measured or "workload" not in measured:
        raise ValueError(f"{path}: no measured side (want the JSON of `rollwise sim validate --json`, with "
                         "measured.modes and measured.workload; --rollout-only results cannot be replayed)")
    if measured["workload"] not in (QUICK.__dict__, FULL.__dict__):
        raise ValueError(f"{path}: measured.workload {measured['workload']} is neither the --quick nor the full "
                         "workload of this version's bench rollout: measure again")
    recorded = doc.get("host") or {}
    host = SharedHost.here(shared_cores if shared_cores is not None else recorded.get("cores"))
    host = SharedHost(host.cores, int(recorded.get("threads", measured.get("threads", host.threads))))
    out = _result(measured, tokenizer, cost, trainer, engine_kind=doc.get("engine", "reference"),
                  quick=measured["workload"] == QUICK.__dict__, seed=int(doc.get("seed", 0)),
                  update_batch=doc.get("update_batch", "fixed"), host=host)
    return {**out, "replay_of": str(path)}


def load_tokenizer(spec: str) -> Any:
    """The model's tokenizer alone (a replay encodes the benchmark's prompts; no weights are needed)."""
    from rollwise.model.loading import TINY_MOE_PREFIX, TINY_PREFIX, load_model, resolve_model_path

    if spec.startswith((TINY_PREFIX, TINY_MOE_PREFIX)):
        return load_model(spec)[1]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(spec))


def _result(measured: dict[str, Any], tokenizer: Any, cost: CostModel, trainer: TrainerModel, *, engine_kind: str,
            quick: bool, seed: int, update_batch: str, host: SharedHost) -> dict[str, Any]:
    simulated = simulate_bench(tokenizer, cost, trainer, quick=quick, seed=seed, update_batch=update_batch,
                               host=host if host.cores > 0 else None)
    return {"engine": engine_kind, "cost_model": cost.name, "update_batch": update_batch, "seed": seed,
            "host": {"cores": host.cores, "threads": host.threads}, "measured": measured,
            "simulated": [{k: v for k, v in r.items() if not k.startswith("_")} for r in simulated],
            "comparison": compare(measured, simulated)}


def measure_rollout_only(model: Any, tokenizer: Any, engine_kind: str, mode: str, *, quick: bool = True,
                         seed: int = 0) -> dict[str, Any]:
    """The benchmark's generation on the real engine with the trainer taken out (no train step; an empty
    weight update only advances the version, reference engine): isolates the engine cost model and the controller's scheduling from the trainer's timing."""
    import time

    from rollwise.engine.factory import create_engine
    from rollwise.observe.bubble import bubble_ratio
    from rollwise.reward.batch import Unscored
    from rollwise.rollout.controller import RolloutController
    from rollwise.engine.core import EngineWorker

    w = QUICK if quick else FULL
    cfg = bench_config(mode, w, seed)
    task = make_task(cfg.task)
    engine = create_engine(with_kind(cfg.engine, engine_kind), model, tokenizer, seed=seed)
    worker = EngineWorker(engine)
    controller = RolloutController(cfg, worker, PromptEncoder(tokenizer, cfg.prompt, cfg.reward),
                                   ProblemStream(task.problems("train"), seed), Unscored(),
                                   length_fn=forced_lengths(seed, w))
    t0 = time.monotonic()
    for version in range(1, w.updates + 1):
        batch = controller.next_batch()
        controller.before_update()
        controller.mark_trained(batch)
        worker.apply_weights({}, version)  # an empty update: the version advances, no weights move
        controller.after_update(version)
    t1 = time.monotonic()
    controller.close("validation over")
    worker.close()
    getattr(engine, "close", lambda: None)()
    n = w.updates * w.prompts_per_step * w.group_size
    return {"mode": mode, "wall_s": t1 - t0, "samples_per_s": n / (t1 - t0),
            "bubble_ratio": bubble_ratio([engine.timeline], [w.max_num_seqs], t0, t1),
            "staleness_mean": 0.0, "samples_regenerated": controller.ledger.regenerated()}


def simulate_rollout_only(tokenizer: Any, cost: CostModel, mode: str, *, quick: bool = True,
                          seed: int = 0) -> dict[str, Any]:
    """The same loop in simulation: trainer time 0, no weight update on the engines."""
    from rollwise.sim.run import build

    w = QUICK if quick else FULL
    cfg = bench_config(mode, w, seed)
    task = make_task(cfg.task)
    scenario = Scenario.model_validate({"name": "bench-rollout-only", "seed": seed,
                                        "cluster": {"gpus": 1, "routing": "round_robin"},
                                        "rollout": {"mode": mode, "max_staleness": w.eta}})
    engine_cost = cost.model_copy(update={"max_num_seqs": w.max_num_seqs, "max_model_len": cfg.engine.max_model_len,
                                          "weight_update_s": 0.0, "update_reprefill": False})
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 2
    run = build(scenario, cost=engine_cost, trainer=TrainerModel(), length_fn=forced_lengths(seed, w),
                encoder=PromptEncoder(tokenizer, cfg.prompt, cfg.reward),
                stream=ProblemStream(task.problems("train"), seed), cfg=cfg, vocab_size=len(tokenizer), eos_token_id=eos)
    c, clock, cluster = run.controller, run.clock, run.cluster
    from rollwise.observe.bubble import busy_integral

    t0 = clock.now
    for version in range(1, w.updates + 1):
        batch = c.next_batch()
        c.before_update()
        c.mark_trained(batch)
        cluster.load_version(version)
        c.after_update(version)
    t1 = clock.now
    e = cluster.engines[0]
    n = w.updates * w.prompts_per_step * w.group_size
    return {"mode": mode, "virtual_s": t1 - t0, "samples_per_s": n / (t1 - t0),
            "bubble_ratio": 1 - busy_integral(e.timeline, t0, t1) / (w.max_num_seqs * (t1 - t0)),
            "staleness_mean": 0.0, "samples_regenerated": c.ledger.regenerated()}


def validate_rollout_only(model: Any, tokenizer: Any, cost: CostModel, *, engine_kind: str, quick: bool = True,
                          seed: int = 0, modes: tuple[str, ...] = ("sync", "sorted")) -> dict[str, Any]:
    measured = {"modes": [measure_rollout_only(model, tokenizer, engine_kind, m, quick=quick, seed=seed)
                          for m in modes]}
    simulated = [simulate_rollout_only(tokenizer, cost, m, quick=quick, seed=seed) for m in modes]
    return {"engine": engine_kind, "cost_model": cost.name, "rollout_only": True, "measured": measured,
            "simulated": simulated, "comparison": compare(measured, simulated)}

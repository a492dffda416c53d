"""The cluster simulator: SimEngine obeys the engine contract, runs are deterministic, the production
controller and routing policies are what it runs, and scale stays cheap."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from rollwise.engine.contract import Engine
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.sim.fit import StepRecord, fit_steps
from rollwise.sim.cluster import SimCluster
from rollwise.sim.cost import CostModel, load_cost_file
from rollwise.sim.engine import SimEngine, VirtualClock
from rollwise.sim.run import build, simulate
from rollwise.sim.scenario import Scenario, load_scenario
from rollwise.sim.sessions import simulate_sessions

SCENARIOS = Path(__file__).parent.parent / "rollwise" / "sim" / "configs" / "scenarios"
COST = CostModel(step_overhead_s=0.01, prefill_s_per_token=1e-4, decode_s_per_seq=1e-3, decode_s_per_ctx_token=1e-6,
                 max_num_seqs=4, max_model_len=64, weight_update_s=0.25)


def _req(rid: str, n: int = 1, max_tokens: int = 8, prompt: list[int] | None = None, seed: int = 0,
         ignore_eos: bool = True) -> GenerationRequest:
    return GenerationRequest(rid, [5, 6, 7] if prompt is None else prompt, SamplingParams(max_tokens=max_tokens, n=n, seed=seed,
                                                                       ignore_eos=ignore_eos))


def _small(**over) -> Scenario:
    raw = {"name": "t", "seed": 3, "cluster": {"gpus": 4, "cost": "h100-7b", "routing": "least_load"},
           "workload": {"updates": 3, "prompts_per_step": 8, "group_size": 8, "prompt_tokens": 64,
                        "output": {"median": 200, "sigma": 1.0, "max_tokens": 2048}},
           "rollout": {"mode": "sorted", "max_staleness": 1}}
    for key, value in over.items():
        node = raw
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    s = Scenario.model_validate(raw)
    s.base_dir = SCENARIOS
    return s


def _metrics(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "sim_wall_s"}


# ---------------------------------------------------------------- the engine contract


def test_sim_engine_is_an_engine_and_generates_contract_shapes():
    engine = SimEngine(COST, length_sampler=lambda req, i: 3 + i)
    assert isinstance(engine, Engine)
    out = engine.generate([_req("a", n=3, max_tokens=4, ignore_eos=False), _req("b", max_tokens=5)])
    assert [(c.request_id, c.index) for c in out] == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    assert [len(c.token_ids) for c in out] == [3, 4, 4, 5]
    assert [c.finish_reason for c in out] == ["stop", "stop", "length", "length"]
    assert out[0].token_ids[-1] in engine.eos_token_ids
    for c in out:
        assert len(c.logprobs) == len(c.versions) == len(c.token_ids)
        assert set(c.versions) == {0}
    assert engine.clock.now > 0 and not engine.has_unfinished()
    load = engine.load()
    assert load.generated_tokens == 16 and load.running == 0 and load.prompt_tokens == 12
    assert load.cached_prompt_tokens == 2 * 3 + 3  # a's 3 samples share a prefill; b (same prompt, same step) too


def test_sim_engine_abort_pause_resume_and_versions():
    engine = SimEngine(COST)
    engine.add_request(_req("a", n=2, max_tokens=10))
    engine.add_request(_req("w", n=4, max_tokens=10))  # does not fit next to a: waits
    engine.step()
    engine.step()
    engine.apply_weights(None, 1)
    t = engine.clock.now
    engine.step()  # the weight load (0.25 s) then a step
    assert engine.clock.now >= t + 0.25
    engine.pause()
    assert engine.step() == [] and engine.paused
    engine.resume()
    engine.step()
    aborted = engine.abort("a")
    assert [c.finish_reason for c in aborted] == ["abort", "abort"]
    assert aborted[0].versions == [0, 0, 1, 1]
    waiting = engine.abort("w")
    assert [len(c.token_ids) for c in waiting] == [0, 0, 0, 0]
    assert not engine.has_unfinished() and engine.abort("a") == []


def test_sim_engine_rejects_bad_input():
    engine = SimEngine(COST)
    for bad in (_req("x", prompt=[]), _req("x", prompt=[1] * 64), _req("x", prompt=[10**9]), _req("x", n=5)):
        with pytest.raises(ValueError):
            engine.add_request(bad)
    engine.add_request(_req("dup"))
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request(_req("dup"))
    with pytest.raises(ValueError):
        engine.apply_weights(None, "v2")  # type: ignore[arg-type]


def test_planned_multi_step_ops_equal_step_by_step():
    """The simulator's fast path (k steps planned at once, cut by commands) times exactly like step()."""
    reqs = [_req(f"r{i}", max_tokens=5 + 3 * i, prompt=[5 + i] * (3 + i), seed=i) for i in range(6)]
    slow = SimEngine(COST)
    done_slow = {}
    for r in reqs:
        slow.add_request(r)
    while slow.has_unfinished():
        for c in slow.step():
            done_slow[c.request_id] = (round(slow.clock.now, 9), len(c.token_ids))
    clock = VirtualClock()
    cluster = SimCluster([SimEngine(COST, clock=clock)], clock)
    cluster.submit(reqs)
    done_fast = {}
    while (c := cluster.next_completion(0.05)) is not None:
        done_fast[c.request_id] = (round(clock.now, 9), len(c.token_ids))
    assert done_fast == done_slow


def test_sim_engine_under_the_production_engine_worker():
    """The real EngineWorker thread and RolloutController run on a SimEngine unchanged."""
    from rollwise.reward.batch import Unscored
    from rollwise.rollout.controller import RolloutController
    from rollwise.engine.core import EngineWorker
    from rollwise.sim.run import SimEncoder, SimStream, run_config

    s = _small()
    engine = SimEngine(COST.model_copy(update={"max_num_seqs": 16, "max_model_len": 512}),
                       length_sampler=lambda req, i: 3 + (req.params.seed + i) % 7)
    worker = EngineWorker(engine)
    controller = RolloutController(run_config(s, 2), worker, SimEncoder(16, 4), SimStream(), Unscored())
    try:
        for version in (1, 2):
            batch = controller.next_batch()
            assert len(batch) == 2 * s.workload.group_size
            controller.before_update()
            controller.mark_trained(batch)
            worker.apply_weights(None, version)
            controller.after_update(version)
    finally:
        controller.close()
        worker.close()


# ---------------------------------------------------------------- the simulator


def test_same_seed_same_result_different_seed_different():
    a = simulate(build(_small()))
    b = simulate(build(_small()))
    assert _metrics(a) == _metrics(b)
    c = simulate(build(_small(seed=4)))
    assert c["virtual_s"] != a["virtual_s"]


def test_modes_behave_as_designed():
    results = {m: simulate(build(_small(**{"rollout.mode": m}))) for m in ("sync", "sorted", "async")}
    assert results["sync"]["staleness_max"] == 0
    for m in ("sorted", "async"):
        assert results[m]["staleness_max"] <= 1
        assert results[m]["bubble_ratio"] < results["sync"]["bubble_ratio"]
        assert results[m]["samples_per_s"] > results["sync"]["samples_per_s"]
    assert all(r["trained_samples"] == 3 * 8 * 8 for r in results.values())


def test_a_controller_policy_change_shows_up_without_simulator_edits(monkeypatch):
    """Patch the production controller's batching rule: the simulation changes with it."""
    from rollwise.rollout.controller import RolloutController

    before = simulate(build(_small()))
    # A sorted controller that waits until nothing is in flight, like sync: more bubble, slower.
    original = RolloutController._batch_ready
    monkeypatch.setattr(RolloutController, "_batch_ready", lambda self: original(self) and not self.running)
    after = simulate(build(_small()))
    assert after["bubble_ratio"] > before["bubble_ratio"]
    assert after["samples_per_s"] < before["samples_per_s"]


def test_a_routing_policy_change_shows_up_without_simulator_edits(monkeypatch):
    from rollwise.router import policies

    spread = build(_small())
    balanced = simulate(spread)
    assert sum(e.stats["steps"] > 0 for e in spread.cluster.engines) == 4
    # least_load that always picks the first replica: everything lands on one engine.
    monkeypatch.setattr(policies.LeastLoad, "choose", lambda self, req, replicas: policies.Decision(
        sorted(r.name for r in replicas)[0], "patched"))
    piled = build(_small())
    result = simulate(piled)
    assert [e.stats["steps"] > 0 for e in piled.cluster.engines] == [True, False, False, False]
    assert result["samples_per_s"] < balanced["samples_per_s"]


def test_256_gpus_in_seconds():
    s = _small(**{"cluster.gpus": 256, "workload.prompts_per_step": 256, "workload.group_size": 16,
                  "workload.updates": 2, "workload.output.median": 150})
    t = time.perf_counter()
    result = simulate(build(s))
    assert result["engines"] == 256 and result["trained_samples"] == 2 * 256 * 16
    assert time.perf_counter() - t < 30


def test_sessions_prefix_routing_reuses_history():
    hits = {}
    for policy in ("round_robin", "prefix"):
        s = load_scenario(SCENARIOS / "agent-sessions.yaml", {"cluster.gpus": 4, "cluster.routing": policy,
                                                               "sessions.count": 24, "sessions.turns": 3})
        hits[policy] = simulate_sessions(s)["prefix_hit_rate"]
    assert hits["prefix"] > hits["round_robin"] + 0.2


def test_bundled_cost_files_load_and_cite_sources():
    for name in ("h100-7b", "h100-32b"):
        engine, trainer = load_cost_file(name)
        assert engine.sources and engine.assumptions and trainer is not None and trainer.sources
    assert load_cost_file("h100-32b")[0].gpus_per_engine == 2


def test_calibration_fit_recovers_a_known_model():
    true = {"c0": 0.02, "seq": 0.003, "ctx": 2e-5, "pre": 4e-4}
    records, run = [], 0
    for batch, plen in ((1, 40), (8, 40), (32, 40), (8, 200), (32, 60)):
        for step in range(10):
            ctx = batch * plen + batch * step
            prefill = batch * plen if step == 0 else 0
            t = true["c0"] + true["seq"] * batch + true["ctx"] * ctx + true["pre"] * prefill
            records.append(StepRecord(run, step, t, batch, ctx, prefill))
        run += 1
    fit = fit_steps(records)
    assert fit["step_overhead_s"] == pytest.approx(true["c0"], rel=1e-6)
    assert fit["decode_s_per_seq"] == pytest.approx(true["seq"], rel=1e-6)
    assert fit["decode_s_per_ctx_token"] == pytest.approx(true["ctx"], rel=1e-6)
    assert fit["prefill_s_per_token"] == pytest.approx(true["pre"], rel=1e-6)


def test_calibration_table_follows_a_step_cost_that_is_not_linear_in_batch():
    # As measured on this CPU: a batch of 1 steps fast (matrix-vector), 2..16 barely differ.
    truth = {1: 0.06, 2: 0.10, 4: 0.11, 8: 0.09, 16: 0.11, 32: 0.14}
    records = [StepRecord(run, step, truth[batch] + (0.2 if step == 0 else 0.0), batch, batch * 48 + batch * step,
                          batch * 48 if step == 0 else 0)
               for run, batch in enumerate(truth) for step in range(10)]
    fit = fit_steps(records)
    cost = CostModel(decode_s_per_ctx_token=fit["decode_s_per_ctx_token"], decode_s_by_batch=fit["decode_s_by_batch"])
    for r in records:
        if r.step >= 2:
            assert cost.decode_s(r.batch, r.context) == pytest.approx(r.seconds, rel=0.05)
    linear = CostModel(step_overhead_s=fit["step_overhead_s"], decode_s_per_seq=fit["decode_s_per_seq"],
                       decode_s_per_ctx_token=fit["decode_s_per_ctx_token"])
    assert abs(linear.decode_s(1, 52) / truth[1] - 1) > 0.25  # what the table is for
    assert cost.decode_s(3, 0) == pytest.approx((fit["decode_s_by_batch"][2] + fit["decode_s_by_batch"][4]) / 2)


def test_trainer_model_counts_the_tokens_the_trainer_computes():
    from rollwise.types.train_config import TrainConfig
    from rollwise.types.sample import Sample
    from rollwise.sim.cost import TrainerModel
    from rollwise.types.microbatch import computed_tokens

    def group(g: int, lengths: list[int]) -> list[Sample]:
        return [Sample(f"{g}/{i}", f"g{g}", "p", [100 + g] * 10, [5] * n, [0.0] * n, [0] * n, "stop", advantage=1.0)
                for i, n in enumerate(lengths)]

    cfg = TrainConfig(micro_batch_size=8, pack_responses=False)  # one response per row
    even, long_tail = group(0, [4, 4, 4, 4]), group(1, [1, 1, 1, 40])
    packed = cfg.model_copy(update={"pack_responses": True, "pack_groups": False})
    assert computed_tokens(long_tail, packed) == 10 + 2 * 40  # packed rows: 40 | 1+1+1
    # a shared-prompt micro-batch: the prompt once + rows x the longest response
    assert computed_tokens(even, cfg) == 10 + 4 * 4
    assert computed_tokens(long_tail, cfg) == 10 + 4 * 40
    assert computed_tokens(even + long_tail, cfg) == 26 + 170  # one micro-batch per prompt
    padded = cfg.model_copy(update={"share_prompt_prefix": False})
    assert computed_tokens(long_tail, padded) == 4 * 50
    per_token = TrainerModel(step_overhead_s=1.0, s_per_token_gpu=0.01, tokens="micro_batches")
    assert per_token.batch_tokens(long_tail, cfg) == 170
    assert per_token.model_copy(update={"tokens": "packed"}).batch_tokens(long_tail, cfg) == 4 * 10 + 43


def test_router_validation_on_real_replicas():
    """`rollwise sim validate-router`'s parts on two real replica processes: the serving costs and the
    busy-time metric they rest on, the same rounds measured and simulated, caches that agree."""
    from rollwise.bench.router import BenchShape, measure_real, replicas
    from rollwise.bench.validate_router import calibrate_replica, compare, measure_serving, sim_config, simulate_bench

    shape = BenchShape(replicas=2, groups=4, group_size=4, group_workers=2, sessions=2, turns=3, shared_tokens=64,
                       question_tokens=128, opening_tokens=128, user_tokens=16, max_tokens=4, rounds=1,
                       max_num_seqs=8, max_model_len=512)
    fit = calibrate_replica(shape, shapes=((1, 64), (4, 64), (8, 128), (2, 192)))
    assert fit["prefill_s_per_token"] > 0
    policies = ["round_robin", "prefix"]
    with replicas(shape) as urls:
        serving = measure_serving(urls, fit, prompt_tokens=192, n=5)
        real = measure_real(shape, 0, policies, urls=urls)
    assert 0 < serving["request_s"] < 1.0 and 0 <= serving["replica_request_s"] < 1.0 and serving["served_step_s"] > 0
    simulated = simulate_bench(shape, sim_config(shape, fit, cores=2, serving=serving), 0, policies)
    rows = {r["policy"]: r for r in compare(real, simulated)}
    for name in policies:
        assert real[name]["requests"] == simulated[name]["requests"] == 4 * 4 + 2 * 3
        assert real[name]["engine_busy_s"] > 0  # rollwise_engine_step_seconds_total moved
        assert rows[name]["requests_per_s_simulated"] > 0
    # the simulated prefix cache and routing agree with the engines' own counts
    assert abs(rows["prefix"]["prefix_hit_rate_measured"] - rows["prefix"]["prefix_hit_rate_simulated"]) < 0.1
    for side in (real, simulated):
        assert side["prefix"]["prefill_tokens"] < side["round_robin"]["prefill_tokens"]


def test_cli_help_and_a_scenario_run(tmp_path, capsys):
    from rollwise.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["sim", "--help"])
    assert exc.value.code == 0
    assert "virtual clock" in capsys.readouterr().out
    out = tmp_path / "r.json"
    assert main(["sim", "grpo-7b", "--set", "cluster.gpus=8", "workload.prompts_per_step=8", "workload.updates=1",
                 "--json", str(out)]) == 0
    assert '"bubble_ratio"' in out.read_text()
    assert main(["sim", "no-such-scenario"]) == 2


# ------------------------------------------------------------ several jobs on one engine pool


def _mux_jobs(n: int) -> list:
    from rollwise.sim.mux import MuxJob

    # Generation ~1 s, training ~1.3 s per step: one job leaves its engine idle more than half the time.
    return [MuxJob(f"j{k}", steps=5, prompts_per_step=4, group_size=8, prompt_tokens=100, max_tokens=48,
                   mean_response_tokens=30, train_s=lambda tokens: 0.5 + 0.0001 * tokens, push_s=0.3)
            for k in range(n)]


MUX_COST = CostModel(step_overhead_s=0.02, decode_s_per_seq=0.001, prefill_s_per_token=0.0001, max_num_seqs=64)


def test_mux_two_jobs_fill_each_others_training_gaps():
    from rollwise.sim.mux import Transitions, compare_shared_vs_dedicated

    r = compare_shared_vs_dedicated(_mux_jobs(2), 1, MUX_COST, Transitions(load_s=0.5, wake_s=0.05, sleep_s=0.02))
    assert r["engine_hours_saved"] > 0.3
    assert 0 <= r["max_slowdown"] < 0.5
    again = compare_shared_vs_dedicated(_mux_jobs(2), 1, MUX_COST, Transitions(load_s=0.5, wake_s=0.05, sleep_s=0.02))
    assert again == r  # deterministic


def test_mux_reports_where_each_jobs_time_went():
    """Per job: generate (submit to last sample back) and train (+ push) seconds, as bench mux measures them.
    Alone, the two make the whole wall time (no start-up here); sharing the engine stretches generation only."""
    from rollwise.sim.mux import simulate_mux

    alone = simulate_mux(_mux_jobs(1), 1, MUX_COST)["jobs"]["j0"]
    assert alone["generate_s"] > 0 and alone["train_s"] > 5 * 0.8  # 5 steps of >= 0.5 s training + 0.3 s push
    assert alone["generate_s"] + alone["train_s"] == pytest.approx(alone["wall_s"])
    shared = simulate_mux(_mux_jobs(2), 1, MUX_COST)["jobs"]
    assert max(j["generate_s"] for j in shared.values()) > alone["generate_s"]
    assert all(j["train_s"] == pytest.approx(alone["train_s"], rel=0.05) for j in shared.values())


def test_mux_runs_the_pools_own_scheduler(monkeypatch):
    """The simulator calls rollwise.pool.scheduler.plan: a policy change there shows up here."""
    import rollwise.pool.scheduler as scheduler
    from rollwise.sim import mux

    base = mux.simulate_mux(_mux_jobs(2), 1, MUX_COST)
    real_plan = scheduler.plan

    def favour_j1(slots, jobs, now, policy=scheduler.Policy()):  # as if j1 had 10x the priority
        return real_plan(slots, [replace(j, priority=10.0) if j.name == "j1" else j for j in jobs], now, policy)

    monkeypatch.setattr(mux, "plan", favour_j1)
    changed = mux.simulate_mux(_mux_jobs(2), 1, MUX_COST)
    # Both jobs want the one engine at t=0: the default serves j0 first (name tie-break), the change j1.
    assert base["jobs"]["j0"]["wall_s"] < base["jobs"]["j1"]["wall_s"]
    assert changed["jobs"]["j1"]["wall_s"] < changed["jobs"]["j0"]["wall_s"]


def test_shared_cores_processor_sharing():
    """rollwise.sim.cores: tasks split the machine's cores; a process's tasks split its own cap."""
    import heapq
    import itertools

    from rollwise.sim.cores import SharedCores

    def run(cores: float, tasks: list[tuple[float, float, str | None]], caps=None) -> list[float]:
        now, events, seq, ends = [0.0], [], itertools.count(), {}
        at = lambda t, fn: heapq.heappush(events, (t, next(seq), fn))  # noqa: E731
        shared = SharedCores(cores, at, lambda: now[0], caps)
        for i, (start, work, group) in enumerate(tasks):
            at(start, lambda i=i, work=work, group=group: shared.run(work, lambda: ends.setdefault(i, now[0]), group))
        while events:
            now[0], _, fn = heapq.heappop(events)
            fn()
        return [ends[i] for i in range(len(tasks))]

    assert run(0, [(0, 1.0, None)] * 3) == pytest.approx([1.0] * 3)  # no shared limit: each its own device
    assert run(2, [(0, 1.0, None)] * 3) == pytest.approx([1.5] * 3)  # 3 processes on 2 cores
    assert run(1.8, [(0, 0.9, None)] * 2) == pytest.approx([1.0] * 2)  # effective cores below the count
    # one process (an interpreter) with two threads of work: they take turns, whatever the cores
    assert run(16, [(0, 1.0, "pool"), (0, 1.0, "pool")], {"pool": 1.0}) == pytest.approx([2.0, 2.0])
    assert run(0, [(0, 1.0, "pool"), (0, 1.0, "pool")], {"pool": 0.5}) == pytest.approx([4.0, 4.0])
    assert run(0, [(0, 1.0, "pool")], {"pool": 0.5}) == pytest.approx([1.0])  # alone: full speed
    # a task arriving mid-way slows the one running; the first ends later than alone, nothing is lost
    first, second = run(1, [(0, 1.0, None), (0.5, 1.0, None)])
    assert first == pytest.approx(1.5) and second == pytest.approx(2.0)

    # crowded: measured effective cores by how many processes are at work (linear between the points)
    from rollwise.sim.cores import crowded_cores

    points = [(2, 1.9), (5, 1.6)]
    assert [crowded_cores(2.0, points, n) for n in (1, 2, 3, 5, 8)] == pytest.approx([1.9, 1.9, 1.8, 1.6, 1.6])
    assert crowded_cores(2.0, [], 7) == 2.0
    now, events, ends = [0.0], [], {}
    shared = SharedCores(2.0, lambda t, fn: events.append((t, fn)), lambda: now[0], crowding=[(2, 2.0), (3, 1.5)])
    for i in range(3):
        shared.run(1.0, lambda i=i: ends.setdefault(i, now[0]))
    while events:
        events.sort(key=lambda e: e[0])
        now[0], fn = events.pop(0)
        fn()
    assert [ends[i] for i in range(3)] == pytest.approx([2.0] * 3)  # 3 processes get 1.5 cores, not 2


def _generation_bound(n: int) -> list:
    from rollwise.sim.mux import MuxJob

    return [MuxJob(f"g{k}", steps=4, prompts_per_step=4, group_size=8, prompt_tokens=50, max_tokens=40,
                   train_s=lambda _tokens: 0.05) for k in range(n)]


def test_mux_host_shares_cores_and_one_interpreter():
    """rollwise.sim.mux's Host: a GPU cluster (the default) shares nothing; on a CPU machine the trainers
    and engines share its cores, and the CPU pool's engine slots, threads of one process, share one
    interpreter."""
    from rollwise.sim.mux import Host, MuxJob, simulate_mux

    devices = simulate_mux(_generation_bound(2), 2, MUX_COST)
    assert simulate_mux(_generation_bound(2), 2, MUX_COST, host=Host()) == devices
    # plenty of cores, no interpreter limit: stepping one step at a time changes nothing but rounding
    many = simulate_mux(_generation_bound(2), 2, MUX_COST, host=Host(cores=64))
    assert many["makespan_s"] == pytest.approx(devices["makespan_s"], rel=0.02)
    # two engine threads of one process: generation takes turns, about twice as long
    one_process = simulate_mux(_generation_bound(2), 2, MUX_COST, host=Host(cores=64, pool_cores=1.0))
    assert 1.7 < one_process["makespan_s"] / devices["makespan_s"] < 2.1
    # training-heavy jobs on one core: the trainers compete with each other and with the engine
    heavy = [MuxJob(f"t{k}", steps=3, prompts_per_step=2, group_size=4, prompt_tokens=50, max_tokens=20,
                    train_s=lambda _tokens: 2.0) for k in range(2)]
    apart = simulate_mux(heavy, 2, MUX_COST, host=Host(cores=64))
    crowded = simulate_mux(heavy, 2, MUX_COST, host=Host(cores=1))
    assert crowded["makespan_s"] > 1.6 * apart["makespan_s"]
    # measured crowding (rollwise.sim.host): four trainers and a pool on 2 cores give less than 2
    measured = Host.measured({"cores": 2.0, "pool_cores": 1.0, "crowding": [[2, 2.0], [5, 1.5]]})
    assert measured.crowding == ((2, 2.0), (5, 1.5))
    four = [MuxJob(f"t{k}", steps=3, prompts_per_step=2, group_size=4, prompt_tokens=50, max_tokens=20,
                   train_s=lambda _tokens: 2.0) for k in range(4)]
    plain = simulate_mux(four, 2, MUX_COST, host=Host(cores=2.0, pool_cores=1.0))
    assert simulate_mux(four, 2, MUX_COST, host=measured)["makespan_s"] > 1.1 * plain["makespan_s"]


def test_mux_step_variation_is_seeded():
    from dataclasses import replace as with_

    from rollwise.sim.mux import Transitions, compare_shared_vs_dedicated

    jobs = [with_(j, generate_cv=0.3, train_cv=0.3) for j in _mux_jobs(2)]
    t = Transitions(load_s=0.5, wake_s=0.05, sleep_s=0.02)
    varied = compare_shared_vs_dedicated(jobs, 1, MUX_COST, t, seed=1)
    assert compare_shared_vs_dedicated(jobs, 1, MUX_COST, t, seed=1) == varied
    assert compare_shared_vs_dedicated(jobs, 1, MUX_COST, t, seed=2) != varied
    assert compare_shared_vs_dedicated(_mux_jobs(2), 1, MUX_COST, t, seed=1) != varied


def test_effective_cores_are_measured_on_real_processes():
    """rollwise.sim.host times real worker processes (tiny model, one torch thread) on its interleaved
    schedule: a short but real run; the value is loose (this machine is noisy), its shape is not."""
    from rollwise.sim.host import measure_effective_cores

    cores = measure_effective_cores(processes=2, seconds=1.5, engine=True)  # an engine beside a trainer
    assert cores["processes"] == 2 and len(cores["per_process"]) == 2 and min(cores["units"]) > 0
    assert cores["kinds"] == ["engine", "train"]
    assert 0.3 < cores["effective_cores"] < 3.0  # 2 when they do not slow each other, 1 when they take turns
    with pytest.raises(ValueError, match="processes must be >= 1"):
        measure_effective_cores(processes=-1)


def test_validate_mux_refuses_bad_rounds(capsys):
    from rollwise.cli import main

    assert main(["sim", "validate-mux", "--rounds", "0"]) == 2
    assert "--rounds must be at least 1" in capsys.readouterr().out


def _dedicated_job(generate_s: float, train_s: float, steps: int = 12, **extra) -> dict:
    """A job's timings as bench mux's dedicated arm records them."""
    return {"steps": steps, "generate_s": generate_s * steps, "train_s": train_s * steps, "weight_sync_s": 0.0,
            "wall_s": 1.0 + (generate_s + train_s) * steps, "start": 100.0, "end": 200.0, **extra}


def test_dedicated_arms_before_and_after_are_averaged():
    """validate-mux calibrates each shared arm on the mean of the dedicated arms on either side of it."""
    from rollwise.bench.mux import mean_dedicated

    before = {"a": _dedicated_job(0.2, 0.3, policy_version=13, run_dir="runs/a0")}
    after = {"a": _dedicated_job(0.3, 0.5, policy_version=13, run_dir="runs/a1", start=900.0)}
    merged = mean_dedicated([before, after])["a"]
    assert merged["generate_s"] == pytest.approx(12 * 0.25) and merged["train_s"] == pytest.approx(12 * 0.4)
    assert merged["wall_s"] == pytest.approx((before["a"]["wall_s"] + after["a"]["wall_s"]) / 2)
    assert (merged["steps"], merged["policy_version"], merged["run_dir"], merged["start"]) == (12, 13, "runs/a0", 100.0)


# ------------------------------------------------------------ speculation (issue 19)


def test_speculation_model_uses_the_engines_budget_and_the_geometric_acceptance():
    from rollwise.engine.speculation.budget import BudgetPolicy, draft_budget
    from rollwise.sim.speculation import SpeculationModel

    spec = SpeculationModel(acceptance=0.5, max_draft=4, batch_knee=8, tokens_per_draft=4.0, expected_remaining=256)
    for batch in (1, 8, 16, 64):  # the engines' own pure budget, not a copy of it
        assert spec.draft_length(batch) == draft_budget(256, batch, BudgetPolicy(max_draft=4, batch_knee=8))
    assert spec.draft_length(1) == 4 and spec.draft_length(64) == 0
    assert spec.tokens_per_step(2) == pytest.approx(1 + 0.5 + 0.25)  # accepted prefix, then the target's token
    assert spec.per_step(2) == {"drafted": 8, "accepted": pytest.approx(2 * 0.9375), "emitted": pytest.approx(2 * 1.9375)}
    # A small batch (the tail) is memory-bound: the verification costs about a decode step, tokens come faster.
    cost = CostModel(decode_s_by_batch={1: 0.010, 8: 0.011, 64: 0.080})
    per_token, _ = spec.token_step(cost.decode_s, 1, 0.0)
    assert per_token < cost.decode_s(1, 0.0) / 1.5


def test_speculation_shortens_the_rollout_tail_in_the_simulator():
    """The same scenario with and without speculation: the same samples, less virtual time (the tail
    runs at small batches, where a verification costs about one decode step)."""
    plain = simulate(build(_small(**{"rollout.mode": "sync"})))
    spec = simulate(build(_small(**{"rollout.mode": "sync", "speculation.acceptance": 0.8})))
    assert spec["trained_samples"] == plain["trained_samples"]
    assert spec["virtual_s"] < plain["virtual_s"]
    with pytest.raises(ValueError, match="acceptance"):
        _small(**{"speculation.acceptance": 1.0})

"""The shared engine pool (rollwise.pool): real pool servers on loopback, real reference engines, real jobs.

- two jobs with different weights generate concurrently while pushing new versions: every sample a
  job gets equals what a standalone engine holding that job's current weights samples, carries only
  that job's versions, and the other job's weights would have sampled something else;
- a job's token opens only its own endpoints (403), unknown jobs are 404, bad input names the field;
- (slot, job) state transitions under concurrent requests, aborts and weight pushes from several jobs
  on two slots follow the state machine (the transition log replays cleanly), nothing is lost or
  answered twice;
- the pure scheduler's decisions;
- `rollwise train pool.url=...` runs to the end attached to a pool, and the pool accounts for it.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from completions import collect

from rollwise.config import ConfigError, load_config
from rollwise.engine.contract import run_to_completion
from rollwise.engine.factory import create_engine
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.local_server import serve_in_thread
from rollwise.model.loading import load_model, tokenizer_fingerprint
from rollwise.control.pool_backend import PoolClient, PoolServerError, PoolWorker, attach_to_pool
from rollwise.types.weight_update import WeightUpdate
from rollwise.pool.scheduler import JobView, Policy, SlotView, plan
from rollwise.pool.engine_pool import EnginePool
from rollwise.pool.app import create_app
from rollwise.pool.states import ACTIVE, EVICTED, SLEEPING, StateError, StateMachine, check_log

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MAX_LEN = 96


def _pool(engines: int = 1, **kw) -> EnginePool:
    kw.setdefault("policy", Policy(min_slice_s=0.05))
    return EnginePool(engines, max_num_seqs=8, max_model_len=MAX_LEN, **kw)


def _attach(url: str, job: str, spec: str, priority: float = 1.0, version: int = 0):
    """(worker, trainer-side model, fingerprint) for a job whose trainer holds `spec`'s model."""
    model, tok = load_model(spec)
    fp = tokenizer_fingerprint(tok)
    client = PoolClient(url)
    client.attach(job, spec, priority, fp)
    worker = PoolWorker(client, fp, poll_s=0.2)
    worker.load_weights(WeightUpdate.of_state(model.state_dict(), version, fp))
    return worker, model, fp


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def _requests(tag: str, rnd: int, count: int = 4) -> list[GenerationRequest]:
    rng = random.Random(f"{tag}{rnd}")
    return [GenerationRequest(f"{tag}-{rnd}-{i}", [rng.randrange(3, 90) for _ in range(rng.randrange(3, 9))],
                              SamplingParams(max_tokens=12, temperature=1.0, n=2, seed=1000 * rnd + i))
            for i in range(count)]


def _standalone(model: torch.nn.Module, spec: str, requests: list[GenerationRequest], version: int) -> dict:
    _, tok = load_model(spec)
    engine = create_engine("reference", model, tok, max_num_seqs=8, max_model_len=MAX_LEN,
                           eos_token_ids=[tok.eos_token_id], policy_version=version, seed=0)
    return {(c.request_id, c.index): c for c in run_to_completion(engine, requests)}


# ==================================================================== isolation


def test_two_jobs_keep_weights_and_data_apart():
    pool = _pool(1)
    with serve_in_thread(create_app(pool)) as (url, _):
        jobs = {"a": ("tiny:0", 0), "b": ("tiny:1", 100)}  # job -> (model, first version): versions never overlap
        attached = {name: _attach(url, name, spec, version=v0) for name, (spec, v0) in jobs.items()}
        rounds: dict[str, list] = {name: [] for name in jobs}
        errors: list[BaseException] = []
        barrier = threading.Barrier(len(jobs), timeout=60)  # every round, both jobs want the one engine

        def run(name: str) -> None:
            worker, model, _ = attached[name]
            try:
                for rnd in range(3):
                    barrier.wait()
                    version = jobs[name][1] + rnd
                    if rnd:  # a new policy version, pushed while the other job generates
                        _perturb(model, seed=hash((name, rnd)) % 2**31)
                        worker.load_weights(WeightUpdate.of_state(model.state_dict(), version, worker.fingerprint))
                    reqs = _requests(name, rnd)
                    worker.submit(reqs)
                    got = collect(worker, sum(r.params.n for r in reqs))
                    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
                    rounds[name].append((version, reqs, got, weights))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=run, args=(name,)) for name in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        state = pool.state()
        for worker, _, _ in attached.values():
            worker.close()
            worker.client.detach()

    assert state["isolation"]["violations"] == []
    assert state["isolation"]["checked_admissions"] >= 6
    kinds = [t["kind"] for t in state["transitions"]]
    assert kinds.count("load") == 2 and "sleep" in kinds and "wake" in kinds, kinds  # the slot was time-sliced
    assert check_log(state["transitions"], num_slots=1) == []

    for name, (spec, _) in jobs.items():
        other = "b" if name == "a" else "a"
        for version, reqs, got, weights in rounds[name]:
            assert sorted((c.request_id, c.index) for c in got) == sorted((r.request_id, i) for r in reqs
                                                                           for i in range(r.params.n))
            assert {v for c in got for v in c.versions} == {version}  # the job's own current version only
            model, _ = load_model(spec)
            model.load_state_dict(weights)
            expected = _standalone(model, spec, reqs, version)
            for c in got:
                ref = expected[(c.request_id, c.index)]
                assert c.token_ids == ref.token_ids, (name, version, c.request_id)
                assert c.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
                assert c.prompt_ids == ref.prompt_ids
        # The other job's weights sample differently: equality above is evidence, not a coincidence.
        version, reqs, got, _ = rounds[name][-1]
        o_version, _, _, o_weights = rounds[other][-1]
        o_model, _ = load_model(jobs[other][0])
        o_model.load_state_dict(o_weights)
        foreign = _standalone(o_model, jobs[other][0], reqs, o_version)
        assert any(c.token_ids != foreign[(c.request_id, c.index)].token_ids for c in got)


def test_a_switched_slot_admits_the_new_jobs_work_at_once(monkeypatch):
    """Job b submits while the only slot sits idle with job a's engine: the slot switches to b and admits
    b's requests right away, not at its next idle re-plan (made 30 s long here; it used to cost every
    switch up to one idle tick, which the simulator's validation against bench mux exposed)."""
    import rollwise.pool.slots as pool_slots

    monkeypatch.setattr(pool_slots, "IDLE_TICK_S", 30.0)
    pool = _pool(1)
    with serve_in_thread(create_app(pool)) as (url, _):
        a, _, _ = _attach(url, "a", "tiny:0")
        b, _, _ = _attach(url, "b", "tiny:1", version=100)
        try:
            reqs = _requests("a", 0)
            a.submit(reqs)
            collect(a, sum(r.params.n for r in reqs), timeout=20)
            assert pool.state()["slots"][0]["job"] == "a"  # a's engine stays loaded while a trains
            reqs = _requests("b", 0)
            t0 = time.monotonic()
            b.submit(reqs)
            got = collect(b, sum(r.params.n for r in reqs), timeout=20)
            waited = time.monotonic() - t0
        finally:
            for w in (a, b):
                w.close()
                w.client.detach()
    assert {v for c in got for v in c.versions} == {100}
    assert waited < 10.0, f"b's samples took {waited:.1f} s: the switched slot waited for an idle tick"


def test_tokens_guard_each_job_and_bad_input_names_the_field():
    pool = _pool(1)
    with serve_in_thread(create_app(pool)) as (url, _):
        wa, model_a, fp = _attach(url, "a", "tiny:0")
        wb, _, _ = _attach(url, "b", "tiny:1")
        a, b = wa.client, wb.client
        http = httpx.Client(base_url=url, timeout=30)
        as_a = {"Authorization": f"Bearer {a.token}"}
        body = {"requests": [{"request_id": "x", "prompt_ids": [5, 6], "params": {"max_tokens": 2}}]}
        # job a's token on job b's endpoints: refused, whatever the endpoint
        for method, path, kw in [("POST", "/jobs/b/requests", {"json": body}), ("GET", "/jobs/b/completions", {}),
                                 ("PUT", "/jobs/b/weights", {"content": b"\0" * 8}),
                                 ("POST", "/jobs/b/abort", {"json": {"request_ids": ["x"]}}),
                                 ("POST", "/jobs/b/pause", {}), ("DELETE", "/jobs/b", {}),
                                 ("POST", "/jobs/b/generate", {"json": {"prompt_ids": [5], "max_tokens": 2}})]:
            r = http.request(method, path, headers=as_a, **kw)
            assert r.status_code == 403, (method, path, r.text)
            assert "does not belong to job 'b'" in r.json()["error"]["message"]
        assert http.post("/jobs/b/requests", json=body).status_code == 403  # no token at all
        r = http.post("/jobs/nope/requests", headers=as_a, json=body)
        assert r.status_code == 404 and "no job 'nope'" in r.json()["error"]["message"]
        # a's own endpoints work with its token
        assert http.post("/jobs/a/requests", headers=as_a, json=body).status_code == 200
        # attach: the name is taken; the tokenizer differs from the trainer's
        with pytest.raises(PoolServerError) as exc:
            PoolClient(url).attach("a", "tiny:0", 1.0, fp)
        assert exc.value.status == 409 and "already attached" in exc.value.message
        with pytest.raises(PoolServerError) as exc:
            PoolClient(url).attach("c", "tiny:0", 1.0, "0" * 64)
        assert exc.value.status == 409 and "tokenizer fingerprint mismatch" in exc.value.message
        cfg = load_config(None, ["model=tiny:2", f"pool.url={url}", "pool.job=d"])
        with pytest.raises(ConfigError, match="tokenizer fingerprint mismatch"):
            attach_to_pool(cfg, model_a, None, fingerprint="f" * 64, policy_version=0)
        # bad requests name the field
        r = http.post("/jobs/a/requests", headers=as_a,
                      json={"requests": [{"request_id": "y", "prompt_ids": [5, 10_000]}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "requests[0].prompt_ids", r.text
        r = http.post("/jobs/a/requests", headers=as_a,
                      json={"requests": [{"request_id": "y", "prompt_ids": [5], "params": {"tempreature": 1}}]})
        assert r.status_code == 400 and "requests[0].params.tempreature" in r.json()["error"]["message"]
        # weights: wrong shapes and backwards versions are refused whole; the job keeps its version
        bad = {k: v for k, v in model_a.state_dict().items()}
        bad["model.norm.weight"] = torch.ones(3)
        with pytest.raises(PoolServerError) as exc:
            a.push_weights(bad, 5, fp)
        assert exc.value.status == 400 and "model.norm.weight" in exc.value.message
        a.push_weights(model_a.state_dict(), 3, fp)
        with pytest.raises(PoolServerError) as exc:
            a.push_weights(model_a.state_dict(), 2, fp)
        assert "already at version 3" in exc.value.message
        assert pool.state()["jobs"]["a"]["policy_version"] == 3
        # a job that pushed no weights cannot generate
        fresh = PoolClient(url)
        fresh.attach("e", "tiny:0", 1.0, fp)
        with pytest.raises(PoolServerError, match="no weights yet"):
            fresh.submit(_requests("e", 0, 1))
        # detach: the job is gone (404 afterwards), its accounting kept
        report = b.detach()
        assert report["job"] == "b"
        assert http.get("/jobs/b/completions", headers={"Authorization": f"Bearer {b.token}"}).status_code == 404
        for w in (wa, wb):
            w.close()
        metrics = http.get("/metrics").text
        assert 'rollwise_pool_job_engine_seconds_total{job="a"}' in metrics  # prometheus_client names counters *_total
        # a trainer that dies without detaching is detached once it has been silent for job_timeout_s
        assert pool.reap() == []
        assert sorted(pool.reap(now=time.monotonic() + pool.job_timeout_s + 1)) == ["a", "e"]
        assert http.post("/jobs/a/pause", headers=as_a).status_code == 404
        assert "no call for" in pool.state()["detached_jobs"]["a"]["detached_because"]


def test_agent_generator_drives_a_pool_job():
    """The agent layer's generator (multi-turn sessions) runs on a pool job's worker like on a local one."""
    from rollwise.agent.generator import LocalGenerator

    pool = _pool(1)
    with serve_in_thread(create_app(pool)) as (url, _):
        worker, model, fp = _attach(url, "agent", "tiny:0", version=4)
        generator = LocalGenerator(worker=worker)
        info = generator.info()
        assert (info.max_model_len, info.tokenizer_fingerprint, info.policy_version) == (MAX_LEN, fp, 4)
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
        turn = generator.generate([5, 6, 7], params, session_id="s1")
        expected = _standalone(model, "tiny:0", [GenerationRequest("x", [5, 6, 7], params)], 4)[("x", 0)]
        assert turn.token_ids == expected.token_ids and set(turn.versions) == {4}
        worker.close()
        worker.client.detach()


# ==================================================================== state transitions


def test_state_machine_refuses_illegal_transitions():
    sm = StateMachine(2)
    with pytest.raises(StateError):
        sm.transition(0, "a", SLEEPING, 0.0)  # evicted -> sleeping is not a transition
    sm.transition(0, "a", ACTIVE, 0.1)
    with pytest.raises(StateError, match="one active job per slot"):
        sm.transition(0, "b", ACTIVE, 0.1)
    sm.transition(1, "b", ACTIVE, 0.1)  # another slot: fine
    sm.transition(0, "a", SLEEPING, 0.01)
    sm.transition(0, "b", ACTIVE, 0.1)
    sm.transition(0, "a", EVICTED, 0.0)
    with pytest.raises(StateError):
        sm.transition(0, "a", EVICTED, 0.0)
    assert check_log(sm.log, 2) == []
    assert sm.snapshot() == {"0": {"b": "active"}, "1": {"b": "active"}}
    assert sm.costs()["load"]["count"] == 3
    forged = [t.as_dict() for t in sm.log]
    forged[2]["job"] = "c"  # 'c' was never loaded, and two would be active on slot 0
    assert check_log(forged, 2)


def test_state_transitions_under_concurrent_requests():
    """Three jobs, two slots, at most one sleeping engine per slot: bursts of requests, aborts and
    weight pushes from all jobs at once force loads, sleeps, wakes and evictions."""
    pool = _pool(2, max_sleeping=1)
    specs = {"a": "tiny:0", "b": "tiny:1", "c": "tiny:2"}
    with serve_in_thread(create_app(pool)) as (url, _):
        attached = {name: _attach(url, name, spec) for name, spec in specs.items()}
        results: dict[str, dict] = {}
        errors: list[BaseException] = []

        def run(name: str) -> None:
            worker, model, _ = attached[name]
            rng = random.Random(name)
            seen: dict[tuple[str, int], str] = {}
            expected: set[tuple[str, int]] = set()
            try:
                for rnd in range(4):
                    reqs = _requests(name, rnd, count=rng.randrange(2, 6))
                    if rnd == 1:  # a long request, aborted below while it runs or waits
                        reqs[0] = GenerationRequest(f"{name}-long", [5, 6, 7],
                                                    SamplingParams(max_tokens=80, n=2, seed=1, ignore_eos=True))
                    # Job a aborts while its requests wait (paused: deterministic, a fast machine can finish
                    # the long request before an abort reaches it); b and c abort while it runs or waits.
                    hold = rnd == 1 and name == "a"
                    if hold:
                        worker.pause()
                    worker.submit(reqs)
                    expected |= {(r.request_id, i) for r in reqs for i in range(r.params.n)}
                    if rnd == 1:  # abort one request mid-flight: its samples come back exactly once
                        for c in worker.abort([reqs[0].request_id]):
                            assert (c.request_id, c.index) not in seen
                            seen[(c.request_id, c.index)] = c.finish_reason
                    if hold:
                        worker.resume()
                    if rnd == 2:
                        _perturb(model, rnd)
                        worker.load_weights(WeightUpdate.of_state(model.state_dict(), rnd, worker.fingerprint))
                    deadline = time.monotonic() + 60
                    while set(seen) != expected:
                        assert time.monotonic() < deadline, "samples missing"
                        c = worker.next_completion(0.05)
                        if c is not None:
                            key = (c.request_id, c.index)
                            assert key not in seen, f"{key} answered twice"
                            seen[key] = c.finish_reason
                    time.sleep(rng.uniform(0, 0.1))  # "training": the job leaves the slot idle
                results[name] = seen
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        stop = threading.Event()
        snapshots: list[dict] = []

        def watch() -> None:  # concurrent readers of the state while it changes
            while not stop.is_set():
                snapshots.append(pool.states.snapshot())
                time.sleep(0.01)

        watcher = threading.Thread(target=watch)
        watcher.start()
        threads = [threading.Thread(target=run, args=(name,)) for name in specs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        stop.set()
        watcher.join()
        assert not errors, (errors, [s.errors for s in pool.slots], [(t.slot, t.job, t.kind, t.reason) for t in pool.states.log])
        state = pool.state()
        for worker, _, _ in attached.values():
            worker.close()
            worker.client.detach()
        final_log = [t.as_dict() for t in pool.states.log]

    assert all(len(results[n]) > 0 for n in specs)
    assert any(r == "abort" for r in results["a"].values())
    assert state["isolation"]["violations"] == []
    assert all(not s["errors"] for s in state["slots"])
    kinds = {t["kind"] for t in final_log}
    assert {"load", "sleep", "evict"} <= kinds, kinds  # evictions: over the sleeping budget, and at detach
    assert check_log(final_log, num_slots=2) == []
    for snap in snapshots:  # never two active jobs on a slot, never more than 1 sleeping per slot
        for jobs in snap.values():
            states = list(jobs.values())
            assert states.count("active") <= 1 and states.count("sleeping") <= 1 + 1, snap
    # after every job detached, nothing is left on any slot
    assert pool.states.snapshot() == {"0": {}, "1": {}}
    costs = state["transition_costs"]
    assert costs["load"]["count"] >= 3 and costs["load"]["mean_s"] > 0
    total = state["detached_jobs"] | state["jobs"]
    assert all(total[n]["engine_seconds_allocated"] > 0 for n in specs)


# ==================================================================== the pure scheduler


def test_scheduler_decisions():
    job = lambda n, q, used=0.0, prio=1.0, paused=False: JobView(n, prio, q, used, paused)  # noqa: E731
    slot = lambda j, since=0.0, running=0: SlotView(0, j, since, running, 8)  # noqa: E731
    # a's generation is done (training): the slot goes to b at once
    assert plan([slot("a")], [job("a", 0), job("b", 4)], now=0.01)[0].action == "switch"
    # a still generates: b waits for the minimum slice, then a drains (running work is never preempted)
    assert plan([slot("a", running=3)], [job("a", 4), job("b", 4)], now=1.0, policy=Policy(5.0))[0].action == "serve"
    d = plan([slot("a", running=3)], [job("a", 4, used=9), job("b", 4)], now=6.0, policy=Policy(5.0))[0]
    assert (d.action, d.target) == ("drain", "b")
    # ... unless the rival is owed less: weighted fair share (b used 4 s at priority 1 > a's 6 s at priority 2)
    d = plan([slot("a", running=3)], [job("a", 4, used=6, prio=2), job("b", 4, used=4)], now=6.0)[0]
    assert d.action == "serve"
    # a free slot goes to the most deserving waiting job; an idle job keeps its warm engine
    d = plan([slot(None)], [job("a", 2, used=5), job("b", 2, used=1)], now=0.0)[0]
    assert (d.action, d.job) == ("switch", "b")
    assert plan([slot("a")], [job("a", 0), job("b", 0)], now=9.0)[0].action == "serve"
    # paused jobs admit nothing and keep the slot while their work is frozen there
    assert plan([slot("a", running=2)], [job("a", 3, paused=True), job("b", 4)], now=99.0)[0].action == "serve"
    # two slots, one job with more work than one slot holds: it gets both
    two = [SlotView(0, None, 0.0, 0, 8), SlotView(1, None, 0.0, 0, 8)]
    assert [d.job for d in plan(two, [job("a", 20)], now=0.0)] == ["a", "a"]
    assert [d.job for d in plan(two, [job("a", 20), job("b", 1, used=1)], now=0.0)] == ["a", "b"]


def test_projection_through_the_simulator():
    """bench mux's projection (rollwise.sim.mux: the pool's scheduler on simulated engines, calibrated on
    the dedicated arm): training longer than generation, two jobs fill each other's gaps on one engine (the
    issue's goal); generation-bound jobs queue for the engine and slow down."""
    from rollwise.bench.mux import QUICK, project_from_dedicated

    def alone(generate_s: float, train_s: float, startup_s: float = 1.0, steps: int = 12) -> dict:
        return {"steps": steps, "generate_s": generate_s * steps, "train_s": train_s * steps, "weight_sync_s": 0.0,
                "wall_s": startup_s + (generate_s + train_s) * steps}

    costs = {"sleep": {"mean_s": 0.002}, "wake": {"mean_s": 0.003}, "load": {"mean_s": 0.02}}
    fits = project_from_dedicated({"a": alone(0.25, 0.35), "b": alone(0.25, 0.35)}, 1, QUICK, costs)
    assert fits["engine_hours_saving"] >= 0.40 and max(fits["slowdown"].values()) <= 0.15, fits
    four = project_from_dedicated({f"j{i}": alone(0.25, 0.35) for i in range(4)}, 2, QUICK, costs)
    assert four["engine_hours_saving"] >= 0.40 and max(four["slowdown"].values()) <= 0.15, four
    bound = project_from_dedicated({"a": alone(0.5, 0.2, 0.0), "b": alone(0.5, 0.2, 0.0)}, 1, QUICK, costs)
    assert max(bound["slowdown"].values()) > 0.3, bound


# ==================================================================== a training run attached to the pool


def test_train_attached_to_pool(tmp_path: Path):
    from rollwise.cli import main

    task = tmp_path / "add.jsonl"
    task.write_text("".join(json.dumps({"prompt": f"{i % 8}+{i // 8}=?", "answer": i % 8 + i // 8}) + "\n"
                            for i in range(24)))
    pool = _pool(1)
    with serve_in_thread(create_app(pool)) as (url, _):
        cfg = {"model": "tiny:0", "seed": 0, "output_dir": str(tmp_path / "run"), "threads": 1,
               "task": {"kind": "jsonl", "path": str(task)}, "prompt": {"system": None, "few_shot": []},
               "rollout": {"prompts_per_step": 2, "group_size": 4, "max_tokens": 8},
               "engine": {"kind": "reference", "max_num_seqs": 8, "max_model_len": MAX_LEN},
               "train": {"steps": 2, "lr": 1e-3, "kl_coef": 0.01}, "eval": {"size": 2}, "tensorboard": False}
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(cfg))
        assert main(["train", "--config", str(path), f"pool.url={url}", "pool.job=trainer-a", "pool.priority=2"]) == 0
        state = pool.state()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["policy_version"] == 2 and summary["engine"] == "pool/reference"
    assert summary["samples"]["trained"] == 16
    report = state["detached_jobs"]["trainer-a"]
    assert report["priority"] == 2 and report["policy_version"] == 2
    assert report["samples"] == 16 + 2 * 2  # the rollouts + two greedy evaluations
    assert report["engine_seconds_busy"] > 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["bubble_ratio"] < 1 for r in records)  # the job's timeline came back from the pool
    assert state["isolation"]["violations"] == []


def test_serve_pool_cli_refuses_bad_options(capsys):
    from rollwise.cli import main

    assert main(["serve", "pool", "--engines", "0"]) == 2
    assert "--engines must be >= 1" in capsys.readouterr().out
    assert main(["serve", "pool", "--min-slice", "-1"]) == 2
    assert "--min-slice must be >= 0" in capsys.readouterr().out

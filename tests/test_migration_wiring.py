"""Live migration where it is used (issue 42 item 3): a pool slot drained for another job moves its running
requests to a peer slot serving the same job; an engine server put to sleep moves them to another engine server;
the router's planned removal of a replica moves them to another replica. Each time the samples equal what one
engine would have produced (greedy), and the move is recorded. A migration the target refuses (another model) is
refused with a named error and nothing changes: the caller falls back to letting the requests finish, explicitly.
(The vLLM backend migrates too: tests/test_vllm_migration.py.)"""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from rollwise.control.pool_backend import PoolClient, completion_of
from rollwise.engine.contract import run_to_completion
from rollwise.engine.factory import create_engine
from rollwise.local_server import serve_in_thread
from rollwise.model.loading import load_model, tokenizer_fingerprint
from rollwise.pool.app import create_app as pool_app
from rollwise.pool.engine_pool import EnginePool
from rollwise.pool.scheduler import Policy
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.types.ledger import RolloutLedger

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MAX_LEN = 512
LONG = 400  # tokens: long enough to be still running when the test pauses the engine, whatever the load
SPEC = "tiny:0"


def _prompt(seed: int, n: int = 10) -> list[int]:
    return torch.randint(5, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(rid: str, seed: int, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(rid, _prompt(seed), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                ignore_eos=True))


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model(SPEC)
    return model, tok


def _alone(tiny, requests: list[GenerationRequest], version: int = 0) -> dict:
    """What one engine produces for `requests`, without any migration."""
    model, tok = tiny
    engine = create_engine("reference", model, tok, max_num_seqs=8, max_model_len=MAX_LEN,
                           eos_token_ids=[tok.eos_token_id], policy_version=version, seed=0)
    return {c.request_id: c for c in run_to_completion(engine, requests)}


def _poll_until(client: PoolClient, count: int, timeout: float = 60.0) -> list[dict]:
    """The job's next `count` samples as the pool posts them (each poll acknowledges those before it)."""
    got, deadline = [], time.monotonic() + timeout
    while len(got) < count:
        assert time.monotonic() < deadline, f"only {len(got)} of {count} samples arrived"
        out = client.poll(client.info.setdefault("seen", 0), 1.0)
        got += out["completions"]
        client.info["seen"] = max([client.info["seen"]] + [e["seq"] for e in out["completions"]])
    return got


# ==================================================================== pool: a drained slot migrates to a peer slot


def test_pool_drain_migrates_running_requests_to_a_peer_slot(tiny):
    model, tok = tiny
    fp = tokenizer_fingerprint(tok)
    pool = EnginePool(2, max_num_seqs=8, max_model_len=MAX_LEN, policy=Policy(min_slice_s=0.0))
    with serve_in_thread(pool_app(pool)) as (url, _):
        a, b = PoolClient(url), PoolClient(url)
        a.attach("a", SPEC, 1.0, fp)
        b.attach("b", SPEC, 1.0, fp)
        a.push_weights(model.state_dict(), 0, fp)
        b.push_weights(model.state_dict(), 7, fp)
        # Both slots serve job a (more work than one slot takes), then idle with a's engine active.
        for attempt in range(4):
            a.submit([_greedy(f"warm{attempt}-{i}", i, 4) for i in range(16)])
            _poll_until(a, 16)
            if [s["job"] for s in pool.state()["slots"]] == ["a", "a"]:
                break
        assert [s["job"] for s in pool.state()["slots"]] == ["a", "a"]
        long = [_greedy(f"long{i}", 100 + i, LONG) for i in range(4)]
        a.submit(long)
        deadline = time.monotonic() + 10
        while max(s["running"] for s in pool.state()["slots"]) < 4:  # on one slot, the other idle
            assert time.monotonic() < deadline
            time.sleep(0.005)
        b.submit([_greedy("b0", 7, 4)])  # b is owed the slot a runs on: it drains, by migration to a's other slot
        got_a = _poll_until(a, 4)
        got_b = _poll_until(b, 1)
        state = pool.state()
        a.detach()
        b.detach()
    log = state["migrations"]["log"]
    assert len(log) == 1 and log[0]["requests"] == 4 and log[0]["samples"] == 4, log
    assert log[0]["tokens"] > 0 and log[0]["source"] != log[0]["target"]
    assert state["migrations"]["migrated_samples"] == 4
    expected = _alone(tiny, long)
    for entry in got_a:  # nothing lost or twice; each equals one engine's; the move is on the sample
        ref = expected[entry["request_id"]]
        assert entry["token_ids"] == ref.token_ids and entry["finish_reason"] == "length"
        assert entry["logprobs"] == pytest.approx(ref.logprobs, abs=1e-4)
        assert entry["versions"] == [0] * LONG
        assert entry["migrations"] == [[log[0]["source"], log[0]["target"]]]
        # what a trainer's rollout controller reads from the pool, and records in its ledger
        assert completion_of(entry).migrations == [(f"slot-{log[0]['source']}", f"slot-{log[0]['target']}")]
        assert entry["slot"] == log[0]["target"]
    assert sorted(e["request_id"] for e in got_a) == sorted(r.request_id for r in long)
    assert got_b[0]["versions"] == [7] * 4 and got_b[0]["slot"] == log[0]["source"]  # the slot switched to b
    assert state["isolation"]["violations"] == []


# ==================================================================== engine servers: sleep migrates to another one


@pytest.fixture(scope="module")
def servers(tiny):
    """Two engine servers of the same model on loopback (A and B), and a third whose engine cannot migrate."""
    from contextlib import ExitStack

    from rollwise.engine.server import create_app as engine_app

    model, tok = tiny
    with ExitStack() as stack:
        urls = []
        for name in ("a", "b"):
            engine = create_engine("reference", model, tok, max_num_seqs=8, max_model_len=MAX_LEN,
                                   eos_token_ids=[tok.eos_token_id], policy_version=0, seed=0, model_name=SPEC)
            url, _ = stack.enter_context(serve_in_thread(engine_app(engine, tok, SPEC)))
            urls.append(url)
        yield urls


def _generate_in_background(url: str, requests: list[GenerationRequest]):
    """Each request's /generate call on its own thread; returns (threads, answers by request id)."""
    import threading

    answers: dict[str, dict] = {}

    def call(r: GenerationRequest) -> None:
        body = {"request_id": r.request_id, "prompt_ids": r.prompt_ids, "max_tokens": r.params.max_tokens,
                "temperature": 0.0, "ignore_eos": True}
        answers[r.request_id] = httpx.post(url + "/generate", json=body, timeout=120).json()

    threads = [threading.Thread(target=call, args=(r,)) for r in requests]
    for t in threads:
        t.start()
    return threads, answers


def _wait_running(url: str, count: int) -> None:
    deadline = time.monotonic() + 60
    while httpx.get(url + "/health").json()["running"] < count:  # (admitted, prefilled: a token sampled each)
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.005)


def _assert_one_engines(tiny, requests: list[GenerationRequest], answers: dict[str, dict],
                        moved: tuple[str, str] | None = None) -> None:
    """Each answer equals one engine's, and names the move it made (recorded in a rollout ledger as the
    rollout controller records it)."""
    expected = _alone(tiny, requests)
    assert sorted(answers) == sorted(r.request_id for r in requests)
    ledger = RolloutLedger()
    ledger.add_group(0, len(requests))
    for i, (rid, answer) in enumerate(sorted(answers.items())):
        [choice] = answer["choices"]
        ref = expected[rid]
        assert choice["token_ids"] == ref.token_ids and choice["finish_reason"] == "length", rid
        assert choice["logprobs"] == pytest.approx(ref.logprobs, abs=1e-4)
        assert choice["versions"] == ref.versions
        assert choice.get("migrations", []) == ([list(moved)] if moved else [])
        ledger.move((0, i), "running")
        for source, target in choice.get("migrations", []):
            ledger.migrate((0, i), source, target)
        ledger.move((0, i), "finished")
    assert ledger.migrations() == (len(requests) if moved else 0) and ledger.regenerated() == 0


def test_engine_put_to_sleep_migrates_its_requests_to_another_engine_server(tiny, servers):
    a, b = servers
    requests = [_greedy(f"s{i}", 200 + i, LONG) for i in range(3)]
    threads, answers = _generate_in_background(a, requests)
    _wait_running(a, 3)
    httpx.post(a + "/pause")  # (so they are surely in flight when it sleeps: a tiny model decodes fast)
    try:
        slept = httpx.post(a + "/sleep", json={"migrate_to": b}, timeout=60)
        for t in threads:
            t.join(timeout=60)
    finally:
        httpx.post(a + "/wake")
        httpx.post(a + "/resume")
    assert slept.status_code == 200, slept.text
    moved = slept.json()["migration"]
    assert len(moved["migrated"]) == 3 and moved["finished_on_source"] == []
    assert moved["still_here"] == 0 and all(tokens > 0 for tokens in moved["migrated"].values())
    _assert_one_engines(tiny, requests, answers, (a, b))  # A's clients got B's continuation, as one engine's


# ==================================================================== router: a planned removal migrates


def _router(replicas: list[str]):
    from rollwise.router.app import create_app as router_app
    from rollwise.router.config import RouterConfig

    return serve_in_thread(router_app(RouterConfig(replicas=replicas, model=SPEC, health_interval_s=0.2)))


def test_router_planned_removal_migrates_the_replicas_requests(tiny, servers):
    a, b = servers
    requests = [_greedy(f"r{i}", 300 + i, LONG) for i in range(3)]
    with _router([a, b]) as (router, _):
        threads, answers = _generate_in_background(a, requests)  # clients of replica a
        _wait_running(a, 3)
        httpx.post(a + "/pause")  # (so they are surely in flight at the removal)
        try:
            removed = httpx.post(router + "/replicas/remove", json={"url": a}, timeout=60)
            for t in threads:
                t.join(timeout=60)
        finally:
            httpx.post(a + "/resume")
        assert removed.status_code == 200, removed.text
        report = removed.json()
        health = httpx.get(router + "/health").json()
        after = httpx.post(router + "/generate", json={"prompt_ids": [5, 6, 7], "max_tokens": 2}, timeout=60)
        refused = httpx.post(router + "/replicas/remove", json={"url": "http://127.0.0.1:1"}, timeout=10)
    assert report["migration_refused"] is None and report["removed"] == a and report["drained"]
    assert len(report["migration"]["migrated"]) == 3 and report["migration"]["target"] == b
    assert httpx.get(a + "/health").json()["running"] == 0  # a's engine is empty: it can be stopped
    _assert_one_engines(tiny, requests, answers, (a, b))
    assert [r["removed"] for r in health["replicas"] if r["url"] == a] == [True]
    assert after.status_code == 200 and after.headers.get("x-rollwise-replica", b) == b
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "url"


def test_unsupported_migration_falls_back_to_finishing_in_place(tiny, servers):
    """An engine that cannot migrate answers what to do instead (abort and resubmit: tokens regenerated). Over HTTP
    a refusal changes nothing: removing a replica whose only peer cannot take its requests (a different model)
    drains it by letting them finish there, and says why."""
    from rollwise.engine.migration_http import NOT_MIGRATABLE
    from rollwise.engine.server import create_app as engine_app

    assert "abort its requests and resubmit" in NOT_MIGRATABLE
    a, _ = servers
    other_model, other_tok = load_model("tiny:1")
    other = create_engine("reference", other_model, other_tok, max_num_seqs=8, max_model_len=MAX_LEN,
                          eos_token_ids=[other_tok.eos_token_id], seed=0, model_name="tiny:1")
    requests = [_greedy(f"f{i}", 400 + i, LONG) for i in range(2)]
    with serve_in_thread(engine_app(other, other_tok, "tiny:1")) as (c, _):
        threads, answers = _generate_in_background(a, requests)
        _wait_running(a, 2)
        httpx.post(a + "/pause")
        try:
            refused = httpx.post(a + "/migrate", json={"target": c}, timeout=30)
            unchanged = httpx.get(a + "/health").json()["running"], httpx.get(c + "/health").json()["running"]
            with _router([a, c]) as (router, _):
                report = httpx.post(router + "/replicas/remove", json={"url": a}, timeout=60).json()
        finally:
            httpx.post(a + "/resume")  # they finish where they ran
        for t in threads:
            t.join(timeout=60)
    assert refused.status_code == 409 and "model_info.model differs" in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"] == "target" and unchanged == (2, 0)
    assert "model_info.model differs" in (report["migration_refused"] or "") and report["migration"] is None
    _assert_one_engines(tiny, requests, answers)  # nothing lost


def test_aborting_a_migrated_request_on_its_source_aborts_it_where_it_runs(tiny, servers):
    a, b = servers
    request = _greedy("ab", 500, LONG)
    threads, answers = _generate_in_background(a, [request])
    _wait_running(a, 1)
    httpx.post(a + "/pause")
    httpx.post(b + "/pause")  # (so it is still running on b when the abort comes)
    try:
        moved = httpx.post(a + "/migrate", json={"target": b}, timeout=30).json()
        aborted = httpx.post(a + "/abort", json={"request_id": "ab"}, timeout=30).json()
        threads[0].join(timeout=30)
    finally:
        httpx.post(a + "/resume")
        httpx.post(b + "/resume")
    [tokens] = moved["migrated"].values()
    assert aborted["aborted_samples"] == 1
    [choice] = answers["ab"]["choices"]
    assert choice["finish_reason"] == "abort" and choice["migrations"] == [[a, b]]
    assert choice["token_ids"] == _alone(tiny, [request])["ab"].token_ids[:tokens]  # what it had, nothing more
    assert httpx.get(b + "/health").json()["running"] == 0


def test_migration_routes_refuse_bad_input_naming_the_field(servers):
    a, b = servers
    params = {"max_tokens": 4, "temperature": 0.0}
    bad_token = httpx.post(b + "/migration/stage", json={"request_id": "x", "prompt_ids": [5, 10**6], "params": params,
                                                          "samples": []})
    unknown = httpx.post(b + "/migration/result", json={"request_id": "never-migrated"})
    not_url = httpx.post(a + "/migrate", json={"target": "not a url"})
    nobody = httpx.post(a + "/migrate", json={"target": "http://127.0.0.1:1"}, timeout=30)
    assert bad_token.status_code == 400 and bad_token.json()["error"]["param"] == "prompt_ids", bad_token.text
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "request_id"
    assert not_url.status_code == 400 and "target" in not_url.json()["error"]["param"], not_url.text
    assert nobody.status_code == 409 and "cannot migrate to http://127.0.0.1:1" in nobody.json()["error"]["message"]
    assert httpx.get(b + "/health").json()["running"] == 0  # nothing was staged or taken


# ==================================================================== the simulator's projection


def test_switch_cost_projection_uses_the_pools_cost_model(capsys):
    from rollwise.sim.cli import main as sim_main
    from rollwise.sim.switch_costs import Assumptions, flat_load_projection, project

    a = Assumptions()
    small, large = project([8, 4096], a)
    assert small["start_s"]["memory"] == pytest.approx(a.build_s + a.model_gb / a.memory_gbps)
    # the flat reader at 0.88 of the disk's 16 GB / 0.7 s, its GPU copy overlapped (PCIe faster than that)
    assert small["start_s"]["disk"] == pytest.approx(a.build_s + a.serverlessllm_s / a.flat_read_efficiency)
    goal = flat_load_projection(a)["safetensors_over_flat"]
    assert goal == pytest.approx(a.safetensors_s * a.flat_read_efficiency / a.serverlessllm_s)
    slow_pcie = Assumptions(memory_gbps=10.0)  # the copy, not the read, bounds the load
    assert flat_load_projection(slow_pcie)["safetensors_over_flat"] == pytest.approx(4.4 / (16 / 10))
    # the remote store is shared by every engine loading at once: 4096 engines get 100/4096 GB/s each
    assert large["start_s"]["remote"] == pytest.approx(a.build_s + a.model_gb / (a.store_gbps / 4096))
    assert small["drain_migrate_s"] < small["drain_wait_s"]
    assert small["gain_kept"]["drain_migrate_then_memory"] > small["gain_kept"]["drain_wait_then_memory"]
    assert small["gain_kept"]["idle_switch_memory"] > small["gain_kept"]["idle_switch_today"]
    assert sim_main(["switch-costs", "--sizes", "8,zero"]) == 2
    assert "--sizes must be comma-separated GPU counts" in capsys.readouterr().out

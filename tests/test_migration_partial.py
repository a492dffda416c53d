"""A migration some of whose requests the target refuses (issue 42 item 3: "nothing lost or duplicated"): one
request's refusal, even after others were handed over, never undoes their moves. Every request is accounted for
once: the moved ones' clients get the target's answers (what one engine produces, greedy), the refused one finishes
on the source, /migrate's answer names each with its reason, and the ledger and /metrics say so."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack

import httpx
import pytest
import torch

from rollwise.engine.contract import run_to_completion
from rollwise.engine.factory import create_engine
from rollwise.engine.migration import migrate
from rollwise.engine.server import create_app as engine_app
from rollwise.local_server import serve_in_thread
from rollwise.model.loading import load_model
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.types.ledger import RolloutLedger

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SPEC = "tiny:0"
SOURCE_LEN, TARGET_LEN = 1024, 700  # the target cannot take a prompt of LONG_PROMPT tokens: it refuses that one
LONG_PROMPT = 720
LONG = 640  # tokens: still running when the test pauses the source, whatever the load, and fits the target
TOKENS = 48


def _prompt(seed: int, n: int = 10) -> list[int]:
    return torch.randint(5, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(rid: str, seed: int, prompt_len: int = 10, tokens: int = TOKENS) -> GenerationRequest:
    return GenerationRequest(rid, _prompt(seed, prompt_len), SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                            ignore_eos=True))


@pytest.fixture(scope="module")
def tiny():
    return load_model(SPEC)


def _engine(tiny, slots: int, max_len: int):
    model, tok = tiny
    return create_engine("reference", model, tok, max_num_seqs=slots, max_model_len=max_len,
                         eos_token_ids=[tok.eos_token_id], policy_version=0, seed=0, model_name=SPEC)


@pytest.fixture(scope="module")
def servers(tiny):
    """Source A (2 slots: later requests wait for admission) and target B (a shorter max_model_len)."""
    _, tok = tiny
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(engine_app(_engine(tiny, slots, max_len), tok, SPEC)))[0]
                for slots, max_len in ((2, SOURCE_LEN), (8, TARGET_LEN))]
        yield urls


def _health(url: str) -> dict:
    return httpx.get(url + "/health").json()


def _until(check, what: str) -> None:
    deadline = time.monotonic() + 60
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in {url}/metrics")


def test_a_request_refused_mid_batch_stays_and_the_others_move(tiny, servers):
    a, b = servers
    running = [_greedy("p0", 600, tokens=LONG), _greedy("p1", 601, tokens=LONG)]
    waiting = [_greedy("p2", 602), _greedy("p3", 603, LONG_PROMPT), _greedy("p4", 604)]  # p3: B refuses it
    requests = running + waiting
    answers: dict[str, dict] = {}

    def call(r: GenerationRequest) -> None:
        body = {"request_id": r.request_id, "prompt_ids": r.prompt_ids, "max_tokens": r.params.max_tokens,
                "temperature": 0.0, "ignore_eos": True}
        answers[r.request_id] = httpx.post(a + "/generate", json=body, timeout=120).json()

    threads = []

    def start(r: GenerationRequest) -> None:
        threads.append(threading.Thread(target=call, args=(r,)))
        threads[-1].start()

    before = {name: _metric(a, f"rollwise_engine_migration_{name}_requests_total") for name in ("migrated", "stayed")}
    sampled_on_b = _metric(b, "rollwise_engine_generated_tokens_total")
    for r in running:
        start(r)
    _until(lambda: _health(a)["running"] == 2, "the requests never started")
    httpx.post(a + "/pause")  # (so they are surely in flight: a tiny model decodes fast)
    try:
        for k, r in enumerate(waiting, 1):  # queued behind them, in this order (the migration's order)
            start(r)
            _until(lambda k=k: _health(a)["waiting"] == k, "the request was never queued")
        moved = httpx.post(a + "/migrate", json={"target": b}, timeout=60)
        on_a = _health(a)["waiting"] + _health(a)["running"]
    finally:
        httpx.post(a + "/resume")  # the refused one finishes where it was
    for t in threads:
        t.join(timeout=60)
    assert moved.status_code == 200, moved.text
    report = moved.json()
    # Each request once (by engine request id): p2 moved before p3 was refused, p4 after (the two waiting ones move
    # with 0 tokens); p3 stayed, named with the target's reason. The clients' answers below say which is which.
    assert len(report["migrated"]) == 4 and report["failed"] == {} and report["finished_on_source"] == [], report
    assert sorted(report["migrated"].values())[:2] == [0, 0] and min(sorted(report["migrated"].values())[2:]) > 0
    [(stayed, why)] = report["stayed"].items()
    assert stayed not in report["migrated"] and on_a == 1 and report["still_here"] == 1
    assert f"prompt_ids has {LONG_PROMPT} tokens" in why and f"max_model_len={TARGET_LEN}" in why
    # Every caller got one engine's answer, once; the moved ones name their move (the ledger records it).
    alone = {c.request_id: c for c in run_to_completion(_engine(tiny, 8, SOURCE_LEN), requests)}
    assert sorted(answers) == sorted(alone)
    ledger = RolloutLedger()
    ledger.add_group(0, len(requests))
    for i, r in enumerate(requests):
        [choice] = answers[r.request_id]["choices"]
        assert choice["token_ids"] == alone[r.request_id].token_ids, r.request_id
        assert choice["logprobs"] == pytest.approx(alone[r.request_id].logprobs, abs=1e-4)
        assert choice["finish_reason"] == "length"
        ledger.move((0, i), "running")
        for source, target in choice.get("migrations", []):
            ledger.migrate((0, i), source, target)
        ledger.move((0, i), "finished")
        assert choice.get("migrations", []) == ([] if r.request_id == "p3" else [[a, b]])
    assert ledger.migrations() == 4 and ledger.regenerated() == 0 and ledger.counts()["finished"] == 5
    assert _health(a)["running"] == _health(b)["running"] == 0  # nothing left running twice
    # B sampled each moved request's rest once: the running ones' from where they stopped, the waiting ones' whole
    rest = sum(LONG - n if n else TOKENS for n in report["migrated"].values())
    assert _metric(b, "rollwise_engine_generated_tokens_total") - sampled_on_b == rest
    assert _metric(a, "rollwise_engine_migration_migrated_requests_total") - before["migrated"] == 4
    assert _metric(a, "rollwise_engine_migration_stayed_requests_total") - before["stayed"] == 1
    assert _metric(a, "rollwise_engine_migration_relay_failures_total") == 0


def test_results_poll_answers_each_request_on_its_own(servers):
    _, b = servers
    unknown = httpx.post(b + "/migration/results", json={"request_ids": ["nope"], "timeout_s": 0}).json()
    assert unknown["results"][0]["request_id"] == "nope" and "no request 'nope'" in unknown["results"][0]["error"]
    empty = httpx.post(b + "/migration/results", json={"request_ids": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "request_ids"


def test_in_process_refusal_keeps_that_request_and_moves_the_others(tiny):
    """The coordinator itself: the target has room for two of three running requests; the third stays, named."""
    requests = [_greedy(f"q{i}", 700 + i) for i in range(3)]
    source, target = _engine(tiny, 4, SOURCE_LEN), _engine(tiny, 2, SOURCE_LEN)
    for r in requests:
        source.add_request(r)
    source.step()
    result = migrate(source, target)
    assert sorted(result.migrated) == ["q0", "q1"] and result.failed == {} and result.finished_on_source == []
    assert list(result.stayed) == ["q2"] and "no free KV slot" in result.stayed["q2"]
    assert source.migratable_requests() == ["q2"] and sorted(target.migratable_requests()) == ["q0", "q1"]

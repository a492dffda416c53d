"""The handover a target refuses (issue 42 item 3: "nothing lost or duplicated"): the source keeps the request's slot
and KV until the target's commit is confirmed, so a refused commit gives the request back to the source, which runs
it on from where it stopped, even when the source is full of other waiting work that would have taken a freed slot.

The race this pins down: the source used to free the request's slot at the handover, before the target committed;
its engine kept stepping meanwhile and admitted a waiting request into that slot; the target then refused the commit,
the source had no slot to take the request back into, and it landed in `failed` (its client got an error).

The engines are real (tiny random model, each on its own EngineWorker thread, as the pool's slots run them) and the
coordinator is the one every caller uses (`migrate_between`: pool drain, sleep with migrate_to, the router's planned
removal). The only test seam orders events at the handover: before the target's commit runs, the source is let step
(the window in which the freed slot used to be taken), then the target is put to sleep, so its real engine refuses
the commit ("the engine is sleeping")."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack

import httpx
import pytest
import torch

from rollwise.engine.contract import run_to_completion
from rollwise.engine.core import EngineWorker
from rollwise.engine.factory import create_engine
from rollwise.engine.migration import MigrationRefused, MigrationState, migrate_between
from rollwise.engine.server import create_app as engine_app
from rollwise.local_server import serve_in_thread
from rollwise.model.loading import load_model
from rollwise.types.generation import Completion, GenerationRequest, SamplingParams

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SPEC = "tiny:0"
LONG, SHORT = 200, 24  # the running requests outlast the migration; the waiting ones are short


def _greedy(rid: str, seed: int, tokens: int, n: int = 1, prompt_len: int = 10) -> GenerationRequest:
    prompt = torch.randint(5, 90, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    return GenerationRequest(rid, prompt, SamplingParams(n=n, max_tokens=tokens, temperature=0.0, ignore_eos=True))


@pytest.fixture(scope="module")
def tiny():
    return load_model(SPEC)


def _engine(tiny, slots: int, max_len: int = 512):
    model, tok = tiny
    return create_engine("reference", model, tok, max_num_seqs=slots, max_model_len=max_len,
                         eos_token_ids=[tok.eos_token_id], policy_version=0, seed=0, model_name=SPEC)


class RefusingAtCommit:
    """The target's end of the migration (a CommandRunner over the real target's worker). Every call goes to the
    real engine; before the handover's commit, it waits until the source has stepped a few times (the window the
    race needed) and puts the target engine to sleep, so the real engine refuses the commit."""

    def __init__(self, target: EngineWorker, source: EngineWorker) -> None:
        self.target, self.source = target, source
        self.commits = 0

    def call(self, fn):  # noqa: ANN001, ANN201 - the coordinator's CommandRunner
        return fn(self)

    def __getattr__(self, name: str):  # noqa: ANN204 - the rest of Migratable: the real target's, on its thread
        return lambda *args: self.target.call(lambda e: getattr(e, name)(*args))

    def commit_migration(self, state: MigrationState) -> None:
        self.commits += 1
        steps = self.source.call(lambda e: e.stats["steps"])
        deadline = time.monotonic() + 10
        while self.source.call(lambda e: e.stats["steps"]) < steps + 3:  # the source decodes its other requests
            assert time.monotonic() < deadline, "the source stopped stepping during the handover"
            time.sleep(0.001)
        self.target.call(lambda e: e.sleep())
        self.target.call(lambda e: e.commit_migration(state))


def _collect(worker: EngineWorker, samples: int) -> list[Completion]:
    done: list[Completion] = []
    deadline = time.monotonic() + 60
    while len(done) < samples:
        assert time.monotonic() < deadline, f"only {len(done)} of {samples} samples came back"
        c = worker.next_completion(timeout=0.1)
        if c is not None:
            done.append(c)
    return done


def test_a_refused_commit_gives_the_request_back_to_the_source_with_its_slot(tiny):
    moving = _greedy("r0", 800, LONG)
    requests = [moving, _greedy("r1", 801, LONG), _greedy("w0", 802, SHORT), _greedy("w1", 803, SHORT)]
    source_engine = _engine(tiny, 2)  # r0 and r1 fill it: w0 and w1 wait, ready to take any slot freed
    source, target = EngineWorker(source_engine, "source"), EngineWorker(_engine(tiny, 4), "target")
    try:
        source.submit(requests)
        deadline = time.monotonic() + 30
        while source.call(lambda e: len(e.export_running("r0").samples)) == 0:
            assert time.monotonic() < deadline, "r0 never started"
            time.sleep(0.001)
        assert source.call(lambda e: (e.num_running, e.num_waiting)) == (2, 2)
        seam = RefusingAtCommit(target, source)
        with pytest.raises(MigrationRefused) as refused:  # nothing moved: r0 stayed, named with the target's reason
            migrate_between(source, seam, ["r0"])
        assert seam.commits == 1, "the refusal must come at the handover's commit, not at a staging"
        assert list(refused.value.stayed) == ["r0"] and "sleeping" in refused.value.stayed["r0"]
        done = _collect(source, 4)
        # each request once, with what one engine produces (greedy), the waiting ones too (not starved, not broken)
        alone = {c.request_id: c for c in run_to_completion(_engine(tiny, 8), requests)}
        assert sorted(c.request_id for c in done) == sorted(alone)
        for c in done:
            assert c.token_ids == alone[c.request_id].token_ids, c.request_id
            assert c.logprobs == pytest.approx(alone[c.request_id].logprobs, abs=1e-4)
            assert c.finish_reason == "length" and c.migrations == []
        # nothing left behind: the target holds nothing (its staging freed), the source no slot (a 2-sample request
        # needs both of them)
        assert target.call(lambda e: e.migratable_requests()) == []
        target.call(lambda e: e.wake())
        assert source.call(lambda e: e.migratable_requests()) == []
        both = _greedy("both", 804, 4, n=2)
        source.submit([both])
        assert sorted(c.index for c in _collect(source, 2)) == [0, 1]
    finally:
        source.close()
        target.close()


def test_migrate_answer_names_each_request_by_its_client_id_too(tiny):
    """Over HTTP: /migrate's maps are keyed by engine request ids (uuids the client never saw); `client_ids` gives the
    request_id each client gave /generate. A waiting request the target refuses at the handover (n=2 samples, more
    than its max_num_seqs) stays, named, and its client gets one engine's answer."""
    _, tok = tiny
    with ExitStack() as stack:
        a, b = (stack.enter_context(serve_in_thread(engine_app(_engine(tiny, slots), tok, SPEC)))[0]
                for slots in (2, 1))
        requests = [_greedy("client-run", 810, LONG), _greedy("client-pair", 811, SHORT, n=2),  # waits: 1 slot free
                    _greedy("client-wait", 812, SHORT)]
        answers: dict[str, dict] = {}

        def call(r: GenerationRequest) -> None:
            body = {"request_id": r.request_id, "prompt_ids": r.prompt_ids, "max_tokens": r.params.max_tokens,
                    "temperature": 0.0, "ignore_eos": True, "n": r.params.n}
            answers[r.request_id] = httpx.post(a + "/generate", json=body, timeout=60).json()

        threads = [threading.Thread(target=call, args=(r,)) for r in requests]
        for k, t in enumerate(threads):
            t.start()
            deadline = time.monotonic() + 30
            while (lambda h: h["running"] + h["waiting"])(httpx.get(a + "/health").json()) < k + 1 + (k > 1):
                assert time.monotonic() < deadline, f"request {k} was never queued: {httpx.get(a + '/health').json()}"
                time.sleep(0.002)
            if k == 0:
                httpx.post(a + "/pause")  # (so the first is surely in flight, the others waiting behind it)
        try:
            moved = httpx.post(a + "/migrate", json={"target": b}, timeout=60)
        finally:
            httpx.post(a + "/resume")
        for t in threads:
            t.join(timeout=60)
    assert moved.status_code == 200, moved.text
    report = moved.json()
    clients = report["client_ids"]
    assert sorted(clients.values()) == sorted(r.request_id for r in requests)
    assert sorted(clients[rid] for rid in report["migrated"]) == ["client-run", "client-wait"]
    [(stayed, why)] = report["stayed"].items()
    assert clients[stayed] == "client-pair" and "max_num_seqs=1" in why and report["failed"] == {}
    alone = {(c.request_id, c.index): c for c in run_to_completion(_engine(tiny, 4), requests)}
    for r in requests:
        choices = answers[r.request_id]["choices"]
        assert len(choices) == r.params.n
        for i, choice in enumerate(choices):
            assert choice["token_ids"] == alone[(r.request_id, i)].token_ids, r.request_id

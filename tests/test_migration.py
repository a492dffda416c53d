"""Live migration of in-flight requests between two reference engines (issue 42 item 3): the migrated
sample equals what one engine would have produced, nothing is lost or generated twice under load with the
source gone right after the handover, a session resumed from retained KV migrates correctly, and the
ledger records the move."""

from __future__ import annotations

import pytest
import torch

from rollwise.engine.core import EngineWorker
from rollwise.engine.migration import migrate, migrate_between
from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.engine.retention import RetentionLimits, RetentionRequest
from rollwise.model.tiny import tiny_llama
from rollwise.types.generation import Completion, GenerationRequest, SamplingParams
from rollwise.types.ledger import LedgerError, RolloutLedger

pytestmark = pytest.mark.usefixtures("single_torch_thread")

LEN = 256


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def _engine(model, *, slots: int = 8, version: int = 0, retention: bool = False, name: str = "model") -> ReferenceEngine:
    limits = RetentionLimits(pin_budget_tokens=4 * LEN, ttl_max_s=60.0) if retention else None
    return ReferenceEngine(model, max_num_seqs=slots, max_model_len=LEN, eos_token_ids=[2], policy_version=version,
                           retention=limits, retention_policy="always_preserve", model_name=name)


def _prompt(seed: int, n: int = 12) -> list[int]:
    return torch.randint(5, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _request(rid: str, seed: int, *, max_tokens: int = 20, temperature: float = 0.0, n: int = 1,
             top_logprobs: int = 0) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, n=n, seed=seed, ignore_eos=True,
                            top_logprobs=top_logprobs)
    return GenerationRequest(rid, _prompt(seed), params)


def _drain(engine: ReferenceEngine) -> list[Completion]:
    done: list[Completion] = []
    while engine.has_unfinished():
        done += engine.step()
    return done


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_migrated_sample_equals_one_engines_with_versions_carried(model, temperature):
    req = _request("r", 3, max_tokens=24, temperature=temperature, top_logprobs=2)
    [alone] = _engine(model).generate([req])
    source, target = _engine(model, version=1), _engine(model, version=2)  # same weights, told apart by version
    source.add_request(req)
    early = source.step() + source.step()  # 3 tokens sampled on the source (the prefill's, 2 decodes)
    result = migrate(source, target, source_steps=3, max_delta=1)  # the source decodes while the target prefills
    assert early == [] and result.source_finished == []
    assert result.rounds >= 2  # the delta sampled during the first prefill was caught up before the handover
    handed_over = result.migrated["r"]
    assert handed_over == 3 + 3 + 1 and not source.has_unfinished()  # + 3 during the prefill, + 1 caught up
    [moved] = _drain(target)
    assert moved.token_ids == alone.token_ids  # the seeded sample kept its RNG stream across engines
    assert moved.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert [t for t, _ in moved.top_logprobs[0]] == [t for t, _ in alone.top_logprobs[0]]
    assert moved.versions == [1] * handed_over + [2] * (24 - handed_over)
    assert moved.finish_reason == "length" and source.step() == []


def test_migration_under_load_loses_and_duplicates_nothing(model):
    requests = [_request(f"q{i}", 10 + i, max_tokens=6 if i == 0 else 14 + i, n=2 if i == 1 else 1)
                for i in range(6)]
    alone = {(c.request_id, c.index): c for c in _engine(model).generate(requests)}
    source, target = _engine(model, slots=4), _engine(model, slots=8)  # 7 samples: some still wait on the source
    target.add_request(_request("other", 99, max_tokens=30))  # the target is busy with its own work
    target.step()
    ledger = RolloutLedger()
    slot_of = {}
    for g, req in enumerate(requests):
        ledger.add_group(g, req.params.n)
        for i in range(req.params.n):
            slot_of[(req.request_id, i)] = (g, i)
            ledger.move((g, i), "running")
        source.add_request(req)
    delivered = source.step() + source.step()
    result = migrate(source, target, source_steps=3)
    for rid in result.migrated:
        for i in range(requests[int(rid[1:])].params.n):
            ledger.migrate(slot_of[(rid, i)], "A", "B")
    delivered += result.source_finished
    assert result.finished_on_source == ["q0"]  # 6 tokens: it finished on the source during the catch-up
    assert [result.migrated[r] for r in ("q3", "q4", "q5")] == [0, 0, 0]  # still waiting: moved at once
    # The source is gone right after the handover: it holds nothing, emits nothing, and sleeps (idle only).
    assert not source.has_unfinished() and source.abort("q2") == [] and source.sleep()
    delivered += [c for c in _drain(target) if c.request_id != "other"]
    keys = [(c.request_id, c.index) for c in delivered]
    assert sorted(keys) == sorted(alone) and len(keys) == len(set(keys))  # every sample once, none twice
    for c in delivered:
        assert c.token_ids == alone[(c.request_id, c.index)].token_ids
        assert c.logprobs == pytest.approx(alone[(c.request_id, c.index)].logprobs, abs=1e-5)
        ledger.move(slot_of[(c.request_id, c.index)], "finished")
    assert ledger.counts()["finished"] == 7 and ledger.regenerated() == 0
    assert ledger.migrations() == sum(requests[int(r[1:])].params.n for r in result.migrated) > 0
    assert ledger.slots[slot_of[("q1", 1)]].migrations == (("A", "B"),)
    with pytest.raises(LedgerError, match="only a running sample migrates"):
        ledger.migrate(slot_of[("q2", 0)], "B", "C")


def test_session_resumed_from_retained_kv_migrates_correctly(model):
    source, target = _engine(model, retention=True), _engine(model, retention=True)
    [turn1] = source.generate([_request("t1", 5, max_tokens=10)])
    assert source.retain(RetentionRequest("s", "t1", "python", 0.5)).action == "preserve"
    prompt = turn1.prompt_ids + turn1.token_ids + _prompt(6, 5)
    turn2 = GenerationRequest("t2", prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True))
    [alone] = _engine(model).generate([turn2])
    source.add_request(turn2)
    source.step()
    result = migrate(source, target)
    assert result.migrated == {"t2": 3}  # 2 sampled before, 1 during the prefill
    assert source.load().running == 0 and source.load().kv_cache_usage == 0  # the session's slot is free again
    [moved] = _drain(target)
    assert moved.token_ids == alone.token_ids
    assert moved.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert moved.cached_prompt_tokens == len(turn1.prompt_ids) + len(turn1.token_ids) - 1  # resumed on the source
    # The session goes on at the target: its next tool call's KV is retained there.
    assert target.retain(RetentionRequest("s", "t2", "python", 0.5)).action == "preserve"
    assert target.release_session("s")


def test_refused_migration_changes_nothing(model):
    req = _request("r", 4, max_tokens=12)
    [alone] = _engine(model).generate([req])
    source = _engine(model)
    source.add_request(req)
    source.step()
    with pytest.raises(ValueError, match="model_info.model"):
        migrate(source, _engine(model, name="other"))
    full = _engine(model, slots=1)
    full.add_request(_request("busy", 8, max_tokens=30))
    full.step()
    with pytest.raises(ValueError, match="no free KV slot.*max_num_seqs=1"):
        migrate(source, full)
    assert full.load().running == 1 and full.step() == [] and full.migratable_requests() == ["busy"]
    asleep = _engine(model, slots=1)
    asleep.sleep()  # its KV cache is freed: nothing can be staged into it
    with pytest.raises(ValueError, match="engine is sleeping; wake"):
        migrate(source, asleep)
    asleep.wake()
    assert asleep.load().running == 0 and asleep.migratable_requests() == [] and source.migratable_requests() == ["r"]
    [done] = _drain(source)  # the source still runs it, as if nothing had been tried
    assert done.token_ids == alone.token_ids
    pair = _engine(model)
    pair.add_request(_request("pair", 9, n=2))
    pair.step()
    one_free = _engine(model, slots=2)
    one_free.add_request(_request("busy", 8, max_tokens=30))
    one_free.step()
    with pytest.raises(ValueError, match="no free KV slot"):  # room for one of its two samples: neither is staged
        migrate(pair, one_free)
    one_free.add_request(_request("next", 11))
    one_free.step()
    assert one_free.load().running == 2 and pair.load().running == 2



def _collect(worker: EngineWorker, count: int, timeout: float) -> list[Completion]:
    """What the worker emits until `count` samples came out, or nothing more for `timeout` seconds."""
    out: list[Completion] = []
    while len(out) < count and (c := worker.next_completion(timeout)) is not None:
        out.append(c)
    return out


def test_draining_a_worker_while_it_decodes_loses_nothing(model):
    """Engines on their own threads (EngineWorker): the source decodes on while the target prefills, and is
    closed right after the handover; every sample comes out of one worker or the other, once."""
    requests = [_request(f"w{i}", 30 + i, max_tokens=160 + 5 * i) for i in range(4)]  # long: in flight when drained
    alone = {c.request_id: c for c in _engine(model).generate(requests)}
    source, target = EngineWorker(_engine(model), "source"), EngineWorker(_engine(model), "target")
    try:
        source.submit(requests)
        result = migrate_between(source, target)
        assert source.call(lambda e: e.has_unfinished()) is False
        source.close()  # gone right after the handover: what it finished before is already out
        delivered = _collect(source, len(requests), 0.0)
        delivered += _collect(target, len(requests) - len(delivered), 30.0)
        assert _collect(target, 1, 0.2) == []  # and nothing more
    finally:
        source.close()
        target.close()
    assert result.migrated and set(result.migrated) | set(result.finished_on_source) <= set(alone)
    ids = [c.request_id for c in delivered]
    assert sorted(ids) == sorted(alone) and len(ids) == len(set(ids))
    for c in delivered:
        assert c.token_ids == alone[c.request_id].token_ids
        assert c.logprobs == pytest.approx(alone[c.request_id].logprobs, abs=1e-5)

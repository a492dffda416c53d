"""A migration target with a smaller max_model_len than the source (issue 42 item 3): a request that could run further
on the source than the target allows stays on the source (recorded as stayed, the reason naming max_model_len) and
finishes there with the tokens one engine produces, instead of being cut off early on the target; a request that fits
both still moves. The source's limit travels with the state (MigrationState.max_model_len), over HTTP too."""

from __future__ import annotations

import pytest
import torch

from rollwise.engine.migration import MigrationState, check_context_limit, migrate
from rollwise.engine.migration_http import StateBody
from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.model.tiny import tiny_llama
from rollwise.types.generation import Completion, GenerationRequest, SamplingParams

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SOURCE_LEN, TARGET_LEN = 256, 128
PROMPT = 12


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def _engine(model, *, max_len: int, slots: int = 8) -> ReferenceEngine:
    return ReferenceEngine(model, max_num_seqs=slots, max_model_len=max_len, eos_token_ids=[2], policy_version=0,
                           model_name="model")


def _request(rid: str, seed: int, max_tokens: int) -> GenerationRequest:
    prompt = torch.randint(5, 90, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def _drain(engine: ReferenceEngine) -> list[Completion]:
    done: list[Completion] = []
    while engine.has_unfinished():
        done += engine.step()
    return done


def test_a_request_the_target_would_cut_off_stays_and_finishes_on_the_source(model):
    fits = _request("fits", 1, 40)  # 12 + 40 tokens: the same on either engine
    long = _request("long", 2, 200)  # 12 + 200 > TARGET_LEN: the target would stop it at 128 tokens
    waiting = _request("long_waiting", 3, 200)  # the same, still waiting for admission on the source
    requests = [fits, long, waiting]
    alone = {c.request_id: c for c in _engine(model, max_len=SOURCE_LEN).generate(requests)}
    assert len(alone["long"].token_ids) == 200  # (what one engine produces: not cut off)
    source, target = _engine(model, max_len=SOURCE_LEN, slots=2), _engine(model, max_len=TARGET_LEN)
    for r in requests:
        source.add_request(r)
    assert source.step() == [] and source.step() == []
    result = migrate(source, target)
    assert sorted(result.migrated) == ["fits"] and result.failed == {} and result.finished_on_source == []
    assert sorted(result.stayed) == ["long", "long_waiting"]
    for rid, why in result.stayed.items():
        assert f"request {rid!r}" in why and f"max_model_len={TARGET_LEN}" in why, why
        assert f"max_model_len={SOURCE_LEN}" in why and f"max_model_len >= {PROMPT + 200}" in why, why
    finished = {c.request_id: c for c in result.source_finished + _drain(source) + _drain(target)}
    assert sorted(finished) == sorted(alone)  # each once
    for rid, c in finished.items():
        assert c.token_ids == alone[rid].token_ids, rid
        assert c.logprobs == pytest.approx(alone[rid].logprobs, abs=1e-5)
        assert c.finish_reason == "length"


def _state(prompt_len: int, max_tokens: int, source_len: int | None) -> MigrationState:
    request = GenerationRequest("r", [5] * prompt_len, SamplingParams(max_tokens=max_tokens))
    return MigrationState(request, [], max_model_len=source_len)


@pytest.mark.parametrize(("max_tokens", "source_len", "target_len", "refused"), [
    (200, None, 128, True),  # unknown source limit: the request's budget decides
    (100, None, 128, False),
    (200, 128, 128, False),  # equal limits: the target stops it where the source would
    (200, 256, 128, True),  # a smaller target
    (100, 256, 128, False),  # ... that the request's budget fits anyway
    (200, 100, 128, False),  # a smaller source: it stops earlier there than here
])
def test_check_context_limit(max_tokens, source_len, target_len, refused):
    state = _state(12, max_tokens, source_len)
    if not refused:
        check_context_limit(state, target_len)
        return
    with pytest.raises(ValueError, match=rf"request 'r'.*max_model_len={target_len}.*max_model_len >= {12 + max_tokens}"):
        check_context_limit(state, target_len)


def test_the_source_limit_travels_over_http_and_an_older_peer_sends_none():
    state = _state(12, 200, 256)
    body = StateBody.of(state)
    assert StateBody.model_validate_json(body.model_dump_json()).state().max_model_len == 256
    old = body.model_dump(mode="json", exclude={"max_model_len"})  # an older peer's body: no such field
    assert StateBody.model_validate(old).state().max_model_len is None

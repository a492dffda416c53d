"""rollwise sim intercept: the simulator's model of session KV retention against what the engine does and
what `rollwise bench intercept` measured (issue 21). Virtual time only: each replay takes about a second."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from rollwise.engine.reference.prefix_cache import PrefixCache
from rollwise.sim.intercept_cache import BlockPrefixCache
from rollwise.sim.intercept_cli import REPLAY_TOLERANCE, replay_rows

BENCH = Path(__file__).resolve().parents[1] / "docs" / "bench"


def _replay(name: str) -> dict[str, dict]:
    return {r["policy"]: r for r in replay_rows(json.loads((BENCH / name).read_text()))}


def test_block_cache_model_matches_the_reference_engines_prefix_cache():
    """Same inserts and lookups (prompts at prefill, histories at finish, sessions growing turn by turn):
    the model finds exactly the cached prefix the engine's LRU block cache finds, evictions included."""
    rng = random.Random(0)
    real, model = PrefixCache(max_tokens=160, block_size=16), BlockPrefixCache(max_tokens=160, block_size=16)
    kv = torch.zeros(1, 1, 512, 1)
    sessions = {s: [rng.randrange(1000) for _ in range(rng.randrange(20, 60))] for s in range(5)}
    for _ in range(200):
        s = rng.randrange(5)
        tokens = sessions[s]
        if rng.random() < 0.5:  # the next turn's prefill: look up, then insert its prompt
            hit = real.match(tokens)
            assert model.match(s, len(tokens)) == (hit.num_tokens if hit else 0)
            real.insert(tokens, kv, kv)
            model.insert(s, len(tokens))
        else:  # a turn finishes: its history grows and is inserted
            if len(tokens) < 400:
                tokens += [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
            real.insert(tokens, kv, kv)
            model.insert(s, len(tokens))
        assert model.num_tokens == real.num_tokens


@pytest.mark.parametrize("name", ["intercept_quick.json", "intercept.json"])
def test_replay_counts_the_recomputation_the_bench_counted(name):
    """Counted, not timed: always_discard recomputes every context; the prefix cache (an LRU over every
    prompt and history, running ones included) saves exactly what it saved in the bench."""
    rows = _replay(name)
    for policy in ("always_discard", "prefix_cache_only"):
        assert rows[policy]["sim"]["recomputed_tokens"] == rows[policy]["bench"]["recomputed_tokens"], policy
    assert rows["min_waste"]["sim"]["recomputed_fraction"] <= 0.10  # the goal the bench met


@pytest.mark.parametrize("policy", ["min_waste", "always_discard", "always_preserve", "prefix_cache_only"])
def test_replay_of_the_full_bench_is_within_ten_percent_on_medians(policy):
    row = _replay("intercept.json")[policy]
    assert all(abs(e) <= REPLAY_TOLERANCE for e in row["error"].values()), row["error"]
    assert row["pass"]


@pytest.mark.parametrize("policy", ["min_waste", "always_discard", "always_preserve", "prefix_cache_only"])
def test_replay_of_the_quick_bench_is_within_ten_percent_on_medians(policy):
    row = _replay("intercept_quick.json")[policy]
    assert row["pass"], row["error"]


def test_a_finished_turn_is_parked_until_its_retain_and_admission_may_take_it_first():
    """Two slots, five sessions: the caller's retain() is served after the next step, so that step's admission
    sees the finished turns parked; half the slots are protected, the others may be taken for a waiting turn
    (with nothing running, keeping a slot would idle the engine), and their retain() then finds nothing to
    keep: always_preserve discards them, as the bench's engine did (turns_dropped_before_retain). Decided
    when the turn ends instead (park_grace_s None), every retain() finds its KV."""
    from rollwise.sim.cost import CostModel
    from rollwise.sim.intercept_models import InterceptWorkload, RetentionModel, ToolSpec
    from rollwise.sim.intercept import simulate

    cost = CostModel(prefill_s_per_token=1e-4, step_overhead_s=0.1, max_num_seqs=2, max_model_len=256,
                     kv_capacity_tokens=2 * 256)
    work = InterceptWorkload(sessions=5, concurrency=5, turns=2, prompt_tokens=100, tool_result_tokens=4,
                             output_tokens=4, tools=[ToolSpec(name="calculator", median_s=0.01, sigma=0.0)])
    parked = simulate(cost, RetentionModel(slot_tokens=256, pin_budget_tokens=512), work, "always_preserve")
    assert parked.reclaimed.get("turns_dropped_before_retain", 0) >= 1
    assert parked.actions.get("discard", 0) >= 1 and parked.recomputed_tokens > 0
    decided_at_once = simulate(cost, RetentionModel(slot_tokens=256, pin_budget_tokens=512, park_grace_s=None),
                               work, "always_preserve")
    assert "turns_dropped_before_retain" not in decided_at_once.reclaimed
    assert decided_at_once.actions == {"preserve": 5}  # every retain() found its KV (admission may drop a pin later)

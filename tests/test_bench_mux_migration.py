"""`rollwise bench mux --migration` (issue 42): the three ways a pool slot drains for another job run on a real pool
and agree on job A's samples (the bench raises if any arm lost, duplicated or changed a token); migration
regenerates nothing, abort regenerates what it threw away, `drain_by=wait` never migrates."""

from __future__ import annotations

import pytest

from rollwise.bench.mux_migration import run_migration_bench

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_the_three_drains_run_and_agree():
    # Drained at 40% of the requests' time alone, so the abort arm surely finds them running.
    result = run_migration_bench(quick=True, rounds=1, drain_at=0.4)
    runs = {arm: arm_runs[0] for arm, arm_runs in result["runs"].items()}
    assert runs["migration"]["migrations"] >= 1 and runs["migration"]["tokens_regenerated"] == 0
    assert runs["migration"]["tokens_prefilled"] > 0
    assert runs["wait"]["migrations"] == 0 and runs["wait"]["tokens_regenerated"] == 0
    assert runs["abort"]["migrations"] == 0 and runs["abort"]["tokens_regenerated"] > 0
    assert result["goals"]["migration_tokens_regenerated"] == 0
    assert result["goals"]["drain_episode_abort_vs_migration"] > 0

"""`rollwise bench trainer --memory`'s growth goal reads the marginal memory per token only between lengths of
512 tokens or more (rollwise.bench.trainer_memory.reference_length): below, the step's costs that do not grow
with length swamp the difference (a 128 -> 256 reference once read 472x on linear memory). Checked on made-up
rows (no training: the arithmetic of the goal), against growth computed by hand."""

from __future__ import annotations

import pytest

from rollwise.bench.trainer_memory import (LENGTHS, MIN_REFERENCE_LENGTH, QUICK_LENGTHS, format_memory_bench,
                                           growth, reference_length)


def _rows(lengths, bytes_of) -> list[dict]:
    return [{"length": n, "step_bytes": bytes_of(n), "step_bytes_per_token": bytes_of(n) / n,
             "base_rss_bytes": 0, "step_s": 0.0} for n in lengths]


@pytest.mark.parametrize("lengths", [LENGTHS, QUICK_LENGTHS], ids=["full", "quick"])
def test_both_ends_of_the_reference_difference_are_at_least_512_tokens(lengths):
    reference = reference_length(lengths)
    ordered = sorted(lengths)
    assert reference is not None and ordered.index(reference) < len(ordered) - 1  # a longer length follows
    assert ordered[ordered.index(reference) - 1] >= MIN_REFERENCE_LENGTH


def test_growth_ignores_the_fixed_costs_of_short_lengths():
    lengths = (128, 256, 512, 1024, 2048)

    def linear(n: int) -> float:  # 2 KiB a token from 512 on; short steps dominated by a fixed cost
        return {128: 101e6, 256: 101.001e6}.get(n, 100e6 + 2048 * n)

    assert reference_length(lengths) == 1024
    assert growth(_rows(lengths, linear), reference_length(lengths)) == pytest.approx(1.0)
    # the old reference (the 128 -> 256 difference) read this linear memory as ~260x
    assert growth(_rows(lengths, linear), 256) > 100

    def quadratic(n: int) -> float:  # the marginal between a and b is c * (a + b): 3072c / 1536c = 2
        return 7.0 * n * n

    assert growth(_rows(lengths, quadratic), reference_length(lengths)) == pytest.approx(2.0)


def test_too_few_long_lengths_measure_no_goal_and_say_why():
    lengths = (128, 256, 512, 1024)
    assert reference_length(lengths) is None and growth(_rows(lengths, lambda n: 1e3 * n), None) is None
    result = {"model": "m", "prompt_tokens": 64, "threads": 2, "lengths": list(lengths), "reference_length": None,
              "arms": {"gradient_checkpointing": {"rows": _rows(lengths, lambda n: 1e3 * n)}},
              "marginal_bytes_per_token": {"gradient_checkpointing": {}},
              "goals": {"memory_growth_linear": {"goal": 1.25, "measured": None, "arm": "gradient_checkpointing",
                                                 "met": False}}}
    caption = str(format_memory_bench(result).caption)
    assert "not measured" in caption and str(MIN_REFERENCE_LENGTH) in caption

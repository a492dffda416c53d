"""The engine's KV cache sized to what the run needs (issue 41 item 7): max_num_seqs sequences of the run's longest
prompt + generation budget, not of engine.max_model_len (rollwise.control.sequence_budget,
rollwise.engine.vllm_startup.kv_cache_blocks_for_run)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollwise.config import load_config
from rollwise.control.sequence_budget import run_sequence_tokens
from rollwise.engine.vllm_startup import kv_cache_blocks_for_run
from rollwise.model.loading import load_model
from rollwise.tasks.prompts import build_messages, encode_prompt
from rollwise.types.task import Problem

SMOLLM2 = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
PROBLEMS = [Problem("a", "Calculate 3 + 4.", "7"), Problem("b", "Calculate 12345 - 678 + 9 - 10 + 11.", "11677")]


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("tiny:0")[1]


def test_blocks_hold_max_num_seqs_of_the_run_longest_sequence():
    # the default run: 64 sequences of at most 111 tokens in 32-token blocks (4 each), + vLLM's null block
    assert kv_cache_blocks_for_run(SMOLLM2, 2, 64, 512, 32, 2.0, sequence_tokens=111) == 64 * 4 + 1
    assert kv_cache_blocks_for_run(SMOLLM2, 2, 64, 512, 32, 2.0) == 64 * 16 + 1  # none given: max_model_len
    # never more than max_model_len per sequence, and never fewer blocks than one max_model_len sequence needs
    assert kv_cache_blocks_for_run(SMOLLM2, 2, 64, 512, 32, 2.0, sequence_tokens=4096) == 64 * 16 + 1
    assert kv_cache_blocks_for_run(SMOLLM2, 2, 1, 512, 32, 2.0, sequence_tokens=40) == 16 + 1
    assert kv_cache_blocks_for_run(SMOLLM2, 4, 64, 1024, 32, 2.0, sequence_tokens=2048) is None  # the cap sizes it


def test_run_sequence_tokens_is_the_longest_prompt_plus_the_largest_budget(tokenizer):
    cfg = load_config(overrides=["rollout.max_tokens=48"])
    lengths = [len(encode_prompt(tokenizer, build_messages(p, cfg.prompt, cfg.reward, True))) for p in PROBLEMS]
    assert lengths[1] > lengths[0]
    assert run_sequence_tokens(cfg, tokenizer, PROBLEMS) == lengths[1] + 48
    longer_eval = load_config(overrides=["rollout.max_tokens=48", "eval.max_tokens=100"])
    assert run_sequence_tokens(longer_eval, tokenizer, PROBLEMS) == lengths[1] + 100
    capped = load_config(overrides=["rollout.max_tokens=48", f"engine.max_model_len={lengths[1] + 10}"])
    assert run_sequence_tokens(capped, tokenizer, PROBLEMS) == lengths[1] + 10


@pytest.mark.parametrize("override", ["engine.speculation=history", "agent.max_turns=2"])
def test_runs_whose_sequences_outgrow_one_generation_keep_max_model_len(tokenizer, override):
    assert run_sequence_tokens(load_config(overrides=[override]), tokenizer, PROBLEMS) is None
    assert run_sequence_tokens(load_config(), tokenizer, []) is None

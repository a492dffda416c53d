"""GRPO learns: the reference engine + GRPOTrainer + in-process weight push, wired exactly as the
training loop wires them, raise a tiny random model's reward on a trivial deterministic task.

Task: reward = fraction of the generated tokens equal to one target token. A random tiny model
spreads its mass over ~100 tokens (reward ~0.01), so the only way up is the policy gradient reaching
the engine through `push_weights` after every update.
"""

from __future__ import annotations

from dataclasses import replace

import time

import pytest
import torch

from rollwise.types.train_config import TrainConfig
from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.model.tiny import tiny_llama, tiny_tokenizer
from rollwise.types.sample import Sample
from rollwise.sync.inprocess import push_weights
from rollwise.train.grpo import group_advantages
from rollwise.train.trainer import GRPOTrainer

GROUP_SIZE = 8
MAX_TOKENS = 4
MAX_STEPS = 40
PROMPTS = ["1+1=", "abc", "hello", "xyz?"]
TARGET_CHAR = "7"


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _run_grpo(*, lr: float, push: bool, model_seed: int = 0) -> tuple[list[float], list[dict[str, float]], float]:
    """Train for up to MAX_STEPS; returns per-step mean rewards, trainer metrics and wall time."""
    tokenizer = tiny_tokenizer()
    target = tokenizer.convert_tokens_to_ids(TARGET_CHAR)
    prompts = [tokenizer.encode(p) for p in PROMPTS]

    model = tiny_llama(seed=model_seed)
    trainer = GRPOTrainer(
        model,
        TrainConfig(lr=lr, micro_batch_size=16, advantage="mean_std"),
        pad_token_id=tokenizer.pad_token_id,
        temperature=1.0,
    )
    # No EOS: every sample is exactly MAX_TOKENS long, so the reward is a clean per-token fraction.
    engine = ReferenceEngine(model, max_num_seqs=64, max_model_len=64, eos_token_ids=[], policy_version=0)

    rewards_per_step: list[float] = []
    metrics_per_step: list[dict[str, float]] = []
    t0 = time.monotonic()
    for step in range(MAX_STEPS):
        requests = [
            GenerationRequest(
                f"step{step}-{slot}",
                prompt,
                SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, n=GROUP_SIZE, seed=1000 * step + 10 * slot),
            )
            for slot, prompt in enumerate(prompts)
        ]
        completions = engine.generate(requests)
        assert len(completions) == len(prompts) * GROUP_SIZE
        samples = [
            replace(Sample.from_completion(c, problem_id=c.request_id),
                    reward=sum(t == target for t in c.token_ids) / len(c.token_ids))
            for c in completions
        ]
        # Synchronous loop: every token was sampled by the trainer's current version (staleness 0);
        # without pushes the engine stays at version 0.
        expected_version = trainer.version if push else 0
        assert engine.policy_version == expected_version
        assert all(v == expected_version for s in samples for v in s.versions)

        groups: dict[str, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.group_id, []).append(s)
        rewards = torch.tensor([[s.reward for s in g] for g in groups.values()])
        advantages = group_advantages(rewards, "mean_std")
        for g, row in zip(groups.values(), advantages):
            for s, a in zip(g, row.tolist()):
                s.advantage = a

        metrics = trainer.train_step(samples)
        if push:
            push_weights(trainer.model, [engine], trainer.version)
        rewards_per_step.append(float(rewards.mean()))
        metrics_per_step.append(metrics)
        if push and len(rewards_per_step) >= 5 and min(rewards_per_step[-5:]) > 0.8:
            break  # learned; no need to spend the rest of the budget
    return rewards_per_step, metrics_per_step, time.monotonic() - t0


def test_grpo_raises_reward_on_trivial_task():
    rewards, metrics, seconds = _run_grpo(lr=5e-3, push=True)
    start = sum(rewards[:3]) / 3
    end = sum(rewards[-5:]) / 5
    curve = " ".join(f"{r:.2f}" for r in rewards)
    assert start < 0.2, f"the random model should rarely emit the target; curve: {curve}"
    assert end > 0.6, f"GRPO did not learn within {MAX_STEPS} steps; curve: {curve}"
    assert len(rewards) <= MAX_STEPS
    # The engine samples with exactly the weights the trainer holds (pushed after each update), so the
    # trainer's recomputed logprobs match the engine's on every step: a fp32 round-off, not a policy lag.
    mismatch = [m["mismatch_abs_logp"] for m in metrics]
    assert max(mismatch) < 1e-4, f"train/inference logprob mismatch per step: {mismatch}"
    assert all(m["update_skipped_nonfinite_grad"] == 0.0 for m in metrics)
    assert seconds < 60, f"learning test took {seconds:.1f}s"


def test_without_weight_push_the_engine_does_not_improve():
    """Control: the engine holds its own copy of the weights; without push_weights it never learns."""
    rewards, metrics, _ = _run_grpo(lr=5e-3, push=False)
    end = sum(rewards[-5:]) / 5
    assert end < 0.2, " ".join(f"{r:.2f}" for r in rewards)
    # The trainer did update, but the engine kept sampling from version 0: the mismatch grows.
    assert metrics[-1]["mismatch_abs_logp"] > 1e-3

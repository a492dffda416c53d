"""The per-token advantages' forwards on the policy's own micro-batches (issue 41, the trainer's step cost;
rollwise.train.token_forwards): the reference's KL in the reward and the critic's values, computed on the packed
layouts (a group's prompt once), equal an independent per-sample forward of the full sequence (to fp32 round-off) in
every layout; the critic's one forward a step (updates_per_step=1) leaves the same values and the same critic weights
as the two passes it replaces (values, then the update's forward); the reference kept in the compute dtype computes
what the float32 reference does under autocast; and the step's metrics say where the time went.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rollwise.model.tiny import tiny_llama
from rollwise.train.advantages import assign_advantages
from rollwise.train.token_advantages import compute_token_advantages, kl_estimate
from rollwise.train.token_forwards import in_order, per_batch
from rollwise.train.trainer import GRPOTrainer
from rollwise.types.microbatch import chunk_samples
from rollwise.types.sample import Sample
from rollwise.types.train_config import TrainConfig

from random_groups import fixed_groups

pytestmark = pytest.mark.usefixtures("single_torch_thread")

LAYOUTS = {"padded": {"share_prompt_prefix": False}, "group": {"pack_responses": False},
           "packed": {"pack_responses": True, "pack_groups": False},
           "packed_groups": {"pack_responses": True, "pack_groups": True}}


def _predictors(backbone, s: Sample) -> torch.Tensor:
    """The hidden states that predict a sample's response tokens: its whole sequence, alone, in float64-free fp32."""
    ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
    hidden = backbone(input_ids=ids).last_hidden_state[0]
    p = len(s.prompt_ids)
    return hidden[p - 1 : p - 1 + len(s.response_ids)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reference_kl_and_critic_values_on_every_layout_equal_a_per_sample_forward(layout):
    cfg = TrainConfig(advantage="gae", kl_coef=0.3, kl_penalty="reward", kl_estimator="k3", micro_batch_size=4,
                      micro_batch_tokens=64, updates_per_step=2, **LAYOUTS[layout])
    model = tiny_llama(seed=11)
    initial = copy.deepcopy(model)
    trainer = GRPOTrainer(model, cfg, pad_token_id=0)
    with torch.no_grad():  # a critic whose head is not zero, so the values are the trunk's
        trainer.critic.model.head.weight.normal_(0, 0.5)
        trainer.critic.model.head.bias.fill_(0.1)
    samples = fixed_groups()
    share, chunks = chunk_samples(samples, cfg)
    assert share == (layout != "padded")
    inputs = trainer.forwards.run(chunks, trainer.forward_batches(share, chunks), sum(s.trained_tokens for s in samples))
    assert not inputs.critic_updated  # updates_per_step=2: the two passes
    kl, values = in_order(samples, inputs.kl), in_order(samples, inputs.values)
    head = trainer.critic.model.head
    with torch.no_grad():
        for s, k, v in zip(samples, kl, values):
            logits = initial(input_ids=torch.tensor([list(s.prompt_ids) + list(s.response_ids)])).logits[0]
            p = len(s.prompt_ids)
            ref = logits[p - 1 : p - 1 + len(s.response_ids)].log_softmax(-1)
            ref = ref.gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
            torch.testing.assert_close(k, kl_estimate(torch.tensor(s.behaviour_logprobs), ref, "k3"), rtol=0, atol=2e-5)
            expected = head(_predictors(trainer.critic.model.backbone, s)).sum(-1)
            torch.testing.assert_close(v, expected, rtol=0, atol=2e-5)
            assert v.abs().sum() > 0


@pytest.mark.parametrize("layout,checkpointing", [("padded", False), ("group", False), ("packed_groups", False),
                                                  ("packed_groups", True), ("group", "selective")])
def test_one_critic_forward_a_step_equals_values_then_update(layout, checkpointing):
    """train.updates_per_step=1: Critic.values_and_update (each micro-batch forwarded once, with grad) against the
    two passes it replaces, run here on a copy: Critic.values, the step's plan (compute_token_advantages over the
    whole batch), then Critic.update. Two steps, so the second's values are the trained critic's."""
    cfg = TrainConfig(advantage="gae", kl_coef=0.2, kl_penalty="reward", micro_batch_size=4, micro_batch_tokens=64,
                      gradient_checkpointing=checkpointing, gae={"critic_lr": 3e-2, "lam": 0.9, "gamma": 0.99},
                      **LAYOUTS[layout])
    trainer = GRPOTrainer(tiny_llama(seed=12), cfg, pad_token_id=0)
    critic = trainer.critic
    twin = copy.deepcopy(critic)
    for step in range(2):
        samples = fixed_groups()
        share, chunks = chunk_samples(samples, cfg)
        batches = trainer.forward_batches(share, chunks)
        n_tokens = sum(s.trained_tokens for s in samples)
        inputs = trainer.forwards.run(chunks, batches, n_tokens)
        assert inputs.critic_updated
        # the two passes, on the twin
        values = [v.cpu() for v in twin.values(batches, trainer._compute)]
        by_id = {id(s): v for chunk, vb in zip(chunks, values)
                 for s, v in zip(chunk, torch.split(vb, [s.trained_tokens for s in chunk]))}
        kl = in_order(samples, inputs.kl)
        plan = compute_token_advantages(samples, cfg, kl=kl, values=in_order(samples, by_id))
        returns = per_batch(chunks, {id(s): g for s, g in zip(samples, plan.returns)})
        want = twin.update(batches, values, returns, trainer._compute)
        for s, got in zip(samples, in_order(samples, inputs.values)):
            torch.testing.assert_close(got, by_id[id(s)], rtol=0, atol=1e-6)
        for key in ("critic/value_loss", "critic/grad_norm", "critic/value_clip_fraction"):
            assert inputs.critic_metrics[key] == pytest.approx(want[key], rel=1e-5, abs=1e-8), key
        for (name, a), b in zip(critic.model.state_dict().items(), twin.model.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert inputs.critic_metrics["critic/value_loss"] > 0 and inputs.critic_metrics["critic/grad_norm"] > 0


def test_the_reference_in_the_compute_dtype_computes_what_autocast_does():
    """compute_dtype=bfloat16: the frozen reference's linear weights are bfloat16 (no cast per forward), its
    embeddings float32, and its log-probs are the float32 model's under autocast."""
    cfg = TrainConfig(advantage="reinforce_pp", kl_coef=0.1, kl_penalty="reward", compute_dtype="bfloat16",
                      micro_batch_size=4)
    model = tiny_llama(seed=13)
    initial = copy.deepcopy(model)
    trainer = GRPOTrainer(model, cfg, pad_token_id=0)
    ref = trainer.ref_model
    assert ref.get_output_embeddings().weight.dtype == torch.bfloat16
    assert ref.get_input_embeddings().weight.dtype == torch.float32
    assert ref.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32  # the policy untouched
    samples = fixed_groups()
    share, chunks = chunk_samples(samples, cfg)
    for mb in trainer.forward_batches(share, chunks):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            want, _ = mb.logprobs(initial, trainer.forwards.options)
        got = trainer.forwards.reference_kl([mb])[0]
        torch.testing.assert_close(got, kl_estimate(mb.behaviour_logp, want.float(), "k1"), rtol=0, atol=1e-6)


@pytest.mark.parametrize("overrides,ref,critic", [({"advantage": "mean_std"}, False, False),
                                                  ({"advantage": "reinforce_pp", "kl_coef": 0.1}, True, False),
                                                  ({"advantage": "mean", "kl_coef": 0.1}, True, False),
                                                  ({"advantage": "gae"}, False, True),
                                                  ({"advantage": "gae", "updates_per_step": 2}, False, True)])
def test_the_step_metrics_time_the_reference_and_the_critic(overrides, ref, critic):
    cfg = TrainConfig(micro_batch_size=4, **overrides)
    trainer = GRPOTrainer(tiny_llama(seed=14), cfg, pad_token_id=0)
    samples = fixed_groups()
    assign_advantages(samples, cfg.advantage)
    metrics = trainer.train_step(samples)
    assert (metrics["time_ref_s"] > 0) == ref and (metrics["time_critic_s"] > 0) == critic
    if critic:  # the critic stepped, in one pass or after the policy's updates
        assert metrics["critic/value_loss"] > 0 and metrics["critic/grad_norm"] > 0

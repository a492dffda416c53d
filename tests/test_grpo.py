"""GRPO math against hand-computed values; loss masking; chunked logprobs equal a full forward."""

import math

import pytest
import torch

from rollwise.types.train_config import TrainConfig
from rollwise.model.tiny import tiny_llama
from rollwise.types.sample import Sample
from rollwise.train.grpo import clipped_surrogate_loss, group_advantages, token_weights
from rollwise.train.logprobs import LogprobOptions, sequence_logprobs
from rollwise.train.trainer import GRPOTrainer, collate


def test_group_advantages_mean_std_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    adv = group_advantages(rewards, "mean_std", eps=0.0 + 1e-12)
    std = math.sqrt(((0.5**2) * 4) / 3)  # unbiased std of [1,0,0,1]
    expected = torch.tensor([[0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(adv, expected, atol=1e-6)


def test_group_advantages_mean_only_and_errors():
    adv = group_advantages(torch.tensor([[1.0, 0.1, 0.0]]), "mean")
    assert torch.allclose(adv, torch.tensor([[1 - 1.1 / 3, 0.1 - 1.1 / 3, -1.1 / 3]]))
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.tensor([[1.0]]))
    with pytest.raises(ValueError, match="mean_std"):
        group_advantages(torch.tensor([[1.0, 0.0]]), "median")  # type: ignore[arg-type]


def test_clipped_surrogate_hand_computed():
    # ratio = exp(logp - old): token 0 ratio 1.5 (A>0, clipped at 1.28), token 1 ratio 0.5 (A<0, clipped at 0.8),
    # token 2 ratio 1.0 (A>0, unclipped).
    old = torch.zeros(3)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.0]))
    adv = torch.tensor([2.0, -1.0, 0.5])
    w = torch.full((3,), 1 / 3)
    terms = clipped_surrogate_loss(logp, old, adv, clip_low=0.2, clip_high=0.28, token_weights=w)
    expected = -(1.28 * 2.0 + 0.8 * -1.0 + 1.0 * 0.5) / 3
    assert terms.loss.item() == pytest.approx(expected, abs=1e-6)
    assert int(terms.clipped_tokens) == 2


def test_k3_kl_term_hand_computed():
    logp = torch.log(torch.tensor([0.5]))
    ref = torch.log(torch.tensor([0.25]))
    terms = clipped_surrogate_loss(logp, logp.clone(), torch.zeros(1), clip_low=0.2, clip_high=0.2,
                                   token_weights=torch.ones(1), ref_logp=ref, kl_coef=0.1)
    log_r = math.log(0.25 / 0.5)
    assert terms.loss.item() == pytest.approx(0.1 * (math.exp(log_r) - log_r - 1), abs=1e-6)


def test_token_weights():
    assert torch.allclose(token_weights([2, 1], "token_mean"), torch.full((3,), 1 / 3))
    assert torch.allclose(token_weights([2, 1], "seq_mean_token_mean"), torch.tensor([0.25, 0.25, 0.5]))


def _sample(prompt, response, adv, logps=None):
    return Sample(sample_id="x", group_id="g", problem_id="p", prompt_ids=prompt, response_ids=response,
                  behaviour_logprobs=logps or [0.0] * len(response), versions=[0] * len(response),
                  finish_reason="stop", advantage=adv)


def test_chunked_logprobs_equal_full_forward():
    torch.manual_seed(0)
    model = tiny_llama(seed=1)
    samples = [_sample([5, 6, 7], [8, 9, 10, 11], 1.0), _sample([5, 6], [12, 13], -1.0)]
    mb = collate(samples, torch.ones(6), pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits.float()
        full = torch.log_softmax(logits[:, :-1], -1).gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
        expected = full[mb.target_mask[:, 1:]]
        got, entropy = sequence_logprobs(model, mb.input_ids, mb.attention_mask, mb.target_mask,
                                         LogprobOptions(chunk_tokens=2))
    assert got.shape == (6,)
    assert torch.allclose(got, expected, atol=1e-5)
    assert (entropy > 0).all()


def test_masked_tokens_get_zero_gradient():
    """Prompt tokens and padding carry no loss: perturbing them cannot change the loss gradient path.

    We check at the level that matters: the gradient w.r.t. the input embeddings of the positions
    *after* the last response token (padding) is exactly zero, and tokens inside the prompt only
    influence the loss through the response positions (the loss is not computed on them).
    """
    model = tiny_llama(seed=2)
    samples = [_sample([5, 6, 7], [8, 9], 1.0), _sample([5, 6, 7, 8, 9, 10], [11], 1.0)]
    mb = collate(samples, torch.full((3,), 1 / 3), pad_id=0)
    embeds = model.get_input_embeddings()(mb.input_ids).detach().requires_grad_(True)
    backbone = model.get_decoder()
    hidden = backbone(inputs_embeds=embeds, attention_mask=mb.attention_mask).last_hidden_state
    from rollwise.train.logprobs import lm_head_logprobs

    targets = mb.input_ids[:, 1:][mb.target_mask[:, 1:]]
    logp, _ = lm_head_logprobs(hidden[:, :-1][mb.target_mask[:, 1:]], model.get_output_embeddings(), targets)
    terms = clipped_surrogate_loss(logp, logp.detach(), mb.advantages, clip_low=0.2, clip_high=0.2,
                                   token_weights=mb.weights)
    terms.loss.backward()
    # Row 0 is padded after position 4 (3 prompt + 2 response): padding gets no gradient.
    assert embeds.grad[0, 5:].abs().sum() == 0
    # The last response token of each row predicts nothing: its input embedding gets no gradient.
    assert embeds.grad[0, 4].abs().sum() == 0
    assert embeds.grad[1, 6].abs().sum() == 0
    # Earlier positions do receive gradient (the loss is not trivially zero).
    assert embeds.grad[0, :4].abs().sum() > 0


def test_trainer_step_changes_weights_and_counts_versions():
    model = tiny_llama(seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = GRPOTrainer(model, TrainConfig(lr=1e-3, micro_batch_size=1), pad_token_id=0)
    samples = [_sample([5, 6, 7], [8, 9], 1.0), _sample([5, 6, 7], [10, 11], -1.0)]
    metrics = trainer.train_step(samples)
    assert trainer.version == 1
    assert metrics["trained_tokens"] == 4
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("share_prompt_prefix", [False, True])
def test_gradient_accumulation_equals_one_big_batch(share_prompt_prefix):
    """Micro-batch size and prompt sharing change the computation, never the gradient."""
    samples = [_sample([5, 6, 7], [8, 9], 1.0), _sample([5, 6, 7], [10, 11, 12], -0.5), _sample([4], [3], 0.7),
               _sample([5, 6, 7], [13], 0.2)]
    reference = None
    for mbs in (1, 4):
        model = tiny_llama(seed=4)
        cfg = TrainConfig(lr=1e-3, micro_batch_size=mbs, grad_clip=1e9, share_prompt_prefix=share_prompt_prefix)
        trainer = GRPOTrainer(model, cfg, pad_token_id=0)
        for mb in trainer._micro_batches(samples):
            logp, _ = mb.logprobs(model, LogprobOptions())
            clipped_surrogate_loss(logp, mb.behaviour_logp, mb.advantages, clip_low=0.2, clip_high=0.2,
                                   token_weights=mb.weights).loss.backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        if reference is None:
            # The plain padded forward with one big batch is the reference for every variant.
            model = tiny_llama(seed=4)
            mb = collate(samples, token_weights([len(s.response_ids) for s in samples], "token_mean"), pad_id=0)
            logp, _ = sequence_logprobs(model, mb.input_ids, mb.attention_mask, mb.target_mask)
            clipped_surrogate_loss(logp, mb.behaviour_logp, mb.advantages, clip_low=0.2, clip_high=0.2,
                                   token_weights=mb.weights).loss.backward()
            reference = torch.cat([p.grad.flatten() for p in model.parameters()])
        assert torch.allclose(grad, reference, atol=1e-6)


def test_shared_prompt_logprobs_equal_full_forward():
    from rollwise.train.logprobs import shared_prompt_logprobs
    from rollwise.train.packing import collate_group

    model = tiny_llama(seed=5)
    samples = [_sample([5, 6, 7, 9], [8, 9, 3], 1.0), _sample([5, 6, 7, 9], [10], 1.0), _sample([5, 6, 7, 9], [4, 4], 1.0)]
    with torch.no_grad():
        mb = collate(samples, torch.ones(6), pad_id=0)
        expected, _ = sequence_logprobs(model, mb.input_ids, mb.attention_mask, mb.target_mask)
        g = collate_group(samples, torch.ones(6), pad_id=0)
        got, _ = shared_prompt_logprobs(model, g.prompt_ids, g.responses, g.response_mask)
    assert torch.allclose(got, expected, atol=1e-5)


def test_off_policy_weights_match_hand_computed_values():
    from rollwise.train.grpo import off_policy_weights

    prox = torch.tensor([-1.0, -2.0, -0.5])
    behav = torch.tensor([-1.5, -1.0, -0.5])
    # exp(prox - behav) = exp(0.5), exp(-1), exp(0)
    exact = torch.tensor([math.exp(0.5), math.exp(-1.0), 1.0])
    assert torch.allclose(off_policy_weights(prox, behav, "decoupled"), exact)
    assert torch.allclose(off_policy_weights(prox, behav, "tis", cap=1.5), torch.tensor([1.5, math.exp(-1.0), 1.0]))
    assert torch.equal(off_policy_weights(prox, behav, "none"), torch.ones(3))
    with pytest.raises(ValueError):
        off_policy_weights(prox, behav, "tis")


def test_decoupled_loss_clips_around_the_proximal_policy():
    # One token, advantage +1: ratio to the proximal policy exp(0.3) is clipped at 1 + 0.2 = 1.2;
    # the loss is -(clipped ratio) * is_weight, with is_weight = exp(prox - behav) = exp(0.4).
    logp = torch.tensor([-0.7], requires_grad=True)
    prox = torch.tensor([-1.0])
    behav = torch.tensor([-1.4])
    w = off_policy = torch.exp(prox - behav)
    terms = clipped_surrogate_loss(logp, behav, torch.tensor([1.0]), clip_low=0.2, clip_high=0.2,
                                   token_weights=torch.ones(1), proximal_logp=prox, is_weights=off_policy)
    assert float(terms.loss.detach()) == pytest.approx(-1.2 * float(w))
    terms.loss.backward()
    assert float(logp.grad) == 0.0  # clipped: no gradient
    # Unclipped case: ratio exp(0.1); d/dlogp of -ratio * w = -ratio * w.
    logp = torch.tensor([-0.9], requires_grad=True)
    terms = clipped_surrogate_loss(logp, behav, torch.tensor([1.0]), clip_low=0.2, clip_high=0.2,
                                   token_weights=torch.ones(1), proximal_logp=prox, is_weights=off_policy)
    terms.loss.backward()
    assert float(logp.grad) == pytest.approx(-math.exp(0.1) * float(w), rel=1e-6)

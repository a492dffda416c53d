"""PPO with a critic (train.advantage=gae) and REINFORCE++'s KL in the reward (train.kl_penalty=reward), issue 41
item 1: GAE and the KL-shaped returns against independent float64 loops written here, on hand-built tensors
(a group of one, a fully masked sequence); the trainer's micro-batches carry the per-token advantages in every
layout; a gae trainer trains its critic (the value loss falls on a fixed batch), and checkpoints and resumes it;
the setting that does not run yet (agent) and a resume without a critic are refused, naming the field (the
sharded trainer's critic: tests/test_critic_sharded.py).
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from rollwise.config import ConfigError, RunError, load_config
from rollwise.types.train_config import TrainConfig
from rollwise.model.tiny import tiny_llama
from rollwise.train.advantages import assign_advantages
from rollwise.train.critic import EXPLAINED_VARIANCE, VALUE_LOSS
from rollwise.train.step_batches import with_token_advantages
from rollwise.train.token_advantages import compute_token_advantages, kl_estimate
from rollwise.train.trainer import GRPOTrainer
from rollwise.types.sample import Sample

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _sample(i: int, group: str, reward: float, n: int, loss_mask: list[int] | None = None,
            prompt: tuple[int, ...] = (5, 6, 7)) -> Sample:
    return Sample(sample_id=f"{group}/{i}", group_id=group, problem_id="p", prompt_ids=list(prompt),
                  response_ids=[(8 + i + t) % 60 + 3 for t in range(n)], behaviour_logprobs=[-2.0 - 0.1 * t for t in range(n)],
                  versions=[0] * n, finish_reason="stop", reward=reward, loss_mask=loss_mask)


# Group "a" of three, group "b" of one; one sample whose every token is masked (template only: no trained tokens).
def _samples() -> list[Sample]:
    return [_sample(0, "a", 1.0, 4), _sample(1, "a", 0.0, 2), _sample(2, "a", 0.5, 3, loss_mask=[0, 0, 0]),
            _sample(3, "b", 0.25, 3)]


VALUES = [[0.1, -0.2, 0.4, 0.3], [0.5, 0.0], [], [0.2, 0.2, -0.1]]
KL = [[0.3, -0.1, 0.2, 0.05], [0.1, 0.4], [], [-0.2, 0.0, 0.3]]


def _ref_gae(rewards, values, gamma, lam):
    """GAE by its definition: A_t = sum_l (gamma lam)^l delta_{t+l}, V after the last token 0 (float64)."""
    n = len(rewards)
    v = list(values) + [0.0]
    delta = [rewards[t] + gamma * v[t + 1] - v[t] for t in range(n)]
    adv = [sum((gamma * lam) ** k * delta[t + k] for k in range(n - t)) for t in range(n)]
    return adv, [a + values[t] for t, a in enumerate(adv)]


def _ref_whiten(seqs):
    flat = np.array([x for s in seqs for x in s], dtype=np.float64)
    mean, var = flat.mean(), flat.var(ddof=1)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in s] for s in seqs]


def _ref_token_rewards(reward, kl, coef):
    r = [-coef * k for k in kl]
    if r:
        r[-1] += reward
    return r


def _ref_kl(logp, ref, estimator):
    d = logp - ref
    return {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) - 1 + d}[estimator]


@pytest.mark.parametrize("gamma,lam,whiten,coef", [(1.0, 0.95, False, 0.0), (0.9, 0.5, True, 0.2), (1.0, 1.0, True, 0.0)])
def test_gae_matches_the_definition(gamma, lam, whiten, coef):
    samples = _samples()
    cfg = TrainConfig(advantage="gae", kl_coef=coef, kl_penalty="reward",
                      gae={"gamma": gamma, "lam": lam, "whiten": whiten})
    kl = [torch.tensor(k) for k in KL] if coef else None
    got = compute_token_advantages(samples, cfg, kl=kl, values=[torch.tensor(v) for v in VALUES])
    pairs = [_ref_gae(_ref_token_rewards(s.reward, k if coef else [0.0] * len(v), coef), v, gamma, lam)
             for s, v, k in zip(samples, VALUES, KL)]
    adv = [a for a, _ in pairs]
    expected = _ref_whiten(adv) if whiten else adv
    assert [len(a) for a in got.advantages] == [4, 2, 0, 3]  # the fully masked sample: no tokens, no advantages
    for g, e in zip(got.advantages, expected):
        assert np.allclose(g.numpy(), e, atol=1e-5), (g, e)
    for g, (_, e) in zip(got.returns, pairs):  # the critic's targets: unwhitened A + V
        assert np.allclose(g.numpy(), e, atol=1e-6)
    # lam = 1, gamma = 1, no KL: the return is the reward at every token, the advantage R - V (Monte Carlo)
    if (gamma, lam, coef) == (1.0, 1.0, 0.0):
        assert np.allclose(got.returns[3].numpy(), [0.25] * 3)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("advantage", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_kl_in_the_reward_matches_the_formula(estimator, advantage):
    samples = _samples()
    logp = [torch.tensor([-1.0, -0.5, -2.0, -0.1]), torch.tensor([-0.3, -1.2]), torch.tensor([]),
            torch.tensor([-0.7, -0.7, -3.0])]
    ref = [torch.tensor([-1.2, -0.5, -1.0, -0.4]), torch.tensor([-0.1, -2.2]), torch.tensor([]),
           torch.tensor([-0.6, -0.9, -2.5])]
    kl = [kl_estimate(a, b, estimator) for a, b in zip(logp, ref)]
    for k, a, b in zip(kl, logp, ref):
        assert np.allclose(k.numpy(), [_ref_kl(float(x), float(y), estimator) for x, y in zip(a, b)], atol=1e-6)
    coef = 0.1
    cfg = TrainConfig(advantage=advantage, kl_coef=coef, kl_estimator=estimator)
    assert cfg.kl_penalty == ("reward" if advantage == "reinforce_pp" else "loss")  # auto: REINFORCE++'s choice
    got = compute_token_advantages(samples, cfg.model_copy(update={"kl_penalty": "reward"}), kl=kl)
    base = {"a": (1.0 + 0.0 + 0.5) / 3, "b": 0.25} if advantage == "reinforce_pp_baseline" else {"a": 0.0, "b": 0.0}
    returns = []
    for s, k in zip(samples, kl):
        r = _ref_token_rewards(s.reward - base[s.group_id], k.tolist(), coef)
        returns.append([sum(r[t:]) for t in range(len(r))])  # undiscounted return-to-go
    for g, e in zip(got.advantages, _ref_whiten(returns)):
        assert np.allclose(g.numpy(), e, atol=1e-5), (g, e)


def _batch(n_groups: int = 2, size: int = 3) -> list[Sample]:
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.2, 0.9][: n_groups * size]
    # one prompt per group (the shared-prompt layouts need it)
    return [_sample(i, f"g{i // size}", r, 2 + i % 3, prompt=(5, 6, 7 + i // size)) for i, r in enumerate(rewards)]


@pytest.mark.parametrize("layout", [{"share_prompt_prefix": False}, {"pack_responses": False},
                                    {"pack_responses": True, "pack_groups": True}])
def test_every_micro_batch_layout_trains_on_the_token_advantages(layout):
    samples = _batch()
    cfg = TrainConfig(advantage="gae", micro_batch_size=2, **layout)
    trainer = GRPOTrainer(tiny_llama(seed=3), cfg, pad_token_id=0)
    assign_advantages(samples, "gae")
    chunks, batches = trainer._step_plan(samples)  # the step's one collation, before the advantages are known
    trainer._token_advantages(samples, chunks, batches)
    expected = torch.tensor([a for s in samples for a in s.token_advantages])
    got = torch.cat([mb.advantages for mb in with_token_advantages(batches, chunks)])
    # filled in, they are what a collation after the plan reads off the samples
    assert torch.equal(got, torch.cat([mb.advantages for mb in trainer._micro_batches(samples)]))
    # chunking may reorder samples (by group): compare as multisets, and per token where the order is kept
    assert torch.equal(got.sort().values, expected.sort().values)
    assert not torch.equal(got, torch.tensor([s.advantage for s in samples for _ in range(s.trained_tokens)]))


def test_trainer_kl_in_the_reward_uses_the_reference_log_probs():
    """reinforce_pp with kl_coef > 0: the trainer's per-token advantages are the hand formula over the initial
    policy's log-probs (computed here with the plain Hugging Face forward), and the loss has no KL term."""
    samples = _batch()
    cfg = TrainConfig(advantage="reinforce_pp", kl_coef=0.5, kl_estimator="k3", micro_batch_size=2)
    model = tiny_llama(seed=4)
    initial = copy.deepcopy(model)
    trainer = GRPOTrainer(model, cfg, pad_token_id=0)
    assert trainer.loss_kl_coef == 0.0 and trainer.ref_model is not None
    metrics = trainer.train_step(samples)
    returns = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
            logits = initial(input_ids=ids).logits[0].double().log_softmax(-1)
            p = len(s.prompt_ids)
            ref = [float(logits[p + t - 1, s.response_ids[t]]) for t in range(len(s.response_ids))]
            kl = [_ref_kl(b, r, "k3") for b, r in zip(s.behaviour_logprobs, ref)]
            r = _ref_token_rewards(s.reward, kl, 0.5)
            returns.append([sum(r[t:]) for t in range(len(r))])
    for s, e in zip(samples, _ref_whiten(returns)):
        assert np.allclose(s.token_advantages, e, atol=1e-4), (s.token_advantages, e)
    assert metrics["kl_reward"] > 0 and metrics["kl"] == 0.0


@pytest.fixture(scope="module")
def gae_cfg() -> TrainConfig:
    return TrainConfig(advantage="gae", lr=1e-3, micro_batch_size=4, gae={"critic_lr": 1e-2, "lam": 1.0})


def test_gae_trains_the_critic_and_resumes_it(tmp_path, gae_cfg):
    from rollwise.model.tiny import tiny_tokenizer
    from rollwise.train.checkpoint_manifest import verify_checkpoint

    batch = _batch(3, 3)
    assign_advantages(batch, "gae")
    trainer = GRPOTrainer(tiny_llama(seed=5), gae_cfg, pad_token_id=0, tokenizer=tiny_tokenizer())
    first = trainer.train_step(copy.deepcopy(batch))
    second = trainer.train_step(copy.deepcopy(batch))
    assert second[VALUE_LOSS] < first[VALUE_LOSS], (first[VALUE_LOSS], second[VALUE_LOSS])
    assert first["critic/value_mean"] == 0.0  # the zero-initialised head: the first values are 0
    assert math.isfinite(second[EXPLAINED_VARIANCE]) and first["grad_norm"] > 0

    ckpt = trainer.save_checkpoint(tmp_path, 2, {}, keep_last=1)
    verify_checkpoint(ckpt)
    listed = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {"critic/value_model.safetensors", "critic/optimizer.pt"} <= set(listed)  # the manifest vouches for them
    resumed = GRPOTrainer(tiny_llama(seed=9), gae_cfg, pad_token_id=0, tokenizer=tiny_tokenizer())
    resumed.load_checkpoint(ckpt)
    for a, b in zip(trainer.critic.model.state_dict().values(), resumed.critic.model.state_dict().values()):
        assert torch.equal(a, b)
    # the next step from the resumed trainer equals the original's: weights and both optimizers restored
    want, got = trainer.train_step(copy.deepcopy(batch)), resumed.train_step(copy.deepcopy(batch))
    assert got[VALUE_LOSS] == want[VALUE_LOSS] and got["loss"] == want["loss"]
    assert resumed.critic.optimizer.state_dict()["state"][0]["step"] == trainer.critic.optimizer.state_dict()["state"][0]["step"]

    plain = GRPOTrainer(tiny_llama(seed=5), TrainConfig(), pad_token_id=0, tokenizer=tiny_tokenizer())
    no_critic = plain.save_checkpoint(tmp_path / "plain", 1, {}, keep_last=1)
    with pytest.raises(RunError, match="has no critic/"):
        GRPOTrainer(tiny_llama(seed=5), gae_cfg, pad_token_id=0).load_checkpoint(no_critic)


@pytest.mark.parametrize("overrides,field", [
    (["train.advantage=mean", "train.kl_penalty=reward"], "train.kl_penalty=reward"),
    (["train.advantage=gae", "agent.max_turns=2"], "agent:"),
    (["train.advantage=reinforce_pp", "train.kl_coef=0.1", "agent.max_turns=2"], "agent:"),
    (["train.gae.value_clip=0"], "train.gae.value_clip"),
    (["train.kl_estimator=k5"], "train.kl_estimator"),
])
def test_refused_with_the_field_named(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, overrides)

"""The sharded trainer's critic and per-token rewards (issue 41 item 1): train.advantage=gae and
train.kl_penalty=reward at trainer.world_size=2 (FSDP2 ranks on gloo; one group runs both, since starting the
ranks is most of the time) train the same policy and critic as the one-process trainer on the same batch, to float
tolerance, with the same per-token advantages; a 2-rank checkpoint resumes its critic (weights and
optimizer, sharded in critic/dcp/) on 2 ranks and in one process, and 2 ranks resume a one-process one's; the config accepts both on the sharded trainer."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from rollwise.config import ConfigError, load_config
from rollwise.model.tiny import tiny_llama, tiny_tokenizer
from rollwise.train.advantages import assign_advantages
from rollwise.train.critic import EXPLAINED_VARIANCE, VALUE_LOSS
from rollwise.train.sharded import ShardedTrainer
from rollwise.train.token_advantages import KL_REWARD
from rollwise.train.trainer import GRPOTrainer
from rollwise.types.sample import Sample
from rollwise.types.train_config import TrainConfig, TrainerConfig
from random_groups import random_groups

pytestmark = [pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="2 ranks need 2 CPU cores"),
              pytest.mark.usefixtures("single_torch_thread")]


def _samples(seed: int, advantage: str) -> list[Sample]:
    """Groups with unequal lengths (the ranks get unequal shares), rewards in [0, 1], advantages by `advantage`."""
    out = random_groups(seed, "reward")
    assign_advantages(out, advantage)
    return out


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for name, tensor in b.items():
        torch.testing.assert_close(a[name], tensor, rtol=0, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def _critic_of(ckpt) -> dict[str, torch.Tensor]:
    return load_file(ckpt / "critic" / "value_model.safetensors")


def _token_advantages(samples: list[Sample]) -> torch.Tensor:
    return torch.tensor([a for s in samples for a in s.token_advantages])


def _pair(cfg: TrainConfig):
    tok = tiny_tokenizer()
    single = GRPOTrainer(tiny_llama(seed=3), cfg, pad_token_id=tok.pad_token_id, tokenizer=tok)
    sharded = ShardedTrainer(tiny_llama(seed=3), cfg, TrainerConfig(world_size=2, device="cpu"),
                             pad_token_id=tok.pad_token_id, tokenizer=tok)
    return single, sharded


def test_gae_and_kl_in_the_reward_on_two_ranks_equal_one_process_and_the_checkpoint_resumes(tmp_path):
    """One group of 2 ranks (their start is most of this test's time) runs both per-token settings at once: GAE's
    critic and the KL folded into the reward (the reference's log-probs on each rank)."""
    # lam < 1, gamma < 1 and a second step (the critic's values no longer 0): the values enter the advantages
    cfg = TrainConfig(advantage="gae", kl_penalty="reward", kl_coef=0.2, kl_estimator="k3", lr=1e-3,
                      micro_batch_size=2, off_policy_correction="none",
                      gae={"critic_lr": 3e-3, "lam": 0.9, "gamma": 0.99, "value_clip": 0.2})
    first, second = _samples(1, "gae"), _samples(2, "gae")
    single, sharded = _pair(cfg)
    try:
        one_samples, on_ranks = copy.deepcopy(first), copy.deepcopy(first)
        one = single.train_step(one_samples)
        two = sharded.train_step(on_ranks)
        assert two["trained_tokens"] == one["trained_tokens"] and two["trainer_rank_token_imbalance"] >= 1.0
        # the controller's per-token advantages, from the ranks' reference log-probs, are the one-process ones
        torch.testing.assert_close(_token_advantages(on_ranks), _token_advantages(one_samples), rtol=0, atol=5e-5)
        assert one[KL_REWARD] > 0 and two["kl"] == one["kl"] == 0.0  # the KL is in the reward, not in the loss
        for key in ("loss", KL_REWARD, VALUE_LOSS, "critic/grad_norm", "critic/value_clip_fraction",
                    "critic/return_mean"):
            assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
        assert one[VALUE_LOSS] > 0
        _close(sharded.weights(), single.weights(), atol=5e-5)
        ckpt = sharded.save_checkpoint(tmp_path, 1, {}, keep_last=3)
        assert (ckpt / "critic" / "dcp").is_dir()  # every rank's shard of the critic and its optimizer
        _close(_critic_of(ckpt), single.critic.model.state_dict(), atol=5e-5)

        # A step, then back to the checkpoint: the step after it must equal the one-process second step,
        # which it only does if the critic's weights and AdamW state came back (a lost state moves by ~lr)
        sharded.train_step(_samples(7, "gae"))
        assert sharded.load_checkpoint(ckpt)["step"] == 1 and sharded.version == 1
        one_samples, on_ranks = copy.deepcopy(second), copy.deepcopy(second)
        two = sharded.train_step(on_ranks)
        one = single.train_step(one_samples)
        assert one["critic/value_mean"] != 0.0  # the critic learned: its values shape the advantages now
        torch.testing.assert_close(_token_advantages(on_ranks), _token_advantages(one_samples), rtol=0, atol=1e-4)
        for key in (VALUE_LOSS, EXPLAINED_VARIANCE, "critic/value_mean"):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
        _close(sharded.weights(), single.weights(), atol=5e-5)
        ckpt2 = sharded.save_checkpoint(tmp_path, 2, {}, keep_last=3)
        critic_two = {name: t.clone() for name, t in single.critic.model.state_dict().items()}
        _close(_critic_of(ckpt2), critic_two, atol=5e-5)

        # The 2 ranks resume a one-process checkpoint's critic (value_model.safetensors and optimizer.pt)
        sharded.load_checkpoint(single.save_checkpoint(tmp_path / "one", 2, {}, keep_last=1))
        third = _samples(3, "gae")
        sharded.train_step(copy.deepcopy(third))
        single.train_step(copy.deepcopy(third))
        _close(_critic_of(sharded.save_checkpoint(tmp_path, 3, {}, keep_last=3)), single.critic.model.state_dict(),
               atol=5e-5)
    finally:
        sharded.close()

    # One process resumes the 2-rank checkpoint's critic: the full weights, the optimizer from the shards. (Built
    # from the run's initial model, as a resumed run is: the reference of the KL is that model, never checkpointed.)
    tok = tiny_tokenizer()
    resumed = GRPOTrainer(tiny_llama(seed=3), cfg, pad_token_id=tok.pad_token_id, tokenizer=tok)
    resumed.load_checkpoint(ckpt)
    again = resumed.train_step(copy.deepcopy(second))
    assert again[VALUE_LOSS] == pytest.approx(one[VALUE_LOSS], rel=1e-4)
    _close(resumed.critic.model.state_dict(), critic_two, atol=5e-5)


@pytest.mark.parametrize("overrides", [["trainer.world_size=2", "trainer.device=cpu"],
                                       ["placement=ray", "ray.trainer_ranks=2"]])
@pytest.mark.parametrize("advantage", [["train.advantage=gae"], ["train.advantage=reinforce_pp", "train.kl_coef=0.1"]])
def test_the_sharded_trainer_takes_the_per_token_advantages(overrides, advantage):
    cfg = load_config(None, advantage + overrides)
    assert cfg.train.advantage == advantage[0].split("=")[1]
    with pytest.raises(ConfigError, match="agent:"):  # still single-turn
        load_config(None, advantage + overrides + ["agent.max_turns=2"])
    assert not math.isnan(cfg.train.lr)

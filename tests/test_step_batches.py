"""One plan, one collation per train step (issue 41): with per-token advantages (REINFORCE++'s KL in the reward,
PPO+GAE's critic) the step collates its micro-batches once; the reference's and the critic's forwards run on them
and the advantages are filled into them afterwards (rollwise.train.step_batches). The step trains exactly as the
two-collation path did (kept here only, from the trainer's public pieces: the forwards on one collation, the
advantages planned over the batch and set on the samples, then a second collation for the policy's update): the
same loss and metrics and bit-identical policy and critic weights, with GRPO as the control.
"""

from __future__ import annotations

import pytest
import torch

from rollwise.model.tiny import tiny_llama
from rollwise.train.advantages import assign_advantages
from rollwise.train.token_advantages import plan_token_advantages
from rollwise.train.token_forwards import in_order, per_batch
from rollwise.train.trainer import GRPOTrainer
from rollwise.types.microbatch import chunk_samples
from rollwise.types.sample import Sample
from rollwise.types.train_config import TrainConfig

from random_groups import fixed_groups

pytestmark = pytest.mark.usefixtures("single_torch_thread")

RECIPES = {
    "grpo": {"advantage": "mean_std"},
    "reinforce_pp": {"advantage": "reinforce_pp", "kl_penalty": "reward", "kl_coef": 0.1},
    "ppo_gae": {"advantage": "gae", "gae": {"critic_lr": 3e-2}},
    "ppo_gae_2_updates": {"advantage": "gae", "kl_penalty": "reward", "kl_coef": 0.05, "updates_per_step": 2,
                          "gae": {"critic_lr": 3e-2}},
}
LAYOUTS = {"packed_groups": {}, "padded": {"share_prompt_prefix": False}}


class CountingTrainer(GRPOTrainer):
    """The trainer, counting the step's collations (every micro-batch is built by collate_chunks)."""

    collations = 0

    def collate_chunks(self, *args, **kwargs):
        self.collations += 1
        return super().collate_chunks(*args, **kwargs)


def _batch(advantage: str) -> list[Sample]:
    """tests/random_groups.fixed_groups with the estimator's advantages."""
    out = fixed_groups()
    assign_advantages(out, advantage)
    return out


def _trainer(cfg: TrainConfig, cls: type[GRPOTrainer] = GRPOTrainer) -> GRPOTrainer:
    torch.manual_seed(0)  # the critic's value head starts random: the same in both trainers
    trainer = cls(tiny_llama(seed=21), cfg, pad_token_id=0)
    if trainer.critic is not None:
        with torch.no_grad():  # a head that is not zero, so the values (and the advantages) are the trunk's
            trainer.critic.model.head.weight.normal_(0, 0.5)
    return trainer


def _two_collation_step(trainer: GRPOTrainer, samples: list[Sample]) -> dict[str, float]:
    """The step as it ran before: the forwards on one collation, the policy's update on a second."""
    cfg = trainer.cfg
    metrics: dict[str, float] = {}
    pending = None
    if trainer.token_advantages:
        share, chunks = chunk_samples(samples, cfg)
        batches = trainer.forward_batches(share, chunks)  # the first collation (zero loss weights)
        inputs = trainer.forwards.run(chunks, batches, sum(s.trained_tokens for s in samples))
        plan, metrics = plan_token_advantages(samples, cfg, in_order(samples, inputs.kl),
                                              in_order(samples, inputs.values))
        metrics.update(inputs.critic_metrics)
        if trainer.critic is not None and not inputs.critic_updated:
            pending = (batches, chunks, plan)
    policy_batches = trainer._micro_batches(samples)  # the second collation, the advantages read off the samples
    proximal: list[torch.Tensor] = []
    for update in range(cfg.updates_per_step):
        out = trainer._update(policy_batches, record_mismatch=update == 0, proximal=proximal)
    if pending is not None:
        batches, chunks, plan = pending
        ids = [id(s) for s in samples]
        old = per_batch(chunks, dict(zip(ids, plan.values)))
        returns = per_batch(chunks, dict(zip(ids, plan.returns)))
        metrics.update(trainer.critic.update(batches, old, returns, trainer._compute))
    return {**out, **metrics}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_one_collation_trains_exactly_as_two(recipe, layout):
    cfg = TrainConfig(micro_batch_size=4, micro_batch_tokens=64, lr=1e-2, **RECIPES[recipe], **LAYOUTS[layout])
    new, old = _trainer(cfg, CountingTrainer), _trainer(cfg)
    for step in range(2):  # the second step from trained weights (and a trained critic)
        got = new.train_step(_batch(cfg.advantage))
        assert new.collations == step + 1  # one collation a step
        want = _two_collation_step(old, _batch(cfg.advantage))
        for key, value in want.items():
            assert got[key] == value, key  # bit-identical
        assert got["loss"] != 0.0 and got["grad_norm"] > 0
        for (name, a), b in zip(new.model.state_dict().items(), old.model.state_dict().values()):
            assert torch.equal(a, b), name
        if new.critic is not None:
            assert got["critic/value_loss"] > 0
            for (name, a), b in zip(new.critic.model.state_dict().items(), old.critic.model.state_dict().values()):
                assert torch.equal(a, b), f"critic {name}"

"""The sharded trainer's per-token advantages: train.advantage=gae (PPO with a critic) and train.kl_penalty=reward
(REINFORCE++'s KL in the reward), on trainer.world_size > 1, torchrun or ray.trainer_ranks > 1.

The advantages of a sample depend on the whole batch (whitened over all its trained tokens, a group's mean
reward), so a step runs in two rounds over the same dealt work (rollwise.train.sharded.split_work):

1. every rank runs the critic's and the reference's forwards on its own micro-batches, before any update
   (command token_inputs: RankTrainer.token_inputs_of, with the one-process trainer's TokenForwards; the rank keeps
   those micro-batches for round 2's update: one collation a step, rollwise.train.step_batches);
   the critic is FSDP2-sharded like the policy, the reference is the rank's frozen copy of the initial policy;
2. the controller gathers them per sample and computes the advantages over the whole batch with the
   one-process trainer's function (rollwise.train.token_advantages.plan_token_advantages) and sets them on the
   samples the ranks then train on. At train.updates_per_step=1 each rank's critic already stepped in round 1
   (one forward per micro-batch: rollwise.train.token_forwards); otherwise the controller hands each rank the
   critic's targets for its micro-batches (RankWork.critic), which it fits after the policy's update with the
   one-process Critic.update.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollwise.types.sample import Sample
from rollwise.types.train_config import TrainConfig
from rollwise.train.critic import SUMMED_OVER_RANKS
from rollwise.train.rank import CriticTargets, RankWork, TokenReply
from rollwise.train.rank_group import RankGroup
from rollwise.train.token_advantages import plan_token_advantages


def _mine(work: RankWork) -> list[Sample]:
    return [s for chunk in work.chunks for s in chunk]


def _per_sample(samples: list[Sample], by_id: dict[int, Tensor]) -> list[Tensor]:
    """A sample no rank trains (no trained tokens) has none: an empty tensor, as the one-process trainer's."""
    return [by_id.get(id(s), torch.zeros(0)) for s in samples]


def plan_on_ranks(group: RankGroup, work: list[RankWork], samples: list[Sample], cfg: TrainConfig) -> dict[str, float]:
    """Set the per-token advantages of `samples` (the step's, as the one-process trainer would see them) from the
    ranks' forwards on `work`, and each rank's critic targets on its work; the step's advantage metrics."""
    kl_used = cfg.kl_penalty == "reward" and cfg.kl_coef > 0
    # Only the per-token rewards the samples carry (train.teacher's): no forward to run on the ranks
    n_tokens = sum(s.trained_tokens for s in samples)
    for w in work:
        w.batch_tokens = n_tokens
    replies: list[TokenReply] = group.call("token_inputs", work) if kl_used or cfg.advantage == "gae" else []
    kl_of: dict[int, Tensor] = {}
    values_of: dict[int, Tensor] = {}
    for w, reply in zip(work, replies):
        if w.idle:  # its chunks are another rank's, which answered for them
            continue
        for i, s in enumerate(_mine(w)):
            if reply.kl is not None:
                kl_of[id(s)] = reply.kl[i]
            if reply.values is not None:
                values_of[id(s)] = reply.values[i]
    kl_list = _per_sample(samples, kl_of) if kl_used else None
    values_list = _per_sample(samples, values_of) if cfg.advantage == "gae" else None
    plan, metrics = plan_token_advantages(samples, cfg, kl_list, values_list)
    if replies and replies[0].critic_updated:  # the critic stepped with its values (updates_per_step=1)
        metrics.update(replies[0].critic_metrics)
        for key in SUMMED_OVER_RANKS:  # each rank's share of the batch's
            metrics[key] = sum(r.critic_metrics[key] for r in replies)
        return metrics
    if plan.values is not None and plan.returns is not None:
        old_of = {id(s): v for s, v in zip(samples, plan.values)}
        returns_of = {id(s): g for s, g in zip(samples, plan.returns)}
        for w in work:
            mine = _mine(w)
            w.critic = CriticTargets(torch.cat([old_of[id(s)] for s in mine]),
                                     torch.cat([returns_of[id(s)] for s in mine]), n_tokens)
    return metrics


__all__ = ["plan_on_ranks"]

"""Advantage estimators (`train.advantage`): scored samples -> one advantage per sample.

One pure function per name (ESTIMATORS), over the step's rewards grouped by prompt. Every path that
assigns advantages uses `estimate` (the single-turn controllers through `assign_advantages`, the agent
layer per episode), so a name means the same numbers everywhere.

- mean_std (GRPO):   (r - mean_group) / (std_group + 1e-6), unbiased std (as verl/TRL).
- mean (Dr. GRPO):   r - mean_group.
- rloo:              r_i - mean of the *other* samples of its group (Ahmadian et al. 2024).
- reinforce_pp:      REINFORCE++ (Hu 2025) with outcome rewards: the reward, whitened over every trained
                     token of the batch: (r - mean) / sqrt(var + 1e-8), mean and unbiased var over tokens.
- reinforce_pp_baseline: r - mean_group first, then whitened over the batch's tokens the same way.

A group of one sample has no group baseline: the group-relative estimators give it 0 (it teaches nothing),
as does a group whose rewards are all equal (rloo and the REINFORCE++ baseline exactly: they subtract a
reference reward first, so equal rewards cancel without rounding). mean_std and mean keep the historical
arithmetic bit for bit (rollwise.train.grpo.group_advantages).

REINFORCE++'s KL: the paper folds a per-token KL to the reference into the token reward. With train.kl_coef > 0
and train.kl_penalty=reward (auto's choice for reinforce_pp) the trainer does so, since only it has the
reference's log-probs: it recomputes these advantages per token (rollwise.train.token_advantages), and the
values here are what a sample's tokens get without a KL. REINFORCE++-baseline's own recipe uses the k3 KL loss
term (kl_penalty=loss, auto's choice for it). gae: the critic's values are the trainer's too; here each sample
gets its reward (the trainer replaces it per token with GAE over the critic's values, rollwise.train.critic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rollwise.train.grpo import group_advantages
from rollwise.types.algorithms import ADVANTAGE_ESTIMATORS
from rollwise.types.sample import Sample, group_samples

WHITEN_EPS = 1e-8  # REINFORCE++'s variance floor (verl's masked_whiten)


@dataclass(frozen=True)
class RewardGroups:
    """The rewards of one train step, by group (prompt), and each sample's trained tokens."""

    rewards: list[Tensor]  # one float32 [n_g] per group
    tokens: list[Tensor]  # trained tokens of each sample, same shapes (REINFORCE++ weighs samples by them)

    @classmethod
    def of(cls, rewards: list[list[float]], tokens: list[list[int]] | None = None) -> RewardGroups:
        return cls([torch.tensor(r, dtype=torch.float32) for r in rewards],
                   [torch.tensor(t, dtype=torch.float32) for t in tokens] if tokens is not None
                   else [torch.ones(len(r)) for r in rewards])


Estimator = Callable[[RewardGroups], list[Tensor]]


def _group_normalised(groups: RewardGroups, mode: str) -> list[Tensor]:
    rewards = groups.rewards
    if rewards and all(len(r) == len(rewards[0]) for r in rewards) and len(rewards[0]) >= 2:
        # Equal group sizes (every single-turn step): the batched historical code, bit for bit.
        return list(group_advantages(torch.stack(rewards), mode))  # type: ignore[arg-type]
    return [group_advantages(r[None], mode)[0] if len(r) >= 2 else torch.zeros_like(r)  # type: ignore[arg-type]
            for r in rewards]


def grpo(groups: RewardGroups) -> list[Tensor]:
    return _group_normalised(groups, "mean_std")


def dr_grpo(groups: RewardGroups) -> list[Tensor]:
    return _group_normalised(groups, "mean")


def rloo(groups: RewardGroups) -> list[Tensor]:
    out = []
    for r in groups.rewards:
        n = len(r)
        if n < 2:
            out.append(torch.zeros_like(r))
            continue
        d = r - r[0]  # relative to one of them: equal rewards give exactly 0
        out.append(d - (d.sum() - d) / (n - 1))
    return out


def whiten_over_tokens(values: list[Tensor], tokens: list[Tensor]) -> list[Tensor]:
    """Each sample's value, whitened by the mean and unbiased variance over the batch's trained tokens."""
    if not values:
        return []
    flat, weight = torch.cat(values), torch.cat(tokens)
    n = float(weight.sum())
    if n == 0:
        return [torch.zeros_like(v) for v in values]
    d = flat - flat[0]  # relative to one value: a batch of equal values whitens to exactly 0
    mean = (d * weight).sum() / n
    var = ((d - mean) ** 2 * weight).sum() / max(n - 1.0, 1.0)
    whitened = (d - mean) * torch.rsqrt(var + WHITEN_EPS)
    return list(torch.split(whitened, [len(v) for v in values]))


def reinforce_pp(groups: RewardGroups) -> list[Tensor]:
    return whiten_over_tokens(list(groups.rewards), groups.tokens)


def gae_placeholder(groups: RewardGroups) -> list[Tensor]:
    """train.advantage=gae before the trainer's critic: the reward itself (a return with no baseline); the trainer
    replaces it per token (rollwise.train.token_advantages)."""
    return [r.clone() for r in groups.rewards]


def reinforce_pp_baseline(groups: RewardGroups) -> list[Tensor]:
    centred = []
    for r in groups.rewards:
        d = r - r[0]
        centred.append(d - d.mean())  # r - mean_group, exactly 0 for equal rewards (and a group of one)
    return whiten_over_tokens(centred, groups.tokens)


ESTIMATORS: dict[str, Estimator] = {
    "mean_std": grpo,
    "mean": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "gae": gae_placeholder,
}
assert tuple(ESTIMATORS) == ADVANTAGE_ESTIMATORS, "rollwise.types.algorithms lists the same names"


def estimate(name: str, groups: RewardGroups) -> list[Tensor]:
    """Advantages of every group's samples, by the estimator `name` (train.advantage)."""
    if name not in ESTIMATORS:
        raise ValueError(f"train.advantage={name!r}: unknown estimator; choose one of {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name](groups)


def zero_variance_fraction(groups: RewardGroups) -> float:
    """Groups that teach a group baseline nothing (one sample, or all rewards equal), as a fraction."""
    rewards = groups.rewards
    if rewards and all(len(r) == len(rewards[0]) for r in rewards) and len(rewards[0]) >= 2:
        return float((torch.stack(rewards).std(dim=1) == 0).float().mean())  # the historical arithmetic
    flat = [len(r) < 2 or float(r.std()) == 0.0 for r in rewards]
    return sum(flat) / max(len(flat), 1)


def assign_advantages(samples: list[Sample], name: str) -> float:
    """Advantages of scored samples by `name`, in place; returns the fraction of groups with zero reward
    variance (groups that teach a group baseline nothing)."""
    groups = list(group_samples(samples).values())
    rewards = RewardGroups.of([[s.reward for s in g] for g in groups], [[s.trained_tokens for s in g] for g in groups])
    for g, row in zip(groups, estimate(name, rewards)):
        for s, a in zip(g, row.tolist()):
            s.advantage = a
    return zero_variance_fraction(rewards)

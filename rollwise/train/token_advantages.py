"""Advantages the trainer computes per token: GAE over a critic's values (train.advantage=gae) and REINFORCE++'s
per-token KL in the reward (train.kl_penalty=reward). Only the trainer has the critic and the reference model,
so these are computed in the train step, set on each sample (Sample.token_advantages), and every micro-batch
layout reads them from there (rollwise.train.trainer.token_owners).

Per sample, over its trained tokens t = 0..T-1 (the response; multi-turn template tokens are not actions):

    reward     r_t = -kl_coef * KL_t + d_t, plus the sample's reward R on the last token (t = T-1)
    d_t        train.teacher's distillation reward (Sample.token_rewards): coefficient * (log p_teacher(y_t) -
               log pi(y_t)), minus the per-token reverse-KL estimate; with train.teacher.mode=replace R is 0
               (the distillation reward alone), with mode=add R is the task's
    KL_t       the estimate of KL(pi || ref) at the sampled token, pi the sampling policy's log-prob
               (the engine's, the behaviour log-prob every sample carries), ref the frozen initial policy's:
               k1 = log(pi/ref), k2 = log(pi/ref)^2 / 2, k3 = ref/pi - 1 - log(ref/pi) (Schulman's estimators)
    REINFORCE++  A_t = sum_{s >= t} r_s (undiscounted return), then whitened over all the batch's trained tokens
                 (reinforce_pp_baseline: R minus its group's mean first), as OpenRLHF's REINFORCE++
    GAE        delta_t = r_t + gamma V_{t+1} - V_t (V_T = 0: the response ends there),
               A_t = delta_t + gamma lam A_{t+1}, the critic's target G_t = A_t + V_t;
               A whitened over the batch's tokens when train.gae.whiten (PPO implementations do)

A sample with no trained tokens gets none (and teaches nothing); a group of one needs no group here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rollwise.types.train_config import TrainConfig
from rollwise.train.advantages import whiten_over_tokens
from rollwise.train.critic import target_metrics
from rollwise.types.sample import Sample, group_samples

KL_REWARD = "kl_reward"  # metric: mean per-token KL estimate folded into the reward


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || ref) from log pi and log ref of the sampled tokens."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"train.kl_estimator={estimator!r}: choose k1, k2 or k3")


def token_rewards(reward: float, n_tokens: int, kl: Tensor | None = None, kl_coef: float = 0.0,
                  per_token: Sequence[float] | None = None) -> Tensor:
    """r_t: -kl_coef * kl_t (+ per_token[t], train.teacher's) on every token, the sample's reward added on the last."""
    rewards = -kl_coef * kl.float() if kl is not None else torch.zeros(n_tokens)
    if per_token is not None:
        if len(per_token) != n_tokens:
            raise ValueError(f"token_rewards: {len(per_token)} per-token rewards for {n_tokens} trained tokens")
        rewards = rewards + torch.tensor(list(per_token), dtype=torch.float32)
    if n_tokens:
        rewards = rewards.clone()
        rewards[-1] += reward
    return rewards


def returns_to_go(rewards: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = sum_{s >= t} gamma^(s-t) r_s."""
    out = torch.empty_like(rewards)
    running = torch.zeros((), dtype=rewards.dtype)
    for t in range(rewards.shape[0] - 1, -1, -1):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def gae(rewards: Tensor, values: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """(advantages, returns) of one sequence: GAE(gamma, lam) with V after the last token 0."""
    advantages = torch.empty_like(rewards)
    running = torch.zeros((), dtype=rewards.dtype)
    next_value = torch.zeros((), dtype=rewards.dtype)
    for t in range(rewards.shape[0] - 1, -1, -1):
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
        next_value = values[t]
    return advantages, advantages + values


def sequence_rewards(samples: list[Sample], advantage: str) -> list[float]:
    """The reward each sample's last token gets: its reward, or (reinforce_pp_baseline) minus its group's mean."""
    if advantage != "reinforce_pp_baseline":
        return [s.reward for s in samples]
    mean = {g: sum(s.reward for s in members) / len(members) for g, members in group_samples(samples).items()}
    return [s.reward - mean[s.group_id] for s in samples]


@dataclass
class TokenAdvantages:
    """One step's per-token advantages, per sample; with GAE also the critic's targets and old values."""

    advantages: list[Tensor]
    returns: list[Tensor] | None = None
    values: list[Tensor] | None = None


def rewards_of(samples: list[Sample], cfg: TrainConfig, kl: list[Tensor] | None) -> list[Tensor]:
    """Each sample's per-token rewards r_t (see the module doc; `kl` per sample, or None)."""
    replace_task = cfg.teacher is not None and cfg.teacher.mode == "replace"  # the distillation reward alone
    base = [0.0] * len(samples) if replace_task else sequence_rewards(samples, cfg.advantage)
    return [token_rewards(r, s.trained_tokens, None if kl is None else kl[i], cfg.kl_coef, s.token_rewards)
            for i, (s, r) in enumerate(zip(samples, base))]


def gae_returns(samples: list[Sample], cfg: TrainConfig, kl: list[Tensor] | None, values: Tensor) -> Tensor:
    """The critic's GAE targets G_t of `samples` (train.advantage=gae), flattened as `values` (their trained
    tokens, sample after sample): per sample, so one micro-batch's need only its own values (the critic's one
    forward a step, rollwise.train.critic.Critic.values_and_update); equal to compute_token_advantages' returns."""
    per_sample = torch.split(values.float(), [s.trained_tokens for s in samples])
    pairs = [gae(r, v, cfg.gae.gamma, cfg.gae.lam) for r, v in zip(rewards_of(samples, cfg, kl), per_sample)]
    return torch.cat([g for _, g in pairs]) if pairs else torch.zeros(0)


def compute_token_advantages(samples: list[Sample], cfg: TrainConfig, *, kl: list[Tensor] | None = None,
                             values: list[Tensor] | None = None) -> TokenAdvantages:
    """Per-token advantages of `samples` by train.advantage (gae needs `values`, the critic's per trained token;
    `kl`: the per-token KL estimates to fold into the reward, or None)."""
    rewards = rewards_of(samples, cfg, kl)
    ones = [torch.ones_like(r) for r in rewards]
    if cfg.advantage == "gae":
        if values is None:
            raise ValueError("train.advantage=gae needs the critic's values")
        pairs = [gae(r, v.float(), cfg.gae.gamma, cfg.gae.lam) for r, v in zip(rewards, values)]
        advantages = [a for a, _ in pairs]
        if cfg.gae.whiten:
            advantages = whiten_over_tokens(advantages, ones)
        return TokenAdvantages(advantages, [g for _, g in pairs], [v.float() for v in values])
    return TokenAdvantages(whiten_over_tokens([returns_to_go(r) for r in rewards], ones))


def set_token_advantages(samples: list[Sample], advantages: list[Tensor]) -> None:
    """Each sample's per-token advantages, where every micro-batch layout reads them."""
    for s, a in zip(samples, advantages):
        s.token_advantages = a.tolist()


def split_per_sample(per_batch: list[Tensor] | None, counts: list[int]) -> list[Tensor] | None:
    """Per-micro-batch tensors over trained tokens (samples in order) as one tensor per sample (`counts` tokens)."""
    return None if per_batch is None else list(torch.split(torch.cat(per_batch), counts))


def plan_token_advantages(samples: list[Sample], cfg: TrainConfig, kl: list[Tensor] | None,
                          values: list[Tensor] | None) -> tuple[TokenAdvantages, dict[str, float]]:
    """The step's per-token advantages over the whole batch, set on each sample, and their metrics (the KL folded
    into the reward; the critic's values against its returns). `kl` and `values`: per sample, from the trainer's
    forwards (None: not used). The one-process trainer and the sharded trainer's controller (from its ranks'
    forwards: rollwise.train.sharded_token_advantages) both call this, so both whiten over the same tokens."""
    plan = compute_token_advantages(samples, cfg, kl=kl, values=values)
    set_token_advantages(samples, plan.advantages)
    metrics: dict[str, float] = {}
    if kl is not None:
        flat = torch.cat(kl) if kl else torch.zeros(0)
        metrics[KL_REWARD] = float(flat.mean()) if flat.numel() else 0.0
    if plan.values is not None and plan.returns is not None:
        metrics.update(target_metrics(plan.values, plan.returns))
    return plan, metrics

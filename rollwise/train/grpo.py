"""GRPO: group-relative advantages and the token-level clipped surrogate (DAPO-style clip bounds).

Pure functions on tensors (plus writing advantages onto Samples), each tested against hand-computed values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rollwise.types.sample import Sample, group_samples


def group_advantages(rewards: Tensor, mode: Literal["mean_std", "mean"] = "mean_std", eps: float = 1e-6) -> Tensor:
    """rewards [groups, group_size] -> advantages of the same shape.

    mean_std: (r - mean) / (std + eps), the GRPO paper's normalisation (unbiased std, as verl/TRL).
    mean:     r - mean, Dr. GRPO's choice (no per-group rescaling, so easy groups don't shout).
    A group whose rewards are all equal gets advantage 0 in both modes: it teaches nothing.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [groups, group_size >= 2], got {tuple(rewards.shape)}")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if mode == "mean":
        return centered
    if mode == "mean_std":
        return centered / (rewards.std(dim=1, keepdim=True) + eps)
    raise ValueError(f"advantage mode must be 'mean_std' or 'mean', got {mode!r}")


def assign_advantages(samples: list[Sample], mode: Literal["mean_std", "mean"]) -> float:
    """Group-relative advantages of scored samples, in place; returns the fraction of groups with
    zero reward variance (groups that teach nothing)."""
    groups = list(group_samples(samples).values())
    rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32)
    adv = group_advantages(rewards, mode)
    for g, row in zip(groups, adv):
        for s, a in zip(g, row.tolist()):
            s.advantage = a
    return float((rewards.std(dim=1) == 0).float().mean())


@dataclass
class LossTerms:
    loss: Tensor  # scalar to backpropagate (already divided by the batch's normaliser)
    clipped_tokens: Tensor  # count of tokens where the clip was active
    kl_sum: Tensor  # sum of k3 KL over tokens (0 when no reference)


OffPolicyCorrection = Literal["none", "decoupled", "tis"]


def off_policy_weights(
    proximal_logp: Tensor, behaviour_logp: Tensor, mode: OffPolicyCorrection, cap: float | None = None
) -> Tensor:
    """Per-token importance weights pi_prox / pi_behav for tokens an older (or numerically different)
    policy sampled. No gradient flows through them.

    decoupled: AReaL's decoupled PPO weight, exact (optionally capped at `cap`).
    tis:       truncated importance sampling (Yao et al. 2025): min(weight, cap), cap required.
    none:      all ones (the on-policy spine).
    """
    if mode == "none":
        return torch.ones_like(behaviour_logp)
    weight = torch.exp((proximal_logp - behaviour_logp).detach())
    if mode == "tis":
        if cap is None:
            raise ValueError("tis needs a cap (train.is_cap)")
        return weight.clamp(max=cap)
    if mode == "decoupled":
        return weight if cap is None else weight.clamp(max=cap)
    raise ValueError(f"off-policy correction must be 'none', 'decoupled' or 'tis', got {mode!r}")


def clipped_surrogate_loss(
    logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    token_weights: Tensor,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    proximal_logp: Tensor | None = None,
    is_weights: Tensor | None = None,
) -> LossTerms:
    """Token-level PPO-clip loss over flattened trained tokens.

    logp            [N] trainer log-probs (with grad)
    behaviour_logp  [N] log-probs of the policy that sampled each token (the engine's)
    advantages      [N] the sequence advantage broadcast to its tokens
    token_weights   [N] how much each token counts in the batch mean, e.g. 1 / (trained tokens in the
                    whole batch) for token_mean. Passing weights rather than dividing per micro-batch
                    keeps gradient accumulation exactly equal to one big batch.
    proximal_logp   [N] optional: the trainer's own log-probs before this update (no grad). With it,
                    the clip is taken around the proximal policy instead of the behaviour policy
                    (decoupled PPO), and `is_weights` (pi_prox / pi_behav, see off_policy_weights)
                    carry the off-policy correction. Without it: the ratio is against the behaviour
                    policy, the on-policy GRPO of the spine.
    """
    old_logp = behaviour_logp if proximal_logp is None else proximal_logp.detach()
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    kl_sum = torch.zeros((), dtype=logp.dtype)
    if ref_logp is not None and kl_coef > 0:
        # k3 estimator of KL(pi || ref): unbiased, always >= 0, low variance (Schulman 2020).
        log_ratio_ref = ref_logp - logp
        kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1.0
        per_token = per_token + kl_coef * kl
        kl_sum = kl.detach().sum()
    loss = (per_token * token_weights).sum()
    clipped_tokens = (clipped < unclipped).sum()
    return LossTerms(loss=loss, clipped_tokens=clipped_tokens, kl_sum=kl_sum)


def token_weights(response_lengths: list[int], agg: Literal["token_mean", "seq_mean_token_mean"]) -> Tensor:
    """Per-token weights [sum(lengths)] that turn a weighted sum into the batch loss.

    token_mean:           every trained token in the batch counts equally (DAPO); long answers
                          are not down-weighted per token.
    seq_mean_token_mean:  mean over tokens within a sequence, then over sequences (original GRPO).
    """
    total = sum(response_lengths)
    if total == 0:
        raise ValueError("batch has no trained tokens")
    if agg == "token_mean":
        return torch.full((total,), 1.0 / total)
    if agg == "seq_mean_token_mean":
        n = len(response_lengths)
        return torch.cat([torch.full((length,), 1.0 / (length * n)) for length in response_lengths if length > 0])
    raise ValueError(f"loss_agg must be 'token_mean' or 'seq_mean_token_mean', got {agg!r}")

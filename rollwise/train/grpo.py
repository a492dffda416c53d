"""GRPO: group-relative advantages, the batch loss weights, and the token-level clipped surrogate
(DAPO-style clip bounds) for callers with plain tensors.

Pure functions on tensors, each tested against hand-computed values. The estimators, policy losses and
corrections a run chooses by name live in rollwise.train.advantages, .policy_loss and .corrections.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from rollwise.train.corrections import correction
from rollwise.train.policy_loss import ClipSettings, LossTerms, PolicyLoss, PolicyLossInputs, ppo_clip


def group_advantages(rewards: Tensor, mode: Literal["mean_std", "mean"] = "mean_std", eps: float = 1e-6) -> Tensor:
    """rewards [groups, group_size] -> advantages of the same shape.

    mean_std: (r - mean) / (std + eps), the GRPO paper's normalisation (unbiased std, as verl/TRL).
    mean:     r - mean, Dr. GRPO's choice (no per-group rescaling, so easy groups don't shout).
    A group whose rewards are all equal gets advantage 0 in both modes (it teaches nothing) when float32
    computes their mean exactly; it does not always (16 rewards of 0.1 give |advantages| ~ 0.007).
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [groups, group_size >= 2], got {tuple(rewards.shape)}")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if mode == "mean":
        return centered
    if mode == "mean_std":
        return centered / (rewards.std(dim=1, keepdim=True) + eps)
    raise ValueError(f"advantage mode must be 'mean_std' or 'mean', got {mode!r}")


OffPolicyCorrection = Literal["none", "decoupled", "tis", "mis", "icepop"]


def off_policy_weights(
    proximal_logp: Tensor, behaviour_logp: Tensor, mode: OffPolicyCorrection, cap: float | None = None
) -> Tensor:
    """Per-token importance weights pi_prox / pi_behav of a token-level correction (no gradient):
    rollwise.train.corrections.correction's weights (decoupled: capped at `cap` if given; tis: min(w, cap))."""
    return correction(proximal_logp, behaviour_logp, mode, cap=cap).weights


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
    """Token-level PPO-clip loss over flattened trained tokens (train.policy_loss=ppo_clip, the trainer's
    default: rollwise.train.policy_loss), for callers holding plain tensors.

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
    n = logp.shape[0]
    batch = PolicyLossInputs(
        logp=logp, behaviour_logp=behaviour_logp,
        old_logp=behaviour_logp if proximal_logp is None else proximal_logp.detach(), advantages=advantages,
        token_weights=token_weights, is_weights=torch.ones_like(logp) if is_weights is None else is_weights,
        kept=torch.ones(n, dtype=torch.bool, device=logp.device), seq_index=torch.zeros(n, dtype=torch.long,
        device=logp.device), num_seqs=1, versions=torch.zeros(n, dtype=torch.long, device=logp.device),
        policy_version=0)
    loss = PolicyLoss("ppo_clip", ClipSettings(clip_low, clip_high), builtin=ppo_clip)
    return loss.terms(batch, corrected=is_weights is not None, masked=False, ref_logp=ref_logp, kl_coef=kl_coef)


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

"""A custom policy loss for rollwise: `rollwise train train.policy_loss=examples.custom_loss:clipped_token_loss`
(run from the repository root; `train.policy_loss=path/to/file.py:function` works from anywhere).

The trainer calls the function once per micro-batch with a `PolicyLossInputs` (rollwise.train.policy_loss):
the micro-batch's trained tokens flattened sample after sample, each field a tensor of shape [N]:

    logp            log-probs of the policy being trained, now (the only field with a gradient)
    behaviour_logp  log-probs at sampling (the engine's)
    old_logp        the ratio's denominator: the proximal policy (train.off_policy_correction on) or behaviour_logp
    advantages      each sample's advantage (train.advantage) on its tokens
    token_weights   each token's share of the whole batch's loss (train.loss_agg)
    is_weights      the off-policy correction's weight per token (1 without one, 0 where mis/icepop masked it)
    kept            False where the correction masked a token out
    seq_index       each token's sample within the micro-batch (num_seqs samples); versions: the policy version
                    that sampled each token; policy_version: the trainer's version now
and helpers: seq_sum / seq_mean (per sample), per_token (a per-sample value on its tokens), batch_loss.

It returns a scalar tensor: this micro-batch's share of the batch loss. Weigh per-token terms with
`batch.token_weights` (`batch.batch_loss(per_token)`): the trainer sums the micro-batches' losses before one
optimizer step, so the sum must be the batch's loss. The KL to the reference (train.kl_coef) is added for you.
Every sample reaches a custom loss, those with advantage 0 too (built-in losses skip them: they add nothing).
Before any step the function is imported and called on a small dummy batch: a bad path, an exception, a
non-scalar, a NaN or a loss that does not depend on `batch.logp` stops the run with an error naming
train.policy_loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollwise.train.policy_loss import PolicyLossInputs


def clipped_token_loss(batch: PolicyLossInputs) -> Tensor:
    """PPO's clipped surrogate with a symmetric 0.2 clip, the off-policy correction applied, and samples of
    older policy versions down-weighted by half a step of staleness each: an example, not a recommendation."""
    ratio = torch.exp(batch.logp - batch.old_logp)
    surrogate = torch.minimum(ratio * batch.advantages, ratio.clamp(0.8, 1.2) * batch.advantages)
    staleness = (batch.policy_version - batch.versions).clamp(min=0).to(ratio.dtype)
    per_token = -surrogate * batch.is_weights / (1.0 + 0.5 * staleness)
    return batch.batch_loss(torch.where(batch.kept, per_token, torch.zeros_like(per_token)))

"""On-policy distillation's reward (`train.teacher`): the student samples, a teacher engine scores the same token
ids (rollwise.control.teacher), and each sampled token's log-ratio is that token's reward.

For a response y sampled by the student S, each sampled token t gives

    d_t = coefficient * (log p_T(y_t | y_<t) - log p_S(y_t | y_<t))

minus the single-sample estimate of the per-token reverse KL(S || T). d_t is token t's reward (Sample.token_rewards),
trained through the per-token advantage path (rollwise.train.token_advantages: REINFORCE++'s returns-to-go, or GAE
with a critic); with train.teacher.mode=add the task's reward also lands on the last token. The expected return
from token t is minus the reverse KL of the rest of the response, so the policy gradient moves the student
toward the teacher on its own samples, token by token.

log p_S is the engine's log-prob of the token as sampled (the behaviour log-prob every sample carries, at the
rollout temperature); the teacher scores at the same temperature, so a teacher equal to the student gives 0 up to
the two engines' float round-off.
"""

from __future__ import annotations

from torch import Tensor

from rollwise.types.sample import Sample

REVERSE_KL = "distill/reverse_kl"  # mean over the batch's sampled tokens of log p_S - log p_T
REWARD_MEAN = "distill/reward_mean"  # mean over samples of the sum of their tokens' distillation rewards
TASK_REWARD_MEAN = "distill/task_reward_mean"  # the task's reward, mean over samples (trained on with mode=add)


def set_distill_rewards(samples: list[Sample], teacher_logprobs: list[Tensor], coefficient: float) -> dict[str, float]:
    """Each sample's per-token distillation rewards (Sample.token_rewards) from the teacher's log-probs of its
    trained tokens (one fp32 tensor per sample); returns the step's distillation metrics."""
    kl_sum, n_tokens, totals = 0.0, 0, []
    for s, t_logp in zip(samples, teacher_logprobs):
        s_logp = Tensor([lp for lp, m in zip(s.behaviour_logprobs, s.trained_mask) if m])
        log_ratio = t_logp.float() - s_logp  # per token: minus the reverse-KL estimate
        s.token_rewards = (coefficient * log_ratio).tolist()
        kl_sum -= float(log_ratio.sum())
        n_tokens += log_ratio.numel()
        totals.append(coefficient * float(log_ratio.sum()))
    n = max(len(samples), 1)
    return {REVERSE_KL: kl_sum / max(n_tokens, 1), REWARD_MEAN: sum(totals) / n,
            TASK_REWARD_MEAN: sum(s.reward for s in samples) / n}

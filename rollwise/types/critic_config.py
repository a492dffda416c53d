"""The `train.gae:` section (PPO with a learned critic, train.advantage=gae) and the checks of the settings whose
advantages the trainer computes per token (gae, and the KL folded into the reward: train.kl_penalty=reward).

Here, beside the other sections that live outside rollwise.config, so config.py stays one page of sections and
the trainer's code reads its settings without importing config.
"""

from __future__ import annotations

from pydantic import Field

from rollwise.types.algorithms import TOKEN_REWARD_ESTIMATORS
from rollwise.types.config_section import ConfigSection


class GaeConfig(ConfigSection):
    """GAE(gamma, lambda) over the response tokens, the reward on the last one, with values from a critic: a
    copy of the policy's decoder with a scalar value head, trained in the same step by its own optimizer
    (rollwise.train.critic), saved and resumed with the policy's checkpoint."""

    gamma: float = Field(1.0, ge=0, le=1, description="discount per token (1: the reward counts fully at every token)")
    lam: float = Field(0.95, ge=0, le=1, description="GAE's lambda: 0 one-step TD (leans on the critic), 1 Monte "
                       "Carlo returns minus the value (unbiased, noisier)")
    critic_lr: float = Field(1e-5, gt=0, description="the critic's AdamW learning rate, constant (betas, "
                             "weight decay and grad clip are train:'s)")
    value_clip: float | None = Field(0.2, gt=0, description="PPO value clipping: a new value moves at most this far "
                                     "from the one the advantages were computed with (max of the clipped and "
                                     "unclipped squared errors); null: no clipping")
    whiten: bool = Field(True, description="normalise the advantages over the batch's trained tokens (mean 0, "
                         "variance 1), as PPO implementations do")
    critic_trainable_layers: int | None = Field(
        None, ge=1, description="the critic trains only its top k decoder layers, the final norm and the value head "
        "(the embedding and the layers below stay at the policy's initial weights and cost a forward only, as trlx's "
        "num_layers_unfrozen); null: every layer trains. At most the model's layer count (checked when the critic "
        "is built, before any step)")


def token_advantage_reason(advantage: str, kl_penalty: str, kl_coef: float, teacher: bool = False) -> str | None:
    """Why the trainer computes this run's advantages per token (None: it does not): GAE needs the critic's
    values, a KL in the reward needs the reference's log-probs, both only the trainer has; train.teacher's
    distillation reward is per token (Sample.token_rewards)."""
    if advantage == "gae":
        return "train.advantage=gae"
    if kl_penalty == "reward" and kl_coef > 0:
        return "train.kl_penalty=reward"
    if teacher:
        return "train.teacher"
    return None


def check_teacher(advantage: str) -> None:
    """train.teacher's per-token reward needs an estimator that takes per-token rewards: a ValueError naming the
    fields otherwise (as train.kl_penalty=reward)."""
    if advantage not in TOKEN_REWARD_ESTIMATORS:
        raise ValueError(f"train.teacher gives a reward on every token (the per-token reverse KL), which "
                         f"train.advantage={advantage!r} (one reward per sample, group-relative) cannot take: set "
                         f"train.advantage to one of {', '.join(TOKEN_REWARD_ESTIMATORS)}")


def check_critic_layers(advantage: str, gae: GaeConfig) -> None:
    """train.gae.critic_trainable_layers sizes the critic, which only train.advantage=gae has: a ValueError naming
    the field otherwise (the other train.gae fields have defaults and are simply unused; this one, set, asks for
    a cheaper critic that would not exist)."""
    if gae.critic_trainable_layers is not None and advantage != "gae":
        raise ValueError(f"train.gae.critic_trainable_layers={gae.critic_trainable_layers} sizes the critic of "
                         f"train.advantage=gae, which train.advantage={advantage!r} has none of: unset "
                         "train.gae.critic_trainable_layers, or set train.advantage=gae")


def check_kl_penalty(advantage: str, kl_penalty: str) -> str:
    """train.kl_penalty resolved (auto: reward for reinforce_pp, loss otherwise); a ValueError naming the field
    when the KL cannot go into this estimator's reward."""
    if kl_penalty == "auto":
        return "reward" if advantage == "reinforce_pp" else "loss"
    if kl_penalty == "reward" and advantage not in TOKEN_REWARD_ESTIMATORS:
        raise ValueError(f"train.kl_penalty=reward folds a per-token KL into the reward, which "
                         f"train.advantage={advantage!r} (one reward per sample, group-relative) cannot take: use "
                         f"train.kl_penalty=loss, or train.advantage one of {', '.join(TOKEN_REWARD_ESTIMATORS)}")
    return kl_penalty


def check_token_advantage_placement(reason: str | None, agent: bool) -> None:
    """The settings whose advantages the trainer computes per token run on every trainer (one process, sharded,
    torchrun, Ray ranks: rollwise.train.sharded_token_advantages), single-turn for now: a ValueError naming the
    field otherwise."""
    if reason is not None and agent:
        raise ValueError(f"{reason} is single-turn for now (an agent episode split into segments would get its "
                         "reward at each segment's end): unset agent:, or choose another train.advantage "
                         "(train.kl_penalty=loss keeps the KL as a loss term)")

"""The names of the RL algorithm pieces a run chooses (`train.advantage`, `train.policy_loss`,
`train.off_policy_correction`), and the check of a chosen name with a did-you-mean hint.

Here, in the types layer, because both sides need the one list: the config refuses an unknown name
before anything loads (rollwise.config), and the trainer's registries (rollwise.train.advantages,
.policy_loss, .corrections) hold one function per name (a test checks the two agree). Pure: no torch.
"""

from __future__ import annotations

import difflib

# train.advantage: mean_std (GRPO) and mean (Dr. GRPO) are the historical names of the group baselines.
# gae: PPO with a learned critic; its advantages are per token and computed by the trainer (rollwise.train.critic).
ADVANTAGE_ESTIMATORS = ("mean_std", "mean", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
# The estimators whose rewards may be per token: train.kl_penalty=reward folds the per-token KL to the reference
# into their reward (rollwise.train.token_advantages); the group baselines see one reward per sample.
TOKEN_REWARD_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae")
# train.kl_penalty: where the KL to the reference goes (auto: the reward for reinforce_pp, as REINFORCE++ does,
# the loss otherwise); train.kl_estimator: the per-token estimate folded into the reward.
KL_PENALTIES = ("auto", "loss", "reward")
KL_ESTIMATORS = ("k1", "k2", "k3")
# train.policy_loss: these, or a custom loss given as "module:function" (or "path/to/file.py:function").
POLICY_LOSSES = ("ppo_clip", "dual_clip", "gspo", "cispo")
# train.off_policy_correction (auto resolves to none or tis from rollout.mode, see rollwise.config).
OFF_POLICY_CORRECTIONS = ("auto", "none", "decoupled", "tis", "mis", "icepop")
# train.mis_level: token (rho_t masked), sequence (the product rho(y) masked), seq_mask_tis (token rho_t,
# whole sequences masked by their geometric-mean rho).
MIS_LEVELS = ("token", "sequence", "seq_mask_tis")

# Names other frameworks use for the same choice, for the hint.
OTHER_NAMES = {
    "grpo": "mean_std", "dr_grpo": "mean", "drgrpo": "mean", "reinforce++": "reinforce_pp",
    "reinforce_plus_plus": "reinforce_pp", "reinforce++_baseline": "reinforce_pp_baseline",
    "reinforce_plus_plus_baseline": "reinforce_pp_baseline", "ppo": "ppo_clip", "vanilla": "ppo_clip",
    "dapo": "ppo_clip", "seq-mask-tis": "seq_mask_tis", "geometric": "seq_mask_tis",
    "ice_pop": "icepop", "ice-pop": "icepop", "ppo_gae": "gae", "critic": "gae", "kl_loss": "loss",
    "in_reward": "reward", "low_var_kl": "k3", "kl": "k1",
}


def did_you_mean(value: str, allowed: tuple[str, ...]) -> str:
    """' Did you mean X?' for the closest allowed name (or another framework's name for it), else ''."""
    if OTHER_NAMES.get(value.lower()) in allowed:
        return f" Did you mean {OTHER_NAMES[value.lower()]!r}?"
    close = difflib.get_close_matches(value, allowed, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def check_choice(value: object, allowed: tuple[str, ...], what: str) -> object:
    """`value` when it is one of `allowed`; a ValueError naming the choices and the closest one otherwise.
    (The config names the field in front of the message.)"""
    if isinstance(value, str) and value not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"unknown {what} {value!r}; choose one of {choices}.{did_you_mean(value, allowed)}")
    return value


def is_custom_loss(name: str) -> bool:
    """A custom policy loss is written "module:function" (a built-in name has no colon)."""
    return ":" in name


def check_policy_loss_name(value: object) -> object:
    """A built-in loss name, or the *form* "module:function" of a custom one (whether it imports, and returns
    a finite scalar, is checked when the trainer is built: rollwise.train.policy_loss.resolve_policy_loss)."""
    if not isinstance(value, str):
        return value  # the str annotation refuses it, with the type named
    if is_custom_loss(value):
        module, _, function = value.rpartition(":")
        if not module.strip() or not function.isidentifier():
            raise ValueError(f"custom loss {value!r} must be written module:function (e.g. "
                             "examples.custom_loss:clipped_token_loss), with a Python name after the colon")
        return value
    return check_choice(value, POLICY_LOSSES, "policy loss (or module:function of a custom one)")

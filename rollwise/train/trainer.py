"""The GRPO trainer: micro-batched forward/backward on exact engine tokens, AdamW, clipping.

It owns the Hugging Face model and the optimizer and knows nothing about engines or tasks: it is
handed samples with advantages and returns metrics. Pushing the new weights out is `rollwise.sync`
(`weights()` hands them over as zero-copy views). It implements rollwise.types.contracts.Trainer.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from functools import partial
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rollwise.types.train_config import TrainConfig
from rollwise.model.precision import resolve_dtype
from rollwise.types.microbatch import chunk_samples, prompt_groups
from rollwise.types.sample import Sample
import rollwise.train.checkpoint as checkpoint
from rollwise.train.corrections import MASKING
from rollwise.train.corrections import correction as correction_of
from rollwise.train.grpo import token_weights
from rollwise.train.lora import adapter_state, wrap_lora
from rollwise.train.packing import GroupMicroBatch, collate_group, collate_packed_groups
from rollwise.train.policy_loss import PolicyLossInputs, resolve_policy_loss
from rollwise.train.logprobs import LogprobOptions, sequence_hidden, sequence_logprobs
from rollwise.train.activation_checkpointing import autocast_cache_enabled, enable_activation_checkpointing
from rollwise.train.routing_replay import ReplayBatch, RoutingReplay, find_routers, rows_batch
from rollwise.train.step_batches import token_advantages_of, with_token_advantages
from rollwise.train.critic import Critic
from rollwise.train.token_advantages import TokenAdvantages, plan_token_advantages
from rollwise.train.token_forwards import TokenForwards, in_order, keep_linears_in, per_batch
from rollwise.types.critic_config import token_advantage_reason


@dataclass
class MicroBatch:
    """Samples packed as right-padded prompt + response rows."""

    input_ids: Tensor  # [B, T] right-padded prompt + response
    attention_mask: Tensor  # [B, T]
    target_mask: Tensor  # [B, T] True on response tokens (the loss mask)
    behaviour_logp: Tensor  # [N] flattened over target positions, row-major
    advantages: Tensor  # [N]
    weights: Tensor  # [N] share of each token in the batch loss
    # A sharded trainer's filler: every rank must run as many forwards as the others (FSDP's
    # collectives), so a rank with fewer micro-batches repeats one with zero weights, uncounted.
    padding: bool = False
    routing: ReplayBatch | None = None  # the engine's MoE routing, for replay (R3) and disagreement metrics
    # Each trained token's sample within the micro-batch (0..num_seqs-1) and the policy version that sampled
    # it: sequence-level losses and corrections, and custom losses (rollwise.train.policy_loss), read them.
    seq_index: Tensor | None = None
    versions: Tensor | None = None
    num_seqs: int = 0

    def logprobs(self, model: nn.Module, options: LogprobOptions) -> tuple[Tensor, Tensor]:
        return sequence_logprobs(model, self.input_ids, self.attention_mask, self.target_mask, options)

    def hidden(self, backbone: nn.Module) -> tuple[Tensor, Tensor]:
        """(hidden states that predict the trained tokens, those tokens), as GroupMicroBatch.hidden."""
        return sequence_hidden(backbone, self.input_ids, self.attention_mask, self.target_mask)

    @property
    def n_tokens(self) -> int:
        return int(self.target_mask.sum())


def to_device(mb: MicroBatch | GroupMicroBatch, device: torch.device) -> MicroBatch | GroupMicroBatch:
    """The micro-batch's tensors on `device` (itself when they are there already)."""
    if mb.weights.device == device:
        return mb
    moved = {f.name: getattr(mb, f.name).to(device) for f in fields(mb) if isinstance(getattr(mb, f.name), Tensor)}
    return replace(mb, **moved)


def collate(samples: list[Sample], weights: Tensor, pad_id: int) -> MicroBatch:
    """Pack samples as prompt_ids + response_ids; only response tokens carry loss (mask 1), and of a
    multi-turn sample only those the engine sampled (its loss_mask), not template/tool tokens."""
    length = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    input_ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), length), dtype=torch.long)
    target_mask = torch.zeros((len(samples), length), dtype=torch.bool)
    behaviour, advantages = [], []
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[row, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        attention_mask[row, : p + r] = 1
        target_mask[row, p : p + r] = torch.tensor(s.trained_mask, dtype=torch.bool)
        behaviour.extend(lp for lp, m in zip(s.behaviour_logprobs, s.trained_mask) if m)
        advantages.extend([s.advantage] * s.trained_tokens)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        target_mask=target_mask,
        behaviour_logp=torch.tensor(behaviour, dtype=torch.float32),
        advantages=torch.tensor(advantages, dtype=torch.float32),
        weights=weights,
        routing=rows_batch(samples, length),
    )


def token_owners(chunk: list[Sample]) -> dict[str, Any]:
    """Each trained token's sample (its index in `chunk`) and the policy version that sampled it, flattened in
    the order every collate flattens trained tokens (sample after sample)."""
    counts = torch.tensor([s.trained_tokens for s in chunk], dtype=torch.long)
    versions = [v for s in chunk for v, m in zip(s.versions, s.trained_mask) if m]
    owners = {"seq_index": torch.repeat_interleave(torch.arange(len(chunk)), counts),
              "versions": torch.tensor(versions, dtype=torch.long), "num_seqs": len(chunk)}
    advantages = token_advantages_of(chunk)  # per-token advantages already set (rollwise.train.token_advantages)
    if advantages is not None:
        owners["advantages"] = advantages
    return owners


def mismatch_sums(engine_logp: Tensor, trainer_logp: Tensor) -> tuple[float, float]:
    """Train-inference mismatch on the same tokens (DESIGN.md): sums of |log p_engine - log p_trainer|
    and of the k3 estimate of KL(engine || trainer); callers divide by their token count."""
    delta = engine_logp - trainer_logp
    return float(delta.abs().sum()), float((torch.exp(-delta) + delta - 1.0).sum())


def lr_factor(cfg: TrainConfig, update: int) -> float:
    """Multiplier of cfg.lr at optimizer update `update` (0-based): linear warmup, then the schedule.
    Decay runs over cfg.steps * cfg.updates_per_step updates and ends at cfg.min_lr_ratio."""
    if update < cfg.warmup_steps:
        return (update + 1) / cfg.warmup_steps
    total = max(cfg.steps * cfg.updates_per_step - cfg.warmup_steps - 1, 1)
    progress = min((update - cfg.warmup_steps) / total, 1.0)
    if cfg.lr_schedule == "cosine":
        decay = 0.5 * (1 + math.cos(math.pi * progress))
    elif cfg.lr_schedule == "linear":
        decay = 1 - progress
    else:
        return 1.0
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay


@dataclass
class PendingCritic:
    """The critic's update still to run after the policy's (train.updates_per_step > 1): the micro-batches its
    values came from, their chunks, and the samples in the order of the step's plan."""

    batches: list[MicroBatch | GroupMicroBatch]
    chunks: list[list[Sample]]
    samples: list[Sample]


class GRPOTrainer:
    def __init__(self, model: nn.Module, cfg: TrainConfig, *, pad_token_id: int, temperature: float = 1.0,
                 tokenizer: Any = None):
        # train.lora: PEFT adapters on a copy of `model` (rollwise.train.lora); only they are trainable,
        # weights() hands out only them, and a checkpoint holds only them.
        self.lora = cfg.lora
        # train.advantage=gae: the critic, a copy of the (base) policy's decoder with a value head (rollwise.train.critic)
        self.critic = Critic(model, cfg, prepare=self._prepare_critic) if cfg.advantage == "gae" else None
        # gae, or the KL in the reward: the advantages are computed per token in the step (_token_advantages)
        self.token_advantages = token_advantage_reason(cfg.advantage, cfg.kl_penalty, cfg.kl_coef,
                                                       cfg.teacher is not None) is not None
        self.loss_kl_coef = cfg.kl_coef if cfg.kl_penalty != "reward" else 0.0  # the KL is in the loss, or not
        if cfg.lora is not None:
            model = wrap_lora(model, cfg.lora)
        self.model = model
        self.tokenizer = tokenizer  # saved with each checkpoint (a checkpoint's model/ loads on its own)
        self.cfg = cfg
        # train.policy_loss: a built-in, or a custom function imported and tried on a dummy batch here,
        # before any step (a ConfigError naming the field when it cannot be used)
        self.policy_loss = resolve_policy_loss(cfg)
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        self.version = 0  # policy version: number of optimizer updates applied
        # Called with the model when a step's gradients are complete, before clipping (tests read the
        # gradients here, the trainer benchmark their memory).
        self.before_step: Callable[[nn.Module], None] | None = None
        self.model.train()
        if cfg.gradient_checkpointing:  # decoder layers recomputed in the backward, KV cache kept (shared prompts)
            enable_activation_checkpointing(self.model, cfg.gradient_checkpointing)
        self.model.config.use_cache = False
        # train.compute_dtype, resolved once (auto reads the CPU's flags): autocast in it when it differs
        # from the parameters' dtype (_compute)
        first = next(model.parameters())
        self.autocast_device = first.device.type
        self.compute_dtype = resolve_dtype(cfg.compute_dtype, self.autocast_device)
        self.autocast = self.compute_dtype != first.dtype
        # Frozen initial policy for the KL term; only built when it is used (it doubles model memory). Under
        # autocast its linear weights are kept in the compute dtype (the same values, no cast per forward).
        self.ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
        if self.ref_model is not None and self.autocast:
            keep_linears_in(self.ref_model, self.compute_dtype)
        # The reference's and the critic's forwards for the per-token advantages, on the policy's micro-batches
        self.forwards = TokenForwards(cfg, self.ref_model, self.critic, self._compute,
                                      LogprobOptions.of(cfg, temperature), first.device)
        # MoE: hooks on the routers (after the copy above, which must route on its own) replay the engine's
        # experts (train.routing_replay=r3) or only measure how often the trainer's routing differs.
        replay = cfg.routing_replay == "r3" or bool(find_routers(model))
        self.routing = RoutingReplay(model, cfg.routing_replay) if replay else None
        if self.routing is not None:
            self.routing.collect_aux = cfg.router_aux_loss_coef > 0
        self._prepare_model()  # a sharded rank shards here, before the optimizer sees the parameters
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=cfg.adam_betas,
            weight_decay=cfg.weight_decay,
            # fused: one vectorised pass per parameter (the default per-parameter loop makes ~6 passes
            # over 4 bytes x N each; on a 2-core CPU it was ~7% of a train step)
            fused=cfg.fused_optimizer or None,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, partial(lr_factor, cfg))

    # ------------------------------------------------------------ rollwise.types.contracts.Trainer

    def weights(self) -> dict[str, Tensor]:
        """The current weights for a transport: detached views of the model's tensors (no copy). With
        train.lora, the adapter's tensors only, by base-model module name (rollwise.sync.adapters)."""
        if self.lora is not None:
            return adapter_state(self.model)
        return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}

    def save_checkpoint(self, run_dir: Path, step: int, extra: dict[str, Any], keep_last: int) -> Path:
        if self.tokenizer is None:
            raise ValueError("GRPOTrainer(tokenizer=...) is needed to write a checkpoint (it is saved with the model)")
        return checkpoint.save_checkpoint(run_dir, self, self.tokenizer, step, extra, keep_last,
                                          also=self.critic.save if self.critic is not None else None)

    def load_checkpoint(self, ckpt: Path) -> dict[str, Any]:
        state = checkpoint.load_checkpoint(ckpt, self)
        if self.critic is not None:
            self.critic.load(ckpt)
        return state

    def _prepare_model(self) -> None:
        """Hook before the optimizer is built (rollwise.train.sharded shards the model here)."""

    def _prepare_critic(self, value_model: nn.Module) -> None:
        """Hook before the critic's optimizer is built (a sharded rank shards the value model here)."""

    def _compute(self) -> torch.autocast:
        """train.compute_dtype: the forward's matmuls in that dtype (the backward follows the forward's
        dtypes); parameters, gradients and optimizer state keep theirs (mixed precision)."""
        return torch.autocast(self.autocast_device, dtype=self.compute_dtype, enabled=self.autocast,
                              cache_enabled=autocast_cache_enabled(self.cfg.gradient_checkpointing))

    def _forward_logprobs(self, model: nn.Module, mb: MicroBatch | GroupMicroBatch) -> tuple[Tensor, Tensor]:
        with self._compute():
            logp, entropy = mb.logprobs(model, LogprobOptions.of(self.cfg, self.temperature))
        return logp.float(), entropy.float()  # the loss and the metrics in float32

    def _logprobs(self, mb: MicroBatch | GroupMicroBatch) -> tuple[Tensor, Tensor]:
        """The policy's log-probs and entropy of a micro-batch's trained tokens."""
        if self.routing is None:
            return self._forward_logprobs(self.model, mb)
        self.routing.begin(mb.routing)
        out = self._forward_logprobs(self.model, mb)
        self.routing.end()
        return out

    def _with_router_aux(self, loss: Tensor, mb: MicroBatch | GroupMicroBatch) -> Tensor:
        """MoE with train.router_aux_loss_coef > 0: plus the load-balancing loss of the forward just run,
        weighted by the micro-batch's share of the batch's tokens (as its policy loss is)."""
        aux = self.routing.aux_loss() if self.routing is not None and self.routing.collect_aux else None
        return loss if aux is None else loss + self.cfg.router_aux_loss_coef * aux * mb.weights.sum()

    def _micro_batches(self, samples: list[Sample]) -> list[MicroBatch | GroupMicroBatch]:
        return self._step_plan(samples)[1]

    def _step_plan(self, samples: list[Sample]) -> tuple[list[list[Sample]], list[MicroBatch | GroupMicroBatch]]:
        """The step's chunks and their micro-batches with the batch's loss weights, collated once (forward_batches)."""
        share, chunks = chunk_samples(samples, self.cfg)
        weights = token_weights([s.trained_tokens for chunk in chunks for s in chunk], self.cfg.loss_agg)
        return chunks, self.forward_batches(share, chunks, weights=weights)

    def collate_chunks(self, share: bool, chunks: list[list[Sample]], weights: Tensor,
                       padding: int = 0) -> list[MicroBatch | GroupMicroBatch]:
        """Micro-batches of `chunks`, whose tokens carry `weights` (flattened in chunk order), plus
        `padding` zero-weight repeats of the first chunk (see MicroBatch.padding)."""
        batches: list[MicroBatch | GroupMicroBatch] = []
        offset = 0
        for chunk in chunks:
            n_tokens = sum(s.trained_tokens for s in chunk)
            mb = self._collate(share, chunk)(chunk, weights[offset : offset + n_tokens], self.pad_token_id)
            batches.append(replace(mb, **token_owners(chunk)))
            offset += n_tokens
        for _ in range(padding):
            batches.append(replace(batches[0], weights=torch.zeros_like(batches[0].weights), padding=True))
        return batches

    def _collate(self, share: bool, chunk: list[Sample]) -> Callable[[list[Sample], Tensor, int], Any]:
        """How a chunk becomes a micro-batch: padded rows; one group's prompt once, its responses
        one to a row or packed (train.pack_responses); several groups packed (train.pack_groups)."""
        if not share:
            return collate
        # MoE routing replay reads the engine's routes in the padded layout: no packing there, and a
        # chunk of several groups (train.pack_groups) takes the padded forward
        if self.routing is not None:
            return collate_group if len(prompt_groups(chunk)) == 1 else collate
        if self.cfg.pack_responses and self.cfg.pack_groups:
            return collate_packed_groups
        return partial(collate_group, pack=self.cfg.pack_responses)

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """One rollout batch -> `updates_per_step` optimizer updates. Returns metrics of the last update."""
        informative = samples
        if self.cfg.skips_zero_advantage():
            # With no KL term (and a built-in loss), a sample with advantage 0 (every sample of a
            # zero-variance group) adds exactly nothing to the gradient: skip its forward/backward. The
            # token mean is then over informative tokens, as with DAPO's dynamic-sampling filter.
            informative = [s for s in samples if s.advantage != 0.0]
        if not informative:
            # Nothing to learn from; still measure entropy and train-inference mismatch (no grad).
            return {"loss": 0.0, "grad_norm": 0.0, "update_skipped_no_signal": 1.0,
                    "update_skipped_nonfinite_grad": 0.0, "trained_tokens": 0.0,
                    "trained_samples": 0.0, "clip_fraction": 0.0, "kl": 0.0,
                    "lr": self.scheduler.get_last_lr()[0], **self._measure(self._micro_batches(samples)[:1]),
                    **(self.routing.take_metrics() if self.routing is not None else {}), **self.forwards.times.take()}
        # One plan, one collation (rollwise.train.step_batches): the reference's and the critic's forwards run on
        # the policy's micro-batches, and the per-token advantages they give are filled into those same batches.
        chunks, batches = self._step_plan(informative)
        planned = None
        if self.token_advantages:
            planned = self._token_advantages(informative, chunks, batches)
            batches = with_token_advantages(batches, chunks)
        metrics: dict[str, float] = {}
        # The proximal policy of decoupled PPO is the trainer's policy before this step's first
        # update. Its log-probs come free from the first update's forward (the weights only change
        # at optimizer.step, after every micro-batch), and are reused by later updates.
        proximal: list[Tensor] = []
        for update in range(self.cfg.updates_per_step):
            metrics = self._update(batches, record_mismatch=update == 0, proximal=proximal)
        metrics["trained_samples"] = float(len(informative))
        if self.routing is not None:
            metrics.update(self.routing.take_metrics())
        metrics["update_skipped_no_signal"] = 0.0
        if planned is not None:
            metrics.update(self._after_token_advantages(*planned))
        metrics.update(self.forwards.times.take())  # time_ref_s, time_critic_s
        return metrics

    def forward_batches(self, share: bool, chunks: list[list[Sample]], padding: int = 0,
                        weights: Tensor | None = None) -> list[MicroBatch | GroupMicroBatch]:
        """The micro-batches of `chunks` (collate_chunks), on the model's device: the step's one collation, which
        the reference's and the critic's forwards and the policy's update all run. `weights`: the loss weights
        (None: zeros, for the forwards alone; a sharded rank fills its in later: rollwise.train.step_batches)."""
        device = next(self.model.parameters()).device
        if weights is None:
            weights = torch.zeros(sum(s.trained_tokens for chunk in chunks for s in chunk))
        return [to_device(mb, device) for mb in self.collate_chunks(share, chunks, weights, padding)]

    def _token_advantages(self, samples: list[Sample], chunks: list[list[Sample]],
                          batches: list[MicroBatch | GroupMicroBatch]) -> tuple[PendingCritic | None, TokenAdvantages,
                                                                              dict[str, float]]:
        """train.advantage=gae / train.kl_penalty=reward: each sample's per-token advantages, set on it
        (rollwise.train.token_advantages), from the reference's and the critic's forwards on the policy's own
        micro-batches `batches` of `chunks` (rollwise.train.token_forwards; at updates_per_step=1 the critic's
        update runs there too)."""
        inputs = self.forwards.run(chunks, batches, sum(s.trained_tokens for s in samples))
        plan, metrics = plan_token_advantages(samples, self.cfg, in_order(samples, inputs.kl),
                                              in_order(samples, inputs.values))
        metrics.update(inputs.critic_metrics)
        pending = PendingCritic(batches, chunks, samples) if self.critic is not None and not inputs.critic_updated else None
        return pending, plan, metrics

    def _after_token_advantages(self, pending: PendingCritic | None, plan: TokenAdvantages,
                                metrics: dict[str, float]) -> dict[str, float]:
        """The critic's update on the step's returns when it has not run with its values (updates_per_step > 1),
        and the step's per-token advantage metrics."""
        if pending is not None and plan.values is not None and plan.returns is not None:
            ids = [id(s) for s in pending.samples]
            old = per_batch(pending.chunks, dict(zip(ids, plan.values)))
            returns = per_batch(pending.chunks, dict(zip(ids, plan.returns)))
            with self.forwards.times.timing("time_critic_s", self.forwards.device):
                metrics.update(self.critic.update(pending.batches, old, returns, self._compute))
        return metrics

    @torch.no_grad()
    def _measure(self, batches: list[MicroBatch | GroupMicroBatch]) -> dict[str, float]:
        n, entropy_sum, abs_diff_sum, k3_sum = 0, 0.0, 0.0, 0.0
        for mb in batches:
            logp, entropy = self._logprobs(mb)
            if mb.padding:
                continue
            n += mb.n_tokens
            entropy_sum += float(entropy.sum())
            abs_diff, k3 = mismatch_sums(mb.behaviour_logp, logp)
            abs_diff_sum += abs_diff
            k3_sum += k3
        n = max(n, 1)
        return {"entropy": entropy_sum / n, "mismatch_abs_logp": abs_diff_sum / n, "mismatch_k3": k3_sum / n}

    def _update(self, batches: list[MicroBatch], record_mismatch: bool, proximal: list[Tensor]) -> dict[str, float]:
        """One optimizer update over all micro-batches. `proximal` is filled on the first update
        (one tensor per micro-batch) when an off-policy correction is on, and read afterwards."""
        correction = self.cfg.off_policy_correction
        if correction == "auto":  # RunConfig resolves auto from rollout.mode; a bare TrainConfig is on-policy
            correction = "none"
        first = not proximal
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        n_tokens = sum(b.n_tokens for b in batches if not b.padding)
        loss_total = 0.0
        clipped = 0
        kl_sum = 0.0
        entropy_sum = 0.0
        abs_diff_sum = 0.0
        k3_sum = 0.0
        is_weight_sum = 0.0
        masked = 0  # tokens the correction masked out (mis, icepop)
        for i, mb in enumerate(batches):
            logp, entropy = self._logprobs(mb)
            old_logp = mb.behaviour_logp
            weights, kept = torch.ones_like(logp), torch.ones_like(logp, dtype=torch.bool)
            if correction != "none":
                if first:
                    proximal.append(logp.detach())
                old_logp = proximal[i]
                corr = correction_of(old_logp, mb.behaviour_logp, correction, cap=self.cfg.is_cap,
                                     floor=self.cfg.is_floor, level=self.cfg.mis_level, seq_index=mb.seq_index,
                                     num_seqs=mb.num_seqs)
                weights, kept = corr.weights, corr.kept
                if not mb.padding:
                    is_weight_sum += float(weights.sum())
                    masked += corr.masked_tokens
            ref_logp = None
            if self.ref_model is not None and self.loss_kl_coef > 0:
                ref_logp = self.forwards.reference_logprobs(mb)
            batch = PolicyLossInputs(
                logp=logp, behaviour_logp=mb.behaviour_logp, old_logp=old_logp, advantages=mb.advantages,
                token_weights=mb.weights, is_weights=weights, kept=kept, seq_index=mb.seq_index,
                num_seqs=mb.num_seqs, versions=mb.versions, policy_version=self.version)
            terms = self.policy_loss.terms(batch, corrected=correction != "none", masked=correction in MASKING,
                                           ref_logp=ref_logp, kl_coef=self.loss_kl_coef)
            self._with_router_aux(terms.loss, mb).backward()
            if mb.padding:
                continue  # its weights are 0: no gradient, and it is not counted in the metrics
            loss_total += float(terms.loss.detach())
            clipped += int(terms.clipped_tokens)
            kl_sum += float(terms.kl_sum)
            entropy_sum += float(entropy.sum())
            if record_mismatch:
                # Train-inference mismatch on the same tokens, before any update (DESIGN.md metric).
                abs_diff, k3 = mismatch_sums(mb.behaviour_logp, logp.detach())
                abs_diff_sum += abs_diff
                k3_sum += k3
        if self.before_step is not None:
            self.before_step(self.model)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        # Sharded parameters (DTensor) give a DTensor norm: full_tensor() sums it over the ranks.
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
            self.version += 1
        skipped = not math.isfinite(grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {
            "loss": loss_total,
            "grad_norm": grad_norm,
            "update_skipped_nonfinite_grad": float(skipped),
            "clip_fraction": clipped / max(n_tokens, 1),
            "entropy": entropy_sum / max(n_tokens, 1),
            "kl": kl_sum / max(n_tokens, 1),
            "trained_tokens": float(n_tokens),
            "lr": self.scheduler.get_last_lr()[0],
            "is_weight_mean": is_weight_sum / max(n_tokens, 1) if correction != "none" else 1.0,
            "is_masked_fraction": masked / max(n_tokens, 1),
        }
        if record_mismatch:
            metrics["mismatch_abs_logp"] = abs_diff_sum / max(n_tokens, 1)
            metrics["mismatch_k3"] = k3_sum / max(n_tokens, 1)
        return metrics

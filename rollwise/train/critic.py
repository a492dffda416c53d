"""The critic of PPO with GAE (train.advantage=gae): a value model trained in the same step as the policy.

The value model is a copy of the policy's decoder (its initial weights, as verl and OpenRLHF start a critic
from the actor) with a scalar head, zero-initialised so the first values are 0 and the first advantages are
the plain returns (train.gae.critic_trainable_layers: only its top k decoder layers, norm and head train; the
rest stays at the policy's initial weights: rollwise.train.critic_layers). V(s_t), the value before the response's
token t, is read at the position that predicts token t, the same positions the policy's log-probs come from
(rollwise.train.logprobs.sequence_logprobs).

Each step: `values` (no grad) before the policy's update gives the advantages' baseline
(rollwise.train.token_advantages), then `update` fits the values to the GAE returns with PPO's clipped value
loss, 0.5 * max((V - G)^2, (V_old + clip(V - V_old, -c, c) - G)^2), averaged over the batch's trained tokens
(micro-batches accumulate into one batch gradient), train.updates_per_step times, by its own AdamW
(train.gae.critic_lr; betas, weight decay and grad clip are train:'s; a constant learning rate). At
train.updates_per_step=1 (the recipes') the two are one forward per micro-batch (`values_and_update`). The critic
runs on the policy's own micro-batches (any layout: `PredictorBatch.hidden` is the shared-prefix forward of its
trunk; rollwise.train.token_forwards). Its weights and optimizer state are saved in the policy's checkpoint
(`critic/`) and restored with it.

On the sharded trainer (rollwise.train.rank) each rank's critic is sharded like its policy (FSDP2 on the same
mesh), runs these same `values` and `update` on the rank's micro-batches, and checkpoints as the policy does
(rollwise.train.critic_shards): the full value model from rank 0, the weights and optimizer shards in `critic/dcp/`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_model, save_model
from torch import Tensor, nn

from rollwise.config import RunError
from rollwise.types.train_config import TrainConfig
from rollwise.train.checkpoint import DCP_DIR, load_dcp_optimizer
from rollwise.train.activation_checkpointing import checkpoint_layer
from rollwise.train.critic_layers import check_marker, freeze_lower_layers, write_marker
from rollwise.train.logprobs import backbone_of

CRITIC_DIR = "critic"  # in a checkpoint folder
VALUE_MODEL_FILE = "value_model.safetensors"
CRITIC_OPTIMIZER_FILE = "optimizer.pt"

VALUE_LOSS = "critic/value_loss"
EXPLAINED_VARIANCE = "critic/explained_variance"
VALUE_CLIP_FRACTION = "critic/value_clip_fraction"
SUMMED_OVER_RANKS = (VALUE_LOSS, VALUE_CLIP_FRACTION)  # each rank's is its share of the batch's


class PredictorBatch(Protocol):
    """Any of the trainer's micro-batches (rollwise.train.trainer.MicroBatch, rollwise.train.packing's
    GroupMicroBatch and PackedGroupsMicroBatch): the critic runs on the policy's own layout."""

    padding: bool  # a sharded rank's filler (rollwise.train.trainer.MicroBatch.padding): run, at weight 0

    def hidden(self, backbone: nn.Module) -> tuple[Tensor, Tensor]:
        """(hidden states [N, H] that predict the trained tokens, in the loss's order; the tokens [N])."""
        ...


class ValueModel(nn.Module):
    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, mb: PredictorBatch) -> Tensor:
        """[N] the value at each trained token, in the order of the policy's log-probs: the micro-batch's own
        forward (padded rows, or a shared prompt once: rollwise.train.packing) through the trunk, then the
        scalar head (never an LM head)."""
        predictors, _ = mb.hidden(self.backbone)
        # sum over the size-1 dim, not squeeze: a new tensor, not a view (FSDP2 warns of a root returning a view)
        return self.head(predictors.to(self.head.weight.dtype)).sum(-1).float()


def explained_variance(values: Tensor, returns: Tensor) -> float:
    """1 - Var(G - V) / Var(G) over tokens: 1 a perfect critic, 0 no better than a constant (NaN: Var(G) = 0)."""
    if returns.numel() < 2:
        return float("nan")
    var = float(returns.var())
    return 1.0 - float((returns - values).var()) / var if var > 0 else float("nan")


def value_loss(new: Tensor, old: Tensor, returns: Tensor, clip: float | None) -> tuple[Tensor, Tensor]:
    """Per-token PPO value loss and where the clipped term was the larger (the clip was active)."""
    unclipped = (new - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped = (old + torch.clamp(new - old, -clip, clip) - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def target_metrics(old: list[Tensor], returns: list[Tensor]) -> dict[str, float]:
    """The step's values (before its update) against its GAE returns, over all the batch's trained tokens."""
    all_old, all_returns = torch.cat(old).cpu(), torch.cat(returns).cpu()
    n_tokens = all_returns.numel()
    return {EXPLAINED_VARIANCE: explained_variance(all_old, all_returns),
            "critic/value_mean": float(all_old.mean()) if n_tokens else 0.0,
            "critic/return_mean": float(all_returns.mean()) if n_tokens else 0.0}


class Critic:
    def __init__(self, policy: nn.Module, cfg: TrainConfig,
                 prepare: Callable[[ValueModel], None] | None = None) -> None:
        """`prepare(value_model)` runs before the optimizer sees its parameters: a sharded rank shards the value
        model there, on the policy's mesh (rollwise.train.rank)."""
        backbone = copy.deepcopy(backbone_of(policy))
        self.model = ValueModel(backbone, policy.config.hidden_size).to(next(policy.parameters()).device)
        self.model.train().requires_grad_(True)
        # train.gae.critic_trainable_layers: the embedding and lower layers frozen before sharding (FSDP2 keeps each
        # parameter's requires_grad), so nothing below the first trainable layer builds a graph or a gradient
        freeze_lower_layers(backbone, cfg.gae.critic_trainable_layers)
        if cfg.gradient_checkpointing:  # as the policy's: the shared-prompt forwards keep their KV cache
            for layer in backbone.layers:  # a frozen layer has no backward: nothing to recompute
                if any(p.requires_grad for p in layer.parameters()):
                    checkpoint_layer(layer, cfg.gradient_checkpointing)
        if prepare is not None:
            prepare(self.model)
        self.cfg = cfg
        # after `prepare`: a sharded rank's parameters are its shards
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=cfg.gae.critic_lr, betas=cfg.adam_betas,
                                           weight_decay=cfg.weight_decay, fused=cfg.fused_optimizer or None)

    @torch.no_grad()
    def values(self, batches: list[PredictorBatch], compute: Callable[[], AbstractContextManager]) -> list[Tensor]:
        """Each batch's values at its trained tokens (flattened), before this step's update."""
        out = []
        for mb in batches:
            with compute():
                out.append(self.model(mb).float())
        return out

    def update(self, batches: list[PredictorBatch], old: list[Tensor], returns: list[Tensor],
               compute: Callable[[], AbstractContextManager], n_tokens: int | None = None) -> dict[str, float]:
        """train.updates_per_step AdamW updates of the value loss over `batches` (old values and GAE returns per
        batch, flattened as the batches' trained tokens). The loss is summed over tokens and divided by `n_tokens`,
        the whole batch's trained tokens (None: these batches'; a sharded rank passes the count over all ranks,
        whose gradients FSDP sums). A padding batch runs at weight 0 and is not counted. Metrics of the first
        update (the loss before any of this step's updates: on a fixed batch it falls from step to step as the
        critic learns); on a rank, the loss and the clip fraction are its share of the batch's (they add up)."""
        n_tokens = sum(r.numel() for r, mb in zip(returns, batches) if not mb.padding) if n_tokens is None else n_tokens
        metrics = {VALUE_LOSS: 0.0}
        if n_tokens == 0:
            return metrics
        for update in range(self.cfg.updates_per_step):
            self.optimizer.zero_grad(set_to_none=True)
            loss_sum, clipped = 0.0, 0
            for mb, v_old, g in zip(batches, old, returns):
                with compute():
                    new = self.model(mb)
                loss, n_clipped = self._backward(mb, new, v_old.to(new.device), g.to(new.device), n_tokens)
                loss_sum += loss
                clipped += n_clipped
            grad_norm = self._step()
            if update == 0:
                metrics.update({VALUE_LOSS: loss_sum, "critic/grad_norm": grad_norm,
                                VALUE_CLIP_FRACTION: clipped / n_tokens})
        return metrics

    def values_and_update(self, batches: list[PredictorBatch], returns_of: Callable[[int, Tensor], Tensor],
                          compute: Callable[[], AbstractContextManager], n_tokens: int) -> tuple[list[Tensor], dict[str, float]]:
        """`values` and then one `update` (train.updates_per_step=1) with one forward per micro-batch, with grad: its
        values (detached, on the CPU) give its GAE returns (`returns_of(i, values)`: GAE is per sample, so no other
        micro-batch is needed), its value loss is backpropagated at once (its graph freed) and the optimizer steps
        after the last. The same values, loss and gradient as the two passes: the update's forward recomputes these
        values, and at V = V_old the clipped term equals the unclipped one (torch.maximum gives each half the
        gradient, and clamp passes it at 0), so the gradient is the unclipped term's. Returns each micro-batch's
        values and the metrics `update` returns."""
        self.optimizer.zero_grad(set_to_none=True)
        values: list[Tensor] = []
        loss_sum, clipped = 0.0, 0
        for i, mb in enumerate(batches):
            with compute():
                new = self.model(mb)
            old = new.detach()
            values.append(old.cpu())
            loss, n_clipped = self._backward(mb, new, old, returns_of(i, values[-1]).to(new.device), max(n_tokens, 1))
            loss_sum += loss
            clipped += n_clipped
        if n_tokens == 0:  # nothing trained: no update (as `update`)
            self.optimizer.zero_grad(set_to_none=True)
            return values, {VALUE_LOSS: 0.0}
        grad_norm = self._step()
        return values, {VALUE_LOSS: loss_sum, "critic/grad_norm": grad_norm, VALUE_CLIP_FRACTION: clipped / n_tokens}

    def _backward(self, mb: PredictorBatch, new: Tensor, old: Tensor, returns: Tensor, n_tokens: int) -> tuple[float, int]:
        """One micro-batch's share of the value loss backpropagated: (its loss, its clipped tokens); a padding batch
        runs at weight 0 (every rank runs as many forwards and backwards as the others: FSDP's collectives)."""
        per_token, was_clipped = value_loss(new, old, returns, self.cfg.gae.value_clip)
        loss = per_token.sum() / n_tokens
        if mb.padding:
            (loss * 0.0).backward()
            return 0.0, 0
        loss.backward()
        return float(loss.detach()), int(was_clipped.sum())

    def _step(self) -> float:
        """Clip the accumulated gradient, step when it is finite; the gradient norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.cfg.grad_clip)
        # Sharded parameters (DTensor) give a DTensor norm: full_tensor() sums it over the ranks.
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def save(self, ckpt: Path) -> None:
        """Weights and optimizer state into `ckpt/critic/` (before the checkpoint's manifest is written)."""
        folder = ckpt / CRITIC_DIR
        folder.mkdir(parents=True, exist_ok=True)
        save_model(self.model, str(folder / VALUE_MODEL_FILE))
        torch.save({"optimizer": self.optimizer.state_dict()}, folder / CRITIC_OPTIMIZER_FILE)
        write_marker(folder, self.cfg.gae.critic_trainable_layers)

    def load(self, ckpt: Path) -> None:
        """Weights and optimizer state from `ckpt/critic/`: the one-process trainer's (optimizer.pt) or the
        sharded trainer's (value_model.safetensors gathered by its rank 0, the optimizer's shards in dcp/)."""
        folder = critic_folder(ckpt, self.cfg.gae.critic_trainable_layers)
        missing, unexpected = load_model(self.model, str(folder / VALUE_MODEL_FILE), strict=False)
        if missing or unexpected:
            raise RunError(f"checkpoint {ckpt}: {CRITIC_DIR}/{VALUE_MODEL_FILE} does not match this run's critic "
                           f"(missing {sorted(missing)}, unexpected {sorted(unexpected)}): resume with the model it "
                           "was trained from")
        if (folder / CRITIC_OPTIMIZER_FILE).exists():
            state = torch.load(folder / CRITIC_OPTIMIZER_FILE, weights_only=False)
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            load_dcp_optimizer(ckpt, f"{CRITIC_DIR}/{DCP_DIR}", self.model, self.optimizer)


def critic_folder(ckpt: Path, trainable_layers: int | None) -> Path:
    """`ckpt/critic/`, refused (naming what to do) when the checkpoint was written without a critic, or with another
    train.gae.critic_trainable_layers (rollwise.train.critic_layers), before anything is loaded."""
    folder = ckpt / CRITIC_DIR
    if not (folder / VALUE_MODEL_FILE).exists():
        raise RunError(f"checkpoint {ckpt} has no {CRITIC_DIR}/ (it was written without train.advantage=gae), "
                       "so this run's critic cannot resume from it: resume with the advantage it was trained "
                       "with, or start the gae run from its model (model=" f"{ckpt / 'model'})")
    check_marker(folder, trainable_layers)
    return folder

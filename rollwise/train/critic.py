"""The critic of PPO with GAE (train.advantage=gae): a value model trained in the same step as the policy.

The value model is a copy of the policy's decoder (its initial weights, as verl and OpenRLHF start a critic
from the actor) with a scalar head, zero-initialised so the first values are 0 and the first advantages are
the plain returns. V(s_t), the value before the response's token t, is read at the position that predicts
token t, the same positions the policy's log-probs come from (rollwise.train.logprobs.sequence_logprobs).

Each step: `values` (no grad) before the policy's update gives the advantages' baseline
(rollwise.train.token_advantages), then `update` fits the values to the GAE returns with PPO's clipped value
loss, 0.5 * max((V - G)^2, (V_old + clip(V - V_old, -c, c) - G)^2), averaged over the batch's trained tokens
(micro-batches accumulate into one batch gradient), train.updates_per_step times, by its own AdamW
(train.gae.critic_lr; betas, weight decay and grad clip are train:'s; a constant learning rate). Its weights
and optimizer state are saved in the policy's checkpoint (`critic/`) and restored with it.
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
from rollwise.train.logprobs import backbone_of

CRITIC_DIR = "critic"  # in a checkpoint folder
VALUE_MODEL_FILE = "value_model.safetensors"
CRITIC_OPTIMIZER_FILE = "optimizer.pt"

VALUE_LOSS = "critic/value_loss"
EXPLAINED_VARIANCE = "critic/explained_variance"


class PaddedBatch(Protocol):
    """Right-padded prompt + response rows (rollwise.train.trainer.MicroBatch)."""

    input_ids: Tensor  # [B, T]
    attention_mask: Tensor  # [B, T]
    target_mask: Tensor  # [B, T] True on trained tokens


class ValueModel(nn.Module):
    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, mb: PaddedBatch) -> Tensor:
        """[N] the value at each trained token, flattened row-major (as the policy's log-probs)."""
        hidden = self.backbone(input_ids=mb.input_ids, attention_mask=mb.attention_mask).last_hidden_state
        predictors = hidden[:, :-1][mb.target_mask[:, 1:]]
        return self.head(predictors.to(self.head.weight.dtype)).squeeze(-1).float()


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


class Critic:
    def __init__(self, policy: nn.Module, cfg: TrainConfig) -> None:
        backbone = copy.deepcopy(backbone_of(policy))
        self.model = ValueModel(backbone, policy.config.hidden_size).to(next(policy.parameters()).device)
        self.model.train().requires_grad_(True)
        if cfg.gradient_checkpointing and hasattr(backbone, "gradient_checkpointing_enable"):
            backbone.gradient_checkpointing_enable()
        self.cfg = cfg
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.gae.critic_lr, betas=cfg.adam_betas,
                                           weight_decay=cfg.weight_decay, fused=cfg.fused_optimizer or None)

    @torch.no_grad()
    def values(self, batches: list[PaddedBatch], compute: Callable[[], AbstractContextManager]) -> list[Tensor]:
        """Each batch's values at its trained tokens (flattened), before this step's update."""
        out = []
        for mb in batches:
            with compute():
                out.append(self.model(mb).float())
        return out

    def update(self, batches: list[PaddedBatch], old: list[Tensor], returns: list[Tensor],
               compute: Callable[[], AbstractContextManager]) -> dict[str, float]:
        """train.updates_per_step AdamW updates of the value loss over `batches` (old values and GAE returns per
        batch, flattened as the batches' trained tokens). Metrics of the first update (the loss before any of
        this step's updates: on a fixed batch it falls from step to step as the critic learns)."""
        n_tokens = sum(r.numel() for r in returns)
        all_old, all_returns = torch.cat(old), torch.cat(returns)
        metrics = {VALUE_LOSS: 0.0, EXPLAINED_VARIANCE: explained_variance(all_old.cpu(), all_returns.cpu()),
                   "critic/value_mean": float(all_old.mean()) if n_tokens else 0.0,
                   "critic/return_mean": float(all_returns.mean()) if n_tokens else 0.0}
        if n_tokens == 0:
            return metrics
        for update in range(self.cfg.updates_per_step):
            self.optimizer.zero_grad(set_to_none=True)
            loss_sum, clipped = 0.0, 0
            for mb, v_old, g in zip(batches, old, returns):
                with compute():
                    new = self.model(mb)
                per_token, was_clipped = value_loss(new, v_old.to(new.device), g.to(new.device), self.cfg.gae.value_clip)
                loss = per_token.sum() / n_tokens
                loss.backward()
                loss_sum += float(loss.detach())
                clipped += int(was_clipped.sum())
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
            if math.isfinite(norm):
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if update == 0:
                metrics.update({VALUE_LOSS: loss_sum, "critic/grad_norm": norm,
                                "critic/value_clip_fraction": clipped / n_tokens})
        return metrics

    def save(self, ckpt: Path) -> None:
        """Weights and optimizer state into `ckpt/critic/` (before the checkpoint's manifest is written)."""
        folder = ckpt / CRITIC_DIR
        folder.mkdir(parents=True, exist_ok=True)
        save_model(self.model, str(folder / VALUE_MODEL_FILE))
        torch.save({"optimizer": self.optimizer.state_dict()}, folder / CRITIC_OPTIMIZER_FILE)

    def load(self, ckpt: Path) -> None:
        folder = ckpt / CRITIC_DIR
        if not (folder / VALUE_MODEL_FILE).exists():
            raise RunError(f"checkpoint {ckpt} has no {CRITIC_DIR}/ (it was written without train.advantage=gae), "
                           "so this run's critic cannot resume from it: resume with the advantage it was trained "
                           "with, or start the gae run from its model (model=" f"{ckpt / 'model'})")
        missing, unexpected = load_model(self.model, str(folder / VALUE_MODEL_FILE), strict=False)
        if missing or unexpected:
            raise RunError(f"checkpoint {ckpt}: {CRITIC_DIR}/{VALUE_MODEL_FILE} does not match this run's critic "
                           f"(missing {sorted(missing)}, unexpected {sorted(unexpected)}): resume with the model it "
                           "was trained from")
        state = torch.load(folder / CRITIC_OPTIMIZER_FILE, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])

"""A tenant's optimizer: AdamW with the tinker SDK's `AdamParams`, set anew on every step (clients change the
learning rate per step), and its state saved and loaded bit-exactly."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tinker import types
from torch import nn

from rollwise.service.errors import ServiceUserError

OPTIMIZER_FILE = "optimizer.pt"


def check_adam(adam: types.AdamParams) -> None:
    """Refuse hyperparameters AdamW cannot take, naming the field, before anything is applied."""
    fields = {"learning_rate": adam.learning_rate, "beta1": adam.beta1, "beta2": adam.beta2, "eps": adam.eps,
              "weight_decay": adam.weight_decay, "grad_clip_norm": adam.grad_clip_norm}
    for name, value in fields.items():
        if not math.isfinite(value) or value < 0:
            raise ServiceUserError(f"adam_params.{name} must be a finite number >= 0, got {value}")
    for name in ("beta1", "beta2"):
        if fields[name] >= 1:
            raise ServiceUserError(f"adam_params.{name} must be in [0, 1), got {fields[name]}")


class TenantOptimizer:
    """AdamW over `params` (decoupled weight decay, as torch.optim.AdamW: p -= lr * wd * p), with optional
    global gradient-norm clipping (grad_clip_norm 0: off). Gradients accumulate in the parameters' .grad
    until `step`, which applies and clears them."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.optimizer = self._fresh()
        self.steps = 0

    def _fresh(self) -> torch.optim.AdamW:
        defaults = types.AdamParams()
        # foreach=False: the same per-tensor arithmetic whatever the parameter count (a resumed run must
        # step exactly as the uninterrupted one, and the same on every platform).
        return torch.optim.AdamW(self.params, lr=defaults.learning_rate, betas=(defaults.beta1, defaults.beta2),
                                 eps=defaults.eps, weight_decay=defaults.weight_decay, foreach=False)

    def step(self, adam: types.AdamParams) -> dict[str, float]:
        """One AdamW step with `adam`; metrics `grad_norm:mean` (before clipping) and `learning_rate:mean`."""
        check_adam(adam)
        for group in self.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        grads = [p for p in self.params if p.grad is not None]
        if grads:
            max_norm = adam.grad_clip_norm if adam.grad_clip_norm > 0 else math.inf
            norm = float(torch.nn.utils.clip_grad_norm_(grads, max_norm, foreach=False))
        else:
            norm = 0.0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm:mean": norm, "learning_rate:mean": float(adam.learning_rate)}

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def reset(self) -> None:
        """A fresh optimizer (no moments, step 0): loading weights without optimizer state."""
        self.optimizer = self._fresh()
        self.steps = 0

    def save(self, path: Path) -> None:
        torch.save({"optimizer": self.optimizer.state_dict(), "steps": self.steps}, path / OPTIMIZER_FILE)

    def read(self, path: Path) -> dict:
        """The saved state, checked against these parameters (applied by `apply`): nothing changes if it fails."""
        file = path / OPTIMIZER_FILE
        if not file.is_file():
            raise ServiceUserError(f"path: checkpoint {path.name!r} holds no optimizer state; load it without "
                                   "the optimizer (load_weights) or save with it (save_state)")
        saved = torch.load(file, weights_only=True)
        state = saved["optimizer"]["state"]
        for index, entry in state.items():
            param = self.params[int(index)] if int(index) < len(self.params) else None
            if param is None or entry["exp_avg"].shape != param.shape:
                raise ServiceUserError(f"path: the optimizer state in {path.name!r} is of another model shape "
                                       "(another LoRA rank or targets?)")
        return saved

    def apply(self, saved: dict) -> None:
        self.optimizer.load_state_dict(saved["optimizer"])
        self.steps = int(saved["steps"])
        self.optimizer.zero_grad(set_to_none=True)
